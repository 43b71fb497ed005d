#include "core/attention/fusion.h"

#include <torch/torch.h>

#include "core/model/transformer.h"
#ifdef HH_HAVE_KERNELS
#include "kernels/gdn.h"
#endif

namespace hh::attention {

at::Tensor fusion_norm_reference(const at::Tensor& o, const at::Tensor& gate, const at::Tensor& gamma, double eps) {
  return gate * (gamma * model::rms_norm(o, {}, eps));
}

#ifdef HH_HAVE_KERNELS
namespace {

class FusionNormFunction : public torch::autograd::Function<FusionNormFunction> {
 public:
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx, const at::Tensor& o,
                                                const at::Tensor& gate, const at::Tensor& gamma, double eps) {
    const int64_t n = o.size(2), Dh = o.size(3);
    const at::Tensor oc = o.contiguous().view({-1, n, Dh}), gc = gate.contiguous().view({-1, n, Dh});
    const at::Tensor gm = gamma.contiguous();
    ctx->save_for_backward({oc, gc, gm});
    ctx->saved_data["eps"] = eps;
    return {kernels::fusion_norm_forward(oc, gc, gm, eps).view(o.sizes())};
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor &oc = saved[0], &gc = saved[1], &gm = saved[2];
    const auto shape = grads[0].sizes().vec();
    const at::Tensor dy = grads[0].to(oc.scalar_type()).contiguous().view(oc.sizes());
    const kernels::FusionNormGrads g = kernels::fusion_norm_backward(dy, oc, gc, gm, ctx->saved_data["eps"].toDouble());
    return {g.d_o.view(shape), g.d_gate.view(shape), g.d_gamma.to(gm.scalar_type()), at::Tensor()};
  }
};

}  // namespace
#endif

at::Tensor fusion_norm(const at::Tensor& o, const at::Tensor& gate, const at::Tensor& gamma, double eps) {
#ifdef HH_HAVE_KERNELS
  if (o.is_cuda() && o.dim() == 4 && o.size(3) <= 256 && o.scalar_type() != at::kDouble &&
      gate.scalar_type() == o.scalar_type() && gamma.scalar_type() == o.scalar_type() && gate.sizes() == o.sizes() &&
      o.numel() > 0)
    return FusionNormFunction::apply(o, gate, gamma, eps)[0];
#endif
  return fusion_norm_reference(o, gate, gamma, eps);
}

}  // namespace hh::attention
