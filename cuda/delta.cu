// delta.cu: the delta-mode ops (engine/backend.h, DESIGN.md section 2; the CPU reference
// is engine/cpu/delta.h and, for the fused steps, backend.h's defaults): the gated add of
// the routed term, its backward, the null source's broadcast and token sum, and the fused
// steps of residual_delta.cpp's loop (stream advance, residual + gate backward, source
// gradient). Storage BF16 or F32, fp32 math.
// - delta_gate: x = base + alpha r, one fp32 fma-free multiply-add per element rounded
//   once: with alpha = 0 it returns base exactly (base + 0 * r, r finite), which the
//   conversion identity on the GPU rests on.
// - Every elementwise kernel walks chunks of 8 consecutive elements, grid-stride: a chunk
//   is one 16-byte access per tensor (bf16x8, or 2 x float4) when every pointer is 16-byte
//   aligned, else (and for the n % 8 tail) element by element with the same fp32
//   arithmetic. A thread therefore sees the same elements in the same order on both
//   paths, so the gate's dot product gets the same bits whichever path runs.
// - The fused kernels do exactly the operations of the op sequences they replace
//   (backend.h's defaults: add_inplace / add in reductions.cu, and this file's gate
//   backward), with each intermediate the sequence stores rounded to the storage type
//   where it would be stored: the same bits, so the conversion identity is untouched.
// - The two reductions are deterministic without atomics: a first kernel writes fixed
//   partial sums into the caller's scratch (the gate: one per block of a fixed grid, the
//   same grid with or without the fused residual add; the null: one row per slab of
//   tokens), a second sums them in a fixed order and adds the result into the gradient.
//   The same shapes give the same bits on every run.
#include <algorithm>

#include "cuda/common.cuh"
#include "cuda/kernels.h"

namespace mhar::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kMaxPartials = 1024;  // the gate backward's grid, at most

// Chunk [i0, i0 + 8) of p into f (elements past n read as 0), and back.
template <bool kVec, class T>
__device__ __forceinline__ void get8(const T* p, int64_t i0, int64_t n, float (&f)[8]) {
  if (kVec && i0 + 8 <= n) {
    load8(p + i0, f);
  } else {
#pragma unroll
    for (int e = 0; e < 8; ++e) f[e] = i0 + e < n ? load(p[i0 + e]) : 0.f;
  }
}
template <bool kVec, class T>
__device__ __forceinline__ void put8(T* p, int64_t i0, int64_t n, const float (&f)[8]) {
  if (kVec && i0 + 8 <= n) {
    store8(p + i0, f);
  } else {
#pragma unroll
    for (int e = 0; e < 8; ++e)
      if (i0 + e < n) p[i0 + e] = store<T>(f[e]);
  }
}

__device__ __forceinline__ int64_t first_chunk() {
  return int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
}
__device__ __forceinline__ int64_t chunk_stride() { return int64_t(gridDim.x) * blockDim.x; }

template <bool kVec, class T, class TA>
__global__ void gate_kernel(T* x, const T* base, const TA* alpha, const T* r, int64_t n) {
  const float a = load(alpha[0]);
  const int64_t chunks = ceil_div(n, 8);
  for (int64_t c = first_chunk(); c < chunks; c += chunk_stride()) {
    float b[8], v[8];
    get8<kVec>(base, c * 8, n, b);
    get8<kVec>(r, c * 8, n, v);
#pragma unroll
    for (int e = 0; e < 8; ++e) b[e] = __fadd_rn(b[e], __fmul_rn(a, v[e]));
    put8<kVec>(x, c * 8, n, b);  // x may alias base: each element read, then written, here
  }
}

// stream += slot; then (kPrev) slot += prev. reductions.cu's add computes y + x in fp32
// and rounds once: so does this, per output.
template <bool kVec, bool kPrev, class T>
__global__ void advance_kernel(T* stream, T* slot, const T* prev, int64_t n) {
  const int64_t chunks = ceil_div(n, 8);
  for (int64_t c = first_chunk(); c < chunks; c += chunk_stride()) {
    float s[8], v[8];
    get8<kVec>(stream, c * 8, n, s);
    get8<kVec>(slot, c * 8, n, v);
#pragma unroll
    for (int e = 0; e < 8; ++e) s[e] = __fadd_rn(s[e], v[e]);
    put8<kVec>(stream, c * 8, n, s);
    if (kPrev) {
      float p[8];
      get8<kVec>(prev, c * 8, n, p);
#pragma unroll
      for (int e = 0; e < 8; ++e) v[e] = __fadd_rn(v[e], p[e]);
      put8<kVec>(slot, c * 8, n, v);
    }
  }
}

