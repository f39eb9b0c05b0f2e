// hyper_cudatest.cpp: the CUDA Hyper-Connections stream ops (cuda/hyper.cu) held to the
// contract hyper_test.cpp states for the CPU reference (backend.h's equations; outputs
// an op overwrites are poisoned with NaN first, gradients it adds to start pre-filled),
// against the CPU backend in fp64 on the same bf16-rounded inputs, static and dynamic
// (per-token coefficients), and the backend's refusals (too many streams, rows that are
// not a multiple of 8) before a model is built.
// Two input regimes:
// - exact: every input a multiple of 2^-3 (bf16-exact, |x| <= 2), every pre-filled
//   gradient a multiple of 2^-6, rows sparse enough at large N*d that the absolute terms
//   of a coefficient gradient sum to under 2^18 (asserted). Then every product and
//   partial sum the GPU forms in fp32 is a multiple of 2^-6 below 2^18 in magnitude, so
//   exact in any order: each bf16 output
//   must be the fp64 reference rounded once to bf16 (round to nearest even), bit for bit,
//   and each F32 coefficient gradient the reference exactly. A missing, doubled or
//   misplaced element of any sum fails this, however small.
// - random normal inputs (the ordinary case, with cancellation): elementwise
//   |gpu - ref| <= 2^-8 |ref| + (1 + 2^-8) gamma_K A, with A the sum of the absolute terms
//   (the same op on |inputs| on the CPU), K the number of terms and gamma_K =
//   K u / (1 - K u), u = 2^-24: fp32 summation of K exact bf16 x bf16 products errs by at
//   most gamma_K A in any order, and the one bf16 rounding of the result by 2^-8 of it
//   (8-bit significand). F32 outputs skip the 2^-8.
// Sizes cover n = 1..8 streams, a single chunk per thread and many (grid-stride loops),
// and the bit-identical repeat of the coefficient gradients (deterministic sums).
// Dynamic (HyperDynamicParity): the four stream ops take the coefficients C as an F32
// input, so they get both regimes above (C dyadic too in the exact one). The
// coefficients (an unscaled RMSNorm, a projection, tanh) and their backward get random
// inputs only, each element held to a bound built from its own reference values: the
// fp32 error of each sum (gamma_K times its absolute terms), rsqrt's and tanhf's
// documented error (2 ulp) carried through the slope of tanh, and the one rounding of
// each output (check_coef states each). The parameter gradients are compared after a
// second run too: bit-identical.
// DISABLED_Throughput (both fixtures) times each op at the 1B shape against the bytes
// it must move.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "engine/config.h"
#include "engine/model.h"
#include "tests/cuda_test_util.h"
#include "tests/model_test_util.h"

