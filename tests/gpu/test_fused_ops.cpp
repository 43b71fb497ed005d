// The fused CUDA kernels against the LibTorch op sequences of HF Qwen3 they replace, written out here
// independently, on fresh random inputs, for float32, float16 and bfloat16.
#include <torch/torch.h>

#include <cmath>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include <gtest/gtest.h>

#include "core/model/fused_autograd.h"
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
    // A column slice of a wider projection (tokens H + 3 heads apart) is read in place: the same bits
    // as its contiguous copy.
    const auto wide = torch::randn({B, T, (H + 3) * Dh}, opts);
    const auto slice = wide.narrow(2, 2 * Dh, H * Dh).view({B, T, H, Dh});
    ASSERT_FALSE(slice.is_contiguous());
    EXPECT_TRUE(torch::equal(hh::kernels::norm_rope(slice, w, cos, sin, 1e-6),
                             hh::kernels::norm_rope(slice.contiguous(), w, cos, sin, 1e-6)))
        << "norm_rope on a column slice, Dh=" << Dh;
    EXPECT_TRUE(torch::equal(hh::kernels::rms_norm(slice, w, 1e-6), hh::kernels::rms_norm(slice.contiguous(), w, 1e-6)))
        << "rms_norm on a column slice, Dh=" << Dh;
    // A layout that is not one run of groups (tokens transposed) is copied first: the same values.
    const auto transposed = x.transpose(0, 1);
    EXPECT_TRUE(torch::equal(hh::kernels::rms_norm(transposed, w, 1e-6), hh::kernels::rms_norm(transposed.contiguous(), w, 1e-6)))
        << "rms_norm on a transposed view, Dh=" << Dh;
    // The LA heads' q/k: RoPE, then x * rsqrt(sum(x^2) + eps) in float32.
    const auto r = hf_rope(x, cos, sin).to(torch::kFloat);
    const auto l2 = (r * torch::rsqrt(r.pow(2).sum(-1, true) + 1e-6)).to(dt);
    expect_near_exact(hh::kernels::rope_l2norm(x, cos, sin, 1e-6), l2, 2 * ulp, "rope_l2norm Dh=" + std::to_string(Dh));
  }
  // 129 columns: element by element; 256: in 16-byte packs.
  for (int64_t cols : {129, 256}) {
    const auto g = torch::randn({7, 333, cols}, opts) * 4, u = torch::randn({7, 333, cols}, opts);
    expect_near_exact(hh::kernels::silu_mul(g, u), torch::silu(g) * u, 2 * ulp, "silu_mul cols=" + std::to_string(cols));
  }

  // merge_attention on strided views, against the formula in LibTorch ops; Dh = 64 runs in packs,
  // Dh = 20 element by element.
  for (int64_t Dh : {64, 20}) {
    const int64_t B = 3, Hkv = 2, G = 4, Tq = 50, Hq = Hkv * G;
    const auto o_new = torch::randn({B, Tq, Hq, Dh}, opts).transpose(1, 2);          // [B, Hq, Tq, Dh], strided
    const auto lse_new = torch::randn({B, Hq, Tq}, opts.dtype(torch::kFloat)) * 3;
    const auto o_pre = torch::randn({1, B * G * Tq, Hkv, Dh}, opts).transpose(1, 2).reshape({Hkv, B, G, Tq, Dh});
    const auto lse_pre = torch::randn({Hkv, B, G, Tq}, opts.dtype(torch::kFloat)) * 3;
    const auto pre_h = o_pre.permute({1, 0, 2, 3, 4}).reshape({B, Hq, Tq, Dh});
    const auto w = torch::sigmoid(lse_pre.permute({1, 0, 2, 3}).reshape({B, Hq, Tq}) - lse_new).unsqueeze(-1);
    const auto want = (o_new.to(torch::kFloat) + (pre_h.to(torch::kFloat) - o_new.to(torch::kFloat)) * w).to(dt).transpose(1, 2);
    expect_near_exact(hh::kernels::merge_attention(o_new, lse_new, o_pre, lse_pre), want, 2 * ulp,
                      "merge_attention Dh=" + std::to_string(Dh));
  }
}

// Largest difference relative to the reference's magnitude.
double rel_err(const torch::Tensor& got, const torch::Tensor& want) {
  const auto g = got.to(torch::kDouble).cpu(), w = want.to(torch::kDouble).cpu();
  return ((g - w).abs().max() / w.abs().max().clamp_min(1e-30)).item<double>();
}

