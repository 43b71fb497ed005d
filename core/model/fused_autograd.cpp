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

// The forward: both parts, merged. Returns (out [B, Tq, Hq, Dh] contiguous, merged lse [B, Hq, Tq] or
// undefined when not asked, and the two calls for the backward).
std::tuple<at::Tensor, at::Tensor, Flash, Flash> split_forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                               const at::Tensor& pk, const at::Tensor& pv, double scale,
                                                               bool want_lse) {
  const Fold f = fold_for(q, k, pk);
  const Flash fresh = flash(q.transpose(1, 2), repeat_kv(k.transpose(1, 2), f.G), repeat_kv(v.transpose(1, 2), f.G),
                            /*causal=*/true, scale);  // [B, Hq, Tq, *]
  const Flash pre = flash(f.rows(q), pk.transpose(1, 2), pv.transpose(1, 2), /*causal=*/false, scale);
  const at::Tensor lse_pre = f.unlse(pre.lse);  // [B, Hq, Tq]
  at::Tensor out;
#ifdef HH_HAVE_KERNELS
  // The kernel reads the prefix part in its folded layout: [Hkv, B, G, Tq, *] views.
  const int64_t B = f.B, Tq = f.Tq, Hkv = f.Hkv, G = f.G, Dh = q.size(3);
  const at::Tensor o5 = f.shared ? pre.out.reshape({Hkv, B, G, Tq, Dh}) : pre.out.reshape({B, Hkv, G, Tq, Dh}).permute({1, 0, 2, 3, 4});
  const at::Tensor l4 = f.shared ? pre.lse.reshape({Hkv, B, G, Tq}) : pre.lse.reshape({B, Hkv, G, Tq}).permute({1, 0, 2, 3});
  out = kernels::merge_attention(fresh.out, fresh.lse, o5, l4);
#else
  // softmax over both key sets = each part's softmax weighted by its share of the total mass.
  const at::Tensor w = at::sigmoid(lse_pre - fresh.lse).unsqueeze(-1);  // [B, Hq, Tq, 1] float32
  const at::Tensor o_new = fresh.out.to(at::kFloat);
  const at::Tensor o_pre = f.unrows(pre.out).transpose(1, 2).to(at::kFloat);  // [B, Hq, Tq, Dh]
  out = (o_new + (o_pre - o_new) * w).to(q.scalar_type()).transpose(1, 2).contiguous();
#endif
  const at::Tensor lse = want_lse ? at::logaddexp(fresh.lse, lse_pre) : at::Tensor();
  return {out, lse, fresh, pre};
}

struct PrefixSplitFn : torch::autograd::Function<PrefixSplitFn> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            const at::Tensor& pk, const at::Tensor& pv, double scale) {
    auto [out, lse, fresh, pre] = split_forward(q, k, v, pk, pv, scale, /*want_lse=*/true);
    ctx->save_for_backward({q, k, v, pk, pv, out, lse, fresh.cum_q, fresh.cum_k, fresh.seed, fresh.offset, pre.cum_q,
                            pre.cum_k, pre.seed, pre.offset});
    ctx->saved_data["scale"] = scale;
    return out;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad) {
    const auto s = ctx->get_saved_variables();
    const at::Tensor &q = s[0], &k = s[1], &v = s[2], &pk = s[3], &pv = s[4], &out = s[5], &lse = s[6];
    const double scale = ctx->saved_data["scale"].toDouble();
    const Fold f = fold_for(q, k, pk);
    const int64_t Tq = f.Tq, P = pk.size(1);
    const at::Tensor dout = grad[0].contiguous();  // [B, Tq, Hq, Dh]
    // Each key set with the merged output and log-sum-exp: P_ij = exp(s_ij - lse_i) and
    // D_i = dO_i . O_i are those of the softmax over all keys, so the parts' gradients add up exactly.
    auto fresh = at::_scaled_dot_product_flash_attention_backward(
        dout.transpose(1, 2), q.transpose(1, 2), repeat_kv(k.transpose(1, 2), f.G), repeat_kv(v.transpose(1, 2), f.G),
        out.transpose(1, 2), lse, s[7], s[8], Tq, Tq, /*dropout_p=*/0.0, /*is_causal=*/true, s[9], s[10], scale);
    auto pre = at::_scaled_dot_product_flash_attention_backward(
        f.rows(dout), f.rows(q), pk.transpose(1, 2), pv.transpose(1, 2), f.rows(out), f.lse(lse).contiguous(), s[11], s[12],
        f.rows(q).size(2), P, /*dropout_p=*/0.0, /*is_causal=*/false, s[13], s[14], scale);
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
  return kernels::rms_norm(x.contiguous(), weight, eps);
}

at::Tensor fused_norm_rope(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& cos, const at::Tensor& sin,
                           double eps) {
  if (recording({&x})) return NormRopeFn::apply(x, weight, cos, sin, eps);
  return kernels::norm_rope(x.contiguous(), weight, cos, sin, eps);
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
  return std::get<0>(split_forward(q, k, v, pk, pv, scale, /*want_lse=*/false));
}
#endif

}  // namespace hh::model
