// cmd_train.cpp: `mhar train CONFIG.json [--set k=v ...] [--run-dir DIR] [--device D]`
// and `mhar train --resume RUN_DIR [--resume-latest-valid]`; `--init-from CHECKPOINT`
// starts the new run from a checkpoint's weights (e.g. an `mhar import`).
#include <spdlog/spdlog.h>

#include <filesystem>

#include "cli/commands.h"
#include "engine/error.h"
#include "engine/trainer.h"

namespace mhar::cli {

void register_train(CLI::App& app) {
  auto* cmd = app.add_subcommand(
      "train",
      "Train a model from a run config. Ctrl-C (SIGINT) or SIGTERM finishes the current step, "
      "writes a checkpoint and exits 0; a second signal exits at once.");
  static std::string config_path, run_dir, resume_dir, device, init_from;
  static std::vector<std::string> overrides;
  static bool latest_valid = false;
  static long long steps = -1;
  cmd->add_option("config", config_path, "Run config (JSON); not needed with --resume");
  cmd->add_option("--set", overrides, "Override a config field, e.g. --set train.lr=3e-4");
  cmd->add_option("--run-dir", run_dir, "Where checkpoints, metrics and the report go "
                  "(default: runs/<config name>)");
  cmd->add_option("--resume", resume_dir, "Continue the run in this directory from its newest checkpoint");
  cmd->add_flag("--resume-latest-valid", latest_valid,
                "With --resume: fall back to the newest checkpoint that validates");
  cmd->add_option("--device", device, "cpu, cuda or auto (default: train.device)")
      ->check(CLI::IsMember({"cpu", "cuda", "auto"}));
  add_number(cmd, "--steps", steps, 1LL, 1000000000LL, "Override train.steps")->default_str("");
  cmd->add_option("--init-from", init_from,
                  "Start the new run from this checkpoint's weights (a checkpoint or run directory)\n"
                  "with a fresh optimizer; the model sections of the configs must agree");
  cmd->callback([] {
    TrainOptions opt;
    opt.device = device;
    Config cfg;
    if (!run_dir.empty()) {
      std::error_code ec;
      if (std::filesystem::exists(run_dir, ec) && !std::filesystem::is_directory(run_dir, ec))
        fail("--run-dir ", run_dir, " exists and is not a directory; give a new or existing run "
             "directory");
    }
    if (!resume_dir.empty()) {
      if (!config_path.empty() || !overrides.empty())
        fail("--resume continues a run with the config it was started with; drop CONFIG and --set");
      require_directory("--resume", resume_dir, "run directory (written by `mhar train`)");
      if (steps > 0) fail("--steps cannot change a resumed run; it continues to its train.steps");
      if (!init_from.empty())
        fail("--init-from starts a new run and --resume continues one; give one of them");
      opt.resume = true;
      opt.resume_latest_valid = latest_valid;
      opt.run_dir = resume_dir;
    } else {
      if (config_path.empty()) fail("give a CONFIG.json to train, or --resume RUN_DIR");
      if (latest_valid) fail("--resume-latest-valid goes with --resume RUN_DIR");
      std::vector<std::string> sets = overrides;
      if (steps > 0) sets.push_back("train.steps=" + std::to_string(steps));
      cfg = load_config(config_path, sets);
      {  // the trainer resolves the same way; a directory is not a shard pattern
        Config resolved = cfg;
        resolve_data_paths(resolved);
        check_shard_pattern(cfg.source + ": data.train", resolved.data.train, "train_*.bin");
        check_shard_pattern(cfg.source + ": data.val", resolved.data.val, "val_*.bin");
      }
      opt.init_from = init_from;
      opt.run_dir = run_dir.empty()
                        ? "runs/" + std::filesystem::path(config_path).stem().string()
                        : run_dir;
    }
    install_stop_signal_handlers();
    TrainResult r = train(cfg, opt);
    spdlog::info("{} at step {}: train loss {:.4f}, val loss {:.4f}; checkpoint {}",
                 r.interrupted ? "stopped" : "done", r.step, r.last_loss, r.last_val_loss,
                 r.last_checkpoint);
  });
}

}  // namespace mhar::cli
