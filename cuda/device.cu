// device.cu: CUDA device discovery (see device.h).
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "cuda/check.h"
#include "cuda/device.h"

namespace mhar::cuda {

bool built_with_cuda() { return true; }

int device_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();  // clear the sticky "no driver" error
    return 0;
  }
  return n;
}

std::string describe_device(int i) {
  cudaDeviceProp p{};
  CUDA_CHECK(cudaGetDeviceProperties(&p, i));
  char buf[256];
  std::snprintf(buf, sizeof buf, "%s (sm_%d%d, %d SMs, %.1f GiB)", p.name, p.major, p.minor,
                p.multiProcessorCount, double(p.totalGlobalMem) / (1 << 30));
  return buf;
}

namespace {
bool& dependent_launch_flag() {
  static bool on = [] {
    const char* e = std::getenv("MHAR_DEPENDENT_LAUNCH");
    if (e && std::strcmp(e, "0") == 0) return false;
    int device = 0, major = 0;
    if (cudaGetDevice(&device) != cudaSuccess ||
        cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess) {
      cudaGetLastError();  // no device: nothing will launch
      return false;
    }
    return major >= 9;
  }();
  return on;
}
}  // namespace

bool dependent_launch_enabled() { return dependent_launch_flag(); }
bool set_dependent_launch(bool on) {
  const bool was = dependent_launch_flag();
  dependent_launch_flag() = on;
  return was;
}

}  // namespace mhar::cuda
