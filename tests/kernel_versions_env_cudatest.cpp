// kernel_versions_env_cudatest.cpp: MHAR_KERNEL_VERSIONS (cuda/kernel_versions_env.cpp)
// sets the named lab versions when a CUDA backend is made, and refuses bad names and
// versions with the valid choices. Skipped without a GPU.
#include <gtest/gtest.h>

#include <cstdlib>
#include <string>

#include "cuda/cuda_backend.h"
#include "cuda/device.h"
#include "cuda/kernels.h"
#include "engine/error.h"

namespace mhar {
namespace {

class KernelVersionsEnv : public ::testing::Test {
 protected:
  void SetUp() override {
    if (cuda::device_count() == 0) GTEST_SKIP() << "no CUDA device";
  }
  void TearDown() override {
    unsetenv("MHAR_KERNEL_VERSIONS");
    cuda::routing_set_kernel_version(cuda::RoutingKernel::KeyGrad, 0);
    cuda::norm_set_kernel_version(cuda::NormKernel::Backward, 0);
  }
  // The message make_cuda_backend fails with under `value`, or "" when it succeeds.
  static std::string backend_error(const char* value) {
    setenv("MHAR_KERNEL_VERSIONS", value, 1);
    try {
      make_cuda_backend(0);
    } catch (const Error& e) {
      return e.what();
    }
    return "";
  }
};

TEST_F(KernelVersionsEnv, SetsTheNamedVersions) {
  ASSERT_EQ(backend_error("key_grad=3,norm_backward=5"), "");
  // routing_set_kernel_version returns the version it replaces.
  EXPECT_EQ(cuda::routing_set_kernel_version(cuda::RoutingKernel::KeyGrad, 0), 3);
  EXPECT_EQ(cuda::norm_set_kernel_version(cuda::NormKernel::Backward, 0), 5);
}

TEST_F(KernelVersionsEnv, RefusesBadItemsWithTheChoices) {
  // The default's number (routing_set_kernel_version returns the version it replaces), and
  // another version, named before a bad item.
  const int default_version = cuda::routing_set_kernel_version(cuda::RoutingKernel::KeyGrad, 0);
  const int other = default_version == 1 ? 2 : 1;
  const std::string unknown =
      backend_error(("key_grad=" + std::to_string(other) + ",no_such_kernel=2").c_str());
  EXPECT_NE(unknown.find("'no_such_kernel=2'"), std::string::npos) << unknown;
  EXPECT_NE(unknown.find("key_grad, norm_forward"), std::string::npos) << unknown;
  // Nothing applies when one item is bad: the version before it did not take.
  EXPECT_EQ(cuda::routing_set_kernel_version(cuda::RoutingKernel::KeyGrad, 0), default_version);
  const int versions = cuda::routing_kernel_versions(cuda::RoutingKernel::KeyGrad);
  const std::string past = backend_error(("key_grad=" + std::to_string(versions + 1)).c_str());
  EXPECT_NE(past.find("1 .. " + std::to_string(versions)), std::string::npos) << past;
  EXPECT_NE(backend_error("key_grad=x").find("key_grad=x"), std::string::npos);
  EXPECT_NE(backend_error("key_grad").find("NAME=VERSION"), std::string::npos);
}

}  // namespace
}  // namespace mhar
