// json_io.h: the one way the engine reads JSON (configs, state.json, safetensors headers,
// tokenizer.json, prepare.json, metrics lines, --set values).
//
// parse_json_strict refuses what nlohmann::json::parse silently accepts or cannot survive:
// nesting deeper than a limit (a value nested 100,000 deep would otherwise crash the
// recursive printer and destructor), duplicate object keys (which would silently take the
// last), invalid UTF-8 and numbers out of double range (1e400). Every error names the
// source, the byte offset or key path, and the rule.
//
// The typed getters check a value's type and range before narrowing and print the user's
// own value in the message (never a wrapped or rounded one).
#pragma once
#include <cstdint>
#include <string>

#include <nlohmann/json.hpp>

namespace mhar {

struct JsonLimits {
  int max_depth = 64;           // objects/arrays nested deeper are refused
  bool allow_comments = false;  // configs allow // and /* */ comments
};

// Parses `text`; throws mhar::Error naming `source` on any violation.
nlohmann::json parse_json_strict(const std::string& text, const std::string& source,
                                 JsonLimits limits = {});
// read_regular_file + parse_json_strict.
nlohmann::json read_json_file(const std::string& path, const char* what, JsonLimits limits = {},
                              uint64_t max_bytes = uint64_t(256) << 20);

// A short rendering of a value for error messages (at most `max_chars`, with "...").
std::string json_excerpt(const nlohmann::json& v, size_t max_chars = 80);

// Typed access with range checks; `where` names the file and field ("state.json: step").
int64_t json_to_int(const nlohmann::json& v, const std::string& where, int64_t lo, int64_t hi);
uint64_t json_to_uint(const nlohmann::json& v, const std::string& where, uint64_t lo, uint64_t hi);
double json_to_finite(const nlohmann::json& v, const std::string& where);
std::string json_to_string(const nlohmann::json& v, const std::string& where);
bool json_to_bool(const nlohmann::json& v, const std::string& where);
// The member `key` of object `obj`, which must exist; the error names where + key.
const nlohmann::json& json_member(const nlohmann::json& obj, const std::string& key,
                                  const std::string& where);

}  // namespace mhar
