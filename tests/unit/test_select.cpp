// Head selection against hand-computed expectations: strategy invariants, ranking of hand-made
// analysis files, the budget formulas worked by hand, and every manifest refusal.
#include <torch/torch.h>

#include <gtest/gtest.h>

#include <cmath>
#include <fstream>
#include <set>

#include "core/io/h5.h"
#include "core/select/manifest.h"
#include "core/select/selection.h"
#include "support/test_support.h"

namespace {

namespace fs = std::filesystem;
using hh::select::Head;
using hh::select::ModelShape;
using hh::select::SelectOptions;

ModelShape shape(int64_t L, int64_t H, int64_t Hkv, int64_t Dh = 8) {
  ModelShape s;
  s.num_layers = L;
  s.num_heads = H;
  s.num_kv_heads = Hkv;
  s.head_dim = Dh;
  return s;
}

// score[l * H + h] = a distinct value per head, larger for (l * 7 + h * 3) % (L * H) (a fixed shuffle).
std::vector<double> shuffled_scores(const ModelShape& s) {
  std::vector<double> v(static_cast<size_t>(s.num_layers * s.num_heads));
  for (size_t i = 0; i < v.size(); ++i) v[i] = static_cast<double>((i * 7 + 3) % v.size());
  return v;
}

int64_t in_layer(const std::vector<Head>& heads, int64_t l) {
  return std::count_if(heads.begin(), heads.end(), [&](const Head& h) { return h.first == l; });
}

TEST(Select, FaCountIsRoundedShareOfAllHeads) {
  EXPECT_EQ(hh::select::fa_count(shape(28, 16, 8), 7), 56);
  EXPECT_EQ(hh::select::fa_count(shape(28, 16, 8), 3), 112);
  EXPECT_EQ(hh::select::fa_count(shape(3, 4, 2), 7), 2);   // 12 / 8 = 1.5 rounds to 2
  EXPECT_EQ(hh::select::fa_count(shape(3, 4, 2), 0), 12);  // 0:1 is dense
}

TEST(Select, GlobalTakesTheTopKAndBreaksTiesByPosition) {
  const auto s = shape(3, 4, 2);
  std::vector<double> score(12, 0.0);
  score[5] = 3;   // 1:1
  score[11] = 2;  // 2:3
  score[0] = 2;   // 0:0 ties with 2:3 and comes first
  SelectOptions o;
  o.ratio = 3;  // k = 3
  EXPECT_EQ(hh::select::select_heads(s, score, o), (std::vector<Head>{{0, 0}, {1, 1}, {2, 3}}));
  o.ratio = 5;  // k = 2: the tie is broken towards 0:0
  EXPECT_EQ(hh::select::select_heads(s, score, o), (std::vector<Head>{{0, 0}, {1, 1}}));
  o.exclude = {{1, 1}};
  o.force = {{2, 2}};
  EXPECT_EQ(hh::select::select_heads(s, score, o), (std::vector<Head>{{0, 0}, {2, 2}}));
}

TEST(Select, PerLayerGivesEqualQuotasAndTheRemainderToTheBestNextHeads) {
  const auto s = shape(4, 8, 2);
  const auto score = shuffled_scores(s);
  SelectOptions o;
  o.strategy = "per-layer";
  o.ratio = 5;  // k = round(32 / 6) = 5 -> 1 per layer, one extra
  const auto heads = hh::select::select_heads(s, score, o);
  ASSERT_EQ(heads.size(), 5u);
  int extra = 0;
  for (int64_t l = 0; l < 4; ++l) {
    const int64_t n = in_layer(heads, l);
    EXPECT_TRUE(n == 1 || n == 2) << "layer " << l;
    extra += n == 2;
    // The layer's chosen heads are its best ones.
    std::vector<double> layer(score.begin() + l * 8, score.begin() + (l + 1) * 8);
    std::sort(layer.rbegin(), layer.rend());
    for (const Head& h : heads)
      if (h.first == l) EXPECT_GE(score[static_cast<size_t>(h.first * 8 + h.second)], layer[static_cast<size_t>(n - 1)]);
  }
  EXPECT_EQ(extra, 1);
}

TEST(Select, KvGroupPicksWholeGroupsByMeanScore) {
  const auto s = shape(2, 4, 2);  // groups of 2 query heads
  std::vector<double> score = {0, 0, 5, 5,   // layer 0: group 1 mean 5
                               9, 0, 4, 4};  // layer 1: group 0 mean 4.5, group 1 mean 4
  SelectOptions o;
  o.strategy = "kv-group";
  o.ratio = 1;  // k = 4 -> 2 groups
  EXPECT_EQ(hh::select::select_heads(s, score, o), (std::vector<Head>{{0, 2}, {0, 3}, {1, 0}, {1, 1}}));
  o.ratio = 3;  // k = 2 -> 1 group
  EXPECT_EQ(hh::select::select_heads(s, score, o), (std::vector<Head>{{0, 2}, {0, 3}}));
  o.exclude = {{0, 3}};  // that group cannot be whole: the next one
  EXPECT_EQ(hh::select::select_heads(s, score, o), (std::vector<Head>{{1, 0}, {1, 1}}));
}

TEST(Select, LayerwiseBaselineIsEveryRPlusOnethLayer) {
  const auto s = shape(8, 2, 1);
  SelectOptions o;
  o.strategy = "layerwise";
  o.ratio = 3;
  EXPECT_EQ(hh::select::select_heads(s, {}, o), (std::vector<Head>{{3, 0}, {3, 1}, {7, 0}, {7, 1}}));
}

TEST(Select, ALayerwisePatternBeyondTheModelsLayersIsSaid) {
  // 6 layers at 7:1: layer 7 would be the first full-attention layer, so the layer-wise baseline (and a
  // layer-wise selection) has no FA head, which the report and the manifest say; at 5:1 layer 5 is one.
  SelectOptions o;
  o.strategy = "random";
  o.ratio = 7;
  auto r = hh::select::make_selection(shape(6, 8, 2), nullptr, {}, o, false, 2, "test");
  EXPECT_TRUE(r.layerwise.empty());
  EXPECT_EQ(r.heads.size(), 6u);  // round(48 / 8)
  ASSERT_EQ(r.notes.size(), 1u);
  EXPECT_NE(r.notes[0].find("layer-wise 7:1 makes layer 7"), std::string::npos) << r.notes[0];
  EXPECT_NE(r.notes[0].find("model's 6 layers"), std::string::npos) << r.notes[0];
  EXPECT_NE(r.notes[0].find("that baseline has no full-attention head"), std::string::npos) << r.notes[0];
  EXPECT_EQ(r.manifest.notes.at("selection_notes"), nlohmann::json(r.notes));
  o.strategy = "layerwise";
  r = hh::select::make_selection(shape(6, 8, 2), nullptr, {}, o, false, 2, "test");
  EXPECT_TRUE(r.heads.empty());
  ASSERT_EQ(r.notes.size(), 1u);
  EXPECT_NE(r.notes[0].find("this selection has no full-attention head"), std::string::npos) << r.notes[0];
  o.ratio = 5;
  r = hh::select::make_selection(shape(6, 8, 2), nullptr, {}, o, false, 2, "test");
  EXPECT_EQ(r.heads.size(), 8u);  // layer 5
  EXPECT_TRUE(r.notes.empty());
  EXPECT_FALSE(r.manifest.notes.contains("selection_notes"));
  o.ratio = 0;  // dense: every layer, no note
  r = hh::select::make_selection(shape(6, 8, 2), nullptr, {}, o, false, 2, "test");
  EXPECT_EQ(r.heads.size(), 48u);
  EXPECT_TRUE(r.notes.empty());
}

TEST(Select, RandomIsDeterministicBySeedAndHonoursExcludeAndForce) {
  const auto s = shape(6, 8, 4);
  SelectOptions o;
  o.strategy = "random";
  o.ratio = 3;  // k = 12
  o.seed = 42;
  const auto a = hh::select::select_heads(s, {}, o), b = hh::select::select_heads(s, {}, o);
  EXPECT_EQ(a, b);
  EXPECT_EQ(a.size(), 12u);
  o.seed = 43;
  EXPECT_NE(hh::select::select_heads(s, {}, o), a);
  o.exclude = {{0, 0}, {1, 1}};
  o.force = {{5, 7}};
  for (uint64_t seed = 0; seed < 20; ++seed) {
    o.seed = seed;
    const auto h = hh::select::select_heads(s, {}, o);
    EXPECT_EQ(h.size(), 12u);
    EXPECT_TRUE(std::binary_search(h.begin(), h.end(), Head{5, 7}));
    EXPECT_FALSE(std::binary_search(h.begin(), h.end(), Head{0, 0}));
    EXPECT_FALSE(std::binary_search(h.begin(), h.end(), Head{1, 1}));
  }
}

TEST(Select, MinPerLayerKeepsTheCountAndFillsEveryLayer) {
  const auto s = shape(4, 8, 2);
  std::vector<double> score(32, 0.0);
  for (int h = 0; h < 8; ++h) score[static_cast<size_t>(h)] = 10 + h;  // layer 0 holds the 8 best heads
  SelectOptions o;
  o.ratio = 3;  // k = 8: all of layer 0 without a minimum
  EXPECT_EQ(in_layer(hh::select::select_heads(s, score, o), 0), 8);
  o.min_per_layer = 1;
  const auto heads = hh::select::select_heads(s, score, o);
  EXPECT_EQ(heads.size(), 8u);
  for (int64_t l = 0; l < 4; ++l) EXPECT_GE(in_layer(heads, l), 1) << l;
  EXPECT_EQ(in_layer(heads, 0), 5);  // its 3 weakest heads made room
  EXPECT_FALSE(std::binary_search(heads.begin(), heads.end(), Head{0, 0}));
  o.min_per_layer = 3;  // 12 > k
  EXPECT_MENTIONS(hh::test::error_of([&] { hh::select::select_heads(s, score, o); }), "needs 12 FA heads");
}

TEST(Select, RankNormaliseAveragesTiesAndPutsNanLast) {
  const double nan = std::nan("");
  const auto r = hh::select::rank_normalise({3.0, 1.0, nan, 1.0, 7.0});
  // Sorted measured values 1, 1, 3, 7 -> ranks 0.5, 0.5, 2, 3 over 3.
  EXPECT_DOUBLE_EQ(r[0], 2.0 / 3.0);
  EXPECT_DOUBLE_EQ(r[1], 0.5 / 3.0);
  EXPECT_DOUBLE_EQ(r[2], 0.0);
  EXPECT_DOUBLE_EQ(r[3], 0.5 / 3.0);
  EXPECT_DOUBLE_EQ(r[4], 1.0);
}

TEST(Select, BudgetMatchesTheFormulasWorkedByHand) {
  const auto s = shape(2, 4, 2, 8);
  const std::vector<Head> fa = {{0, 0}, {0, 1}, {1, 3}};  // KV groups (0, 0) and (1, 1)
  const auto b = hh::select::budget(s, fa, 1024, 2);
  EXPECT_EQ(b.kv_groups, 2);
  EXPECT_EQ(b.la_heads, 5);
  EXPECT_DOUBLE_EQ(b.kv_bytes, 2.0 * 1024 * 8 * 2 * 2);                             // 65,536
  EXPECT_DOUBLE_EQ(b.state_bytes, 5.0 * 8 * 8 * 4);                                // 1,280
  EXPECT_DOUBLE_EQ(b.attn_flops, 3.0 * 2 * 1024 * 1024 * 8 + 5.0 * 6 * 1024 * 64);  // 52,297,728
  const auto dense = hh::select::budget(s, {{0, 0}, {0, 1}, {0, 2}, {0, 3}, {1, 0}, {1, 1}, {1, 2}, {1, 3}}, 1024, 2);
  EXPECT_DOUBLE_EQ(dense.kv_bytes, 2.0 * 1024 * 8 * 2 * 4);
  EXPECT_DOUBLE_EQ(dense.state_bytes, 0.0);
}

// ---- analysis files ------------------------------------------------------------------------------

// A hand-made analysis.h5 for a 2 x 3 model with chosen maps and per-example metrics.
fs::path write_analysis_file(const fs::path& dir, bool with_path) {
  const fs::path p = dir / "analysis.h5";
  auto f = hh::io::H5File::create(p);
  f.set_attr("/", "format", "hydrahead-analysis");
  f.set_attr("/", "format_version", int64_t{1});
  f.set_attr("/", "model_fingerprint", "sha256:abc");
  f.set_attr("/", "config_json",
             R"({"architectures":["Qwen3ForCausalLM"],"model_type":"qwen3","vocab_size":10,"hidden_size":8,)"
             R"("intermediate_size":16,"num_hidden_layers":2,"num_attention_heads":3,"num_key_value_heads":1,)"
             R"("head_dim":4,"hidden_act":"silu"})");
  // Two retrieval examples (clean 0, corrupt -2) and one reasoning example (clean 0, corrupt -1).
  f.write("/examples/metric_clean", torch::tensor({0.0, 0.0, 0.0}, torch::kDouble));
  f.write("/examples/metric_corrupt", torch::tensor({-2.0, -2.0, -1.0}, torch::kDouble));
  f.write_strings("/examples/task", {"passkey", "niah-single", "arithmetic"});
  // metric_patched [3, 2, 3]: retrieval examples hurt most by head 1:2, reasoning by head 0:0.
  auto mp = torch::zeros({3, 2, 3}, torch::kFloat);
  mp[0][1][2] = -2.0;  // effect 1
  mp[1][1][2] = -1.0;  // effect 0.5 -> mean 0.75
  mp[0][0][1] = -1.0;  // effect 0.5 on one example -> mean 0.25
  mp[2][0][0] = -1.0;  // reasoning: effect 1
  f.write("/activation/noising/metric_patched", mp);
  f.write("/activation/noising/effect", torch::zeros({2, 3}, torch::kFloat));
  if (with_path) f.write("/path/effect", torch::tensor({{0.0f, 0.0f, 0.0f}, {0.5f, 0.0f, 0.0f}}));
  f.commit();
  return p;
}

TEST(SelectSignals, RetrievalAndReasoningNoisingAreEffectsOverTheirExamples) {
  const fs::path dir = hh::test::scratch_dir("select_signals");
  const auto s = hh::select::load_signals(write_analysis_file(dir, true), hh::select::default_retrieval_tasks());
  EXPECT_EQ(s.shape.num_layers, 2);
  EXPECT_EQ(s.shape.fingerprint, "sha256:abc");
  const auto& r = s.maps.at("retrieval_noising");
  EXPECT_DOUBLE_EQ(r[5], 0.75);  // 1:2
  EXPECT_DOUBLE_EQ(r[1], 0.25);  // 0:1
  EXPECT_DOUBLE_EQ(r[0], 0.0);
  EXPECT_DOUBLE_EQ(s.maps.at("reasoning_noising")[0], 1.0);
  EXPECT_TRUE(s.absent.count("attribution"));

  // Composite of the three default signals: rank-normalised and averaged.
  const auto c = hh::select::composite(s, hh::select::default_weights());
  EXPECT_EQ(c.used.size(), 3u);
  SelectOptions o;
  o.ratio = 2;  // k = 2 of 6
  // Composite (by hand): 1:2 = 0.6; 0:0 and 1:0 = 0.567 (a tie, which goes to the earlier head); 0:1 = 0.533.
  const auto heads = hh::select::select_heads(s.shape, c.score, o);
  EXPECT_EQ(heads, (std::vector<Head>{{0, 0}, {1, 2}}));
}

TEST(SelectSignals, MissingSignalsAreSaidAndUnknownOnesRefused) {
  const fs::path dir = hh::test::scratch_dir("select_missing");
  const auto s = hh::select::load_signals(write_analysis_file(dir, false), hh::select::default_retrieval_tasks());
  const auto c = hh::select::composite(s, hh::select::default_weights());
  ASSERT_EQ(c.notes.size(), 1u);
  EXPECT_MENTIONS(c.notes[0], "path is missing");
  EXPECT_EQ(c.used.count("path"), 0u);
  EXPECT_DOUBLE_EQ(c.used.at("retrieval_noising"), 0.5);
  EXPECT_MENTIONS(hh::test::error_of([&] { hh::select::composite(s, {{"attribution", 1.0}}); }),
                  "none of the weighted signals");
  EXPECT_MENTIONS(hh::test::error_of([&] { hh::select::composite(s, {{"bogus", 1.0}}); }), "unknown signal 'bogus'");
}

// ---- manifests -----------------------------------------------------------------------------------

hh::select::Manifest sample_manifest() {
  hh::select::Manifest m;
  m.model = shape(4, 8, 2, 64);
  m.model.fingerprint = "sha256:0123";
  m.ratio_la = 7;
  m.ratio_fa = 1;
  m.strategy = "global";
  m.analysis_sha256 = "ff";
  m.signals = {{"path", 1.0}};
  m.fa_heads = {{3, 1}, {0, 7}, {2, 2}, {1, 0}};
  m.created = "2026-11-30T00:00:00Z";
  m.created_by = "hydrahead test";
  m.notes = {{"budget", {1, 2, 3}}};
  return m;
}

TEST(Manifest, RoundTripsAndSortsHeads) {
  const fs::path dir = hh::test::scratch_dir("manifest_rt");
  hh::select::write_manifest(dir / "m.json", sample_manifest());
  const auto m = hh::select::read_manifest(dir / "m.json");
  EXPECT_EQ(m.fa_heads, (std::vector<Head>{{0, 7}, {1, 0}, {2, 2}, {3, 1}}));
  EXPECT_EQ(m.model.num_layers, 4);
  EXPECT_EQ(m.model.head_dim, 64);
  EXPECT_EQ(m.model.fingerprint, "sha256:0123");
  EXPECT_EQ(m.ratio_la, 7);
  EXPECT_EQ(m.strategy, "global");
  EXPECT_EQ(m.signals, nlohmann::json({{"path", 1.0}}));
  EXPECT_EQ(m.notes, nlohmann::json({{"budget", {1, 2, 3}}}));
  EXPECT_EQ(hh::select::to_json(m), hh::select::to_json(hh::select::parse_manifest(hh::select::to_json(m), "again")));
  // Written with DESIGN's key order and one line per head.
  std::ifstream in(dir / "m.json");
  const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  EXPECT_LT(text.find("\"format\""), text.find("\"model\""));
  EXPECT_NE(text.find("[0, 7]"), std::string::npos) << text;
}

TEST(Manifest, AHandWrittenMinimalManifestIsValid) {
  const auto j = nlohmann::json::parse(R"({"format": "hydrahead-manifest", "format_version": 1,
      "model": {"num_layers": 2, "num_heads": 4, "num_kv_heads": 2, "head_dim": 16}, "fa_heads": [[1, 3], [0, 0]]})");
  const auto m = hh::select::parse_manifest(j, "hand.json");
  EXPECT_EQ(m.fa_heads, (std::vector<Head>{{0, 0}, {1, 3}}));
  EXPECT_TRUE(m.model.fingerprint.empty());
}

