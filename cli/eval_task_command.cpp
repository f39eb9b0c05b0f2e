// eval_task_command.cpp: the driver of `mhar eval --task` (see eval_task_command.h).
#include "cli/eval_task_command.h"

#include <chrono>
#include <cstdio>

#include "cli/commands.h"
#include "data/eval_tasks.h"
#include "data/tokenizer.h"
#include "engine/backend_factory.h"
#include "engine/checkpoint.h"
#include "engine/error.h"

namespace mhar::evaltask {

void run_task_command(const std::string& task_name_arg, const std::string& file,
                      const std::string& checkpoint, const std::string& tokenizer_name,
                      const std::string& device, int batch_size, int seq_len) {
  const auto t0 = std::chrono::steady_clock::now();
  const Task task = parse_task(task_name_arg);
  CheckpointInfo ckpt = open_checkpoint(checkpoint);
  const Config& cfg = ckpt.config;
  // The harness's max_length is the model's context (HFLM: max_position_embeddings); the
  // windows are at most that long, so the footprint is checked at it.
  const auto [B, max_len] =
      cli::checkpoint_batch_shape(cfg, batch_size, seq_len, cfg.model.context_length, "eval --task");
  data::Tokenizer tok = cli::load_run_tokenizer(cfg, tokenizer_name);
  TaskData data = load_task(task, file, tok, max_len);
  const int T = longest_input(data, max_len);
  auto backend = make_backend(device);
  Model model(cfg.model, cfg.residual, *backend, B, T, 1, cfg.train.logits_chunk);
  load_model_weights(ckpt, model);
  Progress progress(std::string("eval ") + task_name(task), int64_t(data.requests.size()), true);
  const std::vector<Score> scores =
      score_requests(model, data.requests, max_len, task == Task::Lambada, &progress);
  nlohmann::json out = task_metrics(data, scores);
  out["checkpoint"] = ckpt.dir;
  out["step"] = ckpt.step;
  out["max_length"] = max_len;
  out["batch_size"] = B;
  out["backend"] = backend->name();
  out["seconds"] = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::printf("%s\n", out.dump().c_str());
}

}  // namespace mhar::evaltask
