// classifier.cu: fused softmax cross-entropy over logits [N, V] (BF16 or F32), targets [N]
// (I32, in [0, V): an id outside traps), losses [N] (F32, overwritten):
//   losses[n] = logsumexp(logits[n]) - logits[n, target[n]]
// With compute_grad the logits row is overwritten in place by its gradient
//   grad_scale * (softmax(logits[n]) - onehot(target[n])).
// No fp32 copy of the probabilities exists at any point: memory is the logits. Every
// version reads a row in 16-byte vectors (8 bf16 or 4 floats; a scalar prologue up to the
// first 16-byte boundary and a scalar tail, so any V and any row alignment take the vector
// path), keeps per-thread online (max, sum of exp) states in fp32 with one rescale per
// vector, and merges them in a fixed order; the gradient is written once per element.
//
// The bytes the op must move with the gradient are 1 read + 1 write of the logits (what
// engine/op_profile.cpp counts). Kernel-lab versions (classifier_set_kernel_version,
// kernels.h; tests/kernel_bandwidth_cudatest.cpp's CrossEntropyVersions times them all):
//  1  one block per row, pass 2 re-reads the row from global memory. At 1B (rows of
//     151,936 bf16 = 304 KB) the blocks resident at once (4 of 512 threads per SM) hold
//     ~160 MB of rows between their two passes, 3x the 50 MB L2, so the second read comes
//     from DRAM: 2 reads + 1 write, 1.5x the bytes, measured at copy rate by its own 3
//     passes (3.9 TB/s) = 59% of copy by the 2-pass bytes. The fallback of every version.
//  2-7: a thread-block cluster of c blocks per row (Hopper, sm_90: launched with a cluster
//     attribute, cudaLaunchKernelEx): block r takes the r-th of c equal runs of the row's
//     vectors (rank 0 also the scalar prologue, rank c-1 the tail), folds its partial
//     (max, sum) state, and the c states are exchanged through distributed shared memory
//     and merged by every block in rank order (the same lse bits in all c blocks). Where
//     the slice is kept between the passes is what the versions change:
//  2  shared memory, c sized so that two blocks fit per SM (bf16 V = 151,936: c = 4,
//     76 KB each): the slice arrives by cp.async (no registers held per byte in flight,
//     in two commit groups so the first half is folded while the second lands); one
//     block's exchange and gradient overlap the other's loads.
//  3  shared memory, c sized for one block per SM (bf16 V = 151,936: c = 2, 152 KB each):
//     fewer cluster barriers and partial states per row, no overlap within the SM.
//  4  registers: each of the 512 threads holds up to 5 vectors (40 KB a block, two
//     blocks per SM: __launch_bounds__(512, 2) caps it at 64 registers, and 6 vectors
//     spilled); bf16 V = 151,936: c = 8, 4.6 vectors a thread. Every load is issued
//     before the first use. Rows of more than 163,840 bf16 or 81,920 fp32 elements do not
//     fit (fp32 at V = 151,936 takes version 1).
//  5  no on-chip copy: pass 2 re-reads the slice, but a persistent grid bounds the rows
//     between their passes to half the L2 (bf16 V = 151,936: c = 4, ~66 rows, ~20 MB),
//     so the second read hits L2; it and the gradient stores are marked evict-first
//     (ld/st .cs) so they do not push out rows still to be re-read.
//  6, 7: versions 2 and 4 on a persistent grid (the clusters resident at once, each
//     looping over rows): no block launch per row (versions 2-4 launch N * c blocks of a
//     few microseconds each: 44,032 for version 4 at [5504, 151936]).
// Versions 2-4, 6 and 7 keep the row on chip: 1 DRAM read + 1 write. Where a version's
// slice does not fit (c would exceed 8, the portable cluster limit), the device has no
// cluster launch, or the occupancy API finds no room for one cluster, the launch takes
// version 1 (classifier_last_launch says which ran). Default: version 1 until the device run
// (tests/kernel_bandwidth_cudatest.cpp) picks one (cuda/NOTES.md).
#include <cooperative_groups.h>

