// sampler.cpp: token choice (greedy, temperature, top-k) and the prefill-then-decode
// loop of sampler.h. Logits are read back as fp64 one row at a time (only the last row
// of the prefill matters).
#include "engine/sampler.h"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "engine/error.h"

namespace mhar {

namespace {

uint64_t splitmix64(uint64_t& s) {
  uint64_t z = (s += 0x9E3779B97F4A7C15ULL);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
  return z ^ (z >> 31);
}

// Uniform in [0, 1) with 53 random bits: fully specified, unlike std::*_distribution.
double uniform01(uint64_t& s) { return double(splitmix64(s) >> 11) * 0x1.0p-53; }

}  // namespace

const char* stop_reason_name(StopReason r) {
  switch (r) {
    case StopReason::MaxTokens: return "max_tokens";
    case StopReason::StopToken: return "stop_token";
    case StopReason::ContextFull: return "context_full";
  }
  return "?";
}

void validate_sampling_options(const SamplingOptions& opt) {
  if (opt.max_tokens < 0) fail("--max-tokens = ", opt.max_tokens, " must be >= 0");
  if (!std::isfinite(opt.temperature) || opt.temperature < 0)
    fail("--temperature = ", opt.temperature, " must be a finite number >= 0 (0 = greedy)");
  if (opt.top_k < 0) fail("--top-k = ", opt.top_k, " must be >= 0 (0 = no top-k filter)");
  if (opt.vocab_limit < 0) fail("vocab limit ", opt.vocab_limit, " must be >= 0");
}

int32_t sample_token(const double* logits, int vocab, const SamplingOptions& opt,
                     uint64_t& rng_state) {
  const int n = opt.vocab_limit > 0 ? std::min(vocab, opt.vocab_limit) : vocab;
  MHAR_CHECK(n >= 1, "sampling from ", n, " logits");
  for (int i = 0; i < n; ++i)
    if (!std::isfinite(logits[i]))
      fail("the model produced a non-finite logit (", logits[i], " for token ", i,
           "); the checkpoint's weights are damaged or diverged");
  if (opt.temperature == 0 || opt.top_k == 1) {
    int best = 0;
    for (int i = 1; i < n; ++i)
      if (logits[i] > logits[best]) best = i;
    return best;
  }
  // Candidates in order of decreasing logit (ties: lower id first), cut to top_k.
  std::vector<int> ids(static_cast<size_t>(n));
  std::iota(ids.begin(), ids.end(), 0);
  auto higher = [&](int a, int b) { return logits[a] > logits[b] || (logits[a] == logits[b] && a < b); };
  size_t keep = opt.top_k > 0 ? std::min<size_t>(size_t(opt.top_k), ids.size()) : ids.size();
  std::partial_sort(ids.begin(), ids.begin() + keep, ids.end(), higher);
  ids.resize(keep);
  std::vector<double> p(keep);
  const double top = logits[ids[0]];
  double sum = 0;
  for (size_t i = 0; i < keep; ++i) sum += (p[i] = std::exp((logits[ids[i]] - top) / opt.temperature));
  double u = uniform01(rng_state) * sum;
  for (size_t i = 0; i < keep; ++i) {
    if (u < p[i]) return ids[i];
    u -= p[i];
  }
  return ids[keep - 1];  // u landed on the rounding slack at the very end
}

Generation generate(Model& model, const std::vector<int32_t>& prompt, const SamplingOptions& opt,
                    const std::function<void(int32_t)>& on_token) {
  validate_sampling_options(opt);
  if (model.kv_cache_capacity() == 0)
    fail("generate() needs a model in decode mode (Model::enable_kv_cache)");
  if (prompt.empty()) fail("the prompt is empty: generation needs at least one token to start from");
  const int capacity = model.kv_cache_capacity(), V = model.config().vocab_size;
  if (int64_t(prompt.size()) > capacity)
    fail("the prompt is ", prompt.size(), " tokens, longer than the model's context of ",
         capacity, " tokens");
  for (int32_t t : prompt)
    if (t < 0 || t >= V) fail("prompt token id ", t, " is outside the model's vocabulary [0, ", V, ")");

  model.clear_kv_cache();
  uint64_t rng = opt.seed;
  std::vector<double> row(size_t(V), 0.0);
  auto last_row = [&]() {  // only the last position's logits are computed
    const int64_t n = int64_t(model.batch()) * model.seq_len();
    model.backend().download(row.data(), model.logits(n - 1, 1));
  };
  model.forward_cached(prompt.data(), int(prompt.size()));
  last_row();

  Generation out;
  for (int i = 0; i < opt.max_tokens; ++i) {
    const int32_t next = sample_token(row.data(), V, opt, rng);
    if (opt.stop_token >= 0 && next == opt.stop_token) {
      out.reason = StopReason::StopToken;
      return out;
    }
    out.tokens.push_back(next);
    if (on_token) on_token(next);
    if (i + 1 == opt.max_tokens) break;
    if (model.cached_positions() >= capacity) {
      out.reason = StopReason::ContextFull;
      return out;
    }
    model.forward_cached(&next, 1);
    last_row();
  }
  out.reason = StopReason::MaxTokens;
  return out;
}

}  // namespace mhar
