// hf_export_test.cpp: `mhar export` and `mhar import` (issue 9) without PyTorch: round
// trips (a trained checkpoint exported and imported back comes out bit for bit; sharded
// output; bf16 values are the round-to-nearest-even of the fp32 ones; F16 and BF16
// weights import exactly), the safetensors headers (format "pt", contiguous offsets), the
// config.json of stock and routed exports, the run directory an import makes (eval,
// sample, train --init-from and --resume accept it), and bad input refused cleanly: exit
// 1 in under 5 s, a message naming the file, the field or the tensor, and nothing at
// --out. The comparison with transformers itself needs PyTorch: tools/hf/check_export.py.
#include "engine/hf_export.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <random>
#include <set>

#include "data/shard.h"
#include "engine/backend.h"
#include "engine/checkpoint.h"
#include "engine/error.h"
#include "engine/hf_import.h"
#include "engine/model.h"
#include "engine/safetensors.h"
#include "engine/trainer.h"
#include "tests/data_test_util.h"
#include "tests/model_test_util.h"
#include "tests/process_test_util.h"
#include "tests/wall_clock.h"

namespace fs = std::filesystem;
using namespace mhar;
using mhar::test::read_bytes;
using nlohmann::json;

namespace {

struct CmdResult {
  int code;
  std::string output;       // stdout, then stderr: where a message is looked for
  std::string stdout_text;  // the command's result alone (JSON for eval): logs go to stderr
  double seconds;
};

// Runs `mhar ARGS` (with ENV assignments in front) by process_test_util.h's run_command,
// capturing stdout and stderr apart: a warning the engine logs on stderr (OpenBLAS's slow
// kernels on a CPU it does not recognise) must not break the JSON a command prints on
// stdout.
CmdResult run_mhar(const std::string& args, const std::string& env = "") {
  char err_path[] = "/tmp/mhar_hf_test_stderr_XXXXXX";
  const int fd = ::mkstemp(err_path);
  if (fd < 0) return {-1, "mkstemp failed for the command's stderr", "", 0};
  ::close(fd);
  const mhar::test::CommandResult r =
      mhar::test::run_command(env + (env.empty() ? "" : " ") + std::string(MHAR_BINARY) +
                              " --log-level warn " + args + " 2>'" + err_path + "'");
  const std::string err = read_bytes(err_path);
  ::unlink(err_path);
  return {r.rc, r.out + err, r.out, r.seconds};
}

std::string q(const fs::path& p) { return "'" + p.string() + "'"; }

void write_file(const fs::path& p, const std::string& text) {
  std::ofstream out(p, std::ios::binary | std::ios::trunc);
  out << text;
}

json read_json(const fs::path& p) { return json::parse(read_bytes(p)); }

struct RawTensor {
  std::string dtype;
  std::vector<int64_t> shape;
  std::string bytes;
};

size_t dtype_bytes(const std::string& d) {
  if (d == "F32" || d == "I32") return 4;
  if (d == "BF16" || d == "F16") return 2;
  if (d == "F64" || d == "I64") return 8;
  return 0;
}

// A safetensors file parsed here from its bytes (independently of the engine's reader),
// with the format's rules checked: 8-byte-aligned header, metadata {"format": "pt"} when
// asked, data offsets contiguous from 0 to the end of the file, sizes matching shapes.
std::map<std::string, RawTensor> read_raw(const fs::path& file, bool expect_pt_metadata = true) {
  const std::string raw = read_bytes(file);
  EXPECT_GE(raw.size(), 8u) << file;
  uint64_t n = 0;
  std::memcpy(&n, raw.data(), 8);
  EXPECT_EQ(n % 8, 0u) << file << ": header length is not a multiple of 8";
  const json header = json::parse(raw.substr(8, n));
  if (expect_pt_metadata) {
    EXPECT_EQ(header.value("__metadata__", json()), json({{"format", "pt"}})) << file;
  }
  std::vector<std::pair<uint64_t, uint64_t>> ranges;
  std::map<std::string, RawTensor> out;
  for (auto it = header.begin(); it != header.end(); ++it) {
    if (it.key() == "__metadata__") continue;
    RawTensor t;
    t.dtype = it.value()["dtype"].get<std::string>();
    t.shape = it.value()["shape"].get<std::vector<int64_t>>();
    const uint64_t b = it.value()["data_offsets"][0].get<uint64_t>(), e = it.value()["data_offsets"][1].get<uint64_t>();
    uint64_t numel = 1;
    for (int64_t s : t.shape) numel *= uint64_t(s);
    EXPECT_EQ(e - b, numel * dtype_bytes(t.dtype)) << file << ": " << it.key();
    ranges.push_back({b, e});
    t.bytes = raw.substr(8 + n + b, e - b);
    out[it.key()] = t;
  }
  std::sort(ranges.begin(), ranges.end());
  uint64_t at = 0;
  for (const auto& [b, e] : ranges) {
    EXPECT_EQ(b, at) << file << ": data offsets leave a gap or overlap";
    at = e;
  }
  EXPECT_EQ(at, raw.size() - 8 - n) << file << ": data does not end at the end of the file";
  return out;
}

// The tensors of a Hugging Face directory, single file or sharded.
std::map<std::string, RawTensor> read_dir(const fs::path& dir) {
  if (fs::exists(dir / "model.safetensors")) return read_raw(dir / "model.safetensors");
  const json index = read_json(dir / "model.safetensors.index.json");
  std::map<std::string, RawTensor> out;
  std::set<std::string> files;
  for (auto it = index["weight_map"].begin(); it != index["weight_map"].end(); ++it)
    files.insert(it.value().get<std::string>());
  for (const auto& f : files)
    for (auto& [k, v] : read_raw(dir / f)) {
      EXPECT_EQ(index["weight_map"][k], f) << k << " is in " << f << " but the index says otherwise";
      out[k] = v;
    }
  return out;
}

std::vector<float> as_f32(const RawTensor& t) {
  std::vector<float> v(t.bytes.size() / 4);
  std::memcpy(v.data(), t.bytes.data(), t.bytes.size());
  return v;
}

// Round to nearest even, written from the definition (the two neighbouring bf16 values,
// the nearer wins, a tie goes to the even mantissa), not from the bit trick under test.
uint16_t reference_bf16(float x) {
  if (std::isnan(x)) return 0x7fc0;
  uint32_t u;
  std::memcpy(&u, &x, 4);
  const uint16_t lo = uint16_t(u >> 16), hi = uint16_t(lo + 1);  // toward zero, away from zero
  auto value = [](uint16_t b) {
    if ((b & 0x7fff) == 0x7f80) return std::copysign(std::ldexp(1.0, 128), (b & 0x8000) ? -1.0 : 1.0);
    const uint32_t w = uint32_t(b) << 16;
    float f;
    std::memcpy(&f, &w, 4);
    return double(f);
  };
  if ((u & 0xffff) == 0) return lo;  // exactly representable
  const double dlo = std::fabs(double(x) - value(lo)), dhi = std::fabs(double(x) - value(hi));
  if (dlo != dhi) return dlo < dhi ? lo : hi;
  return (lo & 1) == 0 ? lo : hi;
}

// IEEE half from the textbook formula.
double reference_f16(uint16_t h) {
  const int s = h >> 15, e = (h >> 10) & 31, m = h & 1023;
  const double mag = e == 0 ? (m / 1024.0) * std::pow(2.0, -14) : (1 + m / 1024.0) * std::pow(2.0, e - 15);
  return s ? -mag : mag;
}

// Leftovers of a staged directory (".NAME.tmp-PID" or ".NAME.old-PID") in `parent`.
std::vector<std::string> staging_leftovers(const fs::path& parent) {
  std::vector<std::string> out;
  if (!fs::exists(parent)) return out;
  for (const auto& e : fs::directory_iterator(parent)) {
    const std::string n = e.path().filename().string();
    if (n[0] == '.' && (n.find(".tmp-") != std::string::npos || n.find(".old-") != std::string::npos))
      out.push_back(n);
  }
  return out;
}

class HfExportTest : public ::testing::Test {
 protected:
  fs::path dir;
  fs::path tokenizer = fs::path(MHAR_SOURCE_DIR) / "tests/fixtures/tokenizer/trained_4096.json";

  void SetUp() override {
    dir = fs::temp_directory_path() / ("mhar_hf_test_" + std::to_string(::getpid()) + "_" +
                                       ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir);
    fs::create_directories(dir / "data");
    data::write_shard((dir / "data/train_000.bin").string(), test::markov_tokens(8000, 1), 2);
    data::write_shard((dir / "data/val_000.bin").string(), test::markov_tokens(2000, 3), 2);
  }
  void TearDown() override {
    unsetenv("MHAR_SIMULATE_DISK_FULL_AFTER_BYTES");
    fs::remove_all(dir);
  }

