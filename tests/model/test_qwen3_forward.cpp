// Qwen3 forward against an independent reference written here with plain tensor math and explicit
// loops over heads and positions (float64), plus hook semantics and checkpoint loading.
#include <torch/torch.h>

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <limits>
#include <map>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/io/checkpoint.h"
#include "core/io/safetensors.h"
#include "core/model/hooks.h"
#include "core/model/transformer.h"
#include "core/util/error.h"
#include "support/test_support.h"

namespace hh::model {
namespace {

// Tolerances: float64 model vs float64 reference (same math, different association), and float32
// model vs float64 reference, relative to the largest reference logit.
constexpr double kTolF64 = 1e-10;
constexpr double kTolF32 = 1e-5;
// bf16 keeps ~3 significant digits; logits of a 2-layer random model drift by a few percent.
constexpr double kTolBf16 = 5e-2;
// Init std for test models: large enough that logits and attention are far from uniform.
constexpr double kTestStd = 0.1;

struct TinySpec {
  int64_t d = 32, Hq = 4, Hkv = 2, Dh = 8, I = 48, L = 2, V = 61;
  bool tied = false, bias = false;
  double theta = 10000.0;
};

ModelConfig make_config(const TinySpec& s) {
  ModelConfig c;
  c.vocab_size = s.V;
  c.hidden_size = s.d;
  c.intermediate_size = s.I;
  c.num_hidden_layers = s.L;
  c.num_attention_heads = s.Hq;
  c.num_key_value_heads = s.Hkv;
  c.head_dim = s.Dh;
  c.rms_norm_eps = 1e-6;
  c.rope_theta = s.theta;
  c.tie_word_embeddings = s.tied;
  c.attention_bias = s.bias;
  return c;
}

at::Tensor random_ids(int64_t B, int64_t T, int64_t V, uint64_t seed) {
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  return at::randint(V, {B, T}, gen, at::TensorOptions().dtype(at::kLong));
}

double max_abs(const at::Tensor& t) { return t.abs().max().item<double>(); }

// max |a - b| <= tol * max(1e-3, max |b|), both compared in float64.
void expect_close(const at::Tensor& a, const at::Tensor& b, double tol, const std::string& what) {
  ASSERT_EQ(a.sizes(), b.sizes()) << what;
  const at::Tensor a64 = a.to(at::kDouble), b64 = b.to(at::kDouble);
  const double scale = std::max(1e-3, max_abs(b64));
  const double err = max_abs(a64 - b64);
  EXPECT_LE(err, tol * scale) << what << ": max abs error " << err << " vs scale " << scale;
}

// ---- the independent reference ---------------------------------------------------------------------

struct RefOptions {
  int64_t position_offset = 0;
  int64_t zero_layer = -1, zero_head = -1;  // hook_z of this head set to zero
  std::vector<int64_t> pattern_rows;         // rows whose softmax the reference records
};

struct RefOutput {
  at::Tensor logits;                  // [B, T, V] float64
  std::vector<at::Tensor> patterns;   // per layer [B, Hq, R, T] float64 (when rows requested)
};

at::Tensor ref_rms(const at::Tensor& x, const at::Tensor& w, double eps) {
  return x / at::sqrt((x * x).mean(-1, /*keepdim=*/true) + eps) * w;
}

at::Tensor ref_linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& b) {
  at::Tensor y = at::matmul(x, w.t());
  return b.defined() ? y + b : y;
}

// The HF rotary tables: float32 inv_freq = 1 / theta^(2i/Dh), float32 angles pos * inv_freq
// duplicated over both halves, cos/sin in float32. Returned as float64 [T, Dh].
std::pair<at::Tensor, at::Tensor> ref_rope_tables(double theta, int64_t Dh, int64_t offset, int64_t T) {
  at::Tensor exponent = at::arange(0, Dh, 2, at::kLong).to(at::kFloat) / Dh;
  at::Tensor inv_freq = 1.0 / at::pow(theta, exponent);
  at::Tensor pos = at::arange(offset, offset + T, at::kLong).to(at::kFloat);
  at::Tensor freqs = at::outer(pos, inv_freq);
  at::Tensor angles = at::cat({freqs, freqs}, 1);
  return {angles.cos().to(at::kDouble), angles.sin().to(at::kDouble)};
}

// x [B, T, H, Dh] float64: pairs (i, i + Dh/2) rotate by the angle of position t.
at::Tensor ref_rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  at::Tensor in = x.contiguous();
  at::Tensor out = at::empty_like(in);
  auto xa = in.accessor<double, 4>();
  auto oa = out.accessor<double, 4>();
  auto ca = cos.accessor<double, 2>();
  auto sa = sin.accessor<double, 2>();
  const int64_t half = in.size(3) / 2;
  for (int64_t b = 0; b < in.size(0); ++b)
    for (int64_t t = 0; t < in.size(1); ++t)
      for (int64_t h = 0; h < in.size(2); ++h)
        for (int64_t i = 0; i < half; ++i) {
          const double x1 = xa[b][t][h][i], x2 = xa[b][t][h][i + half];
          oa[b][t][h][i] = x1 * ca[t][i] - x2 * sa[t][i];
          oa[b][t][h][i + half] = x2 * ca[t][i + half] + x1 * sa[t][i + half];
        }
  return out;
}

