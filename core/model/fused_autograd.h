#pragma once
// Autograd-aware fused pieces of the Qwen3 block on CUDA, for analyses that differentiate a forward
// (attribution patching): one graph node each instead of a dozen LibTorch ops, so the backward both
// launches fewer kernels and reads the activations fewer times.
//
//   fused_rms_norm / fused_norm_rope / fused_silu_mul: forward = the kernels of kernels/fused_ops.h,
//     backward = their fused backward kernels. Gradients reach the activations only: norm weights and
//     RoPE tables are constants here (callers use the LibTorch op sequence when a weight needs one).
//   prefix_split_attention: attention of new rows over [cached prefix ++ new rows] as two flash
//     calls merged by log-sum-exp (see transformer.cpp); its backward runs flash's backward on each
//     key set with the merged output and the merged log-sum-exp, which is exact: every key set's
//     share of dQ, and its dK/dV, depends on the softmax over all keys only through those two.
//
// The LibTorch op sequences in transformer.cpp are the reference (tests/gpu/test_fused_ops.cpp).
#include "core/util/compat.h"

namespace hh::model {

#ifdef HH_HAVE_KERNELS
at::Tensor fused_rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);
// x [B, T, H, Dh]; cos/sin [T, Dh] in x's dtype.
at::Tensor fused_norm_rope(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& cos, const at::Tensor& sin,
                           double eps);
at::Tensor fused_silu_mul(const at::Tensor& gate, const at::Tensor& up);
#endif

#if HH_TORCH_AT_LEAST(2, 1)
// Whether prefix_split_attention can run on q: CUDA, 16-bit, head_dim a multiple of 8 up to 256.
bool flash_eligible(const at::Tensor& q);
// q [B, Tq, Hq, Dh], k/v [B, Tq, Hkv, Dh] (new rows, causal among themselves), pk/pv [1 or B, P, Hkv, Dh]
// (keys every new row sees) -> [B, Tq, Hq, Dh] contiguous. Differentiable in q, k, v, pk and pv.
at::Tensor prefix_split_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& pk,
                                  const at::Tensor& pv, double scale);
#endif

}  // namespace hh::model
