// communicator.cpp: the single-process communicator (every collective is the identity).
// MPI and the process group: comm_mpi.cpp; NCCL: cuda/comm_nccl.cu.
#include "engine/communicator.h"

namespace mhar {

namespace {

class SingleCommunicator final : public Communicator {
 public:
  std::string name() const override { return "single"; }
  int rank() const override { return 0; }
  int world_size() const override { return 1; }
  void reduce_scatter_sum(Tensor) override {}
  void all_gather(Tensor) override {}
  void wait_reduced() override {}
  void wait_gathered() override {}
  void all_reduce_sum(double*, int) override {}
  void barrier() override {}
  std::string broadcast_string(const std::string& s) override { return s; }
  std::vector<std::string> gather_strings(const std::string& s) override { return {s}; }
  std::vector<float> gather_floats(const std::vector<float>& mine) override { return mine; }
};

}  // namespace

std::unique_ptr<Communicator> make_single_communicator() {
  return std::make_unique<SingleCommunicator>();
}

}  // namespace mhar