// Causal softmax attention, one (batch, query head, query position) at a time; query head h reads
// KV head h / (Hq / Hkv). Returns z [B, T, Hq, Dh]; fills `pattern` [B, Hq, R, T] when rows given.
at::Tensor ref_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, int64_t zero_head,
                         const std::vector<int64_t>& rows, at::Tensor* pattern) {
  const int64_t B = q.size(0), T = q.size(1), Hq = q.size(2), Dh = q.size(3), Hkv = k.size(2);
  const int64_t G = Hq / Hkv;
  const double scale = 1.0 / std::sqrt(static_cast<double>(Dh));
  at::Tensor z = at::zeros({B, T, Hq, Dh}, at::kDouble);
  *pattern = at::zeros({B, Hq, static_cast<int64_t>(rows.size()), T}, at::kDouble);
  auto qa = q.accessor<double, 4>();
  auto ka = k.accessor<double, 4>();
  auto va = v.accessor<double, 4>();
  auto za = z.accessor<double, 4>();
  auto pa = pattern->accessor<double, 4>();
  std::vector<double> p(static_cast<size_t>(T));
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < Hq; ++h) {
      const int64_t kvh = h / G;
      for (int64_t t = 0; t < T; ++t) {
        double m = -std::numeric_limits<double>::infinity();
        for (int64_t s = 0; s <= t; ++s) {
          double dot = 0;
          for (int64_t i = 0; i < Dh; ++i) dot += qa[b][t][h][i] * ka[b][s][kvh][i];
          p[s] = dot * scale;
          m = std::max(m, p[s]);
        }
        double sum = 0;
        for (int64_t s = 0; s <= t; ++s) sum += (p[s] = std::exp(p[s] - m));
        for (int64_t s = 0; s <= t; ++s) p[s] /= sum;
        for (size_t r = 0; r < rows.size(); ++r)
          if (rows[r] == t)
            for (int64_t s = 0; s <= t; ++s) pa[b][h][static_cast<int64_t>(r)][s] = p[s];
        if (h == zero_head) continue;
        for (int64_t i = 0; i < Dh; ++i) {
          double acc = 0;
          for (int64_t s = 0; s <= t; ++s) acc += p[s] * va[b][s][kvh][i];
          za[b][t][h][i] = acc;
        }
      }
    }
  return z;
}

RefOutput reference_forward(const ModelConfig& c, const Weights& weights, const at::Tensor& ids,
                            const RefOptions& o = {}) {
  auto f64 = [](const at::Tensor& t) { return t.defined() ? t.to(at::kDouble) : t; };
  const int64_t B = ids.size(0), T = ids.size(1);
  const int64_t Hq = c.num_attention_heads, Hkv = c.num_key_value_heads, Dh = c.head_dim;
  const double eps = c.rms_norm_eps;
  auto [cos, sin] = ref_rope_tables(c.rope_theta, Dh, o.position_offset, T);

  RefOutput out;
  at::Tensor x = f64(weights.embed_tokens).index_select(0, ids.reshape({-1})).view({B, T, -1});  // [B, T, d]
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
    const LayerWeights& lw = weights.layers[static_cast<size_t>(l)];
    at::Tensor h = ref_rms(x, f64(lw.input_layernorm), eps);
    at::Tensor q = ref_linear(h, f64(lw.q_proj), f64(lw.q_bias)).view({B, T, Hq, Dh});
    at::Tensor k = ref_linear(h, f64(lw.k_proj), f64(lw.k_bias)).view({B, T, Hkv, Dh});
    at::Tensor v = ref_linear(h, f64(lw.v_proj), f64(lw.v_bias)).view({B, T, Hkv, Dh}).contiguous();
    q = ref_rope(ref_rms(q, f64(lw.q_norm), eps), cos, sin);
    k = ref_rope(ref_rms(k, f64(lw.k_norm), eps), cos, sin);
    at::Tensor pattern;
    at::Tensor z = ref_attention(q, k, v, l == o.zero_layer ? o.zero_head : -1, o.pattern_rows, &pattern);
    out.patterns.push_back(pattern);
    x = x + ref_linear(z.view({B, T, Hq * Dh}), f64(lw.o_proj), f64(lw.o_bias));
    h = ref_rms(x, f64(lw.post_attention_layernorm), eps);
    at::Tensor gate = ref_linear(h, f64(lw.gate_proj), {});
    at::Tensor up = ref_linear(h, f64(lw.up_proj), {});
    x = x + ref_linear(gate / (1.0 + at::exp(-gate)) * up, f64(lw.down_proj), {});
  }
  out.logits = ref_linear(ref_rms(x, f64(weights.norm), eps), f64(weights.lm_head), {});
  return out;
}

Transformer make_model(const TinySpec& s, at::ScalarType dtype, uint64_t seed = 1) {
  ModelConfig cfg = make_config(s);
  return Transformer(cfg, random_weights(cfg, seed, dtype, kTestStd));
}

// Model logits against the reference, in float32 and float64, through both attention paths.
void check_against_reference(const TinySpec& s, int64_t B, int64_t T, int64_t offset = 0) {
  for (at::ScalarType dtype : {at::kDouble, at::kFloat}) {
    Transformer m = make_model(s, dtype);
    at::Tensor ids = random_ids(B, T, s.V, /*seed=*/7);
    RefOptions ro;
    ro.position_offset = offset;
    at::Tensor ref = reference_forward(m.config(), m.weights(), ids, ro).logits;
    for (bool eager : {false, true}) {
      ForwardOptions opts;
      opts.position_offset = offset;
      opts.eager_attention = eager;
      at::Tensor logits = m.forward(ids, opts).logits;
      ASSERT_EQ(logits.sizes(), (std::vector<int64_t>{B, T, s.V}));
      expect_close(logits, ref, dtype == at::kDouble ? kTolF64 : kTolF32,
                   std::string("logits ") + c10::toString(dtype) + (eager ? " eager" : " default"));
    }
  }
}