  // `residual`: further residual.* fields (block_size, hyper_n, ...).
  json run_config(const char* mode, bool tied, int heads, int steps = 4, const json& residual = json::object()) const {
    json r = {{"mode", mode}, {"heads", heads}};
    r.update(residual);
    return {{"model", {{"vocab_size", 4096}, {"d_model", 16}, {"n_layers", 2}, {"n_heads", 4}, {"n_kv_heads", 2},
                       {"head_dim", 4}, {"d_ff", 24}, {"context_length", 16}, {"tie_embeddings", tied}}},
            {"residual", r},
            {"train", {{"micro_batch", 4}, {"seq_len", 16}, {"steps", steps}, {"lr", 1e-2}, {"warmup_steps", 1},
                       {"eval_every", 100}, {"eval_batches", 2}, {"device", "cpu"}, {"seed", 3}}},
            {"data", {{"train", (dir / "data/train_*.bin").string()}, {"val", (dir / "data/val_*.bin").string()},
                      {"tokenizer", tokenizer.string()}}},
            {"checkpoint", {{"every", 0}, {"keep", 1}}}};
  }
  // Trains a tiny model for a few steps (so no weight is at its initial value) and returns
  // its checkpoint directory.
  std::string train_tiny(const std::string& name, const char* mode, bool tied, int heads = 0,
                         const json& residual = json::object()) {
    TrainOptions o;
    o.run_dir = (dir / name).string();
    o.quiet = true;
    return train(config_from_json(run_config(mode, tied, heads, 4, residual), "hf_export_test"), o).last_checkpoint;
  }
  std::string val() const { return q(dir / "data/val_*.bin"); }

  // Expects a clean refusal: exit 1, every needle in the message, fast, nothing at `out`.
  void expect_refused(const std::string& args, const std::vector<std::string>& needles, const fs::path& out,
                      const std::string& env = "") {
    const CmdResult r = run_mhar(args, env);
    EXPECT_EQ(r.code, 1) << args << "\n" << r.output;
    for (const auto& n : needles) EXPECT_NE(r.output.find(n), std::string::npos) << "missing \"" << n << "\" in:\n" << r.output;
    EXPECT_EQ(r.output.find("internal error"), std::string::npos) << r.output;
    EXPECT_LT(r.seconds, mhar::test::wall_clock_bound(5.0)) << args;
    EXPECT_FALSE(fs::exists(out)) << out << " was created by: " << args;
    EXPECT_TRUE(staging_leftovers(out.parent_path()).empty()) << args;
  }
};

// ------------------------------------------------------------------ units

// Every residual configuration the engine trains, as the tests below export it.
std::vector<std::pair<std::string, Config>> every_residual_config(bool tied) {
  using test::tiny_config;
  std::vector<std::pair<std::string, Config>> out = {
      {"standard", tiny_config(ResidualMode::Standard, 0, tied)},
      {"attnres", tiny_config(ResidualMode::AttnRes, 1, tied)},
      {"mhar", tiny_config(ResidualMode::Mhar, 4, tied)},
      {"mhar block 3", tiny_config(ResidualMode::Mhar, 2, tied, 3)},
      {"attnres block 4", tiny_config(ResidualMode::AttnRes, 1, tied, 4)},
      {"hyper n=1", tiny_config(ResidualMode::Hyper, 0, tied, 0, 1)},
      {"hyper n=3", tiny_config(ResidualMode::Hyper, 0, tied, 0, 3)},
      {"delta block_layers 1", tiny_config(ResidualMode::Delta, 2, tied, 0, 4, 1)},
      {"delta block_layers 2", tiny_config(ResidualMode::Delta, 4, tied, 0, 4, 2)},
  };
  Config dyn = tiny_config(ResidualMode::Hyper, 0, tied, 0, 2);
  dyn.residual.hyper_dynamic = true;
  out.push_back({"hyper n=2 dynamic", dyn});
  return out;
}

TEST(HfExportUnit, LayoutIsTheModelsParameterList) {
  auto be = make_cpu_backend(DType::F32);
  for (bool tied : {true, false})
    for (const auto& [what, cfg] : every_residual_config(tied)) {
      SCOPED_TRACE(what + (tied ? " tied" : " untied"));
      Model m(cfg.model, cfg.residual, *be, 1, 1);
      const auto layout = hf_tensor_layout(cfg.model, cfg.residual);
      ASSERT_EQ(layout.size(), m.parameters().size());
      for (size_t i = 0; i < layout.size(); ++i) {
        const Tensor& t = m.parameters()[i].value;
        EXPECT_EQ(layout[i].name, m.parameters()[i].name);
        EXPECT_EQ(layout[i].shape, std::vector<int64_t>(t.shape.begin(), t.shape.begin() + t.ndim)) << layout[i].name;
      }
    }
}

// The scheme tensors under the names and shapes modeling_mhar.py declares (its header
// lists them; a rename on either side must show up here).
TEST(HfExportUnit, SchemeTensorNamesAndShapes) {
  auto names = [](const Config& c) {
    std::map<std::string, std::vector<int64_t>> out;
    for (const auto& t : hf_tensor_layout(c.model, c.residual))
      if (t.name.rfind("model.layers.", 0) != 0 && t.name.rfind("model.embed", 0) != 0 && t.name != "model.norm.weight" &&
          t.name != "lm_head.weight")
        out[t.name] = t.shape;
    return out;
  };
  const auto cfgs = every_residual_config(true);
  auto find = [&](const std::string& what) {
    for (const auto& [w, c] : cfgs)
      if (w == what) return c;
    ADD_FAILURE() << what;
    return cfgs[0].second;
  };
  EXPECT_TRUE(names(find("standard")).empty());
  auto block = names(find("mhar block 3"));  // 2 layers: 5 sites, d = 16
  EXPECT_EQ(block.size(), 10u);
  EXPECT_EQ(block.at("model.routing.4.query"), std::vector<int64_t>{16});
  EXPECT_EQ(block.at("model.routing.0.gain"), std::vector<int64_t>{16});
  auto hyper = names(find("hyper n=3"));  // 4 sublayers x (a_m, a_r, b)
  EXPECT_EQ(hyper.size(), 12u);
  EXPECT_EQ(hyper.at("model.hyper.0.a_m"), std::vector<int64_t>{3});
  EXPECT_EQ(hyper.at("model.hyper.3.a_r"), std::vector<int64_t>{9});
  EXPECT_EQ(hyper.at("model.hyper.2.b"), std::vector<int64_t>{3});
  EXPECT_FALSE(hyper.count("model.hyper.4.a_m"));  // no connection around the head
  auto dyn = names(find("hyper n=2 dynamic"));  // + w, s_a, s_b
  EXPECT_EQ(dyn.size(), 24u);
  EXPECT_EQ(dyn.at("model.hyper.1.w"), std::vector<int64_t>{16 * 4});
  EXPECT_EQ(dyn.at("model.hyper.1.s_a"), std::vector<int64_t>{1});
  EXPECT_EQ(dyn.at("model.hyper.3.s_b"), std::vector<int64_t>{1});
  auto delta = names(find("delta block_layers 1"));  // 5 sites x 3 + null
  EXPECT_EQ(delta.size(), 16u);
  EXPECT_EQ(delta.at("model.delta.4.alpha"), std::vector<int64_t>{1});
  EXPECT_EQ(delta.at("model.delta.0.query"), std::vector<int64_t>{16});
  EXPECT_EQ(delta.at("model.delta.2.gain"), std::vector<int64_t>{16});
  EXPECT_EQ(delta.at("model.delta.null"), std::vector<int64_t>{16});
}

// config.json carries every field modeling_mhar.py reads, and only the mode's own (the
// configuration class refuses a field that contradicts the mode); `mhar import` reads
// them back into the same residual config.
TEST(HfExportUnit, ConfigCarriesTheSchemeAndImportReadsItBack) {
  HfTokenizerInfo tok;
  const std::vector<std::string> scheme_keys = {"residual_mode", "routing_heads", "block_size", "hyper_n",
                                                "hyper_dynamic", "block_layers"};
  for (const auto& [what, cfg] : every_residual_config(false)) {
    SCOPED_TRACE(what);
    EXPECT_NO_THROW(require_exportable(cfg.residual, "ckpt"));
    const json j = hf_config_json(cfg, HfDType::F32, tok);
    const ResidualConfig& r = cfg.residual;
    std::map<std::string, json> want;
    switch (r.mode) {
      case ResidualMode::Standard:
        break;
      case ResidualMode::AttnRes:
      case ResidualMode::Mhar:
        want = {{"residual_mode", residual_mode_name(r.mode)}, {"routing_heads", r.heads}, {"block_size", r.block_size}};
        break;
      case ResidualMode::Hyper:
        want = {{"residual_mode", "hyper"}, {"hyper_n", r.hyper_n}, {"hyper_dynamic", r.hyper_dynamic}};
        break;
      case ResidualMode::Delta:
        want = {{"residual_mode", "delta"}, {"routing_heads", r.heads}, {"block_layers", r.block_layers}};
        break;
    }
    for (const std::string& k : scheme_keys) {
      if (want.count(k)) {
        EXPECT_EQ(j.value(k, json()), want.at(k)) << k;
      } else {
        EXPECT_FALSE(j.contains(k)) << k << " = " << j.value(k, json());
      }
    }
    EXPECT_EQ(j["model_type"], r.mode == ResidualMode::Standard ? "qwen3" : "mhar");
    json engine = engine_model_from_hf_config(j, "exp/config.json");
    engine["train"] = {{"seq_len", 8}};
    const Config back = config_from_json(engine, "imported");
    EXPECT_EQ(back.residual.mode, r.mode);
    EXPECT_EQ(back.residual.heads, r.heads);
    EXPECT_EQ(back.residual.block_size, r.block_size);
    EXPECT_EQ(back.residual.hyper_n, r.hyper_n);
    EXPECT_EQ(back.residual.hyper_dynamic, r.hyper_dynamic);
    EXPECT_EQ(back.residual.block_layers, r.block_layers);
  }
}

// An mhar config.json whose scheme fields contradict each other or the model is refused
// on import naming the field (the engine's config validation judges them).
TEST(HfImportConfig, BadSchemeFieldsAreRefusedNamingTheField) {
  HfTokenizerInfo tok;
  struct Case {
    const char* base;
    std::function<void(json&)> edit;
    std::vector<std::string> needles;
  };
  const std::vector<Case> cases = {
      {"mhar block 3", [](json& j) { j["block_size"] = 5; }, {"block_size", "5"}},
      {"mhar block 3", [](json& j) { j["block_size"] = -1; }, {"block_size", "-1"}},
      {"mhar block 3", [](json& j) { j["hyper_n"] = 2; }, {"hyper_n", "2"}},
      {"hyper n=3", [](json& j) { j["hyper_n"] = 65; }, {"hyper_n", "65"}},
      {"hyper n=3", [](json& j) { j["hyper_n"] = 0; }, {"hyper_n", "0"}},
      {"hyper n=3", [](json& j) { j["block_size"] = 2; }, {"block_size", "hyper"}},
      {"hyper n=3", [](json& j) { j["routing_heads"] = 2; }, {"heads", "hyper"}},
      {"hyper n=3", [](json& j) { j["hyper_dynamic"] = "yes"; }, {"hyper_dynamic", "yes"}},
      {"delta block_layers 1", [](json& j) { j["block_layers"] = 3; }, {"block_layers", "3"}},
      {"delta block_layers 1", [](json& j) { j["block_size"] = 2; }, {"block_size", "delta"}},
      {"delta block_layers 1", [](json& j) { j["routing_heads"] = 3; }, {"heads", "3"}},
      {"mhar", [](json& j) { j["block_layers"] = 1; }, {"block_layers", "mhar"}},
  };
  const auto cfgs = every_residual_config(true);
  for (const auto& c : cases) {
    const Config* base = nullptr;
    for (const auto& [w, cfg] : cfgs)
      if (w == c.base) base = &cfg;
    ASSERT_TRUE(base) << c.base;
    json j = hf_config_json(*base, HfDType::F32, tok);
    c.edit(j);
    try {
      json engine = engine_model_from_hf_config(j, "dir/config.json");
      engine["train"] = {{"seq_len", 8}};
      config_from_json(engine, "dir/config.json (imported)");
      ADD_FAILURE() << "accepted " << j.dump();
    } catch (const Error& e) {
      const std::string msg = e.what();
      EXPECT_NE(msg.find("dir/config.json"), std::string::npos) << msg;
      for (const auto& n : c.needles) EXPECT_NE(msg.find(n), std::string::npos) << "\"" << n << "\" not in: " << msg;
    }
  }
}

TEST(HfExportUnit, Bf16RoundsToNearestEven) {
  std::vector<uint32_t> bits = {0x00000000, 0x80000000, 0x3f800000, 0x3f808000 /* tie -> 0x3f80 */,
                                0x3f818000 /* tie -> 0x3f82 */, 0x3f808001, 0x3f807fff, 0x00000001, 0x807fffff,
                                0x7f7fffff /* -> inf */, 0x7f7f7fff, 0xff7fffff, 0x7f800000, 0xff800000,
                                0x7fc00001, 0x477fe000, 0x0080ffff};
  std::mt19937_64 rng(9);
  for (int i = 0; i < 200000; ++i) bits.push_back(uint32_t(rng()));
  int checked = 0;
  for (uint32_t b : bits) {
    float x;
    std::memcpy(&x, &b, 4);
    if (std::isnan(x)) {
      EXPECT_EQ(f32_to_bf16_rne(x), 0x7fc0);
      continue;
    }
    ASSERT_EQ(f32_to_bf16_rne(x), reference_bf16(x)) << std::hex << b;
    ++checked;
  }
  EXPECT_EQ(f32_to_bf16_rne(1.0f + 0x1p-8f), 0x3f80);        // halfway: to even
  EXPECT_EQ(f32_to_bf16_rne(1.0f + 3 * 0x1p-8f), 0x3f82);    // halfway: to even (up)
  EXPECT_GT(checked, 190000);
}

TEST(HfExportUnit, F16DecodesExactly) {
  EXPECT_EQ(f16_to_f32(0x3c00), 1.0f);
  EXPECT_EQ(f16_to_f32(0xc000), -2.0f);
  EXPECT_EQ(f16_to_f32(0x7bff), 65504.0f);
  EXPECT_EQ(f16_to_f32(0x0001), std::ldexp(1.0f, -24));
  EXPECT_TRUE(std::signbit(f16_to_f32(0x8000)) && f16_to_f32(0x8000) == 0.0f);
  EXPECT_TRUE(std::isinf(f16_to_f32(0x7c00)) && f16_to_f32(0x7c00) > 0);
  EXPECT_TRUE(std::isnan(f16_to_f32(0x7e00)));
  for (uint32_t h = 0; h < 0x7c00; ++h) {  // every finite half, both signs
    ASSERT_EQ(double(f16_to_f32(uint16_t(h))), reference_f16(uint16_t(h))) << h;
    ASSERT_EQ(double(f16_to_f32(uint16_t(h | 0x8000))), reference_f16(uint16_t(h | 0x8000))) << h;
  }
}

TEST(HfExportUnit, ByteSizes) {
  EXPECT_EQ(parse_byte_size("5GB", "--max-shard-size"), 5000000000ULL);
  EXPECT_EQ(parse_byte_size("200mb", "--max-shard-size"), 200000000ULL);
  EXPECT_EQ(parse_byte_size("64KiB", "--max-shard-size"), 65536ULL);
  EXPECT_EQ(parse_byte_size("1048576", "--max-shard-size"), 1048576ULL);
  for (const char* bad : {"", "abc", "0", "0GB", "5XB", "-1", "1.5GB", "99999999999999999999", "20000000000GB"}) {
    try {
      parse_byte_size(bad, "--max-shard-size");
      ADD_FAILURE() << "accepted \"" << bad << "\"";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("--max-shard-size"), std::string::npos) << e.what();
    }
  }
}

