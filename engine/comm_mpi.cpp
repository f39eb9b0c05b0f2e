// comm_mpi.cpp: the process group (MPI start-up, local rank, clean end and job abort)
// and the MPI communicator over host memory, which is the CPU backend's data
// parallelism and the NCCL communicator's host side (scalars, strings, the NCCL id).
//
// Every MPI call returns its error (MPI_ERRORS_RETURN) and a failure becomes an
// mhar::Error naming the call, so the CLI prints it and aborts the job instead of MPI
// printing its own banner from deep inside a collective.
#include <mpi.h>
#include <spdlog/spdlog.h>
#include <unistd.h>

#include <climits>
#include <cstdlib>
#include <cstring>

#include "engine/backend.h"
#include "engine/communicator.h"
#include "engine/error.h"
#include "engine/watchdog.h"

namespace mhar {

namespace {

DistInfo g_info;
bool g_initialised = false, g_finalised = false;

void check_mpi(int rc, const char* what) {
  if (rc == MPI_SUCCESS) return;
  char msg[MPI_MAX_ERROR_STRING];
  int len = 0;
  MPI_Error_string(rc, msg, &len);
  fail("rank ", g_info.rank, ": ", what, " failed: ", std::string(msg, size_t(len)),
       " (another rank has probably died; see mpirun's message)");
}

MPI_Datatype mpi_type(DType t, const char* what) {
  switch (t) {
    case DType::F32: return MPI_FLOAT;
    case DType::F64: return MPI_DOUBLE;
    default: fail("MPI communicator: ", what, " of ", dtype_name(t), " tensors is not supported "
                  "(the CPU backend holds F32 or F64)");
  }
}

int checked_count(int64_t n, const char* what) {
  if (n > INT_MAX)
    fail("MPI communicator: ", what, " of ", n, " elements exceeds MPI's int count");
  return int(n);
}

class MpiCommunicator final : public Communicator {
 public:
  MpiCommunicator() {
    MHAR_CHECK(g_initialised, "MPI communicator without MPI");
    check_mpi(MPI_Comm_dup(MPI_COMM_WORLD, &comm_), "MPI_Comm_dup");
    MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN);
  }
  ~MpiCommunicator() override {
    if (!g_finalised) MPI_Comm_free(&comm_);
  }
  std::string name() const override { return "mpi"; }
  int rank() const override { return g_info.rank; }
  int world_size() const override { return g_info.world_size; }

  void reduce_scatter_sum(Tensor bucket) override {
    const int W = world_size(), r = rank();
    MHAR_CHECK(bucket.numel() % W == 0, "bucket of ", bucket.numel(), " elements over ", W, " ranks");
    const int64_t c = bucket.numel() / W;
    if (W == 1) return;
    const size_t es = dtype_size(bucket.dtype);
    check_mpi(MPI_Reduce_scatter_block(MPI_IN_PLACE, bucket.data, checked_count(c, "reduce-scatter"),
                                       mpi_type(bucket.dtype, "reduce-scatter"), MPI_SUM, comm_),
              "MPI_Reduce_scatter_block");
    // In place, MPI leaves this rank's slice at the start of the buffer.
    char* base = static_cast<char*>(bucket.data);
    if (r > 0) std::memmove(base + size_t(r) * size_t(c) * es, base, size_t(c) * es);
  }
  void all_gather(Tensor bucket) override {
    const int W = world_size();
    MHAR_CHECK(bucket.numel() % W == 0, "bucket of ", bucket.numel(), " elements over ", W, " ranks");
    if (W == 1) return;
    check_mpi(MPI_Allgather(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, bucket.data,
                            checked_count(bucket.numel() / W, "all-gather"),
                            mpi_type(bucket.dtype, "all-gather"), comm_),
              "MPI_Allgather");
  }
  void wait_reduced() override {}  // synchronous
  void wait_gathered() override {}

  void all_reduce_sum(double* values, int n) override {
    if (world_size() == 1) return;
    check_mpi(MPI_Allreduce(MPI_IN_PLACE, values, n, MPI_DOUBLE, MPI_SUM, comm_), "MPI_Allreduce");
  }
  void barrier() override { check_mpi(MPI_Barrier(comm_), "MPI_Barrier"); }
  std::string broadcast_string(const std::string& s) override {
    long long n = (long long)s.size();
    check_mpi(MPI_Bcast(&n, 1, MPI_LONG_LONG, 0, comm_), "MPI_Bcast");
    std::string out = rank() == 0 ? s : std::string(size_t(n), '\0');
    if (n) check_mpi(MPI_Bcast(out.data(), checked_count(n, "broadcast"), MPI_CHAR, 0, comm_), "MPI_Bcast");
    return out;
  }
  std::vector<std::string> gather_strings(const std::string& s) override {
    std::vector<std::string> out;
    for_each_part(s.data(), (long long)s.size(), MPI_CHAR, 1,
                  [&](int, const std::vector<char>& bytes) {
                    out.emplace_back(bytes.begin(), bytes.end());
                  });
    return out;
  }
  std::vector<float> gather_floats(const std::vector<float>& mine) override {
    std::vector<float> out;
    for_each_part(mine.data(), (long long)mine.size(), MPI_FLOAT, sizeof(float),
                  [&](int, const std::vector<char>& bytes) {
                    const size_t at = out.size();
                    out.resize(at + bytes.size() / sizeof(float));
                    if (!bytes.empty()) std::memcpy(out.data() + at, bytes.data(), bytes.size());
                  });
    return out;
  }

