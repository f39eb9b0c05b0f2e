// routing_key_grad_mma.h: key-gradient versions 3-4 (routing_key_grad_mma.cu), the routing
// backward's key gradients of one slot on tensor cores. Internal to cuda/ (routing_key_grads.cu
// calls it).
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/common.cuh"

namespace mhar::cuda {

// One slot's key gradients into gsum's slabs, as key_grad_kernel (routing_key_grads.cu) defines
// them: gsum[slab][source + k][f] += sum over the slab's tokens n of dsr[k][h(f)][n] v[n][f]
// for the slot's ns sites k, where h(f) = f / dh and a slab is a contiguous share of the N
// tokens. dsr: the slot's fp32 ds r rows, [ns][H][N]; v: the slot's bf16 row, [N][d];
// gsum: [slabs][sites][d] fp32. Returns false (nothing launched) where the shapes do not
// allow it: key_grad_mma_applies. async_dsr: ds r staged by cp.async (version 4) rather
// than through registers (version 3); the same bits.
bool key_grad_mma_applies(int64_t N, int d, int heads, const void* dsr, const void* v);
bool key_grad_mma(cudaStream_t s, float* gsum, const float* dsr, const bf16* v, int64_t N, int d,
                  int heads, int sites, int source, int ns, int slabs, bool async_dsr);

}  // namespace mhar::cuda
