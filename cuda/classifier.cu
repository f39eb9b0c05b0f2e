// classifier.cu: fused softmax cross-entropy over logits [N, V] (BF16 or F32), targets [N]
// (I32, in [0, V): an id outside traps), losses [N] (F32, overwritten):
//   losses[n] = logsumexp(logits[n]) - logits[n, target[n]]
// With compute_grad the logits row is overwritten in place by its gradient
//   grad_scale * (softmax(logits[n]) - onehot(target[n])).
// One block per row. The row is read in 16-byte vectors (8 bf16 or 4 floats; a scalar
// prologue up to the first 16-byte boundary and a scalar tail, so any V and any row
// alignment take the vector path); each thread keeps an online (max, sum of exp) in fp32,
// one rescale per vector, merged across the block. No fp32 copy of the probabilities
// exists at any point: memory is the logits. Two kernels (cross_entropy_set_version):
// - version 1, `cross_entropy_kernel`: pass 2 (gradient only) re-reads the row from
//   memory: 2 reads and 1 write of the row with the gradient, 1 read without. 512 threads
//   with 16-byte loads and several blocks per SM keep enough loads in flight (the scalar
//   2-byte loads of the first version reached 0.91 TB/s at 1B). It takes every
//   losses-only call: one read is the floor there.
// - version 2, `cross_entropy_resident_kernel` (gradient only): the row read once and
//   held until its gradient is written, 1,024 threads, one block an SM, persistent: each
//   thread's first 5 vectors in registers, the next ones in shared memory (copied by
//   cp.async, up to the opt-in limit: 227 KB a block on Hopper), and any beyond those (a
//   row over ~300 KB: bf16 V > ~150k, fp32 V > ~75k) read again in pass 2; the block's
//   next row is loaded into each slot as pass 2 empties it. A Qwen3 row (V = 151,936,
//   297 KB in bf16) fits whole: 1 read and 1 write, the bytes the op must move. Its sums
//   run in another order than version 1's (the block's width and the vectors'
//   assignment), so the versions agree within rounding, not bit for bit.
#include <algorithm>
#include <utility>

#include "cuda/attention_mma.cuh"
#include "cuda/common.cuh"
#include "cuda/kernels.h"

namespace mhar::cuda {
namespace {

constexpr int kThreads = 512;

// Merge two (max, sum) online-softmax states.
__device__ __forceinline__ void merge(float& m, float& s, float m2, float s2) {
  const float mn = fmaxf(m, m2);
  if (mn == -INFINITY) return;  // both empty
  s = s * __expf(m - mn) + s2 * __expf(m2 - mn);
  m = mn;
}

// 16 bytes of T: the unit of the vector path.
template <class T> struct Pack {
  static constexpr int kN = 16 / int(sizeof(T));
  uint4 raw;
  __device__ __forceinline__ float get(int i) const {
    return load(reinterpret_cast<const T*>(&raw)[i]);
  }
  __device__ __forceinline__ void set(int i, float x) { reinterpret_cast<T*>(&raw)[i] = store<T>(x); }
};

// Folds values x[0..k) into the online state with one rescale.
template <int K>
__device__ __forceinline__ void fold(float& m, float& s, const float (&x)[K]) {
  float mx = x[0];
#pragma unroll
  for (int i = 1; i < K; ++i) mx = fmaxf(mx, x[i]);
  if (mx == -INFINITY) return;  // every value -inf: contributes nothing
  if (mx > m) {
    s *= __expf(m - mx);  // m = -inf (nothing yet): s = 0 * 0
    m = mx;
  }
  float add = 0.f;
#pragma unroll
  for (int i = 0; i < K; ++i) add += __expf(x[i] - m);
  s += add;
}

// The block's online states merged (warp shuffles, then warp 0 over the warps' states in
// shared memory); thread 0 stores the row's loss. Returns the row's logsumexp to every
// thread. `row_lse` and the target logit (written by thread 0 before the call) are
// published by its first barrier, before any gradient write.
template <int kWarps>
__device__ __forceinline__ float block_logsumexp(float m, float s, float* loss,
                                                 const float& target_logit) {
  __shared__ float sm_m[kWarps], sm_s[kWarps];
  __shared__ float row_lse;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const float m2 = __shfl_xor_sync(0xffffffffu, m, o);
    const float s2 = __shfl_xor_sync(0xffffffffu, s, o);
    merge(m, s, m2, s2);
  }
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  if (lane == 0) {
    sm_m[warp] = m;
    sm_s[warp] = s;
  }
  __syncthreads();
  if (warp == 0) {
    m = lane < kWarps ? sm_m[lane] : -INFINITY;
    s = lane < kWarps ? sm_s[lane] : 0.f;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      const float m2 = __shfl_xor_sync(0xffffffffu, m, o);
      const float s2 = __shfl_xor_sync(0xffffffffu, s, o);
      merge(m, s, m2, s2);
    }
    if (lane == 0) {
      row_lse = m + logf(s);
      *loss = row_lse - target_logit;
    }
  }
  __syncthreads();
  return row_lse;
}

