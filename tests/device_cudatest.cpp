// device_cudatest.cpp: CUDA device discovery; skipped when no GPU is present.
#include <gtest/gtest.h>

#include "cuda/device.h"

TEST(CudaDevice, DiscoveryIsSafeWithoutADevice) {
  int n = mhar::cuda::device_count();
  EXPECT_GE(n, 0);
  if (n == 0) GTEST_SKIP() << "no CUDA device";
  std::string d = mhar::cuda::describe_device(0);
  EXPECT_NE(d.find("sm_"), std::string::npos) << d;
}
