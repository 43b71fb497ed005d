#include "kernels/device_table.h"

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <ATen/cuda/CUDAEvent.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <atomic>
#include <list>
#include <map>
#include <memory>
#include <mutex>
#include <utility>

namespace hh::kernels {
namespace {

std::atomic<int64_t> g_uploads{0};

// From pinned memory, so that the copy queues behind the stream's work instead of waiting for it.
at::Tensor upload(const std::vector<int64_t>& values, const at::Device& device) {
  ++g_uploads;
  return at::tensor(at::ArrayRef<int64_t>(values), at::TensorOptions().dtype(at::kLong))
      .pin_memory()
      .to(device, /*non_blocking=*/true);
}

struct Kept {
  at::Tensor table;
  std::shared_ptr<at::cuda::CUDAEvent> copied;  // recorded on `stream` right after the copy
  c10::cuda::CUDAStream stream;
};

using Key = std::pair<c10::DeviceIndex, std::vector<int64_t>>;

// The kept tables, the most recently used first; each map entry points at its place in the list.
struct Tables {
  std::mutex mu;
  std::list<std::pair<Key, Kept>> order;
  std::map<Key, std::list<std::pair<Key, Kept>>::iterator> index;
};

Tables& tables() {
  static Tables* t = new Tables;  // never destroyed: its tensors would outlive the CUDA context at exit
  return *t;
}

}  // namespace

at::Tensor device_table(const std::vector<int64_t>& values, const at::Device& device) {
  if (!device.is_cuda()) return at::tensor(at::ArrayRef<int64_t>(values), at::TensorOptions().dtype(at::kLong));
  const c10::cuda::CUDAGuard guard(device);
  const c10::cuda::CUDAStream stream = c10::cuda::getCurrentCUDAStream(device.index());
  cudaStreamCaptureStatus capturing = cudaStreamCaptureStatusNone;
  C10_CUDA_CHECK(cudaStreamIsCapturing(stream.stream(), &capturing));
  if (capturing != cudaStreamCaptureStatusNone) return upload(values, device);

  Tables& t = tables();
  const std::lock_guard<std::mutex> lock(t.mu);
  Key key{stream.device_index(), values};
  if (auto it = t.index.find(key); it != t.index.end()) {
    t.order.splice(t.order.begin(), t.order, it->second);
    Kept& k = it->second->second;
    if (k.stream != stream) {
      k.copied->block(stream);
      c10::cuda::CUDACachingAllocator::recordStream(k.table.storage().data_ptr(), stream);
    }
    return k.table;
  }
  Kept k{upload(values, device), std::make_shared<at::cuda::CUDAEvent>(), stream};
  k.copied->record(stream);
  t.order.emplace_front(key, k);
  t.index.emplace(std::move(key), t.order.begin());
  while (t.order.size() > kKeptTables) {
    t.index.erase(t.order.back().first);
    t.order.pop_back();
  }
  return k.table;
}

int64_t device_table_uploads() { return g_uploads.load(); }

}  // namespace hh::kernels
