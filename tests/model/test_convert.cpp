// Conversion teacher + manifest -> hybrid: reused tensors equal the teacher's, the new ones have the
// documented shapes and values, gamma is the teacher's per-channel RMS of z, the checkpoint round-trips,
// and `hydrahead convert` refuses a manifest that does not fit before writing anything.
#include <torch/torch.h>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <array>
#include <cstdio>
#include <fstream>

#include "core/attention/hybrid_model.h"
#include "core/io/h5.h"
#include "core/model/hooks.h"
#include "support/test_support.h"
#include "support/tiny_config.h"

namespace {

namespace fs = std::filesystem;
using hh::attention::HybridModel;
using hh::model::ModelConfig;
using hh::model::Transformer;

ModelConfig cfg2() {
  return hh::test::tiny_config(2, 4, 2, 8, 32, 48, 50);
}

hh::select::Manifest manifest_for(const ModelConfig& c, std::vector<hh::select::Head> heads) {
  hh::select::Manifest m;
  m.model = hh::select::shape_of(c);
  m.fa_heads = std::move(heads);
  return m;
}

TEST(Convert, ReusesTheTeacherAndInitialisesTheNewTensorsAsDocumented) {
  const auto c = cfg2();
  const Transformer teacher(c, hh::model::random_weights(c, 4, torch::kDouble, 0.3));
  const auto m = manifest_for(c, {{0, 1}, {1, 0}, {1, 3}});
  hh::attention::ConvertOptions o;
  const HybridModel h = hh::attention::convert(teacher, m, o);
  EXPECT_EQ(h.splits()[0].fa, (std::vector<int64_t>{1}));
  EXPECT_EQ(h.splits()[0].la, (std::vector<int64_t>{0, 2, 3}));
  EXPECT_EQ(h.splits()[1].la, (std::vector<int64_t>{1, 2}));
  const auto& tw = teacher.weights();
  // Teacher tensors are the teacher's own.
  EXPECT_TRUE(h.teacher().weights().layers[1].q_proj.is_same(tw.layers[1].q_proj));
  const auto& w0 = h.layers()[0];
  EXPECT_EQ(w0.fa_gate.sizes(), (std::vector<int64_t>{8, 32}));
  EXPECT_EQ(w0.fa_gate.abs().max().item<double>(), 0.0);
  EXPECT_EQ(w0.la_k_proj.sizes(), (std::vector<int64_t>{24, 32}));
  // LA heads 0, 2, 3 copy the rows of KV groups 0, 1, 1.
  EXPECT_TRUE(torch::equal(w0.la_k_proj.narrow(0, 0, 8), tw.layers[0].k_proj.narrow(0, 0, 8)));
  EXPECT_TRUE(torch::equal(w0.la_k_proj.narrow(0, 8, 8), tw.layers[0].k_proj.narrow(0, 8, 8)));
  EXPECT_TRUE(torch::equal(w0.la_v_proj.narrow(0, 16, 8), tw.layers[0].v_proj.narrow(0, 8, 8)));
  EXPECT_EQ(w0.la_conv.sizes(), (std::vector<int64_t>{72, 1, 4}));
  EXPECT_EQ(w0.la_conv.select(2, 3).min().item<double>(), 1.0);
  EXPECT_EQ(w0.la_conv.narrow(2, 0, 3).abs().max().item<double>(), 0.0);
  const auto A = w0.la_A_log.exp();
  EXPECT_GE(A.min().item<double>(), 1.0);
  EXPECT_LE(A.max().item<double>(), 16.0);
  const auto dt = torch::softplus(w0.la_dt_bias);
  EXPECT_GE(dt.min().item<double>(), 1e-3 * 0.999);
  EXPECT_LE(dt.max().item<double>(), 0.1 * 1.001);
  EXPECT_TRUE(torch::equal(w0.fusion_gamma, torch::ones({4, 8}, torch::kDouble)));
  // A manifest for another shape is refused.
  auto bad = m;
  bad.model.num_heads = 8;
  EXPECT_MENTIONS(hh::test::error_of([&] { hh::attention::convert(teacher, bad, o); }), "model.num_heads is 8");
}

TEST(Convert, GammaIsTheTeachersPerChannelRmsOfEachHead) {
  const auto c = cfg2();
  const Transformer teacher(c, hh::model::random_weights(c, 5, torch::kDouble, 0.3));
  std::vector<hh::interp::CalibExample> calib(2);
  calib[0].clean_ids = {1, 2, 3, 4, 5};
  calib[1].clean_ids = {9, 8, 7};
  hh::attention::ConvertOptions o;
  o.calib = &calib;
  const HybridModel h = hh::attention::convert(teacher, manifest_for(c, {{0, 0}}), o);
  // By hand: sum of z^2 over both prompts' tokens, per layer, head and channel, / 8 tokens, sqrt.
  torch::Tensor sumsq = torch::zeros({2, 4, 8}, torch::kDouble);
  for (const auto& ex : calib) {
    std::map<std::string, torch::Tensor> z;
    hh::model::Hooks hooks;
    hooks.cache("blocks.0.attn.hook_z", &z);
    hooks.cache("blocks.1.attn.hook_z", &z);
    hh::model::ForwardOptions f;
    f.hooks = &hooks;
    teacher.forward(torch::tensor(ex.clean_ids).unsqueeze(0), f);
    sumsq[0] += z.at("blocks.0.attn.hook_z")[0].pow(2).sum(0);
    sumsq[1] += z.at("blocks.1.attn.hook_z")[0].pow(2).sum(0);
  }
  const auto want = (sumsq / 8).sqrt();
  EXPECT_TRUE(torch::allclose(h.layers()[0].fusion_gamma, want[0], 1e-12, 1e-12));
  EXPECT_TRUE(torch::allclose(h.layers()[1].fusion_gamma, want[1], 1e-12, 1e-12));

  // Progress: the tokens run after each prompt, of all the set's tokens or max_calib_tokens.
  std::vector<std::pair<int64_t, int64_t>> heard;
  o.progress = [&heard](int64_t done, int64_t total) { heard.emplace_back(done, total); };
  hh::attention::convert(teacher, manifest_for(c, {{0, 0}}), o);
  EXPECT_EQ(heard, (std::vector<std::pair<int64_t, int64_t>>{{5, 8}, {8, 8}}));
  heard.clear();
  o.max_calib_tokens = 6;
  hh::attention::convert(teacher, manifest_for(c, {{0, 0}}), o);
  EXPECT_EQ(heard, (std::vector<std::pair<int64_t, int64_t>>{{5, 6}, {6, 6}}));
}

// `hydrahead convert` of a bfloat16 teacher on the CPU: the calibration runs in float32 (dtype auto), the
// hybrid is written in bfloat16 like the teacher, its reused tensors bit for bit the teacher's.
TEST(Convert, CliKeepsA16BitTeachersDtypeAndCalibratesInFloat32) {
  const auto c = cfg2();
  const fs::path dir = hh::test::scratch_dir("convert_bf16");
  hh::model::save_model(dir / "teacher", c, hh::model::random_weights(c, 8, torch::kBFloat16, 0.3));
  hh::select::write_manifest(dir / "m.json", manifest_for(c, {{0, 1}, {1, 3}}));
  std::ofstream(dir / "calib.jsonl") << R"({"task": "t", "clean_ids": [1, 2, 3, 4, 5, 6], "corrupt_ids": [1, 2, 3, 4, 5, 7], "answer_ids": [9]})"
                                     << "\n";
  const auto r = hh::test::run_hydrahead("convert --model " + (dir / "teacher").string() + " --manifest " +
                                         (dir / "m.json").string() + " --calib " + (dir / "calib.jsonl").string() +
                                         " --seed 4 --out " + (dir / "hybrid").string());
  ASSERT_EQ(r.status, 0) << r.output;
  const HybridModel h = HybridModel::load(dir / "hybrid");
  EXPECT_EQ(h.teacher().dtype(), torch::kBFloat16);
  const Transformer stored = Transformer::load(dir / "teacher");
  EXPECT_TRUE(torch::equal(h.teacher().weights().layers[1].q_proj, stored.weights().layers[1].q_proj));
  EXPECT_TRUE(torch::equal(h.teacher().weights().embed_tokens, stored.weights().embed_tokens));
  // gamma: the same conversion in float32 here, rounded to bfloat16.
  const auto calib = hh::interp::read_calibration(dir / "calib.jsonl", nullptr, c.vocab_size);
  hh::attention::ConvertOptions o;
  o.calib = &calib;
  o.seed = 4;
  const HybridModel want = hh::attention::convert(Transformer::load(dir / "teacher", "cpu", "f32"),
                                                  hh::select::read_manifest(dir / "m.json"), o);
  for (int l = 0; l < 2; ++l)
    EXPECT_TRUE(torch::equal(h.layers()[static_cast<size_t>(l)].fusion_gamma,
                             want.layers()[static_cast<size_t>(l)].fusion_gamma.to(torch::kBFloat16)))
        << "layer " << l;
}

TEST(Convert, CheckpointRoundTripsAndTheChunkedForwardEqualsTheRecurrentOne) {
  const auto c = cfg2();
  const Transformer teacher(c, hh::model::random_weights(c, 6, torch::kDouble, 0.3));
  hh::attention::ConvertOptions o;
  o.seed = 3;
  const HybridModel h = hh::attention::convert(teacher, manifest_for(c, {{0, 2}, {1, 1}}), o);
  const fs::path dir = hh::test::scratch_dir("convert_rt") / "hybrid";
  h.save(dir);
  EXPECT_TRUE(hh::attention::is_hybrid_checkpoint(dir));
  EXPECT_MENTIONS(hh::test::error_of([&] { h.save(dir); }), "already exists");
  const HybridModel back = HybridModel::load(dir);
  EXPECT_EQ(back.options().fa_heads, h.options().fa_heads);
  std::atomic<bool> cancel{true};  // a raised flag stops the load; a lowered one changes nothing
  EXPECT_THROW(HybridModel::load(dir, "cpu", "", &cancel), hh::Cancelled);
  cancel = false;
  const HybridModel flagged = HybridModel::load(dir, "cpu", "", &cancel);
  const auto ids = torch::randint(50, {2, 70}, torch::TensorOptions().dtype(torch::kLong));
  const auto a = h.forward(ids), b = back.forward(ids), r = h.forward(ids, /*chunked=*/false);
  EXPECT_TRUE(torch::equal(a, b));
  EXPECT_TRUE(torch::equal(flagged.forward(ids), b));
  EXPECT_LT((a - r).abs().max().item<double>(), 1e-10);
  EXPECT_EQ(a.sizes(), (std::vector<int64_t>{2, 70, 50}));
  // A dense reader of the file refuses the hybrid by name rather than misreading it.
  EXPECT_MENTIONS(hh::test::error_of([&] { Transformer::load(dir); }), "HydraHeadForCausalLM");
}

TEST(HybridDecode, PrefillThenTokenByTokenEqualsTheFullForwardAtEveryPosition) {
  const auto c = cfg2();
  const Transformer teacher(c, hh::model::random_weights(c, 8, torch::kDouble, 0.3));
  for (bool conv : {true, false}) {
    for (bool rope : {false, true}) {
      hh::attention::ConvertOptions o;
      o.hybrid.gdn_short_conv = conv;
      o.hybrid.fa_rope = rope;
      o.hybrid.gdn_chunk = 8;  // prefills that cross chunk boundaries
      o.seed = 2;
      HybridModel h = hh::attention::convert(teacher, manifest_for(c, {{0, 3}, {1, 0}, {1, 1}}), o);
      const auto ids = torch::randint(50, {2, 30}, torch::TensorOptions().dtype(torch::kLong));
      const auto full = h.forward(ids);  // [2, 30, V]
      for (int64_t P : {1, 13, 29}) {
        HybridModel::Cache cache, last_cache;
        const auto pre = h.step(ids.narrow(1, 0, P), cache);
        EXPECT_LT((pre - full.narrow(1, 0, P)).abs().max().item<double>(), 1e-9) << "prefill P=" << P;
        // The last position's logits alone, as a decoder reads them, from a cache of the same state.
        const auto last = h.step(ids.narrow(1, 0, P), last_cache, /*chunked=*/true, /*last_only=*/true);
        ASSERT_EQ(last.sizes(), (std::vector<int64_t>{2, 1, full.size(2)}));
        EXPECT_LT((last - full.narrow(1, P - 1, 1)).abs().max().item<double>(), 1e-9) << "last only, P=" << P;
        EXPECT_EQ(last_cache.pos, P);
        for (int64_t t = P; t < 30; ++t) {
          const auto got = h.step(ids.narrow(1, t, 1), cache);
          EXPECT_LT((got[0][0] - full[0][t]).abs().max().item<double>(), 1e-9) << "conv " << conv << " rope " << rope << " t=" << t;
          EXPECT_LT((got[1][0] - full[1][t]).abs().max().item<double>(), 1e-9);
        }
        EXPECT_EQ(cache.pos, 30);
      }
    }
  }
}

TEST(HybridDecode, GreedyGenerationFollowsTheArgmaxOfFullForwards) {
  const auto c = cfg2();
  const Transformer teacher(c, hh::model::random_weights(c, 9, torch::kDouble, 0.5));
  const HybridModel h = hh::attention::convert(teacher, manifest_for(c, {{0, 0}}), {});
  std::vector<int64_t> seq = {3, 14, 15, 9, 26};
  const auto gen = h.generate(seq, 6);
  ASSERT_EQ(gen.size(), 6u);
  for (int64_t next : gen) {  // each token is the argmax of a full forward over everything before it
    const auto logits = h.forward(torch::tensor(seq).unsqueeze(0));
    EXPECT_EQ(logits[0][static_cast<int64_t>(seq.size()) - 1].argmax().item<int64_t>(), next);
    seq.push_back(next);
  }
}

TEST(Convert, CliRefusesAManifestThatDoesNotFitAndWritesNothing) {
  const auto c = cfg2();
  const fs::path dir = hh::test::scratch_dir("convert_cli");
  hh::model::save_model(dir / "teacher", c, hh::model::random_weights(c, 7, torch::kFloat, 0.3));
  auto m = manifest_for(c, {{0, 0}, {1, 2}});
  hh::select::write_manifest(dir / "ok.json", m);
  m.model.num_layers = 3;
  hh::select::write_manifest(dir / "bad.json", m);
  auto run = [&](const std::string& args) {
    const auto r = hh::test::run_hydrahead("convert " + args);
    return std::make_pair(r.status, r.output);
  };
  auto [rc, out] = run("--model " + (dir / "teacher").string() + " --manifest " + (dir / "bad.json").string() + " --out " +
                       (dir / "hybrid").string());
  EXPECT_EQ(rc, 1);
  EXPECT_MENTIONS(out, "model.num_layers is 3, this model's is 2");
  EXPECT_FALSE(fs::exists(dir / "hybrid"));
  std::tie(rc, out) = run("--model " + (dir / "teacher").string() + " --manifest " + (dir / "ok.json").string() +
                          " --out " + (dir / "hybrid").string());
  ASSERT_EQ(rc, 0) << out;
  EXPECT_MENTIONS(out, "2 FA and 6 LA heads");
  const HybridModel h = HybridModel::load(dir / "hybrid");
  EXPECT_EQ(h.options().fa_heads.size(), 2u);
  for (const auto& e : fs::directory_iterator(dir)) EXPECT_EQ(e.path().filename().string().find(".tmp."), std::string::npos);

  // inspect and run work on the hybrid; run --generate stores what greedy decoding produces.
  auto cli = [&](const std::string& args) {
    const auto r = hh::test::run_hydrahead(args);
    return std::make_pair(r.status, r.output);
  };
  std::tie(rc, out) = cli("inspect --model " + (dir / "hybrid").string());
  ASSERT_EQ(rc, 0) << out;
  EXPECT_MENTIONS(out, "HydraHead: 2 full-attention heads, 6 Gated DeltaNet heads");
  EXPECT_MENTIONS(out, "0*");
  std::tie(rc, out) = cli("run --model " + (dir / "hybrid").string() + " --tokens 3,1,4,1,5 --generate 4 --out " +
                          (dir / "gen.h5").string());
  ASSERT_EQ(rc, 0) << out;
  const auto want = h.generate({3, 1, 4, 1, 5}, 4);
  const auto f = hh::io::H5File::open_read(dir / "gen.h5");
  const auto got = f.read("/generated");
  ASSERT_EQ(got.numel(), 4);
  for (int64_t i = 0; i < 4; ++i) EXPECT_EQ(got[i].item<int64_t>(), want[static_cast<size_t>(i)]);
  EXPECT_TRUE(torch::allclose(f.read("/logits").to(torch::kDouble), h.forward(torch::tensor({3, 1, 4, 1, 5}).unsqueeze(0))[0].to(torch::kFloat).to(torch::kDouble), 1e-5, 1e-5));
  std::tie(rc, out) = cli("run --model " + (dir / "hybrid").string() + " --tokens 3,1 --hooks blocks.0.attn.hook_z --out " +
                          (dir / "no.h5").string());
  EXPECT_EQ(rc, 1);
  EXPECT_MENTIONS(out, "not available on HydraHead hybrid checkpoints");

  // bench forward times the teacher and the hybrid alike, and with --decode their greedy decoding after
  // the first sequence (the prompt's time and a new token's).
  for (const char* kind : {"teacher", "hybrid"}) {
    std::tie(rc, out) = cli("bench forward --model " + (dir / kind).string() +
                            " --device cpu --dtype f32 --seq 9 --batch 2 --iters 1 --warmup 0 --decode 3 --json");
    ASSERT_EQ(rc, 0) << out;
    const auto j = nlohmann::json::parse(out.substr(out.rfind("{\"")));
    EXPECT_EQ(j["model"], std::string(kind) == "hybrid" ? "hybrid" : "dense") << out;
    EXPECT_EQ(j["seq"], 9);
    EXPECT_EQ(j["decode"], 3);
    EXPECT_GT(j["median_ms"].get<double>(), 0.0);
    EXPECT_GT(j["prefill_ms"].get<double>(), 0.0);
    EXPECT_GE(j["decode_token_ms"].get<double>(), 0.0);
  }
  std::tie(rc, out) = cli("bench forward --model " + (dir / "hybrid").string() + " --device cpu --seq 4 --decode -1");
  EXPECT_EQ(rc, 1);
  EXPECT_MENTIONS(out, "--decode");
}

}  // namespace
