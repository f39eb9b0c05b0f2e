// routing_pair_mma.cu: the backward depth tile's pass over its site gradients on tensor
// cores (pair version 12 in routing.cu's lab numbering; routing_pair_mma.h states what it
// computes). Why: the CUDA-core pair kernels issue ~270 instructions a site row and token
// (cuda/NOTES.md, "Where 100M's routing kernels stand"): two dot products a head and two
// weighted sums per element, each a chain of FMAs and shuffles. Per token and head the
// same work is two small products,
//   U [16 sites x 8 columns] = DX [16 sites x dh] . [v0 v1 x 0 ...]^T [dh x 8]
//   VAL [16 channels x 8] += DX^T [16 channels x 16 sites] . [a0 a1 0 ...] [16 sites x 8],
// which mma.m16n8k16 runs in a few instructions; of the 8 columns two are the slots and
// one (U's third, site `source` only) gives ubar. The rest of the columns are zeros: the
// tensor cores have the time to spare, the issue slots do not.
// - Block: one warp a head (H warps), all on one token at a time; the work is a stream of
//   items (token, chunk of 16 sites), each staged in shared memory by cp.async two items
//   ahead of the one computed (3 stages): the chunk's 16 site rows (zero-filled past the
//   last site), the chunk's scalars a0, a1, ubar [3][H][16] (zero-filled likewise), and
//   with a token's first chunk its rows v0, v1, x and inv_rms of both slots (3 buffers by
//   token, so a token's rows outlive the items after it that are in flight).
// - Tokens: a block takes runs of 8 consecutive tokens (a grid of one wave strides over
//   the runs), so that the 4-byte scalars of [pair][head][token] rows share sectors.
// - Shared layout of the site rows: [16][d] bf16, 16-byte chunk c of row r stored at
//   chunk c ^ (r & 7), so that the 8 rows of each ldmatrix matrix (same chunk, rows 8 apart
//   at most) fall in 8 bank groups, for the plain (U's A) and the transposing (VAL's A)
//   loads alike. Token rows [3][d + 8] (the pad spreads the B loads of v0, v1, x).
// - Numerics: dx, v, x are bf16 already, so U's products are exact, summed in fp32 by
//   the mma; the weights a (fp32) enter VAL as bf16 hi + lo parts, two mmas (to ~2^-16
//   relative, as the key-gradient kernels' ds r). ds = a (u - ubar) in fp32 as the
//   CUDA-core kernels. The sums run in another order than those kernels', so the bits
//   differ from them, within the CPU reference's bounds (routing_backward_sum_order).
#include <algorithm>

#include "cuda/attention_mma.cuh"
#include "cuda/routing_pair_mma.h"

namespace mhar::cuda {
namespace {

using attn_mma::cp_async16;
using attn_mma::cp_async_commit;
using attn_mma::cp_async_wait;
using attn_mma::ldmatrix_x4;
using attn_mma::ldmatrix_x4_trans;
using attn_mma::mma;

constexpr int kSites = 16;    // an item's sites: one m16 tile
constexpr int kStages = 3;    // the item computed and two in flight
constexpr int kTokenRun = 8;  // consecutive tokens a block takes (a sector of fp32 scalars)

template <int H, int DH>
struct Shape {
  static constexpr int kD = H * DH;
  static constexpr int kChunks = kD / 8;  // 16-byte chunks of a row
  static constexpr int kThreads = 32 * H;
  static constexpr int kTokenStride = kD + 8;
  static constexpr int kRowElems = kSites * kD;         // a stage's site rows
  static constexpr int kTokenElems = 3 * kTokenStride;  // v0, v1, x
  static constexpr int kScalars = 3 * H * kSites;       // a0, a1, ubar: [3][H][16]
  static constexpr size_t kSmem =
      size_t(kStages) * (2 * (kRowElems + kTokenElems) + 4 * (kScalars + 2));
  static_assert(kChunks % 8 == 0, "whole swizzle groups of 8 chunks a row");
  static_assert(DH % 16 == 0, "a head is whole k16 steps and m16 tiles");
};

// 4 bytes global -> shared, zero-filled when !valid (src then never read).
__device__ __forceinline__ void cp_async4(void* dst, const void* src, bool valid) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(smem_addr(dst)), "l"(src),
               "r"(valid ? 4 : 0));
#else
  __trap();
#endif
}

__device__ __forceinline__ int64_t run_token(int j) {
  return (int64_t(blockIdx.x) + int64_t(j / kTokenRun) * gridDim.x) * kTokenRun + j % kTokenRun;
}

