// cmd_config.cpp: `mhar config CONFIG.json [--set k=v ...]` prints the fully resolved
// config (defaults filled in, overrides applied, validated) as JSON.
#include <cstdio>

#include "cli/commands.h"
#include "engine/config.h"

namespace mhar::cli {

void register_config(CLI::App& app) {
  auto* cmd = app.add_subcommand("config", "Validate a run config and print it fully resolved");
  static std::string path;
  static std::vector<std::string> overrides;
  cmd->add_option("config", path, "Run config (JSON)")->required();
  cmd->add_option("--set", overrides, "Override a field, e.g. --set model.n_layers=4");
  cmd->callback([] {
    Config c = load_config(path, overrides);
    std::printf("%s\n", c.to_json().dump(2).c_str());
  });
}

}  // namespace mhar::cli
