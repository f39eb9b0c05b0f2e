// routing.cu: depth routing (DESIGN.md sections 2-3) split by source, as in backend.h; the
// overview of the routing files, their conventions, and what they share on the host
// (routing_host.h: geometry and checks, head_gemm, the kernel lab's versions in force).
// The ops, by file:
//   routing_logits.cu  routing_source_logits: one read of a new source gives its inv_rms
//                      and its logits for every later site (the queries are
//                      parameters); the q*g tables
//   routing_mix.cu     routing_mix: one site's softmax over its sources, weighted sum;
//                      routing_mix_tile: the same for the first site of a depth tile,
//                      whose later sites then read only their newer slots (section "depth
//                      tiling"; full routing); routing_mix_rmsnorm: routing_mix and the
//                      consumer's input norm, inside a tile's finish kernel where it can
//   routing_backward.cu  routing_source_backward: one source's whole gradient from the
//                      input gradients of every later site (source-stationary: no
//                      read-modify-write of an accumulator per (site, source) pair), plus
//                      its share of the query/gain gradients; routing_source_backward_tile:
//                      the same for the first slot of a backward depth tile, with it the
//                      next older slot's share of the site gradients that both read, so
//                      that slot then reads only its sites before the tile's first
//                      (section "depth tiling of the backward"; block layouts pair closed
//                      slots; its pair kernels in routing_backward_tile.cu, their shared
//                      device code in routing_backward_rows.cuh); routing_delta_site_
//                      backward: Backend::delta_site_backward in one pass (delta mode)
//   routing_finish_key.cu  an unfused slot's key path and finish in one kernel (the lab's
//                      source_finish 2-3; by default the key GEMM and the finish kernel
//                      in routing_backward.cu)
//   routing_key_grads.cu  a slot's key gradients into the slabs of gsum (the backward's
//                      last step; beside the main stream at side_stream 3);
//                      routing_param_grads: dquery/dgain of every site from the slabs
//   routing_delta_forward.cu  routing_delta_site_forward: Backend::delta_site_forward in
//                      one pass (delta mode)
//   routing_rows.cuh   the kernels' shared device code (a token's row in a warp, the online
//                      softmax, per-head sums, the mix and logits of one token)
//   routing_logits_mma.cu, routing_key_grad_mma.cu, routing_pair_mma.cu  the tensor-core
//                      kernels (logits, key gradients, the backward tile's pass)
// Every kernel lives in its file's anonymous namespace (inside routing_detail, whose
// helpers it finds first); only the host entry points above are shared.
// Which slots a site reads is the RoutingLayout (backend.h), passed by value in the
// launch geometry: a source's sites are a contiguous run [source, last_site(source)] with
// contiguous pairs, so the per-source kernels only change loop bounds; the mix derives
// each of its sources' slot and pair (site_source / site_pair) with no division per
// source. Full routing is block 1: slot i = v_i, read by every site k >= i.
// Storage: history, x, dx, dv BF16; query/gain BF16 (the backend's parameters); weights,
// inv_rms, ubar F32; gsum, dquery, dgain F32. Every sum is fp32.
//
// Split of the work (cuda/NOTES.md has the measurements): whatever is a product with the
// token-independent q*g or a sum over tokens is a per-head GEMM on cuBLAS (the logits,
// the backward's key path, the key gradients G_k); the token kernels keep what streams
// the [N, d] rows: the mix, and the backward's value path with the softmax backward.
// Operands that the GEMMs need in bf16 but that are fp32 (q*g, ds*r) go in as bf16
// hi + lo parts, two GEMMs, so no result carries a bf16 rounding the CPU reference lacks.
// Slots read by few sites (<= 8: full routing's last slots, block routing's partial block
// sums) are the exception: a GEMM with one to eight columns is launches and re-reads of
// v, so their logits come from one token kernel (source_logits_span_kernel) and their key
// path runs inside the value kernel (FUSED), in fp32 throughout. Every slot's key
// gradients come from one pass over v on tensor cores (routing_key_grad_mma.cu; ds*r as
// bf16 hi + lo), or where its shapes do not allow it, from key_grad_kernel or the GEMMs.
// routing_delta_site_backward runs the delta scheme's steps around a few-site slot's
// backward in the same kernel (DELTA).
//
// Token kernels run one warp per token, rows read in 16-byte chunks of 8 bf16 (d % 8 ==
// 0, d <= 256 * kMaxNT), in one of two layouts:
// - span (d % 256 == 0 and H dividing 32: the model widths): lane l owns the contiguous
//   chunks [NT l, NT (l+1)), NT = d/256, so a head is a run of 32/H lanes and a per-head
//   sum is a few xor shuffles (routing_rows.cuh, section "span layout");
// - interleaved (any other shape): lane l owns chunks l, l+32, ... (NT = ceil(d/256)),
//   each load instruction of a warp reads 512 contiguous bytes. Per-head sums: when
//   dh % 8 == 0 every chunk lies in one head (ALIGNED) and a segmented warp scan adds the
//   chunks of each head, with a fix-up across a lane's chunk rows for heads that span
//   rows; otherwise every feature is added into a per-warp shared array of H sums.
// Temporaries (qg tables, the backward's fp32 value and key rows, ds*r's bf16 parts) are
// the backend's grow-only scratch (kernels.h); nothing here allocates.
// Kernel lab: the mix tile and finish kernels, the backward's pair kernel and the logits
// keep their earlier versions, numbered, chosen at launch (routing_set_kernel_version,
// kernels.h; the defaults are the measured fastest: mix tile 5 of 5, finish 6 of 6, the
// norm in the finish 2 of 2, pair 17 of 18, the unfused value kernel by width of 9, the
// key gradients 4 of 4, logits 9 of 9, the q*g tables 1 of 2, the delta site forward 1 of
// 2, its backward 2 of 3; routing_host.h lists them with their files), so that one device
// run times each (tests/op_timing_cudatest.cpp); every version
// computes the same bits, but for the logits' choice between token kernel and GEMMs, the
// backward's row parts and fused key path, the key gradients' and pair version 12's
// tensor cores (see there; routing_backward_sum_order tells the tests which).
#include <algorithm>

