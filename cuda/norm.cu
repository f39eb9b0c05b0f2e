// norm.cu: RMSNorm over the last dimension, x [R, D] with weight w [D]; also the per-head
// QK-norm through a [N*heads, head_dim] view.
// - forward: y (overwritten) = x * rstd * w; rstd [R] (F32, overwritten) =
//   1/sqrt(mean(x^2) + eps), fp32 sums.
// - backward: with g = dy * w,  dx = rstd * (g - x * rstd^2 * mean(g * x)), overwritten or
//   added (accumulate_dx); dw [D] (F32) += sum_r dy * x * rstd. The "+=" rounds dx to the
//   storage type first, then adds in fp32 and rounds: the bits of writing dx and then
//   add_inplace, so a scheme may fuse the two without changing any result (the delta
//   scheme, which needs dx itself, must give standard's gradients bit for bit at alpha 0).
// Vector path (BF16 x/y/dx/dy, D a multiple of 8 up to 4096 forward / 2048 backward, all
// pointers 16-byte aligned): a group of TPR lanes holds RPI whole rows in registers as
// bf16x8 vectors, so each byte is read once (forward: x in, y out; backward: x, dy in,
// dx out). The backward also accumulates dw's per-column sums for its rows in registers
// and writes one fp32 partial row per block into backend scratch; a second small kernel
// adds the partial rows into dw in block order. No atomics: the same bits every run (but
// lab versions 11-12, whose blocks take rows as they free up).
// qk_norm_rope_forward/backward: the vector kernels with RoPE fused (head_dim 64/128/256):
// forward rotates the normalised row (rounded to bf16 first, as the unfused path stores
// it) before its one store; backward rotates dy back right after loading it. Saves a
// read and a write of q and k each way. A warp's rows are the heads of one token (head_dim
// 128, heads a multiple of 8), and each lane group computes the token's cos/sin once, 4
// pairs per lane, shared by shuffles: an eighth of a sincosf per element (was a quarter:
// 8 pairs per lane, the rotate-half partner lane computing the same 8).
// qk_norm_rope_forward_qk/_backward_qk (attention's q and k of a layer): with QK lab version
// 7, one launch of the paired-lane kernels for both tensors (its first blocks take q, the
// rest k; one dw finish kernel for both weights), so k's launch, ramp and tail are not
// paid apart; else the two calls.
// add_rmsnorm_forward: the forward vector kernel with x = a + b (rounded to bf16 as add
// does) formed from the loaded a, b and stored before the norm uses it: reads a, b, writes
// x, y, rstd once; the same bits as add then rmsnorm_forward.
// Version 1 of every vector kernel asks L2 for its next step's rows (one bulk prefetch per
// warp and tensor) before computing the current ones, so that more bytes are in flight
// than the registers hold.
// Other shapes/dtypes take the scalar path (warp per row; dw by a slab kernel writing one
// partial row per slab of rows, finished as the vector path's: the same bits every run).
// Kernel lab (norm_set_kernel_version, kernels.h; "kernel lab" below lists them): numbered
// versions of the vector kernels. Most change only how bytes are scheduled (no L2
// prefetch, balanced or one-step grids, a register pipeline of the next step's rows, the
// backward's rows staged in shared memory by cp.async, the dw finish kernel by
// programmatic dependent launch, the fused RoPE's cos/sin split over the warp) and give
// version 1's bits. The others change a sum's order and are compared with the CPU
// instead: the backward's dw partials in shared memory on their own grid (backward 5 at
// model widths 768-1536; 10, the default: 5 with 4 blocks an SM where rows are wider than
// 1024; 11 and 12, 10 with each warp's next row from a ticket counter, whose dw order
// varies run to run) and the paired-lane QK-norm + RoPE (QK 6, and QK 7, the default,
// which launches q and k together: a lane holds both halves of its rotate-half pairs and
// reads cos/sin from a table the backend fills once, ScratchSlot::RopeTable). Backward
// versions 7-9 are the ring kernel (norm_backward_ring.cu: rows brought into shared memory
// by the copy engine, dw finished in the kernel after a grid synchronisation). The
// defaults are the device runs' fastest (kForwardDefault etc. below; cuda/NOTES.md has the
// measured tables).
#include <algorithm>
#include <atomic>
#include <map>
#include <mutex>
#include <type_traits>
#include <unordered_map>
#include <utility>

#include "cuda/common.cuh"
#include "cuda/kernels.h"
#include "cuda/norm_backward_ring.h"
#include "cuda/rmsnorm_row.cuh"  // group_sum and the forward's row arithmetic

namespace mhar::cuda {
namespace {

constexpr int kWarpsPerBlock = 8;

template <class T, class W>
__global__ void rmsnorm_forward_kernel(T* y, float* rstd, const T* x, const W* w, int64_t R,
                                       int64_t D, float eps) {
  const int lane = threadIdx.x & 31;
  const int64_t row = int64_t(blockIdx.x) * kWarpsPerBlock + (threadIdx.x >> 5);
  if (row >= R) return;
  const T* xr = x + row * D;
  float ss = 0.f;
  for (int64_t c = lane; c < D; c += 32) {
    float v = load(xr[c]);
    ss += v * v;
  }
  ss = warp_sum(ss);
  const float r = rsqrtf(ss / float(D) + eps);
  if (lane == 0) rstd[row] = r;
  T* yr = y + row * D;
  for (int64_t c = lane; c < D; c += 32) yr[c] = store<T>(load(xr[c]) * r * load(w[c]));
}

template <class T, class W>
__global__ void rmsnorm_backward_dx_kernel(T* dx, const T* dy, const T* x, const W* w,
                                           const float* rstd, int64_t R, int64_t D,
                                           bool accumulate) {
  const int lane = threadIdx.x & 31;
  const int64_t row = int64_t(blockIdx.x) * kWarpsPerBlock + (threadIdx.x >> 5);
  if (row >= R) return;
  const T* xr = x + row * D;
  const T* dyr = dy + row * D;
  float gx = 0.f;
  for (int64_t c = lane; c < D; c += 32) gx += load(dyr[c]) * load(w[c]) * load(xr[c]);
  gx = warp_sum(gx);
  const float r = rstd[row];
  const float coef = r * r * gx / float(D);
  T* dxr = dx + row * D;
  for (int64_t c = lane; c < D; c += 32) {
    float v = r * (load(dyr[c]) * load(w[c]) - load(xr[c]) * coef);
    if (accumulate) v = stored<T>(v) + load(dxr[c]);  // as dx, then add_inplace
    dxr[c] = store<T>(v);
  }
}

// Block (32 columns) x (8 row lanes); each block sums a slab of rows for its 32 columns into
// its row of `partials` (blockIdx.y), which rmsnorm_dw_finish_kernel adds into dw in slab
// order: no atomics, the same bits every run.
template <class T>
__global__ void rmsnorm_backward_dw_kernel(float* partials, const T* dy, const T* x,
                                           const float* rstd, int64_t R, int64_t D,
                                           int64_t rows_per_block) {
  __shared__ float partial[8][33];
  const int64_t c = int64_t(blockIdx.x) * 32 + threadIdx.x;
  const int64_t r0 = int64_t(blockIdx.y) * rows_per_block;
  const int64_t r1 = min(R, r0 + rows_per_block);
  float acc = 0.f;
  if (c < D)
    for (int64_t r = r0 + threadIdx.y; r < r1; r += 8)
      acc += load(dy[r * D + c]) * load(x[r * D + c]) * rstd[r];
  partial[threadIdx.y][threadIdx.x] = acc;
  __syncthreads();
  if (threadIdx.y == 0 && c < D) {
    float t = 0.f;
#pragma unroll
    for (int i = 0; i < 8; ++i) t += partial[i][threadIdx.x];
    partials[int64_t(blockIdx.y) * D + c] = t;
  }
}

// ---- vector path ----------------------------------------------------------------
// Lanes per row TPR (8, 16 or 32: a shuffle group inside the warp), bf16x8 vectors per
// lane VPL (lane `sub` holds vectors sub, sub + TPR, ...), rows per lane group RPI (more
// 16-byte loads in flight when rows are short). A warp covers RW rows per step, the
// block (8 warps) RB; blocks loop over the rows grid-stride.
constexpr int kVecThreads = 256;
constexpr int kVecMaxD = 4096, kVecMaxDBackward = 2048;

// The fused QK-norm + RoPE (kRope): rows are (token, head) of head_dim = D = 8 * TPR, so a
// lane's 8 features pair with those of the lane TPR/2 away (rotate-half); the partner's
// values come by shuffle. A lane's consecutive rows are usually heads of one token, so its
// cos/sin serve all of them; they are computed once per token by the whole lane group, 4
// of the token's 4 * TPR pairs per lane, and handed out by shuffles.
struct RopeArgs {
  int64_t T_len = 1, first_position = 0;
  int heads = 1;
  double base = 1.0;
  bool backward = false;
};

// Token of a row and its position: in 32-bit arithmetic where the host checked that the
// row indices fit (kLite; the same values as the 64-bit division, several times cheaper).
template <bool k32>
__device__ __forceinline__ int64_t rope_position(const RopeArgs& ra, int64_t row) {
  if constexpr (k32) {
    const uint32_t t = uint32_t(row) / uint32_t(ra.heads);
    return ra.first_position + int64_t(t % uint32_t(ra.T_len));
  } else {
    return ra.first_position + (row / ra.heads) % ra.T_len;
  }
}

template <int TPR, bool k32 = false>
struct RopeCache {
  float cs[8], sn[8];
  int64_t tok = -1;
  // Warp-collective (every lane calls it, with its own row): when any lane's row belongs
  // to a new token, every group recomputes its token's cos/sin (lanes whose token did not
  // change get the same values again). inv_freq of pair p is ipow(base, 8 (p / 8)) times
  // base, p % 8 times in turn: the sequence of fp64 products of rope.cu's vector kernel
  // and of the per-lane code before, so cos/sin are the same bits as theirs.
  __device__ __forceinline__ void update(const RopeArgs& ra, int64_t row, int sub) {
    const int64_t t = k32 ? int64_t(uint32_t(row) / uint32_t(ra.heads)) : row / ra.heads;
    if (!__any_sync(0xffffffffu, t != tok)) return;
    tok = t;
    const int p0 = 4 * sub;  // this lane computes pairs p0 .. p0 + 3
    double f = ipow(ra.base, p0 & ~7);
    if (p0 & 4) {
#pragma unroll
      for (int e = 0; e < 4; ++e) f *= ra.base;
    }
    const int64_t pos =
        ra.first_position + (k32 ? int64_t(uint32_t(t) % uint32_t(ra.T_len)) : t % ra.T_len);
    float c4[4], s4[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      rope_cos_sin(f, pos, ra.backward, c4[k], s4[k]);
      f *= ra.base;
    }
    // Feature e of this lane is pair (sub % (TPR/2)) * 8 + e, held by group lane
    // (sub % (TPR/2)) * 2 + e / 4 at index e % 4.
    const int src = (sub % (TPR / 2)) * 2;
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      cs[e] = __shfl_sync(0xffffffffu, c4[e % 4], src + e / 4, TPR);
      sn[e] = __shfl_sync(0xffffffffu, s4[e % 4], src + e / 4, TPR);
    }
  }
  // Versions >= 2 where every row of the warp's step is a head of one token (kWarpToken):
  // the token's 4 TPR pairs split over all 32 lanes, TPR / 8 each, and handed out by
  // shuffles across the warp (update: 4 per lane, every lane group of the warp computing
  // the same token's pairs, so 32 / TPR times the sincosf). Pair p's inv_freq is the same
  // sequence of fp64 products as update's (ipow(base, 8 (p / 8)), then base p % 8 times),
  // so the same bits.
  __device__ __forceinline__ void update_warp(const RopeArgs& ra, int64_t row, int sub,
                                              int lane) {
    constexpr int P = TPR / 8;  // pairs per lane: 1, 2 or 4, a divisor of 8
    const int64_t pos = rope_position<k32>(ra, row);
    const int p0 = P * lane;
    double f = ipow(ra.base, p0 & ~7);
    for (int i = 0; i < (p0 & 7); ++i) f *= ra.base;
    float cp[P], sp[P];
#pragma unroll
    for (int k = 0; k < P; ++k) {
      rope_cos_sin(f, pos, ra.backward, cp[k], sp[k]);
      f *= ra.base;
    }
    // Feature e of this lane is pair q0 + e, held by lane (q0 + e) / P at index e % P.
    const int q0 = (sub % (TPR / 2)) * 8;
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      cs[e] = __shfl_sync(0xffffffffu, cp[e % P], (q0 + e) / P);
      sn[e] = __shfl_sync(0xffffffffu, sp[e % P], (q0 + e) / P);
    }
  }
  // v rounded to bf16 first (the unfused path stores between the two ops), then rotated
  // with the partner lane's values. Every lane of the warp must call it.
  __device__ __forceinline__ void rotate(float (&v)[8], int sub) const {
    unpack8(pack8(v), v);
    const float sign = sub < TPR / 2 ? -1.f : 1.f;
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      const float p = __shfl_xor_sync(0xffffffffu, v[e], TPR / 2);
      v[e] = v[e] * cs[e] + sign * p * sn[e];
    }
  }
};

