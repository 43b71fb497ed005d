#include "core/attention/gdn.h"

#include <ATen/record_function.h>
#include <torch/torch.h>

#include <limits>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include "core/model/summary.h"
#include "core/util/error.h"
#ifdef HH_HAVE_KERNELS
#include "kernels/gdn.h"
#endif

namespace hh::attention {
namespace {

// A named range in profiler traces (`bench gdn --profile`; scripts/gpu/trace_summary.py --by-scope hh::)
// around each stage of the rule, so that kernel time can be charged to the stage that launched it.
#define HH_GDN_SCOPE(name) RECORD_FUNCTION("hh::gdn::" name, std::vector<c10::IValue>())

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

// ---- gdn_chunked_scan ------------------------------------------------------------------------------

namespace {

// The LibTorch form of hydrahead::gdn_state_scan, for any device and dtype: the loop the kernel runs.
std::tuple<at::Tensor, at::Tensor> state_scan_reference(const at::Tensor& P, const at::Tensor& Z, const at::Tensor& y0,
                                                        at::IntArrayRef offsets, bool reverse) {
  at::Tensor hist = at::empty_like(Z);
  std::vector<at::Tensor> finals;
  for (int64_t s = 0; s + 1 < static_cast<int64_t>(offsets.size()); ++s) {
    at::Tensor Y = y0.select(0, s);  // [H, Dk, Dv]
    const int64_t a = offsets[s], b = offsets[s + 1];
    for (int64_t i = 0; i < b - a; ++i) {
      const int64_t n = reverse ? b - 1 - i : a + i;
      hist.select(1, n).copy_(Y);
      Y = at::matmul(P.select(1, n).transpose(-1, -2), Y) + Z.select(1, n);
    }
    finals.push_back(Y);
  }
  return {hist, finals.empty() ? at::empty_like(y0) : at::stack(finals, 0)};
}

void check_scan_args(const at::Tensor& P, const at::Tensor& Z, const at::Tensor& y0, at::IntArrayRef offsets) {
  if (P.dim() != 4 || Z.dim() != 4 || y0.dim() != 4 || P.size(2) != P.size(3) || Z.size(0) != P.size(0) ||
      Z.size(1) != P.size(1) || Z.size(2) != P.size(2) || y0.size(1) != P.size(0) || y0.size(2) != P.size(2) ||
      y0.size(3) != Z.size(3))
    throw Error("gdn_state_scan: expected P [H, N, Dk, Dk], Z [H, N, Dk, Dv], y0 [S, H, Dk, Dv], got " +
                shape_str(P.sizes()) + ", " + shape_str(Z.sizes()) + ", " + shape_str(y0.sizes()));
  if (static_cast<int64_t>(offsets.size()) != y0.size(0) + 1 || offsets.front() != 0 || offsets.back() != P.size(1))
    throw Error("gdn_state_scan: offsets must hold S + 1 = " + std::to_string(y0.size(0) + 1) + " values from 0 to N = " +
                std::to_string(P.size(1)));
  for (size_t i = 1; i < offsets.size(); ++i)
    if (offsets[i] < offsets[i - 1]) throw Error("gdn_state_scan: offsets must not decrease");
}

std::tuple<at::Tensor, at::Tensor> state_scan_cpu(const at::Tensor& P, const at::Tensor& Z, const at::Tensor& y0,
                                                  at::IntArrayRef offsets, bool reverse) {
  check_scan_args(P, Z, y0, offsets);
  return state_scan_reference(P, Z, y0, offsets, reverse);
}

std::tuple<at::Tensor, at::Tensor> state_scan_cuda(const at::Tensor& P, const at::Tensor& Z, const at::Tensor& y0,
                                                   at::IntArrayRef offsets, bool reverse) {
  check_scan_args(P, Z, y0, offsets);
#ifdef HH_HAVE_KERNELS
  if (kernels::state_scan_supported(P.size(2), Z.size(3), P.scalar_type()) && Z.scalar_type() == P.scalar_type() &&
      y0.scalar_type() == P.scalar_type()) {
    at::Tensor hist = at::empty_like(Z);
    const at::Tensor fin =
        kernels::state_scan(P.contiguous(), Z.contiguous(), y0.contiguous(), offsets.vec(), reverse, hist);
    return {hist, fin};
  }
#endif
  return state_scan_reference(P, Z, y0, offsets, reverse);
}

}  // namespace

TORCH_LIBRARY(hydrahead, m) {
  m.def("gdn_state_scan(Tensor P, Tensor Z, Tensor y0, int[] offsets, bool reverse) -> (Tensor, Tensor)");
  m.def(
      "chunk_gated_delta_rule(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, Tensor? initial_state, float scale, "
      "int chunk, int[] cu_seqlens) -> (Tensor, Tensor)");
}
TORCH_LIBRARY_IMPL(hydrahead, CPU, m) { m.impl("gdn_state_scan", &state_scan_cpu); }
TORCH_LIBRARY_IMPL(hydrahead, CUDA, m) { m.impl("gdn_state_scan", &state_scan_cuda); }

ScanResult gdn_state_scan(const at::Tensor& P, const at::Tensor& Z, const at::Tensor& y0,
                          const std::vector<int64_t>& offsets, bool reverse) {
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("hydrahead::gdn_state_scan", "")
          .typed<std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                                    at::IntArrayRef, bool)>();
  auto [hist, fin] = op.call(P, Z, y0, at::IntArrayRef(offsets), reverse);
  return {hist, fin};
}

namespace {

// Where each sequence's tokens go in the chunk grid: sequences are padded to whole chunks and laid
// end to end, N chunks in all; chunk tensors are [H, N, C, ...].
struct ChunkLayout {
  bool regular = false;          // B sequences of T tokens (no cu_seqlens): chunk b * (N / B) + n
  int64_t rows = 0;              // B * T input rows
  int64_t C = 0, N = 0;          // chunk length, chunks in all
  std::vector<int64_t> offsets;  // S + 1 chunk offsets
  at::Tensor gather;             // [N * C] input row of each grid slot (rows = the zero row of padding)
  at::Tensor scatter;            // [rows] grid slot of each input row
};

ChunkLayout make_layout(int64_t B, int64_t T, int64_t C, const std::vector<int64_t>& cu_seqlens, const at::Device& dev) {
  ChunkLayout L;
  L.regular = cu_seqlens.empty();
  L.rows = B * T;
  L.C = C;
  std::vector<int64_t> starts, lens;
  if (cu_seqlens.empty()) {
    for (int64_t b = 0; b < B; ++b) starts.push_back(b * T), lens.push_back(T);
  } else {
    if (B != 1) throw Error("gated delta rule: cu_seqlens needs the sequences packed into one row (B = 1), got B = " +
                            std::to_string(B));
    if (cu_seqlens.size() < 2 || cu_seqlens.front() != 0 || cu_seqlens.back() != T)
      throw Error("gated delta rule: cu_seqlens must run from 0 to T = " + std::to_string(T));
    for (size_t i = 1; i < cu_seqlens.size(); ++i) {
      if (cu_seqlens[i] < cu_seqlens[i - 1])
        throw Error("gated delta rule: cu_seqlens must not decrease (entry " + std::to_string(i) + ")");
      starts.push_back(cu_seqlens[i - 1]);
      lens.push_back(cu_seqlens[i] - cu_seqlens[i - 1]);
    }
  }
  L.offsets.push_back(0);
  for (int64_t len : lens) L.offsets.push_back(L.offsets.back() + (len + C - 1) / C);
  L.N = L.offsets.back();
  if (L.regular) return L;  // to_chunks / from_chunks pad and permute instead
  std::vector<int64_t> gather(static_cast<size_t>(L.N * C), L.rows), scatter(static_cast<size_t>(L.rows));
  for (size_t s = 0; s < starts.size(); ++s)
    for (int64_t p = 0; p < lens[s]; ++p) {
      const int64_t slot = L.offsets[s] * C + p;
      gather[static_cast<size_t>(slot)] = starts[s] + p;
      scatter[static_cast<size_t>(starts[s] + p)] = slot;
    }
  // On a GPU from pinned memory, so that the copies queue behind the stream's work instead of waiting.
  auto upload = [&](const std::vector<int64_t>& v) {
    at::Tensor t = at::tensor(at::ArrayRef<int64_t>(v), at::TensorOptions().dtype(at::kLong));
    return dev.is_cuda() ? t.pin_memory().to(dev, /*non_blocking=*/true) : t;
  };
  L.gather = upload(gather);
  L.scatter = upload(scatter);
  return L;
}

// A contiguous copy of x * scale in `dtype` (x.to() may hand back x itself, strides and all). The
// product is taken in the wider of the two dtypes: in the same pass when that is x's (a binary op
// computes in its inputs' dtype), else after widening.
at::Tensor dense_copy(const at::Tensor& x, at::ScalarType dtype, double scale = 1.0) {
  at::Tensor out = at::empty(x.sizes(), x.options().dtype(dtype));
  if (scale == 1.0) return out.copy_(x);
  if (at::promoteTypes(x.scalar_type(), dtype) != x.scalar_type()) return out.copy_(x).mul_(scale);
  return at::mul_out(out, x, at::scalar_tensor(scale, at::TensorOptions().dtype(x.scalar_type())));
}

// [B, T, H, ...] -> [H, N, C, ...] in dtype acc, padding slots zero, times `scale` (in the same pass
// for regular batches).
at::Tensor to_chunks(const at::Tensor& x, const ChunkLayout& L, at::ScalarType acc, double scale = 1.0) {
  HH_GDN_SCOPE("to_chunks");
#ifdef HH_HAVE_KERNELS
  // (Not where a graph is recorded through the copy: the kernel has no backward.)
  if (L.regular && x.is_cuda() && x.dim() == 4 && acc == at::kFloat && x.is_contiguous() &&
      !(at::GradMode::is_enabled() && x.requires_grad()) &&
      kernels::chunk_grid_copy_supported(x.size(3), x.scalar_type()) && reinterpret_cast<uintptr_t>(x.data_ptr()) % 16 == 0)
    return kernels::to_chunk_grid(x, L.C, scale);  // one pass with 16-byte accesses
#endif
  if (L.regular) {  // pad T to whole chunks, then one permuting copy (with the dtype change)
    const int64_t B = x.size(0), T = x.size(1), per = L.N / std::max<int64_t>(B, 1), pad = per * L.C - T;
    at::Tensor f = x;
    if (pad > 0) {
      std::vector<int64_t> spec(static_cast<size_t>(2 * (x.dim() - 1)), 0);
      spec.back() = pad;  // constant_pad_nd pads from the last dimension backwards; T is dimension 1
      f = at::constant_pad_nd(f, spec, 0);
    }
    std::vector<int64_t> grid = {B, per, L.C};
    std::vector<int64_t> perm = {3, 0, 1, 2};  // [H, B, per, C, ...]
    for (int64_t i = 2; i < x.dim(); ++i) grid.push_back(x.size(i));
    for (int64_t i = 4; i < static_cast<int64_t>(grid.size()); ++i) perm.push_back(i);
    f = f.reshape(grid).permute(perm);
    std::vector<int64_t> out = {x.size(2), L.N, L.C};
    for (int64_t i = 3; i < x.dim(); ++i) out.push_back(x.size(i));
    return dense_copy(f, acc, scale).view(out);
  }
  std::vector<int64_t> flat = {L.rows};
  for (int64_t i = 2; i < x.dim(); ++i) flat.push_back(x.size(i));
  at::Tensor f = x.to(acc).reshape(flat);
  if (scale != 1.0) f = f * scale;
  std::vector<int64_t> zero_shape = flat;
  zero_shape[0] = 1;
  f = at::cat({f, at::zeros(zero_shape, f.options())}, 0).index_select(0, L.gather);  // [N*C, H, ...]
  std::vector<int64_t> grid = {L.N, L.C};
  grid.insert(grid.end(), flat.begin() + 1, flat.end());
  f = f.view(grid);  // [N, C, H, ...]
  std::vector<int64_t> perm = {2, 0, 1};
  for (int64_t i = 3; i < f.dim(); ++i) perm.push_back(i);
  return f.permute(perm).contiguous();
}

// [H, N, C, D] -> [B, T, H, D] in dtype `dtype`, times `scale` (in the same pass for regular batches)
at::Tensor from_chunks(const at::Tensor& x, const ChunkLayout& L, int64_t B, int64_t T, at::ScalarType dtype,
                       double scale = 1.0) {
  HH_GDN_SCOPE("from_chunks");
  const int64_t H = x.size(0), D = x.size(3);
#ifdef HH_HAVE_KERNELS
  if (L.regular && x.is_cuda() && x.scalar_type() == at::kFloat && kernels::chunk_grid_copy_supported(D, dtype) &&
      !(at::GradMode::is_enabled() && x.requires_grad()))
    return kernels::from_chunk_grid(x.contiguous(), B, T, dtype, scale);  // one pass with 16-byte accesses
#endif
  if (L.regular)
    return dense_copy(x.reshape({H, B, -1, D}).narrow(2, 0, T).permute({1, 2, 0, 3}), dtype, scale);
  const at::Tensor y = scale == 1.0 ? x : x * scale;
  return y.permute({1, 2, 0, 3}).reshape({L.N * L.C, H, D}).index_select(0, L.scatter).view({B, T, H, D}).to(dtype);
}

#ifdef HH_HAVE_KERNELS
// T = (I + L)^{-1} of strictly lower triangular L by the CUDA kernel; backward dL = -(T^T dT T^T),
// kept strictly lower.
class UnitLowerInverse : public torch::autograd::Function<UnitLowerInverse> {
 public:
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx, const at::Tensor& L) {
    at::Tensor T = kernels::unit_lower_inverse(L.contiguous());
    ctx->save_for_backward({T});
    return {T};
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const at::Tensor T = ctx->get_saved_variables()[0];
    const at::Tensor Tt = T.transpose(-1, -2);
    return {(-at::matmul(at::matmul(Tt, grads[0]), Tt)).tril(-1)};
  }
};
#endif

// T = (I + L)^{-1} for strictly lower triangular L [..., C, C], differentiable: the inverse kernel on
// CUDA float32 with C <= 64, else one triangular solve against the identity.
at::Tensor unit_lower_inverse_of(const at::Tensor& L) {
#ifdef HH_HAVE_KERNELS
  if (L.is_cuda() && L.scalar_type() == at::kFloat && L.size(-1) <= 64) return UnitLowerInverse::apply(L)[0];
#endif
  const at::Tensor I = at::eye(L.size(-1), L.options());
  return at::linalg_solve_triangular(L + I, I.expand(L.sizes()), /*upper=*/false, /*left=*/true, /*unitriangular=*/true);
}

// Float32 matrix products on CUDA may use TF32 tensor cores while the rule runs on 16-bit inputs
// (whose own rounding is coarser); restores the previous setting on exit.
class Tf32Scope {
 public:
  explicit Tf32Scope(bool on) : active_(on) {
    if (!active_) return;
    previous_ = at::globalContext().allowTF32CuBLAS();
    at::globalContext().setAllowTF32CuBLAS(true);
  }
  ~Tf32Scope() {
    if (active_) at::globalContext().setAllowTF32CuBLAS(previous_);
  }
  Tf32Scope(const Tf32Scope&) = delete;
  Tf32Scope& operator=(const Tf32Scope&) = delete;

