// config.h: the typed run configuration (model, residual, train, data, checkpoint) and
// its JSON form. Every section lists its fields once, in a visit_fields() function
// (config.cpp) that serves parsing, printing and validation, so they can never drift
// apart; each numeric field carries its valid range there, with the reason for the bound.
// Parsing (parse_json_strict: depth limit, duplicate keys refused) rejects unknown keys
// and range-checks every number before it is narrowed to its field's type, with an error
// naming the file, the field path, the user's own value and what would be valid.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace mhar {

enum class ResidualMode { Standard, AttnRes, Mhar, Hyper, Delta };
const char* residual_mode_name(ResidualMode m);
struct ResidualConfig;
// "standard", "mhar H=4", "mhar H=4 block 3", "hyper n=4", "delta H=4 block_layers 4": the mode and what shapes it,
// for log lines.
std::string residual_summary(const ResidualConfig& r);

struct ModelConfig {
  int vocab_size = 50304;
  int d_model = 512;
  int n_layers = 12;
  int n_heads = 8;
  int n_kv_heads = 4;
  int head_dim = 64;
  int d_ff = 1536;
  int context_length = 2048;
  double rope_theta = 1e6;
  double rms_eps = 1e-6;
  bool tie_embeddings = true;
  double init_std = 0.02;

  int n_sources() const { return 2 * n_layers + 1; }  // v_0 .. v_{2L}
  int n_sites() const { return 2 * n_layers + 1; }    // sites 0 .. 2L
  int q_dim() const { return n_heads * head_dim; }
  int kv_dim() const { return n_kv_heads * head_dim; }
};

struct ResidualConfig {
  ResidualMode mode = ResidualMode::Standard;
  int heads = 0;  // routing heads H; 0 in a file means "n_kv_heads" (mhar) or 1 (attnres)
  // Block routing (DESIGN.md section 2): sublayer outputs per block, s in 1..2L; 0 is
  // full routing, which is also what s = 1 computes.
  int block_size = 0;
  // Hyper-Connections (mode hyper, DESIGN.md section 2): n residual streams, and whether
  // the mixing coefficients get the per-token dynamic term (not implemented yet).
  int hyper_n = 4;
  bool hyper_dynamic = false;
  // Delta conversion (mode delta, DESIGN.md section 2): the routed term's sources are the
  // block sums of the sublayer outputs over blocks of block_layers layers (2 *
  // block_layers sublayers), routed with `heads` heads (0 in a file: n_kv_heads).
  int block_layers = 4;
  // Depth routing over the sources (attnres, mhar); standard and hyper are unrouted.
  bool routed() const { return mode == ResidualMode::AttnRes || mode == ResidualMode::Mhar; }
  int routing_block() const { return block_size > 0 ? block_size : 1; }
  // The routing block (sublayers) of mode delta's routed term.
  int delta_block() const { return 2 * block_layers; }
};

struct TrainConfig {
  int micro_batch = 8;
  int seq_len = 1024;
  long long batch_tokens = 0;  // tokens per optimizer step; 0 = one micro-batch
  int steps = 1000;
  double lr = 5e-4;
  double min_lr_ratio = 0.1;
  int warmup_steps = 100;
  std::string schedule = "cosine";  // cosine | wsd
  double decay_fraction = 0.2;      // wsd: share of the steps spent decaying
  double weight_decay = 0.1;
  double beta1 = 0.9;
  double beta2 = 0.95;
  double adam_eps = 1e-8;
  double grad_clip = 1.0;  // 0 disables clipping
  unsigned long long seed = 1234;
  int eval_every = 100;
  int eval_batches = 10;
  int log_every = 1;
  int max_bad_steps = 5;
  std::string device = "auto";  // auto | cpu | cuda
  // Tokens per chunk of the LM head and cross-entropy (Model: the logits [N, V] are never
  // held whole, only [chunk, V]); 0 = automatic (logits_chunk_tokens below). Values above
  // micro_batch x seq_len mean one chunk.
  int logits_chunk = 0;
};

