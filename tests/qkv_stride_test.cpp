// qkv_stride_test.cpp: the token-row strides of the ops that read q, k and v out of the
// stacked q/k/v projection (Backend::qk_norm_rope_forward/backward's x_row_stride,
// attention_forward/backward's v_row_stride, copy_rows) on the CPU backend, fp32 and
// fp64: a strided call gives the same bits as the dense call on a copy of the same
// columns, writes nothing outside its columns (the rest of the stacked matrix is
// poisoned and must stay so), and a stride below the dense width is refused. Backend's
// default sequence (what a wrapper without its own QK-norm gets: per-token norms) is
// checked against the dense call too. The model's use of them is covered by the golden,
// gradient-check and sampling tests.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "engine/backend.h"
#include "engine/forwarding_backend.h"

using namespace mhar;

namespace {

// A GQA shape with head_dim 8 (RoPE pairs 4) and a stacked row of q | k | v.
struct Shape {
  int64_t B = 2, T = 5, Hq = 4, Hkv = 2, hd = 8;
  int64_t N() const { return B * T; }
  int64_t qd() const { return Hq * hd; }
  int64_t kvd() const { return Hkv * hd; }
  int64_t width() const { return qd() + 2 * kvd(); }
};

template <class T>
struct Buf {
  std::vector<T> v;
  explicit Buf(size_t n, T fill = T(0)) : v(n, fill) {}
  Tensor t(std::initializer_list<int64_t> dims, int64_t offset = 0) {
    return Tensor(v.data() + offset, dtype_of<T>(), dims);
  }
};

template <class T>
void fill_random(std::vector<T>& v, std::mt19937_64& rng, double scale = 1.0) {
  std::normal_distribution<double> nd(0.0, scale);
  for (T& x : v) x = T(nd(rng));
}

// Bitwise equality of two arrays (NaN-safe, -0 vs +0 distinguished).
template <class T>
void expect_same_bits(const std::string& what, const T* a, const T* b, int64_t n) {
  int64_t bad = 0, first = -1;
  for (int64_t i = 0; i < n; ++i)
    if (std::memcmp(a + i, b + i, sizeof(T)) != 0) {
      if (first < 0) first = i;
      ++bad;
    }
  EXPECT_EQ(bad, 0) << what << ": " << bad << " of " << n << " elements differ, first at "
                    << first << " (" << (first >= 0 ? double(a[first]) : 0.0) << " vs "
                    << (first >= 0 ? double(b[first]) : 0.0) << ")";
}

// The poison value of the stacked buffers' unwritten columns: a NaN payload no op
// produces, compared by bits.
template <class T> T poison() {
  if constexpr (sizeof(T) == 4) {
    const uint32_t u = 0x7fc0beefu;
    float f;
    std::memcpy(&f, &u, 4);
    return T(f);
  } else {
    const uint64_t u = 0x7ff8deadbeef0001ull;
    double d;
    std::memcpy(&d, &u, 8);
    return T(d);
  }
}

// Column block [c0, c0 + w) of stacked rows [N, W] out into a dense [N, w].
template <class T>
std::vector<T> columns(const std::vector<T>& rows, int64_t N, int64_t W, int64_t c0, int64_t w) {
  std::vector<T> out(size_t(N * w));
  for (int64_t n = 0; n < N; ++n)
    for (int64_t c = 0; c < w; ++c) out[size_t(n * w + c)] = rows[size_t(n * W + c0 + c)];
  return out;
}

// Every element of stacked rows [N, W] outside columns [c0, c0 + w) still holds poison.
template <class T>
void expect_poison_outside(const std::string& what, const std::vector<T>& rows, int64_t N,
                           int64_t W, int64_t c0, int64_t w) {
  const T p = poison<T>();
  int64_t touched = 0;
  for (int64_t n = 0; n < N; ++n)
    for (int64_t c = 0; c < W; ++c)
      if ((c < c0 || c >= c0 + w) && std::memcmp(&rows[size_t(n * W + c)], &p, sizeof(T)) != 0)
        ++touched;
  EXPECT_EQ(touched, 0) << what << ": " << touched << " elements outside columns [" << c0 << ", "
                        << c0 + w << ") were written";
}

// The strided and the dense QK-norm + RoPE on one backend: y, rstd, dx and dw the same
// bits (dw_exact: false allows the default sequence's per-token summation of dw, checked
// to fp64 rounding instead).
template <class T>
void check_qk_norm_rope(Backend& be, bool q_block, int64_t first_position, bool accumulate,
                        bool dw_exact, const std::string& tag) {
  Shape s;
  if (first_position != 0) s.B = 1;  // decoding (rope_at) has batch 1
  const int64_t N = s.N(), W = s.width(), heads = q_block ? s.Hq : s.Hkv, D = s.hd;
  const int64_t c0 = q_block ? 0 : s.qd(), w = heads * D;
  std::mt19937_64 rng(1234 + uint64_t(q_block) * 7 + uint64_t(first_position) * 3 + accumulate);
  Buf<T> stacked{size_t(N * W)}, weight{size_t(D)};
  fill_random(stacked.v, rng, 2.0);
  fill_random(weight.v, rng, 0.5);
  for (T& x : weight.v) x += T(1);
  std::vector<T> dense_x = columns(stacked.v, N, W, c0, w);
  Buf<T> xd(dense_x.size());
  xd.v = dense_x;
  const double eps = 1e-6, theta = 10000.0;

  Buf<T> y_s{size_t(N * w)}, y_d{size_t(N * w)}, r_s{size_t(N * heads)}, r_d{size_t(N * heads)};
  be.qk_norm_rope_forward(y_s.t({s.B, s.T, heads, D}), r_s.t({N * heads}),
                          stacked.t({N, w}, c0), weight.t({D}), eps, theta, first_position, W);
  be.qk_norm_rope_forward(y_d.t({s.B, s.T, heads, D}), r_d.t({N * heads}), xd.t({N, w}),
                          weight.t({D}), eps, theta, first_position, 0);
  expect_same_bits(tag + " forward y", y_s.v.data(), y_d.v.data(), N * w);
  expect_same_bits(tag + " forward rstd", r_s.v.data(), r_d.v.data(), N * heads);
  if (first_position != 0) return;  // the backward is training's (position 0)

  // Backward: dy is clobbered by the op, so each call gets its own copy.
  Buf<T> dy{size_t(N * w)}, dw0{size_t(D)};
  fill_random(dy.v, rng);
  fill_random(dw0.v, rng, 0.1);
  Buf<T> dy_s = dy, dy_d = dy, dw_s = dw0, dw_d = dw0;
  Buf<T> dstack{size_t(N * W), poison<T>()}, dx_d{size_t(N * w)};
  if (accumulate) {  // the old dx: the same values in both layouts
    fill_random(dx_d.v, rng);
    for (int64_t n = 0; n < N; ++n)
      for (int64_t c = 0; c < w; ++c) dstack.v[size_t(n * W + c0 + c)] = dx_d.v[size_t(n * w + c)];
  }
  be.qk_norm_rope_backward(dstack.t({N, w}, c0), dw_s.t({D}), dy_s.t({s.B, s.T, heads, D}),
                           stacked.t({N, w}, c0), weight.t({D}), r_d.t({N * heads}), theta,
                           accumulate, W);
  be.qk_norm_rope_backward(dx_d.t({N, w}), dw_d.t({D}), dy_d.t({s.B, s.T, heads, D}),
                           xd.t({N, w}), weight.t({D}), r_d.t({N * heads}), theta, accumulate, 0);
  const std::vector<T> dx_s = columns(dstack.v, N, W, c0, w);
  expect_same_bits(tag + " backward dx", dx_s.data(), dx_d.v.data(), N * w);
  expect_poison_outside(tag + " backward dx", dstack.v, N, W, c0, w);
  if (dw_exact) {
    expect_same_bits(tag + " backward dw", dw_s.v.data(), dw_d.v.data(), D);
  } else {
    // Per-token sums: each column's sum of N * heads products in another order; the
    // difference is within the rounding of summing their magnitudes twice.
    const double unit = std::numeric_limits<T>::epsilon();
    for (int64_t c = 0; c < D; ++c) {
      double mag = std::fabs(double(dw0.v[size_t(c)]));
      for (int64_t r = 0; r < N * heads; ++r)
        mag += std::fabs(double(dy.v[size_t(r * D + c)]) * double(xd.v[size_t(r * D + c)]) *
                         double(r_d.v[size_t(r)]));
      EXPECT_LE(std::fabs(double(dw_s.v[size_t(c)]) - double(dw_d.v[size_t(c)])),
                2.0 * double(N * heads + 1) * unit * mag)
          << tag << " backward dw column " << c;
    }
  }
}

// The strided and the dense attention forward and backward on one backend.
template <class T>
void check_attention(Backend& be, const std::string& tag) {
  const Shape s;
  const int64_t N = s.N(), W = s.width(), c0 = s.qd() + s.kvd(), w = s.kvd();
  std::mt19937_64 rng(99);
  Buf<T> q{size_t(N * s.qd())}, k{size_t(N * s.kvd())}, stacked{size_t(N * W), poison<T>()};
  fill_random(q.v, rng);
  fill_random(k.v, rng);
  for (int64_t n = 0; n < N; ++n)
    for (int64_t c = 0; c < w; ++c) stacked.v[size_t(n * W + c0 + c)] = T(std::normal_distribution<double>()(rng));
  Buf<T> vd{size_t(N * w)};
  vd.v = columns(stacked.v, N, W, c0, w);
  Tensor q4 = q.t({s.B, s.T, s.Hq, s.hd}), k4 = k.t({s.B, s.T, s.Hkv, s.hd});
  Tensor vs4 = stacked.t({s.B, s.T, s.Hkv, s.hd}, c0), vd4 = vd.t({s.B, s.T, s.Hkv, s.hd});

  Buf<T> out_s{size_t(N * s.qd())}, out_d{size_t(N * s.qd())};
  Buf<T> lse_s{size_t(s.B * s.Hq * s.T)}, lse_d{size_t(s.B * s.Hq * s.T)};
  be.attention_forward(out_s.t({s.B, s.T, s.Hq, s.hd}), lse_s.t({s.B, s.Hq, s.T}), q4, k4, vs4, W);
  be.attention_forward(out_d.t({s.B, s.T, s.Hq, s.hd}), lse_d.t({s.B, s.Hq, s.T}), q4, k4, vd4, 0);
  expect_same_bits(tag + " attention forward out", out_s.v.data(), out_d.v.data(), N * s.qd());
  expect_same_bits(tag + " attention forward lse", lse_s.v.data(), lse_d.v.data(),
                   s.B * s.Hq * s.T);
  // The stacked v's other columns are still the poison (the forward only reads).
  expect_poison_outside(tag + " attention forward (read only)", stacked.v, N, W, c0, w);

  Buf<T> dout{size_t(N * s.qd())};
  fill_random(dout.v, rng);
  Buf<T> dq_s{size_t(N * s.qd())}, dq_d{size_t(N * s.qd())}, dk_s{size_t(N * s.kvd())},
      dk_d{size_t(N * s.kvd())}, dv_d{size_t(N * w)}, dstack{size_t(N * W), poison<T>()};
  Tensor out4 = out_d.t({s.B, s.T, s.Hq, s.hd}), lse = lse_d.t({s.B, s.Hq, s.T});
  be.attention_backward(dq_s.t({s.B, s.T, s.Hq, s.hd}), dk_s.t({s.B, s.T, s.Hkv, s.hd}),
                        dstack.t({s.B, s.T, s.Hkv, s.hd}, c0), dout.t({s.B, s.T, s.Hq, s.hd}), q4,
                        k4, vs4, out4, lse, W);
  be.attention_backward(dq_d.t({s.B, s.T, s.Hq, s.hd}), dk_d.t({s.B, s.T, s.Hkv, s.hd}),
                        dv_d.t({s.B, s.T, s.Hkv, s.hd}), dout.t({s.B, s.T, s.Hq, s.hd}), q4, k4,
                        vd4, out4, lse, 0);
  expect_same_bits(tag + " attention backward dq", dq_s.v.data(), dq_d.v.data(), N * s.qd());
  expect_same_bits(tag + " attention backward dk", dk_s.v.data(), dk_d.v.data(), N * s.kvd());
  const std::vector<T> dv_s = columns(dstack.v, N, W, c0, w);
  expect_same_bits(tag + " attention backward dv", dv_s.data(), dv_d.v.data(), N * w);
  expect_poison_outside(tag + " attention backward dv", dstack.v, N, W, c0, w);
}

template <class T>
void check_all(Backend& be, bool dw_exact, const std::string& tag) {
  for (bool q_block : {true, false})
    for (bool acc : {false, true})
      check_qk_norm_rope<T>(be, q_block, 0, acc, dw_exact,
                            tag + (q_block ? " q" : " k") + (acc ? " +=" : ""));
  check_qk_norm_rope<T>(be, true, 7, false, dw_exact, tag + " q at position 7");
  check_attention<T>(be, tag);
}

// A wrapper that runs Backend's default sequence (per-token norms for a strided x) over
// the CPU backend's ops, as tests/bf16_storage_backend.h does.
class Plain final : public ForwardingBackend {
 public:
  using ForwardingBackend::ForwardingBackend;
  void qk_norm_rope_forward(Tensor y, Tensor r, Tensor x, Tensor w, double eps, double theta,
                            int64_t first, int64_t x_stride) override {
    Backend::qk_norm_rope_forward(y, r, x, w, eps, theta, first, x_stride);
  }
  void qk_norm_rope_backward(Tensor dx, Tensor dw, Tensor dy, Tensor x, Tensor w, Tensor r,
                             double theta, bool acc, int64_t x_stride) override {
    Backend::qk_norm_rope_backward(dx, dw, dy, x, w, r, theta, acc, x_stride);
  }
};

TEST(QkvStride, StridedEqualsDenseFp32) {
  auto be = make_cpu_backend(DType::F32);
  check_all<float>(*be, true, "cpu-fp32");
}

TEST(QkvStride, StridedEqualsDenseFp64) {
  auto be = make_cpu_backend(DType::F64);
  check_all<double>(*be, true, "cpu-fp64");
}

TEST(QkvStride, DefaultSequenceStridedEqualsDense) {
  auto cpu32 = make_cpu_backend(DType::F32);
  Plain be32(*cpu32);
  check_all<float>(be32, false, "default-fp32");
  auto cpu64 = make_cpu_backend(DType::F64);
  Plain be64(*cpu64);
  check_all<double>(be64, false, "default-fp64");
}

// copy_rows (the decode path's copy of v into the KV cache): the CPU's and the default
// row loop give the rows, and nothing else.
TEST(QkvStride, CopyRowsGathersTheColumns) {
  auto cpu = make_cpu_backend(DType::F32);
  Plain plain(*cpu);
  const int64_t rows = 6, W = 20, c0 = 12, w = 8;
  std::mt19937_64 rng(5);
  Buf<float> src{size_t(rows * W)};
  fill_random(src.v, rng);
  const std::vector<float> want = columns(src.v, rows, W, c0, w);
  for (Backend* be : {static_cast<Backend*>(cpu.get()), static_cast<Backend*>(&plain)}) {
    Buf<float> dst{size_t(rows * w + 3), poison<float>()};
    be->copy_rows(dst.t({rows, w}), src.t({rows, w}, c0), W);
    expect_same_bits("copy_rows " + be->name(), dst.v.data(), want.data(), rows * w);
    const float p = poison<float>();
    for (int i = 0; i < 3; ++i)
      EXPECT_EQ(std::memcmp(&dst.v[size_t(rows * w + i)], &p, 4), 0) << "copy_rows wrote past dst";
  }
}

// A stride below the dense width would overlap rows: every strided op refuses it.
TEST(QkvStride, StrideBelowDenseWidthRefused) {
  auto be = make_cpu_backend(DType::F32);
  const Shape s;
  const int64_t N = s.N(), W = s.width();
  Buf<float> a{size_t(N * W)}, b{size_t(N * W)}, c{size_t(N * W)}, d{size_t(N * W)},
      e{size_t(N * W)}, w{size_t(s.hd), 1.f}, r{size_t(N * s.Hq)}, lse{size_t(N * s.Hq)};
  const int64_t short_q = s.qd() - 1, short_v = s.kvd() - 1;
  EXPECT_THROW(be->qk_norm_rope_forward(a.t({s.B, s.T, s.Hq, s.hd}), r.t({N * s.Hq}),
                                        b.t({N, s.qd()}), w.t({s.hd}), 1e-6, 1e4, 0, short_q),
               Error);
  EXPECT_THROW(be->qk_norm_rope_backward(b.t({N, s.qd()}), w.t({s.hd}),
                                         a.t({s.B, s.T, s.Hq, s.hd}), c.t({N, s.qd()}),
                                         w.t({s.hd}), r.t({N * s.Hq}), 1e4, false, short_q),
               Error);
  Tensor q4 = a.t({s.B, s.T, s.Hq, s.hd}), k4 = b.t({s.B, s.T, s.Hkv, s.hd}),
         v4 = c.t({s.B, s.T, s.Hkv, s.hd});
  EXPECT_THROW(be->attention_forward(d.t({s.B, s.T, s.Hq, s.hd}), lse.t({s.B, s.Hq, s.T}), q4, k4,
                                     v4, short_v),
               Error);
  EXPECT_THROW(be->attention_backward(d.t({s.B, s.T, s.Hq, s.hd}), e.t({s.B, s.T, s.Hkv, s.hd}),
                                      e.t({s.B, s.T, s.Hkv, s.hd}), a.t({s.B, s.T, s.Hq, s.hd}),
                                      q4, k4, v4, a.t({s.B, s.T, s.Hq, s.hd}),
                                      lse.t({s.B, s.Hq, s.T}), short_v),
               Error);
  EXPECT_THROW(be->copy_rows(d.t({N, s.kvd()}), c.t({N, s.kvd()}), short_v), Error);
}

}  // namespace