 private:
  bool active_;
  bool previous_ = false;
};

bool use_tf32(const at::Tensor& q) {
  return q.is_cuda() && (q.scalar_type() == at::kBFloat16 || q.scalar_type() == at::kHalf);
}

// The chunk-local part of the rule for all chunks at once (the first half of gdn_chunked above,
// on the chunk grid), with the intermediates the explicit backward reuses. Differentiable LibTorch.
struct ChunkLocal {
  at::Tensor G, eG;     // [H, N, C]: cumulative log decay G_t, e^{G_t}
  at::Tensor gamma;     // [H, N, C, C]: e^{G_t - G_i} for i <= t, else 0
  at::Tensor KK, QK;    // K K^T, Q K^T
  at::Tensor L, T;      // L[t, i] = beta_t e^{G_t - G_i} k_t.k_i (i < t); T = (I + L)^{-1}
  at::Tensor Kb, Vb;    // diag(beta e^G) K, diag(beta) V
  at::Tensor W, U;      // [H, N, C, Dk], [H, N, C, Dv]: T Kb, T Vb
  at::Tensor attn;      // [H, N, C, C]: (Q K^T) * gamma
  at::Tensor qdecay;    // e^{G_t} q_t
  at::Tensor kd;        // [H, N, C]: e^{G_C - G_i}
  at::Tensor kdecay;    // e^{G_C - G_i} k_i
  at::Tensor dl;        // [H, N]: e^{G_C}
};

ChunkLocal chunk_local(const at::Tensor& Q, const at::Tensor& K, const at::Tensor& V, const at::Tensor& g,
                       const at::Tensor& beta) {
  HH_GDN_SCOPE("chunk_local");
  const int64_t C = Q.size(2);
  const auto opts = Q.options();
  ChunkLocal r;
  r.G = g.cumsum(-1);
  r.eG = r.G.exp();
  const at::Tensor incl = at::ones({C, C}, opts.dtype(at::kBool)).tril();
  r.gamma = (r.G.unsqueeze(-1) - r.G.unsqueeze(-2)).masked_fill(incl.logical_not(), -std::numeric_limits<double>::infinity()).exp();
  const at::Tensor Kt = K.transpose(-1, -2);
  r.KK = at::matmul(K, Kt);
  r.L = (beta.unsqueeze(-1) * r.KK * r.gamma).tril(-1);
  r.T = unit_lower_inverse_of(r.L);
  r.Kb = (beta * r.eG).unsqueeze(-1) * K;
  r.Vb = beta.unsqueeze(-1) * V;
  r.W = at::matmul(r.T, r.Kb);
  r.U = at::matmul(r.T, r.Vb);
  r.QK = at::matmul(Q, Kt);
  r.attn = r.QK * r.gamma;
  r.qdecay = r.eG.unsqueeze(-1) * Q;
  const at::Tensor G_last = r.G.select(-1, C - 1);  // [H, N]
  r.kd = (G_last.unsqueeze(-1) - r.G).exp();
  r.kdecay = r.kd.unsqueeze(-1) * K;
  r.dl = G_last.exp();
  return r;
}

// P_n with S_{n+1} = P_n^T S_n + Z_n: P_n^T = e^{G_C} I - kdecay^T W.
at::Tensor transition(const ChunkLocal& c, bool transposed) {
  const int64_t Dk = c.W.size(-1);
  const at::Tensor eye = at::eye(Dk, c.W.options());
  const at::Tensor KW = transposed ? at::matmul(c.kdecay.transpose(-1, -2), c.W)   // P_n^T
                                   : at::matmul(c.W.transpose(-1, -2), c.kdecay);  // P_n
  return c.dl.unsqueeze(-1).unsqueeze(-1) * eye - KW;
}

// Whether the scan can run on the transition's factors (kernels::low_rank_scan) rather than on the
// materialised P_n (hydrahead::gdn_state_scan): a CUDA float32 chunk grid of the kernel's shapes,
// unless a benchmark asked for one of the P_n kernels.
bool low_rank_scan_ok(const ChunkLocal& c) {
#ifdef HH_HAVE_KERNELS
  return c.W.is_cuda() && c.W.scalar_type() == at::kFloat && kernels::state_scan_kernel() == kernels::ScanKernel::kLowRank &&
         kernels::low_rank_scan_supported(c.W.size(2), c.W.size(3), c.U.size(3));
#else
  (void)c;
  return false;
#endif
}

// Whether the forward runs on the chunk kernels (kernels::chunk_factors / chunk_output around the
// low-rank scan): 16-bit CUDA inputs of their shapes, unless a benchmark asked for another path.
bool chunk_kernels_ok(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, int64_t chunk) {
#ifdef HH_HAVE_KERNELS
  return q.is_cuda() && chunk == 64 && k.scalar_type() == q.scalar_type() && v.scalar_type() == q.scalar_type() &&
         kernels::chunk_kernels_enabled() && kernels::state_scan_kernel() == kernels::ScanKernel::kLowRank &&
         kernels::chunk_forward_supported(q.size(3), v.size(3), q.scalar_type());
#else
  (void)q, (void)k, (void)v, (void)chunk;
  return false;
#endif
}

#ifdef HH_HAVE_KERNELS
// x contiguous and 16-byte aligned, as the chunk kernels read it (a copy only when it is not).
at::Tensor aligned(const at::Tensor& x) {
  at::Tensor c = x.contiguous();
  return reinterpret_cast<uintptr_t>(c.data_ptr()) % 16 == 0 ? c : c.clone();
}
// A gate (g or beta) as chunk_factors and chunk_backward read it: where it lies in float32 or in q's
// dtype (the kernels convert each value as they read it), else converted to float32 first.
// chunk_backward writes each gate's gradient in the dtype it read that gate in.
at::Tensor gate_for_kernels(const at::Tensor& x, const at::Tensor& q) {
  return aligned(x.scalar_type() == at::kFloat || x.scalar_type() == q.scalar_type() ? x : x.to(at::kFloat));
}

struct ForwardScan {
  at::Tensor S, M, final_state;       // each chunk's start state, its new values U - W S, the final state
  at::Tensor S16, S_inv, M16, M_inv;  // S and M in block float16 (LowRankScanArgs), for chunk_output_f16
};
// Where a scan's U comes from: U [H, N, C, Dv] (float32, or float16 by columns with its scales U_inv, the
// column scan's form); or, with from_v (the scan writing the output, U undefined), formed by the scan itself
// from v and chunk_factors' T diag(beta).
struct ScanU {
  at::Tensor U, U_inv;
  std::optional<kernels::LowRankScanArgs::UFromV> from_v;
  int64_t Dv() const { return from_v ? from_v->v.size(3) : U.size(3); }
};
// S_{n+1} = decay_n S_n + kdecay_n^T (U_n - W_n S_n) from s0 (undefined: from zero, with no kernel to zero
// it), on the factors (kernels::low_rank_scan).
// With f16_history (kBlockFloat16 only), S and M in block float16 instead of float32. With keep_states
// and kBlockFloat16, S also in block float16, for the backward's chunk kernels. Given `output` (with
// f16_history), the scan writes the output itself, and the history only where keep_states asks for S.
ForwardScan forward_scan(const at::Tensor& kdecay, const at::Tensor& W, const ScanU& u, const at::Tensor& decay,
                         const at::Tensor& bound, const at::Tensor& s0, const std::vector<int64_t>& offsets,
                         kernels::ScanPrecision precision, bool f16_history = false, bool keep_states = false,
                         const kernels::LowRankScanArgs::Output* output = nullptr) {
  const int64_t H = W.size(0), N = W.size(1), C = W.size(2), Dk = W.size(3), Dv = u.Dv();
  const auto f16 = W.options().dtype(at::kHalf), f32 = W.options().dtype(at::kFloat);
  kernels::LowRankScanArgs a;
  a.A = kdecay;
  a.B = W;
  a.decay = decay.contiguous();
  a.U = u.U;
  a.U_inv = u.U_inv;
  if (u.from_v) a.u_from_v = *u.from_v;
  a.zero_start = !s0.defined();
  a.y0 = a.zero_start ? at::empty({static_cast<int64_t>(offsets.size()) - 1, H, Dk, Dv}, f32) : s0.contiguous();
  a.precision = precision;
  // The segmented scan starts its pieces where the transitions' norm bounds allow.
  if (precision == kernels::ScanPrecision::kBlockFloat16 && bound.defined()) {
    a.segment = kernels::scan_segments();
    a.bound = bound;
  }
  if (output != nullptr) a.output = *output;
  if ((f16_history && output == nullptr) || (keep_states && precision == kernels::ScanPrecision::kBlockFloat16)) {
    a.S16 = at::empty({H, N, Dk, Dv}, f16);
    a.S_inv = at::empty({H, N, Dk / 16, Dv / 16}, f32);
  }
  // The backward's chunk kernel reads the new values too where its reverse scan forms the direct term.
  const bool keep_m = keep_states && f16_history && kernels::direct_in_scan_enabled();
  if ((f16_history && output == nullptr) || keep_m) {
    a.M16 = at::empty({H, N, C, Dv}, f16);
    a.M_inv = at::empty({H, N, C / 16, Dv / 8}, f32);
  } else if (!f16_history) {
    a.hist = at::empty({H, N, Dk, Dv}, f32);
    a.M = at::empty({H, N, C, Dv}, f32);
  }
  const at::Tensor fin = kernels::low_rank_scan(a, offsets);
  return {a.hist, a.M, fin, a.S16, a.S_inv, a.M16, a.M_inv};
}
#endif

struct ChunkedInputs {
  at::Tensor Q, K, V, g, beta;
};
ChunkedInputs chunk_inputs(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
                           const at::Tensor& beta, const ChunkLayout& L, at::ScalarType acc) {
  return {to_chunks(q, L, acc), to_chunks(k, L, acc), to_chunks(v, L, acc), to_chunks(g, L, acc),
          to_chunks(beta, L, acc)};
}

GdnBackward g_backward = GdnBackward::kKernels;

struct StateGrads {
  at::Tensor dS_end;  // [H, N, Dk, Dv]: the gradient of the state at the end of each chunk
  at::Tensor dS0;     // [S, H, Dk, Dv]: of the initial states
};
// The reverse scan dS_n = P_n dS_{n+1} + X_n from dS_end of the last chunks = dfin, with
// X_n = (qdecay - attn W)^T dO_n (dO scaled): on the transition's factors where the kernel applies.
StateGrads state_gradients(const ChunkLocal& c, const at::Tensor& beta, const at::Tensor& dOs, const at::Tensor& dfin,
                           const std::vector<int64_t>& offsets, bool precise) {
  HH_GDN_SCOPE("state_gradients");
  const at::Tensor X = at::matmul((c.qdecay - at::matmul(c.attn, c.W)).transpose(-1, -2), dOs);
  StateGrads r;
  if (low_rank_scan_ok(c)) {
#ifdef HH_HAVE_KERNELS
    HH_GDN_SCOPE("reverse_scan");
    // dS_n = e^{G_C} dS_{n+1} - W^T (kdecay dS_{n+1}) + X_n: P_n applied through its factors.
    kernels::LowRankScanArgs a;
    a.A = c.W;
    a.B = c.kdecay;
    a.decay = c.dl.contiguous();
    a.Z = X.contiguous();
    a.y0 = dfin;
    a.hist = at::empty_like(a.Z);
    a.reverse = true;
    a.precision = precise ? kernels::ScanPrecision::kFloat32 : kernels::ScanPrecision::kTf32;
    if (!precise && kernels::block_f16_scan_enabled()) {
      // The forward's choice for 16-bit inputs: float16 factors (as exact as the TF32 rounding of the
      // float32 ones) and block float16 products.
      a.A = c.W.to(at::kHalf);
      a.B = c.kdecay.to(at::kHalf);
      a.precision = kernels::ScanPrecision::kBlockFloat16;
      a.segment = kernels::scan_segments();
      // The log of each chunk's transition norm bound, G_C + sum_t log max(1, |1 - beta_t k_t.k_t|), as
      // kernels::chunk_factors forms it (P_n's norm is P_n^T's).
      a.bound = (c.G.select(-1, -1) + (1 - beta * c.KK.diagonal(0, -2, -1)).abs_().clamp_min_(1).log_().sum(-1))
                    .to(at::kFloat)
                    .contiguous();
    }
    r.dS0 = kernels::low_rank_scan(a, offsets);
    r.dS_end = a.hist;
#endif
  } else {
    const ScanResult scan =
        gdn_state_scan(transition(c, /*transposed=*/true).contiguous(), X.contiguous(), dfin, offsets, /*reverse=*/true);
    r.dS_end = scan.hist;
    r.dS0 = scan.final_state;
  }
  return r;
}

// <a_n, b_n> for every chunk of two [H, N, Dk, Dv] contiguous tensors, as a batched dot product (no
// state-sized temporary): [H, N].
at::Tensor chunk_dot(const at::Tensor& a, const at::Tensor& b) {
  const int64_t chunks = a.size(0) * a.size(1), state = a.size(2) * a.size(3);
#ifdef HH_HAVE_KERNELS
  if (a.is_cuda() && a.scalar_type() == at::kFloat && b.scalar_type() == at::kFloat)
    return kernels::row_dot(a.reshape({chunks, state}), b.reshape({chunks, state})).view({a.size(0), a.size(1)});
#endif
  return at::bmm(a.reshape({chunks, 1, state}), b.reshape({chunks, state, 1})).view({a.size(0), a.size(1)});
}

struct ChunkGrads {
  at::Tensor dQ, dK, dV, dg, dbeta;  // on the chunk grid
};
// The gradients of J = <dO, O> + <dS_end, S_next> through the chunk-local function of every chunk,
// with its start state S and dS_end held fixed (the scan has accounted for them), by hand:
//   M = U - W S;  O = qdecay S + attn M;  S_next = e^{G_C} S + kdecay^T M
//   dM = attn^T dO + kdecay dS_end,  dattn = dO M^T,  dqdecay = dO S^T,  dkdecay = M dS_end^T,
//   dU = dM,  dW = -dM S^T,  dT = dU Vb^T + dW Kb^T,  dL = -T^T dT T^T (strictly lower),
// then each factor's inputs (q, k, v, beta, and G through every e^{...}); dg is the reverse cumulative
// sum of dG.
ChunkGrads chunk_local_backward(const ChunkLocal& c, const ChunkedInputs& in, const at::Tensor& S,
                                const at::Tensor& dS_end, const at::Tensor& dO) {
  HH_GDN_SCOPE("chunk_local_backward");
  auto t = [](const at::Tensor& x) { return x.transpose(-1, -2); };
  auto rowsum = [](const at::Tensor& a, const at::Tensor& b) {
#ifdef HH_HAVE_KERNELS
    if (a.is_cuda() && a.scalar_type() == at::kFloat && b.scalar_type() == at::kFloat && a.sizes() == b.sizes())
      return kernels::row_dot(a.contiguous(), b.contiguous());  // one pass, no product tensor
#endif
    return (a * b).sum(-1);
  };
  // acc += alpha a b in the product's epilogue (acc a fresh [..., m, n] tensor of ours): no pass of
  // its own for the sum.
  auto mm_acc = [](at::Tensor& acc, const at::Tensor& a, const at::Tensor& b, double alpha) {
    auto flat = [](const at::Tensor& x) { return x.reshape({-1, x.size(-2), x.size(-1)}); };
    at::Tensor view = acc.view({-1, acc.size(-2), acc.size(-1)});
    view.baddbmm_(flat(a), flat(b), 1.0, alpha);
  };
  const at::Tensor M = c.U - at::matmul(c.W, S);
  at::Tensor dM = at::matmul(t(c.attn), dO);
  mm_acc(dM, c.kdecay, dS_end, 1.0);
  const at::Tensor dQK = at::matmul(dO, t(M)).mul_(c.gamma);  // d(Q K^T) through attn = QK * gamma
  const at::Tensor dqdecay = at::matmul(dO, t(S));
  const at::Tensor dkdecay = at::matmul(M, t(dS_end));
  const at::Tensor ndW = at::matmul(dM, t(S));  // -dW: the sign goes into the terms that use it
  const at::Tensor Tt = t(c.T);
  const at::Tensor dVb = at::matmul(Tt, dM), ndKb = at::matmul(Tt, ndW);  // ndKb = -dKb
  at::Tensor dT = at::matmul(dM, t(c.Vb));
  mm_acc(dT, ndW, t(c.Kb), -1.0);
  const at::Tensor dL = at::matmul(at::matmul(Tt, dT), Tt).neg_().tril_(-1);
  const at::Tensor dLg = dL * c.gamma;                         // dL e^{G_t - G_i}
  const at::Tensor dKK = in.beta.unsqueeze(-1) * dLg;          // d(K K^T) through L = beta_t KK gamma
  ChunkGrads r;
  r.dQ = c.eG.unsqueeze(-1) * dqdecay;
  mm_acc(r.dQ, dQK, in.K, 1.0);
  r.dK = (-(in.beta * c.eG)).unsqueeze(-1) * ndKb;
  r.dK.addcmul_(c.kd.unsqueeze(-1), dkdecay);
  mm_acc(r.dK, t(dQK), in.Q, 1.0);
  mm_acc(r.dK, dKK + t(dKK), in.K, 1.0);
  r.dV = in.beta.unsqueeze(-1) * dVb;
  const at::Tensor kb_dot = rowsum(ndKb, in.K).neg_();         // <dKb_t, k_t>
  r.dbeta = rowsum(dLg, c.KK).add_(rowsum(dVb, in.V)).add_(c.eG * kb_dot);
  // G: each e^{G_t - G_i} term X (attn and L) gives dG_t += sum_i dX X and dG_i -= sum_t dX X.
  const at::Tensor XA = dQK * c.QK, XL = dL * c.L;
  const at::Tensor kd_dot = c.kd * rowsum(dkdecay, in.K);      // kdecay_i = e^{G_C - G_i} k_i
  at::Tensor dG = c.eG * rowsum(dqdecay, in.Q);
  dG.add_(in.beta * c.eG * kb_dot).add_(XA.sum(-1) - XA.sum(-2)).add_(XL.sum(-1) - XL.sum(-2)).sub_(kd_dot);
  const int64_t C = dG.size(-1);
  dG.select(-1, C - 1).add_(kd_dot.sum(-1)).add_(c.dl * chunk_dot(S, dS_end));  // through G_C
  r.dg = dG.flip({-1}).cumsum(-1).flip({-1});
  return r;
}

#ifdef HH_HAVE_KERNELS
// The forward on the chunk kernels (chunk_kernels_ok): chunk_factors, the scan, then every chunk's
// output, into o, or, given `fusion`, through the fusion norm into *y (o left undefined: inference,
// with the block float16 history only). With keep_states, what the backward needs besides.
struct KernelForward {
  at::Tensor o, final_state;
  at::Tensor W16, kdecay16, decay, bound;  // the transition factors, for the backward's reverse scan
  at::Tensor S, S16, S_inv;                // the chunks' start states (S16 and S_inv where the scan wrote them)
  at::Tensor Qd, Aq, aq_inv;               // the output's factors, for the reverse scan's direct term
  at::Tensor M16, M_inv;                   // the new values in block float16, for the backward's chunk kernel
  at::Tensor T16;                          // every chunk's T, for the backward's chunk kernel (with M16)
  at::Tensor QK;                           // where the scans form Qd and kdecay from q and k (then neither kept): their rows' scales
};
// Given `conv`, q, k and v are the projections before the short convolution, which chunk_factors applies.
// s0 undefined: every sequence starts from zero.
KernelForward kernel_forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
                             const at::Tensor& beta, const at::Tensor& s0, double scale, const ChunkLayout& L,
                             bool keep_states, const kernels::OutputFusion* fusion = nullptr, at::Tensor* y = nullptr,
                             const kernels::ShortConvInputs* conv = nullptr,
                             const std::function<void(GdnStage)>& on_queued = {}) {
  const int64_t B = q.size(0), T = q.size(1);
  // The chunk kernels read q, k, v, g and beta where they lie; the scan runs between them.
  const kernels::ChunkGrid grid{L.N, L.regular ? L.N / std::max<int64_t>(B, 1) : 0, L.gather};
  const at::Tensor qc = aligned(q), kc = aligned(k), vc = aligned(v), gk = gate_for_kernels(g, q),
                   bk = gate_for_kernels(beta, q);
  // With the block float16 history, the scan hands the output kernel its float16 states and new
  // values, and chunk_factors forms the output's factors from q. For a backward the scan keeps the
  // states in block float16 either way (the backward's chunk kernels read them so).
  const bool f16_history = kernels::block_f16_scan_enabled() && kernels::f16_history_enabled();
  if (fusion != nullptr && !f16_history)
    throw std::logic_error("hh::attention::kernel_forward: the fused output needs the block float16 history");
  if (conv != nullptr && !f16_history)
    throw std::logic_error("hh::attention::kernel_forward: the short convolution inside chunk_factors needs the block float16 history");
  // The scan writes the output itself (kernels::set_output_in_scan), or hands its history to the output kernel.
  const bool output_in_scan = f16_history && kernels::output_in_scan_enabled();
  // With the fusion, the scan applies it itself where asked and where it can: the column scan (a head a
  // block) with kernels::set_fusion_in_column_scan, a cluster of a head's column blocks with
  // kernels::set_fusion_in_scan; the output kernel's fusion's layout conditions, y of q's dtype.
  const int64_t Dk = k.size(3), Dv = v.size(3);
  const bool fuse_in_scan = output_in_scan && fusion != nullptr &&
                            (kernels::fusion_in_scan_enabled() || kernels::column_scan_fuses(Dk, Dv)) &&
                            kernels::scan_output_fusion_supported(Dk, Dv) && kernels::scan_columns() != 16 &&
                            kernels::chunk_output_fusion_fits(*fusion, *y) && y->scalar_type() == q.scalar_type() &&
                            fusion->gate.scalar_type() == q.scalar_type() && fusion->gamma.scalar_type() == q.scalar_type();
  // The column scan reads U in float16 by columns: half U's bytes written by chunk_factors and read by the
  // scan. It keeps the states for a backward (the float16 history) with o written, not through the fusion.
  const bool u16 = output_in_scan && !(keep_states && fuse_in_scan) && kernels::column_scan_takes(Dk, Dv, fuse_in_scan);
  // A forward kept for the backward's chunk kernel keeps T too, where that kernel will read M (below).
  const bool keep_t = keep_states && f16_history && conv == nullptr && kernels::direct_in_scan_enabled();
  // The column scan forms U itself from v where it lies (kernels::set_u_in_scan), with or without the history
  // a backward reads: chunk_factors then reads no v and writes T diag(beta) instead of U.
  const bool u_scan = u16 && !fuse_in_scan && conv == nullptr && kernels::factors_in_turn() == 0 &&
                      kernels::column_scan_forms_u(Dk, vc, grid);
  // It also forms Qd and kdecay from q's and k's rows where they lie (kernels::set_qk_in_scan): chunk_factors
  // then writes only their rows' scales. A forward kept for the backward does so where that backward's reverse
  // scan forms its direct term (keep_t), which then reads q and k in the same way.
  const bool qk_scan = u_scan && (!keep_states || keep_t) && kernels::column_scan_reads_qk(Dk, qc, kc, vc, grid);
  const kernels::ChunkFactors f = kernels::chunk_factors(
      kc, vc, gk, bk, grid, f16_history ? qc : at::Tensor(), scale, conv,
      u_scan ? kernels::UForm::kScan : u16 ? kernels::UForm::kFloat16Columns : kernels::UForm::kFloat32, keep_t, qk_scan);
  if (on_queued) on_queued(GdnStage::kFactors);
  std::optional<kernels::LowRankScanArgs::Output> in_scan;
  if (output_in_scan) {
    in_scan.emplace();
    in_scan->Qd = f.Qd, in_scan->Aq = f.Aq, in_scan->aq_inv = f.aq_inv;
    in_scan->grid = grid, in_scan->B = B, in_scan->T = T;
    if (fuse_in_scan)
      in_scan->fusion = fusion, in_scan->y = *y;
    else
      in_scan->o = at::empty({B, T, f.W.size(0), Dv}, q.options());
  }
  ScanU u{f.U, f.U_inv, std::nullopt};
  if (u_scan) u.from_v = kernels::LowRankScanArgs::UFromV{vc, f.Tb};
  if (qk_scan) u.from_v->q = qc, u.from_v->k = kc, u.from_v->QK = f.QK;
  const ForwardScan r = forward_scan(f.kdecay, f.W, u, f.decay, f.bound, s0, L.offsets,
                                     kernels::block_f16_scan_enabled() ? kernels::ScanPrecision::kBlockFloat16
                                                                       : kernels::ScanPrecision::kTf32,
                                     f16_history, keep_states, in_scan ? &*in_scan : nullptr);
  if (on_queued) on_queued(GdnStage::kScan);
  KernelForward out;
  out.final_state = r.final_state;
  if (in_scan && fusion != nullptr) {
    if (in_scan->fusion == nullptr)  // else the scan has written y itself
      kernels::fusion_norm_forward_into(in_scan->o, fusion->gate, fusion->act, fusion->gamma.contiguous(), fusion->eps, *y,
                                        fusion->heads);
  } else if (in_scan) out.o = in_scan->o;
  else if (fusion != nullptr) kernels::chunk_output_f16_fused(f, r.S16, r.S_inv, r.M16, r.M_inv, grid, B, T, *fusion, *y);
  else
    out.o = f16_history ? kernels::chunk_output_f16(f, r.S16, r.S_inv, r.M16, r.M_inv, grid, B, T, q.scalar_type())
                        : kernels::chunk_output(qc, kc, aligned(g.to(at::kFloat)), r.S, r.M, grid, scale);
  // The backward's reverse scan runs on the same float16 factors; its chunk kernels read the states
  // in block float16 (S in float32 only where the scan wrote no block float16 states).
  if (keep_states) {
    std::tie(out.W16, out.kdecay16, out.decay, out.bound) = std::make_tuple(f.W, f.kdecay, f.decay, f.bound);
    std::tie(out.S, out.S16, out.S_inv) = r.S16.defined() ? std::make_tuple(at::Tensor(), r.S16, r.S_inv)
                                                          : std::make_tuple(r.S, at::Tensor(), at::Tensor());
    // The reverse scan forms its direct term from the output's factors (kernels::set_direct_in_scan).
    if (kernels::direct_in_scan_enabled() && r.S16.defined() && (f.Qd.defined() || f.QK.defined()) && r.M16.defined())
      std::tie(out.Qd, out.Aq, out.aq_inv, out.M16, out.M_inv, out.T16, out.QK) =
          std::make_tuple(f.Qd, f.Aq, f.aq_inv, r.M16, r.M_inv, f.T16, f.QK);
  }
  return out;
}
#endif

