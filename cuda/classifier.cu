// classifier.cu: fused softmax cross-entropy over logits [N, V] (BF16 or F32), targets [N]
// (I32, in [0, V): an id outside traps), losses [N] (F32, overwritten):
//   losses[n] = logsumexp(logits[n]) - logits[n, target[n]]
// With compute_grad the logits row is overwritten in place by its gradient
//   grad_scale * (softmax(logits[n]) - onehot(target[n])).
// The row is taken in 16-byte vectors (8 bf16 or 4 floats; a scalar prologue up to the
// first 16-byte boundary and a scalar tail, so any V and any row alignment take the vector
// path). Per thread an online (max, sum of exp) in fp32, one rescale per vector, merged
// across the block. No fp32 copy of the probabilities exists at any point: memory is the
// logits. Ten kernel-lab versions (cross_entropy_set_version) in three kernels:
// 1 one block per row: pass 1 folds the row, pass 2 (gradient only) re-reads it and writes
//   each element once. 512 threads with 16-byte loads and several blocks an SM keep enough
//   loads in flight (the scalar 2-byte loads of the first form reached 0.91 TB/s at 1B);
//   4 blocks an SM hold ~150 MB of Qwen3 rows (300 KB each) at once, more than L2, so
//   pass 2's reads may go to DRAM again.
// 2 a cluster of C blocks a row (C = 1, 2, 4 or 8: a block's segment of the row at most
//   kSegmentTarget bytes): each block has its segment copied into shared memory by the
//   copy engine in pieces of 8 KB, one transaction barrier each, so that its fold starts
//   on the first piece; the blocks' (max, sum) are merged through distributed shared
//   memory (every block merges the C states in rank order, so all hold the same
//   logsumexp); pass 2 writes the gradient from shared memory. The row is read from DRAM
//   once. Its sums differ from version 1's in order (the CPU parity bound).
// 3 as 2, with pass 1 overwriting each vector of the segment by its exps e = exp(x - m)
//   in fp16 (at most 1; m the thread's running max when it folded the vector, kept as one
//   float a vector after the segment), so that pass 2 takes one exp a vector, p = e
//   exp(m - lse), rather than one an element: ~1.1 exps an element in all against ~2.1.
//   The losses are version 2's bits (pass 1's sums are unchanged); the gradient gains one
//   fp16 rounding of e (2^-11 relative, a quarter of its bf16 rounding; 2^-25 absolute
//   below fp16's normal range).
// 4 version 3 in fewer instructions (ncu of version 3: 238 warp instructions a vector of
//   8 and 0.67 issued a scheduler cycle, so its issue, not its bytes, bounded it): exps
//   by ex2.approx.ftz (fast_exp: __expf's bits wherever the result is normal, without
//   the 4 instructions an exp that keep denormal results), the target looked for once a
//   vector in pass 2 rather than by 8 compares of 64-bit places, 32-bit vector indices.
//   Losses: version 2's bits; gradient: version 3's (both checked by CrossEntropyParity).
// 5 version 4 with pass 1's per-element x - m and multiply by log2(e) as one FFMA against
//   m log2(e) rounded once a change of m (8 instructions fewer a vector of 8), the
//   vector's max and sum as trees (a shorter dependent chain; the sum's order changes).
//   Its losses are not version 2's bits: each exp carries a factor within ~2^-24 |m log2
//   e| of 1 (fold_fma), ~1e-6 relative to the sum at Qwen3's logits, far inside the CPU
//   bound (1e-4); its gradient stays within the bf16 bound as version 4's.
// 6 version 5 with a cheaper exchange of the blocks' states (SYNC in the cluster kernel: a
//   fence by the one writing thread and relaxed arrives instead of every thread's release,
//   the states loaded by one lane each at once): version 5's bits, losses and gradient
//   (CrossEntropyParity checks them).
// 7 version 6 on a persistent grid of clusters with two rows a block in flight (the next
//   row folded while the cluster's states of this one come in; cross_entropy_stream_kernel):
//   version 6's bits. Rows whose two buffers would exceed kSegmentMax take version 6.
// 8 version 7 with blocks of 512 threads (32 warps an SM where 7 has 16). Not its bits:
//   each thread folds half as many vectors, so the sums run in another order and the
//   kept maxima differ (within the CPU bound; CrossEntropyParity checks it there).
// 9 (the default for bf16 rows; fp32 rows take 2) version 6 with its kept maxima in 2
//   bytes a vector, not 4 (COARSE in the cluster kernel), so that 5 blocks fit an SM's
//   228 KB at Qwen3's rows where 6 fits 4 (8 blocks of 2,374 vectors: 42.7 KB of shared
//   memory each against 47.5 KB, and 1.3 KB more a block); GPT-2's rows stay at 7. A
//   thread's running max is taken on bf16's grid, rounded up (a bf16 number >= every logit
//   folded so far, at most 2^-7 |m| above the true max), so every kept m is a bf16 number,
//   kept exactly in 2 bytes. The sums are version 6's terms each times exp(m - m_bf16)
//   (the same state, another reference), so the losses are within the rounding bound of
//   version 5's (CrossEntropyParity) and the exps stay <= 1 in fp16, at most a factor ~0.9
//   smaller at Qwen3's logits.
// 10 version 9's kernel on clusters of up to 16 blocks (a non-portable size, which Hopper
//   allows) with segments of at most 20 KB: 16 blocks of 19 KB a Qwen3 row, 22.7 KB of
//   shared memory a block, so 8 blocks an SM (64 warps, every register: 32 a thread), twice
//   version 6's warps, with twice its blocks' fixed costs a byte. Its segments are not
//   version 9's, so neither are its sums' orders: checked as version 9 is.
// Measured (KernelBandwidth.DISABLED_CrossEntropyVersions, bf16, with the gradient, ms,
// two rounds each, twenty-ninth session): [2048, 151936] v1 / v2 / v3 / v4 0.480 / 0.460 /
// 0.455 / 0.421, [5462, 151936] (the configs' chunk) 1.230 / 1.211 / 1.198 / 1.104,
// [4096, 50257] 0.359 / 0.296 / 0.284 / 0.262: v4 at 70-74% of copy by the bytes the op
// must move (v3 64-68%). So reading the row once gains 2-5% on Qwen3's rows (17% on
// GPT-2's, whose v1 rows start misaligned), half the exps another 1-2%, and version 4's
// instruction diet 8%. Thirty-first session, the same test, v4 / v5: [2048, 151936] 0.4220 /
// 0.4195, 0.4221 / 0.4195; [5462, 151936] 1.1089 / 1.1020, 1.1083 / 1.1028; [4096, 50257]
// 0.2631 / 0.2593, 0.2624 / 0.2589: v5 0.5-1.5% faster (70-71% of copy on Qwen3's rows,
// 75% on GPT-2's), less than its ~4% fewer instructions: pass 1's FADDs were not what
// bounds it. Thirty-third session, the same test, v5 / v6: [2048, 151936] 0.4201 / 0.3955,
// 0.4196 / 0.3939; [5462, 151936] 1.1015 / 1.0399, 1.0993 / 1.0389; [4096, 50257] 0.2591 /
// 0.2467, 0.2593 / 0.2476: v6 5-6% faster (74% of 4.3 TB/s on Qwen3's rows, 77% on
// GPT-2's). Thirty-seventh session, on an H100 (copy 3.03 TB/s), the same test, v6 / v7 /
// v8: [2048, 151936] 0.469 / 0.554 / 0.564, [5462, 151936] 1.231 / 1.454 / 1.485, [4096,
// 50257] 0.296 / 0.382 / 0.488: the persistent versions lose there (v6 already at 88-92%
// of that card's copy rate); not yet timed on an H200. Thirty-eighth session, the same
// card and test (copy 3.01 TB/s), v6 / v9 / v10 in two rounds: [2048, 151936] 0.4721 /
// 0.4545 / 0.4920, 0.4715 / 0.4549 / 0.4917; [5462, 151936] 1.2367 / 1.1906 / 1.2935,
// 1.2365 / 1.1902 / 1.2936; [4096, 50257] 0.2984 / 0.2990 / 0.3553, 0.2977 / 0.2991 /
// 0.3550: v9 3.7% faster on Qwen3's rows (92.6% of copy at the configs' chunk) and even on
// GPT-2's (7 blocks an SM either way), so it is the default; v10's wide clusters lose
// 4-19%. cuda/NOTES.md, lead 4.
#include <cuda_fp16.h>

