// hyper_dynamic_training_noise.cpp: experiment, not a test (no assertions; not built by
// CMake, whose glob is tests/*_test.cpp). Runs tests/model_cudatest.cpp's GpuTraining
// configuration (tiny model, same_weights seed 3, markov_tokens seed 11, 60 AdamW steps,
// lr 3e-3, warmup 5) on the CPU engine under noise models of the GPU's bf16 storage, and
// prints the mean loss of the last 10 steps against the fp32 run's. It measured the
// spread that kTolTrainDynamic there is derived from (2026-11-30). To run it:
//   cp tests/experiments/hyper_dynamic_training_noise.cpp tests/hyper_dynamic_training_noise_test.cpp
//   (re-run cmake, build mhar_tests), then e.g.
//   EXP_MODES=hyper_dynamic, EXP_KINDS=3 EXP_SEEDS=8 ./build-cpu/mhar_tests --gtest_filter='HyperBf16Exp*'
// kind bits: 1 random bf16 rounding of activations (tests/bf16_storage_backend.h), 2 bf16
// weights from fp32 master weights (as the CUDA optimizer), 4 deterministic round-to-nearest
// activations instead of 1's random draw, 8 a planted bug (w, s_a, s_b get no gradient).
// Env: EXP_MODES (labels, each followed by a comma), EXP_KINDS (hex digits), EXP_SEEDS,
// EXP_SEED0 (first seed offset), EXP_FP32 (skip the fp32 run, use this tail), EXP_VERBOSE.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "engine/backend.h"
#include "engine/communicator.h"
#include "engine/config.h"
#include "engine/forwarding_backend.h"
#include "engine/model.h"
#include "engine/optimizer.h"
#include "engine/train_step.h"
#include "tests/bf16_storage_backend.h"
#include "tests/model_pair_util.h"
#include "tests/model_test_util.h"

namespace mhar::test {
namespace {

// Parameters stored in bf16 with fp32 master weights, as the CUDA optimizer keeps them.
class Bf16Params final : public ForwardingBackend {
 public:
  explicit Bf16Params(Backend& in) : ForwardingBackend(in) {}
  std::string name() const override { return "bf16-params(" + in_.name() + ")"; }
  void adamw(Tensor p, Tensor master, Tensor g, Tensor m, Tensor v, const AdamW& hp) override {
    auto& sh = shadow_[p.data];
    float* pp = p.ptr<float>();
    if (sh.empty()) sh.assign(pp, pp + p.numel());
    Tensor s(sh.data(), DType::F32, {p.numel()});
    in_.adamw(s, master, g, m, v, hp);
    for (int64_t i = 0; i < p.numel(); ++i) pp[i] = bf16_round_nearest_even(sh[size_t(i)]);
  }

