// process_test_util.h: what the end-to-end tests share when they run the `mhar` binary
// (or mpirun) as a child process and read what a run wrote: the command runner and the
// reader of a run's metrics (files as bytes: data_test_util.h's read_bytes).
#pragma once
#include <sys/wait.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace mhar::test {

struct CommandResult {
  int rc = -1;          // the exit status; -1 when the command did not exit normally
  std::string out;      // its stdout (add " 2>&1" to the command for stderr too)
  double seconds = 0;   // wall time
};

// Runs `cmd` through /bin/sh and waits for it.
inline CommandResult run_command(const std::string& cmd) {
  CommandResult r;
  const auto t0 = std::chrono::steady_clock::now();
  FILE* p = popen(cmd.c_str(), "r");
  if (!p) return r;
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof buf, p)) > 0) r.out.append(buf, n);
  const int status = pclose(p);
  r.rc = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return r;
}

// The lines of RUN/metrics.jsonl of one kind ("train", "eval", ...), in file order.
inline std::vector<nlohmann::json> read_metrics(const std::filesystem::path& run, const char* kind) {
  std::vector<nlohmann::json> out;
  std::ifstream in(run / "metrics.jsonl");
  std::string line;
  while (std::getline(in, line)) {
    auto j = nlohmann::json::parse(line);
    if (j["kind"] == kind) out.push_back(j);
  }
  return out;
}

}  // namespace mhar::test
