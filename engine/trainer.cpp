// trainer.cpp: the training loop, evaluation, run-directory rules and resume (see
// trainer.h).
#include "engine/trainer.h"

#include <spdlog/spdlog.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <memory>

#include "data/loader.h"
#include "engine/backend_factory.h"
#include "engine/checkpoint.h"
#include "engine/communicator.h"
#include "engine/error.h"
#include "engine/file_io.h"
#include "engine/json_io.h"
#include "engine/metrics.h"
#include "engine/optimizer.h"
#include "engine/probe.h"
#include "engine/report.h"
#include "engine/run_lock.h"
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

// Temporary files of the atomic writes (engine/file_io.h) of config.json, metrics.jsonl
// and the ranks' timed_choices.rankR.txt, which only a lock holder's processes write, are a
// killed writer's and go (so do the names older versions used). report.html is also written by
// `mhar report`, which takes no lock, so its temporary files go only when their pid is gone.
void remove_stale_temp_files(const std::string& run_dir) {
  const std::string pid_now = std::to_string(::getpid());
  std::error_code ec;
  for (fs::directory_iterator it(run_dir, ec), end; !ec && it != end; it.increment(ec)) {
    const std::string name = it->path().filename().string();
    bool stale = name == "config.json.tmp" || name == "metrics.jsonl.tmp";  // older versions' names
    const size_t tmp_at = name.find(".txt.tmp-");
    if (name.rfind(".timed_choices.rank", 0) == 0 && tmp_at != std::string::npos &&
        name.find_first_not_of("0123456789", tmp_at + 9) == std::string::npos)
      stale = true;
    for (const char* file : {"config.json", "metrics.jsonl", "report.html"}) {
      std::string stem = fs::path(temp_path_for(file)).filename().string();  // .F.tmp-<our pid>
      stem.resize(stem.size() - pid_now.size());
      if (std::string(file) == "report.html" && name.rfind(".report.html.tmp.", 0) == 0)
        stem = ".report.html.tmp.";  // older versions' name
      const std::string pid = name.rfind(stem, 0) == 0 ? name.substr(stem.size()) : "";
      if (pid.empty() || pid.size() > 9 || pid.find_first_not_of("0123456789") != std::string::npos) continue;
      stale = std::string(file) != "report.html" || pid == pid_now || !process_alive(std::atoll(pid.c_str()));
      break;
    }
    std::error_code rm;
    if (stale && it->is_regular_file(rm) && fs::remove(it->path(), rm))
      spdlog::warn("removed {} (the temporary file of an interrupted write)", it->path().string());
  }
}

// Takes RUN_DIR's lock (creating RUN_DIR for a new run), before anything in it is read
// for resuming or written, and held until the run ends (engine/run_lock.h). Under it no
// other writer can be alive, so what killed writers left is cleaned up here.
std::unique_ptr<RunLock> take_run_dir(const TrainOptions& opt) {
  std::error_code ec;
  if (!opt.resume) {
    fs::create_directories(opt.run_dir, ec);
    if (ec) fail(opt.run_dir, ": cannot create the run directory (", ec.message(), ")");
  }
  auto lock = std::make_unique<RunLock>(opt.run_dir);
  recover_checkpoint_writes(opt.run_dir);
  remove_stale_temp_files(opt.run_dir);
  return lock;
}

// The run directory must be new, or hold this very run (then only with --resume). A
// start that failed (a full disk) leaves at most config.json and an empty or partial
// metrics.jsonl, and no checkpoint: running the same command again starts over.
void prepare_run_dir(const Config& cfg, const TrainOptions& opt) {
  const fs::path cfg_path = fs::path(opt.run_dir) / "config.json";
  if (opt.resume) return;
  if (fs::exists(fs::symlink_status(cfg_path))) {
    nlohmann::json j;
    bool readable = true;
    try {
      j = parse_json_strict(read_regular_file(cfg_path.string(), "run config", 64 << 20), cfg_path.string());
    } catch (const Error&) {
      readable = false;
    }
    if (!readable)
      fail(opt.run_dir, " already holds a run whose config.json cannot be read (empty or damaged); "
           "choose a new --run-dir, or delete that directory");
    if (j != cfg.to_json())
      fail(opt.run_dir, " already holds a different run (its config.json differs from this "
           "config); choose a new --run-dir, or delete that directory");
    if (!list_checkpoints(opt.run_dir).empty())
      fail(opt.run_dir, " already holds checkpoints of this run; continue it with --resume ",
           opt.run_dir, " or choose a new --run-dir");
  }
  write_file_atomic(cfg_path.string(), cfg.to_json().dump(2) + "\n");
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
                    RoutingProbe* routing) {
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
    if (routing && model.residual().routed()) routing->add(model);
    r.tokens += (long long)B * T;
  }
  r.batches = n;
  r.loss = r.tokens ? sum / double(r.tokens) : NAN;
  return r;
}