// The gradient of sum(f(x) * r) with respect to each of xs, by autograd.
std::vector<torch::Tensor> grads_of(const torch::Tensor& y, const torch::Tensor& r, const std::vector<torch::Tensor>& xs) {
  return torch::autograd::grad({(y.to(torch::kDouble) * r).sum()}, xs);
}

TEST_P(FusedOps, BackwardsMatchAutogradThroughTheOpSequencesInFloat64) {
  ASSERT_TRUE(torch::cuda::is_available());
  const auto dt = GetParam();
  const auto opts = torch::TensorOptions().dtype(dt).device(torch::kCUDA);
  // The backwards compute in float32 from the same inputs; the only 16-bit rounding is the result's.
  const double tol = dt == torch::kBFloat16 ? 2.0 / 128 : dt == torch::kHalf ? 2.0 / 1024 : 1e-5;
  auto leaf = [](const torch::Tensor& t) { return t.detach().requires_grad_(true); };
  for (int64_t n : {8, 100, 2048}) {
    const auto x = leaf(torch::randn({3, 37, n}, opts) * 3), w = 1 + 0.1 * torch::randn({n}, opts);
    const auto r = torch::randn({3, 37, n}, opts.dtype(torch::kDouble));
    const auto x64 = leaf(x.detach().to(torch::kDouble));
    const auto got = grads_of(hh::model::fused_rms_norm(x, w, 1e-6), r, {x})[0];
    const auto want = grads_of(hf_rms_norm(x64, w.to(torch::kDouble), 1e-6), r, {x64})[0];
    EXPECT_LE(rel_err(got, want), tol) << "rms_norm n=" << n;
  }
  for (int64_t Dh : {8, 64, 128, 256}) {
    const int64_t B = 2, T = 45, H = 5;
    const auto x = leaf(torch::randn({B, T, H, Dh}, opts)), w = 1 + 0.1 * torch::randn({Dh}, opts);
    const auto ang = torch::arange(T, torch::kFloat).unsqueeze(1) * torch::rand({1, Dh / 2});
    const auto emb = torch::cat({ang, ang}, 1);
    const auto cos = emb.cos().to(opts), sin = emb.sin().to(opts);
    const auto r = torch::randn({B, T, H, Dh}, opts.dtype(torch::kDouble));
    const auto x64 = leaf(x.detach().to(torch::kDouble));
    const auto got = grads_of(hh::model::fused_norm_rope(x, w, cos, sin, 1e-6), r, {x})[0];
    const auto want = grads_of(hf_rope(hf_rms_norm(x64, w.to(torch::kDouble), 1e-6), cos.to(torch::kDouble), sin.to(torch::kDouble)),
                               r, {x64})[0];
    EXPECT_LE(rel_err(got, want), tol) << "norm_rope Dh=" << Dh;
  }
  for (int64_t Dh : {8, 64, 128, 256}) {  // rope_l2norm's backward (the LA heads' q and k)
    const int64_t B = 2, T = 45, H = 3;
    const auto x = torch::randn({B, T, H, Dh}, opts), dy = torch::randn({B, T, H, Dh}, opts);
    const auto ang = torch::arange(T, torch::kFloat).unsqueeze(1) * torch::rand({1, Dh / 2});
    const auto emb = torch::cat({ang, ang}, 1);
    const auto cos = emb.cos().to(opts), sin = emb.sin().to(opts);
    const auto x64 = leaf(x.to(torch::kDouble));
    const auto r64 = hf_rope(x64, cos.to(torch::kDouble), sin.to(torch::kDouble));
    const auto y64 = r64 * torch::rsqrt(r64.pow(2).sum(-1, true) + 1e-6);
    const auto want = torch::autograd::grad({(y64 * dy.to(torch::kDouble)).sum()}, {x64})[0];
    EXPECT_LE(rel_err(hh::kernels::rope_l2norm_backward(dy, x, cos, sin, 1e-6), want), tol) << "rope_l2norm Dh=" << Dh;
  }
  for (int64_t cols : {129, 256}) {  // element by element, and in packs
    const auto g = leaf(torch::randn({7, 33, cols}, opts) * 4), u = leaf(torch::randn({7, 33, cols}, opts));
    const auto r = torch::randn({7, 33, cols}, opts.dtype(torch::kDouble));
    const auto g64 = leaf(g.detach().to(torch::kDouble)), u64 = leaf(u.detach().to(torch::kDouble));
    const auto got = grads_of(hh::model::fused_silu_mul(g, u), r, {g, u});
    const auto want = grads_of(torch::silu(g64) * u64, r, {g64, u64});
    EXPECT_LE(rel_err(got[0], want[0]), tol) << "silu_mul d/dgate cols=" << cols;
    EXPECT_LE(rel_err(got[1], want[1]), tol) << "silu_mul d/dup cols=" << cols;
  }
}

