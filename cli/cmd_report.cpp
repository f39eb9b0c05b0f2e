// cmd_report.cpp: `mhar report RUN_DIR` (re)writes RUN_DIR/report.html from the run's
// config.json and metrics.jsonl (engine/report.h) and prints its path. The trainer
// writes the same report at every evaluation; this is for runs in progress elsewhere,
// finished runs, or after an upgrade of the report.
#include <cstdio>
#include <filesystem>

#include "cli/commands.h"
#include "engine/error.h"
#include "engine/report.h"

namespace mhar::cli {

void register_report(CLI::App& app) {
  auto* cmd = app.add_subcommand("report", "Write a run's report.html (curves, routing heatmaps)");
  cmd->footer(
      "Writes RUN_DIR/report.html from RUN_DIR/config.json and RUN_DIR/metrics.jsonl: train\n"
      "and validation loss, learning rate, gradient norm and throughput curves, and for\n"
      "attnres/mhar runs a heatmap per routing site of the mean routing weight of each\n"
      "source per head at the latest evaluation. One self-contained file (inline SVG, no\n"
      "scripts, works offline). The trainer rewrites it at every evaluation.");
  static std::string run_dir;
  cmd->add_option("run_dir", run_dir, "Run directory (written by `mhar train`)")->required();
  cmd->callback([] {
    namespace fs = std::filesystem;
    require_directory("RUN_DIR", run_dir, "run directory (written by `mhar train`)");
    std::error_code ec;
    if (!fs::exists(fs::path(run_dir) / "metrics.jsonl", ec) &&
        !fs::exists(fs::path(run_dir) / "config.json", ec))
      fail(run_dir, ": holds neither metrics.jsonl nor config.json; is it a run directory "
                    "written by `mhar train`?");
    write_run_report(run_dir);
    std::printf("%s\n", (fs::path(run_dir) / "report.html").string().c_str());
  });
}

}  // namespace mhar::cli
