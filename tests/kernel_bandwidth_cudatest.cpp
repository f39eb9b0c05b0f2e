// kernel_bandwidth_cudatest.cpp: achieved bandwidth of the memory-bound kernels (RMSNorm
// and QK-norm forward/backward, the fused QK-norm + RoPE, RoPE, SwiGLU, add/add_inplace, the
// cross-entropy) at the 100M / 350M / 1B standard shapes (16384 tokens a step), and the
// fused residual add + RMSNorm against the two ops it replaces. Not a parity test and no
// pass/fail on speed: DISABLED_ so plain runs skip it; run with
// --gtest_also_run_disabled_tests on the GPU.
// Each line: the bytes the op must move (each input read once, each output written once;
// an implementation's temporaries, such as the RMSNorm dw partial rows, not counted), the
// median device time of `reps` calls (timing marks = CUDA events around each call, after
// 3 warm-ups), TB/s, and % of the 4.3 TB/s copy rate measured on an H200 (and % of the
// copy rate measured in this run). Inputs are random, never zeros; when one call's bytes
// are under 4x a 50 MB L2, the calls rotate over several input sets so that no call reads
// what the previous one left in L2.
// NormKernelVersions: every kernel-lab version of the norm kernels (cuda/norm.cu,
// cuda::norm_set_kernel_version) at the 1B shapes, version 1 timed again last (the spread
// between two runs of one version: differences below it are noise), so that one device
// call measures them all and picks the defaults; then the model's QK-norm + RoPE call of
// q and k together (one launch) against the two tensors timed apart above.
// NormBackwardScaling: the RMSNorm backward's time over the row count, split by a fitted
// line into a fixed part per call and a rate per row.
// CrossEntropyVersions: the cross-entropy's versions at the models' classifier chunks.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "cuda/kernels.h"
#include "tests/bandwidth_test_util.h"

namespace mhar::test {
namespace {

struct Shape {
  const char* name;
  int64_t B, T, d, H, Hkv, hd, ff;
};
constexpr Shape k100M{"100M", 8, 2048, 512, 8, 4, 128, 1536};
constexpr Shape k350M{"350M", 16, 1024, 1024, 16, 8, 128, 4096};
constexpr Shape k1B{"1B", 16, 1024, 1280, 16, 8, 128, 5120};

class KernelBandwidth : public BandwidthTest {
 protected:
  // Runs f(label) once per version of a kernel-lab kernel (cuda::norm_set_kernel_version):
  // {0} is the default alone (no label), else each listed version, labelled " vN"; the
  // default is restored after.
  template <class F>
  void each_version(cuda::NormKernel k, const std::vector<int>& versions, F&& f) {
    for (int v : versions) {
      cuda::norm_set_kernel_version(k, v);
      f(v <= 0 ? std::string() : " v" + std::to_string(v));
    }
    cuda::norm_set_kernel_version(k, 0);
  }

  // `sets` input sets of an RMSNorm over [R, D] (x, dy and an old dx random; y for the
  // forward's output) and the weight, rstd and dw they share.
  struct NormSets {
    NormSets(Buffer w_, Buffer rstd_, Buffer dw_)
        : w(std::move(w_)), rstd(std::move(rstd_)), dw(std::move(dw_)) {}
    std::vector<Buffer> x, y, dy, dx;
    Buffer w, rstd, dw;
  };
  NormSets norm_sets(int64_t R, int64_t D, int sets) {
    NormSets n(random_gpu(DType::BF16, {D}), Buffer(*gpu, DType::F32, {R}),
               Buffer(*gpu, DType::F32, {D}));
    for (int i = 0; i < sets; ++i) {
      n.x.push_back(random_gpu(DType::BF16, {R, D}, 2.0));
      n.y.emplace_back(*gpu, DType::BF16, std::initializer_list<int64_t>{R, D});
      n.dy.push_back(random_gpu(DType::BF16, {R, D}));
      n.dx.push_back(random_gpu(DType::BF16, {R, D}));
    }
    return n;
  }

