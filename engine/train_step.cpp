// train_step.cpp: the one training step (see train_step.h).
#include "engine/train_step.h"

#include <cmath>

#include "engine/error.h"
#include "engine/watchdog.h"

namespace mhar {

TrainStep::TrainStep(Model& model, AdamWOptimizer& optimizer, Communicator& comm,
                     const TrainConfig& train, long long accum)
    : model_(model), opt_(optimizer), comm_(comm), cfg_(train), accum_(accum) {
  MHAR_CHECK(accum >= 1, "accum ", accum);
  MHAR_CHECK(model.grad_shards() == comm.world_size() && optimizer.world_size() == comm.world_size() &&
                 optimizer.rank() == comm.rank(),
             "model padded for ", model.grad_shards(), " ranks, optimizer rank ", optimizer.rank(),
             " of ", optimizer.world_size(), ", communicator rank ", comm.rank(), " of ",
             comm.world_size());
  const size_t n = size_t(model.batch()) * size_t(model.seq_len());
  x_.resize(n);
  y_.resize(n);
}

long long TrainStep::micro_batches_per_rank(long long batch_tokens, long long micro_tokens,
                                            int world_size) {
  if (batch_tokens <= 0) return 1;
  const long long per_step = micro_tokens * world_size;
  if (batch_tokens % per_step != 0)
    fail("train.batch_tokens = ", batch_tokens, " is not a multiple of train.micro_batch x "
         "train.seq_len x ranks = ", micro_tokens, " x ", world_size, " = ", per_step,
         ": the global batch must split into whole micro-batches on every rank; choose "
         "train.batch_tokens a multiple of ", per_step, ", or another number of ranks");
  return batch_tokens / per_step;
}

Tensor TrainStep::bucket_view(Tensor flat, int bucket) const {
  const GradBucket& b = model_.buckets()[size_t(bucket)];
  return Tensor(static_cast<char*>(flat.data) + size_t(b.offset) * dtype_size(flat.dtype),
                flat.dtype, {b.numel});
}

StepResult TrainStep::run(long long step, const NextBatch& next_batch,
                          const std::function<bool()>& stop_requested, bool force_nonfinite) {
  const int W = comm_.world_size();
  const bool distributed = W > 1 || comm_.name() != "single";
  watchdog::set_phase("forward and backward", step + 1);
  model_.zero_grads();
  const Tensor grads = model_.all_gradients();
  const Model::BucketHook reduce = [&](int b) { comm_.reduce_scatter_sum(bucket_view(grads, b)); };
  double loss = 0;
  for (long long a = 0; a < accum_; ++a) {
    next_batch(x_.data(), y_.data());
    loss += model_.forward(x_.data(), y_.data(), 1.0 / double(accum_ * W)) / double(accum_);
    // Buckets are reduced once, on the last micro-batch, as the backward finishes each.
    model_.backward(distributed && a + 1 == accum_ ? reduce : nullptr);
  }
  if (force_nonfinite) loss = NAN;
  watchdog::set_phase("gradient reduction and update", step + 1);
  comm_.wait_reduced();
  double sums[3] = {opt_.shard_sum_squares(), loss, stop_requested && stop_requested() ? 1.0 : 0.0};
  comm_.all_reduce_sum(sums, 3);
  StepResult r;
  r.grad_norm = std::sqrt(sums[0]);
  r.loss = sums[1] / double(W);
  r.stop = sums[2] > 0;
  r.lr = learning_rate(cfg_, step);
  r.good = std::isfinite(r.loss) && std::isfinite(r.grad_norm);
  if (r.good) {
    opt_.step(r.lr, clip_factor(r.grad_norm, cfg_.grad_clip), step + 1);
    if (distributed) {
      // The communicator orders each all-gather after the update enqueued above.
      const Tensor params = model_.all_parameters_flat();
      for (size_t b = 0; b < model_.buckets().size(); ++b) comm_.all_gather(bucket_view(params, int(b)));
      comm_.wait_gathered();
    }
  }
  model_.backend().synchronize();
  watchdog::set_phase("between steps", step + 1, false);
  return r;
}

}  // namespace mhar
