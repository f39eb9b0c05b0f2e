// op_profile_test.cpp: the op profiler (engine/op_profile.h) over one training step of a
// tiny model on the CPU backend (host clock):
// - every op the step runs is counted in its family: the matmul count and FLOPs follow
//   from the model's shapes (forward: one matmul per weight matrix or stack of them,
//   [q; k; v] and [gate; up], 2 N K M FLOPs each;
//   backward: two of the same size per forward matmul, input and weight gradient);
// - the attention FLOPs are the causal count of the config's shapes;
// - the families' times add up to no more than the step's wall time;
// - the "by op" and "by product" splits add up to their families;
// - an unarmed profiler records nothing, and the results are the plain backend's.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>

#include "engine/communicator.h"
#include "engine/forwarding_backend.h"
#include "engine/backend.h"
#include "engine/model.h"
#include "engine/op_profile.h"
#include "engine/optimizer.h"
#include "engine/train_step.h"
#include "tests/model_test_util.h"

namespace mhar::test {
namespace {

double step_loss(Model& model, const Config& cfg, OpProfiler* prof) {
  AdamWOptimizer opt(model, cfg.train, 0);
  auto comm = make_single_communicator();
  TrainStep step(model, opt, *comm, cfg.train, 1);
  std::vector<int32_t> tok, tgt;
  random_tokens(model.batch() * model.seq_len(), cfg.model.vocab_size, 4, tok, tgt);
  const auto batch = [&](int32_t* x, int32_t* y) {
    std::copy(tok.begin(), tok.end(), x);
    std::copy(tgt.begin(), tgt.end(), y);
  };
  if (prof) prof->begin_step();
  const auto t0 = std::chrono::steady_clock::now();
  const double loss = step.run(0, batch).loss;
  if (prof) prof->finish_step(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
  return loss;
}

TEST(OpProfiler, CountsEveryOpOfAStepWithItsWork) {
  for (ResidualMode mode : {ResidualMode::Standard, ResidualMode::Mhar, ResidualMode::Delta}) {
    SCOPED_TRACE(residual_mode_name(mode));
    const bool routed = mode != ResidualMode::Standard;
    const Config cfg = tiny_config(mode, routed ? 2 : 0);
    const ModelConfig& m = cfg.model;
    auto cpu = make_cpu_backend(DType::F64);
    OpProfiler prof(*cpu);
    const int B = 2, T = 5;
    Model model(m, cfg.residual, prof, B, T);
    model.init_weights(3);
    step_loss(model, cfg, &prof);
    ASSERT_EQ(prof.steps(), 1);

    const double N = B * T, L = m.n_layers, d = m.d_model;
    const double per_layer = d * m.q_dim() + 2 * d * m.kv_dim() + m.q_dim() * d + 3 * d * m.d_ff;
    const double matrices = L * per_layer + double(m.vocab_size) * d;  // + the (tied) LM head
    const OpFamilyTotals& mm = prof.totals(OpFamily::Matmul);
    const double products_per_layer = 6;  // q, k, v, o, [gate; up], down
    EXPECT_EQ(mm.calls, int64_t(3 * (products_per_layer * L + 1)));
    EXPECT_DOUBLE_EQ(mm.work, 3 * 2 * N * matrices);
    const double attn = L * 4 * B * m.n_heads * double(T) * T * m.head_dim / 2;
    EXPECT_EQ(prof.totals(OpFamily::AttentionForward).calls, int64_t(L));
    EXPECT_DOUBLE_EQ(prof.totals(OpFamily::AttentionForward).work, attn);
    EXPECT_DOUBLE_EQ(prof.totals(OpFamily::AttentionBackward).work, 2.5 * attn);
    for (OpFamily f : {OpFamily::Norms, OpFamily::Rope, OpFamily::Swiglu, OpFamily::Embedding, OpFamily::Classifier,
                       OpFamily::Optimizer})
      EXPECT_GT(prof.totals(f).calls, 0) << op_family_name(f);
    EXPECT_EQ(prof.totals(OpFamily::Routing).calls > 0, routed);

    const nlohmann::json r = prof.report(989, 4.3);
    double ops = 0;
    for (const auto& f : r["families"]) ops += f["ms"].get<double>();
    EXPECT_LE(ops, r["wall_ms"].get<double>());
    EXPECT_NEAR(r["other_ms"].get<double>(), r["wall_ms"].get<double>() - ops, 1e-9);
    EXPECT_NE(prof.table(989, 4.3).find("matmul"), std::string::npos);

    // Every family split by op: each family's calls and time are its ops' sums; the
    // routing's mix is an op of the routed modes only; delta's sites j >= 1 run their
    // whole forward as one routing op, one call each (its site 0 runs the mix itself);
    // mhar's sites (untiled on the CPU) each mix with their consumer's norm, one op.
    for (const auto& f : r["families"]) {
      double calls = 0, ms = 0;
      for (const auto& op : r["ops"])
        if (op["family"] == f["family"]) calls += op["calls"].get<double>(), ms += op["ms"].get<double>();
      EXPECT_EQ(calls, f["calls"].get<double>()) << f["family"];
      EXPECT_NEAR(ms, f["ms"].get<double>(), 1e-9 * std::max(1.0, ms)) << f["family"];
    }
    bool mix = false;
    double site_forward_calls = 0, mix_norm_calls = 0;
    for (const auto& op : r["ops"]) {
      if (op["family"] != "routing") continue;
      mix |= op["op"] == "routing_mix" || op["op"] == "routing_mix_rmsnorm";
      if (op["op"] == "delta_site_forward") site_forward_calls += op["calls"].get<double>();
      if (op["op"] == "routing_mix_rmsnorm") mix_norm_calls += op["calls"].get<double>();
    }
    EXPECT_EQ(mix, routed);
    EXPECT_EQ(site_forward_calls, mode == ResidualMode::Delta ? double(m.n_sites() - 1) : 0.0);
    EXPECT_EQ(mix_norm_calls, mode == ResidualMode::Mhar ? double(m.n_sites()) : 0.0);
    EXPECT_NE(prof.table(989, 4.3).find("rmsnorm_backward"), std::string::npos);

    // The matmul family split by product: every call and FLOP lands in exactly one
    // product, slowest first; the q projection's forward is one of them, by its shape.
    double product_calls = 0, product_ms = 0;
    double last_ms = INFINITY;
    for (const auto& p : r["matmul_products"]) {
      product_calls += p["calls"].get<double>();
      product_ms += p["ms"].get<double>();
      EXPECT_LE(p["ms"].get<double>(), last_ms);
      last_ms = p["ms"].get<double>();
    }
    EXPECT_EQ(product_calls, double(mm.calls));
    EXPECT_NEAR(product_ms, mm.ms, 1e-9 * std::max(1.0, mm.ms));
    const std::string o_forward = "C[" + std::to_string(B * T) + "," + std::to_string(m.d_model) +
                                  "] = A[" + std::to_string(B * T) + "," + std::to_string(m.q_dim()) +
                                  "] B[" + std::to_string(m.d_model) + "," +
                                  std::to_string(m.q_dim()) + "]^T";
    bool found = false;
    for (const auto& p : r["matmul_products"]) found |= p["product"].get<std::string>() == o_forward;
    EXPECT_TRUE(found) << o_forward << " in " << r["matmul_products"].dump();
    EXPECT_NE(prof.table(989, 4.3).find(o_forward), std::string::npos);

    // Unarmed, it only forwards: nothing more is counted, and the step computes what the
    // plain backend computes.
    const int64_t calls = mm.calls;
    auto plain = make_cpu_backend(DType::F64);
    Model a(m, cfg.residual, *plain, B, T), b(m, cfg.residual, prof, B, T);
    a.init_weights(5);
    b.init_weights(5);
    EXPECT_EQ(step_loss(a, cfg, nullptr), step_loss(b, cfg, nullptr));
    EXPECT_EQ(prof.totals(OpFamily::Matmul).calls, calls);
  }
}

// A CPU backend that asks for backward depth tiles of 2 (the CPU runs them untiled: the
// same results), so that the layer loop's tile calls reach the profiler.
class TilingCpu final : public ForwardingBackend {
 public:
  using ForwardingBackend::ForwardingBackend;
  int routing_backward_tile_slots(const RoutingLayout&, int64_t, int) const override { return 2; }
};

// The routing bytes a backward depth tile changes, in a block layout (blocks of 2
// sublayers, 5 slots: closed 0, 2, 4, partial 1, 3; one tile, slots 2 and 0): the tile's
// first call counts 3 rows more (the older slot's row, and its fp32 partial written: two
// rows' bytes), and the older slot counts its 2 sites before the tile plus its partial
// read (2 rows' bytes) in place of all 5 of its sites. The partial slot between them
// (block routing's slot 1, a plain call) counts as it would untiled. So the tiled step
// counts 3 + (2 + 2) - 5 = 2 rows more than the untiled one, for delta and for block mhar.
TEST(OpProfiler, BackwardTilesOfBlockLayoutsCountTheOlderSlotsNewSitesOnly) {
  for (ResidualMode mode : {ResidualMode::Delta, ResidualMode::Mhar}) {
    SCOPED_TRACE(residual_mode_name(mode));
    // delta: block_layers 1 (blocks of 2 sublayers); mhar: routing block_size 2.
    const Config cfg = tiny_config(mode, 2, true, mode == ResidualMode::Mhar ? 2 : 0);
    ASSERT_EQ(cfg.model.n_sites(), 5);
    const int B = 2, T = 5;
    double routing_bytes[2] = {0, 0};
    for (int tiled = 0; tiled < 2; ++tiled) {
      auto cpu = make_cpu_backend(DType::F64);
      TilingCpu tiling(*cpu);
      OpProfiler prof(tiled ? static_cast<Backend&>(tiling) : *cpu);
      Model model(cfg.model, cfg.residual, prof, B, T);
      model.init_weights(3);
      step_loss(model, cfg, &prof);
      routing_bytes[tiled] = prof.totals(OpFamily::Routing).work;
    }
    const double row = double(B * T) * cfg.model.d_model * dtype_size(DType::F64);
    EXPECT_DOUBLE_EQ(routing_bytes[1] - routing_bytes[0], 2 * row);
  }
}

}  // namespace
}  // namespace mhar::test
