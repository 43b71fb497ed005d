// The chunked gated delta rule against the per-token recurrence (the oracle), the recurrence against
// numbers worked by hand, and the chunked form's gradients against finite differences.
#include <torch/torch.h>

#include <gtest/gtest.h>

#include <cmath>
#include <tuple>
#include <vector>

#include <ATen/core/dispatch/Dispatcher.h>

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

// ---- gdn_chunked_scan: batched chunk-local work around the state scan, with its own backward ----

using hh::attention::gdn_chunked_scan;
using hh::attention::gdn_state_scan;

TEST(GatedDeltaRuleScan, StateScanOpRunsTheRecurrenceForwardAndBackward) {
  // Two sequences of 2 and 1 chunks (and an empty one), H = 1, Dk = 2, Dv = 1, numbers by hand:
  // Y_{n+1} = P_n^T Y_n + Z_n.
  const auto f64 = torch::TensorOptions().dtype(torch::kDouble);
  const auto P = torch::tensor({1.0, 2.0, 0.0, 1.0,    // P_0 = [[1, 2], [0, 1]]
                                0.5, 0.0, 0.0, 2.0,    // P_1 = diag(0.5, 2)
                                0.0, 1.0, 1.0, 0.0},   // P_2 = [[0, 1], [1, 0]]
                               f64).view({1, 3, 2, 2});
  const auto Z = torch::tensor({1.0, 0.0, 0.0, 1.0, 3.0, 4.0}, f64).view({1, 3, 2, 1});
  const auto y0 = torch::tensor({1.0, 1.0, 2.0, -1.0, 7.0, 8.0}, f64).view({3, 1, 2, 1});
  const auto fw = gdn_state_scan(P, Z, y0, {0, 2, 2, 3}, /*reverse=*/false);
  // seq 0: Y0 = (1, 1); P_0^T Y0 = (1, 3) + (1, 0) = (2, 3); P_1^T (2, 3) = (1, 6) + (0, 1) = (1, 7).
  // seq 1: no chunks, final = (2, -1). seq 2: Y0 = (7, 8); P_2^T Y0 = (8, 7) + (3, 4) = (11, 11).
  EXPECT_TRUE(torch::equal(fw.hist.flatten(), torch::tensor({1.0, 1.0, 2.0, 3.0, 7.0, 8.0}, f64)));
  EXPECT_TRUE(torch::equal(fw.final_state.flatten(), torch::tensor({1.0, 7.0, 2.0, -1.0, 11.0, 11.0}, f64)));
  const auto bw = gdn_state_scan(P, Z, y0, {0, 2, 2, 3}, /*reverse=*/true);
  // seq 0 reversed: Y = (1, 1); P_1^T Y + Z_1 = (0.5, 2) + (0, 1) = (0.5, 3); P_0^T (0.5, 3) + Z_0 = (1.5, 4).
  EXPECT_TRUE(torch::equal(bw.hist.flatten(), torch::tensor({0.5, 3.0, 1.0, 1.0, 7.0, 8.0}, f64)));
  EXPECT_TRUE(torch::equal(bw.final_state.flatten(), torch::tensor({1.5, 4.0, 2.0, -1.0, 11.0, 11.0}, f64)));
  EXPECT_MENTIONS(hh::test::error_of([&] { gdn_state_scan(P, Z, y0, {0, 2, 3}, false); }), "offsets must hold S + 1 = 4");
}

TEST(GatedDeltaRuleScan, EqualsTheRecurrenceForAnyLengthAndRegime) {
  struct Case {
    int64_t B, T, chunk;
    double decay, beta_lo, beta_hi;
    bool state;
  };
  for (const Case& c : {Case{2, 1, 64, 1, 0, 1, false}, Case{2, 63, 64, 1, 0, 1, true}, Case{1, 65, 64, 1, 0, 1, true},
                        Case{2, 200, 64, 8, 0, 1, true}, Case{1, 150, 16, 0.5, 0, 2, true}, Case{1, 37, 8, 0, 0.99, 1, false}}) {
    const auto in = make_inputs(c.B, c.T, 3, 16, 8, 40 + c.T, c.decay, c.beta_lo, c.beta_hi, c.state);
    const auto r = gdn_recurrent(in.q, in.k, in.v, in.g, in.beta, in.s0, 0.25);
    const auto s = gdn_chunked_scan(in.q, in.k, in.v, in.g, in.beta, in.s0, 0.25, c.chunk);
    const std::string what = "B=" + std::to_string(c.B) + " T=" + std::to_string(c.T) + " chunk=" + std::to_string(c.chunk);
    ASSERT_EQ(s.o.sizes(), r.o.sizes()) << what;
    EXPECT_LT((s.o - r.o).abs().max().item<double>(), 1e-10) << what;
    EXPECT_LT((s.state - r.state).abs().max().item<double>(), 1e-10) << what;
  }
}