  // RMSNorm over [R, D]: forward reads x, writes y and rstd; backward reads dy, x, rstd,
  // writes dx (reads it too when accumulating), dw += (D fp32, read and written).
  void norms(const std::string& what, int64_t R, int64_t D, const std::string& at,
             const std::vector<int>& fwd_versions = {0}, const std::vector<int>& bwd_versions = {0}) {
    const double row = 2.0 * R * D, fwd = 2 * row + 4.0 * R, bwd = 3 * row + 4.0 * R + 8.0 * D;
    const int sets = sets_for(fwd);
    NormSets n = norm_sets(R, D, sets);
    auto &x = n.x, &y = n.y, &dy = n.dy, &dx = n.dx;
    const Buffer &w = n.w, &rstd = n.rstd, &dw = n.dw;
    const std::string tag = " [" + std::to_string(R) + ", " + std::to_string(D) + "]" + at;
    each_version(cuda::NormKernel::Forward, fwd_versions, [&](const std::string& v) {
      report(what + " forward" + v + tag, fwd, median_ms([&](int i) {
               gpu->rmsnorm_forward(y[size_t(i)], rstd, x[size_t(i)], w, 1e-6);
             }, sets));
    });
    if (bwd_versions.empty()) return;
    gpu->rmsnorm_forward(y[0], rstd, x[0], w, 1e-6);  // a valid rstd
    each_version(cuda::NormKernel::Backward, bwd_versions, [&](const std::string& v) {
      for (bool acc : {false, true})
        report(what + " backward" + (acc ? " dx+=" : "") + v + tag, bwd + (acc ? row : 0.0),
               median_ms([&](int i) {
                 gpu->rmsnorm_backward(dx[size_t(i)], dw, dy[size_t(i)], x[size_t(i)], w, rstd,
                                       acc);
               }, sets));
    });
  }

  // Fused QK-norm + RoPE on [B, T, heads, hd]: the norm's bytes (the rotation is free).
  void qk(const std::string& what, const Shape& sh, int64_t heads, const std::string& at,
          const std::vector<int>& versions = {0}) {
    const int64_t N = sh.B * sh.T, R = N * heads, D = sh.hd;
    const double row = 2.0 * R * D, fwd = 2 * row + 4.0 * R, bwd = 3 * row + 4.0 * R + 8.0 * D;
    const int sets = sets_for(fwd);
    std::vector<Buffer> x, y, dy, dx;
    for (int i = 0; i < sets; ++i) {
      x.push_back(random_gpu(DType::BF16, {R, D}, 2.0));
      y.emplace_back(*gpu, DType::BF16, std::initializer_list<int64_t>{sh.B, sh.T, heads, D});
      dy.push_back(random_gpu(DType::BF16, {sh.B, sh.T, heads, D}));
      dx.emplace_back(*gpu, DType::BF16, std::initializer_list<int64_t>{R, D});
    }
    Buffer w = random_gpu(DType::BF16, {D}), rstd(*gpu, DType::F32, {R});
    Buffer dw(*gpu, DType::F32, {D});
    const std::string tag = " [" + std::to_string(sh.B) + ", " + std::to_string(sh.T) + ", " +
                            std::to_string(heads) + ", " + std::to_string(D) + "]" + at;
    each_version(cuda::NormKernel::QkNormRope, versions, [&](const std::string& v) {
      report(what + " forward" + v + tag, fwd, median_ms([&](int i) {
               gpu->qk_norm_rope_forward(y[size_t(i)], rstd, x[size_t(i)], w, 1e-6, 1e6, 0);
             }, sets));
      gpu->rmsnorm_forward(dx[0], rstd, x[0], w, 1e-6);  // a valid rstd
      report(what + " backward" + v + tag, bwd, median_ms([&](int i) {
               gpu->qk_norm_rope_backward(dx[size_t(i)], dw, dy[size_t(i)], x[size_t(i)], w, rstd,
                                          1e6, false);
             }, sets));
    });
  }

