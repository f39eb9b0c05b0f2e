// norm_backward_ring.cu: the RMSNorm backward with its rows brought into shared memory by
// the copy engine (norm backward lab versions 7-9: 7 one block an SM, 8 two, 9 one with a
// row held in registers between its passes, kHold; the operation is norm.cu's header's).
// Why: ncu of the register kernels (versions 1-6) at 1B found them latency-bound, not
// bandwidth-bound: 24 warps an SM load their rows, then all reduce and store, in phase,
// so the memory system idles while they compute (40% issue, 59% of DRAM peak). Here one
// producer lane per block keeps a ring of S row stages (x, dy and, for "+=", the old dx:
// 5 or 7.5 KB a stage at D 1280; S up to 32, about 200 KB) in flight with cp.async.bulk,
// whatever the consumer warps are doing, so loads never wait on arithmetic.
// Layout: one or two blocks an SM on a cooperative grid (G blocks), block b owns the rows
// [b R / G, (b + 1) R / G); its row i sits in stage i % S and is consumed by warp i % C
// (C = 8 consumer warps; S a multiple of C, so each stage has one consumer), which
// computes it exactly as version 1 does (the same lanes' columns, fp32 operations and warp
// sum: dx is version 1's bits) and writes dx straight to global memory; each warp keeps
// dw's per-column sums in registers.
// dw: the C warps' sums are added in warp order into one partial row per block
// (scratch), the grid synchronises (cooperative launch), and block b then adds every
// partial row, in a fixed order, into its share of dw's columns: no second kernel and no
// atomics, the same bits every run (another order than version 1's: tests compare dw
// within fp32 rounding).
// Barriers per stage (mbarrier.cuh): full (the producer's expect_tx, completed by the
// copies' bytes) and empty (one arrival by the consuming warp's lane 0).
// Measured (cuda/NOTES.md, "The backward fed by the copy engine"): at 1B version 7 moves
// the "+=" backward at 67-69% of copy (version 5: 65%) but the overwriting one at 60-62%
// (version 5: 64%); ncu shows the consumers, not the loads, now bound it (0.30 warps
// issuing per scheduler cycle, 7.6 cycles between a warp's instructions); version 9 is no
// better than 7 (sixteenth session: 60.1% / 67.0%), and a fifth of the warps' time is at
// barriers ("Measured: q and k in one launch; where the ring's consumers stall"). Version
// 5 stays the default.
#include "cuda/norm_backward_ring.h"

#include <cooperative_groups.h>

#include <algorithm>
#include <map>
#include <mutex>
#include <utility>

#include "cuda/mbarrier.cuh"

