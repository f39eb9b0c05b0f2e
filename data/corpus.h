// corpus.h: reading documents for `mhar data prepare` and `train-tokenizer`.
// Inputs are files or folders: a .jsonl file holds one document per line as a JSON
// object with "text" (and optionally "id"), the format tools/fetch_assets.sh writes;
// any other file is one document (its bytes, unchanged); a folder is read recursively
// in sorted path order, taking its .jsonl and .txt files. Documents come out in input
// order, which makes everything downstream independent of thread counts.
// Nothing is skipped without a word: a sub-folder that cannot be read, or a .jsonl/.txt
// entry that is not a regular file (a FIFO, a dangling symlink), is an error naming it.
// jsonl lines are parsed strictly (engine/json_io.h).
#pragma once
#include <cstdint>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

namespace mhar::data {

struct Document {
  std::string id;    // "id" from the jsonl, else "<file>:<line>" or the file path
  std::string text;
};

// Expands inputs (files, folders) into the ordered list of files to read; fails on a
// path that does not exist, a folder that cannot be read, or one with no documents.
std::vector<std::string> corpus_files(const std::vector<std::string>& inputs);

class DocumentReader {
 public:
  explicit DocumentReader(const std::vector<std::string>& inputs);
  // The next document; false at the end. Fails on a malformed jsonl line, naming the
  // file and line.
  bool next(Document& doc);
  // Reads the next documents until about max_bytes of text (at least one document).
  std::vector<Document> next_chunk(size_t max_bytes);
  const std::vector<std::string>& files() const { return files_; }

 private:
  std::vector<std::string> files_;
  size_t file_index_ = 0;
  std::unique_ptr<std::ifstream> in_;
  bool in_jsonl_ = false;
  uint64_t line_ = 0;
};

struct CorpusCount {
  uint64_t documents = 0;
  uint64_t text_bytes = 0;  // approximate for jsonl: bytes of the lines
};
// A quick pass that counts documents (lines of jsonl files, other files as one).
CorpusCount count_documents(const std::vector<std::string>& inputs);

}  // namespace mhar::data
