// metrics.cpp: the metrics.jsonl writer (see metrics.h).
#include "engine/metrics.h"

#include <filesystem>
#include <fstream>
#include <vector>

#include "engine/error.h"

namespace mhar {

MetricsLog::MetricsLog(const std::string& path, long long keep_through_step) : path_(path) {
  std::vector<std::string> kept;
  if (keep_through_step >= 0 && std::filesystem::exists(path)) {
    std::ifstream in(path);
    std::string line;
    while (std::getline(in, line)) {
      auto j = nlohmann::json::parse(line, nullptr, false);
      if (j.is_discarded() || !j.is_object()) continue;  // a torn last line from a crash
      if (j.value("step", 0LL) <= keep_through_step) kept.push_back(line);
    }
  }
  const std::string tmp = path + ".tmp";
  {
    std::ofstream out(tmp, std::ios::trunc);
    if (!out) fail(path, ": cannot write metrics");
    for (const auto& l : kept) out << l << '\n';
  }
  std::filesystem::rename(tmp, path);
  f_ = std::fopen(path.c_str(), "a");
  if (!f_) fail(path, ": cannot open metrics for appending");
}

MetricsLog::~MetricsLog() {
  if (f_) std::fclose(f_);
}

void MetricsLog::append(const nlohmann::json& line) {
  const std::string s = line.dump() + "\n";
  if (std::fwrite(s.data(), 1, s.size(), f_) != s.size() || std::fflush(f_) != 0)
    fail(path_, ": write failed (disk full?)");
}

}  // namespace mhar