namespace mhar::cuda {
namespace {

constexpr int kMaxStages = 32;
// Dynamic shared memory a block may take for its barriers, w and the ring (of the 227 KB
// an sm_90 block can have), and the bytes kept in flight an SM to reach the copy rate
// (~4.3 TB/s x ~1.5 us of loaded latency / 132 SMs is ~50 KB; the ring holds up to 4x).
constexpr size_t kSmemBudget = 208 * 1024;
constexpr int kFinishParts = 16;  // lanes summing one dw column's partial rows
constexpr int kConsumers = 8;     // consumer warps a block (16 in one block measured slower)

struct RingArgs {
  bf16* dx;
  float* dw;
  float* partials;  // [G][D]
  const bf16* dy;
  const bf16* x;
  const bf16* w;
  const float* rstd;
  int64_t R;
  int D, stages;
  bool accumulate;
};

// Shared memory: full[kMaxStages], empty[kMaxStages] (uint64), w as fp32 [D], then the
// stages [S][x | dy | old dx][D] bf16. After the row loop the stage area holds the block's
// dw sums and the finish's partial sums.
__host__ __device__ constexpr size_t ring_fixed_bytes(int D) {
  return 2 * kMaxStages * sizeof(uint64_t) + size_t(D) * sizeof(float);
}

// kHold: a row's x, dy (and old dx) stay in registers (as bf16) from the first pass to the
// second, and its stage is released after the first: no shared-memory loads of the row in
// the second pass (the consumers bound versions 7 and 8), one block an SM for registers.
template <int VPL, int C, bool kHold>
__global__ void __launch_bounds__(32 * (C + 1), kHold ? 1 : 2)
    rmsnorm_backward_ring_kernel(RingArgs a) {
  extern __shared__ __align__(128) unsigned char ring_smem[];
  const int D = a.D, S = a.stages, tensors = a.accumulate ? 3 : 2;
  uint64_t* full = reinterpret_cast<uint64_t*>(ring_smem);
  uint64_t* empty = full + kMaxStages;
  float* w_s = reinterpret_cast<float*>(empty + kMaxStages);
  bf16* stages = reinterpret_cast<bf16*>(w_s + D);  // D * 4 bytes: 16-byte aligned
  const int64_t stage_elems = int64_t(tensors) * D;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int64_t G = gridDim.x, b = blockIdx.x;
  const int64_t r0 = b * a.R / G;
  const int n = int((b + 1) * a.R / G - r0);

  if (threadIdx.x == 0) {
    for (int s = 0; s < S; ++s) {
      mbar_init(full + s, 1);
      mbar_init(empty + s, 1);
    }
    mbar_init_fence();
  }
  for (int c = threadIdx.x; c < D; c += blockDim.x) w_s[c] = load(a.w[c]);
  __syncthreads();

  float dw_acc[VPL][8];
#pragma unroll
  for (int k = 0; k < VPL; ++k)
#pragma unroll
    for (int e = 0; e < 8; ++e) dw_acc[k][e] = 0.f;

  if (warp == C) {
    // The producer: stage i % S is free again once row i - S's warp has arrived on empty.
    if (lane == 0) {
      const uint32_t row_bytes = uint32_t(D) * sizeof(bf16);
      int s = 0;
      uint32_t phase = 0;  // of stage s's use by row i: (i / S) & 1
      for (int i = 0; i < n; ++i) {
        if (i >= S) mbar_wait(empty + s, phase ^ 1);
        mbar_expect_tx(full + s, row_bytes * uint32_t(tensors));
        bf16* st = stages + s * stage_elems;
        const int64_t off = (r0 + i) * D;
        bulk_load(st, a.x + off, row_bytes, full + s);
        bulk_load(st + D, a.dy + off, row_bytes, full + s);
        if (a.accumulate) bulk_load(st + 2 * D, a.dx + off, row_bytes, full + s);
        if (++s == S) {
          s = 0;
          phase ^= 1;
        }
      }
    }
  } else {
    // A consumer: version 1's arithmetic on rows warp, warp + C, ... (rstd a row ahead).
    float rs_next = warp < n ? __ldg(a.rstd + r0 + warp) : 0.f;
    int s = warp % S;  // row i's stage and its use's parity, advanced without divisions
    uint32_t phase = uint32_t(warp / S) & 1;
    for (int i = warp; i < n; i += C) {
      const float rs = rs_next;
      if (i + C < n) rs_next = __ldg(a.rstd + r0 + i + C);
      mbar_wait(full + s, phase);
      const bf16* st = stages + s * stage_elems;
      // kHold: the row's values kept between the passes (unused otherwise).
      [[maybe_unused]] uint4 xh[kHold ? VPL : 1], gh[kHold ? VPL : 1], oh[kHold ? VPL : 1];
      float gx = 0.f;
#pragma unroll
      for (int k = 0; k < VPL; ++k) {
        const int col = (lane + k * 32) * 8;
        if (col >= D) continue;
        const uint4 xv = *reinterpret_cast<const uint4*>(st + col);
        const uint4 gv = *reinterpret_cast<const uint4*>(st + D + col);
        float xf[8], gf[8], wf[8];
        unpack8(xv, xf);
        unpack8(gv, gf);
        load8(w_s + col, wf);
#pragma unroll
        for (int e = 0; e < 8; ++e) gx += gf[e] * wf[e] * xf[e];
        if constexpr (kHold) {
          xh[k] = xv;
          gh[k] = gv;
          if (a.accumulate) oh[k] = *reinterpret_cast<const uint4*>(st + 2 * D + col);
        }
      }
      if constexpr (kHold) {
        __syncwarp();  // every lane's reads of the stage are done
        if (lane == 0) mbar_arrive(empty + s);
      }
      const float coef = rs * rs * warp_sum(gx) / float(D);
      bf16* out_row = a.dx + (r0 + i) * D;
#pragma unroll
      for (int k = 0; k < VPL; ++k) {
        const int col = (lane + k * 32) * 8;
        if (col >= D) continue;
        float xf[8], gf[8], wf[8];
        if constexpr (kHold) {
          unpack8(xh[k], xf);
          unpack8(gh[k], gf);
        } else {
          unpack8(*reinterpret_cast<const uint4*>(st + col), xf);
          unpack8(*reinterpret_cast<const uint4*>(st + D + col), gf);
        }
        load8(w_s + col, wf);
#pragma unroll
        for (int e = 0; e < 8; ++e) dw_acc[k][e] += gf[e] * (xf[e] * rs);
        float v[8];
#pragma unroll
        for (int e = 0; e < 8; ++e) v[e] = rs * (gf[e] * wf[e] - xf[e] * coef);
        if (a.accumulate) {
          float old[8];
          if constexpr (kHold) unpack8(oh[k], old);
          else unpack8(*reinterpret_cast<const uint4*>(st + 2 * D + col), old);
#pragma unroll
          for (int e = 0; e < 8; ++e) v[e] = stored<bf16>(v[e]) + old[e];
        }
        store8(out_row + col, v);
      }
      if constexpr (!kHold) {
        __syncwarp();  // every lane's reads of the stage are done
        if (lane == 0) mbar_arrive(empty + s);
      }
      for (s += C; s >= S; s -= S) phase ^= 1;
    }
  }
  __syncthreads();  // every stage consumed: the stage area is free

  // The block's partial row: the consumer warps' sums added in warp order.
  float* col_sum = reinterpret_cast<float*>(stages);
  for (int wi = 0; wi < C; ++wi) {
    if (warp == wi) {
#pragma unroll
      for (int k = 0; k < VPL; ++k) {
        const int col = (lane + k * 32) * 8;
        if (col >= D) continue;
#pragma unroll
        for (int e = 0; e < 8; ++e)
          col_sum[col + e] = wi == 0 ? dw_acc[k][e] : col_sum[col + e] + dw_acc[k][e];
      }
    }
    __syncthreads();
  }
  for (int c = threadIdx.x; c < D; c += blockDim.x) a.partials[b * D + c] = col_sum[c];

  cooperative_groups::this_grid().sync();  // every block's partial row is written

  // Block b's columns [b D / G, (b + 1) D / G): kFinishParts lanes a column each sum every
  // kFinishParts-th partial row, then lane 0 adds the lanes' sums in order.
  const int c0 = int(b * D / G), nc = int((b + 1) * D / G) - c0;
  const int cols_a_pass = int(blockDim.x) / kFinishParts;
  float* part = col_sum + D;
  const int j = int(threadIdx.x) / kFinishParts, p = int(threadIdx.x) % kFinishParts;
  for (int base = 0; base < nc; base += cols_a_pass) {
    const bool active = j < cols_a_pass && base + j < nc;
    const int c = c0 + base + j;
    float acc = 0.f;
    if (active)
      for (int64_t row = p; row < G; row += kFinishParts) acc += __ldcg(a.partials + row * D + c);
    part[threadIdx.x] = acc;
    __syncthreads();
    if (active && p == 0) {
      float t = 0.f;
#pragma unroll
      for (int q = 0; q < kFinishParts; ++q) t += part[j * kFinishParts + q];
      a.dw[c] += t;
    }
    __syncthreads();
  }
}

template <int VPL, bool kHold>
bool launch_ring(cudaStream_t s, int blocks_per_sm, const RingArgs& base,
                 const ScratchFn& scratch) {
  auto kern = rmsnorm_backward_ring_kernel<VPL, kConsumers, kHold>;
  const int threads = 32 * (kConsumers + 1);
  const size_t budget = kSmemBudget / size_t(blocks_per_sm);
  const size_t stage_bytes = size_t(base.accumulate ? 3 : 2) * size_t(base.D) * sizeof(bf16);
  const size_t fixed = ring_fixed_bytes(base.D);
  // A multiple of the consumer warps, so that warp w alone uses stages w, w + C, ...: it
  // waits on a stage's use only after consuming the stage's previous use (so after that
  // use's bytes landed), and a wait on a phase's parity cannot pass a phase early.
  const int stages = int(std::min<size_t>(kMaxStages, (budget - fixed) / stage_bytes)) /
                     kConsumers * kConsumers;
  // The stage area also holds the block's dw row and the finish's partial sums.
  const size_t smem =
      fixed + std::max(size_t(stages) * stage_bytes,
                       (size_t(base.D) + size_t(threads)) * sizeof(float));
  if (stages < kConsumers || smem > budget) return false;
  // Per device: the kernel allowed the budget and the largest carveout (0 blocks where
  // the device has no cooperative launch); then, once per shared-memory size, how many
  // blocks fit an SM (the cooperative launch needs them all resident).
  static std::mutex mu;
  static std::map<int, bool> ready;
  static std::map<std::pair<int, size_t>, int> fit;  // (device, smem) -> blocks an SM
  int dev = 0;
  CUDA_CHECK(cudaGetDevice(&dev));
  {
    std::lock_guard<std::mutex> lock(mu);
    if (!ready.count(dev)) {
      int coop = 0;
      CUDA_CHECK(cudaDeviceGetAttribute(&coop, cudaDevAttrCooperativeLaunch, dev));
      if (coop) {
        CUDA_CHECK(cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                        int(kSmemBudget)));
        CUDA_CHECK(cudaFuncSetAttribute(kern, cudaFuncAttributePreferredSharedMemoryCarveout, 100));
      }
      ready[dev] = coop != 0;
    }
    if (!ready[dev]) return false;
    const auto key = std::make_pair(dev, smem);
    auto it = fit.find(key);
    if (it == fit.end()) {
      int n = 0;
      CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kern, threads, smem));
      it = fit.emplace(key, n).first;
    }
    if (it->second < blocks_per_sm) return false;
  }
  const int64_t grid = std::min<int64_t>(base.R, int64_t(sm_count()) * blocks_per_sm);
  RingArgs a = base;
  a.stages = stages;
  a.partials = static_cast<float*>(
      scratch(ScratchSlot::NormPartials, size_t(grid) * size_t(base.D) * sizeof(float)));
  void* params[] = {&a};
  CUDA_CHECK(cudaLaunchCooperativeKernel(reinterpret_cast<const void*>(kern), dim3(unsigned(grid)),
                                         dim3(unsigned(threads)), params, smem, s));
  return true;
}

}  // namespace