// ---- forward vs reference -----------------------------------------------------------------------------

TEST(Qwen3Forward, GqaHq4Hkv2) { check_against_reference(TinySpec{}, 1, 19); }

TEST(Qwen3Forward, MhaHq4Hkv4) {
  TinySpec s;
  s.Hkv = 4;
  check_against_reference(s, 1, 13);
}

TEST(Qwen3Forward, HeadDimNotHiddenOverHeads_d24_Hq4_Dh8) {
  TinySpec s;
  s.d = 24, s.Hq = 4, s.Hkv = 2, s.Dh = 8;
  check_against_reference(s, 1, 11);
}

TEST(Qwen3Forward, HeadDimNotHiddenOverHeads_d32_Hq3_Dh16) {
  TinySpec s;
  s.d = 32, s.Hq = 3, s.Hkv = 1, s.Dh = 16;
  check_against_reference(s, 1, 11);
}

TEST(Qwen3Forward, TiedEmbeddings) {
  TinySpec s;
  s.tied = true;
  check_against_reference(s, 1, 9);
  Transformer m = make_model(s, at::kFloat);
  EXPECT_TRUE(m.weights().lm_head.is_same(m.weights().embed_tokens));
}

TEST(Qwen3Forward, UntiedEmbeddings) {
  TinySpec s;
  s.tied = false;
  check_against_reference(s, 1, 9);
  Transformer m = make_model(s, at::kFloat);
  EXPECT_FALSE(m.weights().lm_head.is_same(m.weights().embed_tokens));
}

TEST(Qwen3Forward, AttentionBias) {
  TinySpec s;
  s.bias = true;
  check_against_reference(s, 1, 10);
  Transformer m = make_model(s, at::kFloat);
  EXPECT_TRUE(m.weights().layers[0].o_bias.defined());
}

TEST(Qwen3Forward, BatchOfTwoDifferentTokens) {
  check_against_reference(TinySpec{}, 2, 12);
  // Each batch row equals its own single-row forward.
  Transformer m = make_model(TinySpec{}, at::kDouble);
  at::Tensor ids = random_ids(2, 12, TinySpec{}.V, 3);
  ASSERT_FALSE(at::equal(ids[0], ids[1]));
  at::Tensor both = m.forward(ids).logits;
  for (int64_t b = 0; b < 2; ++b)
    expect_close(both[b], m.forward(ids.narrow(0, b, 1)).logits[0], kTolF64, "batch row " + std::to_string(b));
}

TEST(Qwen3Forward, PositionOffset) {
  check_against_reference(TinySpec{}, 1, 8, /*offset=*/37);
  // The offset changes the absolute RoPE angles; with q/k norms and a short span it still moves logits.
  Transformer m = make_model(TinySpec{}, at::kDouble);
  at::Tensor ids = random_ids(1, 8, TinySpec{}.V, 5);
  ForwardOptions opts;
  opts.position_offset = 37;
  EXPECT_FALSE(at::allclose(m.forward(ids).logits, m.forward(ids, opts).logits));
}

TEST(Qwen3Forward, SingleToken) { check_against_reference(TinySpec{}, 2, 1); }

// Long input on a tiny model: the blockwise (or SDPA) attention equals the row-by-row reference,
// across several query blocks.
TEST(Qwen3Forward, LongInputT3000MatchesReference) {
  TinySpec s;
  s.d = 16, s.Hq = 2, s.Hkv = 1, s.Dh = 8, s.I = 24, s.L = 2, s.V = 50;
  Transformer m = make_model(s, at::kFloat);
  const int64_t T = 3000;
  at::Tensor ids = random_ids(1, T, s.V, 11);
  const std::vector<int64_t> rows = {0, 511, 512, 1023, 1500, 2999};
  Hooks hooks;
  std::map<std::string, at::Tensor> store;
  hooks.cache(hook_name(1, HookKind::Pattern), &store);
  ForwardOptions opts;
  opts.hooks = &hooks;
  opts.pattern_rows = at::tensor(rows, at::kLong);
  RefOptions ro;
  ro.pattern_rows = rows;
  RefOutput ref = reference_forward(m.config(), m.weights(), ids, ro);
  for (bool eager : {false, true}) {
    opts.eager_attention = eager;
    at::Tensor logits = m.forward(ids, opts).logits;
    expect_close(logits, ref.logits, kTolF32, std::string("logits T=3000") + (eager ? " eager" : ""));
    expect_close(store.at(hook_name(1, HookKind::Pattern)), ref.patterns[1], kTolF32, "pattern rows T=3000");
  }
}

// ---- hooks ------------------------------------------------------------------------------------------

