// json_io.cpp: strict JSON parsing with depth and duplicate-key limits, and typed,
// range-checked access (see json_io.h).
#include "engine/json_io.h"

#include <cmath>
#include <limits>
#include <vector>

#include "engine/error.h"
#include "engine/file_io.h"

namespace mhar {

namespace {

using json = nlohmann::json;

// A SAX consumer that builds the DOM itself, so that it can stop at the first key that
// repeats or container that nests too deep, before any recursion over the value happens.
class StrictDomBuilder {
 public:
  StrictDomBuilder(json& root, int max_depth) : root_(root), max_depth_(max_depth) {}

  bool null() { return put(json(nullptr)); }
  bool boolean(bool v) { return put(json(v)); }
  bool number_integer(json::number_integer_t v) { return put(json(v)); }
  bool number_unsigned(json::number_unsigned_t v) { return put(json(v)); }
  bool number_float(json::number_float_t v, const json::string_t&) { return put(json(v)); }
  bool string(json::string_t& v) { return put(json(std::move(v))); }
  bool binary(json::binary_t& v) { return put(json::binary(std::move(v))); }
  bool start_object(std::size_t) { return open(json::object()); }
  bool start_array(std::size_t) { return open(json::array()); }
  bool end_object() { return close(); }
  bool end_array() { return close(); }
  bool key(json::string_t& k) {
    json& obj = *stack_.back();
    if (obj.contains(k)) {
      error_ = "duplicate key \"" + k + "\" at " + path() + " (each key may appear once)";
      return false;
    }
    key_ = std::move(k);
    return true;
  }
  bool parse_error(std::size_t pos, const std::string&, const nlohmann::detail::exception& ex) {
    std::string what = ex.what();
    // Drop nlohmann's "[json.exception.parse_error.101] " prefix; keep its line/column.
    const auto bracket = what.find("] ");
    if (bracket != std::string::npos) what = what.substr(bracket + 2);
    error_ = what + " (byte " + std::to_string(pos) + ")";
    return false;
  }

  const std::string& error() const { return error_; }

 private:
  bool put(json v) {
    if (stack_.empty()) {
      root_ = std::move(v);
      return true;
    }
    json& top = *stack_.back();
    if (top.is_object()) {
      top[key_] = std::move(v);
    } else {
      top.push_back(std::move(v));
    }
    return true;
  }
  bool open(json container) {
    if (int(stack_.size()) >= max_depth_) {
      error_ = "nesting deeper than " + std::to_string(max_depth_) + " levels at " + path();
      return false;
    }
    json* slot;
    if (stack_.empty()) {
      root_ = std::move(container);
      slot = &root_;
    } else {
      json& top = *stack_.back();
      if (top.is_object()) {
        keys_.push_back(key_);
        slot = &(top[key_] = std::move(container));
      } else {
        keys_.push_back("[" + std::to_string(top.size()) + "]");
        top.push_back(std::move(container));
        slot = &top.back();
      }
    }
    stack_.push_back(slot);
    return true;
  }
  bool close() {
    if (stack_.size() > 1) keys_.pop_back();  // the root container has no key
    stack_.pop_back();
    return true;
  }
  std::string path() const {
    std::string p = "top level";
    if (!keys_.empty()) {
      p.clear();
      for (const auto& k : keys_) p += (k[0] == '[' || p.empty() ? "" : ".") + k;
    }
    if (p.size() > 120) p = "..." + p.substr(p.size() - 117);
    return p;
  }