#include "cuda/routing_host.h"

namespace mhar::cuda {
namespace routing_detail {

// The kernel lab's versions in force (routing_host.h) and the tests' knobs.
int g_logits_version = kLogitsDefault;
int g_qg_tables_version = kQgTablesDefault;
int g_mix_norm_version = kMixNormDefault;
int g_tile_plan_version = kTilePlanDefault;
int g_mix_tile_version = kMixTileDefault;
int g_mix_finish_version = kMixFinishDefault;
int g_delta_forward_version = kDeltaForwardDefault;
int g_delta_site_version = kDeltaSiteDefault;
int g_source_value_version = kSourceValueDefault;
int g_pair_version = kPairDefault;
int g_key_grad_version = kKeyGradDefault;
int g_source_finish_version = kSourceFinishDefault;
int g_grid_cap = 0;
int g_fused_key_max_sites = kFusedKeyMaxSites;

Geometry geometry(const char* what, int64_t N, int64_t d, int heads, const RoutingLayout& lay) {
  MHAR_CHECK(heads >= 1 && d % heads == 0, "CUDA ", what, ": heads ", heads, " must divide d ", d);
  if (d % 8 != 0 || d > 256 * kMaxNT)
    fail("CUDA ", what, ": d_model = ", d, " unsupported (the CUDA routing reads rows in "
         "16-byte chunks: d must be a multiple of 8 and at most ", 256 * kMaxNT, ")");
  MHAR_CHECK(lay.sources >= 1 && lay.sites >= lay.sources && lay.block >= 1, "CUDA ", what,
             ": routing layout of ", lay.sources, " sources, ", lay.sites, " sites, block ",
             lay.block);
  if (lay.sites > kMaxSites)
    fail("CUDA ", what, ": ", lay.sites, " routing sites, at most ", kMaxSites,
         " supported (2 * n_layers + 1 <= ", kMaxSites, ")");
  Geometry g;
  g.N = N;
  g.d = int(d);
  g.H = heads;
  g.dh = int(d / heads);
  g.lay = lay;
  g.nchunks = int(d / 8);
  return g;
}

SiteParams site_params(const char* what, const RoutingParams& p, int64_t d) {
  MHAR_CHECK(p.query.size() == p.gain.size(), "CUDA ", what, ": ", p.query.size(),
             " queries but ", p.gain.size(), " gains");
  SiteParams sp{};
  for (int k = 0; k < p.sites(); ++k) {
    const Tensor& q = p.query[size_t(k)];
    const Tensor& gn = p.gain[size_t(k)];
    check_dtype(q, DType::BF16, what, "query");
    check_dtype(gn, DType::BF16, what, "gain");
    check_numel(q, d, what, "query");
    check_numel(gn, d, what, "gain");
    sp.q[k] = static_cast<const bf16*>(q.data);
    sp.g[k] = static_cast<const bf16*>(gn.data);
  }
  return sp;
}

void check_weights(const char* what, const Tensor& w, const Geometry& g) {
  check_dtype(w, DType::F32, what, "weights");
  check_numel(w, g.lay.pairs() * g.H * g.N, what, "weights");
}

// The checks shared by the two per-source ops: v [N, d] one source, inv_rms [N].
Geometry source_geometry(const char* what, const Tensor& weights, const Tensor& inv_rms,
                         const Tensor& v, const RoutingParams& params, const RoutingLayout& lay,
                         int source, int heads) {
  const int64_t N = inv_rms.numel();
  MHAR_CHECK(N > 0 && v.numel() % N == 0, "CUDA ", what, ": v ", v.shape_str(),
             " for inv_rms ", inv_rms.shape_str());
  MHAR_CHECK(params.sites() == lay.sites, "CUDA ", what, ": ", params.sites(),
             " sites' parameters for a layout of ", lay.sites, " sites");
  const Geometry g = geometry(what, N, v.numel() / N, heads, lay);
  MHAR_CHECK(source >= 0 && source < lay.sources, "CUDA ", what, ": source ", source, " of ",
             lay.sources);
  check_weights(what, weights, g);
  check_dtype(inv_rms, DType::F32, what, "inv_rms");
  check_dtype(v, DType::BF16, what, "v");
  return g;
}

int token_blocks(int64_t N) { return grid_stride_blocks(N * 32, 32 * kWarpsPerBlock); }

// C_h = op(A_h) op(B_h) for the heads h < batch: one strided-batched cuBLAS call in its
// column-major terms (the caller states the views), fp32 accumulate and C, alpha 1. The
// batch's C views interleave (ldc spans every head) but never share an element.
void head_gemm(cudaStream_t s, cublasHandle_t blas, cublasOperation_t ta, cublasOperation_t tb,
               int64_t m, int64_t n, int64_t k, const void* A, cudaDataType at, int64_t lda,
               int64_t stride_a, const void* B, cudaDataType bt, int64_t ldb, int64_t stride_b,
               float beta, float* C, int64_t ldc, int64_t stride_c, int batch) {
  for (int64_t dim : {m, n, k, lda, ldb, ldc})
    if (dim > INT32_MAX)
      fail("CUDA routing: a GEMM dimension of ", dim, " exceeds cuBLAS's 32-bit limit (fewer "
           "tokens per micro-batch)");
  const float alpha = 1.f;
  CUBLAS_CHECK(cublasSetStream(blas, s));
  CUBLAS_CHECK(cublasGemmStridedBatchedEx(blas, ta, tb, int(m), int(n), int(k), &alpha, A, at,
                                          int(lda), stride_a, B, bt, int(ldb), stride_b, &beta, C,
                                          CUDA_R_32F, int(ldc), stride_c, batch,
                                          CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
}

}  // namespace routing_detail

using namespace routing_detail;

namespace {
// One lab kernel's setting: the version in force, how many there are, and the default.
struct LabSetting {
  int& current;
  int versions;
  int fallback;
};
LabSetting lab_setting(RoutingKernel kernel) {
  switch (kernel) {
    case RoutingKernel::MixTile:
      return {g_mix_tile_version, kMixTileVersions, kMixTileDefault};
    case RoutingKernel::BackwardPair:
      return {g_pair_version, kPairVersions, kPairDefault};
    case RoutingKernel::DeltaSite:
      return {g_delta_site_version, kDeltaSiteVersions, kDeltaSiteDefault};
    case RoutingKernel::DeltaForward:
      return {g_delta_forward_version, kDeltaForwardVersions, kDeltaForwardDefault};
    case RoutingKernel::Logits:
      return {g_logits_version, kLogitsVersions, kLogitsDefault};
    case RoutingKernel::MixFinish:
      return {g_mix_finish_version, kMixFinishVersions, kMixFinishDefault};
    case RoutingKernel::SourceValue:
      return {g_source_value_version, kSourceValueVersions, kSourceValueDefault};
    case RoutingKernel::KeyGrad:
      return {g_key_grad_version, kKeyGradVersions, kKeyGradDefault};
    case RoutingKernel::MixNorm:
      return {g_mix_norm_version, kMixNormVersions, kMixNormDefault};
    case RoutingKernel::QgTables:
      return {g_qg_tables_version, kQgTablesVersions, kQgTablesDefault};
    case RoutingKernel::SourceFinish:
      return {g_source_finish_version, kSourceFinishVersions, kSourceFinishDefault};
    case RoutingKernel::TilePlan:
      return {g_tile_plan_version, kTilePlanVersions, kTilePlanDefault};
  }
  fail("routing kernel lab: unknown kernel ", int(kernel));
}
}  // namespace

int routing_kernel_versions(RoutingKernel kernel) { return lab_setting(kernel).versions; }

int routing_set_kernel_version(RoutingKernel kernel, int version) {
  const LabSetting lab = lab_setting(kernel);
  MHAR_CHECK(version <= lab.versions, "routing_set_kernel_version: version ", version,
             " of a kernel with versions 1 .. ", lab.versions, " (<= 0: the default)");
  const int before = lab.current;
  lab.current = version > 0 ? version : lab.fallback;
  return before;
}

int routing_set_grid_cap(int blocks) {
  const int before = g_grid_cap;
  g_grid_cap = std::max(blocks, 0);
  return before;
}

int routing_set_fused_key_max_sites(int sites) {
  const int before = g_fused_key_max_sites;
  g_fused_key_max_sites = sites < 0 ? kFusedKeyMaxSites : sites;
  return before;
}

int routing_fused_key_max_sites() { return g_fused_key_max_sites; }

}  // namespace mhar::cuda
