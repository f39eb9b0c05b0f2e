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
// - Every tensor an op is given comes from the model's memory plans (allocator.h), and so
//   do the temporaries an op needs beyond them (the CUDA backend's attention workspace,
//   routing GEMM operands, depth-tile partial sums, hyper and norm partial sums): the
//   model plans one "backend.scratch" buffer of op_scratch_bytes() in its activation
//   plan and binds it around each of its passes (op scratch, below). No op of a model's
//   step allocates: once a Model (and its optimizer) is built, training allocates
//   nothing. Ops called with no scratch bound (the op parity tests and kernel timings
//   call them without a model) may take their temporaries from grow-only buffers of the
//   backend's own instead (CUDA does).
#pragma once
#include <algorithm>
#include <cstddef>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "engine/tensor.h"

namespace mhar {

// The routing parameters of every site (one entry per site), and their gradients.
struct RoutingParams {
  std::vector<Tensor> query, gain;    // [d], act dtype
  std::vector<Tensor> dquery, dgain;  // [d], grad dtype (backward only)
  int sites() const { return int(query.size()); }
};

#if defined(__CUDACC__)
#define MHAR_HOST_DEVICE __host__ __device__
#else
#define MHAR_HOST_DEVICE
#endif

// Which source slots every routing site reads (DESIGN.md sections 2-3); the CPU and CUDA
// ops share these few lines, so the two can never disagree on a pair's slot.
// Source slots are the rows of the history [sources, N, d]; sites are counted separately
// (site inputs and their gradients, ubar, gsum and the per-site parameters have `sites`
// rows). Slot i is written just before site i runs and is read by the run of sites
// [i, last_site(i)]: with `block` = s, slot 0 holds v_0 and slot i >= 1 the sum of the
// current block's sublayer outputs up to v_i; a slot that closes its block (i % s == 0)
// is read by every later site, any other slot (a partial block sum) by its own site only.
// Site k therefore reads slots 0, s, 2s, ..., floor(k/s) s and, inside a block, k.
// block = 1 is full routing: every output is its own block, site k reads slots 0..k.
// Pair (slot i, site k) indexes the per-pair statistics, source-major: the pairs of one
// slot are contiguous. Both layouts built today have sources == sites.
struct RoutingLayout {
  int sources = 0, sites = 0;
  int block = 1;  // s, sublayer outputs per block

  static RoutingLayout full(int S) { return RoutingLayout{S, S, 1}; }
  static RoutingLayout blocks(int S, int s) { return RoutingLayout{S, S, s}; }

  MHAR_HOST_DEVICE bool closes_block(int i) const { return i % block == 0; }
  MHAR_HOST_DEVICE int last_site(int i) const { return closes_block(i) ? sites - 1 : i; }
  // Pairs of the slots before i: c = ceil(i/s) closed slots m*s (m < c), each read by
  // sites - m*s sites, and i - c partial slots with one pair each.
  MHAR_HOST_DEVICE int64_t pair_base(int i) const {
    const int64_t c = (int64_t(i) + block - 1) / block;
    return c * sites - int64_t(block) * c * (c - 1) / 2 + (i - c);
  }
  MHAR_HOST_DEVICE int64_t pair(int i, int k) const { return pair_base(i) + (k - i); }
  int64_t pairs() const { return pair_base(sources); }
  // Sources of site k, and the slot of its t-th source (t < site_sources(k), oldest first).
  MHAR_HOST_DEVICE int site_sources(int k) const { return k / block + 1 + (k % block ? 1 : 0); }
  MHAR_HOST_DEVICE int site_source(int k, int t) const { return t <= k / block ? t * block : k; }
  // pair(site_source(k, t), k) without a division, for loops that hoist closed = k / block.
  MHAR_HOST_DEVICE int64_t site_pair(int k, int t, int closed) const {
    const int64_t c = t <= closed ? t : closed + 1;  // closed slots before the source
    const int i = t <= closed ? t * block : k;
    return c * sites - int64_t(block) * c * (c - 1) / 2 + (i - c) + (k - i);
  }
  // Backward depth tiles (Backend::routing_source_backward_tile): the tile of `count`
  // slots that starts at slot i is i, i - block, ..., i - (count - 1) block: every slot in
  // full routing, closed slots only in a block layout (every site that reads closed slot
  // i reads the older closed slots too; a partial slot's one site is read by no other
  // partial slot). back_tile_count(i, k): the count of the tile that starts at slot i
  // when the backend wants tiles of k slots, 0 where none starts. Full routing: slots
  // S-1, S-1-k, ... but slot 0, count min(k, i + 1). Block layouts: the closed slots
  // c * block with c % k == k - 1, count k (the oldest slots tile up, so that what is
  // left alone is the newest, read by the fewest sites).
  int back_tile_count(int i, int k) const {
    if (k < 2 || i < 1) return 0;
    if (block == 1) return (sources - 1 - i) % k == 0 ? std::min(k, i + 1) : 0;
    return closes_block(i) && (i / block) % k == k - 1 ? k : 0;
  }
  // Forward depth tiles (Backend::routing_tile_plan): tiles of k sites from site 0, their
  // counts in site order (the last one shorter where k does not divide the sites).
  std::vector<int> uniform_tiles(int k) const {
    const int count = std::max(k, 1);
    std::vector<int> plan;
    for (int j = 0; j < sites; j += count) plan.push_back(std::min(count, sites - j));
    return plan;
  }
  bool operator==(const RoutingLayout& o) const {
    return sources == o.sources && sites == o.sites && block == o.block;
  }
};

// The operands of Backend::delta_site_backward (residual_delta.cpp's names): those of
// delta_resid_gate_backward, then routing_source_backward's (x is r, and site_dx[site] is
// dr), then delta_source_grad's (next may be empty).
struct DeltaSiteBackward {
  Tensor dresid, dr, dalpha, dx, r, alpha, scratch;
  Tensor slot, weights, ubar, gsum, v, inv_rms;
  const std::vector<Tensor>* site_dx = nullptr;
  const RoutingParams* params = nullptr;
  RoutingLayout layout;
  int site = 0, heads = 0;
  Tensor out, next;
};

// The operands of Backend::delta_site_forward (residual_delta.cpp's names): the running
// standard stream, the history (slot `site` holds v_site, the sublayer output just written),
// the site's input x and routed term r, its gate alpha, and routing_source_logits' weights,
// inv_rms (slot site's row, [N]), params and eps.
struct DeltaSiteForward {
  Tensor stream, history, x, r, alpha, weights, inv_rms;
  const RoutingParams* params = nullptr;
  RoutingLayout layout;
  int site = 0, heads = 0;
  bool continues = false;  // slot site continues its block: it becomes v_site + slot site-1
  double eps = 0;
};

// One of attention's q and k for Backend::qk_norm_rope_forward_qk / _backward_qk: the
// operands of qk_norm_rope_forward (y, rstd, x, w) and of qk_norm_rope_backward (dx, dw,
// dy, x, w, rstd).
struct QkNormRopeOperands {
  Tensor y, rstd, x, w;
};
struct QkNormRopeGradOperands {
  Tensor dx, dw, dy, x, w, rstd;
};

// What the temporaries of a model's ops depend on (Backend::op_scratch_bytes): the model's
// shapes (Model::plan_activations) and what its residual scheme calls
// (ResidualScheme::op_scratch_shapes). Every op of the model's passes is covered: its
// sublayers, norms and head, and the scheme's routing or Hyper-Connections ops.
struct OpScratchShapes {
  int64_t batch = 0, seq_len = 0;  // N = batch * seq_len token rows
  int64_t d_model = 0;
  int heads = 0, kv_heads = 0, head_dim = 0;
  // Depth routing (the routed and delta schemes; routing.sites == 0: none), its heads, and
  // the largest count the scheme passes to routing_mix_tile / routing_source_backward_tile
  // (1: it calls neither).
  RoutingLayout routing;
  int routing_heads = 0;
  int mix_tile_sites = 1, backward_tile_slots = 1;
  // Hyper-Connections (mode hyper; 0: none): streams, and whether per-token coefficients.
  int hyper_streams = 0;
  bool hyper_dynamic = false;