__device__ __forceinline__ float logit_grad(float x, int64_t c, float lse, int32_t target,
                                            float grad_scale) {
  const float p = __expf(x - lse);
  return grad_scale * (c == target ? p - 1.f : p);
}

// The row's layout for the vector path: scalar elements [0, head), 16-byte vectors of T
// [head, head + nvec * kN), scalar elements [tail, V).
template <class T>
struct RowSplit {
  int64_t head, nvec, tail;
  __device__ RowSplit(const T* row, int64_t V) {
    constexpr int64_t kN = 16 / int64_t(sizeof(T));
    const int64_t misalign = int64_t(reinterpret_cast<uintptr_t>(row) & 15) / int64_t(sizeof(T));
    head = misalign == 0 ? 0 : (V < kN - misalign ? V : kN - misalign);
    nvec = (V - head) / kN;
    tail = head + nvec * kN;
  }
};

// Version 1: the row read in pass 1 (the online state) and again in pass 2 (the gradient).
template <class T>
__global__ void __launch_bounds__(kThreads)
    cross_entropy_kernel(float* losses, T* logits, const int32_t* targets, int64_t V,
                         float grad_scale, bool compute_grad) {
  using P = Pack<T>;
  constexpr int kN = P::kN;
  __shared__ float target_logit;
  const int64_t n = blockIdx.x;
  T* row = logits + n * V;
  const int32_t target = targets[n];
  if (target < 0 || target >= V) __trap();
  if (threadIdx.x == 0) target_logit = load(row[target]);
  const RowSplit<T> split(row, V);
  const int64_t head = split.head, nvec = split.nvec, tail = split.tail;
  P* vec = reinterpret_cast<P*>(row + head);

  float m = -INFINITY, s = 0.f;
  for (int64_t c = threadIdx.x; c < head; c += blockDim.x) {
    const float x[1] = {load(row[c])};
    fold(m, s, x);
  }
#pragma unroll 4
  for (int64_t i = threadIdx.x; i < nvec; i += blockDim.x) {
    const P p{*reinterpret_cast<const uint4*>(vec + i)};
    float x[kN];
#pragma unroll
    for (int k = 0; k < kN; ++k) x[k] = p.get(k);
    fold(m, s, x);
  }
  for (int64_t c = tail + threadIdx.x; c < V; c += blockDim.x) {
    const float x[1] = {load(row[c])};
    fold(m, s, x);
  }
  const float lse = block_logsumexp<kThreads / 32>(m, s, losses + n, target_logit);
  if (!compute_grad) return;
  for (int64_t c = threadIdx.x; c < head; c += blockDim.x)
    row[c] = store<T>(logit_grad(load(row[c]), c, lse, target, grad_scale));
#pragma unroll 4
  for (int64_t i = threadIdx.x; i < nvec; i += blockDim.x) {
    P p{*reinterpret_cast<const uint4*>(vec + i)};
    const int64_t c0 = head + i * kN;
#pragma unroll
    for (int k = 0; k < kN; ++k) p.set(k, logit_grad(p.get(k), c0 + k, lse, target, grad_scale));
    *reinterpret_cast<uint4*>(vec + i) = p.raw;
  }
  for (int64_t c = tail + threadIdx.x; c < V; c += blockDim.x)
    row[c] = store<T>(logit_grad(load(row[c]), c, lse, target, grad_scale));
}

constexpr int kResidentThreads = 1024;
constexpr int kRegisterVectors = 5;  // 20 of the 64 registers a thread may have at 1,024

