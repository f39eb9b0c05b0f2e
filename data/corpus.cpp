// corpus.cpp: document enumeration over jsonl/text files and folders.
#include "data/corpus.h"

#include <nlohmann/json.hpp>

#include <sys/stat.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <set>
#include <sstream>

#include "engine/error.h"
#include "engine/file_io.h"
#include "engine/json_io.h"

namespace mhar::data {
namespace fs = std::filesystem;

namespace {

bool is_jsonl(const std::string& path) {
  return path.size() >= 6 && path.compare(path.size() - 6, 6, ".jsonl") == 0;
}

bool is_document_name(const fs::path& p) {
  const auto ext = p.extension().string();
  return ext == ".jsonl" || ext == ".txt";
}

// Lists the .jsonl/.txt files under `dir`, folder by folder, so that a folder that
// cannot be read is named in the error: a corpus silently missing a sub-folder would be
// data lost without a word. A folder reached twice (a symlink back to an ancestor or to
// one already read) is read once.
void collect_folder(const fs::path& dir, std::set<std::pair<dev_t, ino_t>>& seen, std::vector<std::string>& found) {
  struct stat st {};
  if (::stat(dir.c_str(), &st) != 0) fail(dir.string(), ": cannot read the folder (", std::strerror(errno), ")");
  if (!seen.insert({st.st_dev, st.st_ino}).second) return;
  std::error_code ec;
  fs::directory_iterator it(dir, ec), end;
  if (ec)
    fail(dir.string(), ": cannot read the folder (", ec.message(),
         "); every folder under an input is read, so make it readable or give the other folders as inputs");
  std::vector<fs::path> subdirs;
  for (; it != end; it.increment(ec)) {
    if (ec) break;
    const fs::path p = it->path();
    std::error_code tec;
    const auto type = fs::status(p, tec).type();  // follows symlinks
    if (type == fs::file_type::directory) {
      subdirs.push_back(p);
    } else if (is_document_name(p)) {
      require_regular_file(p.string(), "document file");  // a FIFO, a dangling symlink: named
      found.push_back(p.string());
    }
  }
  if (ec) fail(dir.string(), ": cannot list the folder (", ec.message(), ")");
  std::sort(subdirs.begin(), subdirs.end());
  for (const auto& sub : subdirs) collect_folder(sub, seen, found);
}

}  // namespace

std::vector<std::string> corpus_files(const std::vector<std::string>& inputs) {
  if (inputs.empty()) fail("no input given (files or folders of .jsonl / .txt documents)");
  std::vector<std::string> files;
  for (const auto& input : inputs) {
    std::error_code ec;
    const auto type = fs::status(input, ec).type();
    if (type == fs::file_type::directory) {
      std::vector<std::string> found;
      std::set<std::pair<dev_t, ino_t>> seen;
      collect_folder(input, seen, found);
      if (found.empty()) fail(input, ": the folder holds no .jsonl or .txt files");
      std::sort(found.begin(), found.end());
      files.insert(files.end(), found.begin(), found.end());
    } else if (type == fs::file_type::not_found) {
      fail(input, ": no such file or folder");
    } else {
      require_regular_file(input, "document file");  // names a FIFO, a device, a socket
      files.push_back(input);
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
      require_regular_file(path, "document file");  // it may have changed since it was listed
      in_ = std::make_unique<std::ifstream>(path, std::ios::binary);
      if (!*in_) fail(path, ": cannot open (", std::strerror(errno), ")");
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
    // Strict parsing (depth limit, duplicate keys refused): a line is a document, and a
    // line nested 100,000 deep must be an error, not a crash.
    nlohmann::json j = parse_json_strict(line, path + ":" + std::to_string(line_));
    if (!j.is_object() || !j.contains("text") || !j["text"].is_string())
      fail(path, ":", line_, ": expected a JSON object with a string \"text\"");
    doc.text = std::move(j["text"].get_ref<std::string&>());
    doc.id = j.contains("id") && j["id"].is_string() ? j["id"].get<std::string>()
                                                     : path + ":" + std::to_string(line_);
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
    std::error_code ec;
    if (!is_jsonl(path)) {
      ++c.documents;
      const auto size = fs::file_size(path, ec);
      if (ec) fail(path, ": cannot read (", ec.message(), ")");
      c.text_bytes += size;
      continue;
    }
    std::ifstream in(path, std::ios::binary);
    if (!in) fail(path, ": cannot open (", std::strerror(errno), ")");
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