TEST(Manifest, EveryRefusalNamesTheProblem) {
  const auto good = hh::select::to_json(sample_manifest());
  auto refuse = [&](auto edit) {
    auto j = good;
    edit(j);
    return hh::test::error_of([&] { hh::select::parse_manifest(j, "m.json"); });
  };
  EXPECT_MENTIONS(refuse([](auto& j) { j["format"] = "other"; }), "m.json: 'format' must be");
  EXPECT_MENTIONS(refuse([](auto& j) { j["format_version"] = 2; }), "format_version 2 is not supported");
  EXPECT_MENTIONS(refuse([](auto& j) { j.erase("fa_heads"); }), "'fa_heads' is missing");
  EXPECT_MENTIONS(refuse([](auto& j) { j["model"].erase("num_kv_heads"); }), "model: 'num_kv_heads' is missing");
  EXPECT_MENTIONS(refuse([](auto& j) { j["model"]["num_kv_heads"] = 3; }), "not a multiple of num_kv_heads 3");
  EXPECT_MENTIONS(refuse([](auto& j) { j["fa_heads"].push_back({4, 0}); }), "[4, 0]: layer 4 is outside [0, 4)");
  EXPECT_MENTIONS(refuse([](auto& j) { j["fa_heads"].push_back({1, 8}); }), "[1, 8]: head 8 is outside [0, 8)");
  EXPECT_MENTIONS(refuse([](auto& j) { j["fa_heads"].push_back({2, 2}); }), "lists [2, 2] twice");
  EXPECT_MENTIONS(refuse([](auto& j) { j["fa_heads"].push_back({1}); }), "fa_heads[4] must be [layer, head]");
  EXPECT_MENTIONS(refuse([](auto& j) { j["ratio"] = {{"la", 0}, {"fa", 1}}; }), "ratio: 'la' must be a positive integer");

  const auto m = sample_manifest();
  auto other = m.model;
  other.num_heads = 16;
  EXPECT_MENTIONS(hh::test::error_of([&] { hh::select::check_fits(m, other, "m.json"); }),
                  "model.num_heads is 8, this model's is 16");
  other = m.model;
  other.fingerprint = "sha256:9999";
  EXPECT_MENTIONS(hh::test::error_of([&] { hh::select::check_fits(m, other, "m.json"); }),
                  "fingerprint sha256:0123 does not match this model's sha256:9999");
  other.fingerprint.clear();  // unknown: not checked
  EXPECT_NO_THROW(hh::select::check_fits(m, other, "m.json"));

  const fs::path dir = hh::test::scratch_dir("manifest_bad");
  std::ofstream(dir / "broken.json") << "{\"format\": ";
  EXPECT_MENTIONS(hh::test::error_of([&] { hh::select::read_manifest(dir / "broken.json"); }), "broken.json: not valid JSON");
}

}  // namespace
