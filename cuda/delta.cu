// delta.cu: the delta-mode ops (engine/backend.h, DESIGN.md section 2; the CPU reference
// is engine/cpu/delta.h): the gated add of the routed term, its backward, and the null
// source's broadcast and token sum. Storage BF16 or F32, fp32 math.
// - delta_gate: x = base + alpha r, one fp32 fma-free multiply-add per element rounded
//   once: with alpha = 0 it returns base exactly (base + 0 * r, r finite), which the
//   conversion identity on the GPU rests on.
// - The two reductions are deterministic without atomics: a first kernel writes fixed
//   partial sums into the caller's scratch (the gate: one per block of a fixed grid; the
//   null: one row per slab of tokens), a second sums them in a fixed order and adds the
//   result into the gradient. The same shapes give the same bits on every run.
#include <algorithm>

#include "cuda/common.cuh"
#include "cuda/kernels.h"

namespace mhar::cuda {
namespace {

constexpr int kThreads = 256;

template <class TX, class TB, class TA, class TR>
__global__ void gate_kernel(TX* x, const TB* base, const TA* alpha, const TR* r, int64_t n) {
  const float a = load(alpha[0]);
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x)
    x[i] = store<TX>(__fadd_rn(load(base[i]), __fmul_rn(a, load(r[i]))));
}

// dr = alpha dx; partial[blockIdx.x] = this block's sum of dx r (fixed grid, fixed tree).
template <class TD, class TA>
__global__ void gate_backward_kernel(TD* dr, float* partial, const TD* dx, const TD* r,
                                     const TA* alpha, int64_t n) {
  const float a = load(alpha[0]);
  float acc = 0.f;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    const float g = load(dx[i]);
    dr[i] = store<TD>(a * g);
    acc += g * load(r[i]);
  }
  acc = block_sum(acc);
  if (threadIdx.x == 0) partial[blockIdx.x] = acc;
}

// out[0] += sum of partial[0..count) (one block; each thread a strided run, then a tree).
template <class TO>
__global__ void sum_partials_kernel(TO* out, const float* partial, int count) {
  float acc = 0.f;
  for (int i = threadIdx.x; i < count; i += blockDim.x) acc += partial[i];
  acc = block_sum(acc);
  if (threadIdx.x == 0) out[0] = store<TO>(load(out[0]) + acc);
}

template <class TO, class TR>
__global__ void broadcast_kernel(TO* out, const TR* row, int64_t N, int64_t d) {
  const int64_t n_all = N * d;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n_all;
       i += int64_t(gridDim.x) * blockDim.x)
    out[i] = store<TO>(load(row[i % d]));
}

// partial[slab, c] = sum over the slab's token rows of dout[n, c]; grid (column chunks,
// slabs); consecutive threads read consecutive columns (coalesced).
template <class T>
__global__ void column_partial_kernel(float* partial, const T* dout, int64_t N, int64_t d,
                                      int slabs) {
  const int64_t c = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (c >= d) return;
  const int slab = blockIdx.y;
  const int64_t begin = N * slab / slabs, end = N * (slab + 1) / slabs;
  float acc = 0.f;
  for (int64_t n = begin; n < end; ++n) acc += load(dout[n * d + c]);
  partial[int64_t(slab) * d + c] = acc;
}

template <class TO>
__global__ void column_finish_kernel(TO* drow, const float* partial, int64_t d, int slabs) {
  const int64_t c = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (c >= d) return;
  float acc = 0.f;
  for (int s = 0; s < slabs; ++s) acc += partial[int64_t(s) * d + c];
  drow[c] = store<TO>(load(drow[c]) + acc);
}

}  // namespace

void delta_gate(cudaStream_t s, Tensor x, Tensor base, Tensor alpha, Tensor r) {
  const int64_t n = x.numel();
  check_numel(base, n, "delta_gate", "base");
  check_numel(r, n, "delta_gate", "r");
  check_numel(alpha, 1, "delta_gate", "alpha");
  check_dtype(base, x.dtype, "delta_gate", "base");
  check_dtype(r, x.dtype, "delta_gate", "r");
  if (n == 0) return;
  dispatch_float(x.dtype, "delta_gate", [&](auto tx) {
    dispatch_float(alpha.dtype, "delta_gate", [&](auto ta) {
      using T = decltype(tx);
      using TA = decltype(ta);
      gate_kernel<T, T, TA, T><<<grid_stride_blocks(n, kThreads), kThreads, 0, s>>>(
          static_cast<T*>(x.data), static_cast<const T*>(base.data),
          static_cast<const TA*>(alpha.data), static_cast<const T*>(r.data), n);
      CUDA_CHECK_LAUNCH();
    });
  });
}

