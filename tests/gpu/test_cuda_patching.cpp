// The analysis engine on CUDA: the batched sweeps (SDPA with a bottom-right causal mask over the
// cached prefix) equal the one-forward-per-head reference, and every map matches the CPU's.
#include <torch/torch.h>

#include <gtest/gtest.h>

#include "core/interp/patching.h"
#include "core/model/hooks.h"
#include "core/model/transformer.h"

#include "support/tiny_config.h"

namespace {

using hh::interp::Metric;
using hh::interp::Mode;
using hh::model::ModelConfig;
using hh::model::Transformer;

ModelConfig small_config() {
  return hh::test::tiny_config(4, 8, 2, 16, 64, 128, 256);
}

Transformer on(const ModelConfig& cfg, hh::model::Weights w, torch::Device d) {
  for (auto& e : hh::model::weight_table(cfg, w))
    if (e.slot->defined()) *e.slot = e.slot->to(d);
  if (cfg.tie_word_embeddings) w.lm_head = w.embed_tokens;
  return Transformer(cfg, std::move(w));
}

hh::interp::CalibExample example(int64_t len, int64_t diff) {
  torch::manual_seed(len * 31 + diff);
  const auto ids = torch::randint(256, {len}, torch::TensorOptions().dtype(torch::kInt64));
  hh::interp::CalibExample ex;
  ex.task = "gpu";
  ex.clean_ids.assign(ids.data_ptr<int64_t>(), ids.data_ptr<int64_t>() + len);
  ex.corrupt_ids = ex.clean_ids;
  for (int64_t i = diff; i < diff + 3; ++i) ex.corrupt_ids[i] = (ex.clean_ids[i] + 9) % 256;
  ex.answer_ids = {ex.clean_ids[diff], ex.clean_ids[diff + 1]};
  ex.wrong_ids = {ex.corrupt_ids[diff]};
  ex.meta = {{"needle", {diff, diff + 3}}};
  return ex;
}

double max_rel(const torch::Tensor& a, const torch::Tensor& b) {
  return ((a.cpu() - b.cpu()).abs().max() / b.cpu().abs().max().clamp_min(1.0)).item<double>();
}

TEST(CudaPatching, FastSweepsEqualReferenceAndCpu) {
  ASSERT_TRUE(torch::cuda::is_available()) << "gpu tests need a CUDA device";
  const auto cfg = small_config();
  const auto w = hh::model::random_weights(cfg, 3, torch::kFloat32, 0.2);
  const Transformer cpu = on(cfg, w, torch::kCPU);
  const Transformer gpu = on(cfg, w, torch::kCUDA);
  for (auto [len, diff] : {std::pair<int64_t, int64_t>{300, 120}, {97, 0}, {700, 690}}) {
    for (Mode mode : {Mode::Noising, Mode::Denoising}) {
      hh::interp::SweepOptions o;
      o.mode = mode;
      o.metric = Metric::LogitDiff;
      o.max_batch = 5;
      const auto raw = example(len, diff);
      const auto ex_g = hh::interp::prepare_example(raw, gpu, o.metric, "gpu");
      const auto ex_c = hh::interp::prepare_example(raw, cpu, o.metric, "cpu");
      const auto cache_g = hh::interp::run_clean_corrupt(gpu, ex_g, o.metric);
      const auto cache_c = hh::interp::run_clean_corrupt(cpu, ex_c, o.metric);
      const auto fast = hh::interp::head_sweep(gpu, ex_g, cache_g, o);
      EXPECT_LT(max_rel(fast, hh::interp::head_sweep_reference(gpu, ex_g, o)), 1e-3) << len << " " << diff;
      EXPECT_LT(max_rel(fast, hh::interp::head_sweep(cpu, ex_c, cache_c, o)), 1e-3) << len << " " << diff;
      EXPECT_LT(max_rel(hh::interp::attribution(gpu, ex_g, cache_g, o), hh::interp::attribution(cpu, ex_c, cache_c, o)), 1e-3);
      EXPECT_LT(max_rel(hh::interp::layer_sweep(gpu, ex_g, cache_g, o), hh::interp::layer_sweep_reference(gpu, ex_g, o)), 1e-3);
      if (mode == Mode::Noising)
        EXPECT_LT(max_rel(hh::interp::path_sweep(gpu, ex_g, cache_g, {}, o), hh::interp::path_sweep_reference(gpu, ex_g, {}, o)), 1e-3);
      // Argmax positions can flip on near-ties between fp32 reduction orders: allow one head in ten.
      const auto differ = hh::interp::retrieval_score(gpu, raw, ex_g).ne(hh::interp::retrieval_score(cpu, raw, ex_c));
      EXPECT_LE(differ.sum().item<int64_t>(), differ.numel() / 10);
    }
  }
}

TEST(CudaPatching, AutomaticBatchSizeRunsABf16SweepThatMatchesTheReference) {
  ASSERT_TRUE(torch::cuda::is_available()) << "gpu tests need a CUDA device";
  const auto cfg = small_config();
  auto w = hh::model::random_weights(cfg, 4, torch::kBFloat16, 0.2);
  const Transformer gpu = on(cfg, w, torch::kCUDA);
  const auto raw = example(1000, 400);
  hh::interp::SweepOptions o;  // max_batch 0: from free memory
  const auto ex = hh::interp::prepare_example(raw, gpu, o.metric, "bf16");
  const auto cache = hh::interp::run_clean_corrupt(gpu, ex, o.metric);
  const auto fast = hh::interp::head_sweep(gpu, ex, cache, o);
  const auto ref = hh::interp::head_sweep_reference(gpu, ex, o);
  // bf16: batched and one-at-a-time forwards round differently; compare at the metric's own scale.
  EXPECT_LT(max_rel(fast, ref), 2e-2) << fast << ref;
}

TEST(CudaPatching, Bf16PrefixAttentionByLogSumExpMergeEqualsTheFullForward) {
  // bf16 on CUDA takes the two-flash-calls path for a cached prefix; its rows must equal the full
  // forward's (which runs one causal SDPA) up to bf16 rounding, for a shared and a per-row prefix.
  ASSERT_TRUE(torch::cuda::is_available()) << "gpu tests need a CUDA device";
  const auto cfg = small_config();
  const Transformer gpu = on(cfg, hh::model::random_weights(cfg, 9, torch::kBFloat16, 0.2), torch::kCUDA);
  torch::manual_seed(1);
  const auto ids = torch::randint(256, {2, 777}, torch::TensorOptions().dtype(torch::kInt64)).to(torch::kCUDA);
  std::map<std::string, torch::Tensor> full;
  hh::model::Hooks hooks;
  for (int64_t l = 0; l < cfg.num_hidden_layers; ++l) {
    hooks.cache(hh::model::hook_name(l, hh::model::HookKind::K), &full);
    hooks.cache(hh::model::hook_name(l, hh::model::HookKind::V), &full);
  }
  hh::model::ForwardOptions f;
  f.hooks = &hooks;
  const auto logits = gpu.forward(ids, f).logits;  // [2, 777, V]
  for (int64_t P : {1, 300, 776}) {
    for (bool shared : {true, false}) {
      std::vector<torch::Tensor> pk, pv;
      for (int64_t l = 0; l < cfg.num_hidden_layers; ++l) {
        auto k = full.at(hh::model::hook_name(l, hh::model::HookKind::K)).narrow(1, 0, P);
        auto v = full.at(hh::model::hook_name(l, hh::model::HookKind::V)).narrow(1, 0, P);
        pk.push_back(shared ? k.narrow(0, 0, 1) : k);
        pv.push_back(shared ? v.narrow(0, 0, 1) : v);
      }
      hh::model::ForwardOptions g;
      g.prefix_k = &pk;
      g.prefix_v = &pv;
      // With a shared prefix both rows continue row 0's tokens.
      const auto suffix = shared ? ids.narrow(0, 0, 1).narrow(1, P, 777 - P).expand({2, -1}) : ids.narrow(1, P, 777 - P);
      const auto got = gpu.forward(suffix, g).logits;
      const auto want = shared ? logits.narrow(0, 0, 1).narrow(1, P, 777 - P).expand({2, -1, -1}) : logits.narrow(1, P, 777 - P);
      EXPECT_LT(max_rel(got, want), 3e-2) << "P=" << P << " shared=" << shared;
    }
  }
}

}  // namespace
