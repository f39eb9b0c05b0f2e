// backend_factory.cpp: backend selection (see backend_factory.h).
#include "engine/backend_factory.h"

#include <spdlog/spdlog.h>

#include "cuda/cuda_backend.h"
#include "cuda/device.h"
#include "engine/error.h"

extern "C" char* openblas_get_corename(void);

namespace mhar {

namespace {

// OpenBLAS picks its kernels from the CPU model; in some virtual machines the model is
// hidden and it falls back to its SSE3 ("Prescott") kernels, several times slower than
// the AVX2/AVX-512 ones the CPU actually has. Say so, with the fix.
std::unique_ptr<Backend> make_cpu_backend_checked() {
  const std::string core = openblas_get_corename();
  if ((core == "Prescott" || core == "prescott") && __builtin_cpu_supports("avx2"))
    spdlog::warn("OpenBLAS uses its slow {} kernels on this AVX2 CPU (it did not recognise the "
                 "model); export OPENBLAS_CORETYPE=Haswell (or SkylakeX with AVX-512) for a "
                 "several-fold faster CPU backend", core);
  return make_cpu_backend(DType::F32);
}

}  // namespace

std::unique_ptr<Backend> make_backend(const std::string& device) {
  if (device == "cpu") return make_cpu_backend_checked();
  if (device == "cuda" || device == "auto") {
    const int n = cuda::device_count();
    if (n > 0) {
      spdlog::info("device: {}", cuda::describe_device(0));
      return make_cuda_backend(0);
    }
    if (device == "cuda" && !cuda::built_with_cuda()) return make_cuda_backend(0);  // says how to get it
    if (device == "cuda") fail("--device cuda: no CUDA device is present (use --device cpu)");
    return make_cpu_backend_checked();
  }
  fail("device \"", device, "\" is not a device; valid: auto, cpu, cuda");
}

}  // namespace mhar
