// The analysis engine against independent expectations: the batched, prefix-reusing sweeps equal
// the plain one-forward-per-head reference; path patching equals hand-computed direct effects on a
// model built for it; attribution equals the derivative of exact patching; retrieval scores and
// layer similarities have the values their definitions give.
#include <torch/torch.h>

#include <gtest/gtest.h>

#include <ATen/CPUGeneratorImpl.h>

#include <cmath>

#include "core/interp/patching.h"
#include "core/interp/similarity.h"
#include "core/model/hooks.h"
#include "core/model/transformer.h"
#include "support/test_support.h"
#include "support/tiny_config.h"

namespace {

using hh::interp::CalibExample;
using hh::interp::HeadRef;
using hh::interp::Metric;
using hh::interp::Mode;
using hh::interp::PreparedExample;
using hh::interp::RunCache;
using hh::interp::SweepOptions;
using hh::model::HookKind;
using hh::model::hook_name;
using hh::model::ModelConfig;
using hh::model::Transformer;

// float64 models: the fast and reference paths differ only by summation order.
constexpr double kTolF64 = 1e-9;

ModelConfig tiny_config(int64_t L = 3, int64_t Hq = 4, int64_t Hkv = 2) {
  return hh::test::tiny_config(L, Hq, Hkv, 8, 32, 48, 53);
}

Transformer tiny_model(uint64_t seed, at::ScalarType dtype = at::kDouble, ModelConfig cfg = tiny_config()) {
  // std 0.3: attention far from uniform and large per-head effects.
  return Transformer(cfg, hh::model::random_weights(cfg, seed, dtype, 0.3));
}

std::vector<int64_t> random_tokens(int64_t n, int64_t V, uint64_t seed) {
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  at::Tensor t = at::randint(V, {n}, gen, at::TensorOptions().dtype(at::kLong));
  return std::vector<int64_t>(t.data_ptr<int64_t>(), t.data_ptr<int64_t>() + n);
}

// A clean/corrupt pair of `len` prompt tokens that differ from position `diff` on (a few tokens).
CalibExample make_example(int64_t len, int64_t diff, int64_t answer_len, uint64_t seed, int64_t V = 53) {
  CalibExample ex;
  ex.task = "test";
  ex.clean_ids = random_tokens(len, V, seed);
  ex.corrupt_ids = ex.clean_ids;
  for (int64_t i = diff; i < std::min(len, diff + 3); ++i) ex.corrupt_ids[i] = (ex.clean_ids[i] + 7) % V;
  ex.answer_ids = random_tokens(answer_len, V, seed + 100);
  ex.wrong_ids = {(ex.answer_ids[0] + 1) % V};
  return ex;
}

void expect_maps_close(const at::Tensor& a, const at::Tensor& b, double tol, const std::string& what) {
  ASSERT_EQ(a.sizes(), b.sizes()) << what;
  const at::Tensor both_nan = a.isnan().logical_and(b.isnan());
  EXPECT_TRUE(at::equal(a.isnan(), b.isnan())) << what << ": NaN (not asked) entries differ";
  const at::Tensor d = (a - b).abs().masked_fill(both_nan, 0);
  const double scale = std::max(1.0, b.masked_fill(both_nan, 0).abs().max().item<double>());
  EXPECT_LE(d.max().item<double>(), tol * scale) << what << "\nfast:\n" << a << "\nreference:\n" << b;
}

TEST(PrefixForward, SuffixOnCachedKeysAndValuesEqualsTheFullForward) {
  // Rows P.. computed on the first P tokens' cached keys/values equal those rows of the full forward,
  // on both attention kernels, with patterns over all P + T keys.
  const Transformer model = tiny_model(4);
  const at::Tensor ids = at::tensor(at::ArrayRef<int64_t>(random_tokens(19, 53, 3))).unsqueeze(0);
  for (bool eager : {false, true}) {
    std::map<std::string, at::Tensor> full;
    hh::model::Hooks hf;
    for (int64_t l = 0; l < 3; ++l) {
      hf.cache(hook_name(l, HookKind::K), &full);
      hf.cache(hook_name(l, HookKind::V), &full);
      hf.cache(hook_name(l, HookKind::Pattern), &full);
    }
    hh::model::ForwardOptions f;
    f.hooks = &hf;
    f.eager_attention = eager;
    const at::Tensor logits = model.forward(ids, f).logits;
    for (int64_t P : {1, 8, 18}) {
      std::vector<at::Tensor> pk, pv;
      for (int64_t l = 0; l < 3; ++l) {
        pk.push_back(full.at(hook_name(l, HookKind::K)).narrow(1, 0, P));
        pv.push_back(full.at(hook_name(l, HookKind::V)).narrow(1, 0, P));
      }
      std::map<std::string, at::Tensor> part;
      hh::model::Hooks hp;
      hp.cache(hook_name(1, HookKind::Pattern), &part);
      hh::model::ForwardOptions g;
      g.hooks = &hp;
      g.eager_attention = eager;
      g.prefix_k = &pk;
      g.prefix_v = &pv;
      // Two rows of the batch, to check the prefix broadcasts.
      const at::Tensor suffix = ids.narrow(1, P, 19 - P).expand({2, -1});
      const at::Tensor got = model.forward(suffix, g).logits;
      for (int64_t b = 0; b < 2; ++b)
        EXPECT_TRUE(at::allclose(got[b], logits[0].narrow(0, P, 19 - P), 1e-10, 1e-10)) << "P=" << P << " eager=" << eager;
      const at::Tensor pattern = part.at(hook_name(1, HookKind::Pattern));  // [2, Hq, T - P, 19]
      EXPECT_TRUE(at::allclose(pattern[0], full.at(hook_name(1, HookKind::Pattern))[0].narrow(1, P, 19 - P), 1e-10, 1e-10));
    }
  }
}

TEST(PrefixForward, TrimmedLastLayerGivesTheSameLogitsAtTheAskedRows) {
  const Transformer model = tiny_model(6);
  const at::Tensor ids = at::tensor(at::ArrayRef<int64_t>(random_tokens(23, 53, 8))).unsqueeze(0).expand({3, -1});
  const at::Tensor rows = at::tensor(at::ArrayRef<int64_t>(std::vector<int64_t>{4, 11, 22}));
  hh::model::ForwardOptions plain;
  plain.logit_positions = rows;
  hh::model::ForwardOptions trimmed = plain;
  trimmed.trim_last_layer = true;
  const auto a = model.forward(ids, plain), b = model.forward(ids, trimmed);
  EXPECT_TRUE(at::allclose(a.logits, b.logits, 1e-10, 1e-10));
  EXPECT_EQ(b.resid.sizes(), (std::vector<int64_t>{3, 3, 32}));
  EXPECT_TRUE(at::allclose(a.resid.index_select(1, rows), b.resid, 1e-10, 1e-10));
  // From a cached residual with a key prefix, as the sweeps run it.
  std::map<std::string, at::Tensor> full;
  hh::model::Hooks hooks;
  for (int64_t l = 0; l < 3; ++l) {
    hooks.cache(hook_name(l, HookKind::K), &full);
    hooks.cache(hook_name(l, HookKind::V), &full);
    hooks.cache(hook_name(l, HookKind::ResidPre), &full);
  }
  hh::model::ForwardOptions f;
  f.hooks = &hooks;
  const at::Tensor logits = model.forward(ids.narrow(0, 0, 1), f).logits;  // [1, 23, V]
  std::vector<at::Tensor> pk, pv;
  for (int64_t l = 0; l < 3; ++l) {
    pk.push_back(full.at(hook_name(l, HookKind::K)).narrow(1, 0, 9));
    pv.push_back(full.at(hook_name(l, HookKind::V)).narrow(1, 0, 9));
  }
  hh::model::ForwardOptions g;
  g.start_layer = 2;
  g.prefix_k = &pk;
  g.prefix_v = &pv;
  g.logit_positions = rows.narrow(0, 1, 2) - 9;  // rows 11 and 22 of the suffix from 9
  g.trim_last_layer = true;
  const at::Tensor got = model.forward(full.at(hook_name(2, HookKind::ResidPre)).narrow(1, 9, 14), g).logits;
  EXPECT_TRUE(at::allclose(got[0], logits[0].index_select(0, rows.narrow(0, 1, 2)), 1e-10, 1e-10));
  // A hook on the last layer turns trimming off (it must see every row).
  std::map<std::string, at::Tensor> seen;
  hh::model::Hooks last;
  last.cache(hook_name(2, HookKind::MlpOut), &seen);
  trimmed.hooks = &last;
  EXPECT_EQ(model.forward(ids, trimmed).resid.size(1), 23);
  EXPECT_EQ(seen.at(hook_name(2, HookKind::MlpOut)).size(1), 23);
}

TEST(Generate, CachedGreedyDecodingEqualsArgmaxOfFullForwards) {
  const Transformer model = tiny_model(12);
  std::vector<int64_t> seq = random_tokens(9, 53, 4);
  const auto gen = hh::model::generate_greedy(model, seq, 7);
  ASSERT_EQ(gen.size(), 7u);
  for (int64_t next : gen) {
    const auto logits = model.forward(at::tensor(at::ArrayRef<int64_t>(seq)).unsqueeze(0)).logits;
    EXPECT_EQ(logits[0][static_cast<int64_t>(seq.size()) - 1].argmax().item<int64_t>(), next);
    seq.push_back(next);
  }
  EXPECT_TRUE(hh::model::generate_greedy(model, {1, 2}, 0).empty());
  EXPECT_MENTIONS(hh::test::error_of([&] { hh::model::generate_greedy(model, {}, 3); }), "no tokens");
}

// model::linear takes one row on the CPU as a matrix-vector product: the same values as at::linear
// (to the dtype's rounding of a differently ordered sum), in the input's shape, with and without bias,
// and its gradients too; several rows go to at::linear itself.
TEST(Linear, OneRowAsAMatrixVectorProductEqualsAtLinear) {
  at::manual_seed(3);
  for (auto dtype : {at::kFloat, at::kDouble}) {
    const double tol = dtype == at::kFloat ? 1e-5 : 1e-12;
    const at::Tensor w = at::randn({48, 40}, dtype), b = at::randn({48}, dtype);
    for (const std::vector<int64_t>& shape : {std::vector<int64_t>{40}, {1, 40}, {1, 1, 40}, {1, 1, 1, 40}, {3, 40}, {2, 5, 40}}) {
      const at::Tensor x = at::randn(shape, dtype);
      for (bool bias : {false, true}) {
        const at::Tensor got = hh::model::linear(x, w, bias ? b : at::Tensor());
        const at::Tensor want = bias ? at::linear(x, w, b) : at::linear(x, w);
        ASSERT_EQ(got.sizes(), want.sizes());
        EXPECT_TRUE(at::allclose(got, want, tol, tol)) << shape.size() << " dims, bias " << bias;
      }
    }
    const at::Tensor x = at::randn({1, 1, 40}, dtype).requires_grad_(), wg = w.clone().requires_grad_();
    hh::model::linear(x, wg, b).pow(2).sum().backward();
    const at::Tensor x2 = x.detach().clone().requires_grad_(), w2 = w.clone().requires_grad_();
    at::linear(x2, w2, b).pow(2).sum().backward();
    EXPECT_TRUE(at::allclose(x.grad(), x2.grad(), tol, tol));
    EXPECT_TRUE(at::allclose(wg.grad(), w2.grad(), tol, tol));
  }
}

TEST(GrowingRows, AppendsEqualConcatenationAndEarlierViewsKeepTheirValues) {
  at::manual_seed(7);
  hh::model::GrowingRows rows;
  EXPECT_FALSE(rows.rows().defined());
  std::vector<at::Tensor> pieces;
  std::vector<std::pair<at::Tensor, at::Tensor>> seen;  // a view returned by append, and its values then
  int64_t reallocations = 0;
  for (int64_t t : {3, 1, 1, 1, 5, 1, 1, 1, 1, 1, 1, 2}) {
    pieces.push_back(at::randn({2, t, 3, 4}, at::kDouble));
    const int64_t cap = rows.capacity();
    const at::Tensor& all = rows.append(pieces.back());
    reallocations += rows.capacity() != cap;
    ASSERT_TRUE(at::equal(all, at::cat(pieces, 1)));
    EXPECT_EQ(rows.size(), all.size(1));
    EXPECT_GE(rows.capacity(), rows.size());
    seen.emplace_back(all, all.clone());
  }
  // 19 rows in 12 appends: capacity 3, 6, 12, 24, so four allocations, not twelve.
  EXPECT_EQ(rows.capacity(), 24);
  EXPECT_EQ(reallocations, 4);
  for (const auto& [view, values] : seen) EXPECT_TRUE(at::equal(view, values));
  // The rows never alias what was appended.
  pieces.front().fill_(0.0);
  EXPECT_FALSE(at::equal(rows.rows().narrow(1, 0, 3), pieces.front()));

  using hh::test::error_of;
  EXPECT_MENTIONS(error_of([&] { rows.append(at::zeros({2, 1, 3, 5}, at::kDouble)); }), "[2, 1, 3, 5]");
  EXPECT_MENTIONS(error_of([&] { rows.append(at::zeros({1, 1, 3, 4}, at::kDouble)); }), "[2, 19, 3, 4]");
  EXPECT_MENTIONS(error_of([&] { rows.append(at::zeros({2, 1, 3, 4}, at::kFloat)); }), "Float");
  EXPECT_MENTIONS(error_of([&] { rows.append(at::zeros({2, 0, 3, 4}, at::kDouble)); }), "t >= 1");
  EXPECT_EQ(rows.size(), 19);
}

// A forward over a cache (prefill, then several tokens at once, then one at a time) gives the logits
// of one forward over the whole sequence at those positions, for both attention paths, and leaves
// every layer's keys and values in the cache.
TEST(Generate, ForwardsOverACacheEqualTheWholeSequencesForward) {
  const Transformer model = tiny_model(21);
  const int64_t L = model.config().num_hidden_layers;
  const std::vector<int64_t> seq = random_tokens(15, 53, 8);
  const at::Tensor ids = at::tensor(at::ArrayRef<int64_t>(seq)).unsqueeze(0);
  for (bool eager : {false, true}) {
    hh::model::ForwardOptions whole;
    whole.eager_attention = eager;
    const at::Tensor expected = model.forward(ids, whole).logits;  // [1, 15, V]
    hh::model::KvCache cache(L);
    int64_t at_pos = 0;
    for (int64_t t : {6, 4, 1, 1, 3}) {
      hh::model::ForwardOptions f;
      f.cache = &cache;
      f.eager_attention = eager;
      const at::Tensor got = model.forward(ids.narrow(1, at_pos, t), f).logits;
      EXPECT_TRUE(at::allclose(got, expected.narrow(1, at_pos, t), kTolF64, kTolF64)) << "eager " << eager << " at " << at_pos;
      at_pos += t;
      EXPECT_EQ(cache.tokens(), at_pos);
    }
    for (int64_t l = 0; l < L; ++l) EXPECT_EQ(cache.v[static_cast<size_t>(l)].size(), 15);
  }
  // Refusals: with a prefix as well; layers holding different numbers of tokens; too few layers.
  hh::model::KvCache cache(L);
  std::vector<at::Tensor> prefix(static_cast<size_t>(L));
  hh::model::ForwardOptions both;
  both.cache = &cache;
  both.prefix_k = &prefix;
  both.prefix_v = &prefix;
  EXPECT_MENTIONS(hh::test::error_of([&] { model.forward(ids, both); }), "cannot be given together");
  cache.k[1].append(at::zeros({1, 2, model.config().num_key_value_heads, model.config().head_dim}, at::kDouble));
  hh::model::ForwardOptions uneven;
  uneven.cache = &cache;
  EXPECT_MENTIONS(hh::test::error_of([&] { model.forward(ids, uneven); }), "different numbers of tokens");
  hh::model::KvCache short_cache(L - 1);
  uneven.cache = &short_cache;
  EXPECT_MENTIONS(hh::test::error_of([&] { model.forward(ids, uneven); }), "holds 2 layers");
}

struct Case {
  Metric metric;
  Mode mode;
  int64_t diff;  // first differing prompt position
  int64_t answer_len;
};

class SweepVsReference : public ::testing::TestWithParam<Case> {};

TEST_P(SweepVsReference, HeadsLayersAndPathsEqualOneForwardPerVariant) {
  const Case c = GetParam();
  const Transformer model = tiny_model(3);
  const CalibExample raw = make_example(/*len=*/13, c.diff, c.answer_len, /*seed=*/c.diff * 10 + c.answer_len);
  const PreparedExample ex = hh::interp::prepare_example(raw, model, c.metric, "case");
  const RunCache cache = hh::interp::run_clean_corrupt(model, ex, c.metric);
  SweepOptions o;
  o.metric = c.metric;
  o.mode = c.mode;
  o.max_batch = 3;  // chunks that do not divide the 4 heads of a layer

  // The cache's metrics are the plain forwards' metrics.
  const at::Tensor full_clean = model.forward(ex.clean).logits.index_select(1, ex.answer_pos);
  const at::Tensor full_corrupt = model.forward(ex.corrupt).logits.index_select(1, ex.answer_pos);
  EXPECT_NEAR(cache.metric_clean, hh::interp::metric_from_logits(full_clean, ex, c.metric).item<double>(), kTolF64);
  EXPECT_NEAR(cache.metric_corrupt, hh::interp::metric_from_logits(full_corrupt, ex, c.metric).item<double>(), kTolF64);
  EXPECT_GT(std::abs(cache.metric_clean - cache.metric_corrupt), 1e-3) << "the corruption must matter";

  expect_maps_close(hh::interp::head_sweep(model, ex, cache, o), hh::interp::head_sweep_reference(model, ex, o),
                    kTolF64, "heads");
  expect_maps_close(hh::interp::layer_sweep(model, ex, cache, o), hh::interp::layer_sweep_reference(model, ex, o),
                    kTolF64, "layers");
  if (c.mode == Mode::Noising) {
    expect_maps_close(hh::interp::path_sweep(model, ex, cache, {}, o),
                      hh::interp::path_sweep_reference(model, ex, {}, o), kTolF64, "path -> logits");
    const std::vector<HeadRef> receivers = {{1, 2}, {2, 0}, {2, 3}};
    expect_maps_close(hh::interp::path_sweep(model, ex, cache, receivers, o),
                      hh::interp::path_sweep_reference(model, ex, receivers, o), kTolF64, "path -> receivers");
  }
}

INSTANTIATE_TEST_SUITE_P(
    Patching, SweepVsReference,
    ::testing::Values(Case{Metric::LogProb, Mode::Noising, 5, 3}, Case{Metric::LogProb, Mode::Denoising, 5, 3},
                      Case{Metric::LogitDiff, Mode::Noising, 7, 1}, Case{Metric::LogitDiff, Mode::Denoising, 2, 2},
                      Case{Metric::LogProb, Mode::Noising, 0, 2},     // differs from the first token: no prefix
                      Case{Metric::LogProb, Mode::Denoising, 12, 1}),  // differs only in the last prompt token
    [](const auto& info) {
      return std::string(info.param.metric == Metric::LogProb ? "logprob" : "logitdiff") + "_" +
             hh::interp::mode_name(info.param.mode) + "_diff" + std::to_string(info.param.diff) + "_A" +
             std::to_string(info.param.answer_len);
    });

TEST(Patching, FastSweepHandlesExamplesOfDifferentLengthsAndAHeadSubset) {
  const Transformer model = tiny_model(5);
  SweepOptions o;
  o.heads = {{0, 1}, {2, 3}, {2, 0}, {1, 1}};
  for (int64_t len : {4, 9, 21}) {
    const CalibExample raw = make_example(len, len / 2, 2, 40 + len);
    const PreparedExample ex = hh::interp::prepare_example(raw, model, o.metric, "len");
    const RunCache cache = hh::interp::run_clean_corrupt(model, ex, o.metric);
    const at::Tensor fast = hh::interp::head_sweep(model, ex, cache, o);
    expect_maps_close(fast, hh::interp::head_sweep_reference(model, ex, o), kTolF64, "T=" + std::to_string(len));
    EXPECT_EQ(fast.isnan().logical_not().sum().item<int64_t>(), 4) << "only the asked heads are filled";
  }
}

TEST(Patching, Float32FastPathMatchesReferenceWithinRounding) {
  const Transformer model = tiny_model(7, at::kFloat);
  const CalibExample raw = make_example(17, 6, 3, 9);
  SweepOptions o;
  const PreparedExample ex = hh::interp::prepare_example(raw, model, o.metric, "f32");
  const RunCache cache = hh::interp::run_clean_corrupt(model, ex, o.metric);
  expect_maps_close(hh::interp::head_sweep(model, ex, cache, o), hh::interp::head_sweep_reference(model, ex, o), 1e-4,
                    "f32 heads");
}

TEST(Patching, ResidPatchAtTheLastLayerReproducesTheSourceRun) {
  // Replacing the whole final residual with the corrupt run's gives exactly M_corrupt (noising), and
  // the clean run's gives M_clean (denoising): effect 1 in both directions.
  const Transformer model = tiny_model(8);
  const CalibExample raw = make_example(11, 4, 2, 12);
  for (Mode mode : {Mode::Noising, Mode::Denoising}) {
    SweepOptions o;
    o.mode = mode;
    const PreparedExample ex = hh::interp::prepare_example(raw, model, o.metric, "resid");
    const RunCache cache = hh::interp::run_clean_corrupt(model, ex, o.metric);
    const at::Tensor layers = hh::interp::layer_sweep(model, ex, cache, o);  // [3, L]
    const double last = layers[2][2].item<double>();
    const at::Tensor effect = hh::interp::normalise_effect(at::full({1}, last, at::kDouble), cache.metric_clean,
                                                           cache.metric_corrupt, mode);
    EXPECT_NEAR(effect.item<double>(), 1.0, 1e-9) << hh::interp::mode_name(mode);
  }
}

TEST(Patching, IdenticalPromptsGiveNoEffectAndNoWork) {
  const Transformer model = tiny_model(9);
  CalibExample raw = make_example(8, 3, 2, 1);
  raw.corrupt_ids = raw.clean_ids;
  SweepOptions o;
  const PreparedExample ex = hh::interp::prepare_example(raw, model, o.metric, "same");
  EXPECT_EQ(ex.diff, ex.T);
  const RunCache cache = hh::interp::run_clean_corrupt(model, ex, o.metric);
  EXPECT_EQ(cache.metric_clean, cache.metric_corrupt);
  const at::Tensor heads = hh::interp::head_sweep(model, ex, cache, o);
  EXPECT_TRUE(at::allclose(heads, at::full_like(heads, cache.metric_clean)));
}

// ---- path patching on models built for it -----------------------------------------------------

TEST(PathPatching, WithoutLaterAttentionPathEffectEqualsActivationEffect) {
  // o_proj of every layer after 0 is zero: later heads contribute nothing, so freezing them changes
  // nothing and a layer-0 head's path effect is its total effect.
  ModelConfig cfg = tiny_config();
  auto w = hh::model::random_weights(cfg, 21, at::kDouble, 0.3);
  for (size_t l = 1; l < w.layers.size(); ++l) w.layers[l].o_proj.zero_();
  const Transformer model(cfg, w);
  const CalibExample raw = make_example(12, 3, 2, 5);
  SweepOptions o;
  o.heads = {{0, 0}, {0, 1}, {0, 2}, {0, 3}};
  const PreparedExample ex = hh::interp::prepare_example(raw, model, o.metric, "path");
  const RunCache cache = hh::interp::run_clean_corrupt(model, ex, o.metric);
  expect_maps_close(hh::interp::path_sweep(model, ex, cache, {}, o), hh::interp::head_sweep(model, ex, cache, o),
                    kTolF64, "path vs activation");
}

TEST(PathPatching, WithoutMlpsTheDirectEffectIsTheSendersOutputAddedToTheFinalResidual) {
  // MLPs zeroed: with later heads frozen, the sender's change reaches the logits only through the
  // residual stream, so the patched final residual is the clean one plus o_proj of the head's change.
  ModelConfig cfg = tiny_config();
  auto w = hh::model::random_weights(cfg, 22, at::kDouble, 0.3);
  for (auto& lw : w.layers) lw.down_proj.zero_();
  const Transformer model(cfg, w);
  const CalibExample raw = make_example(10, 2, 3, 6);
  SweepOptions o;
  const PreparedExample ex = hh::interp::prepare_example(raw, model, o.metric, "direct");
  const RunCache cache = hh::interp::run_clean_corrupt(model, ex, o.metric);
  const at::Tensor fast = hh::interp::path_sweep(model, ex, cache, {}, o);

  std::map<std::string, at::Tensor> clean, corrupt;
  hh::model::Hooks hc, hk;
  for (int64_t l = 0; l < cfg.num_hidden_layers; ++l) {
    hc.cache(hook_name(l, HookKind::Z), &clean);
    hk.cache(hook_name(l, HookKind::Z), &corrupt);
  }
  hh::model::ForwardOptions fc;
  fc.hooks = &hc;
  const at::Tensor final_resid = model.forward(ex.clean, fc).resid;  // [1, T, d]
  hh::model::ForwardOptions fk;
  fk.hooks = &hk;
  model.forward(ex.corrupt, fk);
  for (int64_t l = 0; l < cfg.num_hidden_layers; ++l)
    for (int64_t h = 0; h < cfg.num_attention_heads; ++h) {
      const std::string name = hook_name(l, HookKind::Z);
      at::Tensor dz = at::zeros_like(clean.at(name));
      dz.select(2, h).copy_(corrupt.at(name).select(2, h) - clean.at(name).select(2, h));
      // o_proj of the change: W_o restricted to head h's columns, by hand.
      const at::Tensor wo = w.layers[static_cast<size_t>(l)].o_proj;  // [d, Hq*Dh]
      const at::Tensor added = at::matmul(dz.flatten(2), wo.t());    // [1, T, d]
      const at::Tensor logits = model.unembed(final_resid + added).index_select(1, ex.answer_pos);  // [1, A, V]
      const at::Tensor lp = at::log_softmax(logits[0], -1);
      double expected = 0;
      for (int64_t i = 0; i < ex.answer_ids.size(0); ++i) expected += lp[i][ex.answer_ids[i].item<int64_t>()].item<double>();
      EXPECT_NEAR(fast[l][h].item<double>(), expected, 1e-9) << "head " << l << ":" << h;
    }
}

// ---- attribution ---------------------------------------------------------------------------------

TEST(Attribution, EqualsTheDerivativeOfExactPatchingAlongTheHeadsChange) {
  // estimate - M_base = d/da M(z_base + a (z_source - z_base) on one head) at a = 0, which central
  // differences of exact patching compute independently of autograd.
  const Transformer model = tiny_model(31);
  const CalibExample raw = make_example(11, 4, 2, 8);
  for (Mode mode : {Mode::Noising, Mode::Denoising}) {
    SweepOptions o;
    o.mode = mode;
    const PreparedExample ex = hh::interp::prepare_example(raw, model, o.metric, "attr");
    const RunCache cache = hh::interp::run_clean_corrupt(model, ex, o.metric);
    const at::Tensor est = hh::interp::attribution(model, ex, cache, o);
    const double m_base = mode == Mode::Noising ? cache.metric_clean : cache.metric_corrupt;
    const at::Tensor& base = mode == Mode::Noising ? ex.clean : ex.corrupt;
    const at::Tensor& source = mode == Mode::Noising ? ex.corrupt : ex.clean;
    std::map<std::string, at::Tensor> src;
    hh::model::Hooks hs;
    for (int64_t l = 0; l < 3; ++l) hs.cache(hook_name(l, HookKind::Z), &src);
    hh::model::ForwardOptions fs;
    fs.hooks = &hs;
    model.forward(source, fs);
    constexpr double kStep = 1e-5;
    for (int64_t l = 0; l < 3; ++l)
      for (int64_t h = 0; h < 4; ++h) {
        auto at_alpha = [&](double a) {
          hh::model::Hooks hooks;
          const std::string name = hook_name(l, HookKind::Z);
          hooks.add(name, [&, a](at::Tensor& z) {
            z = z.clone();
            z.select(2, h).add_((src.at(name).select(2, h) - z.select(2, h)) * a);
          });
          hh::model::ForwardOptions f;
          f.hooks = &hooks;
          const at::Tensor logits = model.forward(base, f).logits.index_select(1, ex.answer_pos);
          return hh::interp::metric_from_logits(logits, ex, o.metric).item<double>();
        };
        const double derivative = (at_alpha(kStep) - at_alpha(-kStep)) / (2 * kStep);
        EXPECT_NEAR(est[l][h].item<double>() - m_base, derivative, 1e-6 * std::max(1.0, std::abs(derivative)))
            << hh::interp::mode_name(mode) << " head " << l << ":" << h;
      }
  }
}

TEST(Attribution, CorrelatesWithExactPatchingOnASmoothModel) {
  // Small weights keep the model near its linear regime, where the first-order estimate tracks the
  // exact effect closely.
  const ModelConfig cfg = tiny_config(4, 4, 2);
  const Transformer model(cfg, hh::model::random_weights(cfg, 41, at::kDouble, 0.1));
  const CalibExample raw = make_example(15, 5, 2, 3);
  SweepOptions o;
  const PreparedExample ex = hh::interp::prepare_example(raw, model, o.metric, "corr");
  const RunCache cache = hh::interp::run_clean_corrupt(model, ex, o.metric);
  const at::Tensor exact = hh::interp::head_sweep(model, ex, cache, o).flatten() - cache.metric_clean;
  const at::Tensor est = hh::interp::attribution(model, ex, cache, o).flatten() - cache.metric_clean;
  const at::Tensor a = exact - exact.mean(), b = est - est.mean();
  const double r = (a * b).sum().item<double>() / std::sqrt((a * a).sum().item<double>() * (b * b).sum().item<double>());
  EXPECT_GT(r, 0.9) << "exact:\n" << exact << "\nestimate:\n" << est;
}

// ---- retrieval score -----------------------------------------------------------------------------

TEST(Retrieval, UniformAttentionPicksTheFirstPositionAndScoresItAgainstTheNeedle) {
  // q_proj = 0: every score is 0, attention is uniform and its argmax is key 0 for every row. Token 0
  // is inside the needle [0, 2) and equals answer token 0, not answer token 1: score 1/2 everywhere.
  ModelConfig cfg = tiny_config(2, 4, 2);
  auto w = hh::model::random_weights(cfg, 51, at::kDouble, 0.3);
  for (auto& lw : w.layers) lw.q_proj.zero_();
  const Transformer model(cfg, w);
  CalibExample raw;
  raw.task = "copy";
  raw.clean_ids = {7, 3, 9, 11, 12, 4};
  raw.corrupt_ids = {8, 3, 9, 11, 12, 4};
  raw.answer_ids = {7, 3};
  raw.meta = {{"needles", {{{"span", {0, 2}}, {"asked", true}}}}};
  const PreparedExample ex = hh::interp::prepare_example(raw, model, Metric::LogProb, "copy");
  const at::Tensor s = hh::interp::retrieval_score(model, raw, ex);
  ASSERT_TRUE(s.defined());
  EXPECT_TRUE(at::allclose(s, at::full({2, 4}, 0.5, at::kDouble))) << s;

  raw.meta = {{"needles", {{{"span", {1, 3}}, {"asked", true}}}}};  // token 0 is outside the needle now
  EXPECT_TRUE(at::allclose(hh::interp::retrieval_score(model, raw, ex), at::zeros({2, 4}, at::kDouble)));
  raw.meta = {{"needle", {0, 2}}};  // the single-needle spelling
  EXPECT_TRUE(at::allclose(hh::interp::retrieval_score(model, raw, ex), at::full({2, 4}, 0.5, at::kDouble)));
  raw.meta = nlohmann::json::object();
  EXPECT_FALSE(hh::interp::retrieval_score(model, raw, ex).defined()) << "no needle: not a copy-style example";
}

TEST(Retrieval, MatchesArgmaxOfFullAttentionPatterns) {
  const Transformer model = tiny_model(52);
  CalibExample raw = make_example(20, 9, 3, 77);
  // The answer is copied from the needle at [9, 12).
  raw.answer_ids = {raw.clean_ids[9], raw.clean_ids[10], raw.clean_ids[11]};
  raw.meta = {{"needles", {{{"span", {9, 12}}, {"asked", true}}, {{"span", {2, 4}}, {"asked", false}}}}};
  const PreparedExample ex = hh::interp::prepare_example(raw, model, Metric::LogProb, "copy");
  const at::Tensor s = hh::interp::retrieval_score(model, raw, ex);

  std::map<std::string, at::Tensor> pat;
  hh::model::Hooks hooks;
  for (int64_t l = 0; l < 3; ++l) hooks.cache(hook_name(l, HookKind::Pattern), &pat);
  hh::model::ForwardOptions f;
  f.hooks = &hooks;  // every row: the full T x T pattern of this short input
  model.forward(ex.clean, f);
  const auto ids = ex.clean[0];
  for (int64_t l = 0; l < 3; ++l)
    for (int64_t h = 0; h < 4; ++h) {
      int hits = 0;
      for (int64_t i = 0; i < 3; ++i) {
        const int64_t row = ex.answer_pos[i].item<int64_t>();
        const int64_t top = pat.at(hook_name(l, HookKind::Pattern))[0][h][row].argmax().item<int64_t>();
        hits += (top >= 9 && top < 12 && ids[top].item<int64_t>() == raw.answer_ids[static_cast<size_t>(i)]) ? 1 : 0;
      }
      EXPECT_DOUBLE_EQ(s[l][h].item<double>(), hits / 3.0) << l << ":" << h;
    }
}

TEST(Retrieval, AnswerAttentionIsTheHeadsFullPatternAtTheAnswerRows) {
  const Transformer model = tiny_model(53);
  CalibExample raw = make_example(20, 9, 3, 78);
  const PreparedExample ex = hh::interp::prepare_example(raw, model, Metric::LogProb, "rows");
  std::map<std::string, at::Tensor> pat;
  hh::model::Hooks hooks;
  for (int64_t l = 0; l < 3; ++l) hooks.cache(hook_name(l, HookKind::Pattern), &pat);
  hh::model::ForwardOptions f;
  f.hooks = &hooks;  // every row, every layer
  model.forward(ex.clean, f);
  for (int64_t l = 0; l < 3; ++l)
    for (int64_t h = 0; h < 4; ++h) {
      const at::Tensor rows = hh::interp::answer_attention(model, ex, l, h);
      ASSERT_EQ(rows.sizes(), (at::IntArrayRef{3, ex.T}));
      const at::Tensor want = pat.at(hook_name(l, HookKind::Pattern))[0][h].index_select(0, ex.answer_pos).to(at::kDouble);
      EXPECT_TRUE(at::allclose(rows, want, 1e-6, 1e-7)) << l << ":" << h;
      EXPECT_TRUE(at::allclose(rows.sum(1), at::ones({3}, at::kDouble), 1e-6));
      for (int64_t i = 0; i < 3; ++i) {  // causal: nothing after the query position
        const int64_t q = ex.answer_pos[i].item<int64_t>();
        if (q + 1 < ex.T) EXPECT_EQ(rows[i].narrow(0, q + 1, ex.T - q - 1).abs().max().item<double>(), 0.0);
      }
    }
  EXPECT_MENTIONS(hh::test::error_of([&] { hh::interp::answer_attention(model, ex, 3, 0); }), "outside the model");
  // A cancel flag: down, the same rows; raised, the forward stops with Cancelled.
  std::atomic<bool> cancel{false};
  EXPECT_TRUE(at::equal(hh::interp::answer_attention(model, ex, 2, 1, &cancel), hh::interp::answer_attention(model, ex, 2, 1)));
  cancel = true;
  EXPECT_THROW(hh::interp::answer_attention(model, ex, 2, 1, &cancel), hh::Cancelled);
}

// ---- layer similarity ----------------------------------------------------------------------------

// Linear CKA straight from its definition: HSIC with explicit centring matrices.
double cka_by_definition(const at::Tensor& x, const at::Tensor& y) {
  const int64_t n = x.size(0);
  const at::Tensor H = at::eye(n, at::kDouble) - at::full({n, n}, 1.0 / n, at::kDouble);
  const at::Tensor K = at::matmul(x, x.t()), M = at::matmul(y, y.t());
  auto hsic = [&](const at::Tensor& a, const at::Tensor& b) {
    return at::trace(at::matmul(at::matmul(at::matmul(a, H), b), H)).item<double>();
  };
  return hsic(K, M) / std::sqrt(hsic(K, K) * hsic(M, M));
}

TEST(Similarity, LinearCkaMatchesItsDefinitionAndItsInvariances) {
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(5);
  const auto f64 = at::TensorOptions().dtype(at::kDouble);
  for (auto [n, d] : {std::pair<int64_t, int64_t>{6, 9}, {12, 4}}) {  // Gram form and feature form
    const at::Tensor x = at::randn({n, d}, gen, f64), y = at::randn({n, d}, gen, f64);
    EXPECT_NEAR(hh::interp::linear_cka(x, y), cka_by_definition(x, y), 1e-12);
    // Invariant to orthogonal transforms, isotropic scaling and translation of either side.
    const at::Tensor q = std::get<0>(at::linalg_qr(at::randn({d, d}, gen, f64)));
    EXPECT_NEAR(hh::interp::linear_cka(x, at::matmul(x, q) * 3.0 + 1.5), 1.0, 1e-12);
  }
}

TEST(Similarity, MatricesHaveTheirDefiningSymmetriesAndValues) {
  const int64_t L = 3, T = 7, d = 5;
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(6);
  const auto f64 = at::TensorOptions().dtype(at::kDouble);
  std::vector<at::Tensor> states;
  states.push_back(at::randn({T, d}, gen, f64));
  // Layer 1 doubles the residual (update = h0), layer 2 adds the same update again (h2 = 3 h0),
  // layer 3 adds an independent one.
  states.push_back(states[0] * 2);
  states.push_back(states[0] * 3);
  states.push_back(states[2] + at::randn({T, d}, gen, f64));
  hh::interp::SimilarityAccumulator acc(L, /*tokens_per_example=*/T, /*max_tokens=*/100);
  acc.add(states);
  const auto r = acc.finish();
  for (const at::Tensor& m : {r.cosine_delta, r.cka, r.angular}) EXPECT_TRUE(at::equal(m, m.t()));
  EXPECT_TRUE(at::allclose(r.cosine_delta.diagonal(), at::ones({L})));
  EXPECT_TRUE(at::allclose(r.cka.diagonal(), at::ones({L})));
  EXPECT_TRUE(at::allclose(r.angular.diagonal(), at::zeros({L})));
  // Layers 0 and 1 make the same update (h0) and have parallel outputs (2 h0 and 3 h0).
  EXPECT_NEAR(r.cosine_delta[0][1].item<float>(), 1.0f, 1e-6);
  EXPECT_NEAR(r.angular[0][1].item<float>(), 0.0f, 1e-3);
  EXPECT_NEAR(r.cka[0][1].item<float>(), 1.0f, 1e-6);
  // Output 2 vs output 0: the per-token mean of arccos(cos)/pi by hand.
  const at::Tensor a = states[1], b = states[3];
  const at::Tensor cos = (a * b).sum(1) / (a.norm(2, 1) * b.norm(2, 1));
  EXPECT_NEAR(r.angular[0][2].item<float>(), (at::acos(cos) / M_PI).mean().item<double>(), 1e-6);
  EXPECT_EQ(r.tokens, T);
  EXPECT_EQ(r.cka_tokens, T);
}

// ---- input checks --------------------------------------------------------------------------------

TEST(Patching, BadInputIsRefusedNamingWhatIsWrong) {
  const Transformer model = tiny_model(1);
  CalibExample raw = make_example(6, 2, 1, 1);
  raw.wrong_ids.clear();
  EXPECT_MENTIONS(hh::test::error_of([&] { hh::interp::prepare_example(raw, model, Metric::LogitDiff, "f.jsonl:3"); }),
                  "f.jsonl:3: metric logit-diff needs wrong_ids");
  raw.answer_ids = {99};
  EXPECT_MENTIONS(hh::test::error_of([&] { hh::interp::prepare_example(raw, model, Metric::LogProb, "f.jsonl:4"); }),
                  "answer_ids[0] = 99");
  EXPECT_MENTIONS(hh::test::error_of([] { hh::interp::parse_heads("1:2,7:0", 3, 4); }), "layer 7");
  EXPECT_MENTIONS(hh::test::error_of([] { hh::interp::parse_heads("1:2,1:2", 3, 4); }), "listed twice");
  EXPECT_MENTIONS(hh::test::error_of([] { hh::interp::parse_heads("1-2", 3, 4); }), "LAYER:HEAD");
  const auto heads = hh::interp::parse_heads(" 2:3, 0:0 ", 3, 4);
  ASSERT_EQ(heads.size(), 2u);
  EXPECT_TRUE((heads[0] == HeadRef{2, 3}));
}

TEST(Patching, CancelStopsASweepBetweenForwards) {
  const Transformer model = tiny_model(2);
  const CalibExample raw = make_example(9, 3, 1, 2);
  std::atomic<bool> stop{true};
  SweepOptions o;
  o.cancel = &stop;
  const PreparedExample ex = hh::interp::prepare_example(raw, model, o.metric, "c");
  const RunCache cache = hh::interp::run_clean_corrupt(model, ex, o.metric);
  EXPECT_THROW(hh::interp::head_sweep(model, ex, cache, o), hh::Cancelled);
}

}  // namespace
