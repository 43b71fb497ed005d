// AdamW against LibTorch's torch::optim::AdamW, float32 masters for bf16 parameters, state round trips,
// gradient clipping and the learning-rate schedules worked by hand.
#include <torch/torch.h>

#include <cmath>

#include "core/train/optim.h"
#include "support/test_support.h"

namespace hh::train {
namespace {

// Deterministic gradients for step s of parameter i, exactly representable in bf16.
at::Tensor grad_for(const at::Tensor& p, int64_t s, int64_t i) {
  at::manual_seed(1000 * s + i);
  return at::randn(p.sizes()).to(at::kBFloat16).to(at::kFloat);
}

std::vector<at::Tensor> make_params(at::ScalarType dt) {
  at::manual_seed(7);
  return {at::randn({4, 3}).to(dt), at::randn({5}).to(dt), at::randn({2, 2, 2}).to(dt)};
}

TEST(AdamW, MatchesLibTorchAdamW) {
  auto ours = make_params(at::kFloat);
  auto ref = make_params(at::kFloat);
  std::vector<Param> params;
  for (size_t i = 0; i < ours.size(); ++i) {
    ours[i].requires_grad_(true);
    params.push_back({"p" + std::to_string(i), ours[i], true});
  }
  AdamWOptions o;
  o.beta1 = 0.8;
  o.beta2 = 0.9;
  o.eps = 1e-6;
  o.weight_decay = 0.1;
  AdamW opt(params, o);
  for (auto& t : ref) t.requires_grad_(true);
  torch::optim::AdamW torch_opt(std::vector<at::Tensor>(ref.begin(), ref.end()),
                                torch::optim::AdamWOptions(0.01).betas({0.8, 0.9}).eps(1e-6).weight_decay(0.1));
  const double lrs[] = {0.01, 0.02, 0.005, 0.03, 0.01, 0.001};
  for (int64_t s = 0; s < 6; ++s) {
    for (size_t i = 0; i < ours.size(); ++i) {
      ours[i].mutable_grad() = grad_for(ours[i], s, static_cast<int64_t>(i));
      ref[i].mutable_grad() = grad_for(ref[i], s, static_cast<int64_t>(i));
    }
    opt.step(lrs[s]);
    for (auto& g : torch_opt.param_groups()) static_cast<torch::optim::AdamWOptions&>(g.options()).lr(lrs[s]);
    torch_opt.step();
  }
  for (size_t i = 0; i < ours.size(); ++i) EXPECT_TRUE(at::allclose(ours[i], ref[i], 1e-6, 1e-7)) << "param " << i;
  EXPECT_EQ(opt.steps(), 6);
}

TEST(AdamW, Bf16ParametersFollowTheirFloat32Masters) {
  auto low = make_params(at::kBFloat16);
  std::vector<at::Tensor> high;
  for (const auto& t : low) high.push_back(t.to(at::kFloat));   // the same starting values
  std::vector<Param> pl, ph;
  for (size_t i = 0; i < low.size(); ++i) {
    low[i].requires_grad_(true);
    high[i].requires_grad_(true);
    pl.push_back({"p" + std::to_string(i), low[i], true});
    ph.push_back({"p" + std::to_string(i), high[i], true});
  }
  AdamW a(pl, {}), b(ph, {});
  for (int64_t s = 0; s < 20; ++s) {
    for (size_t i = 0; i < low.size(); ++i) {
      low[i].mutable_grad() = grad_for(low[i], s, static_cast<int64_t>(i)).to(at::kBFloat16);
      high[i].mutable_grad() = grad_for(high[i], s, static_cast<int64_t>(i));
    }
    a.step(1e-4);   // updates far below bf16 resolution: lost without a master copy
    b.step(1e-4);
  }
  std::map<std::string, at::Tensor> state;
  for (auto& [k, v] : a.state()) state[k] = v;
  for (size_t i = 0; i < low.size(); ++i) {
    const at::Tensor& master = state.at("p" + std::to_string(i) + ".master");
    EXPECT_TRUE(at::allclose(master, high[i], 1e-6, 1e-7)) << "param " << i;
    EXPECT_TRUE(at::equal(low[i], master.to(at::kBFloat16))) << "param " << i;
  }
}

TEST(AdamW, StateRoundTripContinuesTheSameTrajectory) {
  auto straight = make_params(at::kFloat), resumed = make_params(at::kFloat);
  auto params_of = [](std::vector<at::Tensor>& ts) {
    std::vector<Param> ps;
    for (size_t i = 0; i < ts.size(); ++i) {
      ts[i].requires_grad_(true);
      ps.push_back({"p" + std::to_string(i), ts[i], i != 1});
    }
    return ps;
  };
  AdamWOptions o;
  o.weight_decay = 0.05;
  auto run = [&](AdamW& opt, std::vector<at::Tensor>& ts, int64_t from, int64_t to) {
    for (int64_t s = from; s < to; ++s) {
      for (size_t i = 0; i < ts.size(); ++i) ts[i].mutable_grad() = grad_for(ts[i], s, static_cast<int64_t>(i));
      opt.step(0.01);
    }
  };
  AdamW a(params_of(straight), o);
  run(a, straight, 0, 6);
  AdamW b(params_of(resumed), o);
  run(b, resumed, 0, 3);
  std::map<std::string, at::Tensor> saved;
  for (auto& [k, v] : b.state()) saved[k] = v.clone();
  AdamW c(params_of(resumed), o);
  c.load_state(saved, b.steps());
  run(c, resumed, 3, 6);
  for (size_t i = 0; i < straight.size(); ++i) EXPECT_TRUE(at::equal(straight[i], resumed[i])) << "param " << i;

  saved.erase("p2.exp_avg_sq");
  EXPECT_MENTIONS(test::error_of([&] { c.load_state(saved, 3); }), "p2.exp_avg_sq");
}

TEST(AdamW, ParametersWithoutDecayOrGradientAreLeftAlone) {
  at::Tensor a = at::ones({3}).requires_grad_(true), b = at::ones({3}).requires_grad_(true);
  AdamWOptions o;
  o.weight_decay = 0.5;
  AdamW opt({{"a", a, false}, {"b", b, true}}, o);
  a.mutable_grad() = at::zeros({3});
  opt.step(0.1);   // a: zero gradient and no decay -> unchanged; b: no gradient -> skipped
  EXPECT_TRUE(at::equal(a, at::ones({3})));
  EXPECT_TRUE(at::equal(b, at::ones({3})));
}

TEST(ClipGradNorm, ScalesToTheLimitAndReportsTheNormBefore) {
  at::Tensor a = at::zeros({2}).requires_grad_(true), b = at::zeros({1}).requires_grad_(true);
  a.mutable_grad() = at::tensor({3.0f, 4.0f});
  b.mutable_grad() = at::tensor({12.0f});
  std::vector<Param> ps{{"a", a, true}, {"b", b, true}};
  EXPECT_DOUBLE_EQ(grad_norm(ps), 13.0);
  EXPECT_NEAR(clip_grad_norm(ps, 6.5), 13.0, 1e-12);
  EXPECT_NEAR(a.grad()[0].item<double>(), 1.5, 1e-5);
  EXPECT_NEAR(b.grad()[0].item<double>(), 6.0, 1e-5);
  EXPECT_NEAR(clip_grad_norm(ps, 100.0), 6.5, 1e-5);   // under the limit: untouched
  EXPECT_NEAR(a.grad()[1].item<double>(), 2.0, 1e-5);
}

TEST(Schedule, WarmupThenDecayWorkedByHand) {
  // lr 1, min 0.1, warmup 2, 10 steps: warmup 0.5, 1.0; then progress (step - 2) / 8.
  for (auto s : {Schedule::Constant, Schedule::Linear, Schedule::Cosine}) {
    EXPECT_DOUBLE_EQ(schedule_lr(s, 1.0, 0.1, 2, 0, 10), 0.5);
    EXPECT_DOUBLE_EQ(schedule_lr(s, 1.0, 0.1, 2, 1, 10), 1.0);
    EXPECT_DOUBLE_EQ(schedule_lr(s, 1.0, 0.1, 2, 2, 10), 1.0);
  }
  EXPECT_DOUBLE_EQ(schedule_lr(Schedule::Constant, 1.0, 0.1, 2, 9, 10), 1.0);
  EXPECT_NEAR(schedule_lr(Schedule::Linear, 1.0, 0.1, 2, 6, 10), 0.55, 1e-12);
  EXPECT_NEAR(schedule_lr(Schedule::Linear, 1.0, 0.1, 2, 4, 10), 0.775, 1e-12);
  EXPECT_NEAR(schedule_lr(Schedule::Linear, 1.0, 0.1, 2, 9, 10), 0.2125, 1e-12);
  EXPECT_NEAR(schedule_lr(Schedule::Cosine, 1.0, 0.1, 2, 6, 10), 0.55, 1e-12);
  EXPECT_NEAR(schedule_lr(Schedule::Cosine, 1.0, 0.1, 2, 4, 10), 0.1 + 0.45 * (1 + std::sqrt(0.5)), 1e-12);
  EXPECT_NEAR(schedule_lr(Schedule::Cosine, 1.0, 0.1, 2, 9, 10), 0.1 + 0.45 * (1 + std::cos(M_PI * 7 / 8)), 1e-12);
  EXPECT_GT(schedule_lr(Schedule::Cosine, 1.0, 0.0, 0, 9, 10), 0.0) << "the last step still learns";
  EXPECT_DOUBLE_EQ(schedule_lr(Schedule::Cosine, 2.0, 0.0, 0, 0, 1), 2.0);   // a single step
  EXPECT_EQ(parse_schedule("linear"), Schedule::Linear);
  EXPECT_MENTIONS(test::error_of([] { parse_schedule("cosin"); }), "cosin");
}

}  // namespace
}  // namespace hh::train
