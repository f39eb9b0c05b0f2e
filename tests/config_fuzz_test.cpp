// config_fuzz_test.cpp: generated configs (issue 18). Mutations of a valid config, as
// files and as --set values: deleted fields, changed types, extreme numbers (2^31, 2^32+2,
// 2^63, 2^64-1, -0, 1e308, 1e-320, 1e400), NaN-like strings, deep nesting, duplicate keys,
// non-UTF-8 bytes, huge unknown keys, truncation and flipped bytes. Each input is either
// accepted, and then validates again with every field inside its documented bounds
// (checked here against the table in engine/config.cpp, written out independently) and
// round-trips through to_json, or refused with mhar::Error naming the file or the --set;
// never another exception, never a crash. Deterministic seed; the loop is timed.
#include <gtest/gtest.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "engine/config.h"
#include "engine/error.h"
#include "tests/wall_clock.h"

using mhar::Config;
using nlohmann::json;

namespace {

const char* kBase = R"({
  "model": {"vocab_size": 64, "d_model": 32, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2,
            "head_dim": 8, "d_ff": 64, "context_length": 32, "rope_theta": 10000.0,
            "rms_eps": 1e-6, "tie_embeddings": true, "init_std": 0.02},
  "residual": {"mode": "mhar", "heads": 2},
  "train": {"micro_batch": 2, "seq_len": 16, "batch_tokens": 64, "steps": 10, "lr": 0.001,
            "min_lr_ratio": 0.1, "warmup_steps": 2, "schedule": "cosine", "decay_fraction": 0.2,
            "weight_decay": 0.1, "beta1": 0.9, "beta2": 0.95, "adam_eps": 1e-8, "grad_clip": 1.0,
            "seed": 7, "eval_every": 5, "eval_batches": 2, "log_every": 1, "max_bad_steps": 5,
            "device": "cpu", "logits_chunk": 0},
  "data": {"train": "train_*.bin", "val": "val_*.bin", "tokenizer": "gpt2"},
  "checkpoint": {"every": 5, "keep": 2}
})";

// Values as JSON text, so that 1e400 and -0 reach the parser as written.
const std::vector<std::string> kExtremes = {
    "2147483648", "2147483647", "-2147483649", "4294967298", "4294967296", "9223372036854775807",
    "9223372036854775808", "18446744073709551615", "18446744073709551616", "-9223372036854775809",
    "-0", "-0.0", "0", "1", "-1", "0.5", "1e308", "-1e308", "1e-320", "1e400", "-1e400", "1e-400",
    "1.7976931348623157e308", "4.9e-324", "1024", "1025", "65536", "1e6", "1e12", "3.0", "2.5",
    "0.9999999999999999", "1.0000000000000002", "100000", "16777216", "16777217", "1048576"};
const std::vector<std::string> kOddValues = {
    "\"NaN\"", "\"nan\"", "\"Infinity\"", "\"-inf\"", "\"1e3\"", "\"\"", "\"mhar\"", "true", "false",
    "null", "[]", "{}", "[1]", "{\"a\": 1}", "\"\\u0000\"", "NaN", "Infinity", "-", "1e", "+1",
    "01", ".5", "0x10"};