// Row r (0 .. RPI-1) of lane group grp of warp `warp` in the block's step at `base`: the
// groups interleave (rows r*G + grp), so one warp-wide load instruction reads G adjacent
// rows, and a warp's RW rows are contiguous. For the RoPE-fused kernels at head_dim 128
// (RW = 8) and head counts that are multiples of 8, a warp's rows are the heads of one
// token, so its cos/sin are computed once a step.
template <int G, int RPI>
__device__ __forceinline__ int64_t vec_row(int64_t base, int warp, int grp, int r) {
  return base + int64_t(warp * G * RPI + r * G + grp);
}

// The next step's rows of a warp (rows next + warp*RW .. +RW, clipped to R) of up to
// three tensors (null: none) into L2: one bulk prefetch per tensor by lane 0.
template <int RW>
__device__ __forceinline__ void prefetch_rows(int64_t next, int warp, int lane, int64_t R, int D,
                                              const bf16* t0, const bf16* t1 = nullptr,
                                              const bf16* t2 = nullptr) {
  const int64_t first = next + int64_t(warp) * RW;
  if (lane != 0 || first >= R) return;
  const uint32_t bytes = uint32_t((R - first < RW ? R - first : RW) * D * 2);
  prefetch_l2(t0 + first * D, bytes);
  if (t1) prefetch_l2(t1 + first * D, bytes);
  if (t2) prefetch_l2(t2 + first * D, bytes);
}

// The residual add fused in front of the norm (add_rmsnorm_forward): x = a + b rounded to
// bf16 exactly as reductions.cu's add does, stored, and normalised from the rounded value.
// a or b may be x itself (each element is read before the same thread writes it), so no
// read-only loads.
struct AddArgs {
  bf16* x = nullptr;
  const bf16* a = nullptr;
  const bf16* b = nullptr;
};

// What a kernel-lab version changes in a vector kernel, at compile time (norm_set_kernel_version;
// version 1 is OptV1): kPrefetch, the L2 prefetch of the next step's rows; kPipeline
// (forward; backward version 6), the next step's rows loaded into registers before this
// step's arithmetic, so a warp always has a step's loads in flight; kLite (fused RoPE),
// cos/sin split over the warp (RopeCache::update_warp) and the token index in 32 bits;
// kPdl (backward), the dw finish kernel may launch while this one still runs
// (programmatic dependent launch);
// kStaged (backward), x and dy of the next step copied into shared memory by cp.async
// while this step computes (two stages; the step reads its rows from shared memory);
// kDwShared (backward, rows of one warp: TPR 32, RPI 1), dw's per-column partial sums in
// shared memory instead of registers (the same additions in the same order per column),
// which frees VPL x 8 registers a thread for a third block an SM.
// kDynamic (backward with kDwShared; versions 11 and 12): each warp takes its next row from
// a device-wide ticket counter instead of a fixed grid stride, so that warps served late
// take fewer rows and the grid ends evenly. dx is unchanged; dw's partial rows then hold
// whichever rows each block took, so dw's order of sums (and its last bits) varies run to
// run. kTicketAhead (version 12): a warp's first row is its own index in the grid, as in
// the fixed stride, and each later row's ticket (counted from the grid's warps) is
// requested right after the step's loads and read at the step's end, so its round trip to
// L2 overlaps the step instead of preceding the next loads. Version 11 measured ~6 us
// more a call than version 10 in fixed cost, ~6 us already at one row a warp: likely
// its first tickets, every warp's atomic on one address at once, served one at a time.
// None but kDynamic changes an operation on a value or the rows a lane handles: the same
// bits.
// (Outside the unnamed namespace: nvcc warns about its unused members there.)
}  // namespace
namespace norm_lab {
template <bool Prefetch, bool Pipeline = false, bool Lite = false, bool Pdl = false,
          bool Staged = false, bool DwShared = false>
struct VecOpt {
  static constexpr bool kPrefetch = Prefetch, kPipeline = Pipeline, kLite = Lite, kPdl = Pdl,
                        kStaged = Staged, kDwShared = DwShared, kDynamic = false,
                        kTicketAhead = false;
};
// Backward version 11: version 5's options with rows taken from a ticket counter.
struct OptDynamicRows : VecOpt<false, false, false, true, false, true> {
  static constexpr bool kDynamic = true;
};
// Backward version 12: 11 with each warp's next ticket requested a step ahead.
struct OptDynamicRowsAhead : OptDynamicRows {
  static constexpr bool kTicketAhead = true;
};
}  // namespace norm_lab
namespace {
using norm_lab::VecOpt;
using OptV1 = VecOpt<true>;

__device__ __forceinline__ void pdl_launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}
// cp.async of 16 bytes global -> shared, zero-filled when !valid (src then not read); the
// "memory" clobbers keep the compiler from moving this thread's shared-memory reads across
// the wait. Before sm_80: a plain copy (the same bytes, synchronously).
__device__ __forceinline__ void stage_copy16(uint4* dst, const void* src, bool valid) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(
                   static_cast<uint32_t>(__cvta_generic_to_shared(dst))),
               "l"(src), "r"(valid ? 16 : 0)
               : "memory");
#else
  *dst = valid ? *static_cast<const uint4*>(src) : make_uint4(0, 0, 0, 0);
#endif
}
__device__ __forceinline__ void stage_commit() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.commit_group;" ::: "memory");
#endif
}
template <int N> __device__ __forceinline__ void stage_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
#endif
}
// Dynamic shared memory of the staged backward: [2 stages][x, dy][warps][RPI][VPL][32 lanes]
// of 16 bytes.
template <int RPI, int VPL>
constexpr size_t staged_bytes() { return size_t(2) * 2 * (kVecThreads / 32) * RPI * VPL * 32 * 16; }

__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

// kWarpToken (with kRope): every warp's RW rows of a step are heads of one token (the
// host checked heads % RW == 0), so the cos/sin are computed once a step, while the
// step's loads are in flight, and nowhere else (fewer registers than a check per row).
// A step: load_step (x, or a and b with kAdd), then compute_step; with kPipeline the next
// step's load_step is issued before this step's compute_step (rows past R load zeros and
// touch no memory).
template <class W, int TPR, int VPL, int RPI, bool kRope = false, bool kAdd = false,
          bool kWarpToken = false, class Opt = OptV1>
__global__ void __launch_bounds__(kVecThreads)
    rmsnorm_forward_vec_kernel(bf16* __restrict__ y, float* __restrict__ rstd,
                               const bf16* __restrict__ x, const W* __restrict__ w, int64_t R,
                               int D, float eps, RopeArgs ra, AddArgs aa) {
  static_assert(!kRope || VPL == 1, "fused RoPE needs head_dim = 8 * lanes per row");
  static_assert(!(kRope && kAdd), "one fusion at a time");
  RopeCache<TPR, Opt::kLite> rc;
  constexpr int G = 32 / TPR, RW = G * RPI, RB = (kVecThreads / 32) * RW;
  constexpr int NT = kAdd ? 2 : 1;  // tensors a step loads
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int grp = lane / TPR, sub = lane % TPR;
  const int64_t stride = int64_t(gridDim.x) * RB;
  auto row_of = [&](int64_t base, int r) { return vec_row<G, RPI>(base, warp, grp, r); };
  auto load_step = [&](int64_t base, uint4 (&raw)[NT][RPI][VPL]) {
#pragma unroll
    for (int r = 0; r < RPI; ++r) {
      const int64_t row = row_of(base, r);
#pragma unroll
      for (int k = 0; k < VPL; ++k) {
        const int col = (sub + k * TPR) * 8;
        const bool ok = row < R && col < D;
        if constexpr (kAdd) {
          raw[0][r][k] = ok ? *reinterpret_cast<const uint4*>(aa.a + row * D + col)
                            : make_uint4(0, 0, 0, 0);
          raw[1][r][k] = ok ? *reinterpret_cast<const uint4*>(aa.b + row * D + col)
                            : make_uint4(0, 0, 0, 0);
        } else {
          raw[0][r][k] = ok ? __ldg(reinterpret_cast<const uint4*>(x + row * D + col))
                            : make_uint4(0, 0, 0, 0);
        }
      }
    }
  };
  auto compute_step = [&](int64_t base, const uint4 (&raw)[NT][RPI][VPL]) {
    uint4 xv[RPI][VPL];
    float ss[RPI];
    if constexpr (kAdd) {
#pragma unroll
      for (int r = 0; r < RPI; ++r) {
        const int64_t row = row_of(base, r);
#pragma unroll
        for (int k = 0; k < VPL; ++k) {
          const int col = (sub + k * TPR) * 8;
          float fa[8], fb[8];
          unpack8(raw[0][r][k], fa);
          unpack8(raw[1][r][k], fb);
#pragma unroll
          for (int e = 0; e < 8; ++e) fa[e] += fb[e];
          xv[r][k] = pack8(fa);
          if (row < R && col < D) *reinterpret_cast<uint4*>(aa.x + row * D + col) = xv[r][k];
        }
      }
    } else {
#pragma unroll
      for (int r = 0; r < RPI; ++r)
#pragma unroll
        for (int k = 0; k < VPL; ++k) xv[r][k] = raw[0][r][k];
    }
    if constexpr (Opt::kPrefetch) {
      if constexpr (kAdd) prefetch_rows<RW>(base + stride, warp, lane, R, D, aa.a, aa.b);
      else prefetch_rows<RW>(base + stride, warp, lane, R, D, x);
    }
    if constexpr (kRope && kWarpToken) {
      if constexpr (Opt::kLite) rc.update_warp(ra, row_of(base, 0), sub, lane);
      else rc.update(ra, row_of(base, 0), sub);
    }
#pragma unroll
    for (int r = 0; r < RPI; ++r) {
      float acc = 0.f;
#pragma unroll
      for (int k = 0; k < VPL; ++k) add_squares8(acc, xv[r][k]);
      ss[r] = rms_rstd(group_sum<TPR>(acc), D, eps);
    }
#pragma unroll
    for (int k = 0; k < VPL; ++k) {
      const int col = (sub + k * TPR) * 8;
      if (col >= D) continue;
      float wf[8];
      load8(w + col, wf);
#pragma unroll
      for (int r = 0; r < RPI; ++r) {
        const int64_t row = row_of(base, r);
        float f[8];
        unpack8(xv[r][k], f);
        norm_chunk8(f, ss[r], wf);
        if constexpr (kRope) {
          if constexpr (!kWarpToken) rc.update(ra, row, sub);
          rc.rotate(f, sub);
        }
        if (row >= R) continue;
        store8(y + row * D + col, f);
      }
    }
#pragma unroll
    for (int r = 0; r < RPI; ++r) {
      const int64_t row = row_of(base, r);
      if (sub == 0 && row < R) rstd[row] = ss[r];
    }
  };
  if constexpr (Opt::kPipeline) {
    int64_t base = int64_t(blockIdx.x) * RB;
    uint4 cur[NT][RPI][VPL];
    load_step(base, cur);
    for (; base < R; base += stride) {
      uint4 next[NT][RPI][VPL];
      load_step(base + stride, next);
      compute_step(base, cur);
#pragma unroll
      for (int t = 0; t < NT; ++t)
#pragma unroll
        for (int r = 0; r < RPI; ++r)
#pragma unroll
          for (int k = 0; k < VPL; ++k) cur[t][r][k] = next[t][r][k];
    }
  } else {
    for (int64_t base = int64_t(blockIdx.x) * RB; base < R; base += stride) {
      uint4 raw[NT][RPI][VPL];
      load_step(base, raw);
      compute_step(base, raw);
    }
  }
}

// kRope: dy is the gradient w.r.t. the rotated output; it is rotated back (rounded to
// bf16, as the unfused inverse RoPE stores it) right after loading, and not written.
// The body of the backward kernels below (one kernel per launch-bounds rule).
// kDynamic's row tickets: [0] the next row, [1] the warps that found no row left. The
// last warp of a grid to find none zeroes both, so each launch starts from 0 (launches on
// one stream run one after another; kDynamic kernels are never launched concurrently).
// 32 bits: the host takes version 10 instead where rows plus twice the warps reach 2^32.
__device__ unsigned int g_backward_row_ticket[2];

