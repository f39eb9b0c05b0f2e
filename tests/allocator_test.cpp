// allocator_test.cpp: the memory planner never lets two simultaneously live tensors
// share a byte, does reuse memory across layers, and reports bytes per category.
#include <gtest/gtest.h>

#include <random>

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
  for (auto mode : {ResidualMode::Standard, ResidualMode::Mhar}) {
    Config c = test::tiny_config(mode, mode == ResidualMode::Mhar ? 2 : 0);
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

}  // namespace