  int64_t tokens() const { return batch * seq_len; }
};

// The per-site rows t[0], t[1], ... of a [sites, N, d] tensor (routing_source_backward's
// site_dx when one buffer holds them all).
inline std::vector<Tensor> routing_rows(Tensor t) {
  std::vector<Tensor> rows;
  for (int64_t k = 0; k < t.dim(0); ++k) rows.push_back(t[k]);
  return rows;
}

// SwiGLU's shapes (Backend::swiglu_forward/backward): h [rows, F] against the stacked
// gate_up [rows, 2F]; returns F.
inline int64_t swiglu_width(const Tensor& h, const Tensor& gate_up, const char* op) {
  const int64_t F = h.ndim ? h.dim(-1) : 0;
  MHAR_CHECK(h.ndim >= 1 && gate_up.ndim == h.ndim && gate_up.dim(-1) == 2 * F &&
                 gate_up.numel() == 2 * h.numel() && gate_up.dtype == h.dtype,
             op, ": h ", h.shape_str(), " against gate_up ", gate_up.shape_str(),
             " (expected [rows, 2F] for h [rows, F], same dtype)");
  return F;
}
// The same for swiglu_backward's tensors: d_gate_up in gate_up's layout, h empty or dh's.
inline int64_t swiglu_backward_width(const Tensor& d_gate_up, const Tensor& h, const Tensor& dh,
                                     const Tensor& gate_up, const char* op) {
  const int64_t F = swiglu_width(dh, gate_up, op);
  MHAR_CHECK(d_gate_up.numel() == gate_up.numel() && d_gate_up.dtype == gate_up.dtype &&
                 (h.empty() || (h.numel() == dh.numel() && h.dtype == dh.dtype)),
             op, ": d_gate_up ", d_gate_up.shape_str(), " h ", h.shape_str(),
             " against gate_up ", gate_up.shape_str());
  return F;
}

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
  // The most bytes this backend has held from its device's allocator at any time so far
  // (arenas, library workspaces, scratch). -1 when the backend does not count.
  virtual int64_t peak_bytes_in_use() const { return -1; }
  // How many allocations this backend has made from its device's allocator so far (every
  // one peak_bytes_in_use() counts, released or not). -1 when the backend does not count.
  virtual int64_t device_allocations() const { return -1; }
  // Algorithms the backend chose by timing (the CUDA backend's matmuls, cuda/matmul.cu), as
  // text for the run directory, so that a resumed run computes with its first process's
  // choices and gives the bits of a run that never stopped. Empty: nothing to keep (the
  // default, and the CPU's, which chooses nothing). use_timed_choices takes such a text back
  // (before the shapes' first calls): how many choices it will use, or -1 with *why_not set
  // when the text does not apply here (another device or library), and nothing changes.
  virtual std::string timed_choices() const { return {}; }
  virtual int use_timed_choices(const std::string& text, std::string* why_not) {
    (void)text;
    (void)why_not;
    return 0;
  }

