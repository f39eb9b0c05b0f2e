// main.cpp: the `mhar` command. Global flags (--version, --log-level), the list of
// subcommands, and the one place where errors turn into messages and exit codes: bad
// input of any kind (a usage error, mhar::Error, a file-system error, memory exhausted)
// exits 1 with a message naming what was wrong; only a bug in the engine is an
// "internal error" (exit 2).
// Logs go to stderr: stdout carries only a command's result (sampled text, eval's and
// bench's JSON line), so it can be piped or compared whatever the log level.
#include <spdlog/sinks/stdout_color_sinks.h>
#include <spdlog/spdlog.h>

#include <CLI/CLI.hpp>
#include <cstdio>
#include <filesystem>
#include <map>
#include <new>
#include <string>

#include "cli/commands.h"
#include "engine/communicator.h"
#include "engine/error.h"

int main(int argc, char** argv) {
  CLI::App app{
      "mhar: pretraining engine for decoder-only transformers with depth routing\n"
      "(standard residuals, Attention Residuals, Multi-Head Attention Residuals)."};
  app.set_version_flag("--version", std::string("mhar ") + MHAR_VERSION);
  std::string log_level = "info";
  app.add_option("--log-level", log_level, "Logging verbosity")
      ->check(CLI::IsMember({"trace", "debug", "info", "warn", "error", "off"}))
      ->capture_default_str();
  app.require_subcommand(1);

  mhar::cli::register_config(app);
  mhar::cli::register_train(app);
  mhar::cli::register_eval(app);
  mhar::cli::register_data(app);
  mhar::cli::register_sample(app);
  mhar::cli::register_report(app);
  mhar::cli::register_bench_command(app);
  mhar::cli::register_probe(app);
  mhar::cli::register_export(app);
  mhar::cli::register_import(app);
  mhar::cli::register_convert(app);

  app.parse_complete_callback([&] {
    spdlog::set_default_logger(spdlog::stderr_color_mt("mhar"));
    spdlog::set_level(spdlog::level::from_str(log_level));
    spdlog::set_pattern("[%H:%M:%S] %^%l%$ %v");
  });
  // Under mpirun an error on one rank ends the whole job (dist::abort_job): the other
  // ranks would otherwise wait for it in their next collective.
  const auto rank_tag = [] {
    const auto& d = mhar::dist::info();
    return d.world_size > 1 ? "rank " + std::to_string(d.rank) + ": " : std::string();
  };
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    // --help and --version end parsing with exit code 0; every usage error exits 1.
    return app.exit(e) == 0 ? 0 : 1;
  } catch (const mhar::Error& e) {
    std::fprintf(stderr, "error: %s%s\n", rank_tag().c_str(), e.what());
    mhar::dist::abort_job(1);
  } catch (const std::filesystem::filesystem_error& e) {
    // A path the user gave that is not what it should be (a file where a directory is
    // needed, a symlink loop, no permission). Callers check the cases they know; this
    // names the path and the system's reason for the rest.
    std::string paths = e.path1().string();
    if (!e.path2().empty()) paths += " -> " + e.path2().string();
    std::string what = e.what();
    const std::string prefix = "filesystem error: ";
    if (what.rfind(prefix, 0) == 0) what = what.substr(prefix.size());
    const auto bracket = what.find(" [");
    if (bracket != std::string::npos) what = what.substr(0, bracket);
    std::fprintf(stderr, "error: %s%s: %s\n", rank_tag().c_str(), paths.empty() ? "(no path)" : paths.c_str(),
                 what.c_str());
    mhar::dist::abort_job(1);
  } catch (const std::bad_alloc&) {
    std::fprintf(stderr,
                 "error: out of memory; the model, batch or input is larger than this machine "
                 "can hold\n");
    mhar::dist::abort_job(1);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "internal error: %s%s\n", rank_tag().c_str(), e.what());
    mhar::dist::abort_job(2);
  }
  mhar::dist::finalize();
  return 0;
}
