// trainer.cpp: the training loop, evaluation, run-directory rules and resume (see
// trainer.h).
#include "engine/trainer.h"

#include <spdlog/spdlog.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdlib>
#include <filesystem>
#include <fstream>

#include "data/loader.h"
#include "engine/backend_factory.h"
#include "engine/checkpoint.h"
#include "engine/communicator.h"
#include "engine/error.h"
#include "engine/metrics.h"
#include "engine/optimizer.h"
#include "engine/report.h"
#include "engine/train_step.h"
#include "engine/watchdog.h"

namespace fs = std::filesystem;

namespace mhar {

namespace {

std::atomic<int> g_stop_signals{0};

void on_stop_signal(int sig) {
  if (g_stop_signals.fetch_add(1) >= 1) {
    std::signal(sig, SIG_DFL);
    std::raise(sig);  // second signal: leave now
  }
}

std::string format_duration(double seconds) {
  if (!std::isfinite(seconds) || seconds < 0) return "--:--:--";
  long long s = std::llround(seconds);
  char buf[32];
  std::snprintf(buf, sizeof buf, "%02lld:%02lld:%02lld", s / 3600, (s / 60) % 60, s % 60);
  return buf;
}

std::string join_path(const std::string& base, const std::string& p) {
  if (p.empty() || fs::path(p).is_absolute()) return p;
  return (fs::path(base) / p).lexically_normal().string();
}

// The run directory must be new, or hold this very run (then only with --resume).
void prepare_run_dir(const Config& cfg, const TrainOptions& opt) {
  const fs::path cfg_path = fs::path(opt.run_dir) / "config.json";
  if (opt.resume) return;
  if (fs::exists(cfg_path)) {
    std::ifstream in(cfg_path);
    auto j = nlohmann::json::parse(in, nullptr, false);
    if (j.is_discarded() || j != cfg.to_json())
      fail(opt.run_dir, " already holds a different run (its config.json differs from this "
           "config); choose a new --run-dir, or delete that directory");
    if (!list_checkpoints(opt.run_dir).empty())
      fail(opt.run_dir, " already holds checkpoints of this run; continue it with --resume ",
           opt.run_dir, " or choose a new --run-dir");
  }
  fs::create_directories(opt.run_dir);
  const std::string tmp = cfg_path.string() + ".tmp";
  {
    std::ofstream out(tmp, std::ios::trunc);
    out << cfg.to_json().dump(2) << "\n";
    if (!out) fail(cfg_path.string(), ": cannot write (disk full?)");
  }
  fs::rename(tmp, cfg_path);
}

}  // namespace

void install_stop_signal_handlers() {
  std::signal(SIGINT, on_stop_signal);
  std::signal(SIGTERM, on_stop_signal);
  // mpirun forwards SIGUSR1 to every rank (it turns SIGINT/SIGTERM into a job abort).
  std::signal(SIGUSR1, on_stop_signal);
}

void resolve_data_paths(Config& cfg) {
  const std::string base = cfg.config_dir.empty() ? fs::current_path().string() : cfg.config_dir;
  cfg.data.train = join_path(base, cfg.data.train);
  cfg.data.val = join_path(base, cfg.data.val);
  if (cfg.data.tokenizer != "gpt2" && cfg.data.tokenizer != "qwen3")
    cfg.data.tokenizer = join_path(base, cfg.data.tokenizer);
}

EvalResult evaluate(Model& model, data::DataLoader& loader, long long max_batches,
                    RoutingAccumulator* routing) {
  loader.reset();
  const int B = model.batch(), T = model.seq_len();
  long long n = (long long)loader.num_batches();
  if (max_batches > 0) n = std::min(n, max_batches);
  std::vector<int32_t> x(size_t(B) * T), y(size_t(B) * T);
  EvalResult r;
  double sum = 0;
  for (long long b = 0; b < n; ++b) {
    loader.next_batch(x.data(), y.data());
    sum += model.forward(x.data(), y.data(), 0.0) * double(B) * T;  // equal-size batches
    if (routing) routing->add(model);
    r.tokens += (long long)B * T;
  }
  r.batches = n;
  r.loss = r.tokens ? sum / double(r.tokens) : NAN;
  return r;
}

namespace {

// The checkpoint to resume from: rank 0 chooses and validates it; the other ranks take
// its state.json from rank 0 instead of reading and hashing every file again.
CheckpointInfo open_resume_checkpoint(const TrainOptions& opt, Communicator& comm) {
  std::string chosen;
  CheckpointInfo info;
  if (comm.rank() == 0) {
    const std::string path = (fs::path(opt.run_dir) / "config.json").string();
    if (!fs::exists(path))
      fail("--resume ", opt.run_dir, ": no config.json there, so it is not a run directory");
    info = open_checkpoint(opt.run_dir, opt.resume_latest_valid);
    {  // the run directory's config must describe the checkpoint's model
      std::ifstream in(path);
      auto j = nlohmann::json::parse(in, nullptr, false);
      if (j.is_discarded()) fail(path, ": not valid JSON");
      check_same_model(config_from_json(j, path), info.config, info.dir);
    }
    chosen = nlohmann::json{{"dir", info.dir}, {"state", info.state}}.dump();
  }
  chosen = comm.broadcast_string(chosen);
  if (comm.rank() != 0) {
    const nlohmann::json j = nlohmann::json::parse(chosen);
    info.dir = j.at("dir").get<std::string>();
    info.state = j.at("state");
    info.step = info.state.at("step").get<int64_t>();
    info.config = config_from_json(info.state.at("config"), info.dir + "/state.json (config)");
  }
  return info;
}

// The loader position of a checkpoint written by `from` ranks, for `to` ranks: a step
// of the loader covers world_size x micro_batch windows, and the global batch is the
// same, so the position in windows is kept. The epoch boundary follows the new world
// size (the tail that does not fill a step differs), which the log says.
nlohmann::json convert_loader_state(nlohmann::json st, int from, int to,
                                    const data::DataLoader& loader) {
  if (from == to) return st;
  const uint64_t step = st.at("step").get<uint64_t>() * uint64_t(from);
  if (step % uint64_t(to) != 0)
    fail("the checkpoint's data position (loader step ", st.at("step").dump(), " of ", from,
         " ranks) does not fall on a step of ", to, " ranks");
  st["world_size"] = to;
  st["step"] = step / uint64_t(to);
  if (st["step"].get<uint64_t>() >= loader.num_batches()) {
    st["step"] = 0;
    st["epoch"] = st.at("epoch").get<uint64_t>() + 1;
  }
  return st;
}

}  // namespace

TrainResult train(Config cfg, const TrainOptions& opt) {
  MHAR_CHECK(!opt.run_dir.empty(), "run_dir");
  g_stop_signals = 0;
  const DistInfo& dist_info = dist::init();
  const int rank = dist_info.rank, W = dist_info.world_size;
  const bool root = rank == 0;
  TrainResult result;
  // Host collectives before the backend exists (the resume choice) go through MPI on
  // every backend; the training communicator is made with the backend below.
  std::unique_ptr<Communicator> host_comm = make_host_communicator();
  CheckpointInfo resume_from;
  if (opt.resume) {
    resume_from = open_resume_checkpoint(opt, *host_comm);
    cfg = resume_from.config;  // the run continues with the config it was started with
    spdlog::info("resuming {} from {} (step {})", opt.run_dir, resume_from.dir, resume_from.step);
  } else {
    resolve_data_paths(cfg);
  }
  if (!opt.device.empty()) cfg.train.device = opt.device;
  cfg.validate();
  if (cfg.data.train.empty()) fail(cfg.source, ": data.train is empty; give a shard glob");
  if (cfg.data.val.empty()) fail(cfg.source, ": data.val is empty; give a shard glob");
  const auto& t = cfg.train;
  const int B = t.micro_batch, T = t.seq_len;
  const long long micro_tokens = (long long)B * T;
  const long long accum = TrainStep::micro_batches_per_rank(t.batch_tokens, micro_tokens, W);
  if (root) prepare_run_dir(cfg, opt);
  host_comm->barrier();

  data::DataLoader train_data(cfg.data.train, B, T, t.seed, rank, W, cfg.model.vocab_size,
                              data::LoaderMode::Shuffled);
  // Only rank 0 evaluates, over the whole validation set as one process would.
  std::unique_ptr<data::DataLoader> val_data;
  if (root) {
    val_data = std::make_unique<data::DataLoader>(cfg.data.val, B, T, t.seed, 0, 1, cfg.model.vocab_size,
                                                  data::LoaderMode::Sequential);
    if (val_data->num_batches() == 0)
      fail(cfg.data.val, ": validation shards hold ", val_data->total_tokens(),
           " tokens, fewer than one batch of ", B, " x ", T + 1);
  }

  auto backend = make_backend(t.device, dist_info.local_rank);
  auto comm = make_communicator(*backend);
  Model model(cfg.model, cfg.residual, *backend, B, T, W);
  AdamWOptimizer optimizer(model, t, rank);
  TrainStep train_step(model, optimizer, *comm, t, accum);
  long long step = 0, tokens_seen = 0, consecutive_bad = 0, total_bad = 0;
  double elapsed_before = 0;
  if (opt.resume) {
    load_model_weights(resume_from, model, &optimizer);
    load_optimizer_moments(resume_from, model, optimizer);
    const int ckpt_world = checkpoint_world_size(resume_from);
    if (ckpt_world != W)
      spdlog::info("the checkpoint was written by {} rank(s), this run has {}: optimizer state "
                   "re-sharded, data position kept in windows", ckpt_world, W);
    train_data.restore(convert_loader_state(resume_from.state.at("loader"), ckpt_world, W, train_data));
    const auto& ts = resume_from.state.at("trainer");
    step = resume_from.step;
    tokens_seen = ts.value("tokens_seen", 0LL);
    total_bad = ts.value("total_bad_steps", 0LL);
    // A run stopped during a streak of skipped steps keeps counting it toward
    // train.max_bad_steps (absent in checkpoints written before this field: 0).
    consecutive_bad = ts.value("consecutive_bad_steps", 0LL);
    elapsed_before = ts.value("elapsed_s", 0.0);
    result.last_checkpoint = resume_from.dir;
  } else {
    model.init_weights(t.seed);
    optimizer.sync_master_from_params();
  }
  std::unique_ptr<MetricsLog> metrics;
  if (root)
    metrics = std::make_unique<MetricsLog>((fs::path(opt.run_dir) / "metrics.jsonl").string(),
                                           opt.resume ? step : -1);
  auto log_metrics = [&](const nlohmann::json& line) {
    if (metrics) metrics->append(line);
  };
  spdlog::info("model: {} parameters, residual {} (H={}), backend {}", model.num_parameters(),
               residual_mode_name(cfg.residual.mode), cfg.residual.heads, backend->name());
  spdlog::info("batch: {} x {} tokens x {} micro-batches x {} rank(s) = {} tokens per step; {} steps",
               B, T, accum, W, micro_tokens * accum * W, t.steps);
  if (W > 1 || comm->name() != "single")
    spdlog::info("data parallel: {} rank(s) over {}, ZeRO-1 (optimizer state {} per rank)", W,
                 comm->name(), format_bytes(optimizer.state_bytes()));
  spdlog::debug("memory:\n{}", model.memory_report());

  auto checkpoint = [&](long long at_step, double elapsed_total) {
    watchdog::set_phase("checkpoint", at_step, false);
    CheckpointWrite w;
    w.run_dir = opt.run_dir;
    w.step = at_step;
    w.config = &cfg;
    w.loader = train_data.state();
    w.trainer = {{"tokens_seen", tokens_seen}, {"total_bad_steps", total_bad},
                 {"consecutive_bad_steps", consecutive_bad}, {"elapsed_s", elapsed_total}};
    w.keep = cfg.checkpoint.keep;
    w.comm = comm.get();
    result.last_checkpoint = save_checkpoint(w, model, optimizer);
    spdlog::info("checkpoint: {}", result.last_checkpoint);
  };
  auto run_eval = [&](long long at_step) {
    if (!root) {
      // Wait for rank 0's evaluation here, not inside the next step's collectives (which
      // the watchdog bounds).
      watchdog::set_phase("waiting for rank 0's evaluation", at_step, false);
      comm->barrier();
      return;
    }
    watchdog::set_phase("evaluation", at_step, false);
    RoutingAccumulator routing;
    EvalResult ev = evaluate(model, *val_data, t.eval_batches, &routing);
    log_metrics({{"kind", "eval"}, {"step", at_step}, {"val_loss", ev.loss},
                 {"val_ppl", std::exp(ev.loss)}, {"tokens", ev.tokens}});
    for (const auto& line : routing.lines(at_step)) log_metrics(line);
    try {  // the report is a diagnostic: it never stops a run
      write_run_report(opt.run_dir);
    } catch (const std::exception& e) {
      spdlog::warn("report not written: {}", e.what());
    }
    spdlog::info("eval step {}: val loss {:.4f} (ppl {:.2f}) over {} tokens", at_step, ev.loss,
                 std::exp(ev.loss), ev.tokens);
    if (result.first_val_loss < 0) result.first_val_loss = ev.loss;
    result.last_val_loss = ev.loss;
    comm->barrier();
  };

  if (step == 0) run_eval(0);
  // Fault injection for tests: from this step on the loss reads as NaN, as after a
  // divergence, to prove the skip-and-stop path and that checkpoints stay intact.
  const char* nan_env = std::getenv("MHAR_SIMULATE_NONFINITE_FROM_STEP");
  const long long nan_from = nan_env ? std::atoll(nan_env) : -1;
  const auto run_start = std::chrono::steady_clock::now();
  const long long first_step = step;
  const auto next_batch = [&](int32_t* x, int32_t* y) { train_data.next_batch(x, y); };
  while (step < t.steps) {
    const auto t0 = std::chrono::steady_clock::now();
    // The stop request of any rank (a signal, or the test's step budget) is agreed on in
    // the step's all-reduce, so every rank finishes this step and stops after it.
    const auto want_stop = [&] {
      return g_stop_signals > 0 ||
             (opt.stop_after_steps >= 0 && step + 1 - first_step >= opt.stop_after_steps);
    };
    const StepResult r = train_step.run(step, next_batch, want_stop, nan_from >= 0 && step + 1 >= nan_from);
    const double loss = r.loss, grad_norm = r.grad_norm, lr = r.lr;
    const bool good = r.good;
    if (!good) {
      ++consecutive_bad, ++total_bad;
      log_metrics({{"kind", "skip"}, {"step", step + 1},
                   {"reason", !std::isfinite(loss) ? "non-finite loss" : "non-finite gradients"}});
      spdlog::warn("step {}: non-finite {} — update skipped ({} in a row)", step + 1,
                   std::isfinite(loss) ? "gradients" : "loss", consecutive_bad);
      if (consecutive_bad > t.max_bad_steps)
        fail("stopping: ", consecutive_bad, " consecutive steps with non-finite loss or gradients "
             "(train.max_bad_steps = ", t.max_bad_steps, "); the last good checkpoint is ",
             result.last_checkpoint.empty() ? std::string("none yet") : result.last_checkpoint);
    } else {
      consecutive_bad = 0;
      tokens_seen += micro_tokens * accum * W;
    }
    ++step;  // a skipped step's batch is consumed too: the data position moves on
    const double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    const double elapsed =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - run_start).count();
    result.step = step;
    if (good) {
      const double tok_s = double(micro_tokens * accum * W) / dt;
      log_metrics({{"kind", "train"}, {"step", step}, {"loss", loss}, {"lr", lr},
                   {"grad_norm", grad_norm}, {"tokens_per_s", tok_s}, {"tokens", tokens_seen},
                   {"elapsed_s", elapsed_before + elapsed}});
      result.last_loss = loss;
      if (!opt.quiet && (step % t.log_every == 0 || step == t.steps)) {
        const double eta = elapsed / double(step - first_step) * double(t.steps - step);
        spdlog::info("step {:>6}/{} | loss {:.4f} | lr {:.2e} | grad norm {:.3f} | {:.0f} tok/s | ETA {}",
                     step, t.steps, loss, lr, grad_norm, tok_s, format_duration(eta));
      }
    }
    // A stop request and the end of the run are honoured after a skipped step too (a
    // Ctrl-C during a streak of bad steps must not wait for the next good one). That
    // checkpoint is safe: a skipped step leaves weights, master copy and moments as the
    // last good step left them, and only the data position and the step count move on,
    // exactly as in an uninterrupted run, so resuming from it continues that run. The
    // periodic evaluations and checkpoints are for good steps only, so during a streak
    // of bad steps the newest checkpoint stays the last good one (and `keep` does not
    // rotate good checkpoints out in favour of copies of the same weights).
    const bool stop = r.stop;
    if ((good && step % t.eval_every == 0) || step == t.steps) run_eval(step);
    if (stop) {
      spdlog::info("stop requested: checkpointing at step {} and exiting", step);
      checkpoint(step, elapsed_before + elapsed);
      result.interrupted = true;
      return result;
    }
    if ((good && cfg.checkpoint.every > 0 && step % cfg.checkpoint.every == 0) || step == t.steps)
      checkpoint(step, elapsed_before + elapsed);
  }
  result.step = step;
  return result;
}

}  // namespace mhar
