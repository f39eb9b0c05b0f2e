// attention_wgmma.cuh: the wgmma helpers both Hopper attention files share
// (attention_hopper.cu, attention_hopper_ws.cu; built for sm_90a alone): the wgmma
// instructions the kernels issue, as inline-PTX wrappers with fp32 accumulators, the
// 128-byte-swizzled shared-memory layout and its operand descriptors, and the staged
// epilogue that writes a warp's accumulator rows as bf16.
//
// Shared-memory tile layout (wgmma "128B swizzle", also what TMA writes with
// CU_TENSOR_MAP_SWIZZLE_128B): a [rows][HD] bf16 tile is stored as HD/64 column blocks of
// [rows][64]; each 128-byte row holds eight 16-byte chunks, chunk c of row r at position
// c ^ (r % 8). Tiles start 1024-byte aligned (the swizzle reads the address bits).
// Descriptors: K-major operands advance 32 bytes per k-step of 16 inside a column block,
// stride 1024 bytes between 8-row groups; N-major operands advance 16 rows (2048 bytes)
// per k-step, column blocks rows*128 bytes apart.
#pragma once
#include <cstdint>

#include "cuda/attention_mma.cuh"
#include "cuda/mbarrier.cuh"  // fence_proxy_async

namespace mhar::cuda::attn_wgmma {

using namespace attn_mma;

// wgmma and its fences exist only in the sm_90a target; this file is built for it alone
// (CMakeLists.txt), and available() checks the device before anything launches.
#if defined(__CUDA_ARCH__) && !defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define MHAR_NO_WGMMA 1
#endif

#ifndef MHAR_NO_WGMMA
__device__ __forceinline__ void wgmma_fence() {
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void wgmma_commit() {
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void wgmma_wait_all() {
  asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
}
// Waits until at most N of this warpgroup's committed wgmma groups are still running.
template <int N> __device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
// Keeps the compiler from moving reads or writes of an accumulator across a wgmma wait.
template <int N> __device__ __forceinline__ void pin(float (&d)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

// The accumulator operands of the wrappers below, for the 32 (m64n64) or 64 (m64n128) fp32
// values each thread holds: the register list inside the asm text, and its constraints.
#define MHAR_WGMMA_D32 \
  "{" "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, " \
  "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}"
#define MHAR_WGMMA_D64 \
  "{" "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, " \
  "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, " \
  "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, " \
  "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}"
#define MHAR_WGMMA_ACC32(d) \
  "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
  "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), \
  "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), \
  "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
#define MHAR_WGMMA_ACC64(d) \
  MHAR_WGMMA_ACC32(d), \
  "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), \
  "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), \
  "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), \
  "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])

// d (+)= A B, m64n64k16 (N 64, 32 accumulators) or m64n128k16 (N 128, 64): A and B from
// shared memory by descriptors; kTransA / kTransB 0 for a K-major operand (A an [m][k]
// tile, B an [n][k] tile), 1 for an MN-major one (A [k][m], B [k][n], read transposed).
// Accumulates into d when `accumulate`, else overwrites it.
template <int N, int kTransA, int kTransB>
__device__ __forceinline__ void wgmma_ss(float (&d)[N / 2], uint64_t a_desc, uint64_t b_desc,
                                         bool accumulate) {
  static_assert(N == 64 || N == 128, "m64n64k16 or m64n128k16");
  if constexpr (N == 64) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 " MHAR_WGMMA_D32 ", %32, %33, p, 1, 1, %35, %36;\n}\n"
        : MHAR_WGMMA_ACC32(d)
        : "l"(a_desc), "l"(b_desc), "r"(int(accumulate)), "n"(kTransA), "n"(kTransB));
  } else {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 " MHAR_WGMMA_D64 ", %64, %65, p, 1, 1, %67, %68;\n}\n"
        : MHAR_WGMMA_ACC64(d)
        : "l"(a_desc), "l"(b_desc), "r"(int(accumulate)), "n"(kTransA), "n"(kTransB));
  }
}

// d += A B, m64n64k16: A from registers (the m16n8k16 A-fragment layout per warp), B from
// shared memory N-major (transposed: a [k][n] tile), accumulating.
__device__ __forceinline__ void wgmma_rs_m64n64_tb(float (&d)[32], const uint32_t (&a)[4],
                                                   uint64_t b_desc) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 " MHAR_WGMMA_D32 ", {%32, %33, %34, %35}, %36, p, 1, 1, 1;\n}\n"
      : MHAR_WGMMA_ACC32(d)
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b_desc), "r"(1));
}

