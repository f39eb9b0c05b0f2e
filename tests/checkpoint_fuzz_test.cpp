// checkpoint_fuzz_test.cpp: 1,000 damaged checkpoints, generated from one real tiny
// checkpoint with a fixed seed: bit flips in the safetensors headers and data, header
// rewrites (shifted, overlapping, swapped offsets, gaps, trailing junk, shape and dtype
// lies, extra, missing and renamed tensors, reordered data, metadata), truncations,
// header-length lies, state.json field mutations (every checksum recomputed, so the
// structural checks are what is tested) and state.json byte flips (not resealed).
// Each one is opened and loaded the way `train --resume` does it, and must either load
// or be refused with mhar::Error: never a crash, a hang or another exception. Where the
// damage is made at the JSON level, an independent implementation of the format's rule
// and the checkpoint's contract (below) says which, and what the loaded values must be;
// for byte-level damage a load must give the original values. A subset of the refused
// ones goes through the `mhar eval` and `mhar sample` binaries: exit 1, under 5 s.
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <cstring>
#include <map>
#include <random>
#include <set>

#include "engine/error.h"
#include "engine/optimizer.h"
#include "tests/checkpoint_test_util.h"
#include "tests/wall_clock.h"

using namespace mhar;
using namespace mhar::test;

namespace {

// What a file must load to: per tensor name, its values; or invalid.
struct Expected {
  bool valid = false;
  std::string why;  // for messages, when invalid
  std::map<std::string, std::vector<float>> values;
};

bool is_uint(const json& v) { return v.is_number_integer() && (v.is_number_unsigned() || v.get<int64_t>() >= 0); }

// The safetensors rule and the checkpoint's contract, written independently of the
// engine: exactly the names and shapes of `want`, each F32 with exactly dtype, shape and
// data_offsets, the offsets covering the data exactly when sorted, values finite (second
// moments non-negative), metadata a string-to-string map.
Expected oracle(const json& header, const std::string& data,
                const std::map<std::string, std::vector<int64_t>>& want) {
  Expected x;
  auto bad = [&](std::string why) {
    x.valid = false;
    x.why = std::move(why);
    x.values.clear();
    return x;
  };
  if (!header.is_object()) return bad("header not an object");
  std::vector<std::pair<std::pair<uint64_t, uint64_t>, std::string>> ranges;
  std::set<std::string> names;
  for (auto it = header.begin(); it != header.end(); ++it) {
    const json& v = it.value();
    if (it.key() == "__metadata__") {
      if (!v.is_object()) return bad("metadata not an object");
      for (auto m = v.begin(); m != v.end(); ++m)
        if (!m.value().is_string()) return bad("metadata value not a string");
      continue;
    }
    names.insert(it.key());
    if (!want.count(it.key())) return bad("extra tensor " + it.key());
    if (!v.is_object() || v.size() != 3 || !v.contains("dtype") || !v.contains("shape") ||
        !v.contains("data_offsets"))
      return bad("malformed entry " + it.key());
    if (v["dtype"] != "F32") return bad("dtype of " + it.key());
    const json& s = v["shape"];
    if (!s.is_array()) return bad("shape of " + it.key());
    std::vector<int64_t> shape;
    for (const json& d : s) {
      if (!is_uint(d)) return bad("dimension of " + it.key());
      shape.push_back(d.get<int64_t>());
    }
    if (shape != want.at(it.key())) return bad("shape of " + it.key());
    const json& o = v["data_offsets"];
    if (!o.is_array() || o.size() != 2 || !is_uint(o[0]) || !is_uint(o[1])) return bad("offsets of " + it.key());
    const uint64_t b = o[0].get<uint64_t>(), e = o[1].get<uint64_t>();
    uint64_t n = 1;
    for (int64_t d : shape) n *= uint64_t(d);
    if (e < b || e - b != 4 * n) return bad("size of " + it.key());
    ranges.push_back({{b, e}, it.key()});
  }
  for (const auto& [name, shape] : want)
    if (!names.count(name)) return bad("missing " + name);
  std::sort(ranges.begin(), ranges.end());
  uint64_t pos = 0;
  for (const auto& r : ranges) {
    if (r.first.first != pos) return bad("layout at " + r.second);
    pos = r.first.second;
  }
  if (pos != data.size()) return bad("layout: data size");
  for (const auto& r : ranges) {
    std::vector<float> v((r.first.second - r.first.first) / 4);
    std::memcpy(v.data(), data.data() + r.first.first, v.size() * 4);
    const bool second = r.second.size() > 11 && r.second.substr(r.second.size() - 11) == ".exp_avg_sq";
    for (float f : v)
      if (!std::isfinite(f) || (second && f < 0)) return bad("value in " + r.second);
    x.values[r.second] = std::move(v);
  }
  x.valid = true;
  return x;
}

// The engine's typed readers' contract (engine/json_io.h), for the state.json oracle.
bool int_like(const json& v, int64_t lo, int64_t hi) {
  if (v.is_number_unsigned()) return v.get<uint64_t>() <= uint64_t(hi) && int64_t(v.get<uint64_t>()) >= lo;
  if (v.is_number_integer()) return v.get<int64_t>() >= lo && v.get<int64_t>() <= hi;
  if (v.is_number_float()) {
    const double d = v.get<double>();
    return std::isfinite(d) && d == std::floor(d) && d >= double(lo) && d <= double(hi);
  }
  return false;
}
bool uint_like(const json& v, uint64_t lo, uint64_t hi) {
  return is_uint(v) && v.get<uint64_t>() >= lo && v.get<uint64_t>() <= hi;
}

struct StateField {
  const char* pointer;
  std::function<bool(const json&)> valid;  // with every other field as written
};

class Fuzzer {
 public:
  explicit Fuzzer(const TinyRun& run) : run_(run), rng_(0x5eedc4ec) {
    scratch_ = run.root / "fuzz";
    ck_ = scratch_ / "step_00000002";
    model0_ = slurp(fs::path(run.ckpt) / "model.safetensors");
    opt0_ = slurp(fs::path(run.ckpt) / "optimizer.rank0.safetensors");
    state0_ = read_state(run.ckpt);
    CheckpointInfo info = open_checkpoint(run.ckpt);
    be_ = make_cpu_backend();
    model_ = std::make_unique<Model>(info.config.model, info.config.residual, *be_, 2, 16);
    opt_ = std::make_unique<AdamWOptimizer>(*model_, info.config.train);
    for (const Parameter& p : model_->parameters()) {
      want_model_[p.name] = std::vector<int64_t>(p.value.shape.begin(), p.value.shape.begin() + p.value.ndim);
      want_opt_[p.name + ".exp_avg"] = {p.value.numel()};
      want_opt_[p.name + ".exp_avg_sq"] = {p.value.numel()};
    }
    const StParts m = split_safetensors(model0_), o = split_safetensors(opt0_);
    original_ = oracle(m.header, m.data, want_model_);
    const Expected oo = oracle(o.header, o.data, want_opt_);
    EXPECT_TRUE(original_.valid && oo.valid) << original_.why << " / " << oo.why;  // the oracle itself
    for (auto& [k, v] : oo.values) original_.values[k] = v;
    const int64_t size0 = int64_t(model0_.size());
    fields_ = {
        {"/step", [](const json& v) { return int_like(v, 2, 2); }},  // the directory says 2
        {"/format", [](const json& v) { return v == "mhar-checkpoint-2"; }},
        {"/trainer/tokens_seen", [](const json& v) { return int_like(v, 0, INT64_MAX); }},
        {"/trainer/total_bad_steps", [](const json& v) { return int_like(v, 0, 2); }},
        {"/trainer/consecutive_bad_steps", [](const json& v) { return int_like(v, 0, 0); }},
        {"/trainer/elapsed_s",
         [](const json& v) { return v.is_number() && std::isfinite(v.get<double>()) && v.get<double>() >= 0; }},
        {"/loader/epoch", [](const json& v) { return uint_like(v, 0, INT64_MAX); }},
        {"/loader/step", [](const json& v) { return uint_like(v, 0, INT64_MAX); }},
        {"/loader/seed", [](const json& v) { return uint_like(v, 5, 5); }},
        {"/loader/B", [](const json& v) { return int_like(v, 2, 2); }},
        {"/loader/T", [](const json& v) { return int_like(v, 16, 16); }},
        // The loader's world size must be the checkpoint's (one rank wrote this one).
        {"/loader/world_size", [](const json& v) { return int_like(v, 1, 1); }},
        {"/world_size", [](const json& v) { return int_like(v, 1, 1); }},
        {"/loader/shards", [](const json& v) { return uint_like(v, 1, UINT32_MAX); }},
        {"/loader/tokens", [](const json& v) { return uint_like(v, 1, INT64_MAX); }},
        {"/loader/mode", [](const json& v) { return v == "shuffled"; }},
        {"/loader/fingerprint",
         [](const json& v) {
           if (!v.is_string() || v.get<std::string>().size() != 16) return false;
           for (char c : v.get<std::string>())
             if (!std::isdigit((unsigned char)c) && (c < 'a' || c > 'f')) return false;
           return true;
         }},
        {"/files/model.safetensors/bytes", [size0](const json& v) { return int_like(v, size0, size0) && is_uint(v); }},
        // Whole sections: only the section as written is valid among the values drawn.
        {"/trainer", [t = state0_["trainer"]](const json& v) { return v == t; }},
        {"/loader", [l = state0_["loader"]](const json& v) { return v == l; }},
    };
  }

