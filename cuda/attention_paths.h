// attention_paths.h: the three attention strategies that attention.cu dispatches to, one
// file each. Host code only (tests include it for the kernel-lab switches).
//   attention_fp32.cu    fp32 CUDA cores, any storage type and alignment, decoding
//   attention_tc.cu      BF16 tensor cores through mma.sync (sm_80 and later)
//   attention_hopper.cu  BF16 tensor cores through wgmma (sm_90a: compute capability 9.0)
//   attention_hopper_ws.cu  the same, warp-specialized: the forward and the dK/dV kernel
// Layouts, scale and lse are attention.cu's (its header): q, out [B, T, Hq, hd], k, v
// [B, T, Hkv, hd], lse [B, Hq, T] fp32; the BF16 paths want rows 16-byte aligned.
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "engine/tensor.h"

namespace mhar::cuda {

using bf16 = __nv_bfloat16;  // as in cuda/common.cuh

struct AttentionArgs {
  int64_t B, T, Hq, Hkv;  // T: query rows (and keys, except in the cached forward)
  float scale;            // 1 / sqrt(head_dim)
};

namespace attn_fp32 {
// Causal forward over Tk >= a.T keys, query t at position Tk - a.T + t; lse may be empty
// (decoding). Storage type BF16 or F32 (q's), head_dim hd 64 or 128.
void forward(cudaStream_t s, Tensor out, Tensor lse, Tensor q, Tensor k, Tensor v, int64_t hd,
             const AttentionArgs& a, int64_t Tk);
void backward(cudaStream_t s, Tensor dq, Tensor dk, Tensor dv, Tensor dout, Tensor q, Tensor k,
              Tensor v, Tensor out, Tensor lse, int64_t hd, const AttentionArgs& a);
}  // namespace attn_fp32

namespace tc {
// Whether this binary carries the mma.sync kernels for the device (sm_80 or later).
bool available();
template <int HD>
void forward(cudaStream_t s, bf16* out, float* lse, const bf16* q, const bf16* k, const bf16* v,
             const AttentionArgs& a);
// Dsum [B, Hq, T] = rowsum(dout * out), fp32: the row dots both BF16 backwards read.
template <int HD>
void row_dots(cudaStream_t s, float* Dsum, const bf16* dout, const bf16* out,
              const AttentionArgs& a);
template <int HD>
void backward(cudaStream_t s, bf16* dq, bf16* dk, bf16* dv, const bf16* dout, const bf16* q,
              const bf16* k, const bf16* v, const float* lse, const float* Dsum,
              const AttentionArgs& a);
}  // namespace tc

namespace hopper {
// Whether these kernels can run here: the device is compute capability 9.0 (sm_90a code
// runs nowhere else) and the binary carries them.
bool available();
// Causal forward, head_dim HD (64 or 128); lse may be null.
template <int HD>
void forward(cudaStream_t s, bf16* out, float* lse, const bf16* q, const bf16* k, const bf16* v,
             const AttentionArgs& a);
// The same forward, warp-specialized (attention_hopper_ws.cu): forward version 2.
template <int HD>
void forward_ws(cudaStream_t s, bf16* out, float* lse, const bf16* q, const bf16* k,
                const bf16* v, const AttentionArgs& a);
// The backward's dk/dv kernel, warp-specialized (attention_hopper_ws.cu; backward version
// 3): dk, dv and the score-gradient tiles exactly as backward's dk/dv kernel with
// score_grads writes them.
template <int HD>
void dkdv_ws(cudaStream_t s, bf16* dk, bf16* dv, bf16* score_grads, const bf16* dout,
             const bf16* q, const bf16* k, const bf16* v, const float* lse, const float* Dsum,
             const AttentionArgs& a);
// The bf16 score-gradient tiles of one backward (B*Hq of 64 x 64 tiles on and below the
// diagonal, T rounded up to 64).
size_t score_grad_bytes(const AttentionArgs& a);
// Causal backward from the row dots Dsum (tc::row_dots) and lse; writes dq, dk, dv. With
// score_grads (score_grad_bytes(a), 16-byte aligned) the dk/dv kernel stores dS there and
// dq is one product over it, the dk/dv kernel being dkdv_ws when warp_specialized; null:
// dq recomputes S and dP (attention_hopper.cu).
template <int HD>
void backward(cudaStream_t s, bf16* dq, bf16* dk, bf16* dv, const bf16* dout, const bf16* q,
              const bf16* k, const bf16* v, const float* lse, const float* Dsum,
              bf16* score_grads, bool warp_specialized, const AttentionArgs& a);
}  // namespace hopper

}  // namespace mhar::cuda
