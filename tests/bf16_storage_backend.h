// bf16_storage_backend.h: the fp32 CPU engine with bf16 storage noise on what the CUDA
// backend stores in bf16 (its act dtype): every activation and activation gradient an op
// writes gets one rounding error drawn uniformly within half a bf16 ulp (the distribution
// of round-to-nearest's error; drawn, so that seeds give independent samples, as
// tests/golden_test.cpp's Fp32Noise does for fp32). Statistics (rstd, lse, inv_rms,
// routing weights, ubar, losses) and parameter gradients stay fp32, as on the GPU. Used
// by tests/model_cudatest.cpp to measure how much bf16 storage moves each gradient (the
// GPU's deviation from the fp32 CPU comes from that storage, not from its summation
// orders), which perturbing the weights does not capture where a gradient is a sum that
// cancels (e.g. Hyper-Connections' mixing coefficients at equal streams).
// Covers the ops the CUDA backend has (dynamic Hyper-Connections included); others
// (decoding) pass through unrounded.
#pragma once
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>

#include "engine/forwarding_backend.h"

namespace mhar::test {

// bf16 round-to-nearest-even of an fp32 value (what the GPU's stores do); non-finite
// values pass through.
inline float bf16_round_nearest_even(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  if ((u & 0x7f800000u) == 0x7f800000u) return x;
  u = (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
  std::memcpy(&x, &u, 4);
  return x;
}

class Bf16Storage final : public ForwardingBackend {
 public:
  // Drawn: the uniform half-ulp error above (independent samples per seed). NearestEven:
  // the GPU's own deterministic rounding (tests/experiments/ uses it).
  enum class Rounding { Drawn, NearestEven };
  Bf16Storage(Backend& fp32_cpu, uint64_t seed, Rounding r = Rounding::Drawn)
      : ForwardingBackend(fp32_cpu), rng_(seed), rounding_(r) {}
  std::string name() const override { return "bf16-storage(" + in_.name() + ")"; }

  void embedding_forward(Tensor o, Tensor t, Tensor w) override {
    in_.embedding_forward(o, t, w);
    round(o);
  }
  void rmsnorm_forward(Tensor y, Tensor r, Tensor x, Tensor w, double eps) override {
    in_.rmsnorm_forward(y, r, x, w, eps);
    round(y);
  }
  void rmsnorm_backward(Tensor dx, Tensor dw, Tensor dy, Tensor x, Tensor w, Tensor r,
                        bool acc) override {
    in_.rmsnorm_backward(dx, dw, dy, x, w, r, acc);
    round(dx);
  }
  // A transposed first operand is the weight gradient dW += dy^T x (fp32 on the GPU);
  // every other product is an activation or an activation gradient.
  void matmul(Tensor c, Tensor a, Tensor b, bool ta, bool tb, bool acc) override {
    in_.matmul(c, a, b, ta, tb, acc);
    if (!ta) round(c);
  }
  void rope(Tensor x, double theta, bool backward) override {
    in_.rope(x, theta, backward);
    round(x);
  }
  void attention_forward(Tensor out, Tensor lse, Tensor q, Tensor k, Tensor v) override {
    in_.attention_forward(out, lse, q, k, v);
    round(out);
  }
  void attention_backward(Tensor dq, Tensor dk, Tensor dv, Tensor dout, Tensor q, Tensor k,
                          Tensor v, Tensor out, Tensor lse) override {
    in_.attention_backward(dq, dk, dv, dout, q, k, v, out, lse);
    for (Tensor t : {dq, dk, dv}) round(t);
  }
  void swiglu_forward(Tensor h, Tensor gu) override {
    in_.swiglu_forward(h, gu);
    round(h);
  }
  void swiglu_backward(Tensor dgu, Tensor h, Tensor dh, Tensor gu) override {
    in_.swiglu_backward(dgu, h, dh, gu);
    round(dgu);
    if (!h.empty()) round(h);  // the recomputed h, rounded as the forward's was
  }
  void add(Tensor out, Tensor a, Tensor b) override {
    in_.add(out, a, b);
    round(out);
  }
  void add_inplace(Tensor y, Tensor x) override {
    in_.add_inplace(y, x);
    round(y);
  }
  void cross_entropy(Tensor losses, Tensor logits, Tensor targets, double scale,
                     bool grad) override {
    in_.cross_entropy(losses, logits, targets, scale, grad);
    if (grad) round(logits);  // the logits' gradient overwrites the bf16 logits
  }
  void routing_mix(Tensor x, Tensor w, Tensor history, const RoutingLayout& lay, int site,
                   int heads) override {
    in_.routing_mix(x, w, history, lay, site, heads);
    round(x);
  }
  void routing_source_backward(Tensor dv, Tensor w, Tensor ubar, Tensor gsum,
                               const std::vector<Tensor>& site_dx, Tensor x, Tensor v,
                               Tensor inv_rms, const RoutingParams& p, const RoutingLayout& lay,
                               int source, int heads) override {
    in_.routing_source_backward(dv, w, ubar, gsum, site_dx, x, v, inv_rms, p, lay, source, heads);
    round(dv);
  }
  void hyper_mix(Tensor x, Tensor H, Tensor c) override {
    in_.hyper_mix(x, H, c);
    round(x);
  }
  void hyper_mix_backward(Tensor dH, Tensor dc, Tensor dx, Tensor H, Tensor c, bool acc) override {
    in_.hyper_mix_backward(dH, dc, dx, H, c, acc);
    round(dH);
  }
  void hyper_update(Tensor out, Tensor in, Tensor v, Tensor Ar, Tensor B) override {
    in_.hyper_update(out, in, v, Ar, B);
    round(out);
  }
  void hyper_update_backward(Tensor din, Tensor dv, Tensor dAr, Tensor dB, Tensor dout, Tensor in,
                             Tensor v, Tensor Ar, Tensor B) override {
    in_.hyper_update_backward(din, dv, dAr, dB, dout, in, v, Ar, B);
    round(din);
    round(dv);
  }
  // Dynamic: the streams, x and their gradients are bf16 on the GPU; C, T, rstd and dC
  // are F32 there (stat dtype) and stay unrounded.
  void hyper_mix_dynamic(Tensor x, Tensor H, Tensor C) override {
    in_.hyper_mix_dynamic(x, H, C);
    round(x);
  }
  void hyper_mix_dynamic_backward(Tensor dH, Tensor dC, Tensor dx, Tensor H, Tensor C) override {
    in_.hyper_mix_dynamic_backward(dH, dC, dx, H, C);
    round(dH);
  }
  void hyper_update_dynamic(Tensor out, Tensor in, Tensor v, Tensor C) override {
    in_.hyper_update_dynamic(out, in, v, C);
    round(out);
  }
  void hyper_update_dynamic_backward(Tensor din, Tensor dv, Tensor dC, Tensor dout, Tensor in,
                                     Tensor v, Tensor C) override {
    in_.hyper_update_dynamic_backward(din, dv, dC, dout, in, v, C);
    round(din);
    round(dv);
  }
  void hyper_dynamic_coef_backward(Tensor dH, Tensor dW, Tensor dAm, Tensor dAr, Tensor dB,
                                   Tensor dsa, Tensor dsb, Tensor dC, Tensor H, Tensor W,
                                   Tensor T, Tensor rstd, Tensor sa, Tensor sb) override {
    in_.hyper_dynamic_coef_backward(dH, dW, dAm, dAr, dB, dsa, dsb, dC, H, W, T, rstd, sa, sb);
    round(dH);
  }
  void delta_gate(Tensor x, Tensor base, Tensor alpha, Tensor r) override {
    in_.delta_gate(x, base, alpha, r);
    round(x);
  }
  void delta_gate_backward(Tensor dr, Tensor da, Tensor dx, Tensor r, Tensor alpha,
                           Tensor scratch) override {
    in_.delta_gate_backward(dr, da, dx, r, alpha, scratch);
    round(dr);
  }
  void delta_null_forward(Tensor out, Tensor row) override {
    in_.delta_null_forward(out, row);
    round(out);
  }

 private:
  // x + u * half_ulp(x), u uniform in [-1, 1): for |x| in [2^E, 2^(E+1)) a bf16 ulp is
  // 2^(E-7). Zeros, fp32 denormals and non-finite values stay as they are.
  void round(Tensor t) {
    MHAR_CHECK(t.dtype == DType::F32, "Bf16Storage wraps the fp32 CPU backend, got ",
               dtype_name(t.dtype));
    float* p = t.ptr<float>();
    if (rounding_ == Rounding::NearestEven) {
      for (int64_t i = 0; i < t.numel(); ++i) p[i] = bf16_round_nearest_even(p[i]);
      return;
    }
    for (int64_t i = 0; i < t.numel(); ++i) {
      if (!std::isnormal(p[i])) continue;
      int e = 0;
      std::frexp(p[i], &e);  // |x| in [2^(e-1), 2^e)
      const double half_ulp = std::ldexp(1.0, e - 1 - 8);
      p[i] = float(double(p[i]) + half_ulp * (double(int64_t(rng_()) >> 11) * 0x1p-52));
    }
  }
  std::mt19937_64 rng_;
  Rounding rounding_;
};

}  // namespace mhar::test