template <class W, int TPR, int VPL, int RPI, bool kRope, bool kWarpToken, class Opt>
__device__ __forceinline__ void rmsnorm_backward_vec_body(
    bf16* dx, float* __restrict__ partials, const bf16* __restrict__ dy,
    const bf16* __restrict__ x, const W* __restrict__ w, const float* __restrict__ rstd,
    int64_t R, int D, bool accumulate, const RopeArgs& ra) {
  static_assert(!kRope || VPL == 1, "fused RoPE needs head_dim = 8 * lanes per row");
  // The finish kernel's blocks may be scheduled now (they wait for this grid's end before
  // reading `partials`): its launch overlaps this kernel instead of following it.
  if constexpr (Opt::kPdl) pdl_launch_dependents();
  RopeCache<TPR, Opt::kLite> rc;
  constexpr int G = 32 / TPR, RW = G * RPI, RB = (kVecThreads / 32) * RW;
  constexpr bool kDwShared = Opt::kDwShared;
  static_assert(!kDwShared || (TPR == 32 && RPI == 1 && !kRope && !Opt::kStaged),
                "dw in shared memory: one row a warp, no staging");
  static_assert(!Opt::kDynamic || (kDwShared && !Opt::kPipeline && !Opt::kPrefetch),
                "dynamic rows: one row a warp, loaded in its own step");
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int grp = lane / TPR, sub = lane % TPR;
  // kDwShared: warp wi's sums of this lane's 8 columns of vector k, half h (4 floats), at
  // dw_slot(wi, k, h): lanes side by side, so a warp's 16-byte accesses are conflict-free.
  float dw_acc[kDwShared ? 1 : VPL][8];
  extern __shared__ uint4 norm_stage[];
  auto dw_slot = [&](int wi, int k, int h) {
    return reinterpret_cast<float4*>(norm_stage) + ((wi * VPL + k) * 2 + h) * 32 + lane;
  };
  if constexpr (kDwShared) {
#pragma unroll
    for (int k = 0; k < VPL; ++k)
#pragma unroll
      for (int h = 0; h < 2; ++h) *dw_slot(warp, k, h) = make_float4(0.f, 0.f, 0.f, 0.f);
  } else {
#pragma unroll
    for (int k = 0; k < VPL; ++k)
#pragma unroll
      for (int e = 0; e < 8; ++e) dw_acc[k][e] = 0.f;
  }

  auto row_of = [&](int64_t base, int r) { return vec_row<G, RPI>(base, warp, grp, r); };
  const int64_t stride = int64_t(gridDim.x) * RB;
  // The first step's old dx (later steps' come with the previous step's prefetch): in L2
  // by the time dx is computed and added to it.
  if ((Opt::kPrefetch || Opt::kStaged) && accumulate)
    prefetch_rows<RW>(int64_t(blockIdx.x) * RB, warp, lane, R, D, dx);
  // kStaged: a step's x and dy rows, copied a step ahead (each lane copies and later reads
  // its own 16-byte slots: no barrier), and its rstd values, loaded a step ahead too.
  auto slot = [&](int buf, int t, int r, int k) {
    return norm_stage + ((((buf * 2 + t) * (kVecThreads / 32) + warp) * RPI + r) * VPL + k) * 32 +
           lane;
  };
  [[maybe_unused]] float rs_next[RPI];
  auto stage_issue = [&](int64_t base, int buf) {
#pragma unroll
    for (int r = 0; r < RPI; ++r) {
      const int64_t row = row_of(base, r);
      rs_next[r] = row < R ? rstd[row] : 0.f;
#pragma unroll
      for (int k = 0; k < VPL; ++k) {
        const int col = (sub + k * TPR) * 8;
        const bool ok = row < R && col < D;
        const int64_t off = ok ? row * D + col : 0;
        stage_copy16(slot(buf, 0, r, k), x + off, ok);
        stage_copy16(slot(buf, 1, r, k), dy + off, ok);
      }
    }
    stage_commit();
  };
  int buf = 0;
  if constexpr (Opt::kStaged) stage_issue(int64_t(blockIdx.x) * RB, 0);
  // A step's rows x, dy and their rstd (rows past R: zeros, nothing read).
  auto load_rows = [&](int64_t b, uint4 (&xo)[RPI][VPL], uint4 (&go)[RPI][VPL], float (&ro)[RPI]) {
#pragma unroll
    for (int r = 0; r < RPI; ++r) {
      const int64_t row = row_of(b, r);
      ro[r] = row < R ? rstd[row] : 0.f;
#pragma unroll
      for (int k = 0; k < VPL; ++k) {
        const int col = (sub + k * TPR) * 8;
        const bool ok = row < R && col < D;
        xo[r][k] = ok ? __ldg(reinterpret_cast<const uint4*>(x + row * D + col))
                      : make_uint4(0, 0, 0, 0);
        go[r][k] = ok ? __ldg(reinterpret_cast<const uint4*>(dy + row * D + col))
                      : make_uint4(0, 0, 0, 0);
      }
    }
  };
  // kPipeline: the next step's rows are requested before this step's arithmetic and
  // stores, so a warp always has a step's loads in flight.
  [[maybe_unused]] uint4 nx[RPI][VPL], ng[RPI][VPL];
  [[maybe_unused]] float nrs[RPI];
  if constexpr (Opt::kPipeline) load_rows(int64_t(blockIdx.x) * RB, nx, ng, nrs);
  // kDynamic: the warp's row is its ticket; base is set so that row_of(base, 0) gives it.
  auto take_row = [&]() -> int64_t {
    unsigned t = 0;
    if (lane == 0) t = atomicAdd(&g_backward_row_ticket[0], 1u);
    return int64_t(__shfl_sync(0xffffffffu, t, 0)) - warp;
  };
  // kTicketAhead: lane 0's ticket for the next step, requested during this one.
  [[maybe_unused]] unsigned ticket_ahead = 0;
  auto next_row = [&]() -> int64_t {
    if constexpr (Opt::kTicketAhead)
      return int64_t(__shfl_sync(0xffffffffu, ticket_ahead, 0)) - warp;
    else
      return take_row();
  };
  for (int64_t base = Opt::kDynamic && !Opt::kTicketAhead ? take_row() : int64_t(blockIdx.x) * RB;
       Opt::kDynamic ? base + warp < R : base < R;
       base = Opt::kDynamic ? next_row() : base + stride, buf ^= 1) {
    uint4 xv[RPI][VPL], gv[RPI][VPL];
    float rs[RPI], coef[RPI];
    if constexpr (Opt::kPipeline) {
#pragma unroll
      for (int r = 0; r < RPI; ++r) {
        rs[r] = nrs[r];
#pragma unroll
        for (int k = 0; k < VPL; ++k) {
          xv[r][k] = nx[r][k];
          gv[r][k] = ng[r][k];
        }
      }
      load_rows(base + stride, nx, ng, nrs);
    } else if constexpr (Opt::kStaged) {
#pragma unroll
      for (int r = 0; r < RPI; ++r) rs[r] = rs_next[r];
      stage_issue(base + stride, buf ^ 1);  // rows past R: zero-filled, nothing read
      stage_wait<1>();                      // this step's copies (the older group) landed
#pragma unroll
      for (int r = 0; r < RPI; ++r)
#pragma unroll
        for (int k = 0; k < VPL; ++k) {
          xv[r][k] = *slot(buf, 0, r, k);
          gv[r][k] = *slot(buf, 1, r, k);
        }
      if (accumulate) prefetch_rows<RW>(base + stride, warp, lane, R, D, dx);
    } else {
      load_rows(base, xv, gv, rs);
      if constexpr (Opt::kTicketAhead)
        if (lane == 0)  // rows after the grid's first row a warp
          ticket_ahead = atomicAdd(&g_backward_row_ticket[0], 1u) + gridDim.x * (kVecThreads / 32);
    }
    if constexpr (Opt::kPrefetch)
      prefetch_rows<RW>(base + stride, warp, lane, R, D, x, dy, accumulate ? dx : nullptr);
    if constexpr (kRope) {
      if constexpr (kWarpToken) {
        if constexpr (Opt::kLite) rc.update_warp(ra, row_of(base, 0), sub, lane);
        else rc.update(ra, row_of(base, 0), sub);
      }
#pragma unroll
      for (int r = 0; r < RPI; ++r) {
        float gf[8];
        unpack8(gv[r][0], gf);
        if constexpr (!kWarpToken) rc.update(ra, row_of(base, r), sub);
        rc.rotate(gf, sub);
        gv[r][0] = pack8(gf);
      }
    }
    float gx[RPI];
#pragma unroll
    for (int r = 0; r < RPI; ++r) gx[r] = 0.f;
#pragma unroll
    for (int k = 0; k < VPL; ++k) {
      const int col = (sub + k * TPR) * 8;
      if (col >= D) continue;
      float wf[8];
      load8(w + col, wf);
#pragma unroll
      for (int r = 0; r < RPI; ++r) {
        float xf[8], gf[8];
        unpack8(xv[r][k], xf);
        unpack8(gv[r][k], gf);
#pragma unroll
        for (int e = 0; e < 8; ++e) gx[r] += gf[e] * wf[e] * xf[e];
      }
    }
#pragma unroll
    for (int r = 0; r < RPI; ++r) coef[r] = rs[r] * rs[r] * group_sum<TPR>(gx[r]) / float(D);
#pragma unroll
    for (int k = 0; k < VPL; ++k) {
      const int col = (sub + k * TPR) * 8;
      if (col >= D) continue;
      float wf[8];
      load8(w + col, wf);
#pragma unroll
      for (int r = 0; r < RPI; ++r) {
        const int64_t row = row_of(base, r);
        float xf[8], gf[8];
        unpack8(xv[r][k], xf);
        unpack8(gv[r][k], gf);
        // Rows past R hold zeros: they add nothing to dw.
        if constexpr (kDwShared) {
          float4 a = *dw_slot(warp, k, 0), b = *dw_slot(warp, k, 1);
          a.x += gf[0] * (xf[0] * rs[r]);
          a.y += gf[1] * (xf[1] * rs[r]);
          a.z += gf[2] * (xf[2] * rs[r]);
          a.w += gf[3] * (xf[3] * rs[r]);
          b.x += gf[4] * (xf[4] * rs[r]);
          b.y += gf[5] * (xf[5] * rs[r]);
          b.z += gf[6] * (xf[6] * rs[r]);
          b.w += gf[7] * (xf[7] * rs[r]);
          *dw_slot(warp, k, 0) = a;
          *dw_slot(warp, k, 1) = b;
        } else {
#pragma unroll
          for (int e = 0; e < 8; ++e) dw_acc[k][e] += gf[e] * (xf[e] * rs[r]);
        }
        if (row >= R) continue;
        float v[8];
#pragma unroll
        for (int e = 0; e < 8; ++e) v[e] = rs[r] * (gf[e] * wf[e] - xf[e] * coef[r]);
        bf16* out = dx + row * D + col;
        if (accumulate) {
          float old[8];
          load8(out, old);
#pragma unroll
          for (int e = 0; e < 8; ++e) v[e] = stored<bf16>(v[e]) + old[e];
        }
        store8(out, v);
      }
    }
  }

  if constexpr (Opt::kStaged) stage_wait<0>();  // the last (zero-filled) stage
  if constexpr (Opt::kDynamic) {
    if (lane == 0) {
      const unsigned warps = gridDim.x * (kVecThreads / 32);
      if (atomicAdd(&g_backward_row_ticket[1], 1u) == warps - 1) {
        g_backward_row_ticket[0] = 0;
        g_backward_row_ticket[1] = 0;
      }
    }
  }

  if constexpr (kDwShared) {
    // Column c's sums of the 8 warps, in warp order: the additions below, as version 1's.
    __syncthreads();
    const float* sums = reinterpret_cast<const float*>(norm_stage);
    for (int c = threadIdx.x; c < D; c += kVecThreads) {
      const int k = c / (8 * TPR), l = (c / 8) % TPR, h = (c / 4) % 2, j = c % 4;
      auto at = [&](int wi) { return sums[(((wi * VPL + k) * 2 + h) * 32 + l) * 4 + j]; };
      float t = at(0);
#pragma unroll
      for (int wi = 1; wi < kVecThreads / 32; ++wi) t += at(wi);
      partials[int64_t(blockIdx.x) * D + c] = t;
    }
  } else {
    // dw partial of this block: lane groups of a warp (same columns) by shuffles, then the
    // warps in warp order through shared memory; one row of `partials` per block.
#pragma unroll
    for (int k = 0; k < VPL; ++k)
#pragma unroll
      for (int e = 0; e < 8; ++e)
#pragma unroll
        for (int o = 16; o >= TPR; o >>= 1)
          dw_acc[k][e] += __shfl_xor_sync(0xffffffffu, dw_acc[k][e], o);
    __shared__ float col_sum[kVecMaxDBackward];
    for (int wi = 0; wi < kVecThreads / 32; ++wi) {
      if (warp == wi && grp == 0) {
#pragma unroll
        for (int k = 0; k < VPL; ++k) {
          const int col = (sub + k * TPR) * 8;
          if (col >= D) continue;
#pragma unroll
          for (int e = 0; e < 8; ++e)
            col_sum[col + e] = wi == 0 ? dw_acc[k][e] : col_sum[col + e] + dw_acc[k][e];
        }
      }
      __syncthreads();
    }
    for (int c = threadIdx.x; c < D; c += kVecThreads)
      partials[int64_t(blockIdx.x) * D + c] = col_sum[c];
  }
}

template <class W, int TPR, int VPL, int RPI, bool kRope = false, bool kWarpToken = false,
          class Opt = OptV1>
