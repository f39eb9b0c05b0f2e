// routing_key_grads.cu: the routing backward's key gradients, G_k[c] = sum_n (ds_k r)[head(c),
// n] v[n, c] of one slot against its sites, into the slabs of gsum (slot_key_grads,
// routing_host.h: on tensor cores in routing_key_grad_mma.cu, by the kernel below, or by
// per-head GEMMs), and routing_param_grads (backend.h): dquery/dgain of every site from the
// slabs. Conventions: cuda/routing.cu.
#include "cuda/routing_host.h"
#include "cuda/routing_key_grad_mma.h"

namespace mhar::cuda {
namespace routing_detail {
namespace {

// ---------------------------------------------------------------- key gradient
// G_k[c] = sum_n (ds_k r)[head(c), n] v[n, c] of one slot against its sites is, per head,
// a GEMM over the tokens (cuBLAS, tensor cores, fp32 accumulate into gsum's slab 0): [dh x
// N] x [N x ns]. ds r is fp32, v bf16, so ds r goes in as bf16 hi + lo parts (two GEMMs),
// which carry it to ~2^-17 relative.
// A slot read by few sites (ns <= kKeyGradKernelMaxSites, every chunk in one head) takes
// key_grad_kernel instead: at ns = 1 (delta's partial block sums: 64 of the 1B model's 73
// slots) the two GEMMs and the split took 55 us a slot (ncu, tenth session), for 42 MB of
// v that one pass reads in ~12 us. The kernel reads v and the fp32 ds r once and adds
// into every slab of gsum: slab c gets the sum over its share of the tokens [N c / C,
// N (c+1) / C). Each gsum element is written by one thread, the token partials of a block
// summed in a fixed order: deterministic, like the GEMMs.
// Block: kKeyGradRows token rows x 32 chunk lanes (a warp reads 512 contiguous bytes of a
// row); grid: C slabs x ceil(d / 256) chunk groups (320 blocks at the 1B shape, C = 64).
// Measured (ncu, tenth session, 1B, ns = 1): with 4 rows a block the kernel took 31 us
// (1.35 TB/s): ~10 warps per SM, each thread 8 batches of 8 rows in turn, latency-bound;
// 8 rows a block doubles the warps in flight and halves each thread's batches.
// Kernel-lab versions (routing_set_kernel_version(KeyGrad, v)):
// 1 the kernel up to kKeyGradKernelMaxSites sites, the GEMMs past them;
// 2 the kernel at every ns, the slot's sites in groups of kKeyGradKernelMaxSites (the
//   grid's z: each group's blocks read v again, from L2 where it fits).
// Why 2: tools/kernel_times.sh at 100M (twentieth session, call 2) found the GEMMs past 8
// sites at 25 us a launch, two a slot (hi and lo): 0.83 ms of the step's 39.6 ms of
// kernels for 17 slots; their output (dh x ns a head) gives cuBLAS ~32 tiles of work on
// 132 SMs, so each reads its v at ~0.7 TB/s. The kernel's grid is C x d/256 x groups
// (512 blocks at 100M's 25 sites). Version 2 sums each element in fp32 over the tokens in
// the kernel's order (no bf16 split of ds r), so its bits differ from version 1's past 8
// sites (routing_backward_sum_order; both within the CPU parity bound).
// Measured (twentieth session, call 3, OpTiming.DISABLED_RoutingBackwardFusedLimit, a
// step's backward, ms, v1 / v2): 100M tiled 4.045 / **3.630**, untiled 4.407 / 3.980; 350M
// tiled **20.781** / 21.536; 1B tiled **45.866** / 50.441. At d 1024 and 1280 the groups'
// re-reads of v (7 and 10 groups of an up to 42 MB row set) cost more than the GEMMs'
// poor fill. In the 100M step (tools/kernel_times.sh): 34 GEMMs (0.83 ms) and 17 splits
// (0.09 ms) became 17 more kernel launches (0.53 ms).
// 3 tensor cores (routing_key_grad_mma.cu): per head, [ns sites x tokens] x [tokens x dh]
//   as mma.m16n8k16 with ds r split into bf16 hi + lo, v staged by cp.async; every ns in one
//   pass over v where ns <= 32 (groups of 32 sites past that). Another sum order (the CPU
//   parity bound). Where its shapes do not allow it (dh % 16, misaligned rows, a 128-feature
//   block spanning more than 4 heads), the rule by width below.
// 4 version 3 with ds r staged by cp.async as fp32 beside v (each warp splits what it
//   reads): the same bits as 3. Written after the twenty-fourth session's device time ran
//   out, from ncu of version 3 at 100M (10.5-10.8 us for ns <= 16 at 38-40% of DRAM peak,
//   15 us for ns 17-25 at 34%; 23% achieved occupancy, one wave of 256 blocks; 3.9 of 10
//   cycles between a warp's instructions waiting on the ds r loads of the register
//   staging). RoutingParity finds version 3's bits (twenty-fifth session, H200).
// The first version 3 (twenty-third session: version 2 with ds r staged in shared memory a
// block step at a time, 8 token rows of v in flight where NS <= 4; the same bits as 2) lost
// at every size (twenty-fourth session, BENCHMARKS.md call 1,
// OpTiming.DISABLED_RoutingBackwardVersions, a step's tiled backward, ms, v2 / staged: 100M
// 3.434 / 3.567, 350M 21.491 / 22.396, 1B 49.889 / 53.030): its block barriers each step
// and 2 blocks an SM cost more than the per-thread ds r loads they saved. Code at 508fd0d.
// Measured (twenty-fourth session, BENCHMARKS.md call 2,
// OpTiming.DISABLED_RoutingBackwardVersions, a step's tiled backward, ms, v1 / v2 / v3):
// 100M 3.838 / 3.431 / **3.053**, 350M 20.671 / 21.477 / **19.574**, 1B 45.197 / 49.733 /
// **44.499** (untiled: 4.370 / 3.961 / 3.579, 25.271 / 26.146 / 24.229, 55.753 / 60.359 /
// 55.155). Twenty-fifth session (BENCHMARKS.md call 1, the same test, v3 / v4): 100M
// 3.107 / **3.082**, 350M 19.575 / **19.518**, 1B 44.597 / **44.318**; the 100M step
// within its spread (0.901 / 0.897 and 0.891 / 0.893 in two alternating rounds). The
// default is 4 (the same bits, a little less time at every size); where its shapes do not
// allow it, the earlier rule by width (key_grad_fallback_version: 2 at d <= 512, else 1).
constexpr int kKeyGradKernelMaxSites = 8;
constexpr int kKeyGradRows = 8;
int key_grad_fallback_version(int64_t d) { return d <= 512 ? 2 : 1; }

// A key-gradient block's sums: the kKeyGradRows rows' acc added in row order, each feature
// of the block's 256 by one thread, into gsum's slab blockIdx.x for sites source + k.
template <int NS>
__device__ __forceinline__ void key_grad_store(const float (&acc)[NS][8], float* gsum,
                                               const Geometry& g, int source, int ns) {
  __shared__ float part[kKeyGradRows][256];
  const int tx = threadIdx.x & 31, ty = threadIdx.x >> 5, slab = blockIdx.x;
  const int64_t feature0 = int64_t(blockIdx.y) * 256;
#pragma unroll
  for (int k = 0; k < NS; ++k) {
    if (k >= ns) break;  // uniform over the block
    __syncthreads();     // the previous site's partials have been read
#pragma unroll
    for (int e = 0; e < 8; ++e) part[ty][tx * 8 + e] = acc[k][e];
    __syncthreads();
    for (int f = threadIdx.x; f < 256; f += 32 * kKeyGradRows) {
      if (feature0 + f >= g.d) break;
      float sum = 0.f;
#pragma unroll
      for (int r = 0; r < kKeyGradRows; ++r) sum += part[r][f];
      gsum[(int64_t(slab) * g.lay.sites + source + k) * g.d + feature0 + f] += sum;
    }
  }
}

// Sites source + z NS .. (z = blockIdx.z) of the slot's ns: NS >= the group's sites.
template <int NS>
__global__ void __launch_bounds__(32 * kKeyGradRows)
    key_grad_kernel(float* __restrict__ gsum, const float* __restrict__ dsr,
                    const bf16* __restrict__ v, const Geometry g, int source, int ns, int slabs) {
  constexpr int U = NS <= 2 ? 8 : 4;  // token rows in flight per thread
  const int tx = threadIdx.x & 31, ty = threadIdx.x >> 5;
  const int slab = blockIdx.x, chunk = blockIdx.y * 32 + tx;
  const bool active = chunk < g.nchunks;
  const int64_t n0 = g.N * slab / slabs, n1 = g.N * (slab + 1) / slabs;
  const int h = active ? chunk * 8 / g.dh : 0;
  const int k0 = int(blockIdx.z) * NS;  // the group's first site, from source
  source += k0;
  ns = min(ns - k0, NS);
  const uint4* vp = reinterpret_cast<const uint4*>(v) + chunk;
  const float* wp = dsr + (int64_t(k0) * g.H + h) * g.N;  // site k's row: + k H N
  float acc[NS][8];
#pragma unroll
  for (int k = 0; k < NS; ++k)
#pragma unroll
    for (int e = 0; e < 8; ++e) acc[k][e] = 0.f;
  for (int64_t n = n0 + ty; n < n1; n += kKeyGradRows * U) {
    uint4 raw[U];
    float w[U][NS];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int64_t m = n + int64_t(kKeyGradRows) * u;
      const bool ok = active && m < n1;
      raw[u] = ok ? vp[m * g.nchunks] : make_uint4(0, 0, 0, 0);
#pragma unroll
      for (int k = 0; k < NS; ++k) w[u][k] = ok && k < ns ? wp[int64_t(k) * g.H * g.N + m] : 0.f;
    }
#pragma unroll
    for (int u = 0; u < U; ++u)
#pragma unroll
      for (int k = 0; k < NS; ++k)
#pragma unroll
        for (int e = 0; e < 8; ++e) acc[k][e] += w[u][k] * elem(raw[u], e);
  }
  key_grad_store(acc, gsum, g, source, ns);
}

__global__ void split_bf16_kernel(bf16* __restrict__ hi, bf16* __restrict__ lo,
                                  const float* __restrict__ x, int64_t n) {
  for (int64_t e = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; e < n;
       e += int64_t(gridDim.x) * blockDim.x)
    split_bf16(x[e], hi[e], lo[e]);
}

__global__ void param_grads_kernel(const SiteGrads sg, const SiteParams sp,
                                   const float* __restrict__ gsum, int S, int d, int slabs) {
  for (int64_t e = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; e < int64_t(S) * d;
       e += int64_t(gridDim.x) * blockDim.x) {
    const int k = int(e / d), c = int(e % d);
    float G = 0.f;
    for (int r = 0; r < slabs; ++r) G += gsum[(int64_t(r) * S + k) * d + c];
    sg.dq[k][c] += load(sp.g[k][c]) * G;
    sg.dg[k][c] += load(sp.q[k][c]) * G;
  }
}

}  // namespace

void slot_key_grads(cudaStream_t s, RoutingContext& ctx, Tensor gsum, const float* dsr,
                    const bf16* v, const Geometry& g, int source, int ns) {
  int key_version = g_key_grad_version;
  const int slabs = int(gsum.dim(0));
  const bool mma =
      key_version >= 3 && ns > 0 && slabs > 0 && key_grad_mma_applies(g.N, g.d, g.H, dsr, v);
  if (key_version >= 3 && !mma) key_version = key_grad_fallback_version(g.d);
  if (mma || ((ns <= kKeyGradKernelMaxSites || key_version >= 2) && g.dh % 8 == 0)) {
    // These kernels take no scratch and no cuBLAS handle, so they may run beside
    // (KeyGradsBeside); the GEMM path below stays on the op's stream.
    KeyGradsBeside& beside = ctx.key_beside;
    if (beside.stream) {
      CUDA_CHECK(cudaEventRecord(beside.ready, s));
      CUDA_CHECK(cudaStreamWaitEvent(beside.stream, beside.ready, 0));
      s = beside.stream;
    }
    if (mma) {
      MHAR_CHECK(
          key_grad_mma(s, gsum.ptr<float>(), dsr, v, g.N, g.d, g.H, g.lay.sites, source, ns, slabs,
                       g_key_grad_version == 4),
          "CUDA routing key gradients: the tensor-core kernel refused a shape it applies to");
    } else {
      // One pass (see the kernel), a grid layer a group of kKeyGradKernelMaxSites sites.
      const dim3 grid(unsigned(slabs), unsigned(ceil_div(g.nchunks, 32)),
                      unsigned(ceil_div(ns, kKeyGradKernelMaxSites)));
      auto launch = [&](auto ns_bound) {
        constexpr int NS = decltype(ns_bound)::value;  // the kernel's sites a grid layer
        key_grad_kernel<NS>
            <<<grid, 32 * kKeyGradRows, 0, s>>>(gsum.ptr<float>(), dsr, v, g, source, ns, slabs);
        CUDA_CHECK_LAUNCH();
      };
      if (ns == 1)
        launch(std::integral_constant<int, 1>{});
      else if (ns == 2)
        launch(std::integral_constant<int, 2>{});
      else if (ns <= 4)
        launch(std::integral_constant<int, 4>{});
      else
        launch(std::integral_constant<int, kKeyGradKernelMaxSites>{});
    }
    if (beside.stream) {
      CUDA_CHECK(cudaEventRecord(beside.done, beside.stream));
      beside.pending = true;
    }
    return;
  }
  const int64_t pair_vals = int64_t(ns) * g.H * g.N;
  auto* dsr_hi =
      static_cast<bf16*>(ctx.scratch(ScratchSlot::RoutingPairSplit, 2 * pair_vals * sizeof(bf16)));
  bf16* dsr_lo = dsr_hi + pair_vals;
  split_bf16_kernel<<<grid_stride_blocks(pair_vals, 256), 256, 0, s>>>(dsr_hi, dsr_lo, dsr,
                                                                       pair_vals);
  CUDA_CHECK_LAUNCH();
  for (const bf16* part : {static_cast<const bf16*>(dsr_hi), static_cast<const bf16*>(dsr_lo)})
    head_gemm(s, ctx.blas, CUBLAS_OP_N, CUBLAS_OP_N, g.dh, ns, g.N, v, CUDA_R_16BF, g.d, g.dh, part,
              CUDA_R_16BF, int64_t(g.H) * g.N, g.N, 1.f, gsum.ptr<float>() + int64_t(source) * g.d,
              g.d, g.dh, g.H);
}

}  // namespace routing_detail