  // Runs case `i`; returns its kind's name.
  std::string run_case(int i) {
    link_checkpoint(run_.ckpt, ck_);
    const int kind = i % 10;
    Outcome expect;  // filled by the mutation
    std::string label;
    switch (kind) {
      case 0: label = flip_header("model.safetensors", model0_, expect); break;
      case 1: label = flip_data("model.safetensors", model0_, want_model_, expect); break;
      case 2: label = flip_header("optimizer.rank0.safetensors", opt0_, expect); break;
      case 3: label = flip_data("optimizer.rank0.safetensors", opt0_, want_opt_, expect); break;
      case 4: label = rewrite_header("model.safetensors", model0_, want_model_, expect); break;
      case 5: label = rewrite_header("optimizer.rank0.safetensors", opt0_, want_opt_, expect); break;
      case 6: label = resize_file(expect); break;
      case 7: label = mutate_state(expect); break;
      case 8: label = flip_state(expect); break;
      default: label = lie_header_length(expect); break;
    }
    const std::string kind_name = label.substr(0, label.find(':'));
    check(expect, "case " + std::to_string(i) + " (" + label + ")", kind_name);
    return kind_name;
  }

  int accepted = 0, refused = 0, cli_runs = 0;
  double cli_seconds = 0;

 private:
  enum class Rule { Oracle, RefuseOrSame, Refuse };
  struct Outcome {
    Rule rule = Rule::RefuseOrSame;
    Expected expected;  // Rule::Oracle: the model's and the moments' values, or invalid
    std::function<void(const CheckpointInfo&)> state_check;  // extra checks when accepted
    bool model_damaged = false;  // what eval and sample read: then they must refuse too
  };