TEST(GatedDeltaRuleScan, AcceptsStridedInputs) {
  // The hybrid layer hands over narrowed and reshaped projections: q, k, v as slices of one tensor;
  // T = 64 needs no padding (the slices themselves get permuted), T = 70 does.
  for (int64_t T : {64, 70}) {
  const auto in = make_inputs(2, T, 3, 8, 8, 21);
  const auto qkv = torch::cat({in.q, in.k, in.v}, 3);  // [B, T, H, 24]
  const auto q = qkv.narrow(3, 0, 8), k = qkv.narrow(3, 8, 8), v = qkv.narrow(3, 16, 8);
  const auto g = torch::stack({in.g, in.beta}, 3).select(3, 0), beta = torch::stack({in.g, in.beta}, 3).select(3, 1);
  ASSERT_FALSE(q.is_contiguous());
  ASSERT_FALSE(g.is_contiguous());
  const auto r = gdn_recurrent(in.q, in.k, in.v, in.g, in.beta, {}, 0.3);
  const auto s = gdn_chunked_scan(q, k, v, g, beta, {}, 0.3, 16);
  // float32 strided inputs too: no dtype change, so nothing but the layout code makes them dense.
  const auto f32 = gdn_chunked_scan(q.to(torch::kFloat), k.to(torch::kFloat), v.to(torch::kFloat), g.to(torch::kFloat),
                                    beta.to(torch::kFloat), {}, 0.3, 16);
  EXPECT_LT((f32.o.to(torch::kDouble) - r.o).abs().max().item<double>(), 1e-4) << "float32, T=" << T;
  EXPECT_LT((s.o - r.o).abs().max().item<double>(), 1e-10) << "T=" << T;
  EXPECT_LT((s.state - r.state).abs().max().item<double>(), 1e-10) << "T=" << T;
  }
}

TEST(GatedDeltaRuleScan, PackedSequencesEqualEachSequenceAlone) {
  // Lengths 5, 0, 64, 70 packed into one row; each must see only its own tokens and its own state.
  const std::vector<int64_t> cu = {0, 5, 5, 69, 139};
  const auto in = make_inputs(1, 139, 2, 8, 16, 77, 1.0, 0.0, 1.0);
  const auto s0 = torch::randn({4, 2, 8, 16}, torch::kDouble);
  const auto packed = gdn_chunked_scan(in.q, in.k, in.v, in.g, in.beta, s0, 0.5, 16, cu);
  ASSERT_EQ(packed.state.sizes(), s0.sizes());
  for (size_t s = 0; s + 1 < cu.size(); ++s) {
    const int64_t a = cu[s], len = cu[s + 1] - cu[s];
    const auto init = s0.narrow(0, static_cast<int64_t>(s), 1);
    if (len == 0) {
      EXPECT_TRUE(torch::equal(packed.state[static_cast<int64_t>(s)], s0[static_cast<int64_t>(s)])) << "empty sequence";
      continue;
    }
    auto cut = [&](const torch::Tensor& x) { return x.narrow(1, a, len); };
    const auto alone = gdn_recurrent(cut(in.q), cut(in.k), cut(in.v), cut(in.g), cut(in.beta), init, 0.5);
    EXPECT_LT((cut(packed.o) - alone.o).abs().max().item<double>(), 1e-10) << "sequence " << s;
    EXPECT_LT((packed.state.narrow(0, static_cast<int64_t>(s), 1) - alone.state).abs().max().item<double>(), 1e-10)
        << "sequence " << s;
  }
  EXPECT_MENTIONS(hh::test::error_of([&] { gdn_chunked_scan(in.q, in.k, in.v, in.g, in.beta, {}, 0.5, 16, {0, 5, 100}); }),
                  "cu_seqlens must run from 0 to T = 139");
  EXPECT_MENTIONS(hh::test::error_of([&] { gdn_chunked_scan(in.q, in.k, in.v, in.g, in.beta, s0, 0.5, 16, {0, 139}); }),
                  "initial_state must be [S, H, Dk, Dv] = [1, 2, 8, 16]");
}

