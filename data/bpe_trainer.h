// bpe_trainer.h: `mhar data train-tokenizer`: trains a byte-level BPE tokenizer with
// GPT-2 pre-tokenization and writes a Hugging Face tokenizer.json (ByteLevel
// pre-tokenizer and decoder, BPE model, <|endoftext|> as the last id), which both
// mhar and Hugging Face tokenizers load and use identically.
// The base vocabulary is the 256 bytes (id = byte value). Each step merges the most
// frequent adjacent pair over the corpus's pre-tokenized pieces (ties: the smaller
// pair of ids); training stops at the requested size or when no pair occurs at least
// min_frequency times. Deterministic whatever the thread count.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace mhar::data {

struct TrainTokenizerOptions {
  std::vector<std::string> inputs;
  std::string out;          // tokenizer.json path
  int vocab_size = 8192;    // including the 256 bytes and <|endoftext|>
  int min_frequency = 2;
  uint64_t max_bytes = 0;   // read at most this much text (0: all)
  int threads = 0;
};

struct TrainTokenizerSummary {
  uint64_t documents = 0, text_bytes = 0, unique_pieces = 0;
  int vocab_size = 0, merges = 0;
  double seconds = 0, count_seconds = 0;
};

TrainTokenizerSummary train_tokenizer(const TrainTokenizerOptions& options);

}  // namespace mhar::data