  uint64_t pick(uint64_t n) { return rng_() % n; }

  // Replaces file `name` and reseals its record and state.json (the other file's record
  // is still right: it was not touched).
  void write_file(const char* name, const std::string& bytes) {
    spit(ck_ / name, bytes);
    json st = state0_;
    st["files"][name] = {{"bytes", bytes.size()}, {"fnv1a64", test_hex64(test_fnv1a64(bytes))}};
    seal_state(ck_, st);
  }

  // The values the untouched file of the other kind holds, merged into `x`.
  void merge_untouched(Expected& x, bool touched_model) {
    if (!x.valid) return;
    for (const auto& [k, v] : original_.values)
      if (touched_model != bool(want_model_.count(k))) x.values[k] = v;
  }

  std::string flip_header(const char* name, const std::string& file, Outcome& out) {
    std::string f = file;
    uint64_t n = 0;
    for (int i = 7; i >= 0; --i) n = (n << 8) | uint8_t(f[size_t(i)]);
    const size_t at = 8 + size_t(pick(n));
    f[at] = char(uint8_t(f[at]) ^ uint8_t(1 + pick(255)));
    write_file(name, f);
    out.rule = Rule::RefuseOrSame;
    out.model_damaged = std::string(name) == "model.safetensors";
    return std::string("header-flip: ") + name + " byte " + std::to_string(at);
  }