#include <cstdio>
#include <map>
#include <mutex>
#include <string>
#include <tuple>

#include "cuda/common.cuh"
#include "cuda/kernels.h"

namespace mhar::cuda {
namespace {

namespace cg = cooperative_groups;

constexpr int kThreads = 512;
constexpr int kWarps = kThreads / 32;
constexpr int kVersions = 7;
constexpr int kDefaultVersion = 1;
constexpr int kMaxCluster = 8;     // the portable cluster size limit
constexpr int kRegVectors = 5;     // version 4: 16-byte vectors a thread holds

int g_version = kDefaultVersion;   // classifier_set_kernel_version (kernel lab)
int g_cluster = 0;                 // forced cluster size (0: the smallest that fits)
thread_local std::string g_last_launch;  // classifier_last_launch (the calling thread's)

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

template <class T> __device__ __forceinline__ void fold_pack(float& m, float& s, const Pack<T>& p) {
  constexpr int kN = Pack<T>::kN;
  float x[kN];
#pragma unroll
  for (int k = 0; k < kN; ++k) x[k] = p.get(k);
  fold(m, s, x);
}

// The gradient of one 16-byte vector whose first element is column c0.
template <class T>
__device__ __forceinline__ void grad_pack(Pack<T>& p, int64_t c0, float lse, float scale,
                                          int32_t target) {
#pragma unroll
  for (int k = 0; k < Pack<T>::kN; ++k) {
    const float q = __expf(p.get(k) - lse);
    p.set(k, scale * (c0 + k == target ? q - 1.f : q));
  }
}
__device__ __forceinline__ float grad_one(float x, int64_t c, float lse, float scale,
                                          int32_t target) {
  const float q = __expf(x - lse);
  return scale * (c == target ? q - 1.f : q);
}

// A row split into scalar elements [0, head), 16-byte vectors [head, tail) (nvec of them,
// 16-byte aligned) and scalar elements [tail, V).
template <class T> struct RowSplit {
  int64_t head, nvec, tail;
  __device__ __forceinline__ RowSplit(const T* row, int64_t V) {
    constexpr int64_t kN = Pack<T>::kN;
    const int64_t misalign = int64_t(reinterpret_cast<uintptr_t>(row) & 15) / int64_t(sizeof(T));
    head = misalign == 0 ? 0 : (V < kN - misalign ? V : kN - misalign);
    nvec = (V - head) / kN;
    tail = head + nvec * kN;
  }
};

// (m, s) of the block in thread 0 (warp shuffles, then warp 0 over the warps' states in
// warp order). Warp 0 reads sm_m/sm_s after the call's barrier: the caller passes another
// block-wide barrier before calling it again.
__device__ __forceinline__ void block_merge(float& m, float& s, float* sm_m, float* sm_s) {
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

// ---- version 1: one block per row, two reads ------------------------------------------
template <class T>
__global__ void __launch_bounds__(kThreads)
    cross_entropy_kernel(float* losses, T* logits, const int32_t* targets, int64_t V,
                         float grad_scale, bool compute_grad) {
  using P = Pack<T>;
  constexpr int kN = P::kN;
  __shared__ float sm_m[kWarps], sm_s[kWarps];
  __shared__ float row_lse, target_logit;
  const int64_t n = blockIdx.x;
  T* row = logits + n * V;
  const int32_t target = targets[n];
  if (target < 0 || target >= V) __trap();
  if (threadIdx.x == 0) target_logit = load(row[target]);

  const RowSplit<T> sp(row, V);
  const int64_t head = sp.head, nvec = sp.nvec, tail = sp.tail;
  P* vec = reinterpret_cast<P*>(row + head);

  float m = -INFINITY, s = 0.f;
  for (int64_t c = threadIdx.x; c < head; c += blockDim.x) {
    const float x[1] = {load(row[c])};
    fold(m, s, x);
  }
#pragma unroll 4
  for (int64_t i = threadIdx.x; i < nvec; i += blockDim.x) {
    const P p{*reinterpret_cast<const uint4*>(vec + i)};
    fold_pack(m, s, p);
  }
  for (int64_t c = tail + threadIdx.x; c < V; c += blockDim.x) {
    const float x[1] = {load(row[c])};
    fold(m, s, x);
  }
  block_merge(m, s, sm_m, sm_s);  // its barrier also publishes target_logit
  if (threadIdx.x == 0) {
    row_lse = m + logf(s);
    losses[n] = row_lse - target_logit;
  }
  if (!compute_grad) return;
  __syncthreads();
  const float lse = row_lse;
  for (int64_t c = threadIdx.x; c < head; c += blockDim.x)
    row[c] = store<T>(grad_one(load(row[c]), c, lse, grad_scale, target));
#pragma unroll 4
  for (int64_t i = threadIdx.x; i < nvec; i += blockDim.x) {
    P p{*reinterpret_cast<const uint4*>(vec + i)};
    grad_pack(p, head + i * kN, lse, grad_scale, target);
    *reinterpret_cast<uint4*>(vec + i) = p.raw;
  }
  for (int64_t c = tail + threadIdx.x; c < V; c += blockDim.x)
    row[c] = store<T>(grad_one(load(row[c]), c, lse, grad_scale, target));
}

// ---- versions 2-7: a cluster of blocks per row -----------------------------------------
enum class Keep { Shared, Registers, None };  // where a block keeps its slice between passes

// The cluster barrier in two halves: arrive (release: this thread's earlier accesses,
// distributed shared memory included, happen before the other blocks' accesses after their
// wait) and wait (acquire). Every thread of every block of the cluster takes part.
__device__ __forceinline__ void cluster_arrive() {
  asm volatile("barrier.cluster.arrive.release;\n" ::: "memory");
}
__device__ __forceinline__ void cluster_wait() {
  asm volatile("barrier.cluster.wait.acquire;\n" ::: "memory");
}

// 16 bytes global -> shared without registers (both addresses 16-byte aligned); visible
// to the issuing thread after its cp_async_wait that covers the group.
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem) {
  const uint32_t dst = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(gmem) : "memory");
}
__device__ __forceinline__ void cp_async_commit() {
  asm volatile("cp.async.commit_group;\n" ::: "memory");
}
template <int kPending> __device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending) : "memory");
}