namespace mhar::test {
namespace {

// Host values of every input of the four ops, and of every output.
struct Inputs {
  std::vector<double> H, dx, v, dout, am, ar, b;  // streams / rows / coefficients
  std::vector<double> dH0, dam0, dar0, db0;       // pre-filled "+=" outputs
};
struct Outputs {
  // bf16 (act dtype) outputs
  std::vector<double> mix, sum, dH, dH_acc, dH_sum, update, din, dv;
  // grad dtype ("+=") outputs
  std::vector<double> dam, dam_acc, dar, db;
};

// Buffers on one backend that live as long as the set: buf(dtype, shape, &values), or
// poisoned with nullptr (for outputs an op overwrites).
struct BufferSet {
  Backend& be;
  std::vector<std::unique_ptr<Buffer>> keep;
  Buffer* operator()(DType t, std::initializer_list<int64_t> shape, const std::vector<double>* v) {
    keep.push_back(std::make_unique<Buffer>(be, t, shape));
    if (v) keep.back()->set(*v);
    else keep.back()->poison();
    return keep.back().get();
  }
};

// Runs every op once on `be` (act/grad its own dtypes) with the given inputs; outputs
// that an op overwrites are poisoned first.
Outputs run_ops(Backend& be, int n, int64_t N, int64_t d, const Inputs& in) {
  const DType act = be.act_dtype(), grad = be.grad_dtype();
  BufferSet buf{be, {}};
  Buffer *H = buf(act, {n, N, d}, &in.H), *dx = buf(act, {N, d}, &in.dx),
         *v = buf(act, {N, d}, &in.v), *dout = buf(act, {n, N, d}, &in.dout),
         *am = buf(act, {n}, &in.am), *ar = buf(act, {n * n}, &in.ar), *b = buf(act, {n}, &in.b);
  Outputs o;
  Buffer* x = buf(act, {N, d}, nullptr);
  be.hyper_mix(*x, *H, *am);
  o.mix = x->get();
  x->poison();
  be.hyper_mix(*x, *H, Tensor());
  o.sum = x->get();

  Buffer *dH = buf(act, {n, N, d}, nullptr), *dam = buf(grad, {n}, &in.dam0);
  be.hyper_mix_backward(*dH, *dam, *dx, *H, *am, false);
  o.dH = dH->get();
  o.dam = dam->get();
  dH->set(in.dH0);
  be.hyper_mix_backward(*dH, *dam, *dx, *H, *am, true);
  o.dH_acc = dH->get();
  o.dam_acc = dam->get();  // dam0 + 2 <dx, H[i]>
  dH->poison();
  be.hyper_mix_backward(*dH, Tensor(), *dx, Tensor(), Tensor(), false);
  o.dH_sum = dH->get();

  Buffer* out = buf(act, {n, N, d}, nullptr);
  be.hyper_update(*out, *H, *v, *ar, *b);
  o.update = out->get();

  Buffer *din = buf(act, {n, N, d}, nullptr), *dv = buf(act, {N, d}, nullptr),
         *dar = buf(grad, {n * n}, &in.dar0), *db = buf(grad, {n}, &in.db0);
  be.hyper_update_backward(*din, *dv, *dar, *db, *dout, *H, *v, *ar, *b);
  o.din = din->get();
  o.dv = dv->get();
  o.dar = dar->get();
  o.db = db->get();
  return o;
}

Inputs abs_of(Inputs in) {
  for (auto* v : {&in.H, &in.dx, &in.v, &in.dout, &in.am, &in.ar, &in.b, &in.dH0, &in.dam0,
                  &in.dar0, &in.db0})
    for (double& x : *v) x = std::fabs(x);
  return in;
}

// Higham's gamma_K for fp32 (u = 2^-24): the relative error bound of K roundings.
double gamma32(double K) { return K * 0x1p-24 / (1 - K * 0x1p-24); }

// Elementwise |got - want| <= bound (a bound of 0: bit for bit); NaN (an unwritten
// element) fails. Prints one PARITY line.
void expect_within(const std::string& tag, const char* what, const std::vector<double>& got,
                   const std::vector<double>& want, const std::vector<double>& bound,
                   bool exact) {
  ASSERT_EQ(got.size(), want.size()) << tag << " " << what;
  ASSERT_EQ(bound.size(), want.size()) << tag << " " << what;
  int64_t bad = 0;
  double worst = 0;  // largest |err| / bound
  for (size_t e = 0; e < want.size(); ++e) {
    const double err = std::fabs(got[e] - want[e]);
    if (!(err <= bound[e])) {
      if (bad < 5)
        ADD_FAILURE() << tag << " " << what << " [" << e << "]: gpu " << got[e] << ", want "
                      << want[e] << " (bound " << bound[e] << ")";
      ++bad;
    }
    if (bound[e] > 0) worst = std::max(worst, err / bound[e]);
  }
  std::printf("PARITY hyper %-28s %-16s %s  worst err/bound %.3f  bad %lld\n", tag.c_str(), what,
              exact ? "bit-exact" : "bounded  ", worst, static_cast<long long>(bad));
  EXPECT_EQ(bad, 0) << tag << " " << what;
}

// An output that is a sum of K products of the inputs (a pre-filled value counts as one)
// against the fp64 reference `ref`, A the same sum of absolute values (header): exact
// regime bit for bit (bf16: the reference rounded once; F32: the reference itself, whose
// every partial sum must then be exact in fp32: A < 2^18, asserted); otherwise
// |gpu - ref| <= 2^-8 |ref| (bf16 only) + (1 + 2^-8) gamma_K A.
void expect_sum_parity(const std::string& tag, const char* what, const std::vector<double>& got,
                       const std::vector<double>& ref, const std::vector<double>& A, double K,
                       bool bf16, bool exact) {
  ASSERT_EQ(A.size(), ref.size()) << tag << " " << what;
  std::vector<double> want(ref.size()), bound(ref.size());
  for (size_t e = 0; e < ref.size(); ++e) {
    if (exact && !bf16) {
      ASSERT_LT(A[e], 0x1p18) << tag << " " << what << ": not exact in fp32";
    }
    want[e] = exact && bf16 ? round_to(DType::BF16, ref[e]) : ref[e];
    bound[e] = exact ? 0.0
                     : (bf16 ? 0x1p-8 * std::fabs(ref[e]) : 0.0) + (1 + 0x1p-8) * gamma32(K) * A[e];
  }
  expect_within(tag, what, got, want, bound, exact);
}

class HyperParity : public CudaParity {
 protected:
  // Values for `count` elements: exact regime multiples of 2^-shift with |x| <= 2, zero
  // with probability 1 - density; otherwise normal, rounded to `t`.
  std::vector<double> draw(int64_t count, bool exact, int shift, DType t, double density = 1) {
    if (!exact) return random_normal(rng, count, t);
    std::uniform_int_distribution<int> k(-(2 << shift), 2 << shift);
    std::uniform_real_distribution<double> u(0, 1);
    std::vector<double> v(static_cast<size_t>(count));
    for (double& x : v) x = u(rng) < density ? std::ldexp(double(k(rng)), -shift) : 0.0;
    return v;
  }

