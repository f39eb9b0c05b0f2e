// optimizer.h: AdamW (DESIGN.md section 5) over a Model's parameters, with the learning
// rate schedule and global-norm clipping helpers the trainer uses.
//
// State lives in one allocation per kind: first and second moments (F32 on CUDA, the
// scalar type on the CPU) and, when the backend's parameters are not F32 (bf16 on CUDA),
// an F32 master copy that the update reads and writes before rounding into the
// parameters. Weight decay applies to matrices only (Parameter::decay).
// Under data parallelism each rank holds this state for its shard only (ZeRO-1).
#pragma once
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "engine/allocator.h"
#include "engine/config.h"
#include "engine/model.h"

namespace mhar {

// One contiguous run of one parameter inside this rank's shard.
struct ShardSegment {
  int param = 0;            // index into Model::parameters()
  int64_t begin = 0;        // first element, within the parameter (flattened)
  int64_t count = 0;        // elements
  int64_t state_offset = 0; // first element in this rank's optimizer state
};

class AdamWOptimizer {
 public:
  // ZeRO-1: this rank (of model.grad_shards() ranks) holds the moments and the fp32
  // master weights of its shard only: slice `rank` of every gradient bucket
  // (Model::buckets()). With one rank the shard is the whole model.
  AdamWOptimizer(Model& model, const TrainConfig& train, int rank = 0);

  // One update of this rank's shard with learning rate `lr`; gradients are multiplied by
  // `grad_scale` (the clipping factor) first. `step` counts from 1 (bias correction).
  // Weight decay follows each parameter (Parameter::decay), also where a shard starts or
  // ends inside a parameter. The other ranks' parameter elements are left as they are
  // (the all-gather brings them). One Backend::adamw_step over every segment.
  void step(double lr, double grad_scale, long long step);

  // Sum of squares of this rank's shard of the gradients (after the reduce-scatter);
  // the sum over ranks is the squared global norm. One backend reduction per contiguous
  // run of the shard: with one rank, one over the whole gradient allocation.
  double shard_sum_squares() const;

  // The segments of rank `rank`'s shard of `model` (what segments() is on that rank).
  static std::vector<ShardSegment> shard_segments(const Model& model, int rank);

  int rank() const { return rank_; }
  int world_size() const { return world_; }
  bool has_master() const { return master_plan_ != nullptr; }
  const std::vector<ShardSegment>& segments() const { return segments_; }
  // Views of one segment: the parameter and gradient elements, and its optimizer state.
  Tensor param_slice(const ShardSegment& s) const;
  Tensor grad_slice(const ShardSegment& s) const;
  Tensor exp_avg(const ShardSegment& s) const;
  Tensor exp_avg_sq(const ShardSegment& s) const;
  // The fp32 weights the optimizer updates: the master copy, or (no master) the
  // parameter itself.
  Tensor weights(const ShardSegment& s) const;
  // The state of parameter `i` as a whole, where this rank's shard holds all of it (every
  // parameter with one rank): for tests and tools that look at one parameter.
  Tensor exp_avg(size_t i) const { return exp_avg(whole_segment(i)); }
  Tensor exp_avg_sq(size_t i) const { return exp_avg_sq(whole_segment(i)); }
  Tensor weights(size_t i) const { return weights(whole_segment(i)); }
  // Element range [begin, end) of bucket b that this rank owns, in the flat layout.
  int64_t shard_begin(int bucket) const;
  int64_t shard_end(int bucket) const;
  // Copies the parameters into the master copy (after init or load).
  void sync_master_from_params();
  size_t state_bytes() const;

 private:
  Tensor state_slice(const Arena& a, DType t, const ShardSegment& s) const;
  const ShardSegment& whole_segment(size_t param) const;

  Model& model_;
  TrainConfig cfg_;
  int rank_ = 0, world_ = 1;
  DType moment_dtype_;
  int64_t state_numel_ = 0;
  std::vector<ShardSegment> segments_;
  std::vector<std::pair<int64_t, int64_t>> grad_runs_;  // contiguous shard ranges
  std::unique_ptr<MemoryPlan> m_plan_, v_plan_, master_plan_;
  std::unique_ptr<Arena> m_arena_, v_arena_, master_arena_;
  // Every segment's tensors, made once (Backend::adamw_group); declared last so that it
  // goes before the arenas it points into.
  std::unique_ptr<Backend::AdamWGroup> group_;
};

// Learning rate at `step` (0-based): linear warmup to lr over warmup_steps, then cosine
// to lr * min_lr_ratio at the last step, or warmup-stable-decay: constant until the final
// decay_fraction of the steps, then linear down to lr * min_lr_ratio.
double learning_rate(const TrainConfig& t, long long step);

// Factor that scales gradients to global norm `clip` (1 when no clipping is needed).
inline double clip_factor(double grad_norm, double clip) {
  return (clip > 0 && grad_norm > clip) ? clip / grad_norm : 1.0;
}

}  // namespace mhar
