// communicator.h: data parallelism's collectives, beside the Backend (DESIGN.md section 7).
//
// One process per device, launched by `mpirun`; without it (or with one rank) the
// single-process communicator does nothing and a run is exactly a run of one process.
// The training step (train_step.h) talks to ranks only through this interface:
// - gradient buckets (Model::buckets()) are reduce-scattered, summed, on the last
//   micro-batch, as soon as the backward has written them;
// - each rank updates its shard of the weights (ZeRO-1, optimizer.h), and the updated
//   shards of the parameters (the backend's dtype: bf16 on CUDA) are all-gathered;
// - a few host scalars (loss, squared gradient norm, stop flag) are summed on the host.
// Implementations: single process (here), MPI over the CPU backend (comm_mpi.cpp; host
// memory, synchronous), NCCL over the CUDA backend (cuda/comm_nccl.cu; asynchronous on a
// communication stream ordered against the backend's stream by events).
//
// Process-level facts (rank, world size, local rank, whether MPI is running) live in
// `DistRuntime`: MPI is initialised only when the process was started by an MPI launcher
// (OMPI_COMM_WORLD_SIZE, PMI_SIZE or PMIX_RANK in the environment).
#pragma once
#include <memory>
#include <string>
#include <vector>

#include "engine/tensor.h"

namespace mhar {

class Backend;

class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual std::string name() const = 0;  // "single", "mpi", "nccl"
  virtual int rank() const = 0;
  virtual int world_size() const = 0;

  // ---- device buffers (the backend's memory), ordered after the work the backend has
  // enqueued so far. Element counts are multiples of world_size().
  // Sums `bucket` over ranks; rank r's slice [r*n/W, (r+1)*n/W) of the result is left in
  // place; the rest of `bucket` is undefined afterwards.
  virtual void reduce_scatter_sum(Tensor bucket) = 0;
  // Every rank's slice [r*n/W, (r+1)*n/W) of `bucket` is copied to every rank.
  virtual void all_gather(Tensor bucket) = 0;
  // The backend's later work waits for every reduce-scatter / all-gather issued so far.
  virtual void wait_reduced() = 0;
  virtual void wait_gathered() = 0;

  // ---- host values (blocking)
  virtual void all_reduce_sum(double* values, int n) = 0;
  virtual void barrier() = 0;
  // Rank 0's string on every rank.
  virtual std::string broadcast_string(const std::string& s) = 0;
  // Every rank's string, on rank 0 (others get an empty vector).
  virtual std::vector<std::string> gather_strings(const std::string& s) = 0;
  // Every rank's float array concatenated in rank order, on rank 0 (others: empty).
  virtual std::vector<float> gather_floats(const std::vector<float>& mine) = 0;
};

// The single-process communicator: every collective is the identity.
std::unique_ptr<Communicator> make_single_communicator();

// ---- the process group
struct DistInfo {
  bool mpi = false;  // started by an MPI launcher and MPI initialised
  int rank = 0, world_size = 1, local_rank = 0, local_size = 1;
};

namespace dist {
// Initialises MPI when the process was started by an MPI launcher (idempotent); returns
// the process group. Ranks other than 0 then log warnings and errors only, tagged with
// their rank. `singleton`: initialise MPI also without a launcher (one rank; tests of
// the NCCL communicator).
const DistInfo& init(bool singleton = false);
const DistInfo& info();  // init() must have run (else: one process)
bool launched_by_mpi();  // from the environment, without initialising anything
// Clean end (MPI_Finalize) after success; abort the whole job (MPI_Abort) after an error,
// so no rank waits forever for one that has given up.
void finalize();
[[noreturn]] void abort_job(int exit_code);
}  // namespace dist

// MPI over host memory: the CPU backend's data parallelism (CI runs it on 2 ranks).
std::unique_ptr<Communicator> make_mpi_communicator(Backend& backend);
// MPI for the host collectives only (strings, scalars, gathers), whatever the backend:
// the NCCL communicator's host side, and rank agreement before a backend exists. The
// single-process communicator without MPI.
std::unique_ptr<Communicator> make_host_communicator();
// NCCL over the CUDA backend's stream (cuda/comm_nccl.cu); the unique id travels over
// MPI. Without CUDA: an error saying so.
std::unique_ptr<Communicator> make_nccl_communicator(Backend& cuda_backend);
// The communicator for `backend` in this process group: single process without MPI (or
// with MHAR_COMM=single), NCCL on CUDA, MPI on the CPU.
std::unique_ptr<Communicator> make_communicator(Backend& backend);

}  // namespace mhar