 private:
  // Rank 0 receives every rank's array in rank order (point to point, in chunks, so any
  // size works) and hands each to `take`; other ranks send theirs.
  template <class F>
  void for_each_part(const void* data, long long count, MPI_Datatype type, size_t es, F take) {
    constexpr long long kChunk = 1LL << 26;
    const int tag = 7201;
    if (rank() != 0) {
      check_mpi(MPI_Send(&count, 1, MPI_LONG_LONG, 0, tag, comm_), "MPI_Send");
      for (long long at = 0; at < count; at += kChunk)
        check_mpi(MPI_Send(static_cast<const char*>(data) + size_t(at) * es,
                           int(std::min(kChunk, count - at)), type, 0, tag, comm_), "MPI_Send");
      return;
    }
    std::vector<char> buf(size_t(count) * es);
    if (count) std::memcpy(buf.data(), data, buf.size());
    take(0, buf);
    for (int r = 1; r < world_size(); ++r) {
      long long n = 0;
      check_mpi(MPI_Recv(&n, 1, MPI_LONG_LONG, r, tag, comm_, MPI_STATUS_IGNORE), "MPI_Recv");
      buf.assign(size_t(n) * es, 0);
      for (long long at = 0; at < n; at += kChunk)
        check_mpi(MPI_Recv(buf.data() + size_t(at) * es, int(std::min(kChunk, n - at)), type, r,
                           tag, comm_, MPI_STATUS_IGNORE), "MPI_Recv");
      take(r, buf);
    }
  }

  MPI_Comm comm_ = MPI_COMM_NULL;
};

}  // namespace

namespace dist {

bool launched_by_mpi() {
  for (const char* v : {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK"}) {
    const char* e = std::getenv(v);
    if (e && *e) return true;
  }
  return false;
}

const DistInfo& init(bool singleton) {
  if (g_initialised || !(singleton || launched_by_mpi())) return g_info;
  int provided = 0;
  // The watchdog and the data loader's thread never call MPI.
  int rc = MPI_Init_thread(nullptr, nullptr, MPI_THREAD_FUNNELED, &provided);
  if (rc != MPI_SUCCESS) fail("MPI_Init_thread failed (error ", rc, ")");
  g_initialised = true;
  MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);
  g_info.mpi = true;
  MPI_Comm_rank(MPI_COMM_WORLD, &g_info.rank);
  MPI_Comm_size(MPI_COMM_WORLD, &g_info.world_size);
  MPI_Comm local;
  check_mpi(MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, g_info.rank, MPI_INFO_NULL,
                                &local), "MPI_Comm_split_type");
  MPI_Comm_rank(local, &g_info.local_rank);
  MPI_Comm_size(local, &g_info.local_size);
  // Who runs where, for the watchdog: ranks of this node are watched by process id.
  std::vector<int> is_local(size_t(g_info.world_size), 0), pids(size_t(g_info.world_size), 0);
  std::vector<int> world_of_local(size_t(g_info.local_size), 0);
  check_mpi(MPI_Allgather(&g_info.rank, 1, MPI_INT, world_of_local.data(), 1, MPI_INT, local),
            "MPI_Allgather");
  for (int w : world_of_local) is_local[size_t(w)] = 1;
  const int pid = int(::getpid());
  check_mpi(MPI_Allgather(&pid, 1, MPI_INT, pids.data(), 1, MPI_INT, MPI_COMM_WORLD), "MPI_Allgather");
  MPI_Comm_free(&local);
  if (g_info.rank > 0) {
    // Progress, metrics and reports are rank 0's; other ranks speak only up.
    if (spdlog::get_level() < spdlog::level::warn) spdlog::set_level(spdlog::level::warn);
    spdlog::set_pattern("[%H:%M:%S] [rank " + std::to_string(g_info.rank) + "] %^%l%$ %v");
  }
  if (g_info.world_size > 1) {
    std::vector<watchdog::Peer> peers;
    for (int r = 0; r < g_info.world_size; ++r)
      if (r != g_info.rank) peers.push_back({r, pids[size_t(r)], is_local[size_t(r)] != 0});
    watchdog::start(g_info.rank, peers);
  }
  return g_info;
}

const DistInfo& info() { return g_info; }

void finalize() {
  if (!g_initialised || g_finalised) return;
  // Stop watching before any rank may leave: a peer that exits after this barrier has
  // finished, not died.
  watchdog::stop();
  MPI_Barrier(MPI_COMM_WORLD);
  MPI_Finalize();
  g_finalised = true;
}

void abort_job(int exit_code) {
  std::fflush(stderr);
  std::fflush(stdout);
  if (g_initialised && !g_finalised && g_info.world_size > 1) MPI_Abort(MPI_COMM_WORLD, exit_code);
  if (g_initialised && !g_finalised) {
    watchdog::stop();
    MPI_Finalize();
    g_finalised = true;
  }
  std::exit(exit_code);
}

}  // namespace dist

std::unique_ptr<Communicator> make_host_communicator() {
  if (!g_initialised) return make_single_communicator();
  return std::make_unique<MpiCommunicator>();
}

std::unique_ptr<Communicator> make_mpi_communicator(Backend& backend) {
  if (!g_initialised) fail("the MPI communicator needs a launch by mpirun");
  const DType t = backend.grad_dtype();
  if (t != DType::F32 && t != DType::F64)
    fail("the MPI communicator reduces host memory of the CPU backend; ", backend.name(),
         " needs NCCL");
  return std::make_unique<MpiCommunicator>();
}

}  // namespace mhar