// d += A B, m64n128k16: A from registers (the m16n8k16 A-fragment layout per warp), B from
// shared memory N-major (transposed: a [k][n] tile), accumulating.
__device__ __forceinline__ void wgmma_rs_m64n128_tb(float (&d)[64], const uint32_t (&a)[4],
                                                   uint64_t b_desc) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 " MHAR_WGMMA_D64 ", {%64, %65, %66, %67}, %68, p, 1, 1, 1;\n}\n"
      : MHAR_WGMMA_ACC64(d)
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b_desc), "r"(1));
}
#undef MHAR_WGMMA_D32
#undef MHAR_WGMMA_D64
#undef MHAR_WGMMA_ACC32
#undef MHAR_WGMMA_ACC64

// d += A B with N = HD (64 or 128), A K-major and B N-major from shared memory.
template <int HD>
__device__ __forceinline__ void wgmma_ss_kn(float (&d)[HD / 2], uint64_t a_desc,
                                            uint64_t b_desc) {
  wgmma_ss<HD, 0, 1>(d, a_desc, b_desc, true);
}
// d += A B with N = HD (64 or 128), both operands MN-major from shared memory.
template <int HD>
__device__ __forceinline__ void wgmma_ss_tt(float (&d)[HD / 2], uint64_t a_desc,
                                            uint64_t b_desc) {
  wgmma_ss<HD, 1, 1>(d, a_desc, b_desc, true);
}
// d += A B with N = HD (64 or 128): A from registers, B N-major.
template <int HD>
__device__ __forceinline__ void wgmma_rs_tb(float (&d)[HD / 2], const uint32_t (&a)[4],
                                            uint64_t b_desc) {
  if constexpr (HD == 128) wgmma_rs_m64n128_tb(d, a, b_desc);
  else wgmma_rs_m64n64_tb(d, a, b_desc);
}
#endif

// Descriptor of a 128B-swizzled operand at p (shared memory): leading byte offset `lbo`
// (the column-block stride for N-major operands; ignored for K-major ones), stride byte
// offset 1024 (8 rows of 128 bytes), swizzle mode 1 (128 bytes).
__device__ __forceinline__ uint64_t sw128_desc(const void* p, uint32_t lbo) {
  return uint64_t((smem_addr(p) & 0x3FFFF) >> 4) | (uint64_t(lbo >> 4) << 16) |
         (uint64_t(1024 >> 4) << 32) | (uint64_t(1) << 62);
}

// Descriptors of a swizzled tile of TILE_ROWS rows: a base descriptor, made once per
// buffer, plus the k-step's offset (16 along K), a compile-time constant added to the
// address field (addresses stay below 256 KB, so the 14-bit field cannot carry over).
// - K-major (the tile's rows are M or N, its features K), from row `row0` (a multiple of
//   8): 32 bytes per k-step inside a 64-column block, then the next column block.
__device__ __forceinline__ uint64_t kmajor_base(const bf16* tile, int row0) {
  return sw128_desc(tile + row0 * 64, 16);
}
template <int TILE_ROWS>
__device__ __forceinline__ uint64_t kmajor_step(uint64_t base, int ks) {
  return base + uint64_t(((ks / 4) * TILE_ROWS * 128 + (ks % 4) * 32) >> 4);
}
// - N-major (the tile's rows are K, its features N; wgmma reads it transposed): 16 rows
//   (2048 bytes) per k-step, column blocks TILE_ROWS * 128 bytes apart.
template <int TILE_ROWS>
__device__ __forceinline__ uint64_t nmajor_base(const bf16* tile) {
  return sw128_desc(tile, uint32_t(TILE_ROWS) * 128);
}
__device__ __forceinline__ uint64_t nmajor_step(uint64_t base, int ks) {
  return base + uint64_t(ks * 2048 >> 4);
}
// The descriptor offset of stage `st` of a two-stage buffer of tiles of `tile_elems`.
__device__ __forceinline__ uint64_t stage_offset(int st, int tile_elems) {
  return uint64_t(st * (tile_elems * 2 / 16));
}

// The global rows a warp's 16 accumulator rows go to: row0 + r, or (RowOf) any map.
struct ConsecutiveRows {
  int64_t row0;
  __device__ int64_t operator()(int r) const { return row0 + r; }
};