// Rows n = cluster index, += number of clusters (one step each in versions 2-4, whose grid
// has a cluster per row; the grids of versions 5-7 are the clusters resident at once).
// Thread t of a block owns vectors t, t + 512, ... of the block's run, in both passes, so
// in Keep::Shared each thread reads back only what its own cp.async wrote: no block barrier
// between load and use.
template <class T, Keep kKeep>
__global__ void __launch_bounds__(kThreads, 2)
    cross_entropy_cluster_kernel(float* losses, T* logits, const int32_t* targets, int64_t N,
                                 int64_t V, float grad_scale, bool compute_grad) {
  using P = Pack<T>;
  constexpr int kN = P::kN;
  extern __shared__ uint4 slice[];  // Keep::Shared: the block's run of the row's vectors
  __shared__ float sm_m[kWarps], sm_s[kWarps];
  __shared__ float part_m, part_s;  // the block's state, read by every block of the cluster
  __shared__ float row_lse;
  cg::cluster_group cluster = cg::this_cluster();
  const int c = int(cluster.num_blocks());
  const int rank = int(cluster.block_rank());
  const int tid = int(threadIdx.x);
  const bool first = rank == 0, last = rank == c - 1;
  const int64_t clusters = gridDim.x / c;
  bool pending = false;  // an arrive on the cluster barrier not yet waited on
  for (int64_t n = blockIdx.x / c; n < N; n += clusters) {
    T* row = logits + n * V;
    const int32_t target = targets[n];
    if (target < 0 || target >= V) __trap();
    // Read before this block's first cluster arrive, so before any block writes the row.
    float target_logit = 0.f;
    if (first && tid == 0) target_logit = load(row[target]);
    const RowSplit<T> sp(row, V);
    const int64_t per = ceil_div(sp.nvec, c);
    const int64_t v0 = min(sp.nvec, int64_t(rank) * per);
    const int count = int(min(sp.nvec, v0 + per) - v0);
    P* vec = reinterpret_cast<P*>(row + sp.head) + v0;
    const int64_t col0 = sp.head + v0 * kN;  // the column of vec[0]

    // Pass 1: the loads of the whole run are issued before the first is used.
    float m = -INFINITY, s = 0.f;
    P keep[kKeep == Keep::Registers ? kRegVectors : 1];
    const int half = count / 2;
    if constexpr (kKeep == Keep::Registers) {
#pragma unroll
      for (int k = 0; k < kRegVectors; ++k) {
        const int j = tid + k * kThreads;
        if (j < count) keep[k].raw = *reinterpret_cast<const uint4*>(vec + j);
      }
    } else if constexpr (kKeep == Keep::Shared) {
      int j = tid;
      for (; j < half; j += kThreads) cp_async16(slice + j, vec + j);
      cp_async_commit();
      for (; j < count; j += kThreads) cp_async16(slice + j, vec + j);
      cp_async_commit();
    }
    if (first)
      for (int64_t col = tid; col < sp.head; col += kThreads) {
        const float x[1] = {load(row[col])};
        fold(m, s, x);
      }
    if (last)
      for (int64_t col = sp.tail + tid; col < V; col += kThreads) {
        const float x[1] = {load(row[col])};
        fold(m, s, x);
      }
    if constexpr (kKeep == Keep::Registers) {
#pragma unroll
      for (int k = 0; k < kRegVectors; ++k)
        if (tid + k * kThreads < count) fold_pack(m, s, keep[k]);
    } else if constexpr (kKeep == Keep::Shared) {
      int j = tid;
      cp_async_wait<1>();
      for (; j < half; j += kThreads) fold_pack(m, s, P{slice[j]});
      cp_async_wait<0>();
      for (; j < count; j += kThreads) fold_pack(m, s, P{slice[j]});
    } else {
#pragma unroll 4
      for (int j = tid; j < count; j += kThreads)
        fold_pack(m, s, P{*reinterpret_cast<const uint4*>(vec + j)});
    }
    block_merge(m, s, sm_m, sm_s);

    // Exchange: every block merges the c states in rank order (the same lse bits in each).
    if (pending) cluster_wait();  // the previous row's states have been read everywhere
    if (tid == 0) {
      part_m = m;
      part_s = s;
    }
    cluster_arrive();
    cluster_wait();
    if (tid == 0) {
      float lm = -INFINITY, ls = 0.f;
      for (int r = 0; r < c; ++r)
        merge(lm, ls, *cluster.map_shared_rank(&part_m, r), *cluster.map_shared_rank(&part_s, r));
      row_lse = lm + logf(ls);
      if (first) losses[n] = row_lse - target_logit;
    }
    cluster_arrive();  // after thread 0's reads: no block rewrites part_* before they end
    pending = true;
    if (!compute_grad) continue;
    __syncthreads();
    const float lse = row_lse;

    // Pass 2: each element's gradient written once, from where pass 1 kept it.
    if (first)
      for (int64_t col = tid; col < sp.head; col += kThreads)
        row[col] = store<T>(grad_one(load(row[col]), col, lse, grad_scale, target));
    if (last)
      for (int64_t col = sp.tail + tid; col < V; col += kThreads)
        row[col] = store<T>(grad_one(load(row[col]), col, lse, grad_scale, target));
    if constexpr (kKeep == Keep::Registers) {
#pragma unroll
      for (int k = 0; k < kRegVectors; ++k) {
        const int j = tid + k * kThreads;
        if (j < count) {
          grad_pack(keep[k], col0 + int64_t(j) * kN, lse, grad_scale, target);
          *reinterpret_cast<uint4*>(vec + j) = keep[k].raw;
        }
      }
    } else if constexpr (kKeep == Keep::Shared) {
      for (int j = tid; j < count; j += kThreads) {
        P p{slice[j]};
        grad_pack(p, col0 + int64_t(j) * kN, lse, grad_scale, target);
        *reinterpret_cast<uint4*>(vec + j) = p.raw;
      }
    } else {
      // The slice's last use: evict-first loads and stores keep L2 for the rows in flight.
#pragma unroll 4
      for (int j = tid; j < count; j += kThreads) {
        P p{__ldcs(reinterpret_cast<const uint4*>(vec + j))};
        grad_pack(p, col0 + int64_t(j) * kN, lse, grad_scale, target);
        __stcs(reinterpret_cast<uint4*>(vec + j), p.raw);
      }
    }
  }
  if (pending) cluster_wait();  // no block leaves while another may read its part_*
}

