// A minimal JSON value for the topology and tuning files.
//
// Why not a library: the core has no third-party C++ dependency besides pybind11 (which lives only in
// csrc/python/), and these files are small. Objects keep their keys in insertion order so a dump is
// deterministic and dump(load(dump(x))) is byte-for-byte the same text. Parse errors name line and column.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace gpucoll::topo {

class Json {
 public:
  enum class Kind { kNull, kBool, kNumber, kString, kArray, kObject };

  Json() = default;
  static Json boolean(bool b);
  static Json number(double d);
  static Json string(std::string s);
  static Json array();
  static Json object();

  Kind kind() const { return kind_; }
  bool is_null() const { return kind_ == Kind::kNull; }

  // Typed reads; `what` names the field in the InvalidArgument raised on a kind mismatch.
  bool as_bool(const std::string& what) const;
  double as_number(const std::string& what) const;
  int64_t as_int(const std::string& what) const;
  const std::string& as_string(const std::string& what) const;
  const std::vector<Json>& as_array(const std::string& what) const;

  // Objects. get() returns nullptr when absent; at() throws naming the key.
  const Json* get(const std::string& key) const;
  const Json& at(const std::string& key, const std::string& where) const;
  Json& set(const std::string& key, Json value);
  const std::vector<std::pair<std::string, Json>>& items() const { return object_; }

  // Arrays.
  Json& push(Json value);

  // Two-space indented text; numbers that are integral print without a fraction, others with %.17g so they
  // read back to the same double.
  std::string dump(int indent = 0) const;
  // Throws InvalidArgument "<what>: line L column C: ...".
  static Json parse(const std::string& text, const std::string& what);

 private:
  void dump_to(std::string& out, int indent, int depth) const;
  Kind kind_ = Kind::kNull;
  bool bool_ = false;
  double number_ = 0;
  std::string string_;
  std::vector<Json> array_;
  std::vector<std::pair<std::string, Json>> object_;
};

}  // namespace gpucoll::topo
