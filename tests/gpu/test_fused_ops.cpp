// The fused CUDA kernels against the LibTorch op sequences of HF Qwen3 they replace, written out here
// independently, on fresh random inputs, for float32, float16 and bfloat16.
#include <torch/torch.h>

#include <gtest/gtest.h>

#include "core/model/transformer.h"
#ifdef HH_HAVE_KERNELS
#include "kernels/fused_ops.h"
#endif

namespace {

#ifdef HH_HAVE_KERNELS
torch::Tensor hf_rms_norm(const torch::Tensor& x, const torch::Tensor& w, double eps) {
  auto h = x.to(torch::kFloat);
  h = h * torch::rsqrt(h.pow(2).mean(-1, true) + eps);
  return w * h.to(x.scalar_type());
}

torch::Tensor hf_rope(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin) {
  // x [B, T, H, Dh], cos/sin [T, Dh]
  const int64_t half = x.size(-1) / 2;
  auto rot = torch::cat({-x.narrow(-1, half, half), x.narrow(-1, 0, half)}, -1);
  const auto c = cos.view({1, cos.size(0), 1, cos.size(1)}), s = sin.view({1, sin.size(0), 1, sin.size(1)});
  return x * c + rot * s;
}

// Elements that differ, and the largest difference in units of the reference's magnitude.
// 16-bit results must also be bit-identical almost everywhere (a different float32 sum order moves
// the rounding of a few elements); float32 ones differ in the last bits routinely.
void expect_near_exact(const torch::Tensor& got, const torch::Tensor& want, double rel, const std::string& what) {
  const auto g = got.to(torch::kDouble).cpu(), w = want.to(torch::kDouble).cpu();
  const double scale = w.abs().max().item<double>();
  const double max_err = (g - w).abs().max().item<double>();
  EXPECT_LE(max_err, rel * scale) << what;
  if (got.scalar_type() != torch::kFloat) {
    const double same = g.eq(w).to(torch::kDouble).mean().item<double>();
    EXPECT_GE(same, 0.98) << what << ": only " << same << " of the elements are bit-identical";
  }
}

class FusedOps : public ::testing::TestWithParam<torch::Dtype> {};

TEST_P(FusedOps, MatchTheOpSequencesTheyReplace) {
  ASSERT_TRUE(torch::cuda::is_available());
  const auto dt = GetParam();
  const auto opts = torch::TensorOptions().dtype(dt).device(torch::kCUDA);
  // One unit in the last place of the dtype, relative.
  const double ulp = dt == torch::kBFloat16 ? 1.0 / 128 : dt == torch::kHalf ? 1.0 / 1024 : 1e-6;
  for (int64_t n : {8, 100, 2048, 5000}) {
    const auto x = torch::randn({3, 37, n}, opts) * 3;
    const auto w = 1 + 0.1 * torch::randn({n}, opts);
    expect_near_exact(hh::kernels::rms_norm(x, w, 1e-6), hf_rms_norm(x, w, 1e-6), 2 * ulp, "rms_norm n=" + std::to_string(n));
  }
  for (int64_t Dh : {8, 64, 128, 256}) {
    const int64_t B = 2, T = 45, H = 5;
    const auto x = torch::randn({B, T, H, Dh}, opts);
    const auto w = 1 + 0.1 * torch::randn({Dh}, opts);
    const auto ang = torch::arange(T, torch::kFloat).unsqueeze(1) * torch::rand({1, Dh / 2});
    const auto emb = torch::cat({ang, ang}, 1);
    const auto cos = emb.cos().to(opts), sin = emb.sin().to(opts);
    expect_near_exact(hh::kernels::norm_rope(x, w, cos, sin, 1e-6), hf_rope(hf_rms_norm(x, w, 1e-6), cos, sin), 4 * ulp,
                      "norm_rope Dh=" + std::to_string(Dh));
  }
  const auto g = torch::randn({7, 333, 129}, opts) * 4, u = torch::randn({7, 333, 129}, opts);
  expect_near_exact(hh::kernels::silu_mul(g, u), torch::silu(g) * u, 2 * ulp, "silu_mul");

  // merge_attention on strided views, against the formula in LibTorch ops.
  const int64_t B = 3, Hkv = 2, G = 4, Tq = 50, Dh = 64, Hq = Hkv * G;
  const auto o_new = torch::randn({B, Tq, Hq, Dh}, opts).transpose(1, 2);          // [B, Hq, Tq, Dh], strided
  const auto lse_new = torch::randn({B, Hq, Tq}, opts.dtype(torch::kFloat)) * 3;
  const auto o_pre = torch::randn({1, B * G * Tq, Hkv, Dh}, opts).transpose(1, 2).reshape({Hkv, B, G, Tq, Dh});
  const auto lse_pre = torch::randn({Hkv, B, G, Tq}, opts.dtype(torch::kFloat)) * 3;
  const auto pre_h = o_pre.permute({1, 0, 2, 3, 4}).reshape({B, Hq, Tq, Dh});
  const auto w = torch::sigmoid(lse_pre.permute({1, 0, 2, 3}).reshape({B, Hq, Tq}) - lse_new).unsqueeze(-1);
  const auto want = (o_new.to(torch::kFloat) + (pre_h.to(torch::kFloat) - o_new.to(torch::kFloat)) * w).to(dt).transpose(1, 2);
  expect_near_exact(hh::kernels::merge_attention(o_new, lse_new, o_pre, lse_pre), want, 2 * ulp, "merge_attention");
}

INSTANTIATE_TEST_SUITE_P(Dtypes, FusedOps, ::testing::Values(torch::kFloat, torch::kHalf, torch::kBFloat16));

TEST(FusedOps, ForwardWithFusedKernelsMatchesTheDefaultPath) {
  hh::model::ModelConfig c;
  c.vocab_size = 300;
  c.hidden_size = 128;
  c.intermediate_size = 256;
  c.num_hidden_layers = 3;
  c.num_attention_heads = 4;
  c.num_key_value_heads = 2;
  c.head_dim = 32;
  auto w = hh::model::random_weights(c, 5, torch::kBFloat16, 0.1);
  for (auto& e : hh::model::weight_table(c, w)) *e.slot = e.slot->to(torch::kCUDA);
  const hh::model::Transformer m(c, w);
  const auto ids = torch::randint(300, {2, 200}, torch::TensorOptions().dtype(torch::kLong)).to(torch::kCUDA);
  torch::NoGradGuard no_grad;
  hh::model::ForwardOptions fused;
  fused.fused_kernels = true;
  const auto a = m.forward(ids, fused).logits, b = m.forward(ids).logits;
  EXPECT_LE((a - b).abs().max().item<double>(), 0.05 * b.abs().max().item<double>());
}
#else
TEST(FusedOps, NotBuilt) { GTEST_SKIP() << "this build has no CUDA kernels (HH_HAVE_KERNELS)"; }
#endif

}  // namespace