// The modeling files must at least be valid Python (transformers runs them on the GPU
// machine: tools/hf/check_export.py).
TEST(HfExportUnit, ModelingFilesAreValidPython) {
  if (std::system("command -v python3 >/dev/null 2>&1") != 0) GTEST_SKIP() << "no python3 here";
  for (const char* f : {"configuration_mhar.py", "modeling_mhar.py", "check_export.py"}) {
    const fs::path p = fs::path(MHAR_SOURCE_DIR) / "tools/hf" / f;
    const std::string cmd = "python3 -c \"import sys; compile(open(sys.argv[1], encoding='utf-8').read(), "
                            "sys.argv[1], 'exec')\" '" + p.string() + "' 2>&1";
    EXPECT_EQ(std::system(cmd.c_str()), 0) << p;
  }
}

json qwen3_config() {
  return {{"model_type", "qwen3"}, {"architectures", {"Qwen3ForCausalLM"}}, {"vocab_size", 4096},
          {"hidden_size", 16}, {"intermediate_size", 24}, {"num_hidden_layers", 2}, {"num_attention_heads", 4},
          {"num_key_value_heads", 2}, {"head_dim", 4}, {"max_position_embeddings", 16}, {"rms_norm_eps", 1e-6},
          {"rope_theta", 10000.0}, {"tie_word_embeddings", true}, {"hidden_act", "silu"},
          {"attention_bias", false}, {"use_sliding_window", false}, {"sliding_window", nullptr}};
}

