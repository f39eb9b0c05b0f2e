// backend_factory.h: picks the backend for a run: "cpu" (the fp32 reference), "cuda"
// (bf16 on GPU `local_rank`: one rank per GPU under mpirun, GPU 0 without it) or "auto"
// (CUDA when a device is present, else CPU); and the communicator that goes with it.
#pragma once
#include <memory>
#include <string>

#include "engine/backend.h"
#include "engine/communicator.h"

namespace mhar {

std::unique_ptr<Backend> make_backend(const std::string& device, int local_rank = 0);

// Whether a backend of this name (Backend::name()) runs on a GPU: the CUDA backend's names
// begin with "cuda".
bool is_cuda_backend(const std::string& backend_name);

// The communicator of this process group for `backend` (communicator.h): the single
// process one without mpirun; under mpirun NCCL on the CUDA backend, MPI on the CPU.
std::unique_ptr<Communicator> make_communicator(Backend& backend);

}  // namespace mhar
