// metrics.h: RUN_DIR/metrics.jsonl, one JSON object per line, appended as the run goes
// (kinds: "train" per step, "eval", "routing", "skip"; see the report).
//
// Opening for a resumed run drops lines from steps after the checkpoint, so the file
// always describes one consistent history. That rewrite is atomic (engine/file_io.h: a
// new file beside it, checked writes, fsync, rename), and skipped when nothing is to be
// dropped; on a full disk it fails and the old file stays whole. Appends are checked: a
// failed one is an error (never silent) and leaves the lines that were there.
// The trainer holds the run lock (engine/run_lock.h), so there is one writer.
#pragma once
#include <memory>
#include <string>

#include <nlohmann/json.hpp>

#include "engine/file_io.h"

namespace mhar {

class MetricsLog {
 public:
  // keep_through_step < 0: start a new file; otherwise keep lines with step <= it.
  MetricsLog(const std::string& path, long long keep_through_step);
  void append(const nlohmann::json& line);
  // Makes every line appended so far durable (before a checkpoint is published, so the
  // metrics never describe less than the checkpoint a resume starts from).
  void sync();
  const std::string& path() const { return path_; }

 private:
  std::string path_;
  std::unique_ptr<AppendFile> file_;
};

}  // namespace mhar
