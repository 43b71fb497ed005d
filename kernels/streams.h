#pragma once
// Two independent pieces of work on one CUDA device, side by side.

#include <ATen/core/Tensor.h>

#include <functional>

namespace hh::kernels {

// Runs `side` on a second stream of `device` and `main` on the current stream, then returns with the
// current stream's later work ordered after both. `side` starts after everything queued on the current
// stream so far. The second stream is one high-priority stream per device for the whole process, so
// memory the caching allocator keeps for it is reused from call to call; its blocks go to `side`'s
// kernels first as SMs free up, and `main`'s fill the rest.
// Tensors `side` allocates must not outlive it (the allocator would hand their memory back to the
// second stream while the current one may still read it): `side` writes its results into tensors
// allocated before the call.
void run_side_by_side(const at::Device& device, const std::function<void()>& side, const std::function<void()>& main);

}  // namespace hh::kernels
