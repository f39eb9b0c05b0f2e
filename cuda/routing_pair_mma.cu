// routing_pair_mma.cu: the backward depth tile's pass over its site gradients on tensor
// cores (pair versions 12 to 16 in routing.cu's lab numbering; routing_pair_mma.h states
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
#include "cuda/mbarrier.cuh"
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

// U's B fragments for one token, from its staged rows v0, v1, x (dh + 8 apart): lane (g, t)
// with g < 3 holds column g at the channels 16 ks + 2t, +1 (b[ks][0]) and 16 ks + 8 + 2t, +1
// (b[ks][1]); the other lanes zeros. Loaded at a token's first item and kept in registers
// for its later chunks.
template <int DH>
__device__ __forceinline__ void load_u_columns(uint32_t (&b)[DH / 16][2], const bf16* tok,
                                               int lane) {
  constexpr int kStride = DH + 8;
  const int g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int ks = 0; ks < DH / 16; ++ks) {
    b[ks][0] = b[ks][1] = 0;
    if (g < 3) {
      const bf16* p = tok + g * kStride + 16 * ks + 2 * t;
      b[ks][0] = *reinterpret_cast<const uint32_t*>(p);
      b[ks][1] = *reinterpret_cast<const uint32_t*>(p + 8);
    }
  }
}

// One item (token n, head h, chunk c of 16 sites), its site rows and scalars [a0, a1, ubar]
// x 16 in shared memory: U, the pair rows' ds r (and site source's ubar), then VAL's
// products into acc, which the token's last chunk stores. r0, r1: the slots' inv_rms at n.
template <int H, int DH>
__device__ __forceinline__ void consume_item(const PairMmaArgs& a, const bf16* rows,
                                             const uint32_t (&bu)[DH / 16][2], const float* scal,
                                             float r0, float r1, float (&acc)[DH / 16][4],
                                             int64_t n, int h, int c, int chunks, int lane) {
  constexpr int kD = H * DH, kStride = DH + 8;
  const int g = lane >> 2, t = lane & 3, ns = a.ns;
  const int64_t HN = int64_t(H) * a.N, head_off = int64_t(h) * a.N;
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
    if (ks % 2 == 0)
      mma(u, A, bu[ks][0], bu[ks][1]);
    else
      mma(u_odd, A, bu[ks][0], bu[ks][1]);
  }
#pragma unroll
  for (int e = 0; e < 4; ++e) u[e] += u_odd[e];
  // Site `source`'s ubar: column 2 of site 0, held by lane 1 (g 0, t 1).
  const float ux = __shfl_sync(0xffffffffu, u[0], 1);
  if (t == 0) {
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

template <int H, int DH, int STAGES>
__global__ void __launch_bounds__(32 * H) pair_mma_kernel(const PairMmaArgs a) {
  using W = WarpShape<DH, STAGES>;
  constexpr int kD = H * DH, kStride = W::kStride, kChunks = DH / 8;
  extern __shared__ __align__(16) unsigned char pair_mma_smem[];
  const int lane = threadIdx.x & 31, h = threadIdx.x >> 5;
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
  uint32_t bu[DH / 16][2];
  float r0 = 0.f, r1 = 0.f;

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
    if (c == 0) {
      load_u_columns<DH>(bu, tok_st + (j % STAGES) * W::kTokenElems, lane);
      r0 = rms_st[(j % STAGES) * 2], r1 = rms_st[(j % STAGES) * 2 + 1];
    }
    consume_item<H, DH>(a, rows_st + (it % STAGES) * W::kRowElems, bu,
                        scal_st + (it % STAGES) * W::kScalars, r0, r1, acc, n, h, c, chunks, lane);
  }
  cp_async_wait<0>();  // nothing in flight into shared memory at exit
}

// Pair versions 14-16: the same items, each stage's bf16 rows brought by the copy engine
// (cp.async.bulk, one 256-320 byte head slice a copy: 16 site rows an item from 16 lanes in
// one instruction, where pair_mma_kernel's lanes issue 8-16 copies of 16 bytes each), on
// one mbarrier a stage. The scalars stay 4-byte cp.async copies (a bulk copy moves
// multiples of 16 bytes). A stage holds an item's rows and, at a token's first chunk, the
// token's v0, v1, x rows and inv_rms, which that item moves into registers (U's B
// fragments, r0 and r1) for the token's later chunks. Blocks of HB warps, one a head: the
// block's heads are a group of H / HB, the group blockIdx.x % (H / HB).
// Rows past ns are never copied: they keep an earlier item's dx rows (or the zeros written
// at the start), finite, which VAL multiplies by the zero-filled weights and whose U rows
// are never stored. (A non-finite dx row would reach other tokens' sums this way; the step's
// gradient is non-finite then anyway.)
template <int DH>
struct BulkStage {
  static constexpr int kStride = DH + 8;
  static constexpr int kRowElems = kSites * kStride;
  static constexpr int kTokenElems = 3 * kStride;
  static constexpr int kScalars = 3 * kSites;  // then inv_rms x 2 and 2 floats of pad
  static constexpr size_t kBytes = 2 * (kRowElems + kTokenElems) + 4 * (kScalars + 4);
  static_assert(kBytes % 16 == 0, "16-byte aligned stages");
};
template <int DH, int STAGES>
constexpr size_t bulk_warp_bytes() {
  return STAGES * BulkStage<DH>::kBytes + 16 * ((8 * STAGES + 15) / 16);  // + the mbarriers
}

