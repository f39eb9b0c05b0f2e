// device_cudatest.cpp: CUDA device discovery and the driver's energy counter; skipped
// when no GPU is present.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>

#include "cuda/device.h"
#include "cuda/gpu_energy.h"

TEST(CudaDevice, DiscoveryIsSafeWithoutADevice) {
  int n = mhar::cuda::device_count();
  EXPECT_GE(n, 0);
  if (n == 0) GTEST_SKIP() << "no CUDA device";
  std::string d = mhar::cuda::describe_device(0);
  EXPECT_NE(d.find("sm_"), std::string::npos) << d;
}

// The driver's energy counter (cuda/gpu_energy.h) over a second and a half of device-to-
// device copies: it must be readable where nvidia-smi is, advance, and give a mean draw
// between an idle card's and the enforced limit (the card cannot average above its limit
// over that long; 1.1x leaves room for the counter's update steps at both ends, whose
// period NVML does not document).
TEST(CudaDevice, EnergyCounterAdvancesUnderLoad) {
  if (mhar::cuda::device_count() == 0) GTEST_SKIP() << "no CUDA device";
  mhar::cuda::GpuEnergyCounter counter(0);
  ASSERT_TRUE(counter.available()) << counter.why_unavailable();
  const double limit = counter.power_limit_watts();
  ASSERT_TRUE(std::isfinite(limit));
  EXPECT_GT(limit, 50.0);
  EXPECT_LT(limit, 2000.0);

  const size_t bytes = size_t(1) << 30;
  void *a = nullptr, *b = nullptr;
  ASSERT_EQ(cudaMalloc(&a, bytes), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&b, bytes), cudaSuccess);
  ASSERT_EQ(cudaMemset(a, 1, bytes), cudaSuccess);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const auto t0 = std::chrono::steady_clock::now();
  const double j0 = counter.joules();
  double seconds = 0;
  while (seconds < 1.5) {
    for (int i = 0; i < 8; ++i)
      ASSERT_EQ(cudaMemcpy(b, a, bytes, cudaMemcpyDeviceToDevice), cudaSuccess);
    seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  }
  const double j1 = counter.joules();
  seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  cudaFree(a);
  cudaFree(b);
  const double watts = (j1 - j0) / seconds;
  EXPECT_GT(watts, 20.0) << (j1 - j0) << " J in " << seconds << " s";
  EXPECT_LE(watts, 1.1 * limit) << (j1 - j0) << " J in " << seconds << " s";
}