TEST(GatedDeltaRuleScan, GradientsEqualAutogradThroughTheReference) {
  // Several chunks and a ragged end, initial state, loss on the output and the final state; and the
  // packed form against its sequences' reference gradients. Both ways of differentiating the
  // chunk-local function: its formulas written out, and autograd through its ops.
  using hh::attention::GdnBackward;
  for (GdnBackward mode : {GdnBackward::kExplicit, GdnBackward::kAutograd})
  for (const std::vector<int64_t>& cu : {std::vector<int64_t>{}, std::vector<int64_t>{0, 9, 9, 30}}) {
    hh::attention::set_gdn_backward(mode);
    const int64_t B = cu.empty() ? 2 : 1, S = cu.empty() ? 2 : 3;
    Inputs in = make_inputs(B, 30, 2, 6, 5, 8, 1.0, 0.1, 1.5);
    in.s0 = torch::randn({S, 2, 6, 5}, torch::kDouble);
    for (auto* t : {&in.q, &in.k, &in.v, &in.g, &in.beta, &in.s0}) t->requires_grad_(true);
    const auto w_o = torch::randn({B, 30, 2, 5}, torch::kDouble), w_s = torch::randn({S, 2, 6, 5}, torch::kDouble);
    const std::vector<torch::Tensor> leaves = {in.q, in.k, in.v, in.g, in.beta, in.s0};
    const auto fast = gdn_chunked_scan(in.q, in.k, in.v, in.g, in.beta, in.s0, 0.5, 8, cu);
    const auto g_fast = torch::autograd::grad({(fast.o * w_o).sum() + (fast.state * w_s).sum()}, leaves);
    torch::Tensor ref_loss = torch::zeros({}, torch::kDouble);
    if (cu.empty()) {
      const auto ref = gdn_chunked(in.q, in.k, in.v, in.g, in.beta, in.s0, 0.5, 8);
      ref_loss = (ref.o * w_o).sum() + (ref.state * w_s).sum();
    } else {
      for (int64_t s = 0; s < S; ++s) {
        const int64_t a = cu[static_cast<size_t>(s)], len = cu[static_cast<size_t>(s) + 1] - a;
        const auto init = in.s0.narrow(0, s, 1);
        if (len == 0) {
          ref_loss = ref_loss + (init * w_s.narrow(0, s, 1)).sum();
          continue;
        }
        auto cut = [&](const torch::Tensor& x) { return x.narrow(1, a, len); };
        const auto ref = gdn_chunked(cut(in.q), cut(in.k), cut(in.v), cut(in.g), cut(in.beta), init, 0.5, 8);
        ref_loss = ref_loss + (ref.o * cut(w_o)).sum() + (ref.state * w_s.narrow(0, s, 1)).sum();
      }
    }
    const auto g_ref = torch::autograd::grad({ref_loss}, leaves);
    const char* names[] = {"q", "k", "v", "g", "beta", "s0"};
    for (size_t i = 0; i < leaves.size(); ++i) {
      const double scale = g_ref[i].abs().max().item<double>();
      EXPECT_GT(scale, 0.0) << names[i];
      EXPECT_LT((g_fast[i] - g_ref[i]).abs().max().item<double>(), 1e-9 * std::max(1.0, scale))
          << names[i] << (cu.empty() ? " (batch)" : " (packed)") << (mode == GdnBackward::kExplicit ? " explicit" : " autograd");
    }
  }
  hh::attention::set_gdn_backward(GdnBackward::kKernels);
}

TEST(GatedDeltaRuleScan, TheRegisteredOpIsTheRuleWithItsGradient) {
  // hydrahead::chunk_gated_delta_rule called through the dispatcher, as another program linking the
  // library would: values and gradients against the chunked reference, with and without a state.
  const auto op = c10::Dispatcher::singleton()
                      .findSchemaOrThrow("hydrahead::chunk_gated_delta_rule", "")
                      .typed<std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                                                const at::Tensor&, const at::Tensor&,
                                                                const c10::optional<at::Tensor>&, double, int64_t,
                                                                at::IntArrayRef)>();
  for (bool with_state : {false, true}) {
    Inputs in = make_inputs(2, 21, 2, 6, 5, 8, 1.0, 0.1, 1.5);
    in.s0 = with_state ? torch::randn({2, 2, 6, 5}, torch::kDouble) : torch::zeros({2, 2, 6, 5}, torch::kDouble);
    for (auto* t : {&in.q, &in.k, &in.v, &in.g, &in.beta}) t->requires_grad_(true);
    const std::vector<torch::Tensor> leaves = {in.q, in.k, in.v, in.g, in.beta};
    const std::vector<int64_t> no_packing;
    const auto [o, state] = op.call(in.q, in.k, in.v, in.g, in.beta,
                                    with_state ? c10::optional<at::Tensor>(in.s0) : c10::nullopt, 0.5, 8, no_packing);
    const auto ref = gdn_chunked(in.q, in.k, in.v, in.g, in.beta, in.s0, 0.5, 8);
    EXPECT_LT((o - ref.o).abs().max().item<double>(), 1e-10);
    EXPECT_LT((state - ref.state).abs().max().item<double>(), 1e-10);
    const auto w = torch::randn_like(ref.o);
    const auto g_op = torch::autograd::grad({(o * w).sum() + state.sum()}, leaves);
    const auto g_ref = torch::autograd::grad({(ref.o * w).sum() + ref.state.sum()}, leaves);
    for (size_t i = 0; i < leaves.size(); ++i)
      EXPECT_LT((g_op[i] - g_ref[i]).abs().max().item<double>(), 1e-9 * std::max(1.0, g_ref[i].abs().max().item<double>()))
          << "input " << i << (with_state ? " with a state" : "");
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