__device__ __forceinline__ void fence_proxy_async_shared() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
#else
  __trap();
#endif
}

template <int H, int HB, int DH, int STAGES, int MIN_BLOCKS>
__global__ void __launch_bounds__(32 * HB, MIN_BLOCKS) pair_bulk_kernel(const PairMmaArgs a) {
  using St = BulkStage<DH>;
  constexpr int kD = H * DH, kGroups = H / HB;
  constexpr uint32_t kRowBytes = DH * sizeof(bf16);
  extern __shared__ __align__(16) unsigned char pair_bulk_smem[];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int h = int(blockIdx.x % kGroups) * HB + warp;
  const int64_t run0 = blockIdx.x / kGroups, run_step = gridDim.x / kGroups;
  unsigned char* const mine = pair_bulk_smem + size_t(warp) * bulk_warp_bytes<DH, STAGES>();
  uint64_t* const full = reinterpret_cast<uint64_t*>(mine + STAGES * St::kBytes);
  auto stage = [&](int st) { return reinterpret_cast<bf16*>(mine + st * St::kBytes); };
  auto tokens = [&](int st) { return stage(st) + St::kRowElems; };
  auto scalars = [&](int st) { return reinterpret_cast<float*>(tokens(st) + St::kTokenElems); };

  for (int e = lane; e < int(STAGES * St::kBytes / 16); e += 32)
    reinterpret_cast<uint4*>(mine)[e] = make_uint4(0, 0, 0, 0);
  if (lane == 0) {
    for (int st = 0; st < STAGES; ++st) mbar_init(&full[st], 1);
    mbar_init_fence();
  }
  fence_proxy_async_shared();  // the zeros before the copy engine's writes
  __syncwarp();

  const int64_t N = a.N, HN = int64_t(H) * N, head_off = int64_t(h) * N;
  const int ns = a.ns, chunks = (ns + kSites - 1) / kSites, sr = lane & 15;
  const float* const scalar_rows = lane < 16 ? a.w0 : a.w1;
  auto token = [&](int j) {
    return (run0 + int64_t(j / kTokenRun) * run_step) * kTokenRun + j % kTokenRun;
  };

  auto issue = [&](int it) {
    const int j = it / chunks, c = it - j * chunks, st = it % STAGES;
    const int64_t n = token(j);
    if (n >= N) return;
    const int nrows = min(kSites, ns - c * kSites);
    const int64_t row_off = n * kD + int64_t(h) * DH;
    // Every lane's reads of this stage (an item ago) before the copy engine overwrites it.
    fence_proxy_async_shared();
    if (lane == 0) mbar_expect_tx(&full[st], uint32_t(nrows + (c == 0 ? 3 : 0)) * kRowBytes);
    __syncwarp();
    bf16* rows = stage(st);
    if (lane < nrows)
      bulk_load(rows + lane * St::kStride, a.dx[c * kSites + lane] + row_off, kRowBytes, &full[st]);
    float* scal = scalars(st);
    if (c == 0 && lane >= 16 && lane < 19) {
      const int q = lane - 16;
      bulk_load(tokens(st) + q * St::kStride,
                (q == 0   ? a.v0
                 : q == 1 ? a.v1
                          : a.x) +
                    row_off,
                kRowBytes, &full[st]);
    }
    if (c == 0 && lane >= 24 && lane < 26)
      cp_async4(scal + St::kScalars + (lane - 24), (lane == 24 ? a.inv_rms0 : a.inv_rms1) + n,
                true);
    // ubar of site `source` (i = 0) is the kernel's own output: zero here.
    const int i = c * kSites + sr;
    const int64_t scalar_off = int64_t(i) * HN + head_off + n;
    cp_async4(scal + lane, i < ns ? scalar_rows + scalar_off : a.w0, i < ns);
    if (lane < 16) {
      const bool valid = i < ns && i > 0;
      cp_async4(scal + 2 * kSites + lane, valid ? a.ubar_source + scalar_off : a.w0, valid);
    }
  };

  float acc[DH / 16][4];
  uint32_t bu[DH / 16][2];
  float r0 = 0.f, r1 = 0.f;
#pragma unroll
  for (int it = 0; it < STAGES - 1; ++it) {
    issue(it);
    cp_async_commit();
  }
  for (int it = 0;; ++it) {
    const int j = it / chunks, c = it - j * chunks, st = it % STAGES;
    const int64_t n = token(j);
    if (n >= N) break;
    mbar_wait(&full[st], uint32_t(it / STAGES) & 1);  // the stage's rows landed
    cp_async_wait<STAGES - 2>();                      // this lane's scalars of item it
    __syncwarp();                                     // and every lane's
    issue(it + STAGES - 1);
    cp_async_commit();
    if (c == 0) {
      load_u_columns<DH>(bu, tokens(st), lane);
      r0 = scalars(st)[St::kScalars], r1 = scalars(st)[St::kScalars + 1];
    }
    consume_item<H, DH>(a, stage(st), bu, scalars(st), r0, r1, acc, n, h, c, chunks, lane);
  }
  cp_async_wait<0>();  // nothing in flight into shared memory at exit (every issued bulk
                       // copy's item was consumed: tokens only grow with j)
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

// The bulk kernel on a grid of one wave: a whole number of head groups, each taking every
// (grid / groups)-th token run.
template <int H, int HB, int DH, int STAGES, int MIN_BLOCKS>
void launch_bulk(cudaStream_t s, const PairMmaArgs& args, int max_blocks) {
  constexpr int kGroups = H / HB;
  constexpr size_t kSmem = size_t(HB) * bulk_warp_bytes<DH, STAGES>();
  auto kernel = pair_bulk_kernel<H, HB, DH, STAGES, MIN_BLOCKS>;
  static const int per_sm = [&] {
    CUDA_CHECK(
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(kSmem)));
    CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout,
                                    int(cudaSharedmemCarveoutMaxShared)));
    return resident_blocks_per_sm(kernel, 32 * HB, kSmem);
  }();
  const int64_t runs = ceil_div(args.N, int64_t(kTokenRun));
  int64_t blocks = std::min<int64_t>(runs * kGroups, int64_t(sm_count()) * std::max(per_sm, 1));
  if (max_blocks > 0) blocks = std::min<int64_t>(blocks, max_blocks);
  blocks = std::max<int64_t>(kGroups, blocks / kGroups * kGroups);
  kernel<<<unsigned(blocks), 32 * HB, kSmem, s>>>(args);
  CUDA_CHECK_LAUNCH();
}

}  // namespace

