// routing_pair_mma.cu: the backward depth tile's pass over its site gradients on tensor
// cores (pair versions 12 and 13 in routing_backward.cu's lab numbering; routing_pair_mma.h states
// what it computes; cuda/NOTES.md, "The backward tile's pass on tensor cores", what was
// measured). Why: the CUDA-core pair kernels issue ~270 instructions a site row and token
// (cuda/NOTES.md, "Where 100M's routing kernels stand"): two dot products a head and two
// weighted sums per element, each a chain of FMAs and shuffles. Per token and head the
// same work is two small products,
//   U [16 sites x 8 columns] = DX [16 sites x dh] . [v0 v1 x 0 ...]^T [dh x 8]
//   VAL [16 channels x 8] += DX^T [16 channels x 16 sites] . [a0 a1 0 ...] [16 sites x 8],
// which mma.m16n8k16 runs in a few instructions; of the 8 columns two are the slots and
// one (U's third, site `source` only) gives ubar. The rest of the columns are zeros: the
// tensor cores have the time to spare, the issue slots do not.
// - Warps: one a head (H warps a block), each on its own pipeline: the work is a stream
//   of items (token, chunk of 16 sites), each staged by the warp's own cp.async copies
//   STAGES - 1 items ahead of the one computed (4-5 stages, or 2 with twice the warps an
//   SM), into the warp's own shared memory: its head's slice of the chunk's 16 site rows
//   (zero-filled past the last site), its scalars a0, a1, ubar [3][16] (zero-filled
//   likewise), and with a token's first chunk its head's slices of v0, v1, x and both
//   slots' inv_rms (STAGES buffers by token, so a token's rows outlive the items in flight
//   after it). No block barrier: a warp waits for its own copies only
//   (cp.async.wait_group, then __syncwarp for its lanes').
// - Tokens: a block takes runs of 8 consecutive tokens (a grid of one wave strides over
//   the runs), so that the 4-byte scalars of [pair][head][token] rows share sectors.
// - Shared rows are dh + 8 elements apart: the 16-byte pad puts the 8 rows of each
//   ldmatrix matrix (same chunk, consecutive rows) in 8 bank groups, for the plain (U's
//   A) and the transposing (VAL's A) loads alike.
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
constexpr int kTokenRun = 8;  // consecutive tokens a block takes (a sector of fp32 scalars)