  // q and k in one call (qk_norm_rope_forward_qk / _backward_qk, the model's): both
  // tensors' bytes; QK version 6 (two launches) and 7 (one), twice each, alternating.
  void qk_pair(const Shape& sh, const std::string& at) {
    const int64_t N = sh.B * sh.T, D = sh.hd;
    double fwd = 0, bwd = 0;
    struct Side {
      Buffer x, y, dy, dx, w, rstd, dw;
    };
    std::vector<Side> sides;
    for (int64_t heads : {sh.H, sh.Hkv}) {
      const int64_t R = N * heads;
      const double row = 2.0 * R * D;
      fwd += 2 * row + 4.0 * R;
      bwd += 3 * row + 4.0 * R + 8.0 * D;
      Buffer x = random_gpu(DType::BF16, {R, D}, 2.0), w = random_gpu(DType::BF16, {D});
      Buffer dy = random_gpu(DType::BF16, {sh.B, sh.T, heads, D});
      Buffer y(*gpu, DType::BF16, {sh.B, sh.T, heads, D}), dx(*gpu, DType::BF16, {R, D});
      Buffer rstd(*gpu, DType::F32, {R}), dw(*gpu, DType::F32, {D});
      sides.push_back(Side{std::move(x), std::move(y), std::move(dy), std::move(dx), std::move(w),
                           std::move(rstd), std::move(dw)});
    }
    Side& q = sides[0];
    Side& k = sides[1];
    const std::string tag = " [" + std::to_string(sh.B) + ", " + std::to_string(sh.T) + ", " +
                            std::to_string(sh.H) + "+" + std::to_string(sh.Hkv) + ", " +
                            std::to_string(D) + "]" + at;
    // Version 6: the two calls in turn; version 7: one launch.
    each_version(cuda::NormKernel::QkNormRope, {6, 7, 6, 7}, [&](const std::string& v) {
      report("qk-norm+rope fused q+k one call forward" + v + tag, fwd, median_ms([&](int) {
               gpu->qk_norm_rope_forward_qk({q.y, q.rstd, q.x, q.w}, {k.y, k.rstd, k.x, k.w},
                                            1e-6, 1e6, 0);
             }, 1));
      report("qk-norm+rope fused q+k one call backward" + v + tag, bwd, median_ms([&](int) {
               gpu->qk_norm_rope_backward_qk({q.dx, q.dw, q.dy, q.x, q.w, q.rstd},
                                             {k.dx, k.dw, k.dy, k.x, k.w, k.rstd}, 1e6, false);
             }, 1));
    });
  }

