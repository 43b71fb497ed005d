// The hybrid on CUDA: the same logits as on the CPU (fp32), prefill + decode equal to the full forward in
// bf16 (flash attention over the per-sequence key/value cache), the two streams of the layer, and the
// LA heads' decoding step on one kernel.
#include <torch/torch.h>

#include <gtest/gtest.h>

#include "core/attention/hybrid_model.h"
#include "kernels/gdn.h"
#include "kernels/gdn_decode.h"

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

// The layer tests' model: one bfloat16 layer on CUDA, 8 heads of 128 (the fused output kernel's size),
// FA heads 2 and 5.
hh::model::ModelConfig one_layer_config() { return hh::test::tiny_config(1, 8, 2, 128, 256, 512, 300); }
HybridModel one_layer_bf16(const hh::model::ModelConfig& c) {
  auto w = hh::model::random_weights(c, 5, torch::kFloat, 0.1);
  for (auto& e : hh::model::weight_table(c, w)) *e.slot = e.slot->to(torch::kCUDA, torch::kBFloat16);
  hh::select::Manifest m;
  m.model = hh::select::shape_of(c);
  m.fa_heads = {{0, 2}, {0, 5}};
  hh::attention::ConvertOptions co;
  co.seed = 2;
  return hh::attention::convert(hh::model::Transformer(c, w), m, co);
}

