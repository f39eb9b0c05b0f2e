// embedding.cu: token embedding lookup and its gradient.
// - forward: out [N, d] (overwritten) = table [V, d] rows at tokens [N] (I32).
// - backward: dtable [V, d] (grad dtype F32) += dout [N, d] rows, scattered with fp32
//   atomics: repeated tokens add in an unspecified order (not bitwise deterministic).
// Token ids must lie in [0, V): the data loader guarantees it; ids outside trap the kernel
// rather than read or write out of bounds.
#include "cuda/common.cuh"
#include "cuda/kernels.h"

namespace mhar::cuda {
namespace {

template <class TO, class TT>
__global__ void embedding_forward_kernel(TO* out, const int32_t* tokens, const TT* table,
                                         int64_t N, int64_t d, int64_t V) {
  for (int64_t n = blockIdx.x; n < N; n += gridDim.x) {
    const int32_t tok = tokens[n];
    if (tok < 0 || tok >= V) __trap();
    const TT* src = table + int64_t(tok) * d;
    TO* dst = out + n * d;
    for (int64_t c = threadIdx.x; c < d; c += blockDim.x) dst[c] = store<TO>(load(src[c]));
  }
}

template <class TD>
__global__ void embedding_backward_kernel(float* dtable, const TD* dout, const int32_t* tokens,
                                          int64_t N, int64_t d, int64_t V) {
  for (int64_t n = blockIdx.x; n < N; n += gridDim.x) {
    const int32_t tok = tokens[n];
    if (tok < 0 || tok >= V) __trap();
    float* dst = dtable + int64_t(tok) * d;
    const TD* src = dout + n * d;
    for (int64_t c = threadIdx.x; c < d; c += blockDim.x) atomicAdd(dst + c, load(src[c]));
  }
}

int row_threads(int64_t d) { return d >= 256 ? 256 : int(ceil_div(d, 32) * 32); }

}  // namespace

void embedding_forward(cudaStream_t s, Tensor out, Tensor tokens, Tensor table) {
  check_dtype(tokens, DType::I32, "embedding_forward", "tokens");
  const int64_t N = tokens.numel(), d = table.dim(-1), V = table.numel() / d;
  check_numel(out, N * d, "embedding_forward", "out");
  if (N == 0) return;
  dispatch_float(out.dtype, "embedding_forward", [&](auto to) {
    dispatch_float(table.dtype, "embedding_forward", [&](auto tt) {
      using TO = decltype(to);
      using TT = decltype(tt);
      int blocks = int(N < 65535 * 8 ? N : 65535 * 8);
      embedding_forward_kernel<TO, TT><<<blocks, row_threads(d), 0, s>>>(
          static_cast<TO*>(out.data), tokens.ptr<int32_t>(),
          static_cast<const TT*>(table.data), N, d, V);
      CUDA_CHECK_LAUNCH();
    });
  });
}

void embedding_backward(cudaStream_t s, Tensor dtable, Tensor dout, Tensor tokens) {
  check_dtype(tokens, DType::I32, "embedding_backward", "tokens");
  check_dtype(dtable, DType::F32, "embedding_backward", "dtable");
  const int64_t N = tokens.numel(), d = dtable.dim(-1), V = dtable.numel() / d;
  check_numel(dout, N * d, "embedding_backward", "dout");
  if (N == 0) return;
  dispatch_float(dout.dtype, "embedding_backward", [&](auto td) {
    using TD = decltype(td);
    int blocks = int(N < 65535 * 8 ? N : 65535 * 8);
    embedding_backward_kernel<TD><<<blocks, row_threads(d), 0, s>>>(
        dtable.ptr<float>(), static_cast<const TD*>(dout.data), tokens.ptr<int32_t>(), N, d, V);
    CUDA_CHECK_LAUNCH();
  });
}

}  // namespace mhar::cuda
