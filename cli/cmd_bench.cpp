// cmd_bench.cpp: `mhar bench CONFIG.json [--steps N] [--warmup N] [--set k=v ...]
// [--device cuda|cpu|auto]`: training-step throughput of the engine (issue 5).
//
// Builds the model of the config with random weights (DESIGN.md's scales; see
// fast_random_init; no data needed), the
// AdamW optimizer, and one fixed batch of uniform random tokens and targets
// (train.micro_batch x train.seq_len, seed train.seed + rank). Runs --warmup untimed
// steps, then --steps timed full training steps (TrainStep, the step `mhar train` runs,
// one micro-batch per rank), each: zero gradients, forward (loss), backward, gradient
// reduce-scatter, global gradient norm (a host-synchronising reduction), AdamW with
// clipping at train.grad_clip on this rank's shard, all-gather of the parameters, then a
// device synchronisation; each step is timed on the host clock between
// synchronisations. Under `mpirun -np N` every rank runs it on its own GPU; before that,
// unless --no-baseline, every rank times the same steps alone (single-process step, no
// communication) on a fresh backend. Prints ONE JSON line on stdout (rank 0; logs go to
// stderr):
//   tokens_per_s      per rank (GPU): micro_batch * seq_len / median step time
//   tokens_per_s_total  tokens_per_s * ranks
//   ranks, communicator  world size and "single" / "mpi" / "nccl"
//   baseline_ms_per_step, baseline_tokens_per_s  (under mpirun) the rank alone
//   scaling_efficiency  baseline_ms_per_step / ms_per_step: tokens/s per GPU at N ranks
//                     over one GPU with the same micro-batch (at -np 1: the communicator
//                     path's cost, also as comm_overhead = ms / baseline ms - 1)
//   exposed_comm_share  (ms - baseline ms) / ms: the share of the data-parallel step
//                     spent on communication the computation does not hide
//   optimizer_state_bytes, baseline_optimizer_state_bytes  fp32 master + AdamW moments
//                     held by a rank (its ZeRO-1 shard) and by the rank alone
//   peak_mem_bytes_per_rank  each rank's peak (below); peak_mem_bytes is the largest
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
//   profile           with --profile N: N more steps timed op by op (engine/op_profile.h),
//                     per step: each op family's ms, share of the step, calls, TFLOP/s
//                     (matmul, attention) or TB/s (the rest) and its share of the
//                     roofline (989 TFLOP/s bf16; for the memory-bound families the
//                     copy rate of this run's GPU, measured before the profiled steps:
//                     cuda::measure_copy_bytes_per_s, 1 GiB of its own for a moment),
//                     and other/idle; the same as a table on stderr.
//                     profile.copy_rate_method says where the copy rate came from: where
//                     it cannot be measured (the CPU backend, a failed measurement) the
//                     H200's measured 4.3 TB/s stands in, and the method says why
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
//   energy_j_per_step, power_w, tokens_per_j, power_limit_w  (GPU) rank 0's GPU over the
//                     timed steps, from the driver's energy counter (cuda/gpu_energy.h):
//                     joules a step (the counter's difference over all timed steps /
//                     steps), the mean draw over them, micro_batch * seq_len / joules a
//                     step, and the enforced limit. A mean draw at the limit (every
//                     mode and size on an H100, cuda/NOTES.md lead 0) says the step is
//                     power-bound: its joules then follow its time. How often the driver
//                     advances the counter is not documented: time a second of steps or
//                     more.
//                     energy_method says where they came from, or why they are absent.
#include <spdlog/spdlog.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <functional>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "cli/commands.h"
#include "cuda/device.h"
#include "cuda/gpu_energy.h"
#include "engine/backend_factory.h"
#include "engine/communicator.h"
#include "engine/config.h"
#include "engine/error.h"
#include "engine/model.h"
#include "engine/op_profile.h"
#include "engine/optimizer.h"
#include "engine/train_step.h"