// One warp's shared memory: its head's slices, dh + 8 elements a row.
template <int DH, int STAGES>
struct WarpShape {
  static constexpr int kStride = DH + 8;
  static constexpr int kRowElems = kSites * kStride;  // a stage's site rows
  static constexpr int kTokenElems = 3 * kStride;     // v0, v1, x
  static constexpr int kScalars = 3 * kSites;         // a0, a1, ubar
  // Then 2 inv_rms a stage and 2 floats of pad (16-byte aligned warp regions).
  static constexpr size_t kBytes =
      size_t(STAGES) * (2 * (kRowElems + kTokenElems) + 4 * (kScalars + 4));
  static_assert(DH % 16 == 0, "a head is whole k16 steps and m16 tiles");
  static_assert(kBytes % 16 == 0, "16-byte aligned warp regions");
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

template <int H, int DH, int STAGES>
__global__ void __launch_bounds__(32 * H) pair_mma_kernel(const PairMmaArgs a) {
  using W = WarpShape<DH, STAGES>;
  constexpr int kD = H * DH, kStride = W::kStride, kChunks = DH / 8;
  extern __shared__ __align__(16) unsigned char pair_mma_smem[];
  const int lane = threadIdx.x & 31, h = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
  unsigned char* const mine = pair_mma_smem + size_t(h) * W::kBytes;
  bf16* const rows_st = reinterpret_cast<bf16*>(mine);
  bf16* const tok_st = rows_st + STAGES * W::kRowElems;
  float* const scal_st = reinterpret_cast<float*>(tok_st + STAGES * W::kTokenElems);
  float* const rms_st = scal_st + STAGES * W::kScalars;

  const int64_t N = a.N, HN = int64_t(H) * N;
  const int ns = a.ns, chunks = (ns + kSites - 1) / kSites;
  const int64_t head_off = int64_t(h) * N;
  // The copies' lane map, fixed for the kernel: a copy instruction takes kRowsPerCopy rows
  // of the head's slice, lane (rsub, ch) chunk ch of row rsub of them (at dh 160 lanes 20
  // and up idle); the scalar copies take lane (kind, sr): a0 / a1 of site sr, then ubar.
  constexpr int kRowsPerCopy = 32 / kChunks;  // 2 at dh 128, 1 at 160
  const bool copier = lane < kRowsPerCopy * kChunks;
  const int ch = lane % kChunks, rsub = lane / kChunks, sr = lane & 15;
  const int64_t lane_chunk = int64_t(h) * DH + ch * 8;
  const float* const scalar_rows = lane < 16 ? a.w0 : a.w1;

  // Stages item `it` (token run index j = it / chunks, chunk c): this warp's share.
  auto issue = [&](int it) {
    const int j = it / chunks, c = it - j * chunks;
    const int64_t n = run_token(j);
    if (n >= N) return;
    const int64_t row_off = n * kD + lane_chunk;
    bf16* rows = rows_st + (it % STAGES) * W::kRowElems + ch * 8;
#pragma unroll
    for (int u = 0; u < kSites / kRowsPerCopy; ++u) {
      const int r = u * kRowsPerCopy + rsub, i = c * kSites + r;
      // Read unconditionally (i < kPairMmaMaxSites: chunks of 16 cover at most its 256;
      // entries past ns point at x), so that no branch guards the table; the rows past ns
      // copy nothing (zero-filled).
      const bf16* site_row = a.dx[i] + row_off;
      if (copier) cp_async16(rows + r * kStride, i < ns ? site_row : a.x, i < ns);
    }
    // ubar of site `source` (i = 0) is the kernel's own output: zero here.
    float* scal = scal_st + (it % STAGES) * W::kScalars;
    const int i = c * kSites + sr;
    const int64_t scalar_off = int64_t(i) * HN + head_off + n;
    cp_async4(scal + lane, i < ns ? scalar_rows + scalar_off : a.w0, i < ns);
    if (lane < 16) {
      const bool valid = i < ns && i > 0;
      cp_async4(scal + 2 * kSites + lane, valid ? a.ubar_source + scalar_off : a.w0, valid);
    }
    if (c == 0) {
      bf16* tok = tok_st + (j % STAGES) * W::kTokenElems + ch * 8;
#pragma unroll
      for (int u = 0; u < (3 + kRowsPerCopy - 1) / kRowsPerCopy; ++u) {
        const int q = u * kRowsPerCopy + rsub;
        if (copier && q < 3)
          cp_async16(tok + q * kStride, (q == 0 ? a.v0 : q == 1 ? a.v1 : a.x) + row_off, true);
      }
      if (lane < 2)
        cp_async4(rms_st + (j % STAGES) * 2 + lane, (lane == 0 ? a.inv_rms0 : a.inv_rms1) + n,
                  true);
    }
  };

  float acc[DH / 16][4];  // VAL: channels 16 mt + (g, g + 8) of the head x columns 2t, 2t + 1

#pragma unroll
  for (int it = 0; it < STAGES - 1; ++it) {
    issue(it);
    cp_async_commit();
  }
  for (int it = 0;; ++it) {
    const int j = it / chunks, c = it - j * chunks;
    const int64_t n = run_token(j);
    if (n >= N) break;
    cp_async_wait<STAGES - 2>();  // this lane's copies of item it landed
    __syncwarp();                 // and every lane's; item it - 1 read out by all
    issue(it + STAGES - 1);
    cp_async_commit();

    const bf16* rows = rows_st + (it % STAGES) * W::kRowElems;
    const bf16* tok = tok_st + (j % STAGES) * W::kTokenElems;
    const float* scal = scal_st + (it % STAGES) * W::kScalars;
    const float* a0 = scal;
    const float* a1 = scal + kSites;
    const float* ub = scal + 2 * kSites;
    if (c == 0) {
#pragma unroll
      for (int mt = 0; mt < DH / 16; ++mt) acc[mt][0] = acc[mt][1] = acc[mt][2] = acc[mt][3] = 0.f;
    }

    // U: lane (g, t) ends with sites g, g + 8 x columns 2t, 2t + 1 (0: v0, 1: v1, 2: x).
    // Two accumulators (even and odd k steps) halve the chain of dependent mmas.
    float u[4] = {0.f, 0.f, 0.f, 0.f}, u_odd[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
    for (int ks = 0; ks < DH / 16; ++ks) {
      uint32_t A[4];
      ldmatrix_x4(A, rows + (lane & 15) * kStride + 16 * ks + ((lane >> 4) << 3));
      uint32_t b0 = 0, b1 = 0;
      if (g < 3) {
        const bf16* p = tok + g * kStride + 16 * ks + 2 * t;
        b0 = *reinterpret_cast<const uint32_t*>(p);
        b1 = *reinterpret_cast<const uint32_t*>(p + 8);
      }
      if (ks % 2 == 0)
        mma(u, A, b0, b1);
      else
        mma(u_odd, A, b0, b1);
    }
#pragma unroll
    for (int e = 0; e < 4; ++e) u[e] += u_odd[e];
    // Site `source`'s ubar: column 2 of site 0, held by lane 1 (g 0, t 1).
    const float ux = __shfl_sync(0xffffffffu, u[0], 1);
    if (t == 0) {
      const float r0 = rms_st[(j % STAGES) * 2], r1 = rms_st[(j % STAGES) * 2 + 1];
      const int iA = c * kSites + g, iB = iA + 8;
      const float ubA = iA == 0 ? ux : ub[g];
      float* w0 = a.w0 + head_off + n;
      float* w1 = a.w1 + head_off + n;
      if (iA < ns) {
        w0[iA * HN] = a0[g] * (u[0] - ubA) * r0;
        w1[iA * HN] = a1[g] * (u[1] - ubA) * r1;
      }
      if (iB < ns) {
        const float ubB = ub[g + 8];
        w0[iB * HN] = a0[g + 8] * (u[2] - ubB) * r0;
        w1[iB * HN] = a1[g + 8] * (u[3] - ubB) * r1;
      }
      if (iA == 0) a.ubar_source[head_off + n] = ux;
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
      uint32_t A[4];
      ldmatrix_x4_trans(A, rows + r * kStride + 16 * mt + (((lane >> 3) & 1) << 3));
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

template <int H, int DH, int STAGES>
void launch(cudaStream_t s, const PairMmaArgs& args, int max_blocks) {
  constexpr size_t kSmem = size_t(H) * WarpShape<DH, STAGES>::kBytes;
  auto kernel = pair_mma_kernel<H, DH, STAGES>;
  static const int per_sm = [&] {
    CUDA_CHECK(
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(kSmem)));
    // All of the SM's 228 KB as shared memory, so that two blocks of 86-105 KB fit.
    CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout,
                                    int(cudaSharedmemCarveoutMaxShared)));
    return resident_blocks_per_sm(kernel, 32 * H, kSmem);
  }();
  const int64_t runs = ceil_div(args.N, int64_t(kTokenRun));
  int64_t blocks = std::min<int64_t>(runs, int64_t(sm_count()) * std::max(per_sm, 1));
  if (max_blocks > 0) blocks = std::min<int64_t>(blocks, max_blocks);
  kernel<<<unsigned(blocks), 32 * H, kSmem, s>>>(args);
  CUDA_CHECK_LAUNCH();
}

}  // namespace

bool pair_mma_applies(int d, int heads) {
  return (heads == 4 && d == 512) || (heads == 8 && (d == 1024 || d == 1280));
}

bool pair_mma(cudaStream_t s, const PairMmaArgs& args, int d, int heads, bool two_stages,
              int max_blocks) {
  if (!pair_mma_applies(d, heads) || args.ns < 1 || args.ns > kPairMmaMaxSites || args.N <= 0)
    return false;
  // Shared memory a block, and the blocks an SM it allows (of 227 KB): deep, 4-5 stages
  // (3-4 items in flight a warp); two_stages, 2 (1 in flight, twice the warps an SM).
  if (heads == 4) {
    if (two_stages)
      launch<4, 128, 2>(s, args, max_blocks);  // 43 KB: 5 blocks, 20 warps
    else
      launch<4, 128, 5>(s, args, max_blocks);  // 108 KB: 2 blocks, 8 warps
  } else if (d == 1024) {
    if (two_stages)
      launch<8, 128, 2>(s, args, max_blocks);  // 86 KB: 2 blocks, 16 warps
    else
      launch<8, 128, 5>(s, args, max_blocks);  // 215 KB: 1 block, 8 warps
  } else {
    if (two_stages)
      launch<8, 160, 2>(s, args, max_blocks);  // 105 KB: 2 blocks, 16 warps
    else
      launch<8, 160, 4>(s, args, max_blocks);  // 210 KB: 1 block, 8 warps
  }
  return true;
}

}  // namespace mhar::cuda