#include <algorithm>
#include <map>
#include <tuple>

#include "cuda/common.cuh"
#include "cuda/kernels.h"
#include "cuda/mbarrier.cuh"

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

// FTZ: fast_exp (common.cuh), __expf's bits wherever the result is normal.
template <bool FTZ>
__device__ __forceinline__ float exp_of(float x) {
  return FTZ ? fast_exp(x) : __expf(x);
}

// The start of a fold of values whose max is mx: false where every value is -inf (they
// contribute nothing: e zeroed, the state untouched); else true, with the state's max raised
// to mx where mx is larger (s rescaled, then on_raise() for what the caller keeps of m).
template <int K, bool FTZ, class OnRaise>
__device__ __forceinline__ bool fold_start(float& m, float& s, float mx, float (&e)[K],
                                           OnRaise&& on_raise) {
  if (mx == -INFINITY) {
#pragma unroll
    for (int i = 0; i < K; ++i) e[i] = 0.f;
    return false;
  }
  if (mx > m) {
    s *= exp_of<FTZ>(m - mx);  // m = -inf (nothing yet): s = 0 * 0
    m = mx;
    on_raise();
  }
  return true;
}

// Folds values x[0..k) into the online state with one rescale; e[i] = exp(x[i] - m) at the
// m after it (what versions 3-4 keep; 0 where every value is -inf). FTZ: fast_exp.
template <int K, bool FTZ = false>
__device__ __forceinline__ void fold(float& m, float& s, const float (&x)[K], float (&e)[K]) {
  float mx = x[0];
#pragma unroll
  for (int i = 1; i < K; ++i) mx = fmaxf(mx, x[i]);
  if (!fold_start<K, FTZ>(m, s, mx, e, [] {})) return;
  float add = 0.f;
#pragma unroll
  for (int i = 0; i < K; ++i) {
    e[i] = exp_of<FTZ>(x[i] - m);
    add += e[i];
  }
  s += add;
}
template <int K>
__device__ __forceinline__ void fold(float& m, float& s, const float (&x)[K]) {
  float unused[K];
  fold(m, s, x, unused);
}
template <bool FTZ = false, class T>
__device__ __forceinline__ void fold(float& m, float& s, const Pack<T>& pk,
                                     float (&e)[Pack<T>::kN]) {
  float x[Pack<T>::kN];
#pragma unroll
  for (int k = 0; k < Pack<T>::kN; ++k) x[k] = pk.get(k);
  fold<Pack<T>::kN, FTZ>(m, s, x, e);
}
template <class T>
__device__ __forceinline__ void fold(float& m, float& s, const Pack<T>& pk) {
  float unused[Pack<T>::kN];
  fold(m, s, pk, unused);
}
// The least bf16 number >= x, as a float (version 9's grid of maxima): -inf and +inf stay,
// a finite x moves up by less than one bf16 ulp (2^-7 |x| at most); x above bf16's largest
// finite number becomes +inf.
__device__ __forceinline__ float bf16_at_least(float x) {
  return __bfloat162float(__float2bfloat16_ru(x));
}
// Version 5's fold of one bf16 vector: each exp's exponent one FFMA, x log2(e) - m log2(e),
// with m_log2e = m log2(e) rounded once when m changes (version 4: x - m, then the
// multiply); the max and the sum as trees (depth 3, not 7-8; the max's bits do not
// depend on its order, the sum's do). e[i] = 2^(x[i] log2 e - m_log2e): exp(x[i] - m)
// times 2^(m log2 e - m_log2e), a factor within 2^-24 |m log2 e| ln 2 of 1 (~9e-7 at a
// logit of 15) common to the vector's elements and to what they add to s.
// COARSE (version 9): m raised to bf16_at_least(mx), not to mx; a state whose m is on
// bf16's grid stays there.
template <bool COARSE = false>
__device__ __forceinline__ void fold_fma(float& m, float& m_log2e, float& s, const uint4& raw,
                                         float (&e)[8]) {
  float x[8];
  unpack8(raw, x);
  float mx = fmaxf(fmaxf(fmaxf(x[0], x[1]), fmaxf(x[2], x[3])),
                   fmaxf(fmaxf(x[4], x[5]), fmaxf(x[6], x[7])));
  // On the grid, mx > m exactly when bf16_at_least(mx) > m, and -inf stays -inf.
  if constexpr (COARSE) mx = bf16_at_least(mx);
  if (!fold_start<8, true>(m, s, mx, e, [&] { m_log2e = mx * kLog2e; })) return;
#pragma unroll
  for (int i = 0; i < 8; ++i) e[i] = fast_exp2(fmaf(x[i], kLog2e, -m_log2e));
  s += ((e[0] + e[1]) + (e[2] + e[3])) + ((e[4] + e[5]) + (e[6] + e[7]));
}
// Folds the row's elements [from, to) one at a time, strided over the block's threads.
template <class T>
__device__ __forceinline__ void fold_scalars(float& m, float& s, const T* row, int64_t from,
                                             int64_t to) {
  for (int64_t c = from + threadIdx.x; c < to; c += blockDim.x) {
    const float x[1] = {load(row[c])};
    fold(m, s, x);
  }
}

