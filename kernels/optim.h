#pragma once
// The optimiser's passes over every parameter of a training step, each in one launch a dtype over a
// table of tensors, where LibTorch's op sequence takes several launches per tensor: AdamW's update,
// the gradients' sum of squares (for the global norm) and their scaling (clipping).
// core/train/optim.cpp's op sequences are the reference tests/gpu compares these with; each kernel does
// that sequence's float32 arithmetic element by element in the same order (only a fused multiply-add may
// round differently), and the sum of squares adds in a different order (float32 within a run of
// elements, float64 across runs).
#include <vector>

#include "core/util/compat.h"

namespace hh::kernels {

// AdamW's scalars for one step: the step's learning rate, the moments' rates, eps and the weight
// decay, and the bias corrections 1 - beta1^t and 1 - beta2^t.
struct AdamWScalars {
  double lr = 0, beta1 = 0.9, beta2 = 0.95, eps = 1e-8, weight_decay = 0;
  double bias1 = 1, bias2 = 1;
};

// One AdamW tensor: param (float32, float16 or bfloat16), its gradient (param's dtype and shape), the
// moments exp_avg and exp_avg_sq (float32) and, for a 16-bit param, its float32 master (undefined for
// a float32 param). All CUDA, contiguous, on one device.
struct AdamWTensor {
  at::Tensor param, grad, exp_avg, exp_avg_sq, master;
  bool decay = true;
};

// Whether adamw_step takes these tensors (else a caller takes the op sequence).
bool adamw_supported(const std::vector<AdamWTensor>& ts);
// For each tensor, with g = float(grad) and w = master (or param when float32):
//   w *= 1 - lr wd (decay only); m = b1 m + (1 - b1) g; v = b2 v + (1 - b2) g g;
//   w -= (lr / bias1) m / (sqrt(v / bias2) + eps); param = to_dtype(w) (16-bit params).
// Throws std::invalid_argument naming the tensor it refuses.
void adamw_step(const std::vector<AdamWTensor>& ts, const AdamWScalars& s);

// Whether sum_squares and scale_ take these tensors: float32, float16 or bfloat16, CUDA, contiguous,
// on one device.
bool multi_supported(const std::vector<at::Tensor>& xs);
// The sum over every tensor of its elements' squares, a 0-dim float64 tensor on their device (summed in
// float32 within runs of 8192 elements, then in float64). xs not empty.
at::Tensor sum_squares(const std::vector<at::Tensor>& xs);
// x = to_dtype(float(x) * float(s)) for every element of every tensor, in place.
void scale_(const std::vector<at::Tensor>& xs, double s);

}  // namespace hh::kernels
