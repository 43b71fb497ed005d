// The chunked gated delta rule against the per-token recurrence (the oracle), the recurrence against
// numbers worked by hand, and the chunked form's gradients against finite differences.
#include <torch/torch.h>

#include <gtest/gtest.h>

#include <cmath>

#include "core/attention/gdn.h"
#include "support/test_support.h"

namespace {

using hh::attention::gdn_chunked;
using hh::attention::gdn_recurrent;

struct Inputs {
  torch::Tensor q, k, v, g, beta, s0;
};

// L2-normalised q and k as the LA heads feed them; g = -decay_scale * U(0, 1); beta in (lo, hi).
Inputs make_inputs(int64_t B, int64_t T, int64_t H, int64_t Dk, int64_t Dv, uint64_t seed, double decay_scale = 1.0,
                   double beta_lo = 0.0, double beta_hi = 1.0, bool with_state = false) {
  torch::manual_seed(seed);
  const auto f64 = torch::TensorOptions().dtype(torch::kDouble);
  Inputs in;
  in.q = torch::nn::functional::normalize(torch::randn({B, T, H, Dk}, f64), torch::nn::functional::NormalizeFuncOptions().dim(-1));
  in.k = torch::nn::functional::normalize(torch::randn({B, T, H, Dk}, f64), torch::nn::functional::NormalizeFuncOptions().dim(-1));
  in.v = torch::randn({B, T, H, Dv}, f64);
  in.g = -decay_scale * torch::rand({B, T, H}, f64);
  in.beta = beta_lo + (beta_hi - beta_lo) * torch::rand({B, T, H}, f64);
  if (with_state) in.s0 = torch::randn({B, H, Dk, Dv}, f64);
  return in;
}

void expect_same(const Inputs& in, int64_t chunk, const std::string& what) {
  const double scale = 0.25;
  const auto r = gdn_recurrent(in.q, in.k, in.v, in.g, in.beta, in.s0, scale);
  const auto c = gdn_chunked(in.q, in.k, in.v, in.g, in.beta, in.s0, scale, chunk);
  ASSERT_EQ(c.o.sizes(), r.o.sizes()) << what;
  EXPECT_LT((c.o - r.o).abs().max().item<double>(), 1e-10) << what;
  EXPECT_LT((c.state - r.state).abs().max().item<double>(), 1e-10) << what;
}

TEST(GatedDeltaRule, RecurrenceMatchesNumbersWorkedByHand) {
  // B = H = 1, Dk = Dv = 1, two tokens.
  const auto f64 = torch::TensorOptions().dtype(torch::kDouble);
  const auto q = torch::tensor({0.5, 2.0}, f64).view({1, 2, 1, 1});
  const auto k = torch::tensor({1.0, -1.0}, f64).view({1, 2, 1, 1});
  const auto v = torch::tensor({3.0, 1.0}, f64).view({1, 2, 1, 1});
  const auto g = torch::tensor({-0.1, std::log(0.5)}, f64).view({1, 2, 1});
  const auto beta = torch::tensor({0.5, 1.0}, f64).view({1, 2, 1});
  const auto r = gdn_recurrent(q, k, v, g, beta, {}, 1.0);
  // S1 = 0 + k1 * b1 * (v1 - 0) = 1 * 0.5 * 3 = 1.5; o1 = S1 * q1 = 0.75.
  // S2 = 0.5 * 1.5 + k2 * b2 * (v2 - 0.5 * 1.5 * k2) = 0.75 + (-1) * (1 - (-0.75)) = -1.0; o2 = -2.0.
  EXPECT_NEAR(r.o[0][0][0][0].item<double>(), 0.75, 1e-12);
  EXPECT_NEAR(r.o[0][1][0][0].item<double>(), -2.0, 1e-12);
  EXPECT_NEAR(r.state.item<double>(), -1.0, 1e-12);
}

TEST(GatedDeltaRule, ChunkedEqualsRecurrenceForAnyLength) {
  for (int64_t T : {1, 5, 63, 64, 65, 130, 200})
    expect_same(make_inputs(2, T, 3, 16, 8, 10 + T), 64, "T=" + std::to_string(T));
  expect_same(make_inputs(1, 37, 2, 8, 8, 3), 8, "chunk 8");   // several chunks, ragged end
  expect_same(make_inputs(1, 37, 2, 8, 8, 3), 1, "chunk 1");   // the recurrence itself
}

TEST(GatedDeltaRule, ChunkedEqualsRecurrenceInHardRegimes) {
  expect_same(make_inputs(2, 150, 2, 16, 16, 1, 0.0, 0.0, 1.0, true), 64, "initial state, no decay");
  expect_same(make_inputs(2, 150, 2, 16, 16, 2, 8.0, 0.0, 1.0, true), 64, "strong decay (g down to -8)");
  expect_same(make_inputs(2, 150, 2, 16, 16, 3, 1.0, 0.99, 1.0), 64, "beta near 1");
  expect_same(make_inputs(2, 150, 2, 16, 16, 4, 0.5, 0.0, 2.0, true), 64, "negative eigenvalues (beta up to 2)");
}

TEST(GatedDeltaRule, Float32InputsKeepAFloat32State) {
  const auto in = make_inputs(1, 100, 2, 32, 32, 5, 1.0, 0.0, 1.0, true);
  const auto r = gdn_recurrent(in.q, in.k, in.v, in.g, in.beta, in.s0, 0.2);
  const auto c = gdn_chunked(in.q.to(torch::kFloat), in.k.to(torch::kFloat), in.v.to(torch::kBFloat16),
                             in.g.to(torch::kFloat), in.beta.to(torch::kFloat), in.s0.to(torch::kFloat), 0.2);
  EXPECT_EQ(c.state.scalar_type(), torch::kFloat);
  EXPECT_EQ(c.o.scalar_type(), torch::kBFloat16);
  EXPECT_LT((c.state.to(torch::kDouble) - r.state).abs().max().item<double>(), 5e-2);
}

TEST(GatedDeltaRule, ChunkedGradientsMatchFiniteDifferencesAndTheRecurrence) {
  Inputs in = make_inputs(1, 11, 2, 4, 3, 6, 1.0, 0.1, 0.9, true);
  for (auto* t : {&in.q, &in.k, &in.v, &in.g, &in.beta, &in.s0}) t->requires_grad_(true);
  const auto w_o = torch::randn({1, 11, 2, 3}, torch::kDouble), w_s = torch::randn({1, 2, 4, 3}, torch::kDouble);
  auto loss = [&](bool chunked, const Inputs& x) {
    const auto out = chunked ? gdn_chunked(x.q, x.k, x.v, x.g, x.beta, x.s0, 0.5, 4)
                             : gdn_recurrent(x.q, x.k, x.v, x.g, x.beta, x.s0, 0.5);
    return (out.o * w_o).sum() + (out.state * w_s).sum();
  };
  const std::vector<torch::Tensor> leaves = {in.q, in.k, in.v, in.g, in.beta, in.s0};
  const auto gc = torch::autograd::grad({loss(true, in)}, leaves);
  const auto gr = torch::autograd::grad({loss(false, in)}, leaves);
  const char* names[] = {"q", "k", "v", "g", "beta", "s0"};
  for (size_t i = 0; i < leaves.size(); ++i) {
    EXPECT_LT((gc[i] - gr[i]).abs().max().item<double>(), 1e-9) << names[i];
    // Directional derivative along a random direction, by central differences.
    const auto dir = torch::randn_like(leaves[i]);
    const double h = 1e-6;
    Inputs plus = in, minus = in;
    torch::NoGradGuard no_grad;
    auto perturb = [&](Inputs& x, double s) {
      torch::Tensor* slots[] = {&x.q, &x.k, &x.v, &x.g, &x.beta, &x.s0};
      *slots[i] = leaves[i].detach() + s * dir;
    };
    perturb(plus, h);
    perturb(minus, -h);
    const double fd = (loss(true, plus).item<double>() - loss(true, minus).item<double>()) / (2 * h);
    EXPECT_NEAR((gc[i] * dir).sum().item<double>(), fd, 1e-6 * std::max(1.0, std::abs(fd))) << names[i];
  }
}

TEST(GatedDeltaRule, BadShapesAreRefusedNamingTheTensor) {
  const auto in = make_inputs(1, 4, 2, 8, 8, 7);
  EXPECT_MENTIONS(hh::test::error_of([&] { gdn_chunked(in.q, in.k.narrow(3, 0, 4), in.v, in.g, in.beta, {}, 1.0); }),
                  "q and k must both be");
  EXPECT_MENTIONS(hh::test::error_of([&] { gdn_recurrent(in.q, in.k, in.v, in.g.narrow(1, 0, 3), in.beta, {}, 1.0); }),
                  "g and beta must be [B, T, H] = [1, 4, 2]");
  EXPECT_MENTIONS(hh::test::error_of([&] { gdn_chunked(in.q, in.k, in.v, in.g, in.beta, torch::zeros({1, 2, 8, 7}), 1.0); }),
                  "initial_state must be [B, H, Dk, Dv] = [1, 2, 8, 8]");
}

}  // namespace