// Merges the block's threads' states; warp 0 holds the result (lane 0 reads it). sm_m and
// sm_s: a float a warp each. A block barrier: the caller's shared writes before it are
// visible to every thread after it.
__device__ __forceinline__ void merge_block(float& m, float& s, float* sm_m, float* sm_s) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const float m2 = __shfl_xor_sync(0xffffffffu, m, o);
    const float s2 = __shfl_xor_sync(0xffffffffu, s, o);
    merge(m, s, m2, s2);
  }
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  if (lane == 0) sm_m[warp] = m, sm_s[warp] = s;
  __syncthreads();
  if (warp == 0) {
    m = lane < int(blockDim.x >> 5) ? sm_m[lane] : -INFINITY;
    s = lane < int(blockDim.x >> 5) ? sm_s[lane] : 0.f;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      const float m2 = __shfl_xor_sync(0xffffffffu, m, o);
      const float s2 = __shfl_xor_sync(0xffffffffu, s, o);
      merge(m, s, m2, s2);
    }
  }
}

// A row's scalar elements [0, head), 16-byte vectors [head, tail) (nvec of them), scalar
// tail [tail, V): vectors wherever the row's alignment allows.
struct RowSpans {
  int64_t head, nvec, tail;
};
template <class T>
__device__ __forceinline__ RowSpans row_spans(const T* row, int64_t V) {
  constexpr int64_t kN = Pack<T>::kN;
  const int64_t misalign = int64_t(reinterpret_cast<uintptr_t>(row) & 15) / int64_t(sizeof(T));
  const int64_t head = misalign == 0 ? 0 : (V < kN - misalign ? V : kN - misalign);
  const int64_t nvec = (V - head) / kN;
  return {head, nvec, head + nvec * kN};
}

// A logit's gradient: grad_scale (softmax - onehot).
__device__ __forceinline__ float logit_grad(float x, bool is_target, float lse, float grad_scale) {
  const float p = __expf(x - lse);
  return grad_scale * (is_target ? p - 1.f : p);
}
// Overwrites the row's elements [from, to) with their gradients, strided over the block's
// threads.
template <class T>
__device__ __forceinline__ void grad_scalars(T* row, int64_t from, int64_t to, int32_t target,
                                             float lse, float grad_scale) {
  for (int64_t c = from + threadIdx.x; c < to; c += blockDim.x)
    row[c] = store<T>(logit_grad(load(row[c]), c == target, lse, grad_scale));
}

template <class T>
__global__ void __launch_bounds__(kThreads)
    cross_entropy_kernel(float* losses, T* logits, const int32_t* targets, int64_t V,
                         float grad_scale, bool compute_grad) {
  using P = Pack<T>;
  constexpr int kN = P::kN;
  __shared__ float sm_m[kThreads / 32], sm_s[kThreads / 32];
  __shared__ float row_lse, target_logit;
  const int64_t n = blockIdx.x;
  T* row = logits + n * V;
  const int32_t target = targets[n];
  if (target < 0 || target >= V) __trap();
  if (threadIdx.x == 0) target_logit = load(row[target]);

  const auto [head, nvec, tail] = row_spans(row, V);
  P* vec = reinterpret_cast<P*>(row + head);

  float m = -INFINITY, s = 0.f;
  fold_scalars(m, s, row, 0, head);
#pragma unroll 4
  for (int64_t i = threadIdx.x; i < nvec; i += blockDim.x)
    fold(m, s, P{*reinterpret_cast<const uint4*>(vec + i)});
  fold_scalars(m, s, row, tail, V);
  merge_block(m, s, sm_m, sm_s);  // its barrier: the target read before any gradient write
  if (threadIdx.x == 0) {
    row_lse = m + logf(s);
    losses[n] = row_lse - target_logit;
  }
  if (!compute_grad) return;
  __syncthreads();
  const float lse = row_lse;
  grad_scalars(row, 0, head, target, lse, grad_scale);
#pragma unroll 4
  for (int64_t i = threadIdx.x; i < nvec; i += blockDim.x) {
    P p{*reinterpret_cast<const uint4*>(vec + i)};
    const int64_t c0 = head + i * kN;
#pragma unroll
    for (int k = 0; k < kN; ++k) p.set(k, logit_grad(p.get(k), c0 + k == target, lse, grad_scale));
    *reinterpret_cast<uint4*>(vec + i) = p.raw;
  }
  grad_scalars(row, tail, V, target, lse, grad_scale);
}

// Eight floats as fp16 (round to nearest) in 16 bytes, and back (version 3's kept exps).
__device__ __forceinline__ uint4 pack_half8(const float (&f)[8]) {
  uint4 r;
  uint32_t* w = reinterpret_cast<uint32_t*>(&r);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const __half2 h = __floats2half2_rn(f[2 * i], f[2 * i + 1]);
    w[i] = *reinterpret_cast<const uint32_t*>(&h);
  }
  return r;
}
__device__ __forceinline__ void unpack_half8(const uint4& r, float (&f)[8]) {
  const uint32_t* w = reinterpret_cast<const uint32_t*>(&r);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 x = __half22float2(*reinterpret_cast<const __half2*>(&w[i]));
    f[2 * i] = x.x, f[2 * i + 1] = x.y;
  }
}

