// The one registry of GPUCOLL_* environment variables.
//
// Every variable gpucoll understands is a line in GPUCOLL_CONFIG_VARS (config.cc) with its type, default
// and description; nothing else in the core or the Python package calls getenv("GPUCOLL_..."). Python
// reads them through gpucoll._C (gpucoll.config), and `python -m gpucoll info` prints the table.
// The two build-time variables (GPUCOLL_CUDA, GPUCOLL_CUDA_ARCHS) are listed for documentation; setup.py is
// their reader because it runs before this library exists.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace gpucoll {

// kSecret: a string whose value is never shown (`python -m gpucoll info` says only whether it is set).
enum class VarType { kBool, kInt, kBytes, kFloat, kString, kSecret };

struct ConfigVar {
  const char* name;
  VarType type;
  const char* default_value;
  const char* description;
};

const std::vector<ConfigVar>& config_vars();
const char* var_type_name(VarType t);

// The raw value: the environment's if set (and non-empty), else the default. Throws InvalidArgument for a
// name that is not in the registry, so a typo in the code is caught by the first test that reaches it.
std::string config_raw(const std::string& name);
bool config_is_set(const std::string& name);

// Typed accessors; a malformed value raises InvalidArgument naming the variable and what was expected.
bool config_bool(const std::string& name);
int64_t config_int(const std::string& name);
// Accepts 4096, 64K, 64KiB, 1M, 2G (binary multiples).
int64_t config_bytes(const std::string& name);
double config_float(const std::string& name);

// Parse "1M"-style sizes; shared with the benchmark's -b/-e flags through the binding.
bool parse_bytes(const std::string& text, int64_t* out);

}  // namespace gpucoll
