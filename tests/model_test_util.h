// model_test_util.h: tiny model configs, random weights and host-side accessors shared
// by the model tests (gradient checks, routing identities, golden, allocator).
#pragma once
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "engine/backend.h"
#include "engine/config.h"
#include "engine/forwarding_backend.h"
#include "engine/model.h"

namespace mhar::test {

// A config small enough for exhaustive finite differences, with GQA (4 query heads on
// 2 KV heads) and an uneven head/feature split so indexing mistakes show. `block_size`:
// residual.block_size (2 layers: 4 sublayers, so 1..4). `hyper_n`: residual.hyper_n
// (mode hyper only). `block_layers`: residual.block_layers (mode delta only; 1..2).
inline Config tiny_config(ResidualMode mode, int heads = 0, bool tied = true, int block_size = 0,
                          int hyper_n = 4, int block_layers = 1) {
  nlohmann::json j = {
      {"model", {{"vocab_size", 23}, {"d_model", 16}, {"n_layers", 2}, {"n_heads", 4},
                 {"n_kv_heads", 2}, {"head_dim", 4}, {"d_ff", 24}, {"context_length", 8},
                 {"rope_theta", 10000.0}, {"tie_embeddings", tied}}},
      {"residual", {{"mode", residual_mode_name(mode)}, {"heads", heads}, {"block_size", block_size}}},
      {"train", {{"micro_batch", 2}, {"seq_len", 5}, {"warmup_steps", 0}}}};
  if (mode == ResidualMode::Hyper) j["residual"]["hyper_n"] = hyper_n;
  if (mode == ResidualMode::Delta) j["residual"]["block_layers"] = block_layers;
  return config_from_json(j, "tiny");
}

// The "model" section of the tiny GPU model (model_cudatest.cpp, train_cudatest.cpp):
// tiny, but with the shapes the GPU kernels special-case: head_dim 64 (attention supports
// 64 and 128), GQA 2 (4 query heads on 2 KV heads), d_model 128 (routing heads of 64 at
// residual.heads 2).
inline nlohmann::json tiny_gpu_model_json(int vocab, int context_length) {
  return {{"vocab_size", vocab},   {"d_model", 128},
          {"n_layers", 2},         {"n_heads", 4},
          {"n_kv_heads", 2},       {"head_dim", 64},
          {"d_ff", 256},           {"context_length", context_length},
          {"rope_theta", 10000.0}, {"tie_embeddings", true}};
}

inline std::vector<double> download(Backend& be, const Tensor& t) {
  std::vector<double> v(static_cast<size_t>(t.numel()));
  be.download(v.data(), t);
  return v;
}

// Random weights large enough that every path matters: matrices ~0.3, norm weights and
// gains 1 +- 0.2, routing queries ~0.5 (zero queries would hide the key path), hyper
// coefficients their one-hot or identity start +- 0.3 (every stream mixed into every
// other, so no coefficient's path is dead).
inline void randomize_weights(Model& m, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<double> nd(0.0, 1.0);
  for (auto& p : m.parameters()) {
    std::vector<double> v(static_cast<size_t>(p.value.numel()));
    for (size_t i = 0; i < v.size(); ++i) {
      double& x = v[i];
      const int64_t a = p.init_arg;
      switch (p.init) {
        case Init::Zero: x = 0.5 * nd(rng); break;
        case Init::One: x = 1.0 + 0.2 * nd(rng); break;
        case Init::Normal: x = 0.3 * nd(rng); break;
        case Init::OneHot: x = (int64_t(i) == a ? 1.0 : 0.0) + 0.3 * nd(rng); break;
        case Init::Identity: x = (int64_t(i) % (a + 1) == 0 ? 1.0 : 0.0) + 0.3 * nd(rng); break;
        case Init::HyperScale: x = 0.5 * nd(rng); break;
      }
    }
    m.backend().upload(p.value, v.data());
  }
}

inline void random_tokens(int n, int vocab, uint64_t seed, std::vector<int32_t>& tokens,
                          std::vector<int32_t>& targets) {
  std::mt19937_64 rng(seed);
  tokens.resize(n);
  targets.resize(n);
  for (int i = 0; i < n; ++i) {
    tokens[i] = int32_t(rng() % uint64_t(vocab));
    targets[i] = int32_t(rng() % uint64_t(vocab));
  }
}

// Uploads every parameter of `from` into the same-named parameter of `to`.
inline void copy_weights(Model& from, Model& to) {
  for (auto& p : from.parameters()) {
    auto v = download(from.backend(), p.value);
    to.backend().upload(to.parameter(p.name).value, v.data());
  }
}

// A low-entropy Markov "language" over 32 ids: each token is followed by one of two
// successors, so a model that learns it falls from ln 32 = 3.47 toward ln 2 = 0.69.
inline std::vector<int32_t> markov_tokens(size_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<int32_t> t(n);
  t[0] = 1;
  for (size_t i = 1; i < n; ++i) t[i] = int32_t((5 * t[i - 1] + 1 + 7 * (rng() % 2)) % 32);
  return t;
}

// Batch `batch` of B rows of T tokens read in order from a markov_tokens corpus (rows of
// T + 1 tokens: inputs x, next-token targets y).
inline void markov_batch(const std::vector<int32_t>& corpus, size_t batch, int B, int T,
                         int32_t* x, int32_t* y) {
  for (int b = 0; b < B; ++b)
    for (int t = 0; t < T; ++t) {
      const size_t at = (batch * size_t(B) + size_t(b)) * size_t(T + 1) + size_t(t);
      x[b * T + t] = corpus[at];
      y[b * T + t] = corpus[at + 1];
    }
}

// Plans a model at the CUDA backend's dtypes without memory: allocations are never
// touched while a model is built, so every arena gets the same dummy address.
class PlanOnly final : public ForwardingBackend {
 public:
  using ForwardingBackend::ForwardingBackend;
  DType act_dtype() const override { return DType::BF16; }
  DType stat_dtype() const override { return DType::F32; }
  DType grad_dtype() const override { return DType::F32; }
  void* allocate(size_t) override { return reinterpret_cast<void*>(uintptr_t(1) << 20); }
  void release(void*) override {}
};

// Random host values in [-1, 1), uploaded into t; returned for the reference.
inline std::vector<double> fill(Backend& be, Tensor t, std::mt19937_64& rng) {
  std::uniform_real_distribution<double> u(-1, 1);
  std::vector<double> v(size_t(t.numel()));
  for (double& x : v) x = u(rng);
  be.upload(t, v.data());
  return v;
}
// Every element NaN: an op that should overwrite t and skips an element shows it.
inline void poison(Backend& be, Tensor t) {
  std::vector<double> v(size_t(t.numel()), std::numeric_limits<double>::quiet_NaN());
  be.upload(t, v.data());
}

// One more bf16 rounding's worth of noise, to measure how sensitive a result is to it:
// every parameter multiplied by (1 + u), u uniform in [-rel, rel], drawn from `seed`.
// The default 2^-9 is the relative error of rounding to bf16, for weights held in fp32
// or fp64. Weights already on the bf16 grid need rel = 2^-8: a change of 2^-9 or less
// never crosses half a bf16 ulp (2^-9 to 2^-8 of the value), so it would round back to
// the same weights; 2^-8 moves a share of them by one ulp, never more.
inline void perturb_parameters(Model& m, uint64_t seed, double rel = 0x1p-9) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<double> u(-rel, rel);
  for (auto& p : m.parameters()) {
    auto v = download(m.backend(), p.value);
    for (double& x : v) x *= 1.0 + u(rng);
    m.backend().upload(p.value, v.data());
  }
}

// ||a - b|| / ||b|| (0 when both are zero).
inline double rel_error(const std::vector<double>& a, const std::vector<double>& b) {
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    num += (a[i] - b[i]) * (a[i] - b[i]);
    den += b[i] * b[i];
  }
  return den == 0 ? std::sqrt(num) : std::sqrt(num / den);
}

}  // namespace mhar::test
