// commands.h: one register function per subcommand; each lives in cli/cmd_<name>.cpp,
// adds its CLI11 subcommand with its options and --help text, and sets its callback.
// Callbacks throw mhar::Error for user errors; main() prints them and exits 1.
#pragma once
#include <CLI/CLI.hpp>

namespace mhar::cli {

void register_config(CLI::App& app);
void register_train(CLI::App& app);
void register_eval(CLI::App& app);
void register_data(CLI::App& app);
void register_sample(CLI::App& app);
void register_report(CLI::App& app);
void register_bench_command(CLI::App& app);  // `mhar bench` (cmd_bench.cpp)
void register_export(CLI::App& app);         // `mhar export` (cmd_export.cpp)
void register_import(CLI::App& app);         // `mhar import` (cmd_import.cpp)

}  // namespace mhar::cli
