// op_scratch_test.cpp: the model's side of the op scratch (Backend::op_scratch_bytes,
// issue 13) on the CPU. A wrapper backend reports a scratch size made from the shapes it
// is asked about and watches what is bound while each op runs, so that these tests see
// what a CUDA backend would be given: the shapes of the model and of its residual scheme,
// one "backend.scratch" buffer of exactly the reported size in the activation plan (and
// in the memory report), bound around every forward, backward and decode pass and only
// then, each model its own when two share the backend, the previous binding restored
// also when a pass throws. (What the CUDA backend does with it, and that a training step
// on it allocates nothing: tests/op_scratch_cudatest.cpp.)
#include <gtest/gtest.h>

#include <cstdint>
#include <ostream>
#include <stdexcept>
#include <string>
#include <vector>

#include "engine/allocator.h"
#include "engine/backend.h"
#include "engine/config.h"
#include "engine/forwarding_backend.h"
#include "engine/model.h"
#include "tests/model_test_util.h"

namespace mhar::test {
namespace {

class ScratchWatcher final : public ForwardingBackend {
 public:
  using ForwardingBackend::ForwardingBackend;

  // Every field counts, so that a model giving the wrong value for any of them would get
  // a different size than the one recomputed from the expected shapes.
  size_t op_scratch_bytes(const OpScratchShapes& s) const override {
    asked.push_back(s);
    return 256 * size_t(1 + s.batch + 3 * s.seq_len + 5 * s.d_model + 7 * s.heads +
                        11 * s.kv_heads + 13 * s.head_dim + 17 * s.routing.sources +
                        19 * s.routing.sites + 23 * s.routing.block + 29 * s.routing_heads +
                        31 * s.mix_tile_sites + 37 * s.backward_tile_slots +
                        41 * s.hyper_streams + 43 * s.hyper_dynamic);
  }
  OpScratch bind_op_scratch(const OpScratch& s) override {
    OpScratch previous = bound;
    bound = s;
    ++binds;
    return previous;
  }
  // The depth tiles a tiling backend would ask for (the CPU reference runs them untiled),
  // so that the scheme's tile counts reach the shapes.
  int routing_tile_sites(const RoutingLayout& lay, int64_t, int) const override {
    return lay.block == 1 ? 3 : 1;
  }
  // Tiles of 3 (ForwardingBackend's plan would be the CPU's: no tiles).
  std::vector<int> routing_tile_plan(const RoutingLayout& lay, int64_t d,
                                     int heads) const override {
    return Backend::routing_tile_plan(lay, d, heads);
  }
  int routing_backward_tile_slots(const RoutingLayout&, int64_t, int) const override { return 2; }

  // What is bound while ops run: the model's own ops (through matmul, the norms' backward)
  // and each scheme's.
  void matmul(Tensor c, Tensor a, Tensor b, bool ta, bool tb, bool acc) override {
    if (fail_matmul) throw std::runtime_error("planted failure");
    see();
    ForwardingBackend::matmul(c, a, b, ta, tb, acc);
  }
  void rmsnorm_backward(Tensor dx, Tensor dw, Tensor dy, Tensor x, Tensor w, Tensor r,
                        bool acc) override {
    see();
    ForwardingBackend::rmsnorm_backward(dx, dw, dy, x, w, r, acc);
  }
  void attention_backward(Tensor dq, Tensor dk, Tensor dv, Tensor dout, Tensor q, Tensor k,
                          Tensor v, Tensor out, Tensor lse) override {
    see();
    ForwardingBackend::attention_backward(dq, dk, dv, dout, q, k, v, out, lse);
  }
  void routing_mix(Tensor x, Tensor w, Tensor h, const RoutingLayout& lay, int site,
                   int heads) override {
    see();
    ForwardingBackend::routing_mix(x, w, h, lay, site, heads);
  }
  void routing_source_backward(Tensor dv, Tensor w, Tensor ub, Tensor gs,
                               const std::vector<Tensor>& dx, Tensor x, Tensor v, Tensor r,
                               const RoutingParams& p, const RoutingLayout& lay, int i,
                               int heads) override {
    see();
    ForwardingBackend::routing_source_backward(dv, w, ub, gs, dx, x, v, r, p, lay, i, heads);
  }
  void hyper_update_backward(Tensor din, Tensor dv, Tensor dAr, Tensor dB, Tensor dout, Tensor in,
                             Tensor v, Tensor Ar, Tensor B) override {
    see();
    ForwardingBackend::hyper_update_backward(din, dv, dAr, dB, dout, in, v, Ar, B);
  }
  void hyper_dynamic_coef_backward(Tensor dH, Tensor dW, Tensor dAm, Tensor dAr, Tensor dB,
                                   Tensor dsa, Tensor dsb, Tensor dC, Tensor H, Tensor W, Tensor T,
                                   Tensor rstd, Tensor sa, Tensor sb) override {
    see();
    ForwardingBackend::hyper_dynamic_coef_backward(dH, dW, dAm, dAr, dB, dsa, dsb, dC, H, W, T,
                                                   rstd, sa, sb);
  }

