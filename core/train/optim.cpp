#include "core/train/optim.h"

#include <torch/torch.h>

#include <cmath>

#include "core/model/summary.h"
#include "core/util/error.h"
#ifdef HH_HAVE_KERNELS
#include "kernels/optim.h"
#endif

namespace hh::train {

namespace {
bool low_precision(const at::Tensor& t) { return t.scalar_type() == at::kBFloat16 || t.scalar_type() == at::kHalf; }
at::ScalarType state_dtype(const at::Tensor& t) { return t.scalar_type() == at::kDouble ? at::kDouble : at::kFloat; }

bool g_fused = true;

// The gradients that exist, where the kernels take them all (CUDA tensors of their dtypes) and the
// switch is on; else empty, and the op sequences run.
std::vector<at::Tensor> kernel_grads(const std::vector<Param>& params) {
  std::vector<at::Tensor> gs;
#ifdef HH_HAVE_KERNELS
  if (!g_fused) return gs;
  for (const auto& p : params) {
    const at::Tensor& g = p.tensor.grad();
    if (!g.defined()) continue;
    if (!g.is_cuda()) return {};
    gs.push_back(g);
  }
  if (!gs.empty() && !kernels::multi_supported(gs)) gs.clear();
#else
  (void)params;
#endif
  return gs;
}

// grad_norm, on the kernels over kgs where kernel_grads gave them.
double norm_of(const std::vector<Param>& params, const std::vector<at::Tensor>& kgs) {
  at::NoGradGuard no_grad;
#ifdef HH_HAVE_KERNELS
  if (!kgs.empty()) return std::sqrt(kernels::sum_squares(kgs).item<double>());
#else
  (void)kgs;
#endif
  // One device reduction per parameter and a single synchronising read at the end.
  std::vector<at::Tensor> sums;
  for (const auto& p : params)
    if (p.tensor.grad().defined()) {
      const at::Tensor& g = p.tensor.grad();
      sums.push_back(g.to(g.scalar_type() == at::kDouble ? at::kDouble : at::kFloat).pow(2).sum().to(at::kDouble));
    }
  if (sums.empty()) return 0;
  return std::sqrt(at::stack(sums).sum().item<double>());
}
}  // namespace

void set_fused_optimizer(bool on) { g_fused = on; }

AdamW::AdamW(std::vector<Param> params, AdamWOptions options) : params_(std::move(params)), o_(options) {
  at::NoGradGuard no_grad;
  slots_.reserve(params_.size());
  for (const auto& p : params_) {
    if (!p.tensor.defined()) throw Error("optimizer: parameter " + p.name + " is undefined");
    Slot s;
    const auto opts = p.tensor.options().dtype(state_dtype(p.tensor));
    s.exp_avg = at::zeros(p.tensor.sizes(), opts);
    s.exp_avg_sq = at::zeros(p.tensor.sizes(), opts);
    if (low_precision(p.tensor)) s.master = p.tensor.detach().to(at::kFloat).clone();
    slots_.push_back(std::move(s));
  }
}

void AdamW::step(double lr) {
  at::NoGradGuard no_grad;
  ++steps_;
  const double bc1 = 1.0 - std::pow(o_.beta1, static_cast<double>(steps_));
  const double bc2 = 1.0 - std::pow(o_.beta2, static_cast<double>(steps_));
#ifdef HH_HAVE_KERNELS
  if (g_fused && !params_.empty() && params_.front().tensor.is_cuda()) {
    std::vector<kernels::AdamWTensor> ts;
    for (std::size_t i = 0; i < params_.size(); ++i) {
      const at::Tensor& g = params_[i].tensor.grad();
      if (!g.defined()) continue;
      ts.push_back({params_[i].tensor, g, slots_[i].exp_avg, slots_[i].exp_avg_sq, slots_[i].master, params_[i].decay});
    }
    if (ts.empty()) return;
    if (kernels::adamw_supported(ts)) {
      kernels::AdamWScalars sc;
      sc.lr = lr;
      sc.beta1 = o_.beta1;
      sc.beta2 = o_.beta2;
      sc.eps = o_.eps;
      sc.weight_decay = o_.weight_decay;
      sc.bias1 = bc1;
      sc.bias2 = bc2;
      kernels::adamw_step(ts, sc);
      return;
    }
  }
#endif
  for (std::size_t i = 0; i < params_.size(); ++i) {
    const Param& p = params_[i];
    const at::Tensor& g0 = p.tensor.grad();
    if (!g0.defined()) continue;
    Slot& s = slots_[i];
    at::Tensor w = s.master.defined() ? s.master : p.tensor;
    const at::Tensor g = g0.to(s.exp_avg.scalar_type());
    if (p.decay && o_.weight_decay != 0) w.mul_(1.0 - lr * o_.weight_decay);
    s.exp_avg.mul_(o_.beta1).add_(g, 1.0 - o_.beta1);
    s.exp_avg_sq.mul_(o_.beta2).addcmul_(g, g, 1.0 - o_.beta2);
    const at::Tensor denom = (s.exp_avg_sq / bc2).sqrt_().add_(o_.eps);
    w.addcdiv_(s.exp_avg, denom, -lr / bc1);
    if (s.master.defined()) p.tensor.copy_(s.master);
  }
}

void AdamW::zero_grad() {
  for (auto& p : params_)
    if (p.tensor.grad().defined()) p.tensor.mutable_grad() = at::Tensor();
}

std::vector<std::pair<std::string, at::Tensor>> AdamW::state() const {
  std::vector<std::pair<std::string, at::Tensor>> out;
  for (std::size_t i = 0; i < params_.size(); ++i) {
    out.emplace_back(params_[i].name + ".exp_avg", slots_[i].exp_avg);
    out.emplace_back(params_[i].name + ".exp_avg_sq", slots_[i].exp_avg_sq);
    if (slots_[i].master.defined()) out.emplace_back(params_[i].name + ".master", slots_[i].master);
  }
  return out;
}

void AdamW::load_state(const std::map<std::string, at::Tensor>& state, int64_t steps) {
  at::NoGradGuard no_grad;
  auto take = [&](const std::string& name, at::Tensor& dst) {
    const auto it = state.find(name);
    if (it == state.end()) throw Error("optimizer state: tensor '" + name + "' is missing");
    if (it->second.sizes() != dst.sizes())
      throw Error("optimizer state: tensor '" + name + "' has shape " + model::format_shape(it->second.sizes().vec()) +
                  ", expected " + model::format_shape(dst.sizes().vec()));
    dst.copy_(it->second);
  };
  for (std::size_t i = 0; i < params_.size(); ++i) {
    take(params_[i].name + ".exp_avg", slots_[i].exp_avg);
    take(params_[i].name + ".exp_avg_sq", slots_[i].exp_avg_sq);
    if (slots_[i].master.defined()) take(params_[i].name + ".master", slots_[i].master);
  }
  steps_ = steps;
}

double grad_norm(const std::vector<Param>& params) { return norm_of(params, kernel_grads(params)); }

double clip_grad_norm(const std::vector<Param>& params, double max_norm) {
  const std::vector<at::Tensor> kgs = kernel_grads(params);
  const double norm = norm_of(params, kgs);
  if (max_norm > 0 && norm > max_norm && std::isfinite(norm)) {
    at::NoGradGuard no_grad;
    const double scale = max_norm / (norm + 1e-6);
#ifdef HH_HAVE_KERNELS
    if (!kgs.empty()) {
      kernels::scale_(kgs, scale);
      return norm;
    }
#endif
    for (const auto& p : params)
      if (p.tensor.grad().defined()) p.tensor.mutable_grad().mul_(scale);
  }
  return norm;
}

Schedule parse_schedule(const std::string& name) {
  if (name == "constant") return Schedule::Constant;
  if (name == "linear") return Schedule::Linear;
  if (name == "cosine") return Schedule::Cosine;
  throw Error("unknown schedule '" + name + "' (constant, linear or cosine)");
}

const char* schedule_name(Schedule s) {
  switch (s) {
    case Schedule::Constant: return "constant";
    case Schedule::Linear: return "linear";
    case Schedule::Cosine: return "cosine";
  }
  return "?";
}

double schedule_lr(Schedule s, double lr, double min_lr, int64_t warmup, int64_t step, int64_t total) {
  if (step < warmup) return lr * static_cast<double>(step + 1) / static_cast<double>(warmup);
  if (s == Schedule::Constant) return lr;
  const int64_t span = total - warmup;
  const double progress = span <= 0 ? 0.0 : std::min(1.0, static_cast<double>(step - warmup) / static_cast<double>(span));
  if (s == Schedule::Linear) return lr + (min_lr - lr) * progress;
  return min_lr + (lr - min_lr) * 0.5 * (1.0 + std::cos(M_PI * progress));
}

}  // namespace hh::train