// Layer 0 of h (of config c) on x, with or without a cache, its LA heads beside its FA heads or not.
torch::Tensor layer0(const hh::model::ModelConfig& c, const HybridModel& h, const torch::Tensor& x,
                     hh::attention::HybridLayerCache* cache, bool side_by_side) {
  const hh::model::Transformer& teacher = h.teacher();
  return hh::attention::hybrid_attention(c, h.options(), h.splits()[0], teacher.weights().layers[0], h.layers()[0], x,
                                         teacher.inv_freq(), true, cache, side_by_side);
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
  // (Beside flash the LA heads' scan takes pieces of at most kernels::kBesideSegment chunks; at these
  // lengths those are the pieces it takes alone, so the bits agree. Longer sequences may differ in the
  // last bits, as any two segmentations of the scan do.)
  ASSERT_TRUE(torch::cuda::is_available());
  const auto c = one_layer_config();
  const HybridModel h = one_layer_bf16(c);
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
      auto layer = [&](const torch::Tensor& x, bool side_by_side) { return layer0(c, h, x, nullptr, side_by_side); };
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

// Beside the FA heads' attention the LA heads' scan takes pieces of at most kernels::kBesideSegment chunks
// (a ScanBeside), so that they fill the SMs flash frees as it ends; alone, and with the FA heads gated on the
// scan (which then runs alone), the longer pieces that fill the device once. B = 2 sequences of 64K tokens,
// long enough that the device's pieces are longer than kBesideSegment. The two segmentations differ only in
// the pieces' warm-ups, so the outputs agree to the rule's tolerance, not bit for bit.
TEST(CudaHybrid, LayerBesideFlashScansInShortPieces) {
  ASSERT_TRUE(torch::cuda::is_available());
  const auto c = one_layer_config();
  const HybridModel h = one_layer_bf16(c);
  torch::NoGradGuard no_grad;
  const auto xn = torch::randn({2, 65536, c.hidden_size}, torch::TensorOptions().dtype(torch::kBFloat16).device(torch::kCUDA));
  using hh::attention::FlashGate;
  const FlashGate gate_default = hh::attention::flash_gate();
  const auto alone = layer0(c, h, xn, nullptr, false).to(torch::kFloat);
  const int64_t piece_alone = hh::kernels::last_scan_piece_chunks();
  EXPECT_GT(piece_alone, hh::kernels::kBesideSegment) << "the scan alone";
  for (FlashGate gate : {FlashGate::kInputs, FlashGate::kFactors, FlashGate::kScan}) {
    hh::attention::set_flash_gate(gate);
    const auto side = layer0(c, h, xn, nullptr, true).to(torch::kFloat);
    const int64_t piece = hh::kernels::last_scan_piece_chunks();
    const std::string where = "gate " + std::to_string(static_cast<int>(gate));
    if (gate == FlashGate::kScan) {
      EXPECT_EQ(piece, piece_alone) << where << ": flash waits for the scan, which runs alone";
    } else {
      EXPECT_GT(piece, 0) << where;
      EXPECT_LE(piece, hh::kernels::kBesideSegment) << where;
    }
    EXPECT_LT(((side - alone).norm() / alone.norm()).item<double>(), 1e-2) << where;
  }
  hh::attention::set_flash_gate(gate_default);
}

// A prompt into an empty cache runs its LA heads on the second stream too: the same output, the same
// keys, values, state and past inputs in the cache, bit for bit, as one after the other, and the next
// steps from either cache the same.
TEST(CudaHybrid, PromptIntoAnEmptyCacheSideBySideEqualsOneAfterTheOther) {
  ASSERT_TRUE(torch::cuda::is_available());
  const auto c = one_layer_config();
  const HybridModel h = one_layer_bf16(c);
  torch::NoGradGuard no_grad;
  const auto opts = torch::TensorOptions().dtype(torch::kBFloat16).device(torch::kCUDA);
  for (int64_t T : {150, 8192}) {
    const auto xn = torch::randn({2, T + 3, c.hidden_size}, opts);
    auto layer = [&](const torch::Tensor& x, hh::attention::HybridLayerCache& cache, bool side_by_side) {
      return layer0(c, h, x, &cache, side_by_side);
    };
    hh::attention::HybridLayerCache one, side;
    const auto one_after = layer(xn.narrow(1, 0, T), one, false);
    const auto both = layer(xn.narrow(1, 0, T), side, true);
    const std::string where = "T=" + std::to_string(T);
    EXPECT_TRUE(torch::equal(both, one_after)) << where;
    EXPECT_EQ(side.pos, T) << where;
    EXPECT_TRUE(torch::equal(side.fa_k.rows(), one.fa_k.rows())) << where << ": keys";
    EXPECT_TRUE(torch::equal(side.fa_v.rows(), one.fa_v.rows())) << where << ": values";
    EXPECT_TRUE(torch::equal(side.la_state, one.la_state)) << where << ": state";
    EXPECT_TRUE(torch::equal(side.la_conv, one.la_conv)) << where << ": past inputs";
    for (int64_t t = T; t < T + 3; ++t)
      EXPECT_TRUE(torch::equal(layer(xn.narrow(1, t, 1), side, true), layer(xn.narrow(1, t, 1), one, false)))
          << where << ", step " << t;
  }
}

// One layer's attention block over a prompt and then token by token with a cache: the LA heads' step
// on one kernel (kernels::gdn_decode_step) against the same layer in float64 on the CPU (the op
// sequence: at::conv1d with the past, RoPE and the L2 norm, the gates, gdn_recurrent, the fusion) and
// against the op sequence on CUDA in the same dtype (set_decode_kernel(false)). The new tensors are
// drawn at random (the converter's identity convolution, small gates and unit gamma would hide
// mistakes there). Every head size the kernel takes, q from the whole projection and from the LA
// heads' rows, and the options that change its work: no convolution, beta times two, plain
// concatenation.
TEST(CudaHybrid, DecodingStepOnOneKernelMatchesTheOpSequence) {
  ASSERT_TRUE(torch::cuda::is_available());
  struct Case {
    int64_t Dh;
    bool conv, neg, concat;
    std::vector<std::pair<int64_t, int64_t>> fa;
    int64_t P;  // the prompt's tokens (2: fewer than the convolution keeps)
  };
  const std::vector<Case> cases = {{128, true, false, false, {{0, 2}, {0, 5}}, 70},
                                   {64, false, true, false, {{0, 0}}, 70},
                                   {32, true, false, true, {{0, 3}, {0, 4}, {0, 7}}, 70},
                                   {64, true, true, false, {{0, 0}, {0, 1}, {0, 2}, {0, 4}, {0, 5}, {0, 6}}, 70},
                                   {128, true, false, false, {{0, 1}}, 2}};
  const int64_t B = 2, steps = 6;
  for (const Case& k : cases) {
    const int64_t P = k.P;
    const auto c = hh::test::tiny_config(1, 8, 2, k.Dh, 256, 512, 300);
    auto tw = hh::model::random_weights(c, 7, torch::kDouble, 0.1);
    const hh::model::Transformer teacher(c, tw);
    hh::select::Manifest m;
    m.model = hh::select::shape_of(c);
    m.fa_heads = k.fa;
    hh::attention::ConvertOptions co;
    co.seed = 3;
    co.hybrid.gdn_short_conv = k.conv;
    co.hybrid.gdn_allow_neg_eigval = k.neg;
    co.hybrid.fusion_concat = k.concat;
    const HybridModel h = hh::attention::convert(teacher, m, co);
    const auto& split = h.splits()[0];
    torch::manual_seed(11);
    hh::attention::HybridLayerWeights hw = h.layers()[0];
    if (k.conv) hw.la_conv = torch::randn_like(hw.la_conv) * 0.5;
    hw.la_b_proj = torch::randn_like(hw.la_b_proj) * 0.3;
    hw.la_a_proj = torch::randn_like(hw.la_a_proj) * 0.3;
    if (!k.concat) {
      hw.la_gate = torch::randn_like(hw.la_gate) * 0.3;
      hw.fusion_gamma = 1 + 0.3 * torch::randn_like(hw.fusion_gamma);
    }
    const auto xs = torch::randn({B, P + steps, c.hidden_size}, torch::kDouble);
    const std::string name = "Dh " + std::to_string(k.Dh) + ", prompt " + std::to_string(P) + (k.conv ? "" : ", no convolution") +
                             (k.neg ? ", beta times two" : "") + (k.concat ? ", concatenation" : "") + ", " +
                             std::to_string(split.la.size()) + " LA heads";

    // The prompt's and each step's block outputs (float64 on the CPU) and the cache's state and past.
    struct Run {
      std::vector<torch::Tensor> outs;
      torch::Tensor state, past;
    };
    auto run = [&](torch::Device dev, torch::Dtype dt, bool kernel) {
      hh::model::Weights w = tw;
      for (auto& e : hh::model::weight_table(c, w)) *e.slot = e.slot->to(dev, dt);
      hh::attention::HybridLayerWeights lw = hw;
      for (auto& e : hh::attention::hybrid_weight_table(c, h.options(), split, 0, lw)) *e.slot = e.slot->to(dev, dt);
      hh::attention::set_decode_kernel(kernel);
      torch::NoGradGuard no_grad;
      hh::attention::HybridLayerCache cache;
      Run r;
      auto layer = [&](const torch::Tensor& x) {
        return hh::attention::hybrid_attention(c, h.options(), split, w.layers[0], lw, x.to(dev, dt), teacher.inv_freq(), true,
                                               &cache)
            .to(torch::kCPU, torch::kDouble);
      };
      r.outs.push_back(layer(xs.narrow(1, 0, P)));
      for (int64_t t = P; t < P + steps; ++t) r.outs.push_back(layer(xs.narrow(1, t, 1)));
      r.state = cache.la_state.to(torch::kCPU, torch::kDouble);
      if (k.conv) r.past = cache.la_conv.to(torch::kCPU, torch::kDouble);
      hh::attention::set_decode_kernel(true);
      return r;
    };
    const Run ref = run(torch::kCPU, torch::kDouble, false);
    for (torch::Dtype dt : {torch::kFloat, torch::kBFloat16}) {
      const bool f32 = dt == torch::kFloat;
      const std::string where = name + (f32 ? ", float32" : ", bfloat16");
      const int64_t before = hh::attention::decode_kernel_steps();
      const Run kern = run(torch::kCUDA, dt, true);
      EXPECT_EQ(hh::attention::decode_kernel_steps() - before, steps) << where << ": every step on the kernel";
      const Run ops = run(torch::kCUDA, dt, false);
      EXPECT_EQ(hh::attention::decode_kernel_steps() - before, steps) << where << ": none with the kernel off";
      auto rel = [](const torch::Tensor& a, const torch::Tensor& b) {
        return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item<double>();
      };
      for (int64_t s = 1; s <= steps; ++s) {
        const auto& got = kern.outs[static_cast<size_t>(s)];
        ASSERT_TRUE(torch::isfinite(got).all().item<bool>()) << where << ", step " << s;
        EXPECT_LT(rel(got, ref.outs[static_cast<size_t>(s)]), f32 ? 1e-4 : 3e-2) << where << ", step " << s << " against float64";
        EXPECT_LT(rel(got, ops.outs[static_cast<size_t>(s)]), f32 ? 1e-5 : 2e-2) << where << ", step " << s << " against the ops";
      }
      EXPECT_LT(rel(kern.state, ref.state), f32 ? 1e-4 : 3e-2) << where << ": state against float64";
      EXPECT_LT(rel(kern.state, ops.state), f32 ? 1e-5 : 2e-2) << where << ": state against the ops";
      if (k.conv) EXPECT_TRUE(torch::equal(kern.past, ops.past)) << where << ": the convolution's past inputs";
    }
  }
}

// The kernel on a step a hand can follow, and what it refuses, naming the tensor. From a zero state,
// without the convolution, with cos = 1 and sin = 0 (no rotation), b = a = A_log = dt_bias = 0 (beta =
// 1/2) and scale 1: S = k (beta v)^T, so each head's o = (q^ . k^) v / 2 with q^, k^ the L2-normalised
// q and k; heads 1 and 3 of out receive it, heads 0 and 2 stay as they were.
TEST(CudaHybrid, DecodingStepKernelOnAHandCheckedStepAndWhatItRefuses) {
  ASSERT_TRUE(torch::cuda::is_available());
  const auto f = torch::TensorOptions().dtype(torch::kFloat).device(torch::kCUDA);
  const int64_t B = 2, n = 2, Dh = 64, C = n * Dh;
  hh::kernels::DecodeStep s;
  s.q = torch::randn({B, C}, f), s.k = torch::randn({B, C}, f), s.v = torch::randn({B, C}, f);
  s.q_heads = {0, 1};
  s.cos = torch::ones({1, Dh}, f), s.sin = torch::zeros({1, Dh}, f);
  s.b = torch::zeros({B, n}, f), s.a = torch::zeros({B, n}, f), s.A_log = torch::zeros({n}, f), s.dt_bias = torch::zeros({n}, f);
  s.state = torch::zeros({B, n, Dh, Dh}, f);
  s.heads = {1, 3};
  torch::Tensor out = torch::full({B, 1, 4, Dh}, 7.0, f);
  hh::kernels::gdn_decode_step(s, out);
  const auto q = s.q.cpu().to(torch::kDouble).view({B, n, Dh}), k = s.k.cpu().to(torch::kDouble).view({B, n, Dh});
  const auto v = s.v.cpu().to(torch::kDouble).view({B, n, Dh});
  auto unit = [](const torch::Tensor& x) { return x * torch::rsqrt(x.pow(2).sum(-1, true) + 1e-6); };
  const auto want = (unit(q) * unit(k)).sum(-1, true) * v / 2;  // [B, n, Dh]
  const auto got = out.cpu().to(torch::kDouble).select(1, 0);   // [B, 4, Dh]
  EXPECT_LT((got.index_select(1, torch::tensor({1, 3})) - want).abs().max().item<double>(), 1e-5);
  EXPECT_TRUE(torch::equal(got.index_select(1, torch::tensor({0, 2})), torch::full({B, 2, Dh}, 7.0, torch::kDouble)));
  // The state after the step: k^ (v / 2)^T for each head.
  const auto state = s.state.cpu().to(torch::kDouble);
  EXPECT_LT((state - unit(k).unsqueeze(-1) * (v / 2).unsqueeze(-2)).abs().max().item<double>(), 1e-5);

  auto refused = [&](hh::kernels::DecodeStep bad, const std::string& word) {
    EXPECT_FALSE(hh::kernels::try_gdn_decode_step(bad, out)) << word;
    try {
      hh::kernels::gdn_decode_step(bad, out);
      ADD_FAILURE() << "no error for " << word;
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find(word), std::string::npos) << e.what();
    }
  };
  auto bad = s;
  bad.state = torch::zeros({B, n, Dh, Dh}, f.dtype(torch::kBFloat16));
  refused(bad, "state");
  bad = s;
  bad.k = torch::randn({B, C + 1}, f);
  refused(bad, "k has the wrong shape");
  bad = s;
  bad.conv_weight = torch::randn({3 * C, 1, 4}, f);
  refused(bad, "conv_past");
  bad = s;
  bad.heads = {1, 4};
  refused(bad, "head position 4");
  bad = s;
  bad.cos = torch::ones({1, Dh + 2}, f);
  refused(bad, "cos must hold Dh values");
}

}  // namespace
