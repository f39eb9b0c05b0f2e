// model.h: the model of DESIGN.md sections 1-2 and its one layer loop (section 4).
//
// The Model owns three allocations (parameters, gradients, activations; see
// allocator.h) and runs forward and backward through a Backend. Its layer loop treats
// the depth history as a first-class stage: sources v_0 (embedding), v_{2l+1}
// (attention of layer l) and v_{2l+2} (MLP of layer l) live in one [S, N, d] buffer;
// every sublayer writes its output straight into its slot with its last matmul, and
// site j builds the input of sublayer j (site 2L feeds the final norm) from slots 0..j.
// What a site does is the residual mode's ResidualScheme (residual.h); with block
// routing, slot j holds the running sum of v_j's block (residual_routed.cpp).
//
// Decode mode (sampling) runs the same loop over a chunk of new tokens with a KV cache:
// attention appends the chunk's keys and values and attends to every cached position.
// Routing mixes sources of the same position only, so the depth history stays per chunk
// and nothing beyond keys and values is cached across positions.
//
// Parameter names are Hugging Face Qwen3's (DESIGN.md section 6).
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "engine/allocator.h"
#include "engine/backend.h"
#include "engine/config.h"
#include "engine/residual.h"

namespace mhar {

struct Parameter {
  std::string name;
  Tensor value;  // act_dtype
  Tensor grad;   // grad_dtype
  bool decay;    // AdamW weight decay applies (matrices only)
  Init init = Init::Normal;  // what it starts as (residual.h); read by every initialiser
  double init_std = 0;       // Init::Normal: the standard deviation
  int64_t init_arg = 0;      // Init::OneHot: the hot element; Init::Identity: the side
  int64_t offset = 0;  // element offset in the parameter and gradient allocations
  int bucket = 0;      // index into Model::buckets()
};

// A group of parameters whose gradients become complete at one point of the backward
// (one layer, the head, the routing parameters, the embedding): the unit of the gradient
// reduce-scatter. Its parameters are contiguous in both allocations, each at an offset
// that is a multiple of Model::kParamAlign elements (but for the members of a stacked
// projection after its first, which follow the previous member directly: [q; k; v] and
// [gate; up] are one matrix each), and `numel` (padding included) is a
// multiple of grad_shards() * kParamAlign, so rank r of W owns the elements
// [offset + r * numel / W, offset + (r + 1) * numel / W) of the bucket. The padding is
// zero in both allocations.
struct GradBucket {
  std::string name;
  int first_param = 0, end_param = 0;  // parameters [first_param, end_param)
  int64_t offset = 0, numel = 0;       // elements, in both allocations
};

class Model {
 public:
  // Every parameter (every stack of projections) starts at a multiple of this many
  // elements in both allocations (256 bytes of bf16: the alignment cuBLAS and the vector
  // loads want).
  static constexpr int64_t kParamAlign = 128;

  // `grad_shards`: the number of ranks the gradient buckets are padded for (1 without
  // data parallelism). `logits_chunk`: tokens per chunk of the LM head (train.logits_chunk;
  // 0 = automatic, logits_chunk_tokens in config.h).
  Model(const ModelConfig& model, const ResidualConfig& residual, Backend& backend, int batch,
        int seq_len, int grad_shards = 1, int64_t logits_chunk = 0);
  ~Model();

  const ModelConfig& config() const { return cfg_; }
  const ResidualConfig& residual() const { return res_; }
  Backend& backend() { return be_; }
  int batch() const { return B_; }
  int seq_len() const { return T_; }

  std::vector<Parameter>& parameters() { return params_; }
  const std::vector<Parameter>& parameters() const { return params_; }
  const Parameter& parameter(const std::string& name) const;  // throws for unknown names
  int64_t num_parameters() const;
  // The whole gradient allocation as one flat tensor (for the global norm).
  Tensor all_gradients() const;
  // The same layout as flat tensors of each dtype, for views across parameters (buckets,
  // shards): element e of parameter i is element parameters()[i].offset + e of these.
  Tensor all_parameters_flat() const;
  const std::vector<GradBucket>& buckets() const { return buckets_; }
  int grad_shards() const { return grad_shards_; }

  // The one initialiser: every parameter as its Parameter::init says (DESIGN.md section 1:
  // matrices normal(0, init_std), output projections scaled by 1/sqrt(2L), norm weights
  // and routing gains 1, routing queries 0, hyper coefficients the pre-norm residual);
  // an Init::Normal parameter gets init_std
  // times the unit-variance draws `draw(parameter, values)` writes into its values.
  using UnitDraw = std::function<void(const Parameter&, std::vector<double>&)>;
  void init_weights(const UnitDraw& draw);
  // With normals from a splitmix64 stream keyed by `seed` and the parameter's name:
  // deterministic in `seed` on every backend.
  void init_weights(uint64_t seed);
  void zero_grads();

  // Runs the forward pass on tokens/targets [B*T] (host memory) and returns the mean
  // cross-entropy. The head runs in chunks of logits_chunk() tokens (the logits [N, V]
  // never exist whole): logits of the chunk, cross-entropy, and with `loss_scale` != 0
  // the chunk's gradient d(loss_scale * mean loss)/d logits in place, from which the
  // chunk's rows of d(final norm output) are written and the LM head's weight gradient
  // (the embedding's, when tied) is accumulated (+=) right away. So a forward with a
  // loss scale has already added the head's weight gradient: it must be followed by
  // backward(), which adds the rest. With 0 nothing is accumulated.
  double forward(const int32_t* tokens, const int32_t* targets, double loss_scale);
  // Accumulates (+=) parameter gradients of loss_scale * mean loss of the last forward
  // (the head's weight gradient was added by that forward).
  // `bucket_done(b)`, when given, is called as soon as the gradients of bucket b are
  // complete (the rest of the backward is still to be enqueued): data parallelism starts
  // the bucket's reduce-scatter there, overlapped with the rest of the backward. Every
  // bucket is reported exactly once, in the same order on every call.
  using BucketHook = std::function<void(int bucket)>;
  void backward(const BucketHook& bucket_done = nullptr);

