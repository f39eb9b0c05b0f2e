// cuda_backend.h: the CUDA backend (bf16 activations and weights, fp32 statistics and
// parameter gradients, fp32 accumulation everywhere), tested op by op against the CPU
// reference (tests/*_cudatest.cpp). One stream per backend, and a second for side work
// (Backend::side_work_begin: the backward's weight gradients, joined back by
// side_work_join); every op is asynchronous except the host transfers and sum_squares,
// which synchronise.
#pragma once
#include <memory>

#include "engine/backend.h"

namespace mhar {

// Fails (mhar::Error) when `device` does not exist.
std::unique_ptr<Backend> make_cuda_backend(int device = 0);

namespace cuda {
// The CUDA backend's stream (a cudaStream_t) and device, for the NCCL communicator;
// fail for any other backend.
void* backend_stream(Backend& backend);
int backend_device(Backend& backend);
}  // namespace cuda

}  // namespace mhar
