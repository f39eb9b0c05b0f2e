// cmd_bench.cpp: `mhar bench CONFIG.json [--steps N] [--warmup N] [--set k=v ...]
// [--device cuda|cpu|auto]`: training-step throughput of the engine (issue 5).
//
// Builds the model of the config with random weights (DESIGN.md's scales; see
// fast_random_init; no data needed), the
// AdamW optimizer, and one fixed batch of uniform random tokens and targets
// (train.micro_batch x train.seq_len, seed train.seed). Runs --warmup untimed steps, then
// --steps timed full training steps, each: zero gradients, forward (loss), backward,
// global gradient norm (a host-synchronising reduction), AdamW with clipping at
// train.grad_clip, then a device synchronisation; each step is timed on the host clock
// between synchronisations. Prints ONE JSON line on stdout (logs go to stderr):
//   tokens_per_s      micro_batch * seq_len / median step time
//   ms_per_step       median (also _min and _max)
//   peak_mem_bytes    CUDA: the most device memory the backend held from cudaMalloc at
//                     any time (Backend::peak_bytes_in_use): every arena (parameters,
//                     gradients, activations, optimizer state), the cuBLAS workspace and
//                     the attention scratch; the CUDA context and cuBLAS's own handles
//                     are not counted. This is what PyTorch's number in
//                     tools/reference/bench_step.py counts too
//                     (torch.cuda.max_memory_allocated: tensors, its cuBLAS workspace
//                     included, no context). Counted by the process itself, it is not
//                     disturbed by other processes on the GPU (cudaMemGetInfo was, in the
//                     first benchmark runs). CPU: the sum of the arenas. peak_mem_method
//                     says which.
//   mfu               tokens_per_s * flops_per_token / 989e12 (H100/H200 SXM dense bf16
//                     datasheet peak; cuBLAS reaches ~790e12 on these machines, so 0.80 is
//                     the practical ceiling). Reported for CPU runs too, against the same
//                     GPU peak, so it is only meaningful on the GPU.
//   flops_per_token   the same formula as tools/reference/bench_step.py, so the two MFUs
//                     compare: 6 * (matmul parameters: per layer d*(2*q_dim + 2*kv_dim) +
//                     3*d*d_ff, plus the LM head d*V; the embedding lookup not counted) +
//                     6 * n_layers * seq_len * q_dim (causal attention: QK^T and PV, half
//                     of the T x T square, forward and backward = 3x). Routing and
//                     elementwise FLOPs are not counted, so mhar and standard share one
//                     numerator.
//   params            every parameter (tied embedding counted once); also the
//                     non-embedding count.
#include <spdlog/spdlog.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "cli/commands.h"
#include "cuda/device.h"
#include "engine/backend_factory.h"
#include "engine/config.h"
#include "engine/error.h"
#include "engine/model.h"
#include "engine/optimizer.h"

