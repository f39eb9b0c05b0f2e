// checkpoint.h: checkpoints on disk (DESIGN.md section 6).
//
// Layout: RUN_DIR/checkpoints/step_00001000/
//   model.safetensors            fp32 master weights, Hugging Face Qwen3 names
//   optimizer.rank<R>.safetensors  AdamW moments of rank R ("<name>.exp_avg",
//                                ".exp_avg_sq"), fp32
//   state.json                   {"format", "step", "config", "loader", "trainer",
//                                 "files": {name: {"bytes", "fnv1a64"}},
//                                 "state_fnv1a64": its own checksum}
// A checkpoint is written into a hidden temporary directory and renamed into place only
// when every file is complete and flushed, so a crash (or a full disk) never leaves a
// directory that looks whole. Opening validates state.json field by field and against its
// own checksum, and every file's size and checksum (engine/checkpoint_state.h); loading
// the weights enforces the safetensors layout rule (engine/safetensors.h), the model's
// dtype and exact shapes, no extra tensors, and finite values.
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
// With `opt`, its fp32 master copy (bf16 models) gets the same weights from the one read,
// so a resume continues from the exact fp32 values.
void load_model_weights(const CheckpointInfo& ckpt, Model& model, AdamWOptimizer* opt = nullptr);
// Loads rank `rank`'s AdamW moments: the file must be listed (so checksummed) in
// state.json and hold exactly "<name>.exp_avg" and "<name>.exp_avg_sq" per parameter, F32
// of shape [numel], finite, and exp_avg_sq >= 0.
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
