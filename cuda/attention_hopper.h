// attention_hopper.h: the Hopper (sm_90a, wgmma) attention kernels, called by
// attention.cu's dispatcher. Layouts, scale and lse are attention.cu's: q, out [B, T, Hq,
// hd], k, v [B, T, Hkv, hd] BF16 with 16-byte aligned rows; lse [B, Hq, T] fp32.
// Host code only (no device headers), so tests can reach the kernel-lab setter.
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace mhar::cuda {
using bf16 = __nv_bfloat16;  // as in cuda/common.cuh
}

namespace mhar::cuda::hopper {

struct ForwardArgs {
  int64_t B, T, Hq, Hkv;
  float scale;
};

// Whether these kernels can run here: the device is compute capability 9.0 (sm_90a code
// runs nowhere else) and the binary carries them.
bool available();

// Causal forward, head_dim HD (64 or 128); lse may be null.
template <int HD>
void forward(cudaStream_t s, bf16* out, float* lse, const bf16* q, const bf16* k, const bf16* v,
             const ForwardArgs& a);

// Causal backward from the saved out's row dots Dsum [B, Hq, T] = rowsum(dout * out) (fp32,
// attention.cu computes them) and lse; writes dq, dk, dv (every element).
template <int HD>
void backward(cudaStream_t s, bf16* dq, bf16* dk, bf16* dv, const bf16* dout, const bf16* q,
              const bf16* k, const bf16* v, const float* lse, const float* Dsum,
              const ForwardArgs& a);

}  // namespace mhar::cuda::hopper