  // A random bit, or (to reach the value checks) a float made non-finite or negated.
  std::string flip_data(const char* name, const std::string& file,
                        const std::map<std::string, std::vector<int64_t>>& want, Outcome& out) {
    StParts p = split_safetensors(file);
    size_t at = size_t(pick(p.data.size()));
    std::string what;
    switch (pick(4)) {
      case 0: {  // exponent all ones: Inf or NaN
        at -= at % 4;
        p.data[at + 3] = char(uint8_t(p.data[at + 3]) | 0x7f);
        p.data[at + 2] = char(uint8_t(p.data[at + 2]) | 0x80);
        what = "non-finite float at byte ";
        break;
      }
      case 1:
        at -= at % 4;
        p.data[at + 3] = char(uint8_t(p.data[at + 3]) ^ 0x80);
        what = "sign of float at byte ";
        break;
      default:
        p.data[at] = char(uint8_t(p.data[at]) ^ uint8_t(1u << pick(8)));
        what = "bit at byte ";
    }
    write_file(name, join_safetensors(p.header, p.data));
    out.rule = Rule::Oracle;
    out.expected = oracle(p.header, p.data, want);
    out.model_damaged = &want == &want_model_;
    merge_untouched(out.expected, &want == &want_model_);
    return std::string("data-flip: ") + name + " " + what + std::to_string(at);
  }

  std::string rewrite_header(const char* name, const std::string& file,
                             const std::map<std::string, std::vector<int64_t>>& want, Outcome& out) {
    StParts p = split_safetensors(file);
    std::vector<std::string> names;
    for (auto it = p.header.begin(); it != p.header.end(); ++it)
      if (it.key() != "__metadata__") names.push_back(it.key());
    const std::string a = names[pick(names.size())], b = names[pick(names.size())];
    json& ea = p.header[a];
    auto offsets = [&](const std::string& t) {
      return std::make_pair(p.header[t]["data_offsets"][0].get<uint64_t>(), p.header[t]["data_offsets"][1].get<uint64_t>());
    };
    std::string what;
    switch (pick(15)) {
      case 0: {
        const int64_t deltas[] = {-64, -8, -4, -2, -1, 1, 2, 4, 8, 64};
        const int64_t d = deltas[pick(10)];
        auto [x, y] = offsets(a);
        ea["data_offsets"] = {int64_t(x) + d, int64_t(y) + d};  // may go negative: refused
        what = "shift " + a + " by " + std::to_string(d);
        break;
      }
      case 1: ea["data_offsets"] = p.header[b]["data_offsets"]; what = "offsets of " + b + " for " + a; break;
      case 2: std::swap(ea["data_offsets"], p.header[b]["data_offsets"]); what = "swap " + a + " " + b; break;
      case 3: {
        json s = ea["shape"];
        std::reverse(s.begin(), s.end());
        ea["shape"] = s;
        what = "reverse shape of " + a;
        break;
      }
      case 4: {
        json s = ea["shape"];
        const size_t d = size_t(pick(s.size()));
        s[d] = s[d].get<int64_t>() + (pick(2) ? 1 : -1);
        ea["shape"] = s;
        what = "dimension +-1 of " + a;
        break;
      }
      case 5: {
        int64_t n = 1;
        for (const json& d : ea["shape"]) n *= d.get<int64_t>();
        ea["shape"] = pick(2) ? json({n}) : json({1, n});
        what = "reshape " + a;
        break;
      }
      case 6: {
        const char* dtypes[] = {"F16", "BF16", "F64", "I32", "U8", "f32", "", "F32 "};
        const std::string t = dtypes[pick(8)];
        ea["dtype"] = t;
        if (t == "F16" || t == "BF16") ea["shape"] = {offsets(a).second / 2 - offsets(a).first / 2};
        if (t == "U8") ea["shape"] = {offsets(a).second - offsets(a).first};
        what = "dtype " + t + " for " + a;
        break;
      }
      case 7: {  // every tensor's data in another order: valid, same values
        std::vector<std::string> order = names;
        std::shuffle(order.begin(), order.end(), rng_);
        std::string data;
        json h = p.header;
        for (const auto& t : order) {
          auto [x, y] = offsets(t);
          h[t]["data_offsets"] = {data.size(), data.size() + (y - x)};
          data += p.data.substr(size_t(x), size_t(y - x));
        }
        p.header = h;
        p.data = data;
        what = "reorder data";
        break;
      }
      case 8: p.data += std::string(1 + pick(64), 'J'); what = "trailing junk"; break;
      case 9: {
        auto [x, y] = offsets(a);
        const uint64_t g = 1 + pick(16);
        p.data.insert(size_t(y), g, '\0');
        for (const auto& t : names)
          if (offsets(t).first >= y && t != a) {
            auto [u, v] = offsets(t);
            p.header[t]["data_offsets"] = {u + g, v + g};
          }
        what = "gap after " + a;
        break;
      }
      case 10: p.header.erase(a); what = "remove " + a; break;
      case 11: {
        p.header[a + ".extra"] = {{"dtype", "F32"}, {"shape", {1}}, {"data_offsets", {p.data.size(), p.data.size() + 4}}};
        p.data += std::string(4, '\0');
        what = "extra tensor";
        break;
      }
      case 12: {
        json e = ea;
        p.header.erase(a);
        p.header[a + "x"] = e;
        what = "rename " + a;
        break;
      }
      case 13: {
        const json values[] = {json(2), json(nullptr), json::array(), json("ok"), json::object()};
        const json v = values[pick(5)];
        if (pick(4) == 0) p.header.erase("__metadata__"); else p.header["__metadata__"]["k"] = v;
        what = "metadata " + v.dump();
        break;
      }
      default: {
        const json values[] = {json({0}), json({0, 4, 8}), json("0,4"), json({-4, 0}), json({1e3, 2e3}),
                               json({uint64_t(1) << 63, (uint64_t(1) << 63) + 4}), json::array({nullptr, 4})};
        ea["data_offsets"] = values[pick(7)];
        what = "data_offsets " + ea["data_offsets"].dump() + " for " + a;
        break;
      }
    }
    write_file(name, join_safetensors(p.header, p.data));
    out.rule = Rule::Oracle;
    out.expected = oracle(p.header, p.data, want);
    out.model_damaged = &want == &want_model_;
    merge_untouched(out.expected, &want == &want_model_);
    return std::string("rewrite: ") + name + ": " + what;
  }

