// cmd_eval.cpp: `mhar eval --checkpoint DIR --data GLOB [--batches N]` prints one JSON
// line {"loss", "ppl", "tokens", ...}: the mean cross-entropy over every predicted token of
// back-to-back windows read in shard-name order, the same number the trainer logs.
// Under `mpirun -np N` rank r evaluates batches r, r+N, ... (of --batches in all) and the
// sums meet on rank 0, which prints the line.
#include <cmath>
#include <cstdio>

#include "cli/commands.h"
#include "data/loader.h"
#include "engine/backend_factory.h"
#include "engine/checkpoint.h"
#include "engine/communicator.h"
#include "engine/trainer.h"

namespace mhar::cli {

void register_eval(CLI::App& app) {
  auto* cmd = app.add_subcommand("eval", "Evaluate a checkpoint's loss on token shards");
  static std::string checkpoint, glob, device = "auto";
  static long long batches = 0;
  static int batch_size = 0, seq_len = 0;
  cmd->add_option("--checkpoint", checkpoint, "Checkpoint directory, or a run directory (its newest)")
      ->required();
  cmd->add_option("--data", glob, "Shard glob, e.g. 'data/val_*.bin'")->required();
  cmd->add_option("--batches", batches, "Evaluate at most this many batches (default: all)");
  cmd->add_option("--batch-size", batch_size, "Windows per batch (default: the checkpoint's train.micro_batch)");
  cmd->add_option("--seq-len", seq_len, "Tokens per window (default: the checkpoint's train.seq_len)");
  cmd->add_option("--device", device, "cpu, cuda or auto")->check(CLI::IsMember({"cpu", "cuda", "auto"}))
      ->capture_default_str();
  cmd->callback([] {
    CheckpointInfo ckpt = open_checkpoint(checkpoint);
    const Config& cfg = ckpt.config;
    const int B = batch_size > 0 ? batch_size : cfg.train.micro_batch;
    const int T = seq_len > 0 ? seq_len : cfg.train.seq_len;
    if (T > cfg.model.context_length)
      fail("--seq-len ", T, " exceeds the model's context_length ", cfg.model.context_length);
    const DistInfo& d = dist::init();
    data::DataLoader loader(glob, B, T, 0, d.rank, d.world_size, cfg.model.vocab_size,
                            data::LoaderMode::Sequential);
    if (loader.num_batches() == 0)
      fail(glob, ": ", loader.total_tokens(), " tokens are fewer than one batch of ", B, " x ",
           T + 1, d.world_size > 1 ? " per rank" : "");
    auto backend = make_backend(device, d.local_rank);
    Model model(cfg.model, cfg.residual, *backend, B, T);
    load_model_weights(ckpt, model);
    // This rank's share of --batches (all of its batches when --batches is not given).
    const long long mine = batches > 0 ? batches / d.world_size + (d.rank < batches % d.world_size) : 0;
    EvalResult r;
    if (batches <= 0 || mine > 0) r = evaluate(model, loader, mine);
    double sums[3] = {r.loss * double(r.tokens), double(r.tokens), double(r.batches)};
    if (d.world_size > 1) {
      auto comm = make_communicator(*backend);
      comm->all_reduce_sum(sums, 3);
    }
    if (d.rank != 0) return;
    r.tokens = (long long)sums[1];
    r.batches = (long long)sums[2];
    r.loss = d.world_size > 1 ? sums[0] / sums[1] : r.loss;
    // The weights were checked finite on load; a non-finite loss means they overflow on
    // this data. That is a failed evaluation, never a result line.
    if (!std::isfinite(r.loss))
      fail(ckpt.dir, " (step ", ckpt.step, "): the loss over ", r.tokens, " tokens of ", glob, " is ",
           std::isnan(r.loss) ? "nan" : r.loss > 0 ? "inf" : "-inf",
           ": the model's outputs are not finite on this data, so there is no loss to report");
    nlohmann::json out = {{"loss", r.loss}, {"ppl", std::exp(r.loss)}, {"tokens", r.tokens},
                          {"batches", r.batches}, {"checkpoint", ckpt.dir}, {"step", ckpt.step}};
    std::printf("%s\n", out.dump().c_str());
  });
}

}  // namespace mhar::cli
