#include "core/model/fused_autograd.h"

#include <torch/torch.h>

#include <tuple>

#ifdef HH_HAVE_KERNELS
#include "kernels/fused_ops.h"
#endif

namespace hh::model {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

#if defined(HH_HAVE_KERNELS) || HH_TORCH_AT_LEAST(2, 1)
// Whether a graph is being recorded through any of `inputs`.
bool recording(std::initializer_list<const at::Tensor*> inputs) {
  if (!at::GradMode::is_enabled()) return false;
  for (const at::Tensor* t : inputs)
    if (t->defined() && t->requires_grad()) return true;
  return false;
}
#endif

#ifdef HH_HAVE_KERNELS
struct RmsNormFn : torch::autograd::Function<RmsNormFn> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& weight, double eps) {
    const at::Tensor xc = x.contiguous();
    ctx->save_for_backward({xc, weight});
    ctx->saved_data["eps"] = eps;
    return kernels::rms_norm(xc, weight, eps);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grad) {
    const auto s = ctx->get_saved_variables();
    return {kernels::rms_norm_backward(grad[0].contiguous(), s[0], s[1], ctx->saved_data["eps"].toDouble()), at::Tensor(),
            at::Tensor()};
  }
};

struct NormRopeFn : torch::autograd::Function<NormRopeFn> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& weight, const at::Tensor& cos,
                            const at::Tensor& sin, double eps) {
    const at::Tensor xc = x.contiguous();
    ctx->save_for_backward({xc, weight, cos, sin});
    ctx->saved_data["eps"] = eps;
    return kernels::norm_rope(xc, weight, cos, sin, eps);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grad) {
    const auto s = ctx->get_saved_variables();
    return {kernels::norm_rope_backward(grad[0].contiguous(), s[0], s[1], s[2], s[3], ctx->saved_data["eps"].toDouble()),
            at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

struct SiluMulFn : torch::autograd::Function<SiluMulFn> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& gate, const at::Tensor& up) {
    const at::Tensor g = gate.contiguous(), u = up.contiguous();
    ctx->save_for_backward({g, u});
    return kernels::silu_mul(g, u);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grad) {
    const auto s = ctx->get_saved_variables();
    auto [dg, du] = kernels::silu_mul_backward(grad[0].contiguous(), s[0], s[1]);
    return {dg, du};
  }
};
#endif

#if HH_TORCH_AT_LEAST(2, 1)
// One flash call and what its backward needs back.
struct Flash {
  at::Tensor out, lse, cum_q, cum_k, seed, offset;
};

Flash flash(const at::Tensor& qh, const at::Tensor& kh, const at::Tensor& vh, bool causal, double scale) {
  auto r = at::_scaled_dot_product_flash_attention(qh, kh, vh, /*dropout_p=*/0.0, causal, /*return_debug_mask=*/false, scale);
  return {std::get<0>(r), std::get<1>(r), std::get<2>(r), std::get<3>(r), std::get<6>(r), std::get<7>(r)};
}

// [B, Hkv, T, Dh] -> [B, Hq, T, Dh]: query head h reads KV head h / G (a copy; flash wants equal heads).
at::Tensor repeat_kv(const at::Tensor& kh, int64_t G) {
  if (G == 1) return kh;
  const int64_t B = kh.size(0), Hkv = kh.size(1), T = kh.size(2), Dh = kh.size(3);
  return kh.unsqueeze(2).expand({B, Hkv, G, T, Dh}).reshape({B, Hkv * G, T, Dh});
}