__global__ void __launch_bounds__(kVecThreads)
    rmsnorm_backward_vec_kernel(bf16* dx, float* __restrict__ partials,
                                const bf16* __restrict__ dy, const bf16* __restrict__ x,
                                const W* __restrict__ w, const float* __restrict__ rstd,
                                int64_t R, int D, bool accumulate, RopeArgs ra) {
  rmsnorm_backward_vec_body<W, TPR, VPL, RPI, kRope, kWarpToken, Opt>(dx, partials, dy, x, w,
                                                                      rstd, R, D, accumulate, ra);
}
// The staged plain kernels of short rows (D <= 768, kStaged3) held to 3 blocks per SM:
// version 1's residency there (their grid is version 1's); unbounded they took 90 registers.
template <int TPR, int VPL, int RPI>
constexpr bool kStaged3 = RPI > 1 || VPL <= 3;
// The same kernel serves backward version 5 (3 blocks an SM) and 10 (kBlocksPerSm 4).
template <class W, int TPR, int VPL, int RPI, class Opt, int kBlocksPerSm = 3>
__global__ void __launch_bounds__(kVecThreads, kBlocksPerSm)
    rmsnorm_backward_vec_kernel3(bf16* dx, float* __restrict__ partials,
                                 const bf16* __restrict__ dy, const bf16* __restrict__ x,
                                 const W* __restrict__ w, const float* __restrict__ rstd, int64_t R,
                                 int D, bool accumulate, RopeArgs ra) {
  rmsnorm_backward_vec_body<W, TPR, VPL, RPI, false, false, Opt>(dx, partials, dy, x, w, rstd, R,
                                                                  D, accumulate, ra);
}

// ---- QK-norm + RoPE version 6: a lane holds both halves of its rotate-half pairs ------
// Rows are (token, head) of head_dim D = 8 * TPR, half H = D / 2. Lane `sub` of a row's
// TPR lanes holds features [4 sub, 4 sub + 4) and [H + 4 sub, H + 4 sub + 4): two 8-byte
// accesses (a lane group still reads whole 128-byte lines), the rotation needs no
// shuffle, and the lane's four pairs are exactly the pairs of one 32-byte record of the
// cos/sin table (rope_table_fill), read from L1/L2 instead of four sincosf. The ncu
// profile of versions 1-5 (cuda/NOTES.md, "Paired lanes") had them issue-bound: 28
// instructions an element, 0.71-0.76 warps issuing per scheduler cycle.
// In registers the lane's 8 values sit as one bf16x8 vector {first half, second half}, so
// unpack8/pack8 serve. Numerics: version 1's operations on every value, except the order
// of a row's fp32 sums (rstd's sum of squares, the backward's sum of g w x), whose terms a
// lane now meets in another order: rstd and coef can differ from version 1's in the last
// bit (tests compare this version with the CPU, not with version 1's bits). Row mapping
// and dw's summation order per column are version 1's.
struct RopeTableArgs {
  const float* table = nullptr;  // [positions][H / 4][cos x4, sin x4]
  int64_t T_len = 1, first_position = 0;
  int heads = 1;
};

// A lane's 8 values of a row p: 4 at column c1, 4 at column c2 (8-byte aligned), as one
// bf16x8 vector {c1's, c2's}; and back.
__device__ __forceinline__ uint4 load_halves(const bf16* p, int c1, int c2) {
  const uint2 a = *reinterpret_cast<const uint2*>(p + c1),
              b = *reinterpret_cast<const uint2*>(p + c2);
  return make_uint4(a.x, a.y, b.x, b.y);
}
__device__ __forceinline__ uint4 ldg_halves(const bf16* p, int c1, int c2) {
  const uint2 a = __ldg(reinterpret_cast<const uint2*>(p + c1)),
              b = __ldg(reinterpret_cast<const uint2*>(p + c2));
  return make_uint4(a.x, a.y, b.x, b.y);
}
__device__ __forceinline__ void store_halves(bf16* p, int c1, int c2, uint4 v) {
  *reinterpret_cast<uint2*>(p + c1) = make_uint2(v.x, v.y);
  *reinterpret_cast<uint2*>(p + c2) = make_uint2(v.z, v.w);
}

// The four pairs' cos and sin of this lane at the row's position (sin negated: the
// backward's inverse rotation).
template <int TPR, bool kBackward>
__device__ __forceinline__ void pair_cos_sin(const RopeTableArgs& rt, int64_t row, int sub,
                                             float (&c)[4], float (&s)[4]) {
  const uint32_t t = uint32_t(row) / uint32_t(rt.heads);
  const int64_t pos = rt.first_position + int64_t(t % uint32_t(rt.T_len));
  // A position's H / 4 = TPR records of 8 floats; this lane's is record `sub`.
  const float4* rec = reinterpret_cast<const float4*>(rt.table + (pos * TPR + sub) * 8);
  const float4 cv = __ldg(rec), sv = __ldg(rec + 1);
  c[0] = cv.x, c[1] = cv.y, c[2] = cv.z, c[3] = cv.w;
  s[0] = sv.x, s[1] = sv.y, s[2] = sv.z, s[3] = sv.w;
  if constexpr (kBackward) {
#pragma unroll
    for (int k = 0; k < 4; ++k) s[k] = -s[k];
  }
}

// Rotate-half on the lane's {first, second} values: version 1's RopeCache::rotate (v
// rounded to bf16 first; first half v c + (-p) s, second half v c + p s, p the partner).
__device__ __forceinline__ void rotate_pairs(float (&v)[8], const float (&c)[4],
                                             const float (&s)[4]) {
  unpack8(pack8(v), v);
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const float a = v[k], b = v[k + 4];
    v[k] = a * c[k] + (-1.f * b) * s[k];
    v[k + 4] = b * c[k] + (1.f * a) * s[k];
  }
}

constexpr int kPairRpi = 4;  // rows per lane group and step (version 1's at these D)

// One tensor's rows in a launch of the kernels below: the launch's first t0.blocks blocks
// take tensor t0, the rest t1 (kTwo: q and k of a layer in one launch; else t0 alone, and
// the kernel selects nothing: the selects cost the backward 20 bytes of spills). Forward:
// out is y, rstd written. Backward: out is dx, rstd read, and partials holds this
// tensor's dw partial rows, one per block of the tensor.
struct PairRows {
  bf16* out = nullptr;
  float* rstd = nullptr;
  float* partials = nullptr;
  const bf16* x = nullptr;
  const bf16* dy = nullptr;
  const bf16* w = nullptr;
  int64_t R = 0;
  int heads = 1, blocks = 0;
};
// This block's tensor, its index among the tensor's blocks, and the table arguments with
// the tensor's head count.
template <bool kTwo>
__device__ __forceinline__ PairRows pair_rows_of_block(const PairRows& t0, const PairRows& t1,
                                                       RopeTableArgs& rt, int64_t& block) {
  if constexpr (!kTwo) {
    block = blockIdx.x;
    rt.heads = t0.heads;
    return t0;
  }
  const bool second = int(blockIdx.x) >= t0.blocks;
  block = second ? int64_t(blockIdx.x) - t0.blocks : int64_t(blockIdx.x);
  // Field by field: a select of the whole struct copies it through local memory.
  PairRows t;
  t.out = second ? t1.out : t0.out;
  t.rstd = second ? t1.rstd : t0.rstd;
  t.partials = second ? t1.partials : t0.partials;
  t.x = second ? t1.x : t0.x;
  t.dy = second ? t1.dy : t0.dy;
  t.w = second ? t1.w : t0.w;
  t.R = second ? t1.R : t0.R;
  t.heads = second ? t1.heads : t0.heads;
  t.blocks = second ? t1.blocks : t0.blocks;
  rt.heads = t.heads;
  return t;
}

// kWarpToken: a warp's rows of a step are heads of one token (heads % RW == 0): one table
// read a step.
template <int TPR, bool kWarpToken, bool kTwo>
__global__ void __launch_bounds__(kVecThreads)
    qk_norm_rope_forward_pairs_kernel(PairRows t0, PairRows t1, float eps, RopeTableArgs rt) {
  constexpr int D = 8 * TPR, H = D / 2, G = 32 / TPR, RPI = kPairRpi, RW = G * RPI,
                RB = (kVecThreads / 32) * RW;
  int64_t block = 0;
  const PairRows t = pair_rows_of_block<kTwo>(t0, t1, rt, block);
  bf16* __restrict__ y = t.out;
  float* __restrict__ rstd = t.rstd;
  const bf16* __restrict__ x = t.x;
  const int64_t R = t.R;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int grp = lane / TPR, sub = lane % TPR;
  const int c1 = 4 * sub, c2 = H + 4 * sub;
  float wf[8];
  unpack8(ldg_halves(t.w, c1, c2), wf);
  const int64_t stride = int64_t(t.blocks) * RB;
  for (int64_t base = block * RB; base < R; base += stride) {
    uint4 xv[RPI];
#pragma unroll
    for (int r = 0; r < RPI; ++r) {
      const int64_t row = vec_row<G, RPI>(base, warp, grp, r);
      xv[r] = make_uint4(0, 0, 0, 0);
      if (row < R) {
        xv[r] = ldg_halves(x + row * D, c1, c2);
      }
    }
    float c[4], s[4];
    if constexpr (kWarpToken)
      pair_cos_sin<TPR, false>(rt, vec_row<G, RPI>(base, warp, 0, 0), sub, c, s);
#pragma unroll
    for (int r = 0; r < RPI; ++r) {
      const int64_t row = vec_row<G, RPI>(base, warp, grp, r);
      float f[8];
      unpack8(xv[r], f);
      float acc = 0.f;
#pragma unroll
      for (int e = 0; e < 8; ++e) acc += f[e] * f[e];
      const float ss = rsqrtf(group_sum<TPR>(acc) / float(D) + eps);
      if (row >= R) continue;  // after the group's shuffles
#pragma unroll
      for (int e = 0; e < 8; ++e) f[e] = f[e] * ss * wf[e];
      if constexpr (!kWarpToken) pair_cos_sin<TPR, false>(rt, row, sub, c, s);
      rotate_pairs(f, c, s);
      store_halves(y + row * D, c1, c2, pack8(f));
      if (sub == 0) rstd[row] = ss;
    }
  }
}

// The backward of the above: dy rotated back (rounded to bf16, as version 1), then
// version 1's operations; dw's partial row per block as rmsnorm_backward_vec_body, the
// finish kernel launched as a programmatic dependent.
// Held to 80 registers (3 blocks an SM; unbounded it took 95, 2 blocks).
template <int TPR, bool kWarpToken, bool kTwo>
__global__ void __launch_bounds__(kVecThreads, 3)
    qk_norm_rope_backward_pairs_kernel(PairRows t0, PairRows t1, bool accumulate,
                                       RopeTableArgs rt) {
  pdl_launch_dependents();
  constexpr int D = 8 * TPR, H = D / 2, G = 32 / TPR, RPI = kPairRpi, RW = G * RPI,
                RB = (kVecThreads / 32) * RW;
  int64_t block = 0;
  const PairRows t = pair_rows_of_block<kTwo>(t0, t1, rt, block);
  bf16* dx = t.out;
  const bf16* __restrict__ dy = t.dy;
  const bf16* __restrict__ x = t.x;
  const float* __restrict__ rstd = t.rstd;
  const int64_t R = t.R;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int grp = lane / TPR, sub = lane % TPR;
  const int c1 = 4 * sub, c2 = H + 4 * sub;
  float wf[8], dw_acc[8];
  unpack8(ldg_halves(t.w, c1, c2), wf);
#pragma unroll
  for (int e = 0; e < 8; ++e) dw_acc[e] = 0.f;
  const int64_t stride = int64_t(t.blocks) * RB;
  for (int64_t base = block * RB; base < R; base += stride) {
    uint4 xv[RPI], gv[RPI];
    float rs[RPI];
#pragma unroll
    for (int r = 0; r < RPI; ++r) {
      const int64_t row = vec_row<G, RPI>(base, warp, grp, r);
      xv[r] = gv[r] = make_uint4(0, 0, 0, 0);
      rs[r] = 0.f;
      if (row < R) {
        xv[r] = ldg_halves(x + row * D, c1, c2);
        gv[r] = ldg_halves(dy + row * D, c1, c2);
        rs[r] = __ldg(rstd + row);
      }
    }
    float c[4], s[4];
    if constexpr (kWarpToken)
      pair_cos_sin<TPR, true>(rt, vec_row<G, RPI>(base, warp, 0, 0), sub, c, s);
#pragma unroll
    for (int r = 0; r < RPI; ++r) {
      const int64_t row = vec_row<G, RPI>(base, warp, grp, r);
      float xf[8], gf[8];
      unpack8(xv[r], xf);
      unpack8(gv[r], gf);
      if constexpr (!kWarpToken) pair_cos_sin<TPR, true>(rt, row < R ? row : 0, sub, c, s);
      rotate_pairs(gf, c, s);
      unpack8(pack8(gf), gf);  // the rotated gradient as the unfused inverse RoPE stores it
      float gx = 0.f;
#pragma unroll
      for (int e = 0; e < 8; ++e) gx += gf[e] * wf[e] * xf[e];
      const float coef = rs[r] * rs[r] * group_sum<TPR>(gx) / float(D);
      // Rows past R hold zeros: they add nothing to dw.
#pragma unroll
      for (int e = 0; e < 8; ++e) dw_acc[e] += gf[e] * (xf[e] * rs[r]);
      if (row >= R) continue;
      float v[8];
#pragma unroll
      for (int e = 0; e < 8; ++e) v[e] = rs[r] * (gf[e] * wf[e] - xf[e] * coef);
      bf16* q = dx + row * D;
      if (accumulate) {
        float old[8];
        unpack8(load_halves(q, c1, c2), old);
#pragma unroll
        for (int e = 0; e < 8; ++e) v[e] = stored<bf16>(v[e]) + old[e];
      }
      store_halves(q, c1, c2, pack8(v));
    }
  }
  // dw: lane groups by shuffles, then warps in order through shared memory (version 1's order).
#pragma unroll
  for (int e = 0; e < 8; ++e)
#pragma unroll
    for (int o = 16; o >= TPR; o >>= 1) dw_acc[e] += __shfl_xor_sync(0xffffffffu, dw_acc[e], o);
  __shared__ float col_sum[D];
  for (int wi = 0; wi < kVecThreads / 32; ++wi) {
    if (warp == wi && grp == 0) {
#pragma unroll
      for (int e = 0; e < 8; ++e) {
        const int col = e < 4 ? c1 + e : c2 + e - 4;
        col_sum[col] = wi == 0 ? dw_acc[e] : col_sum[col] + dw_acc[e];
      }
    }
    __syncthreads();
  }
  // This block's partial row, its address derived again from the parameters rather than
  // kept live through the loop (kTwo's 80 registers had no room for it).
  int64_t end_block = 0;
  float* partials = pair_rows_of_block<kTwo>(t0, t1, rt, end_block).partials;
  for (int c = threadIdx.x; c < D; c += kVecThreads) partials[end_block * D + c] = col_sum[c];
}

