// routing_stats_cudatest.cpp: Backend::routing_stats (the routing probe's device
// reduction, cuda/routing_stats.cu) against the CPU backend's, on the same F32 weights:
// both compute in fp64 from identical inputs and differ only in summation order, so the
// sums agree to 1e-10 relative. The sums are "+=": both sides start from the same values.
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <vector>

#include "cuda/cuda_backend.h"
#include "cuda/device.h"
#include "engine/backend.h"

namespace mhar::test {
namespace {

TEST(RoutingStatsParity, EverySiteOfSeveralShapes) {
  if (::mhar::cuda::device_count() == 0) GTEST_SKIP() << "no CUDA device";
  auto cpu = make_cpu_backend(DType::F32);
  auto gpu = make_cuda_backend(0);
  struct Shape { int S, H; int64_t N; int block = 1; };
  for (const Shape sh : {Shape{3, 1, 7}, Shape{5, 2, 300}, Shape{9, 4, 1000}, Shape{25, 8, 4099},
                         Shape{9, 4, 1000, 2}, Shape{25, 8, 4099, 3}, Shape{25, 2, 300, 24}}) {
    const RoutingLayout lay = RoutingLayout::blocks(sh.S, sh.block);
    const int64_t P = lay.pairs();
    std::mt19937_64 rng(uint64_t(sh.S * 100 + sh.H));
    std::uniform_real_distribution<double> u(0.0, 1.0);
    // Softmax rows per (site, head, token), with some exact zeros (the 0 log 0 case).
    std::vector<double> w(size_t(P * sh.H * sh.N));
    for (int k = 0; k < sh.S; ++k)
      for (int h = 0; h < sh.H; ++h)
        for (int64_t n = 0; n < sh.N; ++n) {
          double sum = 0;
          const int src = lay.site_sources(k);
          std::vector<double> e(static_cast<size_t>(src));
          for (int t = 0; t < src; ++t) sum += e[t] = (u(rng) < 0.05 ? 0.0 : std::exp(4 * u(rng)));
          if (sum == 0) e[0] = sum = 1;
          for (int t = 0; t < src; ++t)
            w[size_t((lay.pair(lay.site_source(k, t), k) * sh.H + h) * sh.N + n)] =
                double(float(e[t] / sum));
        }
    Tensor wc(cpu->allocate(w.size() * 4), DType::F32, {P, sh.H, sh.N});
    Tensor wg(gpu->allocate(w.size() * 4), DType::F32, {P, sh.H, sh.N});
    cpu->upload(wc, w.data());
    gpu->upload(wg, w.data());
    for (int site = 0; site < sh.S; ++site) {
      const int64_t n_stats = int64_t(sh.H) * (lay.site_sources(site) + 1) + 1;
      std::vector<double> start(static_cast<size_t>(n_stats)), c(start.size()), g(start.size());
      for (double& x : start) x = u(rng);
      Tensor sc(cpu->allocate(start.size() * 8), DType::F64, {n_stats});
      Tensor sg(gpu->allocate(start.size() * 8), DType::F64, {n_stats});
      cpu->upload(sc, start.data());
      gpu->upload(sg, start.data());
      cpu->routing_stats(sc, wc, lay, site, sh.H);
      gpu->routing_stats(sg, wg, lay, site, sh.H);
      cpu->download(c.data(), sc);
      gpu->download(g.data(), sg);
      for (int64_t k = 0; k < n_stats; ++k)
        EXPECT_NEAR(g[k], c[k], 1e-10 * std::max(1.0, std::fabs(c[k])))
            << "S " << sh.S << " block " << sh.block << " H " << sh.H << " N " << sh.N << " site "
            << site << " stat " << k;
      cpu->release(sc.data);
      gpu->release(sg.data);
    }
    cpu->release(wc.data);
    gpu->release(wg.data);
  }
}

}  // namespace
}  // namespace mhar::test
