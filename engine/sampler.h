// sampler.h: text generation with a model in decode mode (Model::enable_kv_cache).
// The prompt is prefilled in one chunk, then each new token is one forward_cached() of
// length 1, so a token costs the layer loop on one row plus attention over the cached
// positions: generation is linear in length, not quadratic. It runs on the model's
// backend, any that implements Backend::rope_at and attention_cached (CPU and CUDA); only
// the last row of logits comes back to the host.
// Conventions: temperature 0 is greedy (argmax, lowest id on ties); top_k 0 keeps the
// whole vocabulary; the random stream is splitmix64 seeded by `seed`, so a seed gives the
// same text for the same logits on every machine (the CUDA backend's bf16 logits differ
// from the CPU's fp32 ones by rounding, which can reorder nearly tied tokens); ids >=
// vocab_limit (the padding rows of an embedding larger than the tokenizer) are never
// sampled.
#pragma once
#include <cstdint>
#include <functional>
#include <vector>

#include "engine/model.h"

namespace mhar {

struct SamplingOptions {
  int max_tokens = 200;      // new tokens at most
  double temperature = 1.0;  // >= 0; 0 = greedy
  int top_k = 0;             // >= 0; 0 = no top-k filter
  uint64_t seed = 1;
  int32_t stop_token = -1;   // generation ends when it is drawn (not emitted); < 0: none
  int vocab_limit = 0;       // sample only ids < vocab_limit; 0 = every logit
};

enum class StopReason { MaxTokens, StopToken, ContextFull };
const char* stop_reason_name(StopReason r);

struct Generation {
  std::vector<int32_t> tokens;  // the continuation, stop token excluded
  StopReason reason = StopReason::MaxTokens;
};

// Throws mhar::Error for invalid options (naming the option and what is valid).
void validate_sampling_options(const SamplingOptions& opt);

// One token from a row of logits [vocab]; `rng_state` advances by one draw when the
// choice is random (temperature > 0), not at all when greedy.
int32_t sample_token(const double* logits, int vocab, const SamplingOptions& opt,
                     uint64_t& rng_state);

// Clears the model's KV cache, prefills `prompt` (non-empty, at most the cache capacity)
// and generates. on_token sees each emitted token as soon as it is chosen (streaming).
// Generation also ends, with StopReason::ContextFull, when the cache is full.
Generation generate(Model& model, const std::vector<int32_t>& prompt,
                    const SamplingOptions& opt,
                    const std::function<void(int32_t)>& on_token = nullptr);

}  // namespace mhar