// The cos/sin table of version 6: record (pos, q) holds pairs 4q .. 4q + 3 (cos, then
// sin) at position pos. inv_freq of pair p is RopeCache::update's sequence of fp64
// products (ipow(base, 8 (p / 8)), then base p % 8 times), and rope_cos_sin the same
// call: the same bits as versions 1-5 compute in the kernel.
__global__ void rope_table_kernel(float* table, double base, int half, int64_t positions) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= positions * half) return;
  const int64_t pos = i / half;
  const int p = int(i % half);
  double f = ipow(base, p & ~7);
  for (int k = 0; k < (p & 7); ++k) f *= base;
  float c, s;
  rope_cos_sin(f, pos, false, c, s);
  float* rec = table + (pos * (half / 4) + p / 4) * 8;
  rec[p % 4] = c;
  rec[4 + p % 4] = s;
}

// dw[c] += sum over blocks b (in order per row lane, then lanes in order) of
// partials[b][c]. Block (32 columns) x (kFinishLanes row lanes): with one partial row per
// resident block (~264 at D 1280) every lane has all its ~8 loads in flight at once (was 8
// lanes with ~33 loads each, 8 in flight: a few microseconds of latency on 40 SMs after
// every backward). At backward version 10's 528 rows a lane issues its ~17 loads 8 at a
// time; issuing up to 32 at once (a1be600: the same bits) made the call 2.9 us slower at
// 1B's 16,384 rows, cause not looked into (cuda/NOTES.md lead 4).
// kPdl: launched as a programmatic dependent of the backward kernel; waits for its end
// (and its partial rows' visibility) before the first read.
// Up to two weights at once (gridDim.y; q's and k's after one QK-norm launch of both).
constexpr int kFinishLanes = 32;
struct DwFinish {
  float* dw = nullptr;
  const float* partials = nullptr;
  int nblocks = 0;
};
template <bool kPdl = false>
__global__ void __launch_bounds__(32 * kFinishLanes)
    rmsnorm_dw_finish_kernel(DwFinish f0, DwFinish f1, int D) {
  if constexpr (kPdl) pdl_wait();
  float* dw = blockIdx.y == 0 ? f0.dw : f1.dw;
  const float* __restrict__ partials = blockIdx.y == 0 ? f0.partials : f1.partials;
  const int nblocks = blockIdx.y == 0 ? f0.nblocks : f1.nblocks;
  __shared__ float part[kFinishLanes][33];
  const int c = blockIdx.x * 32 + threadIdx.x;
  float acc = 0.f;
  if (c < D) {
#pragma unroll 8
    for (int b = threadIdx.y; b < nblocks; b += kFinishLanes)
      acc += __ldg(partials + int64_t(b) * D + c);
  }
  part[threadIdx.y][threadIdx.x] = acc;
  __syncthreads();
  if (threadIdx.y == 0 && c < D) {
    float t = 0.f;
#pragma unroll
    for (int i = 0; i < kFinishLanes; ++i) t += part[i][threadIdx.x];
    dw[c] += t;
  }
}

// The (TPR, VPL, RPI) for a row length D (a multiple of 8, at most kVecMaxD); calls
// f(std::integral_constant...) through a generic lambda taking three int constants.
template <int A, int B, int C>
struct Cfg {
  static constexpr int TPR = A, VPL = B, RPI = C;
};
template <class F> bool dispatch_row_config(int D, bool backward, F&& f) {
  const int vecs = D / 8;
  if (vecs <= 8) f(Cfg<8, 1, 4>{});
  else if (vecs <= 16) f(Cfg<16, 1, 4>{});
  else if (vecs <= 32) f(Cfg<32, 1, 4>{});
  else if (vecs <= 64) f(Cfg<32, 2, 2>{});
  else if (vecs <= 96) f(Cfg<32, 3, 1>{});
  else if (vecs <= 128) f(Cfg<32, 4, 1>{});
  else if (vecs <= 160) f(Cfg<32, 5, 1>{});
  else if (vecs <= 192) f(Cfg<32, 6, 1>{});
  else if (vecs <= 256) f(Cfg<32, 8, 1>{});
  else if (backward) return false;  // dx, dy and dw partials would spill past 2048
  else if (vecs <= 384) f(Cfg<32, 12, 1>{});
  else if (vecs <= 512) f(Cfg<32, 16, 1>{});
  else return false;
  return true;
}

bool vector_path(DType t, int64_t D, int64_t max_d, std::initializer_list<const void*> ptrs) {
  if (t != DType::BF16 || D % 8 != 0 || D <= 0 || D > max_d) return false;
  for (const void* p : ptrs)
    if (!aligned16(p)) return false;
  return true;
}

// ---- kernel lab: numbered versions (norm_set_kernel_version, kernels.h) -----------------
// Every version computes each output value with the same operations in the same order as
// version 1 (the tests compare them bit for bit); they differ in memory scheduling only.
// Forward (rmsnorm_forward and add_rmsnorm_forward):
//   1 L2 prefetch of the next step, grid of the resident blocks (as many as fit at once).
//   2 no prefetch, same grid (the plain forward lost 7 points when the prefetch came).
//   3 no prefetch, balanced grid: ceil(steps / resident) steps for every block, so no
//     last round where a few blocks run alone (1B: 2048 steps on ~660 resident blocks
//     made 68 blocks take a 4th step).
//   4 no prefetch, one step per block (the hardware block scheduler balances the tail).
//   5 no prefetch, register pipeline (kPipeline) on the balanced grid, where a step is at
//     most 10 vectors a lane (else version 3's kernel).
// Backward (rmsnorm_backward). dw's partial rows, and so its fp32 sum order, depend on the
// grid and each lane's rows: every version runs version 1's grid and row mapping.
//   1 L2 prefetch. 2 no prefetch. 3 no prefetch, the dw finish kernel launched as a
//   programmatic dependent (its launch and ramp hidden under the backward's tail).
//   4 version 3 with x and dy staged (kStaged): the next step's rows are copied into
//   shared memory by cp.async while this step computes, so a warp never waits on device
//   memory for its rows (the old dx of "+=" is still asked of L2 a step ahead).
//   Shared memory 2 x 2 x 8 x RPI x VPL x 512 bytes (80 KB at D 1280; the blocks per SM
//   of version 1 still fit up to D 2048).
//   5 version 3 with dw's partial sums in shared memory (kDwShared; rows of one warp,
//   512 < D <= 1536: 8 x VPL KB, 40 KB at D 1280) held to 3 blocks an SM, on its own resident
//   grid: not version 1's dw bits (other partial rows; dx is version 1's bits). Shorter
//   rows run version 3.
//   6 version 5 with the next step's x, dy and rstd loaded into registers before this
//   step's arithmetic (kPipeline), 2 blocks an SM, its own resident grid (as 5: dw's
//   partial rows differ from version 1's). Shorter rows run version 3.
//   7 the ring kernel (norm_backward_ring.cu): one block an SM whose producer lane keeps
//   up to 32 rows of x and dy (and the old dx of "+=") in flight into shared memory by
//   cp.async.bulk while 8 consumer warps compute version 1's dx bits from them; dw
//   finished inside the kernel after a grid synchronisation (cooperative launch): no
//   finish kernel, dw summed over its own grid. 8: 7 with two blocks an SM, each with
//   half the shared memory. 9: 7 with a row's x, dy (and old dx) held in registers from
//   the first pass to the second and its stage released after the first (one block an
//   SM; D <= 1536, else version 7). Where 512 < D <= 2048; other widths run version 5's
//   rule.
//   10 version 5 held to 4 blocks an SM where its rows are 5-6 vectors a lane (1024 < D
//   <= 1536; 64 registers at D 1280, no spills), its own resident grid; elsewhere version
//   5 (at D 1024 version 5 already takes 64 registers and 4 blocks; shorter rows were not
//   timed under the bound). At 1B's 16,384 rows, 528 blocks take every warp through at
//   most 4 rows (3.9 on average), where version 5's 396 take 5.2 on average and 6 at most,
//   the 6th step with 17% of the warps running. Timed on an H100 (thirty-ninth session):
//   75.3% of copy overwriting and 79.0% accumulating against version 5's 74.6% and 76.2%,
//   1-4% where the tail reasoning predicted ~14%, so the tail is a small part of the gap.
//   dw as version 5 (over its own grid's partial rows).
//   11 version 10 with each warp's rows taken from a ticket counter as it frees up
//   (kDynamic), so the grid ends evenly: dx is version 1's bits, dw's order of sums varies
//   run to run. Timed on an H100 (fortieth session, over 4,096-65,536 rows): its rows at
//   99% of copy against version 10's 94%, but ~6 us more a call (its first tickets, every
//   warp's atomic on one address at once), so it loses at 1B's 16,384 rows (69.7% against
//   74.9% overwriting) and wins at 65,536.
//   12 version 11 with each warp's first row its grid index and each later ticket
//   requested a step ahead (kTicketAhead). Not yet run.
// QkNormRope (qk_norm_rope_forward and _backward):
//   1 as version 1 of the others. 2 kLite (cos/sin split over the warp: half the sincosf
//   at head_dim 128; 32-bit token index), no prefetch. 3 version 2, forward on the
//   balanced grid, backward with the programmatic dependent finish. 4 version 3 with the
//   forward's register pipeline. 5 version 4 with the backward's x and dy staged.
//   6 the paired-lane kernels (qk_norm_rope_*_pairs_kernel: both halves of a rotate-half
//   pair in one lane, cos/sin from the backend's table; forward on the balanced grid,
//   backward on its own resident grid with the programmatic dependent finish). Not
//   version 1's bits: a row's fp32 sums meet their terms in another order. Where the
//   call has no table covering its positions, version 3.
//   7 version 6, and qk_norm_rope_forward_qk / _backward_qk run q and k in one launch
//   (other versions: the two calls in turn). The same bits as version 6 but dw's sums.
// Lab versions apply to BF16 weights (the model's); F32 weights take version 1.
constexpr int kForwardVersions = 5, kBackwardVersions = 12, kQkVersions = 7;
// Defaults: the fastest of the device runs (cuda/NOTES.md, "Norm kernel versions",
// "Paired lanes" and "q and k in one launch"): forward 4, backward 10, QK 7.
constexpr int kForwardDefault = 4, kBackwardDefault = 10, kQkDefault = 7;
int g_forward_version = kForwardDefault;    // norm_set_kernel_version (timing lab)
int g_backward_version = kBackwardDefault;
int g_qk_version = kQkDefault;
bool g_skip_dw_finish = false;  // norm_lab_skip_dw_finish (timing lab only)
// QK version 7 is version 6's kernels (it changes only how q and k are launched).
int qk_kernels_version() { return g_qk_version == 7 ? 6 : g_qk_version; }

enum class GridRule { Resident, Balanced, OneStep };
int64_t vec_grid(GridRule rule, int64_t steps, int per_sm) {
  const int64_t resident = int64_t(sm_count()) * per_sm;
  if (rule == GridRule::OneStep || steps <= resident) return steps;
  if (rule == GridRule::Resident) return resident;
  return ceil_div(steps, ceil_div(steps, resident));
}

// Resident blocks per SM of a lab kernel (occupancy API), asked once per kernel.
template <class K> int per_sm_cached(K kern) {
  static std::mutex mu;
  static std::unordered_map<const void*, int> cache;
  const void* key = reinterpret_cast<const void*>(kern);
  std::lock_guard<std::mutex> lock(mu);
  auto it = cache.find(key);
  if (it != cache.end()) return it->second;
  const int n = resident_blocks_per_sm(kern, kVecThreads);
  cache.emplace(key, n);
  return n;
}