#if HH_TORCH_AT_LEAST(2, 1)
// Attention of new rows over [prefix ++ new], written out in float64: query i sees every prefix key
// and new keys <= i.
torch::Tensor attention_over_prefix(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                                    const torch::Tensor& pk, const torch::Tensor& pv, double scale) {
  const int64_t B = q.size(0), Tq = q.size(1), Hq = q.size(2), Hkv = k.size(2), P = pk.size(1);
  const auto ka = torch::cat({pk.expand({B, -1, -1, -1}), k}, 1).repeat_interleave(Hq / Hkv, 2);  // [B, P+Tq, Hq, Dh]
  const auto va = torch::cat({pv.expand({B, -1, -1, -1}), v}, 1).repeat_interleave(Hq / Hkv, 2);
  auto s = torch::einsum("bihd,bjhd->bhij", {q, ka}) * scale;                                     // [B, Hq, Tq, P+Tq]
  const auto future = torch::arange(P + Tq, q.options().dtype(torch::kLong)).unsqueeze(0) >
                      (torch::arange(Tq, q.options().dtype(torch::kLong)) + P).unsqueeze(1);
  s = s.masked_fill(future, -std::numeric_limits<double>::infinity());
  return torch::einsum("bhij,bjhd->bihd", {torch::softmax(s, -1), va});  // [B, Tq, Hq, Dh]
}

TEST_P(FusedOps, PrefixSplitAttentionAndItsGradientsMatchOneSoftmaxOverAllKeys) {
  ASSERT_TRUE(torch::cuda::is_available());
  const auto dt = GetParam();
  if (dt == torch::kFloat) GTEST_SKIP() << "flash kernels take 16-bit inputs only";
  const auto opts = torch::TensorOptions().dtype(dt).device(torch::kCUDA);
  const double tol = dt == torch::kBFloat16 ? 0.05 : 0.01;
  const int64_t B = 2, Tq = 70, P = 130, Hq = 8, Hkv = 2, Dh = 64;
  const double scale = 1.0 / 8;
  auto leaf = [](const torch::Tensor& t) { return t.detach().requires_grad_(true); };
  for (bool shared : {true, false}) {
    const int64_t Bp = shared ? 1 : B;
    const auto q = leaf(torch::randn({B, Tq, Hq, Dh}, opts)), k = leaf(torch::randn({B, Tq, Hkv, Dh}, opts)),
               v = leaf(torch::randn({B, Tq, Hkv, Dh}, opts)), pk = leaf(torch::randn({Bp, P, Hkv, Dh}, opts)),
               pv = leaf(torch::randn({Bp, P, Hkv, Dh}, opts));
    const auto r = torch::randn({B, Tq, Hq, Dh}, opts.dtype(torch::kDouble));
    std::vector<torch::Tensor> xs{q, k, v, pk, pv}, xs64;
    for (const auto& x : xs) xs64.push_back(leaf(x.detach().to(torch::kDouble)));
    const auto out = hh::model::prefix_split_attention(q, k, v, pk, pv, scale);
    const auto want = attention_over_prefix(xs64[0], xs64[1], xs64[2], xs64[3], xs64[4], scale);
    EXPECT_LE(rel_err(out, want), tol) << "output, shared prefix " << shared;
    const auto got_g = grads_of(out, r, xs), want_g = grads_of(want, r, xs64);
    const char* names[] = {"dq", "dk", "dv", "dpk", "dpv"};
    for (size_t i = 0; i < xs.size(); ++i) EXPECT_LE(rel_err(got_g[i], want_g[i]), tol) << names[i] << ", shared prefix " << shared;
    // Without a graph the same function takes the plain path: the same values.
    torch::NoGradGuard no_grad;
    EXPECT_TRUE(torch::equal(hh::model::prefix_split_attention(q, k, v, pk, pv, scale), out.detach()));
  }
}