// The prefix part folds every new row of every query head of a KV head into one query axis, so the
// prefix keys are read once: [B, Tq, Hkv*G, X] -> [1, Hkv, B*G*Tq, X] (prefix shared by the batch) or
// [B, Hkv, G*Tq, X] (a prefix per batch row). lse-like tensors [B, Hq, Tq] fold the same way.
struct Fold {
  int64_t B, Tq, Hkv, G;
  bool shared;
  at::Tensor rows(const at::Tensor& x) const {  // [B, Tq, Hq, Dh]
    const int64_t Dh = x.size(3);
    const at::Tensor x5 = x.reshape({B, Tq, Hkv, G, Dh});
    return shared ? x5.permute({2, 0, 3, 1, 4}).reshape({1, Hkv, B * G * Tq, Dh})
                  : x5.permute({0, 2, 3, 1, 4}).reshape({B, Hkv, G * Tq, Dh});
  }
  at::Tensor unrows(const at::Tensor& y) const {  // inverse of rows()
    const int64_t Dh = y.size(3);
    return shared ? y.reshape({Hkv, B, G, Tq, Dh}).permute({1, 3, 0, 2, 4}).reshape({B, Tq, Hkv * G, Dh})
                  : y.reshape({B, Hkv, G, Tq, Dh}).permute({0, 3, 1, 2, 4}).reshape({B, Tq, Hkv * G, Dh});
  }
  at::Tensor lse(const at::Tensor& l) const {  // [B, Hq, Tq]
    return shared ? l.reshape({B, Hkv, G, Tq}).permute({1, 0, 2, 3}).reshape({1, Hkv, B * G * Tq})
                  : l.reshape({B, Hkv, G * Tq});
  }
  at::Tensor unlse(const at::Tensor& l) const {  // inverse of lse()
    return shared ? l.reshape({Hkv, B, G, Tq}).permute({1, 0, 2, 3}).reshape({B, Hkv * G, Tq}) : l.reshape({B, Hkv * G, Tq});
  }
};

Fold fold_for(const at::Tensor& q, const at::Tensor& k, const at::Tensor& pk) {
  const int64_t Hkv = k.size(2);
  return {q.size(0), q.size(1), Hkv, q.size(2) / Hkv, pk.size(0) == 1};
}

// The forward: both parts, merged. `out` is [B, Tq, Hq, Dh] contiguous; with want_grad the merged
// log-sum-exp [B, Hq, Tq] and the inputs in the layouts the flash calls read (kept for the backward).
struct Split {
  at::Tensor out, lse, k_rep, v_rep, q_rows;
  Flash fresh, pre;
};

Split split_forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& pk, const at::Tensor& pv,
                    double scale, bool want_grad) {
  const Fold f = fold_for(q, k, pk);
  Split r;
  r.k_rep = repeat_kv(k.transpose(1, 2), f.G);  // [B, Hq, Tq, Dh]
  r.v_rep = repeat_kv(v.transpose(1, 2), f.G);
  r.q_rows = f.rows(q);
  r.fresh = flash(q.transpose(1, 2), r.k_rep, r.v_rep, /*causal=*/true, scale);  // [B, Hq, Tq, *]
  r.pre = flash(r.q_rows, pk.transpose(1, 2), pv.transpose(1, 2), /*causal=*/false, scale);
  const at::Tensor lse_pre = f.unlse(r.pre.lse);  // [B, Hq, Tq]
#ifdef HH_HAVE_KERNELS
  // The kernel reads the prefix part in its folded layout: [Hkv, B, G, Tq, *] views.
  const int64_t B = f.B, Tq = f.Tq, Hkv = f.Hkv, G = f.G, Dh = q.size(3);
  const at::Tensor o5 = f.shared ? r.pre.out.reshape({Hkv, B, G, Tq, Dh})
                                 : r.pre.out.reshape({B, Hkv, G, Tq, Dh}).permute({1, 0, 2, 3, 4});
  const at::Tensor l4 = f.shared ? r.pre.lse.reshape({Hkv, B, G, Tq}) : r.pre.lse.reshape({B, Hkv, G, Tq}).permute({1, 0, 2, 3});
  r.out = kernels::merge_attention(r.fresh.out, r.fresh.lse, o5, l4);
#else
  // softmax over both key sets = each part's softmax weighted by its share of the total mass.
  const at::Tensor w = at::sigmoid(lse_pre - r.fresh.lse).unsqueeze(-1);  // [B, Hq, Tq, 1] float32
  const at::Tensor o_new = r.fresh.out.to(at::kFloat);
  const at::Tensor o_pre = f.unrows(r.pre.out).transpose(1, 2).to(at::kFloat);  // [B, Hq, Tq, Dh]
  r.out = (o_new + (o_pre - o_new) * w).to(q.scalar_type()).transpose(1, 2).contiguous();
#endif
  if (want_grad) r.lse = at::logaddexp(r.fresh.lse, lse_pre);
  return r;
}

