#include "core/util/gpu_energy.h"

#include <dlfcn.h>

namespace hh::util {
namespace {
constexpr int kNvmlSuccess = 0;  // NVML_SUCCESS
}  // namespace

GpuEnergy::GpuEnergy(unsigned index) {
  lib_ = dlopen("libnvidia-ml.so.1", RTLD_LAZY | RTLD_LOCAL);
  if (lib_ == nullptr) {
    why_ = "no NVIDIA management library (libnvidia-ml.so.1): no NVIDIA driver here";
    return;
  }
  using Init = int (*)();
  using Handle = int (*)(unsigned, void**);
  using Read = int (*)(void*, unsigned long long*);
  const auto init = reinterpret_cast<Init>(dlsym(lib_, "nvmlInit_v2"));
  const auto handle = reinterpret_cast<Handle>(dlsym(lib_, "nvmlDeviceGetHandleByIndex_v2"));
  const auto read = reinterpret_cast<Read>(dlsym(lib_, "nvmlDeviceGetTotalEnergyConsumption"));
  shutdown_ = reinterpret_cast<int (*)()>(dlsym(lib_, "nvmlShutdown"));
  if (init == nullptr || handle == nullptr || read == nullptr || shutdown_ == nullptr) {
    why_ = "the NVIDIA management library lacks the energy counter's functions";
    shutdown_ = nullptr;
    return;
  }
  if (const int rc = init(); rc != kNvmlSuccess) {
    why_ = "nvmlInit failed (NVML error " + std::to_string(rc) + ")";
    shutdown_ = nullptr;
    return;
  }
  unsigned long long mj = 0;
  if (const int rc = handle(index, &device_); rc != kNvmlSuccess) {
    why_ = "no GPU " + std::to_string(index) + " for NVML (NVML error " + std::to_string(rc) + ")";
    return;
  }
  if (const int rc = read(device_, &mj); rc != kNvmlSuccess) {
    why_ = "GPU " + std::to_string(index) + " reports no energy counter (NVML error " + std::to_string(rc) +
           "; it needs a Volta or later data-centre GPU)";
    return;
  }
  read_ = read;
}

GpuEnergy::~GpuEnergy() {
  if (shutdown_ != nullptr) shutdown_();
  if (lib_ != nullptr) dlclose(lib_);
}

std::optional<uint64_t> GpuEnergy::millijoules() const {
  unsigned long long mj = 0;
  if (read_ == nullptr || read_(device_, &mj) != kNvmlSuccess) return std::nullopt;
  return static_cast<uint64_t>(mj);
}

}  // namespace hh::util
