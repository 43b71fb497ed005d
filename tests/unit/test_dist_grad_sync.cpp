// GradSync's bookkeeping on a real Gloo group of one process (its all-reduce is then the identity, so
// the averaged gradient must equal the plain one exactly): buckets in reverse parameter order, gradient
// accumulation that communicates only on the last micro-step, a parameter that gets no gradient, and
// a parameter whose gradient arrives in two separate backward passes (the fallback path).
#include <torch/torch.h>

#include <gtest/gtest.h>

#include "core/dist/env.h"
#include "core/dist/grad_sync.h"
#include "core/dist/launcher.h"
#include "core/dist/process_group.h"
#include "support/test_support.h"

namespace {

std::shared_ptr<hh::dist::ProcessGroup> group_of_one() {
  hh::dist::DistEnv env;
  env.master_addr = "127.0.0.1";
  env.master_port = hh::dist::free_local_port();
  env.source = "test";
  return hh::dist::ProcessGroup::create(env, "cpu", 30);
}

struct Params {
  std::vector<at::Tensor> t;   // [10] (never used), [300], [1000]
};

Params make_params() {
  at::manual_seed(3);
  return {{at::randn({10}).requires_grad_(), at::randn({300}).requires_grad_(), at::randn({1000}).requires_grad_()}};
}

// A loss of p1 and p2 (not p0), different per micro-step.
at::Tensor loss_of(const Params& p, int micro) {
  const double s = 1.0 + micro;
  return (p.t[2] * p.t[2]).sum() * s + (p.t[1].sin() * s).sum() + p.t[2].narrow(0, 0, 300).dot(p.t[1]);
}

TEST(DistGradSync, BucketsInReverseOrderAndAccumulationCommunicatesOnce) {
  auto g = group_of_one();
  EXPECT_EQ(g->size(), 1);
  EXPECT_STREQ(g->backend_name(), "gloo");
  Params ref = make_params(), dp = make_params();
  // Reference gradients: two micro-steps, plain autograd.
  for (int m = 0; m < 2; ++m) loss_of(ref, m).backward();
  {
    // 1,000-byte buckets, filled from the last parameter: [p2], [p1], [p0].
    hh::dist::GradSync sync(*g, dp.t, 1000);
    EXPECT_EQ(sync.num_buckets(), 3);
    sync.set_sync(false);
    loss_of(dp, 0).backward();
    sync.set_sync(true);
    loss_of(dp, 1).backward();
    sync.finish();
  }
  EXPECT_TRUE(at::equal(dp.t[1].grad(), ref.t[1].grad()));
  EXPECT_TRUE(at::equal(dp.t[2].grad(), ref.t[2].grad()));
  ASSERT_TRUE(dp.t[0].grad().defined()) << "a parameter without a gradient counts as zeros";
  EXPECT_EQ(dp.t[0].grad().abs().sum().item<double>(), 0.0);
  // The hooks are gone with the GradSync: plain accumulation again.
  for (auto& t : dp.t) t.mutable_grad() = at::Tensor();
  loss_of(dp, 0).backward();
  for (auto& t : ref.t) t.mutable_grad() = at::Tensor();
  loss_of(ref, 0).backward();
  EXPECT_TRUE(at::equal(dp.t[2].grad(), ref.t[2].grad()));
  EXPECT_FALSE(dp.t[0].grad().defined());
}

TEST(DistGradSync, AGradientInTwoBackwardPassesOfOneStepIsStillWhole) {
  auto g = group_of_one();
  Params ref = make_params(), dp = make_params();
  (ref.t[2] * 2).sum().backward();
  (ref.t[2] * ref.t[1].narrow(0, 0, 1)).sum().backward();
  hh::dist::GradSync sync(*g, dp.t, 1000);
  for (int step = 0; step < 2; ++step) {   // twice: the state resets between steps
    for (auto& t : dp.t) t.mutable_grad() = at::Tensor();
    sync.set_sync(true);
    (dp.t[2] * 2).sum().backward();                          // p2's bucket (the first) starts here
    (dp.t[2] * dp.t[1].narrow(0, 0, 1)).sum().backward();    // and p2's gradient grows after
    sync.finish();
    EXPECT_TRUE(at::equal(dp.t[2].grad(), ref.t[2].grad())) << "step " << step;
    EXPECT_TRUE(at::equal(dp.t[1].grad(), ref.t[1].grad())) << "step " << step;
    EXPECT_EQ(dp.t[0].grad().abs().sum().item<double>(), 0.0);
  }
}

}  // namespace