// Long causal attention through SDPA on q, k, v that are head slices of wider rows (as the hybrid
// layer's FA heads and the transformer pass them), at an odd and an even length, against one float64
// softmax over all keys; GQA and one KV head per query head.
TEST(FusedOps, LongCausalAttentionOnHeadSlicesMatchesOneSoftmaxInFloat64) {
  ASSERT_TRUE(torch::cuda::is_available());
  const auto opts = torch::TensorOptions().dtype(torch::kBFloat16).device(torch::kCUDA);
  const int64_t Dh = 128;
  const double scale = 1.0 / std::sqrt(static_cast<double>(Dh)), tol = 1e-2;  // bfloat16 operands
  for (const int64_t T : {8191, 8192}) {
    for (const auto& [Hq, Hkv] : std::vector<std::pair<int64_t, int64_t>>{{4, 2}, {2, 2}}) {
      const auto wide = torch::randn({1, T, (Hq + 2 * Hkv + 1) * Dh}, opts);  // one spare head: rows wider than q, k, v
      const auto q = wide.narrow(2, 0, Hq * Dh).view({1, T, Hq, Dh});
      const auto k = wide.narrow(2, Hq * Dh, Hkv * Dh).view({1, T, Hkv, Dh});
      const auto v = wide.narrow(2, (Hq + Hkv) * Dh, Hkv * Dh).view({1, T, Hkv, Dh});
      torch::NoGradGuard no_grad;
      const auto out = hh::model::causal_attention(q, k, v, scale);
      const auto d = [](const torch::Tensor& t) { return t.to(torch::kDouble); };
      const auto none = torch::empty({1, 0, Hkv, Dh}, opts.dtype(torch::kDouble));
      const auto want = attention_over_prefix(d(q), d(k), d(v), none, none, scale);
      EXPECT_LE(rel_err(out, want), tol) << "T=" << T << " Hq=" << Hq << " Hkv=" << Hkv;
    }
  }
}
#endif

INSTANTIATE_TEST_SUITE_P(Dtypes, FusedOps, ::testing::Values(torch::kFloat, torch::kHalf, torch::kBFloat16));

// Where got and want differ bit for bit: how many elements, and the first of them, for a message.
std::string first_difference(const torch::Tensor& got, const torch::Tensor& want) {
  const auto ne = got.ne(want).flatten().cpu();
  const int64_t n = ne.sum().item<int64_t>();
  if (n == 0) return "none";
  const int64_t at = ne.nonzero()[0][0].item<int64_t>();
  return std::to_string(n) + " elements, the first at flat index " + std::to_string(at) + ": " +
         std::to_string(got.flatten()[at].item<double>()) + " against " + std::to_string(want.flatten()[at].item<double>());
}

TEST_P(FusedOps, RopeTablesEqualTheOpSequenceBitForBit) {
  ASSERT_TRUE(torch::cuda::is_available());
  const auto dt = GetParam();
  for (const double theta : {1e6, 1e4}) {
    for (const int64_t Dh : {128, 64}) {
      const auto inv_freq = hh::model::rope_inv_freq(theta, Dh, torch::kCUDA);
      // Long tables (angles past 1e5 radians take cosf's slow argument reduction) and an offset one.
      using Span = std::pair<int64_t, int64_t>;  // (offset, T)
      for (const auto& [offset, T] : std::vector<Span>{{0, 131072}, {12345, 777}}) {
        const auto pos = torch::arange(offset, offset + T, torch::TensorOptions().dtype(torch::kLong).device(torch::kCUDA))
                             .to(torch::kFloat);
        const auto ang = pos.unsqueeze(1) * inv_freq.unsqueeze(0);
        const auto emb = torch::cat({ang, ang}, -1);
        const auto [c, s] = hh::kernels::rope_tables(inv_freq, offset, T, dt);
        const std::string what = "theta " + std::to_string(theta) + " Dh " + std::to_string(Dh) + " offset " +
                                 std::to_string(offset) + " T " + std::to_string(T);
        EXPECT_TRUE(torch::equal(c, emb.cos().to(dt))) << "cos, " << what << ": " << first_difference(c, emb.cos().to(dt));
        EXPECT_TRUE(torch::equal(s, emb.sin().to(dt))) << "sin, " << what << ": " << first_difference(s, emb.sin().to(dt));
      }
      // What the model's layers take: model::rope_cos_sin on CUDA goes through the kernel.
      const auto [c, s] = hh::model::rope_cos_sin(inv_freq, 7, 300, dt);
      const auto [kc, ks] = hh::kernels::rope_tables(inv_freq, 7, 300, dt);
      EXPECT_TRUE(torch::equal(c, kc) && torch::equal(s, ks)) << "rope_cos_sin, Dh " << Dh;
    }
  }
}

