// optimizer.cpp: AdamW state of this rank's shard, the update and the schedule.
// The update is one Backend::adamw_step over a group of every shard segment, made once
// in the constructor (the CUDA backend keeps its segment and chunk tables on the device
// and updates the whole shard in one launch; the default, the CPU reference, calls adamw
// per segment in order, as the loop here did before the group existed).
#include "engine/optimizer.h"

#include <algorithm>
#include <cmath>
#include <utility>
#include <vector>

namespace mhar {

namespace {
Tensor flat_slice(Tensor flat, int64_t begin, int64_t count) {
  return Tensor(static_cast<char*>(flat.data) + size_t(begin) * dtype_size(flat.dtype), flat.dtype,
                {count});
}
}  // namespace

AdamWOptimizer::AdamWOptimizer(Model& model, const TrainConfig& train, int rank)
    : model_(model), cfg_(train), rank_(rank), world_(model.grad_shards()) {
  MHAR_CHECK(rank >= 0 && rank < world_, "rank ", rank, " of ", world_);
  Backend& be = model.backend();
  moment_dtype_ = be.act_dtype() == DType::F64 ? DType::F64 : DType::F32;
  segments_ = shard_segments(model, rank);
  for (size_t b = 0; b < model.buckets().size(); ++b) {
    const int64_t lo = shard_begin(int(b)), hi = shard_end(int(b));
    if (!grad_runs_.empty() && grad_runs_.back().second == lo) grad_runs_.back().second = hi;
    else grad_runs_.push_back({lo, hi});
    state_numel_ += hi - lo;
  }
  m_plan_ = std::make_unique<MemoryPlan>("optimizer.exp_avg");
  v_plan_ = std::make_unique<MemoryPlan>("optimizer.exp_avg_sq");
  m_plan_->add("exp_avg", moment_dtype_, {state_numel_});
  v_plan_->add("exp_avg_sq", moment_dtype_, {state_numel_});
  m_plan_->plan();
  v_plan_->plan();
  m_arena_ = std::make_unique<Arena>(be, *m_plan_);
  v_arena_ = std::make_unique<Arena>(be, *v_plan_);
  const bool need_master = be.act_dtype() != DType::F32 && be.act_dtype() != DType::F64;
  if (need_master) {
    master_plan_ = std::make_unique<MemoryPlan>("optimizer.master");
    master_plan_->add("master", DType::F32, {state_numel_});
    master_plan_->plan();
    master_arena_ = std::make_unique<Arena>(be, *master_plan_);
    sync_master_from_params();
  }
  std::vector<Backend::AdamWSegment> group;
  group.reserve(segments_.size());
  for (const ShardSegment& s : segments_)
    group.push_back({param_slice(s), has_master() ? weights(s) : Tensor(), grad_slice(s),
                     exp_avg(s), exp_avg_sq(s), model.parameters()[size_t(s.param)].decay});
  group_ = be.adamw_group(std::move(group));
}

std::vector<ShardSegment> AdamWOptimizer::shard_segments(const Model& model, int rank) {
  // The shard: slice `rank` of every bucket, stored bucket after bucket (padding
  // included, so a state offset is a fixed shift of the flat offset within a bucket).
  std::vector<ShardSegment> out;
  const int W = model.grad_shards();
  const auto& params = model.parameters();
  int64_t state = 0;
  for (const GradBucket& bk : model.buckets()) {
    const int64_t lo = bk.offset + bk.numel / W * rank, hi = lo + bk.numel / W;
    for (int i = bk.first_param; i < bk.end_param; ++i) {
      const int64_t p0 = params[size_t(i)].offset, p1 = p0 + params[size_t(i)].value.numel();
      const int64_t a = std::max(p0, lo), e = std::min(p1, hi);
      if (a < e) out.push_back({i, a - p0, e - a, state + (a - lo)});
    }
    state += hi - lo;
  }
  return out;
}

int64_t AdamWOptimizer::shard_begin(int bucket) const {
  const GradBucket& b = model_.buckets()[size_t(bucket)];
  return b.offset + b.numel / world_ * rank_;
}
int64_t AdamWOptimizer::shard_end(int bucket) const {
  const GradBucket& b = model_.buckets()[size_t(bucket)];
  return b.offset + b.numel / world_ * (rank_ + 1);
}

Tensor AdamWOptimizer::param_slice(const ShardSegment& s) const {
  return flat_slice(model_.all_parameters_flat(),
                    model_.parameters()[size_t(s.param)].offset + s.begin, s.count);
}
Tensor AdamWOptimizer::grad_slice(const ShardSegment& s) const {
  return flat_slice(model_.all_gradients(), model_.parameters()[size_t(s.param)].offset + s.begin,
                    s.count);
}
Tensor AdamWOptimizer::state_slice(const Arena& a, DType t, const ShardSegment& s) const {
  return flat_slice(Tensor(a.base(), t, {state_numel_}), s.state_offset, s.count);
}
Tensor AdamWOptimizer::exp_avg(const ShardSegment& s) const {
  return state_slice(*m_arena_, moment_dtype_, s);
}
Tensor AdamWOptimizer::exp_avg_sq(const ShardSegment& s) const {
  return state_slice(*v_arena_, moment_dtype_, s);
}
Tensor AdamWOptimizer::weights(const ShardSegment& s) const {
  return has_master() ? state_slice(*master_arena_, DType::F32, s) : param_slice(s);
}

const ShardSegment& AdamWOptimizer::whole_segment(size_t param) const {
  for (const ShardSegment& s : segments_)
    if (size_t(s.param) == param && s.begin == 0 &&
        s.count == model_.parameters()[param].value.numel())
      return s;
  fail("parameter ", model_.parameters().at(param).name, " is not whole in rank ", rank_, "'s shard of ",
       world_, " (per-parameter optimizer state exists with one rank only)");
}

void AdamWOptimizer::sync_master_from_params() {
  if (!has_master()) return;
  Backend& be = model_.backend();
  std::vector<double> host;
  for (const ShardSegment& s : segments_) {
    host.resize(size_t(s.count));
    be.download(host.data(), param_slice(s));
    be.upload(weights(s), host.data());
  }
}

void AdamWOptimizer::step(double lr, double grad_scale, long long step) {
  // weight_decay applies to the segments of decayed parameters only (AdamWSegment::decay).
  const Backend::AdamW hp{lr, cfg_.beta1, cfg_.beta2, cfg_.adam_eps, cfg_.weight_decay, grad_scale,
                          step};
  model_.backend().adamw_step(*group_, hp);
}

double AdamWOptimizer::shard_sum_squares() const {
  Backend& be = model_.backend();
  double sum = 0;
  for (const auto& [lo, hi] : grad_runs_) sum += be.sum_squares(flat_slice(model_.all_gradients(), lo, hi - lo));
  return sum;
}

size_t AdamWOptimizer::state_bytes() const {
  return m_plan_->total_bytes() + v_plan_->total_bytes() +
         (master_plan_ ? master_plan_->total_bytes() : 0);
}

double learning_rate(const TrainConfig& t, long long step) {
  const double peak = t.lr, floor = t.lr * t.min_lr_ratio;
  if (step < t.warmup_steps) return peak * double(step + 1) / double(t.warmup_steps);
  const long long total = t.steps;
  if (t.schedule == "wsd") {
    const long long decay_steps = std::llround(t.decay_fraction * double(total - t.warmup_steps));
    const long long decay_start = total - decay_steps;
    if (step < decay_start || decay_steps == 0) return peak;
    const double frac = double(step - decay_start + 1) / double(decay_steps);
    return peak + (floor - peak) * std::min(1.0, frac);
  }
  const long long span = std::max<long long>(1, total - t.warmup_steps - 1);
  const double frac = std::min(1.0, double(step - t.warmup_steps) / double(span));
  return floor + 0.5 * (peak - floor) * (1.0 + std::cos(M_PI * frac));
}

}  // namespace mhar
