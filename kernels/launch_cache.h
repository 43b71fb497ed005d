#pragma once
// The dynamic shared memory each kernel was last allowed on each device. cudaFuncSetAttribute costs a few
// microseconds of host time (docs/BENCHMARKS.md v72's trace: six calls, 0.02 ms, in a forward and a forward
// and backward of the gated delta rule), and every launch of those kernels made it. A launch asks this table first and sets the
// attribute only where the kernel on that device has not been given exactly that many bytes yet. Plain
// C++ (no CUDA headers), so that the unit tests can check it without a device. A device reset would drop
// the attributes the table remembers; nothing in the project resets a device.
#include <cstddef>
#include <map>
#include <mutex>
#include <utility>

namespace hh::kernels {

class SmemAllowance {
 public:
  // Whether `kernel` on `device` still needs its dynamic shared memory set to `bytes`.
  bool needs(const void* kernel, int device, std::size_t bytes) const {
    const std::lock_guard<std::mutex> lock(mutex_);
    const auto it = given_.find({kernel, device});
    return it == given_.end() || it->second != bytes;
  }
  // Records that the attribute was set: call only once cudaFuncSetAttribute has succeeded, so that a
  // failed set is tried again by the next launch.
  void given(const void* kernel, int device, std::size_t bytes) {
    const std::lock_guard<std::mutex> lock(mutex_);
    given_[{kernel, device}] = bytes;
  }
  std::size_t size() const {
    const std::lock_guard<std::mutex> lock(mutex_);
    return given_.size();
  }

 private:
  mutable std::mutex mutex_;
  std::map<std::pair<const void*, int>, std::size_t> given_;
};

// The process's table (one for every kernel file: a kernel's address is unique across them).
inline SmemAllowance& smem_allowance() {
  static SmemAllowance table;
  return table;
}

}  // namespace hh::kernels