  // ---- op scratch: the temporaries some ops need beyond the tensors they are given.
  // op_scratch_bytes(shapes) is the size of one buffer that holds every temporary of every
  // op a model of those shapes runs (0: none; the default, and the CPU reference's, whose
  // temporaries are host vectors). The model plans it in its activation plan and binds it
  // (OpScratchBinding, below) around each forward and backward pass: while bound, every op
  // takes its temporaries from it, and an op that would need more than `shapes` promised
  // is an internal error (MHAR_CHECK naming the temporary and both sizes), never an
  // allocation. The binding is per pass, not per backend, so models that share a backend
  // each run on their own buffer, and none is left bound to a model that is gone.
  // Unbound, a backend may use grow-only buffers of its own (allocated when a call first
  // needs more, counted in peak_bytes_in_use()): only ops called without a model do.
  struct OpScratch {
    Tensor memory;  // this backend's memory, >= op_scratch_bytes(shapes) bytes; empty: none
    OpScratchShapes shapes;
  };
  virtual size_t op_scratch_bytes(const OpScratchShapes& shapes) const {
    (void)shapes;
    return 0;
  }
  // Binds `scratch` (an empty memory unbinds) and returns the binding it replaces.
  virtual OpScratch bind_op_scratch(const OpScratch& scratch) {
    (void)scratch;
    return OpScratch{};
  }

  // ---- timing marks, for op profiles (engine/op_profile.h). timing_mark() records how
  // far the backend's queue has come and returns the mark's number (0, 1, ... since
  // timing_reset()); timing_ms(a, b) is the device time between marks a and b, valid
  // after synchronize(). -1 from timing_mark(): no device clock (the default, right for a
  // backend whose ops have finished when they return: the profiler reads the host clock).
  virtual int timing_mark() { return -1; }
  virtual double timing_ms(int /*a*/, int /*b*/) { return 0; }
  virtual void timing_reset() {}

  // ---- side work: ops that nothing issued after them needs until a join, so a device
  // backend may run them beside those later ops (the backward's weight gradients beside
  // the routing's, model.cpp). Ops issued between side_work_begin() and side_work_end()
  // start after everything issued before the begin; ops issued after the end may run
  // before or beside them until side_work_join(), after which everything issued later
  // starts after them. The caller keeps every buffer the side work reads or writes
  // untouched by the ops it may run beside. Only the order of whole ops changes, never
  // an op's arithmetic, so results are the same bits as in issue order. The default, the
  // CPU reference's and every ForwardingBackend's (whose wrappers watch ops in issue
  // order): issue order.
  virtual void side_work_begin() {}
  virtual void side_work_end() {}
  virtual void side_work_join() {}

  // ---- embedding: out[n] = table[tokens[n]];  dtable[tokens[n]] += dout[n]
  virtual void embedding_forward(Tensor out, Tensor tokens, Tensor table) = 0;
  virtual void embedding_backward(Tensor dtable, Tensor dout, Tensor tokens) = 0;

  // ---- RMSNorm over the last dimension of x [R, D] with weight [D]:
  //   y = x * rstd * w,  rstd[r] = 1/sqrt(mean(x[r]^2) + eps)   (rstd is saved)
  // backward: dx = (or += when accumulate_dx), dw +=
  virtual void rmsnorm_forward(Tensor y, Tensor rstd, Tensor x, Tensor w, double eps) = 0;
  virtual void rmsnorm_backward(Tensor dx, Tensor dw, Tensor dy, Tensor x, Tensor w,
                                Tensor rstd, bool accumulate_dx) = 0;
  // Residual add + RMSNorm (the standard scheme's site, residual_standard.cpp): exactly
  // add(x, a, b), then rmsnorm_forward(y, rstd, x, w, eps) of the stored (rounded) x, so
  // x, y and rstd are the same bits as the two ops'. x may be a or b (as for add); y is
  // none of x, a, b. This default is the reference; a backend may fuse (CUDA: one pass
  // that reads a, b, w and writes x, y, rstd once).
  virtual void add_rmsnorm_forward(Tensor x, Tensor y, Tensor rstd, Tensor a, Tensor b,
                                   Tensor w, double eps) {
    add(x, a, b);
    rmsnorm_forward(y, rstd, x, w, eps);
  }

  // ---- C = op(A) op(B) (or C += when accumulate); op(X) = X^T when trans_X.
  // 2-D tensors; a linear layer y = x W^T is matmul(y, x, W, false, true, false) and its
  // weight gradient dW += dy^T x is matmul(dW, dy, x, true, false, true). A and B share a
  // dtype; C may be grad_dtype() (fp32 accumulation into a weight gradient).
  virtual void matmul(Tensor c, Tensor a, Tensor b, bool trans_a, bool trans_b,
                      bool accumulate) = 0;
  // The model's three uses of matmul, named (llm.c's matmul_forward / matmul_backward
  // split), so that call sites say what they compute instead of passing three booleans:
  //   y = x W^T                 a linear layer (x [M, K], W [N, K] as stored)
  void matmul_forward(Tensor y, Tensor x, Tensor w) { matmul(y, x, w, false, true, false); }
  //   dx = dy W  (dx += dy W when accumulate: a layer input read by several products)
  void matmul_input_grad(Tensor dx, Tensor dy, Tensor w, bool accumulate) {
    matmul(dx, dy, w, false, false, accumulate);
  }
  //   dW += dy^T x              the weight gradient, accumulated into its grad buffer
  void matmul_weight_grad(Tensor dw, Tensor dy, Tensor x) { matmul(dw, dy, x, true, false, true); }

  // ---- RoPE in place on x [B, T, heads, head_dim], position = t, Hugging Face's
  // rotate-half pairing (i, i + head_dim/2). backward=true applies the inverse rotation
  // (the transpose), which is the gradient.
  virtual void rope(Tensor x, double theta, bool backward) = 0;