  // ---- Decode mode (incremental forward for sampling; backends that implement
  // Backend::rope_at and Backend::attention_cached).
  // Allocates, per layer, a cache of the normed and roped keys and of the values of up
  // to `capacity` positions ([capacity, n_kv_heads, head_dim] each). Needs batch 1.
  void enable_kv_cache(int capacity);
  // Runs the tokens [count] at positions cached_positions() .. + count - 1, appending
  // their keys and values to the cache, up to the final norm; logits(first, rows) then
  // computes the rows wanted (no loss, no backward). A count other than seq_len()
  // re-plans the activation memory to that length, so prefill the prompt in one chunk,
  // then decode one token at a time.
  void forward_cached(const int32_t* tokens, int count);
  int cached_positions() const;
  int kv_cache_capacity() const;
  void clear_kv_cache();  // forget every cached position (a new sequence)

  // Logits of the token rows [first, first + rows) of the last forward or forward_cached,
  // [rows, V], rows <= logits_chunk(): a view of the head's chunk buffer, computed from
  // the saved final-norm output unless the buffer already holds them (after a forward
  // without a loss scale it holds the last chunk). Valid until the next call, forward or
  // backward; the same values the forward's cross-entropy saw.
  Tensor logits(int64_t first, int64_t rows);
  // All N rows at once: for models whose head runs in one chunk (logits_chunk() == N,
  // e.g. every test-sized model); larger ones fail and should page with logits(first, rows).
  Tensor logits();                        // [N, V]
  int64_t logits_chunk() const { return chunk_; }
  // Per-token losses of the last forward, [N] (stat dtype), valid until the next forward.
  Tensor losses() const;
  // Views for tests, reports and sampling (valid after forward).
  Tensor site_input(int site) const;      // x_j [N, d]
  // Routed modes only: the number of sources site `site` mixes (site+1 with full
  // routing), and its softmax weights after a forward, downloaded as
  // [N, H, routing_sources(site)] (the backward reuses their memory).
  int routing_sources(int site) const { return scheme_->site_sources(site); }
  std::vector<double> routing_weights(int site) const;
  // Backend::routing_stats of site `site` after a forward (routed modes only): adds the
  // site's weight, entropy and head-divergence sums into `stats` without downloading.
  void routing_stats(int site, Tensor stats);
  // [S, N, d]: slot j is v_j, or with block routing the running sum of v_j's block.
  Tensor history() const;

  const MemoryPlan& parameter_plan() const { return *param_plan_; }
  const MemoryPlan& activation_plan() const { return *act_plan_; }
  // One line per category: bytes requested and bytes allocated after lifetime reuse.
  std::string memory_report() const;

 private:
  struct LayerParams {
    int attn_norm, wq, wk, wv, wo, q_norm, k_norm, mlp_norm, w_gate, w_up, w_down;
    int qkv, gate_up;  // plan ids of the stacks [q; k; v] and [gate; up] (stacked())
  };
  struct SublayerActs;  // defined in model.cpp

  void plan_parameters();
  void plan_activations();
  void run_layers(const int32_t* tokens);  // embedding, layer loop, final norm
  void head_forward(double loss_scale);   // LM head and cross-entropy, chunk by chunk
  Tensor p(int id) const { return params_[id].value; }
  Tensor g(int id) const { return params_[id].grad; }
  // A stack of projections (plan_parameters) as one matrix: its weights, its gradients.
  Tensor stacked(int plan_id) const;
  Tensor stacked_grad(int plan_id) const;
  Tensor act(int id) const;
  void attention_forward(int layer);
  void attention_backward(int layer);
  void mlp_forward(int layer);
  void mlp_backward(int layer);

  ModelConfig cfg_;
  ResidualConfig res_;
  Backend& be_;
  int B_, T_;
  int64_t N_;
  int grad_shards_ = 1;
  std::vector<GradBucket> buckets_;
  double loss_scale_ = 0;
  int64_t chunk_request_ = 0, chunk_ = 0;  // logits_chunk: as asked (0 = automatic), as planned
  // Token rows whose logits the chunk buffer holds now ([first, first + count); count 0:
  // none, e.g. after the cross-entropy overwrote them with their gradient).
  int64_t held_first_ = 0, held_rows_ = 0;
  bool xn_valid_ = false;  // the final norm's output is readable (a forward ran, no backward since)

  std::vector<Parameter> params_;
  int embed_ = -1, final_norm_ = -1, lm_head_ = -1;
  std::vector<LayerParams> layers_;
  std::unique_ptr<ResidualScheme> scheme_;  // what the residual mode does (residual.h)

  std::unique_ptr<MemoryPlan> param_plan_, grad_plan_, act_plan_;
  std::unique_ptr<Arena> param_arena_, grad_arena_, act_arena_;
  std::vector<std::unique_ptr<SublayerActs>> acts_;  // one per sublayer, then the head
  struct StepBuffers;
  std::unique_ptr<StepBuffers> step_;
  struct KvCache;  // decode mode only
  std::unique_ptr<KvCache> kv_;
  int64_t decode_position_ = -1;  // position of the chunk's first token while decoding
};

}  // namespace mhar