// A run ends (or stops) reported as a success only when its last validation loss is
// finite: NaN or Inf there means the weights it ends with do not work, whatever the
// training losses said (a skipped step never reaches the weights, so the evaluation is
// where such a model shows). Its checkpoint stays for inspection.
static void refuse_nonfinite_val_loss(const TrainResult& r, long long eval_step) {
  if (eval_step >= 0 && !std::isfinite(r.last_val_loss))
    fail("the run ", r.interrupted ? "stopped" : "ended", " at step ", r.step, " with validation loss ",
         std::isnan(r.last_val_loss) ? "nan" : r.last_val_loss > 0 ? "inf" : "-inf", " (evaluated at step ",
         eval_step, "): the model's outputs are not finite, so this is not a usable result (its checkpoint: ",
         r.last_checkpoint.empty() ? "none" : r.last_checkpoint, "). Lower train.lr or check the data, and "
         "train again");
}

namespace {

// The checkpoint to resume from: rank 0 takes the run directory's lock, chooses and
// validates the checkpoint; the other ranks take what rank 0 validated instead of reading
// and hashing every file again.
CheckpointInfo open_resume_checkpoint(const TrainOptions& opt, Communicator& comm,
                                      std::unique_ptr<RunLock>* lock,
                                      const std::function<std::unique_ptr<RunLock>()>& take_lock) {
  std::string chosen;
  CheckpointInfo info;
  if (comm.rank() == 0) {
    std::string error;
    try {
      const std::string path = (fs::path(opt.run_dir) / "config.json").string();
      if (!fs::exists(path))
        fail("--resume ", opt.run_dir, ": no config.json there, so it is not a run directory");
      *lock = take_lock();
      info = open_checkpoint(opt.run_dir, opt.resume_latest_valid);
      {  // the run directory's config must describe the checkpoint's model
        std::ifstream in(path);
        auto j = nlohmann::json::parse(in, nullptr, false);
        if (j.is_discarded()) fail(path, ": not valid JSON");
        check_same_model(config_from_json(j, path), info.config, info.dir);
      }
      chosen = nlohmann::json{{"dir", info.dir},
                              {"state", info.state},
                              {"loader", info.loader},
                              {"world_size", info.world_size},
                              {"trainer", {{"tokens_seen", info.trainer.tokens_seen},
                                           {"total_bad_steps", info.trainer.total_bad_steps},
                                           {"consecutive_bad_steps", info.trainer.consecutive_bad_steps},
                                           {"elapsed_s", info.trainer.elapsed_s}}}}
                   .dump();
    } catch (const Error& e) {
      error = e.what();
    }
    // The other ranks learn of a refusal too, instead of waiting for a checkpoint.
    if (!error.empty()) {
      comm.broadcast_string("!" + error);
      fail(error);
    }
  }
  chosen = comm.broadcast_string(chosen);
  if (comm.rank() != 0) {
    if (!chosen.empty() && chosen[0] == '!') fail("rank 0 could not resume: ", chosen.substr(1));
    const nlohmann::json j = nlohmann::json::parse(chosen);
    info.dir = j.at("dir").get<std::string>();
    info.state = j.at("state");
    info.loader = j.at("loader");
    info.world_size = j.at("world_size").get<int>();
    const auto& tr = j.at("trainer");
    info.trainer.tokens_seen = tr.at("tokens_seen").get<int64_t>();
    info.trainer.total_bad_steps = tr.at("total_bad_steps").get<int64_t>();
    info.trainer.consecutive_bad_steps = tr.at("consecutive_bad_steps").get<int64_t>();
    info.trainer.elapsed_s = tr.at("elapsed_s").get<double>();
    info.step = info.state.at("step").get<int64_t>();
    info.config = config_from_json(info.state.at("config"), info.dir + "/state.json (config)");
  }
  return info;
}

// The loader position of a checkpoint written by `from` ranks, for `to` ranks: a loader
// step covers world_size x micro_batch windows and the global batch is the same, so the
// position in windows is kept. Past the new epoch's last full step (the tail that does
// not fill a step depends on the world size) the next epoch starts.
nlohmann::json convert_loader_state(nlohmann::json st, int from, int to,
                                    const data::DataLoader& loader) {
  if (from == to) return st;
  const uint64_t windows = st.at("step").get<uint64_t>() * uint64_t(from);
  if (windows % uint64_t(to) != 0)
    fail("the checkpoint's data position (loader step ", st.at("step").dump(), " of ", from,
         " ranks) does not fall on a step of ", to, " ranks");
  st["world_size"] = to;
  st["step"] = windows / uint64_t(to);
  if (st["step"].get<uint64_t>() >= loader.num_batches()) {
    st["step"] = 0;
    st["epoch"] = st.at("epoch").get<uint64_t>() + 1;
  }
  return st;
}

// The backend's timed choices (Backend::timed_choices: the CUDA matmuls' algorithms) live in
// the run directory, a file a rank. The run's first process times them and writes the file
// (after a step or an evaluation that added a shape); a later process (a resume) takes them
// from it before its first call, so the whole run multiplies with the same algorithms and
// a resume gives the bits of a run that never stopped. A file there before a new run starts
// is taken too: copied into a new run directory, it repeats another run's choices (the GPU
// tests compare two runs so). The file is a cache, not a checkpoint: one that is unreadable
// or made on another device or library is left aside with a warning, and the process times
// its own.
class TimedChoices {
 public:
  TimedChoices(Backend& be, const std::string& run_dir, int rank)
      : be_(be),
        path_(
            (fs::path(run_dir) / ("timed_choices.rank" + std::to_string(rank) + ".txt")).string()) {
  }
  void load() {
    std::error_code ec;
    if (!fs::exists(fs::symlink_status(path_, ec))) return;
    std::string text, why;
    int n = -1;
    try {
      text = read_regular_file(path_, "timed choices file", uint64_t(1) << 20);
      n = be_.use_timed_choices(text, &why);
    } catch (const Error& e) {
      why = e.what();
    }
    if (n < 0) {
      spdlog::warn(
          "{} not used ({}): this process times its own choices, so its results may "
          "differ in the last bits from the run's first process",
          path_, why);
      return;
    }
    kept_ = text;
    spdlog::info("{} timed choice(s) from {}", n, path_);
  }
  void save() {
    const std::string now = be_.timed_choices();
    if (now.empty() || now == kept_) return;
    kept_ = now;
    try {
      write_file_atomic(path_, now);
    } catch (const std::exception& e) {  // a cache: the run goes on without it
      spdlog::warn("{} not written ({}): a resume will time its own choices", path_, e.what());
    }
  }

