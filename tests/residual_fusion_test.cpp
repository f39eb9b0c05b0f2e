// residual_fusion_test.cpp: the standard scheme's fused residual add + RMSNorm
// (Backend::add_rmsnorm_forward at sites 1..2L) and its backward, where each consumer's
// norm backward adds dx_j straight into the running residual gradient (rmsnorm_backward
// "+=") instead of into its own buffer followed by a separate add.
// - Wiring: the fused op gets exactly the tensors of the old two-op path (x_j, x_{j-1},
//   history slot j, the consumer's norm weight, normed output and rstd buffers, eps), the
//   backward issues one "+=" norm backward per sublayer and no residual add; the other
//   residual modes issue neither (they keep their own path).
// - Arithmetic: the whole model on the CPU reference (fp32 and fp64) gives the same bits
//   (losses, logits, every parameter gradient) as the same model on a backend that runs
//   each fused op as the two ops of the old path (add, then rmsnorm_forward; dx_j into a
//   buffer of its own, then add_inplace into the running sum). The CPU's "+=" adds the
//   finished dx_j value to the old one, so the sums and their order are the old path's.
// - The routed schemes' counterpart: each site's mix and its consumer's norm in one call
//   (Backend::routing_mix_rmsnorm; routing_mix_tile_rmsnorm at a depth tile's first site);
//   their bits against the two ops are the CUDA parity test's (tests/routing_cudatest.cpp),
//   since the CPU's default is the two ops.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#include "tests/model_test_util.h"

