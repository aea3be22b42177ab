#include "topo/json.h"

#include <cmath>
#include <cstdio>
#include <cstdlib>

#include "core/error.h"

namespace gpucoll::topo {

Json Json::boolean(bool b) {
  Json j;
  j.kind_ = Kind::kBool;
  j.bool_ = b;
  return j;
}
Json Json::number(double d) {
  Json j;
  j.kind_ = Kind::kNumber;
  j.number_ = d;
  return j;
}
Json Json::string(std::string s) {
  Json j;
  j.kind_ = Kind::kString;
  j.string_ = std::move(s);
  return j;
}
Json Json::array() {
  Json j;
  j.kind_ = Kind::kArray;
  return j;
}
Json Json::object() {
  Json j;
  j.kind_ = Kind::kObject;
  return j;
}

bool Json::as_bool(const std::string& what) const {
  GPUCOLL_CHECK_ARG(kind_ == Kind::kBool, what, ": expected true or false");
  return bool_;
}
double Json::as_number(const std::string& what) const {
  GPUCOLL_CHECK_ARG(kind_ == Kind::kNumber, what, ": expected a number");
  return number_;
}
int64_t Json::as_int(const std::string& what) const {
  const double d = as_number(what);
  GPUCOLL_CHECK_ARG(std::floor(d) == d && std::fabs(d) < 9e15, what, ": expected an integer, got ", d);
  return static_cast<int64_t>(d);
}
const std::string& Json::as_string(const std::string& what) const {
  GPUCOLL_CHECK_ARG(kind_ == Kind::kString, what, ": expected a string");
  return string_;
}
const std::vector<Json>& Json::as_array(const std::string& what) const {
  GPUCOLL_CHECK_ARG(kind_ == Kind::kArray, what, ": expected an array");
  return array_;
}

const Json* Json::get(const std::string& key) const {
  if (kind_ != Kind::kObject) return nullptr;
  for (const auto& kv : object_) {
    if (kv.first == key) return &kv.second;
  }
  return nullptr;
}
const Json& Json::at(const std::string& key, const std::string& where) const {
  GPUCOLL_CHECK_ARG(kind_ == Kind::kObject, where, ": expected an object");
  const Json* v = get(key);
  GPUCOLL_CHECK_ARG(v != nullptr, where, ": missing field '", key, "'");
  return *v;
}
Json& Json::set(const std::string& key, Json value) {
  for (auto& kv : object_) {
    if (kv.first == key) return kv.second = std::move(value);
  }
  object_.emplace_back(key, std::move(value));
  return object_.back().second;
}
Json& Json::push(Json value) {
  array_.push_back(std::move(value));
  return array_.back();
}

namespace {
void escape(std::string& out, const std::string& s) {
  out += '"';
  for (char c : s) {
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      case '\t': out += "\\t"; break;
      case '\r': out += "\\r"; break;
      default:
        if (static_cast<unsigned char>(c) < 0x20) {
          char buf[8];
          std::snprintf(buf, sizeof(buf), "\\u%04x", static_cast<unsigned>(static_cast<unsigned char>(c)));
          out += buf;
        } else {
          out += c;
        }
    }
  }
  out += '"';
}
}  // namespace

void Json::dump_to(std::string& out, int indent, int depth) const {
  auto newline = [&](int d) {
    if (indent <= 0) return;
    out += '\n';
    out.append(static_cast<size_t>(indent * d), ' ');
  };
  switch (kind_) {
    case Kind::kNull: out += "null"; break;
    case Kind::kBool: out += bool_ ? "true" : "false"; break;
    case Kind::kNumber: {
      char buf[40];
      if (std::floor(number_) == number_ && std::fabs(number_) < 9e15) {
        std::snprintf(buf, sizeof(buf), "%lld", static_cast<long long>(number_));
      } else {
        std::snprintf(buf, sizeof(buf), "%.17g", number_);
      }
      out += buf;
      break;
    }
    case Kind::kString: escape(out, string_); break;
    case Kind::kArray: {
      // Arrays of scalars stay on one line: link lists and matrices read better that way.
      bool scalars = true;
      for (const Json& v : array_) scalars = scalars && v.kind_ != Kind::kArray && v.kind_ != Kind::kObject;
      out += '[';
      for (size_t i = 0; i < array_.size(); ++i) {
        if (i) out += scalars || indent <= 0 ? ", " : ",";
        if (!scalars) newline(depth + 1);
        array_[i].dump_to(out, indent, depth + 1);
      }
      if (!scalars && !array_.empty()) newline(depth);
      out += ']';
      break;
    }
    case Kind::kObject: {
      out += '{';
      for (size_t i = 0; i < object_.size(); ++i) {
        if (i) out += ',';
        newline(depth + 1);
        escape(out, object_[i].first);
        out += ": ";
        object_[i].second.dump_to(out, indent, depth + 1);
      }
      if (!object_.empty()) newline(depth);
      out += '}';
      break;
    }
  }
}

