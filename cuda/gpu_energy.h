// gpu_energy.h: the energy a GPU has drawn, from the driver's counter (NVML's total
// energy consumption, Volta and later), so that `mhar bench` can report joules a step
// and tokens a joule beside tokens a second.
//
// Why: the H100s and H200s run a training step at their power limit (cuda/NOTES.md, lead
// 0), so the clock, and with it every kernel's time, follows the energy the step spends.
// The mean draw says whether a run is power-bound (on an H100 every mode and size drew
// 684-699 W of 700, so there the step's joules follow its time); below the limit, joules
// a step say which way a change moved the energy.
//
// NVML is the driver's library (libnvidia-ml.so.1), not the toolkit's: it is loaded at run
// time, so neither the build nor a machine without the driver needs it. Where it cannot be
// loaded or read (no driver, a CPU-only build, a GPU without the counter, a container
// without access), the counter is unavailable and says why; it never fails the run.
#pragma once
#include <memory>
#include <string>

namespace mhar::cuda {

class GpuEnergyCounter {
 public:
  explicit GpuEnergyCounter(int cuda_device);  // the CUDA ordinal; matched by PCI bus id
  ~GpuEnergyCounter();
  GpuEnergyCounter(const GpuEnergyCounter&) = delete;
  GpuEnergyCounter& operator=(const GpuEnergyCounter&) = delete;

  bool available() const { return why_unavailable_.empty(); }
  const std::string& why_unavailable() const { return why_unavailable_; }
  // Joules drawn since the driver loaded (NVML counts millijoules; how often the driver
  // advances the counter is not documented, so read differences over a second or more, not
  // single steps of a small model), or NaN where unavailable or a read fails.
  double joules() const;
  // The power limit the driver enforces now, W, or NaN.
  double power_limit_watts() const;

 private:
  struct Nvml;
  std::unique_ptr<Nvml> nvml_;
  std::string why_unavailable_;
};

}  // namespace mhar::cuda
