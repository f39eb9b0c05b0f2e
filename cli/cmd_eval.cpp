// cmd_eval.cpp: `mhar eval --checkpoint DIR --data GLOB [--batches N]` prints one JSON
// line {"loss", "ppl", "tokens", ...}: the mean cross-entropy over every predicted token of
// back-to-back windows read in shard-name order, the same number the trainer logs.
#include <cmath>
#include <cstdio>

#include "cli/commands.h"
#include "data/loader.h"
#include "engine/backend_factory.h"
#include "engine/checkpoint.h"
#include "engine/config.h"
#include "engine/trainer.h"

namespace mhar::cli {

void register_eval(CLI::App& app) {
  auto* cmd = app.add_subcommand("eval", "Evaluate a checkpoint's loss on token shards");
  static std::string checkpoint, glob, device = "auto";
  static long long batches = 0;
  static int batch_size = 0, seq_len = 0;
  // 0 = the default for each; the upper ends are the config's caps (engine/config.cpp),
  // and the batch is checked against the step-size cap once the model is known.
  cmd->add_option("--checkpoint", checkpoint, "Checkpoint directory, or a run directory (its newest)")
      ->required();
  cmd->add_option("--data", glob, "Shard glob, e.g. 'data/val_*.bin'")->required();
  add_number(cmd, "--batches", batches, 0LL, 1LL << 40,
             "Evaluate at most this many batches (default 0: all)");
  add_number(cmd, "--batch-size", batch_size, 0, 65536,
             "Windows per batch (default 0: the checkpoint's train.micro_batch)");
  add_number(cmd, "--seq-len", seq_len, 0, 1 << 20,
             "Tokens per window (default 0: the checkpoint's train.seq_len)");
  cmd->add_option("--device", device, "cpu, cuda or auto")->check(CLI::IsMember({"cpu", "cuda", "auto"}))
      ->capture_default_str();
  cmd->callback([] {
    require_directory("--checkpoint", checkpoint, "checkpoint directory or run directory");
    check_shard_pattern("--data", glob, "val_*.bin");
    CheckpointInfo ckpt = open_checkpoint(checkpoint);
    const Config& cfg = ckpt.config;
    const int B = batch_size > 0 ? batch_size : cfg.train.micro_batch;
    const int T = seq_len > 0 ? seq_len : cfg.train.seq_len;
    if (T > cfg.model.context_length)
      fail("--seq-len ", T, " exceeds the model's context_length ", cfg.model.context_length);
    check_footprint(cfg.model, cfg.residual, B, T, "eval with --batch-size " + std::to_string(B) +
                                                      " and --seq-len " + std::to_string(T));
    data::DataLoader loader(glob, B, T, 0, 0, 1, cfg.model.vocab_size, data::LoaderMode::Sequential);
    if (loader.num_batches() == 0)
      fail(glob, ": ", loader.total_tokens(), " tokens are fewer than one batch of ", B, " x ", T + 1);
    auto backend = make_backend(device);
    Model model(cfg.model, cfg.residual, *backend, B, T);
    load_model_weights(ckpt, model);
    EvalResult r = evaluate(model, loader, batches);
    nlohmann::json out = {{"loss", r.loss}, {"ppl", std::exp(r.loss)}, {"tokens", r.tokens},
                          {"batches", r.batches}, {"checkpoint", ckpt.dir}, {"step", ckpt.step}};
    std::printf("%s\n", out.dump().c_str());
  });
}

}  // namespace mhar::cli
