// cuda_test_util.h: shared helpers for the CUDA parity tests (tests/*_cudatest.cpp).
// Every op runs on the CPU reference (make_cpu_backend(F32)) and on the CUDA backend with
// the same inputs; inputs are drawn at random and rounded to what the GPU stores (bf16 for
// activations and weights), so the comparison measures only the op's own arithmetic and
// output rounding. Outputs an op overwrites are poisoned with NaN on the GPU first, so an
// element it fails to write fails the comparison; "+=" outputs start from random values
// on both sides. Each comparison prints one "PARITY" line (op, tensor, relative error) so
// a test log doubles as a table of measured errors.
#pragma once
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "cuda/cuda_backend.h"
#include "cuda/device.h"
#include "engine/backend.h"

namespace mhar::test {

// Tolerances on ||out - ref|| / ||ref|| (inputs are identical on both sides):
// - an output rounded once to bf16 (8-bit significand, unit roundoff 2^-9) is off by at
//   most 2^-9 relative per element, so also in norm; 2^-8 leaves a factor 2 for fp32
//   accumulation-order and fast-exp differences, which are orders of magnitude smaller.
constexpr double kTolBf16Output = 1.0 / 256;
// - an fp32 output computed from the same inputs differs only by summation order and
//   fp32 transcendental error (~1e-6 relative for our sizes); 1e-4 leaves room for the
//   cancellation in sums of random-sign terms (dw, dquery, dgain, lse).
constexpr double kTolF32Output = 1e-4;

#define MHAR_SKIP_WITHOUT_GPU()                                        \
  do {                                                                 \
    if (::mhar::cuda::device_count() == 0) GTEST_SKIP() << "no CUDA device"; \
  } while (0)

// What the GPU stores for a value of dtype t (round to nearest even for bf16).
inline double round_to(DType t, double x) {
  if (t == DType::F64) return x;
  float f = float(x);
  if (t == DType::F32 || std::isnan(f)) return f;
  if (t == DType::BF16) {
    uint32_t bits;
    std::memcpy(&bits, &f, 4);
    bits += 0x7fffu + ((bits >> 16) & 1u);
    bits &= 0xffff0000u;
    std::memcpy(&f, &bits, 4);
    return f;
  }
  return x;
}

inline std::vector<double> rounded(DType t, std::vector<double> v) {
  for (double& x : v) x = round_to(t, x);
  return v;
}

// Normal(mean, stddev) values rounded to dtype t.
inline std::vector<double> random_normal(std::mt19937_64& rng, int64_t n, DType t,
                                         double stddev = 1.0, double mean = 0.0) {
  std::normal_distribution<double> dist(mean, stddev);
  std::vector<double> v(static_cast<size_t>(n));
  for (double& x : v) x = round_to(t, dist(rng));
  return v;
}

// A tensor owned by one backend, released on scope exit.
class Buffer {
 public:
  Buffer(Backend& be, DType dtype, std::initializer_list<int64_t> shape) : be_(&be) {
    t_ = Tensor(nullptr, dtype, shape);
    t_.data = be.allocate(t_.bytes() ? t_.bytes() : 1);
  }
  ~Buffer() {
    if (be_ && t_.data) be_->release(t_.data);
  }
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  Buffer(Buffer&& o) noexcept : be_(o.be_), t_(o.t_) { o.be_ = nullptr; o.t_.data = nullptr; }

  const Tensor& t() const { return t_; }
  operator Tensor() const { return t_; }
  std::vector<double> get() const {
    std::vector<double> v(static_cast<size_t>(t_.numel()));
    be_->download(v.data(), t_);
    return v;
  }
  void set(const std::vector<double>& v) {
    EXPECT_EQ(int64_t(v.size()), t_.numel());
    be_->upload(t_, v.data());
  }
  void poison() { set(std::vector<double>(size_t(t_.numel()), std::nan(""))); }

 private:
  Backend* be_;
  Tensor t_;
};

// The CPU reference and the CUDA backend side by side.
class CudaParity : public ::testing::Test {
 protected:
  void SetUp() override {
    if (cuda::device_count() == 0) GTEST_SKIP() << "no CUDA device";
    cpu = make_cpu_backend(DType::F32);
    gpu = make_cuda_backend(0);
    rng.seed(seed_for(::testing::UnitTest::GetInstance()->current_test_info()->name()));
  }
  // Stable per test (reproducible failures), different between tests.
  static uint64_t seed_for(const char* name) {
    uint64_t h = 1469598103934665603ull;
    for (const char* p = name; *p; ++p) h = (h ^ uint64_t(*p)) * 1099511628211ull;
    return h;
  }

  // One logical tensor on both backends: CPU in F32 (I32 stays I32), GPU in `gpu_dtype`.
  struct Pair {
    Buffer c, g;
    void set(const std::vector<double>& v) { c.set(v); g.set(v); }
  };
  Pair pair(DType gpu_dtype, std::initializer_list<int64_t> shape) {
    const DType cpu_dtype = gpu_dtype == DType::I32 ? DType::I32 : DType::F32;
    return Pair{Buffer(*cpu, cpu_dtype, shape), Buffer(*gpu, gpu_dtype, shape)};
  }
  // A pair filled with the same random normal values (rounded to the GPU's dtype).
  Pair random_pair(DType gpu_dtype, std::initializer_list<int64_t> shape, double stddev = 1.0,
                   double mean = 0.0) {
    Pair p = pair(gpu_dtype, shape);
    p.set(random_normal(rng, p.c.t().numel(), gpu_dtype, stddev, mean));
    return p;
  }