struct DataConfig {
  std::string train;  // shard glob, absolute or relative to the config file
  std::string val;
  std::string tokenizer = "gpt2";
};

struct CheckpointConfig {
  int every = 1000;  // steps; 0 = only at the end
  int keep = 3;      // newest K kept; 0 = keep all
};

struct Config {
  ModelConfig model;
  ResidualConfig residual;
  TrainConfig train;
  DataConfig data;
  CheckpointConfig checkpoint;
  std::string source;      // file it was read from ("<memory>" otherwise), for messages
  std::string config_dir;  // where relative data paths are resolved from

  nlohmann::json to_json() const;
  // Throws mhar::Error naming `source` and the field when a value is invalid.
  void validate() const;
};

// The LM head's chunk: the tokens whose logits [chunk, V] of `value_bytes` each are held
// at once, out of `tokens`. `requested` > 0 is taken as given (at most `tokens`); 0 picks
// the most tokens whose logits fit kLogitsChunkBytes, balanced over the chunks that
// takes and rounded up to a multiple of 64 rows (tensor-core tiles) within the budget.
// The budget is large enough that each chunk's weight-gradient GEMM (reduction depth =
// the chunk) is not held back by re-reading and re-writing the fp32 [V, d] gradient once
// per chunk: 2 GiB is 3 chunks of 5,504 tokens at the 1B shape (16,384 tokens, a
// 151,936-word vocabulary in bf16). Measured on the H200 (BENCHMARKS.md, 2026-12-01,
// seventh session) at that shape: 10 chunks of 1,664 (that chunk's weight gradient ran at
// 599 TFLOP/s against ~750-800 for the model's other GEMMs) 260.3 ms a step, 5 of 3,328
// 256.8 ms for 0.38 GB more peak memory, 3 of 6,656 255.1 ms for 1.39 GB more; our peak
// stays under PyTorch's at every size (issue 13's bar) with 2 GiB.
constexpr double kLogitsChunkBytes = double(int64_t(2) << 30);
int64_t logits_chunk_tokens(int64_t tokens, int64_t vocab, size_t value_bytes, int64_t requested);

// Size caps that hold before any memory is planned: the model and one training step are
// estimated from the config alone (4 bytes a value, as the fp32 CPU backend and the GPU
// backend's fp32 master weights and moments use) and refused above these limits, far
// above what one device can hold today (an H200 has 141 GB), so that an absurd config
// gets a message instead of an allocation failure or a planner running for hours.
constexpr double kMaxParameters = 1e11;                 // 100 billion
constexpr double kMaxStepBytes = double(uint64_t(1) << 40);  // 1 TiB
struct StepFootprint {
  double parameters = 0;      // every parameter (a tied embedding counted once)
  double parameter_bytes = 0; // parameters, gradients, AdamW moments: 16 bytes each
  double activation_bytes = 0;  // the saved activations of one micro-batch
  double kv_cache_bytes = 0;    // `sample`'s cache over the whole context
};
StepFootprint estimate_footprint(const ModelConfig& m, const ResidualConfig& r, int64_t batch,
                                 int64_t seq_len);
// Throws mhar::Error naming `where` when the model or one step of batch x seq_len tokens
// exceeds the caps above.
void check_footprint(const ModelConfig& m, const ResidualConfig& r, int64_t batch, int64_t seq_len,
                     const std::string& where);

// Parses and validates. `source` names the origin in error messages.
Config config_from_json(const nlohmann::json& j, const std::string& source = "<memory>");
// Reads a file (a regular file only, comments allowed), applies `overrides`
// ("model.n_layers=4"; a value that looks like JSON (a number, true/false/null, or one
// starting with { [ or ") is parsed strictly as JSON, anything else is a string), then
// parses and validates.
Config load_config(const std::string& path, const std::vector<std::string>& overrides = {});
// Applies one "a.b.c=value" override to a JSON document (creating no new sections).
void apply_override(nlohmann::json& j, const std::string& assignment, const std::string& source);

}  // namespace mhar
