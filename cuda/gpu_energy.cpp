// gpu_energy.cpp: GpuEnergyCounter over NVML loaded with dlopen (see gpu_energy.h). The few
// NVML entry points are declared here by their documented C signatures (nvml.h): a status
// enum (0 = success), an opaque device handle, the counter in millijoules and the limit in
// milliwatts.
#include "cuda/gpu_energy.h"

#include <dlfcn.h>

#include <cmath>
#include <limits>
#include <stdexcept>
#include <type_traits>

#include "cuda/device.h"

namespace mhar::cuda {

namespace {
using NvmlReturn = int;  // nvmlReturn_t; NVML_SUCCESS is 0
using NvmlDevice = struct NvmlDeviceOpaque*;
constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();
}  // namespace

struct GpuEnergyCounter::Nvml {
  void* library = nullptr;
  bool initialised = false;
  NvmlDevice device = nullptr;
  NvmlReturn (*init)() = nullptr;
  NvmlReturn (*shutdown)() = nullptr;
  const char* (*error_string)(NvmlReturn) = nullptr;
  NvmlReturn (*handle_by_pci_bus_id)(const char*, NvmlDevice*) = nullptr;
  NvmlReturn (*total_energy)(NvmlDevice, unsigned long long*) = nullptr;    // mJ
  NvmlReturn (*enforced_power_limit)(NvmlDevice, unsigned int*) = nullptr;  // mW

  std::string describe(const char* call, NvmlReturn status) const {
    return std::string(call) + " returned " + std::to_string(status) + " (" +
           (error_string ? error_string(status) : "?") + ")";
  }
  ~Nvml() {
    if (initialised) shutdown();
    if (library) dlclose(library);
  }
};

GpuEnergyCounter::GpuEnergyCounter(int cuda_device) : nvml_(std::make_unique<Nvml>()) {
  if (!built_with_cuda()) {
    why_unavailable_ = "this mhar was built without CUDA";
    return;
  }
  Nvml& n = *nvml_;
  n.library = dlopen("libnvidia-ml.so.1", RTLD_NOW | RTLD_LOCAL);
  if (!n.library) {
    const char* e = dlerror();
    why_unavailable_ = std::string("cannot load the driver's libnvidia-ml.so.1: ") + (e ? e : "?");
    return;
  }
  const auto bind = [&](auto& fn, const char* name) {
    fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(dlsym(n.library, name));
    if (!fn && why_unavailable_.empty())
      why_unavailable_ = std::string("libnvidia-ml.so.1 has no ") + name;
  };
  bind(n.init, "nvmlInit_v2");
  bind(n.shutdown, "nvmlShutdown");
  bind(n.error_string, "nvmlErrorString");
  bind(n.handle_by_pci_bus_id, "nvmlDeviceGetHandleByPciBusId_v2");
  bind(n.total_energy, "nvmlDeviceGetTotalEnergyConsumption");
  bind(n.enforced_power_limit, "nvmlDeviceGetEnforcedPowerLimit");
  if (!available()) return;
  if (const NvmlReturn s = n.init(); s != 0) {
    why_unavailable_ = n.describe("nvmlInit_v2", s);
    return;
  }
  n.initialised = true;
  std::string bus_id;
  try {
    bus_id = pci_bus_id(cuda_device);
  } catch (const std::exception& e) {
    why_unavailable_ = std::string("the PCI bus id of CUDA device ") + std::to_string(cuda_device) +
                       ": " + e.what();
    return;
  }
  if (const NvmlReturn s = n.handle_by_pci_bus_id(bus_id.c_str(), &n.device); s != 0) {
    why_unavailable_ = n.describe(("nvmlDeviceGetHandleByPciBusId_v2(" + bus_id + ")").c_str(), s);
    return;
  }
  unsigned long long mj = 0;
  if (const NvmlReturn s = n.total_energy(n.device, &mj); s != 0)
    why_unavailable_ = n.describe("nvmlDeviceGetTotalEnergyConsumption", s);  // pre-Volta
}

GpuEnergyCounter::~GpuEnergyCounter() = default;

double GpuEnergyCounter::joules() const {
  unsigned long long mj = 0;
  if (!available() || nvml_->total_energy(nvml_->device, &mj) != 0) return kNaN;
  return double(mj) * 1e-3;
}

double GpuEnergyCounter::power_limit_watts() const {
  unsigned int mw = 0;
  if (!available() || nvml_->enforced_power_limit(nvml_->device, &mw) != 0) return kNaN;
  return double(mw) * 1e-3;
}

}  // namespace mhar::cuda