  std::string resize_file(Outcome& out) {
    const bool model = pick(2);
    const std::string& file = model ? model0_ : opt0_;
    std::string f = file;
    std::string what;
    if (pick(2)) {
      f.resize(size_t(pick(f.size())));
      what = "truncate to " + std::to_string(f.size());
    } else {
      f += std::string(1 + pick(64), char(pick(256)));
      what = "extend to " + std::to_string(f.size());
    }
    write_file(model ? "model.safetensors" : "optimizer.rank0.safetensors", f);
    out.rule = Rule::Refuse;
    out.model_damaged = model;
    return "resize: " + what;
  }

  std::string lie_header_length(Outcome& out) {
    const bool model = pick(2);
    std::string f = model ? model0_ : opt0_;
    uint64_t n = 0;
    for (int i = 7; i >= 0; --i) n = (n << 8) | uint8_t(f[size_t(i)]);
    const uint64_t choices[] = {n + 8, n - 8, n + 1, n - 1, 0, 1, uint64_t(f.size()), uint64_t(f.size()) - 8,
                                UINT64_MAX, uint64_t(1) << 40, rng_()};
    const uint64_t lie = choices[pick(11)];
    for (int i = 0; i < 8; ++i) f[size_t(i)] = char((lie >> (8 * i)) & 0xff);
    write_file(model ? "model.safetensors" : "optimizer.rank0.safetensors", f);
    out.rule = lie == n ? Rule::RefuseOrSame : Rule::Refuse;
    out.model_damaged = model;
    return "header-length: " + std::to_string(lie) + " for " + std::to_string(n);
  }

