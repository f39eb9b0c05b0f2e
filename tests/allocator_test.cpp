// allocator_test.cpp: the memory planner never lets two simultaneously live tensors
// share a byte, does reuse memory across layers, and reports bytes per category; routing
// (full or block) adds no more to a real model's activation plan than its statistics.
#include <gtest/gtest.h>

#include <random>
#include <set>

#include "engine/allocator.h"
#include "tests/model_test_util.h"

using namespace mhar;

namespace {

// Every pair of buffers whose lifetimes overlap must occupy disjoint byte ranges.
void expect_no_live_overlap(const MemoryPlan& plan) {
  const auto& b = plan.buffers();
  for (size_t i = 0; i < b.size(); ++i)
    for (size_t j = i + 1; j < b.size(); ++j) {
      const bool live_together = b[i].first <= b[j].last && b[j].first <= b[i].last;
      const bool bytes_overlap = b[i].bytes && b[j].bytes && b[i].offset < b[j].offset + b[j].bytes &&
                                 b[j].offset < b[i].offset + b[i].bytes;
      EXPECT_FALSE(live_together && bytes_overlap)
          << b[i].name << " [" << b[i].first << "," << b[i].last << "] @" << b[i].offset << " and "
          << b[j].name << " [" << b[j].first << "," << b[j].last << "] @" << b[j].offset;
    }
  for (const auto& x : b) {
    EXPECT_EQ(x.offset % MemoryPlan::kAlignment, 0u) << x.name;
    EXPECT_LE(x.offset + x.bytes, plan.total_bytes()) << x.name;
  }
}

TEST(MemoryPlan, RandomLifetimesNeverOverlapWhileLive) {
  std::mt19937 rng(1);
  for (int trial = 0; trial < 50; ++trial) {
    MemoryPlan plan("activations");
    for (int i = 0; i < 40; ++i) {
      int a = int(rng() % 30), b = a + int(rng() % 10);
      plan.add("t" + std::to_string(i), DType::F32, {int64_t(1 + rng() % 5000)}, a, b);
    }
    plan.plan();
    expect_no_live_overlap(plan);
    EXPECT_LE(plan.total_bytes(), plan.requested_bytes());
  }
}

TEST(MemoryPlan, DisjointLifetimesShareMemory) {
  MemoryPlan plan("activations");
  int a = plan.add("a", DType::F32, {1000}, 0, 1);
  int b = plan.add("b", DType::F32, {1000}, 2, 3);
  plan.plan();
  EXPECT_EQ(plan.buffers()[a].offset, plan.buffers()[b].offset);
  EXPECT_EQ(plan.total_bytes(), 4096u);  // one 4000-byte buffer, 256-byte aligned
}

TEST(MemoryPlan, ModelPlansAreSafeAndReuseAcrossLayers) {
  for (int block : {0, 3})
  for (auto mode : {ResidualMode::Standard, ResidualMode::Mhar, ResidualMode::Hyper,
                    ResidualMode::Delta}) {
    if (block && mode != ResidualMode::Mhar) continue;
    const bool heads = mode == ResidualMode::Mhar || mode == ResidualMode::Delta;
    Config c = test::tiny_config(mode, heads ? 2 : 0, true, block);
    c.model.n_layers = 6;
    auto be = make_cpu_backend(DType::F32);
    Model m(c.model, c.residual, *be, 4, 8);
    expect_no_live_overlap(m.activation_plan());
    // Backward scratch of different layers shares memory, so less is allocated than asked.
    EXPECT_LT(m.activation_plan().total_bytes(), m.activation_plan().requested_bytes());
    expect_no_live_overlap(m.parameter_plan());
    EXPECT_EQ(m.parameter_plan().total_bytes(), m.parameter_plan().requested_bytes());
    const std::string report = m.memory_report();
    for (const char* cat : {"parameters", "gradients", "activations"})
      EXPECT_NE(report.find(cat), std::string::npos) << report;
  }
}

// The projections that read one input are stacked ([q; k; v], [gate; up]): each member
// follows the previous one with no padding in both allocations (the stacked weight is one
// matrix for one GEMM), at shapes where kParamAlign padding would have separated them
// (F d = 320, kv_dim d = 192: not multiples of 128); every other parameter still starts
// at a multiple of kParamAlign.
TEST(MemoryPlan, StackedProjectionsAreAdjacentInBothAllocations) {
  Config c = test::tiny_config(ResidualMode::Standard);
  c.model.d_ff = 20;
  c.model.head_dim = 6;
  auto be = make_cpu_backend(DType::F32);
  Model m(c.model, c.residual, *be, 2, 4);
  const auto& params = m.parameters();
  std::vector<std::vector<std::string>> stacks;
  for (int l = 0; l < c.model.n_layers; ++l) {
    const std::string pre = "model.layers." + std::to_string(l) + ".";
    stacks.push_back({pre + "self_attn.q_proj.weight", pre + "self_attn.k_proj.weight",
                      pre + "self_attn.v_proj.weight"});
    stacks.push_back({pre + "mlp.gate_proj.weight", pre + "mlp.up_proj.weight"});
  }
  std::set<std::string> followers;
  for (const auto& names : stacks)
    for (size_t i = 1; i < names.size(); ++i) {
      const Parameter &a = m.parameter(names[i - 1]), &b = m.parameter(names[i]);
      followers.insert(b.name);
      EXPECT_EQ(b.offset, a.offset + a.value.numel()) << b.name;
      EXPECT_EQ(static_cast<const char*>(b.value.data),
                static_cast<const char*>(a.value.data) + a.value.bytes()) << b.name;
      EXPECT_EQ(static_cast<const char*>(b.grad.data),
                static_cast<const char*>(a.grad.data) + a.grad.bytes()) << b.name;
    }
  EXPECT_EQ(followers.size(), size_t(3 * c.model.n_layers));
  for (const Parameter& p : params)
    if (!followers.count(p.name)) {
      EXPECT_EQ(p.offset % Model::kParamAlign, 0) << p.name;
    }
  EXPECT_NE(m.parameter("model.layers.0.mlp.gate_proj.weight").value.numel() % Model::kParamAlign, 0)
      << "the test's shapes should need padding between unstacked parameters";
}

// At the shapes of configs/{350m,1b}_*.json: the routed activation plan is the standard
// one plus at most the routing statistics (pairs, inv_rms, ubar, key-gradient slabs);
// the site input gradients the source-stationary backward keeps must fit in memory the
// backward has freed (one [S, N, d] buffer alive from the head's backward added 3 GB at
// 1B).
TEST(MemoryPlan, RoutingAddsOnlyItsStatisticsToTheActivationPlan) {
  auto cpu = make_cpu_backend(DType::F32);
  test::PlanOnly be(*cpu);
  for (const char* size : {"350m", "1b"}) {
    const std::string dir = std::string(MHAR_SOURCE_DIR) + "/configs/";
    const Config std_cfg = load_config(dir + size + "_standard.json");
    const int B = std_cfg.train.micro_batch, T = std_cfg.train.seq_len;
    // One LM-head chunk (logits [N, V]) on both sides, so that both plans peak at the head
    // and the difference is the routing's alone; with the chunked head (the default) the
    // standard plan peaks at the head and the routed one in the last layers' backward, and
    // the difference is no longer one event's buffers.
    const int64_t one_chunk = int64_t(B) * T;
    const double standard = double(
        Model(std_cfg.model, std_cfg.residual, be, B, T, 1, one_chunk).activation_plan().total_bytes());
    for (const char* routed : {"_mhar.json", "_block_mhar.json"}) {
      const Config c = load_config(dir + size + routed);
      ASSERT_EQ(c.train.micro_batch, B);
      Model m(c.model, c.residual, be, B, T, 1, one_chunk);
      const int S = c.model.n_sites(), H = c.residual.heads;
      const double N = double(B) * T, d = c.model.d_model;
      const double stats =
          4 * (double(RoutingLayout::blocks(S, c.residual.routing_block()).pairs()) * H * N +
               S * N + S * H * N + 64.0 * S * d);
      const double got = double(m.activation_plan().total_bytes());
      std::printf("[ memory ] %s%s: activations %.3f GB, standard %.3f GB, routing statistics "
                  "%.3f GB\n", size, routed, got / 1e9, standard / 1e9, stats / 1e9);
      EXPECT_LE(got, standard + stats) << size << routed;
      EXPECT_GT(got, standard) << "the statistics take memory: the comparison is not vacuous";
    }
  }
}

// Hyper-Connections at the 350M shape: the plan is the standard one plus at most the n
// streams of every site (kept for the backward), the two stream gradients alive at once
// and the per-source gradients alive at once (v_0's, to the end, and one other), the
// site inputs and their gradients having standard's lifetimes.
TEST(MemoryPlan, HyperAddsOnlyItsStreamsToTheActivationPlan) {
  auto cpu = make_cpu_backend(DType::F32);
  test::PlanOnly be(*cpu);
  const std::string dir = std::string(MHAR_SOURCE_DIR) + "/configs/";
  const Config std_cfg = load_config(dir + "350m_standard.json");
  const int B = std_cfg.train.micro_batch, T = std_cfg.train.seq_len;
  const double standard =
      double(Model(std_cfg.model, std_cfg.residual, be, B, T).activation_plan().total_bytes());
  for (int n : {1, 4}) {
    Config c = std_cfg;
    c.residual.mode = ResidualMode::Hyper;
    c.residual.hyper_n = n;
    Model m(c.model, c.residual, be, B, T);
    expect_no_live_overlap(m.activation_plan());
    const double row = 2.0 * B * T * c.model.d_model;  // one bf16 [N, d]
    const double streams = row * n * c.model.n_sites(), extra = row * (2 * n + 2);
    const double got = double(m.activation_plan().total_bytes());
    std::printf("[ memory ] 350m hyper n=%d: activations %.3f GB, standard %.3f GB, streams %.3f GB\n",
                n, got / 1e9, standard / 1e9, streams / 1e9);
    EXPECT_LE(got, standard + streams + extra) << n;
    EXPECT_GT(got, standard + 0.9 * streams - extra) << "the streams must be planned, not aliased";
  }
}

}  // namespace
