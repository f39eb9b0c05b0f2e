// attention.cu: causal grouped-query attention, scale 1/sqrt(head_dim), flash-style: the
// [T, T] score matrix is never stored; the forward saves only the log-sum-exp.
// Layouts: q, out, dq [B, T, Hq, hd]; k, v, dk, dv [B, T, Hkv, hd]; lse [B, Hq, T] (F32,
// natural log of sum_u exp(scale q.k_u)). Query head h reads KV head h / (Hq/Hkv).
// attention_cached (incremental decoding) is the forward with Tk >= Tq cached keys, query
// t at position Tk - Tq + t, and no lse.
// Every output is overwritten. head_dim 64 or 128; q, k, v, out and their gradients share
// one storage type (BF16 or F32). No path uses atomics: results are deterministic.
//
// This file checks the arguments and picks a strategy (attention_paths.h):
// - BF16 training forward and backward on compute capability 9.0: the Hopper wgmma
//   kernels (attention_set_hopper turns them off): the forward and the backward's dK/dV
//   kernel warp-specialized (attention_hopper_ws.cu), the backward's dQ kernel in
//   attention_hopper.cu, with the earlier versions for the kernel lab
//   (attention_set_hopper_forward / _backward).
// - BF16 training forward and backward elsewhere: mma.sync tensor cores (attention_tc.cu).
//   Either BF16 backward reads the row dots D = rowsum(dout * out) from a workspace owned
//   by the backend (its op scratch); the Hopper backward (versions 2, 3) also keeps its bf16
//   score-gradient tiles there (attention_backward_workspace_bytes: B*Hq*T floats, then
//   hopper::score_grad_bytes).
// - F32 storage, attention_cached (decode), and BF16 tensors not 16-byte aligned: fp32
//   CUDA cores (attention_fp32.cu).
#include <atomic>
#include <cmath>
#include <type_traits>

#include "cuda/attention_paths.h"
#include "cuda/common.cuh"
#include "cuda/kernels.h"