// Backward versions 5 and 6 (dw in shared memory): the kernel allowed its dynamic shared
// memory, with the largest carveout, once per device; its resident blocks per SM with it.
template <class K> int prepare_dw_shared(K kern, size_t smem) {
  static std::mutex mu;
  static std::map<std::pair<const void*, int>, int> per_sm;  // (kernel, device)
  int dev = 0;
  CUDA_CHECK(cudaGetDevice(&dev));
  std::lock_guard<std::mutex> lock(mu);
  const auto key = std::make_pair(reinterpret_cast<const void*>(kern), dev);
  auto it = per_sm.find(key);
  if (it != per_sm.end()) return it->second;
  CUDA_CHECK(cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
  CUDA_CHECK(cudaFuncSetAttribute(kern, cudaFuncAttributePreferredSharedMemoryCarveout, 100));
  int n = 0;
  CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kern, kVecThreads, smem));
  n = std::max(n, 1);
  per_sm.emplace(key, n);
  return n;
}

// The 32-bit token index of kLite needs row indices (plus a step) below 2^31.
bool lite_rows_fit(int64_t R) { return R < (int64_t(1) << 30); }

// The finish of `count` (1 or 2) weights' partial rows, each D columns.
void launch_dw_finish(cudaStream_t s, bool pdl, const DwFinish& f0, const DwFinish& f1,
                      int count, int D) {
  if (g_skip_dw_finish) return;  // timing only: dw left unfinished
  const dim3 grid(unsigned(ceil_div(D, 32)), unsigned(count)), block(32, kFinishLanes);
  if (!pdl) {
    rmsnorm_dw_finish_kernel<false><<<grid, block, 0, s>>>(f0, f1, D);
    CUDA_CHECK_LAUNCH();
    return;
  }
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = 0;
  cfg.stream = s;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  CUDA_CHECK(cudaLaunchKernelEx(&cfg, rmsnorm_dw_finish_kernel<true>, f0, f1, D));
}
void launch_dw_finish(cudaStream_t s, bool pdl, float* dw, const float* partials, int nblocks,
                      int D) {
  const DwFinish f{dw, partials, nblocks};
  launch_dw_finish(s, pdl, f, f, 1, D);
}

// The vector kernels' launches (plain, with the fused RoPE, or with the residual add in
// front); false when the shape has no vector configuration. Grids by the version's rule
// (version 1: as many blocks as fit on the device at once, at most one row step each).

template <bool kRope, bool kAdd = false>
bool launch_forward_vec(cudaStream_t s, Tensor y, Tensor rstd, Tensor x, Tensor w, int64_t R,
                        int64_t D, double eps, const RopeArgs& ra, const AddArgs& aa = {}) {
  bool launched = false;
  const int version = kRope ? qk_kernels_version() : g_forward_version;
  dispatch_float(w.dtype, "rmsnorm_forward", [&](auto tw) {
    using W = decltype(tw);
    dispatch_row_config(int(D), false, [&](auto cfg) {
      using C = decltype(cfg);
      if constexpr (!kRope || C::VPL == 1) {
        if (kRope && C::TPR * 8 != D) return;
        constexpr int TPR = C::TPR, VPL = C::VPL, RPI = C::RPI, RW = (32 / TPR) * RPI;
        const int64_t steps = ceil_div(R, int64_t(kVecThreads / 32) * RW);
        using Kern = decltype(&rmsnorm_forward_vec_kernel<W, TPR, VPL, RPI, kRope, kAdd>);
        auto go = [&](Kern kern, int per_sm, GridRule rule) {
          const int64_t blocks = vec_grid(rule, steps, per_sm);
          kern<<<unsigned(blocks), kVecThreads, 0, s>>>(
              static_cast<bf16*>(y.data), rstd.ptr<float>(), static_cast<const bf16*>(x.data),
              static_cast<const W*>(w.data), R, int(D), float(eps), ra, aa);
          CUDA_CHECK_LAUNCH();
          launched = true;
        };
        [[maybe_unused]] const bool warp_token = kRope && ra.heads % RW == 0;
        int v = std::is_same_v<W, bf16> ? version : 1;
        if (kRope && !lite_rows_fit(R)) v = 1;
        if (v <= 1) {
          if constexpr (kRope) {
            if (warp_token) {
              auto kern = rmsnorm_forward_vec_kernel<W, TPR, VPL, RPI, true, false, true>;
              static const int per_sm = resident_blocks_per_sm(kern, kVecThreads);
              return go(kern, per_sm, GridRule::Resident);
            }
          }
          auto kern = rmsnorm_forward_vec_kernel<W, TPR, VPL, RPI, kRope, kAdd, false>;
          static const int per_sm = resident_blocks_per_sm(kern, kVecThreads);
          return go(kern, per_sm, GridRule::Resident);
        }
        if constexpr (std::is_same_v<W, bf16>) {
          auto lab = [&](auto opt, auto wt, GridRule rule) {
            auto kern = rmsnorm_forward_vec_kernel<W, TPR, VPL, RPI, kRope, kAdd,
                                                   decltype(wt)::value, decltype(opt)>;
            go(kern, per_sm_cached(kern), rule);
          };
          if constexpr (kRope) {
            auto both = [&](auto opt, GridRule rule) {
              if (warp_token) lab(opt, std::true_type{}, rule);
              else lab(opt, std::false_type{}, rule);
            };
            using Lite = VecOpt<false, false, true>;
            if (v == 2) both(Lite{}, GridRule::Resident);
            else if (v == 3 || v == 6) both(Lite{}, GridRule::Balanced);  // 6: no table here
            else both(VecOpt<false, true, true>{}, GridRule::Balanced);
          } else {
            using Plain = VecOpt<false>;
            constexpr bool kFits = (kAdd ? 2 : 1) * VPL * RPI <= 10;
            using Piped = std::conditional_t<kFits, VecOpt<false, true>, Plain>;
            if (v == 2) lab(Plain{}, std::false_type{}, GridRule::Resident);
            else if (v == 3) lab(Plain{}, std::false_type{}, GridRule::Balanced);
            else if (v == 4) lab(Plain{}, std::false_type{}, GridRule::OneStep);
            else lab(Piped{}, std::false_type{}, GridRule::Balanced);
          }
        }
      }
    });
  });
  return launched;
}

template <bool kRope>
bool launch_backward_vec(cudaStream_t s, Tensor dx, Tensor dw, Tensor dy, Tensor x, Tensor w,
                         Tensor rstd, int64_t R, int64_t D, bool accumulate_dx,
                         const ScratchFn& scratch, const RopeArgs& ra) {
  bool launched = false;
  const int version = kRope ? qk_kernels_version() : g_backward_version;
  dispatch_float(w.dtype, "rmsnorm_backward", [&](auto tw) {
    using W = decltype(tw);
    dispatch_row_config(int(D), true, [&](auto cfg) {
      using C = decltype(cfg);
      // Configurations wider than kVecMaxDBackward are never chosen for the backward.
      if constexpr (C::TPR * C::VPL * 8 <= kVecMaxDBackward && (!kRope || C::VPL == 1)) {
        if (kRope && C::TPR * 8 != D) return;
        constexpr int RPI = C::RPI, RW = (32 / C::TPR) * RPI;
        auto kern = rmsnorm_backward_vec_kernel<W, C::TPR, C::VPL, RPI, kRope, false>;
        auto kern_warp_token = rmsnorm_backward_vec_kernel<W, C::TPR, C::VPL, RPI, kRope, kRope>;
        static const int per_sm_any = resident_blocks_per_sm(kern, kVecThreads);
        static const int per_sm_warp_token = resident_blocks_per_sm(kern_warp_token, kVecThreads);
        const bool warp_token = kRope && ra.heads % RW == 0;
        if (warp_token) kern = kern_warp_token;
        // Version 1's grid for every version (dw's bits depend on it).
        const int per_sm = warp_token ? per_sm_warp_token : per_sm_any;
        const int64_t rb = (kVecThreads / 32) * RW;
        int64_t blocks = std::min<int64_t>(ceil_div(R, rb), int64_t(sm_count()) * per_sm);
        int v = std::is_same_v<W, bf16> ? version : 1;
        if (kRope && !lite_rows_fit(R)) v = 1;
        if (v >= 11 && R + int64_t(sm_count()) * 128 >= (int64_t(1) << 32)) v = 10;  // tickets
        bool pdl = false;
        size_t smem = 0;
        if constexpr (std::is_same_v<W, bf16>) {
          auto pick = [&](auto opt) {
            using Opt = decltype(opt);
            auto k_any = rmsnorm_backward_vec_kernel<W, C::TPR, C::VPL, RPI, kRope, false, Opt>;
            if constexpr (!kRope && Opt::kStaged && kStaged3<C::TPR, C::VPL, RPI>)
              k_any = rmsnorm_backward_vec_kernel3<W, C::TPR, C::VPL, RPI, Opt>;
            auto k_token = rmsnorm_backward_vec_kernel<W, C::TPR, C::VPL, RPI, kRope, kRope, Opt>;
            kern = warp_token ? k_token : k_any;
            pdl = Opt::kPdl;
            if constexpr (Opt::kStaged) {
              smem = staged_bytes<RPI, C::VPL>();
              // Once per device (function attributes are per device) and thread: shared
              // memory for version 1's blocks per SM (up to 3 x 72 KB), so the largest
              // carveout rather than the driver's choice.
              static thread_local int sized_for = -1;
              int dev = 0;
              CUDA_CHECK(cudaGetDevice(&dev));
              if (sized_for != dev) {
                for (auto k : {k_any, k_token}) {
                  CUDA_CHECK(cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                                  int(staged_bytes<RPI, C::VPL>())));
                  CUDA_CHECK(cudaFuncSetAttribute(
                      k, cudaFuncAttributePreferredSharedMemoryCarveout, 100));
                }
                sized_for = dev;
              }
            }
          };
          // Plain: 2, 3, 4 as listed above, 5 and 6 where rows are one warp's (VPL <= 6: at
          // 8, version 5's 3-block bound spills), else 3; QK-norm + RoPE: 2, 3 (and 4,
          // whose change is the forward's), 5, and 3 for 6 (the paired-lane kernels, tried
          // before this, had no table).
          constexpr bool kDwSharedFits = !kRope && C::TPR == 32 && RPI == 1 && C::VPL <= 6;
          const int staged_from = kRope ? 5 : 4;
          if (v == 2) pick(VecOpt<false, false, kRope>{});
          else if (v < staged_from || (kRope && v == 6)) pick(VecOpt<false, false, kRope, true>{});
          else if (kRope || v == 4) pick(VecOpt<false, false, kRope, true, true>{});
          else if constexpr (!kDwSharedFits) pick(VecOpt<false, false, false, true>{});
          else {
            // 5: dw in shared memory, 3 blocks an SM; 6: 5 plus the register pipeline (2
            // blocks); 10: 5 with 4 blocks where VPL is 5-6. Each on its own resident grid,
            // so dw sums other partial rows than version 1's.
            // 11: 10 with rows taken from a ticket counter (kDynamic); 12: 11 with the next
            // ticket requested a step ahead.
            using Opt5 = VecOpt<false, false, false, true, false, true>;
            using Opt6 = VecOpt<false, true, false, true, false, true>;
            using Opt11 = norm_lab::OptDynamicRows;
            using Opt12 = norm_lab::OptDynamicRowsAhead;
            // Versions 10-12 hold 4 blocks an SM where rows are 5-6 vectors a lane.
            auto four_blocks_where_wide = [](auto opt) {
              using O = decltype(opt);
              return C::VPL >= 5 ? rmsnorm_backward_vec_kernel3<W, C::TPR, C::VPL, RPI, O, 4>
                                 : rmsnorm_backward_vec_kernel3<W, C::TPR, C::VPL, RPI, O>;
            };
            kern = v == 6 ? rmsnorm_backward_vec_kernel<W, C::TPR, C::VPL, RPI, false, false, Opt6>
                   : v == 12 ? four_blocks_where_wide(Opt12{})
                   : v == 11 ? four_blocks_where_wide(Opt11{})
                   : v == 10 ? four_blocks_where_wide(Opt5{})
                             : rmsnorm_backward_vec_kernel3<W, C::TPR, C::VPL, RPI, Opt5>;
            pdl = true;
            smem = size_t(kVecThreads / 32) * C::VPL * 2 * 32 * 16;
            blocks = std::min<int64_t>(ceil_div(R, rb),
                                       int64_t(sm_count()) * prepare_dw_shared(kern, smem));
          }
        }
        auto* partials = static_cast<float*>(
            scratch(ScratchSlot::NormPartials, size_t(blocks) * size_t(D) * sizeof(float)));
        kern<<<unsigned(blocks), kVecThreads, smem, s>>>(
            static_cast<bf16*>(dx.data), partials, static_cast<const bf16*>(dy.data),
            static_cast<const bf16*>(x.data), static_cast<const W*>(w.data), rstd.ptr<float>(),
            R, int(D), accumulate_dx, ra);
        CUDA_CHECK_LAUNCH();
        launch_dw_finish(s, pdl, dw.ptr<float>(), partials, int(blocks), int(D));
        launched = true;
      }
    });
  });
  return launched;
}

