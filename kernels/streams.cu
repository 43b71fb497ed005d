#include "kernels/streams.h"

#include <ATen/cuda/CUDAContext.h>
#include <ATen/cuda/CUDAEvent.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <mutex>
#include <optional>
#include <stdexcept>
#include <vector>

namespace hh::kernels {
namespace {

c10::cuda::CUDAStream side_stream(c10::DeviceIndex device) {
  static std::mutex mu;
  static std::vector<std::optional<c10::cuda::CUDAStream>> streams;
  const std::lock_guard<std::mutex> lock(mu);
  if (streams.size() <= static_cast<size_t>(device)) streams.resize(static_cast<size_t>(device) + 1);
  auto& s = streams[static_cast<size_t>(device)];
  if (!s) s = c10::cuda::getStreamFromPool(/*isHighPriority=*/true, device);
  return *s;
}

}  // namespace

struct SideBySide::Impl {
  c10::cuda::CUDAGuard guard;
  c10::cuda::CUDAStream current, second;
  std::vector<at::cuda::CUDAEvent> events;  // each wait's, alive until the join
  bool joined = false;

  explicit Impl(const at::Device& device)
      : guard(device),
        current(c10::cuda::getCurrentCUDAStream(device.index())),
        second(side_stream(current.device_index())) {}
  // `waiter` waits for what `on` holds so far.
  void order(const c10::cuda::CUDAStream& on, const c10::cuda::CUDAStream& waiter) {
    events.emplace_back();
    events.back().record(on);
    events.back().block(waiter);
  }
};

SideBySide::SideBySide(const at::Device& device) {
  if (!device.is_cuda()) throw std::invalid_argument("hh::kernels::SideBySide: expected a CUDA device");
  impl_ = std::make_unique<Impl>(device);
  impl_->order(impl_->current, impl_->second);
}

SideBySide::~SideBySide() {
  if (!impl_ || impl_->joined) return;
  try {
    impl_->order(impl_->second, impl_->current);
  } catch (...) {  // unwinding from an error already: the device's own error is the one to report
  }
}

void SideBySide::on_side(const std::function<void()>& fn) {
  const c10::cuda::CUDAStreamGuard on_second(impl_->second);
  fn();
}

void SideBySide::current_waits_for_side() { impl_->order(impl_->second, impl_->current); }

void SideBySide::used_on_current(const at::Tensor& t) {
  if (t.defined() && t.is_cuda()) c10::cuda::CUDACachingAllocator::recordStream(t.storage().data_ptr(), impl_->current);
}

void SideBySide::join() {
  if (impl_->joined) return;
  impl_->order(impl_->second, impl_->current);
  impl_->joined = true;
}

void run_side_by_side(const at::Device& device, const std::function<void()>& side, const std::function<void()>& main) {
  SideBySide sb(device);
  sb.on_side(side);
  main();  // on an exception the destructor still orders the current stream after the second
  sb.join();
}

}  // namespace hh::kernels