  mutable std::vector<OpScratchShapes> asked;
  OpScratch bound;
  int binds = 0;
  std::vector<OpScratch> seen;  // the binding at each watched op since the last clear
  bool fail_matmul = false;

 private:
  void see() { seen.push_back(bound); }
};

// The activation plan's buffer of that name, or fails the test.
const MemoryPlan::Buffer* plan_buffer(const Model& m, const std::string& name) {
  for (const auto& b : m.activation_plan().buffers())
    if (b.name == name) return &b;
  ADD_FAILURE() << "no activation buffer named " << name;
  return nullptr;
}

// Where the model's scratch buffer is: the activation arena's base (found through the
// history, a public view of the same arena) plus the buffer's planned offset.
const void* scratch_address(const Model& m) {
  const MemoryPlan::Buffer* history = plan_buffer(m, "history");
  const MemoryPlan::Buffer* scratch = plan_buffer(m, "backend.scratch");
  if (!history || !scratch) return nullptr;
  const char* base = static_cast<const char*>(m.history().data) - history->offset;
  return base + scratch->offset;
}

bool same_shapes(const OpScratchShapes& a, const OpScratchShapes& b) {
  return a.batch == b.batch && a.seq_len == b.seq_len && a.d_model == b.d_model &&
         a.heads == b.heads && a.kv_heads == b.kv_heads && a.head_dim == b.head_dim &&
         a.routing == b.routing && a.routing_heads == b.routing_heads &&
         a.mix_tile_sites == b.mix_tile_sites && a.backward_tile_slots == b.backward_tile_slots &&
         a.hyper_streams == b.hyper_streams && a.hyper_dynamic == b.hyper_dynamic;
}

struct ModeCase {
  const char* name;
  ResidualMode mode;
  int heads, block_size;
  bool dynamic;
  friend void PrintTo(const ModeCase& c, std::ostream* os) { *os << c.name; }
};

Config mode_config(const ModeCase& mc) {
  Config c = tiny_config(mc.mode, mc.heads, true, mc.block_size);
  c.residual.hyper_dynamic = mc.dynamic;
  return c;
}

// The shapes a model of config c with batch B, seq_len T must report.
OpScratchShapes expected_shapes(const Config& c, int B, int T) {
  OpScratchShapes s;
  s.batch = B;
  s.seq_len = T;
  s.d_model = c.model.d_model;
  s.heads = c.model.n_heads;
  s.kv_heads = c.model.n_kv_heads;
  s.head_dim = c.model.head_dim;
  const int S = c.model.n_sites();
  switch (c.residual.mode) {
    case ResidualMode::AttnRes:
    case ResidualMode::Mhar: {
      s.routing = RoutingLayout::blocks(S, c.residual.routing_block());
      s.routing_heads = c.residual.heads;
      const bool full = s.routing.block == 1;  // ScratchWatcher's tiles
      s.mix_tile_sites = full ? 3 : 1;
      s.backward_tile_slots = 2;
      break;
    }
    case ResidualMode::Delta:
      s.routing = RoutingLayout::blocks(S, c.residual.delta_block());
      s.routing_heads = c.residual.heads;
      s.backward_tile_slots = 2;  // its closed slots' backward tiles
      break;
    case ResidualMode::Hyper:
      s.hyper_streams = c.residual.hyper_n;
      s.hyper_dynamic = c.residual.hyper_dynamic;
      break;
    case ResidualMode::Standard: break;
  }
  return s;
}

// A model of the mode, built on a watcher of the CPU backend.
class OpScratchPlan : public ::testing::TestWithParam<ModeCase> {
 protected:
  static constexpr int B = 2, T = 5;
  const Config c = mode_config(GetParam());
  std::unique_ptr<Backend> cpu = make_cpu_backend(DType::F32);
  ScratchWatcher be{*cpu};
  Model m{c.model, c.residual, be, B, T};
};

TEST_P(OpScratchPlan, PlannedAtTheReportedSizeAndListedInTheMemoryReport) {
  const OpScratchShapes want = expected_shapes(c, B, T);
  ASSERT_EQ(be.asked.size(), 1u);
  EXPECT_TRUE(same_shapes(be.asked[0], want));
  const size_t bytes = be.op_scratch_bytes(want);
  const MemoryPlan::Buffer* buf = plan_buffer(m, "backend.scratch");
  ASSERT_NE(buf, nullptr);
  EXPECT_EQ(buf->bytes, bytes);
  // Whole-step: its bytes are shared with no other buffer (allocator.h's lifetimes).
  EXPECT_EQ(buf->first, 0);
  EXPECT_EQ(buf->last, Timeline{c.model.n_layers}.last());
  const std::string report = m.memory_report();
  EXPECT_NE(report.find("op scratch"), std::string::npos) << report;
  EXPECT_NE(report.find(format_bytes(bytes)), std::string::npos) << report;
  EXPECT_EQ(be.binds, 0);  // nothing bound before a pass
}

TEST_P(OpScratchPlan, BoundAroundEveryPassAndOnlyThen) {
  randomize_weights(m, 3);
  std::vector<int32_t> tokens, targets;
  random_tokens(B * T, c.model.vocab_size, 4, tokens, targets);
  const void* at = scratch_address(m);
  ASSERT_NE(at, nullptr);
  const size_t bytes = plan_buffer(m, "backend.scratch")->bytes;
  const OpScratchShapes want = expected_shapes(c, B, T);
  auto expect_bound_to_m = [&](const char* pass) {
    ASSERT_FALSE(be.seen.empty()) << pass;
    for (const auto& s : be.seen) {
      EXPECT_EQ(s.memory.data, at) << pass;
      EXPECT_EQ(s.memory.bytes(), bytes) << pass;
      EXPECT_TRUE(same_shapes(s.shapes, want)) << pass;
    }
    EXPECT_EQ(be.bound.memory.data, nullptr) << pass << ": still bound after the pass";
    be.seen.clear();
  };
  for (int step = 0; step < 2; ++step) {
    m.forward(tokens.data(), targets.data(), 1.0);
    expect_bound_to_m("forward");
    m.backward();
    expect_bound_to_m("backward");
  }
  EXPECT_EQ(be.binds, 8);  // bind and restore, per pass
}

INSTANTIATE_TEST_SUITE_P(
    Modes, OpScratchPlan,
    ::testing::Values(ModeCase{"standard", ResidualMode::Standard, 0, 0, false},
                      ModeCase{"attnres", ResidualMode::AttnRes, 1, 0, false},
                      ModeCase{"mhar", ResidualMode::Mhar, 2, 0, false},
                      ModeCase{"block_mhar", ResidualMode::Mhar, 2, 2, false},
                      ModeCase{"hyper", ResidualMode::Hyper, 0, 0, false},
                      ModeCase{"hyper_dynamic", ResidualMode::Hyper, 0, 0, true},
                      ModeCase{"delta", ResidualMode::Delta, 2, 0, false}),
    [](const ::testing::TestParamInfo<ModeCase>& i) { return std::string(i.param.name); });

// Two models on one backend, their passes interleaved: each pass runs on its own model's
// scratch (a binding per backend, made when a model is built, would have left A's ops on
// B's smaller buffer), and A's results are those of A alone.
TEST(OpScratch, ModelsSharingABackendEachRunOnTheirOwn) {
  const Config c = tiny_config(ResidualMode::Mhar, 2);
  auto cpu = make_cpu_backend(DType::F32);
  ScratchWatcher be(*cpu);
  Model a(c.model, c.residual, be, 2, 5), b(c.model, c.residual, be, 1, 3);
  randomize_weights(a, 5);
  randomize_weights(b, 6);
  ASSERT_GT(plan_buffer(a, "backend.scratch")->bytes, plan_buffer(b, "backend.scratch")->bytes);
  std::vector<int32_t> ta, ya, tb, yb;
  random_tokens(10, c.model.vocab_size, 7, ta, ya);
  random_tokens(3, c.model.vocab_size, 8, tb, yb);

  a.zero_grads();
  const double alone = a.forward(ta.data(), ya.data(), 1.0);
  a.backward();
  const auto grads_alone = download(be, a.all_gradients());
  be.seen.clear();

  auto on = [&](const Model& m, const char* pass) {
    ASSERT_FALSE(be.seen.empty()) << pass;
    for (const auto& s : be.seen) EXPECT_EQ(s.memory.data, scratch_address(m)) << pass;
    be.seen.clear();
  };
  a.zero_grads();
  const double interleaved = a.forward(ta.data(), ya.data(), 1.0);
  on(a, "A forward");
  b.forward(tb.data(), yb.data(), 1.0);
  on(b, "B forward");
  a.backward();
  on(a, "A backward");
  b.backward();
  on(b, "B backward");
  EXPECT_EQ(interleaved, alone);
  EXPECT_EQ(download(be, a.all_gradients()), grads_alone);
}

// Decoding re-plans the activations for each new chunk length: the scratch is planned
// again for that length and bound for the pass.
TEST(OpScratch, DecodeBindsTheScratchPlannedForItsChunk) {
  const Config c = tiny_config(ResidualMode::Mhar, 2);
  auto cpu = make_cpu_backend(DType::F32);
  ScratchWatcher be(*cpu);
  Model m(c.model, c.residual, be, 1, 5);
  randomize_weights(m, 9);
  m.enable_kv_cache(c.model.context_length);
  const std::vector<int32_t> tokens = {1, 2, 3, 4, 5, 6};
  for (int count : {5, 1}) {
    be.seen.clear();
    m.forward_cached(tokens.data() + (count == 5 ? 0 : 5), count);
    const OpScratchShapes want = expected_shapes(c, 1, count);
    EXPECT_TRUE(same_shapes(be.asked.back(), want)) << count;
    EXPECT_EQ(plan_buffer(m, "backend.scratch")->bytes, be.op_scratch_bytes(want)) << count;
    ASSERT_FALSE(be.seen.empty());
    for (const auto& s : be.seen) {
      EXPECT_EQ(s.memory.data, scratch_address(m)) << count;
      EXPECT_TRUE(same_shapes(s.shapes, want)) << count;
    }
    EXPECT_EQ(be.bound.memory.data, nullptr);
  }
}

// OpScratchBinding restores what it replaced: nested, and when the pass throws.
TEST(OpScratch, BindingRestoresThePreviousOneAlsoOnAThrow) {
  const Config c = tiny_config(ResidualMode::Standard);
  auto cpu = make_cpu_backend(DType::F32);
  ScratchWatcher be(*cpu);
  Model m(c.model, c.residual, be, 2, 5);
  float outer_mem[4] = {}, inner_mem[4] = {};
  const Backend::OpScratch outer{Tensor(outer_mem, DType::F32, {4}), OpScratchShapes{}};
  const Backend::OpScratch inner{Tensor(inner_mem, DType::F32, {4}), OpScratchShapes{}};
  {
    const OpScratchBinding o(be, outer);
    EXPECT_EQ(be.bound.memory.data, outer_mem);
    {
      const OpScratchBinding i(be, inner);
      EXPECT_EQ(be.bound.memory.data, inner_mem);
    }
    EXPECT_EQ(be.bound.memory.data, outer_mem);
    std::vector<int32_t> tokens, targets;
    random_tokens(10, c.model.vocab_size, 1, tokens, targets);
    be.fail_matmul = true;
    EXPECT_THROW(m.forward(tokens.data(), targets.data(), 1.0), std::runtime_error);
    EXPECT_EQ(be.bound.memory.data, outer_mem);  // the model's binding is gone
  }
  EXPECT_EQ(be.bound.memory.data, nullptr);
}

}  // namespace
}  // namespace mhar::test
