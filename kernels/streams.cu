#include "kernels/streams.h"

#include <ATen/cuda/CUDAContext.h>
#include <ATen/cuda/CUDAEvent.h>
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

void run_side_by_side(const at::Device& device, const std::function<void()>& side, const std::function<void()>& main) {
  if (!device.is_cuda()) throw std::invalid_argument("hh::kernels::run_side_by_side: expected a CUDA device");
  const c10::cuda::CUDAGuard guard(device);
  const c10::cuda::CUDAStream current = c10::cuda::getCurrentCUDAStream(device.index());
  const c10::cuda::CUDAStream second = side_stream(current.device_index());
  at::cuda::CUDAEvent fork, join;
  fork.record(current);
  fork.block(second);
  {
    const c10::cuda::CUDAStreamGuard on_second(second);
    side();
  }
  try {
    main();
  } catch (...) {
    join.record(second);
    join.block(current);
    throw;
  }
  join.record(second);
  join.block(current);
}

}  // namespace hh::kernels
