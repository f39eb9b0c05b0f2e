// backend.h: the interface between the layer loop (model.cpp) and the kernels. The
// model is written once against it; the CPU backend (cpu_backend.h, fp32 or fp64) is
// the reference and the CUDA backend (cuda/) is tested against it op by op.
//
// Conventions for every op:
// - Tensors are row-major views; N = batch * seq_len token rows; d = d_model.
// - Inputs and outputs are act_dtype() unless stated; saved statistics (RMSNorm rstd,
//   attention log-sum-exp, routing inverse RMS and weights, per-token losses) are
//   stat_dtype(). Parameter gradients (dtable, dw, dquery, dgain, and the output of a
//   weight-gradient matmul) are grad_dtype(). Token ids are I32. On the CPU backend all
//   three are the backend's scalar type; on CUDA: BF16, F32, F32.
// - "+=" ops accumulate into their output (gradient accumulation); all others overwrite
//   every element of their output.
// - No op allocates: every buffer comes from the model's memory plans (allocator.h).
#pragma once
#include <cstddef>
#include <memory>
#include <string>

#include "engine/tensor.h"

namespace mhar {

class Backend {
 public:
  virtual ~Backend() = default;
  virtual std::string name() const = 0;
  virtual DType act_dtype() const = 0;
  virtual DType stat_dtype() const = 0;
  virtual DType grad_dtype() const = 0;

  // ---- memory
  virtual void* allocate(size_t bytes) = 0;  // zero-filled
  virtual void release(void* p) = 0;
  virtual void zero(Tensor t) = 0;
  virtual void copy(Tensor dst, Tensor src) = 0;  // same dtype and element count
  // Host <-> backend transfers with conversion from/to float64 on the host side, for
  // initialisation, checkpoints and tests (never on the hot path).
  virtual void upload(Tensor dst, const double* host) = 0;
  virtual void download(double* host, Tensor src) = 0;
  virtual void upload_tokens(Tensor dst, const int32_t* host) = 0;
  virtual void synchronize() {}

  // ---- embedding: out[n] = table[tokens[n]];  dtable[tokens[n]] += dout[n]
  virtual void embedding_forward(Tensor out, Tensor tokens, Tensor table) = 0;
  virtual void embedding_backward(Tensor dtable, Tensor dout, Tensor tokens) = 0;

  // ---- RMSNorm over the last dimension of x [R, D] with weight [D]:
  //   y = x * rstd * w,  rstd[r] = 1/sqrt(mean(x[r]^2) + eps)   (rstd is saved)
  // backward: dx = (or += when accumulate_dx), dw +=
  virtual void rmsnorm_forward(Tensor y, Tensor rstd, Tensor x, Tensor w, double eps) = 0;
  virtual void rmsnorm_backward(Tensor dx, Tensor dw, Tensor dy, Tensor x, Tensor w,
                                Tensor rstd, bool accumulate_dx) = 0;

  // ---- C = op(A) op(B) (or C += when accumulate); op(X) = X^T when trans_X.
  // 2-D tensors; a linear layer y = x W^T is matmul(y, x, W, false, true, false) and its
  // weight gradient dW += dy^T x is matmul(dW, dy, x, true, false, true). A and B share a
  // dtype; C may be grad_dtype() (fp32 accumulation into a weight gradient).
  virtual void matmul(Tensor c, Tensor a, Tensor b, bool trans_a, bool trans_b,
                      bool accumulate) = 0;

  // ---- RoPE in place on x [B, T, heads, head_dim], position = t, Hugging Face's
  // rotate-half pairing (i, i + head_dim/2). backward=true applies the inverse rotation
  // (the transpose), which is the gradient.
  virtual void rope(Tensor x, double theta, bool backward) = 0;

  // ---- incremental decoding (sampling with a KV cache; Model::forward_cached).
  // Defaults throw: a backend opts in by overriding both. The training path never
  // calls them.
  // RoPE in place on x [1, T, heads, head_dim] whose row t sits at position
  // first_position + t (rope() is the case first_position = 0).
  virtual void rope_at(Tensor x, double theta, int64_t first_position);
  // Causal attention of a chunk of queries against the cached keys and values:
  // q, out [1, Tq, Hq, hd]; k_cache, v_cache [1, Tk, Hkv, hd] with Tk >= Tq, the chunk's
  // own keys last, so query i sits at position Tk - Tq + i and reads keys 0..Tk-Tq+i.
  // No log-sum-exp is saved: there is no backward.
  virtual void attention_cached(Tensor out, Tensor q, Tensor k_cache, Tensor v_cache);

