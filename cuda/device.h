// device.h: CUDA device discovery. Safe to call on machines without a GPU or driver:
// they report zero devices instead of failing, so CPU-only runs and CI work unchanged.
#pragma once
#include <string>

namespace mhar::cuda {

bool built_with_cuda();              // false in a -DMHAR_WITH_CUDA=OFF build
int device_count();                  // 0 when no driver or no device
std::string describe_device(int i);  // "NVIDIA H200 (sm_90, 132 SMs, 139.8 GiB)"
std::string pci_bus_id(int i);       // "0000:19:00.0": how the driver's tools name device i

}  // namespace mhar::cuda
