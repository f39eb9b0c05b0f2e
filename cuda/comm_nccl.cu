// comm_nccl.cu: the NCCL communicator over the CUDA backend (engine/communicator.h).
//
// Streams: the backend computes on its stream; collectives run on a communication stream
// of their own, ordered by events, never by a device-wide synchronisation:
// - reduce_scatter_sum(bucket): an event recorded on the compute stream right after the
//   backward has enqueued the bucket's last gradient; the communication stream waits on
//   it and reduce-scatters in place, while the compute stream goes on with the backward
//   of the earlier layers (the overlap);
// - wait_reduced(): the compute stream waits for everything on the communication stream
//   before it reads the shards (norm, update);
// - all_gather(bucket): an event recorded on the compute stream AFTER the update was
//   enqueued, which the communication stream waits on before it gathers the parameters
//   (llm.c's gpt2_update gathers on its NCCL stream without such an event after the
//   update on the main stream; that is a race, not repeated here);
// - wait_gathered(): the compute stream waits for the gathered parameters before the
//   next forward.
// Host collectives (loss, norm, stop flag, checkpoint strings and gathers) go over MPI;
// the NCCL unique id travels the same way. NVLink multicast (NVLS) is left as the
// environment sets it (NCCL_NVLS_ENABLE=0 on the shared machines); nothing here creates
// multicast objects.
// Faults: the watchdog (engine/watchdog.h) polls ncclCommGetAsyncError and, on any fatal
// condition, calls ncclCommAbort so no kernel keeps spinning on a dead peer.
#include <nccl.h>
#include <spdlog/spdlog.h>

#include <atomic>
#include <memory>

#include "cuda/check.h"
#include "cuda/cuda_backend.h"
#include "engine/backend.h"
#include "engine/communicator.h"
#include "engine/error.h"
#include "engine/watchdog.h"

namespace mhar {

namespace {

#define NCCL_CHECK(call)                                                                     \
  do {                                                                                       \
    ncclResult_t r_ = (call);                                                                \
    if (r_ != ncclSuccess)                                                                   \
      ::mhar::fail("NCCL: ", #call, " failed: ", ncclGetErrorString(r_),                     \
                   " (another rank has probably died; see its message)");                    \
  } while (0)

ncclDataType_t nccl_type(DType t) {
  switch (t) {
    case DType::F32: return ncclFloat32;
    case DType::F64: return ncclFloat64;
    case DType::BF16: return ncclBfloat16;
    default: fail("NCCL communicator: no collective for ", dtype_name(t), " tensors");
  }
}

// The communicator handle as the watchdog thread sees it: cleared before destruction, so
// an abort never touches a destroyed communicator.
struct SharedComm {
  std::atomic<ncclComm_t> comm{nullptr};
  std::atomic<bool> aborted{false};
};

class NcclCommunicator final : public Communicator {
 public:
  explicit NcclCommunicator(Backend& backend)
      : host_(make_host_communicator()),
        stream_(static_cast<cudaStream_t>(cuda::backend_stream(backend))),
        device_(cuda::backend_device(backend)),
        shared_(std::make_shared<SharedComm>()) {
    CUDA_CHECK(cudaSetDevice(device_));
    ncclUniqueId id;
    if (host_->rank() == 0) NCCL_CHECK(ncclGetUniqueId(&id));
    const std::string bytes = host_->broadcast_string(
        host_->rank() == 0 ? std::string(reinterpret_cast<const char*>(&id), sizeof id) : std::string());
    MHAR_CHECK(bytes.size() == sizeof id, "NCCL unique id of ", bytes.size(), " bytes");
    std::memcpy(&id, bytes.data(), sizeof id);
    ncclComm_t comm = nullptr;
    NCCL_CHECK(ncclCommInitRank(&comm, host_->world_size(), id, host_->rank()));
    comm_ = comm;
    shared_->comm = comm;
    CUDA_CHECK(cudaStreamCreateWithFlags(&comm_stream_, cudaStreamNonBlocking));
    CUDA_CHECK(cudaEventCreateWithFlags(&compute_done_, cudaEventDisableTiming));
    CUDA_CHECK(cudaEventCreateWithFlags(&comm_done_, cudaEventDisableTiming));
    std::shared_ptr<SharedComm> shared = shared_;
    watchdog::add_abort_hook([shared] {
      ncclComm_t c = shared->comm.exchange(nullptr);
      if (c) {
        shared->aborted = true;
        ncclCommAbort(c);
      }
    });
    watchdog::add_health_check([shared]() -> std::string {
      ncclComm_t c = shared->comm.load();
      if (!c) return "";
      ncclResult_t async = ncclSuccess;
      if (ncclCommGetAsyncError(c, &async) != ncclSuccess) return "";
      if (async == ncclSuccess || async == ncclInProgress) return "";
      return std::string("NCCL reports an asynchronous error: ") + ncclGetErrorString(async) +
             " (" + ncclGetLastError(c) + "); a peer rank has probably died";
    });
    int version = 0;
    ncclGetVersion(&version);
    spdlog::info("NCCL {}: {} rank(s), rank {} on GPU {}", version, host_->world_size(),
                 host_->rank(), device_);
  }