  // ---- QK-norm then RoPE (attention's q and k): exactly rmsnorm_forward(y, rstd, x, w,
  // eps) with w [head_dim], then RoPE in place on y [B, T, heads, head_dim] at positions
  // first_position + t (rope() when 0, else rope_at()). Backward: exactly rope(dy, theta,
  // true) then rmsnorm_backward(dx, dw, dy, x, w, rstd, accumulate_dx); dy's contents
  // are unspecified afterwards. These defaults are the reference; a backend may fuse.
  virtual void qk_norm_rope_forward(Tensor y, Tensor rstd, Tensor x, Tensor w, double eps,
                                    double theta, int64_t first_position) {
    rmsnorm_forward(y, rstd, x, w, eps);
    if (first_position == 0) rope(y, theta, false);
    else rope_at(y, theta, first_position);
  }
  virtual void qk_norm_rope_backward(Tensor dx, Tensor dw, Tensor dy, Tensor x, Tensor w,
                                     Tensor rstd, double theta, bool accumulate_dx) {
    rope(dy, theta, true);
    rmsnorm_backward(dx, dw, dy, x, w, rstd, accumulate_dx);
  }
  // q and k of one attention layer (the same eps, theta and positions): exactly the two
  // calls above, q's then k's; a backend may run both in one launch (the CUDA backend's
  // QK lab version 7 does: the second kernel's fixed cost is a sixth of k's time at 1B).
  virtual void qk_norm_rope_forward_qk(const QkNormRopeOperands& q, const QkNormRopeOperands& k,
                                       double eps, double theta, int64_t first_position) {
    qk_norm_rope_forward(q.y, q.rstd, q.x, q.w, eps, theta, first_position);
    qk_norm_rope_forward(k.y, k.rstd, k.x, k.w, eps, theta, first_position);
  }
  virtual void qk_norm_rope_backward_qk(const QkNormRopeGradOperands& q,
                                        const QkNormRopeGradOperands& k, double theta,
                                        bool accumulate_dx) {
    qk_norm_rope_backward(q.dx, q.dw, q.dy, q.x, q.w, q.rstd, theta, accumulate_dx);
    qk_norm_rope_backward(k.dx, k.dw, k.dy, k.x, k.w, k.rstd, theta, accumulate_dx);
  }

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

  // ---- SwiGLU: h = silu(gate) * up, on the stacked gate/up projection's output:
  // gate_up [N, 2F], row i = [gate_i | up_i] (F each), h and dh [N, F]. The backward
  // overwrites d_gate_up (gate_up's layout) and, unless it is empty, h with the value
  // swiglu_forward writes, bit for bit: the model recomputes h there for the down
  // projection's weight gradient instead of keeping it from the forward (one [N, d_ff]
  // buffer a layer; 6 GB at 1B, for one more write per element).
  virtual void swiglu_forward(Tensor h, Tensor gate_up) = 0;
  virtual void swiglu_backward(Tensor d_gate_up, Tensor h, Tensor dh, Tensor gate_up) = 0;

  // ---- elementwise: out = a + b;  y += x
  virtual void add(Tensor out, Tensor a, Tensor b) = 0;
  virtual void add_inplace(Tensor y, Tensor x) = 0;

  // ---- classifier: losses[n] = logsumexp(logits[n]) - logits[n, targets[n]] (stat
  // dtype). With compute_grad, logits [N, V] are overwritten by their gradient
  // grad_scale * (softmax(logits[n]) - onehot(targets[n])).
  virtual void cross_entropy(Tensor losses, Tensor logits, Tensor targets, double grad_scale,
                             bool compute_grad) = 0;

