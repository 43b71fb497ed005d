// The CUDA path of the gated delta rule and the fused fusion norm against their references, on fresh
// random inputs every run: the state-scan kernel against the LibTorch loop in float64, the chunked
// rule on CUDA against the per-token recurrence in float64 (values, final states, packed sequences,
// gradients), and the fusion kernel against the LibTorch op sequence (values and gradients).
#include <torch/torch.h>

#include <gtest/gtest.h>

#include <ATen/cuda/CUDAContext.h>
#include <ATen/record_function.h>
#include <c10/cuda/CUDACachingAllocator.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <functional>
#include <limits>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "core/attention/fusion.h"
#include "core/attention/gdn.h"
#include "core/model/transformer.h"
#ifdef HH_HAVE_KERNELS
#include "kernels/fused_ops.h"
#include "kernels/gdn.h"
#endif

namespace {

using hh::attention::gdn_chunked;
using hh::attention::gdn_chunked_scan;
using hh::attention::gdn_recurrent;

const auto kCuda = torch::TensorOptions().device(torch::kCUDA);
const auto kF64 = torch::TensorOptions().dtype(torch::kDouble);

// After every test of this binary, however it ended (an ASSERT's early return or an exception midway
// too), the scans' process-wide settings that tests change go back to their defaults, so that no test runs
// on the path another left set. The tests still restore them where they switch paths within themselves.
class ScanDefaultsAfterEachTest : public ::testing::EmptyTestEventListener {
  void OnTestEnd(const ::testing::TestInfo&) override {
    hh::kernels::set_scan_pieces_of_parity(-1);
    hh::kernels::set_scan_columns(0);
    hh::kernels::set_scan_segments(hh::kernels::kAutoSegments);
    hh::kernels::set_qk_in_scan(true);
  }
};
[[maybe_unused]] const bool kScanDefaultsAfterEachTest = [] {
  ::testing::UnitTest::GetInstance()->listeners().Append(new ScanDefaultsAfterEachTest);  // gtest owns it
  return true;
}();

double rel_err(const torch::Tensor& got, const torch::Tensor& want) {
  const auto g = got.to(torch::kCPU, torch::kDouble), w = want.to(torch::kCPU, torch::kDouble);
  EXPECT_FALSE(g.isnan().any().item<bool>()) << "NaN in the result";
  return ((g - w).norm() / w.norm()).item<double>();
}

// Block float16 as the scans write their states (kernels::LowRankScanArgs::S16): x [.., R, D] with R
// and D multiples of the block's r x c (16 x 16; the new values M16: 16 x 8), each block scaled by the
// power of two that puts its largest magnitude in [2^14, 2^15); returns the float16 blocks and the
// inverse scales [.., R / r, D / c] on the GPU.
std::pair<torch::Tensor, torch::Tensor> to_block_f16(const torch::Tensor& x, int64_t r = 16, int64_t c = 16) {
  const auto d = x.to(torch::kCPU, torch::kDouble);
  const int64_t R = d.size(-2), D = d.size(-1);
  std::vector<int64_t> split(d.sizes().begin(), d.sizes().end() - 2);
  split.insert(split.end(), {R / r, r, D / c, c});
  const auto top = d.reshape(split).abs().amax({-3, -1}).clamp_min(1e-30);  // [.., R / r, D / c]
  const auto inv = torch::exp2(torch::floor(torch::log2(top)) - 14);
  const auto full = inv.repeat_interleave(r, -2).repeat_interleave(c, -1);
  return {(d / full).to(kCuda.dtype(torch::kHalf)), inv.to(kCuda.dtype(torch::kFloat))};
}
// Block float16 values x16 with the inverse scales inv [.., R / r, D / c] of their r x c blocks (the
// scans' S16 and S_inv: 16 x 16; their M16 and M_inv: 16 x 8), in float64 on the CPU.
torch::Tensor from_block_f16(const torch::Tensor& x16, const torch::Tensor& inv, int64_t r = 16, int64_t c = 16) {
  return x16.to(torch::kCPU, torch::kDouble) *
         inv.to(torch::kCPU, torch::kDouble).repeat_interleave(r, -2).repeat_interleave(c, -1);
}
// chunk_factors' packed Aq or T16 [H, N, kPackedLower] as the [H, N, 64, 64] matrix it holds, read from its
// documented layout: block row b (16 rows) as 16 rows of its first 16 (b + 1) columns, the block rows in
// turn; zeros above the diagonal blocks. The block rows must fill the packed form exactly.
torch::Tensor unpack_lower(const torch::Tensor& packed) {
  const int64_t H = packed.size(0), N = packed.size(1);
  auto full = torch::zeros({H, N, 64, 64}, packed.options());
  int64_t at = 0;
  for (int64_t b = 0; b < 4; ++b) {
    const int64_t width = 16 * (b + 1);
    full.narrow(2, 16 * b, 16).narrow(3, 0, width).copy_(packed.narrow(2, at, 16 * width).reshape({H, N, 16, width}));
    at += 16 * width;
  }
  EXPECT_EQ(at, packed.size(2)) << "the packed form's last dimension";
  return full;
}

struct Inputs {
  torch::Tensor q, k, v, g, beta, s0;  // float64 on the CPU
};

Inputs make_inputs(int64_t B, int64_t T, int64_t H, int64_t D, int64_t S) {
  namespace F = torch::nn::functional;
  Inputs in;
  in.q = F::normalize(torch::randn({B, T, H, D}, kF64), F::NormalizeFuncOptions().dim(-1));
  in.k = F::normalize(torch::randn({B, T, H, D}, kF64), F::NormalizeFuncOptions().dim(-1));
  in.v = torch::randn({B, T, H, D}, kF64);
  in.g = -torch::rand({B, T, H}, kF64) * 0.5;
  in.beta = torch::rand({B, T, H}, kF64);
  in.s0 = torch::randn({S, H, D, D}, kF64) * 0.5;
  return in;
}

// The inputs as the device sees them: rounded to dtype (q, k, v) and float32 (g, beta, state).
Inputs on_device(const Inputs& in, torch::Dtype dt) {
  return {in.q.to(kCuda.dtype(dt)), in.k.to(kCuda.dtype(dt)), in.v.to(kCuda.dtype(dt)), in.g.to(kCuda.dtype(torch::kFloat)),
          in.beta.to(kCuda.dtype(torch::kFloat)), in.s0.to(kCuda.dtype(torch::kFloat))};
}
Inputs back_in_f64(const Inputs& d) {
  auto c = [](const torch::Tensor& t) { return t.to(torch::kCPU, torch::kDouble); };
  return {c(d.q), c(d.k), c(d.v), c(d.g), c(d.beta), c(d.s0)};
}

#ifdef HH_HAVE_KERNELS
TEST(CudaGdn, StateScanKernelEqualsTheLoopInFloat64) {
  ASSERT_TRUE(torch::cuda::is_available());
  for (int64_t Dk : {32, 64, 128})
    for (int64_t Dv : {16, 128}) {
      const int64_t H = 3;
      const std::vector<int64_t> offsets = {0, 7, 7, 40, 41};  // includes an empty sequence
      const int64_t N = offsets.back(), S = 4;
      // Contractive-ish transitions, like the rule's: 0.9 I + small noise.
      const auto P = 0.9 * torch::eye(Dk, kF64) + 0.3 / std::sqrt(static_cast<double>(Dk)) * torch::randn({H, N, Dk, Dk}, kF64);
      const auto Z = torch::randn({H, N, Dk, Dv}, kF64), y0 = torch::randn({S, H, Dk, Dv}, kF64);
      for (auto kernel : {hh::kernels::ScanKernel::kTensorCores, hh::kernels::ScanKernel::kFma})
      for (bool reverse : {false, true}) {
        hh::kernels::set_state_scan_kernel(kernel);
        const auto want = hh::attention::gdn_state_scan(P, Z, y0, offsets, reverse);
        auto hist = torch::full({H, N, Dk, Dv}, std::numeric_limits<float>::quiet_NaN(), kCuda.dtype(torch::kFloat));
        const auto fin = hh::kernels::state_scan(P.to(kCuda.dtype(torch::kFloat)), Z.to(kCuda.dtype(torch::kFloat)),
                                                 y0.to(kCuda.dtype(torch::kFloat)), offsets, reverse, hist);
        hh::kernels::set_state_scan_kernel(hh::kernels::ScanKernel::kLowRank);
        const std::string what = "Dk=" + std::to_string(Dk) + " Dv=" + std::to_string(Dv) + (reverse ? " reverse" : "") +
                                 (kernel == hh::kernels::ScanKernel::kFma ? " fma" : " tensor cores");
        EXPECT_LT(rel_err(hist, want.hist), 1e-5) << what;  // rel_err also fails on NaN: every element written
        EXPECT_LT(rel_err(fin, want.final_state), 1e-5) << what;
        // Through the dispatcher as well (hydrahead::gdn_state_scan on CUDA tensors).
        const auto op = hh::attention::gdn_state_scan(P.to(kCuda.dtype(torch::kFloat)), Z.to(kCuda.dtype(torch::kFloat)),
                                                      y0.to(kCuda.dtype(torch::kFloat)), offsets, reverse);
        if (kernel == hh::kernels::ScanKernel::kTensorCores) {
          EXPECT_TRUE(torch::equal(op.hist, hist)) << what;
        }
      }
    }
}

TEST(CudaGdn, LowRankScanEqualsTheLoopOnTheFormedTransitionInFloat64) {
  ASSERT_TRUE(torch::cuda::is_available());
  const auto f32 = kCuda.dtype(torch::kFloat);
  for (int64_t Dk : {32, 64, 128})
    for (int64_t Dv : {16, 128}) {
      const int64_t H = 3, C = 64;
      const std::vector<int64_t> offsets = {0, 7, 7, 40, 41};  // includes an empty sequence
      const int64_t N = offsets.back(), S = 4;
      // W-like and kdecay-like factors: A^T B small against the decay, as in the rule.
      const double f = 0.25 / std::sqrt(static_cast<double>(C * Dk));
      // A and B as the left halves of wider rows, U as the right half of B's (W and U share a tensor).
      const auto AX = torch::randn({H, N, C, Dk + 8}, kF64) * std::sqrt(f);
      const auto BU = torch::randn({H, N, C, Dk + Dv}, kF64);
      BU.narrow(-1, 0, Dk).mul_(std::sqrt(f));
      const auto A = AX.narrow(-1, 0, Dk), B = BU.narrow(-1, 0, Dk), U = BU.narrow(-1, Dk, Dv);
      const auto decay = 0.5 + 0.5 * torch::rand({H, N}, kF64);
      const auto Z = torch::randn({H, N, Dk, Dv}, kF64), y0 = torch::randn({S, H, Dk, Dv}, kF64);
      // The same recurrence on the formed transition: P^T = decay I - A^T B, input A^T U + Z.
      const auto P = (decay.unsqueeze(-1).unsqueeze(-1) * torch::eye(Dk, kF64) - torch::matmul(A.transpose(-1, -2), B))
                         .transpose(-1, -2);
      // 3xTF32; one TF32 product (16-bit inputs); one TF32 product on float16 factors; block float16
      // products on float16 factors (the chunk kernels'), at three magnitudes of the state: the
      // recurrence is linear, so scaling y0, U and Z scales every output, and the per-block scales
      // must keep the relative error (float16 alone would overflow at 1e6 and lose 1e-6 to underflow).
      for (auto [mode, mag] : {std::pair<int, double>{0, 1.0}, {1, 1.0}, {2, 1.0}, {3, 1.0}, {3, 1e6}, {3, 1e-6}})
      for (bool with_u : {true, false})
        for (bool reverse : {false, true}) {
          const bool precise = mode == 0, half_factors = mode >= 2;
          const auto Zeff = with_u ? torch::matmul(A.transpose(-1, -2), U) * mag : Z * mag;
          const auto want = hh::attention::gdn_state_scan(P, Zeff, y0 * mag, offsets, reverse);
          const auto want_m = (with_u ? U * mag : torch::zeros_like(U)) - torch::matmul(B, want.hist);
          const auto AXg = AX.to(f32), BUg = BU.to(f32);
          BUg.narrow(-1, Dk, Dv).mul_(mag);  // U
          hh::kernels::LowRankScanArgs a;
          a.A = AXg.narrow(-1, 0, Dk);
          a.B = BUg.narrow(-1, 0, Dk);
          if (half_factors) a.A = a.A.to(torch::kHalf).contiguous(), a.B = a.B.to(torch::kHalf).contiguous();
          a.decay = decay.to(f32);
          if (with_u) a.U = BUg.narrow(-1, Dk, Dv);
          else a.Z = (Z * mag).to(f32);
          a.y0 = (y0 * mag).to(f32);
          a.hist = torch::full({H, N, Dk, Dv}, std::numeric_limits<float>::quiet_NaN(), f32);
          a.M = torch::full({H, N, C, Dv}, std::numeric_limits<float>::quiet_NaN(), f32);
          a.reverse = reverse;
          using hh::kernels::ScanPrecision;
          a.precision = precise ? ScanPrecision::kFloat32 : mode == 3 ? ScanPrecision::kBlockFloat16 : ScanPrecision::kTf32;
          if (mode == 3) {  // the states also in block float16, in either direction
            a.S16 = torch::full({H, N, Dk, Dv}, std::numeric_limits<float>::quiet_NaN(), kCuda.dtype(torch::kHalf));
            a.S_inv = torch::full({H, N, Dk / 16, Dv / 16}, std::numeric_limits<float>::quiet_NaN(), f32);
          }
          const auto fin = hh::kernels::low_rank_scan(a, offsets);
          const std::string what = "Dk=" + std::to_string(Dk) + " Dv=" + std::to_string(Dv) + (with_u ? " U" : " Z") +
                                   (reverse ? " reverse" : "") +
                                   (precise ? " 3xTF32" : mode == 3 ? " block f16" : " TF32") +
                                   (half_factors ? " f16 factors" : "") + " magnitude " + std::to_string(mag);
          // TF32 keeps 10 mantissa bits: about 1e-3 per product, a few times that over the chunks.
          const double tol = precise ? 1e-5 : 1e-2;
          EXPECT_LT(rel_err(a.hist, want.hist), tol) << what;  // rel_err also fails on NaN: every element written
          EXPECT_LT(rel_err(fin, want.final_state), tol) << what;
          EXPECT_LT(rel_err(a.M, want_m), tol) << what;
          if (mode == 3) {
            EXPECT_LT(rel_err(from_block_f16(a.S16, a.S_inv), want.hist), tol) << what << " (S16)";
          }
        }
    }
}

// The segmented scan (LowRankScanArgs::segment) against the same recurrence in float64 run the way
// its contract says: each segment from zero at the latest chunk w whose decays since multiply to at
// most 2^-20 (else from y0 at its sequence's start). The transitions here are deliberately not bounded
// by their decays (A^T B of norm about 0.5), so a warm-up of any other length, or a start from the
// true state, would show as an O(1) difference; with every decay 1 no warm-up ever stops early and the
// segmented scan must equal the whole one bit for bit. Decays are powers of two whose logs cannot sum
// to exactly -20, so float32's sums decide as float64's do.
TEST(CudaGdn, SegmentedScanStartsEachSegmentWhereItsNormBoundsAllow) {
  ASSERT_TRUE(torch::cuda::is_available());
  const auto f32 = kCuda.dtype(torch::kFloat), f16 = kCuda.dtype(torch::kHalf);
  const int64_t H = 3, C = 64, Dk = 128, Dv = 128;
  const std::vector<int64_t> offsets = {0, 1, 1, 23, 60, 64};  // one chunk, empty, 22, 37 and 4 chunks
  const int64_t N = offsets.back(), S = static_cast<int64_t>(offsets.size()) - 1, len = 3;
  const double f = 0.25 / std::sqrt(static_cast<double>(C * Dk));
  const auto A = torch::randn({H, N, C, Dk}, kF64) * std::sqrt(f), B = torch::randn({H, N, C, Dk}, kF64) * std::sqrt(f);
  const auto U = torch::randn({H, N, C, Dv}, kF64), Z = torch::randn({H, N, Dk, Dv}, kF64);
  const auto y0 = torch::randn({S, H, Dk, Dv}, kF64);
  // A and B as float16 (the kernel's operands) and back, so that the reference multiplies the same values.
  const auto A16 = A.to(torch::kHalf).to(torch::kDouble), B16 = B.to(torch::kHalf).to(torch::kDouble);
  // The warm-ups follow the decays (no bound given), or a bound given apart from them.
  for (const char* mode : {"decays", "every decay 1", "bound"})
    for (bool reverse : {false, true}) {
      const std::string what = std::string(reverse ? "reverse" : "forward") + ", " + mode;
      const bool all_ones = mode == std::string("every decay 1"), with_bound = mode == std::string("bound");
      // log2 of each decay from {0, -7.5, -10.5, -25}; of each bound from {1.5, -9.75, -14.25, -21.75},
      // multiples of 0.75, whose sums are never within 0.25 of -20: float32 decides as float64 does.
      const double choices[] = {0.0, -7.5, -10.5, -25.0}, bound_choices[] = {1.5, -9.75, -14.25, -21.75};
      const auto pick = torch::randint(0, 4, {H, N}, torch::kLong), bound_pick = torch::randint(0, 4, {H, N}, torch::kLong);
      auto log2d = torch::zeros({H, N}, kF64), log2b = torch::zeros({H, N}, kF64);
      if (!all_ones)
        for (int64_t h = 0; h < H; ++h)
          for (int64_t n = 0; n < N; ++n) {
            log2d[h][n] = choices[pick[h][n].item<int64_t>()];
            log2b[h][n] = with_bound ? bound_choices[bound_pick[h][n].item<int64_t>()] : log2d[h][n].item<double>();
          }
      const auto decay = torch::exp2(log2d);
      // The reference: per head and segment, w by the contract's rule, then the recurrence from w.
      auto hist = torch::zeros({H, N, Dk, Dv}, kF64), Mref = torch::zeros({H, N, C, Dv}, kF64);
      auto fin = torch::zeros({S, H, Dk, Dv}, kF64), whole_hist = torch::zeros({H, N, Dk, Dv}, kF64);
      auto step = [&](int64_t h, int64_t n, const torch::Tensor& y, torch::Tensor* m_out) {
        const auto m = (reverse ? torch::zeros({C, Dv}, kF64) : U[h][n]) - torch::matmul(B16[h][n], y);
        if (m_out) *m_out = m;
        return decay[h][n].item<double>() * y + torch::matmul(A16[h][n].transpose(0, 1), m) + (reverse ? Z[h][n] : torch::zeros_like(y));
      };
      for (int64_t h = 0; h < H; ++h)
        for (int64_t s = 0; s < S; ++s) {
          const int64_t n0 = offsets[s], n1 = offsets[s + 1];
          {  // the whole sequence, for the difference the segments must show
            auto y = y0[s][h].clone();
            for (int64_t i = 0; i < n1 - n0; ++i) {
              const int64_t n = reverse ? n1 - 1 - i : n0 + i;
              whole_hist[h][n].copy_(y);
              y = step(h, n, y, nullptr);
            }
          }
          if (n1 == n0) fin[s][h].copy_(y0[s][h]);
          for (int64_t lo = n0; lo < n1; lo += len) {
            const int64_t hi = std::min(lo + len, n1);
            int64_t w = reverse ? n1 : n0;
            double sum = 0;
            if (reverse) {
              for (int64_t n = hi; n < n1; ++n)
                if ((sum += log2b[h][n].item<double>()) <= -20) { w = n + 1; break; }
            } else {
              for (int64_t n = lo - 1; n >= n0; --n)
                if ((sum += log2b[h][n].item<double>()) <= -20) { w = n; break; }
            }
            auto y = w == (reverse ? n1 : n0) ? y0[s][h].clone() : torch::zeros({Dk, Dv}, kF64);
            const int64_t count = reverse ? w - lo : hi - w;
            for (int64_t i = 0; i < count; ++i) {
              const int64_t n = reverse ? w - 1 - i : w + i;
              const bool mine = n >= lo && n < hi;
              torch::Tensor m;
              if (mine) hist[h][n].copy_(y);
              y = step(h, n, y, &m);
              if (mine && !reverse) Mref[h][n].copy_(m);
            }
            if (reverse ? lo == n0 : hi == n1) fin[s][h].copy_(y);
          }
        }
      auto run = [&](int64_t segment) {
        hh::kernels::LowRankScanArgs a;
        a.A = A.to(f16);
        a.B = B.to(f16);
        a.decay = decay.to(f32);
        if (with_bound) a.bound = (log2b * std::log(2.0)).to(f32);
        if (reverse) a.Z = Z.to(f32);
        else a.U = U.to(f32);
        a.y0 = y0.to(f32);
        a.reverse = reverse;
        a.precision = hh::kernels::ScanPrecision::kBlockFloat16;
        a.segment = segment;
        a.hist = torch::full({H, N, Dk, Dv}, std::numeric_limits<float>::quiet_NaN(), f32);
        a.S16 = torch::full({H, N, Dk, Dv}, std::numeric_limits<float>::quiet_NaN(), f16);
        a.S_inv = torch::full({H, N, Dk / 16, Dv / 16}, std::numeric_limits<float>::quiet_NaN(), f32);
        if (!reverse) {
          a.M = torch::full({H, N, C, Dv}, std::numeric_limits<float>::quiet_NaN(), f32);
          a.M16 = torch::full({H, N, C, Dv}, std::numeric_limits<float>::quiet_NaN(), f16);
          a.M_inv = torch::full({H, N, C / 16, Dv / 8}, std::numeric_limits<float>::quiet_NaN(), f32);
        }
        const auto out = hh::kernels::low_rank_scan(a, offsets);
        return std::make_pair(a, out);
      };
      // Segments of 3 chunks: 22 segments x 4 slices of 32 columns x 3 heads = 264 blocks; with 16-column
      // slices (below) 528, more than an H200's SMs, so that the two-slot ring runs there.
      const auto [seg, seg_fin] = run(len);
      EXPECT_LT(rel_err(seg.hist, hist), 1e-2) << what;  // rel_err also fails on NaN: every element written
      EXPECT_LT(rel_err(from_block_f16(seg.S16, seg.S_inv), hist), 1e-2) << what;
      EXPECT_LT(rel_err(seg_fin, fin), 1e-2) << what;
      if (!reverse) {
        EXPECT_LT(rel_err(seg.M, Mref), 1e-2) << what;
        EXPECT_LT(rel_err(from_block_f16(seg.M16, seg.M_inv, 16, 8), Mref), 1e-2) << what;
      }
      // Blocks of 16 columns (as where 32 do not divide Dv) compute the same values in the same order as
      // the 32-column blocks Dv = 128 gets.
      ASSERT_EQ(hh::kernels::scan_columns(), 0);
      hh::kernels::set_scan_columns(16);
      const auto [narrow, narrow_fin] = run(len);
      hh::kernels::set_scan_columns(0);
      EXPECT_TRUE(torch::equal(seg.hist, narrow.hist)) << what << " (16-column blocks)";
      EXPECT_TRUE(torch::equal(seg.S16, narrow.S16)) << what << " (16-column blocks)";
      EXPECT_TRUE(torch::equal(seg.S_inv, narrow.S_inv)) << what << " (16-column blocks)";
      EXPECT_TRUE(torch::equal(seg_fin, narrow_fin)) << what << " (16-column blocks)";
      if (!reverse) {
        EXPECT_TRUE(torch::equal(seg.M16, narrow.M16)) << what << " (16-column blocks)";
        EXPECT_TRUE(torch::equal(seg.M_inv, narrow.M_inv)) << what << " (16-column blocks)";
      }
      const auto [whole, whole_fin] = run(0);
      if (all_ones) {
        EXPECT_TRUE(torch::equal(seg.hist, whole.hist)) << what;
        EXPECT_TRUE(torch::equal(seg.S16, whole.S16)) << what;
        EXPECT_TRUE(torch::equal(seg.S_inv, whole.S_inv)) << what;
        EXPECT_TRUE(torch::equal(seg_fin, whole_fin)) << what;
        if (!reverse) {
          EXPECT_TRUE(torch::equal(seg.M16, whole.M16)) << what;
        }
      } else {
        // The pieces' early starts leave out what came before them (in float64, a few percent of the
        // states here): the kernel's pieces differ from the whole scan as much.
        const double gap = rel_err(hist, whole_hist);
        EXPECT_GT(gap, 1e-2) << what << ": no piece starts early";
        EXPECT_LT(rel_err(whole.hist, whole_hist), 1e-2) << what;
        EXPECT_GT(rel_err(seg.hist, whole_hist), 0.5 * gap) << what << ": the segments' warm-ups made no difference";
      }
    }
}

TEST(CudaGdn, AutoSegmentsFillTheDeviceOnce) {
  using hh::kernels::auto_segment_chunks;
  // 32-column blocks, one an SM of an H200's 132: B1 H16 Dv128 at 32K, two pieces of 256 chunks (128
  // blocks); 14 heads at 128K; 2 heads, 16 pieces; B4 H16 at 8K, already 256 blocks: whole sequences.
  EXPECT_EQ(auto_segment_chunks(64, 512, 132), 256);
  EXPECT_EQ(auto_segment_chunks(56, 2048, 132), 1024);
  EXPECT_EQ(auto_segment_chunks(8, 512, 132), 32);
  EXPECT_EQ(auto_segment_chunks(256, 128, 132), 128);
  // 16-column blocks, two an SM: 264 slots.
  EXPECT_EQ(auto_segment_chunks(128, 512, 264), 256);
  EXPECT_EQ(auto_segment_chunks(16, 100, 264), 16);  // 16 pieces of 7 would be below the minimum
  EXPECT_EQ(auto_segment_chunks(0, 128, 132), 0);
  EXPECT_EQ(auto_segment_chunks(128, 0, 132), 0);
  // Beside another stream's kernels (the hybrid layer's LA heads beside flash): pieces of at most 32 chunks.
  // The column scan's 14 heads at 128K: 126 blocks of 228 chunks alone, 896 of 32 beside; 14 heads at 8K
  // already within it; the scope ends with its object.
  EXPECT_FALSE(hh::kernels::scan_beside());
  EXPECT_EQ(auto_segment_chunks(14, 2048, 132), 228);
  {
    const hh::kernels::ScanBeside beside;
    EXPECT_TRUE(hh::kernels::scan_beside());
    EXPECT_EQ(auto_segment_chunks(14, 2048, 132), 32);
    EXPECT_EQ(auto_segment_chunks(14, 128, 132), 16);
    EXPECT_EQ(auto_segment_chunks(0, 128, 132), 0);
  }
  EXPECT_FALSE(hh::kernels::scan_beside());
  EXPECT_EQ(auto_segment_chunks(14, 2048, 132), 228);
}

// [B, T, H, ...] -> [H, B * per, 64, ...]: the chunk grid of B regular sequences, zero-padded.
torch::Tensor on_grid(const torch::Tensor& x, int64_t per) {
  const int64_t B = x.size(0), T = x.size(1);
  std::vector<int64_t> pad_shape = x.sizes().vec(), grid = {B, per, 64}, perm = {3, 0, 1, 2}, out = {x.size(2), B * per, 64};
  pad_shape[1] = per * 64 - T;
  for (int64_t i = 2; i < x.dim(); ++i) grid.push_back(x.size(i));
  for (int64_t i = 4; i < static_cast<int64_t>(grid.size()); ++i) perm.push_back(i);
  for (int64_t i = 3; i < x.dim(); ++i) out.push_back(x.size(i));
  return torch::cat({x, torch::zeros(pad_shape, x.options())}, 1).reshape(grid).permute(perm).reshape(out);
}

// Leaves every free block of the CUDA caching allocator filled with NaN, so that tensors a kernel allocates
// next start as NaN (an element it fails to write then shows in rel_err). The fill is all bits one, a NaN
// read as float32, bfloat16 or float16 alike (a float32 NaN's low 16 bits read as a 16-bit value are zero).
// The allocator takes tensors of up to 1 MB from small blocks (2 MB each) and larger ones from large
// blocks, and a free block keeps what was last written there: so the cached blocks are released first,
// then one large block of 256 MB and 64 MB of small ones are allocated, filled and freed.
void poison_allocator() {
  c10::cuda::CUDACachingAllocator::emptyCache();
  const auto i32 = kCuda.dtype(torch::kInt);
  (void)torch::full({64 << 20}, -1, i32);
  std::vector<torch::Tensor> small;
  for (int i = 0; i < 64; ++i) small.push_back(torch::full({1 << 18}, -1, i32));  // 1 MB each, two to a small block
}

// A fused output y [B, T, Hy, Dv] against another path's: the heads not in `heads` untouched (7 where
// both were filled), the others the same bits but for a few elements, each within 3 ulp of the inputs'
// 16-bit type (a last-place change of the norm can move each of the three roundings after it).
void expect_fused_heads_close(const torch::Tensor& got, const torch::Tensor& want, const std::vector<int64_t>& heads,
                              const std::string& what) {
  const double ulp = got.scalar_type() == torch::kBFloat16 ? 1.0 / 128 : 1.0 / 1024;  // one unit in the last place, relative
  for (int64_t h = 0; h < got.size(2); ++h) {
    const auto a = got.select(2, h), b = want.select(2, h);
    if (std::find(heads.begin(), heads.end(), h) == heads.end()) {
      EXPECT_TRUE(a.eq(7.0).all().item<bool>()) << what << " head " << h << " written";
      continue;
    }
    EXPECT_GE(a.eq(b).to(torch::kDouble).mean().item<double>(), 0.99) << what << " head " << h;
    const auto af = a.to(torch::kFloat), bf = b.to(torch::kFloat);
    EXPECT_LE(((af - bf).abs() - 3 * ulp * bf.abs()).max().item<double>(), 1e-6) << what << " head " << h;
  }
}

// Fresh inputs for the chunk kernels on the GPU: L2-normalised q, k and Gaussian v of dtype dt;
// g = -0.5 U(0, 1) and beta = U(0, 1) in float32.
struct ChunkIn {
  torch::Tensor q, k, v, g, beta;
};
ChunkIn chunk_in(int64_t B, int64_t T, int64_t H, int64_t Dk, int64_t Dv, torch::Dtype dt) {
  namespace F = torch::nn::functional;
  const auto nrm = F::NormalizeFuncOptions().dim(-1);
  const auto dev = kCuda.dtype(dt), f32 = kCuda.dtype(torch::kFloat);
  return {F::normalize(torch::randn({B, T, H, Dk}, kF64), nrm).to(dev), F::normalize(torch::randn({B, T, H, Dk}, kF64), nrm).to(dev),
          torch::randn({B, T, H, Dv}, kF64).to(dev), (-0.5 * torch::rand({B, T, H}, kF64)).to(f32),
          torch::rand({B, T, H}, kF64).to(f32)};
}

// f(dt, Dk, Dv, what) for both 16-bit dtypes and every pair of the chunk kernels' head sizes.
template <class Fn>
void for_each_chunk_case(Fn f) {
  for (torch::Dtype dt : {torch::kBFloat16, torch::kHalf})
    for (auto [Dk, Dv] : {std::pair<int64_t, int64_t>{128, 128}, {64, 128}, {128, 64}, {64, 64}})
      f(dt, Dk, Dv, std::string(c10::toString(dt)) + " Dk=" + std::to_string(Dk) + " Dv=" + std::to_string(Dv));
}

// The chunk kernels alone against their formulas in float64 on the chunk grid: T not a multiple of
// 64 (the last chunk's padding slots), B = 2, Dk != Dv, both 16-bit dtypes.
TEST(CudaGdn, ChunkKernelsEqualTheirFormulasInFloat64) {
  ASSERT_TRUE(torch::cuda::is_available());
  const int64_t B = 2, T = 150, H = 3, per = 3, N = B * per, C = 64;
  const double scale = 0.1;
  for_each_chunk_case([&](torch::Dtype dt, int64_t Dk, int64_t Dv, const std::string& what) {
    const auto f32 = kCuda.dtype(torch::kFloat);
    const auto [q, k, v, g, beta] = chunk_in(B, T, H, Dk, Dv, dt);
    auto f64 = [](const torch::Tensor& x) { return x.to(torch::kCPU, torch::kDouble); };
    const auto Q = on_grid(f64(q), per), K = on_grid(f64(k), per), V = on_grid(f64(v), per);
    const auto G = on_grid(f64(g), per).cumsum(-1), Bt = on_grid(f64(beta), per);  // [H, N, C]
    const auto diff = G.unsqueeze(-1) - G.unsqueeze(-2);
    const auto strict = torch::ones({C, C}, torch::kBool).tril(-1), incl = torch::ones({C, C}, torch::kBool).tril();
    const auto L = (Bt.unsqueeze(-1) * torch::matmul(K, K.transpose(-1, -2)) * diff.exp()).masked_fill(strict.logical_not(), 0.0);
    const auto Tinv = torch::inverse(torch::eye(C, kF64) + L);
    const auto W = torch::matmul(Tinv, (Bt * G.exp()).unsqueeze(-1) * K), U = torch::matmul(Tinv, Bt.unsqueeze(-1) * V);
    const auto last = G.select(-1, C - 1);
    const auto kdecay = (last.unsqueeze(-1) - G).exp().unsqueeze(-1) * K;

    poison_allocator();
    const hh::kernels::ChunkGrid grid{N, per, {}};
    const auto f = hh::kernels::chunk_factors(k, v, g, beta, grid);
    // W rounded to float16 (measured 2.0e-4 to 2.1e-4 over both dtypes and head sizes); U from T split
    // into two 16-bit parts, about 16 significant bits (measured 2.2e-6 for bfloat16, 1.9e-7 for float16).
    // The bounds leave 5x and 14x.
    EXPECT_LT(rel_err(f.W, W), 1e-3) << what;
    EXPECT_LT(rel_err(f.U, U), 3e-5) << what;
    std::printf("[ measured ] %s: W %.3g, U %.3g\n", what.c_str(), rel_err(f.W, W), rel_err(f.U, U));
    EXPECT_EQ(f.W.scalar_type(), torch::kHalf) << what;  // W and kdecay as the scan streams them
    EXPECT_LT(rel_err(f.kdecay, kdecay), 1e-3) << what;      // float16's rounding
    EXPECT_LT(rel_err(f.decay, last.exp()), 1e-6) << what;
    // The log of the transition's norm bound, G_C + sum_t log max(1, |1 - beta_t |k_t|^2|): G_C for these
    // unit keys, more for keys of lengths 2^-1 .. 2 (out of the rule's contract).
    for (bool unit : {true, false}) {
      const auto kw = unit ? k : (f64(k) * torch::exp2(2 * torch::rand({B, T, H, 1}, kF64) - 1)).to(k.options());
      const auto Kw = on_grid(f64(kw), per);
      const auto want = last + (1 - Bt * (Kw * Kw).sum(-1)).abs().clamp_min(1).log().sum(-1);
      const auto got = (unit ? f : hh::kernels::chunk_factors(kw, v, g, beta, grid)).bound.to(torch::kCPU, torch::kDouble);
      EXPECT_LT((got - want).abs().max().item<double>(), 1e-4) << what << (unit ? "" : ", keys of other lengths");
      if (unit) EXPECT_LT((want - last).abs().max().item<double>(), 1e-3) << what;  // within bfloat16's rounding of |k|
      else EXPECT_GT((want - last).mean().item<double>(), 0.5) << what;
    }

    // The output from arbitrary start states and new values (rows of padding slots M = 0, as the scan leaves them).
    const auto S = torch::randn({H, N, Dk, Dv}, kF64);
    const auto M = torch::randn({H, N, C, Dv}, kF64) * (Bt != 0).unsqueeze(-1);
    const auto attn = (torch::matmul(Q, K.transpose(-1, -2)) * diff.masked_fill(incl.logical_not(), -std::numeric_limits<double>::infinity()).exp());
    const auto O = scale * (G.exp().unsqueeze(-1) * torch::matmul(Q, S) + torch::matmul(attn, M));  // [H, N, C, Dv]
    const auto want = O.reshape({H, B, per * C, Dv}).narrow(2, 0, T).permute({1, 2, 0, 3});
    poison_allocator();
    const auto got = hh::kernels::chunk_output(q, k, g, S.to(f32), M.to(f32), grid, scale);
    EXPECT_EQ(got.scalar_type(), dt) << what;
    EXPECT_LT(rel_err(got, want), 1e-2) << what;  // the 16-bit output's rounding

    // The output's factors (given q); the forward scan's block float16 history; chunk_output_f16 from
    // both; all against the chunked rule in float64 from a random initial state (each sequence's
    // per = 3 chunks in turn).
    poison_allocator();
    const auto fo = hh::kernels::chunk_factors(k, v, g, beta, grid, q, scale);
    EXPECT_LT(rel_err(fo.W, W), 3e-3) << what;  // the factors are unchanged by q
    EXPECT_LT(rel_err(fo.Qd, scale * G.exp().unsqueeze(-1) * Q), 1e-3) << what;
    EXPECT_EQ(fo.Aq.sizes(), torch::IntArrayRef({H, N, hh::kernels::kPackedLower})) << what;
    EXPECT_LT(rel_err(unpack_lower(fo.Aq).to(torch::kDouble) * fo.aq_inv.to(torch::kDouble).unsqueeze(-1).unsqueeze(-1), scale * attn),
              1e-3)
        << what;
    // Aq's scale: a power of two with each chunk's largest |entry| in [2^14, 2^15) before the
    // rounding to float16, which may carry an entry just below 2^15 up to 2^15 itself.
    const auto inv = fo.aq_inv.cpu().to(torch::kDouble);
    EXPECT_TRUE(torch::equal(torch::exp2(torch::round(torch::log2(inv))), inv)) << what;
    const auto top = std::get<0>(fo.Aq.cpu().to(torch::kDouble).abs().flatten(2).max(-1));
    EXPECT_GE(top.min().item<double>(), 16384.0) << what;
    EXPECT_LE(top.max().item<double>(), 32768.0) << what;
    EXPECT_FALSE(fo.U_inv.defined()) << what;

    // U in float16 with a power of two a column (UForm::kFloat16Columns, the column scan's form): the other
    // factors the same bits; each column's scale puts its largest |entry| in [2^14, 2^15] (the rounding may
    // carry one to 2^15), so every element is within half a float16 ulp there, 8 u_inv, of the kernel's
    // float32 U, which is itself within about 2e-6 of U (0.03 u_inv for a column whose largest entry is
    // U's largest; measured 8.00 to 8.09 u_inv in all, so the bound leaves a whole u_inv for the rest).
    poison_allocator();
    const auto fu = hh::kernels::chunk_factors(k, v, g, beta, grid, q, scale, nullptr, hh::kernels::UForm::kFloat16Columns);
    EXPECT_EQ(fu.U.scalar_type(), torch::kHalf) << what;
    EXPECT_TRUE(torch::equal(fu.W, fo.W) && torch::equal(fu.kdecay, fo.kdecay) && torch::equal(fu.Qd, fo.Qd) &&
                torch::equal(fu.Aq, fo.Aq) && torch::equal(fu.decay, fo.decay) && torch::equal(fu.bound, fo.bound))
        << what << ": the other factors";
    const auto u_inv = fu.U_inv.cpu().to(torch::kDouble).unsqueeze(2);  // [H, N, 1, Dv]
    EXPECT_TRUE(torch::equal(torch::exp2(torch::round(torch::log2(u_inv))), u_inv)) << what;
    const auto u16 = fu.U.cpu().to(torch::kDouble);
    const auto col_top = std::get<0>(u16.abs().max(2));  // [H, N, Dv]
    EXPECT_GE(col_top.min().item<double>(), 16384.0) << what;
    EXPECT_LE(col_top.max().item<double>(), 32768.0) << what;
    const double ulps = ((u16 * u_inv - U).abs() / u_inv).max().item<double>();
    EXPECT_LE(ulps, 9.0) << what;
    std::printf("[ measured ] %s: U in float16 by columns, %.3g of a column's scale (rel %.3g)\n", what.c_str(), ulps,
                rel_err(fu.U.to(torch::kDouble) * fu.U_inv.to(torch::kDouble).unsqueeze(2), U));
    EXPECT_THROW(hh::kernels::chunk_factors(k, v, g, beta, grid, {}, scale, nullptr, hh::kernels::UForm::kFloat16Columns),
                 std::invalid_argument)
        << what << ": without q";

    // T for the backward (keep_t): the other factors the same bits; T in the inputs' kind, unit lower
    // triangular exactly (ones on the diagonal, zeros above it) and within one rounding to that kind of
    // the inverse in float64 (under 2^-8 of an entry for bfloat16, 2^-11 for float16) plus the float32
    // inverse's own error: measured 0.00387 and 0.000483 at most, so the bounds leave a quarter of a
    // rounding for that error.
    poison_allocator();
    const auto ft = hh::kernels::chunk_factors(k, v, g, beta, grid, q, scale, nullptr, hh::kernels::UForm::kFloat32, true);
    EXPECT_TRUE(torch::equal(ft.W, fo.W) && torch::equal(ft.U, fo.U) && torch::equal(ft.kdecay, fo.kdecay) &&
                torch::equal(ft.Qd, fo.Qd) && torch::equal(ft.Aq, fo.Aq) && torch::equal(ft.bound, fo.bound))
        << what << ": the other factors with T";
    EXPECT_FALSE(fo.T16.defined()) << what;
    ASSERT_TRUE(ft.T16.defined()) << what;
    EXPECT_EQ(ft.T16.scalar_type(), dt) << what;
    EXPECT_EQ(ft.T16.sizes(), torch::IntArrayRef({H, N, hh::kernels::kPackedLower})) << what;
    const auto t16 = unpack_lower(ft.T16).cpu().to(torch::kDouble);
    EXPECT_TRUE(torch::equal(t16.triu(1), torch::zeros_like(t16))) << what << ": T above its diagonal";
    EXPECT_TRUE(torch::equal(t16.diagonal(0, -2, -1), torch::ones({H, N, C}, kF64))) << what << ": T's diagonal";
    const double t_err = ((t16 - Tinv).abs() / Tinv.abs().clamp_min(1e-3)).max().item<double>();
    EXPECT_LT(t_err, dt == torch::kBFloat16 ? 1.25 / 256 : 1.25 / 2048) << what;
    std::printf("[ measured ] %s: T for the backward, %.3g of an entry at most (rel %.3g)\n", what.c_str(), t_err,
                rel_err(unpack_lower(ft.T16), Tinv));
    EXPECT_THROW(hh::kernels::chunk_factors(k, v, g, beta, grid, {}, scale, nullptr, hh::kernels::UForm::kFloat32, true),
                 std::invalid_argument)
        << what << ": T without q";

    const auto s0 = 0.5 * torch::randn({B, H, Dk, Dv}, kF64);
    auto Sn = torch::empty({H, N, Dk, Dv}, kF64), Mn = torch::empty({H, N, C, Dv}, kF64);
    auto fin = torch::empty({B, H, Dk, Dv}, kF64);
    for (int64_t b = 0; b < B; ++b) {
      auto y = s0[b].clone();  // [H, Dk, Dv]
      for (int64_t j = 0; j < per; ++j) {
        const int64_t n = b * per + j;
        Sn.select(1, n).copy_(y);
        Mn.select(1, n).copy_(U.select(1, n) - torch::matmul(W.select(1, n), y));
        y = last.select(1, n).exp().view({H, 1, 1}) * y + torch::matmul(kdecay.select(1, n).transpose(-1, -2), Mn.select(1, n));
      }
      fin[b].copy_(y);
    }
    const auto Of = scale * (G.exp().unsqueeze(-1) * torch::matmul(Q, Sn) + torch::matmul(attn, Mn));
    const auto want_f = Of.reshape({H, B, per * C, Dv}).narrow(2, 0, T).permute({1, 2, 0, 3});
    for (bool states : {false, true}) {
      poison_allocator();
      hh::kernels::LowRankScanArgs a;
      a.A = fo.kdecay;
      a.B = fo.W;
      a.decay = fo.decay;
      a.U = fo.U;
      a.y0 = s0.to(f32);
      if (states) a.hist = torch::empty({H, N, Dk, Dv}, f32);
      a.precision = hh::kernels::ScanPrecision::kBlockFloat16;
      a.S16 = torch::empty({H, N, Dk, Dv}, kCuda.dtype(torch::kHalf));
      a.S_inv = torch::empty({H, N, Dk / 16, Dv / 16}, f32);
      a.M16 = torch::empty({H, N, C, Dv}, kCuda.dtype(torch::kHalf));
      a.M_inv = torch::empty({H, N, C / 16, Dv / 8}, f32);
      const auto final_state = hh::kernels::low_rank_scan(a, {0, per, 2 * per});
      const std::string how = what + (states ? " (with the float32 history)" : "");
      EXPECT_LT(rel_err(final_state, fin), 3e-3) << how;
      if (states) {
        EXPECT_LT(rel_err(a.hist, Sn), 3e-3) << how;
      }
      // The float16 history: 11 significant bits an element on top of the scan's own error.
      EXPECT_LT(rel_err(from_block_f16(a.S16, a.S_inv), Sn), 3e-3) << how;
      EXPECT_LT(rel_err(from_block_f16(a.M16, a.M_inv, 16, 8), Mn), 3e-3) << how;
      poison_allocator();
      const auto o = hh::kernels::chunk_output_f16(fo, a.S16, a.S_inv, a.M16, a.M_inv, grid, B, T, dt);
      EXPECT_EQ(o.scalar_type(), dt) << how;
      EXPECT_LT(rel_err(o, want_f), 1e-2) << how;  // the 16-bit output's rounding
    }
  });
}

// chunk_factors with its blocks an SM capped (its shared memory padded) gives the same bits as with as many
// as fit, holds at most the cap (exactly the cap where the kernel alone would hold more), and refuses a cap
// out of range.
TEST(CudaGdn, FactorsBlocksAnSmCapChangesNoBit) {
  ASSERT_TRUE(torch::cuda::is_available());
  const int64_t B = 2, T = 150, H = 3, per = (T + 63) / 64;
  const hh::kernels::ChunkGrid grid{B * per, per, {}};
  for_each_chunk_case([&](torch::Dtype dt, int64_t Dk, int64_t Dv, const std::string& what) {
    const auto [q, k, v, g, beta] = chunk_in(B, T, H, Dk, Dv, dt);
    auto factors = [&] {
      poison_allocator();
      return hh::kernels::chunk_factors(k, v, g, beta, grid, q, 0.1, nullptr, hh::kernels::UForm::kFloat16Columns);
    };
    ASSERT_EQ(hh::kernels::factors_blocks_per_sm(), 0) << what;
    const auto want = factors();
    const int fit = hh::kernels::factors_resident_blocks();
    ASSERT_GE(fit, 1) << what;
    for (int cap : {3, 2, 1}) {
      hh::kernels::set_factors_blocks_per_sm(cap);
      const auto got = factors();
      const int held = hh::kernels::factors_resident_blocks();
      hh::kernels::set_factors_blocks_per_sm(0);
      const std::string how = what + " at most " + std::to_string(cap) + " blocks an SM";
      EXPECT_EQ(held, std::min(cap, fit)) << how;
      const std::vector<std::pair<const char*, std::pair<torch::Tensor, torch::Tensor>>> pairs = {
          {"W", {got.W, want.W}},         {"U", {got.U, want.U}},   {"U_inv", {got.U_inv, want.U_inv}},
          {"kdecay", {got.kdecay, want.kdecay}}, {"decay", {got.decay, want.decay}}, {"bound", {got.bound, want.bound}},
          {"Qd", {got.Qd, want.Qd}},      {"Aq", {got.Aq, want.Aq}}, {"aq_inv", {got.aq_inv, want.aq_inv}}};
      for (const auto& [name, t] : pairs) EXPECT_TRUE(torch::equal(t.first, t.second)) << how << ": " << name;
    }
    // Back to as many as fit.
    (void)factors();
    EXPECT_EQ(hh::kernels::factors_resident_blocks(), fit) << what;
  });
  EXPECT_THROW(hh::kernels::set_factors_blocks_per_sm(-1), std::invalid_argument);
  EXPECT_THROW(hh::kernels::set_factors_blocks_per_sm(33), std::invalid_argument);
  EXPECT_EQ(hh::kernels::factors_blocks_per_sm(), 0);
}

// The shapes of the tests of chunks in turn: two regular sequences of `per` chunks, the last 23 rows long;
// or one row of packed sequences of these lengths on a gather grid (a padding slot reads row B T).
struct TurnsGrid {
  int64_t B, T, N;
  torch::Tensor gather;
};
TurnsGrid turns_grid(bool packed, int64_t per, const std::vector<int64_t>& lengths) {
  constexpr int64_t C = 64;
  if (!packed) return {2, C * (per - 1) + 23, 2 * per, torch::Tensor()};
  TurnsGrid t{1, 0, 0, torch::Tensor()};
  for (int64_t len : lengths) t.T += len, t.N += (len + C - 1) / C;
  std::vector<int64_t> slots;
  int64_t a = 0;
  for (int64_t len : lengths) {
    for (int64_t j = 0; j < (len + C - 1) / C; ++j)
      for (int64_t r = 0; r < C; ++r) slots.push_back(C * j + r < len ? a + C * j + r : t.B * t.T);
    a += len;
  }
  t.gather = torch::tensor(slots, torch::kLong).to(torch::kCUDA);
  return t;
}

// chunk_factors as one or two blocks an SM taking chunks in turn (set_factors_in_turn), each chunk's rows and
// gates loaded during the chunk before, against one block a chunk: every output the same bits, with U in
// float32 and in float16 columns and with T kept; over three times as many (chunk, head) pairs as blocks,
// so that every block takes several chunks and the last turn leaves some without one; short last chunks;
// regular sequences and packed ones on a gather grid (an empty one, one shorter than a chunk, one of exactly
// a chunk); both 16-bit dtypes and the four head-size pairs; outputs from a NaN-poisoned allocator. With
// the phases' clocks on (set_factors_phase_clocks), the same bits and every phase timed.
TEST(CudaGdn, FactorsInTurnEqualOneBlockAChunk) {
  ASSERT_TRUE(torch::cuda::is_available());
  const int64_t sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount, H = 3, C = 64;
  for_each_chunk_case([&](torch::Dtype dt, int64_t Dk, int64_t Dv, const std::string& what_dims) {
    for (bool packed : {false, true}) {
      const std::string what = what_dims + (packed ? " packed" : " regular");
      const auto [B, T, N, gather] = turns_grid(packed, (6 * sms) / (2 * H) + 2, {100, 0, 40, C * (6 * sms / H) + 17, C, 1});
      const int64_t per = packed ? 0 : N / B;
      ASSERT_GT(N * H, 6 * sms) << what;
      const hh::kernels::ChunkGrid grid{N, per, gather};
      const auto [q, k, v, g, beta] = chunk_in(B, T, H, Dk, Dv, dt);
      for (int form : {0, 1}) {  // U in float16 columns; U in float32 with T kept
        const auto u = form == 0 ? hh::kernels::UForm::kFloat16Columns : hh::kernels::UForm::kFloat32;
        auto factors = [&](int blocks) {
          hh::kernels::set_factors_in_turn(blocks);
          const int64_t before = hh::kernels::factors_in_turn_launches();
          poison_allocator();
          const auto f = hh::kernels::chunk_factors(k, v, g, beta, grid, q, 0.1, nullptr, u, form == 1);
          hh::kernels::set_factors_in_turn(0);
          EXPECT_EQ(hh::kernels::factors_in_turn_launches() - before, blocks > 0 ? 1 : 0) << what << ": which kernel ran";
          if (blocks > 0) EXPECT_EQ(hh::kernels::factors_resident_blocks(), blocks) << what << ": blocks an SM";
          return f;
        };
        const auto want = factors(0);
        for (int blocks : {1, 2, -1}) {  // -1: one block an SM with the phases' clocks
          if (blocks < 0) hh::kernels::set_factors_phase_clocks(true);
          const auto got = factors(std::abs(blocks));
          if (blocks < 0) {
            // Every chunk but each block's first (its rows not loaded during a chunk before) is timed, and
            // every phase takes time but the split (3), which some forms do not run.
            const auto p = hh::kernels::factors_turn_phases();
            hh::kernels::set_factors_phase_clocks(false);
            EXPECT_EQ(p.chunks, N * H - std::min(N * H, sms)) << what << ": chunks timed";
            for (int i : {0, 1, 2, 4}) EXPECT_GT(p.cycles[i], 0.0) << what << ": phase " << i;
            EXPECT_EQ(hh::kernels::factors_turn_phases().chunks, 0) << what << ": clocks off";
          }
          const std::string how = what + " form " + std::to_string(form) + ", " + std::to_string(std::abs(blocks)) +
                                  " blocks an SM in turn" + (blocks < 0 ? " with clocks" : "");
          std::vector<std::pair<const char*, std::pair<torch::Tensor, torch::Tensor>>> pairs = {
              {"W", {got.W, want.W}},         {"U", {got.U, want.U}},         {"kdecay", {got.kdecay, want.kdecay}},
              {"decay", {got.decay, want.decay}}, {"bound", {got.bound, want.bound}}, {"Qd", {got.Qd, want.Qd}},
              {"Aq", {got.Aq, want.Aq}},      {"aq_inv", {got.aq_inv, want.aq_inv}}};
          if (form == 0) pairs.push_back({"U_inv", {got.U_inv, want.U_inv}});
          else pairs.push_back({"T16", {got.T16, want.T16}});
          for (const auto& [name, t] : pairs) EXPECT_TRUE(torch::equal(t.first, t.second)) << how << ": " << name;
        }
      }
    }
  });
  EXPECT_THROW(hh::kernels::set_factors_in_turn(3), std::invalid_argument);
  EXPECT_THROW(hh::kernels::set_factors_in_turn(-1), std::invalid_argument);
  EXPECT_EQ(hh::kernels::factors_in_turn(), 0);
}

// Without initial states the rule's scans start from zero with no tensor of zeros (the op's stand-in is
// at::empty's, LowRankScanArgs::zero_start), and without a final-state gradient the reverse scan likewise:
// the output, the final state and every gradient the same bits as with explicit zeros, the stand-ins drawn
// from a NaN-poisoned allocator, so that a scan reading one would show. Regular and packed sequences
// (segmented scans: the first piece of each sequence is the one that starts from y0), both 16-bit dtypes
// and float32 (LibTorch's chunk-local factors around the float32 kernel scan), with and without a graph.
// float32's backward runs on LibTorch ops, whose sums need not repeat bit for bit from run to run, so its
// gradients are compared within 1e-5 of their largest magnitude; its output and final state bit for bit.
TEST(CudaGdn, ZeroStartStatesNeedNoZerosAndKeepTheBits) {
  ASSERT_TRUE(torch::cuda::is_available());
  const int64_t H = 4, D = 128;
  for (torch::Dtype dt : {torch::kBFloat16, torch::kHalf, torch::kFloat})
    for (bool packed : {false, true}) {
      const std::string what = std::string(c10::toString(dt)) + (packed ? " packed" : " regular");
      const int64_t B = packed ? 1 : 2, T = packed ? 3000 : 1500;
      const std::vector<int64_t> cu = packed ? std::vector<int64_t>{0, 700, 701, 2300, 3000} : std::vector<int64_t>{};
      const int64_t S = packed ? 4 : B;
      const auto [q, k, v, g, beta] = chunk_in(B, T, H, D, D, dt);
      const auto w_o = torch::randn({B, T, H, D}, kCuda.dtype(torch::kFloat));
      const auto zeros = torch::zeros({S, H, D, D}, kCuda.dtype(torch::kFloat));
      // The forward alone.
      auto forward = [&](bool given) {
        torch::NoGradGuard no_grad;
        poison_allocator();
        return gdn_chunked_scan(q, k, v, g, beta, given ? zeros : torch::Tensor(), 0.1, 64, cu);
      };
      const auto f_want = forward(true), f_got = forward(false);
      EXPECT_TRUE(torch::equal(f_got.o, f_want.o)) << what << ": o, forward alone";
      EXPECT_TRUE(torch::equal(f_got.state, f_want.state)) << what << ": final state, forward alone";
      // With a graph: the final state in the loss, or not (no gradient for it: the reverse scan starts from
      // zero), against explicit zero initial states and, for the latter, the final state in the loss times 0
      // (a gradient of zeros, which the reverse scan reads).
      for (bool use_state : {true, false}) {
        auto run = [&](bool given) {
          std::vector<torch::Tensor> x = {q.detach().requires_grad_(true), k.detach().requires_grad_(true), v.detach().requires_grad_(true),
                                          g.detach().requires_grad_(true), beta.detach().requires_grad_(true)};
          poison_allocator();
          const auto r = gdn_chunked_scan(x[0], x[1], x[2], x[3], x[4], given ? zeros : torch::Tensor(), 0.1, 64, cu);
          auto loss = (r.o.to(torch::kFloat) * w_o).sum();
          if (use_state) loss = loss + r.state.sum();
          else if (given) loss = loss + (r.state * 0).sum();
          auto grads = torch::autograd::grad({loss}, x);
          grads.push_back(r.o.detach());
          grads.push_back(r.state.detach());
          return grads;
        };
        const auto want = run(true), got = run(false);
        const char* names[] = {"dq", "dk", "dv", "dg", "dbeta", "o", "final state"};
        for (size_t i = 0; i < 7; ++i) {
          const std::string at = what + (use_state ? ", final state used: " : ", final state unused: ") + names[i];
          if (dt == torch::kFloat && i < 5) {
            const double tol = 1e-5 * want[i].abs().max().item<double>();
            EXPECT_TRUE(got[i].isfinite().all().item<bool>()) << at;
            EXPECT_LE((got[i] - want[i]).abs().max().item<double>(), tol) << at;
          } else {
            EXPECT_TRUE(torch::equal(got[i], want[i])) << at;
          }
        }
      }
    }
}

// The output written by the forward scan itself (LowRankScanArgs::output) against chunk_output_f16 from
// the same scan's block float16 history: the same bits (the same float16 operands, scales and order of
// sums) and the same final state. Both dtypes and the chunk kernels' head sizes, the scan's 32- and
// 16-column blocks, whole sequences and segments of two chunks (with warm-ups), T not a multiple of 64,
// an initial state, o from a NaN-poisoned allocator (an unwritten element fails the comparison).
TEST(CudaGdn, OutputInTheScanEqualsChunkOutputF16BitForBit) {
  ASSERT_TRUE(torch::cuda::is_available());
  const int64_t B = 2, T = 777, H = 3, per = (T + 63) / 64, N = B * per, C = 64;
  const double scale = 0.1;
  for_each_chunk_case([&](torch::Dtype dt, int64_t Dk, int64_t Dv, const std::string& what) {
    const auto f32 = kCuda.dtype(torch::kFloat);
    const auto [q, k, v, g, beta] = chunk_in(B, T, H, Dk, Dv, dt);
    const hh::kernels::ChunkGrid grid{N, per, {}};
    const auto fo = hh::kernels::chunk_factors(k, v, g, beta, grid, q, scale);
    // U in float16 by columns, the form the column scan reads.
    const auto fu = hh::kernels::chunk_factors(k, v, g, beta, grid, q, scale, nullptr, hh::kernels::UForm::kFloat16Columns);
    const auto s0 = (0.5 * torch::randn({B, H, Dk, Dv}, kF64)).to(f32);
    // The forward scan's arguments on these factors, in pieces of `segment` chunks (0: whole sequences),
    // with the output written into a fresh o if `output`.
    auto args = [&](int64_t segment, bool output) {
      hh::kernels::LowRankScanArgs a;
      a.A = fo.kdecay;
      a.B = fo.W;
      a.decay = fo.decay;
      a.U = fo.U;
      a.y0 = s0;
      a.bound = fo.bound;
      a.precision = hh::kernels::ScanPrecision::kBlockFloat16;
      a.segment = segment;
      if (output) {
        a.output.Qd = fo.Qd;
        a.output.Aq = fo.Aq;
        a.output.aq_inv = fo.aq_inv;
        a.output.o = torch::empty({B, T, H, Dv}, kCuda.dtype(dt));
        a.output.grid = grid;
        a.output.B = B;
        a.output.T = T;
      }
      return a;
    };
    // set_scan_columns(32 or 16): the scan in blocks of columns, never the whole-head column scan.
    for (int columns : {32, 16})
      for (int64_t segment : {int64_t{0}, int64_t{2}}) {
        const std::string how = what + (columns == 32 ? ", 32 columns a block" : ", 16 columns a block") +
                                (segment == 0 ? ", whole sequences" : ", segments of 2 chunks");
        hh::kernels::set_scan_columns(columns);
        hh::kernels::LowRankScanArgs apart = args(segment, false);
        apart.S16 = torch::empty({H, N, Dk, Dv}, kCuda.dtype(torch::kHalf));
        apart.S_inv = torch::empty({H, N, Dk / 16, Dv / 16}, f32);
        apart.M16 = torch::empty({H, N, C, Dv}, kCuda.dtype(torch::kHalf));
        apart.M_inv = torch::empty({H, N, C / 16, Dv / 8}, f32);
        const auto fin_apart = hh::kernels::low_rank_scan(apart, {0, per, 2 * per});
        const auto want = hh::kernels::chunk_output_f16(fo, apart.S16, apart.S_inv, apart.M16, apart.M_inv, grid, B, T, dt);
        poison_allocator();
        hh::kernels::LowRankScanArgs in = args(segment, true);
        const auto fin = hh::kernels::low_rank_scan(in, {0, per, 2 * per});
        hh::kernels::set_scan_columns(0);
        EXPECT_TRUE(torch::equal(in.output.o, want)) << how;
        EXPECT_TRUE(torch::equal(fin, fin_apart)) << how;
        EXPECT_LT(rel_err(in.output.o, want), 1e-6) << how;  // how far, where the bits differ
        // The column scan (the default where it fits: Dk = 128, the columns automatic): its own block float16
        // (a scale a row of S^T and of M^T), so the output agrees to the 16-bit output's rounding and the
        // state to the products'.
        // It reads U in float16 by columns; U in float32 keeps the blocks of 32 columns, and U in float16 is
        // refused where the column scan does not run.
        if (Dk == 128 && columns == 32) {
          EXPECT_TRUE(hh::kernels::scan_warp_columns_enabled());
          poison_allocator();
          hh::kernels::LowRankScanArgs col = args(segment, true);
          col.U = fu.U, col.U_inv = fu.U_inv;
          const int64_t launches = hh::kernels::column_scan_launches();
          const auto fin_col = hh::kernels::low_rank_scan(col, {0, per, 2 * per});
          EXPECT_EQ(hh::kernels::column_scan_launches() - launches, 1) << how << ": the column scan";
          EXPECT_LT(rel_err(col.output.o, want), 1e-2) << how << " (column scan)";
          EXPECT_LT(rel_err(fin_col, fin_apart), 3e-3) << how << " (column scan)";
          std::printf("[ measured ] %s, column scan against the 32-column blocks: o %.3g, state %.3g\n", how.c_str(),
                      rel_err(col.output.o, want), rel_err(fin_col, fin_apart));
          hh::kernels::LowRankScanArgs f32_u = args(segment, true);
          hh::kernels::low_rank_scan(f32_u, {0, per, 2 * per});
          EXPECT_EQ(hh::kernels::column_scan_launches() - launches, 1) << how << ": U in float32 takes the blocks";
          EXPECT_TRUE(torch::equal(f32_u.output.o, want)) << how << ": U in float32";
          hh::kernels::set_scan_columns(32);
          hh::kernels::LowRankScanArgs refused = args(segment, true);
          refused.U = fu.U, refused.U_inv = fu.U_inv;
          EXPECT_THROW(hh::kernels::low_rank_scan(refused, {0, per, 2 * per}), std::invalid_argument) << how;
          refused.U_inv = torch::Tensor();
          hh::kernels::set_scan_columns(0);
          EXPECT_THROW(hh::kernels::low_rank_scan(refused, {0, per, 2 * per}), std::invalid_argument) << how << ": no U_inv";
        }
      }
    // The output's tensors are checked: o of the wrong shape, and a reverse scan, are refused.
    hh::kernels::LowRankScanArgs bad = args(0, true);
    bad.output.o = torch::empty({B, T - 1, H, Dv}, kCuda.dtype(dt));
    EXPECT_THROW(hh::kernels::low_rank_scan(bad, {0, per, 2 * per}), std::invalid_argument) << what;
    bad.output.o = torch::empty({B, T, H, Dv}, kCuda.dtype(dt));
    bad.reverse = true;
    EXPECT_THROW(hh::kernels::low_rank_scan(bad, {0, per, 2 * per}), std::invalid_argument) << what;
  });
}

// The column scan's float16 history (S16 and M16, for the backward's chunk kernel) against the history of
// the scan in blocks of 32 columns (whose own products read it), both decoded by their scales: the same
// start states and new values to the products' rounding. Every block's scale is a power of two, the
// blocks of a warp's 16-column slab (S16's Dk x 16, M16's C x 16) share one, which puts the slab's largest
// magnitude in [2^14, 2^15) before rounding (or the slab is zero), every element is written (a NaN-poisoned
// allocator), and the output and final state are the same bits as the column scan's without the history.
// Either history alone gives the same bits as both. Whole sequences and segments of 2 chunks (a warm-up
// that writes nothing), both dtypes, Dv 128 and 64.
TEST(CudaGdn, ColumnScanWritesTheHistoryTheBackwardReads) {
  ASSERT_TRUE(torch::cuda::is_available());
  ASSERT_TRUE(hh::kernels::scan_warp_columns_enabled());
  const int64_t B = 2, T = 777, H = 3, per = (T + 63) / 64, N = B * per, C = 64, Dk = 128;
  const double scale = 0.1;
  const auto f16 = kCuda.dtype(torch::kHalf), f32 = kCuda.dtype(torch::kFloat);
  // Each r x c block's largest magnitude of x16 [H, N, R, D] in [2^14, 2^15] (scaled into [2^14, 2^15), then
  // rounded to float16, which may round up to 2^15), or zero. r = R: the slabs.
  auto in_range = [](const torch::Tensor& x16, int64_t r, int64_t c) {
    const auto x = x16.to(torch::kCPU, torch::kDouble);
    const auto top = x.reshape({x.size(0), x.size(1), x.size(2) / r, r, x.size(3) / c, c}).abs().amax({3, 5});
    return top.eq(0).logical_or(top.ge(16384).logical_and(top.le(32768))).all().item<bool>();
  };
  auto powers_of_two = [](const torch::Tensor& inv) {
    const auto l = torch::log2(inv.to(torch::kCPU, torch::kDouble));
    return l.eq(l.round()).all().item<bool>();
  };
  // The inverse scales inv [H, N, R / r, D / c] of blocks c columns wide: one a 16-column slab (equal along
  // the rows' blocks and within each run of 16 / c column blocks).
  auto one_a_slab = [](const torch::Tensor& inv, int64_t c) {
    const auto x = inv.to(torch::kCPU);
    const auto slabs = x.reshape({x.size(0), x.size(1), x.size(2), x.size(3) / (16 / c), 16 / c});
    return slabs.eq(slabs.narrow(2, 0, 1).narrow(4, 0, 1)).all().item<bool>();
  };
  for (torch::Dtype dt : {torch::kBFloat16, torch::kHalf})
    for (int64_t Dv : {int64_t{128}, int64_t{64}}) {
      const auto [q, k, v, g, beta] = chunk_in(B, T, H, Dk, Dv, dt);
      const hh::kernels::ChunkGrid grid{N, per, {}};
      const auto fo = hh::kernels::chunk_factors(k, v, g, beta, grid, q, scale);
      const auto fu = hh::kernels::chunk_factors(k, v, g, beta, grid, q, scale, nullptr, hh::kernels::UForm::kFloat16Columns);
      const auto s0 = (0.5 * torch::randn({B, H, Dk, Dv}, kF64)).to(f32);
      // history: 0 none, 1 S16 and M16, 2 S16 alone, 3 M16 alone.
      auto args = [&](int64_t segment, bool u16, int history) {
        hh::kernels::LowRankScanArgs a;
        a.A = fo.kdecay, a.B = fo.W, a.decay = fo.decay, a.bound = fo.bound, a.y0 = s0;
        a.U = u16 ? fu.U : fo.U;
        if (u16) a.U_inv = fu.U_inv;
        a.precision = hh::kernels::ScanPrecision::kBlockFloat16;
        a.segment = segment;
        a.output.Qd = fo.Qd, a.output.Aq = fo.Aq, a.output.aq_inv = fo.aq_inv;
        a.output.o = torch::empty({B, T, H, Dv}, kCuda.dtype(dt));
        a.output.grid = grid, a.output.B = B, a.output.T = T;
        if (history == 1 || history == 2)
          a.S16 = torch::empty({H, N, Dk, Dv}, f16), a.S_inv = torch::empty({H, N, Dk / 16, Dv / 16}, f32);
        if (history == 1 || history == 3)
          a.M16 = torch::empty({H, N, C, Dv}, f16), a.M_inv = torch::empty({H, N, C / 16, Dv / 8}, f32);
        return a;
      };
      for (int64_t segment : {int64_t{0}, int64_t{2}}) {
        const std::string how = std::string(c10::toString(dt)) + " Dv=" + std::to_string(Dv) +
                                (segment == 0 ? ", whole sequences" : ", segments of 2 chunks");
        hh::kernels::set_scan_columns(32);
        hh::kernels::LowRankScanArgs blocks = args(segment, false, 1);
        hh::kernels::low_rank_scan(blocks, {0, per, 2 * per});
        hh::kernels::set_scan_columns(0);
        poison_allocator();
        hh::kernels::LowRankScanArgs col = args(segment, true, 1);
        const int64_t launches = hh::kernels::column_scan_launches();
        const auto fin = hh::kernels::low_rank_scan(col, {0, per, 2 * per});
        EXPECT_EQ(hh::kernels::column_scan_launches() - launches, 1) << how << ": the column scan";
        hh::kernels::LowRankScanArgs plain = args(segment, true, 0);
        const auto fin_plain = hh::kernels::low_rank_scan(plain, {0, per, 2 * per});
        EXPECT_TRUE(torch::equal(col.output.o, plain.output.o)) << how << ": o";
        EXPECT_TRUE(torch::equal(fin, fin_plain)) << how << ": the final state";
        const double es = rel_err(from_block_f16(col.S16, col.S_inv), from_block_f16(blocks.S16, blocks.S_inv)),
                     em = rel_err(from_block_f16(col.M16, col.M_inv, 16, 8), from_block_f16(blocks.M16, blocks.M_inv, 16, 8));
        EXPECT_LT(es, 3e-3) << how << ": S16";
        EXPECT_LT(em, 1e-2) << how << ": M16";
        std::printf("[ measured ] %s, the column scan's history against the blocks': S %.3g, M %.3g\n", how.c_str(), es, em);
        EXPECT_TRUE(in_range(col.S16, Dk, 16)) << how << ": S16's slabs";
        EXPECT_TRUE(in_range(col.M16, C, 16)) << how << ": M16's slabs";
        EXPECT_TRUE(powers_of_two(col.S_inv)) << how << ": S16's scales";
        EXPECT_TRUE(powers_of_two(col.M_inv)) << how << ": M16's scales";
        EXPECT_TRUE(one_a_slab(col.S_inv, 16)) << how << ": S16's scales a slab";
        EXPECT_TRUE(one_a_slab(col.M_inv, 8)) << how << ": M16's scales a slab";
        // Either history alone (each staging tile's copy then waited for before the next write of that tile
        // alone): the same bits, every element written.
        poison_allocator();
        hh::kernels::LowRankScanArgs s_only = args(segment, true, 2);
        hh::kernels::low_rank_scan(s_only, {0, per, 2 * per});
        EXPECT_TRUE(torch::equal(s_only.S16, col.S16) && torch::equal(s_only.S_inv, col.S_inv)) << how << ": S16 alone";
        hh::kernels::LowRankScanArgs m_only = args(segment, true, 3);
        hh::kernels::low_rank_scan(m_only, {0, per, 2 * per});
        EXPECT_TRUE(torch::equal(m_only.M16, col.M16) && torch::equal(m_only.M_inv, col.M_inv)) << how << ": M16 alone";
        EXPECT_TRUE(torch::equal(s_only.output.o, plain.output.o) && torch::equal(m_only.output.o, plain.output.o)) << how << ": o";
      }
    }
}

// The rule with its output written by the scan (the default) against the output kernel on the scan's
// history (kernels::set_output_in_scan(false)): the same output, final state and gradients of q, k and
// v bit for bit, for a regular batch and for packed sequences (the chunks' slots by gather, an empty
// sequence among them), with and without a graph (which keeps the states for the backward). dg and
// dbeta sum a chunk's terms by atomic adds in chunk_backward, in an order that varies from run to run,
// so those two agree to float32's rounding of their sums instead.
TEST(CudaGdn, OutputInTheScanLeavesTheRuleUnchanged) {
  ASSERT_TRUE(torch::cuda::is_available());
  ASSERT_TRUE(hh::kernels::output_in_scan_enabled());
  // The scan in blocks of 32 columns, whose products are chunk_output_f16's (the whole-head column scan
  // scales the state by rows: OutputInTheScanEqualsChunkOutputF16BitForBit and
  // ForwardWithTheChunkKernelsEqualsTheRecurrence check it).
  hh::kernels::set_scan_columns(32);
  struct Case {
    int64_t B, T;
    std::vector<int64_t> cu;
  };
  for (const Case& c : {Case{2, 777, {}}, Case{1, 1000, {0, 100, 100, 164, 1000}}}) {
    const int64_t S = c.cu.empty() ? c.B : static_cast<int64_t>(c.cu.size()) - 1;
    const Inputs d = on_device(make_inputs(c.B, c.T, 3, 128, S), torch::kBFloat16);
    const auto dO = torch::randn_like(d.v);
    auto run = [&](bool in_scan, bool grad) {
      hh::kernels::set_output_in_scan(in_scan);
      std::vector<torch::Tensor> x = {d.q, d.k, d.v, d.g, d.beta};
      if (grad)
        for (auto& t : x) t = t.detach().requires_grad_(true);
      poison_allocator();
      std::vector<torch::Tensor> out;
      {
        std::optional<torch::NoGradGuard> no_grad;
        if (!grad) no_grad.emplace();
        const auto r = gdn_chunked_scan(x[0], x[1], x[2], x[3], x[4], d.s0, 0.1, 64, c.cu);
        out = {r.o.detach(), r.state.detach()};
        if (grad) {
          torch::autograd::backward({r.o}, {dO});
          for (auto& t : x) out.push_back(t.grad());
        }
      }
      hh::kernels::set_output_in_scan(true);
      return out;
    };
    for (bool grad : {false, true}) {
      const auto in = run(true, grad), apart = run(false, grad);
      const char* names[] = {"o", "state", "dq", "dk", "dv", "dg", "dbeta"};
      ASSERT_EQ(in.size(), apart.size());
      for (size_t i = 0; i < in.size(); ++i) {
        const std::string how = std::string(c.cu.empty() ? "regular batch" : "packed sequences") +
                                (grad ? ", with a graph: " : ": ") + names[i];
        if (i < 5) EXPECT_TRUE(torch::equal(in[i], apart[i])) << how;
        else EXPECT_LT(rel_err(in[i], apart[i]), 1e-5) << how;
      }
    }
  }
  hh::kernels::set_scan_columns(0);
}

// The rule's backward with its reverse scan forming the direct term (the default) against
// chunk_state_direct forming it (kernels::set_direct_in_scan(false)): the same gradients of q, k, v, g,
// beta and the initial state to the 16-bit products' rounding (the bound the gradient tests against
// float64 take), for regular batches and for packed sequences
// (an empty one among them), with an initial state and the final state's gradient given. Where a chunk's
// slots are consecutive tokens (T a multiple of 64, or one sequence) the reverse scan reads dO in place,
// else grad_to_grid_f16's copy: both paths through the rule's backward.
TEST(CudaGdn, DirectTermInTheReverseScanKeepsTheGradients) {
  ASSERT_TRUE(torch::cuda::is_available());
  ASSERT_TRUE(hh::kernels::direct_in_scan_enabled());
  struct Case {
    int64_t B, T;
    std::vector<int64_t> cu;
  };
  for (const Case& c : {Case{2, 777, {}}, Case{1, 1000, {0, 100, 100, 164, 1000}}, Case{2, 256, {}}, Case{1, 150, {}}}) {
    const int64_t S = c.cu.empty() ? c.B : static_cast<int64_t>(c.cu.size()) - 1;
    const bool in_place = c.cu.empty() && (c.T % 64 == 0 || c.B == 1);
    const std::string what = "B=" + std::to_string(c.B) + " T=" + std::to_string(c.T) + (c.cu.empty() ? "" : " packed");
    const Inputs d = on_device(make_inputs(c.B, c.T, 3, 128, S), torch::kBFloat16);
    const auto dO = torch::randn_like(d.v);
    const auto dfin = torch::randn_like(d.s0);
    auto run = [&](bool in_scan) {
      hh::kernels::set_direct_in_scan(in_scan);
      std::vector<torch::Tensor> x = {d.q, d.k, d.v, d.g, d.beta, d.s0};
      for (auto& t : x) t = t.detach().requires_grad_(true);
      poison_allocator();
      const auto forms = hh::kernels::chunk_backward_launches();
      const int64_t reads = hh::kernels::dO_in_place_scans();
      const auto r = gdn_chunked_scan(x[0], x[1], x[2], x[3], x[4], x[5], 0.1, 64, c.cu);
      torch::autograd::backward({r.o, r.state}, {dO, dfin});
      const auto after = hh::kernels::chunk_backward_launches();
      EXPECT_EQ(hh::kernels::dO_in_place_scans() - reads, in_scan && in_place ? 1 : 0) << what << ": dO read in place";
      // With the direct term in the reverse scan, chunk_backward reads M, dM and T (form 2); apart, the
      // forward keeps neither M nor T, and it forms M and dM itself (form 0).
      for (size_t form = 0; form < forms.size(); ++form)
        EXPECT_EQ(after[form] - forms[form], form == (in_scan ? 2u : 0u) ? 1 : 0)
            << what << ", direct term in the scan " << in_scan << ": chunk_backward's form " << form;
      std::vector<torch::Tensor> out;
      for (auto& t : x) out.push_back(t.grad());
      hh::kernels::set_direct_in_scan(true);
      return out;
    };
    const auto in = run(true), apart = run(false);
    const char* names[] = {"dq", "dk", "dv", "dg", "dbeta", "ds0"};
    for (size_t i = 0; i < in.size(); ++i)
      EXPECT_LT(rel_err(in[i], apart[i]), 1e-2) << what << ": " << names[i];
  }
}

// [H, B * per, 64, ...] -> [B, T, H, ...]: on_grid's inverse (padding slots dropped).
torch::Tensor off_grid(const torch::Tensor& x, int64_t B, int64_t T) {
  std::vector<int64_t> shape = {x.size(0), B, x.size(1) / B * 64}, perm = {1, 2, 0};
  for (int64_t i = 3; i < x.dim(); ++i) shape.push_back(x.size(i));
  for (int64_t i = 3; i < x.dim(); ++i) perm.push_back(i);
  return x.reshape(shape).narrow(2, 0, T).permute(perm);
}

// The backward's chunk kernels against float64 autograd through the chunk-local function, with
// arbitrary start states S_n and end-state gradients dS_n held fixed (not from a scan):
//   chunk_state_direct = d/dS_n sum <scale dO, O>,
//   chunk_backward     = d/d(q, k, v, g, beta) of sum_n <scale dO_n, O_n> + <dS_n, S_{n+1}>.
// T not a multiple of 64 (the last chunks' padding slots), B = 2, Dk != Dv, both 16-bit dtypes,
// outputs from a NaN-poisoned allocator.
TEST(CudaGdn, BackwardChunkKernelsEqualAutogradInFloat64) {
  ASSERT_TRUE(torch::cuda::is_available());
  const int64_t B = 2, T = 150, H = 3, per = 3, N = B * per, C = 64;
  const double scale = 0.1;
  for_each_chunk_case([&](torch::Dtype dt, int64_t Dk, int64_t Dv, const std::string& what) {
    const auto dev = kCuda.dtype(dt);
    const auto [q, k, v, g, beta] = chunk_in(B, T, H, Dk, Dv, dt);
    const auto dO = torch::randn({B, T, H, Dv}, kF64).to(dev);
    const auto S = 0.5 * torch::randn({H, N, Dk, Dv}, kF64), dS = torch::randn({H, N, Dk, Dv}, kF64);
    auto f64 = [](const torch::Tensor& x) { return x.to(torch::kCPU, torch::kDouble); };

    // The chunk-local function in float64 on the grid, by autograd.
    auto Q = on_grid(f64(q), per).requires_grad_(true), K = on_grid(f64(k), per).requires_grad_(true);
    auto V = on_grid(f64(v), per).requires_grad_(true), Gi = on_grid(f64(g), per).requires_grad_(true);
    auto Bt = on_grid(f64(beta), per).requires_grad_(true);
    const auto Sg = S.clone().requires_grad_(true);
    const auto G = Gi.cumsum(-1);
    const auto diff = G.unsqueeze(-1) - G.unsqueeze(-2);
    const auto strict = torch::ones({C, C}, torch::kBool).tril(-1), incl = torch::ones({C, C}, torch::kBool).tril();
    const auto gamma = diff.masked_fill(incl.logical_not(), -std::numeric_limits<double>::infinity()).exp();
    const auto Lm = (Bt.unsqueeze(-1) * torch::matmul(K, K.transpose(-1, -2)) * gamma).masked_fill(strict.logical_not(), 0.0);
    const auto Tinv = torch::inverse(torch::eye(C, kF64) + Lm);
    const auto W = torch::matmul(Tinv, (Bt * G.exp()).unsqueeze(-1) * K), U = torch::matmul(Tinv, Bt.unsqueeze(-1) * V);
    const auto M = U - torch::matmul(W, Sg);
    const auto O = G.exp().unsqueeze(-1) * torch::matmul(Q, Sg) + torch::matmul(torch::matmul(Q, K.transpose(-1, -2)) * gamma, M);
    const auto last = G.select(-1, C - 1);
    const auto Snext = last.exp().unsqueeze(-1).unsqueeze(-1) * Sg +
                       torch::matmul(((last.unsqueeze(-1) - G).exp().unsqueeze(-1) * K).transpose(-1, -2), M);
    const auto dOg = scale * on_grid(f64(dO), per);
    const auto out_term = (dOg * O).sum();
    const auto Z = torch::autograd::grad({out_term}, {Sg}, {}, /*retain_graph=*/true)[0];
    const auto grads = torch::autograd::grad({out_term + (dS * Snext).sum()}, {Q, K, V, Gi, Bt});

    const hh::kernels::ChunkGrid grid{N, per, {}};
    const auto f = hh::kernels::chunk_factors(k, v, g, beta, grid);
    poison_allocator();
    const auto z = hh::kernels::chunk_state_direct(q, k, g, f.W, dO, grid, scale);
    EXPECT_LT(rel_err(z, Z), 3e-3) << what << " (direct term)";  // block float16 products
    poison_allocator();
    const auto [S16, S_inv] = to_block_f16(S);  // the states as the scans hand them over
    const auto [dS16, dS_inv] = to_block_f16(dS);
    // Given also the new values as the scans hand them over (the reverse scan's negated: -dM with
    // dM = diag(kd) K dS + A^T scale dO), the kernel reads M and dM instead of forming them.
    const auto Mv = M.detach();
    const auto dM = ((last.unsqueeze(-1) - G).exp().unsqueeze(-1) * torch::matmul(K, dS) +
                     torch::matmul((torch::matmul(Q, K.transpose(-1, -2)) * gamma).transpose(-1, -2), dOg)).detach();
    const auto [M16, M_inv] = to_block_f16(Mv, 16, 8);
    const auto [ndM16, ndM_inv] = to_block_f16(-dM, 16, 8);
    // Given also T from the forward's chunk_factors (keep_t), the kernel reads it instead of inverting.
    const auto T16 = hh::kernels::chunk_factors(k, v, g, beta, grid, q, scale, nullptr, hh::kernels::UForm::kFloat32, true).T16;
    for (int form : {0, 1, 2}) {
      const bool hist = form > 0;
      poison_allocator();
      const auto d = form == 2 ? hh::kernels::chunk_backward(q, k, v, g, beta, S16, S_inv, dS16, dS_inv, dO, grid, scale, M16,
                                                             M_inv, ndM16, ndM_inv, T16)
                     : hist    ? hh::kernels::chunk_backward(q, k, v, g, beta, S16, S_inv, dS16, dS_inv, dO, grid, scale, M16,
                                                             M_inv, ndM16, ndM_inv)
                               : hh::kernels::chunk_backward(q, k, v, g, beta, S16, S_inv, dS16, dS_inv, dO, grid, scale);
      const torch::Tensor got[] = {d.dq, d.dk, d.dv, d.dg, d.dbeta};
      const char* names[] = {"dq", "dk", "dv", "dg", "dbeta"};
      for (size_t i = 0; i < 5; ++i) {
        const std::string how = what + (form == 2 ? " (M, dM and T given) " : hist ? " (M and dM given) " : " ") + names[i];
        EXPECT_EQ(got[i].scalar_type(), i < 3 ? dt : torch::kFloat) << how;
        // Products on 16-bit operands of the inputs' kind (bfloat16: ~3e-3) and, for dq, dk, dv, the 16-bit rounding.
        EXPECT_LT(rel_err(got[i], off_grid(grads[i], B, T)), 1e-2) << how;
      }
    }
    EXPECT_THROW(hh::kernels::chunk_backward(q, k, v, g, beta, S16, S_inv, dS16, dS_inv, dO, grid, scale, M16, M_inv),
                 std::invalid_argument)
        << what << ": M without dM";
    EXPECT_THROW(hh::kernels::chunk_backward(q, k, v, g, beta, S16, S_inv, dS16, dS_inv, dO, grid, scale, {}, {}, {}, {}, T16),
                 std::invalid_argument)
        << what << ": T without M and dM";
  });
}

// Random inputs of chunk_backward's form that reads T on a grid of N chunks, as the scans (states and new
// values in block float16) and the forward's chunk_factors (T) hand them over; run() is that backward.
struct BackwardCase {
  torch::Tensor q, k, v, g, beta, dO, S16, S_inv, dS16, dS_inv, M16, M_inv, dM16, dM_inv, T16;
  hh::kernels::ChunkInputGrads run(const hh::kernels::ChunkGrid& grid, double scale) const {
    return hh::kernels::chunk_backward(q, k, v, g, beta, S16, S_inv, dS16, dS_inv, dO, grid, scale, M16, M_inv, dM16, dM_inv, T16);
  }
};
BackwardCase backward_case(int64_t B, int64_t T, int64_t H, int64_t Dk, int64_t Dv, torch::Dtype dt,
                           const hh::kernels::ChunkGrid& grid, double scale) {
  constexpr int64_t C = 64;
  const int64_t N = grid.N;
  BackwardCase c;
  const ChunkIn in = chunk_in(B, T, H, Dk, Dv, dt);
  c.q = in.q, c.k = in.k, c.v = in.v, c.g = in.g, c.beta = in.beta;
  c.dO = torch::randn({B, T, H, Dv}, kF64).to(kCuda.dtype(dt));
  std::tie(c.S16, c.S_inv) = to_block_f16(0.5 * torch::randn({H, N, Dk, Dv}, kF64));
  std::tie(c.dS16, c.dS_inv) = to_block_f16(torch::randn({H, N, Dk, Dv}, kF64));
  std::tie(c.M16, c.M_inv) = to_block_f16(torch::randn({H, N, C, Dv}, kF64), 16, 8);
  std::tie(c.dM16, c.dM_inv) = to_block_f16(torch::randn({H, N, C, Dv}, kF64), 16, 8);
  c.T16 = hh::kernels::chunk_factors(c.k, c.v, c.g, c.beta, grid, c.q, scale, nullptr, hh::kernels::UForm::kFloat32, true).T16;
  return c;
}

// chunk_backward's form that reads T with Dk = Dv = 128, one block an SM taking chunks in turn
// (set_backward_chunks_in_turn), against one block a chunk (the default): over three times as many (chunk, head)
// pairs as SMs, so that every block takes several chunks and the last turn leaves some blocks without one;
// short last chunks; B = 2 regular sequences, and packed ones on a gather grid (an empty sequence, one
// shorter than a chunk, one of exactly a chunk); both 16-bit dtypes; outputs from a NaN-poisoned allocator.
// Each chunk's arithmetic is the same, so dq, dk and dv are the same bits; dg and dbeta take sums that warps
// add in shared memory in whatever order they come.
TEST(CudaGdn, BackwardChunksInTurnEqualOneBlockAChunk) {
  ASSERT_TRUE(torch::cuda::is_available());
  const int64_t sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount, H = 2, D = 128, C = 64;
  const int64_t per = (3 * sms) / (2 * H) + 2;  // chunks of each regular sequence
  for (torch::Dtype dt : {torch::kBFloat16, torch::kHalf})
    for (bool packed : {false, true}) {
      const std::string what = std::string(c10::toString(dt)) + (packed ? " packed" : " regular");
      // Regular: B sequences of T tokens (the last chunk 23 long). Packed: one row of these lengths.
      const auto [B, T, N, gather] = turns_grid(packed, per, {100, 0, 40, C * (3 * sms / H) + 17, C, 1});
      ASSERT_GT(N * H, 3 * sms) << what;
      const hh::kernels::ChunkGrid grid{N, packed ? 0 : per, gather};
      const BackwardCase c = backward_case(B, T, H, D, D, dt, grid, 0.1);
      hh::kernels::ChunkInputGrads d[2];  // chunks in turn, then one block a chunk
      for (int i : {0, 1}) {
        hh::kernels::set_backward_chunks_in_turn(i == 0);
        const int64_t before = hh::kernels::backward_chunks_in_turn_launches();
        poison_allocator();
        d[i] = c.run(grid, 0.1);
        hh::kernels::set_backward_chunks_in_turn(false);
        EXPECT_EQ(hh::kernels::backward_chunks_in_turn_launches() - before, i == 0 ? 1 : 0) << what << ": which kernel ran";
      }
      const auto &turns = d[0], &each = d[1];
      EXPECT_TRUE(torch::equal(turns.dq, each.dq)) << what << ": dq";
      EXPECT_TRUE(torch::equal(turns.dk, each.dk)) << what << ": dk";
      EXPECT_TRUE(torch::equal(turns.dv, each.dv)) << what << ": dv";
      EXPECT_FALSE(each.dq.isnan().any().item<bool>()) << what << ": dq written";
      EXPECT_LT(rel_err(turns.dg, each.dg), 1e-5) << what << ": dg";
      EXPECT_LT(rel_err(turns.dbeta, each.dbeta), 1e-5) << what << ": dbeta";
    }
}

// chunk_factors reads g and beta in the inputs' 16-bit dtype where they lie: every factor the same bits as
// with the float32 gates that are those values (the conversion is exact), T kept or not; and through the
// rule's op, whose forward passes the 16-bit gates (its backward converts them for chunk_backward), the
// output, the final state and every gradient. T not a multiple of 64, B = 2, both 16-bit dtypes, every
// pair of head sizes, outputs from a NaN-poisoned allocator. A gate of another dtype than float32 or q's
// is refused by name.
TEST(CudaGdn, GatesInTheInputsDtypeGiveTheBitsOfTheirFloat32Values) {
  ASSERT_TRUE(torch::cuda::is_available());
  const int64_t B = 2, T = 150, H = 3, per = 3, N = B * per;
  const double scale = 0.1;
  const hh::kernels::ChunkGrid grid{N, per, {}};
  for_each_chunk_case([&](torch::Dtype dt, int64_t Dk, int64_t Dv, const std::string& what) {
    const auto [q, k, v, g0, beta0] = chunk_in(B, T, H, Dk, Dv, dt);
    const auto g16 = g0.to(dt), b16 = beta0.to(dt);                             // the caller's 16-bit gates
    const auto g32 = g16.to(torch::kFloat), b32 = b16.to(torch::kFloat);        // the same values in float32
    ASSERT_TRUE(torch::equal(g32.to(dt), g16)) << what;
    for (bool keep_t : {false, true}) {
      poison_allocator();
      const auto w = hh::kernels::chunk_factors(k, v, g32, b32, grid, q, scale, nullptr, hh::kernels::UForm::kFloat32, keep_t);
      poison_allocator();
      const auto n = hh::kernels::chunk_factors(k, v, g16, b16, grid, q, scale, nullptr, hh::kernels::UForm::kFloat32, keep_t);
      const std::pair<const char*, std::pair<torch::Tensor, torch::Tensor>> factors[] = {
          {"W", {w.W, n.W}},       {"U", {w.U, n.U}},         {"kdecay", {w.kdecay, n.kdecay}}, {"decay", {w.decay, n.decay}},
          {"bound", {w.bound, n.bound}}, {"Qd", {w.Qd, n.Qd}}, {"Aq", {w.Aq, n.Aq}},              {"aq_inv", {w.aq_inv, n.aq_inv}}};
      for (const auto& [name, x] : factors) EXPECT_TRUE(torch::equal(x.first, x.second)) << what << ": chunk_factors' " << name;
      if (keep_t) {
        EXPECT_TRUE(torch::equal(w.T16, n.T16)) << what << ": chunk_factors' T16";
      }
    }
    // Another 16-bit dtype than q's, and float64, are refused, naming the gate.
    auto refusal = [](const std::function<void()>& f) {
      try {
        f();
      } catch (const std::invalid_argument& e) {
        return std::string(e.what());
      }
      return std::string("(no refusal)");
    };
    const auto other = dt == torch::kBFloat16 ? torch::kHalf : torch::kBFloat16;
    const std::string bad_g = refusal([&] { (void)hh::kernels::chunk_factors(k, v, g0.to(other), b16, grid, q, scale); });
    EXPECT_NE(bad_g.find("hh::kernels::chunk_factors: g must be float32 or"), std::string::npos) << what << ": " << bad_g;
    const std::string bad_beta = refusal([&] {
      (void)hh::kernels::chunk_factors(k, v, g16, beta0.to(torch::kDouble), grid, q, scale);
    });
    EXPECT_NE(bad_beta.find("hh::kernels::chunk_factors: beta must be float32 or"), std::string::npos) << what << ": " << bad_beta;
  });
  // Through the rule's op with its gradients (the chunk kernels' forward and backward): the 16-bit gates
  // against their float32 values, the output, the final state and every gradient (dg and dbeta in the
  // gates' dtype).
  for (torch::Dtype dt : {torch::kBFloat16, torch::kHalf}) {
    const auto [q, k, v, g0, beta0] = chunk_in(B, 256, H, 128, 128, dt);
    const auto s0 = (0.5 * torch::randn({B, H, 128, 128}, kF64)).to(kCuda.dtype(torch::kFloat));
    const auto w_o = torch::randn({B, 256, H, 128}, kCuda.dtype(torch::kFloat));
    auto run = [&](const torch::Tensor& g_in, const torch::Tensor& b_in) {
      std::vector<torch::Tensor> x = {q.detach().requires_grad_(true), k.detach().requires_grad_(true), v.detach().requires_grad_(true),
                                      g_in.detach().requires_grad_(true), b_in.detach().requires_grad_(true)};
      const auto r = gdn_chunked_scan(x[0], x[1], x[2], x[3], x[4], s0, scale);
      auto grads = torch::autograd::grad({(r.o.to(torch::kFloat) * w_o).sum() + r.state.sum()}, x);
      grads.push_back(r.o.detach());
      grads.push_back(r.state.detach());
      return grads;
    };
    const auto g16 = g0.to(dt), b16 = beta0.to(dt);
    const auto narrow = run(g16, b16), wide = run(g16.to(torch::kFloat), b16.to(torch::kFloat));
    const char* names[] = {"dq", "dk", "dv", "dg", "dbeta", "o", "final state"};
    for (size_t i = 0; i < 7; ++i)
      EXPECT_TRUE(torch::equal(narrow[i], wide[i].to(narrow[i].scalar_type())))
          << c10::toString(dt) << " through the op: " << names[i];
    EXPECT_EQ(narrow[3].scalar_type(), dt);
  }
}

// chunk_backward reads g and beta in the inputs' 16-bit dtype where they lie, and writes dg and dbeta in
// their gates' dtypes: dq, dk, dv the same bits as with the float32 gates that are those values (the
// conversion is exact), dg and dbeta those of the float32 gates' results rounded to 16 bits, in every form
// of the kernel (chunks in turn: dg and dbeta sum in the order the warps come, so within a 16-bit step
// there); with one gate of each kind, each gradient in its own gate's dtype. T not
// a multiple of 64, B = 2, both 16-bit dtypes, every pair of head sizes, outputs from a NaN-poisoned
// allocator. A gate of another dtype than float32 or q's is refused by name. (The rule's op, which now
// passes its 16-bit gates to both chunk kernels, is checked against float32 gates in the test above.)
TEST(CudaGdn, BackwardTakesAndGivesGatesInTheInputsDtype) {
  ASSERT_TRUE(torch::cuda::is_available());
  const int64_t B = 2, T = 150, H = 3, per = 3, N = B * per, C = 64;
  const double scale = 0.1;
  const hh::kernels::ChunkGrid grid{N, per, {}};
  for_each_chunk_case([&](torch::Dtype dt, int64_t Dk, int64_t Dv, const std::string& what) {
    const auto [q, k, v, g0, beta0] = chunk_in(B, T, H, Dk, Dv, dt);
    const auto g16 = g0.to(dt), b16 = beta0.to(dt);
    const auto g32 = g16.to(torch::kFloat), b32 = b16.to(torch::kFloat);
    const auto dO = torch::randn({B, T, H, Dv}, kF64).to(kCuda.dtype(dt));
    const auto [S16, S_inv] = to_block_f16(0.5 * torch::randn({H, N, Dk, Dv}, kF64));
    const auto [dS16, dS_inv] = to_block_f16(torch::randn({H, N, Dk, Dv}, kF64));
    const auto [M16, M_inv] = to_block_f16(torch::randn({H, N, C, Dv}, kF64), 16, 8);
    const auto [dM16, dM_inv] = to_block_f16(torch::randn({H, N, C, Dv}, kF64), 16, 8);
    const auto T16 = hh::kernels::chunk_factors(k, v, g32, b32, grid, q, scale, nullptr, hh::kernels::UForm::kFloat32, true).T16;
    // Forms: M and dM formed in the kernel; read; T read too; T read with chunks in turn (Dk = Dv = 128).
    for (int form : {0, 1, 2, 3}) {
      if (form == 3 && (Dk != 128 || Dv != 128)) continue;
      auto run = [&](const torch::Tensor& g, const torch::Tensor& beta) {
        hh::kernels::set_backward_chunks_in_turn(form == 3);
        poison_allocator();
        const auto d = form == 0 ? hh::kernels::chunk_backward(q, k, v, g, beta, S16, S_inv, dS16, dS_inv, dO, grid, scale)
                       : form == 1 ? hh::kernels::chunk_backward(q, k, v, g, beta, S16, S_inv, dS16, dS_inv, dO, grid, scale, M16,
                                                                 M_inv, dM16, dM_inv)
                                   : hh::kernels::chunk_backward(q, k, v, g, beta, S16, S_inv, dS16, dS_inv, dO, grid, scale, M16,
                                                                 M_inv, dM16, dM_inv, T16);
        hh::kernels::set_backward_chunks_in_turn(false);
        return d;
      };
      const std::string how = what + " form " + std::to_string(form);
      const auto wide = run(g32, b32), narrow = run(g16, b16);
      EXPECT_TRUE(torch::equal(wide.dq, narrow.dq)) << how << ": dq";
      EXPECT_TRUE(torch::equal(wide.dk, narrow.dk)) << how << ": dk";
      EXPECT_TRUE(torch::equal(wide.dv, narrow.dv)) << how << ": dv";
      // dg and dbeta come in their gates' dtypes: float32 from float32 gates; from 16-bit ones, the float32
      // results rounded where stored, the bits of converting the float32 gates' results after the kernel.
      EXPECT_EQ(wide.dg.scalar_type(), torch::kFloat) << how;
      EXPECT_EQ(wide.dbeta.scalar_type(), torch::kFloat) << how;
      ASSERT_EQ(narrow.dg.scalar_type(), dt) << how << ": dg";
      ASSERT_EQ(narrow.dbeta.scalar_type(), dt) << how << ": dbeta";
      if (form == 3) {  // the float32 sums may differ in their last bit, and so round apart: within one 16-bit step
        const double step = dt == torch::kBFloat16 ? 1.0 / 128 : 1.0 / 1024;
        EXPECT_LT(rel_err(narrow.dg.to(torch::kFloat), wide.dg), step) << how << ": dg";
        EXPECT_LT(rel_err(narrow.dbeta.to(torch::kFloat), wide.dbeta), step) << how << ": dbeta";
      } else {
        EXPECT_TRUE(torch::equal(narrow.dg, wide.dg.to(dt))) << how << ": dg";
        EXPECT_TRUE(torch::equal(narrow.dbeta, wide.dbeta.to(dt))) << how << ": dbeta";
      }
      if (form == 0) {  // one gate of each kind: each gradient in its own gate's dtype
        const auto mixed = run(g32, b16);
        EXPECT_EQ(mixed.dg.scalar_type(), torch::kFloat) << how;
        EXPECT_TRUE(torch::equal(mixed.dg, wide.dg)) << how << ": dg with a 16-bit beta";
        EXPECT_TRUE(torch::equal(mixed.dbeta, wide.dbeta.to(dt))) << how << ": dbeta in 16 bits beside a float32 g";
      }
    }
    std::string bad_beta = "(no refusal)";
    try {
      (void)hh::kernels::chunk_backward(q, k, v, g16, beta0.to(torch::kDouble), S16, S_inv, dS16, dS_inv, dO, grid, scale);
    } catch (const std::invalid_argument& e) {
      bad_beta = e.what();
    }
    EXPECT_NE(bad_beta.find("hh::kernels::chunk_backward: beta must be float32 or"), std::string::npos) << what << ": " << bad_beta;
  });
}

// grad_to_grid_f16: the output's gradient on the chunk grid in block float16, one power-of-two scale a
// chunk and head; bfloat16 and float16 values within 2^-28 of the chunk's largest magnitude are kept
// exactly. Magnitudes spread over 2^-13 .. 2^13 within each chunk, padding slots zero, outputs from a
// NaN-poisoned allocator.
TEST(CudaGdn, GradientOnTheChunkGridInBlockFloat16IsExact) {
  ASSERT_TRUE(torch::cuda::is_available());
  const int64_t B = 2, T = 150, H = 3, per = 3, N = B * per;
  for (torch::Dtype dt : {torch::kBFloat16, torch::kHalf})
    for (int64_t Dv : {64, 128}) {
      const std::string what = std::string(c10::toString(dt)) + " Dv=" + std::to_string(Dv);
      const auto sign = torch::randint(0, 2, {B, T, H, Dv}, kF64).mul_(2).sub_(1);
      const auto x = (sign * (0.5 + torch::rand({B, T, H, Dv}, kF64)) * torch::exp2(torch::randint(-12, 13, {B, T, H, Dv}, kF64)))
                         .to(kCuda.dtype(dt));
      poison_allocator();
      const auto r = hh::kernels::grad_to_grid_f16(x, hh::kernels::ChunkGrid{N, per, {}});
      ASSERT_EQ(r.x16.sizes(), torch::IntArrayRef({H, N, 64, Dv})) << what;
      ASSERT_EQ(r.inv.sizes(), torch::IntArrayRef({H, N})) << what;
      const auto inv = r.inv.to(torch::kCPU, torch::kDouble);
      EXPECT_TRUE(torch::equal(torch::exp2(torch::log2(inv).round()), inv)) << what << ": scales are powers of two";
      const auto want = on_grid(x.to(torch::kCPU, torch::kDouble), per);  // padding slots zero
      const auto got = r.x16.to(torch::kCPU, torch::kDouble) * inv.unsqueeze(-1).unsqueeze(-1);
      EXPECT_TRUE(torch::equal(got, want)) << what << ": max difference " << (got - want).abs().max().item<double>();
      // Each chunk's largest magnitude lands in [2^14, 2^15).
      const auto top = r.x16.to(torch::kCPU, torch::kDouble).abs().amax({-2, -1});
      EXPECT_TRUE((top >= 16384).all().item<bool>() && (top < 32768).all().item<bool>()) << what;
    }
  EXPECT_THROW(hh::kernels::grad_to_grid_f16(torch::zeros({1, 64, 1, 32}, kCuda.dtype(torch::kBFloat16)), {1, 1, {}}),
               std::invalid_argument);
}

// The backward's reverse block float16 scan over chunk_factors' output f (A = W, B = kdecay, its decays and
// norm bounds) from the end-state gradients y0 [S, H, Dk, Dv], in pieces of `segment` chunks, writing its
// history into NaN-filled S16, S_inv, M16 and M_inv; the direct term from d16 where given (else the caller
// gives Z).
hh::kernels::LowRankScanArgs reverse_scan_args(const hh::kernels::ChunkFactors& f, const hh::kernels::GridF16* d16,
                                               const torch::Tensor& y0, int64_t segment) {
  const int64_t H = f.W.size(0), N = f.W.size(1), C = f.W.size(2), Dk = f.W.size(3), Dv = y0.size(3);
  const double nan = std::numeric_limits<double>::quiet_NaN();
  const auto f32 = kCuda.dtype(torch::kFloat), f16 = kCuda.dtype(torch::kHalf);
  hh::kernels::LowRankScanArgs a;
  a.A = f.W;
  a.B = f.kdecay;
  a.decay = f.decay;
  a.bound = f.bound;
  if (d16 != nullptr) a.direct.Qd = f.Qd, a.direct.Aq = f.Aq, a.direct.aq_inv = f.aq_inv, a.direct.dO16 = d16->x16, a.direct.do_inv = d16->inv;
  a.y0 = y0;
  a.S16 = torch::full({H, N, Dk, Dv}, nan, f16);
  a.S_inv = torch::full({H, N, Dk / 16, Dv / 16}, nan, f32);
  a.M16 = torch::full({H, N, C, Dv}, nan, f16);
  a.M_inv = torch::full({H, N, C / 16, Dv / 8}, nan, f32);
  a.reverse = true;
  a.precision = hh::kernels::ScanPrecision::kBlockFloat16;
  a.segment = segment;
  return a;
}

// The reverse scan forming each chunk's direct term from chunk_factors' output factors and the output's
// gradient in block float16 (LowRankScanArgs::direct), against the reverse recursion in float64
//   dS_end_n = Y,  Y <- e^{G_C} Y - W^T (kdecay Y) + scale (diag(e^G) Q - A W)^T dO_n,
// and against the same scan on chunk_state_direct's Z. Both column widths (and at Dk = 128 the column
// scan, a head a block), whole sequences and pieces, T not a multiple of 64, B = 2, both 16-bit dtypes
// and all head sizes.
TEST(CudaGdn, ReverseScanFormsTheDirectTermFromTheOutputFactors) {
  ASSERT_TRUE(torch::cuda::is_available());
  const int64_t B = 2, T = 150, H = 3, per = 3, N = B * per, C = 64;
  const double scale = 0.1;
  const std::vector<int64_t> offsets = {0, per, 2 * per};
  for_each_chunk_case([&](torch::Dtype dt, int64_t Dk, int64_t Dv, const std::string& what) {
    const auto f32 = kCuda.dtype(torch::kFloat);
    const auto [q, k, v, g, beta] = chunk_in(B, T, H, Dk, Dv, dt);
    const auto dO = torch::randn({B, T, H, Dv}, kF64).to(kCuda.dtype(dt));
    const auto dfin = torch::randn({B, H, Dk, Dv}, kF64);
    auto f64 = [](const torch::Tensor& x) { return x.to(torch::kCPU, torch::kDouble); };

    // The reverse recursion in float64 on the grid.
    const auto Q = on_grid(f64(q), per), K = on_grid(f64(k), per), V = on_grid(f64(v), per);
    const auto G = on_grid(f64(g), per).cumsum(-1), Bt = on_grid(f64(beta), per), dOg = scale * on_grid(f64(dO), per);
    const auto diff = G.unsqueeze(-1) - G.unsqueeze(-2);
    const auto strict = torch::ones({C, C}, torch::kBool).tril(-1), incl = torch::ones({C, C}, torch::kBool).tril();
    const auto Lm = (Bt.unsqueeze(-1) * torch::matmul(K, K.transpose(-1, -2)) * diff.exp()).masked_fill(strict.logical_not(), 0.0);
    const auto W = torch::matmul(torch::inverse(torch::eye(C, kF64) + Lm), (Bt * G.exp()).unsqueeze(-1) * K);
    const auto A = (torch::matmul(Q, K.transpose(-1, -2)) * diff.exp()).masked_fill(incl.logical_not(), 0.0);
    const auto Z = torch::matmul((G.exp().unsqueeze(-1) * Q - torch::matmul(A, W)).transpose(-1, -2), dOg);
    const auto last = G.select(-1, C - 1);
    const auto Kd = (last.unsqueeze(-1) - G).exp().unsqueeze(-1) * K;
    auto hist = torch::empty({H, N, Dk, Dv}, kF64);
    auto dS0 = torch::empty({B, H, Dk, Dv}, kF64);
    for (int64_t b = 0; b < B; ++b) {
      auto Y = dfin[b].clone();  // [H, Dk, Dv]
      for (int64_t n = offsets[b + 1] - 1; n >= offsets[b]; --n) {
        hist.select(1, n).copy_(Y);
        const auto kn = Kd.select(1, n), wn = W.select(1, n);
        Y = last.select(1, n).exp().view({H, 1, 1}) * Y - torch::matmul(wn.transpose(-1, -2), torch::matmul(kn, Y)) + Z.select(1, n);
      }
      dS0[b].copy_(Y);
    }

    const hh::kernels::ChunkGrid grid{N, per, {}};
    const auto f = hh::kernels::chunk_factors(k, v, g, beta, grid, q, scale);
    for (int columns : {0, 16})
      for (int64_t segment : {int64_t{0}, int64_t{1}}) {
        hh::kernels::set_scan_columns(columns);
        auto scan = [&](bool direct) {
          std::optional<hh::kernels::GridF16> d16;  // dO on the chunk grid: the direct term's input only
          if (direct) d16 = hh::kernels::grad_to_grid_f16(dO, grid);
          hh::kernels::LowRankScanArgs a = reverse_scan_args(f, direct ? &*d16 : nullptr, dfin.to(f32), segment);
          if (!direct) a.Z = hh::kernels::chunk_state_direct(q, k, g, f.W, dO, grid, scale);
          const int64_t launches = hh::kernels::column_scan_launches();
          const auto fin = hh::kernels::low_rank_scan(a, offsets);
          // The column scan (a head a block) takes the direct term at Dk = 128 with the columns automatic.
          EXPECT_EQ(hh::kernels::column_scan_launches() - launches, direct && columns == 0 && Dk == 128 ? 1 : 0)
              << what << " columns " << columns << ": the path taken";
          return std::make_tuple(from_block_f16(a.S16, a.S_inv), fin, from_block_f16(a.M16, a.M_inv, 16, 8));
        };
        const auto [hist_d, fin_d, m_d] = scan(true);
        const auto [hist_z, fin_z, m_z] = scan(false);
        const std::string how = what + " columns " + std::to_string(columns) + " segment " + std::to_string(segment);
        // Block float16 products over three chunks; a piece's warm-up from zero within 2^-20.
        EXPECT_LT(rel_err(hist_d, hist), 3e-3) << how << " (history, direct term in the scan)";
        EXPECT_LT(rel_err(fin_d, dS0), 3e-3) << how << " (dS0, direct term in the scan)";
        EXPECT_LT(rel_err(hist_z, hist), 3e-3) << how << " (history, chunk_state_direct)";
        EXPECT_LT(rel_err(hist_d, hist_z), 3e-3) << how << " (the two paths)";
        // The scan's new values: -dM = -(kdecay dS_end + scale A^T dO) with the direct term, -kdecay dS_end without.
        const auto kd_hist = torch::matmul(Kd, hist);
        EXPECT_LT(rel_err(m_d, -(kd_hist + torch::matmul(A.transpose(-1, -2), dOg))), 3e-3) << how << " (-dM)";
        EXPECT_LT(rel_err(m_z, -kd_hist), 3e-3) << how << " (-kdecay dS_end)";
      }
    hh::kernels::set_scan_columns(0);
  });
  // The direct term is the reverse scan's only: refused with Z, forward, or part of it missing.
  const hh::kernels::ChunkGrid grid{2, 2, {}};  // one sequence of two chunks
  const auto [q, k, v, g, beta] = chunk_in(1, 100, 1, 64, 64, torch::kBFloat16);
  const auto f = hh::kernels::chunk_factors(k, v, g, beta, grid, q, scale);
  const auto d16 = hh::kernels::grad_to_grid_f16(torch::randn({1, 100, 1, 64}, kCuda.dtype(torch::kBFloat16)), grid);
  hh::kernels::LowRankScanArgs a;
  a.A = f.W, a.B = f.kdecay, a.decay = f.decay, a.y0 = torch::zeros({1, 1, 64, 64}, kCuda.dtype(torch::kFloat));
  a.precision = hh::kernels::ScanPrecision::kBlockFloat16;
  a.reverse = true;
  a.direct.Qd = f.Qd, a.direct.Aq = f.Aq, a.direct.aq_inv = f.aq_inv, a.direct.dO16 = d16.x16, a.direct.do_inv = d16.inv;
  EXPECT_NO_THROW(hh::kernels::low_rank_scan(a, {0, 2}));
  auto refused = [&](auto&& change, const char* what) {
    hh::kernels::LowRankScanArgs b = a;
    change(b);
    EXPECT_THROW(hh::kernels::low_rank_scan(b, {0, 2}), std::invalid_argument) << what;
  };
  refused([](auto& b) { b.reverse = false; }, "forward");
  refused([&](auto& b) { b.Z = torch::zeros({1, 2, 64, 64}, kCuda.dtype(torch::kFloat)); }, "with Z");
  refused([](auto& b) { b.direct.do_inv = at::Tensor(); }, "without do_inv");
  refused([](auto& b) { b.direct.dO16 = b.direct.dO16.narrow(-1, 0, 32).contiguous(); }, "dO16 of the wrong width");
}

// The reverse scan given dO as it lies (LowRankScanArgs::direct.dO) against the same scan given dO16 and
// do_inv from grad_to_grid_f16. Where the column scan reads dO in place (one sequence of any length; two of
// a multiple of 64 tokens; Dk = 128), each row of a chunk's tile has its own power of two where dO16 has
// one a chunk: the same values but for the smallest entries' float16 rounding, so the history and dS0
// agree within 1e-4. Elsewhere (two sequences of 150 tokens, whose chunks' slots are not consecutive rows;
// Dk = 64, which the column scan does not take) low_rank_scan forms dO16 itself: bit for bit.
TEST(CudaGdn, ReverseScanReadsDOInPlaceWhereItsChunksAreRows) {
  ASSERT_TRUE(torch::cuda::is_available());
  const int64_t H = 3, C = 64;
  const double scale = 0.1;
  for (auto [B, T] : {std::pair<int64_t, int64_t>{1, 150}, {2, 192}, {2, 150}})
    for_each_chunk_case([&, B = B, T = T](torch::Dtype dt, int64_t Dk, int64_t Dv, const std::string& dims) {
      const std::string what = dims + " B=" + std::to_string(B) + " T=" + std::to_string(T);
      const int64_t per = (T + C - 1) / C, N = B * per;
      std::vector<int64_t> offsets;
      for (int64_t b = 0; b <= B; ++b) offsets.push_back(b * per);
      const auto f32 = kCuda.dtype(torch::kFloat);
      const auto [q, k, v, g, beta] = chunk_in(B, T, H, Dk, Dv, dt);
      // A wide spread of magnitudes across dO's columns, so that the rows' scales differ from a chunk's.
      const auto dO = (torch::randn({B, T, H, Dv}, kF64) * torch::logspace(-6, 2, Dv, 10, kF64)).to(kCuda.dtype(dt));
      const auto dfin = torch::randn({B, H, Dk, Dv}, kF64).to(f32);
      const hh::kernels::ChunkGrid grid{N, per, {}};
      const auto f = hh::kernels::chunk_factors(k, v, g, beta, grid, q, scale);
      for (int64_t segment : {int64_t{0}, int64_t{1}}) {
        const auto d16 = hh::kernels::grad_to_grid_f16(dO, grid);
        hh::kernels::LowRankScanArgs on_grid = reverse_scan_args(f, &d16, dfin, segment);
        hh::kernels::LowRankScanArgs in_place = reverse_scan_args(f, nullptr, dfin, segment);
        in_place.direct.Qd = f.Qd, in_place.direct.Aq = f.Aq, in_place.direct.aq_inv = f.aq_inv;
        in_place.direct.dO = dO, in_place.direct.grid = grid;
        const bool rows = Dk == 128 && (B == 1 || T % C == 0);
        EXPECT_EQ(hh::kernels::reverse_scan_reads_dO_in_place(in_place), rows) << what;
        const auto fin_g = hh::kernels::low_rank_scan(on_grid, offsets);
        const int64_t reads = hh::kernels::dO_in_place_scans();
        const auto fin_p = hh::kernels::low_rank_scan(in_place, offsets);
        EXPECT_EQ(hh::kernels::dO_in_place_scans() - reads, rows ? 1 : 0) << what << ": the scan that read dO in place";
        const std::string how = what + " segment " + std::to_string(segment);
        if (rows) {
          EXPECT_LT(rel_err(from_block_f16(in_place.S16, in_place.S_inv), from_block_f16(on_grid.S16, on_grid.S_inv)), 1e-4) << how;
          EXPECT_LT(rel_err(from_block_f16(in_place.M16, in_place.M_inv, 16, 8), from_block_f16(on_grid.M16, on_grid.M_inv, 16, 8)), 1e-4)
              << how;
          EXPECT_LT(rel_err(fin_p, fin_g), 1e-4) << how;
        } else {
          EXPECT_TRUE(torch::equal(in_place.S16, on_grid.S16) && torch::equal(in_place.S_inv, on_grid.S_inv)) << how;
          EXPECT_TRUE(torch::equal(in_place.M16, on_grid.M16) && torch::equal(in_place.M_inv, on_grid.M_inv)) << how;
          EXPECT_TRUE(torch::equal(fin_p, fin_g)) << how;
        }
      }
    });
  // dO and dO16 are two forms of one input: not both.
  const hh::kernels::ChunkGrid grid{2, 2, {}};
  const auto [q, k, v, g, beta] = chunk_in(1, 100, 1, 128, 128, torch::kBFloat16);
  const auto f = hh::kernels::chunk_factors(k, v, g, beta, grid, q, scale);
  const auto dO = torch::randn({1, 100, 1, 128}, kCuda.dtype(torch::kBFloat16));
  const auto d16 = hh::kernels::grad_to_grid_f16(dO, grid);
  hh::kernels::LowRankScanArgs both = reverse_scan_args(f, &d16, torch::zeros({1, 1, 128, 128}, kCuda.dtype(torch::kFloat)), 0);
  both.direct.dO = dO, both.direct.grid = grid;
  EXPECT_THROW(hh::kernels::low_rank_scan(both, {0, 2}), std::invalid_argument);
}

// The names of the hh::gdn:: profiler ranges (core/attention/gdn.cpp's stages) entered while fn ran,
// on any thread: the backward runs on the autograd engine's thread for the device.
std::set<std::string> gdn_ranges_during(const std::function<void()>& fn) {
  static std::mutex mu;
  static std::set<std::string> seen;
  {
    const std::lock_guard<std::mutex> lock(mu);
    seen.clear();
  }
  const auto handle = at::addGlobalCallback(at::RecordFunctionCallback(
      [](const at::RecordFunction& f) -> std::unique_ptr<at::ObserverContext> {
        const std::string name = f.name();
        if (name.rfind("hh::gdn::", 0) == 0) {
          const std::lock_guard<std::mutex> lock(mu);
          seen.insert(name);
        }
        return nullptr;
      }));
  fn();
  at::removeCallback(handle);
  const std::lock_guard<std::mutex> lock(mu);
  return seen;
}

// The gradients of the whole rule with the backward's chunk kernels (the default for 16-bit CUDA
// inputs) against float64 autograd through the chunked rule and against the LibTorch explicit
// backward: batches with odd T and an initial state, packed sequences (an empty one among them),
// Dk != Dv, both 16-bit dtypes. The kernels' bfloat16 products leave each element of dbeta and dg an
// error relative to the terms it sums, not to itself: the one-token case has B H = 24 of each, so that
// the relative error is a statistic over them (over 2, one near-cancellation exceeded 1e-2).
TEST(CudaGdn, GradientsWithTheBackwardChunkKernelsEqualTheReference) {
  ASSERT_TRUE(torch::cuda::is_available());
  using hh::attention::GdnBackward;
  namespace F = torch::nn::functional;
  const auto nrm = F::NormalizeFuncOptions().dim(-1);
  struct Case {
    int64_t B, T, H, Dk, Dv;
    torch::Dtype dt;
    std::vector<int64_t> cu;
  };
  for (const Case& c : {Case{2, 777, 3, 128, 128, torch::kBFloat16, {}}, Case{3, 130, 2, 64, 128, torch::kHalf, {}},
                        Case{3, 1, 8, 128, 64, torch::kBFloat16, {}},
                        Case{1, 1000, 3, 128, 128, torch::kBFloat16, {0, 100, 100, 164, 1000}}}) {
    const std::string what = "B=" + std::to_string(c.B) + " T=" + std::to_string(c.T) + " Dk=" + std::to_string(c.Dk) +
                             " Dv=" + std::to_string(c.Dv) + " " + std::string(c10::toString(c.dt)) +
                             (c.cu.empty() ? "" : " packed");
    const int64_t S = c.cu.empty() ? c.B : static_cast<int64_t>(c.cu.size()) - 1;
    const auto dev = kCuda.dtype(c.dt), f32 = kCuda.dtype(torch::kFloat);
    std::vector<torch::Tensor> in = {F::normalize(torch::randn({c.B, c.T, c.H, c.Dk}, kF64), nrm).to(dev),
                                     F::normalize(torch::randn({c.B, c.T, c.H, c.Dk}, kF64), nrm).to(dev),
                                     torch::randn({c.B, c.T, c.H, c.Dv}, kF64).to(dev),
                                     (-0.5 * torch::rand({c.B, c.T, c.H}, kF64)).to(f32),
                                     torch::rand({c.B, c.T, c.H}, kF64).to(f32),
                                     (0.5 * torch::randn({S, c.H, c.Dk, c.Dv}, kF64)).to(f32)};
    const auto w_o = torch::randn({c.B, c.T, c.H, c.Dv}, kF64), w_s = torch::randn({S, c.H, c.Dk, c.Dv}, kF64);
    auto run = [&](GdnBackward mode, int64_t segments) {
      hh::attention::set_gdn_backward(mode);
      hh::kernels::set_scan_segments(segments);
      std::vector<torch::Tensor> x;
      for (const auto& t : in) x.push_back(t.detach().requires_grad_(true));
      poison_allocator();
      std::vector<torch::Tensor> grads;
      const auto forms = hh::kernels::chunk_backward_launches();
      const int64_t in_turn = hh::kernels::backward_chunks_in_turn_launches();
      const std::set<std::string> ranges = gdn_ranges_during([&] {
        const auto r = gdn_chunked_scan(x[0], x[1], x[2], x[3], x[4], x[5], 0.1, 64, c.cu);
        grads = torch::autograd::grad({(r.o.to(torch::kFloat) * w_o.to(f32)).sum() + (r.state * w_s.to(f32)).sum()}, x);
      });
      const auto after = hh::kernels::chunk_backward_launches();
      hh::attention::set_gdn_backward(GdnBackward::kKernels);
      hh::kernels::set_scan_segments(hh::kernels::kAutoSegments);
      // The backward took the path asked for: the kernels, or the LibTorch formulas.
      const bool kernels = mode == GdnBackward::kKernels;
      EXPECT_EQ(ranges.count("hh::gdn::chunk_kernels_backward"), kernels ? 1u : 0u) << what;
      EXPECT_EQ(ranges.count("hh::gdn::chunk_local_backward"), kernels ? 0u : 1u) << what;
      // The kernels' backward ran chunk_backward once, in the form that reads M and dM from the scans and T
      // from the forward (the forward keeps T, the direct term is in the reverse scan: the defaults).
      for (size_t form = 0; form < forms.size(); ++form)
        EXPECT_EQ(after[form] - forms[form], kernels && form == 2 ? 1 : 0) << what << ": chunk_backward's form " << form;
      // One block a chunk (the default), not one block an SM taking chunks in turn.
      EXPECT_EQ(hh::kernels::backward_chunks_in_turn_launches() - in_turn, 0) << what << ": chunk_backward's chunks in turn";
      return grads;
    };
    // The scans (forward and reverse) on whole sequences, and in segments of 2 chunks. At Dk = 128 both are
    // the column scan (a head a block; the forward's writes the history the backward reads); the blocks of
    // 32 columns beside it.
    const int64_t launches = hh::kernels::column_scan_launches();
    const auto got = run(GdnBackward::kKernels, 0);
    EXPECT_EQ(hh::kernels::column_scan_launches() - launches, c.Dk == 128 ? 2 : 0) << what << ": the two scans";
    const auto split = run(GdnBackward::kKernels, 2), expl = run(GdnBackward::kExplicit, 0);
    hh::kernels::set_scan_warp_columns(false);
    const auto blocks = run(GdnBackward::kKernels, 0);
    hh::kernels::set_scan_warp_columns(true);
    std::vector<torch::Tensor> r;
    for (const auto& t : in) r.push_back(t.to(torch::kCPU, torch::kDouble).requires_grad_(true));
    // The reference loss: of the batch, or of each packed sequence alone (an empty one keeps its state).
    torch::Tensor loss = torch::zeros({}, kF64);
    const std::vector<int64_t> cu = c.cu.empty() ? std::vector<int64_t>{0, c.T} : c.cu;
    for (int64_t s = 0; s + 1 < static_cast<int64_t>(cu.size()); ++s) {
      const int64_t a = cu[static_cast<size_t>(s)], len = cu[static_cast<size_t>(s) + 1] - a;
      const auto init = c.cu.empty() ? r[5] : r[5].narrow(0, s, 1), ws = c.cu.empty() ? w_s : w_s.narrow(0, s, 1);
      if (len == 0) {
        loss = loss + (init * ws).sum();
        continue;
      }
      auto cut = [&](const torch::Tensor& x) { return x.narrow(1, a, len); };
      const auto ref = gdn_chunked(cut(r[0]), cut(r[1]), cut(r[2]), cut(r[3]), cut(r[4]), init, 0.1);
      loss = loss + (ref.o * cut(w_o)).sum() + (ref.state * ws).sum();
    }
    const auto want = torch::autograd::grad({loss}, r);
    const char* names[] = {"q", "k", "v", "g", "beta", "s0"};
    for (size_t i = 0; i < 6; ++i) {
      EXPECT_EQ(got[i].scalar_type(), in[i].scalar_type()) << what << " " << names[i];
      EXPECT_LT(rel_err(got[i], want[i]), 1e-2) << what << " " << names[i];
      EXPECT_LT(rel_err(got[i], expl[i]), 1e-2) << what << " " << names[i] << " (against the explicit backward)";
      EXPECT_LT(rel_err(split[i], want[i]), 1e-2) << what << " " << names[i] << " (scans in segments of 2 chunks)";
      EXPECT_LT(rel_err(blocks[i], want[i]), 1e-2) << what << " " << names[i] << " (the forward's scan in blocks of 32 columns)";
      if (c.Dk == 128)
        std::printf("[ measured ] %s %s: the column scan %.3g, blocks of 32 columns %.3g against float64\n", what.c_str(), names[i],
                    rel_err(got[i], want[i]), rel_err(blocks[i], want[i]));
    }
  }
}

// The whole forward with the chunk kernels against the recurrence, and against the same forward with
// the chunk-local part in LibTorch: initial state, Dk != Dv, T = 1 and odd T.
TEST(CudaGdn, ForwardWithTheChunkKernelsEqualsTheRecurrence) {
  ASSERT_TRUE(torch::cuda::is_available());
  namespace F = torch::nn::functional;
  const auto nrm = F::NormalizeFuncOptions().dim(-1);
  struct Case {
    int64_t B, T, H, Dk, Dv;
    torch::Dtype dt;
  };
  for (const Case& c : {Case{2, 777, 3, 128, 128, torch::kBFloat16}, Case{1, 1, 2, 128, 64, torch::kBFloat16},
                        Case{3, 130, 2, 64, 128, torch::kHalf}, Case{1, 640, 4, 64, 64, torch::kBFloat16}}) {
    const std::string what = "B=" + std::to_string(c.B) + " T=" + std::to_string(c.T) + " Dk=" + std::to_string(c.Dk) +
                             " Dv=" + std::to_string(c.Dv) + " " + std::string(c10::toString(c.dt));
    const auto dev = kCuda.dtype(c.dt), f32 = kCuda.dtype(torch::kFloat);
    const auto q = F::normalize(torch::randn({c.B, c.T, c.H, c.Dk}, kF64), nrm).to(dev);
    const auto k = F::normalize(torch::randn({c.B, c.T, c.H, c.Dk}, kF64), nrm).to(dev);
    const auto v = torch::randn({c.B, c.T, c.H, c.Dv}, kF64).to(dev);
    const auto g = (-0.5 * torch::rand({c.B, c.T, c.H}, kF64)).to(f32), beta = torch::rand({c.B, c.T, c.H}, kF64).to(f32);
    const auto s0 = (0.5 * torch::randn({c.B, c.H, c.Dk, c.Dv}, kF64)).to(f32);
    auto f64 = [](const torch::Tensor& x) { return x.to(torch::kCPU, torch::kDouble); };
    const auto ref = gdn_recurrent(f64(q), f64(k), f64(v), f64(g), f64(beta), f64(s0), 0.1);
    ASSERT_TRUE(hh::kernels::chunk_kernels_enabled());
    ASSERT_TRUE(hh::kernels::f16_history_enabled());
    hh::kernels::set_chunk_kernels(false);
    const auto lt = gdn_chunked_scan(q, k, v, g, beta, s0, 0.1);
    hh::kernels::set_chunk_kernels(true);
    // The output from the scan's block float16 history (chunk_output_f16, the default) and from its
    // float32 one (chunk_output); the scan on whole sequences, and in segments of 2 chunks.
    ASSERT_EQ(hh::kernels::scan_segments(), hh::kernels::kAutoSegments);
    // With the float16 history both forms of the scan: the whole-head column scan (set_scan_warp_columns,
    // the default where it fits: Dk = 128) and blocks of 32 columns.
    ASSERT_TRUE(hh::kernels::scan_warp_columns_enabled());
    for (int64_t segments : {int64_t{0}, int64_t{2}})
    for (int mode : {0, 1, 2}) {
      if (mode == 2 && c.Dk != 128) continue;
      const bool f16_history = mode != 1, columns = mode == 2;
      hh::kernels::set_f16_history(f16_history);
      hh::kernels::set_scan_segments(segments);
      hh::kernels::set_scan_warp_columns(columns);
      poison_allocator();
      const int64_t launches = hh::kernels::column_scan_launches();
      const auto got = gdn_chunked_scan(q, k, v, g, beta, s0, 0.1);
      hh::kernels::set_f16_history(true);
      hh::kernels::set_scan_segments(hh::kernels::kAutoSegments);
      hh::kernels::set_scan_warp_columns(true);
      const std::string how = what + (columns ? " (column scan" : f16_history ? " (float16 history, 32 columns a block" : " (float32 history") +
                              (segments == 0 ? ", whole sequences)" : ", segments of 2 chunks)");
      EXPECT_EQ(hh::kernels::column_scan_launches() - launches, columns ? 1 : 0) << how << ": the path taken";
      EXPECT_EQ(got.o.scalar_type(), c.dt) << how;
      EXPECT_LT(rel_err(got.o, ref.o), 1e-2) << how;
      EXPECT_LT(rel_err(got.state, ref.state), 2e-3) << how;  // float32 states from 11-bit products
      EXPECT_LT(rel_err(got.o, lt.o), 1e-2) << how;
      EXPECT_LT(rel_err(got.state, lt.state), 2e-3) << how;
    }
  }
}

// The column scan's products by warpgroup (wgmma, reading each chunk's factors from shared memory once for
// four warps: set_scan_wgmma, the default) against the same scan's products by warp (mma.sync on ldmatrix
// fragments): the same operands summed in the same order of 16-deep steps, so o, the final state and,
// through the history the forward's scan writes for the backward, dq, dk, dv and ds0 are the same bits. dg
// and dbeta differ in bits between two runs of the same path (the backward's own order of sums), so those
// only within a bound. Both head sizes the column scan takes (Dv 128: two warpgroups, 64: one), whole
// sequences and segments of 2 chunks (warm-up chunks that write nothing), packed sequences, T not a
// multiple of 64.
TEST(CudaGdn, ColumnScanByWarpgroupEqualsTheScanByWarp) {
  ASSERT_TRUE(torch::cuda::is_available());
  ASSERT_TRUE(hh::kernels::scan_wgmma_enabled());
  if (!hh::kernels::scan_wgmma_available()) GTEST_SKIP() << "this device's code has no warpgroup products (not built for sm_90a)";
  namespace F = torch::nn::functional;
  const auto nrm = F::NormalizeFuncOptions().dim(-1);
  struct Case {
    int64_t B, T, H, Dv;
    std::vector<int64_t> cu;
  };
  for (const Case& c : {Case{2, 777, 3, 128, {}}, Case{1, 1000, 2, 64, {0, 100, 164, 1000}}, Case{1, 4096, 2, 128, {}}})
    for (int64_t segments : {int64_t{0}, int64_t{2}}) {
      const std::string what = "B=" + std::to_string(c.B) + " T=" + std::to_string(c.T) + " Dv=" + std::to_string(c.Dv) +
                               (c.cu.empty() ? "" : " packed") + (segments == 0 ? ", whole sequences" : ", segments of 2 chunks");
      const int64_t S = c.cu.empty() ? c.B : static_cast<int64_t>(c.cu.size()) - 1, Dk = 128;
      const auto dev = kCuda.dtype(torch::kBFloat16), f32 = kCuda.dtype(torch::kFloat);
      const std::vector<torch::Tensor> in = {F::normalize(torch::randn({c.B, c.T, c.H, Dk}, kF64), nrm).to(dev),
                                             F::normalize(torch::randn({c.B, c.T, c.H, Dk}, kF64), nrm).to(dev),
                                             torch::randn({c.B, c.T, c.H, c.Dv}, kF64).to(dev),
                                             (-0.5 * torch::rand({c.B, c.T, c.H}, kF64)).to(f32),
                                             torch::rand({c.B, c.T, c.H}, kF64).to(f32),
                                             (0.5 * torch::randn({S, c.H, Dk, c.Dv}, kF64)).to(f32)};
      const auto w_o = torch::randn({c.B, c.T, c.H, c.Dv}, f32), w_s = torch::randn({S, c.H, Dk, c.Dv}, f32);
      struct Out {
        torch::Tensor o, state;
        std::vector<torch::Tensor> grads;
      };
      auto run = [&](bool wgmma) {
        hh::kernels::set_scan_wgmma(wgmma);
        hh::kernels::set_scan_segments(segments);
        hh::kernels::set_u_in_scan(false);  // U from chunk_factors on both sides (the warps' products read only that)
        Out r;
        {
          torch::NoGradGuard no_grad;
          poison_allocator();
          const auto f = gdn_chunked_scan(in[0], in[1], in[2], in[3], in[4], in[5], 0.1, 64, c.cu);
          r.o = f.o, r.state = f.state;
        }
        std::vector<torch::Tensor> x;
        for (const auto& t : in) x.push_back(t.detach().requires_grad_(true));
        poison_allocator();
        const auto f = gdn_chunked_scan(x[0], x[1], x[2], x[3], x[4], x[5], 0.1, 64, c.cu);
        r.grads = torch::autograd::grad({(f.o.to(torch::kFloat) * w_o).sum() + (f.state * w_s).sum()}, x);
        hh::kernels::set_u_in_scan(true);
        hh::kernels::set_scan_wgmma(true);
        hh::kernels::set_scan_segments(hh::kernels::kAutoSegments);
        return r;
      };
      const int64_t launches = hh::kernels::column_scan_launches();
      const Out wg = run(true), warp = run(false), again = run(false);
      // Each run: the inference forward's scan, the training forward's, the backward's reverse scan.
      EXPECT_EQ(hh::kernels::column_scan_launches() - launches, 9) << what << ": the path taken";
      EXPECT_TRUE(torch::equal(wg.o, warp.o)) << what << " o, " << rel_err(wg.o, warp.o) << " apart";
      EXPECT_TRUE(torch::equal(wg.state, warp.state)) << what << " state, " << rel_err(wg.state, warp.state) << " apart";
      const bool same = torch::equal(wg.o, warp.o) && torch::equal(wg.state, warp.state);
      const char* names[] = {"q", "k", "v", "g", "beta", "s0"};
      // The gradients that differ in bits from the products by warp, and those that differ between two runs of
      // the products by warp (the backward's own order of sums).
      std::string differ, differ_again;
      for (size_t i = 0; i < 6; ++i) {
        const bool bits = i != 3 && i != 4;  // not dg, dbeta
        if (bits) {
          EXPECT_TRUE(torch::equal(wg.grads[i], warp.grads[i])) << what << " d" << names[i];
        }
        EXPECT_LT(rel_err(wg.grads[i], warp.grads[i]), 1e-4) << what << " d" << names[i];
        if (!torch::equal(wg.grads[i], warp.grads[i])) differ += std::string(" d") + names[i];
        if (!torch::equal(again.grads[i], warp.grads[i])) differ_again += std::string(" d") + names[i];
      }
      std::printf("[ measured ] %s: o %.3g, state %.3g apart (%s); gradients not the same bits:%s; between two runs by warp:%s\n",
                  what.c_str(), rel_err(wg.o, warp.o), rel_err(wg.state, warp.state), same ? "the same bits" : "not the same bits",
                  differ.empty() ? " none" : differ.c_str(), differ_again.empty() ? " none" : differ_again.c_str());
    }
}

// The cases of the column scan's path tests (U and Qd, kdecay formed in the scan): one sequence of T not a
// multiple of 64 (its last rows past the tensor) and a batch of T a multiple of 64, each chunk's slots
// consecutive tokens (rows: the scan takes the path), and a batch whose chunks are not rows; each with the
// automatic pieces, whole sequences and pieces of 2 chunks, with and without an initial state: fn(case, its
// inputs, s0 or undefined, segments, a name).
struct PathCase {
  int64_t B, T;
  bool rows;
};
template <class Fn>
void for_each_path_case(torch::Dtype dt, int64_t H, int64_t Dk, int64_t Dv, Fn&& fn) {
  for (const PathCase& c : {PathCase{1, 777, true}, PathCase{2, 640, true}, PathCase{2, 700, false}})
    for (int64_t segments : {hh::kernels::kAutoSegments, int64_t{0}, int64_t{2}})
      for (bool with_s0 : {true, false}) {
        const std::string what = std::string(c10::toString(dt)) + " Dv=" + std::to_string(Dv) + " B=" + std::to_string(c.B) +
                                 " T=" + std::to_string(c.T) + " segments " + std::to_string(segments) + (with_s0 ? ", s0" : "");
        const ChunkIn in = chunk_in(c.B, c.T, H, Dk, Dv, dt);
        const auto s0 = with_s0 ? (0.5 * torch::randn({c.B, H, Dk, Dv}, kF64)).to(kCuda.dtype(torch::kFloat)) : torch::Tensor();
        fn(c, in, s0, segments, what);
      }
}
// The rule without a graph from a NaN-poisoned allocator, with a path's switch (set_u_in_scan, set_qk_in_scan)
// at `on` and the scan in pieces of `segments` chunks; both back to their defaults after.
hh::attention::GdnOutput rule_on_path(void (*set)(bool), bool on, int64_t segments, const ChunkIn& in, const torch::Tensor& s0,
                                      double scale) {
  torch::NoGradGuard no_grad;
  set(on);
  hh::kernels::set_scan_segments(segments);
  poison_allocator();
  auto r = gdn_chunked_scan(in.q, in.k, in.v, in.g, in.beta, s0, scale);
  hh::kernels::set_scan_segments(hh::kernels::kAutoSegments);
  set(true);
  return r;
}

// Training's forward and backward from a NaN-poisoned allocator with a path's switch (set_u_in_scan,
// set_qk_in_scan) at `on` for the forward (the backward follows what the forward kept), the scan in pieces of
// `segments` chunks, and the backward's scans by warpgroup or by warp: the gradients of q, k, v, g, beta and s0 of
// sum(o w_o) + sum(final state), then o and the final state (kTrainedNames). The switches back to their defaults after.
const char* const kTrainedNames[] = {"dq", "dk", "dv", "dg", "dbeta", "ds0", "o", "final state"};
std::vector<torch::Tensor> train_on_path(void (*set)(bool), bool on, int64_t segments, const ChunkIn& in, const torch::Tensor& s0,
                                         const torch::Tensor& w_o, double scale, bool wgmma_backward = true) {
  const torch::AutoGradMode with_graph(true);
  std::vector<torch::Tensor> x = {in.q.detach().requires_grad_(true), in.k.detach().requires_grad_(true),
                                  in.v.detach().requires_grad_(true), in.g.detach().requires_grad_(true),
                                  in.beta.detach().requires_grad_(true), s0.detach().requires_grad_(true)};
  set(on);
  hh::kernels::set_scan_segments(segments);
  poison_allocator();
  const auto r = gdn_chunked_scan(x[0], x[1], x[2], x[3], x[4], x[5], scale);
  set(true);
  hh::kernels::set_scan_wgmma(wgmma_backward);
  auto grads = torch::autograd::grad({(r.o.to(torch::kFloat) * w_o).sum() + r.state.sum()}, x);
  hh::kernels::set_scan_wgmma(true);
  hh::kernels::set_scan_segments(hh::kernels::kAutoSegments);
  grads.push_back(r.o.detach());
  grads.push_back(r.state.detach());
  return grads;
}

// The forward's column scan forming U = T diag(beta) V itself (set_u_in_scan, the default where
// column_scan_forms_u holds; without a graph, and training's with the history) from v's rows and
// chunk_factors' T diag(beta) in two 16-bit parts (UForm::kScan). The factors: no U; W, kdecay, Qd, Aq, decay
// and the bound the same bits as with U formed; hi + lo within 3e-5 of T diag(beta) in float64 (U's own bound
// from the same split); each part of the inputs' kind and zero above the diagonal blocks, lo within an ulp of
// hi. The rule: o and the final state against the recurrence in float64 and against the path with U from
// chunk_factors, from a NaN-poisoned allocator, both 16-bit dtypes, Dv 128 and 64, one sequence of T not a
// multiple of 64 (its last rows past the tensor) and a batch of T a multiple of 64, the automatic pieces,
// whole sequences and pieces of 2 chunks (warm-ups), with and without an initial state; a batch whose chunks
// are not rows takes U from chunk_factors. With a graph (training's scan, which also writes the history the
// backward reads), the output, final state and every gradient against the path with U from chunk_factors, and
// the gradients against the chunked rule's in float64; with T for the backward, chunk_factors' T and T
// diag(beta) the bits of each form alone.
TEST(CudaGdn, ColumnScanFormingUFromVEqualsTheRecurrence) {
  ASSERT_TRUE(torch::cuda::is_available());
  ASSERT_TRUE(hh::kernels::u_in_scan_enabled());
  if (!hh::kernels::scan_wgmma_available()) GTEST_SKIP() << "this device's code has no warpgroup products (not built for sm_90a)";
  const int64_t H = 3, Dk = 128, C = 64;
  const double scale = 0.1;
  for (torch::Dtype dt : {torch::kBFloat16, torch::kHalf})
    for (int64_t Dv : {int64_t{128}, int64_t{64}}) {
      // The factors, on a batch of two sequences of 3 chunks.
      {
        const int64_t B = 2, T = 192, per = 3, N = B * per;
        const std::string what = std::string(c10::toString(dt)) + " Dv=" + std::to_string(Dv) + " factors";
        const auto [q, k, v, g, beta] = chunk_in(B, T, H, Dk, Dv, dt);
        auto f64 = [](const torch::Tensor& x) { return x.to(torch::kCPU, torch::kDouble); };
        const auto K = on_grid(f64(k), per), G = on_grid(f64(g), per).cumsum(-1), Bt = on_grid(f64(beta), per);
        const auto strict = torch::ones({C, C}, torch::kBool).tril(-1);
        const auto L = (Bt.unsqueeze(-1) * torch::matmul(K, K.transpose(-1, -2)) * (G.unsqueeze(-1) - G.unsqueeze(-2)).exp())
                           .masked_fill(strict.logical_not(), 0.0);
        const auto Tb = torch::inverse(torch::eye(C, kF64) + L) * Bt.unsqueeze(-2);  // T diag(beta)
        const hh::kernels::ChunkGrid grid{N, per, {}};
        poison_allocator();
        const auto fu = hh::kernels::chunk_factors(k, v, g, beta, grid, q, scale, nullptr, hh::kernels::UForm::kFloat16Columns);
        poison_allocator();
        const auto fs = hh::kernels::chunk_factors(k, v, g, beta, grid, q, scale, nullptr, hh::kernels::UForm::kScan);
        EXPECT_FALSE(fs.U.defined() || fs.U_inv.defined()) << what;
        EXPECT_TRUE(torch::equal(fs.W, fu.W) && torch::equal(fs.kdecay, fu.kdecay) && torch::equal(fs.Qd, fu.Qd) &&
                    torch::equal(fs.Aq, fu.Aq) && torch::equal(fs.aq_inv, fu.aq_inv) && torch::equal(fs.decay, fu.decay) &&
                    torch::equal(fs.bound, fu.bound))
            << what << ": the other factors";
        ASSERT_EQ(fs.Tb.sizes(), torch::IntArrayRef({H, N, 2, hh::kernels::kPackedLower})) << what;
        EXPECT_EQ(fs.Tb.scalar_type(), dt) << what;
        const auto hi = unpack_lower(fs.Tb.select(2, 0)).cpu().to(torch::kDouble), lo = unpack_lower(fs.Tb.select(2, 1)).cpu().to(torch::kDouble);
        EXPECT_TRUE(torch::equal(hi.triu(1), torch::zeros_like(hi)) && torch::equal(lo.triu(1), torch::zeros_like(lo))) << what
                                                                                                                    << ": above the diagonal";
        const double ulp = dt == torch::kBFloat16 ? 1.0 / 128 : 1.0 / 1024;
        EXPECT_TRUE((lo.abs() <= ulp * hi.abs()).all().item<bool>()) << what << ": lo within an ulp of hi";
        EXPECT_LT(rel_err(hi + lo, Tb), 3e-5) << what;
        std::printf("[ measured ] %s: T diag(beta) as hi + lo %.3g, hi alone %.3g\n", what.c_str(), rel_err(hi + lo, Tb), rel_err(hi, Tb));
        EXPECT_THROW(hh::kernels::chunk_factors(k, v, g, beta, grid, {}, scale, nullptr, hh::kernels::UForm::kScan), std::invalid_argument)
            << what << ": without q";
        // With T for the backward (training's forward): T and T diag(beta) the bits of each form alone.
        poison_allocator();
        const auto ft = hh::kernels::chunk_factors(k, v, g, beta, grid, q, scale, nullptr, hh::kernels::UForm::kFloat16Columns, true);
        poison_allocator();
        const auto fst = hh::kernels::chunk_factors(k, v, g, beta, grid, q, scale, nullptr, hh::kernels::UForm::kScan, true);
        EXPECT_TRUE(torch::equal(fst.T16, ft.T16) && torch::equal(fst.Tb, fs.Tb) && torch::equal(fst.W, fs.W) &&
                    torch::equal(fst.kdecay, fs.kdecay) && torch::equal(fst.Qd, fs.Qd) && torch::equal(fst.Aq, fs.Aq))
            << what << ": with T for the backward";
      }
      // The rule.
      for_each_path_case(dt, H, Dk, Dv, [&](const PathCase& c, const ChunkIn& in, const torch::Tensor& s0, int64_t segments,
                                            const std::string& what) {
            const auto& [q, k, v, g, beta] = in;
            const bool with_s0 = s0.defined();
            auto f64 = [](const torch::Tensor& x) { return x.to(torch::kCPU, torch::kDouble); };
            const auto ref = gdn_recurrent(f64(q), f64(k), f64(v), f64(g), f64(beta),
                                           with_s0 ? f64(s0) : torch::zeros({c.B, H, Dk, Dv}, kF64), scale);
            auto run = [&](bool u_in_scan) { return rule_on_path(hh::kernels::set_u_in_scan, u_in_scan, segments, in, s0, scale); };
            const int64_t launches = hh::kernels::u_in_scan_launches();
            const auto got = run(true);
            EXPECT_EQ(hh::kernels::u_in_scan_launches() - launches, c.rows ? 1 : 0) << what << ": the path taken";
            const auto apart = run(false);
            EXPECT_EQ(hh::kernels::u_in_scan_launches() - launches, c.rows ? 1 : 0) << what << ": switched off";
            EXPECT_EQ(got.o.scalar_type(), dt) << what;
            EXPECT_LT(rel_err(got.o, ref.o), 1e-2) << what;
            EXPECT_LT(rel_err(got.state, ref.state), 2e-3) << what;
            // U unrounded here, U in float16 by columns there: no less accurate, within the outputs' rounding.
            EXPECT_LT(rel_err(got.state, ref.state), 1.5 * rel_err(apart.state, ref.state) + 1e-5) << what;
            EXPECT_LT(rel_err(got.o, apart.o), 1e-2) << what;
            if (!c.rows) {
              EXPECT_TRUE(torch::equal(got.o, apart.o) && torch::equal(got.state, apart.state)) << what << ": the same path";
            }
            if (segments == hh::kernels::kAutoSegments && !with_s0)
              std::printf("[ measured ] %s: o %.3g / %.3g, state %.3g / %.3g (U formed in the scan / from chunk_factors)\n",
                          what.c_str(), rel_err(got.o, ref.o), rel_err(apart.o, ref.o), rel_err(got.state, ref.state),
                          rel_err(apart.state, ref.state));
            if (segments != hh::kernels::kAutoSegments || !with_s0) return;
            // With a graph (training's forward scan, which also writes the history the backward reads): o, the final
            // state and the gradients of q, k, v, g, beta and s0 against the path with U from chunk_factors, and the
            // gradients against the chunked rule's in float64, within the 16-bit products' rounding (the bound of the
            // backward's other comparisons).
            const torch::AutoGradMode with_graph(true);
            const auto w_o = torch::randn({c.B, c.T, H, Dv}, kCuda.dtype(torch::kFloat));
            auto train = [&](bool u_in_scan) {
              return train_on_path(hh::kernels::set_u_in_scan, u_in_scan, segments, in, s0, w_o, scale);
            };
            const int64_t before = hh::kernels::u_in_scan_launches();
            const auto g_in = train(true);
            EXPECT_EQ(hh::kernels::u_in_scan_launches() - before, c.rows ? 1 : 0) << what << ", with a graph: the path taken";
            const auto g_apart = train(false);
            std::vector<torch::Tensor> r = {f64(q), f64(k), f64(v), f64(g), f64(beta), f64(s0)};
            for (auto& t : r) t.requires_grad_(true);
            const auto ref64 = gdn_chunked(r[0], r[1], r[2], r[3], r[4], r[5], scale);
            const auto want = torch::autograd::grad({(ref64.o * f64(w_o)).sum() + ref64.state.sum()}, r);
            for (size_t i = 0; i < 8; ++i) {
              EXPECT_TRUE(g_in[i].isfinite().all().item<bool>()) << what << ", with a graph: " << kTrainedNames[i];
              EXPECT_LT(rel_err(g_in[i], g_apart[i]), 1e-2) << what << ", with a graph: " << kTrainedNames[i];
              if (i < 6) {
                EXPECT_LT(rel_err(g_in[i], want[i]), 1e-2) << what << ", with a graph: " << kTrainedNames[i] << " against float64";
              }
            }
          });
    }
}

// The forward's column scan reading q's and k's rows where they lie and forming Qd = scale e^G q and kdecay =
// e^{G_C - G} k itself (set_qk_in_scan, the default where column_scan_reads_qk holds), from the rows' scales
// chunk_factors writes instead of both (qk_in_scan). The factors: no Qd or kdecay; the scales times q's and k's
// rows, rounded to float16 on the host's side, the bits of chunk_factors' own Qd and kdecay; the other factors
// the same bits, with and without T for the backward; the option refused without UForm::kScan. The rule: o and
// the final state the same bits as the scan reading chunk_factors' Qd and kdecay (the same arithmetic on the
// same values), from a NaN-poisoned allocator, both 16-bit dtypes, Dv 128 and 64, one sequence of T not a
// multiple of 64 (its last rows past the tensor), a batch of T a multiple of 64, the automatic pieces, whole
// sequences and pieces of 2 chunks, with and without an initial state; a batch whose chunks are not rows takes
// the other path. With a graph (training's forward scan with the history, and the backward's reverse scan reading
// q and k too): o, the final state and every gradient the same bits as with chunk_factors' Qd and kdecay; and
// with the reverse scan by warp, which cannot read them, Qd and kdecay formed on the host's side from the scales.
TEST(CudaGdn, ColumnScanReadingQAndKEqualsReadingTheirFactors) {
  ASSERT_TRUE(torch::cuda::is_available());
  ASSERT_TRUE(hh::kernels::qk_in_scan_enabled());
  if (!hh::kernels::scan_wgmma_available()) GTEST_SKIP() << "this device's code has no warpgroup products (not built for sm_90a)";
  const int64_t H = 3, Dk = 128;
  const double scale = 0.1;
  for (torch::Dtype dt : {torch::kBFloat16, torch::kHalf})
    for (int64_t Dv : {int64_t{128}, int64_t{64}}) {
      {
        const int64_t B = 2, T = 150, per = 3, N = B * per;
        const std::string what = std::string(c10::toString(dt)) + " Dv=" + std::to_string(Dv) + " factors";
        const auto [q, k, v, g, beta] = chunk_in(B, T, H, Dk, Dv, dt);
        const hh::kernels::ChunkGrid grid{N, per, {}};
        using hh::kernels::UForm;
        poison_allocator();
        const auto fs = hh::kernels::chunk_factors(k, v, g, beta, grid, q, scale, nullptr, UForm::kScan);
        poison_allocator();
        const auto fq = hh::kernels::chunk_factors(k, v, g, beta, grid, q, scale, nullptr, UForm::kScan, false, true);
        EXPECT_FALSE(fq.Qd.defined() || fq.kdecay.defined()) << what;
        ASSERT_EQ(fq.QK.sizes(), torch::IntArrayRef({H, N, 2, 64})) << what;
        ASSERT_EQ(fq.QK.scalar_type(), torch::kFloat) << what;
        EXPECT_TRUE(torch::equal(fq.W, fs.W) && torch::equal(fq.Tb, fs.Tb) && torch::equal(fq.Aq, fs.Aq) &&
                    torch::equal(fq.aq_inv, fs.aq_inv) && torch::equal(fq.decay, fs.decay) && torch::equal(fq.bound, fs.bound))
            << what << ": the other factors";
        // Each row times its scale in float32 (exact products, rounded once), then to float16 (to nearest even).
        auto formed = [&](const torch::Tensor& x, int part) {
          return (on_grid(x.to(torch::kFloat), per) * fq.QK.select(2, part).unsqueeze(-1)).to(torch::kHalf);
        };
        EXPECT_TRUE(torch::equal(formed(q, 0), fs.Qd)) << what << ": Qd from q's rows and their scales";
        EXPECT_TRUE(torch::equal(formed(k, 1), fs.kdecay)) << what << ": kdecay from k's rows and their scales";
        EXPECT_THROW(hh::kernels::chunk_factors(k, v, g, beta, grid, q, scale, nullptr, UForm::kFloat16Columns, false, true),
                     std::invalid_argument)
            << what << ": without UForm::kScan";
        // With T for the backward (training's forward): the same scales, and T the bits of the form without them.
        poison_allocator();
        const auto ft = hh::kernels::chunk_factors(k, v, g, beta, grid, q, scale, nullptr, UForm::kScan, true);
        poison_allocator();
        const auto fqt = hh::kernels::chunk_factors(k, v, g, beta, grid, q, scale, nullptr, UForm::kScan, true, true);
        EXPECT_FALSE(fqt.Qd.defined() || fqt.kdecay.defined()) << what << ": with T for the backward";
        EXPECT_TRUE(torch::equal(fqt.QK, fq.QK) && torch::equal(fqt.T16, ft.T16) && torch::equal(fqt.W, fs.W) &&
                    torch::equal(fqt.Tb, fs.Tb) && torch::equal(fqt.Aq, fs.Aq) && torch::equal(fqt.aq_inv, fs.aq_inv))
            << what << ": with T for the backward";
      }
      for_each_path_case(dt, H, Dk, Dv, [&](const PathCase& c, const ChunkIn& in, const torch::Tensor& s0, int64_t segments,
                                            const std::string& what) {
            auto run = [&](bool qk_in_scan) { return rule_on_path(hh::kernels::set_qk_in_scan, qk_in_scan, segments, in, s0, scale); };
            const int64_t launches = hh::kernels::qk_in_scan_launches(), u_launches = hh::kernels::u_in_scan_launches();
            const auto got = run(true);
            EXPECT_EQ(hh::kernels::qk_in_scan_launches() - launches, c.rows ? 1 : 0) << what << ": the path taken";
            const auto apart = run(false);
            EXPECT_EQ(hh::kernels::qk_in_scan_launches() - launches, c.rows ? 1 : 0) << what << ": switched off";
            EXPECT_EQ(hh::kernels::u_in_scan_launches() - u_launches, c.rows ? 2 : 0) << what << ": U formed in the scan both times";
            EXPECT_TRUE(got.o.isfinite().all().item<bool>()) << what;
            EXPECT_TRUE(torch::equal(got.o, apart.o)) << what << ": o";
            EXPECT_TRUE(torch::equal(got.state, apart.state)) << what << ": the final state";
            if (segments == 0 || !s0.defined()) return;
            // With a graph: training's forward scan (with the history) and the backward's reverse scan both read q
            // and k; o, the final state and every gradient the same bits as with chunk_factors' Qd and kdecay.
            const auto w_o = torch::randn({c.B, c.T, H, Dv}, kCuda.dtype(torch::kFloat));
            const int64_t before = hh::kernels::qk_in_scan_launches();
            const auto t_in = train_on_path(hh::kernels::set_qk_in_scan, true, segments, in, s0, w_o, scale);
            EXPECT_EQ(hh::kernels::qk_in_scan_launches() - before, c.rows ? 2 : 0) << what << ", with a graph: both scans";
            const auto t_apart = train_on_path(hh::kernels::set_qk_in_scan, false, segments, in, s0, w_o, scale);
            EXPECT_EQ(hh::kernels::qk_in_scan_launches() - before, c.rows ? 2 : 0) << what << ", with a graph: switched off";
            for (size_t i = 0; i < t_in.size(); ++i)
              EXPECT_TRUE(torch::equal(t_in[i], t_apart[i])) << what << ", with a graph: " << kTrainedNames[i];
            if (!c.rows || Dv != 128 || segments != 2) return;
            // A backward whose reverse scan cannot read them (by warp) forms Qd and kdecay from the forward's
            // scales on the host's side: the same bits again.
            const int64_t by_warp = hh::kernels::qk_in_scan_launches();
            const auto t_host = train_on_path(hh::kernels::set_qk_in_scan, true, segments, in, s0, w_o, scale, /*wgmma_backward=*/false);
            EXPECT_EQ(hh::kernels::qk_in_scan_launches() - by_warp, 1) << what << ", with a graph: the forward's scan only";
            for (size_t i = 0; i < t_in.size(); ++i)
              EXPECT_TRUE(torch::equal(t_host[i], t_apart[i])) << what << ", a backward by warp: " << kTrainedNames[i];
          });
    }
}

// The rule's output through the fusion norm (gdn_fused_output: the scan's own output then the fusion
// kernel by default, or the norm inside chunk_output_f16 from the scan's history) against the rule
// then the fusion kernel: the same final state bit for bit (the same kernels up to the output), the
// fused heads in their places with the fusion's roundings (only each row's sum of squares is added in
// another order: almost every element the same bits, the rest a few ulp), the other heads untouched.
// Both head sizes the output kernel takes (Dv 128: a cluster of two blocks a row range), both
// activations and 16-bit dtypes, T not a multiple of 64, an initial state, the gate a column slice.
TEST(CudaGdn, FusedOutputEqualsTheRuleThenTheFusion) {
  ASSERT_TRUE(torch::cuda::is_available());
  namespace F = torch::nn::functional;
  using hh::kernels::GateActivation;
  const auto nrm = F::NormalizeFuncOptions().dim(-1);
  const int64_t B = 2, T = 150, H = 3, Hy = 7;
  const std::vector<int64_t> heads = {0, 4, 5};
  for (torch::Dtype dt : {torch::kBFloat16, torch::kHalf})
    for (auto [Dk, Dv] : {std::pair<int64_t, int64_t>{128, 128}, {64, 64}, {128, 64}})
      for (GateActivation act : {GateActivation::kSilu, GateActivation::kSigmoid})
      for (bool in_scan : {true, false}) {
        // The output and its fusion from the scan (the default; the scan's output then the fusion kernel where
        // the scan cannot fuse), or the fusion inside chunk_output_f16.
        hh::kernels::set_output_in_scan(in_scan);
        const std::string what = std::string(c10::toString(dt)) + " Dk=" + std::to_string(Dk) + " Dv=" +
                                 std::to_string(Dv) + " activation " + std::to_string(static_cast<int>(act)) +
                                 (in_scan ? ", output in the scan" : ", fusion in the output kernel");
        const auto dev = kCuda.dtype(dt), f32 = kCuda.dtype(torch::kFloat);
        const auto q = F::normalize(torch::randn({B, T, H, Dk}, kF64), nrm).to(dev);
        const auto k = F::normalize(torch::randn({B, T, H, Dk}, kF64), nrm).to(dev);
        const auto v = torch::randn({B, T, H, Dv}, kF64).to(dev);
        const auto g = (-0.5 * torch::rand({B, T, H}, kF64)).to(f32), beta = torch::rand({B, T, H}, kF64).to(f32);
        const auto s0 = (0.5 * torch::randn({B, H, Dk, Dv}, kF64)).to(f32);
        const auto proj = torch::randn({B, T, (H + 1) * Dv}, dev);  // the gate is columns Dv .. (H + 1) Dv
        hh::kernels::OutputFusion fu;
        fu.gate = proj.narrow(2, Dv, H * Dv);
        fu.gamma = 1 + 0.3 * torch::randn({H, Dv}, dev);
        fu.act = act;
        fu.eps = 1e-6;
        fu.heads = heads;
        torch::NoGradGuard no_grad;
        const auto r = hh::attention::gdn(q, k, v, g, beta, s0, 0.1);
        auto want = torch::full({B, T, Hy, Dv}, 7.0, dev);
        hh::kernels::fusion_norm_forward_into(r.o, fu.gate, act, fu.gamma, fu.eps, want, heads);
        poison_allocator();
        auto got = torch::full({B, T, Hy, Dv}, 7.0, dev);
        const auto state = hh::attention::gdn_fused_output(q, k, v, g, beta, s0, 0.1, 64, fu, got);
        EXPECT_TRUE(torch::equal(state, r.state)) << what << " (final state)";
        expect_fused_heads_close(got, want, heads, what);
        // A gate the output kernel cannot read (one element off 16-byte alignment): bit for bit the rule,
        // then the fusion kernel (with the output apart, gdn_fused_output takes that path itself; with the
        // output in the scan, its kernels, whose fusion kernel reads any gate layout).
        hh::kernels::OutputFusion off = fu;
        off.gate = proj.narrow(2, 1, H * Dv);
        ASSERT_FALSE(hh::kernels::chunk_output_fusion_fits(off, got)) << what;
        auto want_off = torch::full({B, T, Hy, Dv}, 7.0, dev), got_off = torch::full({B, T, Hy, Dv}, 7.0, dev);
        hh::kernels::fusion_norm_forward_into(r.o, off.gate, act, off.gamma, off.eps, want_off, heads);
        (void)hh::attention::gdn_fused_output(q, k, v, g, beta, s0, 0.1, 64, off, got_off);
        EXPECT_TRUE(torch::equal(got_off, want_off)) << what << " (gate off alignment)";
        // Where the scan cannot apply the fusion itself (Dk 64), its output goes through the fusion kernel:
        // the reference's own path, bit for bit.
        if (in_scan && !hh::kernels::scan_output_fusion_supported(Dk, Dv)) {
          EXPECT_TRUE(torch::equal(got, want)) << what << " (the rule's own output through the fusion kernel)";
        }
        hh::kernels::set_output_in_scan(true);
      }
  // Inference only: a graph through it is refused.
  const auto dev = kCuda.dtype(torch::kBFloat16), f32 = kCuda.dtype(torch::kFloat);
  const auto q = torch::randn({1, 64, 1, 64}, dev).requires_grad_(true), k = torch::randn({1, 64, 1, 64}, dev),
             v = torch::randn({1, 64, 1, 64}, dev);
  const auto g = -torch::rand({1, 64, 1}, f32), beta = torch::rand({1, 64, 1}, f32);
  hh::kernels::OutputFusion fu;
  fu.gate = torch::randn({1, 64, 64}, dev);
  fu.gamma = torch::ones({1, 64}, dev);
  fu.heads = {0};
  auto y = torch::zeros({1, 64, 1, 64}, dev);
  EXPECT_THROW(hh::attention::gdn_fused_output(q, k, v, g, beta, torch::Tensor(), 0.1, 64, fu, y), std::runtime_error);
}

// One sequence's gate needs no batch stride: a gate cut from a longer projection's first T rows (its
// batch stride is not T rows) goes through the output kernel's fusion and the fusion kernel alike, with
// the same bits as a contiguous copy of it.
TEST(CudaGdn, FusedOutputTakesAOneSequenceGateOfAnyBatchStride) {
  ASSERT_TRUE(torch::cuda::is_available());
  namespace F = torch::nn::functional;
  const auto nrm = F::NormalizeFuncOptions().dim(-1);
  const int64_t T = 150, H = 2, D = 128, Hy = 3;
  const std::vector<int64_t> heads = {0, 2};
  const auto dev = kCuda.dtype(torch::kBFloat16), f32 = kCuda.dtype(torch::kFloat);
  const auto q = F::normalize(torch::randn({1, T, H, D}, kF64), nrm).to(dev);
  const auto k = F::normalize(torch::randn({1, T, H, D}, kF64), nrm).to(dev);
  const auto v = torch::randn({1, T, H, D}, kF64).to(dev);
  const auto g = (-0.5 * torch::rand({1, T, H}, kF64)).to(f32), beta = torch::rand({1, T, H}, kF64).to(f32);
  hh::kernels::OutputFusion fu;
  fu.gate = torch::randn({1, T + 5, H * D}, dev).narrow(1, 0, T);
  ASSERT_NE(fu.gate.stride(0), T * fu.gate.stride(1));
  fu.gamma = 1 + 0.3 * torch::randn({H, D}, dev);
  fu.act = hh::kernels::GateActivation::kSilu;
  fu.eps = 1e-6;
  fu.heads = heads;
  hh::kernels::OutputFusion copy = fu;
  copy.gate = fu.gate.contiguous();
  torch::NoGradGuard no_grad;
  for (int mode : {0, 1, 2, 3}) {  // the column scan's output then the fusion kernel; the fusion in the cluster scan; in
                                   // the output kernel; in the column scan
    const bool in_scan = mode != 2;
    hh::kernels::set_output_in_scan(in_scan);
    hh::kernels::set_fusion_in_scan(mode == 1);
    hh::kernels::set_fusion_in_column_scan(mode == 3);
    const std::string what = mode == 0   ? "output in the scan"
                             : mode == 1 ? "fusion in the cluster scan"
                             : mode == 2 ? "fusion in the output kernel"
                                         : "fusion in the column scan";
    auto got = torch::full({1, T, Hy, D}, 7.0, dev), want = torch::full({1, T, Hy, D}, 7.0, dev);
    EXPECT_TRUE(hh::kernels::chunk_output_fusion_fits(fu, got)) << what;
    const int64_t launches = hh::kernels::fused_scan_launches(), columns = hh::kernels::column_scan_launches();
    const auto s1 = hh::attention::gdn_fused_output(q, k, v, g, beta, torch::Tensor(), 0.1, 64, fu, got);
    const auto s2 = hh::attention::gdn_fused_output(q, k, v, g, beta, torch::Tensor(), 0.1, 64, copy, want);
    EXPECT_EQ(hh::kernels::fused_scan_launches() - launches, mode == 1 ? 2 : 0) << what << ": the path taken";
    EXPECT_EQ(hh::kernels::column_scan_launches() - columns, mode == 0 || mode == 3 ? 2 : 0) << what << ": the column scan";
    EXPECT_TRUE(torch::equal(got, want)) << what;
    EXPECT_TRUE(torch::equal(s1, s2)) << what;
    EXPECT_TRUE(got.select(2, 1).eq(7.0).all().item<bool>()) << what << ": the head between is written";
  }
  hh::kernels::set_output_in_scan(true);
  hh::kernels::set_fusion_in_scan(false);
  hh::kernels::set_fusion_in_column_scan(false);
  const auto o = torch::randn({1, T, H, D}, dev);
  auto got = torch::zeros({1, T, Hy, D}, dev), want = torch::zeros({1, T, Hy, D}, dev);
  hh::kernels::fusion_norm_forward_into(o, fu.gate, fu.act, fu.gamma, fu.eps, got, heads);
  hh::kernels::fusion_norm_forward_into(o, copy.gate, fu.act, fu.gamma, fu.eps, want, heads);
  EXPECT_TRUE(torch::equal(got, want)) << "the fusion kernel";
}

// The fusion inside the scan (set_fusion_in_scan: a cluster of a head's column blocks exchanging each
// row's sums of squares every chunk) against the fusion inside chunk_output_f16 from the scan's history,
// over segments of two chunks (whose warm-ups write nothing, in every block of a cluster alike) and whole
// sequences, T not a multiple of 64, Dv 128 (four blocks a cluster) and 64 (two): the same final state,
// the fused heads within the fusion's roundings, the other heads untouched. And the fusion inside the
// column scan (set_fusion_in_column_scan; a head a block): the fused heads within the fusion's roundings of
// the column scan's own output through the fusion kernel (the default), and the final state its bits.
TEST(CudaGdn, FusionInTheScanEqualsTheFusedOutputKernel) {
  ASSERT_TRUE(torch::cuda::is_available());
  namespace F = torch::nn::functional;
  const auto nrm = F::NormalizeFuncOptions().dim(-1);
  const int64_t B = 2, T = 777, H = 3, Hy = 5, Dk = 128;
  const std::vector<int64_t> heads = {4, 0, 2};
  // The blocks the device runs at once: whole clusters, no more than one an SM (the ring's shared memory).
  const int64_t sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  for (int cs : {2, 4, 8}) {
    const int64_t n = hh::kernels::fused_scan_slots(cs);
    EXPECT_GT(n, 0) << cs;
    EXPECT_EQ(n % cs, 0) << cs;
    EXPECT_LE(n, sms) << cs;
  }
  EXPECT_THROW(hh::kernels::fused_scan_slots(0), std::invalid_argument);
  EXPECT_THROW(hh::kernels::fused_scan_slots(9), std::invalid_argument);
  for (int64_t Dv : {int64_t{128}, int64_t{64}})
    for (int64_t segments : {int64_t{2}, int64_t{0}}) {
      const std::string what = "Dv=" + std::to_string(Dv) + (segments == 0 ? ", whole sequences" : ", segments of 2 chunks");
      ASSERT_TRUE(hh::kernels::scan_output_fusion_supported(Dk, Dv)) << what;
      const auto dev = kCuda.dtype(torch::kBFloat16), f32 = kCuda.dtype(torch::kFloat);
      const auto q = F::normalize(torch::randn({B, T, H, Dk}, kF64), nrm).to(dev);
      const auto k = F::normalize(torch::randn({B, T, H, Dk}, kF64), nrm).to(dev);
      const auto v = torch::randn({B, T, H, Dv}, kF64).to(dev);
      const auto g = (-0.5 * torch::rand({B, T, H}, kF64)).to(f32), beta = torch::rand({B, T, H}, kF64).to(f32);
      const auto s0 = (0.5 * torch::randn({B, H, Dk, Dv}, kF64)).to(f32);
      const auto proj = torch::randn({B, T, 2 * H * Dv}, dev);
      hh::kernels::OutputFusion fu;
      fu.gate = proj.narrow(2, H * Dv, H * Dv);
      fu.gamma = 1 + 0.3 * torch::randn({H, Dv}, dev);
      fu.act = hh::kernels::GateActivation::kSilu;
      fu.heads = heads;
      torch::NoGradGuard no_grad;
      hh::kernels::set_scan_segments(segments);
      auto run = [&](bool in_scan, torch::Tensor& y) {
        hh::kernels::set_output_in_scan(in_scan);
        hh::kernels::set_fusion_in_scan(in_scan);
        poison_allocator();
        const int64_t launches = hh::kernels::fused_scan_launches();
        const auto state = hh::attention::gdn_fused_output(q, k, v, g, beta, s0, 0.1, 64, fu, y);
        EXPECT_EQ(hh::kernels::fused_scan_launches() - launches, in_scan ? 1 : 0) << what << ": the path taken";
        hh::kernels::set_output_in_scan(true);
        hh::kernels::set_fusion_in_scan(false);
        return state;
      };
      auto got = torch::full({B, T, Hy, Dv}, 7.0, dev), want = torch::full({B, T, Hy, Dv}, 7.0, dev);
      const auto state = run(true, got), want_state = run(false, want);
      EXPECT_TRUE(torch::equal(state, want_state)) << what << " (final state)";
      expect_fused_heads_close(got, want, heads, what);
      // The column scan with the fusion against its output through the fusion kernel (the default).
      // (EXPECT, not ASSERT: a failure must not leave the segments or the switch set for later tests.)
      EXPECT_FALSE(hh::kernels::fusion_in_column_scan_enabled());
      hh::kernels::set_fusion_in_column_scan(true);
      EXPECT_TRUE(hh::kernels::column_scan_fuses(Dk, Dv)) << what;
      poison_allocator();
      auto col = torch::full({B, T, Hy, Dv}, 7.0, dev);
      const int64_t launches = hh::kernels::column_scan_launches(), cluster = hh::kernels::fused_scan_launches();
      const auto col_state = hh::attention::gdn_fused_output(q, k, v, g, beta, s0, 0.1, 64, fu, col);
      hh::kernels::set_fusion_in_column_scan(false);
      EXPECT_EQ(hh::kernels::column_scan_launches() - launches, 1) << what << ": the column scan";
      EXPECT_EQ(hh::kernels::fused_scan_launches() - cluster, 0) << what << ": not the cluster";
      auto col_apart = torch::full({B, T, Hy, Dv}, 7.0, dev);
      const auto col_apart_state = hh::attention::gdn_fused_output(q, k, v, g, beta, s0, 0.1, 64, fu, col_apart);
      EXPECT_EQ(hh::kernels::column_scan_launches() - launches, 2) << what << ": the column scan, its output apart";
      hh::kernels::set_scan_segments(hh::kernels::kAutoSegments);
      EXPECT_TRUE(torch::equal(col_state, col_apart_state)) << what << " (column scan, final state)";
      expect_fused_heads_close(col, col_apart, heads, what + " (column scan)");
      EXPECT_LT(rel_err(col_state, state), 3e-3) << what << " (column scan against the cluster's final state)";
    }
}

// The LA heads' short convolution, RoPE and L2 norm inside chunk_factors (ShortConvInputs) against the
// same steps as kernels of their own before it: every factor bit for bit, over two sequences (the
// convolution's window must not reach across them) with a partial last chunk, and over two sequences
// shorter than the convolution's window; then through
// gdn_fused_output, whose output and final state must be the same bits as with q, k, v convolved first.
TEST(CudaGdn, ShortConvInsideChunkFactorsEqualsItsOwnKernels) {
  ASSERT_TRUE(torch::cuda::is_available());
  const int64_t B = 2, H = 3;
  // 150 tokens: three chunks a sequence, the last partial; 2 tokens: one chunk whose 67 rows (from three
  // before the sequence on) lie all but two outside it, read as zeros.
  for (int64_t T : {150, 2})
    for (torch::Dtype dt : {torch::kBFloat16, torch::kHalf})
      for (int64_t D : {128, 64}) {
        const int64_t per = (T + 63) / 64;
        const std::string what = std::string(c10::toString(dt)) + " D=" + std::to_string(D) + " T=" + std::to_string(T);
        const auto dev = kCuda.dtype(dt), f32 = kCuda.dtype(torch::kFloat);
        const auto q = torch::randn({B, T, H, D}, dev), k = torch::randn({B, T, H, D}, dev), v = torch::randn({B, T, H, D}, dev);
        hh::kernels::ShortConvInputs conv;
        conv.wq = 0.5 * torch::randn({H * D, 1, 4}, dev);
        conv.wk = 0.5 * torch::randn({H * D, 1, 4}, dev);
        conv.wv = 0.5 * torch::randn({H * D, 1, 4}, dev);
        std::tie(conv.cos, conv.sin) =
            hh::model::rope_cos_sin(hh::model::rope_inv_freq(10000.0, D, torch::kCUDA), 0, T, dt);
        conv.eps = 1e-6;
        const auto g = (-0.5 * torch::rand({B, T, H}, kF64)).to(f32), beta = torch::rand({B, T, H}, kF64).to(f32);
        auto flat = [&](const torch::Tensor& x) { return x.reshape({B, T, H * D}); };
        const auto qc = hh::kernels::causal_conv_silu_rope_l2norm(flat(q), conv.wq, conv.cos, conv.sin, D, 1e-6).view({B, T, H, D});
        const auto kc = hh::kernels::causal_conv_silu_rope_l2norm(flat(k), conv.wk, conv.cos, conv.sin, D, 1e-6).view({B, T, H, D});
        const auto vc = hh::kernels::causal_conv_silu(flat(v), conv.wv).view({B, T, H, D});
        const hh::kernels::ChunkGrid grid{B * per, per, {}};
        const auto want = hh::kernels::chunk_factors(kc, vc, g, beta, grid, qc, 0.1);
        poison_allocator();
        const auto got = hh::kernels::chunk_factors(k, v, g, beta, grid, q, 0.1, &conv);
        const std::vector<std::pair<const char*, std::pair<torch::Tensor, torch::Tensor>>> pairs = {
            {"W", {got.W, want.W}},       {"U", {got.U, want.U}},          {"kdecay", {got.kdecay, want.kdecay}},
            {"decay", {got.decay, want.decay}}, {"bound", {got.bound, want.bound}}, {"Qd", {got.Qd, want.Qd}},
            {"Aq", {got.Aq, want.Aq}},    {"aq_inv", {got.aq_inv, want.aq_inv}}};
        for (const auto& [name, t] : pairs) EXPECT_TRUE(torch::equal(t.first, t.second)) << what << ": " << name;
        // Three blocks an SM instead of four (bfloat16, D = 128; elsewhere the same kernel): the same bits.
        hh::kernels::set_factors_four_blocks(false);
        poison_allocator();
        const auto three = hh::kernels::chunk_factors(k, v, g, beta, grid, q, 0.1, &conv);
        hh::kernels::set_factors_four_blocks(true);
        EXPECT_TRUE(torch::equal(three.W, got.W) && torch::equal(three.U, got.U) && torch::equal(three.kdecay, got.kdecay) &&
                    torch::equal(three.Qd, got.Qd) && torch::equal(three.Aq, got.Aq) && torch::equal(three.bound, got.bound))
            << what << ": three blocks an SM";

        hh::kernels::OutputFusion fu;
        fu.gate = torch::randn({B, T, H * D}, dev);
        fu.gamma = 1 + 0.3 * torch::randn({H, D}, dev);
        fu.act = hh::kernels::GateActivation::kSilu;
        fu.heads = {0, 1, 2};
        torch::NoGradGuard no_grad;
        auto y_want = torch::full({B, T, H, D}, 7.0, dev), y_got = torch::full({B, T, H, D}, 7.0, dev);
        const auto s_want = hh::attention::gdn_fused_output(qc, kc, vc, g, beta, torch::Tensor(), 0.1, 64, fu, y_want);
        const auto s_got = hh::attention::gdn_fused_output(q, k, v, g, beta, torch::Tensor(), 0.1, 64, fu, y_got, &conv);
        EXPECT_TRUE(torch::equal(y_got, y_want)) << what << " (fused output)";
        EXPECT_TRUE(torch::equal(s_got, s_want)) << what << " (final state)";
        // With the convolution kept out of chunk_factors, gdn_fused_output runs its kernels first: the same bits.
        hh::kernels::set_conv_in_factors(false);
        auto y_apart = torch::full({B, T, H, D}, 7.0, dev);
        const auto s_apart = hh::attention::gdn_fused_output(q, k, v, g, beta, torch::Tensor(), 0.1, 64, fu, y_apart, &conv);
        hh::kernels::set_conv_in_factors(true);
        EXPECT_TRUE(torch::equal(y_apart, y_want)) << what << " (convolution apart)";
        EXPECT_TRUE(torch::equal(s_apart, s_want)) << what << " (convolution apart, final state)";
      }
  // chunk_factors refuses the convolution without q, on a gathered grid, and with T for the backward.
  const auto dev = kCuda.dtype(torch::kBFloat16), f32 = kCuda.dtype(torch::kFloat);
  const auto x = torch::randn({1, 64, 1, 64}, dev);
  hh::kernels::ShortConvInputs conv;
  conv.wq = conv.wk = conv.wv = torch::randn({64, 1, 4}, dev);
  conv.cos = conv.sin = torch::randn({64, 64}, dev);
  const auto g = -torch::rand({1, 64, 1}, f32), beta = torch::rand({1, 64, 1}, f32);
  const hh::kernels::ChunkGrid grid{1, 1, {}};
  EXPECT_THROW(hh::kernels::chunk_factors(x, x, g, beta, grid, torch::Tensor(), 0.1, &conv), std::invalid_argument);
  EXPECT_THROW(hh::kernels::chunk_factors(x, x, g, beta, grid, x, 0.1, &conv, hh::kernels::UForm::kFloat32, true),
               std::invalid_argument);
  const hh::kernels::ChunkGrid gathered{1, 0, torch::arange(64, kCuda.dtype(torch::kLong))};
  EXPECT_THROW(hh::kernels::chunk_factors(x, x, g, beta, gathered, x, 0.1, &conv), std::invalid_argument);
}

// More chunks than one launch's grid takes (2^16 - 1 along y): chunk_factors launches in slices, and
// the chunks of the second slice equal the same rows' factors computed alone (each chunk's factors
// depend on its own rows only), with the convolution inside as well (its rows reach three tokens back,
// so the rows alone start three tokens early and the first chunk is left out of the comparison).
TEST(CudaGdn, ChunkFactorsPastOneLaunchEqualTheSameRowsAlone) {
  ASSERT_TRUE(torch::cuda::is_available());
  const int64_t D = 64, per = 65535 + 3, T = per * 64 - 20, H = 1, first = 65534;  // the compared rows' chunks from `first`
  namespace F = torch::nn::functional;
  const auto dev = kCuda.dtype(torch::kBFloat16), f32 = kCuda.dtype(torch::kFloat);
  // As chunk_in's, drawn on the GPU (4.2M rows).
  const auto nrm = F::NormalizeFuncOptions().dim(-1);
  const auto q = F::normalize(torch::randn({1, T, H, D}, f32), nrm).to(dev), k = F::normalize(torch::randn({1, T, H, D}, f32), nrm).to(dev);
  const auto v = torch::randn({1, T, H, D}, dev), g = -0.5 * torch::rand({1, T, H}, f32), beta = torch::rand({1, T, H}, f32);
  hh::kernels::ShortConvInputs conv;
  conv.wq = 0.5 * torch::randn({H * D, 1, 4}, dev);
  conv.wk = 0.5 * torch::randn({H * D, 1, 4}, dev);
  conv.wv = 0.5 * torch::randn({H * D, 1, 4}, dev);
  std::tie(conv.cos, conv.sin) = hh::model::rope_cos_sin(hh::model::rope_inv_freq(10000.0, D, torch::kCUDA), 0, T, torch::kBFloat16);
  conv.eps = 1e-6;
  for (bool with_conv : {false, true}) {
    const std::string what = with_conv ? "with the convolution" : "without";
    poison_allocator();
    const auto all = with_conv ? hh::kernels::chunk_factors(k, v, g, beta, {per, per, {}}, q, 0.1, &conv)
                               : hh::kernels::chunk_factors(k, v, g, beta, {per, per, {}}, q, 0.1);
    // The rows from chunk first - 1 on (one chunk of context for the convolution), as a sequence of their own.
    const int64_t t0 = (first - 1) * 64, len = T - t0, sub_per = (len + 63) / 64;
    auto rows = [&](const torch::Tensor& x) { return x.narrow(1, t0, len).contiguous(); };
    hh::kernels::ShortConvInputs sub_conv = conv;
    sub_conv.cos = conv.cos.narrow(0, t0, len).contiguous();
    sub_conv.sin = conv.sin.narrow(0, t0, len).contiguous();
    const hh::kernels::ChunkGrid sub_grid{sub_per, sub_per, {}};
    const auto alone = with_conv ? hh::kernels::chunk_factors(rows(k), rows(v), rows(g), rows(beta), sub_grid, rows(q), 0.1, &sub_conv)
                                 : hh::kernels::chunk_factors(rows(k), rows(v), rows(g), rows(beta), sub_grid, rows(q), 0.1);
    // Chunks first .. per - 1 of the whole against chunks 1 .. of the rows alone.
    auto tail = [&](const torch::Tensor& x, int64_t from) { return x.narrow(1, from, per - first); };
    const std::vector<std::pair<const char*, std::pair<torch::Tensor, torch::Tensor>>> pairs = {
        {"W", {all.W, alone.W}},    {"U", {all.U, alone.U}},    {"kdecay", {all.kdecay, alone.kdecay}},
        {"Qd", {all.Qd, alone.Qd}}, {"Aq", {all.Aq, alone.Aq}}, {"bound", {all.bound, alone.bound}},
        {"decay", {all.decay, alone.decay}}};
    for (const auto& [name, t] : pairs)
      EXPECT_TRUE(torch::equal(tail(t.first, first), tail(t.second, 1))) << what << ": " << name;
  }
}

// Keys outside the rule's contract: every key of a head along one direction with beta |k|^2 = 2.3, so
// each token multiplies the state's component along it by -1.3 e^g. A chunk's decay e^{-16} alone
// would let a piece start one chunk early, but its transition grows that component by 1.3^64 e^{-16}
// = 2.2: the pieces must start at their sequences' starts, giving the whole scan's values bit for bit.
TEST(CudaGdn, PiecesWarmUpFromTheSequenceStartWhereTransitionsGrow) {
  ASSERT_TRUE(torch::cuda::is_available());
  const int64_t B = 2, T = 64 * 12, H = 2, D = 128;
  const auto dev = kCuda.dtype(torch::kBFloat16), f32 = kCuda.dtype(torch::kFloat);
  const auto dir = torch::nn::functional::normalize(torch::randn({1, 1, H, D}, kF64),
                                                    torch::nn::functional::NormalizeFuncOptions().dim(-1));
  const auto k = (std::sqrt(2.3) * dir).expand({B, T, H, D}).contiguous().to(dev);
  const auto q = torch::randn({B, T, H, D}, kF64).div(std::sqrt(static_cast<double>(D))).to(dev);
  const auto v = torch::randn({B, T, H, D}, kF64).to(dev);
  const auto g = torch::full({B, T, H}, -0.25, f32), beta = torch::ones({B, T, H}, f32);
  const auto s0 = torch::randn({B, H, D, D}, f32);
  const auto kk = k.to(torch::kDouble).pow(2).sum(-1);
  ASSERT_GT(kk.min().item<double>(), 2.29);  // bfloat16's rounding keeps beta |k|^2 near 2.3
  ASSERT_LT(kk.max().item<double>(), 2.31);
  const auto grid = hh::kernels::ChunkGrid{B * 12, 12, {}};
  const auto f = hh::kernels::chunk_factors(k, v, g.contiguous(), beta, grid);
  EXPECT_GT(f.bound.min().item<double>(), 0.0) << "each chunk's norm bound: about -16 + 64 log 1.3 = 0.79";
  auto run = [&](int64_t segments, bool grad) {
    hh::kernels::set_scan_segments(segments);
    auto ql = q.detach().requires_grad_(grad), kl = k.detach().requires_grad_(grad), vl = v.detach().requires_grad_(grad);
    const auto out = gdn_chunked_scan(ql, kl, vl, g, beta, s0, 0.1);
    std::vector<torch::Tensor> r{out.o, out.state};
    if (grad) {
      (out.o.to(torch::kFloat) * torch::cos(torch::arange(out.o.numel(), f32).view(out.o.sizes()))).sum().backward();
      r.insert(r.end(), {ql.grad(), kl.grad(), vl.grad()});
    }
    hh::kernels::set_scan_segments(hh::kernels::kAutoSegments);
    return r;
  };
  for (bool grad : {false, true}) {
    const auto whole = run(0, grad), pieces = run(2, grad);
    const char* names[] = {"o", "final state", "dq", "dk", "dv"};
    for (size_t i = 0; i < whole.size(); ++i)
      EXPECT_TRUE(torch::equal(whole[i], pieces[i])) << names[i] << (grad ? " (forward + backward)" : "");
  }
  const auto ref = gdn_recurrent(q.to(torch::kCPU, torch::kDouble), k.to(torch::kCPU, torch::kDouble),
                                 v.to(torch::kCPU, torch::kDouble), g.to(torch::kCPU, torch::kDouble),
                                 beta.to(torch::kCPU, torch::kDouble), s0.to(torch::kCPU, torch::kDouble), 0.1);
  const auto got = run(2, false);
  EXPECT_LT(rel_err(got[0], ref.o), 2e-2);
  EXPECT_LT(rel_err(got[1], ref.state), 2e-2);
}

// A piece's warm-up writes nothing. With every decay 1 (g = 0) and beta |k|^2 <= 1, no chunk's norm bound
// lets a piece start late: each piece's warm-up runs from its sequence's start (reverse: its end), across
// every piece before (after) it. Only every other piece runs (set_scan_pieces_of_parity), into outputs from
// a NaN-poisoned allocator or NaN-filled: the chunks of the pieces left out must stay NaN, those of the
// pieces run must be the bits of the run of every piece, and the run of every piece the bits of the scan of
// whole sequences (each warm-up from the sequence's start repeats its operations exactly: so the warm-ups did
// cross the pieces left out). The rule's forward (o) by the column scan and in
// blocks of 32 columns, each without and with a graph (the forms that also write the history), and the
// backward's reverse scan forming the direct term (its history S16 and M16) by the column scan and in blocks
// of 16 columns; B = 2, the last chunk partial.
TEST(CudaGdn, AWarmUpWritesNothing) {
  ASSERT_TRUE(torch::cuda::is_available());
  ASSERT_EQ(hh::kernels::scan_pieces_of_parity(), -1);
  const int64_t B = 2, per = 12, N = B * per, T = 64 * per - 5, H = 2, D = 128, len = 2;
  const double scale = 0.1;
  const ChunkIn in = chunk_in(B, T, H, D, D, torch::kBFloat16);
  const auto g = torch::zeros_like(in.g);
  const auto s0 = torch::randn({B, H, D, D}, kF64).to(kCuda.dtype(torch::kFloat));
  auto kept = [&](int64_t chunk_in_sequence, int parity) { return (chunk_in_sequence / len) % 2 == parity; };
  for (int columns : {0, 32})
    for (bool grad : {false, true}) {
      const std::string what = std::string("forward, ") + (columns == 0 ? "column scan" : "blocks of 32 columns") +
                               (grad ? ", with a graph" : "");
      hh::kernels::set_scan_columns(columns);
      auto forward = [&](int parity, int64_t segment) {
        std::vector<torch::Tensor> x = {in.q, in.k, in.v};
        if (grad)
          for (auto& t : x) t = t.detach().requires_grad_(true);
        std::optional<torch::NoGradGuard> no_grad;
        if (!grad) no_grad.emplace();
        hh::kernels::set_scan_segments(segment);
        hh::kernels::set_scan_pieces_of_parity(parity);
        poison_allocator();
        const auto o = gdn_chunked_scan(x[0], x[1], x[2], g, in.beta, s0, scale).o.detach();
        hh::kernels::set_scan_pieces_of_parity(-1);
        EXPECT_EQ(hh::kernels::last_scan_piece_chunks(), segment) << what;
        return o;
      };
      const auto every = forward(-1, len);
      ASSERT_FALSE(every.isnan().any().item<bool>()) << what;
      EXPECT_TRUE(torch::equal(every, forward(-1, 0))) << what << ": the pieces against whole sequences";
      for (int parity : {0, 1}) {
        const auto some = forward(parity, len);
        for (int64_t n = 0; n < per; ++n) {
          const int64_t t0 = 64 * n, rows = std::min<int64_t>(64, T - t0);
          const auto got = some.narrow(1, t0, rows), want = every.narrow(1, t0, rows);
          const std::string where = what + ", pieces of parity " + std::to_string(parity) + ", chunk " + std::to_string(n);
          if (kept(n, parity)) {
            EXPECT_TRUE(torch::equal(got, want)) << where;
          } else {
            EXPECT_TRUE(got.isnan().all().item<bool>()) << where << ": written by another piece's warm-up";
          }
        }
      }
    }
  const hh::kernels::ChunkGrid grid{N, per, {}};
  const std::vector<int64_t> offsets = {0, per, N};
  const auto f = hh::kernels::chunk_factors(in.k, in.v, g, in.beta, grid, in.q, scale);
  EXPECT_EQ(f.bound.max().item<double>(), 0.0) << "every chunk's norm bound: decay 1, |1 - beta k.k| <= 1";
  const auto d16 = hh::kernels::grad_to_grid_f16(torch::randn({B, T, H, D}, kF64).to(kCuda.dtype(torch::kBFloat16)), grid);
  const auto dfin = torch::randn({B, H, D, D}, kF64).to(kCuda.dtype(torch::kFloat));
  for (int columns : {0, 16}) {
    const std::string what = std::string("reverse scan with the direct term, ") + (columns == 0 ? "column scan" : "blocks of 16 columns");
    hh::kernels::set_scan_columns(columns);
    auto reverse = [&](int parity, int64_t segment) {
      const hh::kernels::LowRankScanArgs a = reverse_scan_args(f, &d16, dfin, segment);
      hh::kernels::set_scan_pieces_of_parity(parity);
      (void)hh::kernels::low_rank_scan(a, offsets);
      hh::kernels::set_scan_pieces_of_parity(-1);
      return std::vector<torch::Tensor>{a.S16, a.S_inv, a.M16, a.M_inv};
    };
    const char* names[] = {"S16", "S_inv", "M16", "M_inv"};
    const auto every = reverse(-1, len), whole = reverse(-1, 0);
    for (size_t i = 0; i < every.size(); ++i) {
      ASSERT_FALSE(every[i].isnan().any().item<bool>()) << what << ": " << names[i];
      EXPECT_TRUE(torch::equal(every[i], whole[i])) << what << ": " << names[i] << ", the pieces against whole sequences";
    }
    for (int parity : {0, 1}) {
      const auto some = reverse(parity, len);
      for (size_t i = 0; i < every.size(); ++i)
        for (int64_t n = 0; n < N; ++n) {
          const auto got = some[i].select(1, n), want = every[i].select(1, n);
          const std::string where = what + ", pieces of parity " + std::to_string(parity) + ", " + names[i] + " of chunk " +
                                    std::to_string(n);
          if (kept(n % per, parity)) {
            EXPECT_TRUE(torch::equal(got, want)) << where;
          } else {
            EXPECT_TRUE(got.isnan().all().item<bool>()) << where << ": written by another piece's warm-up";
          }
        }
    }
  }
  hh::kernels::set_scan_columns(0);
  hh::kernels::set_scan_segments(hh::kernels::kAutoSegments);
  EXPECT_THROW(hh::kernels::set_scan_pieces_of_parity(2), std::invalid_argument);
}

TEST(CudaGdn, ShortConvKernelEqualsConv1dThenSilu) {
  ASSERT_TRUE(torch::cuda::is_available());
  for (auto dt : {torch::kFloat, torch::kBFloat16})
    for (int64_t C : {256, 20})  // in 16-byte packs; channel by channel
      for (int64_t T : {1, 3, 37}) {
        const auto opts = kCuda.dtype(dt);
        const int64_t B = 2;
        const auto x = torch::randn({B, T, C}, opts), w = 0.5 * torch::randn({C, 1, 4}, opts);
        // The reference: left-pad three zeros, depthwise conv1d, SiLU (as hybrid.cpp's short_conv).
        const auto full = torch::cat({torch::zeros({B, C, 3}, opts), x.transpose(1, 2)}, 2);
        const std::vector<int64_t> one = {1}, zero = {0};
        const auto want = torch::silu(torch::conv1d(full, w, torch::Tensor(), one, zero, one, C)).transpose(1, 2);
        const auto got = hh::kernels::causal_conv_silu(x, w);
        const double tol = dt == torch::kFloat ? 1e-5 : 2.0 / 128;  // a different float32 sum order, rounded
        EXPECT_LT(rel_err(got, want), tol) << "C=" << C << " T=" << T << (dt == torch::kFloat ? " f32" : " bf16");
      }
}

// The convolution's backward kernel (training's) against autograd through conv1d and SiLU in float64 on
// the same inputs: dx and the taps' gradient, sequences shorter than the taps and not a multiple of the
// kernel's 32-step runs, channels not a multiple of its 128-thread blocks; what it refuses.
TEST(CudaGdn, ShortConvBackwardEqualsAutogradInFloat64) {
  ASSERT_TRUE(torch::cuda::is_available());
  for (auto dt : {torch::kFloat, torch::kBFloat16})
    for (int64_t C : {200, 5})
      for (int64_t T : {1, 3, 37, 100, 300}) {  // 300: several blocks of 4 runs of 32 steps
        const auto opts = kCuda.dtype(dt);
        const int64_t B = 2;
        const auto x = torch::randn({B, T, C}, opts), w = 0.5 * torch::randn({C, 1, 4}, opts), dy = torch::randn({B, T, C}, opts);
        const auto xd = x.to(torch::kDouble).requires_grad_(), wd = w.to(torch::kDouble).requires_grad_();
        const auto full = torch::cat({torch::zeros({B, C, 3}, xd.options()), xd.transpose(1, 2)}, 2);
        const std::vector<int64_t> one = {1}, zero = {0};
        torch::silu(torch::conv1d(full, wd, torch::Tensor(), one, zero, one, C)).transpose(1, 2).backward(dy.to(torch::kDouble));
        const auto [dx, dw] = hh::kernels::causal_conv_silu_backward(dy, x, w);
        const std::string what = "C=" + std::to_string(C) + " T=" + std::to_string(T) + (dt == torch::kFloat ? " f32" : " bf16");
        ASSERT_EQ(dx.sizes(), x.sizes()) << what;
        ASSERT_EQ(dw.sizes(), w.sizes()) << what;
        const double tol = dt == torch::kFloat ? 1e-5 : 2e-2;  // bfloat16: its roundings of z, dz and dx
        EXPECT_LT(rel_err(dx, xd.grad()), tol) << what << ": dx";
        EXPECT_LT(rel_err(dw, wd.grad()), tol) << what << ": dweight";
      }
  const auto x = torch::randn({1, 4, 8}, kCuda);
  EXPECT_THROW(hh::kernels::causal_conv_silu_backward(x, x, torch::randn({8, 1, 3}, kCuda)), std::invalid_argument);
  EXPECT_THROW(hh::kernels::causal_conv_silu_backward(x.narrow(1, 0, 3), x, torch::randn({8, 1, 4}, kCuda)), std::invalid_argument);
}

// The LA heads' q and k in one pass equal the short convolution's kernel then rope_l2norm's, bit for
// bit: the same roundings in the same order. Several heads, sequences not a multiple of the kernels' 8 and 4
// time steps, the head sizes and dtypes it takes; shapes it does not take are refused.
TEST(CudaGdn, ConvRopeL2normEqualsTheTwoKernels) {
  ASSERT_TRUE(torch::cuda::is_available());
  for (auto dt : {torch::kBFloat16, torch::kHalf, torch::kFloat})
    for (int64_t Dh : {128, 64})
      for (auto [B, T, H] : {std::tuple<int64_t, int64_t, int64_t>{2, 37, 3}, {1, 8, 2}, {3, 1, 1}}) {
        const std::string what = std::string(c10::toString(dt)) + " Dh=" + std::to_string(Dh) + " B=" + std::to_string(B) +
                                 " T=" + std::to_string(T) + " H=" + std::to_string(H);
        const auto opts = kCuda.dtype(dt);
        const int64_t C = H * Dh;
        const auto x = torch::randn({B, T, C}, opts), w = 0.5 * torch::randn({C, 1, 4}, opts);
        const auto inv_freq = 1.0 / torch::pow(10000.0, torch::arange(0, Dh, 2, kCuda.dtype(torch::kFloat)) / Dh);
        const auto [cos, sin] = hh::model::rope_cos_sin(inv_freq, 5, T, dt);
        ASSERT_TRUE(hh::kernels::conv_rope_l2norm_supported(C, Dh, dt)) << what;
        const auto want = hh::kernels::rope_l2norm(hh::kernels::causal_conv_silu(x, w).view({B, T, H, Dh}), cos, sin, 1e-6);
        poison_allocator();
        const auto got = hh::kernels::causal_conv_silu_rope_l2norm(x, w, cos, sin, Dh, 1e-6);
        ASSERT_EQ(got.sizes(), want.sizes()) << what;
        EXPECT_TRUE(torch::equal(got, want)) << what << ": largest difference "
                                             << (got.to(torch::kFloat) - want.to(torch::kFloat)).abs().max().item<float>();
      }
  // 48 = 6 packs of bfloat16 (not a power of two); C not a multiple of Dh.
  EXPECT_FALSE(hh::kernels::conv_rope_l2norm_supported(96, 48, torch::kBFloat16));
  EXPECT_FALSE(hh::kernels::conv_rope_l2norm_supported(200, 128, torch::kBFloat16));
  const auto x = torch::randn({1, 4, 96}, kCuda.dtype(torch::kBFloat16)), w = torch::randn({96, 1, 4}, kCuda.dtype(torch::kBFloat16));
  const auto cs = torch::ones({4, 48}, kCuda.dtype(torch::kBFloat16));
  EXPECT_THROW(hh::kernels::causal_conv_silu_rope_l2norm(x, w, cs, cs, 48, 1e-6), std::invalid_argument);
}

TEST(CudaGdn, ChunkGridCopiesEqualThePermutingCopies) {
  ASSERT_TRUE(torch::cuda::is_available());
  const int64_t B = 2, T = 150, H = 3, D = 64, C = 64, per = 3;  // T not a whole number of chunks
  const double scale = 0.37;
  for (torch::Dtype dt : {torch::kBFloat16, torch::kHalf}) {
    const std::string what = c10::toString(dt);
    const auto x = torch::randn({B, T, H, D}, kCuda.dtype(dt));
    // [B, T, H, D] -> pad T -> [B, per, C, H, D] -> [H, B, per, C, D] in float32, times scale.
    const auto padded = torch::cat({x, torch::zeros({B, per * C - T, H, D}, x.options())}, 1);
    const auto want = padded.reshape({B, per, C, H, D}).permute({3, 0, 1, 2, 4}).to(torch::kFloat).mul(scale).reshape({H, B * per, C, D});
    poison_allocator();
    const auto grid = hh::kernels::to_chunk_grid(x, C, scale);
    EXPECT_TRUE(torch::equal(grid, want)) << what;  // the same float32 products, padding zero

    const auto y = torch::randn({H, B * per, C, D}, kCuda.dtype(torch::kFloat));
    const auto back_want = y.reshape({H, B, per * C, D}).narrow(2, 0, T).permute({1, 2, 0, 3}).mul(scale).to(dt);
    poison_allocator();
    const auto back = hh::kernels::from_chunk_grid(y, B, T, dt, scale);
    EXPECT_TRUE(torch::equal(back, back_want)) << what;
  }
  EXPECT_THROW(hh::kernels::to_chunk_grid(torch::randn({1, 4, 2, 12}, kCuda.dtype(torch::kBFloat16)), 64, 1.0),
               std::invalid_argument);  // D not a multiple of 8
}

TEST(CudaGdn, RowDotEqualsTheSumOfProductsInFloat64) {
  ASSERT_TRUE(torch::cuda::is_available());
  const auto f32 = kCuda.dtype(torch::kFloat);
  // Each lane of a row's warp sums D / 32 products in one float32 chain, then five levels of a tree:
  // every row within float32's bound for sums of that length, (D / 32 + 5) 2^-24 sum_i |a_i b_i|. (A
  // bound relative to the row's sum itself fails now and then: random rows can nearly cancel.)
  auto check = [&](const torch::Tensor& a, const torch::Tensor& b, const std::string& what) {
    const auto prod = a.to(torch::kCPU, torch::kDouble) * b.to(torch::kCPU, torch::kDouble);
    const auto want = prod.sum(-1);
    const double chain = static_cast<double>((a.size(-1) + 31) / 32 + 5) * std::ldexp(1.0, -24);
    poison_allocator();
    const auto got = hh::kernels::row_dot(a, b);
    ASSERT_EQ(got.sizes(), want.sizes()) << what;
    const auto err = (got.to(torch::kCPU, torch::kDouble) - want).abs();
    EXPECT_TRUE((err <= chain * prod.abs().sum(-1)).all().item<bool>())
        << what << ": largest error " << err.max().item<double>();
  };
  // 16-byte loads (D = 128, the rule's rows; D = 16384, a whole state per row), the scalar path
  // (D = 17; a row start off 16-byte alignment), and D = 1.
  for (const auto& shape : {std::vector<int64_t>{3, 5, 64, 128}, {7, 16384}, {4, 9, 17}, {33, 1}})
    check(torch::randn(shape, f32), torch::randn(shape, f32), "shape " + c10::str(at::IntArrayRef(shape)));
  const auto flat = torch::randn({1 + 6 * 128}, f32);
  const auto shifted = flat.narrow(0, 1, 6 * 128).view({6, 128});
  check(shifted, torch::randn({6, 128}, f32), "rows off 16-byte alignment");
  EXPECT_THROW(hh::kernels::row_dot(torch::randn({4, 8}, f32), torch::randn({4, 9}, f32)), std::invalid_argument);
  EXPECT_THROW(hh::kernels::row_dot(torch::randn({4, 8}, f32).t(), torch::randn({8, 4}, f32)), std::invalid_argument);
}

TEST(CudaGdn, UnitLowerInverseKernelInverts) {
  ASSERT_TRUE(torch::cuda::is_available());
  for (int64_t C : {1, 17, 64}) {
    const auto L = (torch::randn({3, 5, C, C}, kF64) * 0.3).tril(-1);
    const auto T = hh::kernels::unit_lower_inverse(L.to(kCuda.dtype(torch::kFloat)));
    const auto eye = torch::eye(C, kF64);
    const auto want = torch::linalg_solve_triangular(L + eye, eye.expand({3, 5, C, C}), false, true, true);
    EXPECT_LT(rel_err(T, want), 1e-5) << "C=" << C;
    EXPECT_TRUE(torch::equal(T.cpu().triu(1), torch::zeros({3, 5, C, C}))) << "C=" << C;
  }
}
#endif

TEST(CudaGdn, ChunkedRuleOnCudaEqualsTheRecurrence) {
  ASSERT_TRUE(torch::cuda::is_available());
  struct Case {
    int64_t B, T, H, D;
    torch::Dtype dt;
    double tol;
  };
  // float32 arithmetic throughout: far under 1e-3; bf16 inputs and output: the output's rounding.
  for (const Case& c : {Case{2, 1, 3, 128, torch::kFloat, 2e-4}, Case{2, 65, 3, 128, torch::kFloat, 2e-4},
                        Case{1, 1000, 2, 128, torch::kFloat, 2e-4}, Case{2, 333, 4, 64, torch::kFloat, 2e-4},
                        Case{1, 200, 5, 32, torch::kFloat, 2e-4}, Case{2, 777, 3, 128, torch::kBFloat16, 1e-2},
                        Case{1, 130, 2, 48, torch::kFloat, 2e-4}}) {  // Dv 48: the LibTorch scan
    const Inputs in = make_inputs(c.B, c.T, c.H, c.D, c.B);
    const Inputs d = on_device(in, c.dt);
    const Inputs ref_in = back_in_f64(d);
    const auto ref = gdn_recurrent(ref_in.q, ref_in.k, ref_in.v, ref_in.g, ref_in.beta, ref_in.s0, 0.1);
    const auto got = hh::attention::gdn(d.q, d.k, d.v, d.g, d.beta, d.s0, 0.1);
    const std::string what = "T=" + std::to_string(c.T) + " D=" + std::to_string(c.D) + " " + std::string(c10::toString(c.dt));
    EXPECT_EQ(got.o.scalar_type(), c.dt) << what;
    EXPECT_LT(rel_err(got.o, ref.o), c.tol) << what;
    EXPECT_LT(rel_err(got.state, ref.state), c.tol) << what;
  }
}

TEST(CudaGdn, PackedSequencesOnCudaEqualEachAlone) {
  ASSERT_TRUE(torch::cuda::is_available());
  const std::vector<int64_t> cu = {0, 100, 100, 164, 1000};
  const int64_t S = 4;
  const Inputs in = make_inputs(1, 1000, 3, 128, S);
  const Inputs d = on_device(in, torch::kBFloat16);
  const Inputs r = back_in_f64(d);
  const auto got = gdn_chunked_scan(d.q, d.k, d.v, d.g, d.beta, d.s0, 0.1, 64, cu);
  for (int64_t s = 0; s < S; ++s) {
    const int64_t a = cu[static_cast<size_t>(s)], len = cu[static_cast<size_t>(s) + 1] - a;
    if (len == 0) {
      EXPECT_LT(rel_err(got.state[s], r.s0[s]), 1e-7) << "empty sequence keeps its state";
      continue;
    }
    auto cut = [&](const torch::Tensor& x) { return x.narrow(1, a, len); };
    const auto alone = gdn_recurrent(cut(r.q), cut(r.k), cut(r.v), cut(r.g), cut(r.beta), r.s0.narrow(0, s, 1), 0.1);
    EXPECT_LT(rel_err(cut(got.o), alone.o), 1e-2) << "sequence " << s;
    // float32 states from TF32 products (16-bit inputs): ~3e-4.
    EXPECT_LT(rel_err(got.state.narrow(0, s, 1), alone.state), 2e-3) << "sequence " << s;
  }
}

TEST(CudaGdn, GradientsOnCudaEqualTheReferenceInFloat64) {
  ASSERT_TRUE(torch::cuda::is_available());
  using hh::attention::GdnBackward;
  for (GdnBackward mode : {GdnBackward::kKernels, GdnBackward::kExplicit, GdnBackward::kAutograd})
  for (torch::Dtype dt : {torch::kFloat, torch::kBFloat16}) {
    hh::attention::set_gdn_backward(mode);
    const Inputs in = make_inputs(2, 300, 3, 128, 2);
    Inputs d = on_device(in, dt);
    for (auto* t : {&d.q, &d.k, &d.v, &d.g, &d.beta, &d.s0}) t->requires_grad_(true);
    Inputs r = back_in_f64(d);
    for (auto* t : {&r.q, &r.k, &r.v, &r.g, &r.beta, &r.s0}) t->requires_grad_(true);
    const auto w_o = torch::randn({2, 300, 3, 128}, kF64), w_s = torch::randn({2, 3, 128, 128}, kF64);
    const auto got = gdn_chunked_scan(d.q, d.k, d.v, d.g, d.beta, d.s0, 0.1);
    const auto g_got = torch::autograd::grad(
        {(got.o.to(torch::kFloat) * w_o.to(kCuda.dtype(torch::kFloat))).sum() + (got.state * w_s.to(kCuda.dtype(torch::kFloat))).sum()},
        {d.q, d.k, d.v, d.g, d.beta, d.s0});
    const auto ref = gdn_chunked(r.q, r.k, r.v, r.g, r.beta, r.s0, 0.1);
    const auto g_ref = torch::autograd::grad({(ref.o * w_o).sum() + (ref.state * w_s).sum()}, {r.q, r.k, r.v, r.g, r.beta, r.s0});
    const char* names[] = {"q", "k", "v", "g", "beta", "s0"};
    // float32 arithmetic: 1e-4; bf16: the gradients are rounded to bf16 where the inputs are.
    const double tol = dt == torch::kFloat ? 1e-4 : 1e-2;
    for (size_t i = 0; i < 6; ++i)
      EXPECT_LT(rel_err(g_got[i], g_ref[i]), tol) << names[i] << " " << std::string(c10::toString(dt))
                                                  << (mode == GdnBackward::kKernels    ? " kernels"
                                                      : mode == GdnBackward::kExplicit ? " explicit"
                                                                                       : " autograd");
  }
  hh::attention::set_gdn_backward(GdnBackward::kKernels);
}

TEST(CudaGdn, FusionKernelMatchesTheOpSequence) {
  ASSERT_TRUE(torch::cuda::is_available());
  for (torch::Dtype dt : {torch::kFloat, torch::kBFloat16, torch::kHalf})
    for (int64_t Dh : {32, 100, 128, 256}) {
      const auto opts = kCuda.dtype(dt);
      auto o = (torch::randn({2, 37, 5, Dh}, opts) * 2).requires_grad_(true);
      auto gate = torch::sigmoid(torch::randn({2, 37, 5, Dh}, opts)).requires_grad_(true);
      auto gamma = (1 + 0.3 * torch::randn({5, Dh}, opts)).requires_grad_(true);
      const std::string what = std::string(c10::toString(dt)) + " Dh=" + std::to_string(Dh);
      const auto want = hh::attention::fusion_norm_reference(o, gate, gamma, 1e-6);
      const auto got = hh::attention::fusion_norm(o, gate, gamma, 1e-6);
      if (dt == torch::kFloat) {
        EXPECT_LT(rel_err(got, want), 1e-6) << what;
      } else {  // the same roundings: bit-identical but for a different float32 sum order in a few rows
        const double same = got.eq(want).to(torch::kDouble).mean().item<double>();
        EXPECT_GE(same, 0.98) << what;
        EXPECT_LT(rel_err(got, want), 1e-2) << what;
      }
      const auto dy = torch::randn_like(want);
      const auto g_want = torch::autograd::grad({(want * dy).sum()}, {o, gate, gamma});
      const auto g_got = torch::autograd::grad({(got * dy).sum()}, {o, gate, gamma});
      const double tol = dt == torch::kFloat ? 1e-5 : 2e-2;
      const char* names[] = {"o", "gate", "gamma"};
      for (size_t i = 0; i < 3; ++i) EXPECT_LT(rel_err(g_got[i], g_want[i]), tol) << names[i] << " " << what;
    }
}

// The forward with the gate's activation inside and each head written into its place in a wider
// output: against the reference on the activated gate, copied head by head, with the gate a column
// slice of a wider projection and the other heads of the output untouched.
TEST(CudaFusion, PlacedForwardEqualsTheReferenceHeadByHead) {
  ASSERT_TRUE(torch::cuda::is_available());
  using hh::kernels::GateActivation;
  for (torch::Dtype dt : {torch::kFloat, torch::kBFloat16, torch::kHalf})
    for (GateActivation act : {GateActivation::kSigmoid, GateActivation::kSilu, GateActivation::kNone}) {
      const auto opts = kCuda.dtype(dt);
      const int64_t B = 2, T = 37, n = 3, Dh = 128, Hy = 7;
      const std::vector<int64_t> heads = {0, 4, 5};
      const auto o = torch::randn({B, T, n, Dh}, opts);
      const auto proj = torch::randn({B, T, (n + 2) * Dh}, opts);  // the gate is columns Dh .. (n + 1) Dh
      const auto gate_pre = proj.narrow(2, Dh, n * Dh);
      const auto gamma = 1 + 0.3 * torch::randn({n, Dh}, opts);
      const auto gate = act == GateActivation::kSigmoid ? torch::sigmoid(gate_pre)
                        : act == GateActivation::kSilu  ? torch::silu(gate_pre)
                                                        : gate_pre.clone();
      const auto want = hh::attention::fusion_norm_reference(o, gate.view({B, T, n, Dh}), gamma, 1e-6);
      auto y = torch::full({B, T, Hy, Dh}, 7.0, opts);
      hh::kernels::fusion_norm_forward_into(o, gate_pre, act, gamma, 1e-6, y, heads);
      const std::string what = std::string(c10::toString(dt)) + " activation " + std::to_string(static_cast<int>(act));
      for (int64_t i = 0; i < n; ++i) {
        const auto got = y.select(2, heads[static_cast<size_t>(i)]), ref = want.select(2, i);
        if (dt == torch::kFloat) {
          EXPECT_LT(rel_err(got, ref), 1e-6) << what << " head " << i;
        } else {  // the same roundings, as in the test above
          EXPECT_GE(got.eq(ref).to(torch::kDouble).mean().item<double>(), 0.98) << what << " head " << i;
          EXPECT_LT(rel_err(got, ref), 1e-2) << what << " head " << i;
        }
      }
      for (int64_t h : {1, 2, 3, 6}) EXPECT_TRUE(y.select(2, h).eq(7.0).all().item<bool>()) << what << " head " << h;
    }
  auto y = torch::zeros({1, 4, 2, 128}, kCuda);
  EXPECT_THROW(hh::kernels::fusion_norm_forward_into(torch::zeros({1, 4, 1, 128}, kCuda), torch::zeros({1, 4, 128}, kCuda),
                                                     GateActivation::kNone, torch::ones({1, 128}, kCuda), 1e-6, y, {2}),
               std::invalid_argument);  // head position outside y
}

}  // namespace
