// routing_stats.cu: Backend::routing_stats on the GPU, the device-side reduction of the
// routing probe (engine/probe.h): per site, the sums over tokens of every head's weight
// of every source, of each head's entropy, and of the mean pairwise Jensen-Shannon
// divergence between heads, added into a small F64 buffer that stays on the device
// across batches. Only that buffer (H*(src+1)+1 numbers per site of src sources) is ever
// downloaded, never the [pairs, H, N] weights.
// One thread per token reads its site's weights (F32, coalesced across the warp: pair
// rows are [H, N]) and computes in fp64; warp sums, then one shared-memory atomic per
// warp and one global atomic per block and statistic. The order of the atomics varies,
// so the last bits of a sum vary from run to run (fp64: far below what a probe shows).
#include <cmath>

#include "cuda/common.cuh"
#include "cuda/kernels.h"

namespace mhar::cuda {
namespace {

constexpr int kStatsThreads = 256;

__global__ void routing_stats_kernel(double* __restrict__ stats, const float* __restrict__ weights,
                                     const RoutingLayout lay, int site, int H, int64_t N) {
  extern __shared__ double acc[];  // [H*(src+1) + 1]
  const int src = lay.site_sources(site), closed = site / lay.block;
  const int n_stats = H * (src + 1) + 1, lane = threadIdx.x & 31;
  for (int k = threadIdx.x; k < n_stats; k += blockDim.x) acc[k] = 0;
  __syncthreads();
  const int64_t n = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  const bool live = n < N;
  auto a = [&](int i, int h) -> double {
    return live ? double(weights[(lay.site_pair(site, i, closed) * H + h) * N + n]) : 0.0;
  };
  for (int h = 0; h < H; ++h) {
    double ent = 0;
    for (int i = 0; i < src; ++i) {
      const double w = a(i, h);
      if (w > 0) ent -= w * log(w);
      const double s = warp_sum(w);
      if (lane == 0) atomicAdd(&acc[h * src + i], s);
    }
    const double s = warp_sum(ent);
    if (lane == 0) atomicAdd(&acc[H * src + h], s);
  }
  if (H > 1) {
    double js = 0;
    for (int h = 0; h < H && live; ++h)
      for (int g = h + 1; g < H; ++g) {
        double d = 0;
        for (int i = 0; i < src; ++i) {
          const double p = a(i, h), q = a(i, g), m = 0.5 * (p + q);
          if (p > 0) d += 0.5 * p * log(p / m);
          if (q > 0) d += 0.5 * q * log(q / m);
        }
        js += d < 0 ? 0 : d;
      }
    js /= 0.5 * H * (H - 1);
    const double s = warp_sum(js);
    if (lane == 0) atomicAdd(&acc[H * (src + 1)], s);
  }
  __syncthreads();
  for (int k = threadIdx.x; k < n_stats; k += blockDim.x) atomicAdd(&stats[k], acc[k]);
}

}  // namespace

void routing_stats(cudaStream_t s, Tensor stats, Tensor weights, const RoutingLayout& layout,
                   int site, int heads) {
  const char* what = "routing_stats";
  check_dtype(weights, DType::F32, what, "weights");
  check_dtype(stats, DType::F64, what, "stats");
  MHAR_CHECK(weights.ndim == 3 && weights.dim(1) == heads, "CUDA ", what, ": weights ", weights.shape_str());
  const int64_t P = weights.dim(0), N = weights.dim(2);
  MHAR_CHECK(P == layout.pairs() && site >= 0 && site < layout.sites, "CUDA ", what, ": site ",
             site, " of ", layout.sites, " with ", P, " pairs");
  const int src = layout.site_sources(site);
  MHAR_CHECK(stats.numel() == int64_t(heads) * (src + 1) + 1, "CUDA ", what, ": stats of ", stats.numel());
  if (N == 0) return;
  const size_t smem = sizeof(double) * size_t(stats.numel());
  if (smem > 48 * 1024)
    CUDA_CHECK(cudaFuncSetAttribute(routing_stats_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
  routing_stats_kernel<<<unsigned(ceil_div(N, kStatsThreads)), kStatsThreads, smem, s>>>(
      stats.ptr<double>(), weights.ptr<float>(), layout, site, heads, N);
  CUDA_CHECK_LAUNCH();
}

}  // namespace mhar::cuda
