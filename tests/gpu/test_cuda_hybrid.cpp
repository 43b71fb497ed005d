// The hybrid on CUDA: the same logits as on the CPU (fp32), and prefill + decode equal to the full
// forward in bf16 (flash attention over the per-sequence key/value cache).
#include <torch/torch.h>

#include <gtest/gtest.h>

#include "core/attention/hybrid_model.h"

#include "support/tiny_config.h"

namespace {

using hh::attention::HybridModel;

hh::model::ModelConfig config() {
  return hh::test::tiny_config(3, 8, 2, 32, 128, 256, 300);
}

HybridModel hybrid_on(const hh::model::ModelConfig& c, torch::Device d, torch::Dtype t) {
  auto w = hh::model::random_weights(c, 4, torch::kFloat, 0.1);
  for (auto& e : hh::model::weight_table(c, w)) *e.slot = e.slot->to(d, t);
  const hh::model::Transformer teacher(c, w);
  hh::select::Manifest m;
  m.model = hh::select::shape_of(c);
  m.fa_heads = {{0, 1}, {1, 4}, {2, 0}, {2, 7}};
  hh::attention::ConvertOptions o;
  o.seed = 1;
  return hh::attention::convert(teacher, m, o);
}

TEST(CudaHybrid, MatchesCpuAndDecodesLikeTheFullForward) {
  ASSERT_TRUE(torch::cuda::is_available());
  const auto c = config();
  const auto ids = torch::randint(300, {2, 150}, torch::TensorOptions().dtype(torch::kLong));
  const auto cpu = hybrid_on(c, torch::kCPU, torch::kFloat).forward(ids);
  const auto gpu = hybrid_on(c, torch::kCUDA, torch::kFloat).forward(ids.to(torch::kCUDA)).cpu();
  EXPECT_LT(((gpu - cpu).abs().max() / cpu.abs().max()).item<double>(), 1e-4);

  const auto h = hybrid_on(c, torch::kCUDA, torch::kBFloat16);
  const auto ids_g = ids.to(torch::kCUDA);
  const auto full = h.forward(ids_g).cpu();
  HybridModel::Cache cache;
  const auto pre = h.step(ids_g.narrow(1, 0, 100), cache).cpu();
  const double scale = full.abs().max().item<double>();
  EXPECT_LT((pre - full.narrow(1, 0, 100)).abs().max().item<double>(), 0.05 * scale);
  for (int64_t t = 100; t < 150; ++t) {
    const auto got = h.step(ids_g.narrow(1, t, 1), cache).cpu();
    EXPECT_LT((got.select(1, 0) - full.select(1, t)).abs().max().item<double>(), 0.05 * scale) << "t=" << t;
  }
}

TEST(CudaHybrid, ForwardWithoutAGraphEqualsTheForwardWithOne) {
  // Without a graph (and without a cache) the LA heads' short convolution runs as
  // kernels::causal_conv_silu on each q/k/v block; with one, as at::conv1d over all of them.
  ASSERT_TRUE(torch::cuda::is_available());
  const auto h = hybrid_on(config(), torch::kCUDA, torch::kFloat);
  const auto ids = torch::randint(300, {2, 150}, torch::TensorOptions().dtype(torch::kLong)).to(torch::kCUDA);
  const auto with_graph = h.forward(ids).detach().cpu();
  torch::NoGradGuard no_grad;
  const auto without = h.forward(ids).cpu();
  EXPECT_LT(((without - with_graph).abs().max() / with_graph.abs().max()).item<double>(), 1e-4);
}

TEST(CudaHybrid, LayerSideBySideEqualsOneAfterTheOther) {
  // Without a graph on CUDA the LA heads run on a second stream beside the FA heads. Each head's
  // output must be the same bits as with the two one after the other, and, with the output poisoned
  // beforehand by a run of other inputs, every element written (a missing join would leave the LA
  // heads' part unfinished when the current stream reads it). Dh = 128 takes the fused output kernel.
  ASSERT_TRUE(torch::cuda::is_available());
  const auto c = hh::test::tiny_config(1, 8, 2, 128, 256, 512, 300);
  auto w = hh::model::random_weights(c, 5, torch::kFloat, 0.1);
  for (auto& e : hh::model::weight_table(c, w)) *e.slot = e.slot->to(torch::kCUDA, torch::kBFloat16);
  const hh::model::Transformer teacher(c, w);
  hh::select::Manifest m;
  m.model = hh::select::shape_of(c);
  m.fa_heads = {{0, 2}, {0, 5}};
  hh::attention::ConvertOptions co;
  co.seed = 2;
  const HybridModel h = hh::attention::convert(teacher, m, co);
  // Every gate of the FA heads' attention: after its own inputs alone, after the LA heads'
  // chunk_factors (the default) or their scan (with its inputs formed on the second stream and read on
  // this one).
  torch::NoGradGuard no_grad;
  const auto opts = torch::TensorOptions().dtype(torch::kBFloat16).device(torch::kCUDA);
  using hh::attention::FlashGate;
  const FlashGate gate_default = hh::attention::flash_gate();
  for (FlashGate gate : {FlashGate::kInputs, FlashGate::kFactors, FlashGate::kScan})
    for (int64_t T : {150, 8192}) {
      hh::attention::set_flash_gate(gate);
      const auto xn = torch::randn({2, T, c.hidden_size}, opts);
      auto layer = [&](const torch::Tensor& x, bool side_by_side) {
        return hh::attention::hybrid_attention(c, h.options(), h.splits()[0], teacher.weights().layers[0], h.layers()[0],
                                               x, teacher.inv_freq(), true, nullptr, side_by_side);
      };
      const auto one_after = layer(xn, false);
      (void)layer(torch::randn_like(xn) * 10, true);  // leaves other values in the memory the next run takes
      const auto side = layer(xn, true);
      const std::string where = "T=" + std::to_string(T) + ", gate " + std::to_string(static_cast<int>(gate));
      EXPECT_TRUE(torch::equal(side, one_after))
          << where << ": max difference " << (side.to(torch::kFloat) - one_after.to(torch::kFloat)).abs().max().item<float>();
      EXPECT_TRUE(torch::isfinite(side).all().item<bool>()) << where;
    }
  hh::attention::set_flash_gate(gate_default);
}

}  // namespace
