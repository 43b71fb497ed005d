// The CUDA forward equals the CPU forward (fp32), and bf16 on CUDA stays close to it.
#include <torch/torch.h>

#include <gtest/gtest.h>

#include "core/model/hooks.h"
#include "core/model/kv_cache.h"
#include "core/model/transformer.h"

namespace {

using hh::model::ModelConfig;
using hh::model::Transformer;

ModelConfig small_config() {
  ModelConfig c;
  c.vocab_size = 512;
  c.hidden_size = 128;
  c.intermediate_size = 256;
  c.num_hidden_layers = 3;
  c.num_attention_heads = 8;
  c.num_key_value_heads = 2;
  c.head_dim = 32;  // != hidden / heads
  c.rope_theta = 10000.0;
  return c;
}

hh::model::Weights to_device(hh::model::Weights w, const ModelConfig& cfg, torch::Device d, torch::Dtype t) {
  for (auto& e : hh::model::weight_table(cfg, w))
    if (e.slot->defined()) *e.slot = e.slot->to(d, t);
  if (cfg.tie_word_embeddings) w.lm_head = w.embed_tokens;
  return w;
}

// Tolerance of fp32 CUDA vs CPU: different reduction orders, no TF32 (LibTorch's default for matmul).
constexpr double kFp32RelTol = 1e-4;
// bf16 keeps 8 bits of mantissa; over 3 layers the logits drift by a few percent of their scale.
constexpr double kBf16RelTol = 5e-2;

double rel_to_max(const torch::Tensor& a, const torch::Tensor& ref) {
  return ((a.to(torch::kCPU, torch::kDouble) - ref.to(torch::kDouble)).abs().max() /
          ref.to(torch::kDouble).abs().max()).item<double>();
}

TEST(CudaForward, MatchesCpuFp32AndBf16) {
  ASSERT_TRUE(torch::cuda::is_available()) << "gpu tests need a CUDA device";
  const auto cfg = small_config();
  const auto w = hh::model::random_weights(cfg, /*seed=*/7, torch::kFloat32, /*std=*/0.08);
  const Transformer cpu(cfg, w);
  const Transformer gpu(cfg, to_device(w, cfg, torch::kCUDA, torch::kFloat32));
  const Transformer gpu_bf16(cfg, to_device(w, cfg, torch::kCUDA, torch::kBFloat16));
  torch::manual_seed(0);
  const auto ids = torch::randint(cfg.vocab_size, {2, 300}, torch::kInt64);  // [B, T]
  torch::NoGradGuard ng;
  const auto ref = cpu.forward(ids).logits;
  const auto got = gpu.forward(ids.cuda()).logits;
  const auto got16 = gpu_bf16.forward(ids.cuda()).logits;
  EXPECT_LT(rel_to_max(got, ref), kFp32RelTol);
  EXPECT_LT(rel_to_max(got16, ref), kBf16RelTol);
}

TEST(CudaForward, HookZPatchAndStartLayerOnCuda) {
  const auto cfg = small_config();
  const auto w = hh::model::random_weights(cfg, /*seed=*/3, torch::kFloat32, /*std=*/0.08);
  const Transformer gpu(cfg, to_device(w, cfg, torch::kCUDA, torch::kFloat32));
  const auto ids = torch::randint(cfg.vocab_size, {1, 64}, torch::kInt64).cuda();
  torch::NoGradGuard ng;
  std::map<std::string, torch::Tensor> cache;
  hh::model::Hooks hooks;
  hooks.cache("blocks.1.hook_resid_pre", &cache);
  const auto full = gpu.forward(ids, {&hooks}).logits;
  hh::model::ForwardOptions from1;
  from1.start_layer = 1;
  const auto resumed = gpu.forward(cache.at("blocks.1.hook_resid_pre"), from1).logits;
  EXPECT_LT(rel_to_max(resumed, full.cpu()), 1e-6);
}

// Decoding on CUDA over the growing key/value cache (a prompt, a block of tokens, then single tokens,
// which take SDPA with a KV head's query heads as rows of that head): each piece's logits against the
// whole sequence's forward, on the device, in float32 (different kernels, the same sums) and bfloat16
// (the same tolerance as against the CPU). B = 2, GQA 8:2, positions past 256 keys.
TEST(CudaForward, DecodesOverACacheLikeTheFullForward) {
  ASSERT_TRUE(torch::cuda::is_available()) << "gpu tests need a CUDA device";
  const auto cfg = small_config();
  const auto w = hh::model::random_weights(cfg, /*seed=*/11, torch::kFloat32, /*std=*/0.08);
  torch::manual_seed(1);
  const auto ids = torch::randint(cfg.vocab_size, {2, 300}, torch::kInt64).cuda();
  torch::NoGradGuard ng;
  for (torch::Dtype dt : {torch::kFloat32, torch::kBFloat16}) {
    const Transformer gpu(cfg, to_device(w, cfg, torch::kCUDA, dt));
    const auto full = gpu.forward(ids).logits.to(torch::kCPU, torch::kDouble);
    hh::model::KvCache cache(cfg.num_hidden_layers);
    int64_t at = 0;
    for (int64_t t : {200, 37, 1, 1, 1, 60}) {
      hh::model::ForwardOptions f;
      f.cache = &cache;
      const auto got = gpu.forward(ids.narrow(1, at, t), f).logits;
      const double err = rel_to_max(got, full.narrow(1, at, t));
      EXPECT_LT(err, dt == torch::kFloat32 ? kFp32RelTol : kBf16RelTol)
          << c10::toString(dt) << ": tokens " << at << ".." << at + t - 1;
      at += t;
      EXPECT_EQ(cache.tokens(), at);
    }
  }
}

}  // namespace
