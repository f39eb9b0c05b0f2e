// backend_factory.cpp: backend selection (see backend_factory.h).
#include "engine/backend_factory.h"

#include <spdlog/spdlog.h>

#include "cuda/cuda_backend.h"
#include "cuda/device.h"
#include "engine/error.h"

namespace mhar {

std::unique_ptr<Backend> make_backend(const std::string& device) {
  if (device == "cpu") return make_cpu_backend(DType::F32);
  if (device == "cuda" || device == "auto") {
    const int n = cuda::device_count();
    if (n > 0) {
      spdlog::info("device: {}", cuda::describe_device(0));
      return make_cuda_backend(0);
    }
    if (device == "cuda") fail("--device cuda: no CUDA device is present (use --device cpu)");
    return make_cpu_backend(DType::F32);
  }
  fail("device \"", device, "\" is not a device; valid: auto, cpu, cuda");
}

}  // namespace mhar
