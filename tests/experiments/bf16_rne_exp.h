// bf16_rne_exp.h: experiment only (tests/experiments/hyper_dynamic_training_noise.cpp),
// not built by CMake. A copy of tests/bf16_storage_backend.h (same ops rounded) whose
// rounding is the GPU's deterministic round-to-nearest-even to bf16, or, with
// EXP_NOISE_SCALE=s in the environment, the uniform half-ulp error times s.
#pragma once
#include <cmath>
#include <cstdint>
#include <random>
#include <cstring>
#include <cstdlib>

#include "engine/forwarding_backend.h"

namespace mhar::test {

class Bf16Rne final : public ForwardingBackend {
 public:
  Bf16Rne(Backend& fp32_cpu, uint64_t seed) : ForwardingBackend(fp32_cpu), rng_(seed) {}
  std::string name() const override { return "bf16-rne(" + in_.name() + ")"; }

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
  void swiglu_forward(Tensor h, Tensor g, Tensor u) override {
    in_.swiglu_forward(h, g, u);
    round(h);
  }
  void swiglu_backward(Tensor dg, Tensor du, Tensor dh, Tensor g, Tensor u) override {
    in_.swiglu_backward(dg, du, dh, g, u);
    round(dg);
    round(du);
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
    for (int64_t i = 0; i < t.numel(); ++i) {
      if (!std::isnormal(p[i])) continue;
      int e = 0;
      std::frexp(p[i], &e);  // |x| in [2^(e-1), 2^e)
      const double half_ulp = std::ldexp(1.0, e - 1 - 8);
      static const double scale = std::getenv("EXP_NOISE_SCALE") ? std::atof(std::getenv("EXP_NOISE_SCALE")) : 0;
      if (scale > 0) { p[i] = float(double(p[i]) + scale * half_ulp * (double(int64_t(rng_()) >> 11) * 0x1p-52)); continue; }
      uint32_t u; std::memcpy(&u, &p[i], 4); u = (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u; std::memcpy(&p[i], &u, 4);
    }
  }
  std::mt19937_64 rng_;
};

}  // namespace mhar::test
