// optimizer.h: AdamW (DESIGN.md section 5) over a Model's parameters, with the learning
// rate schedule and global-norm clipping helpers the trainer uses.
//
// State lives in one allocation per kind: first and second moments (F32 on CUDA, the
// scalar type on the CPU) and, when the backend's parameters are not F32 (bf16 on CUDA),
// an F32 master copy that the update reads and writes before rounding into the
// parameters. Weight decay applies to matrices only (Parameter::decay).
#pragma once
#include <memory>
#include <string>
#include <vector>

#include "engine/allocator.h"
#include "engine/config.h"
#include "engine/model.h"

namespace mhar {

class AdamWOptimizer {
 public:
  AdamWOptimizer(Model& model, const TrainConfig& train);

  // One update with learning rate `lr`; gradients are multiplied by `grad_scale`
  // (the clipping factor) first. `step` counts from 1 (bias correction).
  void step(double lr, double grad_scale, long long step);

  bool has_master() const { return master_plan_ != nullptr; }
  // Per-parameter state tensors, index-aligned with model.parameters().
  Tensor exp_avg(size_t i) const { return m_arena_->tensor(int(i)); }
  Tensor exp_avg_sq(size_t i) const { return v_arena_->tensor(int(i)); }
  Tensor master(size_t i) const { return has_master() ? master_arena_->tensor(int(i)) : Tensor(); }
  // The fp32 weights the optimizer updates (master copy, or the parameters themselves).
  Tensor weights(size_t i) const;
  // Copies the parameters into the master copy (after init or load).
  void sync_master_from_params();
  size_t state_bytes() const;

 private:
  Model& model_;
  TrainConfig cfg_;
  std::unique_ptr<MemoryPlan> m_plan_, v_plan_, master_plan_;
  std::unique_ptr<Arena> m_arena_, v_arena_, master_arena_;
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