namespace mhar::cli {

namespace {

constexpr double kPeakBf16Flops = 989e12;
// The roofline of the memory-bound op families in --profile is the GPU's own
// device-to-device copy rate, measured in the run: what a kernel that must move its
// bytes can reach (not the datasheet's 4.8 TB/s on an H200, 3.35 on an H100). Where it
// cannot be measured, the H200's measured rate (BENCHMARKS.md) stands in.
constexpr double kReferenceCopyBytesPerS = 4.3e12;

double flops_per_token(const ModelConfig& m, int seq_len) {
  const double d = m.d_model, L = m.n_layers, qd = m.q_dim(), kvd = m.kv_dim();
  const double per_layer = d * (2 * qd + 2 * kvd) + 3 * d * m.d_ff;
  const double matmul_params = L * per_layer + d * double(m.vocab_size);
  return 6 * matmul_params + 6 * L * double(seq_len) * qd;
}

// Model::init_weights with uniform draws of unit variance from xorshift64* instead of
// its Box-Muller normals: the same scales, and the timing does not depend on the values,
// while the normals cost ~40 s of host time at 1B parameters.
void fast_random_init(Model& model, uint64_t seed) {
  uint64_t s = seed * 0x9E3779B97F4A7C15ULL + 1;
  model.init_weights([&s](const Parameter&, std::vector<double>& out) {
    for (double& x : out) {
      s ^= s >> 12, s ^= s << 25, s ^= s >> 27;
      const double u = double((s * 0x2545F4914F6CDD1DULL) >> 11) * 0x1.0p-53;  // [0, 1)
      x = std::sqrt(3.0) * (2 * u - 1);                                      // U(-sqrt 3, sqrt 3)
    }
  });
}

struct BenchOptions {
  std::string config_path, device = "auto";
  std::vector<std::string> overrides;
  int steps = 10, warmup = 3;
  int profile_steps = 0;  // --profile: steps timed op by op after the timed steps
  bool baseline = true;
};

// Timed steps of one configuration: a fresh backend (so its peak memory is this
// phase's own), the model padded for `comm`'s ranks, the sharded optimizer, TrainStep.
struct PhaseResult {
  std::vector<double> times;  // seconds per timed step
  double loss = 0;
  long long steps = 0;
  int64_t peak = 0;  // backend allocations, or the arenas when the backend does not count
  std::string peak_method;
  size_t arena_bytes = 0;
  size_t optimizer_state_bytes = 0;  // this rank's fp32 master and moments (its ZeRO-1 shard)
  int64_t params = 0, embed_params = 0;
  std::string backend_name;
  nlohmann::json profile;  // --profile: OpProfiler::report
  std::string profile_table;
  double copy_bytes_per_s = NAN;  // --profile's roofline of the memory-bound families
  std::string copy_rate_method;   // where it came from (profile.copy_rate_method)
  double energy_j = NAN;  // the GPU's over the timed steps (NaN: no counter)
  double power_limit_w = NAN;
  std::string energy_method;  // "nvml ..." or why there is none
};

PhaseResult run_phase(const Config& cfg, const BenchOptions& o, int local_rank,
                      const std::function<std::unique_ptr<Communicator>(Backend&)>& make_comm) {
  const auto& t = cfg.train;
  const int B = t.micro_batch, T = t.seq_len;
  auto device = make_backend(o.device, local_rank);
  auto comm = make_comm(*device);  // on the device's own stream
  // The model and optimizer run on the profiler, which passes ops straight through
  // until a profiled step arms it.
  std::optional<OpProfiler> profiler;
  if (o.profile_steps > 0) profiler.emplace(*device);
  Backend* backend = profiler ? static_cast<Backend*>(&*profiler) : device.get();
  Model model(cfg.model, cfg.residual, *backend, B, T, comm->world_size(), cfg.train.logits_chunk);
  fast_random_init(model, t.seed);
  AdamWOptimizer optimizer(model, t, comm->rank());  // copies its shard into the fp32 master
  TrainStep step(model, optimizer, *comm, t, 1);

  std::vector<int32_t> x(size_t(B) * T), y(size_t(B) * T);
  std::mt19937_64 rng(t.seed + uint64_t(comm->rank()));
  for (size_t i = 0; i < x.size(); ++i) {
    x[i] = int32_t(rng() % uint64_t(cfg.model.vocab_size));
    y[i] = int32_t(rng() % uint64_t(cfg.model.vocab_size));
  }
  const auto batch = [&](int32_t* xs, int32_t* ys) {
    std::copy(x.begin(), x.end(), xs);
    std::copy(y.begin(), y.end(), ys);
  };
  PhaseResult r;
  for (const auto& p : model.parameters())
    if (p.name == "model.embed_tokens.weight" || p.name == "lm_head.weight")
      r.embed_params += p.value.numel();
  r.params = model.num_parameters();
  r.backend_name = backend->name();
  for (int i = 0; i < o.warmup; ++i) r.loss = step.run(r.steps++, batch).loss;
  std::optional<cuda::GpuEnergyCounter> energy;
  if (is_cuda_backend(r.backend_name)) {
    energy.emplace(local_rank);
    r.energy_method = energy->available()
                          ? "nvml total energy counter of rank 0's GPU over the timed steps"
                          : "unavailable: " + energy->why_unavailable();
  }
  const double joules_before = energy ? energy->joules() : NAN;
  for (int i = 0; i < o.steps; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    r.loss = step.run(r.steps++, batch).loss;  // ends with a device synchronisation
    r.times.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  if (energy && energy->available()) {
    r.energy_j = energy->joules() - joules_before;
    r.power_limit_w = energy->power_limit_watts();
    if (std::isnan(r.energy_j)) {
      r.energy_method = "unavailable: a read of the energy counter failed";
    } else if (r.energy_j <= 0) {
      r.energy_method =
          "unavailable: the energy counter did not advance over the timed steps "
          "(time more of them)";
      r.energy_j = NAN;
    }
  }
  if (profiler) {
    std::string why = "the " + r.backend_name + " backend has no GPU to measure";
    if (is_cuda_backend(r.backend_name)) r.copy_bytes_per_s = cuda::measure_copy_bytes_per_s(&why);
    if (std::isfinite(r.copy_bytes_per_s)) {
      r.copy_rate_method = "measured on this GPU: cudaMemcpyAsync of 512 MiB, median of 7";
    } else {
      r.copy_bytes_per_s = kReferenceCopyBytesPerS;
      char rate[32];
      std::snprintf(rate, sizeof rate, "%.1f", kReferenceCopyBytesPerS / 1e12);
      r.copy_rate_method =
          std::string("the H200's measured ") + rate + " TB/s (not measured here: " + why + ")";
    }
  }
  for (int i = 0; i < o.profile_steps; ++i) {
    profiler->begin_step();
    const auto t0 = std::chrono::steady_clock::now();
    r.loss = step.run(r.steps++, batch).loss;
    profiler->finish_step(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
  }
  if (profiler) {
    r.profile = profiler->report(kPeakBf16Flops / 1e12, r.copy_bytes_per_s / 1e12);
    r.profile["copy_rate_method"] = r.copy_rate_method;
    r.profile_table = profiler->table(kPeakBf16Flops / 1e12, r.copy_bytes_per_s / 1e12);
  }
  if (!std::isfinite(r.loss)) fail("bench: the loss is ", r.loss, " after ", r.steps, " steps");
  r.arena_bytes = model.parameter_plan().total_bytes() + model.activation_plan().total_bytes() +
                  size_t(model.all_gradients().bytes()) + optimizer.state_bytes();
  r.optimizer_state_bytes = optimizer.state_bytes();
  r.peak = (int64_t)r.arena_bytes;
  r.peak_method = "arenas";
  if (backend->peak_bytes_in_use() >= 0) {
    r.peak = backend->peak_bytes_in_use();
    r.peak_method = "backend allocations";
  }
  return r;
}

double median_of(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

void run_bench(const BenchOptions& o) {
  if (o.steps < 1) fail("--steps must be at least 1, got ", o.steps);
  if (o.warmup < 0) fail("--warmup must be >= 0, got ", o.warmup);
  Config cfg = load_config(o.config_path, o.overrides);
  const auto& t = cfg.train;
  const int B = t.micro_batch, T = t.seq_len;
  const DistInfo& dist_info = dist::init();
  const int W = dist_info.world_size;
  const bool root = dist_info.rank == 0;

  spdlog::info("bench: {} ({}), {} x {} tokens per rank, {} rank(s), {} warmup + {} timed "
               "steps", cfg.source, residual_summary(cfg.residual),
               B, T, W, o.warmup, o.steps);
  // Under mpirun: first every rank alone (the single-process step, no communication:
  // the one-GPU baseline of the scaling efficiency, and at one rank the reference the
  // communicator's overhead is measured against), then the data-parallel step.
  std::optional<PhaseResult> base;
  if (dist_info.mpi && o.baseline) {
    BenchOptions alone = o;
    alone.profile_steps = 0;  // the profile is of the step that is reported
    base = run_phase(cfg, alone, dist_info.local_rank, [](Backend&) { return make_single_communicator(); });
    make_host_communicator()->barrier();  // the phases start together on every rank
  }
  std::string comm_name;
  const PhaseResult r = run_phase(cfg, o, dist_info.local_rank, [&](Backend& be) {
    auto c = make_communicator(be);
    comm_name = c->name();
    return c;
  });
  // Per-rank peaks (and step times) on rank 0.
  std::vector<std::string> rank_reports;
  {
    const nlohmann::json mine = {{"peak", r.peak}, {"ms", median_of(r.times) * 1e3}};
    rank_reports = make_host_communicator()->gather_strings(mine.dump());
  }
  if (!root) return;
  std::vector<long long> peaks;
  for (const auto& s : rank_reports) peaks.push_back(nlohmann::json::parse(s).at("peak").get<long long>());
  const long long peak = *std::max_element(peaks.begin(), peaks.end());

  std::vector<double> sorted = r.times;
  std::sort(sorted.begin(), sorted.end());
  const double median = median_of(r.times);
  const double tokens_per_s = double(B) * T / median;  // per rank
  const double fpt = flops_per_token(cfg.model, T);
  const bool on_gpu = is_cuda_backend(r.backend_name);

  nlohmann::json j = {
      {"tool", "mhar bench"},
      {"config", cfg.source},
      {"mode", residual_mode_name(cfg.residual.mode)},
      {"heads", cfg.residual.heads},
      {"hyper_n", cfg.residual.mode == ResidualMode::Hyper ? cfg.residual.hyper_n : 0},
      {"block_layers", cfg.residual.mode == ResidualMode::Delta ? cfg.residual.block_layers : 0},
      {"device", on_gpu ? cuda::describe_device(dist_info.local_rank) : std::string("cpu")},
      {"backend", r.backend_name},
      {"ranks", W},
      {"communicator", comm_name},
      {"params", r.params},
      {"params_nonembedding", r.params - r.embed_params},
      {"micro_batch", B},
      {"seq_len", T},
      {"steps_timed", o.steps},
      {"warmup", o.warmup},
      {"tokens_per_s", std::round(tokens_per_s * 10) / 10},
      {"tokens_per_s_total", std::round(tokens_per_s * W * 10) / 10},
      {"ms_per_step", median * 1e3},
      {"ms_per_step_min", sorted.front() * 1e3},
      {"ms_per_step_max", sorted.back() * 1e3},
      {"peak_mem_bytes", peak},
      {"peak_mem_bytes_per_rank", peaks},
      {"peak_mem_method", r.peak_method},
      {"arena_bytes", (long long)r.arena_bytes},
      {"optimizer_state_bytes", (long long)r.optimizer_state_bytes},
      {"flops_per_token", fpt},
      {"mfu", tokens_per_s * fpt / kPeakBf16Flops},
      {"loss", r.loss},
  };
  if (base) {
    // The same micro-batch on one device without any communication.
    const double base_median = median_of(base->times);
    j["baseline_ms_per_step"] = base_median * 1e3;
    j["baseline_tokens_per_s"] = std::round(double(B) * T / base_median * 10) / 10;
    j["baseline_peak_mem_bytes"] = base->peak;
    j["baseline_optimizer_state_bytes"] = (long long)base->optimizer_state_bytes;
    j["scaling_efficiency"] = base_median / median;
    j["comm_overhead"] = median / base_median - 1;
    // The step time the communication adds (what the backward and the forward do not
    // hide), as a share of the data-parallel step.
    j["exposed_comm_share"] = (median - base_median) / median;
  }
  if (on_gpu) {
    j["energy_method"] = r.energy_method;
    if (std::isfinite(r.energy_j)) {
      double seconds = 0;
      for (double s : r.times) seconds += s;
      const double per_step = r.energy_j / o.steps;
      j["energy_j_per_step"] = per_step;
      j["power_w"] = r.energy_j / seconds;
      j["tokens_per_j"] = double(B) * T / per_step;
    }
    if (std::isfinite(r.power_limit_w)) j["power_limit_w"] = r.power_limit_w;
  }
  if (!r.profile.is_null()) {
    j["profile"] = r.profile;
    std::fprintf(stderr,
                 "profile of %d step(s), per step (rank 0; the rooflines: %.0f TFLOP/s bf16, "
                 "%.2f TB/s copy, %s):\n%s",
                 o.profile_steps, kPeakBf16Flops / 1e12, r.copy_bytes_per_s / 1e12,
                 r.copy_rate_method.c_str(), r.profile_table.c_str());
  }
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
  add_number(cmd, "--profile", o.profile_steps, 1, 1000,
             "After the timed steps, time this many more op by op: time per step by op family, its "
             "share, achieved TFLOP/s or TB/s against the roofline (a table on stderr, \"profile\" in "
             "the JSON)");
  cmd->add_flag("--baseline,!--no-baseline", o.baseline,
                "Under mpirun: time every rank alone first (one-GPU baseline of the scaling "
                "efficiency and of the communicator's overhead)");
  cmd->add_option("--device", o.device, "cuda, cpu or auto (CUDA when a GPU is present)")
      ->check(CLI::IsMember({"cpu", "cuda", "auto"}))
      ->capture_default_str();
  cmd->callback([] { run_bench(o); });
}

}  // namespace mhar::cli