// Versions 4-8's gradient of one vector from its kept fp16 exps e (taken at kept_m):
// grad_scale (e exp(kept_m - lse) - onehot), `at` the target's place in the vector (the
// one-hot by selects, not an index, so that e stays in registers).
__device__ __forceinline__ uint4 kept_grad(const uint4& kept, float kept_m, int64_t at, float lse,
                                           float grad_scale) {
  float e[8];
  unpack_half8(kept, e);
  const float scaled = grad_scale * fast_exp(kept_m - lse);
#pragma unroll
  for (int k = 0; k < 8; ++k) e[k] *= scaled;
  if (uint64_t(at) < 8u) {
    const int t = int(at);
#pragma unroll
    for (int k = 0; k < 8; ++k) e[k] = k == t ? e[k] - grad_scale : e[k];
  }
  Pack<bf16> pk;
#pragma unroll
  for (int k = 0; k < 8; ++k) pk.set(k, e[k]);
  return pk.raw;
}

// Version 2's geometry: a block's threads, its row segment's target and limit (a row whose
// segment would exceed kSegmentMax at kMaxCluster blocks takes version 1), the pieces.
constexpr int kClusterThreads = 256;
constexpr int kMaxCluster = 8;                 // the portable cluster size
constexpr int64_t kSegmentTarget = 40 * 1024;  // 5 blocks an SM by shared memory
// Version 10's: Hopper's largest cluster (non-portable) and half the segment.
constexpr int kMaxClusterWide = 16;
constexpr int64_t kSegmentTargetWide = 20 * 1024;
constexpr int64_t kSegmentMax = 192 * 1024;
constexpr int kPieceVectors = 512;  // 8 KB
constexpr int kMaxPieces = int(kSegmentMax / (16 * kPieceVectors));
static_assert(kSegmentMax % (16 * kPieceVectors) == 0, "whole pieces");