template <int H, int DH>
__global__ void __launch_bounds__(32 * H) pair_mma_kernel(const PairMmaArgs a) {
  using S = Shape<H, DH>;
  constexpr int kD = S::kD, kChunks = S::kChunks, kThreads = S::kThreads;
  extern __shared__ __align__(16) unsigned char pair_mma_smem[];
  bf16* const rows_st = reinterpret_cast<bf16*>(pair_mma_smem);
  bf16* const tok_st = rows_st + kStages * S::kRowElems;
  float* const scal_st = reinterpret_cast<float*>(tok_st + kStages * S::kTokenElems);
  float* const rms_st = scal_st + kStages * S::kScalars;

  const int64_t N = a.N, HN = int64_t(H) * N;
  const int ns = a.ns, chunks = (ns + kSites - 1) / kSites;

  // Stages item `it` (token run index j = it / chunks, chunk c) into its buffers.
  auto issue = [&](int it) {
    const int j = it / chunks, c = it - j * chunks;
    const int64_t n = run_token(j);
    if (n >= N) return;
    bf16* rows = rows_st + (it % kStages) * S::kRowElems;
    for (int idx = threadIdx.x; idx < kSites * kChunks; idx += kThreads) {
      const int r = idx / kChunks, ch = idx - r * kChunks, i = c * kSites + r;
      const bool valid = i < ns;
      const bf16* src = valid ? a.dx[i] + n * kD + ch * 8 : a.x;
      cp_async16(rows + r * kD + ((ch ^ (r & 7)) << 3), src, valid);
    }
    float* scal = scal_st + (it % kStages) * S::kScalars;
    for (int idx = threadIdx.x; idx < S::kScalars; idx += kThreads) {
      const int kind = idx / (H * kSites), h = (idx / kSites) % H, r = idx % kSites;
      const int i = c * kSites + r;
      // ubar of site `source` (i = 0) is the kernel's own output: zero here.
      const bool valid = i < ns && !(kind == 2 && i == 0);
      const float* base = kind == 0 ? a.w0 : kind == 1 ? a.w1 : a.ubar_source;
      const float* src = base + int64_t(i) * HN + int64_t(h) * N + n;
      cp_async4(scal + idx, valid ? src : a.w0, valid);
    }
    if (c == 0) {
      bf16* tok = tok_st + (j % kStages) * S::kTokenElems;
      for (int idx = threadIdx.x; idx < 3 * kChunks; idx += kThreads) {
        const int q = idx / kChunks, ch = idx - q * kChunks;
        const bf16* src = q == 0 ? a.v0 : q == 1 ? a.v1 : a.x;
        cp_async16(tok + q * S::kTokenStride + ch * 8, src + n * kD + ch * 8, true);
      }
      if (threadIdx.x < 2)
        cp_async4(rms_st + (j % kStages) * 2 + threadIdx.x,
                  (threadIdx.x == 0 ? a.inv_rms0 : a.inv_rms1) + n, true);
    }
  };

  const int lane = threadIdx.x & 31, h = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
  float acc[DH / 16][4];  // VAL: channels h DH + 16 mt + (g, g + 8) x columns (2t, 2t + 1)

  issue(0);
  cp_async_commit();
  issue(1);
  cp_async_commit();
  for (int it = 0;; ++it) {
    const int j = it / chunks, c = it - j * chunks;
    const int64_t n = run_token(j);
    if (n >= N) break;
    cp_async_wait<1>();  // item it landed (item it + 1 may still be in flight)
    __syncthreads();     // every thread's copies of it; and item it - 1 read out by all
    issue(it + 2);
    cp_async_commit();

    const bf16* rows = rows_st + (it % kStages) * S::kRowElems;
    const bf16* tok = tok_st + (j % kStages) * S::kTokenElems;
    const float* scal = scal_st + (it % kStages) * S::kScalars;
    const float* a0 = scal + h * kSites;
    const float* a1 = scal + (H + h) * kSites;
    const float* ub = scal + (2 * H + h) * kSites;
    if (c == 0) {
#pragma unroll
      for (int mt = 0; mt < DH / 16; ++mt) acc[mt][0] = acc[mt][1] = acc[mt][2] = acc[mt][3] = 0.f;
    }

    // U: lane (g, t) ends with sites g, g + 8 x columns 2t, 2t + 1 (0: v0, 1: v1, 2: x).
    float u[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
    for (int ks = 0; ks < DH / 16; ++ks) {
      const int r = lane & 15, chunk = h * (DH / 8) + 2 * ks + (lane >> 4);
      uint32_t A[4];
      ldmatrix_x4(A, rows + r * kD + ((chunk ^ (r & 7)) << 3));
      uint32_t b0 = 0, b1 = 0;
      if (g < 3) {
        const bf16* p = tok + g * S::kTokenStride + h * DH + 16 * ks + 2 * t;
        b0 = *reinterpret_cast<const uint32_t*>(p);
        b1 = *reinterpret_cast<const uint32_t*>(p + 8);
      }
      mma(u, A, b0, b1);
    }
    // Site `source`'s ubar: column 2 of site 0, held by lane 1 (g 0, t 1).
    const float ux = __shfl_sync(0xffffffffu, u[0], 1);
    if (t == 0) {
      const float r0 = rms_st[(j % kStages) * 2], r1 = rms_st[(j % kStages) * 2 + 1];
      const int iA = c * kSites + g, iB = iA + 8;
      const float ubA = iA == 0 ? ux : ub[g];
      float* w0 = a.w0 + int64_t(h) * N + n;
      float* w1 = a.w1 + int64_t(h) * N + n;
      if (iA < ns) {
        w0[iA * HN] = a0[g] * (u[0] - ubA) * r0;
        w1[iA * HN] = a1[g] * (u[1] - ubA) * r1;
      }
      if (iB < ns) {
        const float ubB = ub[g + 8];
        w0[iB * HN] = a0[g + 8] * (u[2] - ubB) * r0;
        w1[iB * HN] = a1[g + 8] * (u[3] - ubB) * r1;
      }
      if (iA == 0) a.ubar_source[int64_t(h) * N + n] = ux;
    }

    // VAL's B: column g < 2 is slot g's weights at the item's sites 2t, 2t + 1 (b0) and
    // 2t + 8, 2t + 9 (b1), as hi and lo parts.
    uint32_t bh0 = 0, bh1 = 0, bl0 = 0, bl1 = 0;
    if (g < 2) {
      const float* w = g == 0 ? a0 : a1;
      split_bf16x2(w[2 * t], w[2 * t + 1], bh0, bl0);
      split_bf16x2(w[2 * t + 8], w[2 * t + 9], bh1, bl1);
    }
#pragma unroll
    for (int mt = 0; mt < DH / 16; ++mt) {
      const int r = (lane & 7) + ((lane >> 4) << 3);
      const int chunk = h * (DH / 8) + 2 * mt + ((lane >> 3) & 1);
      uint32_t A[4];
      ldmatrix_x4_trans(A, rows + r * kD + ((chunk ^ (r & 7)) << 3));
      mma(acc[mt], A, bh0, bh1);
      mma(acc[mt], A, bl0, bl1);
    }
    if (c == chunks - 1 && t == 0) {
      float* val = a.val + n * kD + h * DH + g;
      float* partial = a.partial + n * kD + h * DH + g;
#pragma unroll
      for (int mt = 0; mt < DH / 16; ++mt) {
        val[16 * mt] = acc[mt][0];
        partial[16 * mt] = acc[mt][1];
        val[16 * mt + 8] = acc[mt][2];
        partial[16 * mt + 8] = acc[mt][3];
      }
    }
  }
  cp_async_wait<0>();  // nothing in flight into shared memory at exit
}

template <int H, int DH>
void launch(cudaStream_t s, const PairMmaArgs& args, int max_blocks) {
  using S = Shape<H, DH>;
  auto kernel = pair_mma_kernel<H, DH>;
  static const int per_sm = [&] {
    CUDA_CHECK(
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(S::kSmem)));
    return resident_blocks_per_sm(kernel, S::kThreads, S::kSmem);
  }();
  const int64_t runs = ceil_div(args.N, int64_t(kTokenRun));
  int64_t blocks = std::min<int64_t>(runs, int64_t(sm_count()) * std::max(per_sm, 1));
  if (max_blocks > 0) blocks = std::min<int64_t>(blocks, max_blocks);
  kernel<<<unsigned(blocks), S::kThreads, S::kSmem, s>>>(args);
  CUDA_CHECK_LAUNCH();
}

}  // namespace

bool pair_mma_applies(int d, int heads) {
  return (heads == 4 && d == 512) || (heads == 8 && (d == 1024 || d == 1280));
}

bool pair_mma(cudaStream_t s, const PairMmaArgs& args, int d, int heads, int max_blocks) {
  if (!pair_mma_applies(d, heads) || args.ns < 1 || args.ns > kPairMmaMaxSites || args.N <= 0)
    return false;
  if (heads == 4)
    launch<4, 128>(s, args, max_blocks);
  else if (d == 1024)
    launch<8, 128>(s, args, max_blocks);
  else
    launch<8, 160>(s, args, max_blocks);
  return true;
}

}  // namespace mhar::cuda