  void check(int n, int64_t N, int64_t d, bool exact) {
    const std::string tag = std::string(exact ? "exact" : "random") + " n" + std::to_string(n) +
                            " N" + std::to_string(N) + " d" + std::to_string(d);
    const int64_t M = N * d;
    // Exact regime: a coefficient gradient's terms (products of two rows, |x y| <= 4)
    // must sum to under 2^18 in absolute value for every partial sum to be exact; rows
    // with about 2^15 / M nonzero products keep it so at any M (checked below).
    const double dens = exact ? std::min(1.0, std::sqrt(32768.0 / double(M))) : 1.0;
    Inputs in;
    in.H = draw(n * M, exact, 3, DType::BF16, dens);
    in.dx = draw(M, exact, 3, DType::BF16, dens);
    in.v = draw(M, exact, 3, DType::BF16, dens);
    in.dout = draw(n * M, exact, 3, DType::BF16, dens);
    in.am = draw(n, exact, 3, DType::BF16);
    in.ar = draw(n * n, exact, 3, DType::BF16);
    in.b = draw(n, exact, 3, DType::BF16);
    in.dH0 = draw(n * M, exact, 3, DType::BF16);
    // multiples of 2^-6 (|x| <= 2) in the exact regime
    in.dam0 = draw(n, exact, 6, DType::F32);
    in.dar0 = draw(n * n, exact, 6, DType::F32);
    in.db0 = draw(n, exact, 6, DType::F32);

    auto ref_be = make_cpu_backend(DType::F64);
    const Outputs g = run_ops(*gpu, n, N, d, in), r = run_ops(*ref_be, n, N, d, in),
                  a = run_ops(*ref_be, n, N, d, abs_of(in));

    auto cmp = [&](const char* what, const std::vector<double>& got,
                   const std::vector<double>& ref, const std::vector<double>& A, double K,
                   bool bf16) { expect_sum_parity(tag, what, got, ref, A, K, bf16, exact); };
    const double Mg = double(M) + 1;  // terms of a coefficient gradient, with its pre-fill
    cmp("mix", g.mix, r.mix, a.mix, n, true);
    cmp("sum", g.sum, r.sum, a.sum, n, true);
    cmp("mix dH", g.dH, r.dH, a.dH, 1, true);
    cmp("mix dH +=", g.dH_acc, r.dH_acc, a.dH_acc, 2, true);
    cmp("sum dH", g.dH_sum, r.dH_sum, a.dH_sum, 1, true);
    cmp("mix dA_m", g.dam, r.dam, a.dam, Mg, false);
    cmp("mix dA_m 2x", g.dam_acc, r.dam_acc, a.dam_acc, 2 * Mg, false);
    cmp("update", g.update, r.update, a.update, n + 1, true);
    cmp("update din", g.din, r.din, a.din, n, true);
    cmp("update dv", g.dv, r.dv, a.dv, n, true);
    cmp("update dA_r", g.dar, r.dar, a.dar, Mg, false);
    cmp("update dB", g.db, r.db, a.db, Mg, false);

    // The coefficient gradients are sums in a fixed order: a second run reproduces
    // every bit (training resumes bit-exactly).
    const Outputs g2 = run_ops(*gpu, n, N, d, in);
    EXPECT_EQ(g2.dam, g.dam) << tag;
    EXPECT_EQ(g2.dam_acc, g.dam_acc) << tag;
    EXPECT_EQ(g2.dar, g.dar) << tag;
    EXPECT_EQ(g2.db, g.db) << tag;
    EXPECT_EQ(g2.din, g.din) << tag;
  }
};

TEST_F(HyperParity, EveryStreamCountExact) {
  for (int n = 1; n <= 8; ++n) check(n, 37, 64, true);
}
TEST_F(HyperParity, EveryStreamCountRandom) {
  for (int n = 1; n <= 8; ++n) check(n, 37, 64, false);
}
TEST_F(HyperParity, ModelWidthsAndManyChunksPerThread) {
  check(4, 160, 1024, true);
  check(4, 160, 1024, false);
  // More chunks than the grid has threads: every thread loops (2.4M elements per stream).
  check(4, 1200, 2048, true);
  check(2, 1200, 2048, false);
}

// ---- Dynamic Hyper-Connections (residual.hyper_dynamic): per-token coefficients.

// The stream ops with given per-token coefficients C [N, n, n+2] (stat dtype).
struct DynInputs {
  std::vector<double> H, dx, v, dout, dH0, C;
};
struct DynOutputs {
  std::vector<double> mix, dH_acc, update, din, dv, dC, dC_update_only;
};

DynInputs abs_of(DynInputs in) {
  for (auto* v : {&in.H, &in.dx, &in.v, &in.dout, &in.dH0, &in.C})
    for (double& x : *v) x = std::fabs(x);
  return in;
}

// Runs the four dynamic stream ops once on `be` in the scheme's order: the update's
// backward fills dC's columns 1..n+1 (dC poisoned before), then the mix's backward its
// column 0 (so a mix backward that wrote the other columns would fail the comparison).
DynOutputs run_dyn_stream_ops(Backend& be, int n, int64_t N, int64_t d, const DynInputs& in) {
  const DType act = be.act_dtype(), st = be.stat_dtype();
  BufferSet buf{be, {}};
  Buffer *H = buf(act, {n, N, d}, &in.H), *dx = buf(act, {N, d}, &in.dx),
         *v = buf(act, {N, d}, &in.v), *dout = buf(act, {n, N, d}, &in.dout),
         *C = buf(st, {N, n, n + 2}, &in.C);
  DynOutputs o;
  Buffer* x = buf(act, {N, d}, nullptr);
  be.hyper_mix_dynamic(*x, *H, *C);
  o.mix = x->get();
  Buffer* out = buf(act, {n, N, d}, nullptr);
  be.hyper_update_dynamic(*out, *H, *v, *C);
  o.update = out->get();
  Buffer *din = buf(act, {n, N, d}, nullptr), *dv = buf(act, {N, d}, nullptr),
         *dC = buf(st, {N, n, n + 2}, nullptr);
  be.hyper_update_dynamic_backward(*din, *dv, *dC, *dout, *H, *v, *C);
  o.din = din->get();
  o.dv = dv->get();
  o.dC_update_only = dC->get();
  Buffer* dH = buf(act, {n, N, d}, &in.dH0);
  be.hyper_mix_dynamic_backward(*dH, *dC, *dx, *H, *C);
  o.dH_acc = dH->get();
  o.dC = dC->get();
  return o;
}

// The coefficients and their backward.
struct CoefInputs {
  std::vector<double> H, W, am, ar, b, sa, sb;             // forward
  std::vector<double> T, rstd, dC;                         // backward's saved / incoming
  std::vector<double> dH0, dW0, dam0, dar0, db0, dsa0, dsb0;  // pre-filled "+=" outputs
};
struct CoefOutputs {
  std::vector<double> C, T, rstd;                      // forward
  std::vector<double> dH, dW, dam, dar, db, dsa, dsb;  // backward
};

CoefInputs abs_of(CoefInputs in) {
  for (auto* v : {&in.H, &in.W, &in.am, &in.ar, &in.b, &in.sa, &in.sb, &in.T, &in.rstd, &in.dC,
                  &in.dH0, &in.dW0, &in.dam0, &in.dar0, &in.db0, &in.dsa0, &in.dsb0})
    for (double& x : *v) x = std::fabs(x);
  return in;
}

// hyper_dynamic_coef, and hyper_dynamic_coef_backward on the given (independent) T, rstd
// and dC, once each on `be`.
CoefOutputs run_coef_ops(Backend& be, int n, int64_t N, int64_t d, double eps,
                         const CoefInputs& in) {
  const DType act = be.act_dtype(), st = be.stat_dtype(), grad = be.grad_dtype();
  const int Q = n + 2;
  BufferSet buf{be, {}};
  Buffer *H = buf(act, {n, N, d}, &in.H), *W = buf(act, {d, Q}, &in.W),
         *am = buf(act, {n}, &in.am), *ar = buf(act, {n * n}, &in.ar), *b = buf(act, {n}, &in.b),
         *sa = buf(act, {1}, &in.sa), *sb = buf(act, {1}, &in.sb);
  CoefOutputs o;
  Buffer *C = buf(st, {N, n, Q}, nullptr), *T = buf(st, {N, n, Q}, nullptr),
         *rstd = buf(st, {N, n}, nullptr);
  be.hyper_dynamic_coef(*C, *T, *rstd, *H, *W, *am, *ar, *b, *sa, *sb, eps);
  o.C = C->get();
  o.T = T->get();
  o.rstd = rstd->get();

  Buffer *Ti = buf(st, {N, n, Q}, &in.T), *ri = buf(st, {N, n}, &in.rstd),
         *dC = buf(st, {N, n, Q}, &in.dC), *dH = buf(act, {n, N, d}, &in.dH0),
         *dW = buf(grad, {d, Q}, &in.dW0), *dam = buf(grad, {n}, &in.dam0),
         *dar = buf(grad, {n * n}, &in.dar0), *db = buf(grad, {n}, &in.db0),
         *dsa = buf(grad, {1}, &in.dsa0), *dsb = buf(grad, {1}, &in.dsb0);
  be.hyper_dynamic_coef_backward(*dH, *dW, *dam, *dar, *db, *dsa, *dsb, *dC, *H, *W, *Ti, *ri,
                                 *sa, *sb);
  o.dH = dH->get();
  o.dW = dW->get();
  o.dam = dam->get();
  o.dar = dar->get();
  o.db = db->get();
  o.dsa = dsa->get();
  o.dsb = dsb->get();
  return o;
}

class HyperDynamicParity : public HyperParity {
 protected:
  // The stream ops: same two regimes as the static ones (C's entries are then multiples
  // of 2^-3 too, exact in F32, so every product is again a multiple of 2^-6).
  void check_streams(int n, int64_t N, int64_t d, bool exact) {
    const std::string tag = std::string(exact ? "dyn exact" : "dyn random") + " n" +
                            std::to_string(n) + " N" + std::to_string(N) + " d" +
                            std::to_string(d);
    const int64_t M = N * d;
    DynInputs in;
    in.H = draw(n * M, exact, 3, DType::BF16);
    in.dx = draw(M, exact, 3, DType::BF16);
    in.v = draw(M, exact, 3, DType::BF16);
    in.dout = draw(n * M, exact, 3, DType::BF16);
    in.dH0 = draw(n * M, exact, 3, DType::BF16);
    in.C = draw(N * n * (n + 2), exact, 3, DType::F32);
    auto ref_be = make_cpu_backend(DType::F64);
    const DynOutputs g = run_dyn_stream_ops(*gpu, n, N, d, in),
                     r = run_dyn_stream_ops(*ref_be, n, N, d, in),
                     a = run_dyn_stream_ops(*ref_be, n, N, d, abs_of(in));
    auto cmp = [&](const char* what, const std::vector<double>& got,
                   const std::vector<double>& ref, const std::vector<double>& A, double K,
                   bool bf16) { expect_sum_parity(tag, what, got, ref, A, K, bf16, exact); };
    cmp("dyn mix", g.mix, r.mix, a.mix, n, true);
    cmp("dyn mix dH +=", g.dH_acc, r.dH_acc, a.dH_acc, 2, true);
    cmp("dyn update", g.update, r.update, a.update, n + 1, true);
    cmp("dyn update din", g.din, r.din, a.din, n, true);
    cmp("dyn update dv", g.dv, r.dv, a.dv, n, true);
    // Every column of dC: <dout_i, in_r>, <dout_i, v> and <dx, h_r> over the token's d.
    cmp("dyn dC", g.dC, r.dC, a.dC, double(d), false);
    // The update's backward leaves the mix's column alone (still the poison).
    int64_t touched = 0;
    for (int64_t p = 0; p < N * n; ++p) touched += !std::isnan(g.dC_update_only[size_t(p * (n + 2))]);
    EXPECT_EQ(touched, 0) << tag << ": hyper_update_dynamic_backward wrote dC's column 0";

    const DynOutputs g2 = run_dyn_stream_ops(*gpu, n, N, d, in);
    EXPECT_EQ(g2.dC, g.dC) << tag;
    EXPECT_EQ(g2.din, g.din) << tag;
    EXPECT_EQ(g2.dH_acc, g.dH_acc) << tag;
  }