  std::string mutate_state(Outcome& out) {
    const StateField& field = fields_[pick(fields_.size())];
    json original = state0_[json::json_pointer(field.pointer)];
    std::vector<json> pool = {original, -1, -5, 0, 1, 2, 2.0, 4.5, 1e300, -0.0, "2", nullptr, true,
                              json::array(), json::object(), INT64_MAX, UINT64_MAX, "shuffled",
                              "mhar-checkpoint-2", "0123456789abcdef", json::array({json::array({1})})};
    if (original.is_number_integer()) pool.push_back(original.get<int64_t>() + 1);
    if (original.is_number()) pool.push_back(original.get<double>());  // the same value as a float
    const json value = pool[pick(pool.size())];
    json st = state0_;  // its file records match the untouched files
    st[json::json_pointer(field.pointer)] = value;
    seal_state(ck_, st);
    // What the reader sees is the value as written and read back.
    const json seen = json::parse(value.dump());
    out.rule = field.valid(seen) ? Rule::Oracle : Rule::Refuse;
    out.expected = original_;
    const std::string pointer = field.pointer;
    out.state_check = [pointer, seen](const CheckpointInfo& info) {
      // Accepted values are the file's own, never wrapped or rounded.
      const double want = seen.is_number() ? seen.get<double>() : 0;
      if (pointer == "/step") {
        EXPECT_EQ(double(info.step), want);
      } else if (pointer == "/trainer/tokens_seen") {
        EXPECT_EQ(double(info.trainer.tokens_seen), want);
      } else if (pointer == "/trainer/total_bad_steps") {
        EXPECT_EQ(double(info.trainer.total_bad_steps), want);
      } else if (pointer == "/trainer/elapsed_s") {
        EXPECT_EQ(info.trainer.elapsed_s, want);
      }
      if (pointer.rfind("/loader/", 0) == 0) {
        const json& got = info.loader[pointer.substr(8)];
        if (seen.is_number()) EXPECT_EQ(got.get<double>(), want) << pointer;
        else EXPECT_EQ(got, seen) << pointer;
      }
    };
    return std::string("state: ") + field.pointer + " = " + value.dump();
  }

  std::string flip_state(Outcome& out) {
    std::string text = slurp(ck_ / "state.json");
    const size_t at = size_t(pick(text.size()));
    text[at] = char(uint8_t(text[at]) ^ uint8_t(1 + pick(255)));
    spit(ck_ / "state.json", text);  // not resealed: the checksum (or the parser) must see it
    out.rule = Rule::RefuseOrSame;
    out.expected = original_;
    const json s0 = state0_;
    out.state_check = [s0](const CheckpointInfo& info) {
      EXPECT_EQ(info.step, s0["step"].get<int64_t>());
      EXPECT_EQ(info.trainer.tokens_seen, s0["trainer"]["tokens_seen"].get<int64_t>());
      EXPECT_EQ(info.loader, s0["loader"]);
    };
    return "state-flip: byte " + std::to_string(at);
  }

  // Loads the damaged checkpoint as a resume does and checks the outcome against `expect`.
  void check(const Outcome& expect, const std::string& label, const std::string& kind) {
    // Poison: a load that claims success must have written every value.
    for (size_t i = 0; i < model_->parameters().size(); ++i) {
      std::vector<double> junk(size_t(model_->parameters()[i].value.numel()), 12345.0);
      be_->upload(model_->parameters()[i].value, junk.data());
      be_->upload(opt_->exp_avg(i), junk.data());
      be_->upload(opt_->exp_avg_sq(i), junk.data());
    }
    bool ok = false;
    std::string error;
    try {
      CheckpointInfo info = open_checkpoint(ck_.string());
      load_model_weights(info, *model_, opt_.get());
      load_optimizer_moments(info, *model_, *opt_);
      ok = true;
      if (expect.state_check) expect.state_check(info);
    } catch (const Error& e) {
      error = e.what();
    } catch (const std::exception& e) {
      ADD_FAILURE() << label << ": not an mhar::Error: " << e.what();
      return;
    }
    if (!ok) {
      ++refused;
      EXPECT_FALSE(error.empty()) << label;
      EXPECT_TRUE(expect.rule != Rule::Oracle || !expect.expected.valid)
          << label << ": refused, but the oracle says it is a valid checkpoint: " << error;
      if (expect.model_damaged && cli_checked_[kind]++ < 2) check_cli(label);
      return;
    }
    ++accepted;
    ASSERT_NE(expect.rule, Rule::Refuse) << label << ": accepted";
    const std::map<std::string, std::vector<float>>& want =
        expect.rule == Rule::Oracle ? expect.expected.values : original_.values;
    ASSERT_TRUE(expect.rule != Rule::Oracle || expect.expected.valid)
        << label << ": accepted, but the oracle refuses it: " << expect.expected.why;
    for (size_t i = 0; i < model_->parameters().size(); ++i) {
      const Parameter& p = model_->parameters()[i];
      expect_equal(download(*be_, p.value), want.at(p.name), label + ": " + p.name);
      expect_equal(download(*be_, opt_->exp_avg(i)), want.at(p.name + ".exp_avg"), label + ": exp_avg");
      expect_equal(download(*be_, opt_->exp_avg_sq(i)), want.at(p.name + ".exp_avg_sq"), label + ": exp_avg_sq");
    }
  }

