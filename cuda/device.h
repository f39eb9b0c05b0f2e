// device.h: CUDA device discovery, and the current device's copy rate. Safe to call on
// machines without a GPU or driver: they report zero devices (and no copy rate) instead of
// failing, so CPU-only runs and CI work unchanged.
#pragma once
#include <cstddef>
#include <string>

namespace mhar::cuda {

bool built_with_cuda();              // false in a -DMHAR_WITH_CUDA=OFF build
int device_count();                  // 0 when no driver or no device
std::string describe_device(int i);  // "NVIDIA H200 (sm_90, 132 SMs, 139.8 GiB)"
std::string pci_bus_id(int i);       // "0000:19:00.0": how the driver's tools name device i

// The current device's device-to-device copy rate, bytes read + written per second
// (cudaMemcpyAsync of 512 MiB, median of 7 after 2 warm-ups, timed by events): what a
// memory-bound kernel that must move its bytes can reach on this card (the H200 ~4.3e12,
// an H100 ~3.0-3.3e12). It allocates 1 GiB of its own for the measurement and frees it;
// NaN, with the reason in *why, where that or any CUDA call fails (no device, no memory
// left, a build without CUDA); it clears the runtime's last error after a failure, so a
// caller's next error check is not about the measurement.
double measure_copy_bytes_per_s(std::string* why);
constexpr size_t kCopyRateBytes = size_t(512) << 20;  // what it copies each way

}  // namespace mhar::cuda
