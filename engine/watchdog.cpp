// watchdog.cpp: the fault watchdog of a data-parallel rank (see watchdog.h).
#include "engine/watchdog.h"

#include <spdlog/spdlog.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <mutex>
#include <sstream>
#include <thread>

namespace mhar::watchdog {

namespace {

using Clock = std::chrono::steady_clock;

struct State {
  std::mutex mutex;  // hooks and checks
  std::vector<std::function<void()>> abort_hooks;
  std::vector<std::function<std::string()>> checks;
  std::vector<Peer> peers;
  int rank = 0;
  std::atomic<const char*> phase{"start-up"};
  std::atomic<long long> step{0};
  std::atomic<bool> bounded{false};
  std::atomic<int64_t> phase_start_ns{0};
  std::atomic<bool> running{false};
  std::thread thread;
};

State& state() {
  static State* s = new State;  // never destroyed: the thread may outlive main's statics
  return *s;
}

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now().time_since_epoch()).count();
}

[[noreturn]] void fatal(const std::string& message) {
  State& s = state();
  // stderr directly: this must get out even if the logger is busy in the stuck thread.
  std::fprintf(stderr, "error: rank %d: %s\n", s.rank, message.c_str());
  std::fflush(stderr);
  std::vector<std::function<void()>> hooks;
  {
    std::lock_guard<std::mutex> lock(s.mutex);
    hooks = s.abort_hooks;
  }
  for (auto& h : hooks) h();
  _exit(1);
}

std::string stopped_peers() {
  std::string out;
  for (const Peer& p : state().peers)
    if (p.same_node && process_state(p.pid) == 'T')
      out += (out.empty() ? "" : ", ") + std::string("rank ") + std::to_string(p.rank) +
             " (pid " + std::to_string(p.pid) + ") is stopped";
  return out;
}

void loop() {
  State& s = state();
  const double timeout = step_timeout_s();
  while (s.running) {
    std::this_thread::sleep_for(std::chrono::milliseconds(500));
    if (!s.running) break;
    for (const Peer& p : s.peers) {
      if (!p.same_node) continue;
      const char st = process_state(p.pid);
      if (st == 0 || st == 'Z' || st == 'X')
        fatal("rank " + std::to_string(p.rank) + " (pid " + std::to_string(p.pid) +
              ") has exited while the job runs; stopping this rank too. The last complete "
              "checkpoint is intact: resume from it");
    }
    std::vector<std::function<std::string()>> checks;
    {
      std::lock_guard<std::mutex> lock(s.mutex);
      checks = s.checks;
    }
    for (auto& c : checks) {
      const std::string err = c();
      if (!err.empty()) fatal(err);
    }
    if (s.bounded) {
      const double waited = double(now_ns() - s.phase_start_ns.load()) * 1e-9;
      if (waited > timeout) {
        const std::string stopped = stopped_peers();
        std::ostringstream m;
        m << s.phase.load() << " of step " << s.step.load() << " has not finished after "
          << int(waited) << " s (MHAR_STEP_TIMEOUT_S = " << timeout << "): another rank has "
          << "died or hangs" << (stopped.empty() ? "" : ": " + stopped)
          << "; stopping. The last complete checkpoint is intact: resume from it";
        fatal(m.str());
      }
    }
  }
}

}  // namespace

char process_state(int pid) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/stat");
  if (!in) return 0;
  std::string line;
  std::getline(in, line);
  const size_t close = line.rfind(')');  // the command name may hold spaces and parens
  if (close == std::string::npos || close + 2 >= line.size()) return 0;
  return line[close + 2];
}

double step_timeout_s() {
  const char* env = std::getenv("MHAR_STEP_TIMEOUT_S");
  if (env && *env) {
    char* end = nullptr;
    const double v = std::strtod(env, &end);
    if (end && *end == 0 && v > 0) return v;
    spdlog::warn("MHAR_STEP_TIMEOUT_S = \"{}\" is not a positive number of seconds; using 900", env);
  }
  return 900;
}

void start(int rank, const std::vector<Peer>& peers) {
  State& s = state();
  if (s.running) return;
  s.rank = rank;
  s.peers = peers;
  s.phase_start_ns = now_ns();
  s.running = true;
  s.thread = std::thread(loop);
}

void stop() {
  State& s = state();
  if (!s.running) return;
  s.running = false;
  if (s.thread.joinable()) s.thread.join();
}

void set_phase(const char* phase, long long step, bool bounded) {
  State& s = state();
  s.bounded = false;  // never judged with a stale start time
  s.phase = phase;
  s.step = step;
  s.phase_start_ns = now_ns();
  s.bounded = bounded;
}

void add_abort_hook(std::function<void()> hook) {
  std::lock_guard<std::mutex> lock(state().mutex);
  state().abort_hooks.push_back(std::move(hook));
}

void add_health_check(std::function<std::string()> check) {
  std::lock_guard<std::mutex> lock(state().mutex);
  state().checks.push_back(std::move(check));
}

}  // namespace mhar::watchdog
