// no_cuda.cpp: the CUDA entry points of a build configured with -DMHAR_WITH_CUDA=OFF (a
// machine without the CUDA toolkit). Discovery reports no device, so `auto` picks the CPU;
// asking for the CUDA backend explicitly is an error that says how to get it.
#include <cmath>

#include "cuda/cuda_backend.h"
#include "cuda/device.h"
#include "engine/communicator.h"
#include "engine/error.h"

namespace mhar {

namespace cuda {

bool built_with_cuda() { return false; }
int device_count() { return 0; }
namespace {
[[noreturn]] void no_device(int i) {
  fail("CUDA device ", i, ": this mhar was built without CUDA (-DMHAR_WITH_CUDA=OFF)");
}
}  // namespace
std::string describe_device(int i) { no_device(i); }
std::string pci_bus_id(int i) { no_device(i); }
double measure_copy_bytes_per_s(std::string* why) {
  if (why) *why = "this mhar was built without CUDA (-DMHAR_WITH_CUDA=OFF)";
  return NAN;
}

}  // namespace cuda

std::unique_ptr<Communicator> make_nccl_communicator(Backend&) {
  fail("this mhar was built without CUDA, so without NCCL; use --device cpu (MPI over the CPU)");
}

std::unique_ptr<Backend> make_cuda_backend(int) {
  fail("this mhar was built without the CUDA backend; reconfigure with -DMHAR_WITH_CUDA=ON "
       "(needs the CUDA toolkit), or use --device cpu");
}

}  // namespace mhar