  json& root_;
  int max_depth_;
  std::vector<json*> stack_;
  std::vector<std::string> keys_;  // the path to the innermost open container
  std::string key_;
  std::string error_;
};

[[noreturn]] void bad_type(const json& v, const std::string& where, const char* want) {
  fail(where, " = ", json_excerpt(v), " has type ", v.type_name(), "; expected ", want);
}

}  // namespace

json parse_json_strict(const std::string& text, const std::string& source, JsonLimits limits) {
  json root;
  StrictDomBuilder b(root, limits.max_depth);
  const bool ok = json::sax_parse(text, &b, json::input_format_t::json, /*strict=*/true,
                                  limits.allow_comments);
  if (!ok) fail(source, ": not valid JSON: ", b.error().empty() ? "parse error" : b.error());
  return root;
}

json read_json_file(const std::string& path, const char* what, JsonLimits limits, uint64_t max_bytes) {
  return parse_json_strict(read_regular_file(path, what, max_bytes), path, limits);
}

std::string json_excerpt(const json& v, size_t max_chars) {
  // Values reaching here were parsed with a depth limit, so dump() cannot recurse deeply.
  std::string s = v.dump(-1, ' ', false, json::error_handler_t::replace);
  if (s.size() > max_chars) s = s.substr(0, max_chars) + "...";
  return s;
}

int64_t json_to_int(const json& v, const std::string& where, int64_t lo, int64_t hi) {
  if (v.is_number_unsigned()) {
    const uint64_t u = v.get<uint64_t>();
    if (u > uint64_t(std::numeric_limits<int64_t>::max()) || int64_t(u) > hi || int64_t(u) < lo)
      fail(where, " = ", u, " is out of range; valid: ", lo, " to ", hi);
    return int64_t(u);
  }
  if (v.is_number_integer()) {
    const int64_t i = v.get<int64_t>();
    if (i < lo || i > hi) fail(where, " = ", i, " is out of range; valid: ", lo, " to ", hi);
    return i;
  }
  if (v.is_number_float()) {
    const double d = v.get<double>();
    // d < 2^63 first: double(INT64_MAX) rounds up to 2^63, whose conversion would overflow.
    if (std::isfinite(d) && d == std::floor(d) && d >= -0x1p63 && d < 0x1p63) {
      const int64_t i = int64_t(d);
      if (i >= lo && i <= hi) return i;
    }
    fail(where, " = ", json_excerpt(v), " is not a whole number in range; valid: ", lo, " to ", hi);
  }
  bad_type(v, where, "an integer");
}

uint64_t json_to_uint(const json& v, const std::string& where, uint64_t lo, uint64_t hi) {
  if (v.is_number_unsigned()) {
    const uint64_t u = v.get<uint64_t>();
    if (u < lo || u > hi) fail(where, " = ", u, " is out of range; valid: ", lo, " to ", hi);
    return u;
  }
  if (v.is_number_integer()) {  // parsed JSON stores non-negative integers as unsigned;
    const int64_t i = v.get<int64_t>();  // a value built in code may hold them signed
    if (i < 0 || uint64_t(i) < lo || uint64_t(i) > hi)
      fail(where, " = ", i, " is out of range; valid: ", lo, " to ", hi);
    return uint64_t(i);
  }
  if (v.is_number_float())
    fail(where, " = ", json_excerpt(v), " is not a whole number; valid: ", lo, " to ", hi);
  bad_type(v, where, "a non-negative integer");
}

double json_to_finite(const json& v, const std::string& where) {
  if (!v.is_number()) bad_type(v, where, "a number");
  const double d = v.get<double>();
  if (!std::isfinite(d)) fail(where, " = ", json_excerpt(v), " is not finite");
  return d;
}

std::string json_to_string(const json& v, const std::string& where) {
  if (!v.is_string()) bad_type(v, where, "a string");
  return v.get<std::string>();
}

bool json_to_bool(const json& v, const std::string& where) {
  if (!v.is_boolean()) bad_type(v, where, "true or false");
  return v.get<bool>();
}

const json& json_member(const json& obj, const std::string& key, const std::string& where) {
  if (!obj.is_object()) fail(where, ": expected a JSON object, got ", obj.type_name());
  auto it = obj.find(key);
  if (it == obj.end()) fail(where, ": missing field \"", key, "\"");
  return *it;
}

}  // namespace mhar