TEST_P(FusedOps, TokenScaledRmsNormEqualsTheNormTimesTheScale) {
  ASSERT_TRUE(torch::cuda::is_available());
  const auto dt = GetParam();
  const auto opts = torch::TensorOptions().dtype(dt).device(torch::kCUDA);
  const int64_t B = 2, T = 333, H = 2, Dh = 128;
  // The FA heads' q as the hybrid layer forms it: a column slice of one wider projection.
  const auto wide = torch::randn({B, T, 5 * Dh}, opts) * 2;
  const auto q = wide.narrow(2, Dh, H * Dh).view({B, T, H, Dh});
  const auto w = 1 + 0.1 * torch::randn({Dh}, opts);
  const double a = 512;
  const auto t = torch::arange(100, 100 + T, torch::TensorOptions().dtype(torch::kFloat).device(torch::kCUDA));
  const auto scale = ((t + a).log() / std::log(a)).to(dt);
  const auto want = hh::kernels::rms_norm(q, w, 1e-6) * scale.view({1, T, 1, 1});
  const auto got = hh::kernels::rms_norm_token_scaled(q, w, 1e-6, scale);
  EXPECT_TRUE(torch::equal(got, want)) << first_difference(got, want);
  // And against HF's op sequence, the norm written out here, times the scale.
  const double ulp = dt == torch::kBFloat16 ? 1.0 / 128 : dt == torch::kHalf ? 1.0 / 1024 : 1e-6;
  expect_near_exact(got, hf_rms_norm(q, w, 1e-6) * scale.view({1, T, 1, 1}), 4 * ulp, "rms_norm_token_scaled");
  // Element by element (n = 100 is no multiple of a 16-byte pack): the same.
  const auto x = torch::randn({B, T, 3, 100}, opts);
  const auto w100 = 1 + 0.1 * torch::randn({100}, opts);
  EXPECT_TRUE(torch::equal(hh::kernels::rms_norm_token_scaled(x, w100, 1e-6, scale),
                           hh::kernels::rms_norm(x, w100, 1e-6) * scale.view({1, T, 1, 1})));
  EXPECT_THROW(hh::kernels::rms_norm_token_scaled(q, w, 1e-6, scale.narrow(0, 0, T - 1)), std::invalid_argument);
}

TEST(FusedOps, GdnGatesEqualTheOpSequenceBitForBit) {
  ASSERT_TRUE(torch::cuda::is_available());
  for (const auto dt : {torch::kBFloat16, torch::kHalf}) {
    const auto opts = torch::TensorOptions().dtype(dt).device(torch::kCUDA);
    const int64_t B = 3, T = 1001, H = 14, N = 64 + 2 * H + 4;
    // b and a as the hybrid layer reads them: column slices of one product; some of a + dt_bias past
    // softplus's threshold of 20.
    const auto prod = torch::randn({B, T, N}, opts) * 6;
    prod.narrow(2, 64 + H, 1).add_(25);
    const auto b = prod.narrow(2, 64, H), a = prod.narrow(2, 64 + H, H);
    const auto A_log = (torch::rand({H}, opts.dtype(torch::kFloat)) * 15 + 1).log().to(dt);
    const auto dt_bias = torch::randn({H}, opts);
    ASSERT_TRUE(hh::kernels::gdn_gates_supported(b, a, A_log, dt_bias));
    for (const bool two : {false, true}) {
      auto beta = torch::sigmoid(b);
      if (two) beta = beta * 2;
      const auto g = -A_log.exp() * torch::softplus(a + dt_bias);
      const auto [kg, kbeta] = hh::kernels::gdn_gates(b, a, A_log, dt_bias, two);
      EXPECT_TRUE(torch::equal(kbeta, beta.to(torch::kFloat))) << "beta, " << dt << ": " << first_difference(kbeta, beta.to(torch::kFloat));
      EXPECT_TRUE(torch::equal(kg, g.to(torch::kFloat))) << "g, " << dt << ": " << first_difference(kg, g.to(torch::kFloat));
    }
    EXPECT_FALSE(hh::kernels::gdn_gates_supported(b, a, A_log.to(torch::kFloat), dt_bias));  // mixed dtypes: the ops
  }
}

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
