// checkpoint.h: checkpoints on disk (DESIGN.md section 6).
//
// Layout: RUN_DIR/checkpoints/step_00001000/
//   model.safetensors            fp32 master weights, Hugging Face Qwen3 names
//   optimizer.rank<R>.safetensors  AdamW moments of rank R's shard ("<name>.exp_avg",
//                                ".exp_avg_sq"), fp32 (engine/checkpoint_shards.h)
//   state.json                   {"format", "step", "world_size", "config", "loader",
//                                 "trainer", "files": {name: {"bytes", "fnv1a64"}},
//                                 "state_fnv1a64": its own checksum}
// A checkpoint is written into a hidden temporary directory and renamed into place only
// when every file is complete and flushed, so a crash (or a full disk) never leaves a
// directory that looks whole. Under data parallelism every rank writes its optimizer
// shard into that directory; rank 0 gathers the fp32 weights, writes model.safetensors,
// and writes state.json and renames the directory only once every rank has reported its
// file. Opening validates state.json field by field and against its own checksum, and
// every file's size and checksum (engine/checkpoint_state.h); loading the weights
// enforces the safetensors layout rule (engine/safetensors.h), the model's dtype and
// exact shapes, no extra tensors, and finite values.
#pragma once
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "engine/communicator.h"
#include "engine/config.h"
#include "engine/model.h"

namespace mhar {

class AdamWOptimizer;

// The trainer's counters from state.json, validated.
struct CheckpointTrainerState {
  int64_t tokens_seen = 0;
  int64_t total_bad_steps = 0;
  int64_t consecutive_bad_steps = 0;  // the streak of skipped steps the run stopped in
  double elapsed_s = 0;
};

struct CheckpointInfo {
  std::string dir;
  int64_t step = 0;
  Config config;
  nlohmann::json loader;           // the data position (DataLoader::restore), validated
  CheckpointTrainerState trainer;  // validated
  int world_size = 1;              // ranks that wrote it (one optimizer file each)
  nlohmann::json state;            // the whole state.json (use the typed fields above)
};

// Checkpoint directories under RUN_DIR/checkpoints, oldest first (not validated).
std::vector<std::string> list_checkpoints(const std::string& run_dir);

// Opens and fully validates a checkpoint. `path` is a checkpoint directory, or a run
// directory (then its newest checkpoint; with `newest_valid`, the newest one that
// validates, logging why newer ones were refused). Throws mhar::Error naming the
// directory, the file and the problem.
CheckpointInfo open_checkpoint(const std::string& path, bool newest_valid = false);

// Loads the fp32 master weights into `model`: the file must hold exactly the model's
// tensors, each F32 with the model's exact shape and every value finite, else the error
// names the first extra, missing or mismatched tensor (and the first non-finite index).
// With `opt`, its fp32 master copy (bf16 models; this rank's shard) gets the same weights
// from the one read, so a resume continues from the exact fp32 values.
void load_model_weights(const CheckpointInfo& ckpt, Model& model, AdamWOptimizer* opt = nullptr);
// Number of ranks that wrote the checkpoint (state.json "world_size"; 1 when absent).
int checkpoint_world_size(const CheckpointInfo& ckpt);
// Loads the AdamW moments of `opt`'s shard, re-sharding when the checkpoint was written
// by another number of ranks: each file it reads must be listed (so checksummed) in
// state.json and hold only "<name>.exp_avg" and "<name>.exp_avg_sq" of this model's
// parameters, F32, 1-D of the range its metadata names, finite, exp_avg_sq >= 0; every
// element of the shard must come from exactly one file.
void load_optimizer_moments(const CheckpointInfo& ckpt, Model& model, AdamWOptimizer& opt);
// Throws if the model sections differ, naming the first differing field.
void check_same_model(const Config& ours, const Config& theirs, const std::string& theirs_where);

struct CheckpointWrite {
  std::string run_dir;
  int64_t step = 0;
  const Config* config = nullptr;
  nlohmann::json loader;   // data position
  nlohmann::json trainer;  // counters the trainer needs to resume (tokens, bad steps, ...)
  int keep = 0;            // keep the newest K checkpoints (0 = all)
  Communicator* comm = nullptr;  // the ranks that write it together (null: this process)
};
// Writes atomically (see above) and prunes old checkpoints. Returns the directory (on
// every rank). Collective: every rank calls it.
std::string save_checkpoint(const CheckpointWrite& w, Model& model, AdamWOptimizer& opt);

// Called at the start of a run, under the run lock (engine/run_lock.h), so that no live
// writer can own what it finds: cleans up after checkpoint writers that were killed.
// Every RUN_DIR/checkpoints/.tmp-step_N-PID (a partial checkpoint) is removed; an
// .old-step_N-PID (a whole checkpoint set aside while step N was re-saved) is removed
// when step_N exists, else renamed back to step_N, being its only copy. Logs each action.
void recover_checkpoint_writes(const std::string& run_dir);

}  // namespace mhar
