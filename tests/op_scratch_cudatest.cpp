// op_scratch_cudatest.cpp: the CUDA backend's op temporaries come from the model's memory
// plan (Backend::op_scratch_bytes, issue 13), so that a training step allocates nothing.
// - For every residual mode whose ops take scratch (standard: attention's row dots and
//   the norms' partial sums; mhar/attnres full routing: also the routing tables, value
//   and key rows, pair split and both depth tiles; block routing and delta: untiled
//   routing; hyper static and dynamic: the coefficient partial sums), a model, its AdamW
//   optimizer and the training step of `mhar train` are built, the backend's allocation
//   count and peak are read, and three steps run (forward, backward, gradient norm,
//   optimizer update): neither may change. A model whose plan missed a temporary would
//   fail there loudly (the bound scratch's MHAR_CHECK), not allocate.
// - Two models on one backend, their passes interleaved, each on its own scratch, with
//   no allocation, and A's results those of A alone.
// - The control that makes the above mean something: the same op called without a model
//   (nothing bound) does allocate its grow-only buffer, once; and with a scratch bound that
//   is too small for the op, the op fails naming the temporary and allocates nothing.
// - Figures: the planned scratch at the shapes of configs/1b_*.json.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <memory>
#include <ostream>
#include <string>
#include <vector>

#include "cuda/cuda_backend.h"
#include "cuda/device.h"
#include "engine/allocator.h"
#include "engine/backend.h"
#include "engine/communicator.h"
#include "engine/config.h"
#include "engine/error.h"
#include "engine/model.h"
#include "engine/optimizer.h"
#include "engine/train_step.h"
#include "tests/cuda_test_util.h"
#include "tests/model_test_util.h"

