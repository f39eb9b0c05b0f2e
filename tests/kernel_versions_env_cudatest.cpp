// kernel_versions_env_cudatest.cpp: MHAR_KERNEL_VERSIONS (cuda/kernel_versions_env.cpp)
// sets the named lab versions, refuses bad names and versions with the valid choices and
// then sets nothing, and is applied when a CUDA backend is made. The parsing needs no GPU
// (the lab's version switches are host state); the backend's part is skipped without one.
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
  void TearDown() override {
    unsetenv("MHAR_KERNEL_VERSIONS");
    cuda::routing_set_kernel_version(cuda::RoutingKernel::KeyGrad, 0);
    cuda::norm_set_kernel_version(cuda::NormKernel::Backward, 0);
    cuda::side_stream_set_version(0);
  }
  // The message apply_kernel_versions_from_env fails with under `value`, or "" when it
  // succeeds.
  static std::string apply_error(const char* value) {
    setenv("MHAR_KERNEL_VERSIONS", value, 1);
    try {
      cuda::apply_kernel_versions_from_env();
    } catch (const Error& e) {
      return e.what();
    }
    return "";
  }
};

TEST_F(KernelVersionsEnv, SetsTheNamedVersions) {
  ASSERT_EQ(apply_error("key_grad=3,norm_backward=5,embedding_backward=2,side_stream=1"), "");
  // Each set_version returns the version it replaces.
  EXPECT_EQ(cuda::routing_set_kernel_version(cuda::RoutingKernel::KeyGrad, 0), 3);
  EXPECT_EQ(cuda::norm_set_kernel_version(cuda::NormKernel::Backward, 0), 5);
  EXPECT_EQ(cuda::embedding_backward_set_version(0), 2);
  EXPECT_EQ(cuda::side_stream_set_version(0), 1);
}

TEST_F(KernelVersionsEnv, RefusesBadItemsWithTheChoices) {
  // The default's number (routing_set_kernel_version returns the version it replaces), and
  // another version, named before a bad item.
  const int default_version = cuda::routing_set_kernel_version(cuda::RoutingKernel::KeyGrad, 0);
  const int other = default_version == 1 ? 2 : 1;
  const std::string unknown =
      apply_error(("key_grad=" + std::to_string(other) + ",no_such_kernel=2").c_str());
  EXPECT_NE(unknown.find("'no_such_kernel=2'"), std::string::npos) << unknown;
  EXPECT_NE(unknown.find("key_grad, mix_norm, qg_tables, source_finish, norm_forward"),
            std::string::npos)
      << unknown;
  // Nothing applies when one item is bad: the version before it did not take.
  EXPECT_EQ(cuda::routing_set_kernel_version(cuda::RoutingKernel::KeyGrad, 0), default_version);
  const int versions = cuda::routing_kernel_versions(cuda::RoutingKernel::KeyGrad);
  const std::string past = apply_error(("key_grad=" + std::to_string(versions + 1)).c_str());
  EXPECT_NE(past.find("1 .. " + std::to_string(versions)), std::string::npos) << past;
  EXPECT_NE(apply_error("key_grad=x").find("key_grad=x"), std::string::npos);
  EXPECT_NE(apply_error("key_grad").find("NAME=VERSION"), std::string::npos);
  // Empty: nothing to set.
  EXPECT_EQ(apply_error(""), "");
  EXPECT_EQ(cuda::routing_set_kernel_version(cuda::RoutingKernel::KeyGrad, 0), default_version);
}

TEST_F(KernelVersionsEnv, TheBackendAppliesThem) {
  if (cuda::device_count() == 0) GTEST_SKIP() << "no CUDA device";
  setenv("MHAR_KERNEL_VERSIONS", "key_grad=2", 1);
  make_cuda_backend(0);
  EXPECT_EQ(cuda::routing_set_kernel_version(cuda::RoutingKernel::KeyGrad, 0), 2);
}

}  // namespace
}  // namespace mhar
