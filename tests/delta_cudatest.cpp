// delta_cudatest.cpp: residual.mode delta on the CUDA backend (cuda/delta.cu) against the
// CPU reference (engine/cpu/delta.h), and the conversion identity on the GPU.
// - delta_gate (bf16 x = base + alpha r): one bf16 rounding of the output, kTolBf16Output;
//   with alpha = 0 the output is base bit for bit.
// - delta_gate_backward: dr = alpha dx, one bf16 rounding (kTolBf16Output); dalpha (fp32
//   "+="): the CPU sums in fp64, the GPU in fp32 over a fixed grid (each thread a strided
//   run of at most ceil(n / (blocks * 256)) terms, then two 32-way and one
//   blocks-way tree). A sum of m terms in fp32 is off by at most m * 2^-24 * sum |terms|
//   (Higham), so the bound is (run + 32 + 32 + 1024) * 2^-24 * sum |dx r| (+ the rounding
//   of the "+=" to fp32); the same inputs twice must give the same bits (no atomics).
// - delta_null_forward: a copy, exact. delta_null_backward (fp32 "+="): per column a run
//   of ceil(N / slabs) rows then the slabs in order: bound (N/slabs + 1 + slabs) * 2^-24 *
//   sum_n |dout[n, c]| per column; deterministic.
// - The identity, on real text (the bytes of the repo's DESIGN.md as token ids, vocab 256):
//   a standard model and a delta model holding the same bf16 weights, the delta gates 0
//   (queries, gains and null random, so the gated-off term is not 0), give the same loss
//   and logits bit for bit (max |logit difference| = 0).
#include <gtest/gtest.h>

#include <algorithm>
#include <fstream>
#include <iterator>

#include "engine/config.h"
#include "engine/model.h"
#include "tests/cuda_test_util.h"
#include "tests/model_test_util.h"

namespace mhar::cuda {
int grid_stride_blocks(int64_t work_items, int threads);  // cuda/device.cu: the grid delta.cu uses
}

