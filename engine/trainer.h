// trainer.h: `mhar train` and `mhar eval` as library functions.
//
// train() runs the whole job: backend selection, model and optimizer, data loaders,
// gradient accumulation up to train.batch_tokens, AdamW with the schedule and global-norm
// clipping, validation every train.eval_every steps, metrics.jsonl, checkpoints (every
// checkpoint.every steps, at the end, and when SIGINT/SIGTERM asks the run to stop: the
// step in flight finishes, a checkpoint is written, and train() returns normally).
// A step with a non-finite loss or gradient norm is skipped (no update; the data position
// moves on); more than train.max_bad_steps of them in a row stop the run with an error.
// A stop request and the end of the run are honoured after a skipped step as after a
// good one; periodic evaluations and checkpoints follow good steps only.
// Resuming restores weights, optimizer moments, step and data position, so the resumed
// run's losses are bit-identical to an uninterrupted run's.
// The run holds RUN_DIR's lock (engine/run_lock.h) from before it reads or writes
// anything there until it returns; a second trainer on the directory is refused.
#pragma once
#include <string>

#include "engine/config.h"
#include "engine/model.h"

namespace mhar {

namespace data { class DataLoader; }
class RoutingProbe;

struct TrainOptions {
  std::string run_dir;              // required
  bool resume = false;              // continue the run in run_dir from its newest checkpoint
  bool resume_latest_valid = false; // ...or from the newest checkpoint that validates
  std::string init_from;            // a new run starting from this checkpoint's weights
                                    // (fresh optimizer, step 0; e.g. an `mhar import`)
  std::string device;               // overrides train.device when not empty
  long long stop_after_steps = -1;  // stop as if interrupted after this many steps (tests)
  bool quiet = false;               // no progress lines (tests)
};

struct TrainResult {
  long long step = 0;  // steps completed
  double last_loss = 0;
  double last_val_loss = -1;
  double first_val_loss = -1;
  bool interrupted = false;
  std::string last_checkpoint;
};

TrainResult train(Config cfg, const TrainOptions& opt);

struct EvalResult {
  double loss = 0;
  long long tokens = 0;
  long long batches = 0;
};
// Mean cross-entropy over every predicted token of the first `max_batches` batches (all
// when <= 0) of a sequential loader, read from its first batch. With `routing` and a
// routed model, every batch's routing statistics are reduced into it on the device (for
// the report).
EvalResult evaluate(Model& model, data::DataLoader& loader, long long max_batches,
                    RoutingProbe* routing = nullptr);

// Makes relative data globs and a tokenizer.json path absolute against the config
// file's directory (the names "gpt2" and "qwen3" stay as they are).
void resolve_data_paths(Config& cfg);

// Install SIGINT/SIGTERM handlers that ask a running train() to stop cleanly (a second
// signal exits at once).
void install_stop_signal_handlers();

}  // namespace mhar