namespace mhar::cli {

namespace {

constexpr double kPeakBf16Flops = 989e12;

double flops_per_token(const ModelConfig& m, int seq_len) {
  const double d = m.d_model, L = m.n_layers, qd = m.q_dim(), kvd = m.kv_dim();
  const double per_layer = d * (2 * qd + 2 * kvd) + 3 * d * m.d_ff;
  const double matmul_params = L * per_layer + d * double(m.vocab_size);
  return 6 * matmul_params + 6 * L * double(seq_len) * qd;
}

// Random weights with DESIGN.md's scales (matrices std init_std, output projections
// scaled by 1/sqrt(2L), norm weights and routing gains 1, routing queries 0), drawn
// uniform with that std from xorshift64* instead of Model::init_weights' Box-Muller
// normals: the timing does not depend on the values, and the normals cost ~40 s of host
// time at 1B parameters.
void fast_random_init(Model& model, uint64_t seed) {
  const auto& m = model.config();
  const double out_scale = 1.0 / std::sqrt(2.0 * m.n_layers);
  uint64_t s = seed * 0x9E3779B97F4A7C15ULL + 1;
  std::vector<double> host;
  for (auto& p : model.parameters()) {
    host.assign(size_t(p.value.numel()), 0.0);
    const bool query = p.name.find(".query") != std::string::npos;
    if (p.value.ndim == 1) {
      if (!query) std::fill(host.begin(), host.end(), 1.0);
    } else {
      const bool out = p.name.find("o_proj") != std::string::npos ||
                       p.name.find("down_proj") != std::string::npos;
      const double a = std::sqrt(3.0) * m.init_std * (out ? out_scale : 1.0);  // U(-a, a)
      for (double& x : host) {
        s ^= s >> 12, s ^= s << 25, s ^= s >> 27;
        const double u = double((s * 0x2545F4914F6CDD1DULL) >> 11) * 0x1.0p-53;  // [0, 1)
        x = a * (2 * u - 1);
      }
    }
    model.backend().upload(p.value, host.data());
  }
}

struct BenchOptions {
  std::string config_path, device = "auto";
  std::vector<std::string> overrides;
  int steps = 10, warmup = 3;
};

void run_bench(const BenchOptions& o) {
  if (o.steps < 1) fail("--steps must be at least 1, got ", o.steps);
  if (o.warmup < 0) fail("--warmup must be >= 0, got ", o.warmup);
  Config cfg = load_config(o.config_path, o.overrides);
  const auto& t = cfg.train;
  const int B = t.micro_batch, T = t.seq_len;

  auto backend = make_backend(o.device);
  const bool on_gpu = backend->name().rfind("cuda", 0) == 0;

  Model model(cfg.model, cfg.residual, *backend, B, T);
  fast_random_init(model, t.seed);
  AdamWOptimizer optimizer(model, t);  // copies the weights into its fp32 master copy

  std::vector<int32_t> x(size_t(B) * T), y(size_t(B) * T);
  std::mt19937_64 rng(t.seed);
  for (size_t i = 0; i < x.size(); ++i) {
    x[i] = int32_t(rng() % uint64_t(cfg.model.vocab_size));
    y[i] = int32_t(rng() % uint64_t(cfg.model.vocab_size));
  }
  int64_t embed_params = 0;
  for (const auto& p : model.parameters())
    if (p.name == "model.embed_tokens.weight" || p.name == "lm_head.weight")
      embed_params += p.value.numel();

  spdlog::info("bench: {} ({} H={}), {} parameters, {} x {} tokens, backend {}, {} warmup + {} "
               "timed steps", cfg.source, residual_mode_name(cfg.residual.mode),
               cfg.residual.heads, model.num_parameters(), B, T, backend->name(), o.warmup,
               o.steps);

  double loss = 0;
  long long step_no = 0;
  auto step = [&] {
    model.zero_grads();
    loss = model.forward(x.data(), y.data(), 1.0);
    model.backward();
    const double grad_norm = std::sqrt(backend->sum_squares(model.all_gradients()));
    optimizer.step(t.lr, clip_factor(grad_norm, t.grad_clip), ++step_no);
    backend->synchronize();
  };
  for (int i = 0; i < o.warmup; ++i) step();
  std::vector<double> times;
  for (int i = 0; i < o.steps; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    step();
    times.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  if (!std::isfinite(loss)) fail("bench: the loss is ", loss, " after ", step_no, " steps");

  const size_t arena_bytes = model.parameter_plan().total_bytes() +
                             model.activation_plan().total_bytes() +
                             size_t(model.all_gradients().bytes()) + optimizer.state_bytes();
  long long peak = (long long)arena_bytes;
  std::string method = "arenas";
  if (backend->peak_bytes_in_use() >= 0) {
    peak = (long long)backend->peak_bytes_in_use();
    method = "backend allocations";
  }
  std::vector<double> sorted = times;
  std::sort(sorted.begin(), sorted.end());
  const size_t n = sorted.size();
  const double median = n % 2 ? sorted[n / 2] : 0.5 * (sorted[n / 2 - 1] + sorted[n / 2]);
  const double tokens_per_s = double(B) * T / median;
  const double fpt = flops_per_token(cfg.model, T);

  nlohmann::json j = {
      {"tool", "mhar bench"},
      {"config", cfg.source},
      {"mode", residual_mode_name(cfg.residual.mode)},
      {"heads", cfg.residual.heads},
      {"device", on_gpu ? cuda::describe_device(0) : std::string("cpu")},
      {"backend", backend->name()},
      {"params", model.num_parameters()},
      {"params_nonembedding", model.num_parameters() - embed_params},
      {"micro_batch", B},
      {"seq_len", T},
      {"steps_timed", o.steps},
      {"warmup", o.warmup},
      {"tokens_per_s", std::round(tokens_per_s * 10) / 10},
      {"ms_per_step", median * 1e3},
      {"ms_per_step_min", sorted.front() * 1e3},
      {"ms_per_step_max", sorted.back() * 1e3},
      {"peak_mem_bytes", peak},
      {"peak_mem_method", method},
      {"arena_bytes", (long long)arena_bytes},
      {"flops_per_token", fpt},
      {"mfu", tokens_per_s * fpt / kPeakBf16Flops},
      {"loss", loss},
  };
  std::printf("%s\n", j.dump().c_str());
  std::fflush(stdout);
}

}  // namespace

void register_bench_command(CLI::App& app) {
  auto* cmd = app.add_subcommand(
      "bench",
      "Time full training steps (forward, backward, AdamW) of a config's model on random "
      "tokens and print one JSON line: tokens/s, ms per step (median), peak device memory, MFU.");
  static BenchOptions o;
  cmd->add_option("config", o.config_path, "Run config (JSON)")->required();
  // Step counts only cost time; the caps catch typing slips.
  add_number(cmd, "--steps", o.steps, 1, 1000000, "Timed steps (the median is reported)");
  add_number(cmd, "--warmup", o.warmup, 0, 1000000, "Untimed steps first");
  cmd->add_option("--set", o.overrides, "Override a config field, e.g. --set train.micro_batch=4");
  cmd->add_option("--device", o.device, "cuda, cpu or auto (CUDA when a GPU is present)")
      ->check(CLI::IsMember({"cpu", "cuda", "auto"}))
      ->capture_default_str();
  cmd->callback([] { run_bench(o); });
}

}  // namespace mhar::cli
