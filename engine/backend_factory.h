// backend_factory.h: picks the backend for a run: "cpu" (the fp32 reference), "cuda"
// (bf16 on the first GPU) or "auto" (CUDA when a device is present, else CPU).
#pragma once
#include <memory>
#include <string>

#include "engine/backend.h"

namespace mhar {

std::unique_ptr<Backend> make_backend(const std::string& device);

}  // namespace mhar
