#pragma once
// Fused CUDA kernels for the elementwise parts of the Qwen3 block, used by the patching sweeps (which
// run many forwards and are bound by memory traffic between LibTorch's small kernels). Each one
// reproduces HF Qwen3's numerics operation by operation (float32 statistics, rounding to the model
// dtype where HF rounds); only the order of the float32 sum of squares differs from LibTorch's
// reduction, so results can differ from the unfused ops by one unit in the last place.
// The LibTorch op sequences in core/model/transformer.cpp are the reference these are tested against
// (tests/gpu/test_fused_ops.cpp). CUDA tensors of float32, float16 or bfloat16 only.
#include <utility>

#include "core/util/compat.h"

namespace hh::kernels {

// weight * to_dtype(x * rsqrt(mean(x^2, -1) + eps)), statistics in float32. x [..., n] contiguous, or
// a column slice [..., g, n] of a wider projection read in place (other layouts are copied first); y contiguous.
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);
// rms_norm(x, weight) * scale per token, rounded to the dtype after each as to_dtype(rms_norm(x) * s)
// rounds: x [B, T, H, n] as above, scale [T] of x's dtype (the FA heads' log-scaled queries). No backward.
at::Tensor rms_norm_token_scaled(const at::Tensor& x, const at::Tensor& weight, double eps, const at::Tensor& scale);

// RoPE's cos and sin tables [T, 2 inv_freq.size(0)] in `dtype` for positions offset .. offset + T - 1
// (inv_freq float32 on the device), bit for bit core/model/transformer.cpp's rope_tables, in one launch.
std::pair<at::Tensor, at::Tensor> rope_tables(const at::Tensor& inv_freq, int64_t offset, int64_t T, at::ScalarType dtype);

// The LA heads' gates in float32: beta = sigmoid(b) (times 2 given beta_times_two) and
// g = -exp(A_log) * softplus(a + dt_bias), with the values of that op sequence in the 16-bit dtype of
// b, a, A_log and dt_bias (each op's result rounded to it), in one pass. b and a [B, T, H] with unit
// stride over heads and evenly spaced rows (column slices of one projection), A_log and dt_bias [H].
// Returns (g, beta), [B, T, H] float32 contiguous. No backward.
bool gdn_gates_supported(const at::Tensor& b, const at::Tensor& a, const at::Tensor& A_log, const at::Tensor& dt_bias);
std::pair<at::Tensor, at::Tensor> gdn_gates(const at::Tensor& b, const at::Tensor& a, const at::Tensor& A_log,
                                            const at::Tensor& dt_bias, bool beta_times_two);

// RoPE(rms_norm(x, weight)) for x [B, T, H, Dh] (contiguous, or a column slice of a wider projection: heads
// packed, tokens evenly spaced; other layouts are copied first), cos/sin [T, Dh] in x's dtype
// (rotate-half layout: y = x*cos + rotate_half(x)*sin, each product rounded to the dtype as HF does).
at::Tensor norm_rope(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& cos, const at::Tensor& sin,
                     double eps);

// The LA heads' q/k: r = RoPE(x) (rounded as above), then y = to_dtype(r * rsqrt(sum(r^2, -1) + eps)) in
// float32 (core/attention/hybrid.cpp's l2_normalise(model::rotary(x)) is the reference).
at::Tensor rope_l2norm(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, double eps);
// Its backward for training, dx from dy = dL/dy (x's shape and dtype, contiguous) and x: the gradient of
// the float32 formula, the forward's roundings passed through, rounded once to the dtype.
at::Tensor rope_l2norm_backward(const at::Tensor& dy, const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
                                double eps);

// to_dtype(silu(gate)) * up, elementwise, gate/up contiguous and of one shape.
at::Tensor silu_mul(const at::Tensor& gate, const at::Tensor& up);

// Attention over [prefix ++ new keys] from its two parts, each with its log-sum-exp:
//   out = to_dtype(o_new + (o_pre - o_new) * sigmoid(lse_pre - lse_new))   (float32 inside)
// o_new [B, Hq, Tq, Dh], lse_new [B, Hq, Tq]; o_pre [Hkv, B, G, Tq, Dh], lse_pre [Hkv, B, G, Tq] with
// query head h = kv * G + g. Any strides (views of the flash outputs are read in place). Returns
// [B, Tq, Hq, Dh] contiguous, the layout the next projection reads.
at::Tensor merge_attention(const at::Tensor& o_new, const at::Tensor& lse_new, const at::Tensor& o_pre,
                           const at::Tensor& lse_pre);

// Backwards of rms_norm, norm_rope and silu_mul with respect to their activations (not the weights),
// in float32 from the saved inputs; dy has the output's shape and dtype, all contiguous.
at::Tensor rms_norm_backward(const at::Tensor& dy, const at::Tensor& x, const at::Tensor& weight, double eps);
at::Tensor norm_rope_backward(const at::Tensor& dy, const at::Tensor& x, const at::Tensor& weight, const at::Tensor& cos,
                              const at::Tensor& sin, double eps);
std::pair<at::Tensor, at::Tensor> silu_mul_backward(const at::Tensor& dy, const at::Tensor& gate, const at::Tensor& up);  // (dgate, dup)

}  // namespace hh::kernels