TEST(Qwen3Hooks, NamesFollowTransformerLens) {
  EXPECT_EQ(hook_name(0, HookKind::ResidPre), "blocks.0.hook_resid_pre");
  EXPECT_EQ(hook_name(3, HookKind::Q), "blocks.3.attn.hook_q");
  EXPECT_EQ(hook_name(3, HookKind::K), "blocks.3.attn.hook_k");
  EXPECT_EQ(hook_name(3, HookKind::V), "blocks.3.attn.hook_v");
  EXPECT_EQ(hook_name(3, HookKind::Pattern), "blocks.3.attn.hook_pattern");
  EXPECT_EQ(hook_name(12, HookKind::Z), "blocks.12.attn.hook_z");
  EXPECT_EQ(hook_name(1, HookKind::AttnOut), "blocks.1.hook_attn_out");
  EXPECT_EQ(hook_name(1, HookKind::ResidMid), "blocks.1.hook_resid_mid");
  EXPECT_EQ(hook_name(1, HookKind::MlpOut), "blocks.1.hook_mlp_out");
  EXPECT_EQ(hook_name(1, HookKind::ResidPost), "blocks.1.hook_resid_post");
  const auto names = all_hook_names(2);
  ASSERT_EQ(names.size(), 20u);
  EXPECT_EQ(names.front(), "blocks.0.hook_resid_pre");
  EXPECT_EQ(names.back(), "blocks.1.hook_resid_post");
  for (const auto& n : names) EXPECT_EQ(hook_name(parse_hook_name(n).first, parse_hook_name(n).second), n);
  for (const char* bad : {"blocks.x.hook_z", "blocks.1.hook_z", "block.1.attn.hook_z", "blocks.01.attn.hook_z",
                          "blocks.-1.attn.hook_z", "blocks.1.attn.hook_zz", "blocks.1"}) {
    try {
      parse_hook_name(bad);
      ADD_FAILURE() << "accepted " << bad;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(bad), std::string::npos) << e.what();
    }
  }
  Hooks h;
  EXPECT_THROW(h.add("blocks.0.attn.hook_zed", [](at::Tensor&) {}), Error);
}

TEST(Qwen3Hooks, ReplacingEachHookWithItsOwnValueIsBitExact) {
  Transformer m = make_model(TinySpec{}, at::kFloat);
  at::Tensor ids = random_ids(2, 10, TinySpec{}.V, 2);
  const at::Tensor base = m.forward(ids).logits;
  int64_t calls = 0;
  for (const std::string& name : all_hook_names(m.config().num_hidden_layers)) {
    Hooks hooks;
    hooks.add(name, [&calls](at::Tensor& t) {
      ++calls;
      t = t.clone();
    });
    ForwardOptions opts;
    opts.hooks = &hooks;
    EXPECT_TRUE(at::equal(m.forward(ids, opts).logits, base)) << name;
  }
  EXPECT_EQ(calls, 20);
}

TEST(Qwen3Hooks, HookShapes) {
  TinySpec s;
  Transformer m = make_model(s, at::kFloat);
  const int64_t B = 2, T = 6;
  at::Tensor ids = random_ids(B, T, s.V, 2);
  Hooks hooks;
  std::map<std::string, at::Tensor> store;
  for (const auto& n : all_hook_names(s.L)) hooks.cache(n, &store);
  ForwardOptions opts;
  opts.hooks = &hooks;
  opts.pattern_rows = at::tensor(std::vector<int64_t>{1, 5}, at::kLong);
  m.forward(ids, opts);
  using V = std::vector<int64_t>;
  EXPECT_EQ(store.at("blocks.1.hook_resid_pre").sizes(), (V{B, T, s.d}));
  EXPECT_EQ(store.at("blocks.1.attn.hook_q").sizes(), (V{B, T, s.Hq, s.Dh}));
  EXPECT_EQ(store.at("blocks.1.attn.hook_k").sizes(), (V{B, T, s.Hkv, s.Dh}));
  EXPECT_EQ(store.at("blocks.1.attn.hook_v").sizes(), (V{B, T, s.Hkv, s.Dh}));
  EXPECT_EQ(store.at("blocks.1.attn.hook_pattern").sizes(), (V{B, s.Hq, 2, T}));
  EXPECT_EQ(store.at("blocks.1.attn.hook_z").sizes(), (V{B, T, s.Hq, s.Dh}));
  for (const char* n : {"hook_attn_out", "hook_resid_mid", "hook_mlp_out", "hook_resid_post"})
    EXPECT_EQ(store.at(std::string("blocks.0.") + n).sizes(), (V{B, T, s.d})) << n;
  EXPECT_EQ(store.size(), 20u);
  // resid_post of layer 0 is resid_pre of layer 1.
  EXPECT_TRUE(at::equal(store.at("blocks.0.hook_resid_post"), store.at("blocks.1.hook_resid_pre")));
}

TEST(Qwen3Hooks, ZeroingOneHeadOfHookZMatchesReference) {
  TinySpec s;
  for (at::ScalarType dtype : {at::kDouble, at::kFloat}) {
    Transformer m = make_model(s, dtype);
    at::Tensor ids = random_ids(2, 9, s.V, 4);
    const int64_t layer = 1, head = 2;
    Hooks hooks;
    hooks.add(hook_name(layer, HookKind::Z), [&](at::Tensor& z) {
      z = z.clone();
      z.select(2, head).zero_();  // [B, T, Dh] of that head
    });
    ForwardOptions opts;
    opts.hooks = &hooks;
    at::Tensor patched = m.forward(ids, opts).logits;
    RefOptions ro;
    ro.zero_layer = layer;
    ro.zero_head = head;
    at::Tensor ref = reference_forward(m.config(), m.weights(), ids, ro).logits;
    expect_close(patched, ref, dtype == at::kDouble ? kTolF64 : kTolF32, "zeroed head");
    EXPECT_FALSE(at::allclose(patched, m.forward(ids).logits));
  }
}

