// run_tokenizer.cpp: the tokenizer a checkpoint's commands (sample, export, eval --task)
// use: the checkpoint's data.tokenizer, or the one --tokenizer names, with a message that
// says which of the two failed to load (declared in cli/commands.h).
#include "cli/commands.h"
#include "data/tokenizer.h"

namespace mhar::cli {

data::Tokenizer load_run_tokenizer(const Config& cfg, const std::string& tokenizer_option) {
  const std::string name = tokenizer_option.empty() ? cfg.data.tokenizer : tokenizer_option;
  try {
    return data::Tokenizer::load(name);
  } catch (const Error& e) {
    fail(e.what(), "\n  (the tokenizer named by ",
         tokenizer_option.empty() ? "the checkpoint's data.tokenizer" : "--tokenizer",
         "; pass --tokenizer gpt2|qwen3|PATH to choose another)");
  }
}

}  // namespace mhar::cli
