// attention_timing_cudatest.cpp: the BF16 training attention at issue 13's comparison
// shapes (causal, head_dim 128, B16 T1024 and B8 T2048, 16 query / 8 KV heads), forward
// and backward through each BF16 kernel the device has (Hopper wgmma, mma.sync). Not a parity
// test (attention_cudatest.cpp is): DISABLED_, run with --gtest_also_run_disabled_tests
// (tools/gpu_check.sh). tools/reference/attention_bench.py times PyTorch's cuDNN and FA2
// attention at the same shapes with the same FLOP convention, so that one device call
// gives the ratio.
// FLOPs: forward 4 B Hq T^2 hd / 2 (two products, causal halves the pairs), backward 2.5x
// that (five products over two). Time: median over 7 rounds of the mean of 10 calls, after
// warm-up; inputs random (zeros can run faster than real data).
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <functional>
#include <vector>

#include "cuda/kernels.h"
#include "tests/cuda_test_util.h"

namespace mhar::test {
namespace {

class AttentionTiming : public CudaParity {
 protected:
  double median_ms(const std::function<void()>& op) {
    for (int i = 0; i < 3; ++i) op();
    gpu->synchronize();
    std::vector<double> rounds;
    for (int r = 0; r < 7; ++r) {
      const auto t0 = std::chrono::steady_clock::now();
      for (int i = 0; i < 10; ++i) op();
      gpu->synchronize();
      const auto t1 = std::chrono::steady_clock::now();
      rounds.push_back(std::chrono::duration<double, std::milli>(t1 - t0).count() / 10);
    }
    std::sort(rounds.begin(), rounds.end());
    return rounds[rounds.size() / 2];
  }
};

TEST_F(AttentionTiming, DISABLED_ComparisonShapes) {
  const bool had_hopper = cuda::attention_set_hopper(true);
  const int had_version = cuda::attention_set_hopper_backward(2);
  const int had_forward = cuda::attention_set_hopper_forward(2);
  const bool hopper = cuda::attention_uses_hopper();
  for (auto [B, T] : {std::pair<int64_t, int64_t>{16, 1024}, {8, 2048}}) {
    const int64_t Hq = 16, Hkv = 8, hd = 128;
    const AttentionTensors a = attention_tensors(B, T, Hq, Hkv, hd);
    const double fwd_flop = 4.0 * B * Hq * hd * double(T) * T / 2;
    const std::string shape = "B" + std::to_string(B) + " T" + std::to_string(T) + " H16/8 hd128";
    // The Hopper forward's two versions (cuda::attention_set_hopper_forward), then mma.sync.
    for (const int path : {2, 1, 0}) {
      const bool use_hopper = path > 0;
      if (use_hopper && !hopper) continue;
      cuda::attention_set_hopper(use_hopper);
      if (use_hopper) cuda::attention_set_hopper_forward(path);
      const double ms = median_ms([&] { gpu->attention_forward(a.out, a.lse, a.q, a.k, a.v); });
      std::printf("ATTENTION forward  %-8s %-22s %8.3f ms %7.1f TFLOP/s\n",
                  path == 2 ? "wgmma v2" : path == 1 ? "wgmma v1" : "mma.sync", shape.c_str(),
                  ms, fwd_flop / ms * 1e-9);
    }
    // The Hopper backward's three versions (cuda::attention_set_hopper_backward), then
    // mma.sync.
    for (const int path : {3, 2, 1, 0}) {
      const bool use_hopper = path > 0;
      if (use_hopper && !hopper) continue;
      cuda::attention_set_hopper(use_hopper);
      if (use_hopper) cuda::attention_set_hopper_backward(path);
      const double ms = median_ms([&] {
        gpu->attention_backward(a.dq, a.dk, a.dv, a.dout, a.q, a.k, a.v, a.out, a.lse);
      });
      std::printf("ATTENTION backward %-8s %-22s %8.3f ms %7.1f TFLOP/s\n",
                  path > 0 ? ("wgmma v" + std::to_string(path)).c_str() : "mma.sync",
                  shape.c_str(), ms, 2.5 * fwd_flop / ms * 1e-9);
    }
  }
  cuda::attention_set_hopper(had_hopper);
  cuda::attention_set_hopper_backward(had_version);
  cuda::attention_set_hopper_forward(had_forward);
}

}  // namespace
}  // namespace mhar::test