  // ---- depth routing (DESIGN.md sections 2 and 3), split by source rather than by site.
  // `layout` (above) says which source slots each site reads; pair (i, k) is slot i read
  // by site k. Per-pair statistics live in one tensor `weights` [layout.pairs(), H, N]
  // (stat dtype), pair (i, k) at layout.pair(i, k): the pairs of one slot are contiguous.
  // Each pair holds first the raw logit, then (after routing_mix of site k) the softmax
  // weight, then (after routing_source_backward of slot i) the logit gradient times
  // inv_rms. `params` gives every site's query and gain [d] (act dtype) and, for the
  // backward, their gradients (grad dtype, +=); it has layout.sites entries.
  //
  // Slot i, as soon as its history row v [N, d] is written:
  //   inv_rms[n] = 1/sqrt(mean_c v[n,c]^2 + eps)                                (overwritten)
  //   weights[pair(i,k), h, n] = inv_rms[n] * sum_{c in h} q_k[c] g_k[c] v[n,c]
  //                                                        for k = i .. last_site(i)
  // The queries are parameters, so a slot's logits for every later site are known at
  // once: one read of v, instead of one per site.
  virtual void routing_source_logits(Tensor weights, Tensor inv_rms, Tensor v,
                                     const RoutingParams& params, const RoutingLayout& layout,
                                     int source, int heads, double eps) = 0;
  // Site j: softmax over its sources (slots i = site_source(j, t)) in place
  // (weights[pair(i,j)] becomes a_i, saved), then
  // x[n,c] = sum_i a_i[head(c), n] * history[i, n, c] (overwritten). history is
  // [layout.sources, N, d]; only the site's own slots are read.
  virtual void routing_mix(Tensor x, Tensor weights, Tensor history, const RoutingLayout& layout,
                           int site, int heads) = 0;
  // The mix of site j and its consumer's input norm: exactly routing_mix(x, ...), then
  // rmsnorm_forward(y, rstd, x, norm_w, eps) of the stored x, so x, y, rstd and the
  // weights are the same bits as the two ops'. This default is the reference; a backend
  // may normalise each token's row while it still holds it (CUDA: inside a depth tile's
  // finish kernels), saving a read of x and a launch.
  virtual void routing_mix_rmsnorm(Tensor x, Tensor y, Tensor rstd, Tensor weights, Tensor history,
                                   const RoutingLayout& layout, int site, int heads, Tensor norm_w,
                                   double eps) {
    routing_mix(x, weights, history, layout, site, heads);
    rmsnorm_forward(y, rstd, x, norm_w, eps);
  }
  // Depth tiling (DESIGN.md section 3), a speed-up of the mix with the same results:
  // routing_mix_tile(..., site, count, ...) is routing_mix(..., site, ...) plus a promise
  // that sites site+1 .. site+count-1 are mixed next, in order, by routing_mix with the
  // same weights and history, and that until then only slots > site and their pairs are
  // written. A backend may then read the slots <= site once for the whole tile, keeping
  // each later site's partial softmax sums in its own memory, so that those sites read
  // only their newer slots. routing_tile_sites() is the largest tile this backend takes
  // for a layout and width (1: it does not tile; the default and the CPU reference), and
  // routing_tile_plan() the tiles it wants, in site order: their counts, which sum to
  // layout.sites (a count of 1 is a site mixed on its own). The default plan is tiles of
  // routing_tile_sites() from site 0.
  virtual void routing_mix_tile(Tensor x, Tensor weights, Tensor history,
                                const RoutingLayout& layout, int site, int count, int heads) {
    (void)count;
    routing_mix(x, weights, history, layout, site, heads);
  }
  // A tile's first site with its consumer's input norm: exactly routing_mix_tile(x, ...),
  // then rmsnorm_forward(y, rstd, x, norm_w, eps), as routing_mix_rmsnorm is to routing_mix
  // (CUDA: the norm inside the tile kernel's last pass over the site's row).
  virtual void routing_mix_tile_rmsnorm(Tensor x, Tensor y, Tensor rstd, Tensor weights,
                                        Tensor history, const RoutingLayout& layout, int site,
                                        int count, int heads, Tensor norm_w, double eps) {
    routing_mix_tile(x, weights, history, layout, site, count, heads);
    rmsnorm_forward(y, rstd, x, norm_w, eps);
  }
  virtual int routing_tile_sites(const RoutingLayout& layout, int64_t d, int heads) const {
    (void)layout, (void)d, (void)heads;
    return 1;
  }
  virtual std::vector<int> routing_tile_plan(const RoutingLayout& layout, int64_t d,
                                             int heads) const {
    return layout.uniform_tiles(routing_tile_sites(layout, d, heads));
  }
  // Slot i's gradient, source-stationary: once the input gradient of every site k in
  // [i, last_site(i)] exists in site_dx[k] [N, d] (one tensor per site, so that the model
  // can give each its own lifetime; entries of other sites are not read). With
  // a_k = weights[pair(i,k)],
  // r = inv_rms (of slot i), u_k = sum_{c in h} dx_k[c] v[c] and
  // ubar_k = sum_{c in h} dx_k[c] x_k[c] (= sum over site k's sources i' of a_i' u_i'):
  //   ds_k[h] = a_k[h] (u_k[h] - ubar_k[h])                          (softmax backward)
  //   dv[c] = sum_k ( a_k[head(c)] dx_k[c] + r q_k[c] g_k[c] ds_k[head(c)] )
  //           - v[c] r^3 / d * sum_k sum_{c'} ds_k[head(c')] q_k[c'] g_k[c'] v[c']
  //   (sums over k = i .. last_site(i); the last term is the gradient through inv_rms)
  //                                                                   (dv overwritten)
  //   weights[pair(i,k), h, n] := ds_k[h] * r                          (for the key grads)
  //   gsum += contributions to G_k[c] = sum_n ds_k[head(c)] r v[c]     (see below)
  // ubar [sites, H, N] (stat dtype): row i is computed here from dx_i and x (site i's
  // input; slot i is the newest source of site i, so its call comes first in the
  // backward) and written; rows k > i were written by the later slots' calls.
  // gsum [C, sites, d] (grad dtype) is scratch, zeroed before the first slot: the backend
  // spreads token rows over the C slabs as it likes; only the sum over slabs is defined.
  virtual void routing_source_backward(Tensor dv, Tensor weights, Tensor ubar, Tensor gsum,
                                       const std::vector<Tensor>& site_dx, Tensor x, Tensor v,
                                       Tensor inv_rms, const RoutingParams& params,
                                       const RoutingLayout& layout, int source, int heads) = 0;
  // Depth tiling of the backward, a speed-up with the same results (up to fp32 summation
  // order): routing_source_backward_tile(..., history, inv_rms, ..., source, count, ...)
  // is routing_source_backward(..., history[source], inv_rms[source], ..., source, ...)
  // (history [layout.sources, N, d], inv_rms [layout.sources, N]) plus a promise that the
  // tile's older slots (RoutingLayout::back_tile_count: source - block, ...,
  // source - (count-1) block) come next, in order, by routing_source_backward with the
  // same weights, ubar, gsum, site_dx and x/v/inv_rms rows of those slots; that between
  // them only the slots in between run their own backward (routing_source_backward,
  // delta_site_backward); and that until the tile's last slot only site_dx[k] for
  // k < source, the pairs and ubar rows of sites < source are written. A backend may then
  // stream each site gradient k >= source once for the tile's slots, keeping their
  // partial gradients in its own memory, so that the older slots read only their newer
  // sites. routing_backward_tile_slots() is the tile this backend wants (1: it does not
  // tile; the default and the CPU reference).
  virtual void routing_source_backward_tile(Tensor dv, Tensor weights, Tensor ubar, Tensor gsum,
                                            const std::vector<Tensor>& site_dx, Tensor x,
                                            Tensor history, Tensor inv_rms,
                                            const RoutingParams& params,
                                            const RoutingLayout& layout, int source, int count,
                                            int heads) {
    (void)count;
    routing_source_backward(dv, weights, ubar, gsum, site_dx, x, history[source], inv_rms[source],
                            params, layout, source, heads);
  }
  virtual int routing_backward_tile_slots(const RoutingLayout& layout, int64_t d, int heads) const {
    (void)layout, (void)d, (void)heads;
    return 1;
  }
  // After slot 0's backward: with G_k = sum over slabs of gsum[:, k, :],
  //   dquery_k += g_k * G_k,  dgain_k += q_k * G_k   for every site k.
  virtual void routing_param_grads(const RoutingParams& params, Tensor gsum) = 0;