TEST(Qwen3Hooks, StartAtLayerFromCachedResidPre) {
  Transformer m = make_model(TinySpec{}, at::kFloat);
  at::Tensor ids = random_ids(2, 10, TinySpec{}.V, 6);
  Hooks hooks;
  std::map<std::string, at::Tensor> store;
  hooks.cache("blocks.1.hook_resid_pre", &store);
  ForwardOptions opts;
  opts.hooks = &hooks;
  const at::Tensor full = m.forward(ids, opts).logits;
  ForwardOptions from1;
  from1.start_layer = 1;
  EXPECT_TRUE(at::equal(m.forward(store.at("blocks.1.hook_resid_pre"), from1).logits, full));
}

TEST(Qwen3Hooks, StopLayerReturnsResidPostOfLastLayerRun) {
  Transformer m = make_model(TinySpec{}, at::kFloat);
  at::Tensor ids = random_ids(1, 10, TinySpec{}.V, 6);
  Hooks hooks;
  std::map<std::string, at::Tensor> store;
  hooks.cache("blocks.0.hook_resid_post", &store);
  ForwardOptions opts;
  opts.hooks = &hooks;
  opts.stop_layer = 1;
  ForwardOutput out = m.forward(ids, opts);
  EXPECT_FALSE(out.logits.defined());
  EXPECT_TRUE(at::equal(out.resid, store.at("blocks.0.hook_resid_post")));
  // Resuming from that residual finishes the forward.
  ForwardOptions rest;
  rest.start_layer = 1;
  EXPECT_TRUE(at::equal(m.forward(out.resid, rest).logits, m.forward(ids).logits));
}

TEST(Qwen3Hooks, LogitPositionsEqualSlicedLogits) {
  Transformer m = make_model(TinySpec{}, at::kDouble);
  at::Tensor ids = random_ids(2, 10, TinySpec{}.V, 8);
  at::Tensor pos = at::tensor(std::vector<int64_t>{9, 0, 4}, at::kLong);
  ForwardOptions opts;
  opts.logit_positions = pos;
  at::Tensor some = m.forward(ids, opts).logits;
  expect_close(some, m.forward(ids).logits.index_select(1, pos), kTolF64, "logit_positions");
  opts.logit_positions = at::tensor(std::vector<int64_t>{10}, at::kLong);
  EXPECT_THROW(m.forward(ids, opts), Error);
}

TEST(Qwen3Hooks, PatternRowsMatchReference) {
  TinySpec s;
  Transformer m = make_model(s, at::kDouble);
  const int64_t T = 12;
  at::Tensor ids = random_ids(2, T, s.V, 9);
  const std::vector<int64_t> rows = {0, 3, 11, 7};
  Hooks hooks;
  std::map<std::string, at::Tensor> store;
  hooks.cache("blocks.0.attn.hook_pattern", &store);
  hooks.cache("blocks.1.attn.hook_pattern", &store);
  ForwardOptions opts;
  opts.hooks = &hooks;
  opts.pattern_rows = at::tensor(rows, at::kLong);
  m.forward(ids, opts);
  RefOptions ro;
  ro.pattern_rows = rows;
  RefOutput ref = reference_forward(m.config(), m.weights(), ids, ro);
  for (int64_t l = 0; l < 2; ++l) {
    const at::Tensor p = store.at(hook_name(l, HookKind::Pattern));  // [B, Hq, R, T]
    expect_close(p, ref.patterns[static_cast<size_t>(l)], kTolF64, "pattern layer " + std::to_string(l));
    expect_close(p.sum(-1), at::ones({2, s.Hq, 4}, at::kDouble), 1e-12, "row sums");
    for (size_t r = 0; r < rows.size(); ++r) {
      const int64_t above = T - 1 - rows[r];
      if (above > 0)
        EXPECT_EQ(max_abs(p.select(2, static_cast<int64_t>(r)).narrow(-1, rows[r] + 1, above)), 0.0);
    }
  }
  // Undefined rows: every row.
  opts.pattern_rows = at::Tensor();
  store.clear();
  m.forward(ids, opts);
  EXPECT_EQ(store.at("blocks.1.attn.hook_pattern").sizes(), (std::vector<int64_t>{2, s.Hq, T, T}));
}

TEST(Qwen3Hooks, PatchingPatternRecomputesThoseRowsOfZ) {
  TinySpec s;
  Transformer m = make_model(s, at::kDouble);
  const int64_t T = 8;
  at::Tensor ids = random_ids(1, T, s.V, 10);
  const std::vector<int64_t> rows = {2, 6};
  Hooks hooks;
  std::map<std::string, at::Tensor> store;
  // Every requested row attends only to position 0; other rows keep their attention.
  hooks.add("blocks.0.attn.hook_pattern", [](at::Tensor& p) {
    p = at::zeros_like(p);
    p.select(-1, 0).fill_(1.0);
  });
  hooks.cache("blocks.0.attn.hook_v", &store);
  hooks.cache("blocks.0.attn.hook_z", &store);
  ForwardOptions opts;
  opts.hooks = &hooks;
  opts.pattern_rows = at::tensor(rows, at::kLong);
  m.forward(ids, opts);
  const at::Tensor v = store.at("blocks.0.attn.hook_v");  // [1, T, Hkv, Dh]
  const at::Tensor z = store.at("blocks.0.attn.hook_z");  // [1, T, Hq, Dh]
  const int64_t G = s.Hq / s.Hkv;
  for (int64_t r : rows)
    for (int64_t h = 0; h < s.Hq; ++h)
      EXPECT_TRUE(at::allclose(z[0][r][h], v[0][0][h / G])) << "row " << r << " head " << h;

  Hooks plain;
  plain.cache("blocks.0.attn.hook_z", &store);
  ForwardOptions popts;
  popts.hooks = &plain;
  m.forward(ids, popts);
  const at::Tensor z_clean = store.at("blocks.0.attn.hook_z");
  for (int64_t r : {1, 3, 7}) EXPECT_TRUE(at::equal(z[0][r], z_clean[0][r])) << "row " << r;
}

