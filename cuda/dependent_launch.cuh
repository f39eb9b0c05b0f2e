// dependent_launch.cuh: programmatic dependent launch (sm_90's griddepcontrol) for chains of
// short kernels in one stream, such as the routing's (cuda/routing.cu, cuda/delta.cu).
//
// Why: a routing op is 2-6 kernels of 10-100 us each at 100M, and every kernel boundary
// costs the next grid's launch and block ramp after the previous grid's last block
// (cuda/NOTES.md, "Programmatic dependent launch of the routing kernels"). A kernel
// launched by launch_dependent may be placed on the SMs while the kernel before it in the
// stream still runs its last wave; it waits in dependent_kernel_entry() until that kernel
// has finished and its writes are visible, then lets the kernel after it launch.
//
// Conventions:
// - Every kernel launched through launch_dependent calls dependent_kernel_entry() as its
//   first statement, before any global load or store: until it returns, the previous
//   kernel may still read and write the memory this one uses. A kernel that has it may
//   also be launched the ordinary way (the wait is then a no-op).
// - The trigger comes after the wait, so at most one grid waits ahead of the running one
//   (a chain triggered before its waits would stack grids whose idle blocks hold the SM
//   slots the running grid's later waves need).
// - Results do not change: every kernel still starts its work after the previous one has
//   finished. Only the launch and ramp overlap.
// - dependent_launch_enabled() (cuda/device.h) decides: MHAR_DEPENDENT_LAUNCH=0 in the
//   environment launches the ordinary way (the A/B of the benchmark); tests switch it with
//   set_dependent_launch. Off before sm_90.
#pragma once
#include <cuda_runtime.h>

#include <utility>

#include "cuda/check.h"
#include "cuda/device.h"

namespace mhar::cuda {

// Waits until every grid this one depends on has finished and its writes are visible
// (returns at once when the kernel was launched the ordinary way).
__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
// Lets the next dependent grid in the stream launch once every block of this grid has
// executed it (or exited).
__device__ __forceinline__ void pdl_launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}
// The first statement of a kernel that launch_dependent may start (see the conventions).
__device__ __forceinline__ void dependent_kernel_entry() {
  pdl_wait();
  pdl_launch_dependents();
}

// kernel<<<grid, block, smem, s>>>(args...), as a programmatic dependent of the stream's
// previous kernel where `dependent`; such a kernel must wait (pdl_wait) before its first
// global access.
template <class... KArgs, class... Args>
void launch_kernel(cudaStream_t s, bool dependent, dim3 grid, dim3 block, size_t smem,
                   void (*kernel)(KArgs...), Args&&... args) {
  if (!dependent) {
    kernel<<<grid, block, smem, s>>>(std::forward<Args>(args)...);
    CUDA_CHECK_LAUNCH();
    return;
  }
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = s;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  CUDA_CHECK(cudaLaunchKernelEx(&cfg, kernel, std::forward<Args>(args)...));
}
// The same, dependent when enabled; the kernel begins with dependent_kernel_entry().
template <class... KArgs, class... Args>
void launch_dependent(cudaStream_t s, dim3 grid, dim3 block, size_t smem, void (*kernel)(KArgs...),
                      Args&&... args) {
  launch_kernel(s, dependent_launch_enabled(), grid, block, smem, kernel,
                std::forward<Args>(args)...);
}

}  // namespace mhar::cuda