TEST(HfImportConfig, ReadsTransformers4And5Conventions) {
  json v4 = qwen3_config();
  json m = engine_model_from_hf_config(v4, "config.json")["model"];
  EXPECT_EQ(m["rope_theta"].get<double>(), 10000.0);
  EXPECT_EQ(m["d_model"].get<int>(), 16);
  json v5 = qwen3_config();
  v5.erase("rope_theta");
  v5["rope_parameters"] = {{"rope_type", "default"}, {"rope_theta", 5e5}};
  EXPECT_EQ(engine_model_from_hf_config(v5, "config.json")["model"]["rope_theta"].get<double>(), 5e5);
  // Keys left out take Qwen3Config's defaults, as transformers reads the file...
  json minimal = {{"model_type", "qwen3"}, {"vocab_size", 100}, {"hidden_size", 64}, {"intermediate_size", 64},
                  {"num_hidden_layers", 1}, {"num_attention_heads", 32}};
  m = engine_model_from_hf_config(minimal, "config.json")["model"];
  EXPECT_EQ(m["n_kv_heads"].get<int>(), 32);
  EXPECT_EQ(m["head_dim"].get<int>(), 128);
  EXPECT_EQ(m["tie_embeddings"].get<bool>(), false);
  EXPECT_EQ(m["rope_theta"].get<double>(), 10000.0);
  EXPECT_EQ(m["context_length"].get<int>(), 32768);
  EXPECT_EQ(m["rms_eps"].get<double>(), 1e-6);
  // ...and null head counts are derived: KV heads = heads, head_dim = hidden / heads.
  minimal["num_key_value_heads"] = nullptr;
  minimal["head_dim"] = nullptr;
  m = engine_model_from_hf_config(minimal, "config.json")["model"];
  EXPECT_EQ(m["n_kv_heads"].get<int>(), 32);
  EXPECT_EQ(m["head_dim"].get<int>(), 2);
  minimal["num_attention_heads"] = 4;
  EXPECT_EQ(engine_model_from_hf_config(minimal, "config.json")["model"]["n_kv_heads"].get<int>(), 4);
}

TEST(HfImportConfig, UnsupportedConfigurationsAreRefusedNamingTheField) {
  struct Case {
    std::function<void(json&)> edit;
    std::vector<std::string> needles;
  };
  const std::vector<Case> cases = {
      {[](json& j) { j["use_sliding_window"] = true; }, {"use_sliding_window", "sliding-window"}},
      {[](json& j) { j["layer_types"] = {"full_attention", "sliding_attention"}; }, {"layer_types"}},
      {[](json& j) { j["rope_scaling"] = {{"rope_type", "yarn"}, {"factor", 4.0}}; }, {"rope_scaling", "yarn"}},
      {[](json& j) { j["rope_parameters"] = {{"rope_type", "linear"}, {"rope_theta", 1e4}, {"factor", 2.0}}; },
       {"rope_parameters.rope_type", "linear"}},
      {[](json& j) { j["rope_parameters"] = {{"rope_type", "default"}, {"rope_theta", 1e6}}; },
       {"contradicts", "rope_theta"}},
      {[](json& j) { j["attention_bias"] = true; }, {"attention_bias", "biases"}},
      {[](json& j) { j["mlp_bias"] = true; }, {"mlp_bias"}},
      {[](json& j) { j["model_type"] = "qwen3_moe"; }, {"model_type", "mixture-of-experts"}},
      {[](json& j) { j["num_experts"] = 8; }, {"num_experts", "mixture-of-experts"}},
      {[](json& j) { j["model_type"] = "llama"; }, {"model_type", "llama", "qwen3"}},
      {[](json& j) { j.erase("model_type"); }, {"model_type"}},
      {[](json& j) { j["hidden_act"] = "gelu"; }, {"hidden_act", "gelu"}},
      {[](json& j) { j["quantization_config"] = {{"quant_method", "gptq"}}; }, {"quantization_config"}},
      {[](json& j) { j.erase("hidden_size"); }, {"hidden_size", "missing"}},
      {[](json& j) { j["num_hidden_layers"] = "two"; }, {"num_hidden_layers", "\"two\""}},
      {[](json& j) { j["vocab_size"] = -5; }, {"vocab_size", "-5"}},
      {[](json& j) { j["num_hidden_layers"] = 100000; }, {"num_hidden_layers", "100000"}},
      {[](json& j) { j["tie_word_embeddings"] = "yes"; }, {"tie_word_embeddings"}},
      {[](json& j) { j["partial_rotary_factor"] = 0.5; }, {"partial_rotary_factor"}},
  };
  for (const auto& c : cases) {
    json j = qwen3_config();
    c.edit(j);
    try {
      engine_model_from_hf_config(j, "dir/config.json");
      ADD_FAILURE() << "accepted " << j.dump();
    } catch (const Error& e) {
      const std::string msg = e.what();
      EXPECT_NE(msg.find("dir/config.json"), std::string::npos) << msg;
      for (const auto& n : c.needles) EXPECT_NE(msg.find(n), std::string::npos) << "\"" << n << "\" not in: " << msg;
    }
  }
}

// Random damage to a config.json: every outcome is a model or a mhar::Error (no other
// exception, no crash), and the model always validates as an engine config.
TEST(HfImportConfig, FuzzedConfigsFailCleanly) {
  std::mt19937_64 rng(2024);
  const std::vector<json> values = {nullptr, true, false, 0, -1, 1, 3, 7, 1e300, -1e-300, 0.5, 2147483648LL,
                                    "", "silu", "default", "qwen3", "mhar", "attnres", "hyper", "delta", json::array(),
                                    json::array({1, 2}), json::object(), json({{"rope_type", "default"}})};
  std::vector<std::string> keys;
  const json base = qwen3_config();
  for (auto it = base.begin(); it != base.end(); ++it) keys.push_back(it.key());
  for (const char* k : {"rope_parameters", "rope_scaling", "residual_mode", "routing_heads", "num_experts",
                        "layer_types", "initializer_range", "partial_rotary_factor", "block_size", "hyper_n",
                        "hyper_dynamic", "block_layers"})
    keys.push_back(k);
  int accepted = 0, refused = 0;
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < 3000; ++i) {
    json j = qwen3_config();
    if (rng() % 4 == 0) j["model_type"] = "mhar", j["residual_mode"] = "mhar", j["routing_heads"] = 2;
    const int edits = 1 + int(rng() % 3);
    for (int e = 0; e < edits; ++e) {
      const std::string& k = keys[rng() % keys.size()];
      if (rng() % 5 == 0) j.erase(k);
      else j[k] = values[rng() % values.size()];
    }
    try {
      json engine = engine_model_from_hf_config(j, "fuzz/config.json");
      engine["train"] = {{"seq_len", 1}};
      config_from_json(engine, "fuzz");
      ++accepted;
    } catch (const Error&) {
      ++refused;
    } catch (const std::exception& e) {
      FAIL() << "config " << j.dump() << " threw a non-mhar exception: " << e.what();
    }
  }
  EXPECT_GT(accepted, 0);
  EXPECT_GT(refused, 0);
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(),
            mhar::test::wall_clock_bound(10.0));
}

// ------------------------------------------------------------------ export and import