  // ---- routing probe (engine/probe.h). After routing_mix of `site` (its pairs hold
  // a_t[h, n] for its sources t = 0 .. src-1, src = layout.site_sources(site)),
  // accumulates over the N tokens into `stats` (F64, [H*src + H + 1], this backend's
  // memory; "+="):
  //   stats[h*src + t]  += sum_n a_t[h, n]
  //   stats[H*src + h]  += sum_n -sum_t a_t[h, n] ln a_t[h, n]
  //   stats[H*(src+1)]  += sum_n mean_{h<g} JS(a[h, :, n], a[g, :, n])   (0 when H = 1)
  // with JS in nats. The default downloads the site's pairs and reduces on the host;
  // a device backend overrides it so that only the small stats leave the device.
  virtual void routing_stats(Tensor stats, Tensor weights, const RoutingLayout& layout, int site,
                             int heads);

  // ---- Hyper-Connections (residual.mode hyper, DESIGN.md section 2; residual_hyper.cpp).
  // Streams H [n, N, d] (act dtype), stream i at H[i]. One sublayer's coefficients are
  // parameters (act dtype): a mix vector [n], A_r [n, n] row-major (A_r[r, i] at
  // r * n + i: how much of stream r goes into new stream i), B [n]; their gradients
  // (grad dtype) are "+=". The CPU reference and the CUDA backend implement them; the
  // defaults fail naming the mode, and has_hyper_ops() says so before a model is built.
  virtual bool has_hyper_ops() const { return false; }
  // Fails, naming the mode and what would run, when this backend cannot run hyper with n
  // streams (dynamic: per-token coefficients); the scheme calls it when a model is built.
  virtual void check_hyper(int n, bool dynamic) const;
  //   x = sum_i coef[i] H[i]   (x overwritten; an empty coef is all ones: the head's sum)
  virtual void hyper_mix(Tensor x, Tensor H, Tensor coef);
  //   dH[i] = coef[i] dx   (+= when accumulate);   dcoef[i] += sum_{n,c} dx H[i]
  // (an empty coef is all ones and has no gradient; then dcoef and H may be empty).
  virtual void hyper_mix_backward(Tensor dH, Tensor dcoef, Tensor dx, Tensor H, Tensor coef,
                                  bool accumulate);
  //   out[i] = B[i] v + sum_r A_r[r, i] in[r]    (v [N, d] the sublayer's output; out
  //   overwritten, a different buffer from in)
  virtual void hyper_update(Tensor out, Tensor in, Tensor v, Tensor Ar, Tensor B);
  // Its backward, from dout = d(loss)/d(out):
  //   din[r] = sum_i A_r[r, i] dout[i],  dv = sum_i B[i] dout[i]       (overwritten)
  //   dAr[r, i] += sum_{n,c} dout[i] in[r],  dB[i] += sum_{n,c} dout[i] v
  virtual void hyper_update_backward(Tensor din, Tensor dv, Tensor dAr, Tensor dB, Tensor dout,
                                     Tensor in, Tensor v, Tensor Ar, Tensor B);
  // Dynamic Hyper-Connections (residual.hyper_dynamic; engine/cpu/hyper.h for the
  // equations): per token t and stream r, Q = n + 2 coefficients C[t, r, :] = (mix,
  // update row A_r[r, :], output share B[r]) = static + s * tanh(rmsnorm(h_r[t]) @ W),
  // W [d, Q]. C, dC, T (the tanh) [N, n, Q] and rstd [N, n] are stat dtype; s_a, s_b are
  // one-element parameters. The CPU reference and the CUDA backend implement them.
  //   C, T, rstd from H and the parameters (overwritten)
  virtual void hyper_dynamic_coef(Tensor C, Tensor T, Tensor rstd, Tensor H, Tensor W, Tensor Am,
                                  Tensor Ar, Tensor B, Tensor s_a, Tensor s_b, double eps);
  //   x[t] = sum_r C[t, r, 0] H[r][t]   (overwritten)
  virtual void hyper_mix_dynamic(Tensor x, Tensor H, Tensor C);
  //   dH[r][t] += C[t, r, 0] dx[t];  dC[t, r, 0] = <dx[t], H[r][t]>  (that column overwritten)
  virtual void hyper_mix_dynamic_backward(Tensor dH, Tensor dC, Tensor dx, Tensor H, Tensor C);
  //   out[i][t] = C[t, i, n+1] v[t] + sum_r C[t, r, 1+i] in[r][t]   (out overwritten)
  virtual void hyper_update_dynamic(Tensor out, Tensor in, Tensor v, Tensor C);
  //   din, dv (overwritten); dC's columns 1..n+1 (overwritten)
  virtual void hyper_update_dynamic_backward(Tensor din, Tensor dv, Tensor dC, Tensor dout,
                                             Tensor in, Tensor v, Tensor C);
  //   from the complete dC: dH += (through C's dependence on H), dW, dAm, dAr, dB, ds_a,
  //   ds_b += (grad dtype)
  virtual void hyper_dynamic_coef_backward(Tensor dH, Tensor dW, Tensor dAm, Tensor dAr,
                                           Tensor dB, Tensor ds_a, Tensor ds_b, Tensor dC,
                                           Tensor H, Tensor W, Tensor T, Tensor rstd,
                                           Tensor s_a, Tensor s_b);

