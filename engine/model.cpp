// model.cpp: parameter layout, activation memory plan, and the one layer loop (forward
// and backward) of the model in model.h.
//
// Timeline used by the activation plan. Forward events, in order:
//   site j           at 2j        (j = 0..2L; x_j and its consumer's input norm, which
//                                 the scheme may fuse; site 0 also runs the embedding)
//   sublayer j       at 2j + 1    (j = 0..2L-1; even j attention, odd j MLP)
//   head             at 4L + 1    (LM head, cross-entropy, and with a loss
//                                 scale the head's input and weight gradients)
// The backward runs the same E = 4L + 2 events in reverse: event e at 2E - 1 - e.
// A buffer saved by event e for its backward lives [e, 2E-1-e]; a backward scratch lives
// only at its event, so scratch of different layers shares memory.
//
// The head runs in chunks of chunk_ tokens (train.logits_chunk; config.h's
// logits_chunk_tokens picks it): per chunk, logits [chunk, V] = xn W^T, the
// cross-entropy (losses, and in place the gradient, whose scale the forward knows), then
// d xn = dlogits W for the chunk's rows and dW += dlogits^T xn, so only one chunk's
// logits exist at any time (the idea of Cut Cross-Entropy / fused linear cross-entropy,
// with every product still a tensor-core GEMM of the backend). One chunk (chunk_ = N, every
// test-sized model) issues exactly the ops of the unchunked head. More chunks change one
// thing numerically: the head's weight gradient sums its N token terms chunk by chunk.
//
// The residual mode is a ResidualScheme (residual.h): it builds the site inputs, owns
// their buffers and their gradients and the gradients of the sources; the loop below
// reads the same for every mode.
#include "engine/model.h"

#include <algorithm>
#include <cmath>
#include <cstdio>

#include "engine/error.h"

