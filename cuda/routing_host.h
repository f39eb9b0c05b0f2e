// routing_host.h: what the routing files share on the host (cuda/routing.cu has the
// overview and defines these): the launch geometry and its argument checks, dispatch by
// row width, the pass-long q*g tables, and the kernel lab's versions and test knobs.
#pragma once

#include <type_traits>

#include "cuda/routing_rows.cuh"

namespace mhar::cuda::routing_detail {

// The checked geometry of a launch over N tokens of width d (fails naming `what` where the
// CUDA routing cannot take the shape), the sites' q and g pointers, the weights' shape.
Geometry geometry(const char* what, int64_t N, int64_t d, int heads, const RoutingLayout& lay);
SiteParams site_params(const char* what, const RoutingParams& p, int64_t d);
void check_weights(const char* what, const Tensor& w, const Geometry& g);
// The checks shared by the two per-source ops: v [N, d] one source, inv_rms [N].
Geometry source_geometry(const char* what, const Tensor& weights, const Tensor& inv_rms,
                         const Tensor& v, const RoutingParams& params, const RoutingLayout& lay,
                         int source, int heads);
// Blocks of kWarpsPerBlock warps for one warp a token over N tokens (grid-stride).
int token_blocks(int64_t N);
// C_h = op(A_h) op(B_h) for the heads h < batch: one strided-batched cuBLAS call in its
// column-major terms (the caller states the views), fp32 accumulate and C, alpha 1. The
// batch's C views interleave (ldc spans every head) but never share an element.
void head_gemm(cudaStream_t s, cublasHandle_t blas, cublasOperation_t ta, cublasOperation_t tb,
               int64_t m, int64_t n, int64_t k, const void* A, cudaDataType at, int64_t lda,
               int64_t stride_a, const void* B, cudaDataType bt, int64_t ldb, int64_t stride_b,
               float beta, float* C, int64_t ldc, int64_t stride_c, int batch);
// The fp32 q*g rows of sites source .. source + ns - 1 ([ns, d]): the bound pass's (every
// site's, filled at the pass's first need: QgPassTables, kernels.h) or this op's own in
// the RoutingTables scratch (routing_logits.cu).
const float* qg_rows_f32(cudaStream_t s, RoutingContext& ctx, const SiteParams& sp, int sites,
                         int source, int ns, int d);
// One slot's key gradients: gsum's slabs [., k] += G_k for its sites k = source .. source
// + ns - 1, from its pairs' ds r (dsr, [ns, H, N]) and its row v [N, d]
// (routing_key_grads.cu).
void slot_key_grads(cudaStream_t s, RoutingContext& ctx, Tensor gsum, const float* dsr,
                    const bf16* v, const Geometry& g, int source, int ns);
// An unfused slot's key path and finish in one kernel (routing_finish_key.cu; SourceFinish
// versions 2-4): dv from its fp32 value row `val`, its pairs' ds r (dsr, [ns, H, N]), the
// q*g rows qg [ns, d], v and inv_rms. False (nothing launched) where `version` or the shape
// does not allow it: the caller then runs the key GEMM and the finish kernel.
bool source_finish_key_fits(int64_t d, int heads, int version);  // the width and heads
bool source_finish_key(cudaStream_t s, bf16* dv, const float* val, const float* dsr,
                       const float* qg, const bf16* v, const float* inv_rms, const Geometry& g,
                       int ns, int version);

// Calls f.template operator()<NT, ALIGNED>() for the geometry's row width and head size.
template <class F>
void dispatch_rows(const Geometry& g, F&& f) {
  const int nt = int(ceil_div(g.d, 256));
  const bool aligned = g.dh % 8 == 0;
  auto with = [&](auto nt_tag) {
    constexpr int NT = decltype(nt_tag)::value;
    if (aligned)
      f(std::integral_constant<int, NT>{}, std::true_type{});
    else
      f(std::integral_constant<int, NT>{}, std::false_type{});
  };
  // clang-format off
  switch (nt) {
    case 1: with(std::integral_constant<int, 1>{}); break;
    case 2: with(std::integral_constant<int, 2>{}); break;
    case 3: with(std::integral_constant<int, 3>{}); break;
    case 4: with(std::integral_constant<int, 4>{}); break;
    case 5: with(std::integral_constant<int, 5>{}); break;
    case 6: with(std::integral_constant<int, 6>{}); break;
    default: with(std::integral_constant<int, 8>{}); break;  // 7 and 8 chunk rows
  }
  // clang-format on
}

// Calls f(std::integral_constant<int, NT>) with NT = d / 256 exactly (span layout;
// geometry() caps d at 2048, so NT is 1..8; any other width takes 8).
template <class F>
void dispatch_span(const Geometry& g, F&& f) {
  const int nt = g.d / 256;
  dispatch_int<1, kMaxNT>(nt >= 1 && nt <= kMaxNT ? nt : kMaxNT, f);
}

// Dynamic shared memory beyond the default 48 KiB needs an opt-in per kernel.
template <class K>
void allow_smem(K kernel, size_t bytes) {
  if (bytes > 48 * 1024)
    CUDA_CHECK(
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(bytes)));
}

