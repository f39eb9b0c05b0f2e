// checkpoint.h: checkpoints on disk (DESIGN.md section 6).
//
// Layout: RUN_DIR/checkpoints/step_00001000/
//   model.safetensors            fp32 master weights, Hugging Face Qwen3 names
//   optimizer.rank<R>.safetensors  AdamW moments of rank R ("<name>.exp_avg",
//                                ".exp_avg_sq"), fp32
//   state.json                   {"format", "step", "config", "loader", "trainer",
//                                 "files": {name: {"bytes", "fnv1a64"}}}
// A checkpoint is written into a hidden temporary directory and renamed into place only
// when every file is complete and flushed, so a crash (or a full disk) never leaves a
// directory that looks whole. Opening verifies every file's size and checksum.
#pragma once
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "engine/config.h"
#include "engine/model.h"

namespace mhar {

class AdamWOptimizer;

struct CheckpointInfo {
  std::string dir;
  int64_t step = 0;
  Config config;
  nlohmann::json state;  // the whole state.json
};

// Checkpoint directories under RUN_DIR/checkpoints, oldest first (not validated).
std::vector<std::string> list_checkpoints(const std::string& run_dir);

// Opens and fully validates a checkpoint. `path` is a checkpoint directory, or a run
// directory (then its newest checkpoint; with `newest_valid`, the newest one that
// validates, logging why newer ones were refused). Throws mhar::Error naming the
// directory, the file and the problem.
CheckpointInfo open_checkpoint(const std::string& path, bool newest_valid = false);

// Loads the fp32 master weights into `model`; every tensor must exist with the model's
// shape, else the error names the first mismatch. With `opt`, its fp32 master copy (bf16
// models) gets the same weights from the one read, so a resume continues from the exact
// fp32 values.
void load_model_weights(const CheckpointInfo& ckpt, Model& model, AdamWOptimizer* opt = nullptr);
// Loads rank `rank`'s AdamW moments.
void load_optimizer_moments(const CheckpointInfo& ckpt, Model& model, AdamWOptimizer& opt, int rank);
// Throws if the model sections differ, naming the first differing field.
void check_same_model(const Config& ours, const Config& theirs, const std::string& theirs_where);

struct CheckpointWrite {
  std::string run_dir;
  int64_t step = 0;
  const Config* config = nullptr;
  nlohmann::json loader;   // data position
  nlohmann::json trainer;  // counters the trainer needs to resume (tokens, bad steps, ...)
  int keep = 0;            // keep the newest K checkpoints (0 = all)
};
// Writes atomically (see above) and prunes old checkpoints. Returns the directory.
std::string save_checkpoint(const CheckpointWrite& w, Model& model, AdamWOptimizer& opt);

// Called at the start of a run, under the run lock (engine/run_lock.h), so that no live
// writer can own what it finds: cleans up after checkpoint writers that were killed.
// Every RUN_DIR/checkpoints/.tmp-step_N-PID (a partial checkpoint) is removed; an
// .old-step_N-PID (a whole checkpoint set aside while step N was re-saved) is removed
// when step_N exists, else renamed back to step_N, being its only copy. Logs each action.
void recover_checkpoint_writes(const std::string& run_dir);

}  // namespace mhar