  // Residual add + RMSNorm over [R, D] (the standard scheme's sites): the fused op reads
  // a, b, w and writes x, y, rstd; the two ops it replaces, timed together (two_ops), must
  // move x once more (written by the add, read by the norm).
  void add_norm(int64_t R, int64_t D, const std::string& at, bool two_ops,
                const std::vector<int>& versions = {0}) {
    const double row = 2.0 * R * D, fused = 4 * row + 4.0 * R + 2.0 * D;
    const int sets = sets_for(fused);
    std::vector<Buffer> a, b, x, y;
    for (int i = 0; i < sets; ++i) {
      a.push_back(random_gpu(DType::BF16, {R, D}, 2.0));
      b.push_back(random_gpu(DType::BF16, {R, D}));
      x.emplace_back(*gpu, DType::BF16, std::initializer_list<int64_t>{R, D});
      y.emplace_back(*gpu, DType::BF16, std::initializer_list<int64_t>{R, D});
    }
    Buffer w = random_gpu(DType::BF16, {D}), rstd(*gpu, DType::F32, {R});
    const std::string tag = " [" + std::to_string(R) + ", " + std::to_string(D) + "]" + at;
    each_version(cuda::NormKernel::Forward, versions, [&](const std::string& v) {
      report("add+rmsnorm fused forward" + v + tag, fused, median_ms([&](int i) {
               const size_t k = size_t(i);
               gpu->add_rmsnorm_forward(x[k], y[k], rstd, a[k], b[k], w, 1e-6);
             }, sets));
    });
    if (!two_ops) return;
    report("add then rmsnorm (two ops, fused bytes)" + tag, fused, median_ms([&](int i) {
             const size_t k = size_t(i);
             gpu->add(x[k], a[k], b[k]);
             gpu->rmsnorm_forward(y[k], rstd, x[k], w, 1e-6);
           }, sets));
  }
};

TEST_F(KernelBandwidth, DISABLED_MemoryBoundKernels) {
  measure_copy_rate();
  for (const Shape& sh : {k100M, k350M, k1B}) {
    const int64_t N = sh.B * sh.T, d = sh.d;
    const std::string at = std::string(" ") + sh.name;
    add_norm(N, d, at, true);
    qk("qk-norm+rope fused q", sh, sh.H, at);
    qk("qk-norm+rope fused k", sh, sh.Hkv, at);
    norms("rmsnorm", N, d, at);
    norms("qk-norm q", N * sh.H, sh.hd, at);
    norms("qk-norm k", N * sh.Hkv, sh.hd, at);
    // RoPE in place on [B, T, heads, hd]: reads and writes x once.
    for (auto [what, heads] : {std::pair<const char*, int64_t>{"rope q", sh.H}, {"rope k", sh.Hkv}}) {
      const double bytes = 2.0 * 2 * N * heads * sh.hd;
      const int sets = sets_for(bytes);
      std::vector<Buffer> x;
      for (int i = 0; i < sets; ++i) x.push_back(random_gpu(DType::BF16, {sh.B, sh.T, heads, sh.hd}));
      const std::string tag = std::string(what) + " [" + std::to_string(sh.B) + ", " +
                              std::to_string(sh.T) + ", " + std::to_string(heads) + ", " +
                              std::to_string(sh.hd) + "]" + at;
      for (bool bwd : {false, true})
        report(tag + (bwd ? " backward" : " forward"), bytes,
               median_ms([&](int i) { gpu->rope(x[size_t(i)], 1e6, bwd); }, sets));
    }
    // SwiGLU over [N, ff]: forward reads gate, up, writes h; backward reads dh, gate, up,
    // writes dgate, dup and h again (as the model runs it: it keeps no h for the backward).
    {
      const int64_t n = N * sh.ff;
      const double e = 2.0 * n;
      const int sets = sets_for(3 * e);
      std::vector<Buffer> gu, h, dgu, h_again;
      for (int i = 0; i < sets; ++i) {
        h_again.emplace_back(*gpu, DType::BF16, std::initializer_list<int64_t>{N, sh.ff});
        gu.push_back(random_gpu(DType::BF16, {N, 2 * sh.ff}, 3.0));
        h.push_back(random_gpu(DType::BF16, {N, sh.ff}));
        dgu.emplace_back(*gpu, DType::BF16, std::initializer_list<int64_t>{N, 2 * sh.ff});
      }
      const std::string tag = " [" + std::to_string(N) + " x " + std::to_string(sh.ff) + "]" + at;
      report("swiglu forward" + tag, 3 * e, median_ms([&](int i) {
               const size_t k = size_t(i);
               gpu->swiglu_forward(h_again[k], gu[k]);
             }, sets));
      report("swiglu backward" + tag, 6 * e, median_ms([&](int i) {
               const size_t k = size_t(i);
               gpu->swiglu_backward(dgu[k], h_again[k], h[k], gu[k]);
             }, sets));
    }
    // Residual adds over [N, d]: out = a + b and y += x in bf16; the fp32 += bf16 mix.
    {
      const int64_t n = N * d;
      const int sets = sets_for(3 * 2.0 * n);
      std::vector<Buffer> a, b, o, yf;
      for (int i = 0; i < sets; ++i) {
        a.push_back(random_gpu(DType::BF16, {n}));
        b.push_back(random_gpu(DType::BF16, {n}));
        o.push_back(random_gpu(DType::BF16, {n}));
        yf.push_back(random_gpu(DType::F32, {n}));
      }
      const std::string tag = " [" + std::to_string(N) + " x " + std::to_string(d) + "]" + at;
      report("add bf16 = bf16 + bf16" + tag, 3 * 2.0 * n,
             median_ms([&](int i) { gpu->add(o[size_t(i)], a[size_t(i)], b[size_t(i)]); }, sets));
      // Each call adds a to o again: values grow by at most reps * |a| <= ~30, still
      // ordinary finite bf16.
      report("add_inplace bf16 += bf16" + tag, 3 * 2.0 * n,
             median_ms([&](int i) { gpu->add_inplace(o[size_t(i)], a[size_t(i)]); }, sets));
      report("add_inplace f32 += bf16" + tag, (4 + 4 + 2) * double(n),
             median_ms([&](int i) { gpu->add_inplace(yf[size_t(i)], a[size_t(i)]); }, sets));
    }
  }
}

// Versions 1 .. n of each lab kernel, then version 1 again, at the 1B shapes of the
// standard path's norm calls: the residual add + norm and the final norm (forward), the
// sublayer norms' backward (+=, and = at the head), the fused QK-norm + RoPE of q and k.
TEST_F(KernelBandwidth, DISABLED_NormKernelVersions) {
  measure_copy_rate();
  auto all = [](cuda::NormKernel k) {
    std::vector<int> v;
    for (int i = 1; i <= cuda::norm_kernel_versions(k); ++i) v.push_back(i);
    v.push_back(1);
    return v;
  };
  const Shape& sh = k1B;
  const int64_t N = sh.B * sh.T;
  const std::string at = std::string(" ") + sh.name;
  add_norm(N, sh.d, at, false, all(cuda::NormKernel::Forward));
  norms("rmsnorm", N, sh.d, at, all(cuda::NormKernel::Forward), all(cuda::NormKernel::Backward));
  qk("qk-norm+rope fused q", sh, sh.H, at, all(cuda::NormKernel::QkNormRope));
  qk("qk-norm+rope fused k", sh, sh.Hkv, at, all(cuda::NormKernel::QkNormRope));
  qk_pair(sh, at);
}

// NormBackwardScaling: the RMSNorm backward (versions 5 and 10-12, overwriting and "+=") at
// 1B's row width over 4,096-65,536 rows, beside add (out = a + b: the overwriting
// backward's bytes, two rows read and one written, with no reduction) and the forward.
// A line fitted to each op's times over the rows separates what a call costs whatever its
// size (launches, dw's partial rows and finish, the grid's ramp and tail) from what a row
// costs, as a rate against this run's copy rate: it says whether 1B's 16,384 rows miss
// the copy rate in the rows' own work or in the call's fixed part (cuda/NOTES.md lead 4).
TEST_F(KernelBandwidth, DISABLED_NormBackwardScaling) {
  measure_copy_rate();
  constexpr int64_t D = 1280;
  const int64_t rows[] = {4096, 8192, 16384, 32768, 65536};
  struct Series {
    std::string name;
    double row_bytes;  // bytes a row moves, as the report lines count them
    std::vector<std::pair<double, double>> r_ms;
  };
  std::vector<Series> series;  // in the order first timed
  // A row of bf16; dw's D floats, read and written once a call.
  const double row = 2.0 * D, dw_bytes = 8.0 * D;
  for (int64_t R : rows) {
    const int sets = sets_for(3 * row * double(R));
    NormSets n = norm_sets(R, D, sets);
    auto &x = n.x, &y = n.y, &dy = n.dy, &dx = n.dx;
    const Buffer &w = n.w, &rstd = n.rstd, &dw = n.dw;
    const std::string tag = " [" + std::to_string(R) + ", " + std::to_string(D) + "]";
    // Times op as series `name` (a row moving row_bytes, a call call_bytes more).
    auto time = [&](const std::string& name, double row_bytes, double call_bytes,
                    const std::function<void(int)>& op) {
      auto it = std::find_if(series.begin(), series.end(),
                             [&](const Series& s) { return s.name == name; });
      if (it == series.end()) it = series.insert(it, Series{name, row_bytes, {}});
      const double ms = median_ms(op, sets);
      report(name + tag, row_bytes * double(R) + call_bytes, ms);
      it->r_ms.emplace_back(double(R), ms);
    };
    auto backward = [&](bool acc) {
      return [&, acc](int i) {
        gpu->rmsnorm_backward(dx[size_t(i)], dw, dy[size_t(i)], x[size_t(i)], w, rstd, acc);
      };
    };
    time("add (a + b)", 3 * row, 0,
         [&](int i) { gpu->add(y[size_t(i)], x[size_t(i)], dy[size_t(i)]); });
    time("rmsnorm forward", 2 * row + 4, 0,
         [&](int i) { gpu->rmsnorm_forward(y[size_t(i)], rstd, x[size_t(i)], w, 1e-6); });
    for (int v : {5, 10, 11, 12}) {
      cuda::norm_set_kernel_version(cuda::NormKernel::Backward, v);
      const std::string suffix = " v" + std::to_string(v);
      time("rmsnorm backward" + suffix, 3 * row + 4, dw_bytes, backward(false));
      time("rmsnorm backward dx+=" + suffix, 4 * row + 4, dw_bytes, backward(true));
    }
    // The main kernel without dw's finish (dw left unfinished: timing only), so that the
    // fixed part above splits into the finish with its launch and the main kernel's own.
    cuda::norm_set_kernel_version(cuda::NormKernel::Backward, 10);
    const bool skipped = cuda::norm_lab_skip_dw_finish(true);
    time("rmsnorm backward v10 main kernel only", 3 * row + 4, dw_bytes, backward(false));
    cuda::norm_lab_skip_dw_finish(skipped);
    cuda::norm_set_kernel_version(cuda::NormKernel::Backward, 0);
  }
  // Least squares ms = fixed + R * per_row over the sizes.
  for (const Series& s : series) {
    double n = 0, sr = 0, sm = 0, srr = 0, srm = 0;
    for (auto [r, ms] : s.r_ms) {
      n += 1;
      sr += r;
      sm += ms;
      srr += r * r;
      srm += r * ms;
    }
    const double per_row = (n * srm - sr * sm) / (n * srr - sr * sr),
                 fixed = (sm - per_row * sr) / n;
    const double tbs = s.row_bytes / per_row * 1e-9;
    double worst = 0;  // the fit's largest miss, as a share of that size's time
    for (auto [r, ms] : s.r_ms) worst = std::max(worst, std::abs(fixed + per_row * r - ms) / ms);
    std::printf(
        "SCALING %-28s fixed %6.2f us  rows at %5.2f TB/s = %5.1f%% of copy here"
        "  (fit within %.1f%%)\n",
        s.name.c_str(), fixed * 1e3, tbs, 100.0 * tbs / copy_tbs_, 100.0 * worst);
  }
}

// The cross-entropy with its gradient (cuda/classifier.cu, cuda::cross_entropy_set_version)
// at Qwen3's 151,936 words over 2,048 tokens (the chunk the earlier figures used) and 5,462
// (the automatic chunk of the 100M-1B configs: 16,384 tokens in 3 chunks of at most 2 GiB),
// and a GPT-2-sized vocabulary of odd width (every row misaligned); bf16 logits. The op must read
// the logits once and write their gradient in place once (plus the targets and losses); version 1
// reads them twice. One input set (0.6-1.7 GB, 12x L2 and more); each call overwrites the logits
// with their gradient, which the next call takes as its logits. Every version in turn, twice.
TEST_F(KernelBandwidth, DISABLED_CrossEntropyVersions) {
  measure_copy_rate();
  const std::pair<int64_t, int64_t> chunks[] = {{2048, 151936}, {5462, 151936}, {4096, 50257}};
  for (auto [rows, V] : chunks) {
    Buffer logits = random_gpu(DType::BF16, {rows, V}, 3.0);
    Buffer targets(*gpu, DType::I32, {rows}), losses(*gpu, DType::F32, {rows});
    std::vector<int32_t> ids(static_cast<size_t>(rows));
    for (size_t i = 0; i < ids.size(); ++i) ids[i] = int32_t((i * 7919) % size_t(V));
    gpu->upload_tokens(targets, ids.data());
    const double bytes = 2 * 2.0 * double(rows) * double(V) + 8.0 * double(rows);
    const std::string tag = " [" + std::to_string(rows) + ", " + std::to_string(V) + "]";
    const int versions = cuda::cross_entropy_versions();
    for (int round = 0; round < 2 * versions; ++round) {
      const int version = 1 + round % versions;
      cuda::cross_entropy_set_version(version);
      report("cross_entropy with gradient v" + std::to_string(version) + tag, bytes,
             median_ms([&](int) { gpu->cross_entropy(losses, logits, targets, 1.0, true); }, 1));
    }
  }
  cuda::cross_entropy_set_version(0);
}

}  // namespace
}  // namespace mhar::test