// Slots read by at most this many sites take the fused backward (source_value_span_kernel,
// FUSED): its traffic is the ns site rows + 4, the unfused one's ns + ~13 row-sized
// reads and writes (fp32 value and key rows, finish), and its extra per-site work (the
// key path's q*g row from L1 and a second per-head sum) stays small next to that.
constexpr int kFusedKeyMaxSites = 8;

// ---------------------------------------------------------------- the kernel lab
// routing_set_kernel_version (kernels.h) picks among each kernel's numbered versions, so
// that one device run times them all (tests/op_timing_cudatest.cpp). Per kernel: its
// versions, its default (the measured fastest; 0: by width) and, defined in routing.cu,
// the version in force. What each version is, and what it measured, is written beside its
// kernels in the file named.
constexpr int kLogitsVersions = 9, kLogitsDefault = 9;              // routing_logits.cu
constexpr int kQgTablesVersions = 2, kQgTablesDefault = 1;          // routing_logits.cu
constexpr int kMixNormVersions = 4, kMixNormDefault = 4;            // routing_mix.cu
constexpr int kMixTileVersions = 5, kMixTileDefault = 5;            // routing_mix.cu
constexpr int kTilePlanVersions = 3, kTilePlanDefault = 3;          // routing_mix.cu
constexpr int kMixFinishVersions = 6, kMixFinishDefault = 6;        // routing_mix.cu
constexpr int kDeltaForwardVersions = 2, kDeltaForwardDefault = 1;  // routing_delta_forward.cu
constexpr int kDeltaSiteVersions = 3, kDeltaSiteDefault = 2;        // routing_backward.cu
constexpr int kSourceValueVersions = 9, kSourceValueDefault = 0;    // routing_backward.cu
constexpr int kPairVersions = 18, kPairDefault = 17;                // routing_backward_tile.cu
constexpr int kKeyGradVersions = 4, kKeyGradDefault = 4;            // routing_key_grads.cu
constexpr int kSourceFinishVersions = 4, kSourceFinishDefault = 1;  // routing_finish_key.cu
extern int g_logits_version, g_qg_tables_version, g_mix_norm_version, g_mix_tile_version,
    g_mix_finish_version, g_delta_forward_version, g_delta_site_version, g_source_value_version,
    g_pair_version, g_key_grad_version, g_source_finish_version, g_tile_plan_version;
// The tests' knobs: a cap on the one-wave grids (routing_set_grid_cap) and the most sites
// a slot may have for the fused backward (routing_set_fused_key_max_sites).
extern int g_grid_cap, g_fused_key_max_sites;

}  // namespace mhar::cuda::routing_detail
