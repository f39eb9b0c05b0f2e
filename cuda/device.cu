// device.cu: CUDA device discovery and the copy rate (see device.h).
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <vector>

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

double measure_copy_bytes_per_s(std::string* why) {
  // 512 MiB each way: ten times the H200's 50 MB L2, so the copies run from DRAM.
  constexpr size_t kBytes = kCopyRateBytes;
  constexpr int kWarmup = 2, kTimed = 7;
  void *src = nullptr, *dst = nullptr;
  cudaStream_t stream = nullptr;
  std::vector<cudaEvent_t> events(kTimed + 1, nullptr);
  std::vector<float> ms(kTimed, 0.f);
  // The first failing call, by name (what fails after it follows from it).
  cudaError_t failed = cudaSuccess;
  const char* failed_call = "";
  auto ok = [&](cudaError_t e, const char* call) {
    if (failed == cudaSuccess && e != cudaSuccess) failed = e, failed_call = call;
    return failed == cudaSuccess;
  };
  if (ok(cudaMalloc(&src, kBytes), "cudaMalloc") && ok(cudaMalloc(&dst, kBytes), "cudaMalloc") &&
      ok(cudaMemset(src, 0x3c, kBytes), "cudaMemset") &&
      ok(cudaStreamCreate(&stream), "cudaStreamCreate")) {
    // After a failure the later calls still run (on null events they fail harmlessly);
    // `ok` keeps the first.
    for (auto& ev : events) ok(cudaEventCreate(&ev), "cudaEventCreate");
    for (int i = 0; i < kWarmup; ++i)
      ok(cudaMemcpyAsync(dst, src, kBytes, cudaMemcpyDeviceToDevice, stream), "cudaMemcpyAsync");
    ok(cudaEventRecord(events[0], stream), "cudaEventRecord");
    for (size_t i = 0; i < kTimed; ++i) {
      ok(cudaMemcpyAsync(dst, src, kBytes, cudaMemcpyDeviceToDevice, stream), "cudaMemcpyAsync");
      ok(cudaEventRecord(events[i + 1], stream), "cudaEventRecord");
    }
    ok(cudaStreamSynchronize(stream), "cudaStreamSynchronize");
    for (size_t i = 0; i < kTimed; ++i)
      ok(cudaEventElapsedTime(&ms[i], events[i], events[i + 1]), "cudaEventElapsedTime");
  }
  for (auto ev : events)
    if (ev) cudaEventDestroy(ev);
  if (stream) cudaStreamDestroy(stream);
  if (src) cudaFree(src);
  if (dst) cudaFree(dst);
  if (failed != cudaSuccess) {
    cudaGetLastError();  // cleared, so that the caller's next check is not about this one
    if (why) *why = std::string(failed_call) + ": " + cudaGetErrorString(failed);
    return NAN;
  }
  std::sort(ms.begin(), ms.end());
  const double median_s = double(ms[ms.size() / 2]) * 1e-3;
  if (!(median_s > 0)) {
    if (why) *why = "the timed copies took no measurable time";
    return NAN;
  }
  return 2.0 * double(kBytes) / median_s;
}

}  // namespace mhar::cuda
