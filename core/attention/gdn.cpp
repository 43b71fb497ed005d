#include "core/attention/gdn.h"

#include <torch/torch.h>

#include <limits>
#include <string>
#include <vector>

#include "core/model/summary.h"
#include "core/util/error.h"

namespace hh::attention {
namespace {

std::string shape_str(at::IntArrayRef s) { return model::format_shape(s.vec()); }

// Checks shapes; returns the accumulation dtype (float64 for float64 inputs, else float32).
at::ScalarType check_inputs(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
                            const at::Tensor& beta, const at::Tensor& s0) {
  if (q.dim() != 4 || k.sizes() != q.sizes())
    throw Error("gated delta rule: q and k must both be [B, T, H, Dk], got " + shape_str(q.sizes()) + " and " +
                shape_str(k.sizes()));
  const int64_t B = q.size(0), T = q.size(1), H = q.size(2), Dk = q.size(3);
  if (v.dim() != 4 || v.size(0) != B || v.size(1) != T || v.size(2) != H)
    throw Error("gated delta rule: v must be [" + std::to_string(B) + ", " + std::to_string(T) + ", " + std::to_string(H) +
                ", Dv], got " + shape_str(v.sizes()));
  const std::vector<int64_t> bth = {B, T, H};
  if (g.sizes() != at::IntArrayRef(bth) || beta.sizes() != at::IntArrayRef(bth))
    throw Error("gated delta rule: g and beta must be [B, T, H] = " + shape_str(bth) + ", got " + shape_str(g.sizes()) +
                " and " + shape_str(beta.sizes()));
  if (s0.defined() && s0.sizes() != at::IntArrayRef({B, H, Dk, v.size(3)}))
    throw Error("gated delta rule: initial_state must be [B, H, Dk, Dv] = " + shape_str({B, H, Dk, v.size(3)}) +
                ", got " + shape_str(s0.sizes()));
  return q.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
}

}  // namespace

GdnOutput gdn_recurrent(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
                        const at::Tensor& beta, const at::Tensor& initial_state, double scale) {
  const at::ScalarType acc = check_inputs(q, k, v, g, beta, initial_state);
  const int64_t B = q.size(0), T = q.size(1), H = q.size(2), Dk = q.size(3), Dv = v.size(3);
  const auto opts = q.options().dtype(acc);
  at::Tensor S = initial_state.defined() ? initial_state.to(acc) : at::zeros({B, H, Dk, Dv}, opts);
  const at::Tensor qf = q.to(acc), kf = k.to(acc), vf = v.to(acc), gf = g.to(acc), bf = beta.to(acc);
  std::vector<at::Tensor> outs;
  outs.reserve(static_cast<size_t>(T));
  for (int64_t t = 0; t < T; ++t) {
    const at::Tensor q_t = qf.select(1, t), k_t = kf.select(1, t), v_t = vf.select(1, t);  // [B, H, D]
    const at::Tensor decay = gf.select(1, t).exp().view({B, H, 1, 1});
    const at::Tensor b_t = bf.select(1, t).view({B, H, 1});
    S = S * decay;                                                                         // e^{g_t} S_{t-1}
    const at::Tensor pred = at::matmul(S.transpose(2, 3), k_t.unsqueeze(-1)).squeeze(-1);  // [B, H, Dv]
    const at::Tensor u = b_t * (v_t - pred);                                               // [B, H, Dv]
    S = S + k_t.unsqueeze(-1) * u.unsqueeze(-2);                                           // + k u^T
    outs.push_back(at::matmul(S.transpose(2, 3), q_t.unsqueeze(-1)).squeeze(-1) * scale); // [B, H, Dv]
  }
  return {at::stack(outs, 1).to(v.scalar_type()), S};
}

GdnOutput gdn_chunked(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
                      const at::Tensor& beta, const at::Tensor& initial_state, double scale, int64_t chunk) {
  const at::ScalarType acc = check_inputs(q, k, v, g, beta, initial_state);
  if (chunk < 1) throw Error("gated delta rule: chunk must be >= 1");
  const int64_t B = q.size(0), T = q.size(1), H = q.size(2), Dk = q.size(3), Dv = v.size(3);
  const int64_t C = chunk, N = (T + C - 1) / C, pad = N * C - T;
  const auto opts = q.options().dtype(acc);
  // Padding steps have k = v = q = 0, g = 0, beta = 0: they leave the state untouched.
  auto prep = [&](const at::Tensor& x) {
    at::Tensor f = x.to(acc).transpose(1, 2);  // [B, H, T, ...]
    if (pad > 0) {
      std::vector<int64_t> shape(f.sizes().begin(), f.sizes().end());
      shape[2] = pad;
      f = at::cat({f, at::zeros(shape, opts)}, 2);
    }
    std::vector<int64_t> s = {B, H, N, C};
    for (int64_t i = 3; i < f.dim(); ++i) s.push_back(f.size(i));
    return f.reshape(s);  // [B, H, N, C, ...]
  };
  const at::Tensor Q = prep(q), K = prep(k), V = prep(v);  // [B, H, N, C, D]
  const at::Tensor Gl = prep(g), Bt = prep(beta);          // [B, H, N, C]

  // Chunk-local cumulative log decay G_t = g_1 + ... + g_t, and the decay between rows t >= i.
  const at::Tensor G = Gl.cumsum(-1);                                             // [B, H, N, C]
  const at::Tensor diff = G.unsqueeze(-1) - G.unsqueeze(-2);                      // [.., C(t), C(i)] G_t - G_i
  const at::Tensor incl = at::ones({C, C}, opts.dtype(at::kBool)).tril();         // i <= t
  const at::Tensor strict = at::ones({C, C}, opts.dtype(at::kBool)).tril(-1);     // i < t
  // exp only where i <= t (G_t - G_i <= 0 there; elsewhere it could overflow).
  const at::Tensor gamma = diff.masked_fill(incl.logical_not(), -std::numeric_limits<double>::infinity()).exp();

  // UT transform: (I + L) U = diag(beta) (V - diag(e^G) K S0), L[t, i] = beta_t e^{G_t - G_i} k_t.k_i (i < t).
  const at::Tensor kk = at::matmul(K, K.transpose(-1, -2));                              // [.., C, C]
  const at::Tensor L = (Bt.unsqueeze(-1) * kk * gamma).masked_fill(strict.logical_not(), 0.0);
  const at::Tensor I = at::eye(C, opts);
  const at::Tensor M = I + L;                                                            // unit lower triangular
  const at::Tensor rhs_v = Bt.unsqueeze(-1) * V;                                         // [.., C, Dv]
  const at::Tensor rhs_k = (Bt * G.exp()).unsqueeze(-1) * K;                             // [.., C, Dk]
  const at::Tensor Uv = at::linalg_solve_triangular(M, rhs_v, /*upper=*/false, /*left=*/true, /*unitriangular=*/true);
  const at::Tensor Wk = at::linalg_solve_triangular(M, rhs_k, /*upper=*/false, /*left=*/true, /*unitriangular=*/true);
  // Intra-chunk attention (Q K^T masked by decay, i <= t) and the decays the state needs.
  const at::Tensor P = at::matmul(Q, K.transpose(-1, -2)) * gamma;                       // [.., C, C]
  const at::Tensor qdecay = G.exp().unsqueeze(-1) * Q;                                   // e^{G_t} q_t
  const at::Tensor G_last = G.select(-1, C - 1);                                         // [B, H, N]
  const at::Tensor kdecay = (G_last.unsqueeze(-1) - G).exp().unsqueeze(-1) * K;          // e^{G_C - G_i} k_i

  at::Tensor S = initial_state.defined() ? initial_state.to(acc) : at::zeros({B, H, Dk, Dv}, opts);
  std::vector<at::Tensor> outs;
  outs.reserve(static_cast<size_t>(N));
  for (int64_t n = 0; n < N; ++n) {
    const at::Tensor U = Uv.select(2, n) - at::matmul(Wk.select(2, n), S);              // [B, H, C, Dv]
    const at::Tensor O = at::matmul(qdecay.select(2, n), S) + at::matmul(P.select(2, n), U);
    outs.push_back(O * scale);
    S = G_last.select(2, n).exp().view({B, H, 1, 1}) * S + at::matmul(kdecay.select(2, n).transpose(-1, -2), U);
  }
  at::Tensor o = at::stack(outs, 2).reshape({B, H, N * C, Dv}).narrow(2, 0, T).transpose(1, 2);  // [B, T, H, Dv]
  return {o.to(v.scalar_type()), S};
}

}  // namespace hh::attention