  static void expect_equal(const std::vector<double>& got, const std::vector<float>& want, const std::string& what) {
    ASSERT_EQ(got.size(), want.size()) << what;
    for (size_t i = 0; i < got.size(); ++i)
      if (got[i] != double(want[i])) {
        ADD_FAILURE() << what << "[" << i << "] = " << got[i] << ", the file holds " << want[i];
        return;
      }
  }

  // The binaries refuse it too: exit 1 with a message, in under 5 s.
  void check_cli(const std::string& label) {
    for (const std::string& cmd :
         {"eval --device cpu --checkpoint " + ck_.string() + " --data '" + run_.val_glob + "'",
          "sample --device cpu --checkpoint " + ck_.string() + " --prompt 'ab' --max-tokens 2"}) {
      const CliRun r = run_mhar(scratch_, cmd);
      ++cli_runs;
      cli_seconds += r.seconds;
      EXPECT_EQ(r.rc, 1) << label << ": mhar " << cmd << "\n" << r.err;
      EXPECT_LT(r.seconds, mhar::test::wall_clock_bound(5.0)) << label << ": mhar " << cmd;
      EXPECT_EQ(r.err.rfind("error: ", 0), 0u) << label << ": " << r.err;
    }
  }

  const TinyRun& run_;
  std::mt19937_64 rng_;
  fs::path scratch_, ck_;
  std::string model0_, opt0_;
  json state0_;
  std::unique_ptr<Backend> be_;
  std::unique_ptr<Model> model_;
  std::unique_ptr<AdamWOptimizer> opt_;
  std::map<std::string, std::vector<int64_t>> want_model_, want_opt_;
  Expected original_;
  std::vector<StateField> fields_;
  std::map<std::string, int> cli_checked_;  // refused cases of a kind run through the binaries
};

TEST(CheckpointFuzz, DamagedCheckpointsLoadAsTheFileSaysOrAreRefused) {
  const TinyRun run = make_tiny_run(fs::temp_directory_path() / ("mhar_ckpt_fuzz_" + std::to_string(::getpid())));
  Fuzzer fuzz(run);
  const int kCases = 1000;
  std::map<std::string, std::pair<int, int>> by_kind;  // accepted, refused
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < kCases && !::testing::Test::HasFatalFailure(); ++i) {
    const int acc = fuzz.accepted;
    const std::string kind = fuzz.run_case(i);
    (fuzz.accepted > acc ? by_kind[kind].first : by_kind[kind].second)++;
  }
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::printf("[ fuzz ] %d damaged checkpoints in %.1f s: %d loaded as the file says, %d refused; "
              "%d binary runs (%.1f s of it)\n", kCases, secs, fuzz.accepted, fuzz.refused, fuzz.cli_runs,
              fuzz.cli_seconds);
  for (const auto& [k, v] : by_kind) std::printf("[ fuzz ]   %-14s %4d loaded %4d refused\n", k.c_str(), v.first, v.second);
  EXPECT_EQ(fuzz.accepted + fuzz.refused, kCases);
  // Every kind of damage was generated and the structural kinds were refused at least
  // once (the loop cannot pass by accepting everything or by never reaching a check).
  for (const char* k : {"header-flip", "data-flip", "rewrite", "resize", "state", "state-flip", "header-length"})
    EXPECT_GT(by_kind[k].second, 0) << k;
  EXPECT_GT(by_kind["data-flip"].first, 0);
  EXPECT_GT(by_kind["state"].first, 0);
  // Bounded: about 3 s of CPU (11 s of wall time on a 2-core machine shared with a
  // load of 10); the limit leaves room for a loaded CI machine, a hang would pass it.
  EXPECT_LT(secs, mhar::test::wall_clock_bound(120.0));
  if (!::testing::Test::HasFailure()) fs::remove_all(run.root);
}

}  // namespace
