// data_test_util.h: helpers shared by the data tests (tokenizer, shard, loader,
// prepare): fixture paths, base64, temp folders, and asset lookup that skips a test
// when the fetched tokenizers are absent (and fails instead under CI, where
// tools/setup.sh fetches them).
#pragma once
#include <gtest/gtest.h>

#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "data/tokenizer.h"
#include "engine/error.h"

namespace mhar::test {

inline std::string fixture_dir() { return std::string(MHAR_SOURCE_DIR) + "/tests/fixtures/tokenizer"; }

inline std::string base64_decode(const std::string& in) {
  static const std::string chars = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
  std::string out;
  // Unsigned: the accumulator keeps only its low bits that matter, and older bits shifted
  // out the top must wrap rather than overflow (a signed int overflowed after 5 characters).
  std::uint32_t val = 0;
  int bits = -8;
  for (char c : in) {
    if (c == '=') break;
    const auto pos = chars.find(c);
    if (pos == std::string::npos) continue;
    val = (val << 6) + static_cast<std::uint32_t>(pos);
    bits += 6;
    if (bits >= 0) {
      out.push_back(static_cast<char>((val >> bits) & 0xFF));
      bits -= 8;
    }
  }
  return out;
}

struct TestString {
  int id;
  std::string category;
  std::string bytes;
  bool special;
};

inline std::vector<TestString> load_test_strings() {
  std::ifstream in(fixture_dir() + "/strings.jsonl");
  std::vector<TestString> out;
  std::string line;
  while (std::getline(in, line)) {
    const auto j = nlohmann::json::parse(line);
    out.push_back({j["id"].get<int>(), j["cat"].get<std::string>(), base64_decode(j["b64"].get<std::string>()),
                   j.value("special", false)});
  }
  return out;
}

// id -> expected ids; a null "ids" (reference error) is left out.
inline std::map<int, std::vector<int32_t>> load_expected(const std::string& file) {
  std::map<int, std::vector<int32_t>> out;
  std::ifstream in(file);
  std::string line;
  while (std::getline(in, line)) {
    const auto j = nlohmann::json::parse(line);
    if (!j["ids"].is_null()) out[j["id"].get<int>()] = j["ids"].get<std::vector<int32_t>>();
  }
  return out;
}

inline bool under_ci() {
  const char* ci = std::getenv("CI");
  return ci && *ci && std::string(ci) != "false" && std::string(ci) != "0";
}

// Loads gpt2/qwen3 from the assets folder; skips (or fails under CI) when missing.
#define MHAR_LOAD_TOKENIZER_OR_SKIP(var, name)                                                   \
  std::optional<mhar::data::Tokenizer> var##_holder;                                            \
  try {                                                                                          \
    var##_holder = mhar::data::Tokenizer::load(name);                                            \
  } catch (const mhar::Error& e) {                                                               \
    if (mhar::test::under_ci()) FAIL() << "tokenizer " << name << " unavailable in CI: " << e.what(); \
    GTEST_SKIP() << "tokenizer " << name << " not fetched (run tools/fetch_assets.sh): " << e.what(); \
  }                                                                                              \
  const mhar::data::Tokenizer& var = *var##_holder

class TempDir {
 public:
  TempDir() {
    std::random_device rd;
    path_ = std::filesystem::temp_directory_path() / ("mhar_data_test_" + std::to_string(rd()) + std::to_string(rd()));
    std::filesystem::create_directories(path_);
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  std::string str() const { return path_.string(); }
  std::string operator/(const std::string& name) const { return (path_ / name).string(); }

 private:
  std::filesystem::path path_;
};

inline std::string read_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

inline void write_bytes(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary);
  out << bytes;
}

// The message of the mhar::Error that f throws, or "" if it does not throw one.
template <class F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const mhar::Error& e) {
    return e.what();
  }
  return "";
}

}  // namespace mhar::test
