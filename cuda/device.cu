// device.cu: CUDA device discovery (see device.h).
#include <cstdio>

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

std::string pci_bus_id(int i) {
  char buf[64] = {};
  CUDA_CHECK(cudaDeviceGetPCIBusId(buf, int(sizeof buf), i));
  return buf;
}

}  // namespace mhar::cuda
