// watchdog.h: a thread that stops a data-parallel rank whose job can no longer finish,
// instead of letting it wait forever in a collective (issue 16, "faults").
//
// Every rank marks what it is doing (set_phase). Once a second the thread checks:
// - the other ranks on this node, by process id (/proc/PID/stat): one that has exited
//   (or is a zombie) is fatal at once, named in the message;
// - the current phase: a bounded phase (a training step: forward, backward, the
//   collectives, the update) that lasts longer than MHAR_STEP_TIMEOUT_S (default 900 s)
//   is fatal; the message names the phase and step and the ranks of this node that are
//   stopped (SIGSTOP) if any. Evaluation and checkpoints (rank 0 works, others wait) are
//   unbounded phases: their peers' liveness is still checked;
// - health checks registered by communicators (NCCL's asynchronous error).
// Fatal means: the message on stderr, the abort hooks (NCCL: ncclCommAbort, so no kernel
// spins on), then _exit(1); mpirun then ends the other ranks. The last complete
// checkpoint is untouched (checkpoints are published by a rename once whole).
#pragma once
#include <functional>
#include <string>
#include <vector>

namespace mhar::watchdog {

struct Peer {
  int rank = 0;
  int pid = 0;
  bool same_node = false;
};

// Starts the thread (once per process). `peers` excludes this rank.
void start(int rank, const std::vector<Peer>& peers);
void stop();
// `phase` must be a string literal (or otherwise outlive the process).
void set_phase(const char* phase, long long step, bool bounded = true);
void add_abort_hook(std::function<void()> hook);
// A check that returns a non-empty error message when the job cannot go on.
void add_health_check(std::function<std::string()> check);
// Seconds a bounded phase may last (MHAR_STEP_TIMEOUT_S, default 900).
double step_timeout_s();
// The state letter of process `pid` from /proc (R, S, D, T, Z, ...), or 0 when it does
// not exist.
char process_state(int pid);

}  // namespace mhar::watchdog
