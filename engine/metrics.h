// metrics.h: RUN_DIR/metrics.jsonl, one JSON object per line, appended and flushed as
// the run goes (kinds: "train" per step, "eval", "routing", "skip"; see the report).
// Opening for a resumed run drops lines from steps after the checkpoint, so the file
// always describes one consistent history.
#pragma once
#include <cstdio>
#include <string>

#include <nlohmann/json.hpp>

namespace mhar {

class MetricsLog {
 public:
  // keep_through_step < 0: start a new file; otherwise keep lines with step <= it.
  MetricsLog(const std::string& path, long long keep_through_step);
  ~MetricsLog();
  void append(const nlohmann::json& line);
  const std::string& path() const { return path_; }

 private:
  std::string path_;
  std::FILE* f_ = nullptr;
};

}  // namespace mhar