namespace mhar::test {
namespace {

class DeltaParity : public CudaParity {};

TEST_F(DeltaParity, GateForwardAndBackward) {
  for (int64_t n : {int64_t(1), int64_t(4097), int64_t(3000017)}) {
    const std::string tag = " n" + std::to_string(n);
    Pair base = random_pair(DType::BF16, {n}), r = random_pair(DType::BF16, {n});
    Pair dx = random_pair(DType::BF16, {n}), alpha = random_pair(DType::BF16, {1}, 0.5);
    Pair x = pair(DType::BF16, {n}), dr = pair(DType::BF16, {n});
    Pair dalpha = random_pair(DType::F32, {1});
    Buffer scratch_c(*cpu, DType::F32, {64, 16}), scratch_g(*gpu, DType::F32, {64, 16});
    x.g.poison();
    cpu->delta_gate(x.c, base.c, alpha.c, r.c);
    gpu->delta_gate(x.g, base.g, alpha.g, r.g);
    expect_close("delta_gate bf16" + tag, x.g, x.c, kTolBf16Output);

    dr.g.poison();
    const double da0 = dalpha.c.get()[0];
    cpu->delta_gate_backward(dr.c, dalpha.c, dx.c, r.c, alpha.c, scratch_c);
    gpu->delta_gate_backward(dr.g, dalpha.g, dx.g, r.g, alpha.g, scratch_g);
    expect_close("delta_gate_backward dr bf16" + tag, dr.g, dr.c, kTolBf16Output);
    const auto vdx = dx.c.get(), vr = r.c.get();
    double abs_sum = 0;
    for (size_t i = 0; i < vdx.size(); ++i) abs_sum += std::fabs(vdx[i] * vr[i]);
    const double blocks = double(std::min<int64_t>({cuda::grid_stride_blocks(n, 256), 1024, 64 * 16}));
    const double run = std::ceil(double(n) / (blocks * 256));
    const double bound = (run + 32 + 32 + blocks) * 0x1p-24 * abs_sum + 0x1p-24 * (std::fabs(da0) + abs_sum);
    const double got = dalpha.g.get()[0], ref = dalpha.c.get()[0];
    std::printf("PARITY %-48s abs_err %.3e  bound %.3e\n", ("delta_gate_backward dalpha" + tag).c_str(),
                std::fabs(got - ref), bound);
    EXPECT_LE(std::fabs(got - ref), bound) << n;
    // Deterministic: the same inputs again give the same bits.
    Pair dalpha2 = pair(DType::F32, {1});
    dalpha2.set({da0});
    gpu->delta_gate_backward(dr.g, dalpha2.g, dx.g, r.g, alpha.g, scratch_g);
    EXPECT_EQ(dalpha2.g.get()[0], got) << n;
  }
  // alpha = 0: x is base exactly.
  const int64_t n = 100003;
  Pair base = random_pair(DType::BF16, {n}), r = random_pair(DType::BF16, {n}, 100.0);
  Pair zero = pair(DType::BF16, {1}), x = pair(DType::BF16, {n});
  zero.set({0.0});
  x.g.poison();
  gpu->delta_gate(x.g, base.g, zero.g, r.g);
  EXPECT_EQ(x.g.get(), base.g.get());
}

TEST_F(DeltaParity, NullBroadcastAndTokenSum) {
  for (auto [N, d] : {std::pair<int64_t, int64_t>{1, 16}, {4096, 1280}, {1000, 300}}) {
    const std::string tag = " " + std::to_string(N) + "x" + std::to_string(d);
    Pair row = random_pair(DType::BF16, {d}), out = pair(DType::BF16, {N, d});
    out.g.poison();
    cpu->delta_null_forward(out.c, row.c);
    gpu->delta_null_forward(out.g, row.g);
    EXPECT_EQ(out.g.get(), out.c.get()) << tag;  // a copy: exact

    Pair dout = random_pair(DType::BF16, {N, d}), drow = random_pair(DType::F32, {d});
    Buffer scratch_c(*cpu, DType::F32, {64, d}), scratch_g(*gpu, DType::F32, {64, d});
    const auto before = drow.c.get();
    cpu->delta_null_backward(drow.c, dout.c, scratch_c);
    gpu->delta_null_backward(drow.g, dout.g, scratch_g);
    const auto got = drow.g.get(), ref = drow.c.get(), vd = dout.c.get();
    const double slabs = double(std::min<int64_t>(64, N)), run = std::ceil(double(N) / slabs);
    int64_t over = 0;
    double worst = 0;
    for (int64_t c = 0; c < d; ++c) {
      double abs_sum = 0;
      for (int64_t i = 0; i < N; ++i) abs_sum += std::fabs(vd[size_t(i * d + c)]);
      const double bound = (run + 1 + slabs) * 0x1p-24 * abs_sum +
                           0x1p-24 * (std::fabs(before[size_t(c)]) + abs_sum);
      const double e = std::fabs(got[size_t(c)] - ref[size_t(c)]);
      worst = std::max(worst, e / bound);
      if (!(e <= bound)) ++over;
    }
    std::printf("PARITY %-48s worst err/bound %.3f\n", ("delta_null_backward" + tag).c_str(), worst);
    EXPECT_EQ(over, 0) << tag;
    Pair drow2 = pair(DType::F32, {d});
    drow2.set(before);
    gpu->delta_null_backward(drow2.g, dout.g, scratch_g);
    EXPECT_EQ(drow2.g.get(), got) << tag << ": not deterministic";
  }
}

Config gpu_config(const std::string& mode) {
  nlohmann::json j = {
      {"model", {{"vocab_size", 256}, {"d_model", 128}, {"n_layers", 4}, {"n_heads", 4},
                 {"n_kv_heads", 2}, {"head_dim", 64}, {"d_ff", 256}, {"context_length", 128},
                 {"rope_theta", 10000.0}, {"tie_embeddings", true}}},
      {"residual", {{"mode", mode}}},
      {"train", {{"micro_batch", 2}, {"seq_len", 96}, {"warmup_steps", 0}}}};
  if (mode == "delta") j["residual"]["block_layers"] = 2;  // closed and partial blocks
  return config_from_json(j, "delta_cudatest");
}

TEST(DeltaGpuIdentity, ZeroGatesGiveTheStandardLogitsExactlyOnRealText) {
  if (cuda::device_count() == 0) GTEST_SKIP() << "no CUDA device";
  std::ifstream in(std::string(MHAR_SOURCE_DIR) + "/DESIGN.md", std::ios::binary);
  const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const Config s = gpu_config("standard"), dc = gpu_config("delta");
  const int B = s.train.micro_batch, T = s.train.seq_len, N = B * T;
  ASSERT_GT(text.size(), size_t(8 * N + 1));
  auto gpu = make_cuda_backend(0);
  Model ms(s.model, s.residual, *gpu, B, T), md(dc.model, dc.residual, *gpu, B, T);
  ms.init_weights(5);
  md.init_weights(5);
  randomize_weights(ms, 6);  // larger than the init: every path carries signal
  copy_weights(ms, md);      // the same bf16 values
  std::mt19937_64 rng(8);
  std::normal_distribution<double> nd;
  for (auto& p : md.parameters()) {
    if (p.name.rfind("model.delta.", 0) != 0 || p.name.find(".alpha") != std::string::npos) continue;
    std::vector<double> v(size_t(p.value.numel()));
    for (double& x : v) x = (p.init == Init::One ? 1.0 : 0.0) + 0.5 * nd(rng);
    gpu->upload(p.value, v.data());
  }
  double worst = 0;
  for (int batch = 0; batch < 8; ++batch) {
    std::vector<int32_t> tok(static_cast<size_t>(N)), tgt(static_cast<size_t>(N));
    for (int i = 0; i < N; ++i) {
      tok[size_t(i)] = int32_t(uint8_t(text[size_t(batch * N + i)]));
      tgt[size_t(i)] = int32_t(uint8_t(text[size_t(batch * N + i + 1)]));
    }
    const double ls = ms.forward(tok.data(), tgt.data(), 0.0);
    const double ld = md.forward(tok.data(), tgt.data(), 0.0);
    EXPECT_EQ(ls, ld) << "batch " << batch;
    const auto xs = download(*gpu, ms.logits()), xd = download(*gpu, md.logits());
    for (size_t i = 0; i < xs.size(); ++i) worst = std::max(worst, std::fabs(xs[i] - xd[i]));
  }
  std::printf("DELTA_IDENTITY gpu: max |logit difference| over 8 batches of %d x %d bytes of DESIGN.md: %g\n",
              B, T, worst);
  EXPECT_EQ(worst, 0.0);
  // An open gate changes the logits (the routed term is live on the GPU).
  const double alpha = 0.5;
  gpu->upload(md.parameter("model.delta.5.alpha").value, &alpha);
  std::vector<int32_t> tok(static_cast<size_t>(N)), tgt(static_cast<size_t>(N));
  for (int i = 0; i < N; ++i) tok[size_t(i)] = int32_t(uint8_t(text[size_t(i)])), tgt[size_t(i)] = int32_t(uint8_t(text[size_t(i + 1)]));
  EXPECT_NE(ms.forward(tok.data(), tgt.data(), 0.0), md.forward(tok.data(), tgt.data(), 0.0));
}

}  // namespace
}  // namespace mhar::test
