#pragma once
// Independent pieces of work on one CUDA device, side by side on two streams.

#include <ATen/core/Tensor.h>

#include <functional>
#include <memory>

namespace hh::kernels {

// Work on a second stream beside the current one. The second stream starts after everything queued on
// the current stream when the object is made; join() (or the destructor) orders the current stream's
// later work after everything queued on the second. The second stream is one high-priority stream per
// device for the whole process, so memory the caching allocator keeps for it is reused from call to
// call; its blocks go first as SMs free up, and the current stream's fill the rest.
// Tensors allocated on the second stream must not outlive the object unless used_on_current() marks
// them (the allocator would hand their memory back to the second stream while the current one may
// still read it).
class SideBySide {
 public:
  explicit SideBySide(const at::Device& device);
  ~SideBySide();  // joins, if join() was not called
  SideBySide(const SideBySide&) = delete;
  SideBySide& operator=(const SideBySide&) = delete;

  // Runs fn with the second stream current (fn may call the members below).
  void on_side(const std::function<void()>& fn);
  // The current stream's work queued from now on waits for what the second stream holds so far.
  void current_waits_for_side();
  // t, allocated on the second stream, is read by the current stream's work queued so far and later.
  void used_on_current(const at::Tensor& t);
  void join();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// Runs `side` on the second stream and `main` on the current one, then returns with the current
// stream's later work ordered after both (SideBySide in one call). `side` writes its results into
// tensors allocated before the call.
void run_side_by_side(const at::Device& device, const std::function<void()>& side, const std::function<void()>& main);

}  // namespace hh::kernels