bool pair_mma_applies(int d, int heads) {
  return (heads == 4 && d == 512) || (heads == 8 && (d == 1024 || d == 1280));
}

bool pair_mma(cudaStream_t s, const PairMmaArgs& args, int d, int heads, int version,
              int max_blocks) {
  if (!pair_mma_applies(d, heads) || args.ns < 1 || args.ns > kPairMmaMaxSites || args.N <= 0 ||
      version < 12 || version > 16)
    return false;
  // Shared memory a block, and the blocks an SM it allows (of 227 KB). Version 12: 4-5
  // stages a warp (3-4 items in flight); 13: 2 (1 in flight, twice the warps an SM); 14:
  // 13's stages by the copy engine; 15: 14 in blocks of half the heads (more blocks fit);
  // 16: 15 at 3 stages. The bulk kernels' second bound keeps ptxas under the registers
  // that those blocks need.
  const bool h4 = heads == 4, dh128 = heads == 4 || d == 1024;
  switch (version) {
    case 12:
      if (h4)
        launch<4, 128, 5>(s, args, max_blocks);  // 108 KB: 2 blocks, 8 warps
      else if (dh128)
        launch<8, 128, 5>(s, args, max_blocks);  // 215 KB: 1 block, 8 warps
      else
        launch<8, 160, 4>(s, args, max_blocks);  // 210 KB: 1 block, 8 warps
      break;
    case 13:
      if (h4)
        launch<4, 128, 2>(s, args, max_blocks);  // 43 KB: 5 blocks, 20 warps
      else if (dh128)
        launch<8, 128, 2>(s, args, max_blocks);  // 86 KB: 2 blocks, 16 warps
      else
        launch<8, 160, 2>(s, args, max_blocks);  // 105 KB: 2 blocks, 16 warps
      break;
    case 14:
      if (h4)
        launch_bulk<4, 4, 128, 2, 5>(s, args, max_blocks);  // 43 KB: 20 warps
      else if (dh128)
        launch_bulk<8, 8, 128, 2, 2>(s, args, max_blocks);  // 86 KB: 16 warps
      else
        launch_bulk<8, 8, 160, 2, 2>(s, args, max_blocks);  // 106 KB: 16 warps
      break;
    case 15:
      if (h4)
        launch_bulk<4, 2, 128, 2, 10>(s, args, max_blocks);  // 22 KB: 20 warps
      else if (dh128)
        launch_bulk<8, 4, 128, 2, 5>(s, args, max_blocks);  // 43 KB: 20 warps
      else
        launch_bulk<8, 4, 160, 2, 4>(s, args, max_blocks);  // 53 KB: 16 warps
      break;
    default:
      if (h4)
        launch_bulk<4, 2, 128, 3, 7>(s, args, max_blocks);  // 32 KB: 14 warps
      else if (dh128)
        launch_bulk<8, 4, 128, 3, 3>(s, args, max_blocks);  // 65 KB: 12 warps
      else
        launch_bulk<8, 4, 160, 3, 2>(s, args, max_blocks);  // 79 KB: 8 warps
      break;
  }
  return true;
}

}  // namespace mhar::cuda