// Version 2 (gradient only), persistent: block b takes rows b, b + gridDim.x, ... Thread t
// owns the vectors t + k * 1024 of each row: for k < kRegisterVectors in registers
// (held[k]), for the next `staged_rows` values of k in shared memory
// (staged[(k - kRegisterVectors) * 1024 + t]: consecutive threads, consecutive 16 bytes),
// and later ones are read again in pass 2. The slots are storage only: each row indexes
// its vectors by its own alignment. Pass 2 of a row refills each slot with the block's
// next row as soon as the slot's gradient is stored, so the next row's loads run under
// this row's arithmetic and stores (one block fills an SM: no other block overlaps them).
// A thread reads back only the shared memory it copied into, so cp.async's wait is the
// only synchronisation the staging needs.
template <class T>
__global__ void __launch_bounds__(kResidentThreads, 1)
    cross_entropy_resident_kernel(float* losses, T* logits, const int32_t* targets, int64_t N,
                                  int64_t V, float grad_scale, int staged_rows) {
  using P = Pack<T>;
  constexpr int kN = P::kN, B = kResidentThreads;
  extern __shared__ uint4 staged[];
  __shared__ float target_logit;
  const int t = threadIdx.x;
  const int64_t first_staged = int64_t(kRegisterVectors) * B;
  const int64_t first_reread = first_staged + int64_t(staged_rows) * B;
  uint4 held[kRegisterVectors] = {};

  // Issues every resident load of row n: the shared-memory part by cp.async, then the
  // register part (used only after the fold of the previous row's data, if any).
  auto issue_row = [&](int64_t n) {
    const T* row = logits + n * V;
    const RowSplit<T> split(row, V);
    const P* vec = reinterpret_cast<const P*>(row + split.head);
    for (int k = 0; k < staged_rows; ++k)
      if (const int64_t i = first_staged + int64_t(k) * B + t; i < split.nvec)
        attn_mma::cp_async16(&staged[k * B + t], vec + i, true);
    attn_mma::cp_async_commit();
#pragma unroll
    for (int k = 0; k < kRegisterVectors; ++k)
      if (const int64_t i = int64_t(k) * B + t; i < split.nvec)
        held[k] = *reinterpret_cast<const uint4*>(vec + i);
  };

  int64_t n = blockIdx.x;
  if (n < N) issue_row(n);
  for (; n < N; n += gridDim.x) {
    T* row = logits + n * V;
    const int32_t target = targets[n];
    if (target < 0 || target >= V) __trap();
    // The previous row's reads of target_logit all came before its second barrier.
    if (t == 0) target_logit = load(row[target]);
    const RowSplit<T> split(row, V);
    const int64_t head = split.head, nvec = split.nvec, tail = split.tail;
    P* vec = reinterpret_cast<P*>(row + head);

    float m = -INFINITY, s = 0.f;
    auto fold_vector = [&](const uint4& raw) {
      const P p{raw};
      float x[kN];
#pragma unroll
      for (int k = 0; k < kN; ++k) x[k] = p.get(k);
      fold(m, s, x);
    };
    for (int64_t c = t; c < head; c += B) {
      const float x[1] = {load(row[c])};
      fold(m, s, x);
    }
#pragma unroll
    for (int k = 0; k < kRegisterVectors; ++k)
      if (int64_t(k) * B + t < nvec) fold_vector(held[k]);
    attn_mma::cp_async_wait<0>();
    for (int k = 0; k < staged_rows; ++k)
      if (first_staged + int64_t(k) * B + t < nvec) fold_vector(staged[k * B + t]);
    for (int64_t i = first_reread + t; i < nvec; i += B)
      fold_vector(*reinterpret_cast<const uint4*>(vec + i));
    for (int64_t c = tail + t; c < V; c += B) {
      const float x[1] = {load(row[c])};
      fold(m, s, x);
    }
    const float lse = block_logsumexp<B / 32>(m, s, losses + n, target_logit);

    // Pass 2, each resident slot refilled from the next row once its gradient is out.
    const int64_t next = n + gridDim.x;
    const bool refill = next < N;
    const T* next_row = logits + next * V;
    const RowSplit<T> next_split(refill ? next_row : row, V);
    const P* next_vec = reinterpret_cast<const P*>(next_row + next_split.head);
    auto write_vector = [&](uint4 raw, int64_t i) {
      P p{raw};
      const int64_t c0 = head + i * kN;
#pragma unroll
      for (int k = 0; k < kN; ++k) p.set(k, logit_grad(p.get(k), c0 + k, lse, target, grad_scale));
      *reinterpret_cast<uint4*>(vec + i) = p.raw;
    };
    for (int64_t c = t; c < head; c += B)
      row[c] = store<T>(logit_grad(load(row[c]), c, lse, target, grad_scale));
    for (int k = 0; k < staged_rows; ++k) {
      const int64_t i = first_staged + int64_t(k) * B + t;
      if (i < nvec) write_vector(staged[k * B + t], i);
      if (refill && i < next_split.nvec) attn_mma::cp_async16(&staged[k * B + t], next_vec + i, true);
    }
    attn_mma::cp_async_commit();
#pragma unroll
    for (int k = 0; k < kRegisterVectors; ++k) {
      const int64_t i = int64_t(k) * B + t;
      if (i < nvec) write_vector(held[k], i);
      if (refill && i < next_split.nvec) held[k] = *reinterpret_cast<const uint4*>(next_vec + i);
    }
    for (int64_t i = first_reread + t; i < nvec; i += B)
      write_vector(*reinterpret_cast<const uint4*>(vec + i), i);
    for (int64_t c = tail + t; c < V; c += B)
      row[c] = store<T>(logit_grad(load(row[c]), c, lse, target, grad_scale));
  }
}