// A warp's 16 rows of wgmma accumulators (m64nHD layout, this warp's quarter) times
// mul_lo / mul_hi (rows g / g + 8) -> bf16, staged through `stage` (16 rows of HD + 8
// elements, this warp's alone) and written as 16-byte stores to global rows row_of(0..15)
// (`stride` elements apart; rows >= n_rows skipped).
template <int HD, class RowOf = ConsecutiveRows>
__device__ __forceinline__ void store_rows_staged(bf16* stage, const float (&acc)[HD / 2],
                                                  float mul_lo, float mul_hi, bf16* base,
                                                  int64_t stride, RowOf row_of, int64_t n_rows,
                                                  int lane) {
  constexpr int LD = HD + 8, CPR = HD / 8;
  const int g = lane >> 2, c2 = 2 * (lane & 3);
#pragma unroll
  for (int dt = 0; dt < HD / 8; ++dt) {
    *reinterpret_cast<uint32_t*>(stage + g * LD + dt * 8 + c2) =
        pack(acc[4 * dt] * mul_lo, acc[4 * dt + 1] * mul_lo);
    *reinterpret_cast<uint32_t*>(stage + (g + 8) * LD + dt * 8 + c2) =
        pack(acc[4 * dt + 2] * mul_hi, acc[4 * dt + 3] * mul_hi);
  }
  __syncwarp();
#pragma unroll
  for (int i = lane; i < 16 * CPR; i += 32) {
    const int r = i / CPR, c = i % CPR;
    const int64_t row = row_of(r);
    if (row < n_rows)
      *reinterpret_cast<uint4*>(base + row * stride + c * 8) =
          *reinterpret_cast<const uint4*>(stage + r * LD + c * 8);
  }
  __syncwarp();
}

// The same rows (this thread's: row_lo and row_lo + 8) times `mul` -> bf16, written straight
// from the accumulators as 4-byte pairs: for a kernel with no shared memory to stage in,
// whose store is rare (once per work item).
template <int HD>
__device__ __forceinline__ void store_rows_direct(const float (&acc)[HD / 2], float mul,
                                                  bf16* base, int64_t stride, int64_t row_lo,
                                                  int64_t n_rows, int lane) {
  const int c2 = 2 * (lane & 3);
#pragma unroll
  for (int dt = 0; dt < HD / 8; ++dt) {
    if (row_lo < n_rows)
      *reinterpret_cast<uint32_t*>(base + row_lo * stride + dt * 8 + c2) =
          pack(acc[4 * dt] * mul, acc[4 * dt + 1] * mul);
    if (row_lo + 8 < n_rows)
      *reinterpret_cast<uint32_t*>(base + (row_lo + 8) * stride + dt * 8 + c2) =
          pack(acc[4 * dt + 2] * mul, acc[4 * dt + 3] * mul);
  }
}

// The online softmax's running maxima for a thread's two rows (g and g + 8 of its warp's
// 16) of a score tile s in the m64nN accumulator layout (N / 8 n8 tiles): on the diagonal
// tile (`diag`) keys after each row's last visible one (tile columns lim_lo, and lim_lo + 8
// for the second row) are set to -inf first; then the rows' maxima, reduced over the quad,
// scaled by c (> 0, so scaling after the max gives the same max) and merged into m_lo and
// m_hi. Returns the old statistics' rescale factors 2^(m_old - m_new). The maxima are
// finite: key 0 of tile 0 is visible to every row.
template <int N>
__device__ __forceinline__ float2 update_row_max(float (&s)[N / 2], bool diag, int lim_lo,
                                                 int c2, float c, float& m_lo, float& m_hi) {
  const int lim_hi = lim_lo + 8;
  float mx_lo = -INFINITY, mx_hi = -INFINITY;
#pragma unroll
  for (int nt = 0; nt < N / 8; ++nt) {
    if (diag) {
#pragma unroll
      for (int e = 0; e < 4; ++e)
        if (nt * 8 + c2 + (e & 1) > (e < 2 ? lim_lo : lim_hi)) s[4 * nt + e] = -INFINITY;
    }
    mx_lo = fmaxf(mx_lo, fmaxf(s[4 * nt], s[4 * nt + 1]));
    mx_hi = fmaxf(mx_hi, fmaxf(s[4 * nt + 2], s[4 * nt + 3]));
  }
  mx_lo = fmaxf(mx_lo, __shfl_xor_sync(0xffffffffu, mx_lo, 1));
  mx_lo = fmaxf(mx_lo, __shfl_xor_sync(0xffffffffu, mx_lo, 2));
  mx_hi = fmaxf(mx_hi, __shfl_xor_sync(0xffffffffu, mx_hi, 1));
  mx_hi = fmaxf(mx_hi, __shfl_xor_sync(0xffffffffu, mx_hi, 2));
  mx_lo = fmaxf(m_lo, mx_lo * c);
  mx_hi = fmaxf(m_hi, mx_hi * c);
  const float2 alpha = make_float2(fast_exp2(m_lo - mx_lo), fast_exp2(m_hi - mx_hi));
  m_lo = mx_lo;
  m_hi = mx_hi;
  return alpha;
}