// ---- launch plans ---------------------------------------------------------------------
// What the device offers, read once per device.
struct Limits {
  bool clusters = false;  // cluster launch (compute capability >= 9.0)
  int sms = 0;
  int64_t l2 = 0, smem_sm = 0, smem_block = 0, smem_reserved = 0;
};
Limits device_limits(int dev) {
  auto attr = [&](cudaDeviceAttr a) {
    int v = 0;
    CUDA_CHECK(cudaDeviceGetAttribute(&v, a, dev));
    return v;
  };
  Limits l;
  l.clusters = attr(cudaDevAttrClusterLaunch) != 0;
  l.sms = attr(cudaDevAttrMultiProcessorCount);
  l.l2 = attr(cudaDevAttrL2CacheSize);
  l.smem_sm = attr(cudaDevAttrMaxSharedMemoryPerMultiprocessor);
  l.smem_block = attr(cudaDevAttrMaxSharedMemoryPerBlockOptin);
  l.smem_reserved = attr(cudaDevAttrReservedSharedMemoryPerBlock);
  return l;
}

// How one call launches: version 1, or a cluster version with c blocks per row, `smem`
// dynamic shared bytes per block and `clusters` clusters in the grid.
struct Plan {
  int version = 1;
  int c = 1;
  int64_t smem = 0, clusters = 0;
  std::string why;  // version 1 in place of the one asked for: the reason
};