// Launches version 2: as many shared-memory rows as a row needs, at most what the
// device's opt-in limit leaves beside the kernel's static shared memory (the kernel's
// dynamic limit is raised once, to that most); as many blocks as fit on the device at
// once, at most one a row.
template <class T>
void launch_resident(cudaStream_t s, float* losses, T* logits, const int32_t* targets, int64_t N,
                     int64_t V, float grad_scale) {
  constexpr int B = kResidentThreads;
  static const std::pair<int, int> limits = [] {
    int dev = 0, optin = 0, count = 0;
    CUDA_CHECK(cudaGetDevice(&dev));
    CUDA_CHECK(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev));
    CUDA_CHECK(cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, dev));
    cudaFuncAttributes attr{};
    CUDA_CHECK(cudaFuncGetAttributes(&attr, cross_entropy_resident_kernel<T>));
    const int rows = std::max(0, (optin - int(attr.sharedSizeBytes)) / (16 * B));
    CUDA_CHECK(cudaFuncSetAttribute(cross_entropy_resident_kernel<T>,
                                    cudaFuncAttributeMaxDynamicSharedMemorySize, rows * 16 * B));
    return std::pair{rows, count};
  }();
  const auto [most, sms] = limits;
  constexpr int64_t kN = 16 / int64_t(sizeof(T));
  const int64_t vectors = (V + kN - 1) / kN;  // a row's vectors, whatever its alignment
  const int rows = int(std::clamp<int64_t>((vectors + B - 1) / B - kRegisterVectors, 0, most));
  const size_t smem = size_t(rows) * 16 * B;
  int per_sm = 0;
  CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(
      &per_sm, cross_entropy_resident_kernel<T>, B, smem));
  const int64_t grid = std::min<int64_t>(N, int64_t(std::max(per_sm, 1)) * sms);
  cross_entropy_resident_kernel<T><<<unsigned(grid), B, smem, s>>>(losses, logits, targets, N, V,
                                                                   grad_scale, rows);
}

int g_version = 0;  // 0: the default (version 2 with the gradient, 1 without)

}  // namespace

void cross_entropy(cudaStream_t s, Tensor losses, Tensor logits, Tensor targets,
                   double grad_scale, bool compute_grad) {
  check_dtype(targets, DType::I32, "cross_entropy", "targets");
  check_dtype(losses, DType::F32, "cross_entropy", "losses");
  const int64_t N = targets.numel();
  check_numel(losses, N, "cross_entropy", "losses");
  MHAR_CHECK(N > 0 && logits.numel() % N == 0, "cross_entropy: logits ", logits.shape_str(),
             " for ", N, " targets");
  const int64_t V = logits.numel() / N;
  MHAR_CHECK(V > 0, "cross_entropy: empty vocabulary");
  MHAR_CHECK(N <= 0x7fffffff, "cross_entropy: too many rows");
  dispatch_float(logits.dtype, "cross_entropy", [&](auto tag) {
    using T = decltype(tag);
    T* rows = static_cast<T*>(logits.data);
    if (compute_grad && g_version != 1)
      launch_resident<T>(s, losses.ptr<float>(), rows, targets.ptr<int32_t>(), N, V,
                         float(grad_scale));
    else
      cross_entropy_kernel<T><<<unsigned(N), kThreads, 0, s>>>(
          losses.ptr<float>(), rows, targets.ptr<int32_t>(), V, float(grad_scale), compute_grad);
    CUDA_CHECK_LAUNCH();
  });
}

int cross_entropy_set_version(int version) {
  const int previous = g_version;
  g_version = version == 1 || version == 2 ? version : 0;
  return previous;
}

}  // namespace mhar::cuda