// A thread's two rows of an m64n{HD} accumulator (rows g and g + 8 of its warp's 16) times
// their rescale factors: the online softmax's O after the running maxima moved.
template <int HD>
__device__ __forceinline__ void rescale_rows(float (&o)[HD / 2], float al_lo, float al_hi) {
#pragma unroll
  for (int dt = 0; dt < HD / 8; ++dt) {
    o[4 * dt] *= al_lo;
    o[4 * dt + 1] *= al_lo;
    o[4 * dt + 2] *= al_hi;
    o[4 * dt + 3] *= al_hi;
  }
}

// The dynamic shared memory, its start rounded up to the swizzle's 1024 bytes (the
// shared-memory address, which the swizzle reads, not the generic pointer).
__device__ __forceinline__ bf16* aligned_smem(unsigned char* raw) {
  const uint32_t a = smem_addr(raw);
  return reinterpret_cast<bf16*>(raw + (((a + 1023) & ~1023u) - a));
}

#ifndef MHAR_NO_WGMMA
// d = A B over K = 16 KSTEPS, both operands K-major swizzled tiles (of A_ROWS and B_ROWS
// rows) from their base descriptors; m64n64 products.
template <int KSTEPS, int A_ROWS, int B_ROWS>
__device__ __forceinline__ void wgmma_ss_k(float (&d)[32], uint64_t a_desc, uint64_t b_desc) {
#pragma unroll
  for (int ks = 0; ks < KSTEPS; ++ks)
    wgmma_ss<64, 0, 0>(d, kmajor_step<A_ROWS>(a_desc, ks), kmajor_step<B_ROWS>(b_desc, ks), ks > 0);
}
// d += A B over K = 16 KSTEPS, A from registers (one m16n8k16 A fragment per k-step), B an
// N-major swizzled tile; N = HD.
template <int HD, int KSTEPS>
__device__ __forceinline__ void wgmma_rs_k(float (&d)[HD / 2], const uint32_t (&a)[KSTEPS][4],
                                           uint64_t b_desc) {
#pragma unroll
  for (int kk = 0; kk < KSTEPS; ++kk) wgmma_rs_tb<HD>(d, a[kk], nmajor_step(b_desc, kk));
}
#endif

// ---- the backward's score-gradient tiles (dk/dv writes them, dq reads them)
constexpr int kGradTile = 64;  // a score-gradient tile's keys and queries

// Tiles on and below the diagonal of one (b, h): tile (qt, kt), kt <= qt, is number
// qt (qt + 1) / 2 + kt.
__host__ __device__ inline int64_t grad_tiles_per_head(int64_t T) {
  return ceil_div(T, int64_t(kGradTile)) * (ceil_div(T, int64_t(kGradTile)) + 1) / 2;
}
// Inside a tile, row (key) u holds its 64 queries in the order that lets dk/dv's threads
// store 16-byte chunks: the thread with column pair c (2c, 2c + 1 of each n8 tile) writes
// n8 tiles 4a .. 4a + 3 at positions 32a + 8c .. 32a + 8c + 7. So position p holds query
// tile_query(p); dq's product rows come out in position order and its store maps them back.
__device__ __forceinline__ int tile_query(int p) {
  return 8 * (4 * (p >> 5) + ((p >> 1) & 3)) + 2 * ((p >> 3) & 3) + (p & 1);
}
template <class P>  // bf16* or const bf16*
__device__ __forceinline__ P score_grad_tile(P base, int64_t bh, int64_t T, int qt, int kt) {
  return base + (bh * grad_tiles_per_head(T) + int64_t(qt) * (qt + 1) / 2 + kt) *
                    (kGradTile * kGradTile);
}
// A warp's 16 key rows of a dS^T tile (this warp's quarter of an m64n64 accumulator, as
// the bf16 A fragments `da` that dK's product reads) in the tile's column order: each
// thread's 4 n8 tiles of a row are 16 contiguous bytes, so a warp's store fills whole
// 32-byte sectors.
__device__ __forceinline__ void store_score_grad_rows(bf16* tile, int warp, int lane,
                                                      const uint32_t (&da)[4][4]) {
  bf16* row = tile + (16 * warp + (lane >> 2)) * kGradTile + 8 * (lane & 3);
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    *reinterpret_cast<uint4*>(row + 32 * half) =
        make_uint4(da[2 * half][0], da[2 * half][2], da[2 * half + 1][0], da[2 * half + 1][2]);
    *reinterpret_cast<uint4*>(row + 8 * kGradTile + 32 * half) =
        make_uint4(da[2 * half][1], da[2 * half][3], da[2 * half + 1][1], da[2 * half + 1][3]);
  }
}

}  // namespace mhar::cuda::attn_wgmma