// Version 6 (the paired-lane kernels) where it applies: BF16 weights, head_dim 64, 128 or
// 256, row indices in 32 bits, and a table of this head_dim covering every position of
// the call. f(integral_constant<TPR>, RopeTableArgs) launches; false: not taken.
template <class F>
bool with_pairs(const Tensor& w, int64_t R, int64_t D, const RopeArgs& ra, const RopeTable& table,
                F&& f) {
  if (qk_kernels_version() != 6 || w.dtype != DType::BF16 || !lite_rows_fit(R) || !table.data ||
      table.head_dim != D || ra.first_position < 0 ||
      ra.first_position + ra.T_len > table.positions)
    return false;
  RopeTableArgs rt;
  rt.table = table.data;
  rt.T_len = ra.T_len;
  rt.first_position = ra.first_position;
  rt.heads = ra.heads;
  if (D == 64) f(std::integral_constant<int, 8>{}, rt);
  else if (D == 128) f(std::integral_constant<int, 16>{}, rt);
  else if (D == 256) f(std::integral_constant<int, 32>{}, rt);
  else return false;
  return true;
}

std::atomic<int64_t> g_qk_pair_launches{0};  // qk_pair_launches()

// Calls f(bool_constant<kWarpToken>, bool_constant<kTwo>) for a paired-lane launch of
// `count` tensors: kWarpToken where every tensor's heads are a multiple of a warp's rows.
template <int RW, class F>
void with_pair_variant(const PairRows (&rows)[2], int count, F&& f) {
  bool warp_token = true;
  for (int i = 0; i < count; ++i) warp_token = warp_token && rows[i].heads % RW == 0;
  using Yes = std::true_type;
  using No = std::false_type;
  if (count == 2) {
    if (warp_token) f(Yes{}, Yes{});
    else f(No{}, Yes{});
  } else if (warp_token) {
    f(Yes{}, No{});
  } else {
    f(No{}, No{});
  }
}

// The paired-lane kernels over `count` tensors (1, or 2: q and k of a layer, the same
// head_dim, positions and weight dtype) in one launch; rows[i].blocks is set here. The
// forward's grid is the balanced rule over both tensors' steps; the backward's the
// resident blocks, shared in proportion to the rows.
bool launch_forward_pairs(cudaStream_t s, PairRows (&rows)[2], int count, const Tensor& w,
                          int64_t D, double eps, const RopeArgs& ra, const RopeTable& table) {
  const int64_t R_max = count == 2 ? std::max(rows[0].R, rows[1].R) : rows[0].R;
  return with_pairs(w, R_max, D, ra, table, [&](auto tpr, const RopeTableArgs& rt) {
    constexpr int TPR = decltype(tpr)::value, RW = (32 / TPR) * kPairRpi;
    constexpr int64_t RB = int64_t(kVecThreads / 32) * RW;
    auto go = [&](auto kern) {
      const int64_t resident = int64_t(sm_count()) * per_sm_cached(kern);
      int64_t steps[2] = {ceil_div(rows[0].R, RB), count == 2 ? ceil_div(rows[1].R, RB) : 0};
      const int64_t total = steps[0] + steps[1];
      const int64_t per_block = total <= resident ? 1 : ceil_div(total, resident);
      int64_t grid = 0;
      for (int i = 0; i < count; ++i) {
        rows[i].blocks = int(ceil_div(steps[i], per_block));
        grid += rows[i].blocks;
      }
      kern<<<unsigned(grid), kVecThreads, 0, s>>>(rows[0], rows[count - 1], float(eps), rt);
      CUDA_CHECK_LAUNCH();
      if (count == 2) ++g_qk_pair_launches;
    };
    with_pair_variant<RW>(rows, count, [&](auto token, auto two) {
      go(qk_norm_rope_forward_pairs_kernel<TPR, decltype(token)::value, decltype(two)::value>);
    });
  });
}

bool launch_backward_pairs(cudaStream_t s, PairRows (&rows)[2], DwFinish (&dw)[2], int count,
                           const Tensor& w, int64_t D, bool accumulate_dx,
                           const ScratchFn& scratch, const RopeArgs& ra, const RopeTable& table) {
  const int64_t R_max = count == 2 ? std::max(rows[0].R, rows[1].R) : rows[0].R;
  return with_pairs(w, R_max, D, ra, table, [&](auto tpr, const RopeTableArgs& rt) {
    constexpr int TPR = decltype(tpr)::value, RW = (32 / TPR) * kPairRpi;
    constexpr int64_t RB = int64_t(kVecThreads / 32) * RW;
    auto go = [&](auto kern) {
      const int64_t resident = int64_t(sm_count()) * per_sm_cached(kern);
      int64_t share[2] = {resident, 0};
      if (count == 2) {
        share[0] = std::max<int64_t>(1, resident * rows[0].R / (rows[0].R + rows[1].R));
        share[1] = std::max<int64_t>(1, resident - share[0]);
      }
      int64_t total = 0;
      for (int i = 0; i < count; ++i) {
        rows[i].blocks = int(std::min(ceil_div(rows[i].R, RB), share[i]));
        total += rows[i].blocks;
      }
      auto* partials = static_cast<float*>(
          scratch(ScratchSlot::NormPartials, size_t(total) * size_t(D) * sizeof(float)));
      for (int i = 0, first = 0; i < count; first += rows[i].blocks, ++i) {
        rows[i].partials = partials + int64_t(first) * D;
        dw[i].partials = rows[i].partials;
        dw[i].nblocks = rows[i].blocks;
      }
      kern<<<unsigned(total), kVecThreads, 0, s>>>(rows[0], rows[count - 1], accumulate_dx, rt);
      CUDA_CHECK_LAUNCH();
      if (count == 2) ++g_qk_pair_launches;
      launch_dw_finish(s, true, dw[0], dw[count - 1], count, int(D));
    };
    with_pair_variant<RW>(rows, count, [&](auto token, auto two) {
      go(qk_norm_rope_backward_pairs_kernel<TPR, decltype(token)::value, decltype(two)::value>);
    });
  });
}
PairRows forward_rows(Tensor y, Tensor rstd, Tensor x, Tensor w, int64_t R, int heads) {
  PairRows r;
  r.out = static_cast<bf16*>(y.data);
  r.rstd = rstd.ptr<float>();
  r.x = static_cast<const bf16*>(x.data);
  r.w = static_cast<const bf16*>(w.data);
  r.R = R;
  r.heads = heads;
  return r;
}
PairRows backward_rows(Tensor dx, Tensor dy, Tensor x, Tensor w, Tensor rstd, int64_t R,
                       int heads) {
  PairRows r = forward_rows(dx, rstd, x, w, R, heads);
  r.dy = static_cast<const bf16*>(dy.data);
  return r;
}

void check_forward(const char* what, Tensor y, Tensor rstd, Tensor x, int64_t R, int64_t D) {
  check_numel(x, R * D, what, "x");
  check_numel(y, R * D, what, "y");
  check_numel(rstd, R, what, "rstd");
  check_dtype(rstd, DType::F32, what, "rstd");
  check_dtype(y, x.dtype, what, "y");
}
void check_backward(const char* what, Tensor dx, Tensor dw, Tensor dy, Tensor x, Tensor rstd,
                    int64_t R, int64_t D) {
  check_numel(x, R * D, what, "x");
  check_numel(dx, R * D, what, "dx");
  check_numel(dy, R * D, what, "dy");
  check_numel(dw, D, what, "dw");
  check_numel(rstd, R, what, "rstd");
  check_dtype(rstd, DType::F32, what, "rstd");
  check_dtype(dw, DType::F32, what, "dw");
  check_dtype(dx, x.dtype, what, "dx");
  check_dtype(dy, x.dtype, what, "dy");
}

// x [B, T, heads, head_dim] -> the fused kernels' RoPE arguments; whether the fused path
// applies (head_dim 64, 128 or 256: one vector per lane).
RopeArgs rope_args(const char* what, Tensor x, double theta, bool backward,
                   int64_t first_position) {
  MHAR_CHECK(x.ndim == 4, what, " wants [B, T, heads, head_dim], got ", x.shape_str());
  RopeArgs ra;
  ra.T_len = x.dim(1);
  ra.heads = int(x.dim(2));
  ra.first_position = first_position;
  ra.base = std::pow(theta, -2.0 / double(x.dim(3)));
  ra.backward = backward;
  return ra;
}
bool fused_rope_shape(int64_t D) { return D == 64 || D == 128 || D == 256; }
// The backend's cos/sin table where it was filled for this theta; else none (the kernels
// then compute cos/sin themselves).
RopeTable table_for(const RopeTable& table, double theta) {
  return table.theta == theta ? table : RopeTable{};
}

// Backward versions 7-9 (norm_backward_ring.cu); version 9 where it does not apply (D >
// 1536) runs version 7.
bool ring_backward(cudaStream_t s, int version, bf16* dx, float* dw, const bf16* dy,
                   const bf16* x, const bf16* w, const float* rstd, int64_t R, int D,
                   bool accumulate, const ScratchFn& scratch) {
  if (version == 9 &&
      rmsnorm_backward_ring(s, 1, true, dx, dw, dy, x, w, rstd, R, D, accumulate, scratch))
    return true;
  return rmsnorm_backward_ring(s, version == 8 ? 2 : 1, false, dx, dw, dy, x, w, rstd, R, D,
                               accumulate, scratch);
}

// The scalar path's dw slabs: about 8 blocks an SM in all (grid_stride_blocks' cap), so
// that the slab kernel fills the GPU and its partial rows stay few.
int64_t scalar_dw_max_slabs(int64_t D) {
  return std::max<int64_t>(1, ceil_div(int64_t(sm_count()) * 8, ceil_div(D, 32)));
}
int64_t scalar_dw_rows_per_slab(int64_t R, int64_t D) {
  const int64_t want = ceil_div(int64_t(grid_stride_blocks(R * D, 256)), ceil_div(D, 32));
  return ceil_div(R, std::clamp<int64_t>(want, 1, std::min(R, scalar_dw_max_slabs(D))));
}

}  // namespace

size_t rmsnorm_backward_scratch_bytes(int64_t D) {
  if (D <= 0) return 0;
  // The scalar path's slabs: at most its grid's cap over its column blocks.
  const size_t scalar = size_t(scalar_dw_max_slabs(D)) * size_t(D) * sizeof(float);
  if (D % 8 != 0 || D > kVecMaxDBackward) return scalar;
  // launch_backward_vec's grid: at most sm_count() x its kernel's resident blocks per SM,
  // and an SM holds no more kVecThreads-thread blocks than its thread limit allows.
  static const int per_sm = [] {
    int dev = 0, threads = 0;
    CUDA_CHECK(cudaGetDevice(&dev));
    CUDA_CHECK(cudaDeviceGetAttribute(&threads, cudaDevAttrMaxThreadsPerMultiProcessor, dev));
    return std::max(1, threads / kVecThreads);
  }();
  return std::max(scalar, size_t(sm_count()) * size_t(per_sm) * size_t(D) * sizeof(float));
}

void rmsnorm_forward(cudaStream_t s, Tensor y, Tensor rstd, Tensor x, Tensor w, double eps) {
  const int64_t D = w.numel(), R = x.numel() / D;
  check_forward("rmsnorm_forward", y, rstd, x, R, D);
  if (R == 0) return;
  if (vector_path(x.dtype, D, kVecMaxD, {x.data, y.data, w.data}) &&
      launch_forward_vec<false>(s, y, rstd, x, w, R, D, eps, RopeArgs{}))
    return;
  dispatch_float(x.dtype, "rmsnorm_forward", [&](auto tx) {
    dispatch_float(w.dtype, "rmsnorm_forward", [&](auto tw) {
      using T = decltype(tx);
      using W = decltype(tw);
      rmsnorm_forward_kernel<T, W><<<ceil_div(R, kWarpsPerBlock), 32 * kWarpsPerBlock, 0, s>>>(
          static_cast<T*>(y.data), rstd.ptr<float>(), static_cast<const T*>(x.data),
          static_cast<const W*>(w.data), R, D, float(eps));
      CUDA_CHECK_LAUNCH();
    });
  });
}

bool rmsnorm_forward_row_fusable(Tensor y, Tensor rstd, Tensor x, Tensor w) {
  const int64_t D = w.numel(), R = D > 0 ? x.numel() / D : 0;
  check_forward("rmsnorm_forward", y, rstd, x, R, D);
  return w.dtype == DType::BF16 && y.data != x.data &&
         vector_path(x.dtype, D, kVecMaxD, {x.data, y.data, w.data}) &&
         dispatch_row_config(int(D), false, [](auto) {});
}