template <class T, Keep kKeep> auto cluster_kernel() {
  return cross_entropy_cluster_kernel<T, kKeep>;
}

cudaLaunchConfig_t cluster_config(const Plan& p, cudaStream_t s, cudaLaunchAttribute* attr) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(unsigned(p.clusters * p.c));
  cfg.blockDim = dim3(kThreads);
  cfg.dynamicSmemBytes = size_t(p.smem);
  cfg.stream = s;
  attr[0].id = cudaLaunchAttributeClusterDimension;
  attr[0].val.clusterDim.x = unsigned(p.c);
  attr[0].val.clusterDim.y = 1;
  attr[0].val.clusterDim.z = 1;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  return cfg;
}

// The shape of a cluster version's launch for rows of V elements of T: everything but the
// number of clusters (plan_for adds it from N). Version 1 with the reason where it does
// not fit.
template <class T, Keep kKeep> Plan plan_cluster(int version, int64_t V, int dev) {
  const Limits lim = device_limits(dev);
  auto fallback = [&](std::string why) {
    Plan f;
    f.why = "version " + std::to_string(version) + " " + why;
    return f;
  };
  if (!lim.clusters) return fallback("needs cluster launch (sm_90)");
  const auto kernel = cluster_kernel<T, kKeep>();
  cudaFuncAttributes fa{};
  CUDA_CHECK(cudaFuncGetAttributes(&fa, kernel));
  const int64_t vectors = ceil_div(V * int64_t(sizeof(T)), 16);  // at most, any alignment
  const int64_t row_bytes = V * int64_t(sizeof(T));
  // The most vectors a block may keep (version 5 keeps none).
  const int kind = version == 6 ? 2 : version == 7 ? 4 : version;  // 6, 7: 2, 4 persistent
  int64_t capacity = INT64_MAX;
  if (kind == 2)
    capacity = std::min(lim.smem_sm / 2 - lim.smem_reserved, lim.smem_block) -
               int64_t(fa.sharedSizeBytes);
  if (kind == 3)
    capacity = std::min(lim.smem_sm - lim.smem_reserved, lim.smem_block) -
               int64_t(fa.sharedSizeBytes);
  if (kind == 2 || kind == 3) capacity /= 16;
  if (kind == 4) capacity = int64_t(kThreads) * kRegVectors;
  int c = std::max(g_cluster, 1);
  while (c <= kMaxCluster && ceil_div(vectors, c) > capacity) c *= 2;
  if (version == 5) {
    // Rows between their passes at once (every resident block busy) within half the L2.
    int per_sm = 0;
    CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kThreads, 0));
    const int64_t resident = int64_t(std::max(per_sm, 1)) * lim.sms;
    while (c < kMaxCluster && resident / c * row_bytes > lim.l2 / 2) c *= 2;
  }
  if (c > kMaxCluster)
    return fallback("needs " + std::to_string(ceil_div(vectors, kMaxCluster) * 16) +
                    " B a block at cluster size 8, has " + std::to_string(capacity * 16));
  Plan p;
  p.version = version;
  p.c = c;
  p.smem = kKeep == Keep::Shared ? std::max<int64_t>(ceil_div(vectors, c), 1) * 16 : 0;
  // The device's whole opt-in limit (not this shape's bytes): the attribute is per kernel
  // and the cached plans of other shapes launch the same kernel.
  // All of the SM's unified L1/shared memory as shared (the slices stream: L1 keeps
  // nothing they reuse), so that version 2's two blocks fit an SM.
  if (p.smem > 0) {
    CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                    int(lim.smem_block - int64_t(fa.sharedSizeBytes))));
    CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout,
                                    int(cudaSharedmemCarveoutMaxShared)));
  }
  // The occupancy API says whether (and how many) clusters of this shape fit at once.
  p.clusters = 1;
  cudaLaunchAttribute attr[1];
  const cudaLaunchConfig_t cfg = cluster_config(p, nullptr, attr);
  int active = 0;
  if (cudaOccupancyMaxActiveClusters(&active, kernel, &cfg) != cudaSuccess) {
    cudaGetLastError();  // not sticky: clear it
    active = 0;
  }
  if (active < 1)
    return fallback("finds no room for a cluster of " + std::to_string(c) + " x " +
                    std::to_string(kThreads) + " threads with " + std::to_string(p.smem) +
                    " B shared");
  // Version 5's grid: the clusters resident at once, at most half the L2 of rows; 6 and 7:
  // the clusters resident at once; 2-4: one a row (0 here).
  if (version == 5)
    p.clusters = std::min<int64_t>(active, std::max<int64_t>(lim.l2 / 2 / row_bytes, 1));
  if (version >= 6) p.clusters = active;
  return p;
}

