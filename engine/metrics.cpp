// metrics.cpp: the metrics.jsonl writer (see metrics.h).
#include "engine/metrics.h"

#include <spdlog/spdlog.h>

#include <filesystem>
#include <fstream>

#include "engine/error.h"
#include "engine/json_io.h"

namespace mhar {

namespace {

// Whether a line survives a resume to step `keep`. A line that is not a JSON object (the
// torn last line of a killed run, or an empty one) does not; one without a numeric step
// is kept.
bool keep_line(const std::string& line, long long keep, const std::string& where) {
  if (line.empty()) return false;
  nlohmann::json j;
  try {
    j = parse_json_strict(line, where);
  } catch (const Error&) {
    return false;
  }
  if (!j.is_object()) return false;
  const auto it = j.find("step");
  if (it == j.end() || !it->is_number()) return true;
  return it->get<double>() <= double(keep);
}

bool ends_with_newline(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  in.seekg(0, std::ios::end);
  if (in.tellg() <= 0) return true;  // empty
  in.seekg(-1, std::ios::end);
  char c = 0;
  in.get(c);
  return c == '\n';
}

}  // namespace

MetricsLog::MetricsLog(const std::string& path, long long keep_through_step) : path_(path) {
  if (keep_through_step < 0 || !std::filesystem::exists(std::filesystem::symlink_status(path))) {
    write_file_atomic(path, "");
  } else {
    require_regular_file(path, "metrics file");
    // Pass 1: is anything to be dropped? A resume whose metrics end at its checkpoint (a
    // stop with Ctrl-C, the usual case) writes nothing here.
    size_t kept = 0, dropped = 0;
    {
      std::ifstream in(path, std::ios::binary);
      std::string line;
      for (size_t n = 1; std::getline(in, line); ++n)
        (keep_line(line, keep_through_step, path + ":" + std::to_string(n)) ? kept : dropped) += 1;
      if (in.bad()) fail(path, ": read failed");
    }
    if (dropped || !ends_with_newline(path)) {
      // Pass 2: the kept lines into a new file, published only when whole.
      CheckedFile out(temp_path_for(path));
      std::ifstream in(path, std::ios::binary);
      std::string line, buf;
      for (size_t n = 1; std::getline(in, line); ++n) {
        if (!keep_line(line, keep_through_step, path + ":" + std::to_string(n))) continue;
        buf += line;
        buf += '\n';
        if (buf.size() >= (size_t(1) << 20)) out.write(buf), buf.clear();
      }
      if (in.bad()) fail(path, ": read failed");
      out.write(buf);
      publish(out, path);
      spdlog::info("{}: kept {} lines through step {}, dropped {} (steps after that checkpoint, "
                   "or an incomplete line)", path, kept, keep_through_step, dropped);
    }
  }
  file_ = std::make_unique<AppendFile>(path);
}

void MetricsLog::append(const nlohmann::json& line) { file_->append(line.dump() + "\n"); }

void MetricsLog::sync() { file_->sync(); }

}  // namespace mhar