// Cluster primitives (sm_90; the project builds for sm_90 only, older targets trap).
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
#define MHAR_CE_OLD_ARCH 1
#endif
// This block's rank in its cluster, the cluster's blocks, the cluster's index in the grid,
// the grid's clusters.
enum class ClusterReg { Rank, Blocks, Index, Count };
template <ClusterReg R>
__device__ __forceinline__ uint32_t cluster_reg() {
  uint32_t r = 0;
#ifdef MHAR_CE_OLD_ARCH
  __trap();
#else
  if constexpr (R == ClusterReg::Rank)
    asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
  else if constexpr (R == ClusterReg::Blocks)
    asm volatile("mov.u32 %0, %%cluster_nctarank;" : "=r"(r));
  else if constexpr (R == ClusterReg::Index)
    asm volatile("mov.u32 %0, %%clusterid.x;" : "=r"(r));
  else
    asm volatile("mov.u32 %0, %%nclusterid.x;" : "=r"(r));
#endif
  return r;
}
// Every thread of every block of the cluster: arrive (release: this thread's writes before
// it are visible to the cluster after the wait), then wait (acquire).
__device__ __forceinline__ void cluster_arrive() {
#ifdef MHAR_CE_OLD_ARCH
  __trap();
#else
  asm volatile("barrier.cluster.arrive.release.aligned;\n" ::: "memory");
#endif
}
// The same barrier without release semantics: a thread whose writes the cluster must see
// orders them first by cluster_fence (version 6: only the thread that wrote them).
__device__ __forceinline__ void cluster_arrive_relaxed() {
#ifdef MHAR_CE_OLD_ARCH
  __trap();
#else
  asm volatile("barrier.cluster.arrive.relaxed.aligned;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void cluster_fence() {
#ifdef MHAR_CE_OLD_ARCH
  __trap();
#else
  asm volatile("fence.acq_rel.cluster;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void cluster_wait() {
#ifdef MHAR_CE_OLD_ARCH
  __trap();
#else
  asm volatile("barrier.cluster.wait.acquire.aligned;\n" ::: "memory");
#endif
}
// The float at p's place in the shared memory of the cluster's block `rank`.
__device__ __forceinline__ float load_cluster_shared(const float* p, uint32_t rank) {
  float v = 0.f;
#ifdef MHAR_CE_OLD_ARCH
  __trap();
#else
  uint32_t remote;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;"
               : "=r"(remote)
               : "r"(smem_addr(p)), "r"(rank));
  asm volatile("ld.shared::cluster.f32 %0, [%1];" : "=f"(v) : "r"(remote) : "memory");
#endif
  return v;
}
#undef MHAR_CE_OLD_ARCH

// A vector's kept m (KEEP): a float, or in version 9 (COARSE) a bf16 number, which holds
// that version's m exactly (they are on bf16's grid).
template <bool COARSE>
struct KeptMax {
  float m;
  static __device__ __forceinline__ KeptMax of(float x) { return {x}; }
  __device__ __forceinline__ explicit operator float() const { return m; }
};
template <>
struct KeptMax<true> {
  bf16 m;
  static __device__ __forceinline__ KeptMax of(float x) { return {__float2bfloat16_rn(x)}; }
  __device__ __forceinline__ explicit operator float() const { return __bfloat162float(m); }
};

// Version 2. segment_vectors: each block's share of a row's vectors (its rank's run of
// them; the last blocks' may be short or empty). Rank 0 also takes the scalar head and
// tail and the target's logit, which it reads before the first cluster barrier: no block
// writes the row before it.
// KEEP (version 3, bf16): pass 1 overwrites each vector of the segment with its exps
// (fp16; exp(x - m) <= 1) and records the m they were taken at (one float a vector, after
// the segment), so that pass 2 takes one exp a vector, p = e exp(m - lse), rather than
// one an element.
// LEAN (version 4, with KEEP): version 3's arithmetic with fewer instructions: fast_exp for
// __expf, the target looked for once a vector in pass 2 (one compare of its place, not
// eight 64-bit ones), 32-bit vector indices.
// FMA (version 5, with LEAN): pass 1 folds by fold_fma.
// COARSE (version 9, with SYNC): the maxima on bf16's grid, kept in 2 bytes a vector
// (KeptM), so that one block more fits an SM.
// SYNC (version 6, with FMA): version 5's arithmetic with a cheaper exchange. ncu of
// version 5 (thirty-third session) put ~40% of its stall cycles at the two cluster barriers
// and the block barrier after the merge: every thread's arrive.release is a GPU-scope
// membar, and thread 0 loaded the blocks' 2 x 8 states one remote load at a time while
// the block waited. Here only thread 0, the writer of part_m / part_s, fences before a
// relaxed arrive (the second arrive publishes nothing), and warp 0's lanes load one
// block's state each at once, which lane 0 merges in rank order: version 5's bits.
template <class T, bool KEEP, bool LEAN = false, bool FMA = false, bool SYNC = false,
          bool COARSE = false>
__global__ void __launch_bounds__(kClusterThreads)
    cross_entropy_cluster_kernel(float* losses, T* logits, const int32_t* targets, int64_t V,
                                 int64_t segment_vectors, float grad_scale, bool compute_grad) {
  using P = Pack<T>;
  using KeptM = KeptMax<COARSE>;
  constexpr int kN = P::kN;
  static_assert(!KEEP || kN == 8, "version 3 keeps the exps of bf16 rows");
  static_assert(!LEAN || KEEP, "version 4 is version 3's form");
  static_assert(!FMA || LEAN, "version 5 is version 4's form");
  static_assert(!SYNC || FMA, "version 6 is version 5's form");
  static_assert(!COARSE || SYNC, "version 9 is version 6's form");
  extern __shared__ uint4 segment[];
  KeptM* const kept_m = reinterpret_cast<KeptM*>(segment + segment_vectors);  // KEEP
  __shared__ uint64_t bars[kMaxPieces];
  __shared__ float sm_m[kClusterThreads / 32], sm_s[kClusterThreads / 32];
  __shared__ float part_m, part_s, row_lse, target_logit;
  const uint32_t rank = cluster_reg<ClusterReg::Rank>(), blocks = cluster_reg<ClusterReg::Blocks>();
  const int64_t n = cluster_reg<ClusterReg::Index>();
  T* row = logits + n * V;
  const int32_t target = targets[n];
  if (target < 0 || target >= V) __trap();

  const auto [head, nvec, tail] = row_spans(row, V);
  const int64_t first = int64_t(rank) * segment_vectors;
  const int64_t count =
      first >= nvec ? 0 : (nvec - first < segment_vectors ? nvec - first : segment_vectors);
  uint4* global_segment = reinterpret_cast<uint4*>(row + head) + first;
  const int pieces = int(ceil_div(count, kPieceVectors));
  if (threadIdx.x == 0) {
    for (int p = 0; p < pieces; ++p) mbar_init(&bars[p], 1);
    mbar_init_fence();
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    if (rank == 0) target_logit = load(row[target]);
    for (int p = 0; p < pieces; ++p) {
      const int64_t at = int64_t(p) * kPieceVectors;
      const uint32_t bytes =
          uint32_t(16 * (count - at < kPieceVectors ? count - at : kPieceVectors));
      mbar_expect_tx(&bars[p], bytes);
      bulk_load(segment + at, global_segment + at, bytes, &bars[p]);
    }
  }

  float m = -INFINITY, s = 0.f;
  if (rank == 0) {
    fold_scalars(m, s, row, 0, head);
    fold_scalars(m, s, row, tail, V);
  }
  if constexpr (COARSE) {  // the scalars' m onto the grid before the first kept m
    const float up = bf16_at_least(m);
    if (up != m) s *= __expf(m - up), m = up;  // never at -inf or +inf: m - up is finite
  }
  float m_log2e = m * kLog2e;  // FMA: fold_fma's m log2(e), updated with m
  for (int p = 0; p < pieces; ++p) {
    mbar_wait(&bars[p], 0);
    const int64_t end =
        int64_t(p + 1) * kPieceVectors < count ? int64_t(p + 1) * kPieceVectors : count;
    for (int i = p * kPieceVectors + int(threadIdx.x); i < int(end); i += int(blockDim.x)) {
      if constexpr (KEEP) {
        float e[kN];
        if constexpr (FMA) {
          fold_fma<COARSE>(m, m_log2e, s, segment[i], e);
        } else {
          fold<LEAN>(m, s, P{segment[i]}, e);
        }
        segment[i] = pack_half8(e);
        kept_m[i] = KeptM::of(m);
      } else {
        fold(m, s, P{segment[i]});
      }
    }
  }
  merge_block(m, s, sm_m, sm_s);
  if constexpr (SYNC) {
    if (threadIdx.x == 0) {
      part_m = m, part_s = s;
      cluster_fence();
    }
    cluster_arrive_relaxed();
    cluster_wait();
    if (threadIdx.x < 32) {
      const uint32_t lane = threadIdx.x;
      float lm = -INFINITY, ls = 0.f;
      if (lane < blocks)
        lm = load_cluster_shared(&part_m, lane), ls = load_cluster_shared(&part_s, lane);
      float rm = -INFINITY, rs = 0.f;
      for (uint32_t r = 0; r < blocks; ++r)
        merge(rm, rs, __shfl_sync(0xffffffffu, lm, int(r)), __shfl_sync(0xffffffffu, ls, int(r)));
      if (lane == 0) {
        row_lse = rm + logf(rs);
        if (rank == 0) losses[n] = row_lse - target_logit;
      }
    }
    cluster_arrive_relaxed();  // done reading the other blocks' shared memory
  } else {
    if (threadIdx.x == 0) part_m = m, part_s = s;
    cluster_arrive();
    cluster_wait();
    if (threadIdx.x == 0) {
      float rm = -INFINITY, rs = 0.f;
      for (uint32_t r = 0; r < blocks; ++r)
        merge(rm, rs, load_cluster_shared(&part_m, r), load_cluster_shared(&part_s, r));
      row_lse = rm + logf(rs);
      if (rank == 0) losses[n] = row_lse - target_logit;
    }
    cluster_arrive();  // done reading the other blocks' shared memory
  }
  __syncthreads();  // row_lse
  if (compute_grad) {
    const float lse = row_lse;
    const int64_t at0 = int64_t(target) - (head + first * kN);
    for (int i = int(threadIdx.x); i < int(count); i += int(blockDim.x)) {
      const int64_t at = at0 - int64_t(i) * kN;  // the target's place in this vector
      P pk{segment[i]};
      if constexpr (LEAN) {
        pk.raw = kept_grad(pk.raw, float(kept_m[i]), at, lse, grad_scale);
      } else if constexpr (KEEP) {
        float e[kN];
        unpack_half8(pk.raw, e);
        const float scaled = grad_scale * __expf(float(kept_m[i]) - lse);
#pragma unroll
        for (int k = 0; k < kN; ++k) {
          const float g = e[k] * scaled;
          pk.set(k, at == k ? g - grad_scale : g);
        }
      } else {
#pragma unroll
        for (int k = 0; k < kN; ++k) pk.set(k, logit_grad(pk.get(k), at == k, lse, grad_scale));
      }
      global_segment[i] = pk.raw;
    }
    if (rank == 0) {
      grad_scalars(row, 0, head, target, lse, grad_scale);
      grad_scalars(row, tail, V, target, lse, grad_scale);
    }
  }
  cluster_wait();  // no block leaves while another may still read its part_m / part_s
}

// Version 7: version 6's arithmetic and exchange on a persistent grid of clusters (as many
// as fit at once), cluster c taking rows c, c + G, c + 2G, ... with two rows in flight a
// block. ncu of version 6 (thirty-fourth session, [2048, 151936]) put a quarter of its
// stall samples at the cluster wait (a block's eight segments finish their folds at
// different times on different SMs, and the merge needs all eight) and 14% at the wait
// for the copy engine's pieces, with nothing of the block's own to overlap either. Here a
// block folds row k + 1 (its segment copied in while row k was folded) before it waits
// for the cluster's states of row k, then writes row k's gradient and has row k + 2 copied
// into the buffer row k leaves. Each buffer is version 6's segment and kept m's; two
// buffers double the shared memory (2 blocks an SM at Qwen3's rows). The bits are version
// 6's (the same fold, merges and gradient by row; CrossEntropyParity checks them).
// The cluster barrier's phases: arrive 0 after row 0's state is published; each row k then
// waits phase k (every block's state of row k visible) and arrives phase k + 1, which
// publishes row k + 1's state and says this block is done reading the others' states of
// row k (so that they may overwrite that slot with row k + 2's after their wait k + 1); a
// last wait keeps every block's shared memory alive until no block reads it.
// Buffer reuse: the fold writes a buffer and the gradient pass reads it by ordinary
// accesses; each thread orders them before the copy engine's by a proxy fence, a block
// barrier follows, then thread 0 has the copy engine overwrite it.
// THREADS: 256 (version 7) or 512 (version 8: two blocks an SM at Qwen3's rows are 16
// warps at 256 threads, half of version 6's four blocks; version 8 keeps 32).
template <class T, int THREADS>
__global__ void __launch_bounds__(THREADS)
    cross_entropy_stream_kernel(float* losses, T* logits, const int32_t* targets, int64_t N,
                                int64_t V, int64_t segment_vectors, int64_t buffer_vectors,
                                float grad_scale, bool compute_grad) {
  static_assert(Pack<T>::kN == 8, "version 7 keeps the exps of bf16 rows");
  constexpr int kN = 8;
  extern __shared__ uint4 buffers[];  // 2 x buffer_vectors: the segment, then its kept m's
  __shared__ uint64_t bars[2][kMaxPieces];
  __shared__ float sm_m[THREADS / 32], sm_s[THREADS / 32];
  // Two of each, by row parity: a slot is rewritten for row k + 2 only after a barrier
  // that every reader of row k's has passed.
  __shared__ float part_m[2], part_s[2], target_logit[2], row_lse[2];
  const uint32_t rank = cluster_reg<ClusterReg::Rank>(), blocks = cluster_reg<ClusterReg::Blocks>();
  const int64_t cluster = cluster_reg<ClusterReg::Index>(),
                clusters = cluster_reg<ClusterReg::Count>();
  const int64_t rows = cluster < N ? (N - 1 - cluster) / clusters + 1 : 0;  // the grid has <= N
  const int pieces_max = int(ceil_div(segment_vectors, kPieceVectors));
  if (threadIdx.x == 0) {
    for (int b = 0; b < 2; ++b)
      for (int p = 0; p < pieces_max; ++p) mbar_init(&bars[b][p], 1);
    mbar_init_fence();
  }
  __syncthreads();

  // Row k of this cluster: where it lies, this block's run of its vectors.
  struct Row {
    T* row;
    int32_t target;
    int64_t head, tail, first, count;
  };
  auto row_at = [&](int64_t k) {
    Row r;
    const int64_t n = cluster + k * clusters;
    r.row = logits + n * V;
    r.target = targets[n];
    if (r.target < 0 || r.target >= V) __trap();
    const auto [head, nvec, tail] = row_spans(r.row, V);
    r.head = head, r.tail = tail, r.first = int64_t(rank) * segment_vectors;
    r.count =
        r.first >= nvec ? 0 : (nvec - r.first < segment_vectors ? nvec - r.first : segment_vectors);
    return r;
  };
  // Thread 0: row k's segment into buffer k & 1, every piece barrier of the buffer armed
  // (those past the block's count with no bytes) so that each completes one phase a use.
  // Rank 0 reads the target's logit here, before its arrive for row k: no block writes
  // row k's gradient before every block has arrived for it.
  auto fetch = [&](int64_t k) {
    const Row r = row_at(k);
    const int b = int(k & 1);
    uint4* segment = buffers + b * buffer_vectors;
    const uint4* global_segment = reinterpret_cast<const uint4*>(r.row + r.head) + r.first;
    if (rank == 0) target_logit[b] = load(r.row[r.target]);
    for (int p = 0; p < pieces_max; ++p) {
      const int64_t at = int64_t(p) * kPieceVectors;
      const int64_t left = r.count - at;
      const uint32_t bytes =
          left <= 0 ? 0 : uint32_t(16 * (left < kPieceVectors ? left : kPieceVectors));
      mbar_expect_tx(&bars[b][p], bytes);
      if (bytes > 0) bulk_load(segment + at, global_segment + at, bytes, &bars[b][p]);
    }
  };
  // Row k's place, kept by its fold for its gradient pass (by row parity, as the buffers:
  // rewritten by row k + 2's fold, after the barrier that follows row k's gradient pass).
  __shared__ Row placed[2];
  // Row k's fold (version 6's) over buffer k & 1, merged across the block: thread 0 holds it.
  auto fold_row = [&](int64_t k, float& m, float& s) {
    const Row r = row_at(k);
    const int b = int(k & 1);
    if (threadIdx.x == 0) placed[b] = r;  // read after merge_block's barrier
    uint4* segment = buffers + b * buffer_vectors;
    float* kept_m = reinterpret_cast<float*>(segment + segment_vectors);
    const uint32_t parity = uint32_t(k >> 1) & 1u;
    m = -INFINITY, s = 0.f;
    if (rank == 0) {
      fold_scalars(m, s, r.row, 0, r.head);
      fold_scalars(m, s, r.row, r.tail, V);
    }
    float m_log2e = m * kLog2e;
    const int pieces = int(ceil_div(r.count, kPieceVectors));
    for (int p = 0; p < pieces; ++p) {
      mbar_wait(&bars[b][p], parity);
      const int64_t end =
          int64_t(p + 1) * kPieceVectors < r.count ? int64_t(p + 1) * kPieceVectors : r.count;
      for (int i = p * kPieceVectors + int(threadIdx.x); i < int(end); i += int(blockDim.x)) {
        float e[kN];
        fold_fma(m, m_log2e, s, segment[i], e);
        segment[i] = pack_half8(e);
        kept_m[i] = m;
      }
    }
    merge_block(m, s, sm_m, sm_s);
  };
  auto publish = [&](int64_t k, float m, float s) {  // thread 0
    part_m[k & 1] = m, part_s[k & 1] = s;
    cluster_fence();
  };

  if (threadIdx.x == 0) {
    fetch(0);
    if (rows > 1) fetch(1);
  }
  float m, s;
  fold_row(0, m, s);
  if (threadIdx.x == 0) publish(0, m, s);
  // Warp 0 has read sm_m / sm_s before any warp writes them again (row 1's merge_block);
  // in the loop the barrier after each row's merge of the cluster's states does this.
  __syncthreads();
  cluster_arrive_relaxed();
  for (int64_t k = 0; k < rows; ++k) {
    const int b = int(k & 1);
    const bool next = k + 1 < rows;
    if (next) fold_row(k + 1, m, s);
    cluster_wait();
    if (threadIdx.x < 32) {
      const uint32_t lane = threadIdx.x;
      float lm = -INFINITY, ls = 0.f;
      if (lane < blocks)
        lm = load_cluster_shared(&part_m[b], lane), ls = load_cluster_shared(&part_s[b], lane);
      float rm = -INFINITY, rs = 0.f;
      for (uint32_t r = 0; r < blocks; ++r)
        merge(rm, rs, __shfl_sync(0xffffffffu, lm, int(r)), __shfl_sync(0xffffffffu, ls, int(r)));
      if (lane == 0) {
        row_lse[b] = rm + logf(rs);
        if (rank == 0) losses[cluster + k * clusters] = row_lse[b] - target_logit[b];
        if (next) publish(k + 1, m, s);
      }
    }
    cluster_arrive_relaxed();
    __syncthreads();  // row_lse
    const float lse = row_lse[b];
    if (compute_grad) {
      const Row r = placed[b];
      const uint4* segment = buffers + b * buffer_vectors;
      const float* kept_m = reinterpret_cast<const float*>(segment + segment_vectors);
      uint4* global_segment = reinterpret_cast<uint4*>(r.row + r.head) + r.first;
      const int64_t at0 = int64_t(r.target) - (r.head + r.first * kN);
      for (int i = int(threadIdx.x); i < int(r.count); i += int(blockDim.x))
        global_segment[i] =
            kept_grad(segment[i], kept_m[i], at0 - int64_t(i) * kN, lse, grad_scale);
      if (rank == 0) {
        grad_scalars(r.row, 0, r.head, r.target, lse, grad_scale);
        grad_scalars(r.row, r.tail, V, r.target, lse, grad_scale);
      }
    }
    if (k + 2 < rows) {
      fence_proxy_async();  // this thread's reads and writes of buffer b before the copy's
      __syncthreads();
      if (threadIdx.x == 0) fetch(k + 2);
    }
  }
  cluster_wait();  // no block leaves while another may still read its part_m / part_s
}

constexpr int kCrossEntropyVersions = 10;
constexpr int kCrossEntropyDefault = 9;
int g_cross_entropy_version = kCrossEntropyDefault;

// Versions 2-5's blocks a row and each block's vectors for rows of V elements of `bytes`
// each, with `kept` more bytes a vector (version 3's m), or false where a block's shared
// memory would exceed kSegmentMax (version 1 then).
struct ClusterPlan {
  int blocks;
  int64_t segment_vectors;
  size_t smem;
};
bool plan_cluster(int64_t V, int64_t bytes, int64_t kept, ClusterPlan& plan,
                  int max_blocks = kMaxCluster, int64_t segment_target = kSegmentTarget) {
  const int64_t vectors = V / (16 / bytes);  // at least any row's vector count
  int blocks = 1;
  while (blocks < max_blocks && ceil_div(vectors, blocks) * 16 > segment_target) blocks *= 2;
  const int64_t segment = ceil_div(vectors, blocks);
  plan = {blocks, segment, size_t(segment * (16 + kept))};
  return int64_t(plan.smem) <= kSegmentMax;
}

// A launch of clusters of `blocks` blocks: the configuration and the cluster attribute it
// points to (so neither copies nor moves).
struct ClusterLaunch {
  cudaLaunchConfig_t cfg = {};
  cudaLaunchAttribute attr[1] = {};
  ClusterLaunch(cudaStream_t s, int blocks, int threads, size_t smem) {
    cfg.blockDim = dim3(unsigned(threads));
    cfg.dynamicSmemBytes = smem;
    cfg.stream = s;
    attr[0].id = cudaLaunchAttributeClusterDimension;
    attr[0].val.clusterDim.x = unsigned(blocks);
    attr[0].val.clusterDim.y = 1;
    attr[0].val.clusterDim.z = 1;
    cfg.attrs = attr;
    cfg.numAttrs = 1;
  }
  ClusterLaunch(const ClusterLaunch&) = delete;
  ClusterLaunch& operator=(const ClusterLaunch&) = delete;
};
// Lets Kernel take up to kSegmentMax bytes of dynamic shared memory and, where
// `wide_clusters` (version 10), clusters of more than 8 blocks (once a kernel: the template
// is on the function itself, not its type, which kernels share).
template <auto Kernel>
void allow_segment_smem(bool wide_clusters = false) {
  static const bool allowed = [] {
    CUDA_CHECK(cudaFuncSetAttribute(Kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                    int(kSegmentMax)));
    return true;
  }();
  static bool wide_allowed = false;
  if (wide_clusters && !wide_allowed) {
    CUDA_CHECK(cudaFuncSetAttribute(Kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1));
    wide_allowed = true;
  }
  (void)allowed;
}

// Versions 7-8's grid: as many clusters of plan.blocks as are resident at once (the
// occupancy calculator's count for this shared memory), at most one a row.
template <class T, int THREADS>
void launch_stream(cudaStream_t s, float* losses, T* logits, const int32_t* targets, int64_t N,
                   int64_t V, const ClusterPlan& plan, float grad_scale, bool compute_grad) {
  auto kernel = cross_entropy_stream_kernel<T, THREADS>;
  allow_segment_smem<cross_entropy_stream_kernel<T, THREADS>>();
  const int64_t buffer_vectors = plan.segment_vectors + ceil_div(plan.segment_vectors, 4);
  ClusterLaunch launch(s, plan.blocks, THREADS, size_t(2 * 16 * buffer_vectors));
  // The resident count depends only on the device, the cluster's blocks and the shared
  // memory (one map an instantiation: the kernel is fixed). The backend calls from one host
  // thread.
  int device = 0;
  CUDA_CHECK(cudaGetDevice(&device));
  static std::map<std::tuple<int, int, size_t>, int> resident;
  auto [it, fresh] = resident.try_emplace({device, plan.blocks, launch.cfg.dynamicSmemBytes}, 0);
  if (fresh) {
    launch.cfg.gridDim = dim3(unsigned(plan.blocks));
    CUDA_CHECK(cudaOccupancyMaxActiveClusters(&it->second, kernel, &launch.cfg));
    MHAR_CHECK(it->second > 0, "cross_entropy: no cluster of ", plan.blocks, " blocks with ",
               launch.cfg.dynamicSmemBytes, " bytes of shared memory fits");
  }
  const int64_t clusters = std::min<int64_t>(N, it->second);
  launch.cfg.gridDim = dim3(unsigned(clusters * plan.blocks));
  CUDA_CHECK(cudaLaunchKernelEx(&launch.cfg, kernel, losses, logits, targets, N, V,
                                plan.segment_vectors, buffer_vectors, grad_scale, compute_grad));
}

template <class T, bool KEEP, bool LEAN = false, bool FMA = false, bool SYNC = false,
          bool COARSE = false>
void launch_cluster(cudaStream_t s, float* losses, T* logits, const int32_t* targets, int64_t N,
                    int64_t V, const ClusterPlan& plan, float grad_scale, bool compute_grad) {
  auto kernel = cross_entropy_cluster_kernel<T, KEEP, LEAN, FMA, SYNC, COARSE>;
  allow_segment_smem<cross_entropy_cluster_kernel<T, KEEP, LEAN, FMA, SYNC, COARSE>>(plan.blocks >
                                                                                     kMaxCluster);
  MHAR_CHECK(N * plan.blocks <= 0x7fffffff, "cross_entropy: ", N, " rows of ", plan.blocks,
             " blocks");
  ClusterLaunch launch(s, plan.blocks, kClusterThreads, plan.smem);
  launch.cfg.gridDim = dim3(unsigned(N * plan.blocks));
  CUDA_CHECK(cudaLaunchKernelEx(&launch.cfg, kernel, losses, logits, targets, V,
                                plan.segment_vectors, grad_scale, compute_grad));
}

}  // namespace