TEST(Qwen3Hooks, GradientOnHookZMatchesFiniteDifference) {
  TinySpec s;
  Transformer m = make_model(s, at::kDouble);
  const int64_t T = 7;
  at::Tensor ids = random_ids(1, T, s.V, 12);
  const int64_t target = 5;
  auto metric = [&](const at::Tensor& logits) { return at::log_softmax(logits[0][T - 1], -1)[target]; };

  at::Tensor z_leaf;
  Hooks grad_hooks;
  grad_hooks.add("blocks.0.attn.hook_z", [&z_leaf](at::Tensor& z) {
    z.requires_grad_(true);
    z_leaf = z;
  });
  ForwardOptions opts;
  opts.hooks = &grad_hooks;
  at::Tensor M = metric(m.forward(ids, opts).logits);
  M.backward();
  ASSERT_TRUE(z_leaf.grad().defined());
  const int64_t t = 3, h = 1, i = 5;
  const double analytic = z_leaf.grad()[0][t][h][i].item<double>();

  auto shifted = [&](double delta) {
    at::NoGradGuard no_grad;
    Hooks shift;
    shift.add("blocks.0.attn.hook_z", [&](at::Tensor& z) {
      z = z.clone();
      z[0][t][h][i].add_(delta);
    });
    ForwardOptions so;
    so.hooks = &shift;
    return metric(m.forward(ids, so).logits).item<double>();
  };
  const double step = 1e-5;
  const double numeric = (shifted(step) - shifted(-step)) / (2 * step);
  EXPECT_NEAR(analytic, numeric, 1e-7 * std::max(1.0, std::abs(numeric)));
  EXPECT_GT(std::abs(analytic), 1e-6);  // the element does influence the metric
}

TEST(Qwen3Hooks, BadReplacementShapeIsAnError) {
  Transformer m = make_model(TinySpec{}, at::kFloat);
  Hooks hooks;
  hooks.add("blocks.0.attn.hook_z", [](at::Tensor& z) { z = z.narrow(2, 0, 1); });
  ForwardOptions opts;
  opts.hooks = &hooks;
  try {
    m.forward(random_ids(1, 4, TinySpec{}.V, 1), opts);
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("blocks.0.attn.hook_z"), std::string::npos) << e.what();
  }
}

TEST(Qwen3Forward, TokenIdOutOfRangeNamesIdAndPosition) {
  TinySpec s;
  Transformer m = make_model(s, at::kFloat);
  at::Tensor ids = random_ids(2, 5, s.V, 1);
  ids[1][3] = s.V;
  try {
    m.forward(ids);
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find(std::to_string(s.V)), std::string::npos) << msg;
    EXPECT_NE(msg.find("position 3"), std::string::npos) << msg;
  }
  ids[1][3] = -2;
  EXPECT_THROW(m.forward(ids), Error);
}

TEST(Qwen3Forward, OptionsAreValidated) {
  Transformer m = make_model(TinySpec{}, at::kFloat);
  at::Tensor ids = random_ids(1, 4, TinySpec{}.V, 1);
  ForwardOptions o;
  o.stop_layer = 3;
  EXPECT_THROW(m.forward(ids, o), Error);
  o = {};
  o.start_layer = 1;
  EXPECT_THROW(m.forward(ids, o), Error);  // ids where a residual is expected
  EXPECT_THROW(m.forward(at::zeros({1, 4, 5}), o), Error);
  EXPECT_THROW(parse_dtype("int8"), Error);
  EXPECT_EQ(parse_dtype("bf16"), at::kBFloat16);
  EXPECT_EQ(parse_dtype("float32"), at::kFloat);
}

TEST(Qwen3Weights, RandomWeightsAreSeededAndCastConsistently) {
  ModelConfig cfg = make_config(TinySpec{});
  Weights a = random_weights(cfg, 3, at::kFloat), b = random_weights(cfg, 3, at::kFloat);
  Weights c = random_weights(cfg, 4, at::kFloat), h = random_weights(cfg, 3, at::kBFloat16);
  EXPECT_TRUE(at::equal(a.layers[1].q_proj, b.layers[1].q_proj));
  EXPECT_FALSE(at::equal(a.layers[1].q_proj, c.layers[1].q_proj));
  EXPECT_TRUE(at::equal(a.layers[1].q_proj.to(at::kBFloat16), h.layers[1].q_proj));
  EXPECT_NEAR(a.norm.mean().item<double>(), 1.0, 0.1);
}

TEST(Qwen3Weights, ConstructorChecksShapes) {
  ModelConfig cfg = make_config(TinySpec{});
  Weights w = random_weights(cfg, 1, at::kFloat);
  w.layers[1].k_proj = at::zeros({3, 3});
  try {
    Transformer m(cfg, w);
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("model.layers.1.self_attn.k_proj.weight"), std::string::npos) << e.what();
  }
}

// ---- checkpoint loading -----------------------------------------------------------------------------

