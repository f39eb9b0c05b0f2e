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

std::unique_ptr<Backend> make_backend(const std::string& device, int local_rank) {
  if (device == "cpu") return make_cpu_backend_checked();
  if (device == "cuda" || device == "auto") {
    const int n = cuda::device_count();
    if (n > 0) {
      if (local_rank >= n)
        fail("local rank ", local_rank, " has no GPU of its own: this node has ", n,
             " GPU(s); start at most ", n, " ranks per node (one per GPU)");
      spdlog::info("device: {}", cuda::describe_device(local_rank));
      return make_cuda_backend(local_rank);
    }
    if (device == "cuda" && !cuda::built_with_cuda()) return make_cuda_backend(0);  // says how to get it
    if (device == "cuda") fail("--device cuda: no CUDA device is present (use --device cpu)");
    return make_cpu_backend_checked();
  }
  fail("device \"", device, "\" is not a device; valid: auto, cpu, cuda");
}

bool is_cuda_backend(const std::string& backend_name) { return backend_name.rfind("cuda", 0) == 0; }

std::unique_ptr<Communicator> make_communicator(Backend& backend) {
  if (!dist::info().mpi) return make_single_communicator();
  if (is_cuda_backend(backend.name())) return make_nccl_communicator(backend);
  return make_mpi_communicator(backend);
}

}  // namespace mhar
