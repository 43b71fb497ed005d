// The HydraHead attention block against the DESIGN section 9 formulas written out step by step.
#include <torch/torch.h>

#include <gtest/gtest.h>

#include <cmath>
#include <utility>
#include <vector>

#include "core/attention/gdn.h"
#include "core/attention/hybrid.h"
#include "core/model/hooks.h"
#include "core/model/transformer.h"
#include "support/test_support.h"
#include "support/tiny_config.h"

namespace {

using hh::attention::HybridLayerWeights;
using hh::attention::HybridOptions;
using hh::model::ModelConfig;

ModelConfig one_layer() {
  return hh::test::tiny_config(1, 4, 2, 8, 32, 48, 40);
}

HybridLayerWeights random_hybrid(const ModelConfig& c, const HybridOptions& o, const hh::attention::HeadSplit& s) {
  HybridLayerWeights w;
  torch::manual_seed(3);
  for (auto& e : hh::attention::hybrid_weight_table(c, o, s, 0, w)) *e.slot = torch::randn(e.shape, torch::kDouble) * 0.3;
  return w;
}

torch::Tensor rms(const torch::Tensor& x, double eps) { return x * torch::rsqrt(x.pow(2).mean(-1, true) + eps); }

// The teacher's layer 0 on `ids`: its normed input x^ and its per-head outputs z.
struct LayerZero {
  torch::Tensor xn, z;
};
LayerZero teacher_layer0(const ModelConfig& c, const hh::model::Weights& tw, const hh::model::Transformer& teacher,
                         const torch::Tensor& ids) {
  std::map<std::string, torch::Tensor> acts;
  hh::model::Hooks hooks;
  hooks.cache(hh::model::hook_name(0, hh::model::HookKind::ResidPre), &acts);
  hooks.cache(hh::model::hook_name(0, hh::model::HookKind::Z), &acts);
  hh::model::ForwardOptions f;
  f.hooks = &hooks;
  teacher.forward(ids, f);
  return {hh::model::rms_norm(acts.at("blocks.0.hook_resid_pre"), tw.layers[0].input_layernorm, c.rms_norm_eps),
          acts.at("blocks.0.attn.hook_z")};
}

TEST(HybridOptions, RoundTripAndRefusals) {
  const auto c = one_layer();
  HybridOptions o;
  o.fa_heads = {{0, 3}, {0, 1}};
  o.fa_log_scale_alpha = 256;
  auto j = o.to_json();
  const auto back = HybridOptions::from_json(j, c, "config.json");
  EXPECT_EQ(back.fa_heads, (std::vector<std::pair<int64_t, int64_t>>{{0, 1}, {0, 3}}));
  EXPECT_EQ(back.fa_log_scale_alpha, 256);
  j["fa_heads"].push_back({1, 0});
  EXPECT_MENTIONS(hh::test::error_of([&] { HybridOptions::from_json(j, c, "config.json"); }), "outside the model's 1 layers");
  j = o.to_json();
  j["fa_heads"].push_back({0, 3});
  EXPECT_MENTIONS(hh::test::error_of([&] { HybridOptions::from_json(j, c, "config.json"); }), "lists [0, 3] twice");
  j = o.to_json();
  j["gdn_chunk"] = 0;
  EXPECT_MENTIONS(hh::test::error_of([&] { HybridOptions::from_json(j, c, "config.json"); }), "hydrahead.gdn_chunk");
  const auto split = hh::attention::split_heads(back, c);
  EXPECT_EQ(split[0].fa, (std::vector<int64_t>{1, 3}));
  EXPECT_EQ(split[0].la, (std::vector<int64_t>{0, 2}));
}

TEST(HybridAttention, EveryHeadFollowsTheFormulasStepByStep) {
  const auto c = one_layer();
  const double eps = c.rms_norm_eps, scale = 1.0 / std::sqrt(8.0);
  const auto tw = hh::model::random_weights(c, 9, torch::kDouble, 0.3);
  const hh::model::Transformer teacher(c, tw);
  const int64_t T = 70;  // more than one chunk
  const auto ids = torch::randint(40, {2, T}, torch::TensorOptions().dtype(torch::kLong));
  const auto [xn, z_teacher] = teacher_layer0(c, tw, teacher, ids);  // z: [2, T, 4, 8]

  // FA heads 1 and 3 read KV groups 0 and 1; heads 2 and 3 both read group 1 (the layer projects
  // that group's keys and values only), and LA heads 0 and 1 are one run of consecutive heads.
  const std::vector<std::vector<std::pair<int64_t, int64_t>>> fa_sets = {{{0, 1}, {0, 3}}, {{0, 2}, {0, 3}}};
  for (const auto& fa_set : fa_sets)
  for (bool log_scale : {false, true}) {
    HybridOptions o;
    o.fa_heads = fa_set;
    o.fa_rope = true;  // with RoPE and no log scale the FA heads are the teacher's heads
    o.fa_log_scale = log_scale;
    o.fa_log_scale_alpha = 16;
    o.gdn_allow_neg_eigval = log_scale;  // exercise both beta ranges
    const auto split = hh::attention::split_heads(o, c)[0];
    const auto w = random_hybrid(c, o, split);
    const auto y = hh::attention::hybrid_attention(c, o, split, tw.layers[0], w, xn, teacher.inv_freq(), true);
    ASSERT_EQ(y.sizes(), (std::vector<int64_t>{2, T, 4, 8}));
    const auto y_rec = hh::attention::hybrid_attention(c, o, split, tw.layers[0], w, xn, teacher.inv_freq(), false);
    EXPECT_LT((y - y_rec).abs().max().item<double>(), 1e-10) << "chunked vs recurrent";

    // The FA heads (rows 0 and 1 of fa_gate).
    ASSERT_EQ(split.fa.size(), 2u);
    ASSERT_EQ(split.la.size(), 2u);
    for (int64_t i = 0; i < 2; ++i) {
      const int64_t h = split.fa[static_cast<size_t>(i)];
      torch::Tensor o_h;
      if (!log_scale) {
        o_h = z_teacher.select(2, h);
      } else {
        auto q = rms(torch::matmul(xn, tw.layers[0].q_proj.narrow(0, h * 8, 8).t()), eps) * tw.layers[0].q_norm;
        auto k = rms(torch::matmul(xn, tw.layers[0].k_proj.narrow(0, (h / 2) * 8, 8).t()), eps) * tw.layers[0].k_norm;
        const auto v = torch::matmul(xn, tw.layers[0].v_proj.narrow(0, (h / 2) * 8, 8).t());
        q = hh::model::rotary(q.unsqueeze(2), teacher.inv_freq(), 0).squeeze(2);
        k = hh::model::rotary(k.unsqueeze(2), teacher.inv_freq(), 0).squeeze(2);
        q = q * (torch::log(torch::arange(T, torch::kDouble) + 16) / std::log(16.0)).view({1, T, 1});
        auto s = torch::matmul(q, k.transpose(1, 2)) * scale;
        s = s.masked_fill(torch::ones({T, T}, torch::kBool).triu(1), -INFINITY);
        o_h = torch::matmul(torch::softmax(s, -1), v);
      }
      const auto gate = torch::sigmoid(torch::matmul(xn, w.fa_gate.narrow(0, i * 8, 8).t()));
      const auto want = gate * (w.fusion_gamma[h] * rms(o_h, eps));
      EXPECT_LT((y.select(2, h) - want).abs().max().item<double>(), 1e-9) << "FA head " << h << " log_scale " << log_scale;
    }
    // The LA heads: conv + SiLU, RoPE, L2 norm, gated delta rule, SiLU gate, fusion.
    for (int64_t i = 0; i < 2; ++i) {
      const int64_t h = split.la[static_cast<size_t>(i)];
      auto conv = [&](const torch::Tensor& x, int64_t block) {  // x [2, T, 8], taps of channels of head i
        const auto wc = w.la_conv.narrow(0, block * 16 + i * 8, 8).squeeze(1);  // [8, 4]
        auto y = torch::zeros_like(x);
        for (int64_t j = 0; j < 4; ++j) {
          const int64_t shift = 3 - j;  // tap j reads x[t - shift]
          if (shift >= T) continue;
          y.narrow(1, shift, T - shift).add_(x.narrow(1, 0, T - shift) * wc.select(1, j));
        }
        return torch::silu(y);
      };
      auto l2 = [](const torch::Tensor& x) { return x * torch::rsqrt(x.pow(2).sum(-1, true) + 1e-6); };
      auto q = conv(torch::matmul(xn, tw.layers[0].q_proj.narrow(0, h * 8, 8).t()), 0);
      auto k = conv(torch::matmul(xn, w.la_k_proj.narrow(0, i * 8, 8).t()), 1);
      const auto v = conv(torch::matmul(xn, w.la_v_proj.narrow(0, i * 8, 8).t()), 2);
      q = l2(hh::model::rotary(q.unsqueeze(2), teacher.inv_freq(), 0));  // [2, T, 1, 8]
      k = l2(hh::model::rotary(k.unsqueeze(2), teacher.inv_freq(), 0));
      auto beta = torch::sigmoid(torch::matmul(xn, w.la_b_proj[i])).unsqueeze(-1);  // [2, T, 1]
      if (log_scale) beta = beta * 2;
      const auto g = (-w.la_A_log[i].exp() * torch::softplus(torch::matmul(xn, w.la_a_proj[i]) + w.la_dt_bias[i])).unsqueeze(-1);
      const auto r = hh::attention::gdn_recurrent(q, k, v.unsqueeze(2), g, beta, {}, scale);
      const auto gate = torch::silu(torch::matmul(xn, w.la_gate.narrow(0, i * 8, 8).t()));
      const auto want = gate * (w.fusion_gamma[h] * rms(r.o.squeeze(2), eps));
      EXPECT_LT((y.select(2, h) - want).abs().max().item<double>(), 1e-9) << "LA head " << h;
    }
  }
}

TEST(HybridAttention, ConcatFusionPassesEachHeadsRawOutput) {
  const auto c = one_layer();
  const auto tw = hh::model::random_weights(c, 5, torch::kDouble, 0.3);
  const hh::model::Transformer teacher(c, tw);
  const int64_t T = 67;
  const auto ids = torch::randint(40, {1, T}, torch::TensorOptions().dtype(torch::kLong));
  const auto [xn, z_teacher] = teacher_layer0(c, tw, teacher, ids);

  HybridOptions norm;
  norm.fa_heads = {{0, 2}};
  norm.fa_rope = true;
  norm.fa_log_scale = false;
  HybridOptions concat = norm;
  concat.fusion_concat = true;
  const auto split = hh::attention::split_heads(norm, c)[0];
  const auto w = random_hybrid(c, norm, split);  // the scale-normalised set: concat ignores its gates and gamma
  HybridLayerWeights wc;
  std::vector<std::string> names;
  for (auto& e : hh::attention::hybrid_weight_table(c, concat, split, 0, wc)) names.push_back(e.name);
  for (const auto& n : names) {
    EXPECT_EQ(n.find("gate"), std::string::npos) << n;
    EXPECT_EQ(n.find("fusion_gamma"), std::string::npos) << n;
  }
  const auto y = hh::attention::hybrid_attention(c, concat, split, tw.layers[0], w, xn, teacher.inv_freq(), true);
  const auto y_norm = hh::attention::hybrid_attention(c, norm, split, tw.layers[0], w, xn, teacher.inv_freq(), true);
  // FA head 2 with RoPE and no log scale is the teacher's head: its raw output is the teacher's z.
  EXPECT_LT((y.select(2, 2) - z_teacher.select(2, 2)).abs().max().item<double>(), 1e-10);
  // Every LA head: the scale-normalised output is the SiLU gate times gamma times RMSNorm of the raw one.
  for (int64_t i = 0; i < 3; ++i) {
    const int64_t h = split.la[static_cast<size_t>(i)];
    const auto gate = torch::silu(torch::matmul(xn, w.la_gate.narrow(0, i * 8, 8).t()));
    const auto want = gate * (w.fusion_gamma[h] * rms(y.select(2, h), c.rms_norm_eps));
    EXPECT_LT((y_norm.select(2, h) - want).abs().max().item<double>(), 1e-9) << "LA head " << h;
  }
  // The option survives config.json and a wrong value is refused by name.
  auto j = concat.to_json();
  EXPECT_EQ(j.at("fusion"), "concat");
  EXPECT_TRUE(HybridOptions::from_json(j, c, "config.json").fusion_concat);
  j["fusion"] = "sum";
  EXPECT_MENTIONS(hh::test::error_of([&] { HybridOptions::from_json(j, c, "config.json"); }), "hydrahead.fusion");
}

// The layer's gradients with respect to the teacher rows it takes by head (q_proj for both head kinds,
// k_proj and v_proj for the FA heads' groups) and to fusion_gamma, against central differences in
// float64: LA heads 0, 2 and 3 are two runs of consecutive heads, FA head 1 one of its own.
TEST(HybridAttention, GradientsOfRowsTakenByHeadMatchFiniteDifferences) {
  const auto c = one_layer();
  auto tw = hh::model::random_weights(c, 13, torch::kDouble, 0.3);
  const hh::model::Transformer teacher(c, tw);
  const auto ids = torch::randint(40, {1, 19}, torch::TensorOptions().dtype(torch::kLong));
  const auto xn = teacher_layer0(c, tw, teacher, ids).xn.detach();
  HybridOptions o;
  o.fa_heads = {{0, 1}};
  const auto split = hh::attention::split_heads(o, c)[0];
  auto w = random_hybrid(c, o, split);
  auto& lw = tw.layers[0];
  torch::manual_seed(5);
  const auto r = torch::randn({1, 19, 4, 8}, torch::kDouble);
  auto loss = [&] {
    return (hh::attention::hybrid_attention(c, o, split, lw, w, xn, teacher.inv_freq()) * r).sum();
  };
  struct Checked {
    const char* name;
    torch::Tensor* t;
    std::vector<std::pair<int64_t, int64_t>> at;  // (row, column)
  };
  // q_proj rows of every head (8 rows a head), k_proj and v_proj rows of group 0 (head 1's) and of
  // group 1 (unused: gradient zero), gamma of an LA and the FA head.
  const std::vector<Checked> checked = {{"q_proj", &lw.q_proj, {{0, 3}, {9, 7}, {17, 0}, {31, 20}}},
                                        {"k_proj", &lw.k_proj, {{2, 5}, {12, 1}}},
                                        {"v_proj", &lw.v_proj, {{7, 30}, {8, 2}}},
                                        {"fusion_gamma", &w.fusion_gamma, {{0, 4}, {1, 6}, {3, 0}}}};
  for (const auto& ch : checked) ch.t->requires_grad_(true);
  loss().backward();
  for (const auto& ch : checked) {
    const torch::Tensor grad = ch.t->grad().clone();
    ch.t->requires_grad_(false);
    for (const auto& [i, j] : ch.at) {
      torch::NoGradGuard ng;
      const double h = 1e-6, x0 = (*ch.t)[i][j].item<double>();
      (*ch.t)[i][j] = x0 + h;
      const double up = loss().item<double>();
      (*ch.t)[i][j] = x0 - h;
      const double down = loss().item<double>();
      (*ch.t)[i][j] = x0;
      const double fd = (up - down) / (2 * h), g = grad[i][j].item<double>();
      EXPECT_NEAR(g, fd, 1e-6 * std::max(1.0, std::abs(fd))) << ch.name << "[" << i << "][" << j << "]";
    }
  }
  // Group 1 serves no FA head: the layer takes no k_proj or v_proj row of it.
  EXPECT_EQ(lw.k_proj.grad().narrow(0, 8, 8).abs().max().item<double>(), 0.0);
}

}  // namespace