  // ---- delta mode (residual.mode delta, DESIGN.md section 2; residual_delta.cpp): the
  // gated routed term and the learned null source. alpha [1] and row [d] are parameters
  // (act dtype); dalpha and drow are their gradients (grad dtype, "+="). The reductions
  // are deterministic (no float atomics). `scratch` [C, d] (grad dtype, C >= 1) is the
  // op's own workspace: its contents before and after are undefined. The defaults fail
  // naming the mode; has_delta_ops() says so before a model is built.
  virtual bool has_delta_ops() const { return false; }
  //   x = base + alpha[0] * r                     (x overwritten; may alias base)
  virtual void delta_gate(Tensor x, Tensor base, Tensor alpha, Tensor r);
  //   dr = alpha[0] * dx (overwritten);  dalpha[0] += sum_{n,c} dx[n,c] r[n,c]
  virtual void delta_gate_backward(Tensor dr, Tensor dalpha, Tensor dx, Tensor r, Tensor alpha,
                                   Tensor scratch);
  //   out[n, c] = row[c] for every row n of out [N, d]   (overwritten)
  virtual void delta_null_forward(Tensor out, Tensor row);
  //   drow[c] += sum_n dout[n, c]
  virtual void delta_null_backward(Tensor drow, Tensor dout, Tensor scratch);
  // Fused steps of the scheme's loop (residual_delta.cpp). Each default is the sequence
  // of ops it replaces, and is the reference: a backend that overrides one computes the
  // same bits (the same fp32 operations, each result rounded to the act dtype where the
  // sequence stores it), so the conversion identity holds on it exactly as before.
  // `next`/`prev` may be empty (Tensor()): that step is skipped. All tensors [N, d], act
  // dtype, distinct buffers.
  //   stream += slot; then, when prev is given, slot += prev
  // (a finished sublayer's output joins the running standard stream, then its history
  // slot becomes its block's running sum)
  virtual void delta_stream_advance(Tensor stream, Tensor slot, Tensor prev) {
    add_inplace(stream, slot);
    if (!prev.empty()) add_inplace(slot, prev);
  }
  //   dresid += dx; then delta_gate_backward(dr, dalpha, dx, r, alpha, scratch)
  virtual void delta_resid_gate_backward(Tensor dresid, Tensor dr, Tensor dalpha, Tensor dx,
                                         Tensor r, Tensor alpha, Tensor scratch) {
    add_inplace(dresid, dx);
    delta_gate_backward(dr, dalpha, dx, r, alpha, scratch);
  }
  //   slot += next (when next is given); then out = dresid + slot
  // (a slot's routing gradient gathers the later slots of its block; v's whole gradient
  // is the standard part plus that)
  virtual void delta_source_grad(Tensor out, Tensor dresid, Tensor slot, Tensor next) {
    if (!next.empty()) add_inplace(slot, next);
    add(out, dresid, slot);
  }
  // The whole forward of a site j >= 1 (residual_delta.cpp): v_j joins the stream and its
  // slot becomes its block's running sum, the slot's logits, site j's mix, the gate:
  //   delta_stream_advance(stream, history[j], continues ? history[j-1] : Tensor());
  //   routing_source_logits(weights, inv_rms, history[j], *params, layout, j, heads, eps);
  //   routing_mix(r, weights, history, layout, j, heads);
  //   delta_gate(x, stream, alpha, r)
  // An override gives the sequence's bits in every output. The fusion's point, for a slot
  // read by site j alone (a block's partial sum): the new slot row is in registers when
  // its logits and the mix need it, and so is the advanced stream when the gate does, so
  // the stream, v, the slot and r are read once where the sequence reads them 2-3 times.
  virtual void delta_site_forward(const DeltaSiteForward& a) {
    const Tensor slot = a.history[a.site];
    delta_stream_advance(a.stream, slot, a.continues ? a.history[a.site - 1] : Tensor());
    routing_source_logits(a.weights, a.inv_rms, slot, *a.params, a.layout, a.site, a.heads, a.eps);
    routing_mix(a.r, a.weights, a.history, a.layout, a.site, a.heads);
    delta_gate(a.x, a.stream, a.alpha, a.r);
  }
  // The whole backward of a site j >= 1 whose slot is read by site j alone (a block's
  // partial sum: layout.last_site(j) == j), as residual_delta.cpp runs it:
  //   delta_resid_gate_backward(dresid, dr, dalpha, dx, r, alpha, scratch);
  //   routing_source_backward(slot, weights, ubar, gsum, *site_dx, r, v, inv_rms, *params,
  //                           layout, j, heads);          ((*site_dx)[j] is dr)
  //   delta_source_grad(out, dresid, slot, next)
  // An override gives the sequence's bits in every output but dalpha, whose sum over the
  // tokens may run in another fixed order (deterministic; within the fp32 bound of its
  // length). The fusion's point: each row-sized tensor is read or written once, where the
  // sequence reads r and dresid twice and writes dr and the slot's gradient, then reads
  // them back.
  virtual void delta_site_backward(const DeltaSiteBackward& a) {
    delta_resid_gate_backward(a.dresid, a.dr, a.dalpha, a.dx, a.r, a.alpha, a.scratch);
    routing_source_backward(a.slot, a.weights, a.ubar, a.gsum, *a.site_dx, a.r, a.v, a.inv_rms,
                            *a.params, a.layout, a.site, a.heads);
    delta_source_grad(a.out, a.dresid, a.slot, a.next);
  }

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
  // Many adamw() calls as one (the optimizer's whole shard, every step). A segment is one
  // call's tensors; its weight decay is the step's hp.weight_decay where `decay`, else 0.
  // Segments must not overlap. A group is made once (a backend may keep device tables of
  // its segments) and stepped with each step's hyperparameters; its tensors must stay
  // where they are, and the backend must outlive it. The default calls adamw() once per
  // segment, in order: the reference an override matches bit for bit. adamw_step accepts
  // a group made by any backend (one it did not make runs the default loop).
  struct AdamWSegment {
    Tensor param, master, grad, m, v;
    bool decay = false;
  };
  class AdamWGroup {
   public:
    explicit AdamWGroup(std::vector<AdamWSegment> segments) : segments_(std::move(segments)) {}
    virtual ~AdamWGroup() = default;
    const std::vector<AdamWSegment>& segments() const { return segments_; }