namespace mhar::test {
namespace {

// d_model 256 with 4 routing heads is the routing kernels' span layout, where full routing tiles in
// depth both ways (cuda/routing_mix.cu, cuda/routing_backward_tile.cu); 4 layers give 9 sites, so
// the forward tiles hold several sites and some slots take the fused key path, others not.
Config scratch_config(const std::string& mode, int heads, int block, bool dynamic) {
  nlohmann::json j = {
      {"model", {{"vocab_size", 256}, {"d_model", 256}, {"n_layers", 4}, {"n_heads", 4},
                 {"n_kv_heads", 2}, {"head_dim", 64}, {"d_ff", 512}, {"context_length", 128},
                 {"rope_theta", 10000.0}, {"tie_embeddings", true}}},
      {"residual", {{"mode", mode}, {"heads", heads}, {"block_size", block}}},
      {"train", {{"micro_batch", 2}, {"seq_len", 80}, {"warmup_steps", 0}, {"lr", 1e-3}}}};
  if (mode == "hyper") j["residual"]["hyper_dynamic"] = dynamic;
  if (mode == "delta") {  // block names residual.block_layers here
    j["residual"]["block_size"] = 0;
    j["residual"]["block_layers"] = block;
  }
  return config_from_json(j, "op_scratch_cudatest");
}

struct ModeCase {
  const char* label;
  const char* mode;
  int heads, block;
  bool dynamic;
  friend void PrintTo(const ModeCase& c, std::ostream* os) { *os << c.label; }
};

size_t planned_scratch(const Model& m) {
  for (const auto& b : m.activation_plan().buffers())
    if (b.name == "backend.scratch") return b.bytes;
  ADD_FAILURE() << "no backend.scratch in the activation plan";
  return 0;
}

void fill_batch(const Config& c, int step, int32_t* x, int32_t* y) {
  std::vector<int32_t> tokens, targets;
  const int n = c.train.micro_batch * c.train.seq_len;
  random_tokens(n, c.model.vocab_size, 100 + uint64_t(step), tokens, targets);
  std::copy(tokens.begin(), tokens.end(), x);
  std::copy(targets.begin(), targets.end(), y);
}

class OpScratchCuda : public ::testing::TestWithParam<ModeCase> {};

TEST_P(OpScratchCuda, TrainingStepsAllocateNothing) {
  MHAR_SKIP_WITHOUT_GPU();
  const ModeCase mc = GetParam();
  const Config c = scratch_config(mc.mode, mc.heads, mc.block, mc.dynamic);
  auto gpu = make_cuda_backend(0);
  Model m(c.model, c.residual, *gpu, c.train.micro_batch, c.train.seq_len);
  randomize_weights(m, 21);  // routing queries and hyper coefficients away from their init
  AdamWOptimizer opt(m, c.train);
  opt.sync_master_from_params();
  auto single = make_single_communicator();
  TrainStep step(m, opt, *single, c.train, 1);
  const size_t scratch = planned_scratch(m);
  EXPECT_GT(scratch, 0u);  // attention's row dots at least
  EXPECT_NE(m.memory_report().find("op scratch"), std::string::npos);
  gpu->synchronize();
  const int64_t allocations = gpu->device_allocations(), peak = gpu->peak_bytes_in_use();
  ASSERT_GT(allocations, 0) << "the backend does not count its allocations";
  for (int s = 0; s < 3; ++s) {
    const StepResult r = step.run(s, [&](int32_t* x, int32_t* y) { fill_batch(c, s, x, y); });
    EXPECT_TRUE(r.good && std::isfinite(r.loss)) << mc.label << " step " << s;
  }
  gpu->synchronize();
  EXPECT_EQ(gpu->device_allocations(), allocations) << mc.label << ": a training step allocated";
  EXPECT_EQ(gpu->peak_bytes_in_use(), peak) << mc.label;
  std::printf("OP_SCRATCH %-14s planned %s of %s activations; %lld allocations, none in 3 steps\n",
              mc.label, format_bytes(scratch).c_str(),
              format_bytes(m.activation_plan().total_bytes()).c_str(),
              static_cast<long long>(allocations));
}

INSTANTIATE_TEST_SUITE_P(
    Modes, OpScratchCuda,
    ::testing::Values(ModeCase{"standard", "standard", 0, 0, false},
                      ModeCase{"attnres", "attnres", 1, 0, false},
                      ModeCase{"mhar", "mhar", 4, 0, false},
                      ModeCase{"block_mhar", "mhar", 4, 2, false},
                      ModeCase{"hyper", "hyper", 0, 0, false},
                      ModeCase{"hyper_dynamic", "hyper", 0, 0, true},
                      ModeCase{"delta", "delta", 4, 1, false}),
    [](const ::testing::TestParamInfo<ModeCase>& i) { return std::string(i.param.label); });

// A (2 x 80 tokens) and B (1 x 40) share the backend, passes interleaved. A's loss and
// gradients must be those of A alone: every kernel of this forward is deterministic
// (attention, norms, routing's span kernels and cross-entropy use no atomics; cuBLAS
// repeats its results for the same shapes on one stream), so its loss is compared to
// 1e-6 relative, a few fp32 ulps; the embedding's backward adds token rows with fp32
// atomics in any order, a relative change of order 1e-7 of the gradients, compared to
// 1e-5. A pass that ran on the other model's scratch would fail its size check (B's is
// smaller) or corrupt the depth tiles' partial sums, far beyond either bound.
TEST(OpScratchCudaShared, ModelsSharingABackendAllocateNothingAndKeepTheirResults) {
  MHAR_SKIP_WITHOUT_GPU();
  const Config c = scratch_config("mhar", 4, 0, false);
  auto gpu = make_cuda_backend(0);
  Model a(c.model, c.residual, *gpu, 2, 80), b(c.model, c.residual, *gpu, 1, 40);
  randomize_weights(a, 31);
  randomize_weights(b, 32);
  ASSERT_GT(planned_scratch(a), planned_scratch(b));
  std::vector<int32_t> xa, ya, xb, yb;
  random_tokens(160, c.model.vocab_size, 33, xa, ya);
  random_tokens(40, c.model.vocab_size, 34, xb, yb);
  gpu->synchronize();
  const int64_t allocations = gpu->device_allocations();

  a.zero_grads();
  const double alone = a.forward(xa.data(), ya.data(), 1.0);
  a.backward();
  const auto grads_alone = download(*gpu, a.all_gradients());

  a.zero_grads();
  b.zero_grads();
  const double interleaved = a.forward(xa.data(), ya.data(), 1.0);
  b.forward(xb.data(), yb.data(), 1.0);
  a.backward();
  b.backward();
  const auto grads = download(*gpu, a.all_gradients());
  gpu->synchronize();
  EXPECT_EQ(gpu->device_allocations(), allocations);
  EXPECT_NEAR(interleaved, alone, 1e-6 * std::fabs(alone));
  EXPECT_LT(rel_error(grads, grads_alone), 1e-5);
}

// attention_backward at [2, 80, 4, 64] with GQA 2 (its workspace: row dots, 2 * 80 * 4
// floats, and on Hopper 2 * 4 * 3 score-gradient tiles).
struct AttentionCall {
  Buffer q, k, v, out, dout, lse, dq, dk, dv;
  explicit AttentionCall(Backend& be)
      : q(be, DType::BF16, {2, 80, 4, 64}), k(be, DType::BF16, {2, 80, 2, 64}),
        v(be, DType::BF16, {2, 80, 2, 64}), out(be, DType::BF16, {2, 80, 4, 64}),
        dout(be, DType::BF16, {2, 80, 4, 64}), lse(be, DType::F32, {2, 4, 80}),
        dq(be, DType::BF16, {2, 80, 4, 64}), dk(be, DType::BF16, {2, 80, 2, 64}),
        dv(be, DType::BF16, {2, 80, 2, 64}) {
    std::mt19937_64 rng(41);
    for (Buffer* t : {&q, &k, &v, &dout})
      t->set(random_normal(rng, t->t().numel(), DType::BF16));
    be.attention_forward(out, lse, q, k, v);
  }
  void backward(Backend& be) { be.attention_backward(dq, dk, dv, dout, q, k, v, out, lse); }
};

TEST(OpScratchCudaControl, UnboundOpsGrowTheirOwnBuffersAndTooSmallABindingFails) {
  MHAR_SKIP_WITHOUT_GPU();
  auto gpu = make_cuda_backend(0);
  AttentionCall call(*gpu);
  gpu->synchronize();
  const int64_t before = gpu->device_allocations();
  call.backward(*gpu);  // nothing bound: the workspace's grow-only buffer
  const auto unbound = call.dq.get();
  EXPECT_EQ(gpu->device_allocations(), before + 1);
  call.backward(*gpu);  // the same shapes again: that buffer is large enough
  EXPECT_EQ(gpu->device_allocations(), before + 1);

  // Bound for the shapes of this call: the same results, no allocation.
  OpScratchShapes fits;
  fits.batch = 2, fits.seq_len = 80, fits.d_model = 256;
  fits.heads = 4, fits.kv_heads = 2, fits.head_dim = 64;
  Buffer memory(*gpu, DType::F32, {int64_t((gpu->op_scratch_bytes(fits) + 3) / 4)});
  {
    const OpScratchBinding bind(*gpu, {memory, fits});
    call.dq.poison();
    call.backward(*gpu);
    EXPECT_EQ(call.dq.get(), unbound);  // deterministic kernels: the same bits
  }
  // Bound for half the tokens: the row dots (and score-gradient tiles) do not fit; an
  // error, never an allocation.
  OpScratchShapes half = fits;
  half.seq_len = 40;
  {
    const OpScratchBinding bind(*gpu, {memory, half});
    try {
      call.backward(*gpu);
      ADD_FAILURE() << "an op needing more scratch than planned ran";
    } catch (const Error& e) {
      const std::string what = e.what();
      EXPECT_NE(what.find("attention backward row dots"), std::string::npos) << what;
    }
  }
  gpu->synchronize();
  EXPECT_EQ(gpu->device_allocations(), before + 2);  // + the bound buffer itself
}

// The planned scratch at the shapes of configs/1b_*.json (no memory: PlanOnly), for the
// record, and that it stays a small part of the activations.
TEST(OpScratchCudaFigures, PlannedScratchAt1B) {
  MHAR_SKIP_WITHOUT_GPU();
  auto gpu = make_cuda_backend(0);
  PlanOnly be(*gpu);
  for (const char* name : {"standard", "mhar", "block_mhar", "attnres", "hyper",
                           "hyper_dynamic", "delta"}) {
    const Config c = load_config(std::string(MHAR_SOURCE_DIR) + "/configs/1b_" + name + ".json");
    Model m(c.model, c.residual, be, c.train.micro_batch, c.train.seq_len);
    const size_t scratch = planned_scratch(m), total = m.activation_plan().total_bytes();
    std::printf("OP_SCRATCH 1b_%-14s %s of %s activations (%.2f%%)\n", name,
                format_bytes(scratch).c_str(), format_bytes(total).c_str(),
                100.0 * double(scratch) / double(total));
    EXPECT_GT(scratch, 0u) << name;
    EXPECT_LT(double(scratch), 0.1 * double(total)) << name;
  }
}

}  // namespace
}  // namespace mhar::test