class GdnScanFunction : public torch::autograd::Function<GdnScanFunction> {
 public:
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx, const at::Tensor& q,
                                                const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
                                                const at::Tensor& beta, const at::Tensor& s0, double scale,
                                                int64_t chunk, std::vector<int64_t> cu_seqlens, bool keep_states,
                                                bool zero_s0) {
    const int64_t B = q.size(0), T = q.size(1);
    const at::ScalarType acc = q.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
    // With zero_s0 s0 holds no values (the op's stand-in, at::empty's): the start states are zero, which the
    // kernels' scans take without a tensor of zeros; the LibTorch paths form one.
    ctx->set_materialize_grads(false);  // an unused output's gradient stays undefined: no kernel zeroes it
    auto start = [&] { return zero_s0 ? at::zeros(s0.sizes(), s0.options().dtype(acc)) : s0.to(acc); };
    const Tf32Scope tf32(use_tf32(q));
    const ChunkLayout L = make_layout(B, T, chunk, cu_seqlens, q.device());
    at::Tensor S, o, final_state;  // S: the state at the start of each chunk
    at::Tensor W16, kdecay16, decay, bound;  // the chunk kernels' transition factors, kept for the backward's reverse scan
    at::Tensor S16, S_inv;            // S in block float16 (kernels::LowRankScanArgs), kept for the backward
    at::Tensor Qd, Aq, aq_inv;        // the output's factors, kept for the reverse scan's direct term
    at::Tensor M16, M_inv;            // the new values in block float16, kept for the backward's chunk kernel
    at::Tensor T16;                   // every chunk's T, kept for the backward's chunk kernel
    at::Tensor QK;                    // Qd's and kdecay's row scales, kept in their place where the scans form them
    if (chunk_kernels_ok(q, k, v, chunk)) {
#ifdef HH_HAVE_KERNELS
      const KernelForward r = kernel_forward(q, k, v, g, beta, zero_s0 ? at::Tensor() : s0.to(acc), scale, L, keep_states);
      std::tie(o, final_state, W16, kdecay16, decay, bound, S, S16, S_inv) =
          std::make_tuple(r.o, r.final_state, r.W16, r.kdecay16, r.decay, r.bound, r.S, r.S16, r.S_inv);
      std::tie(Qd, Aq, aq_inv, M16, M_inv, T16, QK) = std::make_tuple(r.Qd, r.Aq, r.aq_inv, r.M16, r.M_inv, r.T16, r.QK);
#endif
    } else {
      const ChunkedInputs in = chunk_inputs(q, k, v, g, beta, L, acc);
      const ChunkLocal c = chunk_local(in.Q, in.K, in.V, in.g, in.beta);
      at::Tensor O;
      if (low_rank_scan_ok(c)) {
#ifdef HH_HAVE_KERNELS
        const ForwardScan r = forward_scan(c.kdecay, c.W, ScanU{c.U, {}, std::nullopt}, c.dl, at::Tensor(), zero_s0 ? at::Tensor() : s0.to(acc), L.offsets,
                                           use_tf32(q) ? kernels::ScanPrecision::kTf32 : kernels::ScanPrecision::kFloat32);
        S = r.S;
        final_state = r.final_state;
        O = at::matmul(c.attn, r.M).add_(at::matmul(c.qdecay, S));  // times scale in from_chunks
#endif
      } else {
        const at::Tensor Z = at::matmul(c.kdecay.transpose(-1, -2), c.U);  // [H, N, Dk, Dv]
        const ScanResult scan = gdn_state_scan(transition(c, /*transposed=*/false).contiguous(), Z.contiguous(),
                                               start().contiguous(), L.offsets, /*reverse=*/false);
        S = scan.hist;
        final_state = scan.final_state;
        O = at::matmul(c.qdecay, S) + at::matmul(c.attn, c.U - at::matmul(c.W, S));
      }
      o = from_chunks(O, L, B, T, v.scalar_type(), scale);
    }
    ctx->save_for_backward({q, k, v, g, beta, S, W16, kdecay16, decay, S16, S_inv, bound, Qd, Aq, aq_inv, M16, M_inv, T16, QK});
    ctx->saved_data["scale"] = scale;
    ctx->saved_data["chunk"] = chunk;
    ctx->saved_data["cu_seqlens"] = cu_seqlens;
    ctx->saved_data["s0_dtype"] = static_cast<int64_t>(s0.scalar_type());
    return {o, final_state};
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor &q = saved[0], &k = saved[1], &v = saved[2], &g = saved[3], &beta = saved[4];
    // The chunk states in block float16 when the chunk kernels' forward kept them so (16 x 16 blocks).
    const at::Tensor &S16 = saved[9], &S_inv = saved[10];
    const double scale = ctx->saved_data["scale"].toDouble();
    const int64_t chunk = ctx->saved_data["chunk"].toInt();
    const std::vector<int64_t> cu_seqlens = ctx->saved_data["cu_seqlens"].toIntVector();
    const auto s0_dtype = static_cast<at::ScalarType>(ctx->saved_data["s0_dtype"].toInt());
    const int64_t B = q.size(0), T = q.size(1), H = q.size(2), Dk = q.size(3), Dv = v.size(3);
    const at::ScalarType acc = q.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
    const Tf32Scope tf32(use_tf32(q));
    const ChunkLayout L = make_layout(B, T, chunk, cu_seqlens, q.device());
    const int64_t nseq = static_cast<int64_t>(L.offsets.size()) - 1;
    // No final-state gradient (the final state unused): zeros for the LibTorch paths; the kernels' reverse
    // scan starts from zero without them.
    auto final_grad = [&] {
      return grads[1].defined() ? grads[1].to(acc).contiguous() : at::zeros({nseq, H, Dk, Dv}, q.options().dtype(acc));
    };

    // 1. State gradients, last chunk to first: dS_n = P_n dS_{n+1} + X_n with
    //    X_n = scale (qdecay - attn W)^T dO_n, the direct effect of S_n on chunk n's output.
    // 2. With every chunk's start state S_n and end-state gradient fixed, the inputs' gradients are
    //    those of J = sum_n <dO_n, O_n> + <dS_end_n, S_{n+1}> through the chunk-local function:
    //    by the formulas of chunk_local_backward, or (GdnBackward::kAutograd) by autograd through
    //    chunk_local, with J written so that nothing state-sized ([Dk, Dv] a chunk) needs a gradient.
    auto cast = [](const at::Tensor& gr, const at::Tensor& like) {
      return gr.defined() ? gr.to(like.scalar_type()) : at::zeros_like(like);
    };
#ifdef HH_HAVE_KERNELS
    // The forward kept its factors (and the block float16 states) exactly when its chunk kernels ran for
    // a graph on the block float16 scan.
    if (gdn_backward() == GdnBackward::kKernels && saved[6].defined() && S16.defined() &&
        kernels::block_f16_scan_enabled()) {
      // The chunk kernels read the inputs and dO where they lie and write the gradients there; the
      // reverse scan runs between them on the forward's float16 factors, as the forward's scan did.
      HH_GDN_SCOPE("chunk_kernels_backward");
      at::NoGradGuard no_grad;
      const kernels::ChunkGrid grid{L.N, L.regular ? L.N / std::max<int64_t>(B, 1) : 0, L.gather};
      const at::Tensor qc = aligned(q), kc = aligned(k), vc = aligned(v), gk = gate_for_kernels(g, q),
                       bk = gate_for_kernels(beta, q);
      const at::Tensor dO = grads[0].defined() ? aligned(grads[0].to(q.scalar_type())) : at::zeros_like(vc);
      const at::Tensor &W16 = saved[6], &kdecay16 = saved[7], &decay = saved[8], &bound = saved[11];
      kernels::LowRankScanArgs a;
      a.A = W16;
      a.B = kdecay16;
      a.decay = decay;
      a.bound = bound;  // P_n's norm is P_n^T's
      // The direct term: formed by the scan from the forward's output factors and dO in block float16
      // where the forward kept them (and then the scan's new values, -dM, go to the chunk kernel beside
      // the forward's M), else chunk_state_direct's Z.
      const at::Tensor &Qd = saved[12], &Aq = saved[13], &aq_inv = saved[14], &M16 = saved[15], &M_inv = saved[16],
                       &T16 = saved[17], &QK = saved[18];
      if (Qd.defined() || QK.defined()) {
        // dO as it lies: the scan reads it so where it can, else brings it to the chunk grid first.
        a.direct.Qd = Qd, a.direct.Aq = Aq, a.direct.aq_inv = aq_inv;
        a.direct.dO = dO, a.direct.grid = grid;
        a.M16 = at::empty_like(M16);
        a.M_inv = at::empty_like(M_inv);
      } else {
        a.Z = kernels::chunk_state_direct(qc, kc, aligned(g.to(at::kFloat)), W16, dO, grid, scale);
      }
      a.zero_start = !grads[1].defined();
      a.y0 = a.zero_start ? at::empty({nseq, H, Dk, Dv}, q.options().dtype(acc)) : final_grad();
      a.S16 = at::empty_like(S16);  // the end-state gradients, in block float16 as S
      a.S_inv = at::empty_like(S_inv);
      a.reverse = true;
      a.precision = kernels::ScanPrecision::kBlockFloat16;
      a.segment = kernels::scan_segments();
      // Where the forward's scans formed Qd and kdecay from q and k (QK kept in their place), the reverse scan
      // does too where it can; elsewhere they are formed here from the rows' scales, the same bits
      // (chunk_factors' products and rounding).
      if (QK.defined() && kernels::reverse_scan_takes_qk(Dk, qc, kc, dO, grid) && kernels::reverse_scan_reads_dO_in_place(a)) {
        a.direct.q = qc, a.direct.k = kc, a.direct.QK = QK;
      } else if (QK.defined()) {
        auto scaled = [&](const at::Tensor& x, int64_t which) {
          return kernels::to_chunk_grid(x, chunk, 1.0).mul_(QK.select(2, which).unsqueeze(-1)).to(at::kHalf);
        };
        a.direct.Qd = scaled(qc, 0);
        a.B = scaled(kc, 1);
      }
      const at::Tensor dS0 = kernels::low_rank_scan(a, L.offsets);
      const kernels::ChunkInputGrads d =
          kernels::chunk_backward(qc, kc, vc, gk, bk, S16, S_inv, a.S16, a.S_inv, dO, grid, scale, M16, M_inv, a.M16, a.M_inv,
                                  T16);
      return {d.dq, d.dk, d.dv, d.dg.to(g.scalar_type()), d.dbeta.to(beta.scalar_type()), dS0.to(s0_dtype),
              at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
    }
#endif
    // The LibTorch backward takes the states in float32: as kept, or expanded from block float16.
    const at::Tensor S = saved[5].defined()
                             ? saved[5]
                             : S16.to(at::kFloat).mul_(S_inv.repeat_interleave(16, -2).repeat_interleave(16, -1));
    const at::Tensor dfin = final_grad();
    // dO times the output scale: every term below takes dO with it.
    const at::Tensor dOs = grads[0].defined() ? to_chunks(grads[0], L, acc, scale)
                                              : at::zeros({H, L.N, chunk, Dv}, q.options().dtype(acc));
    if (gdn_backward() != GdnBackward::kAutograd) {
      at::NoGradGuard no_grad;
      const ChunkedInputs in = chunk_inputs(q, k, v, g, beta, L, acc);
      const ChunkLocal c = chunk_local(in.Q, in.K, in.V, in.g, in.beta);
      const StateGrads sg = state_gradients(c, in.beta, dOs, dfin, L.offsets, !use_tf32(q));
      const ChunkGrads d = chunk_local_backward(c, in, S, sg.dS_end, dOs);
      // Back from the chunk grid to [B, T, H, ...] in each input's dtype.
      auto back = [&](const at::Tensor& x, const at::Tensor& like) { return from_chunks(x, L, B, T, like.scalar_type()); };
      auto back_bth = [&](const at::Tensor& x, const at::Tensor& like) { return back(x.unsqueeze(-1), like).squeeze(-1); };
      return {back(d.dQ, q), back(d.dK, k), back(d.dV, v), back_bth(d.dg, g), back_bth(d.dbeta, beta),
              sg.dS0.to(s0_dtype), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
    }
    at::Tensor lq = q.detach().requires_grad_(true), lk = k.detach().requires_grad_(true),
               lv = v.detach().requires_grad_(true), lg = g.detach().requires_grad_(true),
               lb = beta.detach().requires_grad_(true);
    at::AutoGradMode grad_mode(true);
    const ChunkedInputs in = chunk_inputs(lq, lk, lv, lg, lb, L, acc);
    const ChunkLocal c = chunk_local(in.Q, in.K, in.V, in.g, in.beta);
    //      <O, dO>      = scale (<qdecay, dO S^T> + <attn Uc, dO>)   (scale carried by dOs)
    //      <S_next, dS> = e^{G_C} <S, dS> + <Uc, kdecay dS>           (Uc = U - W S)
    at::Tensor dO_St, S_dS;
    StateGrads sg;
    {
      at::NoGradGuard no_grad;
      sg = state_gradients(c, in.beta, dOs, dfin, L.offsets, !use_tf32(q));
      dO_St = at::matmul(dOs, S.transpose(-1, -2));  // [H, N, C, Dk]
      S_dS = chunk_dot(S, sg.dS_end);
    }
    const at::Tensor Uc = c.U - at::matmul(c.W, S);
    const at::Tensor objective = (c.qdecay * dO_St).sum() + (at::matmul(c.attn, Uc) * dOs).sum() +
                                 (c.dl * S_dS).sum() + (Uc * at::matmul(c.kdecay, sg.dS_end)).sum();
    const torch::autograd::variable_list input_grads =
        torch::autograd::grad({objective}, {lq, lk, lv, lg, lb}, {}, /*retain_graph=*/false,
                              /*create_graph=*/false, /*allow_unused=*/true);
    return {cast(input_grads[0], q), cast(input_grads[1], k), cast(input_grads[2], v), cast(input_grads[3], g),
            cast(input_grads[4], beta), sg.dS0.to(s0_dtype), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

// The op hydrahead::chunk_gated_delta_rule for every backend (CompositeImplicitAutograd: the
// autograd function inside records the graph).
std::tuple<at::Tensor, at::Tensor> chunk_rule_op(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                 const at::Tensor& g, const at::Tensor& beta,
                                                 const c10::optional<at::Tensor>& initial_state, double scale,
                                                 int64_t chunk, at::IntArrayRef cu_seqlens) {
  if (chunk < 1) throw Error("gated delta rule: chunk must be >= 1");
  const at::ScalarType acc = q.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  if (q.dim() != 4) throw Error("gated delta rule: q must be [B, T, H, Dk], got " + shape_str(q.sizes()));
  const int64_t B = q.size(0), H = q.size(2), Dk = q.size(3);
  const int64_t nseq = cu_seqlens.empty() ? B : static_cast<int64_t>(cu_seqlens.size()) - 1;
  // Shape checks on the batch form (initial_state checked against the number of sequences).
  check_inputs(q, k, v, g, beta, at::Tensor());
  const int64_t Dv = v.size(3);
  if (initial_state.has_value() && initial_state->defined() && initial_state->sizes() != at::IntArrayRef({nseq, H, Dk, Dv}))
    throw Error("gated delta rule: initial_state must be [S, H, Dk, Dv] = " + shape_str({nseq, H, Dk, Dv}) + ", got " +
                shape_str(initial_state->sizes()));
  // Without initial states, a stand-in of their shape that holds no values (zero_s0): no kernel zeroes it.
  const bool zero_s0 = !(initial_state.has_value() && initial_state->defined());
  const at::Tensor s0 = zero_s0 ? at::empty({std::max<int64_t>(nseq, 0), H, Dk, Dv}, q.options().dtype(acc)) : *initial_state;
  // The chunks' start states are kept for the backward only when a graph is recorded.
  const bool keep_states = at::GradMode::is_enabled() && (q.requires_grad() || k.requires_grad() || v.requires_grad() ||
                                                          g.requires_grad() || beta.requires_grad() || s0.requires_grad());
  auto r = GdnScanFunction::apply(q, k, v, g, beta, s0, scale, chunk, cu_seqlens.vec(), keep_states, zero_s0);
  return {r[0], r[1]};
}

}  // namespace

TORCH_LIBRARY_IMPL(hydrahead, CompositeImplicitAutograd, m) { m.impl("chunk_gated_delta_rule", &chunk_rule_op); }

void set_gdn_backward(GdnBackward b) { g_backward = b; }
GdnBackward gdn_backward() { return g_backward; }

GdnOutput gdn_chunked_scan(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
                           const at::Tensor& beta, const at::Tensor& initial_state, double scale, int64_t chunk,
                           const std::vector<int64_t>& cu_seqlens) {
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("hydrahead::chunk_gated_delta_rule", "")
          .typed<std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                                    const at::Tensor&, const at::Tensor&,
                                                    const c10::optional<at::Tensor>&, double, int64_t,
                                                    at::IntArrayRef)>();
  const c10::optional<at::Tensor> s0 = initial_state.defined() ? c10::optional<at::Tensor>(initial_state) : c10::nullopt;
  auto [o, state] = op.call(q, k, v, g, beta, s0, scale, chunk, at::IntArrayRef(cu_seqlens));
  return {o, state};
}

GdnOutput gdn(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g, const at::Tensor& beta,
              const at::Tensor& initial_state, double scale, int64_t chunk) {
  if (q.is_cuda()) return gdn_chunked_scan(q, k, v, g, beta, initial_state, scale, chunk);
  return gdn_chunked(q, k, v, g, beta, initial_state, scale, chunk);
}

#ifdef HH_HAVE_KERNELS
at::Tensor gdn_fused_output(const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in, const at::Tensor& g,
                            const at::Tensor& beta, const at::Tensor& initial_state, double scale, int64_t chunk,
                            const kernels::OutputFusion& fusion, at::Tensor& y, const kernels::ShortConvInputs* conv,
                            const std::function<void(GdnStage)>& on_queued) {
  at::Tensor q = q_in, k = k_in, v = v_in;
  const bool graph = at::GradMode::is_enabled() &&
                     (q.requires_grad() || k.requires_grad() || v.requires_grad() || g.requires_grad() ||
                      beta.requires_grad() || (initial_state.defined() && initial_state.requires_grad()) ||
                      fusion.gate.requires_grad() || fusion.gamma.requires_grad());
  if (graph)
    throw Error("gated delta rule with a fused output: inference only, but an input requires a gradient "
                "(run it under a no-grad guard, or take gdn and the fusion norm apart)");
  // With the output in the scan, the fusion norm runs as a kernel of its own after it, as it does after
  // the rule's other paths (so any layout that kernel takes will do); with the output apart the output
  // kernel applies it, under that kernel's layout conditions.
  const bool fused = q.is_cuda() && chunk_kernels_ok(q, k, v, chunk) && kernels::block_f16_scan_enabled() &&
                     kernels::f16_history_enabled() &&
                     (kernels::output_in_scan_enabled() ||
                      (kernels::chunk_output_fusion_supported(q.size(2), v.size(3), q.scalar_type()) &&
                       kernels::chunk_output_fusion_fits(fusion, y) && y.scalar_type() == q.scalar_type()));
  // The convolution inside chunk_factors where its tensors fit (contiguous, 16-byte aligned), else first.
  auto fits = [](const at::Tensor& t) {
    return t.is_contiguous() && reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0;
  };
  const bool conv_inside = conv != nullptr && fused && kernels::conv_in_factors_enabled() &&
                           kernels::short_conv_fusion_supported(q.size(3), v.size(3), q.scalar_type()) &&
                           fits(q) && fits(k) && fits(v) && fits(conv->wq) && fits(conv->wk) && fits(conv->wv) &&
                           fits(conv->cos) && fits(conv->sin);
  if (conv != nullptr && !conv_inside) {
    const kernels::ConvolvedQkv c = kernels::short_conv_apart(q, k, v, *conv);
    q = c.q, k = c.k, v = c.v;
  }
  if (!fused) {
    const GdnOutput r = gdn(q, k, v, g, beta, initial_state, scale, chunk);
    kernels::fusion_norm_forward_into(r.o.contiguous(), fusion.gate, fusion.act, fusion.gamma.contiguous(), fusion.eps, y,
                                      fusion.heads);
    return r.state;
  }
  check_inputs(q, k, v, g, beta, initial_state);
  at::NoGradGuard no_grad;
  const int64_t B = q.size(0), T = q.size(1), H = q.size(2), Dk = q.size(3), Dv = v.size(3);
  const at::Tensor s0 = initial_state.defined() ? initial_state.to(at::kFloat) : at::Tensor();  // undefined: from zero
  const Tf32Scope tf32(use_tf32(q));
  const ChunkLayout L = make_layout(B, T, chunk, {}, q.device());
  return kernel_forward(q, k, v, g, beta, s0, scale, L, /*keep_states=*/false, &fusion, &y, conv_inside ? conv : nullptr,
                        on_queued)
      .final_state;
}
#endif

}  // namespace hh::attention