 private:
  std::map<void*, std::vector<float>> shadow_;
};

// A planted bug: the dynamic parameters w, s_a, s_b get no gradient.
class NoDynGrad final : public ForwardingBackend {
 public:
  explicit NoDynGrad(Backend& in) : ForwardingBackend(in) {}
  std::string name() const override { return "nodyn(" + in_.name() + ")"; }
  void hyper_dynamic_coef_backward(Tensor dH, Tensor dW, Tensor dAm, Tensor dAr, Tensor dB,
                                   Tensor dsa, Tensor dsb, Tensor dC, Tensor H, Tensor W,
                                   Tensor T, Tensor rstd, Tensor sa, Tensor sb) override {
    std::vector<float> w(size_t(dW.numel())), a(1), b(1);
    in_.hyper_dynamic_coef_backward(dH, Tensor(w.data(), DType::F32, {dW.numel()}), dAm, dAr, dB,
                                    Tensor(a.data(), DType::F32, {1}), Tensor(b.data(), DType::F32, {1}),
                                    dC, H, W, T, rstd, sa, sb);
  }
};

Config cfg_for(const std::string& mode, bool dyn) {
  nlohmann::json j = {
      {"model", {{"vocab_size", 32}, {"d_model", 128}, {"n_layers", 2}, {"n_heads", 4},
                 {"n_kv_heads", 2}, {"head_dim", 64}, {"d_ff", 256}, {"context_length", 128},
                 {"rope_theta", 10000.0}, {"tie_embeddings", true}}},
      {"residual", {{"mode", mode}, {"heads", mode == "mhar" ? 2 : 0}, {"block_size", 0}}},
      {"train", {{"micro_batch", 4}, {"seq_len", 64}, {"warmup_steps", 5}}}};
  if (dyn) j["residual"]["hyper_dynamic"] = true;
  Config c = config_from_json(j, "exp");
  c.train.steps = 60;
  c.train.lr = 3e-3;
  return c;
}

// kind: 0 fp32, 1 bf16 activations, 2 bf16 params, 3 both.
double train(const std::string& mode, bool dyn, int kind, uint64_t seed, bool verbose,
             double pert = 0) {
  Config cfg = cfg_for(mode, dyn);
  const int B = cfg.train.micro_batch, T = cfg.train.seq_len, steps = cfg.train.steps;
  const std::vector<int32_t> corpus = markov_tokens(size_t(steps) * B * (T + 1) + 1, 11);
  auto cpu = make_cpu_backend(DType::F32);
  Model m0(cfg.model, cfg.residual, *cpu, B, T);
  {
    auto cpu2 = make_cpu_backend(DType::F32);
    Model src(cfg.model, cfg.residual, *cpu2, B, T);
    same_weights(src, m0, 3, 0.1);
  }
  // bf16 weights at the start, as the GPU test uploads them.
  std::mt19937_64 prng(seed * 7 + 1);
  std::uniform_real_distribution<double> ud(-1, 1);
  for (auto& p : m0.parameters()) {
    auto v = download(*cpu, p.value);
    for (auto& x : v) {
      x = bf16_round_nearest_even(float(x));
      if (pert > 0) x *= 1 + pert * ud(prng);
    }
    cpu->upload(p.value, v.data());
  }
  std::unique_ptr<Backend> act, par;
  Backend* be = cpu.get();
  if (kind & 4)
    act = std::make_unique<Bf16Storage>(*be, seed, Bf16Storage::Rounding::NearestEven), be = act.get();
  else if (kind & 1) act = std::make_unique<Bf16Storage>(*be, seed), be = act.get();
  std::unique_ptr<Backend> bug;
  if (kind & 8) bug = std::make_unique<NoDynGrad>(*be), be = bug.get();
  if (kind & 2) par = std::make_unique<Bf16Params>(*be), be = par.get();
  Model mc(cfg.model, cfg.residual, *be, B, T);
  copy_weights(m0, mc);
  AdamWOptimizer oc(mc, cfg.train);
  auto single = make_single_communicator();
  TrainStep ts(mc, oc, *single, cfg.train, 1);
  double tail = 0;
  std::vector<int32_t> x(size_t(B) * T), y(size_t(B) * T);
  for (int s = 0; s < steps; ++s) {
    markov_batch(corpus, size_t(s), B, T, x.data(), y.data());
    const double l = ts.run(s, [&](int32_t* xs, int32_t* ys) {
                         std::copy(x.begin(), x.end(), xs);
                         std::copy(y.begin(), y.end(), ys);
                       }).loss;
    if (s >= steps - 10) tail += l / 10;
    if (verbose && (s % 10 == 0 || s == steps - 1)) std::printf("  step %2d %.4f\n", s + 1, l);
  }
  return tail;
}

TEST(HyperBf16Exp, Sweep) {
  struct M { const char* mode; bool dyn; };
  const char* env = std::getenv("EXP_MODES");
  std::vector<M> ms = {{"hyper", true}, {"hyper", false}, {"standard", false}, {"mhar", false}};
  const int seeds = std::getenv("EXP_SEEDS") ? std::atoi(std::getenv("EXP_SEEDS")) : 4;
  for (const M& m : ms) {
    const std::string label = std::string(m.mode) + (m.dyn ? "_dynamic" : "");
    if (env && std::string(env).find(label + ",") == std::string::npos) continue;
    const double f = std::getenv("EXP_FP32") ? std::atof(std::getenv("EXP_FP32"))
                                              : train(m.mode, m.dyn, 0, 0, true);
    std::printf("EXP %-14s fp32 %.4f\n", label.c_str(), f);
    std::fflush(stdout);
    const std::string kinds = std::getenv("EXP_KINDS") ? std::getenv("EXP_KINDS") : "123";
    for (int kind = 1; kind <= 15; ++kind) {
      if (kinds.find("0123456789abcdef"[kind]) == std::string::npos) continue;
      double s1 = 0, s2 = 0;
      for (int sd = 0; sd < seeds; ++sd) {
        const double l = train(m.mode, m.dyn, kind, 100 + sd + (std::getenv("EXP_SEED0") ? std::atoi(std::getenv("EXP_SEED0")) : 0), std::getenv("EXP_VERBOSE") != nullptr);
        std::printf("EXP %-14s kind %d seed %d tail %.4f rel %+.4f\n", label.c_str(), kind, sd, l,
                    (l - f) / f);
        std::fflush(stdout);
        s1 += l, s2 += l * l;
      }
      const double mean = s1 / seeds, sd = std::sqrt(std::max(0.0, s2 / seeds - mean * mean));
      std::printf("EXP %-14s kind %d mean %.4f (rel %+.4f) sd %.4f (rel %.4f)\n", label.c_str(),
                  kind, mean, (mean - f) / f, sd, sd / f);
      std::fflush(stdout);
    }
  }
}

}  // namespace
}  // namespace mhar::test