nlohmann::json config_json(const ModelConfig& c, const std::string& dtype) {
  return {{"architectures", {"Qwen3ForCausalLM"}},
          {"model_type", "qwen3"},
          {"vocab_size", c.vocab_size},
          {"hidden_size", c.hidden_size},
          {"intermediate_size", c.intermediate_size},
          {"num_hidden_layers", c.num_hidden_layers},
          {"num_attention_heads", c.num_attention_heads},
          {"num_key_value_heads", c.num_key_value_heads},
          {"head_dim", c.head_dim},
          {"hidden_act", "silu"},
          {"rms_norm_eps", c.rms_norm_eps},
          {"rope_theta", c.rope_theta},
          {"max_position_embeddings", 4096},
          {"tie_word_embeddings", c.tie_word_embeddings},
          {"attention_bias", c.attention_bias},
          {"torch_dtype", dtype}};
}

void write_text(const std::filesystem::path& p, const std::string& text) {
  std::ofstream f(p);
  f << text;
}

using Named = std::vector<std::pair<std::string, at::Tensor>>;

Named named_tensors(const ModelConfig& cfg, const Weights& w) {
  Weights copy = w;
  Named out;
  for (const WeightEntry& e : weight_table(cfg, copy)) out.emplace_back(e.name, e.slot->contiguous());
  return out;
}

// shards == 1: model.safetensors; else model-0000i-of-0000n.safetensors + index.
void save_model(const std::filesystem::path& dir, const ModelConfig& cfg, const Named& tensors,
                const std::string& dtype = "float32", int shards = 1) {
  write_text(dir / "config.json", config_json(cfg, dtype).dump(2));
  if (shards == 1) {
    io::save_tensors(dir / "model.safetensors", tensors);
    return;
  }
  nlohmann::json weight_map = nlohmann::json::object();
  int64_t total = 0;
  for (int s = 0; s < shards; ++s) {
    const std::string file = "model-0000" + std::to_string(s + 1) + "-of-0000" + std::to_string(shards) + ".safetensors";
    Named part;
    for (size_t i = static_cast<size_t>(s); i < tensors.size(); i += static_cast<size_t>(shards)) {
      part.push_back(tensors[i]);
      weight_map[tensors[i].first] = file;
      total += tensors[i].second.numel() * tensors[i].second.element_size();
    }
    io::save_tensors(dir / file, part);
  }
  nlohmann::json index = {{"metadata", {{"total_size", total}}}, {"weight_map", weight_map}};
  write_text(dir / "model.safetensors.index.json", index.dump(2));
}

TEST(Qwen3Load, SingleFileRoundTrip) {
  for (bool tied : {false, true}) {
    TinySpec s;
    s.tied = tied;
    s.bias = tied;  // cover biases too
    Transformer m = make_model(s, at::kFloat);
    const auto dir = test::scratch_dir(tied ? "tied" : "untied");
    save_model(dir, m.config(), named_tensors(m.config(), m.weights()));
    Transformer loaded = Transformer::load(dir);
    EXPECT_EQ(loaded.dtype(), at::kFloat);
    EXPECT_EQ(loaded.config().tie_word_embeddings, tied);
    at::Tensor ids = random_ids(2, 9, s.V, 13);
    EXPECT_TRUE(at::equal(loaded.forward(ids).logits, m.forward(ids).logits)) << "tied=" << tied;
  }
}

TEST(Qwen3Load, ShardedRoundTrip) {
  Transformer m = make_model(TinySpec{}, at::kFloat);
  const auto dir = test::scratch_dir("sharded");
  save_model(dir, m.config(), named_tensors(m.config(), m.weights()), "float32", /*shards=*/3);
  ASSERT_FALSE(std::filesystem::exists(dir / "model.safetensors"));
  Transformer loaded = Transformer::load(dir);
  at::Tensor ids = random_ids(1, 9, TinySpec{}.V, 13);
  EXPECT_TRUE(at::equal(loaded.forward(ids).logits, m.forward(ids).logits));
}

TEST(Qwen3Load, RaisedCancelFlagStopsTheLoad) {
  Transformer m = make_model(TinySpec{}, at::kFloat);
  const auto dir = test::scratch_dir("cancel");
  save_model(dir, m.config(), named_tensors(m.config(), m.weights()));
  std::atomic<bool> cancel{true};
  EXPECT_THROW(Transformer::load(dir, "cpu", "", &cancel), Cancelled);
  cancel = false;  // a flag that stays down changes nothing
  Transformer loaded = Transformer::load(dir, "cpu", "", &cancel);
  at::Tensor ids = random_ids(1, 7, TinySpec{}.V, 5);
  EXPECT_TRUE(at::equal(loaded.forward(ids).logits, m.forward(ids).logits));
}

void expect_load_error(const std::filesystem::path& dir, const std::vector<std::string>& needles) {
  try {
    Transformer::load(dir);
    ADD_FAILURE() << "load succeeded";
  } catch (const Error& e) {
    for (const auto& n : needles) EXPECT_NE(std::string(e.what()).find(n), std::string::npos) << e.what();
  }
}

TEST(Qwen3Load, MissingTensorIsNamed) {
  Transformer m = make_model(TinySpec{}, at::kFloat);
  Named t = named_tensors(m.config(), m.weights());
  const std::string gone = "model.layers.1.mlp.up_proj.weight";
  t.erase(std::remove_if(t.begin(), t.end(), [&](const auto& p) { return p.first == gone; }), t.end());
  const auto dir = test::scratch_dir("missing");
  save_model(dir, m.config(), t);
  expect_load_error(dir, {gone});
}