  // Uniform(-scale, scale) values on the GPU only, from a cheap xorshift: for the timing
  // tests' buffers of up to ~10^8 elements (never zeros: zeros can run faster than data).
  Buffer random_gpu(DType t, std::initializer_list<int64_t> shape, double scale = 1.0) {
    Buffer b(*gpu, t, shape);
    std::vector<double> v(static_cast<size_t>(b.t().numel()));
    uint64_t x = rng() | 1;  // xorshift's state must not be 0
    for (double& e : v) {
      x ^= x << 13;
      x ^= x >> 7;
      x ^= x << 17;
      e = scale * (double(x >> 11) * (2.0 / 9007199254740992.0) - 1.0);
    }
    b.set(v);
    return b;
  }

  // The tensors of one causal GQA attention call for the timing tests, q [B, T, Hq, hd]
  // and k, v [B, T, Hkv, hd]: q (scale 2), k, v and dout random bf16 (drawn in that order);
  // out, the log-sum-exp [B, Hq, T] (F32) and the gradients allocated.
  struct AttentionTensors {
    Buffer q, k, v, out, lse, dout, dq, dk, dv;
  };
  AttentionTensors attention_tensors(int64_t B, int64_t T, int64_t Hq, int64_t Hkv, int64_t hd) {
    return AttentionTensors{random_gpu(DType::BF16, {B, T, Hq, hd}, 2.0),
                            random_gpu(DType::BF16, {B, T, Hkv, hd}),
                            random_gpu(DType::BF16, {B, T, Hkv, hd}),
                            Buffer(*gpu, DType::BF16, {B, T, Hq, hd}),
                            Buffer(*gpu, DType::F32, {B, Hq, T}),
                            random_gpu(DType::BF16, {B, T, Hq, hd}),
                            Buffer(*gpu, DType::BF16, {B, T, Hq, hd}),
                            Buffer(*gpu, DType::BF16, {B, T, Hkv, hd}),
                            Buffer(*gpu, DType::BF16, {B, T, Hkv, hd})};
  }

  std::unique_ptr<Backend> cpu, gpu;
  std::mt19937_64 rng;
};

struct Comparison {
  double rel_err = 0, max_abs_err = 0;
  int64_t bad = 0;  // NaN or inf on the GPU side
};

inline Comparison compare(const std::vector<double>& got, const std::vector<double>& ref) {
  Comparison c;
  double num = 0, den = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    if (!std::isfinite(got[i])) {
      ++c.bad;
      continue;
    }
    const double e = got[i] - ref[i];
    num += e * e;
    den += ref[i] * ref[i];
    c.max_abs_err = std::max(c.max_abs_err, std::fabs(e));
  }
  c.rel_err = c.bad ? std::numeric_limits<double>::infinity()
                    : std::sqrt(num) / std::max(std::sqrt(den), 1e-300);
  return c;
}

// Checks ||got - ref|| / ||ref|| < tol, every element finite, and prints a PARITY line.
inline void expect_close(const std::string& what, const std::vector<double>& got,
                         const std::vector<double>& ref, double tol) {
  ASSERT_EQ(got.size(), ref.size()) << what;
  const Comparison c = compare(got, ref);
  std::printf("PARITY %-48s rel_err %.3e  max_abs %.3e  tol %.1e  %s\n", what.c_str(),
              c.rel_err, c.max_abs_err, tol, c.bad ? "NON-FINITE" : "");
  EXPECT_EQ(c.bad, 0) << what << ": " << c.bad << " non-finite (unwritten?) elements";
  EXPECT_LT(c.rel_err, tol) << what;
}

inline void expect_close(const std::string& what, const Buffer& got, const Buffer& ref,
                         double tol) {
  expect_close(what, got.get(), ref.get(), tol);
}

// Bit-for-bit comparison of two downloads (bf16 and fp32 widen to double exactly): the
// elements whose doubles differ in any bit, or that are NaN on either side (the outputs
// compared this way are written and finite, so a NaN is an unwritten element), and the
// first of them as "element i: got vs ref" in hexadecimal floating point.
struct BitDifferences {
  int64_t count = 0;
  std::string first;
};

inline BitDifferences bit_differences(const std::vector<double>& got,
                                      const std::vector<double>& ref) {
  BitDifferences d;
  if (got.size() != ref.size()) {
    d.count = int64_t(std::max(got.size(), ref.size()));
    d.first = "sizes " + std::to_string(got.size()) + " vs " + std::to_string(ref.size());
    return d;
  }
  for (size_t i = 0; i < ref.size(); ++i) {
    if (std::memcmp(&got[i], &ref[i], sizeof(double)) == 0 && !std::isnan(got[i])) continue;
    if (d.count++ == 0) {
      char buf[96];
      std::snprintf(buf, sizeof buf, "element %zu: %a vs %a", i, got[i], ref[i]);
      d.first = buf;
    }
  }
  return d;
}

// Expects no bit differences; the message names `what`, the count and the first.
inline void expect_same_bits(const std::string& what, const std::vector<double>& got,
                             const std::vector<double>& ref) {
  const BitDifferences d = bit_differences(got, ref);
  EXPECT_EQ(d.count, 0) << what << ": " << d.count << " of " << ref.size()
                        << " elements differ, first " << d.first;
}

}  // namespace mhar::test