namespace mhar::cuda {
namespace {

struct Shape {
  int64_t B, T, Hq, Hkv, hd;
};

Shape check_shapes(const char* what, const Tensor& q, const Tensor& k, const Tensor& v,
                   bool cached = false) {
  MHAR_CHECK(q.ndim == 4 && k.ndim == 4 && v.ndim == 4, what, ": q, k, v must be [B, T, H, hd]");
  Shape sh{q.dim(0), q.dim(1), q.dim(2), k.dim(2), q.dim(3)};
  MHAR_CHECK(k.dim(0) == sh.B && (cached ? k.dim(1) >= sh.T : k.dim(1) == sh.T) &&
                 k.dim(3) == sh.hd, what, ": k ",
             k.shape_str(), " vs q ", q.shape_str());
  MHAR_CHECK(v.numel() == k.numel(), what, ": v ", v.shape_str(), " vs k ", k.shape_str());
  MHAR_CHECK(sh.Hkv > 0 && sh.Hq % sh.Hkv == 0, what, ": Hq ", sh.Hq, " not a multiple of Hkv ",
             sh.Hkv);
  if (sh.hd != 64 && sh.hd != 128)
    fail("CUDA ", what, ": head_dim ", sh.hd, " unsupported (64 or 128)");
  MHAR_CHECK(k.dtype == q.dtype && v.dtype == q.dtype, what, ": q, k, v dtypes differ");
  return sh;
}

AttentionArgs args_of(const Shape& sh) {
  return {sh.B, sh.T, sh.Hq, sh.Hkv, float(1.0 / std::sqrt(double(sh.hd)))};
}

// The tensor-core paths take BF16 tensors whose rows are 16-byte aligned (cp.async and
// vector stores); anything else goes to the fp32 CUDA-core kernels.
bool use_tensor_cores(std::initializer_list<const Tensor*> ts) {
  if (!tc::available()) return false;
  for (const Tensor* t : ts)
    if (t->dtype != DType::BF16 || reinterpret_cast<uintptr_t>(t->data) % 16 != 0) return false;
  return true;
}

// f(std::integral_constant<int, HD>) for head_dim hd (64 or 128, as check_shapes allows).
template <class F> void with_head_dim(int64_t hd, F&& f) {
  if (hd == 64) f(std::integral_constant<int, 64>());
  else f(std::integral_constant<int, 128>());
}

std::atomic<bool> g_hopper_enabled{true};
std::atomic<int> g_hopper_forward{2};
std::atomic<int> g_hopper_backward{3};

// The workspace's row dots, rounded up so that the score-gradient tiles after them start
// 256-byte aligned (the workspace itself is).
size_t row_dot_bytes(int64_t B, int64_t T, int64_t Hq) {
  return (size_t(B * T * Hq) * sizeof(float) + 255) / 256 * 256;
}
bool hopper_stores_score_grads() {
  return attention_uses_hopper() && g_hopper_backward.load() >= 2;
}

}  // namespace

bool attention_set_hopper(bool enabled) { return g_hopper_enabled.exchange(enabled); }
bool attention_uses_hopper() { return g_hopper_enabled.load() && hopper::available(); }
int attention_set_hopper_forward(int version) {
  MHAR_CHECK(version == 1 || version == 2, "attention_set_hopper_forward: version ", version,
             " (valid: 1, 2)");
  return g_hopper_forward.exchange(version);
}
int attention_set_hopper_backward(int version) {
  MHAR_CHECK(version >= 1 && version <= 3, "attention_set_hopper_backward: version ", version,
             " (valid: 1, 2, 3)");
  return g_hopper_backward.exchange(version);
}

size_t attention_backward_workspace_bytes(int64_t B, int64_t T, int64_t Hq, int64_t hd) {
  if (B <= 0 || T <= 0 || Hq <= 0 || !tc::available()) return 0;
  size_t bytes = row_dot_bytes(B, T, Hq);
  if ((hd == 64 || hd == 128) && hopper_stores_score_grads())
    bytes += hopper::score_grad_bytes(AttentionArgs{B, T, Hq, 1, 1.f});
  return bytes;
}

void attention_forward(cudaStream_t s, Tensor out, Tensor lse, Tensor q, Tensor k, Tensor v) {
  const Shape sh = check_shapes("attention_forward", q, k, v);
  check_numel(out, q.numel(), "attention_forward", "out");
  check_dtype(out, q.dtype, "attention_forward", "out");
  check_numel(lse, sh.B * sh.Hq * sh.T, "attention_forward", "lse");
  check_dtype(lse, DType::F32, "attention_forward", "lse");
  if (q.numel() == 0) return;
  if (use_tensor_cores({&out, &q, &k, &v})) {
    const AttentionArgs a = args_of(sh);
    auto* o = static_cast<bf16*>(out.data);
    auto *qp = static_cast<const bf16*>(q.data), *kp = static_cast<const bf16*>(k.data),
         *vp = static_cast<const bf16*>(v.data);
    with_head_dim(sh.hd, [&](auto hd) {
      constexpr int HD = decltype(hd)::value;
      if (!attention_uses_hopper()) tc::forward<HD>(s, o, lse.ptr<float>(), qp, kp, vp, a);
      else if (g_hopper_forward.load() == 2)
        hopper::forward_ws<HD>(s, o, lse.ptr<float>(), qp, kp, vp, a);
      else hopper::forward<HD>(s, o, lse.ptr<float>(), qp, kp, vp, a);
    });
    return;
  }
  attn_fp32::forward(s, out, lse, q, k, v, sh.hd, args_of(sh), sh.T);
}

void attention_backward(cudaStream_t s, Tensor dq, Tensor dk, Tensor dv, Tensor dout, Tensor q,
                        Tensor k, Tensor v, Tensor out, Tensor lse, void* workspace,
                        size_t workspace_bytes) {
  const Shape sh = check_shapes("attention_backward", q, k, v);
  check_numel(dq, q.numel(), "attention_backward", "dq");
  check_numel(dout, q.numel(), "attention_backward", "dout");
  check_numel(out, q.numel(), "attention_backward", "out");
  check_numel(dk, k.numel(), "attention_backward", "dk");
  check_numel(dv, k.numel(), "attention_backward", "dv");
  check_numel(lse, sh.B * sh.Hq * sh.T, "attention_backward", "lse");
  check_dtype(lse, DType::F32, "attention_backward", "lse");
  for (const Tensor* t : {&dq, &dk, &dv, &dout, &out})
    MHAR_CHECK(t->dtype == q.dtype, "attention_backward: gradient dtypes must match q");
  if (q.numel() == 0) return;
  if (use_tensor_cores({&dq, &dk, &dv, &dout, &q, &k, &v, &out})) {
    const size_t need = attention_backward_workspace_bytes(sh.B, sh.T, sh.Hq, sh.hd);
    MHAR_CHECK(workspace && workspace_bytes >= need, "attention_backward: a workspace of ",
               need, " bytes needed (attention_backward_workspace_bytes), ", workspace_bytes,
               " given");
    const AttentionArgs a = args_of(sh);
    auto bp = [](const Tensor& t) { return static_cast<bf16*>(t.data); };
    const float* l = lse.ptr<float>();
    auto* dots = static_cast<float*>(workspace);
    // Version 1 passes no tiles: the dq kernel then recomputes S and dP itself.
    bf16* score_grads = hopper_stores_score_grads()
                            ? reinterpret_cast<bf16*>(static_cast<char*>(workspace) +
                                                      row_dot_bytes(sh.B, sh.T, sh.Hq))
                            : nullptr;
    with_head_dim(sh.hd, [&](auto hd) {
      constexpr int HD = decltype(hd)::value;
      tc::row_dots<HD>(s, dots, bp(dout), bp(out), a);
      if (attention_uses_hopper())
        hopper::backward<HD>(s, bp(dq), bp(dk), bp(dv), bp(dout), bp(q), bp(k), bp(v), l,
                             dots, score_grads, g_hopper_backward.load() == 3, a);
      else
        tc::backward<HD>(s, bp(dq), bp(dk), bp(dv), bp(dout), bp(q), bp(k), bp(v), l, dots,
                         a);
    });
    return;
  }
  attn_fp32::backward(s, dq, dk, dv, dout, q, k, v, out, lse, sh.hd, args_of(sh));
}

void attention_cached(cudaStream_t s, Tensor out, Tensor q, Tensor k_cache, Tensor v_cache) {
  const Shape sh = check_shapes("attention_cached", q, k_cache, v_cache, true);
  check_numel(out, q.numel(), "attention_cached", "out");
  check_dtype(out, q.dtype, "attention_cached", "out");
  if (q.numel() == 0) return;
  const int64_t Tk = k_cache.dim(1);
  attn_fp32::forward(s, out, Tensor(), q, k_cache, v_cache, sh.hd, args_of(sh), Tk);
}

}  // namespace mhar::cuda
