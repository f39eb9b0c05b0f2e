// attention_mma.cuh: the copy and matrix helpers the tensor-core attention kernels share
// (attention.cu's mma.sync path, attention_hopper.cu's wgmma path): cp.async staging of
// 16-byte chunks, ldmatrix, the m16n8k16 bf16 mma, the fp32 -> bf16x2 pack, and the
// dk/dv kernels' walk over query tiles and staging of per-query statistics. The
// fragment layouts are PTX's for mma.m16n8k16 (the wgmma accumulators and register A
// operand use the same layout per warp, which is why the forward kernels can feed the
// score accumulators straight back as the A operand of P V).
#pragma once
#include <cstdint>

#include "cuda/common.cuh"

namespace mhar::cuda::attn_mma {

// The helpers below need sm_80+ (cp.async, ldmatrix, bf16 mma); builds for older targets
// compile them to traps, and attention.cu's tc_available() then sends every call to the
// fp32 path.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
#define MHAR_TC_OLD_ARCH 1
#endif

// 16 bytes global -> shared; zero-filled when !valid (src is then never read).
__device__ __forceinline__ void cp_async16(void* dst, const void* src, bool valid) {
#ifdef MHAR_TC_OLD_ARCH
  __trap();
#else
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(dst)),
               "l"(src), "r"(valid ? 16 : 0));
#endif
}
__device__ __forceinline__ void cp_async_commit() {
#ifdef MHAR_TC_OLD_ARCH
  __trap();
#else
  asm volatile("cp.async.commit_group;\n" ::);
#endif
}
template <int N> __device__ __forceinline__ void cp_async_wait() {
#ifdef MHAR_TC_OLD_ARCH
  __trap();
#else
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
#endif
}
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* p) {
#ifdef MHAR_TC_OLD_ARCH
  __trap();
#else
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(p)));
#endif
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], const void* p) {
#ifdef MHAR_TC_OLD_ARCH
  __trap();
#else
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(p)));
#endif
}
// d += a b, m16n8k16, bf16 in, fp32 accumulate.
__device__ __forceinline__ void mma(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                    uint32_t b1) {
#ifdef MHAR_TC_OLD_ARCH
  __trap();
#else
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#endif
}
__device__ __forceinline__ uint32_t pack(float lo, float hi) {
  __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&v);
}

// The dk/dv kernels' statistics of query tile t0 .. t0 + N - 1 of one (b, query head)
// (`stats_row`: that head's [B, Hq, T] row of lse and Dsum) into shared memory, one
// thread per query: lse in the exp2 domain and D. Queries past the end get lse = INFINITY
// and D = 0, so P = exp2(x - inf) = 0 there and they add exact zeros.
template <int N>
__device__ __forceinline__ void stage_query_stats(float* lse_st, float* D_st, const float* lse,
                                                  const float* Dsum, int64_t stats_row,
                                                  int64_t t0, int64_t T) {
  if (threadIdx.x < N) {
    const int64_t t = t0 + threadIdx.x;
    const bool ok = t < T;
    lse_st[threadIdx.x] = ok ? lse[stats_row + t] * kLog2e : INFINITY;
    D_st[threadIdx.x] = ok ? Dsum[stats_row + t] : 0.f;
  }
}

// The end of a forward's online softmax for a thread's two rows t_lo and t_lo + 8: the row
// sums l (partial per thread) reduced over the quad of lanes that share the rows and, when
// lse is given, lse[row0 + t] = (m + log2 l) ln 2 (m and l in the exp2 domain) stored by the
// quad's first lane for the rows before T.
__device__ __forceinline__ void finish_row_sums(float& l_lo, float& l_hi, float m_lo,
                                                float m_hi, float* lse, int64_t row0,
                                                int64_t t_lo, int64_t T, int lane) {
  l_lo += __shfl_xor_sync(0xffffffffu, l_lo, 1);
  l_lo += __shfl_xor_sync(0xffffffffu, l_lo, 2);
  l_hi += __shfl_xor_sync(0xffffffffu, l_hi, 1);
  l_hi += __shfl_xor_sync(0xffffffffu, l_hi, 2);
  if (lse && (lane & 3) == 0) {
    const float ln2 = 0.6931471805599453f;
    if (t_lo < T) lse[row0 + t_lo] = (m_lo + log2f(l_lo)) * ln2;
    if (t_lo + 8 < T) lse[row0 + t_lo + 8] = (m_hi + log2f(l_hi)) * ln2;
  }
}

// The dk/dv kernels' walk for a block of keys starting at u0: every query tile of BQ that
// can see one of them (tiles u0 / BQ .. the last), for each query head of KV head hkv's
// group in turn. Iteration `it` (0 .. group * tiles - 1) visits head(it), tile t0(it).
template <int BQ>
struct QueryTileWalk {
  int64_t hq0;
  int first, tiles;  // the first tile; tiles per head
  __device__ QueryTileWalk(int64_t hkv, int64_t group, int64_t u0, int64_t T)
      : hq0(hkv * group), first(int(u0 / BQ)), tiles(int(ceil_div(T, BQ)) - int(u0 / BQ)) {}
  __device__ int64_t head(int it) const { return hq0 + it / tiles; }
  __device__ int64_t t0(int it) const { return int64_t(first + it % tiles) * BQ; }
};

}  // namespace mhar::cuda::attn_mma