TEST_F(HfExportTest, StandardModelRoundTrip) {
  const std::string ck = train_tiny("run", "standard", true);
  const fs::path exp = dir / "exp";
  CmdResult r = run_mhar("export --checkpoint " + q(ck) + " --out " + q(exp));
  ASSERT_EQ(r.code, 0) << r.output;
  for (const char* f : {"model.safetensors", "config.json", "generation_config.json", "tokenizer.json",
                        "tokenizer_config.json"})
    EXPECT_TRUE(fs::exists(exp / f)) << f;
  EXPECT_FALSE(fs::exists(exp / "modeling_mhar.py"));  // a stock Qwen3 model needs no code
  EXPECT_FALSE(fs::exists(exp / "model.safetensors.index.json"));

  // The tensors are the checkpoint's fp32 master weights, byte for byte.
  const auto src = read_raw(fs::path(ck) / "model.safetensors", false);
  const auto out = read_raw(exp / "model.safetensors");
  ASSERT_EQ(src.size(), out.size());
  for (const auto& [name, t] : src) {
    ASSERT_TRUE(out.count(name)) << name;
    EXPECT_EQ(out.at(name).dtype, "F32");
    EXPECT_EQ(out.at(name).shape, t.shape) << name;
    EXPECT_EQ(out.at(name).bytes, t.bytes) << name;
  }
  EXPECT_FALSE(out.count("lm_head.weight"));  // tied

  const json c = read_json(exp / "config.json");
  EXPECT_EQ(c["model_type"], "qwen3");
  EXPECT_EQ(c["architectures"], json({"Qwen3ForCausalLM"}));
  EXPECT_FALSE(c.contains("auto_map"));
  EXPECT_EQ(c["vocab_size"], 4096);
  EXPECT_EQ(c["hidden_size"], 16);
  EXPECT_EQ(c["intermediate_size"], 24);
  EXPECT_EQ(c["num_hidden_layers"], 2);
  EXPECT_EQ(c["num_attention_heads"], 4);
  EXPECT_EQ(c["num_key_value_heads"], 2);
  EXPECT_EQ(c["head_dim"], 4);
  EXPECT_EQ(c["max_position_embeddings"], 16);
  EXPECT_EQ(c["tie_word_embeddings"], true);
  EXPECT_EQ(c["rope_theta"].get<double>(), 1e6);
  EXPECT_EQ(c["rope_parameters"], json({{"rope_type", "default"}, {"rope_theta", 1e6}}));
  EXPECT_EQ(c["rms_norm_eps"].get<double>(), 1e-6);
  EXPECT_EQ(c["hidden_act"], "silu");
  EXPECT_EQ(c["attention_bias"], false);
  EXPECT_EQ(c["use_sliding_window"], false);
  EXPECT_EQ(c["dtype"], "float32");
  EXPECT_EQ(c["eos_token_id"], 4095);  // the fixture tokenizer's <|endoftext|>
  EXPECT_EQ(c["bos_token_id"], 4095);
  EXPECT_TRUE(c["pad_token_id"].is_null());
  EXPECT_EQ(read_bytes(exp / "tokenizer.json"), read_bytes(tokenizer));
  const json tc = read_json(exp / "tokenizer_config.json");
  EXPECT_EQ(tc["tokenizer_class"], "PreTrainedTokenizerFast");
  EXPECT_EQ(tc["eos_token"], "<|endoftext|>");
  EXPECT_EQ(tc["model_max_length"], 16);
  const json gc = read_json(exp / "generation_config.json");
  EXPECT_EQ(gc["eos_token_id"], 4095);
  EXPECT_FALSE(gc.contains("suppress_tokens"));  // the tokenizer covers the whole embedding

  // Import the export: the same weights, a run directory eval and sample accept.
  const fs::path imp = dir / "imp";
  r = run_mhar("import --hf " + q(exp) + " --out " + q(imp));
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_EQ(read_bytes(imp / "tokenizer.json"), read_bytes(tokenizer));
  const CheckpointInfo info = open_checkpoint(imp.string());
  EXPECT_EQ(info.step, 0);
  EXPECT_NO_THROW(check_same_model(open_checkpoint(ck).config, info.config, "import"));
  EXPECT_EQ(info.config.data.tokenizer, (imp / "tokenizer.json").string());
  const auto back = read_raw(fs::path(info.dir) / "model.safetensors", false);
  for (const auto& [name, t] : src) EXPECT_EQ(back.at(name).bytes, t.bytes) << name;

  // export(import(x)) == x: tensors and config.json alike.
  const fs::path exp2 = dir / "exp2";
  ASSERT_EQ(run_mhar("export --checkpoint " + q(imp) + " --out " + q(exp2)).code, 0);
  EXPECT_EQ(read_bytes(exp2 / "model.safetensors"), read_bytes(exp / "model.safetensors"));
  EXPECT_EQ(read_bytes(exp2 / "config.json"), read_bytes(exp / "config.json"));

  const std::string eval_args = " --data " + val() + " --device cpu --batch-size 4 --seq-len 16";
  const CmdResult e1 = run_mhar("eval --checkpoint " + q(ck) + eval_args);
  const CmdResult e2 = run_mhar("eval --checkpoint " + q(imp) + eval_args);
  ASSERT_EQ(e1.code, 0) << e1.output;
  ASSERT_EQ(e2.code, 0) << e2.output;
  EXPECT_EQ(json::parse(e1.stdout_text)["loss"].get<double>(),
            json::parse(e2.stdout_text)["loss"].get<double>());
  const CmdResult s = run_mhar("sample --checkpoint " + q(imp) + " --prompt 'the' --max-tokens 3 --temperature 0 --device cpu");
  EXPECT_EQ(s.code, 0) << s.output;
}

// `mhar eval --logits-out` (what tools/hf/check_export.py compares transformers with):
// the windows the loader read and logits whose cross-entropy is the loss eval reports.
TEST_F(HfExportTest, EvalWritesItsLogits) {
  const std::string ck = train_tiny("run", "mhar", true, 4);
  const fs::path file = dir / "logits.safetensors";
  const CmdResult r = run_mhar("eval --checkpoint " + q(ck) + " --data " + val() +
                               " --device cpu --batch-size 2 --seq-len 16 --batches 3 --logits-out " + q(file));
  ASSERT_EQ(r.code, 0) << r.output;
  const json out = json::parse(r.stdout_text);
  EXPECT_EQ(out["logits_file"], file.string());
  const auto t = read_raw(file, false);
  ASSERT_EQ(t.at("logits").shape, (std::vector<int64_t>{6, 16, 4096}));
  ASSERT_EQ(t.at("input_ids").shape, (std::vector<int64_t>{6, 16}));
  const std::vector<float> logits = as_f32(t.at("logits"));
  std::vector<int32_t> ids(96), targets(96);
  std::memcpy(ids.data(), t.at("input_ids").bytes.data(), 96 * 4);
  std::memcpy(targets.data(), t.at("targets").bytes.data(), 96 * 4);
  // Window k is tokens [16k, 16k + 17) of the validation shard.
  const std::vector<int32_t> stream = test::markov_tokens(2000, 3);
  for (int k = 0; k < 6; ++k)
    for (int i = 0; i < 16; ++i) {
      ASSERT_EQ(ids[k * 16 + i], stream[k * 16 + i]);
      ASSERT_EQ(targets[k * 16 + i], stream[k * 16 + i + 1]);
    }
  double sum = 0;
  for (int n = 0; n < 96; ++n) {
    const float* row = logits.data() + size_t(n) * 4096;
    double mx = row[0], z = 0;
    for (int v = 0; v < 4096; ++v) mx = std::max(mx, double(row[v]));
    for (int v = 0; v < 4096; ++v) z += std::exp(double(row[v]) - mx);
    sum += mx + std::log(z) - row[targets[n]];
  }
  // The engine's per-token losses are fp32 (a few ulps of ~8, about 1e-6 each); ten ulps.
  EXPECT_NEAR(sum / 96, out["loss"].get<double>(), 1e-5);
}

TEST_F(HfExportTest, ImportedRunsTrainByInitFromAndResume) {
  const std::string ck = train_tiny("run", "mhar", false, 4);
  const fs::path exp = dir / "exp";
  ASSERT_EQ(run_mhar("export --checkpoint " + q(ck) + " --out " + q(exp)).code, 0);
  const fs::path imp = dir / "imp";
  ASSERT_EQ(run_mhar("import --hf " + q(exp) + " --out " + q(imp)).code, 0);

  // --init-from: a new run whose first evaluation is that of the imported weights.
  const fs::path cfg_file = dir / "tiny.json";
  write_file(cfg_file, run_config("mhar", false, 4, 2).dump(2));
  CmdResult r = run_mhar("train " + q(cfg_file) + " --run-dir " + q(dir / "ft") + " --init-from " + q(imp));
  ASSERT_EQ(r.code, 0) << r.output;
  double first_eval = -1;
  {
    std::ifstream in(dir / "ft/metrics.jsonl");
    std::string line;
    while (std::getline(in, line)) {
      const json j = json::parse(line);
      if (j["kind"] == "eval" && j["step"] == 0) first_eval = j["val_loss"].get<double>();
    }
  }
  const CmdResult e = run_mhar("eval --checkpoint " + q(ck) + " --data " + val() +
                               " --device cpu --batch-size 4 --seq-len 16 --batches 2");
  ASSERT_EQ(e.code, 0) << e.output;
  EXPECT_EQ(first_eval, json::parse(e.stdout_text)["loss"].get<double>());
  EXPECT_TRUE(fs::exists(dir / "ft/checkpoints/step_00000002"));

  // A different model is refused, naming the field.
  json other = run_config("mhar", false, 4, 2);
  other["model"]["n_layers"] = 3;
  write_file(dir / "other.json", other.dump(2));
  r = run_mhar("train " + q(dir / "other.json") + " --run-dir " + q(dir / "ft_other") + " --init-from " + q(imp));
  EXPECT_EQ(r.code, 1) << r.output;
  EXPECT_NE(r.output.find("n_layers"), std::string::npos) << r.output;
  r = run_mhar("train --resume " + q(dir / "ft") + " --init-from " + q(imp));
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.output.find("--init-from"), std::string::npos) << r.output;

  // --resume: an import given data (and the run's shape) continues as a run.
  const fs::path imp2 = dir / "imp2";
  r = run_mhar("import --hf " + q(exp) + " --out " + q(imp2) + " --set data.train=" + q(dir / "data/train_*.bin") +
               " --set data.val=" + val() + " --set train.steps=2 --set train.micro_batch=4 --set train.seq_len=16" +
               " --set train.warmup_steps=1 --set train.eval_batches=2 --set train.device=cpu");
  ASSERT_EQ(r.code, 0) << r.output;
  r = run_mhar("train --resume " + q(imp2));
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_TRUE(fs::exists(imp2 / "checkpoints/step_00000002"));
  // Without data the import says what --resume needs.
  r = run_mhar("import --hf " + q(exp) + " --out " + q(dir / "imp3") + " --set data.train=" +
               q(dir / "data/train_*.bin"));
  EXPECT_EQ(r.code, 1);
  EXPECT_NE(r.output.find("data.val"), std::string::npos) << r.output;
}