bool rmsnorm_backward_ring(cudaStream_t s, int blocks_per_sm, bool hold_rows, bf16* dx,
                           float* dw, const bf16* dy, const bf16* x, const bf16* w,
                           const float* rstd, int64_t R, int D, bool accumulate_dx,
                           const ScratchFn& scratch) {
  if (D <= 512 || D > 2048 || D % 8 != 0 || R <= 0 || blocks_per_sm < 1) return false;
  const RingArgs a{dx, dw, nullptr, dy, x, w, rstd, R, D, 0, accumulate_dx};
  // The vectors a lane holds: norm.cu's row configurations for one warp a row. Held rows
  // need 16 registers a vector more: up to 6 vectors (D 1536), one block an SM.
  const int vecs = D / 8;
  if (hold_rows) {
    if (blocks_per_sm != 1) return false;
    if (vecs <= 96) return launch_ring<3, true>(s, 1, a, scratch);
    if (vecs <= 128) return launch_ring<4, true>(s, 1, a, scratch);
    if (vecs <= 160) return launch_ring<5, true>(s, 1, a, scratch);
    if (vecs <= 192) return launch_ring<6, true>(s, 1, a, scratch);
    return false;
  }
  if (vecs <= 96) return launch_ring<3, false>(s, blocks_per_sm, a, scratch);
  if (vecs <= 128) return launch_ring<4, false>(s, blocks_per_sm, a, scratch);
  if (vecs <= 160) return launch_ring<5, false>(s, blocks_per_sm, a, scratch);
  if (vecs <= 192) return launch_ring<6, false>(s, blocks_per_sm, a, scratch);
  return launch_ring<8, false>(s, blocks_per_sm, a, scratch);
}

}  // namespace mhar::cuda
