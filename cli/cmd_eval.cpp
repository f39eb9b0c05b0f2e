// cmd_eval.cpp: `mhar eval --checkpoint DIR --data GLOB [--batches N]` prints one JSON
// line {"loss", "ppl", "tokens", ...}: the mean cross-entropy over every predicted token of
// back-to-back windows read in shard-name order, the same number the trainer logs.
// Under `mpirun -np N` rank r evaluates batches r, r+N, ... (of --batches in all) and the
// sums meet on rank 0, which prints the line.
// --logits-out FILE also writes those windows' inputs, targets and logits as safetensors
// (for comparing the engine's forward with another implementation, tools/hf/).
#include <algorithm>
#include <cmath>
#include <cstdio>

#include "cli/commands.h"
#include "cli/eval_task_command.h"
#include "data/loader.h"
#include "engine/backend_factory.h"
#include "engine/checkpoint.h"
#include "engine/communicator.h"
#include "engine/config.h"
#include "engine/file_io.h"
#include "engine/safetensors.h"
#include "engine/trainer.h"

namespace mhar::cli {

void register_eval(CLI::App& app) {
  auto* cmd = app.add_subcommand("eval", "Evaluate a checkpoint's loss on token shards");
  static std::string checkpoint, glob, device = "auto";
  static long long batches = 0;
  static int batch_size = 0, seq_len = 0;
  // 0 = the default for each; the upper ends are the config's caps (engine/config.cpp),
  // and the batch is checked against the step-size cap once the model is known.
  static std::string logits_out;
  cmd->add_option("--checkpoint", checkpoint, "Checkpoint directory, or a run directory (its newest)")
      ->required();
  cmd->add_option("--data", glob, "Shard glob, e.g. 'data/val_*.bin' (not with --task)");
  add_number(cmd, "--batches", batches, 0LL, 1LL << 40,
             "Evaluate at most this many batches (default 0: all)");
  add_number(cmd, "--batch-size", batch_size, 0, 65536,
             "Windows per batch (default 0: the checkpoint's train.micro_batch)");
  add_number(cmd, "--seq-len", seq_len, 0, 1 << 20,
             "Tokens per window (default 0: the checkpoint's train.seq_len)");
  cmd->add_option("--device", device, "cpu, cuda or auto")->check(CLI::IsMember({"cpu", "cuda", "auto"}))
      ->capture_default_str();
  static std::string task, task_file, tokenizer_name;
  cmd->add_option("--task", task, "Zero-shot task scored as lm-evaluation-harness does: lambada, hellaswag or wikitext")
      ->check(CLI::IsMember({"lambada", "hellaswag", "wikitext"}));
  cmd->add_option("task_file", task_file, "The task's file (LAMBADA jsonl, HellaSwag jsonl, WikiText raw), with --task");
  cmd->add_option("--tokenizer", tokenizer_name, "With --task: gpt2, qwen3 or a tokenizer.json (default: the checkpoint's data.tokenizer)");
  cmd->add_option("--logits-out", logits_out,
                  "Also write the evaluated windows' input_ids, targets [n, T] (I32) and logits [n, T, V]\n"
                  "(F32) to this safetensors file (at most 4 GiB of logits: limit with --batches)");
  cmd->callback([] {
    require_directory("--checkpoint", checkpoint, "checkpoint directory or run directory");
    if (!task.empty()) {  // data/eval_tasks.h
      if (!glob.empty()) fail("--task scores a task file; --data is for token shards: give one of them");
      if (task_file.empty()) fail("--task ", task, " needs the task's file as an argument");
      evaltask::run_task_command(task, task_file, checkpoint, tokenizer_name, device, batch_size, seq_len);
      return;
    }
    if (!task_file.empty()) fail("the file argument '", task_file, "' is for --task lambada|hellaswag|wikitext");
    if (glob.empty()) fail("eval needs --data GLOB (token shards) or --task NAME FILE");
    check_shard_pattern("--data", glob, "val_*.bin");
    CheckpointInfo ckpt = open_checkpoint(checkpoint);
    const Config& cfg = ckpt.config;
    const auto [B, T] = checkpoint_batch_shape(cfg, batch_size, seq_len, cfg.train.seq_len, "eval");
    const DistInfo& d = dist::init();
    data::DataLoader loader(glob, B, T, 0, d.rank, d.world_size, cfg.model.vocab_size,
                            data::LoaderMode::Sequential);
    if (loader.num_batches() == 0)
      fail(glob, ": ", loader.total_tokens(), " tokens are fewer than one batch of ", B, " x ",
           T + 1, d.world_size > 1 ? " per rank" : "");
    auto backend = make_backend(device, d.local_rank);
    Model model(cfg.model, cfg.residual, *backend, B, T, 1, cfg.train.logits_chunk);
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
    if (!logits_out.empty()) {
      // A second pass over the same batches: the loss above stays evaluate()'s own.
      const int64_t V = cfg.model.vocab_size, rows = r.batches * B;
      const double logit_bytes = double(rows) * T * double(V) * 4;
      if (logit_bytes > double(uint64_t(4) << 30))
        fail("--logits-out: ", r.batches, " batches of ", B, " x ", T, " tokens x vocab ", V, " = ",
             logit_bytes / double(1 << 30), " GiB of logits, more than 4 GiB; use --batches");
      std::vector<int32_t> x(size_t(B) * T), y(size_t(B) * T), ids, targets;
      std::vector<float> logits;
      std::vector<double> row(static_cast<size_t>(V));  // one position at a time: the host copy stays F32
      loader.reset();
      for (long long b = 0; b < r.batches; ++b) {
        loader.next_batch(x.data(), y.data());
        model.forward(x.data(), y.data(), 0.0);
        const int64_t N = int64_t(B) * T, chunk = model.logits_chunk();
        for (int64_t first = 0; first < N; first += chunk) {  // the head's chunks, in turn
          const Tensor part = model.logits(first, std::min(chunk, N - first));
          for (int64_t n = 0; n < part.dim(0); ++n) {
            backend->download(row.data(), part[n]);
            logits.insert(logits.end(), row.begin(), row.end());
          }
        }
        ids.insert(ids.end(), x.begin(), x.end());
        targets.insert(targets.end(), y.begin(), y.end());
      }
      std::string bytes;
      write_safetensors_to([&](const void* p, size_t n) { bytes.append(static_cast<const char*>(p), n); },
                           {{"input_ids", "I32", {rows, T}, ids.data()},
                            {"targets", "I32", {rows, T}, targets.data()},
                            {"logits", "F32", {rows, T, V}, logits.data()}},
                           {{"format", "mhar-logits"}, {"checkpoint", ckpt.dir}, {"step", std::to_string(ckpt.step)},
                            {"backend", backend->name()}});
      write_file_atomic(logits_out, bytes);
      out["logits_file"] = logits_out;
    }
    std::printf("%s\n", out.dump().c_str());
  });
}

}  // namespace mhar::cli
