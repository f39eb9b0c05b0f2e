// optimizer_test.cpp: the AdamW group (Backend::adamw_group / adamw_step) on the CPU
// reference: its default is adamw() once per segment in order, with the step's weight
// decay on decayed segments only; a wrapper backend that overrides adamw() sees every
// segment; and AdamWOptimizer::step on each rank of a sharded model (grad_shards 2) is
// that loop over its shard's segments.
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <vector>

#include "engine/backend.h"
#include "engine/forwarding_backend.h"
#include "engine/model.h"
#include "engine/optimizer.h"
#include "tests/model_test_util.h"

namespace mhar::test {
namespace {

std::vector<float> normal(std::mt19937_64& rng, size_t n, double stddev) {
  std::normal_distribution<double> d(0.0, stddev);
  std::vector<float> v(n);
  for (float& x : v) x = float(d(rng));
  return v;
}

Tensor view(std::vector<float>& v, size_t at, int64_t n) {
  return Tensor(v.data() + at, DType::F32, {n});
}

// Three segments of one flat buffer set: decayed, not decayed, decayed (with a gap).
struct Buffers {
  std::vector<float> w, g, m, v;
  std::vector<Backend::AdamWSegment> segments() {
    return {{view(w, 0, 40), Tensor(), view(g, 0, 40), view(m, 0, 40), view(v, 0, 40), true},
            {view(w, 40, 7), Tensor(), view(g, 40, 7), view(m, 40, 7), view(v, 40, 7), false},
            {view(w, 50, 13), Tensor(), view(g, 50, 13), view(m, 50, 13), view(v, 50, 13), true}};
  }
};

Buffers make_buffers(uint64_t seed) {
  std::mt19937_64 rng(seed);
  Buffers b{normal(rng, 64, 0.5), normal(rng, 64, 1e-2), normal(rng, 64, 1e-3), normal(rng, 64, 1e-5)};
  for (float& x : b.v) x = std::fabs(x);
  return b;
}

const Backend::AdamW kHp{3e-3, 0.9, 0.95, 1e-8, 0.5, 0.7, 2};

TEST(AdamwGroup, DefaultIsAdamwPerSegmentWithDecayOnDecayedSegmentsOnly) {
  auto cpu = make_cpu_backend(DType::F32);
  Buffers a = make_buffers(1), b = make_buffers(1), c = make_buffers(1);
  const auto group = cpu->adamw_group(a.segments());
  cpu->adamw_step(*group, kHp);
  for (const auto& s : b.segments()) {
    Backend::AdamW h = kHp;
    h.weight_decay = s.decay ? kHp.weight_decay : 0.0;
    cpu->adamw(s.param, s.master, s.grad, s.m, s.v, h);
  }
  for (const auto& s : c.segments()) cpu->adamw(s.param, s.master, s.grad, s.m, s.v, kHp);
  EXPECT_EQ(a.w, b.w);
  EXPECT_EQ(a.m, b.m);
  EXPECT_EQ(a.v, b.v);
  // The elements outside every segment are untouched.
  for (size_t i : {47, 48, 49, 63}) EXPECT_EQ(a.w[i], make_buffers(1).w[i]) << i;
  // The undecayed segment differs from a decayed update (decay 0.5 is far above rounding).
  for (size_t i = 40; i < 47; ++i) EXPECT_NE(a.w[i], c.w[i]) << i;
  for (size_t i = 0; i < 40; ++i) EXPECT_EQ(a.w[i], c.w[i]) << i;
}

// Wrappers that alter adamw() (tests/experiments/) keep seeing every segment: the group
// of a ForwardingBackend is the default one, stepped through the wrapper's adamw().
class CountingAdamw final : public ForwardingBackend {
 public:
  using ForwardingBackend::ForwardingBackend;
  void adamw(Tensor p, Tensor master, Tensor g, Tensor m, Tensor v, const AdamW& hp) override {
    sizes.push_back(p.numel());
    decays.push_back(hp.weight_decay);
    in_.adamw(p, master, g, m, v, hp);
  }
  std::vector<int64_t> sizes;
  std::vector<double> decays;
};

TEST(AdamwGroup, WrapperOverridingAdamwSeesEverySegment) {
  auto cpu = make_cpu_backend(DType::F32);
  CountingAdamw counting(*cpu);
  Buffers a = make_buffers(2);
  const auto group = counting.adamw_group(a.segments());
  counting.adamw_step(*group, kHp);
  EXPECT_EQ(counting.sizes, (std::vector<int64_t>{40, 7, 13}));
  EXPECT_EQ(counting.decays, (std::vector<double>{0.5, 0.0, 0.5}));
}

// AdamWOptimizer::step is adamw() per shard segment with Parameter::decay's weight decay,
// on either rank of grad_shards 2.
TEST(AdamwGroup, ShardedOptimizerStepIsTheLoopOverItsSegments) {
  const Config cfg = tiny_config(ResidualMode::Standard);
  for (int rank : {0, 1}) {
    SCOPED_TRACE(rank);
    auto cpu = make_cpu_backend(DType::F64);
    Model a(cfg.model, cfg.residual, *cpu, 2, 5, 2), b(cfg.model, cfg.residual, *cpu, 2, 5, 2);
    a.init_weights(7);
    b.init_weights(7);
    std::mt19937_64 rng(9);
    std::normal_distribution<double> d(0.0, 1e-2);
    for (size_t p = 0; p < a.parameters().size(); ++p) {  // the padding stays zero
      const Tensor ga = a.parameters()[p].grad, gb = b.parameters()[p].grad;
      for (int64_t i = 0; i < ga.numel(); ++i) ga.ptr<double>()[i] = gb.ptr<double>()[i] = d(rng);
    }
    AdamWOptimizer oa(a, cfg.train, rank), ob(b, cfg.train, rank);
    oa.step(1e-2, 0.5, 1);
    for (const ShardSegment& s : ob.segments()) {
      const Backend::AdamW hp{1e-2, cfg.train.beta1, cfg.train.beta2, cfg.train.adam_eps,
                              b.parameters()[size_t(s.param)].decay ? cfg.train.weight_decay : 0.0,
                              0.5, 1};
      cpu->adamw(ob.param_slice(s), Tensor(), ob.grad_slice(s), ob.exp_avg(s), ob.exp_avg_sq(s), hp);
    }
    const Tensor pa = a.all_parameters_flat(), pb = b.all_parameters_flat();
    int64_t differ = 0, changed = 0;
    for (int64_t i = 0; i < pa.numel(); ++i) differ += pa.ptr<double>()[i] != pb.ptr<double>()[i];
    EXPECT_EQ(differ, 0);
    Model fresh(cfg.model, cfg.residual, *cpu, 2, 5, 2);
    fresh.init_weights(7);
    const Tensor pf = fresh.all_parameters_flat();
    for (int64_t i = 0; i < pa.numel(); ++i) changed += pa.ptr<double>()[i] != pf.ptr<double>()[i];
    EXPECT_GT(changed, 0);
  }
}

}  // namespace
}  // namespace mhar::test
