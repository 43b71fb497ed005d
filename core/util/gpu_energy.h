#pragma once
// The energy an NVIDIA GPU has drawn, read from the driver's management library (NVML), which is
// loaded at run time: nothing links against the driver, and where it is missing (a machine without an
// NVIDIA driver) there is simply no reading. Under a power limit a piece of work's time is about its
// energy over the limit, so energy per call compares variants where the clocks move from run to run.
#include <cstdint>
#include <optional>
#include <string>

namespace hh::util {

class GpuEnergy {
 public:
  // NVML's device `index` (NVML counts every GPU of the machine; CUDA's index is the same one unless
  // CUDA_VISIBLE_DEVICES reorders or hides devices).
  explicit GpuEnergy(unsigned index = 0);
  ~GpuEnergy();
  GpuEnergy(const GpuEnergy&) = delete;
  GpuEnergy& operator=(const GpuEnergy&) = delete;

  bool available() const { return read_ != nullptr; }
  const std::string& why_unavailable() const { return why_; }
  // Millijoules drawn since the driver loaded, as the device last updated it (every 20-100 ms), or
  // nothing where unavailable or the read fails.
  std::optional<uint64_t> millijoules() const;

 private:
  void* lib_ = nullptr;
  void* device_ = nullptr;                                   // nvmlDevice_t
  int (*read_)(void* device, unsigned long long* mj) = nullptr;  // nvmlDeviceGetTotalEnergyConsumption
  int (*shutdown_)() = nullptr;                               // nvmlShutdown
  std::string why_;
};

}  // namespace hh::util