std::string Json::dump(int indent) const {
  std::string out;
  dump_to(out, indent, 0);
  return out;
}

namespace {
struct Parser {
  const std::string& s;
  const std::string& what;
  size_t i = 0;

  [[noreturn]] void fail(const std::string& msg) const {
    int line = 1, col = 1;
    for (size_t k = 0; k < i && k < s.size(); ++k) {
      if (s[k] == '\n') {
        ++line;
        col = 1;
      } else {
        ++col;
      }
    }
    GPUCOLL_INVALID_ARG(what, ": line ", line, " column ", col, ": ", msg);
  }
  void ws() {
    while (i < s.size() && (s[i] == ' ' || s[i] == '\n' || s[i] == '\t' || s[i] == '\r')) ++i;
  }
  bool eat(char c) {
    ws();
    if (i < s.size() && s[i] == c) {
      ++i;
      return true;
    }
    return false;
  }
  void expect(char c) {
    if (!eat(c)) fail(std::string("expected '") + c + "'");
  }
  std::string str() {
    expect('"');
    std::string out;
    while (i < s.size() && s[i] != '"') {
      char c = s[i++];
      if (c == '\\') {
        if (i >= s.size()) fail("unterminated escape");
        const char e = s[i++];
        switch (e) {
          case 'n': out += '\n'; break;
          case 't': out += '\t'; break;
          case 'r': out += '\r'; break;
          case 'b': out += '\b'; break;
          case 'f': out += '\f'; break;
          case 'u': {
            if (i + 4 > s.size()) fail("truncated \\u escape");
            const unsigned cp = static_cast<unsigned>(std::strtoul(s.substr(i, 4).c_str(), nullptr, 16));
            i += 4;
            // Topology files are ASCII; encode the BMP code point as UTF-8 for completeness.
            if (cp < 0x80) {
              out += static_cast<char>(cp);
            } else if (cp < 0x800) {
              out += static_cast<char>(0xC0 | (cp >> 6));
              out += static_cast<char>(0x80 | (cp & 0x3F));
            } else {
              out += static_cast<char>(0xE0 | (cp >> 12));
              out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
              out += static_cast<char>(0x80 | (cp & 0x3F));
            }
            break;
          }
          default: out += e;
        }
      } else {
        out += c;
      }
    }
    if (i >= s.size()) fail("unterminated string");
    ++i;
    return out;
  }
  Json value(int depth) {
    if (depth > 64) fail("nested too deeply");
    ws();
    if (i >= s.size()) fail("unexpected end of input");
    const char c = s[i];
    if (c == '{') {
      ++i;
      Json o = Json::object();
      if (eat('}')) return o;
      do {
        ws();
        std::string k = str();
        expect(':');
        o.set(k, value(depth + 1));
      } while (eat(','));
      expect('}');
      return o;
    }
    if (c == '[') {
      ++i;
      Json a = Json::array();
      if (eat(']')) return a;
      do {
        a.push(value(depth + 1));
      } while (eat(','));
      expect(']');
      return a;
    }
    if (c == '"') return Json::string(str());
    if (s.compare(i, 4, "true") == 0) {
      i += 4;
      return Json::boolean(true);
    }
    if (s.compare(i, 5, "false") == 0) {
      i += 5;
      return Json::boolean(false);
    }
    if (s.compare(i, 4, "null") == 0) {
      i += 4;
      return Json();
    }
    if (c == '-' || (c >= '0' && c <= '9')) {
      const char* begin = s.c_str() + i;
      char* end = nullptr;
      const double d = std::strtod(begin, &end);
      if (end == begin) fail("bad number");
      i += static_cast<size_t>(end - begin);
      return Json::number(d);
    }
    fail(std::string("unexpected character '") + c + "'");
  }
};
}  // namespace

Json Json::parse(const std::string& text, const std::string& what) {
  Parser p{text, what};
  p.ws();
  if (p.i >= text.size()) p.fail("empty input");
  Json v = p.value(0);
  p.ws();
  if (p.i != text.size()) p.fail("trailing characters after the JSON value");
  return v;
}

}  // namespace gpucoll::topo