void add_rmsnorm_forward(cudaStream_t s, Tensor x, Tensor y, Tensor rstd, Tensor a, Tensor b,
                         Tensor w, double eps) {
  const int64_t D = w.numel(), R = D > 0 ? x.numel() / D : 0;
  check_forward("add_rmsnorm_forward", y, rstd, x, R, D);
  check_numel(a, R * D, "add_rmsnorm_forward", "a");
  check_numel(b, R * D, "add_rmsnorm_forward", "b");
  MHAR_CHECK(y.data != x.data && y.data != a.data && y.data != b.data,
             "add_rmsnorm_forward: y must not be x, a or b");
  if (R == 0) return;
  if (a.dtype == DType::BF16 && b.dtype == DType::BF16 &&
      vector_path(x.dtype, D, kVecMaxD, {x.data, y.data, w.data, a.data, b.data})) {
    AddArgs aa;
    aa.x = static_cast<bf16*>(x.data);
    aa.a = static_cast<const bf16*>(a.data);
    aa.b = static_cast<const bf16*>(b.data);
    if (launch_forward_vec<false, true>(s, y, rstd, x, w, R, D, eps, RopeArgs{}, aa)) return;
  }
  add(s, x, a, b);
  rmsnorm_forward(s, y, rstd, x, w, eps);
}

void rmsnorm_backward(cudaStream_t s, Tensor dx, Tensor dw, Tensor dy, Tensor x, Tensor w,
                      Tensor rstd, bool accumulate_dx, const ScratchFn& scratch) {
  const int64_t D = w.numel(), R = x.numel() / D;
  check_backward("rmsnorm_backward", dx, dw, dy, x, rstd, R, D);
  if (R == 0) return;
  const bool vec = vector_path(x.dtype, D, kVecMaxDBackward, {x.data, dx.data, dy.data, w.data});
  if (vec && g_backward_version >= 7 && g_backward_version <= 9 && w.dtype == DType::BF16 &&
      ring_backward(s, g_backward_version, static_cast<bf16*>(dx.data), dw.ptr<float>(),
                    static_cast<const bf16*>(dy.data), static_cast<const bf16*>(x.data),
                    static_cast<const bf16*>(w.data), rstd.ptr<float>(), R, int(D), accumulate_dx,
                    scratch))
    return;
  if (vec && launch_backward_vec<false>(s, dx, dw, dy, x, w, rstd, R, D, accumulate_dx, scratch,
                                 RopeArgs{}))
    return;
  dispatch_float(x.dtype, "rmsnorm_backward", [&](auto tx) {
    dispatch_float(w.dtype, "rmsnorm_backward", [&](auto tw) {
      using T = decltype(tx);
      using W = decltype(tw);
      rmsnorm_backward_dx_kernel<T, W>
          <<<ceil_div(R, kWarpsPerBlock), 32 * kWarpsPerBlock, 0, s>>>(
              static_cast<T*>(dx.data), static_cast<const T*>(dy.data),
              static_cast<const T*>(x.data), static_cast<const W*>(w.data), rstd.ptr<float>(),
              R, D, accumulate_dx);
      CUDA_CHECK_LAUNCH();
    });
    using T = decltype(tx);
    const int64_t rows_per_block = scalar_dw_rows_per_slab(R, D);
    const int64_t slabs = ceil_div(R, rows_per_block);
    auto* partials = static_cast<float*>(
        scratch(ScratchSlot::NormPartials, size_t(slabs) * size_t(D) * sizeof(float)));
    dim3 grid(unsigned(ceil_div(D, 32)), unsigned(slabs));
    rmsnorm_backward_dw_kernel<T><<<grid, dim3(32, 8), 0, s>>>(
        partials, static_cast<const T*>(dy.data), static_cast<const T*>(x.data), rstd.ptr<float>(),
        R, D, rows_per_block);
    CUDA_CHECK_LAUNCH();
    launch_dw_finish(s, false, dw.ptr<float>(), partials, int(slabs), int(D));
  });
}

}  // namespace mhar::cuda

namespace mhar::cuda {

void qk_norm_rope_forward(cudaStream_t s, Tensor y, Tensor rstd, Tensor x, Tensor w, double eps,
                          double theta, int64_t first_position, const RopeTable& table) {
  const int64_t D = w.numel(), R = x.numel() / D;
  const RopeArgs ra = rope_args("qk_norm_rope_forward", y, theta, false, first_position);
  MHAR_CHECK(y.dim(3) == D, "qk_norm_rope_forward: head_dim ", y.dim(3), " but weight ", D);
  check_forward("qk_norm_rope_forward", y, rstd, x, R, D);
  if (R == 0) return;
  PairRows single_rows[2] = {forward_rows(y, rstd, x, w, R, ra.heads)};
  if (fused_rope_shape(D) && vector_path(x.dtype, D, kVecMaxD, {x.data, y.data, w.data}) &&
      (launch_forward_pairs(s, single_rows, 1, w, D, eps, ra, table_for(table, theta)) ||
       launch_forward_vec<true>(s, y, rstd, x, w, R, D, eps, ra)))
    return;
  rmsnorm_forward(s, y, rstd, x, w, eps);
  rope(s, y, theta, false, first_position);
}

void qk_norm_rope_backward(cudaStream_t s, Tensor dx, Tensor dw, Tensor dy, Tensor x, Tensor w,
                           Tensor rstd, double theta, bool accumulate_dx, const ScratchFn& scratch,
                           const RopeTable& table) {
  const int64_t D = w.numel(), R = x.numel() / D;
  const RopeArgs ra = rope_args("qk_norm_rope_backward", dy, theta, true, 0);
  MHAR_CHECK(dy.dim(3) == D, "qk_norm_rope_backward: head_dim ", dy.dim(3), " but weight ", D);
  check_backward("qk_norm_rope_backward", dx, dw, dy, x, rstd, R, D);
  if (R == 0) return;
  PairRows single_rows[2] = {backward_rows(dx, dy, x, w, rstd, R, ra.heads)};
  DwFinish single_dw[2] = {DwFinish{dw.ptr<float>(), nullptr, 0}};
  if (fused_rope_shape(D) &&
      vector_path(x.dtype, D, kVecMaxDBackward, {x.data, dx.data, dy.data, w.data}) &&
      (launch_backward_pairs(s, single_rows, single_dw, 1, w, D, accumulate_dx, scratch, ra,
                             table_for(table, theta)) ||
       launch_backward_vec<true>(s, dx, dw, dy, x, w, rstd, R, D, accumulate_dx, scratch, ra)))
    return;
  rope(s, dy, theta, true);
  rmsnorm_backward(s, dx, dw, dy, x, w, rstd, accumulate_dx, scratch);
}

namespace {
// Whether q and k may take one paired-lane launch (QK version 7): one head_dim the fused
// kernels take, one weight dtype, both [B, T, heads, head_dim] with the same T. The launch
// checks the rest (alignment, table, row counts) and the two calls run where it declines.
bool qk_pair_applies(const Tensor& wq, const Tensor& wk, const Tensor& tq, const Tensor& tk) {
  const int64_t D = wq.numel();
  return g_qk_version == 7 && fused_rope_shape(D) && wk.numel() == D && wq.dtype == wk.dtype &&
         tq.ndim == 4 && tk.ndim == 4 && tq.dim(1) == tk.dim(1) && tq.dim(3) == D &&
         tk.dim(3) == D;
}
}  // namespace

void qk_norm_rope_forward_qk(cudaStream_t s, const QkNormRopeOperands& q,
                             const QkNormRopeOperands& k, double eps, double theta,
                             int64_t first_position, const RopeTable& table) {
  const int64_t D = q.w.numel();
  if (qk_pair_applies(q.w, k.w, q.y, k.y)) {
    const int64_t Rq = q.x.numel() / D, Rk = k.x.numel() / D;
    const RopeArgs rq = rope_args("qk_norm_rope_forward_qk", q.y, theta, false, first_position);
    const RopeArgs rk = rope_args("qk_norm_rope_forward_qk", k.y, theta, false, first_position);
    check_forward("qk_norm_rope_forward_qk (q)", q.y, q.rstd, q.x, Rq, D);
    check_forward("qk_norm_rope_forward_qk (k)", k.y, k.rstd, k.x, Rk, D);
    PairRows rows[2] = {forward_rows(q.y, q.rstd, q.x, q.w, Rq, rq.heads),
                        forward_rows(k.y, k.rstd, k.x, k.w, Rk, rk.heads)};
    if (Rq > 0 && Rk > 0 && vector_path(q.x.dtype, D, kVecMaxD, {q.x.data, q.y.data, q.w.data}) &&
        vector_path(k.x.dtype, D, kVecMaxD, {k.x.data, k.y.data, k.w.data}) &&
        launch_forward_pairs(s, rows, 2, q.w, D, eps, rq, table_for(table, theta)))
      return;
  }
  qk_norm_rope_forward(s, q.y, q.rstd, q.x, q.w, eps, theta, first_position, table);
  qk_norm_rope_forward(s, k.y, k.rstd, k.x, k.w, eps, theta, first_position, table);
}

void qk_norm_rope_backward_qk(cudaStream_t s, const QkNormRopeGradOperands& q,
                              const QkNormRopeGradOperands& k, double theta, bool accumulate_dx,
                              const ScratchFn& scratch, const RopeTable& table) {
  const int64_t D = q.w.numel();
  if (qk_pair_applies(q.w, k.w, q.dy, k.dy)) {
    const int64_t Rq = q.x.numel() / D, Rk = k.x.numel() / D;
    const RopeArgs rq = rope_args("qk_norm_rope_backward_qk", q.dy, theta, true, 0);
    const RopeArgs rk = rope_args("qk_norm_rope_backward_qk", k.dy, theta, true, 0);
    check_backward("qk_norm_rope_backward_qk (q)", q.dx, q.dw, q.dy, q.x, q.rstd, Rq, D);
    check_backward("qk_norm_rope_backward_qk (k)", k.dx, k.dw, k.dy, k.x, k.rstd, Rk, D);
    PairRows rows[2] = {backward_rows(q.dx, q.dy, q.x, q.w, q.rstd, Rq, rq.heads),
                        backward_rows(k.dx, k.dy, k.x, k.w, k.rstd, Rk, rk.heads)};
    DwFinish dw[2] = {DwFinish{q.dw.ptr<float>(), nullptr, 0},
                      DwFinish{k.dw.ptr<float>(), nullptr, 0}};
    if (Rq > 0 && Rk > 0 &&
        vector_path(q.x.dtype, D, kVecMaxDBackward, {q.x.data, q.dx.data, q.dy.data, q.w.data}) &&
        vector_path(k.x.dtype, D, kVecMaxDBackward, {k.x.data, k.dx.data, k.dy.data, k.w.data}) &&
        launch_backward_pairs(s, rows, dw, 2, q.w, D, accumulate_dx, scratch, rq,
                              table_for(table, theta)))
      return;
  }
  qk_norm_rope_backward(s, q.dx, q.dw, q.dy, q.x, q.w, q.rstd, theta, accumulate_dx, scratch,
                        table);
  qk_norm_rope_backward(s, k.dx, k.dw, k.dy, k.x, k.w, k.rstd, theta, accumulate_dx, scratch,
                        table);
}

}  // namespace mhar::cuda

namespace mhar::cuda {

size_t rope_table_bytes(int64_t head_dim, int64_t positions) {
  if (!fused_rope_shape(head_dim) || positions <= 0) return 0;
  return size_t(positions) * size_t(head_dim) * sizeof(float);  // cos and sin of D/2 pairs
}

RopeTable rope_table_fill(cudaStream_t s, void* table, double theta, int64_t head_dim,
                          int64_t positions) {
  MHAR_CHECK(rope_table_bytes(head_dim, positions) > 0, "rope_table_fill: head_dim ", head_dim,
             " (64, 128 or 256) and positions ", positions, " (> 0)");
  MHAR_CHECK(theta > 0, "rope_table_fill: theta ", theta, " (> 0)");
  const int half = int(head_dim / 2);
  const double base = std::pow(theta, -2.0 / double(head_dim));  // as rope_args
  const int64_t n = positions * half;
  rope_table_kernel<<<unsigned(ceil_div(n, int64_t(256))), 256, 0, s>>>(static_cast<float*>(table),
                                                                      base, half, positions);
  CUDA_CHECK_LAUNCH();
  RopeTable t;
  t.data = static_cast<const float*>(table);
  t.head_dim = head_dim;
  t.positions = positions;
  t.theta = theta;
  return t;
}

int64_t qk_pair_launches() { return g_qk_pair_launches.load(); }

int norm_kernel_versions(NormKernel kernel) {
  switch (kernel) {
    case NormKernel::Forward: return kForwardVersions;
    case NormKernel::Backward: return kBackwardVersions;
    case NormKernel::QkNormRope: return kQkVersions;
  }
  return 1;
}

bool norm_lab_skip_dw_finish(bool skip) { return std::exchange(g_skip_dw_finish, skip); }

int norm_set_kernel_version(NormKernel kernel, int version) {
  const int versions = norm_kernel_versions(kernel);
  MHAR_CHECK(version <= versions, "norm_set_kernel_version: version ", version,
             " of a kernel with versions 1 .. ", versions, " (<= 0: the default)");
  int& v = kernel == NormKernel::Forward    ? g_forward_version
           : kernel == NormKernel::Backward ? g_backward_version
                                            : g_qk_version;
  const int defaults = kernel == NormKernel::Forward    ? kForwardDefault
                       : kernel == NormKernel::Backward ? kBackwardDefault
                                                        : kQkDefault;
  const int before = v;
  v = version > 0 ? version : defaults;
  return before;
}

}  // namespace mhar::cuda
