// checkpoint_test_util.h: a real tiny checkpoint and the tools to damage it the way a
// buggy writer or another tool would, for the checkpoint validation and fuzz tests.
// Damage is followed by `reseal`, which recomputes every checksum state.json records
// (each listed file's bytes and fnv1a64, then state.json's own state_fnv1a64), so that
// what a test exercises is the structural check under test, not the checksums. The
// checksum and safetensors parsing here are written independently of the engine's.
#pragma once
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

#include <nlohmann/json.hpp>

#include "data/shard.h"
#include "engine/checkpoint.h"
#include "engine/trainer.h"
#include "tests/model_test_util.h"

namespace mhar::test {

namespace fs = std::filesystem;
using nlohmann::json;

inline std::string slurp(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

// Replaces `p` (removing it first, so that a hard link's other name keeps the old bytes).
inline void spit(const fs::path& p, const std::string& bytes) {
  fs::remove(p);
  std::ofstream out(p, std::ios::binary);
  out.write(bytes.data(), std::streamsize(bytes.size()));
}

inline uint64_t test_fnv1a64(const std::string& s) {
  uint64_t h = 1469598103934665603ULL;
  for (unsigned char c : s) h = (h ^ c) * 1099511628211ULL;
  return h;
}

inline std::string test_hex64(uint64_t v) {
  char buf[17];
  std::snprintf(buf, sizeof buf, "%016llx", static_cast<unsigned long long>(v));
  return buf;
}

inline json read_state(const fs::path& ckpt) { return json::parse(slurp(ckpt / "state.json")); }

// Recomputes, in `st`, the size and checksum of every file it lists that is a regular file.
inline void reseal_files(const fs::path& ckpt, json& st) {
  if (!st.contains("files") || !st["files"].is_object()) return;
  for (auto it = st["files"].begin(); it != st["files"].end(); ++it) {
    const fs::path f = ckpt / it.key();
    std::error_code ec;
    if (!it.value().is_object() || !fs::is_regular_file(f, ec)) continue;
    const std::string bytes = slurp(f);
    it.value()["bytes"] = bytes.size();
    it.value()["fnv1a64"] = test_hex64(test_fnv1a64(bytes));
  }
}

// Writes `st` as ckpt/state.json with state.json's own checksum recomputed.
inline void seal_state(const fs::path& ckpt, json st) {
  st.erase("state_fnv1a64");
  const std::string canonical = st.dump();
  st["state_fnv1a64"] = test_hex64(test_fnv1a64(canonical));
  spit(ckpt / "state.json", st.dump(2) + "\n");
}

// Both: every checksum state.json records made to match again.
inline void reseal(const fs::path& ckpt, json st) {
  reseal_files(ckpt, st);
  seal_state(ckpt, std::move(st));
}
inline void reseal(const fs::path& ckpt) { reseal(ckpt, read_state(ckpt)); }

// A safetensors file taken apart: the parsed header and the data section.
struct StParts {
  json header;
  std::string data;
};

inline StParts split_safetensors(const std::string& file) {
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | uint8_t(file[size_t(i)]);
  return {json::parse(file.substr(8, size_t(n))), file.substr(size_t(8 + n))};
}

// Header text + data as a safetensors file (header padded with spaces to 8 bytes, as the
// format's writers do).
inline std::string join_safetensors(std::string header_text, const std::string& data) {
  header_text.append((8 - header_text.size() % 8) % 8, ' ');
  std::string out(8, '\0');
  uint64_t n = header_text.size();
  for (int i = 0; i < 8; ++i) out[size_t(i)] = char((n >> (8 * i)) & 0xff);
  return out + header_text + data;
}
inline std::string join_safetensors(const json& header, const std::string& data) {
  return join_safetensors(header.dump(), data);
}

// Hard-links every file of checkpoint `from` into a new directory `to` (cheap; `spit`
// replaces a file without touching the original).
inline void link_checkpoint(const fs::path& from, const fs::path& to) {
  fs::remove_all(to);
  fs::create_directories(to);
  for (const auto& e : fs::directory_iterator(from)) fs::create_hard_link(e.path(), to / e.path().filename());
}

// A real checkpoint of a tiny model: 2 steps of a 4-step run (so it can be resumed),
// vocabulary 4096 so that the 4096-token test tokenizer can sample from it; non-square
// matrices (k_proj [4, 8], MLP [12, 8]) so that a reversed shape differs.
struct TinyRun {
  fs::path root, run_dir, ckpt;
  std::string val_glob, tokenizer;
  Config cfg;
};

inline TinyRun make_tiny_run(const fs::path& root) {
  TinyRun r;
  r.root = root;
  fs::remove_all(root);
  fs::create_directories(root / "data");
  data::write_shard((root / "data/train_000.bin").string(), markov_tokens(3000, 1), 2);
  data::write_shard((root / "data/val_000.bin").string(), markov_tokens(800, 3), 2);
  r.val_glob = (root / "data/val_*.bin").string();
  r.tokenizer = std::string(MHAR_SOURCE_DIR) + "/tests/fixtures/tokenizer/trained_4096.json";
  json j = {
      {"model", {{"vocab_size", 4096}, {"d_model", 8}, {"n_layers", 1}, {"n_heads", 2},
                 {"n_kv_heads", 1}, {"head_dim", 4}, {"d_ff", 12}, {"context_length", 16}}},
      {"residual", {{"mode", "mhar"}}},
      {"train", {{"micro_batch", 2}, {"seq_len", 16}, {"steps", 4}, {"lr", 1e-2}, {"warmup_steps", 1},
                 {"eval_every", 2}, {"eval_batches", 2}, {"device", "cpu"}, {"seed", 5}}},
      {"data", {{"train", (root / "data/train_*.bin").string()}, {"val", r.val_glob},
                {"tokenizer", r.tokenizer}}},
      {"checkpoint", {{"every", 2}, {"keep", 0}}}};
  r.cfg = config_from_json(j, "tiny_run");
  TrainOptions o;
  o.run_dir = (root / "run").string();
  o.quiet = true;
  o.stop_after_steps = 2;
  TrainResult res = train(r.cfg, o);
  r.run_dir = o.run_dir;
  r.ckpt = res.last_checkpoint;
  return r;
}

// Runs the mhar binary; returns the exit status (-1 if killed) and the seconds it took;
// stdout and stderr are left in `out` and `err`. A run longer than 20 s is killed, so a
// hang fails the test instead of stalling it.
struct CliRun {
  int rc = -1;
  double seconds = 0;
  std::string out, err;
};

inline CliRun run_mhar(const fs::path& scratch, const std::string& args) {
  const fs::path out = scratch / "cli.out", err = scratch / "cli.err";
  const std::string cmd = "timeout -s KILL 20 " + std::string(MHAR_BINARY) + " --log-level error " + args +
                          " >" + out.string() + " 2>" + err.string() + " </dev/null";
  const auto t0 = std::chrono::steady_clock::now();
  const int status = std::system(cmd.c_str());
  CliRun r;
  r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  r.rc = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  r.out = slurp(out);
  r.err = slurp(err);
  return r;
}

}  // namespace mhar::test