TEST(Qwen3Load, UntiedWithoutLmHeadIsAnError) {
  Transformer m = make_model(TinySpec{}, at::kFloat);
  Named t = named_tensors(m.config(), m.weights());
  t.erase(std::remove_if(t.begin(), t.end(), [](const auto& p) { return p.first == "lm_head.weight"; }), t.end());
  const auto dir = test::scratch_dir("nolmhead");
  save_model(dir, m.config(), t);
  expect_load_error(dir, {"lm_head.weight"});
}

TEST(Qwen3Load, WrongShapeIsNamed) {
  Transformer m = make_model(TinySpec{}, at::kFloat);
  Named t = named_tensors(m.config(), m.weights());
  const std::string bad = "model.layers.0.self_attn.k_norm.weight";
  for (auto& p : t)
    if (p.first == bad) p.second = at::ones({TinySpec{}.Dh + 1});
  const auto dir = test::scratch_dir("shape");
  save_model(dir, m.config(), t);
  expect_load_error(dir, {bad, "[9]", "[8]"});
}

TEST(Qwen3Load, Bf16LoadIsCloseToF32) {
  Transformer m = make_model(TinySpec{}, at::kFloat);
  const auto dir = test::scratch_dir("bf16");
  save_model(dir, m.config(), named_tensors(m.config(), m.weights()));
  at::Tensor ids = random_ids(2, 16, TinySpec{}.V, 14);
  const at::Tensor ref = m.forward(ids).logits;

  Transformer as_bf16 = Transformer::load(dir, "cpu", "bf16");
  EXPECT_EQ(as_bf16.dtype(), at::kBFloat16);
  at::Tensor logits = as_bf16.forward(ids).logits;
  EXPECT_EQ(logits.scalar_type(), at::kFloat);
  expect_close(logits, ref, kTolBf16, "bf16 (cast at load)");

  // A bf16 file keeps its dtype when none is requested.
  Named t = named_tensors(m.config(), m.weights());
  for (auto& p : t) p.second = p.second.to(at::kBFloat16);
  const auto dir16 = test::scratch_dir("bf16file");
  save_model(dir16, m.config(), t, "bfloat16");
  Transformer stored = Transformer::load(dir16);
  EXPECT_EQ(stored.dtype(), at::kBFloat16);
  EXPECT_TRUE(at::equal(stored.forward(ids).logits, logits));
}

// ---- optional: logits produced by HF transformers ----------------------------------------------------
// HH_QWEN3_HF_REF names a directory holding, per case, an HF checkpoint dir <case>/ and <case>.ref.safetensors
// with "input_ids" [B, T] int64 and "logits.{f32|bf16}.{eager|sdpa}.{cpu|cuda}" [B, T, V] float32.
// HH_QWEN3_HF_DEVICE (default cpu) picks the device our forward runs on and the logits it is held to;
// "eager" logits are compared with eager_attention=true, "sdpa" ones with the default path.

at::Tensor read_stored(const io::SafetensorsFile& f, const std::string& name) {
  const io::TensorInfo& info = f.info(name);
  at::Tensor view = at::from_blob(const_cast<std::byte*>(f.data(info)), info.shape,
                                  at::TensorOptions().dtype(io::to_scalar_type(info.dtype)));
  return view.clone();
}

TEST(Qwen3Hf, MatchesTransformersLogits) {
  const char* root_env = std::getenv("HH_QWEN3_HF_REF");
  if (root_env == nullptr || *root_env == 0) GTEST_SKIP() << "HH_QWEN3_HF_REF not set";
  const char* dev_env = std::getenv("HH_QWEN3_HF_DEVICE");
  const std::string device = dev_env != nullptr && *dev_env != 0 ? dev_env : "cpu";
  const std::string dev_type = device.substr(0, device.find(':'));
  int compared = 0;
  for (const auto& entry : std::filesystem::directory_iterator(root_env)) {
    const auto ref_path = entry.path();
    const std::string suffix = ".ref.safetensors";
    const std::string file = ref_path.filename().string();
    if (file.size() <= suffix.size() || file.compare(file.size() - suffix.size(), suffix.size(), suffix) != 0) continue;
    const auto model_dir = ref_path.parent_path() / file.substr(0, file.size() - suffix.size());
    io::SafetensorsFile ref(ref_path);
    const at::Tensor ids = read_stored(ref, "input_ids");
    for (const std::string dtype : {"f32", "bf16"}) {
      Transformer m = Transformer::load(model_dir, device, dtype);
      for (const std::string impl : {"eager", "sdpa"}) {
        const std::string key = "logits." + dtype + "." + impl + "." + dev_type;
        if (!ref.contains(key)) continue;
        ForwardOptions opts;
        opts.eager_attention = impl == "eager";
        const at::Tensor ours = m.forward(ids, opts).logits.to(at::kCPU);
        const at::Tensor hf = read_stored(ref, key);
        const double scale = max_abs(hf);
        const double err = max_abs(ours.to(at::kDouble) - hf.to(at::kDouble));
        const double same = ours.eq(hf).to(at::kDouble).mean().item<double>();
        std::cout << "[hf-parity] case=" << model_dir.filename().string() << " " << key << " shape=" << hf.sizes()
                  << " max|hf|=" << scale << " max_abs_err=" << err << " bit_equal_fraction=" << same << std::endl;
        EXPECT_LE(err, (dtype == "f32" ? 1e-4 : kTolBf16) * scale) << model_dir << " " << key;
        ++compared;
      }
    }
  }
  EXPECT_GT(compared, 0) << "no reference logits for device type " << dev_type << " under " << root_env;
}

}  // namespace
}  // namespace hh::model
