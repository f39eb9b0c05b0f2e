// corpus.cpp: document enumeration over jsonl/text files and folders.
#include "data/corpus.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <filesystem>
#include <sstream>

#include "engine/error.h"

namespace mhar::data {
namespace fs = std::filesystem;

namespace {
bool is_jsonl(const std::string& path) {
  return path.size() >= 6 && path.compare(path.size() - 6, 6, ".jsonl") == 0;
}
}  // namespace

std::vector<std::string> corpus_files(const std::vector<std::string>& inputs) {
  if (inputs.empty()) fail("no input given (files or folders of .jsonl / .txt documents)");
  std::vector<std::string> files;
  for (const auto& input : inputs) {
    std::error_code ec;
    if (fs::is_directory(input, ec)) {
      std::vector<std::string> found;
      for (auto it = fs::recursive_directory_iterator(input, fs::directory_options::follow_directory_symlink, ec);
           it != fs::recursive_directory_iterator(); it.increment(ec)) {
        if (ec) fail(input, ": cannot read the folder: ", ec.message());
        const auto ext = it->path().extension().string();
        if (it->is_regular_file() && (ext == ".jsonl" || ext == ".txt")) found.push_back(it->path().string());
      }
      if (found.empty()) fail(input, ": the folder holds no .jsonl or .txt files");
      std::sort(found.begin(), found.end());
      files.insert(files.end(), found.begin(), found.end());
    } else if (fs::is_regular_file(input, ec)) {
      files.push_back(input);
    } else {
      fail(input, ": no such file or folder");
    }
  }
  return files;
}

DocumentReader::DocumentReader(const std::vector<std::string>& inputs) : files_(corpus_files(inputs)) {}

bool DocumentReader::next(Document& doc) {
  for (;;) {
    if (!in_) {
      if (file_index_ >= files_.size()) return false;
      const std::string& path = files_[file_index_];
      in_ = std::make_unique<std::ifstream>(path, std::ios::binary);
      if (!*in_) fail(path, ": cannot open");
      in_jsonl_ = is_jsonl(path);
      line_ = 0;
      if (!in_jsonl_) {
        std::ostringstream ss;
        ss << in_->rdbuf();
        doc.id = path;
        doc.text = ss.str();
        in_.reset();
        ++file_index_;
        return true;
      }
    }
    std::string line;
    if (!std::getline(*in_, line)) {
      in_.reset();
      ++file_index_;
      continue;
    }
    ++line_;
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    const std::string& path = files_[file_index_];
    try {
      const auto j = nlohmann::json::parse(line);
      if (!j.is_object() || !j.contains("text") || !j["text"].is_string())
        fail(path, ":", line_, ": expected a JSON object with a string \"text\"");
      doc.text = j["text"].get<std::string>();
      doc.id = j.contains("id") && j["id"].is_string() ? j["id"].get<std::string>()
                                                       : path + ":" + std::to_string(line_);
    } catch (const nlohmann::json::exception& e) {
      fail(path, ":", line_, ": not valid JSON: ", e.what());
    }
    return true;
  }
}

std::vector<Document> DocumentReader::next_chunk(size_t max_bytes) {
  std::vector<Document> docs;
  size_t bytes = 0;
  Document d;
  while (bytes < max_bytes && next(d)) {
    bytes += d.text.size();
    docs.push_back(std::move(d));
  }
  return docs;
}

CorpusCount count_documents(const std::vector<std::string>& inputs) {
  CorpusCount c;
  for (const auto& path : corpus_files(inputs)) {
    if (!is_jsonl(path)) {
      ++c.documents;
      c.text_bytes += fs::file_size(path);
      continue;
    }
    std::ifstream in(path, std::ios::binary);
    std::string line;
    while (std::getline(in, line)) {
      if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
      ++c.documents;
      c.text_bytes += line.size();
    }
  }
  return c;
}

}  // namespace mhar::data