using namespace routing_detail;

void routing_param_grads(cudaStream_t s, const RoutingParams& params, Tensor gsum) {
  const char* what = "routing_param_grads";
  const int S = params.sites();
  MHAR_CHECK(gsum.ndim == 3 && gsum.dim(1) == S, "CUDA ", what, ": gsum ", gsum.shape_str(),
             " for ", S, " sites");
  check_dtype(gsum, DType::F32, what, "gsum");
  const int64_t d = gsum.dim(2);
  if (S > kMaxSites) fail("CUDA ", what, ": ", S, " sites, at most ", kMaxSites);
  MHAR_CHECK(int(params.dquery.size()) == S && int(params.dgain.size()) == S, "CUDA ", what,
             ": needs dquery and dgain of every site");
  const SiteParams sp = site_params(what, params, d);
  SiteGrads sg{};
  for (int k = 0; k < S; ++k) {
    check_dtype(params.dquery[size_t(k)], DType::F32, what, "dquery");
    check_dtype(params.dgain[size_t(k)], DType::F32, what, "dgain");
    check_numel(params.dquery[size_t(k)], d, what, "dquery");
    check_numel(params.dgain[size_t(k)], d, what, "dgain");
    sg.dq[k] = params.dquery[size_t(k)].ptr<float>();
    sg.dg[k] = params.dgain[size_t(k)].ptr<float>();
  }
  const int threads = 256;
  param_grads_kernel<<<grid_stride_blocks(int64_t(S) * d, threads), threads, 0, s>>>(
      sg, sp, gsum.ptr<float>(), S, int(d), int(gsum.dim(0)));
  CUDA_CHECK_LAUNCH();
}

}  // namespace mhar::cuda
