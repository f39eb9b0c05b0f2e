// cmd_convert.cpp: `mhar convert --checkpoint STANDARD_CKPT --out DIR --mode delta
// [--block-layers 4] [--heads H] [--overwrite]` turns a trained standard checkpoint into a
// delta-mode run directory whose model equals the original exactly (engine/delta_convert.h).
#include <cstdio>

#include "cli/commands.h"
#include "engine/delta_convert.h"
#include "engine/error.h"

namespace mhar::cli {

void register_convert(CLI::App& app) {
  auto* cmd = app.add_subcommand(
      "convert", "Convert a trained standard checkpoint into a delta-mode model (DESIGN.md section 2)");
  cmd->footer(
      "Writes the run directory DIR with config.json (residual.mode delta) and a step-0 checkpoint:\n"
      "the original weights bit for bit, plus per site a gate alpha_j (0), a routing query (0) and\n"
      "gain (1), and the null source (0), so the converted model's logits equal the original's\n"
      "exactly. No optimizer state is carried over. Continue training as a new run with a fresh\n"
      "optimizer and the config's schedule:\n"
      "  mhar train DIR/config.json --init-from DIR --run-dir NEW_RUN\n"
      "(edit train.* in a copy of DIR/config.json first to change the schedule or the data).");
  static std::string checkpoint, out, mode;
  static int block_layers = 4, heads = 0;
  static bool overwrite = false;
  cmd->add_option("--checkpoint", checkpoint,
                  "A standard checkpoint directory, or a run directory (its newest)")
      ->required();
  cmd->add_option("--out", out, "Run directory to create (must not exist, unless --overwrite)")
      ->required();
  cmd->add_option("--mode", mode, "The residual mode to convert into (delta)")
      ->required()
      ->check(CLI::IsMember({"delta"}));
  add_number(cmd, "--block-layers", block_layers, 1, 1 << 20,
             "Layers per block of the routed sources' block sums (at most model.n_layers)")
      ->default_str("4");
  add_number(cmd, "--heads", heads, 0, 1 << 20,
             "Routing heads (must divide model.d_model; 0 = model.n_kv_heads)")
      ->default_str("n_kv_heads");
  cmd->add_flag("--overwrite", overwrite, "Replace --out if it exists (once the new one is complete)");
  cmd->callback([] {
    DeltaConvertOptions opt;
    opt.checkpoint = checkpoint;
    opt.out_dir = out;
    opt.block_layers = block_layers;
    opt.heads = heads;
    opt.overwrite = overwrite;
    require_directory("--checkpoint", checkpoint, "checkpoint or run directory");
    const DeltaConvertResult r = convert_to_delta(opt);
    std::printf("converted  %s (standard) -> %s\n", r.source_checkpoint.c_str(), r.run_dir.c_str());
    std::printf("model      %lld parameters (%lld added: gates, routing queries and gains, null), "
                "residual delta H=%d block_layers %d\n",
                static_cast<long long>(r.parameters), static_cast<long long>(r.added_parameters),
                r.heads, r.block_layers);
    std::printf("checkpoint %s\n", r.checkpoint_dir.c_str());
    std::printf("next       mhar train %s/config.json --init-from %s --run-dir NEW_RUN\n",
                r.run_dir.c_str(), r.run_dir.c_str());
  });
}

}  // namespace mhar::cli