  // The coefficients and their backward: tanh and a norm, so random inputs only, each
  // element held to a bound derived from its own reference values (header of this part).
  void check_coef(int n, int64_t N, int64_t d, double eps, double w_std) {
    const std::string tag = "dyn coef n" + std::to_string(n) + " N" + std::to_string(N) + " d" +
                            std::to_string(d);
    const int Q = n + 2;
    const int64_t M = N * d;
    const double u = 0x1p-24;
    CoefInputs in;
    // Streams of different sizes (rstd from 4 to 1/8).
    for (int r = 0; r < n; ++r) {
      const auto h = random_normal(rng, M, DType::BF16, std::ldexp(1.0, r % 6 - 2));
      in.H.insert(in.H.end(), h.begin(), h.end());
    }
    in.W = random_normal(rng, d * Q, DType::BF16, w_std);
    in.am = random_normal(rng, n, DType::BF16);
    in.ar = random_normal(rng, n * n, DType::BF16);
    in.b = random_normal(rng, n, DType::BF16);
    in.sa = random_normal(rng, 1, DType::BF16, 0.5);
    in.sb = random_normal(rng, 1, DType::BF16, 0.5);
    std::uniform_real_distribution<double> tanh_range(-0.97, 0.97);
    in.T.resize(size_t(N * n * Q));
    for (double& x : in.T) x = round_to(DType::F32, tanh_range(rng));
    in.rstd.resize(size_t(N * n));
    for (int64_t t = 0; t < N; ++t)
      for (int r = 0; r < n; ++r) {
        double ss = 0;
        for (int64_t c = 0; c < d; ++c) ss += in.H[size_t(r * M + t * d + c)] * in.H[size_t(r * M + t * d + c)];
        in.rstd[size_t(t * n + r)] = round_to(DType::F32, 1 / std::sqrt(ss / double(d) + eps));
      }
    in.dC = random_normal(rng, N * n * Q, DType::F32);
    in.dH0 = random_normal(rng, n * M, DType::BF16);
    in.dW0 = random_normal(rng, d * Q, DType::F32);
    in.dam0 = random_normal(rng, n, DType::F32);
    in.dar0 = random_normal(rng, n * n, DType::F32);
    in.db0 = random_normal(rng, n, DType::F32);
    in.dsa0 = random_normal(rng, 1, DType::F32);
    in.dsb0 = random_normal(rng, 1, DType::F32);

    auto ref_be = make_cpu_backend(DType::F64);
    const CoefOutputs g = run_coef_ops(*gpu, n, N, d, eps, in),
                      r = run_coef_ops(*ref_be, n, N, d, eps, in),
                      a = run_coef_ops(*ref_be, n, N, d, eps, abs_of(in));

    // Forward. rstd: the sum of d squares (gamma_d relative, all terms positive), /d,
    // +eps (eps rounded to fp32), a correctly rounded sqrt (the relative error halves)
    // and division: e_rs = gamma_{d+3} / 2 + 3u (one u for the second-order terms).
    // z = S rs with S = <h, W[:, q]> (d products, |error| <= gamma_d sum |h W|) and one
    // more rounding. tanhf errs by at most 2 ulp (CUDA math API), <= 2^-22 |T|, on top
    // of the change of tanh over z's error interval (slope at most 1 - tanh^2 of the
    // interval's smallest |z|). C = fma(s, T, base): |s| T's error plus one rounding.
    const double e_rs = gamma32(d + 3) / 2 + 3 * u;
    std::vector<double> bC(r.C.size()), bT(r.T.size()), brs(r.rstd.size());
    for (int64_t t = 0; t < N; ++t)
      for (int rr = 0; rr < n; ++rr) {
        const double rs = r.rstd[size_t(t * n + rr)];
        brs[size_t(t * n + rr)] = e_rs * rs;
        const double* h = &in.H[size_t(rr * M + t * d)];
        for (int q = 0; q < Q; ++q) {
          double S = 0, AS = 0;
          for (int64_t c = 0; c < d; ++c) {
            S += h[c] * in.W[size_t(c * Q + q)];
            AS += std::fabs(h[c] * in.W[size_t(c * Q + q)]);
          }
          const double z = S * rs, grow = (1 + e_rs) * (1 + u);
          const double z_err = gamma32(double(d)) * AS * rs * grow + std::fabs(z) * (grow - 1);
          const double lo = std::fabs(z) - z_err;
          const double slope = lo > 0 ? 1 - std::tanh(lo) * std::tanh(lo) : 1.0;
          const size_t p = size_t((t * n + rr) * Q + q);
          const double T_err = slope * z_err + 0x1p-22 * (std::fabs(r.T[p]) + slope * z_err);
          const double s = std::fabs(q <= n ? in.sa[0] : in.sb[0]);
          bT[p] = T_err;
          bC[p] = s * T_err + u * (std::fabs(r.C[p]) + s * T_err);
        }
      }
    expect_within(tag, "dyn rstd", g.rstd, r.rstd, brs, false);
    expect_within(tag, "dyn T", g.T, r.T, bT, false);
    expect_within(tag, "dyn C", g.C, r.C, bC, false);

    // Backward. dz = dC s (1 - T^2) is 3 roundings (1 - T^2 one fma), U = rs dz one more.
    // dW[c, q]: N n products h U plus the pre-fill, any order: K = N n + 6.
    // dA_m, dA_r, dB: N terms + pre-fill; ds_a, ds_b: at most N Q + pre-fill.
    // dH = dH0 + rs dhbar - h rs^3 <dhbar, h> / d, dhbar = dz . W[c, :] (Q terms): its
    // longest chain is dz (3), dhbar (Q), the dot (d), rs^3 / d (4), two fma (2):
    // K = d + Q + 10, with A = |dH0| + rs |dz||W| + |h| rs^3 (|dz||W|).|h| / d, the same
    // expression in absolute values, computed here.
    expect_sum_parity(tag, "dyn dW", g.dW, r.dW, a.dW, double(N * n + 6), false, false);
    expect_sum_parity(tag, "dyn dA_m", g.dam, r.dam, a.dam, double(N + 1), false, false);
    expect_sum_parity(tag, "dyn dA_r", g.dar, r.dar, a.dar, double(N + 1), false, false);
    expect_sum_parity(tag, "dyn dB", g.db, r.db, a.db, double(N + 1), false, false);
    expect_sum_parity(tag, "dyn ds_a", g.dsa, r.dsa, a.dsa, double(N * Q + 1), false, false);
    expect_sum_parity(tag, "dyn ds_b", g.dsb, r.dsb, a.dsb, double(N * Q + 1), false, false);
    std::vector<double> AdH(static_cast<size_t>(n * M)), adz(static_cast<size_t>(Q)),
        aw(static_cast<size_t>(d));
    for (int64_t t = 0; t < N; ++t)
      for (int rr = 0; rr < n; ++rr) {
        const double rs = in.rstd[size_t(t * n + rr)];
        for (int q = 0; q < Q; ++q) {
          const size_t p = size_t((t * n + rr) * Q + q);
          adz[size_t(q)] = std::fabs(in.dC[p] * (q <= n ? in.sa[0] : in.sb[0])) *
                           (1 - in.T[p] * in.T[p]);
        }
        const double* h = &in.H[size_t(rr * M + t * d)];
        double dot = 0;
        for (int64_t c = 0; c < d; ++c) {
          double s = 0;
          for (int q = 0; q < Q; ++q) s += adz[size_t(q)] * std::fabs(in.W[size_t(c * Q + q)]);
          aw[size_t(c)] = s;
          dot += s * std::fabs(h[c]);
        }
        for (int64_t c = 0; c < d; ++c) {
          const size_t e = size_t(rr * M + t * d + c);
          AdH[e] = std::fabs(in.dH0[e]) + rs * aw[size_t(c)] +
                   std::fabs(h[c]) * rs * rs * rs * dot / double(d);
        }
      }
    expect_sum_parity(tag, "dyn coef dH +=", g.dH, r.dH, AdH, double(d + Q + 10), true, false);

    // Every parameter gradient is a sum in a fixed order: a rerun reproduces each bit.
    const CoefOutputs g2 = run_coef_ops(*gpu, n, N, d, eps, in);
    EXPECT_EQ(g2.C, g.C) << tag;
    EXPECT_EQ(g2.dH, g.dH) << tag;
    EXPECT_EQ(g2.dW, g.dW) << tag;
    EXPECT_EQ(g2.dam, g.dam) << tag;
    EXPECT_EQ(g2.dar, g.dar) << tag;
    EXPECT_EQ(g2.db, g.db) << tag;
    EXPECT_EQ(g2.dsa, g.dsa) << tag;
    EXPECT_EQ(g2.dsb, g.dsb) << tag;
  }
};

TEST_F(HyperDynamicParity, StreamOpsEveryStreamCount) {
  for (int n = 1; n <= 8; ++n) {
    check_streams(n, 37, 64, true);
    check_streams(n, 37, 64, false);
  }
}
TEST_F(HyperDynamicParity, CoefficientsEveryStreamCount) {
  // W's scale: projections z of order 0.5 (tanh's linear part and its bend).
  for (int n = 1; n <= 8; ++n) check_coef(n, 37, 64, 1e-6, 0.06);
}
TEST_F(HyperDynamicParity, ModelWidthsSaturationAndEps) {
  // d = 1088: several lanes' chunks per token and a partial last column block of dW.
  check_streams(4, 160, 1088, true);
  check_streams(4, 160, 1088, false);
  check_coef(4, 160, 1088, 1e-6, 0.03);
  // |z| of several units: tanh saturates (the slope of the bound shrinks, T near +-1).
  check_coef(3, 50, 256, 1e-6, 0.5);
  // A large eps (the golden fixture's 0.05) moves rstd: a kernel that ignored it fails.
  check_coef(2, 50, 128, 0.05, 0.06);
}
TEST_F(HyperDynamicParity, MoreTokensThanTheGridHasWarps) {
  // 20000 tokens: more than 8 blocks per SM x 8 warps on any current GPU (the H200 has
  // 132 SMs: 8448 warps), so every warp loops over tokens, and dW's splits hold several.
  check_streams(2, 20000, 64, true);
  check_streams(3, 20000, 64, false);
  check_coef(3, 20000, 64, 1e-6, 0.06);
}

TEST_F(HyperParity, RefusesWhatTheKernelsDoNotTake) {
  // Rows whose length is not a multiple of 8 elements (d % 8 != 0).
  Buffer x(*gpu, DType::BF16, {3, 12}), H(*gpu, DType::BF16, {2, 3, 12});
  x.poison();
  EXPECT_THROW(gpu->hyper_mix(x, H, Tensor()), Error);
  Buffer Hd(*gpu, DType::BF16, {2, 3, 12}), C(*gpu, DType::F32, {3, 2, 4});
  EXPECT_THROW(gpu->hyper_mix_dynamic(x, Hd, C), Error);
  // Too many streams, static or dynamic: refused when a model is built.
  EXPECT_NO_THROW(gpu->check_hyper(8, false));
  EXPECT_NO_THROW(gpu->check_hyper(8, true));
  for (bool dynamic : {false, true}) {
    try {
      gpu->check_hyper(9, dynamic);
      ADD_FAILURE() << "9 streams accepted";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("residual.hyper_n = 9"), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find("--device cpu"), std::string::npos) << e.what();
    }
  }
  Config h = tiny_config(ResidualMode::Hyper, 0, true, 0, 9);
  EXPECT_THROW(Model(h.model, h.residual, *gpu, 2, 5), Error);
  h.residual.hyper_dynamic = true;
  EXPECT_THROW(Model(h.model, h.residual, *gpu, 2, 5), Error);
  h = tiny_config(ResidualMode::Hyper, 0, true, 0, 4);
  h.residual.hyper_dynamic = true;
  EXPECT_NO_THROW(Model(h.model, h.residual, *gpu, 2, 5));
}

// Throughput at the 1B config's shape (16 x 1024 tokens, d 1280, n 4: 42 MB per stream,
// several times the L2), against the bytes each op must move (every input read once,
// every output written once) and the copy bandwidth measured on the H200 (4.3 TB/s).
// DISABLED_: run with --gtest_also_run_disabled_tests --gtest_filter='HyperParity.DISABLED_*'.
TEST_F(HyperParity, DISABLED_Throughput) {
  const int n = 4;
  const int64_t N = 16 * 1024, d = 1280, M = N * d;
  auto rnd = [&](std::initializer_list<int64_t> shape) {
    auto b = std::make_unique<Buffer>(*gpu, DType::BF16, shape);
    b->set(random_normal(rng, b->t().numel(), DType::BF16));
    return b;
  };
  auto H = rnd({n, N, d}), H2 = rnd({n, N, d}), dH = rnd({n, N, d}), dout = rnd({n, N, d});
  auto x = rnd({N, d}), dx = rnd({N, d}), v = rnd({N, d}), dv = rnd({N, d});
  auto am = rnd({n}), ar = rnd({n * n}), b = rnd({n});
  Buffer dam(*gpu, DType::F32, {n}), dar(*gpu, DType::F32, {n * n}), db(*gpu, DType::F32, {n});
  auto time_ms = [&](const std::function<void()>& op) {
    op();
    op();
    gpu->synchronize();
    const int reps = 20;
    const auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < reps; ++i) op();
    gpu->synchronize();
    return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count() /
           reps;
  };
  auto report = [&](const char* what, double rows, const std::function<void()>& op) {
    const double ms = time_ms(op), bytes = rows * double(M) * 2;
    std::printf("TIMING hyper %-34s %8.3f ms  %7.1f GB/s  %.2f of 4.3 TB/s\n", what, ms,
                bytes / ms * 1e-6, bytes / ms * 1e-6 / 4300);
  };
  report("mix (n+1 rows)", n + 1, [&] { gpu->hyper_mix(*x, *H, *am); });
  report("mix backward += (3n+1 rows)", 3 * n + 1,
         [&] { gpu->hyper_mix_backward(*dH, dam, *dx, *H, *am, true); });
  report("mix backward = (2n+1 rows)", 2 * n + 1,
         [&] { gpu->hyper_mix_backward(*dH, dam, *dx, *H, *am, false); });
  report("update (2n+1 rows)", 2 * n + 1, [&] { gpu->hyper_update(*H2, *H, *v, *ar, *b); });
  report("update backward (3n+2 rows)", 3 * n + 2,
         [&] { gpu->hyper_update_backward(*dH, *dv, dar, db, *dout, *H, *v, *ar, *b); });
}