int cross_entropy_set_version(int version) {
  return set_lab_version(g_cross_entropy_version, version, kCrossEntropyVersions,
                         kCrossEntropyDefault, "cross_entropy_set_version");
}
int cross_entropy_versions() { return kCrossEntropyVersions; }

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
    ClusterPlan plan{};
    // Versions 3-10 keep fp16 exps of bf16 rows only; fp32 rows take version 2 there.
    // Versions 7-8 take two buffers a block; rows whose two would exceed kSegmentMax take 6.
    // Versions 9-10 keep each vector's m in 2 bytes, the others in 4; 10 plans wide clusters.
    constexpr bool kKeepable = sizeof(T) == 2;
    const int version = g_cross_entropy_version;
    const bool keep = kKeepable && version >= 3;
    const bool coarse = keep && version >= 9, wide = keep && version == 10;
    const bool planned =
        wide ? plan_cluster(V, int64_t(sizeof(T)), 2, plan, kMaxClusterWide, kSegmentTargetWide)
             : plan_cluster(V, int64_t(sizeof(T)),
                            !keep    ? 0
                            : coarse ? 2
                                     : 4,
                            plan);
    if (version >= 2 && planned) {
      auto* out = losses.ptr<float>();
      auto* rows = static_cast<T*>(logits.data);
      const auto* ids = targets.ptr<int32_t>();
      if constexpr (kKeepable) {
        if (keep && (version == 7 || version == 8) && 2 * plan.smem + 16 * 4 <= kSegmentMax) {
          if (version == 7)
            launch_stream<T, 256>(s, out, rows, ids, N, V, plan, float(grad_scale), compute_grad);
          else
            launch_stream<T, 512>(s, out, rows, ids, N, V, plan, float(grad_scale), compute_grad);
          return;
        }
      }
      if (coarse)
        launch_cluster<T, kKeepable, kKeepable, kKeepable, kKeepable, kKeepable>(
            s, out, rows, ids, N, V, plan, float(grad_scale), compute_grad);
      else if (keep && version >= 6)
        launch_cluster<T, kKeepable, kKeepable, kKeepable, kKeepable>(
            s, out, rows, ids, N, V, plan, float(grad_scale), compute_grad);
      else if (keep && version == 5)
        launch_cluster<T, kKeepable, kKeepable, kKeepable>(s, out, rows, ids, N, V, plan,
                                                           float(grad_scale), compute_grad);
      else if (keep && version == 4)
        launch_cluster<T, kKeepable, kKeepable>(s, out, rows, ids, N, V, plan, float(grad_scale),
                                                compute_grad);
      else if (keep)
        launch_cluster<T, kKeepable>(s, out, rows, ids, N, V, plan, float(grad_scale),
                                     compute_grad);
      else
        launch_cluster<T, false>(s, out, rows, ids, N, V, plan, float(grad_scale), compute_grad);
      return;
    }
    cross_entropy_kernel<T><<<unsigned(N), kThreads, 0, s>>>(
        losses.ptr<float>(), static_cast<T*>(logits.data), targets.ptr<int32_t>(), V,
        float(grad_scale), compute_grad);
    CUDA_CHECK_LAUNCH();
  });
}

}  // namespace mhar::cuda