struct PrefixSplitFn : torch::autograd::Function<PrefixSplitFn> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            const at::Tensor& pk, const at::Tensor& pv, double scale) {
    Split r = split_forward(q, k, v, pk, pv, scale, /*want_grad=*/true);
    ctx->save_for_backward({q, r.k_rep, r.v_rep, r.q_rows, pk, pv, r.out, r.lse, r.fresh.cum_q, r.fresh.cum_k, r.fresh.seed,
                            r.fresh.offset, r.pre.cum_q, r.pre.cum_k, r.pre.seed, r.pre.offset});
    ctx->saved_data["scale"] = scale;
    ctx->saved_data["hkv"] = k.size(2);
    return r.out;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad) {
    const auto s = ctx->get_saved_variables();
    const at::Tensor &q = s[0], &k_rep = s[1], &v_rep = s[2], &q_rows = s[3], &pk = s[4], &pv = s[5], &out = s[6], &lse = s[7];
    const double scale = ctx->saved_data["scale"].toDouble();
    const int64_t Hkv = ctx->saved_data["hkv"].toInt();
    const Fold f{q.size(0), q.size(1), Hkv, q.size(2) / Hkv, pk.size(0) == 1};
    const int64_t Tq = f.Tq, P = pk.size(1);
    const at::Tensor dout = grad[0].contiguous();  // [B, Tq, Hq, Dh]
    // Each key set with the merged output and log-sum-exp: P_ij = exp(s_ij - lse_i) and
    // D_i = dO_i . O_i are those of the softmax over all keys, so the parts' gradients add up exactly.
    auto fresh = at::_scaled_dot_product_flash_attention_backward(
        dout.transpose(1, 2), q.transpose(1, 2), k_rep, v_rep, out.transpose(1, 2), lse, s[8], s[9], Tq, Tq,
        /*dropout_p=*/0.0, /*is_causal=*/true, s[10], s[11], scale);
    auto pre = at::_scaled_dot_product_flash_attention_backward(
        f.rows(dout), q_rows, pk.transpose(1, 2), pv.transpose(1, 2), f.rows(out), f.lse(lse).contiguous(), s[12], s[13],
        q_rows.size(2), P, /*dropout_p=*/0.0, /*is_causal=*/false, s[14], s[15], scale);
    const at::Tensor dq = std::get<0>(fresh).transpose(1, 2) + f.unrows(std::get<0>(pre));  // [B, Tq, Hq, Dh]
    auto unrepeat = [&](const at::Tensor& d) {  // [B, Hq, Tq, Dh] -> [B, Tq, Hkv, Dh], summed over the group
      const at::Tensor g = f.G == 1 ? d : d.reshape({f.B, f.Hkv, f.G, Tq, d.size(3)}).sum(2);
      return g.transpose(1, 2);
    };
    return {dq, unrepeat(std::get<1>(fresh)), unrepeat(std::get<2>(fresh)), std::get<1>(pre).transpose(1, 2),
            std::get<2>(pre).transpose(1, 2), at::Tensor()};
  }
};
#endif

}  // namespace

#ifdef HH_HAVE_KERNELS
at::Tensor fused_rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  if (recording({&x})) return RmsNormFn::apply(x, weight, eps);
  return kernels::rms_norm(x, weight, eps);  // reads a column slice of a projection in place
}

at::Tensor fused_norm_rope(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& cos, const at::Tensor& sin,
                           double eps) {
  if (recording({&x})) return NormRopeFn::apply(x, weight, cos, sin, eps);
  return kernels::norm_rope(x, weight, cos, sin, eps);  // reads a column slice of a projection in place
}

at::Tensor fused_silu_mul(const at::Tensor& gate, const at::Tensor& up) {
  if (recording({&gate, &up})) return SiluMulFn::apply(gate, up);
  return kernels::silu_mul(gate.contiguous(), up.contiguous());
}
#endif

#if HH_TORCH_AT_LEAST(2, 1)
bool flash_eligible(const at::Tensor& q) {
  const auto t = q.scalar_type();
  return q.is_cuda() && (t == at::kBFloat16 || t == at::kHalf) && q.size(3) % 8 == 0 && q.size(3) <= 256;
}

at::Tensor prefix_split_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& pk,
                                  const at::Tensor& pv, double scale) {
  if (recording({&q, &k, &v, &pk, &pv})) return PrefixSplitFn::apply(q, k, v, pk, pv, scale);
  return split_forward(q, k, v, pk, pv, scale, /*want_grad=*/false).out;
}
#endif

}  // namespace hh::model