 private:
  Backend& be_;
  std::string path_, kept_;
};

}  // namespace

TrainResult train(Config cfg, const TrainOptions& opt) {
  MHAR_CHECK(!opt.run_dir.empty(), "run_dir");
  g_stop_signals = 0;
  // Data parallelism (DESIGN.md section 7): one process per device under mpirun; without
  // it, one rank of one.
  const DistInfo& dist_info = dist::init();
  const int rank = dist_info.rank, W = dist_info.world_size;
  const bool root = rank == 0;
  // Host agreement before the backend exists (the resume choice, the run directory).
  std::unique_ptr<Communicator> host_comm = make_host_communicator();
  TrainResult result;
  CheckpointInfo resume_from;
  std::unique_ptr<RunLock> lock;  // held for the whole run, by rank 0
  if (opt.resume) {
    resume_from = open_resume_checkpoint(opt, *host_comm, &lock, [&] { return take_run_dir(opt); });
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
  if (root) {  // the run directory is rank 0's; the others wait until it is ready
    std::string error;
    try {
      if (!opt.resume) lock = take_run_dir(opt);
      prepare_run_dir(cfg, opt);
    } catch (const Error& e) {
      error = e.what();
    }
    host_comm->broadcast_string(error);
    if (!error.empty()) fail(error);
  } else {
    const std::string error = host_comm->broadcast_string("");
    if (!error.empty()) fail("rank 0 could not prepare the run directory: ", error);
  }

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
  TimedChoices timed_choices(*backend, opt.run_dir, rank);
  timed_choices.load();
  auto comm = make_communicator(*backend);
  Model model(cfg.model, cfg.residual, *backend, B, T, W, cfg.train.logits_chunk);
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
    // The values open_checkpoint validated (engine/checkpoint_state.h), not raw JSON.
    if (resume_from.loader.empty())
      fail(resume_from.dir, " holds no data position (an `mhar convert`, or an import made without "
           "--set data.train/data.val): start a new run from it with `mhar train CONFIG --init-from ", opt.run_dir, "`");
    train_data.restore(convert_loader_state(resume_from.loader, ckpt_world, W, train_data));
    step = resume_from.step;
    tokens_seen = resume_from.trainer.tokens_seen;
    total_bad = resume_from.trainer.total_bad_steps;
    // A run stopped during a streak of skipped steps keeps counting it toward
    // train.max_bad_steps.
    consecutive_bad = resume_from.trainer.consecutive_bad_steps;
    elapsed_before = resume_from.trainer.elapsed_s;
    result.last_checkpoint = resume_from.dir;
  } else if (!opt.init_from.empty()) {
    // A new run from another checkpoint's weights, with a fresh optimizer. The models must
    // be the same; context_length (a bound on seq_len) and init_std (unused when loading)
    // may differ.
    const CheckpointInfo init = open_checkpoint(opt.init_from);
    Config theirs = init.config;
    theirs.model.context_length = cfg.model.context_length;
    theirs.model.init_std = cfg.model.init_std;
    check_same_model(cfg, theirs, init.dir);
    load_model_weights(init, model, &optimizer);
    spdlog::info("initial weights from {} (step {}); fresh optimizer", init.dir, init.step);
  } else {
    model.init_weights(t.seed);
    optimizer.sync_master_from_params();
  }
  // Metrics are rank 0's.
  std::unique_ptr<MetricsLog> metrics;
  if (root)
    metrics = std::make_unique<MetricsLog>((fs::path(opt.run_dir) / "metrics.jsonl").string(),
                                           opt.resume ? step : -1);
  auto log_metrics = [&](const nlohmann::json& line) {
    if (metrics) metrics->append(line);
  };
  spdlog::info("model: {} parameters, residual {}, backend {}", model.num_parameters(),
               residual_summary(cfg.residual), backend->name());
  spdlog::info("batch: {} x {} tokens x {} micro-batches x {} rank(s) = {} tokens per step; {} steps",
               B, T, accum, W, micro_tokens * accum * W, t.steps);
  if (comm->name() != "single")
    spdlog::info("data parallel: {} rank(s) over {}, ZeRO-1 (optimizer state {} per rank)", W,
                 comm->name(), format_bytes(optimizer.state_bytes()));
  spdlog::debug("memory:\n{}", model.memory_report());

  long long checkpointed_step = step;  // nothing to lose before the first step
  auto checkpoint = [&](long long at_step, double elapsed_total, nlohmann::json loader_state = nullptr) {
    watchdog::set_phase("checkpoint", at_step, false);
    CheckpointWrite w;
    w.run_dir = opt.run_dir;
    w.step = at_step;
    w.config = &cfg;
    w.loader = loader_state.is_null() ? train_data.state() : std::move(loader_state);
    checkpointed_step = at_step;
    w.trainer = {{"tokens_seen", tokens_seen}, {"total_bad_steps", total_bad},
                 {"consecutive_bad_steps", consecutive_bad}, {"elapsed_s", elapsed_total}};
    w.keep = cfg.checkpoint.keep;
    w.comm = comm.get();
    if (metrics) metrics->sync();  // the metrics reach at least as far as the checkpoint a resume starts from
    result.last_checkpoint = save_checkpoint(w, model, optimizer);
    spdlog::info("checkpoint: {}", result.last_checkpoint);
  };
  long long last_eval_step = -1;
  auto run_eval = [&](long long at_step) {
    last_eval_step = at_step;
    double val_loss = 0;  // rank 0's, then every rank's (the sum below)
    if (root) {
      watchdog::set_phase("evaluation", at_step, false);
      RoutingProbe routing;  // reduced on the device: one small download per evaluation
      EvalResult ev = evaluate(model, *val_data, t.eval_batches, &routing);
      log_metrics({{"kind", "eval"}, {"step", at_step}, {"val_loss", ev.loss},
                   {"val_ppl", std::exp(ev.loss)}, {"tokens", ev.tokens}});
      if (routing.tokens() > 0)
        for (const auto& line : probe_metrics_lines(routing.to_json(), at_step)) log_metrics(line);
      try {  // the report is a diagnostic: it never stops a run
        write_run_report(opt.run_dir);
      } catch (const std::exception& e) {
        spdlog::warn("report not written: {}", e.what());
      }
      spdlog::info("eval step {}: val loss {:.4f} (ppl {:.2f}) over {} tokens", at_step, ev.loss,
                   std::exp(ev.loss), ev.tokens);
      val_loss = ev.loss;
      // The other ranks are waiting for this already: a long wait now is a dead or hung
      // rank, which the watchdog's bound catches.
      watchdog::set_phase("sharing the validation loss", at_step, true);
    } else {
      // Wait for rank 0's evaluation here, not inside the next step's collectives (which
      // the watchdog bounds).
      watchdog::set_phase("waiting for rank 0's evaluation", at_step, false);
    }
    // Every rank learns the validation loss (a NaN ends the run on every rank alike).
    comm->all_reduce_sum(&val_loss, 1);
    if (result.first_val_loss < 0) result.first_val_loss = val_loss;
    result.last_val_loss = val_loss;
    timed_choices.save();  // an evaluation's products may be shapes no step has
  };

  if (step == 0) run_eval(0);
  // Fault injection for tests: from this step on the loss reads as NaN, as after a
  // divergence, to prove the skip-and-stop path and that checkpoints stay intact.
  const char* nan_env = std::getenv("MHAR_SIMULATE_NONFINITE_FROM_STEP");
  const long long nan_from = nan_env ? std::atoll(nan_env) : -1;
  const auto run_start = std::chrono::steady_clock::now();
  const long long first_step = step;
  // A data error (a shard changed on disk, a read error) stops the run, but first the
  // last completed step is checkpointed, at the data position where that step ended,
  // so no finished step is lost; the error then propagates (exit 1).
  // Under data parallelism the other ranks are inside the step's collectives, so there is
  // no collective checkpoint to write: the error ends the job (the last checkpoint stays).
  auto checkpoint_then_rethrow = [&](nlohmann::json loader_state) {
    if (W == 1 && step > checkpointed_step) {
      spdlog::error("data error after step {}: checkpointing that step before stopping", step);
      try {
        checkpoint(step, elapsed_before + std::chrono::duration<double>(std::chrono::steady_clock::now() -
                                                                        run_start).count(),
                   std::move(loader_state));
      } catch (const std::exception& e) {
        spdlog::error("that checkpoint failed too: {}", e.what());
      }
    }
    throw;
  };
  // One micro-batch of this rank; a data error checkpoints the last completed step first,
  // at the data position where that step ended.
  uint64_t data_epoch = 0, data_step = 0;  // the loader's position when this step began
  const auto next_batch = [&](int32_t* x, int32_t* y) {
    try {
      train_data.next_batch(x, y);
    } catch (const Error&) {
      nlohmann::json at_step_start = train_data.state();  // before this step's micro-batches
      at_step_start["epoch"] = data_epoch;
      at_step_start["step"] = data_step;
      checkpoint_then_rethrow(std::move(at_step_start));
    }
  };
  while (step < t.steps) {
    const auto t0 = std::chrono::steady_clock::now();
    data_epoch = train_data.epoch(), data_step = train_data.step();
    // The stop request of any rank (a signal, or the tests' step budget) is read after
    // the backward and agreed on in the step's all-reduce, so every rank finishes this
    // step and stops after it.
    const auto want_stop = [&] {
      return g_stop_signals > 0 ||
             (opt.stop_after_steps >= 0 && step + 1 - first_step >= opt.stop_after_steps);
    };
    const StepResult r =
        train_step.run(step, next_batch, want_stop, nan_from >= 0 && step + 1 >= nan_from);
    const double loss = r.loss, grad_norm = r.grad_norm, lr = r.lr;
    const bool good = r.good;
    if (!good) {
      ++consecutive_bad, ++total_bad;
      log_metrics({{"kind", "skip"}, {"step", step + 1},
                   {"reason", !std::isfinite(loss) ? "non-finite loss" : "non-finite gradients"}});
      if (root)  // every rank sees the same reduced loss and norm: one warning is enough
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
    timed_choices.save();
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
    if ((good && step % t.eval_every == 0) || step == t.steps) {
      try {
        run_eval(step);
      } catch (const Error&) {
        checkpoint_then_rethrow(nullptr);  // the step is complete: the loader's own position
      }
    }
    if (stop) {
      spdlog::info("stop requested: checkpointing at step {} and exiting", step);
      checkpoint(step, elapsed_before + elapsed);
      result.interrupted = true;
      refuse_nonfinite_val_loss(result, last_eval_step);
      return result;
    }
    if ((good && cfg.checkpoint.every > 0 && step % cfg.checkpoint.every == 0) || step == t.steps)
      checkpoint(step, elapsed_before + elapsed);
  }
  result.step = step;
  refuse_nonfinite_val_loss(result, last_eval_step);
  return result;
}

}  // namespace mhar