TEST_F(HfExportTest, RoutedModelsCarryTheirModelingCode) {
  struct Run {
    const char* mode;
    bool tied;
    int heads;
  };
  for (const Run& run : {Run{"mhar", false, 4}, Run{"attnres", true, 1}}) {
    SCOPED_TRACE(run.mode);
    const std::string ck = train_tiny(std::string("run_") + run.mode, run.mode, run.tied, run.heads);
    const fs::path exp = dir / (std::string("exp_") + run.mode);
    ASSERT_EQ(run_mhar("export --checkpoint " + q(ck) + " --out " + q(exp)).code, 0);
    const json c = read_json(exp / "config.json");
    EXPECT_EQ(c["model_type"], "mhar");  // never "qwen3": that would load without the routing
    EXPECT_EQ(c["architectures"], json({"MharForCausalLM"}));
    EXPECT_EQ(c["auto_map"]["AutoConfig"], "configuration_mhar.MharConfig");
    EXPECT_EQ(c["auto_map"]["AutoModelForCausalLM"], "modeling_mhar.MharForCausalLM");
    EXPECT_EQ(c["residual_mode"], run.mode);
    EXPECT_EQ(c["routing_heads"], run.heads);
    EXPECT_EQ(c["tie_word_embeddings"], run.tied);
    // The exported code is the repository's, byte for byte.
    for (const char* f : {"configuration_mhar.py", "modeling_mhar.py"})
      EXPECT_EQ(read_bytes(exp / f), read_bytes(fs::path(MHAR_SOURCE_DIR) / "tools/hf" / f)) << f;
    const auto out = read_raw(exp / "model.safetensors");
    for (int j = 0; j < 5; ++j) {
      EXPECT_EQ(out.at("model.routing." + std::to_string(j) + ".query").shape, std::vector<int64_t>{16});
      EXPECT_EQ(out.at("model.routing." + std::to_string(j) + ".gain").shape, std::vector<int64_t>{16});
    }
    EXPECT_EQ(out.count("lm_head.weight"), run.tied ? 0u : 1u);
    const fs::path imp = dir / (std::string("imp_") + run.mode);
    const CmdResult r = run_mhar("import --hf " + q(exp) + " --out " + q(imp));
    ASSERT_EQ(r.code, 0) << r.output;
    const CheckpointInfo info = open_checkpoint(imp.string());
    EXPECT_EQ(info.config.residual.mode, open_checkpoint(ck).config.residual.mode);
    EXPECT_EQ(info.config.residual.heads, run.heads);
    EXPECT_EQ(read_bytes(fs::path(info.dir) / "model.safetensors").size(),
              read_bytes(fs::path(ck) / "model.safetensors").size());
    const auto a = read_raw(fs::path(ck) / "model.safetensors", false);
    const auto b = read_raw(fs::path(info.dir) / "model.safetensors", false);
    for (const auto& [name, t] : a) EXPECT_EQ(b.at(name).bytes, t.bytes) << name;
  }
}

// Block routing, Hyper-Connections (static and dynamic) and delta: trained, exported
// with their scheme's config fields, tensors and modeling code, and imported back bit for
// bit (a run whose eval equals the original's exactly).
TEST_F(HfExportTest, EveryResidualSchemeExportsAndImportsBitForBit) {
  struct Run {
    const char* name;
    const char* mode;
    bool tied;
    int heads;
    json residual;
    const char* prefix;  // the scheme's tensors
  };
  const std::vector<Run> runs = {
      {"block_mhar", "mhar", false, 2, {{"block_size", 3}}, "model.routing."},
      {"hyper", "hyper", true, 0, {{"hyper_n", 3}}, "model.hyper."},
      {"hyper_dynamic", "hyper", false, 0, {{"hyper_n", 2}, {"hyper_dynamic", true}}, "model.hyper."},
      {"delta", "delta", true, 2, {{"block_layers", 1}}, "model.delta."},
  };
  for (const Run& run : runs) {
    SCOPED_TRACE(run.name);
    const std::string ck = train_tiny(std::string("run_") + run.name, run.mode, run.tied, run.heads, run.residual);
    const fs::path exp = dir / (std::string("exp_") + run.name);
    const CmdResult ex = run_mhar("export --checkpoint " + q(ck) + " --out " + q(exp));
    ASSERT_EQ(ex.code, 0) << ex.output;
    EXPECT_NE(ex.output.find("trust_remote_code"), std::string::npos) << ex.output;
    const json c = read_json(exp / "config.json");
    EXPECT_EQ(c["model_type"], "mhar");
    EXPECT_EQ(c["architectures"], json({"MharForCausalLM"}));
    EXPECT_EQ(c["residual_mode"], run.mode);
    for (auto it = run.residual.begin(); it != run.residual.end(); ++it) EXPECT_EQ(c[it.key()], it.value()) << it.key();
    if (std::string(run.mode) != "hyper") {
      EXPECT_EQ(c["routing_heads"], run.heads);
    }
    for (const char* f : {"configuration_mhar.py", "modeling_mhar.py"})
      EXPECT_EQ(read_bytes(exp / f), read_bytes(fs::path(MHAR_SOURCE_DIR) / "tools/hf" / f)) << f;

    // The export's tensors are the checkpoint's, byte for byte, and include the scheme's,
    // some of which training moved from their init.
    const auto src = read_raw(fs::path(ck) / "model.safetensors", false);
    const auto out = read_raw(exp / "model.safetensors");
    ASSERT_EQ(src.size(), out.size());
    const Config cfg = open_checkpoint(ck).config;
    auto be = make_cpu_backend(DType::F32);
    Model fresh(cfg.model, cfg.residual, *be, 1, 1);
    fresh.init_weights(cfg.train.seed);
    int scheme = 0, moved = 0;
    for (const auto& [name, t] : src) {
      ASSERT_TRUE(out.count(name)) << name;
      EXPECT_EQ(out.at(name).shape, t.shape) << name;
      EXPECT_EQ(out.at(name).bytes, t.bytes) << name;
      if (name.rfind(run.prefix, 0) != 0) continue;
      ++scheme;
      const std::vector<double> init = test::download(*be, fresh.parameter(name).value);
      const std::vector<float> now = as_f32(out.at(name));
      for (size_t i = 0; i < now.size(); ++i)
        if (double(now[i]) != init[i]) {
          ++moved;
          break;
        }
    }
    EXPECT_GT(scheme, 0);
    EXPECT_GT(moved, scheme / 2) << moved << " of " << scheme << " scheme tensors left their init";

    // Import: the same residual config, the same weights bit for bit, the same eval loss.
    const fs::path imp = dir / (std::string("imp_") + run.name);
    const CmdResult im = run_mhar("import --hf " + q(exp) + " --out " + q(imp));
    ASSERT_EQ(im.code, 0) << im.output;
    const CheckpointInfo info = open_checkpoint(imp.string());
    EXPECT_EQ(info.config.residual.mode, cfg.residual.mode);
    EXPECT_EQ(info.config.residual.heads, cfg.residual.heads);
    EXPECT_EQ(info.config.residual.block_size, cfg.residual.block_size);
    EXPECT_EQ(info.config.residual.hyper_n, cfg.residual.hyper_n);
    EXPECT_EQ(info.config.residual.hyper_dynamic, cfg.residual.hyper_dynamic);
    EXPECT_EQ(info.config.residual.block_layers, cfg.residual.block_layers);
    const auto back = read_raw(fs::path(info.dir) / "model.safetensors", false);
    ASSERT_EQ(back.size(), src.size());
    for (const auto& [name, t] : src) EXPECT_EQ(back.at(name).bytes, t.bytes) << name;
    const std::string eval_args = " --data " + val() + " --device cpu --batch-size 4 --seq-len 16 --batches 2";
    const CmdResult e0 = run_mhar("eval --checkpoint " + q(ck) + eval_args);
    const CmdResult e1 = run_mhar("eval --checkpoint " + q(imp) + eval_args);
    ASSERT_EQ(e0.code, 0) << e0.output;
    ASSERT_EQ(e1.code, 0) << e1.output;
    EXPECT_EQ(json::parse(e0.stdout_text)["loss"].get<double>(),
              json::parse(e1.stdout_text)["loss"].get<double>());
  }
}