void delta_gate_backward(cudaStream_t s, Tensor dr, Tensor dalpha, Tensor dx, Tensor r,
                         Tensor alpha, Tensor scratch) {
  const int64_t n = dx.numel();
  check_numel(dr, n, "delta_gate_backward", "dr");
  check_numel(r, n, "delta_gate_backward", "r");
  check_numel(alpha, 1, "delta_gate_backward", "alpha");
  check_numel(dalpha, 1, "delta_gate_backward", "dalpha");
  check_dtype(dr, dx.dtype, "delta_gate_backward", "dr");
  check_dtype(r, dx.dtype, "delta_gate_backward", "r");
  check_dtype(scratch, DType::F32, "delta_gate_backward", "scratch");
  if (scratch.numel() < 1) fail("CUDA delta_gate_backward: empty scratch");
  // A fixed grid: at most the scratch's length and 1024 partial sums.
  const int blocks = int(std::max<int64_t>(
      1, std::min<int64_t>({int64_t(grid_stride_blocks(std::max<int64_t>(n, 1), kThreads)), 1024,
                            scratch.numel()})));
  float* partial = static_cast<float*>(scratch.data);
  dispatch_float(dx.dtype, "delta_gate_backward", [&](auto td) {
    dispatch_float(alpha.dtype, "delta_gate_backward", [&](auto ta) {
      using T = decltype(td);
      using TA = decltype(ta);
      gate_backward_kernel<T, TA><<<blocks, kThreads, 0, s>>>(
          static_cast<T*>(dr.data), partial, static_cast<const T*>(dx.data),
          static_cast<const T*>(r.data), static_cast<const TA*>(alpha.data), n);
      CUDA_CHECK_LAUNCH();
    });
  });
  dispatch_float(dalpha.dtype, "delta_gate_backward", [&](auto to) {
    using TO = decltype(to);
    sum_partials_kernel<TO><<<1, kThreads, 0, s>>>(static_cast<TO*>(dalpha.data), partial, blocks);
    CUDA_CHECK_LAUNCH();
  });
}

void delta_null_forward(cudaStream_t s, Tensor out, Tensor row) {
  if (out.ndim != 2) fail("CUDA delta_null_forward: out ", out.shape_str(), " is not [N, d]");
  const int64_t N = out.dim(0), d = out.dim(1);
  check_numel(row, d, "delta_null_forward", "row");
  if (N * d == 0) return;
  dispatch_float(out.dtype, "delta_null_forward", [&](auto to) {
    dispatch_float(row.dtype, "delta_null_forward", [&](auto tr) {
      using TO = decltype(to);
      using TR = decltype(tr);
      broadcast_kernel<TO, TR><<<grid_stride_blocks(N * d, kThreads), kThreads, 0, s>>>(
          static_cast<TO*>(out.data), static_cast<const TR*>(row.data), N, d);
      CUDA_CHECK_LAUNCH();
    });
  });
}

void delta_null_backward(cudaStream_t s, Tensor drow, Tensor dout, Tensor scratch) {
  if (dout.ndim != 2) fail("CUDA delta_null_backward: dout ", dout.shape_str(), " is not [N, d]");
  const int64_t N = dout.dim(0), d = dout.dim(1);
  check_numel(drow, d, "delta_null_backward", "drow");
  check_dtype(scratch, DType::F32, "delta_null_backward", "scratch");
  if (d == 0) return;
  // One partial row per slab of tokens: as many slabs as the scratch holds rows (<= 64).
  const int slabs = int(std::max<int64_t>(1, std::min<int64_t>({scratch.numel() / d, 64, std::max<int64_t>(N, 1)})));
  if (scratch.numel() < d) fail("CUDA delta_null_backward: scratch of ", scratch.numel(), " < d = ", d);
  float* partial = static_cast<float*>(scratch.data);
  const dim3 grid(unsigned(ceil_div(d, kThreads)), unsigned(slabs));
  dispatch_float(dout.dtype, "delta_null_backward", [&](auto tg) {
    using T = decltype(tg);
    column_partial_kernel<T><<<grid, kThreads, 0, s>>>(partial, static_cast<const T*>(dout.data), N,
                                                       d, slabs);
    CUDA_CHECK_LAUNCH();
  });
  dispatch_float(drow.dtype, "delta_null_backward", [&](auto to) {
    using TO = decltype(to);
    column_finish_kernel<TO><<<unsigned(ceil_div(d, kThreads)), kThreads, 0, s>>>(
        static_cast<TO*>(drow.data), partial, d, slabs);
    CUDA_CHECK_LAUNCH();
  });
}

}  // namespace mhar::cuda