// The documented bounds (engine/config.cpp's field list), checked on accepted configs.
void expect_within_documented_bounds(const Config& c, const std::string& input) {
  const auto& m = c.model;
  const auto& t = c.train;
  SCOPED_TRACE(input.substr(0, 300));
  EXPECT_TRUE(m.vocab_size >= 1 && m.vocab_size <= (1 << 24));
  EXPECT_TRUE(m.d_model >= 1 && m.d_model <= 65536);
  EXPECT_TRUE(m.n_layers >= 1 && m.n_layers <= 1024);
  EXPECT_TRUE(m.n_heads >= 1 && m.n_heads <= 1024);
  EXPECT_TRUE(m.n_kv_heads >= 1 && m.n_kv_heads <= 1024 && m.n_heads % m.n_kv_heads == 0);
  EXPECT_TRUE(m.head_dim >= 2 && m.head_dim <= 1024 && m.head_dim % 2 == 0);
  EXPECT_TRUE(m.d_ff >= 1 && m.d_ff <= 262144);
  EXPECT_TRUE(m.context_length >= 1 && m.context_length <= (1 << 20));
  EXPECT_TRUE(m.rope_theta >= 1 && m.rope_theta <= 1e12);
  EXPECT_TRUE(m.rms_eps >= 1e-30 && m.rms_eps < 1);
  EXPECT_TRUE(m.init_std > 0 && m.init_std <= 10);
  EXPECT_TRUE(c.residual.heads >= 0 && c.residual.heads <= 1024);
  if (c.residual.mode == mhar::ResidualMode::Mhar) {
    EXPECT_EQ(m.d_model % c.residual.heads, 0);
  }
  EXPECT_TRUE(t.micro_batch >= 1 && t.micro_batch <= 65536);
  EXPECT_TRUE(t.seq_len >= 1 && t.seq_len <= m.context_length);
  EXPECT_TRUE(t.batch_tokens >= 0 && t.batch_tokens <= (1LL << 40));
  EXPECT_TRUE(t.steps >= 1 && t.steps <= 1000000000);
  EXPECT_TRUE(t.lr > 0 && t.lr <= 10);
  EXPECT_TRUE(t.min_lr_ratio >= 0 && t.min_lr_ratio <= 1);
  EXPECT_TRUE(t.warmup_steps >= 0 && t.warmup_steps <= t.steps);
  EXPECT_TRUE(t.decay_fraction >= 0 && t.decay_fraction <= 1);
  EXPECT_TRUE(t.weight_decay >= 0 && t.weight_decay <= 10 && t.lr * t.weight_decay < 1);
  EXPECT_TRUE(t.beta1 >= 0 && t.beta1 < 1);
  EXPECT_TRUE(t.beta2 >= 0 && t.beta2 < 1);
  EXPECT_TRUE(t.adam_eps >= 1e-30 && t.adam_eps < 1);
  EXPECT_TRUE(t.grad_clip >= 0 && t.grad_clip <= 1e6);
  EXPECT_TRUE(t.eval_every >= 1 && t.eval_batches >= 1 && t.log_every >= 1 && t.max_bad_steps >= 1);
  EXPECT_TRUE(t.logits_chunk >= 0 && t.logits_chunk <= (1 << 30));
  EXPECT_TRUE(t.schedule == "cosine" || t.schedule == "wsd");
  EXPECT_TRUE(t.device == "cpu" || t.device == "cuda" || t.device == "auto");
  EXPECT_TRUE(c.checkpoint.every >= 0 && c.checkpoint.keep >= 0);
  for (double v : {m.rope_theta, m.rms_eps, m.init_std, t.lr, t.min_lr_ratio, t.decay_fraction,
                   t.weight_decay, t.beta1, t.beta2, t.adam_eps, t.grad_clip})
    EXPECT_TRUE(std::isfinite(v));
}

struct Field {
  std::string section, key;
};

class Mutator {
 public:
  explicit Mutator(uint64_t seed) : rng_(seed), base_(json::parse(kBase)) {
    for (auto s = base_.begin(); s != base_.end(); ++s)
      for (auto f = s->begin(); f != s->end(); ++f) fields_.push_back({s.key(), f.key()});
  }

  size_t pick(size_t n) { return size_t(rng_() % n); }
  const Field& field() { return fields_[pick(fields_.size())]; }

  // The text of `j` with field f's value replaced by `value_text` (raw JSON, maybe invalid).
  static std::string with_value(json j, const Field& f, const std::string& value_text) {
    const std::string marker = "@@MARK@@";
    j[f.section][f.key] = marker;
    std::string text = j.dump(1);
    text.replace(text.find("\"" + marker + "\""), marker.size() + 2, value_text);
    return text;
  }

  std::string nested(size_t depth) {
    const bool arrays = pick(2);
    std::string s;
    for (size_t i = 0; i < depth; ++i) s += arrays ? "[" : "{\"a\":";
    s += "1";
    for (size_t i = 0; i < depth; ++i) s += arrays ? "]" : "}";
    return s;
  }

  std::string non_utf8() {
    std::string s;
    const int n = 1 + int(pick(4));
    for (int i = 0; i < n; ++i) s += char(0x80 + pick(0x80));
    if (pick(2)) s = "ok" + s;
    return s;
  }