namespace mhar::test {
namespace {

// The old path's ops for the fused ones, everything else forwarded.
class TwoOpPath final : public ForwardingBackend {
 public:
  using ForwardingBackend::ForwardingBackend;
  void add_rmsnorm_forward(Tensor x, Tensor y, Tensor rstd, Tensor a, Tensor b, Tensor w,
                           double eps) override {
    in_.add(x, a, b);
    in_.rmsnorm_forward(y, rstd, x, w, eps);
  }
  void rmsnorm_backward(Tensor dx, Tensor dw, Tensor dy, Tensor x, Tensor w, Tensor rstd,
                        bool acc) override {
    if (!acc) return in_.rmsnorm_backward(dx, dw, dy, x, w, rstd, false);
    Tensor own = dx;
    own.data = in_.allocate(dx.bytes());
    in_.rmsnorm_backward(own, dw, dy, x, w, rstd, false);
    in_.add_inplace(dx, own);
    in_.release(own.data);
  }
};

// Records the fused forward's arguments and counts the backward's "+=" norms and adds.
class Recorder final : public ForwardingBackend {
 public:
  using ForwardingBackend::ForwardingBackend;
  struct Fused {
    const void *x, *y, *rstd, *a, *b, *w;
    double eps;
  };
  std::vector<Fused> fused;
  int norm_backward_acc = 0, norm_backward = 0, adds = 0;
  void add_rmsnorm_forward(Tensor x, Tensor y, Tensor rstd, Tensor a, Tensor b, Tensor w,
                           double eps) override {
    fused.push_back({x.data, y.data, rstd.data, a.data, b.data, w.data, eps});
    in_.add_rmsnorm_forward(x, y, rstd, a, b, w, eps);
  }
  void rmsnorm_backward(Tensor dx, Tensor dw, Tensor dy, Tensor x, Tensor w, Tensor rstd,
                        bool acc) override {
    ++(acc ? norm_backward_acc : norm_backward);
    in_.rmsnorm_backward(dx, dw, dy, x, w, rstd, acc);
  }
  void add_inplace(Tensor y, Tensor x) override {
    ++adds;
    in_.add_inplace(y, x);
  }
  void add(Tensor o, Tensor a, Tensor b) override {
    ++adds;
    in_.add(o, a, b);
  }
};

// The bits of every value, so that EXPECT_EQ on them means "the same bits" (-0 vs +0
// and NaN payloads included).
std::vector<uint64_t> bits(const std::vector<double>& v) {
  std::vector<uint64_t> b(v.size());
  std::memcpy(b.data(), v.data(), v.size() * sizeof(double));
  return b;
}

// The name of site j's consumer's input norm weight (the head's final norm at j = 2L).
std::string consumer_norm_weight(int j, int L) {
  const std::string layer = "model.layers." + std::to_string(j / 2) + ".";
  return j == 2 * L   ? "model.norm.weight"
         : j % 2 == 0 ? layer + "input_layernorm.weight"
                      : layer + "post_attention_layernorm.weight";
}

// Random weights (seed), then one forward with a loss on 10 random tokens (seed + 1).
void forward_once(Model& m, uint64_t seed) {
  randomize_weights(m, seed);
  std::vector<int32_t> tok, tgt;
  random_tokens(10, m.config().vocab_size, seed + 1, tok, tgt);
  m.forward(tok.data(), tgt.data(), 1.0);
}

struct Results {
  std::vector<double> losses, logits;
  std::vector<std::vector<double>> grads;
};

Results run_step(Model& m, uint64_t seed) {
  std::vector<int32_t> tok, tgt;
  random_tokens(m.batch() * m.seq_len(), m.config().vocab_size, seed, tok, tgt);
  Results r;
  m.forward(tok.data(), tgt.data(), 0.0);
  r.logits = download(m.backend(), m.logits());
  m.zero_grads();
  m.forward(tok.data(), tgt.data(), 1.0);
  r.losses = download(m.backend(), m.losses());
  m.backward();
  for (const Parameter& p : m.parameters()) r.grads.push_back(download(m.backend(), p.grad));
  return r;
}

TEST(ResidualFusion, StandardSchemeFusesWithTheOldPathsTensors) {
  for (bool tied : {true, false}) {
    const Config c = tiny_config(ResidualMode::Standard, 0, tied);
    auto cpu = make_cpu_backend(DType::F32);
    Recorder rec(*cpu);
    Model m(c.model, c.residual, rec, 2, 5);
    forward_once(m, 11);
    const int L = c.model.n_layers;
    ASSERT_EQ(int(rec.fused.size()), 2 * L) << "one fused add + norm per site 1..2L";
    EXPECT_EQ(rec.adds, 0) << "the residual adds are all in the fused op";
    for (int j = 1; j <= 2 * L; ++j) {
      SCOPED_TRACE("site " + std::to_string(j));
      const Recorder::Fused& f = rec.fused[size_t(j - 1)];
      const std::string wname = consumer_norm_weight(j, L);
      EXPECT_EQ(f.x, m.site_input(j).data);
      EXPECT_EQ(f.a, m.site_input(j - 1).data);
      EXPECT_EQ(f.b, m.history()[j].data);
      EXPECT_EQ(f.w, m.parameter(wname).value.data);
      EXPECT_EQ(f.eps, c.model.rms_eps);
      EXPECT_NE(f.y, f.x);
    }
    // Normed outputs and rstd buffers: one per consumer, all distinct.
    for (size_t i = 0; i < rec.fused.size(); ++i)
      for (size_t k = i + 1; k < rec.fused.size(); ++k) {
        EXPECT_NE(rec.fused[i].y, rec.fused[k].y);
        EXPECT_NE(rec.fused[i].rstd, rec.fused[k].rstd);
      }
    m.backward();
    EXPECT_EQ(rec.norm_backward_acc, 2 * L) << "each sublayer's norm adds into the running sum";
    EXPECT_EQ(rec.adds, 0) << "no separate residual-gradient add";
  }
}

TEST(ResidualFusion, OtherModesKeepTheirPath) {
  struct Case {
    ResidualMode mode;
    int heads, block;
  };
  for (const Case cs : {Case{ResidualMode::AttnRes, 0, 0}, Case{ResidualMode::Mhar, 2, 0},
                        Case{ResidualMode::Mhar, 2, 2}, Case{ResidualMode::Hyper, 0, 0},
                        Case{ResidualMode::Delta, 2, 0}}) {
    const Config c = tiny_config(cs.mode, cs.heads, true, cs.block);
    SCOPED_TRACE(residual_mode_name(cs.mode) + std::string(" block ") + std::to_string(cs.block));
    auto cpu = make_cpu_backend(DType::F64);
    Recorder rec(*cpu);
    Model m(c.model, c.residual, rec, 2, 5);
    forward_once(m, 13);
    m.backward();
    EXPECT_TRUE(rec.fused.empty());
    EXPECT_EQ(rec.norm_backward_acc, 0);
  }
}

// A CPU backend that asks for depth tiles of 3 (the CPU mixes them untiled: the same
// results), recording the routed schemes' fused mix + norm calls and the plain norms.
class MixNormRecorder final : public ForwardingBackend {
 public:
  using ForwardingBackend::ForwardingBackend;
  struct Fused {
    int site, tile_count;  // tile_count 0: routing_mix_rmsnorm
    const void *x, *y, *rstd, *w;
    double eps;
  };
  std::vector<Fused> fused;
  std::vector<const void*> normed;  // x of each rmsnorm_forward
  int routing_tile_sites(const RoutingLayout&, int64_t, int) const override { return 3; }
  // Tiles of 3 (ForwardingBackend's plan would be the CPU's: no tiles).
  std::vector<int> routing_tile_plan(const RoutingLayout& lay, int64_t d,
                                     int heads) const override {
    return Backend::routing_tile_plan(lay, d, heads);
  }
  void routing_mix_rmsnorm(Tensor x, Tensor y, Tensor rstd, Tensor weights, Tensor history,
                           const RoutingLayout& layout, int site, int heads, Tensor norm_w,
                           double eps) override {
    fused.push_back({site, 0, x.data, y.data, rstd.data, norm_w.data, eps});
    in_.routing_mix_rmsnorm(x, y, rstd, weights, history, layout, site, heads, norm_w, eps);
  }
  void routing_mix_tile_rmsnorm(Tensor x, Tensor y, Tensor rstd, Tensor weights, Tensor history,
                                const RoutingLayout& layout, int site, int count, int heads,
                                Tensor norm_w, double eps) override {
    fused.push_back({site, count, x.data, y.data, rstd.data, norm_w.data, eps});
    in_.routing_mix_tile_rmsnorm(x, y, rstd, weights, history, layout, site, count, heads, norm_w,
                                 eps);
  }
  void rmsnorm_forward(Tensor y, Tensor rstd, Tensor x, Tensor w, double eps) override {
    normed.push_back(x.data);
    in_.rmsnorm_forward(y, rstd, x, w, eps);
  }
};

// The routed schemes hand each site's consumer norm to the mix: routing_mix_rmsnorm, and
// routing_mix_tile_rmsnorm (with the tile's count) at a depth tile's first site; the model
// normalises no site input itself.
TEST(ResidualFusion, RoutedSchemesFuseTheConsumersNormIntoTheMix) {
  for (ResidualMode mode : {ResidualMode::AttnRes, ResidualMode::Mhar}) {
    SCOPED_TRACE(residual_mode_name(mode));
    const Config c = tiny_config(mode, mode == ResidualMode::Mhar ? 2 : 0, true);
    auto cpu = make_cpu_backend(DType::F32);
    MixNormRecorder rec(*cpu);
    Model m(c.model, c.residual, rec, 2, 5);
    forward_once(m, 15);
    const int L = c.model.n_layers;
    size_t next = 0;
    for (int j = 0; j <= 2 * L; ++j) {
      SCOPED_TRACE("site " + std::to_string(j));
      EXPECT_EQ(std::count(rec.normed.begin(), rec.normed.end(), m.site_input(j).data), 0);
      ASSERT_LT(next, rec.fused.size());
      const MixNormRecorder::Fused& f = rec.fused[next++];
      const std::string wname = consumer_norm_weight(j, L);
      EXPECT_EQ(f.site, j);
      EXPECT_EQ(f.tile_count, j % 3 == 0 ? std::min(3, 2 * L + 1 - j) : 0);
      EXPECT_EQ(f.x, m.site_input(j).data);
      EXPECT_EQ(f.w, m.parameter(wname).value.data);
      EXPECT_EQ(f.eps, c.model.rms_eps);
      EXPECT_NE(f.y, f.x);
    }
    EXPECT_EQ(next, rec.fused.size()) << "no fused call beyond one a site";
  }
}

TEST(ResidualFusion, FusedPathGivesTheTwoOpPathsBits) {
  for (DType dt : {DType::F32, DType::F64})
    for (bool tied : {true, false}) {
      SCOPED_TRACE(std::string(dtype_name(dt)) + (tied ? " tied" : " untied"));
      const Config c = tiny_config(ResidualMode::Standard, 0, tied);
      auto cpu = make_cpu_backend(dt), cpu2 = make_cpu_backend(dt);
      TwoOpPath two(*cpu2);
      Model fused(c.model, c.residual, *cpu, 2, 5), ref(c.model, c.residual, two, 2, 5);
      randomize_weights(fused, 21);
      copy_weights(fused, ref);
      const Results a = run_step(fused, 22), b = run_step(ref, 22);
      EXPECT_EQ(bits(a.losses), bits(b.losses));
      EXPECT_EQ(bits(a.logits), bits(b.logits));
      ASSERT_EQ(a.grads.size(), b.grads.size());
      for (size_t i = 0; i < a.grads.size(); ++i)
        EXPECT_EQ(bits(a.grads[i]), bits(b.grads[i])) << fused.parameters()[i].name;
      // Not vacuous: the gradients are not all zero.
      double norm = 0;
      for (const auto& g : a.grads)
        for (double v : g) norm += v * v;
      EXPECT_GT(norm, 0);
    }
}

}  // namespace
}  // namespace mhar::test