TEST_F(HfExportTest, LargeModelsAreSharded) {
  const std::string ck = train_tiny("run", "mhar", false, 4);
  const fs::path exp = dir / "exp";
  const CmdResult r = run_mhar("export --checkpoint " + q(ck) + " --out " + q(exp) + " --max-shard-size 20KB");
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_FALSE(fs::exists(exp / "model.safetensors"));
  const json index = read_json(exp / "model.safetensors.index.json");
  const auto src = read_raw(fs::path(ck) / "model.safetensors", false);
  std::set<std::string> files;
  uint64_t total = 0;
  for (const auto& [name, t] : src) {
    ASSERT_TRUE(index["weight_map"].contains(name)) << name;
    files.insert(index["weight_map"][name].get<std::string>());
    total += t.bytes.size();
  }
  EXPECT_EQ(index["weight_map"].size(), src.size());
  EXPECT_EQ(index["metadata"]["total_size"].get<uint64_t>(), total);
  EXPECT_GT(files.size(), 2u);
  size_t k = 0;
  for (const auto& f : files) {
    char want[64];
    std::snprintf(want, sizeof want, "model-%05zu-of-%05zu.safetensors", ++k, files.size());
    EXPECT_EQ(f, want);
    const auto shard = read_raw(exp / f);
    uint64_t bytes = 0;
    for (const auto& [name, t] : shard) bytes += t.bytes.size();
    if (shard.size() > 1) {
      EXPECT_LE(bytes, 20000u) << f;  // a larger tensor sits alone
    }
  }
  const auto out = read_dir(exp);
  for (const auto& [name, t] : src) EXPECT_EQ(out.at(name).bytes, t.bytes) << name;
  // The sharded export imports back to the same weights.
  ASSERT_EQ(run_mhar("import --hf " + q(exp) + " --out " + q(dir / "imp")).code, 0);
  const auto back = read_raw(fs::path(open_checkpoint((dir / "imp").string()).dir) / "model.safetensors", false);
  for (const auto& [name, t] : src) EXPECT_EQ(back.at(name).bytes, t.bytes) << name;
}

TEST_F(HfExportTest, Bf16ExportRoundsToNearestEven) {
  const std::string ck = train_tiny("run", "standard", false);
  const fs::path exp = dir / "exp";
  ASSERT_EQ(run_mhar("export --checkpoint " + q(ck) + " --out " + q(exp) + " --dtype bf16").code, 0);
  EXPECT_EQ(read_json(exp / "config.json")["dtype"], "bfloat16");
  const auto src = read_raw(fs::path(ck) / "model.safetensors", false);
  const auto out = read_raw(exp / "model.safetensors");
  size_t values = 0;
  for (const auto& [name, t] : src) {
    const RawTensor& b = out.at(name);
    ASSERT_EQ(b.dtype, "BF16") << name;
    const std::vector<float> f = as_f32(t);
    ASSERT_EQ(b.bytes.size(), 2 * f.size());
    for (size_t i = 0; i < f.size(); ++i) {
      uint16_t got;
      std::memcpy(&got, b.bytes.data() + 2 * i, 2);
      ASSERT_EQ(got, reference_bf16(f[i])) << name << "[" << i << "] = " << f[i];
    }
    values += f.size();
  }
  EXPECT_GT(values, 100000u);
  // A bf16 export imports to those bf16 values, widened exactly.
  ASSERT_EQ(run_mhar("import --hf " + q(exp) + " --out " + q(dir / "imp")).code, 0);
  const auto back = read_raw(fs::path(open_checkpoint((dir / "imp").string()).dir) / "model.safetensors", false);
  for (const auto& [name, b] : out) {
    const std::vector<float> w = as_f32(back.at(name));
    for (size_t i = 0; i < w.size(); ++i) {
      uint16_t h;
      std::memcpy(&h, b.bytes.data() + 2 * i, 2);
      const uint32_t bits = uint32_t(h) << 16;
      float want;
      std::memcpy(&want, &bits, 4);
      ASSERT_EQ(w[i], want) << name;
    }
  }
}

// Writes a Hugging Face directory by hand: config.json and one safetensors file.
void write_hf_dir(const fs::path& d, const json& config, const std::vector<TensorToWrite>& tensors,
                  const std::string& tokenizer) {
  fs::create_directories(d);
  write_file(d / "config.json", config.dump(2));
  std::string bytes;
  write_safetensors_to([&](const void* p, size_t n) { bytes.append(static_cast<const char*>(p), n); }, tensors,
                       {{"format", "pt"}});
  write_file(d / "model.safetensors", bytes);
  if (!tokenizer.empty()) write_file(d / "tokenizer.json", read_bytes(tokenizer));
}

TEST_F(HfExportTest, F16WeightsImportExactly) {
  json config = qwen3_config();
  config["tie_word_embeddings"] = false;
  json engine = engine_model_from_hf_config(config, "config.json");
  engine["train"] = {{"seq_len", 16}};
  const Config cfg = config_from_json(engine, "test");
  std::mt19937_64 rng(77);
  std::vector<std::vector<uint16_t>> halves;
  std::vector<TensorToWrite> tensors;
  const auto layout = hf_tensor_layout(cfg.model, cfg.residual);
  for (const auto& s : layout) {
    int64_t n = 1;
    for (int64_t d : s.shape) n *= d;
    std::vector<uint16_t> h(static_cast<size_t>(n));
    for (auto& x : h) {  // random sign and mantissa, exponents from subnormal to 2^5
      const uint16_t exp = uint16_t(rng() % 21);
      x = uint16_t(((rng() & 1) << 15) | (exp << 10) | (rng() & 0x3ff));
    }
    if (s.name == "model.norm.weight") h[0] = 0x0001, h[1] = 0x8000;  // smallest subnormal, -0
    halves.push_back(std::move(h));
  }
  for (size_t i = 0; i < layout.size(); ++i)
    tensors.push_back({layout[i].name, "F16", layout[i].shape, halves[i].data()});
  const fs::path hf = dir / "hf16";
  write_hf_dir(hf, config, tensors, tokenizer.string());
  const CmdResult r = run_mhar("import --hf " + q(hf) + " --out " + q(dir / "imp"));
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_NE(r.output.find("F16"), std::string::npos) << r.output;
  const auto back = read_raw(fs::path(open_checkpoint((dir / "imp").string()).dir) / "model.safetensors", false);
  for (size_t i = 0; i < layout.size(); ++i) {
    const std::vector<float> w = as_f32(back.at(layout[i].name));
    ASSERT_EQ(w.size(), halves[i].size());
    for (size_t k = 0; k < w.size(); ++k) {
      ASSERT_EQ(double(w[k]), reference_f16(halves[i][k])) << layout[i].name << "[" << k << "]";
      ASSERT_EQ(std::signbit(w[k]), bool(halves[i][k] & 0x8000)) << layout[i].name << "[" << k << "]";
    }
  }
}