  // One mutated config text; `what` describes it for failure messages.
  std::string config_text(std::string& what) {
    json j = base_;
    switch (pick(10)) {
      case 0: {  // delete fields (defaults must then apply, or the combination is refused)
        const int n = 1 + int(pick(4));
        what = "deleted";
        for (int i = 0; i < n; ++i) {
          const Field& f = field();
          j[f.section].erase(f.key);
          what += " " + f.section + "." + f.key;
        }
        if (pick(4) == 0) {
          const Field& f = field();
          j.erase(f.section);
          what += " section " + f.section;
        }
        return j.dump(pick(2) ? 2 : -1);
      }
      case 1: {  // type change / NaN-like
        const Field& f = field();
        const std::string v = kOddValues[pick(kOddValues.size())];
        what = f.section + "." + f.key + " = " + v;
        return with_value(j, f, v);
      }
      case 2:
      case 3: {  // extreme numbers (two cases: the most interesting mutation)
        const Field& f = field();
        const std::string v = kExtremes[pick(kExtremes.size())];
        what = f.section + "." + f.key + " = " + v;
        return with_value(j, f, v);
      }
      case 4: {  // nesting around the depth limit, and far beyond it
        const size_t depths[] = {1, 62, 63, 64, 65, 200, 70000};
        const size_t d = depths[pick(7)];
        const Field& f = field();
        what = f.section + "." + f.key + " nested " + std::to_string(d);
        return with_value(j, f, nested(d));
      }
      case 5: {  // a duplicated key, of a field or of a whole section
        const Field& f = field();
        std::string text = j.dump();
        if (pick(2)) {
          const std::string at = "\"" + f.section + "\":{";
          const size_t p = text.find(at) + at.size();
          text.insert(p, "\"" + f.key + "\":" + j[f.section][f.key].dump() + ",");
          what = "duplicate " + f.section + "." + f.key;
        } else {
          text.insert(text.size() - 1, ",\"" + f.section + "\":" + j[f.section].dump());
          what = "duplicate section " + f.section;
        }
        return text;
      }
      case 6: {  // non-UTF-8 bytes in a value or a key
        const Field& f = field();
        std::string text = j.dump();
        const std::string bytes = non_utf8();
        if (pick(2)) {
          text = with_value(j, f, "\"" + bytes + "\"");
          what = f.section + "." + f.key + " = non-UTF-8 string";
        } else {
          const std::string at = "\"" + f.key + "\"";
          text.insert(text.find(at) + 1, bytes);
          what = "non-UTF-8 key " + f.section + "." + f.key;
        }
        return text;
      }
      case 7: {  // truncation
        std::string text = j.dump(pick(2) ? 2 : -1);
        const size_t cut = pick(text.size());
        what = "truncated at " + std::to_string(cut);
        return text.substr(0, cut);
      }
      case 8: {  // an unknown key or section, up to 100,000 bytes long
        const std::string key(pick(2) ? 100000 : 1 + pick(20), char('a' + pick(26)));
        if (pick(2)) {
          j[field().section][key] = 1;
          what = "unknown key of " + std::to_string(key.size()) + " bytes";
        } else {
          j[key] = json::object();
          what = "unknown section of " + std::to_string(key.size()) + " bytes";
        }
        return j.dump();
      }
      default: {  // flipped or inserted bytes
        std::string text = j.dump();
        const int n = 1 + int(pick(3));
        what = "bytes changed at";
        for (int i = 0; i < n; ++i) {
          const size_t p = pick(text.size());
          text[p] = char(rng_());
          what += " " + std::to_string(p);
        }
        return text;
      }
    }
  }

  // One --set assignment with a mutated value.
  std::string assignment() {
    const Field& f = field();
    std::string value;
    switch (pick(5)) {
      case 0: value = kExtremes[pick(kExtremes.size())]; break;
      case 1: value = kOddValues[pick(kOddValues.size())]; break;
      case 2: value = nested(pick(2) ? 70000 : 65); break;
      case 3: value = non_utf8(); break;
      default: value = "{\"a\": 1, \"a\": 2}"; break;
    }
    return f.section + "." + f.key + "=" + value;
  }

 private:
  std::mt19937_64 rng_;
  json base_;
  std::vector<Field> fields_;
};

}  // namespace

TEST(ConfigFuzz, GeneratedConfigsAreAcceptedWithinBoundsOrRefusedNamingTheSource) {
  namespace fs = std::filesystem;
  const fs::path dir = fs::path(::testing::TempDir()) / ("mhar_config_fuzz_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  fs::create_directories(dir);
  const std::string path = (dir / "fuzz.json").string();

  Mutator mut(18);
  const int kInputs = 1500;
  int accepted = 0, refused = 0;
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < kInputs; ++i) {
    std::string what;
    std::vector<std::string> sets;
    std::string text;
    if (i % 4 == 3) {  // a valid file with one or two mutated --set values
      text = kBase;
      sets.push_back(mut.assignment());
      if (mut.pick(2)) sets.push_back(mut.assignment());
      what = "--set";
      for (const auto& s : sets) what += " " + s.substr(0, 80);
    } else {
      text = mut.config_text(what);
    }
    // A new file each time: truncating one in place makes ext4 write it back on close.
    fs::remove(path);
    std::ofstream(path, std::ios::binary) << text;
    const std::string input = "input " + std::to_string(i) + " (" + what + ")";
    try {
      Config c = mhar::load_config(path, sets);
      ++accepted;
      c.validate();
      expect_within_documented_bounds(c, input);
      const Config again = mhar::config_from_json(c.to_json(), "again.json");
      EXPECT_EQ(again.to_json(), c.to_json()) << input;
    } catch (const mhar::Error& e) {
      ++refused;
      const std::string msg = e.what();
      const bool names_source =
          msg.find(path) != std::string::npos || (!sets.empty() && msg.find("--set") != std::string::npos);
      EXPECT_TRUE(names_source) << input << ": " << msg;
      EXPECT_LT(msg.size(), 2000u) << input << ": the message must not dump the input";
    } catch (const std::exception& e) {
      ADD_FAILURE() << input << ": threw " << typeid(e).name() << " instead of mhar::Error: "
                    << e.what();
    }
  }
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::printf("[ fuzz ] %d configs: %d accepted, %d refused, %.2f s\n", kInputs, accepted, refused,
              secs);
  // Both outcomes must occur, or the mutations stopped exercising one side.
  EXPECT_GT(accepted, kInputs / 20);
  EXPECT_GT(refused, kInputs / 2);
  EXPECT_LT(secs, mhar::test::wall_clock_bound(30.0))
      << "each input is bounded; the loop must stay a few seconds";
  fs::remove_all(dir);
}