// Throughput of the dynamic ops at the 1B config's shape (as DISABLED_Throughput above),
// against the bytes each must move at least: every stream row (M bf16) and per-token F32
// tensor ([N, n, n+2] C, T, dC; [N, n] rstd) it reads read once, every output written
// once. The coefficients' backward reads H three times (two passes of its token kernel
// and dW's) and dH twice: its line also gives that count's ratio.
// DISABLED_: run with --gtest_also_run_disabled_tests
// --gtest_filter='HyperDynamicParity.DISABLED_*'.
TEST_F(HyperDynamicParity, DISABLED_Throughput) {
  const int n = 4, Q = n + 2;
  const int64_t N = 16 * 1024, d = 1280, M = N * d;
  auto rnd = [&](DType t, std::initializer_list<int64_t> shape, double stddev = 1.0) {
    auto b = std::make_unique<Buffer>(*gpu, t, shape);
    b->set(random_normal(rng, b->t().numel(), t, stddev));
    return b;
  };
  auto H = rnd(DType::BF16, {n, N, d}), H2 = rnd(DType::BF16, {n, N, d}),
       dH = rnd(DType::BF16, {n, N, d}), dout = rnd(DType::BF16, {n, N, d});
  auto x = rnd(DType::BF16, {N, d}), dx = rnd(DType::BF16, {N, d}), v = rnd(DType::BF16, {N, d}),
       dv = rnd(DType::BF16, {N, d});
  auto W = rnd(DType::BF16, {d, Q}, 0.03), am = rnd(DType::BF16, {n}),
       ar = rnd(DType::BF16, {n * n}), b = rnd(DType::BF16, {n}), sa = rnd(DType::BF16, {1}),
       sb = rnd(DType::BF16, {1});
  auto C = rnd(DType::F32, {N, n, Q}), T = rnd(DType::F32, {N, n, Q}, 0.3),
       dC = rnd(DType::F32, {N, n, Q}), rstd = rnd(DType::F32, {N, n});
  Buffer dW(*gpu, DType::F32, {d, Q}), dam(*gpu, DType::F32, {n}), dar(*gpu, DType::F32, {n * n}),
      db(*gpu, DType::F32, {n}), dsa(*gpu, DType::F32, {1}), dsb(*gpu, DType::F32, {1});
  auto time_ms = [&](const std::function<void()>& op) {
    op();
    op();
    gpu->synchronize();
    const int reps = 20;
    const auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < reps; ++i) op();
    gpu->synchronize();
    return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count() /
           reps;
  };
  const double row = double(M) * 2, tok = double(N) * n * Q * 4, rs = double(N) * n * 4;
  auto report = [&](const char* what, double bytes, const std::function<void()>& op) {
    const double ms = time_ms(op);
    std::printf("TIMING hyper %-44s %8.3f ms  %7.1f GB/s  %.2f of 4.3 TB/s\n", what, ms,
                bytes / ms * 1e-6, bytes / ms * 1e-6 / 4300);
  };
  report("dyn coef (n rows; C, T, rstd written)", n * row + 2 * tok + rs,
         [&] { gpu->hyper_dynamic_coef(*C, *T, *rstd, *H, *W, *am, *ar, *b, *sa, *sb, 1e-6); });
  report("dyn mix (n+1 rows, C)", (n + 1) * row + tok, [&] { gpu->hyper_mix_dynamic(*x, *H, *C); });
  report("dyn mix backward (3n+1 rows, C, dC)", (3 * n + 1) * row + 2 * tok,
         [&] { gpu->hyper_mix_dynamic_backward(*dH, *dC, *dx, *H, *C); });
  report("dyn update (2n+1 rows, C)", (2 * n + 1) * row + tok,
         [&] { gpu->hyper_update_dynamic(*H2, *H, *v, *C); });
  report("dyn update backward (3n+2 rows, C, dC)", (3 * n + 2) * row + 2 * tok,
         [&] { gpu->hyper_update_dynamic_backward(*dH, *dv, *dC, *dout, *H, *v, *C); });
  const auto coef_backward = [&] {
    gpu->hyper_dynamic_coef_backward(*dH, dW, dam, dar, db, dsa, dsb, *dC, *H, *W, *T, *rstd,
                                     *sa, *sb);
  };
  report("dyn coef backward (min: 3n rows, dC, T, rstd)", 3 * n * row + 2 * tok + rs,
         coef_backward);
  report("dyn coef backward (as made: 5n rows, ...)", 5 * n * row + 2 * tok + rs, coef_backward);
}

}  // namespace
}  // namespace mhar::test