// The plan of one call, cached per device, version, cluster setting, dtype and V (the
// occupancy queries run once per shape).
template <class T> Plan plan_for(int version, int64_t N, int64_t V) {
  if (version == 1) return Plan{};
  int dev = 0;
  CUDA_CHECK(cudaGetDevice(&dev));
  static std::mutex mu;
  static std::map<std::tuple<int, int, int, int64_t>, Plan> cache;
  const auto key = std::make_tuple(dev, version, g_cluster, V);
  Plan p;
  {
    std::lock_guard<std::mutex> lock(mu);
    auto it = cache.find(key);
    if (it == cache.end()) {
      switch (version) {
        case 2:
        case 3:
        case 6: p = plan_cluster<T, Keep::Shared>(version, V, dev); break;
        case 4:
        case 7: p = plan_cluster<T, Keep::Registers>(version, V, dev); break;
        default: p = plan_cluster<T, Keep::None>(version, V, dev);
      }
      it = cache.emplace(key, p).first;
    }
    p = it->second;
  }
  if (p.version == 1) return p;
  const int64_t most = 0x7fffffff / p.c;  // grid blocks fit in an int; the rows loop
  p.clusters = std::min(p.clusters > 0 ? p.clusters : N, std::min(N, most));
  return p;
}

// "v1: ..." or "v<k> c<c> <smem> B: ..." (the part before ':' labels timing lines).
std::string describe(const Plan& p, int64_t N, int64_t V, size_t elem) {
  char buf[320];
  if (p.version == 1)
    std::snprintf(buf, sizeof buf, "v1: a block of %d threads per row, %lld rows%s%s%s",
                  kThreads, (long long)N, p.why.empty() ? "" : " (", p.why.c_str(),
                  p.why.empty() ? "" : ")");
  else
    std::snprintf(buf, sizeof buf,
                  "v%d c%d %lld B: clusters of %d blocks of %d threads with %lld B shared "
                  "each, %lld clusters for %lld rows of %lld B",
                  p.version, p.c, (long long)p.smem, p.c, kThreads, (long long)p.smem,
                  (long long)p.clusters, (long long)N, (long long)(V * int64_t(elem)));
  return buf;
}

}  // namespace

