// prepare.h: `mhar data prepare`: documents -> llm.c shards for training and validation.
// Each document is written as <|endoftext|> followed by its tokens (llm.c's layout, so
// every document, the first included, starts after a separator). Validation holds out
// whole documents, spread evenly over the input order: with n of D documents held
// out, document i goes to validation iff floor((i+1)n/D) > floor(i n/D). Shards are
// filled to exactly shard_tokens (the last one holds the rest), named
// train_000000.bin... and val_000000.bin..., and described in prepare.json. Output is
// byte-identical for the same inputs whatever the thread count.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace mhar::data {

struct PrepareOptions {
  std::string tokenizer = "gpt2";  // gpt2 | qwen3 | path to tokenizer.json
  std::vector<std::string> inputs;
  std::string out_dir;
  int64_t val_docs = -1;       // exact number of validation documents, or
  double val_fraction = -1.0;  // fraction of documents (default 0.01 when neither is set)
  uint64_t shard_tokens = 100'000'000;
  int threads = 0;             // 0: all cores
  bool progress = true;        // progress bar on stderr
};

struct PrepareSummary {
  uint64_t documents = 0, train_documents = 0, val_documents = 0;
  uint64_t train_tokens = 0, val_tokens = 0;  // including the separators
  uint64_t text_bytes = 0;
  double seconds = 0;
  std::vector<std::string> train_shards, val_shards;
  std::string tokenizer;
  int vocab_size = 0;
};

PrepareSummary prepare(const PrepareOptions& options);

}  // namespace mhar::data