   private:
    std::vector<AdamWSegment> segments_;
  };
  virtual std::unique_ptr<AdamWGroup> adamw_group(std::vector<AdamWSegment> segments) {
    return std::make_unique<AdamWGroup>(std::move(segments));
  }
  virtual void adamw_step(const AdamWGroup& group, const AdamW& hp) {
    for (const AdamWSegment& s : group.segments()) {
      AdamW h = hp;
      h.weight_decay = s.decay ? hp.weight_decay : 0.0;
      adamw(s.param, s.master, s.grad, s.m, s.v, h);
    }
  }
};

// A model's op scratch bound for one pass (Backend::op_scratch_bytes); the binding it
// replaced comes back on scope exit, also when the pass throws.
class OpScratchBinding {
 public:
  OpScratchBinding(Backend& be, const Backend::OpScratch& scratch)
      : be_(be), previous_(be.bind_op_scratch(scratch)) {}
  ~OpScratchBinding() { be_.bind_op_scratch(previous_); }
  OpScratchBinding(const OpScratchBinding&) = delete;
  OpScratchBinding& operator=(const OpScratchBinding&) = delete;

 private:
  Backend& be_;
  Backend::OpScratch previous_;
};

inline void Backend::rope_at(Tensor, double, int64_t) {
  fail(name(), " does not implement incremental decoding yet; run sampling on the CPU");
}
inline void Backend::attention_cached(Tensor, Tensor, Tensor, Tensor) {
  fail(name(), " does not implement incremental decoding yet; run sampling on the CPU");
}

// The refusal of every Hyper-Connections op on a backend without them.
[[noreturn]] inline void hyper_unsupported(const std::string& backend) {
  fail("residual.mode hyper has no kernels on the ", backend,
       " backend (the CPU backend is its reference): run it with --device cpu");
}
inline void Backend::check_hyper(int, bool) const {
  if (!has_hyper_ops()) hyper_unsupported(name());
}
inline void Backend::hyper_mix(Tensor, Tensor, Tensor) { hyper_unsupported(name()); }
inline void Backend::hyper_mix_backward(Tensor, Tensor, Tensor, Tensor, Tensor, bool) {
  hyper_unsupported(name());
}
inline void Backend::hyper_update(Tensor, Tensor, Tensor, Tensor, Tensor) {
  hyper_unsupported(name());
}
inline void Backend::hyper_update_backward(Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor,
                                           Tensor, Tensor) {
  hyper_unsupported(name());
}

inline void Backend::hyper_dynamic_coef(Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor,
                                        Tensor, Tensor, Tensor, double) {
  hyper_unsupported(name());
}
inline void Backend::hyper_mix_dynamic(Tensor, Tensor, Tensor) { hyper_unsupported(name()); }
inline void Backend::hyper_mix_dynamic_backward(Tensor, Tensor, Tensor, Tensor, Tensor) {
  hyper_unsupported(name());
}
inline void Backend::hyper_update_dynamic(Tensor, Tensor, Tensor, Tensor) {
  hyper_unsupported(name());
}
inline void Backend::hyper_update_dynamic_backward(Tensor, Tensor, Tensor, Tensor, Tensor, Tensor,
                                                   Tensor) {
  hyper_unsupported(name());
}
inline void Backend::hyper_dynamic_coef_backward(Tensor, Tensor, Tensor, Tensor, Tensor, Tensor,
                                                 Tensor, Tensor, Tensor, Tensor, Tensor, Tensor,
                                                 Tensor, Tensor) {
  hyper_unsupported(name());
}
[[noreturn]] inline void delta_unsupported(const std::string& backend) {
  fail("residual.mode delta has no kernels on the ", backend,
       " backend (the CPU backend is its reference): run it with --device cpu");
}
inline void Backend::delta_gate(Tensor, Tensor, Tensor, Tensor) { delta_unsupported(name()); }
inline void Backend::delta_gate_backward(Tensor, Tensor, Tensor, Tensor, Tensor, Tensor) {
  delta_unsupported(name());
}
inline void Backend::delta_null_forward(Tensor, Tensor) { delta_unsupported(name()); }
inline void Backend::delta_null_backward(Tensor, Tensor, Tensor) { delta_unsupported(name()); }

// The CPU reference backend in fp32 (dtype F32) or fp64 (F64, for gradient checks).
std::unique_ptr<Backend> make_cpu_backend(DType dtype = DType::F32);

}  // namespace mhar
