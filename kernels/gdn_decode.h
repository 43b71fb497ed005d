#pragma once
// The LA heads' whole decoding step in one launch: for one new token of each sequence, the short
// convolution over its cached inputs, RoPE and the L2 norm of q and k, the gates, one step of the gated
// delta rule on the float32 state and the scale-normalised fusion, written into the layer's per-head
// output at each head's position. core/attention/hybrid.cpp's op sequence for one token with a cache
// (short_conv with its past, rope_l2, the gates, gdn_recurrent, the fusion) is the reference
// tests/gpu compares it with; each step's values are rounded to the model's dtype where that sequence
// rounds them.
#include <cstdint>
#include <vector>

#include "core/util/compat.h"

namespace hh::kernels {

// The most LA heads a layer may have for gdn_decode_step (their positions travel with the launch).
inline constexpr int64_t kMaxDecodeHeads = 128;

// One layer's LA heads for one token of B sequences; n = nL LA heads of Dh = Dk = Dv each, C = n Dh.
// All CUDA tensors on one device, of the model's dtype T (float32, float16 or bfloat16) unless noted.
struct DecodeStep {
  // The token's projections before the convolution: q [B, Hq_cols * Dh] and k, v [B, C], each row with
  // unit column stride (rows may be further apart: column slices of a wider product). LA head i's q is
  // the Dh columns at q_heads[i] * Dh of q's row (q may be the product of every head's rows).
  at::Tensor q, k, v;
  std::vector<int64_t> q_heads;
  // The short convolution (weight [3 C, 1, 4], channels q, k, v as la_conv.weight orders them) and its
  // last three inputs [B, 3 C, 3] (contiguous, updated in place to end with this token's); both
  // undefined: no convolution.
  at::Tensor conv_weight, conv_past;
  at::Tensor cos, sin;  // RoPE tables at the token's position, Dh values each
  // The gates' projections b and a [B, n] (unit column stride) and la_A_log, la_dt_bias [n].
  at::Tensor b, a, A_log, dt_bias;
  bool beta_times_two = false;
  at::Tensor state;  // [B, n, Dh, Dh] float32 contiguous, advanced in place
  double scale = 1.0, l2_eps = 1e-6;
  // The fusion: gate [B, C] before its SiLU (unit column stride) and gamma [Hq, Dh], whose row
  // heads[i] is LA head i's; both undefined: no fusion (plain concatenation, y = o).
  at::Tensor gate, gamma;
  double norm_eps = 1e-6;
  std::vector<int64_t> heads;  // where LA head i goes among out's Hq heads
};

// Runs the step: out [B, 1, Hq, Dh] contiguous receives LA head i at heads[i]; state and conv_past
// advance. Takes Dh in {32, 64, 128}, at most kMaxDecodeHeads heads, the dtypes and layouts above;
// throws std::invalid_argument naming the tensor it refuses.
void gdn_decode_step(const DecodeStep& s, at::Tensor& out);
// The same where it takes the inputs, with one check; returns false (having run nothing) where it does
// not, for a caller that then takes the op sequence.
bool try_gdn_decode_step(const DecodeStep& s, at::Tensor& out);

}  // namespace hh::kernels
