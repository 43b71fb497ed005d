#pragma once
// The gated delta rule (Gated DeltaNet, DESIGN.md section 9), the linear-attention recurrence of the
// HydraHead LA heads. Per head, with state S [Dk, Dv] (float32, or float64 for float64 inputs):
//   S_t = exp(g_t) S_{t-1} + k_t (beta_t (v_t - exp(g_t) S_{t-1}^T k_t))^T
//   o_t = scale * S_t^T q_t
// q and k are expected L2-normalised by the caller; g_t <= 0 is the log decay; beta_t in (0, 1], or
// (0, 2) with negative eigenvalues allowed.
//
// gdn_recurrent is the oracle: one step per token, obviously the formula above.
// gdn_chunked computes the same in chunks (64 by default) with the UT transform: inside a chunk the
// delta terms u_t solve a unit lower-triangular system, so everything but the chunk-to-chunk state
// hand-off is batched matrix work. Both are plain LibTorch ops, so autograd differentiates them, and
// both take any T (not a multiple of the chunk, shorter than a chunk).
#include <cstdint>

#include "core/util/compat.h"

namespace hh::attention {

struct GdnOutput {
  at::Tensor o;      // [B, T, H, Dv] in v's dtype
  at::Tensor state;  // [B, H, Dk, Dv] float32 (float64 for float64 inputs): S after the last token
};

// q, k [B, T, H, Dk]; v [B, T, H, Dv]; g, beta [B, T, H]; initial_state [B, H, Dk, Dv] or undefined (0).
GdnOutput gdn_recurrent(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
                        const at::Tensor& beta, const at::Tensor& initial_state, double scale);
GdnOutput gdn_chunked(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
                      const at::Tensor& beta, const at::Tensor& initial_state, double scale, int64_t chunk = 64);

}  // namespace hh::attention
