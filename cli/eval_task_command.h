// eval_task_command.h: `mhar eval --task NAME FILE` (called from cmd_eval.cpp): opens the
// checkpoint, reads and encodes the task file (data/eval_tasks.h), builds the model just
// long enough for the longest request, scores in batches and prints one JSON line.
#pragma once
#include <string>

namespace mhar::evaltask {

void run_task_command(const std::string& task, const std::string& file, const std::string& checkpoint,
                      const std::string& tokenizer_name, const std::string& device, int batch_size,
                      int seq_len);

}  // namespace mhar::evaltask
