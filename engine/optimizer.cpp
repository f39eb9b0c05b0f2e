// optimizer.cpp: AdamW state allocation, the update loop and the schedule.
#include "engine/optimizer.h"

#include <cmath>
#include <vector>

namespace mhar {

AdamWOptimizer::AdamWOptimizer(Model& model, const TrainConfig& train)
    : model_(model), cfg_(train) {
  Backend& be = model.backend();
  const DType moment_dtype = be.act_dtype() == DType::F64 ? DType::F64 : DType::F32;
  m_plan_ = std::make_unique<MemoryPlan>("optimizer.exp_avg");
  v_plan_ = std::make_unique<MemoryPlan>("optimizer.exp_avg_sq");
  const bool need_master = be.act_dtype() != DType::F32 && be.act_dtype() != DType::F64;
  if (need_master) master_plan_ = std::make_unique<MemoryPlan>("optimizer.master");
  for (const auto& p : model.parameters()) {
    std::initializer_list<int64_t> flat = {p.value.numel()};
    m_plan_->add(p.name, moment_dtype, flat);
    v_plan_->add(p.name, moment_dtype, flat);
    if (need_master) master_plan_->add(p.name, DType::F32, flat);
  }
  m_plan_->plan();
  v_plan_->plan();
  m_arena_ = std::make_unique<Arena>(be, *m_plan_);
  v_arena_ = std::make_unique<Arena>(be, *v_plan_);
  if (need_master) {
    master_plan_->plan();
    master_arena_ = std::make_unique<Arena>(be, *master_plan_);
    sync_master_from_params();
  }
}

Tensor AdamWOptimizer::weights(size_t i) const {
  return has_master() ? master(i) : model_.parameters()[i].value;
}

void AdamWOptimizer::sync_master_from_params() {
  if (!has_master()) return;
  Backend& be = model_.backend();
  std::vector<double> host;
  for (size_t i = 0; i < model_.parameters().size(); ++i) {
    const Tensor& p = model_.parameters()[i].value;
    host.resize(size_t(p.numel()));
    be.download(host.data(), p);
    be.upload(master(i), host.data());
  }
}

void AdamWOptimizer::step(double lr, double grad_scale, long long step) {
  Backend& be = model_.backend();
  auto& params = model_.parameters();
  for (size_t i = 0; i < params.size(); ++i) {
    Backend::AdamW hp{lr, cfg_.beta1, cfg_.beta2, cfg_.adam_eps,
                      params[i].decay ? cfg_.weight_decay : 0.0, grad_scale, step};
    Tensor flat_param = params[i].value.view({params[i].value.numel()});
    Tensor flat_grad = params[i].grad.view({params[i].grad.numel()});
    be.adamw(flat_param, master(i), flat_grad, exp_avg(i), exp_avg_sq(i), hp);
  }
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
