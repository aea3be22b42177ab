#include "emulation/configure.h"

#include <gpucoll_emu/api.h>

#include <string>

#include "core/config.h"
#include "core/error.h"

namespace gpucoll::emulation {
namespace {

int int_in(const char* name, int64_t lo, int64_t hi) {
  const int64_t v = config_int(name);
  GPUCOLL_CHECK_ARG(v >= lo && v <= hi, name, " must be in [", lo, ", ", hi, "]; got ", v);
  return static_cast<int>(v);
}

}  // namespace

void configure_from_registry() {
  gpucoll_emu_config c;
  gpucoll_emu_default_config(&c);
  c.devices = int_in("GPUCOLL_EMU_DEVICES", 1, 16);
  c.sms = int_in("GPUCOLL_EMU_SMS", 1, 1024);
  c.blocks_per_sm = int_in("GPUCOLL_EMU_BLOCKS_PER_SM", 1, 32);
  const std::string cc = config_raw("GPUCOLL_EMU_COMPUTE_CAPABILITY");
  const size_t dot = cc.find('.');
  const bool digits = dot != std::string::npos && dot > 0 && dot + 1 < cc.size() &&
                      cc.find_first_not_of("0123456789.") == std::string::npos && cc.find('.', dot + 1) == std::string::npos;
  GPUCOLL_CHECK_ARG(digits, "GPUCOLL_EMU_COMPUTE_CAPABILITY must be major.minor, e.g. 9.0; got '", cc, "'");
  c.cc_major = std::stoi(cc.substr(0, dot));
  c.cc_minor = std::stoi(cc.substr(dot + 1));
  c.p2p = config_bool("GPUCOLL_EMU_P2P") ? 1 : 0;
  const int64_t memory = config_bytes("GPUCOLL_EMU_MEMORY");
  GPUCOLL_CHECK_ARG(memory >= (int64_t{1} << 20), "GPUCOLL_EMU_MEMORY must be at least 1M; got ", memory);
  c.memory = static_cast<unsigned long long>(memory);
  c.jitter_ns = static_cast<unsigned long long>(int_in("GPUCOLL_EMU_JITTER_US", 0, 1000000)) * 1000ull;
  const int64_t seed = config_int("GPUCOLL_EMU_SEED");
  c.seed = static_cast<unsigned long long>(seed);
  c.shuffle_threads = config_bool("GPUCOLL_EMU_SHUFFLE_THREADS") ? 1 : 0;
  c.host_fence = config_bool("GPUCOLL_EMU_HOST_FENCE") ? 1 : 0;
  const cudaError_t err = gpucoll_emu_configure(&c);
  if (err == cudaErrorIllegalState) {
    GPUCOLL_THROW(ErrorCode::kInvalidUsage, "gpucoll_emu_configure",
                  "the emulated CUDA device was already used with another shape in this process; set the "
                  "emulator's variables (GPUCOLL_EMU_SMS and the others) before gpucoll is imported");
  }
  GPUCOLL_CHECK_ARG(err == cudaSuccess, "the emulator's variables describe a device it cannot make (",
                    cudaGetErrorName(err), ")");
}

}  // namespace gpucoll::emulation