  // ---- causal grouped-query attention with scale 1/sqrt(head_dim).
  // q, out [B, T, Hq, hd]; k, v [B, T, Hkv, hd]; lse [B, Hq, T] (saved).
  virtual void attention_forward(Tensor out, Tensor lse, Tensor q, Tensor k, Tensor v) = 0;
  // dq, dk, dv are overwritten.
  virtual void attention_backward(Tensor dq, Tensor dk, Tensor dv, Tensor dout, Tensor q,
                                  Tensor k, Tensor v, Tensor out, Tensor lse) = 0;

  // ---- SwiGLU: h = silu(gate) * up; backward overwrites dgate, dup.
  virtual void swiglu_forward(Tensor h, Tensor gate, Tensor up) = 0;
  virtual void swiglu_backward(Tensor dgate, Tensor dup, Tensor dh, Tensor gate,
                               Tensor up) = 0;

  // ---- elementwise: out = a + b;  y += x
  virtual void add(Tensor out, Tensor a, Tensor b) = 0;
  virtual void add_inplace(Tensor y, Tensor x) = 0;

  // ---- classifier: losses[n] = logsumexp(logits[n]) - logits[n, targets[n]] (stat
  // dtype). With compute_grad, logits [N, V] are overwritten by their gradient
  // grad_scale * (softmax(logits[n]) - onehot(targets[n])).
  virtual void cross_entropy(Tensor losses, Tensor logits, Tensor targets, double grad_scale,
                             bool compute_grad) = 0;

  // ---- depth routing (DESIGN.md section 2).
  // inv_rms [N] of one source v [N, d]: 1/sqrt(mean_c v[n,c]^2 + eps); computed once when
  // the source is written, shared by every later site.
  virtual void routing_source_stats(Tensor inv_rms, Tensor v, double eps) = 0;
  // Site reading sources 0..n_src-1 of history [S, N, d] (slots >= n_src are never read):
  //   s[n,i,h] = sum_{c in head h} query[c] * gain[c] * history[i,n,c] * inv_rms[i,n]
  //   weights[n,h,i] = softmax_i s[n,i,h];  x[n,c] = sum_i weights[n,head(c),i] history[i,n,c]
  // inv_rms [S, N]; query, gain [d]; weights [N, heads, n_src] (saved).
  virtual void routing_forward(Tensor x, Tensor weights, Tensor history, Tensor inv_rms,
                               Tensor query, Tensor gain, int n_src, int heads) = 0;
  // dhistory[i] += for i < n_src (value and key paths, through inv_rms too); dquery,
  // dgain +=.
  virtual void routing_backward(Tensor dhistory, Tensor dquery, Tensor dgain, Tensor dx,
                                Tensor history, Tensor inv_rms, Tensor weights, Tensor query,
                                Tensor gain, int n_src, int heads) = 0;

  // ---- optimizer support
  // Sum of squares of every element (fp64 result, host-synchronising): the global
  // gradient norm is sqrt(sum_squares(all gradients)), one call over the gradient arena.
  virtual double sum_squares(Tensor t) = 0;
  // One AdamW step on one parameter tensor (DESIGN.md section 5), elementwise:
  //   g = grad * grad_scale;  m = b1 m + (1-b1) g;  v = b2 v + (1-b2) g^2
  //   w -= lr * ( m/(1-b1^t) / (sqrt(v/(1-b2^t)) + eps) + weight_decay * w )
  // w is `master` (F32) when given, then copied (rounded) into `param`; when `master` is
  // empty, `param` itself is the master. m, v are F32 (CPU: the backend's scalar type).
  struct AdamW {
    double lr, beta1, beta2, eps, weight_decay, grad_scale;
    long long step;  // t, from 1
  };
  virtual void adamw(Tensor param, Tensor master, Tensor grad, Tensor m, Tensor v,
                     const AdamW& hp) = 0;
};

inline void Backend::rope_at(Tensor, double, int64_t) {
  fail(name(), " does not implement incremental decoding yet; run sampling on the CPU");
}
inline void Backend::attention_cached(Tensor, Tensor, Tensor, Tensor) {
  fail(name(), " does not implement incremental decoding yet; run sampling on the CPU");
}

// The CPU reference backend in fp32 (dtype F32) or fp64 (F64, for gradient checks).
std::unique_ptr<Backend> make_cpu_backend(DType dtype = DType::F32);

}  // namespace mhar
