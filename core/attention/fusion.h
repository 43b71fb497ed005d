#pragma once
// The scale-normalised fusion of DESIGN.md section 9, for n heads at once:
//   y[..., i, :] = gate[..., i, :] * (gamma[i] * RMSNorm(o[..., i, :]))   (weightless RMSNorm, eps)
// o, gate [B, T, n, Dh] of one dtype, gamma [n, Dh]. RMSNorm is model::rms_norm (float32 statistics,
// result rounded to the dtype), then two products in the dtype.
#include "core/util/compat.h"

namespace hh::attention {

// The LibTorch op sequence: the reference.
at::Tensor fusion_norm_reference(const at::Tensor& o, const at::Tensor& gate, const at::Tensor& gamma, double eps);

// The fused CUDA kernel (forward and backward, kernels/gdn.cu) for CUDA tensors of float32, float16 or
// bfloat16 with Dh <= 256; the reference otherwise. Differentiable in o, gate and gamma either way.
at::Tensor fusion_norm(const at::Tensor& o, const at::Tensor& gate, const at::Tensor& gamma, double eps);

}  // namespace hh::attention
