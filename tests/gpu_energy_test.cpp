// gpu_energy_test.cpp: the energy counter (cuda/gpu_energy.h) where there is no GPU, as on
// CI: it must not fail, say why it is unavailable, and read NaN. Where a GPU is present,
// tests/device_cudatest.cpp reads its counter under load.
#include "cuda/gpu_energy.h"

#include <gtest/gtest.h>

#include <cmath>

#include "cuda/device.h"

TEST(GpuEnergyCounter, WithoutADeviceSaysWhyAndReadsNaN) {
  if (mhar::cuda::device_count() > 0)
    GTEST_SKIP() << "a GPU is present: CudaDevice.EnergyCounterAdvancesUnderLoad reads it";
  const mhar::cuda::GpuEnergyCounter counter(0);
  EXPECT_FALSE(counter.available());
  EXPECT_FALSE(counter.why_unavailable().empty());
  EXPECT_TRUE(std::isnan(counter.joules()));
  EXPECT_TRUE(std::isnan(counter.power_limit_watts()));
}
