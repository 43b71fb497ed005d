// The optimiser's kernels (kernels/optim.h) against core/train/optim.cpp's op sequences on the same GPU
// and against the update worked in float64 on the CPU: AdamW over float32, float16 and bfloat16
// parameters of awkward sizes (empty, one element, runs of the kernel's block and one more), the
// gradients' global norm and clipping, and the inputs the kernels refuse.
#include <torch/torch.h>

#include <gtest/gtest.h>

#include <cmath>
#include <map>
#include <stdexcept>

#include "core/train/optim.h"
#include "kernels/optim.h"

namespace hh::train {
namespace {

const at::ScalarType kTypes[] = {at::kFloat, at::kBFloat16, at::kHalf};
// Element counts around the kernel's runs of 8192 elements and its unrolled stride of 1024.
const int64_t kSizes[] = {1, 0, 1023, 8192, 8193, 3 * 8192 + 5, 20000};

struct Case {
  std::vector<at::Tensor> init;                 // float32 on the CPU, the parameters' starting values
  std::vector<at::ScalarType> types;
  std::vector<std::vector<at::Tensor>> grads;   // [step][tensor], float32 on the CPU, exact in every type
};

Case make_case(int steps) {
  Case c;
  at::manual_seed(11);
  int i = 0;
  for (const int64_t n : kSizes)
    for (const at::ScalarType t : kTypes) {
      // Values exact in the 16-bit types, so every path starts from the same numbers.
      c.init.push_back(at::randn({n}).to(at::kHalf).to(at::kBFloat16).to(at::kFloat));
      c.types.push_back(t);
      ++i;
    }
  for (int s = 0; s < steps; ++s) {
    std::vector<at::Tensor> g;
    for (const auto& p : c.init) g.push_back((at::randn(p.sizes()) * 0.01).to(at::kHalf).to(at::kBFloat16).to(at::kFloat));
    c.grads.push_back(g);
  }
  return c;
}

std::vector<Param> cuda_params(const Case& c) {
  std::vector<Param> ps;
  for (size_t i = 0; i < c.init.size(); ++i) {
    at::Tensor t = c.init[i].to(at::kCUDA, c.types[i]).requires_grad_(true);
    ps.push_back({"p" + std::to_string(i), t, i % 3 != 1});   // some without decay
  }
  return ps;
}

struct Trained {
  std::vector<Param> params;
  std::map<std::string, at::Tensor> state;
};

const double kLr[] = {3e-3, 2e-3, 1e-3};

// Three AdamW steps through core/train/optim.cpp, fused or as ops; tensor 4 gets no gradient at step 1.
Trained run(const Case& c, const AdamWOptions& o, bool fused) {
  set_fused_optimizer(fused);
  Trained r;
  r.params = cuda_params(c);
  AdamW opt(r.params, o);
  for (size_t s = 0; s < c.grads.size(); ++s) {
    for (size_t i = 0; i < r.params.size(); ++i)
      if (!(s == 1 && i == 4)) r.params[i].tensor.mutable_grad() = c.grads[s][i].to(at::kCUDA, c.types[i]);
    opt.step(kLr[s]);
    opt.zero_grad();
  }
  for (auto& [name, t] : opt.state()) r.state[name] = t.cpu();
  set_fused_optimizer(true);
  return r;
}

// The largest difference between a and b in units of the type's epsilon at b's largest magnitude (a
// tensor-wide bound: elements that cancel to near zero keep an absolute error of their terms' size).
double eps_units(const at::Tensor& a, const at::Tensor& b, at::ScalarType t) {
  const double eps = t == at::kFloat ? std::ldexp(1.0, -23) : t == at::kHalf ? std::ldexp(1.0, -10) : std::ldexp(1.0, -7);
  if (a.numel() == 0) return 0;
  const auto da = a.to(at::kDouble), db = b.to(at::kDouble);
  return (da - db).abs().max().item<double>() / (std::max(db.abs().max().item<double>(), 1e-30) * eps);
}

TEST(CudaOptim, AdamWKernelMatchesTheOpSequenceAndFloat64) {
  ASSERT_TRUE(torch::cuda::is_available());
  const Case c = make_case(3);
  AdamWOptions o;
  o.beta1 = 0.8;
  o.beta2 = 0.9;
  o.eps = 1e-6;
  o.weight_decay = 0.1;
  {
    // The case's tensors are ones the kernel takes (else the fused run would be the ops again).
    std::vector<kernels::AdamWTensor> ts;
    for (const Param& p : cuda_params(c)) {
      const bool low = p.tensor.scalar_type() != at::kFloat;
      const auto f = p.tensor.options().dtype(at::kFloat);
      ts.push_back({p.tensor, at::zeros_like(p.tensor), at::zeros(p.tensor.sizes(), f), at::zeros(p.tensor.sizes(), f),
                    low ? at::zeros(p.tensor.sizes(), f) : at::Tensor(), p.decay});
    }
    ASSERT_TRUE(kernels::adamw_supported(ts));
  }
  const Trained fused = run(c, o, true), ops = run(c, o, false);

  // float64 reference of the same three steps.
  for (size_t i = 0; i < c.init.size(); ++i) {
    const at::ScalarType t = c.types[i];
    const bool decay = i % 3 != 1;
    at::Tensor w = c.init[i].to(at::kDouble), m = at::zeros_like(w), v = at::zeros_like(w);
    for (size_t s = 0; s < c.grads.size(); ++s) {
      if (s == 1 && i == 4) continue;
      const at::Tensor g = c.grads[s][i].to(at::kDouble);
      if (decay) w = w * (1 - kLr[s] * o.weight_decay);
      m = o.beta1 * m + (1 - o.beta1) * g;
      v = o.beta2 * v + (1 - o.beta2) * g * g;
      // The bias corrections count the optimiser's steps, not the tensor's.
      const double bc1 = 1 - std::pow(o.beta1, static_cast<double>(s + 1)), bc2 = 1 - std::pow(o.beta2, static_cast<double>(s + 1));
      w = w - (kLr[s] / bc1) * m / ((v / bc2).sqrt() + o.eps);
    }
    const std::string name = "p" + std::to_string(i);
    SCOPED_TRACE(name + " " + std::string(c10::toString(t)) + " n=" + std::to_string(c.init[i].numel()));
    if (c.init[i].numel() == 0) continue;   // in the launches, nothing to compare
    // The kernel rounds where the ops round, so the two agree to within a unit or two of float32 (a
    // fused multiply-add inside a LibTorch op may round differently from ours); both stay within a few
    // units of the float64 values.
    for (const char* part : {".exp_avg", ".exp_avg_sq"}) {
      EXPECT_LE(eps_units(fused.state.at(name + part), ops.state.at(name + part), at::kFloat), 2.0) << part;
      const at::Tensor& exact = std::string(part) == ".exp_avg" ? m : v;
      EXPECT_LE(eps_units(fused.state.at(name + part), exact, at::kFloat), 8.0) << part << " against float64";
    }
    const at::Tensor wf = t == at::kFloat ? fused.params[i].tensor.detach().cpu() : fused.state.at(name + ".master");
    const at::Tensor wo = t == at::kFloat ? ops.params[i].tensor.detach().cpu() : ops.state.at(name + ".master");
    EXPECT_LE(eps_units(wf, wo, at::kFloat), 4.0);
    EXPECT_LT((wf.to(at::kDouble) - w).abs().max().item<double>(), 1e-6 * (1 + w.abs().max().item<double>()));
    if (t != at::kFloat) {
      // The parameter is its master rounded to its type, as the op sequence's copy_ rounds it.
      EXPECT_TRUE(at::equal(fused.params[i].tensor.detach().cpu(), fused.state.at(name + ".master").to(t)));
      EXPECT_LE(eps_units(fused.params[i].tensor.detach().cpu().to(at::kFloat), ops.params[i].tensor.detach().cpu().to(at::kFloat), t),
                1.0);
    }
  }
}

TEST(CudaOptim, GradNormAndClippingMatchTheOpsAndFloat64) {
  ASSERT_TRUE(torch::cuda::is_available());
  const Case c = make_case(1);
  auto with_grads = [&] {
    std::vector<Param> ps = cuda_params(c);
    for (size_t i = 0; i < ps.size(); ++i) ps[i].tensor.mutable_grad() = c.grads[0][i].to(at::kCUDA, c.types[i]) * 100;
    ps[7].tensor.mutable_grad() = at::Tensor();   // no gradient: left out of the norm
    return ps;
  };
  double ref = 0;
  for (const Param& p : with_grads())
    if (p.tensor.grad().defined()) ref += p.tensor.grad().cpu().to(at::kDouble).pow(2).sum().item<double>();
  ref = std::sqrt(ref);

  set_fused_optimizer(true);
  auto pf = with_grads();
  const double nf = clip_grad_norm(pf, ref / 3);
  set_fused_optimizer(false);
  auto po = with_grads();
  const double no = clip_grad_norm(po, ref / 3);
  set_fused_optimizer(true);
  EXPECT_NEAR(nf, ref, 1e-6 * ref);
  EXPECT_NEAR(no, ref, 1e-5 * ref);
  for (size_t i = 0; i < pf.size(); ++i) {
    if (i == 7) {
      EXPECT_FALSE(pf[i].tensor.grad().defined());
      continue;
    }
    // Each path scales by the factor of its own norm; by the fused path's factor, the op the op sequence
    // runs (mul_) gives the same bits as the kernel.
    const double s = (ref / 3) / (nf + 1e-6);
    const at::Tensor want = (c.grads[0][i].to(at::kCUDA, c.types[i]) * 100).mul_(s);
    EXPECT_TRUE(at::equal(pf[i].tensor.grad(), want)) << "tensor " << i;
  }
  // Under the limit nothing is scaled.
  auto pu = with_grads();
  EXPECT_NEAR(clip_grad_norm(pu, ref * 2), ref, 1e-6 * ref);
  for (size_t i = 0; i < pu.size(); ++i)
    if (i != 7) EXPECT_TRUE(at::equal(pu[i].tensor.grad(), c.grads[0][i].to(at::kCUDA, c.types[i]) * 100));
}

TEST(CudaOptim, KernelsNameWhatTheyRefuse) {
  ASSERT_TRUE(torch::cuda::is_available());
  const auto f = at::TensorOptions().dtype(at::kFloat).device(at::kCUDA);
  const auto b = f.dtype(at::kBFloat16);
  auto expect_refusal = [](const std::vector<kernels::AdamWTensor>& ts, const std::string& what) {
    EXPECT_FALSE(kernels::adamw_supported(ts)) << what;
    try {
      kernels::adamw_step(ts, {});
      ADD_FAILURE() << "no refusal: " << what;
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find(what), std::string::npos) << e.what();
    }
  };
  const at::Tensor p = at::zeros({10}, b), g = at::zeros({10}, b), m = at::zeros({10}, f), v = at::zeros({10}, f),
                   w = at::zeros({10}, f);
  expect_refusal({{p, g, m, v, at::Tensor()}}, "master of tensor 0");
  expect_refusal({{p, g, m, v, w}, {at::zeros({4}, f), at::zeros({4}, f), at::zeros({4}, f), at::zeros({4}, f), w}},
                 "master of tensor 1");
  expect_refusal({{p, at::zeros({10}, f), m, v, w}}, "grad of tensor 0");
  expect_refusal({{p, g, at::zeros({9}, f), v, w}}, "exp_avg of tensor 0");
  expect_refusal({{p, g, m, at::zeros({20}, f).slice(0, 0, 20, 2), w}}, "exp_avg_sq of tensor 0");
  expect_refusal({{p.cpu(), g, m, v, w}}, "param of tensor 0");
  expect_refusal({{p.to(at::kDouble), g, m, v, w}}, "param of tensor 0");
  EXPECT_FALSE(kernels::multi_supported({at::zeros({3}, f), at::zeros({3}, f.dtype(at::kDouble))}));
  EXPECT_FALSE(kernels::multi_supported({at::zeros({3}, f), at::zeros({3})}));
  EXPECT_FALSE(kernels::multi_supported({}));
  EXPECT_THROW(kernels::sum_squares({at::zeros({4}, f).slice(0, 0, 4, 2)}), std::invalid_argument);
  EXPECT_THROW(kernels::scale_({at::zeros({3}, f.dtype(at::kLong))}, 2.0), std::invalid_argument);
  // A float64 parameter is left to the op sequence: AdamW still steps it.
  std::vector<Param> ps = {{"d", at::ones({3}, f.dtype(at::kDouble)).requires_grad_(true), true}};
  ps[0].tensor.mutable_grad() = at::ones({3}, f.dtype(at::kDouble));
  AdamW opt(ps, {});
  opt.step(0.1);
  EXPECT_TRUE(at::allclose(ps[0].tensor.detach().cpu(), at::full({3}, 0.9, at::kDouble), 1e-9, 1e-9));
}

}  // namespace
}  // namespace hh::train
