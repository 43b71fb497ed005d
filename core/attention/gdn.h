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
#include <functional>
#include <vector>

#include "core/util/compat.h"

#ifdef HH_HAVE_KERNELS
namespace hh::kernels {
struct OutputFusion;  // kernels/gdn.h
struct ShortConvInputs;
}
#endif

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

// The same chunked rule evaluated for speed, and the path the hybrid layer takes on CUDA tensors:
//  - everything inside a chunk (the UT transform, the intra-chunk attention, each chunk's state
//    transition P_n and input Z_n) is batched over all chunks of all sequences at once;
//  - only the chunk-to-chunk recurrence S_{n+1} = P_n^T S_n + Z_n runs in order, as the op
//    hydrahead::gdn_state_scan (a CUDA kernel, kernels/gdn.cu; a LibTorch loop elsewhere);
//  - the backward runs the same scan in reverse for the state gradients (dS_n = P_n dS_{n+1} + X_n),
//    then differentiates the chunk-local function for all chunks at once with the chunk-start
//    states and the chunk-end state gradients held fixed, which is the exact gradient (by its
//    formulas written out, see GdnBackward).
// cu_seqlens (host values 0 = c_0 < c_1 < ... < c_S = T, B must be 1) packs S sequences of lengths
// c_{s+1} - c_s into one row: chunks never cross a boundary, initial_state and the returned state are
// then [S, H, Dk, Dv]. Without it, each of the B rows is one sequence.
// On CUDA with 16-bit q, k, v (Dk, Dv in {64, 128}, chunk 64) the forward's chunk-local halves run as
// the kernels kernels::chunk_factors / chunk_output around the scan, and the backward's as
// kernels::chunk_backward after the reverse scan, which forms each chunk's direct term from the
// forward's output factors (kept for it with the scan's block float16 new values; with
// kernels::set_direct_in_scan(false), kernels::chunk_state_direct forms that term instead and the
// forward keeps less) (GdnBackward::kKernels).
// Their block float16 scans split long sequences into pieces scanned side by side, each from zero a
// few chunks early (kernels::LowRankScanArgs::segment), where the product of the warm-up's transition
// norm bounds e^{G_C} prod_t max(1, |1 - beta_t |k_t|^2|) (e^{G_C} under the contract above) is at
// most 2^-20, so a piece's start state misses at most 2^-20 of the state where its warm-up began, for
// any input (kernels::set_scan_segments(0) scans whole sequences).
// Runs as the op hydrahead::chunk_gated_delta_rule(q, k, v, g, beta, initial_state?, scale, chunk,
// cu_seqlens) -> (o, final_state), registered for every backend with its autograd (a program that
// links this library can call it through the dispatcher, e.g. torch.ops.hydrahead from Python).
GdnOutput gdn_chunked_scan(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
                           const at::Tensor& beta, const at::Tensor& initial_state, double scale, int64_t chunk = 64,
                           const std::vector<int64_t>& cu_seqlens = {});

// How gdn_chunked_scan's backward differentiates the chunk-local function (process-wide; for
// benchmarks and tests): by the CUDA chunk kernels where they apply (16-bit CUDA inputs of the forward
// kernels' shapes; the reverse scan and kernels::chunk_backward) and by
// kExplicit elsewhere (the default); by its gradient formulas written out on LibTorch ops (fewer and
// larger operations than autograd's); or by autograd through the LibTorch ops of the forward.
enum class GdnBackward { kKernels, kExplicit, kAutograd };
void set_gdn_backward(GdnBackward b);
GdnBackward gdn_backward();

// gdn_chunked_scan on CUDA tensors, gdn_chunked elsewhere.
GdnOutput gdn(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g, const at::Tensor& beta,
              const at::Tensor& initial_state, double scale, int64_t chunk = 64);

// The stages of the rule on the chunk kernels, in the order they are queued.
enum class GdnStage { kFactors, kScan };

#ifdef HH_HAVE_KERNELS
// Inference: gdn's output passed straight through the fusion norm into y (kernels::OutputFusion: the
// gate before its activation, gamma, the activation, eps and each head's place in y), without o being
// written, where the chunk kernels and their block float16 history run (kernels::chunk_output_f16_fused);
// elsewhere gdn, then kernels::fusion_norm_forward_into. One sequence a row (no cu_seqlens). No graph
// may be recorded through it: an input that requires a gradient under grad mode is an error. Returns
// the final state, as gdn does.
// Given `conv`, q, k and v [B, T, H, D] are the LA heads' projections before their short convolution
// (kernels::ShortConvInputs): chunk_factors applies it where it can, else its own kernels run first; the
// same values either way. on_queued, where given, is called with each stage of the chunk kernels' path
// once that stage's kernels are queued (points for another stream to wait on); on no other path.
at::Tensor gdn_fused_output(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
                            const at::Tensor& beta, const at::Tensor& initial_state, double scale, int64_t chunk,
                            const kernels::OutputFusion& fusion, at::Tensor& y,
                            const kernels::ShortConvInputs* conv = nullptr,
                            const std::function<void(GdnStage)>& on_queued = {});
#endif

// The op hydrahead::gdn_state_scan, through the dispatcher. P [H, N, Dk, Dk], Z [H, N, Dk, Dv],
// y0 [S, H, Dk, Dv] of one floating dtype; the chunks of sequence s are [offsets[s], offsets[s+1]).
// Per (s, h): Y = y0; for each chunk n in order (reversed when reverse): hist[h, n] = Y; Y = P^T Y + Z.
// Returns {hist [H, N, Dk, Dv], final Y [S, H, Dk, Dv]}.
struct ScanResult {
  at::Tensor hist, final_state;
};
ScanResult gdn_state_scan(const at::Tensor& P, const at::Tensor& Z, const at::Tensor& y0,
                          const std::vector<int64_t>& offsets, bool reverse);

}  // namespace hh::attention