int classifier_kernel_versions() { return kVersions; }

int classifier_set_kernel_version(int version, int cluster) {
  MHAR_CHECK(version <= kVersions, "classifier_set_kernel_version: version ", version,
             " of versions 1 .. ", kVersions, " (<= 0: the default)");
  MHAR_CHECK(cluster == 0 || cluster == 1 || cluster == 2 || cluster == 4 || cluster == 8,
             "classifier_set_kernel_version: cluster size ", cluster,
             " (0: the smallest that fits, else 1, 2, 4 or 8)");
  const int before = g_version;
  g_version = version > 0 ? version : kDefaultVersion;
  g_cluster = cluster;
  return before;
}

std::string classifier_last_launch() { return g_last_launch; }

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
    float* l = losses.ptr<float>();
    T* x = static_cast<T*>(logits.data);
    const int32_t* t = targets.ptr<int32_t>();
    const Plan p = plan_for<T>(g_version, N, V);
    g_last_launch = describe(p, N, V, sizeof(T));
    if (p.version == 1) {
      cross_entropy_kernel<T><<<unsigned(N), kThreads, 0, s>>>(l, x, t, V, float(grad_scale),
                                                               compute_grad);
      CUDA_CHECK_LAUNCH();
      return;
    }
    cudaLaunchAttribute attr[1];
    const cudaLaunchConfig_t cfg = cluster_config(p, s, attr);
    const float scale = float(grad_scale);
    switch (p.version) {
      case 2:
      case 3:
      case 6:
        CUDA_CHECK(cudaLaunchKernelEx(&cfg, cluster_kernel<T, Keep::Shared>(), l, x, t, N, V,
                                      scale, compute_grad));
        break;
      case 4:
      case 7:
        CUDA_CHECK(cudaLaunchKernelEx(&cfg, cluster_kernel<T, Keep::Registers>(), l, x, t, N,
                                      V, scale, compute_grad));
        break;
      default:
        CUDA_CHECK(cudaLaunchKernelEx(&cfg, cluster_kernel<T, Keep::None>(), l, x, t, N, V,
                                      scale, compute_grad));
    }
  });
}

}  // namespace mhar::cuda