// (kResid: dresid += dx;) dr = alpha dx; partial[blockIdx.x] = this block's sum of dx r
// (each thread its chunks in order, an fma per element; then block_sum's fixed tree).
template <bool kVec, bool kResid, class T, class TA>
__global__ void gate_backward_kernel(T* dresid, T* dr, float* partial, const T* dx, const T* r,
                                     const TA* alpha, int64_t n) {
  const float a = load(alpha[0]);
  const int64_t chunks = ceil_div(n, 8);
  float acc = 0.f;
  for (int64_t c = first_chunk(); c < chunks; c += chunk_stride()) {
    float g[8], v[8], o[8];
    get8<kVec>(dx, c * 8, n, g);
    get8<kVec>(r, c * 8, n, v);
    if (kResid) {
      float d[8];
      get8<kVec>(dresid, c * 8, n, d);
#pragma unroll
      for (int e = 0; e < 8; ++e) d[e] = __fadd_rn(d[e], g[e]);
      put8<kVec>(dresid, c * 8, n, d);
    }
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      o[e] = __fmul_rn(a, g[e]);
      acc = __fmaf_rn(g[e], v[e], acc);
    }
    put8<kVec>(dr, c * 8, n, o);
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

// (kNext: slot += next, stored;) out = dresid + slot: add_inplace then add, with slot
// rounded to T between them as the sequence stores it.
template <bool kVec, bool kNext, class T>
__global__ void source_grad_kernel(T* out, T* slot, const T* dresid, const T* next, int64_t n) {
  const int64_t chunks = ceil_div(n, 8);
  for (int64_t c = first_chunk(); c < chunks; c += chunk_stride()) {
    float s[8], d[8];
    get8<kVec>(slot, c * 8, n, s);
    if (kNext) {
      float q[8];
      get8<kVec>(next, c * 8, n, q);
#pragma unroll
      for (int e = 0; e < 8; ++e) s[e] = __fadd_rn(s[e], q[e]);
      put8<kVec>(slot, c * 8, n, s);
#pragma unroll
      for (int e = 0; e < 8; ++e) s[e] = stored<T>(s[e]);
    }
    get8<kVec>(dresid, c * 8, n, d);
#pragma unroll
    for (int e = 0; e < 8; ++e) d[e] = __fadd_rn(d[e], s[e]);
    put8<kVec>(out, c * 8, n, d);
  }
}

// out[n, :] = row. Vector path: d % 8 == 0, so a chunk never straddles two rows.
template <bool kVec, class TO, class TR>
__global__ void broadcast_kernel(TO* out, const TR* row, int64_t N, int64_t d) {
  const int64_t n_all = N * d, chunks = ceil_div(n_all, 8);
  for (int64_t c = first_chunk(); c < chunks; c += chunk_stride()) {
    float f[8];
    if (kVec) {
      load8(row + (c * 8) % d, f);
      store8(out + c * 8, f);
    } else {
#pragma unroll
      for (int e = 0; e < 8; ++e) {
        const int64_t i = c * 8 + e;
        if (i < n_all) out[i] = store<TO>(load(row[i % d]));
      }
    }
  }
}

// partial[slab, c] = sum over the slab's token rows of dout[n, c], rows in order; grid
// (column groups, slabs). Vector path (d % 8 == 0): a thread owns 8 adjacent columns and
// reads them as one 16-byte access per row; each column's sum is the same sequence of
// fp32 adds as on the scalar path (a thread per column).
template <bool kVec, class T>
__global__ void column_partial_kernel(float* partial, const T* dout, int64_t N, int64_t d,
                                      int slabs) {
  constexpr int kCols = kVec ? 8 : 1;
  const int64_t c0 = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) * kCols;
  if (c0 >= d) return;
  const int slab = blockIdx.y;
  const int64_t begin = N * slab / slabs, end = N * (slab + 1) / slabs;
  float acc[kCols];
#pragma unroll
  for (int e = 0; e < kCols; ++e) acc[e] = 0.f;
#pragma unroll 4
  for (int64_t n = begin; n < end; ++n) {
    if (kVec) {
      float f[8];
      load8(dout + n * d + c0, f);
#pragma unroll
      for (int e = 0; e < kCols; ++e) acc[e] += f[e];
    } else {
      acc[0] += load(dout[n * d + c0]);
    }
  }
#pragma unroll
  for (int e = 0; e < kCols; ++e) partial[int64_t(slab) * d + c0 + e] = acc[e];
}

template <class TO>
__global__ void column_finish_kernel(TO* drow, const float* partial, int64_t d, int slabs) {
  const int64_t c = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (c >= d) return;
  float acc = 0.f;
  for (int s = 0; s < slabs; ++s) acc += partial[int64_t(s) * d + c];
  drow[c] = store<TO>(load(drow[c]) + acc);
}