TEST_F(HfExportTest, BadImportInputIsRefusedCleanly) {
  const std::string ck = train_tiny("run", "standard", true);
  const fs::path good = dir / "good", sharded = dir / "sharded";
  ASSERT_EQ(run_mhar("export --checkpoint " + q(ck) + " --out " + q(good)).code, 0);
  ASSERT_EQ(run_mhar("export --checkpoint " + q(ck) + " --out " + q(sharded) + " --max-shard-size 20KB").code, 0);
  const fs::path out = dir / "outs" / "imported";
  int n = 0;
  // Copies `from` to a fresh directory, applies `edit`, imports it, expects a refusal.
  auto check = [&](const fs::path& from, const std::function<void(const fs::path&)>& edit,
                   const std::vector<std::string>& needles, const std::string& extra = "") {
    const fs::path d = dir / ("case" + std::to_string(++n));
    fs::copy(from, d, fs::copy_options::recursive);
    edit(d);
    SCOPED_TRACE("case " + std::to_string(n));
    expect_refused("import --hf " + q(d) + " --out " + q(out) + extra, needles, out);
  };
  auto edit_config = [](const std::function<void(json&)>& f) {
    return [f](const fs::path& d) {
      json j = read_json(d / "config.json");
      f(j);
      write_file(d / "config.json", j.dump(2));
    };
  };
  // Rewrites model.safetensors with its tensors changed by `f`.
  auto edit_tensors = [](const std::function<void(std::map<std::string, RawTensor>&)>& f) {
    return [f](const fs::path& d) {
      auto t = read_raw(d / "model.safetensors");
      f(t);
      std::vector<TensorToWrite> w;
      for (const auto& [name, v] : t) w.push_back({name, v.dtype, v.shape, v.bytes.data()});
      std::string bytes;
      write_safetensors_to([&](const void* p, size_t k) { bytes.append(static_cast<const char*>(p), k); }, w,
                           {{"format", "pt"}});
      write_file(d / "model.safetensors", bytes);
    };
  };

  check(good, [](const fs::path& d) { fs::remove(d / "config.json"); }, {"config.json", "missing"});
  check(good, [](const fs::path& d) { write_file(d / "config.json", "{\"model_type\": \"qwen3\","); },
        {"config.json", "not valid JSON"});
  check(good, edit_config([](json& j) { j.erase("hidden_size"); }), {"config.json", "hidden_size"});
  check(good, edit_config([](json& j) { j["use_sliding_window"] = true; }), {"config.json", "use_sliding_window"});
  check(good, edit_config([](json& j) { j["rope_scaling"] = {{"rope_type", "yarn"}, {"factor", 4.0}}; }),
        {"rope_scaling"});
  check(good, edit_config([](json& j) { j["attention_bias"] = true; }), {"attention_bias"});
  check(good, edit_config([](json& j) { j["model_type"] = "qwen3_moe"; }), {"model_type", "mixture-of-experts"});
  check(good, [](const fs::path& d) { fs::remove(d / "model.safetensors"); },
        {"no model.safetensors or model.safetensors.index.json"});
  check(good, [](const fs::path& d) { fs::remove(d / "tokenizer.json"); }, {"tokenizer.json", "data.tokenizer"});
  check(good, edit_tensors([](auto& t) { t.erase("model.layers.1.mlp.up_proj.weight"); }),
        {"model.layers.1.mlp.up_proj.weight", "missing"});
  check(good, edit_tensors([](auto& t) {
          RawTensor bias{"F32", {16}, std::string(64, '\0')};
          t["model.layers.0.self_attn.q_proj.bias"] = bias;
        }),
        {"model.safetensors", "model.layers.0.self_attn.q_proj.bias", "biases are not supported"});
  check(good, edit_tensors([](auto& t) {
          t["model.norm.weight"].shape = {8};
          t["model.norm.weight"].bytes.resize(32);
        }),
        {"model.safetensors", "model.norm.weight", "[8]", "[16]"});
  check(good, edit_tensors([](auto& t) { t["model.norm.weight"].dtype = "I32"; }),
        {"model.norm.weight", "I32", "F32, BF16, F16"});
  check(good, edit_tensors([](auto& t) {
          const float nan = NAN;
          std::memcpy(&t["model.layers.0.input_layernorm.weight"].bytes[4], &nan, 4);
        }),
        {"model.layers.0.input_layernorm.weight", "non-finite", "element 1"});
  check(good, edit_tensors([](auto& t) { t["lm_head.weight"] = t["model.embed_tokens.weight"]; t["lm_head.weight"].bytes[0] ^= 1; }),
        {"lm_head.weight differs", "tie_word_embeddings"});
  check(good, [](const fs::path& d) { fs::resize_file(d / "model.safetensors", fs::file_size(d / "model.safetensors") - 100); },
        {"model.safetensors"});
  // Sharded: a damaged index.
  check(sharded, [](const fs::path& d) { write_file(d / "model.safetensors.index.json", "[1,"); },
        {"model.safetensors.index.json", "not valid JSON"});
  check(sharded, [](const fs::path& d) { write_file(d / "model.safetensors.index.json", "{\"metadata\": {}}"); },
        {"model.safetensors.index.json", "weight_map"});
  check(sharded, [](const fs::path& d) {
          json j = read_json(d / "model.safetensors.index.json");
          j["weight_map"]["model.norm.weight"] = "../../etc/passwd";
          write_file(d / "model.safetensors.index.json", j.dump());
        },
        {"model.safetensors.index.json", "model.norm.weight", "not a file name"});
  check(sharded, [](const fs::path& d) {
          json j = read_json(d / "model.safetensors.index.json");
          j["weight_map"]["model.norm.weight"] = "model-00009-of-00009.safetensors";
          write_file(d / "model.safetensors.index.json", j.dump());
        },
        {"model-00009-of-00009.safetensors"});
  check(sharded, [](const fs::path& d) {
          json j = read_json(d / "model.safetensors.index.json");
          j["weight_map"]["model.layers.7.mlp.up_proj.weight"] = "model-00001-of-" +
              j["weight_map"]["model.norm.weight"].get<std::string>().substr(15);
          write_file(d / "model.safetensors.index.json", j.dump());
        },
        {"model.layers.7.mlp.up_proj.weight"});
  check(sharded, [](const fs::path& d) {
          json j = read_json(d / "model.safetensors.index.json");
          const std::string first = j["weight_map"]["model.embed_tokens.weight"];
          const std::string other = j["weight_map"]["model.norm.weight"];
          ASSERT_NE(first, other);
          j["weight_map"]["model.norm.weight"] = first;  // mapped to a file that does not hold it
          write_file(d / "model.safetensors.index.json", j.dump());
        },
        {"model.norm.weight"});
  // Options.
  check(good, [](const fs::path&) {}, {"data.val"}, " --set data.train=x");
  check(good, [](const fs::path&) {}, {"model.layers.2"}, " --set model.n_layers=3");
  fs::create_directories(out);
  write_file(out / "keep.txt", "old");
  const CmdResult r = run_mhar("import --hf " + q(good) + " --out " + q(out));
  EXPECT_EQ(r.code, 1);
  EXPECT_NE(r.output.find("already exists"), std::string::npos) << r.output;
  EXPECT_EQ(read_bytes(out / "keep.txt"), "old");
  const CmdResult self = run_mhar("import --hf " + q(good) + " --out " + q(good) + " --overwrite");
  EXPECT_EQ(self.code, 1);
  EXPECT_NE(self.output.find("holds the model being imported"), std::string::npos) << self.output;
  EXPECT_TRUE(fs::exists(good / "model.safetensors"));
  const CmdResult over = run_mhar("import --hf " + q(good) + " --out " + q(out) + " --overwrite");
  EXPECT_EQ(over.code, 0) << over.output;
  EXPECT_FALSE(fs::exists(out / "keep.txt"));
  EXPECT_TRUE(staging_leftovers(out.parent_path()).empty());
}

TEST_F(HfExportTest, BadExportInputIsRefusedCleanly) {
  const std::string ck = train_tiny("run", "standard", true);
  const fs::path out = dir / "outs" / "exp";
  expect_refused("export --checkpoint " + q(dir / "nope") + " --out " + q(out), {"nope"}, out);
  expect_refused("export --checkpoint " + q(ck) + " --out " + q(out) + " --max-shard-size 0", {"--max-shard-size"}, out);
  expect_refused("export --checkpoint " + q(ck) + " --out " + q(out) + " --tokenizer " + q(dir / "none.json"),
                 {"none.json", "--tokenizer"}, out);
  const CmdResult dt = run_mhar("export --checkpoint " + q(ck) + " --out " + q(out) + " --dtype fp16");
  EXPECT_NE(dt.code, 0);
  EXPECT_NE(dt.output.find("--dtype"), std::string::npos) << dt.output;
  EXPECT_FALSE(fs::exists(out));
  // A run directory must not be replaced by its own export.
  const CmdResult self = run_mhar("export --checkpoint " + q(ck) + " --out " + q(dir / "run") + " --overwrite");
  EXPECT_EQ(self.code, 1);
  EXPECT_NE(self.output.find("holds the checkpoint being exported"), std::string::npos) << self.output;
  EXPECT_TRUE(fs::exists(ck));
  // An existing --out is kept unless --overwrite, which replaces it whole.
  fs::create_directories(out);
  write_file(out / "keep.txt", "old");
  const CmdResult exists = run_mhar("export --checkpoint " + q(ck) + " --out " + q(out));
  EXPECT_EQ(exists.code, 1);
  EXPECT_NE(exists.output.find("already exists"), std::string::npos) << exists.output;
  EXPECT_EQ(read_bytes(out / "keep.txt"), "old");
  ASSERT_EQ(run_mhar("export --checkpoint " + q(ck) + " --out " + q(out) + " --overwrite").code, 0);
  EXPECT_FALSE(fs::exists(out / "keep.txt"));
  EXPECT_TRUE(fs::exists(out / "model.safetensors"));
  EXPECT_TRUE(staging_leftovers(out.parent_path()).empty());
}

TEST_F(HfExportTest, FullDiskLeavesNothingAtOut) {
  const std::string ck = train_tiny("run", "mhar", true, 4);
  const fs::path exp = dir / "exp";
  ASSERT_EQ(run_mhar("export --checkpoint " + q(ck) + " --out " + q(exp)).code, 0);
  const uint64_t size = fs::file_size(exp / "model.safetensors");
  for (uint64_t limit : {uint64_t(0), uint64_t(1000), size / 2, size + 10}) {
    const std::string env = "MHAR_SIMULATE_DISK_FULL_AFTER_BYTES=" + std::to_string(limit);
    SCOPED_TRACE(env);
    const fs::path out = dir / "full" / "exp";
    expect_refused("export --checkpoint " + q(ck) + " --out " + q(out), {"No space left on device"}, out, env);
    const fs::path imp = dir / "full" / "imp";
    expect_refused("import --hf " + q(exp) + " --out " + q(imp), {"No space left on device"}, imp, env);
  }
}

}  // namespace
