// train_step.h: one optimizer step, written once for `mhar train`, `mhar bench` and the
// tests (issue 16): zero the gradients; forward and backward over this rank's
// micro-batches (gradient accumulation); on the last micro-batch the gradient buckets are
// reduce-scattered as the backward completes them; the global gradient norm over the
// shards; the loss, the norm and a stop flag summed over ranks in one host all-reduce;
// clipping; the AdamW update of this rank's shard, skipped on every rank when the loss or
// the norm is not finite; the all-gather of the updated parameters.
//
// The arithmetic is that of one process with world_size * accum micro-batches: each
// micro-batch's loss is scaled by 1 / (accum * world_size) and the reduce-scatter sums,
// so W ranks x accum micro-batches give the gradients of one rank with W * accum
// micro-batches up to the order of the fp32 additions. With one rank every collective is
// the identity and the step is bit for bit the single-process step.
#pragma once
#include <cstdint>
#include <functional>

#include "engine/communicator.h"
#include "engine/config.h"
#include "engine/model.h"
#include "engine/optimizer.h"

namespace mhar {

struct StepResult {
  double loss = 0;       // mean over every micro-batch of every rank
  double grad_norm = 0;  // global, before clipping
  double lr = 0;
  bool good = true;      // finite loss and norm: the update was applied
  bool stop = false;     // some rank asked to stop (the stop flag's all-reduce)
};

class TrainStep {
 public:
  // `accum`: micro-batches per rank per step.
  TrainStep(Model& model, AdamWOptimizer& optimizer, Communicator& comm, const TrainConfig& train,
            long long accum);

  // Fills one micro-batch (inputs, targets; micro_batch x seq_len each).
  using NextBatch = std::function<void(int32_t* inputs, int32_t* targets)>;
  // Step `step` (0-based: its learning rate is learning_rate(train, step), its AdamW step
  // count step + 1). `stop_requested`: this rank's stop flag, read after the backward
  // (so a signal during the step stops after it) and agreed over ranks in the result.
  // `force_nonfinite`: the loss reads as NaN (fault injection for tests).
  StepResult run(long long step, const NextBatch& next_batch,
                 const std::function<bool()>& stop_requested = nullptr, bool force_nonfinite = false);

  long long accum() const { return accum_; }
  // Number of micro-batches per rank for a global batch of `batch_tokens` (0: one
  // micro-batch per rank) with micro-batches of `micro_tokens` over `world_size` ranks;
  // fails, naming the config fields, when it does not divide.
  static long long micro_batches_per_rank(long long batch_tokens, long long micro_tokens,
                                          int world_size);

 private:
  Tensor bucket_view(Tensor flat, int bucket) const;

  Model& model_;
  AdamWOptimizer& opt_;
  Communicator& comm_;
  TrainConfig cfg_;
  long long accum_;
  std::vector<int32_t> x_, y_;
};

}  // namespace mhar