bool all_aligned(std::initializer_list<const void*> ps) {
  for (const void* p : ps)
    if (p && !aligned16(p)) return false;
  return true;
}

int chunk_blocks(int64_t n) { return grid_stride_blocks(std::max<int64_t>(ceil_div(n, 8), 1), kThreads); }

// The gate backward's fixed grid: a function of n and the scratch only, so that the fused
// and unfused calls (and the vector and scalar paths) sum the same partials.
int gate_backward_blocks(int64_t n, const Tensor& scratch) {
  return int(std::max<int64_t>(
      1, std::min<int64_t>({int64_t(chunk_blocks(n)), kMaxPartials, scratch.numel()})));
}

// dresid (may be empty: no residual add), dr, dalpha, dx, r, alpha, scratch.
void gate_backward(cudaStream_t s, const char* what, Tensor dresid, Tensor dr, Tensor dalpha,
                   Tensor dx, Tensor r, Tensor alpha, Tensor scratch) {
  const int64_t n = dx.numel();
  check_numel(dr, n, what, "dr");
  check_numel(r, n, what, "r");
  check_numel(alpha, 1, what, "alpha");
  check_numel(dalpha, 1, what, "dalpha");
  check_dtype(dr, dx.dtype, what, "dr");
  check_dtype(r, dx.dtype, what, "r");
  const bool resid = !dresid.empty();
  if (resid) {
    check_numel(dresid, n, what, "dresid");
    check_dtype(dresid, dx.dtype, what, "dresid");
  }
  check_dtype(scratch, DType::F32, what, "scratch");
  if (scratch.numel() < 1) fail("CUDA ", what, ": empty scratch");
  const int blocks = gate_backward_blocks(n, scratch);
  float* partial = static_cast<float*>(scratch.data);
  const bool vec = all_aligned({dresid.data, dr.data, dx.data, r.data});
  dispatch_float(dx.dtype, what, [&](auto td) {
    dispatch_float(alpha.dtype, what, [&](auto ta) {
      using T = decltype(td);
      using TA = decltype(ta);
      auto kern = vec ? (resid ? gate_backward_kernel<true, true, T, TA>
                               : gate_backward_kernel<true, false, T, TA>)
                      : (resid ? gate_backward_kernel<false, true, T, TA>
                               : gate_backward_kernel<false, false, T, TA>);
      kern<<<blocks, kThreads, 0, s>>>(static_cast<T*>(dresid.data), static_cast<T*>(dr.data),
                                       partial, static_cast<const T*>(dx.data),
                                       static_cast<const T*>(r.data),
                                       static_cast<const TA*>(alpha.data), n);
      CUDA_CHECK_LAUNCH();
    });
  });
  delta_add_partials(s, dalpha, partial, blocks);
}

}  // namespace

void delta_add_partials(cudaStream_t s, Tensor out, const float* partial, int count) {
  dispatch_float(out.dtype, "delta_add_partials", [&](auto to) {
    using TO = decltype(to);
    sum_partials_kernel<TO><<<1, kThreads, 0, s>>>(static_cast<TO*>(out.data), partial, count);
    CUDA_CHECK_LAUNCH();
  });
}

void delta_gate(cudaStream_t s, Tensor x, Tensor base, Tensor alpha, Tensor r) {
  const int64_t n = x.numel();
  check_numel(base, n, "delta_gate", "base");
  check_numel(r, n, "delta_gate", "r");
  check_numel(alpha, 1, "delta_gate", "alpha");
  check_dtype(base, x.dtype, "delta_gate", "base");
  check_dtype(r, x.dtype, "delta_gate", "r");
  if (n == 0) return;
  const bool vec = all_aligned({x.data, base.data, r.data});
  dispatch_float(x.dtype, "delta_gate", [&](auto tx) {
    dispatch_float(alpha.dtype, "delta_gate", [&](auto ta) {
      using T = decltype(tx);
      using TA = decltype(ta);
      auto kern = vec ? gate_kernel<true, T, TA> : gate_kernel<false, T, TA>;
      kern<<<chunk_blocks(n), kThreads, 0, s>>>(
          static_cast<T*>(x.data), static_cast<const T*>(base.data),
          static_cast<const TA*>(alpha.data), static_cast<const T*>(r.data), n);
      CUDA_CHECK_LAUNCH();
    });
  });
}

void delta_gate_backward(cudaStream_t s, Tensor dr, Tensor dalpha, Tensor dx, Tensor r,
                         Tensor alpha, Tensor scratch) {
  gate_backward(s, "delta_gate_backward", Tensor(), dr, dalpha, dx, r, alpha, scratch);
}

void delta_resid_gate_backward(cudaStream_t s, Tensor dresid, Tensor dr, Tensor dalpha, Tensor dx,
                               Tensor r, Tensor alpha, Tensor scratch) {
  if (dresid.empty()) fail("CUDA delta_resid_gate_backward: no dresid");
  gate_backward(s, "delta_resid_gate_backward", dresid, dr, dalpha, dx, r, alpha, scratch);
}