  ~NcclCommunicator() override {
    cudaStreamSynchronize(comm_stream_);
    ncclComm_t c = shared_->comm.exchange(nullptr);
    if (c) ncclCommDestroy(c);
    cudaEventDestroy(compute_done_);
    cudaEventDestroy(comm_done_);
    cudaStreamDestroy(comm_stream_);
  }

  std::string name() const override { return "nccl"; }
  int rank() const override { return host_->rank(); }
  int world_size() const override { return host_->world_size(); }

  void reduce_scatter_sum(Tensor bucket) override {
    const int W = world_size();
    MHAR_CHECK(bucket.numel() % W == 0, "bucket of ", bucket.numel(), " elements over ", W, " ranks");
    const size_t c = size_t(bucket.numel() / W), es = dtype_size(bucket.dtype);
    char* base = static_cast<char*>(bucket.data);
    after_compute();
    // In place: this rank's slice of the sum lands at its own offset.
    NCCL_CHECK(ncclReduceScatter(base, base + size_t(rank()) * c * es, c, nccl_type(bucket.dtype),
                                 ncclSum, comm_, comm_stream_));
  }
  void all_gather(Tensor bucket) override {
    const int W = world_size();
    MHAR_CHECK(bucket.numel() % W == 0, "bucket of ", bucket.numel(), " elements over ", W, " ranks");
    const size_t c = size_t(bucket.numel() / W), es = dtype_size(bucket.dtype);
    char* base = static_cast<char*>(bucket.data);
    after_compute();  // the event between the update and the gather
    NCCL_CHECK(ncclAllGather(base + size_t(rank()) * c * es, base, c, nccl_type(bucket.dtype), comm_,
                             comm_stream_));
  }
  void wait_reduced() override { compute_after_comm(); }
  void wait_gathered() override { compute_after_comm(); }

  void all_reduce_sum(double* values, int n) override { host_->all_reduce_sum(values, n); }
  void barrier() override { host_->barrier(); }
  std::string broadcast_string(const std::string& s) override { return host_->broadcast_string(s); }
  std::vector<std::string> gather_strings(const std::string& s) override {
    return host_->gather_strings(s);
  }
  std::vector<float> gather_floats(const std::vector<float>& mine) override {
    return host_->gather_floats(mine);
  }

 private:
  // The communication stream's next work waits for what the compute stream enqueued.
  void after_compute() {
    CUDA_CHECK(cudaEventRecord(compute_done_, stream_));
    CUDA_CHECK(cudaStreamWaitEvent(comm_stream_, compute_done_, 0));
  }
  // The compute stream's next work waits for the collectives enqueued so far.
  void compute_after_comm() {
    CUDA_CHECK(cudaEventRecord(comm_done_, comm_stream_));
    CUDA_CHECK(cudaStreamWaitEvent(stream_, comm_done_, 0));
  }

  std::unique_ptr<Communicator> host_;
  cudaStream_t stream_ = nullptr, comm_stream_ = nullptr;
  int device_ = 0;
  ncclComm_t comm_ = nullptr;
  cudaEvent_t compute_done_ = nullptr, comm_done_ = nullptr;
  std::shared_ptr<SharedComm> shared_;
};

}  // namespace

std::unique_ptr<Communicator> make_nccl_communicator(Backend& cuda_backend) {
  if (!dist::info().mpi)
    fail("the NCCL communicator needs a launch by mpirun (the NCCL id travels over MPI)");
  return std::make_unique<NcclCommunicator>(cuda_backend);
}

}  // namespace mhar