namespace mhar {

namespace {

// splitmix64: a tiny, fully specified generator, so initial weights are identical on
// every platform and backend for the same seed.
struct SplitMix64 {
  uint64_t s;
  uint64_t next() {
    uint64_t z = (s += 0x9E3779B97F4A7C15ULL);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    return z ^ (z >> 31);
  }
  double uniform() { return (double(next() >> 11) + 0.5) * 0x1.0p-53; }  // (0, 1)
  double normal() {  // Box-Muller; one draw per call keeps the stream simple
    return std::sqrt(-2.0 * std::log(uniform())) * std::cos(6.283185307179586 * uniform());
  }
};

}  // namespace

struct Model::SublayerActs {
  // Saved for the backward (both kinds).
  int xn = -1, rstd = -1;
  // Attention.
  int q_pre = -1, k_pre = -1, q = -1, k = -1, v = -1, q_rstd = -1, k_rstd = -1, att = -1,
      lse = -1;
  // MLP: the stacked projection's output [N, 2F], row = [gate | up] (h is forward-only:
  // the backward recomputes it into h_again).
  int gate_up = -1, h = -1;
  // Backward scratch.
  int d_xn = -1, d_att = -1, dq = -1, dk = -1, dv = -1, dq_pre = -1, dk_pre = -1, d_h = -1,
      d_gate_up = -1, h_again = -1;
};

struct Model::StepBuffers {
  int tokens = -1, targets = -1, history = -1, losses = -1;
  std::vector<int> site_x;  // planned by the scheme
  int xfn = -1, rstd_f = -1, logits = -1, d_xfn = -1;
  int op_scratch = -1;  // the backend's op temporaries (Backend::op_scratch_bytes)
  OpScratchShapes scratch_shapes;
};

struct Model::KvCache {
  int capacity = 0, used = 0;
  std::unique_ptr<MemoryPlan> plan;
  std::unique_ptr<Arena> arena;
  std::vector<int> k, v;  // per layer, [capacity, n_kv_heads, head_dim]
};

Model::Model(const ModelConfig& model, const ResidualConfig& residual, Backend& backend,
             int batch, int seq_len, int grad_shards, int64_t logits_chunk)
    : cfg_(model), res_(residual), be_(backend), B_(batch), T_(seq_len),
      N_(int64_t(batch) * seq_len), grad_shards_(grad_shards), chunk_request_(logits_chunk) {
  MHAR_CHECK(batch > 0 && seq_len > 0, "batch ", batch, " seq_len ", seq_len);
  MHAR_CHECK(grad_shards >= 1, "grad_shards ", grad_shards);
  MHAR_CHECK(logits_chunk >= 0, "logits_chunk ", logits_chunk);
  scheme_ = make_residual_scheme(
      SchemeContext{be_, cfg_, res_, [this](int id) { return act(id); }, params_});
  plan_parameters();
  plan_activations();
}

Model::~Model() = default;

void Model::plan_parameters() {
  const int64_t d = cfg_.d_model, V = cfg_.vocab_size, F = cfg_.d_ff, hd = cfg_.head_dim;
  const DType pt = be_.act_dtype(), gt = be_.grad_dtype();
  param_plan_ = std::make_unique<MemoryPlan>("parameters");
  grad_plan_ = std::make_unique<MemoryPlan>("gradients");
  // Both allocations get the same layout in elements (buckets of parameters, each
  // parameter padded to kParamAlign elements, each bucket to grad_shards * kParamAlign),
  // so one element range names the same weights, gradients and optimizer state.
  // A stack (the projections that read one input: [q; k; v], [gate; up]) is one plan
  // buffer padded as a whole, its members back to back inside it, so the stacked weight
  // is one row-major matrix for one GEMM; every other user (checkpoints, HF export, the
  // optimizer's segments) still sees the members as separate parameters.
  auto round_up = [](int64_t x, int64_t a) { return (x + a - 1) / a * a; };
  int64_t elems = 0;
  struct Placement {
    int plan_id;
    int64_t first = 0, rows = 0, cols = 0;  // a stack member: its rows of the plan buffer
  };
  std::vector<Placement> placed;
  auto new_parameter = [&](const std::string& name, bool decay, Init init, double init_std,
                           Placement at) {
    Parameter prm{name, Tensor(), Tensor(), decay, init, init_std};
    prm.offset = elems + at.first;
    prm.bucket = int(buckets_.size()) - 1;
    params_.push_back(prm);
    placed.push_back(at);
    return int(params_.size()) - 1;
  };
  auto plan_buffer = [&](const std::string& name, std::initializer_list<int64_t> shape) {
    int64_t n = 1;
    for (int64_t s : shape) n *= s;
    const int64_t padded = round_up(n, kParamAlign);
    const int id = param_plan_->add_padded(name, pt, shape, padded);
    MHAR_CHECK(grad_plan_->add_padded(name, gt, shape, padded) == id, "plan ids");
    return std::pair<int, int64_t>{id, padded};
  };
  auto add = [&](const std::string& name, std::initializer_list<int64_t> shape, bool decay,
                 Init init, double init_std = 0) {
    const auto [id, padded] = plan_buffer(name, shape);
    const int index = new_parameter(name, decay, init, init_std, {id});
    elems += padded;
    return index;
  };
  auto open_bucket = [&](const std::string& name) {
    GradBucket b;
    b.name = name;
    b.first_param = int(params_.size());
    b.offset = elems;
    buckets_.push_back(b);
  };
  auto close_bucket = [&] {
    GradBucket& b = buckets_.back();
    b.end_param = int(params_.size());
    const int64_t used = elems - b.offset, total = round_up(used, kParamAlign * grad_shards_);
    if (total > used) {
      param_plan_->add(b.name + ".padding", pt, {total - used});
      grad_plan_->add(b.name + ".padding", gt, {total - used});
    }
    b.numel = total;
    elems = b.offset + total;
  };
  // DESIGN.md section 1: matrices normal(0, init_std), the output projections (whose
  // outputs are sources) scaled by 1/sqrt(2L), norm weights 1.
  const double std = cfg_.init_std, out_std = std * (1.0 / std::sqrt(2.0 * cfg_.n_layers));
  auto matrix = [&](const std::string& name, std::initializer_list<int64_t> shape, double s) {
    return add(name, shape, true, Init::Normal, s);
  };
  auto norm = [&](const std::string& name, int64_t n) { return add(name, {n}, false, Init::One); };
  // Matrices of `cols` columns stacked by rows; returns the stack's plan id and writes
  // each member's parameter index to *index.
  struct Member {
    std::string name;
    int64_t rows;
    double std;
    int* index;
  };
  auto stack = [&](const std::string& name, int64_t cols, std::initializer_list<Member> members) {
    int64_t rows = 0;
    for (const Member& m : members) rows += m.rows;
    const auto [id, padded] = plan_buffer(name, {rows, cols});
    int64_t first = 0;
    for (const Member& m : members) {
      *m.index = new_parameter(m.name, true, Init::Normal, m.std, {id, first, m.rows, cols});
      first += m.rows * cols;
    }
    elems += padded;
    return id;
  };
  open_bucket("embedding");
  embed_ = matrix("model.embed_tokens.weight", {V, d}, std);
  close_bucket();
  for (int l = 0; l < cfg_.n_layers; ++l) {
    const std::string pre = "model.layers." + std::to_string(l) + ".";
    open_bucket("layer." + std::to_string(l));
    LayerParams lp;
    lp.attn_norm = norm(pre + "input_layernorm.weight", d);
    lp.qkv = stack(pre + "self_attn.qkv_proj.stack", d,
                   {{pre + "self_attn.q_proj.weight", cfg_.q_dim(), std, &lp.wq},
                    {pre + "self_attn.k_proj.weight", cfg_.kv_dim(), std, &lp.wk},
                    {pre + "self_attn.v_proj.weight", cfg_.kv_dim(), std, &lp.wv}});
    lp.wo = matrix(pre + "self_attn.o_proj.weight", {d, cfg_.q_dim()}, out_std);
    lp.q_norm = norm(pre + "self_attn.q_norm.weight", hd);
    lp.k_norm = norm(pre + "self_attn.k_norm.weight", hd);
    lp.mlp_norm = norm(pre + "post_attention_layernorm.weight", d);
    lp.gate_up = stack(pre + "mlp.gate_up_proj.stack", d,
                       {{pre + "mlp.gate_proj.weight", F, std, &lp.w_gate},
                        {pre + "mlp.up_proj.weight", F, std, &lp.w_up}});
    lp.w_down = matrix(pre + "mlp.down_proj.weight", {d, F}, out_std);
    layers_.push_back(lp);
    close_bucket();
  }
  open_bucket("head");
  final_norm_ = norm("model.norm.weight", d);
  if (!cfg_.tie_embeddings) lm_head_ = matrix("lm_head.weight", {V, d}, std);
  close_bucket();
  if (const char* bucket = scheme_->bucket()) {
    open_bucket(bucket);
    scheme_->add_parameters([&](const std::string& name, int64_t n, Init init, int64_t arg) {
      const int id = add(name, {n}, false, init);
      params_[size_t(id)].init_arg = arg;
      return id;
    });
    close_bucket();
  }
  param_plan_->plan();
  grad_plan_->plan();
  param_arena_ = std::make_unique<Arena>(be_, *param_plan_);
  grad_arena_ = std::make_unique<Arena>(be_, *grad_plan_);
  auto place = [](Tensor buffer, const Placement& at) {
    if (at.rows == 0) return buffer;
    return Tensor(static_cast<char*>(buffer.data) + size_t(at.first) * dtype_size(buffer.dtype),
                  buffer.dtype, {at.rows, at.cols});
  };
  for (size_t i = 0; i < params_.size(); ++i) {
    const Placement& at = placed[i];
    params_[i].value = place(param_arena_->tensor(at.plan_id), at);
    params_[i].grad = place(grad_arena_->tensor(at.plan_id), at);
    MHAR_CHECK(param_plan_->buffers()[size_t(at.plan_id)].offset ==
                       size_t(params_[i].offset - at.first) * dtype_size(pt) &&
                   grad_plan_->buffers()[size_t(at.plan_id)].offset ==
                       size_t(params_[i].offset - at.first) * dtype_size(gt),
               "parameter layout of ", params_[i].name);
  }
  MHAR_CHECK(param_plan_->total_bytes() == size_t(elems) * dtype_size(pt) &&
                 grad_plan_->total_bytes() == size_t(elems) * dtype_size(gt),
             "parameter allocation size");
  scheme_->bind_parameters();
}

void Model::plan_activations() {
  const int L = cfg_.n_layers, S = cfg_.n_sources();
  const int64_t N = N_, d = cfg_.d_model, F = cfg_.d_ff, V = cfg_.vocab_size;
  const int64_t qd = cfg_.q_dim(), kvd = cfg_.kv_dim();
  const DType at = be_.act_dtype(), st = be_.stat_dtype();
  const Timeline tl{L};
  const int last = tl.last();
  auto tb = [&](int e) { return tl.back(e); };
  auto sub_ev = [&](int j) { return tl.sublayer(j); };
  const int head_ev = tl.head();

  act_plan_ = std::make_unique<MemoryPlan>("activations");
  MemoryPlan& P = *act_plan_;
  step_ = std::make_unique<StepBuffers>();
  StepBuffers& s = *step_;
  s.tokens = P.add("tokens", DType::I32, {N}, 0, last);
  s.targets = P.add("targets", DType::I32, {N}, 0, last);
  s.history = P.add("history", at, {S, N, d}, 0, last);
  s.losses = P.add("losses", st, {N}, 0, last);
  scheme_->plan(P, tl, N, s.history, s.site_x);
  // Where the scheme holds a sublayer's output gradient through its site's backward, the
  // output projection's weight gradient is side work too, and its other operand (the
  // attention output, the recomputed SwiGLU) lives that event longer as well.
  const int held = scheme_->source_grad_held_through_site() ? 1 : 0;
  for (int j = 0; j < 2 * L; ++j) {
    const int e = sub_ev(j), b = tb(e);
    const std::string name = "sublayer." + std::to_string(j) + ".";
    auto A = std::make_unique<SublayerActs>();
    // The input norm is written at the site (run_layers), one event before the sublayer.
    // What the sublayer's side work (backward(), below) reads lives one event longer, to
    // its site's backward (b + 1), which may run beside it.
    A->xn = P.add(name + "xn", at, {N, d}, tl.site(j), b + 1);
    A->rstd = P.add(name + "rstd", st, {N}, tl.site(j), b);
    A->d_xn = P.add(name + "xn.grad", at, {N, d}, b, b);
    if (j % 2 == 0) {
      const int64_t hq = cfg_.n_heads, hkv = cfg_.n_kv_heads;
      A->q_pre = P.add(name + "q_pre", at, {N, qd}, e, b);
      A->k_pre = P.add(name + "k_pre", at, {N, kvd}, e, b);
      A->q = P.add(name + "q", at, {N, qd}, e, b);
      A->k = P.add(name + "k", at, {N, kvd}, e, b);
      A->v = P.add(name + "v", at, {N, kvd}, e, b);
      A->q_rstd = P.add(name + "q_rstd", st, {N * hq}, e, b);
      A->k_rstd = P.add(name + "k_rstd", st, {N * hkv}, e, b);
      A->att = P.add(name + "att", at, {N, qd}, e, b + held);
      A->lse = P.add(name + "lse", st, {int64_t(B_), hq, int64_t(T_)}, e, b);
      A->d_att = P.add(name + "att.grad", at, {N, qd}, b, b);
      A->dq = P.add(name + "q.grad", at, {N, qd}, b, b);
      A->dk = P.add(name + "k.grad", at, {N, kvd}, b, b);
      A->dv = P.add(name + "v.grad", at, {N, kvd}, b, b + 1);
      A->dq_pre = P.add(name + "q_pre.grad", at, {N, qd}, b, b + 1);
      A->dk_pre = P.add(name + "k_pre.grad", at, {N, kvd}, b, b + 1);
    } else {
      A->gate_up = P.add(name + "gate_up", at, {N, 2 * F}, e, b);
      // h = silu(gate) * up is not kept for the backward: swiglu_backward writes it again,
      // bit for bit, for the down projection's weight gradient (6 GB less at 1B).
      A->h = P.add(name + "h", at, {N, F}, e, e);
      A->h_again = P.add(name + "h.again", at, {N, F}, b, b + held);
      A->d_h = P.add(name + "h.grad", at, {N, F}, b, b);
      A->d_gate_up = P.add(name + "gate_up.grad", at, {N, 2 * F}, b, b + 1);
    }
    acts_.push_back(std::move(A));
  }
  // The head's products all run at its forward event, so the normed input and the
  // logits chunk are forward-only; d xn is written there and read by the final norm's
  // backward. (After a forward, before the backward, nothing else has touched either, so
  // logits(first, rows) can still recompute from xn.)
  chunk_ = logits_chunk_tokens(N, V, dtype_size(at), chunk_request_);
  held_rows_ = 0;
  s.xfn = P.add("head.xn", at, {N, d}, tl.site(2 * L), head_ev);  // written at site 2L
  s.rstd_f = P.add("head.rstd", st, {N}, tl.site(2 * L), tb(head_ev));
  s.logits = P.add("head.logits", at, {chunk_, V}, head_ev, head_ev);
  s.d_xfn = P.add("head.xn.grad", at, {N, d}, head_ev, tb(head_ev));
  // Every op's temporaries, in one buffer for the whole step (the backend lays out its
  // parts; some live from one op to the next), bound around each pass: no op allocates.
  OpScratchShapes& sh = s.scratch_shapes;
  sh = OpScratchShapes{};
  sh.batch = B_, sh.seq_len = T_, sh.d_model = d;
  sh.heads = cfg_.n_heads, sh.kv_heads = cfg_.n_kv_heads, sh.head_dim = cfg_.head_dim;
  scheme_->op_scratch_shapes(sh);
  const size_t scratch_bytes = be_.op_scratch_bytes(sh);
  s.op_scratch = P.add("backend.scratch", DType::F32, {int64_t((scratch_bytes + 3) / 4)}, 0, last);
  P.plan();
  act_arena_ = std::make_unique<Arena>(be_, P);
}

Tensor Model::act(int id) const { return act_arena_->tensor(id); }
Tensor Model::stacked(int plan_id) const { return param_arena_->tensor(plan_id); }
Tensor Model::stacked_grad(int plan_id) const { return grad_arena_->tensor(plan_id); }

const Parameter& Model::parameter(const std::string& name) const {
  for (const auto& p : params_)
    if (p.name == name) return p;
  fail("no parameter named ", name, " in this model (", residual_mode_name(res_.mode),
       ", tie_embeddings=", cfg_.tie_embeddings ? "true" : "false", ")");
}

int64_t Model::num_parameters() const {
  int64_t n = 0;
  for (const auto& p : params_) n += p.value.numel();
  return n;
}

Tensor Model::all_gradients() const {
  Tensor t(grad_arena_->base(), be_.grad_dtype(),
           {int64_t(grad_plan_->total_bytes() / dtype_size(be_.grad_dtype()))});
  return t;  // alignment padding between tensors is zero and stays zero
}

Tensor Model::all_parameters_flat() const {
  return Tensor(param_arena_->base(), be_.act_dtype(),
                {int64_t(param_plan_->total_bytes() / dtype_size(be_.act_dtype()))});
}

void Model::init_weights(const UnitDraw& draw) {
  std::vector<double> host;
  for (const Parameter& prm : params_) {
    host.assign(size_t(prm.value.numel()), 0.0);
    switch (prm.init) {
      case Init::Zero: break;
      case Init::One: std::fill(host.begin(), host.end(), 1.0); break;
      case Init::OneHot:
        MHAR_CHECK(prm.init_arg >= 0 && prm.init_arg < prm.value.numel(), prm.name,
                   ": one-hot element ", prm.init_arg, " of ", prm.value.numel());
        host[size_t(prm.init_arg)] = 1.0;
        break;
      case Init::Identity:
        MHAR_CHECK(prm.init_arg * prm.init_arg == prm.value.numel(), prm.name, ": identity of side ",
                   prm.init_arg, " in ", prm.value.numel(), " elements");
        for (int64_t i = 0; i < prm.init_arg; ++i) host[size_t(i * prm.init_arg + i)] = 1.0;
        break;
      case Init::HyperScale: std::fill(host.begin(), host.end(), 0.01); break;
      case Init::Normal:
        draw(prm, host);
        for (double& x : host) x = prm.init_std * x;
        break;
    }
    be_.upload(prm.value, host.data());
  }
}

void Model::init_weights(uint64_t seed) {
  init_weights([seed](const Parameter& prm, std::vector<double>& out) {
    // Each tensor draws from its own stream, keyed by seed and name, so adding a tensor
    // never changes the others' initial values.
    uint64_t key = seed;
    for (char c : prm.name) key = key * 1099511628211ULL + uint8_t(c);
    SplitMix64 rng{key};
    for (double& x : out) x = rng.normal();
  });
}

void Model::zero_grads() { be_.zero(all_gradients()); }

namespace {
// Rows [first, first + count) of a tensor whose leading dimension is the token.
Tensor token_rows(Tensor t, int64_t first, int64_t count) {
  MHAR_CHECK(t.ndim >= 1 && first >= 0 && count >= 1 && first + count <= t.dim(0), "rows [",
             first, ", ", first + count, ") of ", t.shape_str());
  Tensor r = t;
  r.shape[0] = count;
  const size_t row_bytes = t.dim(0) ? t.bytes() / size_t(t.dim(0)) : 0;
  r.data = static_cast<char*>(t.data) + size_t(first) * row_bytes;
  return r;
}
}  // namespace

Tensor Model::logits(int64_t first, int64_t rows) {
  if (first < 0 || rows < 1 || first + rows > N_)
    fail("logits of token rows [", first, ", ", first + rows, "): the last forward ran ", N_,
         " tokens; valid rows are [0, ", N_, ")");
  if (rows > chunk_)
    fail("logits of ", rows, " token rows at once: the LM head holds ", chunk_,
         " rows of logits at a time (train.logits_chunk); ask for at most that many");
  const StepBuffers& s = *step_;
  const Tensor buf = act(s.logits);
  if (held_rows_ > 0 && first >= held_first_ && first + rows <= held_first_ + held_rows_)
    return token_rows(buf, first - held_first_, rows);
  MHAR_CHECK(xn_valid_, "logits() after backward(): the final norm's output is gone; run a forward");
  Tensor head_w = lm_head_ >= 0 ? p(lm_head_) : p(embed_);
  Tensor out = token_rows(buf, 0, rows);
  be_.matmul_forward(out, token_rows(act(s.xfn), first, rows), head_w);
  held_first_ = first;
  held_rows_ = rows;
  return out;
}

Tensor Model::logits() {
  if (chunk_ < N_)
    fail("logits() of all ", N_, " tokens: this model's LM head holds ", chunk_,
         " rows of logits at a time (train.logits_chunk); read them with logits(first, rows)");
  return logits(0, N_);
}

Tensor Model::losses() const { return act(step_->losses); }
Tensor Model::site_input(int site) const { return act(step_->site_x.at(site)); }
std::vector<double> Model::routing_weights(int site) const {
  return scheme_->routing_weights(site);
}
void Model::routing_stats(int site, Tensor stats) { scheme_->routing_stats(site, stats); }
Tensor Model::history() const { return act(step_->history); }

std::string Model::memory_report() const {
  std::string out;
  for (const MemoryPlan* p : {param_plan_.get(), grad_plan_.get(), act_plan_.get()}) {
    char line[200];
    std::snprintf(line, sizeof line, "%-12s %12s allocated (%s requested, %zu tensors)\n",
                  p->category().c_str(), format_bytes(p->total_bytes()).c_str(),
                  format_bytes(p->requested_bytes()).c_str(), p->buffers().size());
    out += line;
  }
  if (step_) {  // part of the activations: the backend's op temporaries
    char line[200];
    std::snprintf(line, sizeof line, "%-12s %12s of the activations (backend.scratch)\n",
                  "op scratch",
                  format_bytes(act_plan_->buffers()[size_t(step_->op_scratch)].bytes).c_str());
    out += line;
  }
  return out;
}

// ---------------------------------------------------------------- forward

double Model::forward(const int32_t* tokens, const int32_t* targets, double loss_scale) {
  const StepBuffers& s = *step_;
  const OpScratchBinding scratch(be_, {act(s.op_scratch), s.scratch_shapes});
  loss_scale_ = loss_scale;
  be_.upload_tokens(act(s.targets), targets);
  run_layers(tokens);
  head_forward(loss_scale);
  std::vector<double> losses(static_cast<size_t>(N_));
  be_.download(losses.data(), act(s.losses));
  double sum = 0;
  for (double l : losses) sum += l;
  return sum / double(N_);
}

void Model::run_layers(const int32_t* tokens) {
  const StepBuffers& s = *step_;
  be_.upload_tokens(act(s.tokens), tokens);
  Tensor hist = act(s.history);
  be_.embedding_forward(hist[0], act(s.tokens), p(embed_));
  const int last_site = 2 * cfg_.n_layers;
  for (int j = 0; j <= last_site; ++j) {
    // The consumer's input norm (sublayer j's; the head's final norm for j = 2L): the
    // scheme writes it with x_j where it can (residual.h), else the model does here.
    const SiteNorm norm =
        j == last_site
            ? SiteNorm{act(s.xfn), act(s.rstd_f), p(final_norm_), cfg_.rms_eps}
            : SiteNorm{act(acts_[size_t(j)]->xn), act(acts_[size_t(j)]->rstd),
                       p(j % 2 == 0 ? layers_[size_t(j / 2)].attn_norm
                                    : layers_[size_t(j / 2)].mlp_norm),
                       cfg_.rms_eps};
    if (!scheme_->site_forward_normed(j, norm))
      be_.rmsnorm_forward(norm.y, norm.rstd, site_input(j), norm.w, norm.eps);
    if (j == last_site) break;  // the head's LM head and loss run in head_forward
    if (j % 2 == 0) attention_forward(j / 2);
    else mlp_forward(j / 2);
    scheme_->sublayer_done(j);
  }
  held_rows_ = 0;  // new activations: the logits buffer no longer matches them
  xn_valid_ = true;
}

void Model::head_forward(double loss_scale) {
  const StepBuffers& s = *step_;
  const bool grad = loss_scale != 0;
  const double grad_scale = loss_scale / double(N_);
  Tensor head_w = lm_head_ >= 0 ? p(lm_head_) : p(embed_);
  Tensor head_g = lm_head_ >= 0 ? g(lm_head_) : g(embed_);
  const Tensor xfn = act(s.xfn), buf = act(s.logits), d_xfn = act(s.d_xfn);
  const Tensor losses = act(s.losses), targets = act(s.targets);
  for (int64_t first = 0; first < N_; first += chunk_) {
    const int64_t rows = std::min(chunk_, N_ - first);
    const Tensor lg = token_rows(buf, 0, rows), xn = token_rows(xfn, first, rows);
    be_.matmul_forward(lg, xn, head_w);
    be_.cross_entropy(token_rows(losses, first, rows), lg, token_rows(targets, first, rows),
                      grad_scale, grad);
    if (!grad) continue;
    // The chunk's dlogits are complete: its input gradient rows and its share of the
    // weight gradient (accumulated: earlier chunks, micro-batches and, when tied, the
    // embedding's scatter add into the same buffer).
    be_.matmul_input_grad(token_rows(d_xfn, first, rows), lg, head_w, false);
    be_.matmul_weight_grad(head_g, lg, xn);
  }
  // Without a loss scale the buffer keeps the last chunk's logits for logits().
  held_first_ = grad ? 0 : (N_ - 1) / chunk_ * chunk_;
  held_rows_ = grad ? 0 : N_ - held_first_;
}

// ---------------------------------------------------------------- decode mode

void Model::enable_kv_cache(int capacity) {
  if (B_ != 1)
    fail("decoding with a KV cache needs batch 1, this model was built for batch ", B_);
  if (capacity < 1) fail("KV cache capacity must be at least 1 position, got ", capacity);
  const int64_t hkv = cfg_.n_kv_heads, hd = cfg_.head_dim;
  kv_.reset();
  auto kv = std::make_unique<KvCache>();
  kv->capacity = capacity;
  kv->plan = std::make_unique<MemoryPlan>("kv_cache");
  for (int l = 0; l < cfg_.n_layers; ++l) {
    const std::string pre = "layer." + std::to_string(l) + ".";
    kv->k.push_back(kv->plan->add(pre + "k", be_.act_dtype(), {capacity, hkv, hd}));
    kv->v.push_back(kv->plan->add(pre + "v", be_.act_dtype(), {capacity, hkv, hd}));
  }
  kv->plan->plan();
  kv->arena = std::make_unique<Arena>(be_, *kv->plan);
  kv_ = std::move(kv);
}

int Model::cached_positions() const { return kv_ ? kv_->used : 0; }
int Model::kv_cache_capacity() const { return kv_ ? kv_->capacity : 0; }
void Model::clear_kv_cache() {
  if (kv_) kv_->used = 0;
}

void Model::forward_cached(const int32_t* tokens, int count) {
  MHAR_CHECK(kv_, "forward_cached() needs enable_kv_cache() first");
  MHAR_CHECK(count >= 1, "forward_cached() of ", count, " tokens");
  if (kv_->used + count > kv_->capacity)
    fail("decoding past the end of the KV cache: ", kv_->used, " cached + ", count,
         " new positions > capacity ", kv_->capacity);
  if (count != T_) {  // re-plan the activations for this chunk length
    act_arena_.reset();
    act_plan_.reset();
    acts_.clear();
    T_ = count;
    N_ = count;
    plan_activations();
  }
  loss_scale_ = 0;
  decode_position_ = kv_->used;
  const OpScratchBinding scratch(be_, {act(step_->op_scratch), step_->scratch_shapes});
  try {
    run_layers(tokens);
  } catch (...) {
    decode_position_ = -1;
    throw;
  }
  decode_position_ = -1;
  kv_->used += count;
}

void Model::attention_forward(int l) {
  const int j = 2 * l;
  const SublayerActs& A = *acts_[j];
  const LayerParams& lp = layers_[l];
  const int64_t hq = cfg_.n_heads, hkv = cfg_.n_kv_heads, hd = cfg_.head_dim;
  // A.xn, the input norm of site j, was written at the site (run_layers).
  be_.matmul_forward(act(A.q_pre), act(A.xn), p(lp.wq));
  be_.matmul_forward(act(A.k_pre), act(A.xn), p(lp.wk));
  be_.matmul_forward(act(A.v), act(A.xn), p(lp.wv));
  Tensor q4 = act(A.q).view({B_, T_, hq, hd}), k4 = act(A.k).view({B_, T_, hkv, hd});
  Tensor v4 = act(A.v).view({B_, T_, hkv, hd}), att4 = act(A.att).view({B_, T_, hq, hd});
  // QK-norm then RoPE; decode: the chunk continues the cached prefix at decode_position_.
  const int64_t first_position = decode_position_ < 0 ? 0 : decode_position_;
  be_.qk_norm_rope_forward_qk({q4, act(A.q_rstd), act(A.q_pre), p(lp.q_norm)},
                              {k4, act(A.k_rstd), act(A.k_pre), p(lp.k_norm)}, cfg_.rms_eps,
                              cfg_.rope_theta, first_position);
  if (decode_position_ < 0) {
    be_.attention_forward(att4, act(A.lse), q4, k4, v4);
  } else {
    auto cache_rows = [&](int id, int64_t first, int64_t count) {
      Tensor c = kv_->arena->tensor(id);
      char* base = static_cast<char*>(c.data) + size_t(first) * size_t(hkv * hd) * dtype_size(c.dtype);
      return Tensor(base, c.dtype, {1, count, hkv, hd});
    };
    be_.copy(cache_rows(kv_->k[l], decode_position_, T_), k4);
    be_.copy(cache_rows(kv_->v[l], decode_position_, T_), v4);
    const int64_t seen = decode_position_ + T_;
    be_.attention_cached(att4, q4, cache_rows(kv_->k[l], 0, seen), cache_rows(kv_->v[l], 0, seen));
  }
  be_.matmul_forward(history()[j + 1], act(A.att), p(lp.wo));
}

void Model::mlp_forward(int l) {
  const int j = 2 * l + 1;
  const SublayerActs& A = *acts_[j];
  const LayerParams& lp = layers_[l];
  // A.xn, the input norm of site j, was written at the site (run_layers).
  be_.matmul_forward(act(A.gate_up), act(A.xn), stacked(lp.gate_up));
  be_.swiglu_forward(act(A.h), act(A.gate_up));
  be_.matmul_forward(history()[j + 1], act(A.h), p(lp.w_down));
}

// ---------------------------------------------------------------- backward

void Model::backward(const BucketHook& bucket_done) {
  MHAR_CHECK(loss_scale_ != 0, "backward() after a forward without a loss scale");
  const StepBuffers& s = *step_;
  const OpScratchBinding scratch(be_, {act(s.op_scratch), s.scratch_shapes});
  const int last_site = 2 * cfg_.n_layers;
  auto done = [&](int bucket) {
    if (bucket_done) bucket_done(bucket);
  };
  // Bucket indices follow plan_parameters(): embedding, layers, head, the scheme's.
  const int head_bucket = 1 + cfg_.n_layers, scheme_bucket = 2 + cfg_.n_layers;
  ResidualScheme& rs = *scheme_;
  rs.begin_backward();
  // Head: the forward already wrote d xn and added the LM head's weight gradient.
  be_.rmsnorm_backward(rs.site_grad(last_site), g(final_norm_), act(s.d_xfn),
                       site_input(last_site), p(final_norm_), act(s.rstd_f),
                       rs.site_grad_accumulates(last_site));
  done(head_bucket);  // final norm, and the LM head unless it is the (tied) embedding
  // Each sublayer's backward issues the weight gradients that read only its own
  // activations and gradients as side work (Backend::side_work_begin), which may run
  // beside the sublayer's input norm backward and its site's backward: in the routed
  // modes those are the routing's backward kernels, which leave the tensor cores idle
  // (100M mhar's step 1% faster on an H100; standard's unchanged). The output projection's
  // weight gradient joins them where the scheme holds the sublayer's output gradient
  // through the site's backward (ResidualScheme::source_grad_held_through_site); in the
  // standard scheme that buffer is the site gradient the input norm's backward adds into,
  // so there it runs in order, before. The buffers the side work reads live through its
  // site's backward event (the plan above), so it is joined right after that: before the
  // next sublayer's backward writes its scratch, which may reuse their memory, and before
  // a layer's bucket is handed on.
  for (int j = last_site; j >= 0; --j) {
    if (j < last_site) {
      if (j % 2 == 0)
        attention_backward(j / 2);
      else
        mlp_backward(j / 2);
    }
    rs.site_backward(j);
    be_.side_work_join();
    if (j < last_site && j % 2 == 0)
      done(1 + j / 2);  // the layer's last weight gradient (its input norm) is written
  }
  if (rs.finish_backward()) done(scheme_bucket);
  be_.embedding_backward(g(embed_), rs.source_grad(0), act(s.tokens));
  done(0);
  loss_scale_ = 0;  // the head's gradients of that forward are consumed
  held_rows_ = 0;   // the backward reused the memory of the logits and of the normed input
  xn_valid_ = false;
}

void Model::attention_backward(int l) {
  const int j = 2 * l;
  const SublayerActs& A = *acts_[j];
  const LayerParams& lp = layers_[l];
  const int64_t hq = cfg_.n_heads, hkv = cfg_.n_kv_heads, hd = cfg_.head_dim;
  Tensor dout = scheme_->source_grad(j + 1);
  const bool dout_held = scheme_->source_grad_held_through_site();
  be_.matmul_input_grad(act(A.d_att), dout, p(lp.wo), false);
  if (!dout_held) be_.matmul_weight_grad(g(lp.wo), dout, act(A.att));
  Tensor dq4 = act(A.dq).view({B_, T_, hq, hd}), dk4 = act(A.dk).view({B_, T_, hkv, hd});
  be_.attention_backward(dq4, dk4, act(A.dv).view({B_, T_, hkv, hd}),
                         act(A.d_att).view({B_, T_, hq, hd}), act(A.q).view({B_, T_, hq, hd}),
                         act(A.k).view({B_, T_, hkv, hd}), act(A.v).view({B_, T_, hkv, hd}),
                         act(A.att).view({B_, T_, hq, hd}), act(A.lse));
  be_.qk_norm_rope_backward_qk(
      {act(A.dq_pre), g(lp.q_norm), dq4, act(A.q_pre), p(lp.q_norm), act(A.q_rstd)},
      {act(A.dk_pre), g(lp.k_norm), dk4, act(A.k_pre), p(lp.k_norm), act(A.k_rstd)},
      cfg_.rope_theta, false);
  be_.matmul_input_grad(act(A.d_xn), act(A.dq_pre), p(lp.wq), false);
  be_.matmul_input_grad(act(A.d_xn), act(A.dk_pre), p(lp.wk), true);
  be_.matmul_input_grad(act(A.d_xn), act(A.dv), p(lp.wv), true);
  be_.side_work_begin();
  if (dout_held) be_.matmul_weight_grad(g(lp.wo), dout, act(A.att));
  be_.matmul_weight_grad(g(lp.wq), act(A.dq_pre), act(A.xn));
  be_.matmul_weight_grad(g(lp.wk), act(A.dk_pre), act(A.xn));
  be_.matmul_weight_grad(g(lp.wv), act(A.dv), act(A.xn));
  be_.side_work_end();
  // Last: the scheme's site_grad(j) may be the buffer of source_grad(j + 1) (residual.h).
  be_.rmsnorm_backward(scheme_->site_grad(j), g(lp.attn_norm), act(A.d_xn), site_input(j),
                       p(lp.attn_norm), act(A.rstd), scheme_->site_grad_accumulates(j));
}

void Model::mlp_backward(int l) {
  const int j = 2 * l + 1;
  const SublayerActs& A = *acts_[j];
  const LayerParams& lp = layers_[l];
  Tensor dout = scheme_->source_grad(j + 1);
  const bool dout_held = scheme_->source_grad_held_through_site();
  be_.matmul_input_grad(act(A.d_h), dout, p(lp.w_down), false);
  be_.swiglu_backward(act(A.d_gate_up), act(A.h_again), act(A.d_h), act(A.gate_up));
  if (!dout_held) be_.matmul_weight_grad(g(lp.w_down), dout, act(A.h_again));
  be_.matmul_input_grad(act(A.d_xn), act(A.d_gate_up), stacked(lp.gate_up), false);
  be_.side_work_begin();
  if (dout_held) be_.matmul_weight_grad(g(lp.w_down), dout, act(A.h_again));
  be_.matmul_weight_grad(stacked_grad(lp.gate_up), act(A.d_gate_up), act(A.xn));
  be_.side_work_end();
  // Last: the scheme's site_grad(j) may be the buffer of source_grad(j + 1) (residual.h).
  be_.rmsnorm_backward(scheme_->site_grad(j), g(lp.mlp_norm), act(A.d_xn), site_input(j),
                       p(lp.mlp_norm), act(A.rstd), scheme_->site_grad_accumulates(j));
}

}  // namespace mhar