void delta_stream_advance(cudaStream_t s, Tensor stream, Tensor slot, Tensor prev) {
  const char* what = "delta_stream_advance";
  const int64_t n = stream.numel();
  check_numel(slot, n, what, "slot");
  check_dtype(slot, stream.dtype, what, "slot");
  const bool has_prev = !prev.empty();
  if (has_prev) {
    check_numel(prev, n, what, "prev");
    check_dtype(prev, stream.dtype, what, "prev");
  }
  if (n == 0) return;
  const bool vec = all_aligned({stream.data, slot.data, prev.data});
  dispatch_float(stream.dtype, what, [&](auto tag) {
    using T = decltype(tag);
    auto kern = vec ? (has_prev ? advance_kernel<true, true, T> : advance_kernel<true, false, T>)
                    : (has_prev ? advance_kernel<false, true, T> : advance_kernel<false, false, T>);
    kern<<<chunk_blocks(n), kThreads, 0, s>>>(static_cast<T*>(stream.data),
                                              static_cast<T*>(slot.data),
                                              static_cast<const T*>(prev.data), n);
    CUDA_CHECK_LAUNCH();
  });
}

void delta_source_grad(cudaStream_t s, Tensor out, Tensor dresid, Tensor slot, Tensor next) {
  const char* what = "delta_source_grad";
  const int64_t n = out.numel();
  check_numel(dresid, n, what, "dresid");
  check_numel(slot, n, what, "slot");
  check_dtype(dresid, out.dtype, what, "dresid");
  check_dtype(slot, out.dtype, what, "slot");
  const bool has_next = !next.empty();
  if (has_next) {
    check_numel(next, n, what, "next");
    check_dtype(next, out.dtype, what, "next");
  }
  if (n == 0) return;
  const bool vec = all_aligned({out.data, dresid.data, slot.data, next.data});
  dispatch_float(out.dtype, what, [&](auto tag) {
    using T = decltype(tag);
    auto kern = vec ? (has_next ? source_grad_kernel<true, true, T> : source_grad_kernel<true, false, T>)
                    : (has_next ? source_grad_kernel<false, true, T>
                                : source_grad_kernel<false, false, T>);
    kern<<<chunk_blocks(n), kThreads, 0, s>>>(
        static_cast<T*>(out.data), static_cast<T*>(slot.data), static_cast<const T*>(dresid.data),
        static_cast<const T*>(next.data), n);
    CUDA_CHECK_LAUNCH();
  });
}

void delta_null_forward(cudaStream_t s, Tensor out, Tensor row) {
  if (out.ndim != 2) fail("CUDA delta_null_forward: out ", out.shape_str(), " is not [N, d]");
  const int64_t N = out.dim(0), d = out.dim(1);
  check_numel(row, d, "delta_null_forward", "row");
  if (N * d == 0) return;
  const bool vec = d % 8 == 0 && all_aligned({out.data, row.data});
  dispatch_float(out.dtype, "delta_null_forward", [&](auto to) {
    dispatch_float(row.dtype, "delta_null_forward", [&](auto tr) {
      using TO = decltype(to);
      using TR = decltype(tr);
      auto kern = vec ? broadcast_kernel<true, TO, TR> : broadcast_kernel<false, TO, TR>;
      kern<<<chunk_blocks(N * d), kThreads, 0, s>>>(static_cast<TO*>(out.data),
                                                    static_cast<const TR*>(row.data), N, d);
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
  if (scratch.numel() < d) fail("CUDA delta_null_backward: scratch of ", scratch.numel(), " < d = ", d);
  // One partial row per slab of tokens: as many slabs as the scratch holds rows (<= 64).
  const int slabs = int(std::max<int64_t>(
      1, std::min<int64_t>({scratch.numel() / d, 64, std::max<int64_t>(N, 1)})));
  float* partial = static_cast<float*>(scratch.data);
  const bool vec = d % 8 == 0 && all_aligned({dout.data});
  // Vector path: 32 threads a block, so that a d of a few thousand columns (a few hundred
  // groups of 8) still spreads over several blocks per slab.
  const int threads = vec ? 32 : kThreads;
  const dim3 grid(unsigned(ceil_div(vec ? d / 8 : d, threads)), unsigned(slabs));
  dispatch_float(dout.dtype, "delta_null_backward", [&](auto tg) {
    using T = decltype(tg);
    auto kern = vec ? column_partial_kernel<true, T> : column_partial_kernel<false, T>;
    kern<<<grid, threads, 0, s>>>(partial, static_cast<const T*>(dout.data), N, d, slabs);
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
