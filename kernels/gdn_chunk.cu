// The chunk-local halves of the chunked gated delta rule's forward for 16-bit inputs (DESIGN.md
// section 9), on either side of low_rank_scan. One block per (chunk, head) reads q, k, v, g and beta
// where they lie ([B, T, H, ...]), so nothing is copied onto the chunk grid first:
//   chunk_factors: G = cumsum(g), L = strict_lower(beta_t e^{G_t - G_i} k_t.k_i), T = (I + L)^{-1},
//                  W = T diag(beta e^G) K, U = T diag(beta) V, kdecay = e^{G_C - G} K, decay = e^{G_C}
//                  (W and kdecay in float16, as the scan streams them); given q, also the output's
//                  factors Qd = scale e^G Q and Aq = scale (Q K^T * e^{G_t - G_i}, i <= t) in block float16
//   chunk_output:  O = scale (diag(e^G) Q S_n + (Q K^T * e^{G_t - G_i}, i <= t) M_n)
//   chunk_output_f16: the same O = Qd S_n + Aq M_n from the scan's block float16 history
// with S_n the chunk's start state and M_n = U - W S_n its new values (both from the scan). Products
// run on the tensor cores with float32 accumulation: Q K^T and K K^T on the 16-bit inputs themselves
// (m16n8k16, exact products); the inverse's off-diagonal blocks in 3xTF32 (float32 accuracy); W and U
// on K and V as they are, times T diag(scale) split into two 16-bit parts (about 16 significant bits,
// more than TF32's 11); chunk_output_f16's on float16 blocks with their power-of-two scales (11
// significant bits an element, as TF32); chunk_output's with TF32 operands, S_n and M_n rounded to TF32
// as LibTorch's float32 GEMMs round them with TF32 allowed. core/attention/gdn.cpp's LibTorch form is
// the reference.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <cooperative_groups.h>

#include <algorithm>
#include <atomic>
#include <limits>
#include <stdexcept>
#include <string>

#include "kernels/chunk_common.cuh"

namespace hh::kernels {
namespace {

constexpr int kWarps = 8;
constexpr int kThreads = 32 * kWarps;
constexpr int kOutCols = 64;          // output columns a chunk_output block computes
constexpr int kLdOut = kOutCols + 8;  // float slices read as the B operand

// R rows x 64 columns of a float32 matrix at src (row stride ld) into dst [R][kLdOut].
template <int R>
__device__ __forceinline__ void load_slice(float* dst, const float* __restrict__ src, int64_t ld) {
  for (int i = threadIdx.x; i < R * kOutCols / 4; i += kThreads) {
    const int r = i / (kOutCols / 4), c = (i % (kOutCols / 4)) * 4;
    cp_async16(dst + r * kLdOut + c, src + r * ld + c);
  }
}

// x diag(s) for a pair of float32 values (one row, two consecutive columns) split into two 16-bit parts of
// T's kind, hi + lo (about 16 significant bits; 22 for float16), as m16n8k16 operand registers.
template <class T>
__device__ __forceinline__ void split16(float2 x, float2 s, unsigned& hi, unsigned& lo) {
  const float a = x.x * s.x, b = x.y * s.y;
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    const __nv_bfloat162 h = __floats2bfloat162_rn(a, b);
    const float2 f = __bfloat1622float2(h);
    const __nv_bfloat162 l = __floats2bfloat162_rn(a - f.x, b - f.y);
    hi = *reinterpret_cast<const unsigned*>(&h);
    lo = *reinterpret_cast<const unsigned*>(&l);
  } else {
    const __half2 h = __floats2half2_rn(a, b);
    const float2 f = __half22float2(h);
    const __half2 l = __floats2half2_rn(a - f.x, b - f.y);
    hi = *reinterpret_cast<const unsigned*>(&h);
    lo = *reinterpret_cast<const unsigned*>(&l);
  }
}

// Ts diag(scale) X for lower triangular Ts [C][kLdT] (float32) and a 16-bit [C][D] tile X of T's kind, on
// m16n8k16 products: Ts diag(scale) split into two 16-bit parts (split16) as the A operand, X exact as
// the B operand (ldmatrix.trans). The A operand's fragments for rows m.., columns k.. come from `a(m, k,
// hi, lo)`: SplitOf forms them in registers from float pairs at each use; SplitPacked reads them from
// the split blocks pack_split formed once for the block. Warp w computes the 16-row tiles w % 2 and 3 -
// w % 2 (equal work under the triangle: 1 + 4 or 2 + 3 16-deep steps) in columns (D / 4)(w / 2) .. + D /
// 4 - 1. lower_tile forms one of them: rows m .. m + 15 into acc (accumulator layout: tile j holds rows
// m + g, m + g + 8 of columns n0 + 8 j + 2 t, + 1).
template <class T>
struct SplitOf {
  const float* Ts;
  const float* scale;
  __device__ __forceinline__ void operator()(int m, int k, unsigned (&hi)[4], unsigned (&lo)[4]) const {
    const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
    const float* a0 = Ts + (m + g) * kLdT + k + 2 * t;
    const float* a1 = a0 + 8 * kLdT;
    const float2 s0 = *reinterpret_cast<const float2*>(scale + k + 2 * t);
    const float2 s8 = *reinterpret_cast<const float2*>(scale + k + 2 * t + 8);
    split16<T>(*reinterpret_cast<const float2*>(a0), s0, hi[0], lo[0]);
    split16<T>(*reinterpret_cast<const float2*>(a1), s0, hi[1], lo[1]);
    split16<T>(*reinterpret_cast<const float2*>(a0 + 8), s8, hi[2], lo[2]);
    split16<T>(*reinterpret_cast<const float2*>(a1 + 8), s8, hi[3], lo[3]);
  }
};
// Ts diag(scale)'s ten 16 x 16 blocks on and below the diagonal, split as SplitOf splits them, in 16-bit
// elements of T's kind at Ap: block (i, j) (j <= i) is p = i (i + 1) / 2 + j, its high parts at Ap + 256 p
// and its low parts at Ap + 256 (10 + p), each 16 rows of 32 bytes laid out by row32_unit. Every thread of
// the block takes part; the caller's barrier follows.
constexpr int kPackedSplitElems = 2 * 10 * 256;
template <class T>
__device__ __forceinline__ void pack_split(const float* Ts, const float* scale, T* Ap) {
  for (int u = threadIdx.x; u < 10 * 32; u += kThreads) {  // (block, row, half): eight elements each
    const int p = u / 32, r = (u % 32) / 2, half = u % 2;
    const int i = p < 1 ? 0 : (p < 3 ? 1 : (p < 6 ? 2 : 3)), j = p - i * (i + 1) / 2;
    const float* x = Ts + (16 * i + r) * kLdT + 16 * j + 8 * half;
    const float* s = scale + 16 * j + 8 * half;
    unsigned hi[4], lo[4];
#pragma unroll
    for (int e = 0; e < 4; ++e)
      split16<T>(*reinterpret_cast<const float2*>(x + 2 * e), *reinterpret_cast<const float2*>(s + 2 * e), hi[e], lo[e]);
    const int at = 256 * p + row32_unit<2>(r, half);
    *reinterpret_cast<uint4*>(Ap + at) = make_uint4(hi[0], hi[1], hi[2], hi[3]);
    *reinterpret_cast<uint4*>(Ap + 10 * 256 + at) = make_uint4(lo[0], lo[1], lo[2], lo[3]);
  }
}
template <class T>
struct SplitPacked {
  const T* Ap;
  __device__ __forceinline__ void operator()(int m, int k, unsigned (&hi)[4], unsigned (&lo)[4]) const {
    // Lane l gives row l % 8 + 8 ((l / 8) % 2), half l / 16 of the block: the fragments SplitOf forms.
    const int lane = threadIdx.x % 32, r = lane % 8 + 8 * ((lane / 8) % 2), half = lane / 16;
    const int i = m / 16, p = i * (i + 1) / 2 + k / 16;
    const T* at = Ap + 256 * p + row32_unit<2>(r, half);
    ldmatrix_x4(hi, at);
    ldmatrix_x4(lo, at + 10 * 256);
  }
};
__device__ __forceinline__ int lower_tile_row(int pass) {
  const int warp = threadIdx.x / 32;
  return 16 * (pass == 0 ? warp % 2 : 3 - warp % 2);
}
template <int D, class T, class A>
__device__ __forceinline__ void lower_tile(const A& a, const T* Xs, int m, float (&acc)[D / 32][4]) {
  constexpr int LD = ld16<D>(), NT = D / 32;  // 8-column tiles a warp
  static_assert(NT % 2 == 0, "two 8-column tiles a B load");
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int n0 = (warp / 2) * (D / 4);
  const T* b_at = Xs + (lane % 8 + 8 * ((lane / 8) % 2)) * LD + n0 + 8 * (lane / 16);
#pragma unroll
  for (int j = 0; j < NT; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.f;
  for (int k = 0; k < m + 16; k += 16) {  // Ts[r][k] = 0 for k > r
    unsigned hi[4], lo[4];
    a(m, k, hi, lo);
#pragma unroll
    for (int j = 0; j < NT; j += 2) {
      unsigned bf[4];
      ldmatrix_x4_trans(bf, b_at + k * LD + 8 * j);
      const unsigned b0[2] = {bf[0], bf[1]}, b1[2] = {bf[2], bf[3]};
      mma16<T>(acc[j], hi, b0);
      mma16<T>(acc[j], lo, b0);
      mma16<T>(acc[j + 1], hi, b1);
      mma16<T>(acc[j + 1], lo, b1);
    }
  }
}
// out = Ts diag(scale) X (row stride D), float32 or 16-bit, with Ts diag(scale)'s fragments from `a`
// (SplitOf, or SplitPacked where the split was packed once).
template <int D, class T, class O, class A>
__device__ __forceinline__ void lower_times(const A& a, const T* Xs, O* __restrict__ out) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const int n0 = (warp / 2) * (D / 4);
#pragma unroll 1
  for (int pass = 0; pass < 2; ++pass) {
    const int m = lower_tile_row(pass);
    float acc[D / 32][4];
    lower_tile<D>(a, Xs, m, acc);
    if constexpr (sizeof(O) == 2 && (D / 32) % 4 == 0) {  // a row's 16 bytes a lane
      store_tiles16<O>(acc, [&](int half) { return out + (m + g + 8 * half) * D + n0; });
    } else {
#pragma unroll
      for (int j = 0; j < D / 32; ++j)
#pragma unroll
        for (int e = 0; e < 4; e += 2) store2(out + (m + g + (e >= 2 ? 8 : 0)) * D + n0 + 8 * j + 2 * t, acc[j][e], acc[j][e + 1]);
    }
  }
}
// The same product into float16 with one power-of-two scale a column (UForm::kFloat16Columns): each
// column's largest |entry| over the C rows into [2^14, 2^15), floored at 2^-10 (scales up to 2^24), out16 =
// the scaled values (row stride D), inv [D] the scales' inverses. The two warps that share a column slice
// exchange their halves' maxima through xch (kWarps x D / 4 floats of shared memory no other warp uses
// meanwhile) behind a barrier of the pair alone (warp_pair_sync: named barriers 1 .. kWarps / 2).
template <int D, class T, class A>
__device__ __forceinline__ void lower_times_f16_columns(const A& a, const T* Xs, c10::Half* __restrict__ out16,
                                                        float* __restrict__ inv, float* xch) {
  constexpr int NT = D / 32;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const int n0 = (warp / 2) * (D / 4);
  float acc[2][NT][4];
  lower_tile<D>(a, Xs, lower_tile_row(0), acc[0]);
  lower_tile<D>(a, Xs, lower_tile_row(1), acc[1]);
  float mx[NT][2];  // columns n0 + 8 j + 2 t, + 1
#pragma unroll
  for (int j = 0; j < NT; ++j)
#pragma unroll
    for (int c = 0; c < 2; ++c) {
      mx[j][c] = fmaxf(fmaxf(fabsf(acc[0][j][c]), fabsf(acc[0][j][c + 2])), fmaxf(fabsf(acc[1][j][c]), fabsf(acc[1][j][c + 2])));
#pragma unroll
      for (int o = 4; o < 32; o <<= 1) mx[j][c] = fmaxf(mx[j][c], __shfl_xor_sync(0xffffffffu, mx[j][c], o));
    }
  float* const mine = xch + warp * (D / 4);
  if (g == 0)
#pragma unroll
    for (int j = 0; j < NT; ++j) store2(mine + 8 * j + 2 * t, mx[j][0], mx[j][1]);
  warp_pair_sync(warp);
  const float* const other = xch + (warp ^ 1) * (D / 4);
  uint32_t h16[2][2][NT];  // pass, row half, tile: the scaled pairs in float16
#pragma unroll
  for (int j = 0; j < NT; ++j) {
    const float2 o = *reinterpret_cast<const float2*>(other + 8 * j + 2 * t);
    const Pow2Scale s0 = pow2_scale(fmaxf(fmaxf(mx[j][0], o.x), 0x1p-10f)), s1 = pow2_scale(fmaxf(fmaxf(mx[j][1], o.y), 0x1p-10f));
    if (g == 0 && warp % 2 == 0) store2(inv + n0 + 8 * j + 2 * t, s0.inverse, s1.inverse);
#pragma unroll
    for (int pass = 0; pass < 2; ++pass)
#pragma unroll
      for (int half = 0; half < 2; ++half)
        h16[pass][half][j] = pack_f16(acc[pass][j][2 * half] * s0.scale, acc[pass][j][2 * half + 1] * s1.scale);
  }
#pragma unroll
  for (int pass = 0; pass < 2; ++pass)
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      c10::Half* const row = out16 + (lower_tile_row(pass) + g + 8 * half) * D + n0;
      if constexpr (NT % 4 == 0) {  // as store_tiles16, on pairs scaled by column
#pragma unroll
        for (int q = 0; q < NT / 4; ++q) {
          uint32_t p[4] = {h16[pass][half][4 * q], h16[pass][half][4 * q + 1], h16[pass][half][4 * q + 2], h16[pass][half][4 * q + 3]};
          store_quad16<false>(p, row, 4 * q);
        }
      } else {
#pragma unroll
        for (int j = 0; j < NT; ++j) *reinterpret_cast<uint32_t*>(row + 8 * j + 2 * t) = h16[pass][half][j];
      }
    }
}

// K's rows, then one region for V's, which with OUT holds Q's first (the output's factors are formed
// from Q before V is loaded there): a quarter less than three tiles, so four blocks share an SM.
template <int DK, int DV, bool OUT>
constexpr int factors_second_tile() {
  return kC * (OUT && ld16<DK>() > ld16<DV>() ? ld16<DK>() : ld16<DV>());
}
template <int DK, int DV, class T, bool OUT>
constexpr size_t factors_smem() {
  return (kC * ld16<DK>() + factors_second_tile<DK, DV, OUT>()) * sizeof(T) +
         (kC * kLdT + 4 * kC + 4) * sizeof(float) + kC * sizeof(int64_t) + 2 * sizeof(unsigned long long);
}
// Chunks in turn (chunk_factors_kernel's TURN): a second set of the two tiles and of the row table.
template <int DK, int DV, class T>
constexpr size_t factors_turn_smem() {
  return factors_smem<DK, DV, T, true>() + (kC * ld16<DK>() + factors_second_tile<DK, DV, true>()) * sizeof(T) + kC * sizeof(int64_t);
}

// The output's factors of chunk_factors (given q): Qd = scale e^G Q and the block float16 Aq with its
// inverse scale (kernels/gdn.h).
struct OutFactors {
  const void* q;  // [B, T, H, Dk] of k's dtype, or null: none
  float scale;
  c10::Half* Qd;
  c10::Half* Aq;
  float* aq_inv;
  void* t16;  // T [H, N, kPackedLower] of k's dtype for the backward's chunk kernel (ChunkFactors::T16), or null: none
  void* tb;   // UForm::kScan: T diag(beta) in two parts of k's dtype (ChunkFactors::Tb), and no V read or U formed; or null
  float* qk;  // with tb, for the scan that reads q and k itself (ChunkFactors::QK): their row scales, and no Qd or kdecay; or null
};

// The LA heads' short convolution inside chunk_factors (given ShortConvInputs): the block reads the
// projections before the convolution and forms the chunk's q, k and v itself, bit for bit as
// causal_conv_silu_rope_l2norm (q, k) and causal_conv_silu (v) form them in kernels/gdn.cu, so they
// are never written to memory and read back. Regular sequences only (slots.gather null): position t of
// sequence b is row b T + t.
template <class T>
struct PreConv {
  const T* wq;  // [H Dk, 1, 4]: q's taps, channel-major
  const T* wk;
  const T* wv;   // [H Dv, 1, 4]
  const T* cos;  // [T, Dk]: RoPE's tables at positions 0 .. T - 1
  const T* sin;
  float eps;     // the L2 norm's
};
constexpr int kConvTaps = 4;

// The rows the convolution of a chunk reads: its C rows and the K - 1 before them.
constexpr int kConvRows = kC + kConvTaps - 1;
// The projections before the convolution as the copy engine reads them (conv_rows_map): x [B, T, H, D] as
// a 3-D tensor (H D channels, T tokens, B sequences), in boxes of one head's D channels of kConvRows
// tokens. A chunk's box starts K - 1 tokens before it; the rows before its sequence's start or past its
// end land as zeros (the copy engine's fill outside the tensor), as the convolution's padding.
struct ConvMaps {
  CUtensorMap q, k, v;
};
// The staged rows (the ConvMaps boxes, landed) through the convolution with taps w of head h, its SiLU
// and, with ROPE, RoPE at the rows' positions and each row's L2 norm, into tile [C][ld16<D>] (another
// region; padding rows zero). Thread i takes pack i % P (P = D / 8 packs a row) of R consecutive rows,
// its window sliding in registers; the P threads of a row are consecutive lanes, which swap
// rotate-half partners and sum the row's squares by shuffles in causal_conv_silu_rope_l2norm's order.
// The taps are read from L1 each step: held in registers as packs they spilled 36 bytes a thread at the
// kernel's 80 and gained nothing (BENCHMARKS.md v36). Every thread of the block must call it.
template <bool ROPE, class T>
__device__ __forceinline__ void short_conv_rows128(const T* staged, T* tile, const T* __restrict__ w, const PreConv<T>& pc,
                                                   const SlotRows& slots, int64_t n, int h);

template <int D, bool ROPE, class T>
__device__ __forceinline__ void short_conv_tile(const T* staged, T* tile, const T* __restrict__ w, const PreConv<T>& pc,
                                                const SlotRows& slots, int64_t n, int h) {
  if constexpr (D == 128) {
    short_conv_rows128<ROPE>(staged, tile, w, pc, slots, n, h);
    return;
  }
  constexpr int V = 16 / sizeof(T), P = D / V, R = kC * P / kThreads, K = kConvTaps;
  static_assert(V == 8 && R * kThreads == kC * P && P <= 32 && 32 % P == 0, "16-bit values, whole rows a warp");
  const int j = threadIdx.x % P, r0 = threadIdx.x / P * R, lane = threadIdx.x % 32;
  const unsigned group = P == 32 ? 0xffffffffu : ((1u << P) - 1u) << (lane / P * P);
  const bool first = j < P / 2;  // rotate_half: -x[i + D/2] in the first half, x[i - D/2] in the second
  const int64_t t0 = (n % slots.per) * kC;
  const T* wj = w + (static_cast<int64_t>(h) * D + j * V) * K;  // the pack's V channels' K taps
  Pack<T, V> win[K];
#pragma unroll
  for (int i = 0; i < K - 1; ++i) win[i + 1] = load_pack<V>(staged + (r0 + i) * D + j * V);
#pragma unroll 1
  for (int s = 0; s < R; ++s) {
#pragma unroll
    for (int i = 0; i < K - 1; ++i) win[i] = win[i + 1];
    win[K - 1] = load_pack<V>(staged + (r0 + s + K - 1) * D + j * V);
    Pack<T, V> y;
#pragma unroll
    for (int i = 0; i < V; i += 2) {  // two channels' taps (16 bytes) a load, from L1 each step
      const Pack<T, 2 * K> wp = load_pack<2 * K>(wj + i * K);
      float acc[2] = {0.f, 0.f};
#pragma unroll
      for (int u = 0; u < 2; ++u)
#pragma unroll
        for (int q = 0; q < K; ++q) acc[u] = fmaf(pack_float(wp, u * K + q), pack_float(win[q], i + u), acc[u]);
      // The convolution's output in the dtype, then SiLU: a pair rounded a conversion, as each alone.
      using P2 = typename Pair16<T>::type;
      const float2 a = Pair16<T>::to_float2(Pair16<T>::round(acc[0], acc[1]));
      *reinterpret_cast<P2*>(y.v + i) = Pair16<T>::round(gate_activation<2, T>(a.x), gate_activation<2, T>(a.y));
    }
    const int64_t t = t0 + r0 + s;
    if constexpr (ROPE) {
      const int64_t tt = t < slots.T ? t : slots.T - 1;  // rows past the end: any table row (they are zeroed)
      const Pack<T, V> cp = load_pack<V>(pc.cos + tt * D + j * V), sp = load_pack<V>(pc.sin + tt * D + j * V);
      y = rope_l2_lanes<T, V>(y, group, P, first, cp, sp, pc.eps);
    }
    T* d = tile + (r0 + s) * ld16<D>() + j * V;
    if (t < slots.T) store_pack<V>(d, y);
    else *reinterpret_cast<uint4*>(d) = make_uint4(0u, 0u, 0u, 0u);
  }
}

// short_conv_tile for D = 128 by rows: warp w forms rows R w .. R w + R - 1 (R = C / 8), lane l channels
// 4l .. 4l + 3 of each, its taps (16 floats) and a window of K rows (a ring of K x 4 floats, slots
// named statically in steps of K) in registers: a row's inputs are read and converted once, where
// a thread of 8 channels and 4 rows read its taps from L1 and converted every tap and window value
// at each step. Bit for bit the 8-channel form's values: each channel's taps summed in the same order,
// and the row's squares summed in rope_l2_lanes' order: lane 2j + 1 continues lane 2j's sum over its
// own four channels (together the 8-channel pack j's sum, in element order), then the pack sums meet
// by the same butterfly (lane offsets 16, 8, 4, 2 for pack offsets 8, 4, 2, 1).
template <bool ROPE, class T>
__device__ __forceinline__ void short_conv_rows128(const T* staged, T* tile, const T* __restrict__ w, const PreConv<T>& pc,
                                                   const SlotRows& slots, int64_t n, int h) {
  constexpr int D = 128, E = 4, K = kConvTaps, R = kC / kWarps;
  static_assert(sizeof(T) == 2 && D == 32 * E && R % K == 0 && E * K == 16, "16-bit values, one row a warp");
  using P2 = typename Pair16<T>::type;
  const int lane = threadIdx.x % 32, r0 = threadIdx.x / 32 * R;
  const bool first = lane < 16, odd = lane % 2 != 0;  // rotate_half's first half; pack j's second four channels
  // Positions in 32 bits (chunk_factors checks T < 2^31 - 64), and the table rows' addresses by one
  // wide multiply from the lane's columns: 64-bit comparisons and shifts took 17 instructions a row.
  const int t0 = static_cast<int>((n % slots.per) * kC), len = static_cast<int>(slots.T);
  const T* const cos_l = pc.cos + E * lane;
  const T* const sin_l = pc.sin + E * lane;
  float tap[E][K];
  {
    const T* wl = w + (static_cast<int64_t>(h) * D + E * lane) * K;  // the lane's channels' taps, 32 bytes
    const Pack<T, 8> a = load_pack<8>(wl), b = load_pack<8>(wl + 8);
#pragma unroll
    for (int q = 0; q < K; ++q) {
      tap[0][q] = pack_float(a, q), tap[1][q] = pack_float(a, K + q);
      tap[2][q] = pack_float(b, q), tap[3][q] = pack_float(b, K + q);
    }
  }
  float win[K][E];  // window row q of step s (staged row r0 + s + q) in slot (s + q) % K
  auto enter = [&](float(&slot)[E], int row) {
    const Pack<T, E> p = load_pack<E>(staged + row * D + E * lane);
#pragma unroll
    for (int e = 0; e < E; ++e) slot[e] = pack_float(p, e);
  };
#pragma unroll
  for (int q = 0; q < K - 1; ++q) enter(win[q], r0 + q);
#pragma unroll 1
  for (int s0 = 0; s0 < R; s0 += K) {
#pragma unroll
    for (int u = 0; u < K; ++u) {
      const int s = s0 + u;
      enter(win[(u + K - 1) % K], r0 + s + K - 1);
      Pack<T, E> y;
#pragma unroll
      for (int e = 0; e < E; e += 2) {
        float acc[2] = {0.f, 0.f};
#pragma unroll
        for (int c = 0; c < 2; ++c)
#pragma unroll
          for (int q = 0; q < K; ++q) acc[c] = fmaf(tap[e + c][q], win[(u + q) % K][e + c], acc[c]);
        const float2 a = Pair16<T>::to_float2(Pair16<T>::round(acc[0], acc[1]));
        *reinterpret_cast<P2*>(y.v + e) = Pair16<T>::round(gate_activation<2, T>(a.x), gate_activation<2, T>(a.y));
      }
      const int t = t0 + r0 + s;
      if constexpr (ROPE) {
        const unsigned tt = static_cast<unsigned>(min(t, len - 1));  // rows past the end: any table row (they are zeroed)
        const uint64_t at = static_cast<uint64_t>(tt) * D;
        const Pack<T, E> cp = load_pack<E>(cos_l + at), sp = load_pack<E>(sin_l + at);
        Pack<T, E> partner;
#pragma unroll
        for (int q = 0; q < E / 2; ++q)
          reinterpret_cast<unsigned*>(partner.v)[q] = __shfl_xor_sync(0xffffffffu, reinterpret_cast<const unsigned*>(y.v)[q], 16);
        float r[E];
        float ss = rope_pack<T, E>(y, partner, first, cp, sp, r);
        const float before = __shfl_up_sync(0xffffffffu, ss, 1);  // lane 2j's sum, for lane 2j + 1
        if (odd) {
          ss = before;
#pragma unroll
          for (int e = 0; e < E; ++e) ss += r[e] * r[e];
        }
#pragma unroll
        for (int off = 16; off > 1; off >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, off);
        const float total = __shfl_xor_sync(0xffffffffu, ss, 1);  // even lanes: their odd neighbour's
        const float inv = rsqrt_ftz((odd ? ss : total) + pc.eps);
#pragma unroll
        for (int e = 0; e < E; e += 2) *reinterpret_cast<P2*>(y.v + e) = Pair16<T>::round(r[e] * inv, r[e + 1] * inv);
      }
      T* d = tile + (r0 + s) * ld16<D>() + E * lane;
      if (t < len) store_pack<E>(d, y);
      else *reinterpret_cast<uint2*>(d) = make_uint2(0u, 0u);
    }
  }
}

// of.tb (UForm::kScan; with OUT, not PRE or TURN): the block loads no V and forms no U; after the inverse it
// writes T diag(beta) in two parts of T's kind, hi = round(x) and lo = round(x - hi), each packed, then W,
// for the column scan that forms U from v itself. With of.qk too, it writes neither Qd nor kdecay but their rows'
// scales (scale e^{G_t} and e^{G_C - G_t}), for the column scan that forms both from q's and k's rows itself.
// PRE: k, v and of.q are the projections before the short convolution, which the block applies
// (PreConv above), read through `maps` by the copy engine; needs OUT, DK = DV and regular sequences. The
// raw rows are staged where the tile they become is not: K's in Ls's region and Q's in K's, then Q formed
// into Q's region and K into K's; V's in V's region (as V's rows land in the other forms), formed into K's
// region once W is done, where U's product reads it.
// MINB blocks an SM: four (at most 64 registers a thread), three with PRE by default. The 8-channel
// convolution (D = 64) spills about 120 bytes a thread at 64 registers; the by-rows one (D = 128) none for
// bfloat16 and 12 bytes for float16, so the bfloat16 Dh = 128 form also comes in four
// (set_factors_four_blocks).
// TURN (with OUT, without PRE): a grid of a few blocks an SM, each taking chunks in turn (chunk c, then c +
// gridDim.x, ..., in the order of (chunk, head) with heads fastest, n0 = 0 and `turns` chunks in all), with
// a second set of K and Q/V tiles and row table (factors_turn_smem): each chunk's K and Q rows and its gate
// loads are issued once the chunk before has issued V's, and land while it forms its inverse, W and U.
// Each chunk's arithmetic is the one-block-a-chunk form's, so every output is the same bits. CLOCKS (with
// TURN, given `clocks`): thread 0 times the phases (kFactorsPhases, each ended by a barrier) of each chunk
// whose rows landed during the chunk before, and writes block b's sums at clocks[b * (kFactorsPhases + 1)],
// then the number of chunks timed.
template <int DK, int DV, class T, bool OUT, bool PRE, int MINB = (PRE ? 3 : 4), bool TURN = false, bool CLOCKS = false>
__global__ void __launch_bounds__(kThreads, MINB)
    chunk_factors_kernel(const T* __restrict__ k, const T* __restrict__ v, GateIn<T> g, GateIn<T> beta, SlotRows slots, int H, int64_t N, c10::Half* __restrict__ W,
                         void* __restrict__ U, float* __restrict__ U_inv, c10::Half* __restrict__ kdecay,
                         float* __restrict__ decay, float* __restrict__ bound, OutFactors of, PreConv<T> pc,
                         const __grid_constant__ ConvMaps maps, int64_t n0, int64_t turns,
                         unsigned long long* __restrict__ clocks) {
  static_assert(OUT || !PRE, "the short convolution inside chunk_factors comes with the output's factors");
  constexpr bool kQkScales = OUT && !PRE && !TURN;  // the forms that may be given of.qk (with of.tb)
  static_assert(!PRE || DK == DV, "V formed into K's region");
  static_assert(!TURN || (OUT && !PRE), "chunks in turn: the form with the output's factors, without the convolution");
  static_assert(!CLOCKS || TURN, "the phases' clocks: chunks in turn only");
  extern __shared__ float4 smem4[];
  T* const Ks0 = reinterpret_cast<T*>(smem4);
  T* const Vs0 = Ks0 + kC * ld16<DK>();
  float* const Ls = reinterpret_cast<float*>(Vs0 + factors_second_tile<DK, DV, OUT>());  // L, then T = (I + L)^{-1}
  float* const Gs = Ls + kC * kLdT;
  // Row r's scale of Qd = scale e^G Q and of kdecay = e^{G_C - G} K (last = G_C, the chunk's Gs[kC - 1]): one
  // formula for the stores below and for the scales the column scan forms both with (of.qk), so that its Qd and
  // kdecay stay these bits.
  [[maybe_unused]] auto qd_scale = [&](int r) { return of.scale * expf(Gs[r]); };
  auto kdecay_scale = [&](float last, int r) { return expf(last - Gs[r]); };
  float* const bs = Gs + kC;  // beta
  float* const ws = bs + kC;  // beta e^G: W's scale
  float* const kk = ws + kC;  // beta_t k_t.k_t
  unsigned* const amax = reinterpret_cast<unsigned*>(kk + kC);  // Aq's largest |entry|, as bits (then 3 spare words)
  int64_t* const row_h0 = reinterpret_cast<int64_t*>(amax + 4);  // each slot's row of [rows * H, D]
  unsigned long long* const landed = reinterpret_cast<unsigned long long*>(row_h0 + kC);  // PRE: q and k's raw rows; v's
  const int tid = threadIdx.x;
  // TURN: the next chunk's gate loads, warp 0's, issued after the chunk's V (put once the chunk is done).
  GateBits next_gates{};
  // CLOCKS: thread 0's clock at the chunk's start and at the end of each phase but the last.
  long long clk[kFactorsPhases] = {};
  auto mark = [&](int i) {
    if constexpr (CLOCKS) {
      if (tid == 0) clk[i] = clock64();
    }
  };
  // Chunk n of head h with its tiles at Ks, Vs and its row table at row_h: with `landed` (TURN) its rows,
  // table and gates are in place; `issue_next` (TURN) runs once V's copies are issued, and issues the next
  // chunk's loads as one more group of copies.
  auto one_chunk = [&](const int64_t n, const int h, T* const Ks, T* const Vs, int64_t* const row_h, const bool rows_landed,
                       auto&& issue_next) {
    [[maybe_unused]] T* const Qs = Vs;  // with OUT, until V is loaded
    const int64_t chunk = static_cast<int64_t>(h) * N + n;
    if (!rows_landed) {
      if (tid < kC) row_h[tid] = slots.row_h(n, tid, h, H);
      if (tid == 0) *amax = 0u;
      if constexpr (PRE) {
        if (tid == 0) {  // device_ops.cuh's copy-engine helpers trap below sm_90, where chunk_factors refuses PRE
          mbar_init(&landed[0], 1);
          mbar_init(&landed[1], 1);
          mbar_init_fence();
        }
      }
      __syncthreads();
      if constexpr (PRE) {
        static_assert(kConvRows * DK * sizeof(T) <= kC * kLdT * sizeof(float), "K's raw rows fit Ls's region");
        static_assert(kConvRows * DK <= kC * ld16<DK>() && kConvRows * DV <= factors_second_tile<DK, DV, OUT>(),
                      "Q's and V's raw rows fit K's and V's regions");
        // K's raw rows into Ls's region, Q's into K's, by the copy engine: one thread's two box copies, where
        // each thread used to issue its share of 16-byte copies and form their addresses. The boxes start K - 1
        // rows before the chunk in its sequence, at head h's channels. The issuing thread keeps the box's row
        // and sequence in the spare words after amax for V's copy, rather than in registers live until then
        // (8 bytes of spill in the four-block form).
        if (tid == 0) {
          const int t = static_cast<int>((n % slots.per) * kC) - (kConvTaps - 1), b = static_cast<int>(n / slots.per);
          reinterpret_cast<int*>(amax)[2] = t;
          reinterpret_cast<int*>(amax)[3] = b;
          mbar_arrive_expect_tx(&landed[0], 2 * kConvRows * DK * sizeof(T));
          tma_load_3d(Ls, &maps.k, h * DK, t, b, &landed[0]);
          tma_load_3d(Ks, &maps.q, h * DK, t, b, &landed[0]);
        }
      } else {
        load_rows<DK, kThreads>(Ks, k, row_h);
        if constexpr (OUT) load_rows<DK, kThreads>(Qs, static_cast<const T*>(of.q), row_h);
        else load_rows<DV, kThreads>(Vs, v, row_h);
      }
      if constexpr (PRE) {
        // The gates while the rows land; one thread waits for them, and the barrier after passes them on.
        chunk_gates(g, beta, row_h, Gs, bs);
        if (tid == 0) mbar_wait(&landed[0], 0);
        __syncthreads();
      } else {
        gates_while_tiles_land(g, beta, row_h, Gs, bs);
      }
    }  // the rows, table and gates in place
    if constexpr (PRE) {
      short_conv_tile<DK, true>(Ks, Qs, pc.wq, pc, slots, n, h);
      __syncthreads();  // Q's raw rows read: K's region takes K
      short_conv_tile<DK, true>(reinterpret_cast<const T*>(Ls), Ks, pc.wk, pc, slots, n, h);
      __syncthreads();
    }

    if constexpr (OUT) {
      // The output's factors first: Aq (the masked Q K^T, held in each warp's registers: its largest |entry|
      // over the block, then scaled to float16 and stored from there) and Qd = scale e^G Q. Then Q's region
      // takes V. (Aq used to pass through Ls: a float32 tile written, read for the maximum and read again for
      // the stores, each behind a barrier.)
      float aq[4][4];
      masked_gram_tiles<DK>(Qs, Ks, Gs, nullptr, /*inclusive=*/true, aq);
      float m = 0.f;
#pragma unroll
      for (int j = 0; j < 4; ++j) m = fmaxf(fmaxf(m, fmaxf(fabsf(aq[j][0]), fabsf(aq[j][1]))), fmaxf(fabsf(aq[j][2]), fabsf(aq[j][3])));
      block_max(m, amax);
      __syncthreads();
      const Pow2Scale sc = pow2_scale(of.scale * __uint_as_float(*amax));
      const float s = of.scale * sc.scale;
      {  // packed (kPackedLower): the warp's block row b keeps its first 16 (b + 1) columns
        const int lane = tid % 32, warp = tid / 32, b = warp / 2, width = 16 * (b + 1), n0 = (warp % 2) * 32;
        const bool keep = n0 + 8 * (lane % 4) < width;  // the lane's 8 columns after the quads' transpose
        c10::Half* const at = of.Aq + chunk * kPackedLower + packed_lower_row(b) + (lane / 4) * width + n0;
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          uint32_t p[4];
#pragma unroll
          for (int j = 0; j < 4; ++j) p[j] = pack_f16(s * aq[j][2 * half], s * aq[j][2 * half + 1]);
          store_quad16<true>(p, keep ? at + 8 * half * width : nullptr, 0);
        }
      }
      if (tid == 0) of.aq_inv[chunk] = sc.inverse;
      if (kQkScales && of.qk != nullptr) {  // the scan forms Qd and kdecay from q's and k's rows: their rows' scales, as below
        if (tid < kC) {
          of.qk[chunk * 2 * kC + tid] = qd_scale(tid);
          of.qk[chunk * 2 * kC + kC + tid] = kdecay_scale(Gs[kC - 1], tid);
        }
      } else {
        for (int i = tid; i < kC * DK / 8; i += kThreads) {
          const int r = (8 * i) / DK, c = (8 * i) % DK;
          store_global16(of.Qd + chunk * kC * DK + r * DK + c, scaled_half8(Qs + r * ld16<DK>() + c, qd_scale(r)));
        }
      }
    }

    // L, while no copy writes the region that held Q.
    masked_gram<DK>(Ks, Ks, Gs, bs, /*inclusive=*/false, Ls, tid / 32, kk);
    if constexpr (PRE) fence_proxy_async_shared();  // Q's region, written and read, takes V's raw rows next
    __syncthreads();  // every thread is done with Q, and L is whole
    mark(1);

    if constexpr (OUT) {
      if constexpr (PRE) {  // V's raw rows land while L's inverse and W are formed
        if (tid == 0) {
          mbar_arrive_expect_tx(&landed[1], kConvRows * DV * sizeof(T));
          tma_load_3d(Vs, &maps.v, h * DV, reinterpret_cast<const int*>(amax)[2], reinterpret_cast<const int*>(amax)[3],
                      &landed[1]);
        }
      } else {
        if (TURN || of.tb == nullptr) load_rows<DV, kThreads>(Vs, v, row_h);  // (UForm::kScan: the scan reads V)
        cp_async_commit();
        if constexpr (TURN) issue_next();
      }
    }

    // T = (I + L)^{-1} in place; the threads past the diagonal blocks' 64 write kdecay and decay meanwhile.
    // (Its upper right block is left as the inverse used it: only T16 below reads it, and writes zeros there.)
    invert_unit_lower<kThreads, false>(Ls, [&] {
      const float last = Gs[kC - 1];
      c10::Half* dst = kdecay + chunk * kC * DK;
      for (int i = tid - kC; (!kQkScales || kdecay != nullptr) && i < kC * DK / 8; i += kThreads - kC) {  // (none with of.qk)
        const int r = (8 * i) / DK, c = (8 * i) % DK;
        store_global16(dst + r * DK + c, scaled_half8(Ks + r * ld16<DK>() + c, kdecay_scale(last, r)));
      }
      if (tid < 2 * kC) ws[tid - kC] = bs[tid - kC] * expf(Gs[tid - kC]);
      if (tid == kC) decay[chunk] = expf(last);
      if (tid >= kThreads - 32) {  // the norm bound: the last warp, two tokens a lane
        auto term = [](float x) {  // log max(1, |1 - x|), not a number for x not one
          const float a = fabsf(1.f - x);
          return logf(a > 1.f || a != a ? a : 1.f);
        };
        const int l = tid - (kThreads - 32);
        float x = term(kk[2 * l]) + term(kk[2 * l + 1]);
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
        if (l == 0) bound[chunk] = last + x;
      }
    });
    mark(2);

    if constexpr (OUT && !PRE) {  // (not with the convolution: the layer's inference, whose registers it would cost)
      if (of.t16 != nullptr) {  // T rounded to k's kind, as chunk_backward rounds its own (then reads this instead)
        T* dst = static_cast<T*>(of.t16) + chunk * kPackedLower;
        for (int i = tid; i < kPackedLower / 8; i += kThreads) {  // packed: the blocks on and below the diagonal
          float x[8];
          (void)packed_lower_floats(Ls, 8 * i, x);
          Pack<T, 8> p;
#pragma unroll
          for (int j = 0; j < 8; ++j) p.v[j] = T(x[j]);
          store_pack_global<8>(dst + 8 * i, p);
        }
      }
    }
    if constexpr (OUT && !PRE && !TURN) {
      if (of.tb != nullptr) {  // UForm::kScan: T diag(beta) as hi + lo for the column scan (then W, and no U)
        T* const hi = static_cast<T*>(of.tb) + 2 * chunk * kPackedLower;
        T* const lo = hi + kPackedLower;
        for (int i = tid; i < kPackedLower / 8; i += kThreads) {  // packed: the blocks on and below the diagonal
          float x[8];
          const int c = packed_lower_floats(Ls, 8 * i, x).y;
          Pack<T, 8> h, l;
#pragma unroll
          for (int j = 0; j < 8; ++j) {
            const float y = x[j] * bs[c + j];
            h.v[j] = T(y);
            l.v[j] = T(y - static_cast<float>(h.v[j]));
          }
          store_pack_global<8>(hi + 8 * i, h);
          store_pack_global<8>(lo + 8 * i, l);
        }
      }
    }
    if constexpr (OUT && !PRE && !TURN && kPackedSplitElems <= factors_second_tile<DK, DV, OUT>()) {
      if (of.tb != nullptr) {  // UForm::kScan: W, and no U (the scan forms it from v)
        // No V comes into Q's region, so (where it holds the split: not at Dk = Dv = 64) T diag(beta e^G)
        // is split once into it, as for U's product below, instead of by each of the four warps that share
        // a row tile of W.
        pack_split(Ls, ws, Vs);
        __syncthreads();
        lower_times<DK>(SplitPacked<T>{Vs}, Ks, W + chunk * kC * DK);
        return;
      }
    }
    lower_times<DK>(SplitOf<T>{Ls, ws}, Ks, W + chunk * kC * DK);
    if constexpr (OUT && !PRE && !TURN) {
      if (of.tb != nullptr) return;  // UForm::kScan: no U (the scan forms it from v)
    }
    if constexpr (OUT) {
      if constexpr (PRE) {  // V's rows
        if (tid == 0) mbar_wait(&landed[1], 0);
      } else {
        cp_async_wait<TURN ? 1 : 0>();  // TURN: the next chunk's group, issued after V's, may still be landing
      }
      __syncthreads();
      mark(3);
      mark(4);  // (again after the split, where there is one)
      if constexpr (PRE) {
        short_conv_tile<DV, false>(Vs, Ks, pc.wv, pc, slots, n, h);  // K's region: free once W is done
        __syncthreads();
      }
    }
    if constexpr (OUT) {
      if (U_inv != nullptr) {  // UForm::kFloat16Columns; the pairs meet in the tile V's product does not read
        T* const free = PRE ? Vs : Ks;  // K's rows (read by W), or V's raw rows (read by the convolution)
        c10::Half* const u16 = static_cast<c10::Half*>(U) + chunk * kC * DV;
        constexpr int kFree = PRE ? factors_second_tile<DK, DV, OUT>() : kC * ld16<DK>();
        if constexpr (kFree >= kPackedSplitElems + 2 * kWarps * (DV / 4)) {
          // T diag(beta) split once into that region, where each of the four warps that share a row tile
          // formed its split again (a third of chunk_factors' instructions went to the two products).
          pack_split(Ls, bs, free);
          __syncthreads();
          mark(4);
          lower_times_f16_columns<DV>(SplitPacked<T>{free}, PRE ? Ks : Vs, u16, U_inv + chunk * DV,
                                      reinterpret_cast<float*>(free + kPackedSplitElems));
        } else {
          lower_times_f16_columns<DV>(SplitOf<T>{Ls, bs}, PRE ? Ks : Vs, u16, U_inv + chunk * DV, reinterpret_cast<float*>(free));
        }
        return;
      }
    }
    lower_times<DV>(SplitOf<T>{Ls, bs}, PRE ? Ks : Vs, static_cast<float*>(U) + chunk * kC * DV);
  };

  if constexpr (!TURN) {
    // The grid is (H, chunks n0 ..; a launch takes at most 2^16 - 1 chunks): heads vary fastest, so the H
    // blocks of a chunk run together and its rows of q, k and v (one span of H D values a row) and of
    // RoPE's tables are read from memory once and then from L2, where the other order read the tables
    // again for each head (64 MB at T = 128K, more than L2; the kernel's DRAM bytes fell by a fifth).
    one_chunk(n0 + blockIdx.y, blockIdx.x, Ks0, Vs0, row_h0, false, [] {});
  } else {
    // The second tiles and row table, after `landed`.
    T* const Ks1 = reinterpret_cast<T*>(landed + 2);
    T* const Vs1 = Ks1 + kC * ld16<DK>();
    int64_t* const row_h1 = reinterpret_cast<int64_t*>(Vs1 + factors_second_tile<DK, DV, OUT>());
    int64_t c = blockIdx.x;  // (chunk, head) in the order heads fastest, as the grid above
    bool landed_rows = false;
    unsigned long long sums[kFactorsPhases] = {}, timed = 0;  // thread 0's, with CLOCKS
    // CLOCKS, thread 0, after a barrier that ends a chunk: its phases counted where its rows had landed
    // during the chunk before; `end` starts the next.
    auto account = [&](const long long end) {
      if (landed_rows) {
#pragma unroll
        for (int i = 0; i < kFactorsPhases; ++i)
          sums[i] += static_cast<unsigned long long>((i + 1 < kFactorsPhases ? clk[i + 1] : end) - clk[i]);
        ++timed;
      }
      clk[0] = end;
    };
    for (int b = 0; c < turns; b ^= 1) {
      T* const Ks = b ? Ks1 : Ks0;
      T* const Vs = b ? Vs1 : Vs0;
      int64_t* const row_h = b ? row_h1 : row_h0;
      T* const Kn = b ? Ks0 : Ks1;
      T* const Qn = b ? Vs0 : Vs1;
      int64_t* const row_n = b ? row_h0 : row_h1;
      const int64_t cn = c + gridDim.x;
      const bool more = cn < turns;
      // The next chunk's table, read after the chunk's first barrier (its rows are issued after V's).
      if (more && tid < kC) row_n[tid] = slots.row_h(cn / H, tid, static_cast<int>(cn % H), H);
      one_chunk(c / H, static_cast<int>(c % H), Ks, Vs, row_h, landed_rows, [&] {
        if (more) {
          load_rows<DK, kThreads>(Kn, k, row_n);
          load_rows<DK, kThreads>(Qn, static_cast<const T*>(of.q), row_n);
          if (tid < 32) next_gates = chunk_gate_bits(g, beta, row_n, true);
        }
        cp_async_commit();  // an empty group without a next chunk: the wait for V above counts on one
      });
      if (!more) {
        if constexpr (CLOCKS) {
          __syncthreads();  // the last chunk's U done
          if (tid == 0) account(clock64());
        }
        break;
      }
      __syncthreads();  // the chunk's reads of Gs, bs and amax are done
      if (tid < 32) put_gate_bits(g, beta, next_gates, Gs, bs);
      if (tid == 0) *amax = 0u;
      cp_async_wait<0>();
      __syncthreads();
      if (CLOCKS && tid == 0) account(clock64());  // the chunk's U done, and the next chunk's gates and rows in place
      landed_rows = true;
      c = cn;
    }
    if (CLOCKS && tid == 0) {
      unsigned long long* out = clocks + static_cast<int64_t>(blockIdx.x) * (kFactorsPhases + 1);
      for (int i = 0; i < kFactorsPhases; ++i) out[i] = sums[i];
      out[kFactorsPhases] = timed;
    }
  }
}

template <int DK, class T>
constexpr size_t output_smem() {
  return 2 * kC * ld16<DK>() * sizeof(T) + (kC * kLdT + DK * kLdOut + kC * kLdOut + kC) * sizeof(float) +
         kC * sizeof(int64_t);
}

template <int DK, int DV, class T>
__global__ void __launch_bounds__(kThreads)
    chunk_output_kernel(const T* __restrict__ q, const T* __restrict__ k, const float* __restrict__ g, SlotRows slots,
                        int H, int64_t N, const float* __restrict__ S, const float* __restrict__ M, float scale,
                        T* __restrict__ out) {
  extern __shared__ float4 smem4[];
  T* const Qs = reinterpret_cast<T*>(smem4);
  T* const Ks = Qs + kC * ld16<DK>();
  float* const As = reinterpret_cast<float*>(Ks + kC * ld16<DK>());  // the masked Q K^T
  float* const Ss = As + kC * kLdT;                                   // [DK][kLdOut]: S_n's column slice
  float* const Ms = Ss + DK * kLdOut;                                 // [C][kLdOut]: M_n's column slice
  float* const Gs = Ms + kC * kLdOut;
  int64_t* const row_h = reinterpret_cast<int64_t*>(Gs + kC);
  const int64_t n = blockIdx.x;
  const int h = blockIdx.y, col0 = blockIdx.z * kOutCols, tid = threadIdx.x;
  const int64_t chunk = static_cast<int64_t>(h) * N + n;
  if (tid < kC) row_h[tid] = slots.row_h(n, tid, h, H);
  __syncthreads();
  load_rows<DK, kThreads>(Qs, q, row_h);
  load_rows<DK, kThreads>(Ks, k, row_h);
  load_slice<DK>(Ss, S + chunk * DK * DV + col0, DV);
  load_slice<kC>(Ms, M + chunk * kC * DV + col0, DV);
  gates_while_tiles_land(g, nullptr, row_h, Gs, nullptr);

  masked_gram<DK>(Qs, Ks, Gs, nullptr, /*inclusive=*/true, As);
  __syncthreads();

  // O = scale (e^{G_t} (Q S)_t + (A M)_t): warp w computes rows 16 (w % 4) .. + 15 and 32 of the
  // block's columns.
  constexpr int NT = kOutCols / 16, LD = ld16<DK>();
  const int warp = tid / 32, lane = tid % 32, g8 = lane / 4, t = lane % 4;
  const int m = (warp % 4) * 16, n0 = (warp / 4) * (kOutCols / 2);
  float qs[NT][4] = {}, am[NT][4] = {};
#pragma unroll 4
  for (int k0 = 0; k0 < DK; k0 += 8) {
    const unsigned a[4] = {bits(Qs[(m + g8) * LD + k0 + t]), bits(Qs[(m + g8 + 8) * LD + k0 + t]),
                           bits(Qs[(m + g8) * LD + k0 + t + 4]), bits(Qs[(m + g8 + 8) * LD + k0 + t + 4])};
#pragma unroll
    for (int j = 0; j < NT; ++j) {
      const int c = n0 + 8 * j + g8;
      const unsigned b[2] = {to_tf32(Ss[(k0 + t) * kLdOut + c]), to_tf32(Ss[(k0 + t + 4) * kLdOut + c])};
      mma_tf32(qs[j], a, b);
    }
  }
  for (int k0 = 0; k0 < m + 16; k0 += 8) {  // A[r][i] = 0 for i > r
    const unsigned a[4] = {to_tf32(As[(m + g8) * kLdT + k0 + t]), to_tf32(As[(m + g8 + 8) * kLdT + k0 + t]),
                           to_tf32(As[(m + g8) * kLdT + k0 + t + 4]), to_tf32(As[(m + g8 + 8) * kLdT + k0 + t + 4])};
#pragma unroll
    for (int j = 0; j < NT; ++j) {
      const int c = n0 + 8 * j + g8;
      const unsigned b[2] = {to_tf32(Ms[(k0 + t) * kLdOut + c]), to_tf32(Ms[(k0 + t + 4) * kLdOut + c])};
      mma_tf32(am[j], a, b);
    }
  }
#pragma unroll
  for (int e = 0; e < 4; e += 2) {
    const int r = m + g8 + (e >= 2 ? 8 : 0);
    const int64_t row = row_h[r];
    if (row < 0) continue;
    const float decay = expf(Gs[r]);
    T* dst = out + row * DV + col0;
#pragma unroll
    for (int j = 0; j < NT; ++j) {
      const int c = n0 + 8 * j + 2 * t;
      const T pair[2] = {T(scale * fmaf(decay, qs[j][e], am[j][e])), T(scale * fmaf(decay, qs[j][e + 1], am[j][e + 1]))};
      *reinterpret_cast<uint32_t*>(dst + c) = *reinterpret_cast<const uint32_t*>(pair);
    }
  }
}

// chunk_output on the block float16 history: one block per (chunk, head, 64 output columns); warp w
// computes rows 16 (w % 4) .. + 15 and columns 32 (w / 4) .. + 31 of
//   O = sum_j S_inv[j] (Qd[:, 16 j ..] S16[16 j .., :]) + aq_inv sum_{i <= t} M_inv[i] (Aq[:, 16 i ..] M16[16 i .., :])
// with each 16-deep product's scale applied to its float32 partial sum (S16's per 16 x 16 block, M16's
// per 16 x 8 tile, as the scan formed them).
constexpr int kLdH = ld16<kOutCols>();  // float16 rows of 64 (Aq, S16 and M16 slices): conflict-free ldmatrix

// acc[j] += sum_{kb < kblocks} inv(kb, n0 + 8 j) (A[m.., 16 kb ..] B[16 kb .., n0 + 8 j ..]) for a warp's 16
// rows from m and four 8-column tiles from n0: float16 products of block float16 operands in shared
// memory (A [r][k] with row stride lda, B [k][n] with row stride kLdH), each 16-deep partial product
// scaled by its block's inverse scale into the float32 sum.
template <class Inv>
__device__ __forceinline__ void block_f16_product(float (&acc)[4][4], int m, int n0, int kblocks, const __half* A,
                                                  int lda, const __half* B, Inv inv) {
#pragma unroll 4
  for (int kb = 0; kb < kblocks; ++kb) {
    float part[4][4] = {};
    product16<false, true, 4>(part, m, n0, 16 * kb, 16 * kb + 16, A, lda, B, kLdH);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const float x = inv(kb, n0 + 8 * j);
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[j][e] = fmaf(part[j][e], x, acc[j][e]);
    }
  }
}

template <int DK>
constexpr size_t output_f16_smem() {
  return (kC * ld16<DK>() + kC * kLdH + DK * kLdH + kC * kLdH) * sizeof(__half) +
         (DK / 16 * 4 + 4 * 8) * sizeof(float) + kC * sizeof(int64_t);
}

// The fused epilogue's shared memory after the kernel's own: each row's two 32-column sums of squares,
// then the block's gate tile [kC][kLdH] (fetched while the products run).
constexpr size_t kFusedPartials = 2 * kC * sizeof(float);
constexpr size_t kFusedExtra = kFusedPartials + kC * kLdH * sizeof(__half);

// The block's 64 x 64 output tile, staged in shared memory (Ys [kC][kLdH], pairs at the warps' fragment
// positions), stored a row of 128 bytes at a time: 16 bytes a lane, whole sectors (the fragments' own
// 4-byte stores cover half of each 32-byte sector an instruction). dst(row) is where row `row` of the
// tile's first column goes; padding rows (row < 0) are not stored.
template <class O, class Dst>
__device__ __forceinline__ void store_staged_tile(const __half* Ys, const int64_t* rows, Dst dst) {
  __syncthreads();  // every warp's pairs in Ys
  for (int i = threadIdx.x; i < kC * kOutCols / 8; i += kThreads) {
    const int r = (8 * i) / kOutCols, c = (8 * i) % kOutCols;
    const int64_t row = rows[r];
    if (row >= 0) *reinterpret_cast<float4*>(dst(row) + c) = *reinterpret_cast<const float4*>(Ys + r * kLdH + c);
  }
}

// The fused epilogue of chunk_output_f16_kernel: the warp's 16 rows from m and columns n0 .. n0 + 31 of
// the block's 64 (qs, am as the kernel formed them; the gate tile Gs fetched by this thread's copies
// of the last group). Each row's sum of squares over all Dv columns is added in one order in every
// block that holds part of the row (columns 0-31, 32-63, then 64-95, 96-127 from the cluster's second
// block), so that both halves normalise by the same value; then, as the fusion kernel: normed =
// O(o rstd), y = O(O(act(gate)) O(gamma normed)), the last two products as rounded 16-bit pairs
// (products of two 16-bit values are exact in float32: the same bits), staged in Ys (free once every
// warp's products are done) and stored by rows.
template <int DV, class O, int ACT>
__device__ __forceinline__ void fused_output_epilogue(const float (&qs)[4][4], const float (&am)[4][4], float a_inv,
                                                      const int64_t* rows, float* part, const __half* Gs, __half* Ys,
                                                      int m, int n0, int g, int t, int warp, int h, int col0,
                                                      const FusedOutputArgs& fa) {
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 900  // clusters: Hopper on
  using P2 = typename Pair16<O>::type;
  cp_async_wait<0>();        // this thread's copies of the gate tile
  float v[4][4];             // o, rounded to O as chunk_output_f16 stores it
  float ss[2] = {0.f, 0.f};  // rows m + g and m + g + 8, this thread's 8 columns of each
#pragma unroll
  for (int j = 0; j < 4; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      v[j][e] = static_cast<float>(O(fmaf(a_inv, am[j][e], qs[j][e])));
      ss[e / 2] += v[j][e] * v[j][e];
    }
#pragma unroll
  for (int i = 0; i < 2; ++i) {  // over the quad's 4 lanes: the same sum in each (addition commutes)
    ss[i] += __shfl_xor_sync(0xffffffffu, ss[i], 1);
    ss[i] += __shfl_xor_sync(0xffffffffu, ss[i], 2);
  }
  if (t == 0) part[(warp / 4) * kC + m + g] = ss[0], part[(warp / 4) * kC + m + g + 8] = ss[1];
  float total[2];
  if constexpr (DV / kOutCols == 2) {
    namespace cg = cooperative_groups;
    cg::cluster_group cluster = cg::this_cluster();
    cluster.sync();  // both blocks' sums, the gate tile and every warp's products done
    const float* p0 = cluster.map_shared_rank(part, 0);
    const float* p1 = cluster.map_shared_rank(part, 1);
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int r = m + g + 8 * i;
      total[i] = ((p0[r] + p0[kC + r]) + p1[r]) + p1[kC + r];
    }
    // Neither block may leave while the other still reads its sums: each arrives once its own reads are
    // done (relaxed: cluster.sync's release waited on every store before it) and waits for the other's
    // arrival only before it leaves, after its rows are stored.
    cluster_arrive_relaxed();
  } else {
    __syncthreads();
#pragma unroll
    for (int i = 0; i < 2; ++i) total[i] = part[m + g + 8 * i] + part[kC + m + g + 8 * i];
  }
  const O* gamma = static_cast<const O*>(fa.gamma) + static_cast<int64_t>(h) * DV + col0 + n0 + 2 * t;
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int r = m + g + 8 * i;
    const float rstd = rsqrtf(total[i] / static_cast<float>(DV) + fa.eps);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int c = n0 + 8 * j + 2 * t;
      *reinterpret_cast<P2*>(Ys + r * kLdH + c) =
          fusion_pair<ACT, O>(make_float2(v[j][2 * i], v[j][2 * i + 1]), rstd,
                              Pair16<O>::to_float2(*reinterpret_cast<const P2*>(Gs + r * kLdH + c)),
                              *reinterpret_cast<const P2*>(gamma + 8 * j));
    }
  }
  O* const y = static_cast<O*>(fa.y) + static_cast<int64_t>(fa.pl.pos[h]) * DV + col0;
  store_staged_tile<O>(Ys, rows, [&](int64_t row) { return y + row * fa.pl.y_ld; });
  if constexpr (DV / kOutCols == 2) cluster_wait();  // the other block's arrival
#else
  __trap();
#endif
}

// FUSE < 0: o into out. FUSE = a GateActivation (chunk_output_f16_fused): o, rounded to O as it would be
// stored, through the fusion norm into fa.y, with out unused; a head's Dv / 64 blocks of one row
// range form a cluster along z, whose blocks add their rows' sums of squares through each other's
// shared memory in one column order.
template <int DK, int DV, class O, int FUSE>
__global__ void __launch_bounds__(kThreads)
    chunk_output_f16_kernel(const __half* __restrict__ Qd, const __half* __restrict__ Aq, const float* __restrict__ aq_inv,
                            const __half* __restrict__ S16, const float* __restrict__ S_inv, const __half* __restrict__ M16,
                            const float* __restrict__ M_inv, SlotRows slots, int H, int64_t N, O* __restrict__ out,
                            const __grid_constant__ FusedOutputArgs fa) {
  constexpr int LDQ = ld16<DK>();
  extern __shared__ float4 smem4[];
  __half* const Qs = reinterpret_cast<__half*>(smem4);
  __half* const As = Qs + kC * LDQ;
  __half* const Ss = As + kC * kLdH;
  __half* const Ms = Ss + DK * kLdH;
  float* const s_inv = reinterpret_cast<float*>(Ms + kC * kLdH);  // [DK / 16][4]: this block's 16-column blocks
  float* const m_inv = s_inv + DK / 16 * 4;                       // [4][8]: this block's 8-column tiles
  int64_t* const rows = reinterpret_cast<int64_t*>(m_inv + 4 * 8);
  const int64_t n = blockIdx.x;
  const int h = blockIdx.y, col0 = blockIdx.z * kOutCols, tid = threadIdx.x;
  const int64_t chunk = static_cast<int64_t>(h) * N + n;
  for (int i = tid; i < kC * DK / 8; i += kThreads) {
    const int r = (8 * i) / DK, c = (8 * i) % DK;
    cp_async16(Qs + r * LDQ + c, Qd + (chunk * kC + r) * DK + c);
  }
  for (int i = tid; i < kPackedLower / 8; i += kThreads) {  // packed: the blocks on and below the diagonal, all it reads
    const int2 at = packed_lower_at(8 * i);
    cp_async16(As + at.x * kLdH + at.y, Aq + chunk * kPackedLower + 8 * i);
  }
  for (int i = tid; i < DK * kOutCols / 8; i += kThreads) {
    const int r = (8 * i) / kOutCols, c = (8 * i) % kOutCols;
    cp_async16(Ss + r * kLdH + c, S16 + (chunk * DK + r) * DV + col0 + c);
  }
  for (int i = tid; i < kC * kOutCols / 8; i += kThreads) {
    const int r = (8 * i) / kOutCols, c = (8 * i) % kOutCols;
    cp_async16(Ms + r * kLdH + c, M16 + (chunk * kC + r) * DV + col0 + c);
  }
  cp_async_commit();
  if (tid < DK / 16 * 4) s_inv[tid] = S_inv[(chunk * (DK / 16) + tid / 4) * (DV / 16) + col0 / 16 + tid % 4];
  else if (tid < DK / 16 * 4 + 32) {
    const int i = tid - DK / 16 * 4;
    m_inv[i] = M_inv[(chunk * (kC / 16) + i / 8) * (DV / 8) + col0 / 8 + i % 8];
  }
  if (tid >= kThreads - kC) rows[tid - (kThreads - kC)] = slots(n, tid - (kThreads - kC));
  const float a_inv = aq_inv[chunk];
  float* const part = reinterpret_cast<float*>(rows + kC);                  // FUSE only: [2][kC]
  __half* const Gs = reinterpret_cast<__half*>(part + 2 * kC);              // FUSE only: the gate tile
  if constexpr (FUSE >= 0) {
    // The gate tile as a second group of copies, in flight while the products run.
    __syncthreads();  // rows
    const O* gate = static_cast<const O*>(fa.gate) + static_cast<int64_t>(h) * DV + col0;
    for (int i = tid; i < kC * kOutCols / 8; i += kThreads) {
      const int r = (8 * i) / kOutCols, c = (8 * i) % kOutCols;
      const int64_t row = rows[r];
      if (row >= 0) cp_async16(Gs + r * kLdH + c, gate + row * fa.pl.gate_ld + c);
    }
    cp_async_commit();
    cp_async_wait<1>();
  } else {
    cp_async_wait<0>();
  }
  __syncthreads();

  const int warp = tid / 32, lane = tid % 32, g = lane / 4, t = lane % 4;
  const int m = (warp % 4) * 16, n0 = (warp / 4) * 32;
  float qs[4][4] = {}, am[4][4] = {};
  block_f16_product(qs, m, n0, DK / 16, Qs, LDQ, Ss, [&](int j, int c) { return s_inv[j * 4 + c / 16]; });
  block_f16_product(am, m, n0, m / 16 + 1, As, kLdH, Ms, [&](int i, int c) { return m_inv[i * 8 + c / 8]; });  // Aq[r][i] = 0 for i > r
  // The output tile is staged in Qs's region (free once every warp's products are done) and stored by rows.
  __half* const Ys = Qs;
  if constexpr (FUSE < 0) {
    __syncthreads();  // every warp's products done: Qs free
#pragma unroll
    for (int e = 0; e < 4; e += 2) {
      const int r = m + g + (e >= 2 ? 8 : 0);
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const O pair[2] = {O(fmaf(a_inv, am[j][e], qs[j][e])), O(fmaf(a_inv, am[j][e + 1], qs[j][e + 1]))};
        *reinterpret_cast<uint32_t*>(Ys + r * kLdH + n0 + 8 * j + 2 * t) = *reinterpret_cast<const uint32_t*>(pair);
      }
    }
    O* const dst = out + static_cast<int64_t>(h) * DV + col0;
    store_staged_tile<O>(Ys, rows, [&](int64_t row) { return dst + row * H * DV; });
  } else {
    fused_output_epilogue<DV, O, FUSE>(qs, am, a_inv, rows, part, Gs, Ys, m, n0, g, t, warp, h, col0, fa);
  }
}

// ConvMaps' map of x [B, T, H, D] (16-bit, unit stride over D, heads D apart, tokens a multiple of 16
// bytes apart, sequences T tokens apart; chunk_factors has checked it), in boxes of D x kConvRows.
CUtensorMap conv_rows_map(const at::Tensor& x, const char* what) {
  const int64_t B = x.size(0), T = x.size(1), H = x.size(2), D = x.size(3), elem = x.element_size();
  const int64_t ld = x.stride(1);
  const cuuint64_t dims[3] = {static_cast<cuuint64_t>(H * D), static_cast<cuuint64_t>(T), static_cast<cuuint64_t>(B)};
  const cuuint64_t strides[2] = {static_cast<cuuint64_t>(ld * elem), static_cast<cuuint64_t>(T * ld * elem)};
  const cuuint32_t box[3] = {static_cast<cuuint32_t>(D), static_cast<cuuint32_t>(kConvRows), 1};
  return encode_tensor_map(x.scalar_type() == at::kBFloat16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16, 3,
                           x.data_ptr(), dims, strides, box, CU_TENSOR_MAP_SWIZZLE_NONE, "chunk_factors", what);
}

bool g_chunk_kernels = true;
bool g_block_f16_scan = true;
bool g_f16_history = true;
bool g_conv_in_factors = true;
bool g_factors_four_blocks = true;
int g_factors_blocks_an_sm = 0;                  // 0: as many as fit (set_factors_blocks_per_sm)
int g_factors_in_turn = 0;                       // blocks an SM taking chunks in turn; 0: one block a chunk
std::atomic<int64_t> g_factors_turn_launches{0};
bool g_factors_phase_clocks = false;  // set_factors_phase_clocks
at::Tensor g_factors_clocks;          // the last chunks-in-turn launch's, with the clocks on
// The last chunk_factors launch's kernel and shared memory, for factors_resident_blocks.
std::atomic<const void*> g_factors_last_kernel{nullptr};
std::atomic<size_t> g_factors_last_smem{0};

// The dynamic shared memory that lets at most n blocks of a kernel needing `smem` share an SM: a block's
// share of the SM's shared memory, less what the device reserves a block (never less than `smem`).
size_t smem_for_blocks_per_sm(size_t smem, int n) {
  if (n <= 0) return smem;
  int device = 0, per_sm = 0, reserved = 0, optin = 0;
  C10_CUDA_CHECK(cudaGetDevice(&device));
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&per_sm, cudaDevAttrMaxSharedMemoryPerMultiprocessor, device));
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&reserved, cudaDevAttrReservedSharedMemoryPerBlock, device));
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
  const size_t share = static_cast<size_t>(per_sm / n - reserved);
  return std::max(smem, std::min(share, static_cast<size_t>(optin)));
}

}  // namespace

void set_chunk_kernels(bool on) { g_chunk_kernels = on; }
bool chunk_kernels_enabled() { return g_chunk_kernels; }
void set_block_f16_scan(bool on) { g_block_f16_scan = on; }
bool block_f16_scan_enabled() { return g_block_f16_scan && copy_engine_available(); }
void set_f16_history(bool on) { g_f16_history = on; }
bool f16_history_enabled() { return g_f16_history; }
void set_conv_in_factors(bool on) { g_conv_in_factors = on; }
bool conv_in_factors_enabled() { return g_conv_in_factors; }
void set_factors_four_blocks(bool on) { g_factors_four_blocks = on; }
bool factors_four_blocks_enabled() { return g_factors_four_blocks; }
void set_factors_blocks_per_sm(int n) {
  if (n < 0 || n > 32) throw std::invalid_argument("hh::kernels::set_factors_blocks_per_sm: expected 0 (as many as fit) to 32, got " + std::to_string(n));
  g_factors_blocks_an_sm = n;
}
int factors_blocks_per_sm() { return g_factors_blocks_an_sm; }
int factors_resident_blocks() {
  const void* kernel = g_factors_last_kernel.load(std::memory_order_relaxed);
  if (kernel == nullptr) return 0;
  int resident = 0;  // the launch set the kernel's shared memory attribute
  C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&resident, kernel, kThreads, g_factors_last_smem.load(std::memory_order_relaxed)));
  return resident;
}
void set_factors_in_turn(int blocks_an_sm) {
  if (blocks_an_sm < 0 || blocks_an_sm > 2)
    throw std::invalid_argument("hh::kernels::set_factors_in_turn: expected 0 (one block a chunk), 1 or 2 blocks an SM, got " +
                                std::to_string(blocks_an_sm));
  g_factors_in_turn = blocks_an_sm;
}
int factors_in_turn() { return g_factors_in_turn; }
int64_t factors_in_turn_launches() { return g_factors_turn_launches.load(std::memory_order_relaxed); }
void set_factors_phase_clocks(bool on) {
  g_factors_phase_clocks = on;
  if (!on) g_factors_clocks = at::Tensor();
}
FactorsPhases factors_turn_phases() {
  FactorsPhases p;
  if (!g_factors_clocks.defined()) return p;
  const at::Tensor c = g_factors_clocks.view({-1, kFactorsPhases + 1}).sum(0).cpu();  // waits for the launch
  const int64_t* x = c.data_ptr<int64_t>();
  p.chunks = x[kFactorsPhases];
  for (int i = 0; i < kFactorsPhases; ++i) p.cycles[i] = p.chunks > 0 ? static_cast<double>(x[i]) / static_cast<double>(p.chunks) : 0.0;
  return p;
}
int device_sms() { return at::cuda::getCurrentDeviceProperties()->multiProcessorCount; }

bool chunk_forward_supported(int64_t Dk, int64_t Dv, at::ScalarType dtype) {
  return (Dk == 64 || Dk == 128) && (Dv == 64 || Dv == 128) && (dtype == at::kBFloat16 || dtype == at::kHalf);
}

bool short_conv_fusion_supported(int64_t Dk, int64_t Dv, at::ScalarType dtype) {
  // 16-bit values, D in {64, 128} (8 or 16 lanes a row); V is formed into K's region.
  return chunk_forward_supported(Dk, Dv, dtype) && Dk == Dv;
}

ChunkFactors chunk_factors(const at::Tensor& k, const at::Tensor& v, const at::Tensor& g, const at::Tensor& beta,
                           const ChunkGrid& grid, const at::Tensor& q, double scale, const ShortConvInputs* conv,
                           UForm u_form, bool keep_t, bool qk_in_scan) {
  if (k.dim() != 4 || v.dim() != 4) throw std::invalid_argument("hh::kernels::chunk_factors: k and v must be [B, T, H, D]");
  const int64_t B = k.size(0), T = k.size(1), H = k.size(2), Dk = k.size(3), Dv = v.size(3), N = grid.N;
  need(k, "chunk_factors", "k", k.sizes(), true);
  need(v, "chunk_factors", "v", {B, T, H, Dv}, true);
  if (v.scalar_type() != k.scalar_type() || !chunk_forward_supported(Dk, Dv, k.scalar_type()))
    throw std::invalid_argument("hh::kernels::chunk_factors: k and v of one 16-bit dtype, Dk and Dv in {64, 128} only");
  need_gate(g, "chunk_factors", "g", {B, T, H}, k.scalar_type());
  need_gate(beta, "chunk_factors", "beta", {B, T, H}, k.scalar_type());
  if (q.defined()) {
    need(q, "chunk_factors", "q", k.sizes(), true);
    if (q.scalar_type() != k.scalar_type()) throw std::invalid_argument("hh::kernels::chunk_factors: q must have k's dtype");
  }
  const SlotRows slots = slot_rows(grid, B, T);
  PreConv<void> pre{nullptr, nullptr, nullptr, nullptr, nullptr, 1e-6f};  // type-erased until dispatch
  ConvMaps maps{};
  if (conv != nullptr) {
    const std::string fn = "hh::kernels::chunk_factors: with the short convolution, ";
    if (!q.defined()) throw std::invalid_argument(fn + "q is needed");
    if (grid.gather.defined()) throw std::invalid_argument(fn + "the grid must hold regular sequences");
    // short_conv_rows128 keeps positions in int, and the copy engine's box coordinates are 32-bit.
    if (T > std::numeric_limits<int>::max() - kC || B > std::numeric_limits<int>::max())
      throw std::invalid_argument(fn + "T must be below 2^31 - 64 tokens and B below 2^31 sequences");
    if (!copy_engine_available()) throw std::invalid_argument(fn + "the copy engine (sm_90 on) is needed");
    if (!short_conv_fusion_supported(Dk, Dv, k.scalar_type())) throw std::invalid_argument(fn + "Dk = Dv in {64, 128} only");
    need(conv->wq, "chunk_factors", "the short convolution's q taps", {H * Dk, 1, kConvTaps}, true);
    need(conv->wk, "chunk_factors", "the short convolution's k taps", {H * Dk, 1, kConvTaps}, true);
    need(conv->wv, "chunk_factors", "the short convolution's v taps", {H * Dv, 1, kConvTaps}, true);
    need(conv->cos, "chunk_factors", "RoPE's cos table", {T, Dk}, true);
    need(conv->sin, "chunk_factors", "RoPE's sin table", {T, Dk}, true);
    for (const at::Tensor* t : {&conv->wq, &conv->wk, &conv->wv, &conv->cos, &conv->sin})
      if (t->scalar_type() != k.scalar_type()) throw std::invalid_argument(fn + "the taps and tables must have k's dtype");
    pre = {conv->wq.data_ptr(), conv->wk.data_ptr(), conv->wv.data_ptr(), conv->cos.data_ptr(), conv->sin.data_ptr(),
           static_cast<float>(conv->eps)};
    maps = {conv_rows_map(q, "q"), conv_rows_map(k, "k"), conv_rows_map(v, "v")};
  }
  const c10::cuda::CUDAGuard guard(k.device());
  const auto f32 = k.options().dtype(at::kFloat);
  const auto f16 = k.options().dtype(at::kHalf);
  const bool u16 = u_form == UForm::kFloat16Columns, u_scan = u_form == UForm::kScan;
  if (u16 && !q.defined())
    throw std::invalid_argument("hh::kernels::chunk_factors: U in float16 by columns comes with the output's factors (q is needed)");
  if (u_scan && (!q.defined() || conv != nullptr || g_factors_in_turn > 0))
    throw std::invalid_argument(
        "hh::kernels::chunk_factors: T diag(beta) for the scan (UForm::kScan) comes with the output's factors (q is needed), "
        "without the short convolution or chunks in turn");
  if (keep_t && (!q.defined() || conv != nullptr))
    throw std::invalid_argument(
        "hh::kernels::chunk_factors: T for the backward comes with the output's factors (q is needed), without the short convolution");
  if (qk_in_scan && !u_scan)
    throw std::invalid_argument(
        "hh::kernels::chunk_factors: the row scales of q and k for the scan (qk_in_scan) come with T diag(beta) (UForm::kScan)");
  ChunkFactors r{at::empty({H, N, kC, Dk}, f16), u_scan ? at::Tensor() : at::empty({H, N, kC, Dv}, u16 ? f16 : f32),
                 qk_in_scan ? at::Tensor() : at::empty({H, N, kC, Dk}, f16), at::empty({H, N}, f32), at::empty({H, N}, f32)};
  if (u16) r.U_inv = at::empty({H, N, Dv}, f32);
  if (u_scan) r.Tb = at::empty({H, N, 2, kPackedLower}, k.options());
  if (qk_in_scan) r.QK = at::empty({H, N, 2, kC}, f32);
  OutFactors of{nullptr, static_cast<float>(scale), nullptr, nullptr, nullptr, nullptr, nullptr, nullptr};
  if (q.defined()) {
    if (!qk_in_scan) r.Qd = at::empty({H, N, kC, Dk}, f16);
    r.Aq = at::empty({H, N, kPackedLower}, f16);
    r.aq_inv = at::empty({H, N}, f32);
    if (keep_t) r.T16 = at::empty({H, N, kPackedLower}, k.options());
    of = {q.data_ptr(), static_cast<float>(scale), qk_in_scan ? nullptr : r.Qd.data_ptr<c10::Half>(), r.Aq.data_ptr<c10::Half>(),
          r.aq_inv.data_ptr<float>(), keep_t ? r.T16.data_ptr() : nullptr, u_scan ? r.Tb.data_ptr() : nullptr,
          qk_in_scan ? r.QK.data_ptr<float>() : nullptr};
  }
  if (N == 0 || H == 0) return r;
  dispatch(Dk, Dv, k.scalar_type(), [&](auto dk, auto dv, auto x) {
    using X = decltype(x);
    constexpr int DK = decltype(dk)::value, DV = decltype(dv)::value;
    const PreConv<X> pc{static_cast<const X*>(pre.wq), static_cast<const X*>(pre.wk), static_cast<const X*>(pre.wv),
                        static_cast<const X*>(pre.cos), static_cast<const X*>(pre.sin), pre.eps};
    auto launch = [&](auto kernel, dim3 grid, size_t smem, int64_t n0, int64_t turns, unsigned long long* clocks = nullptr) {
      g_factors_last_kernel.store(reinterpret_cast<const void*>(kernel), std::memory_order_relaxed);
      g_factors_last_smem.store(smem, std::memory_order_relaxed);
      launch_kernel(kernel, grid, kThreads, smem, static_cast<const X*>(k.data_ptr()), static_cast<const X*>(v.data_ptr()),
                    gate_in<X>(g), gate_in<X>(beta), slots, static_cast<int>(H), N, r.W.data_ptr<c10::Half>(),
                    u_scan ? nullptr : r.U.data_ptr(),
                    u16 ? r.U_inv.data_ptr<float>() : nullptr, qk_in_scan ? nullptr : r.kdecay.data_ptr<c10::Half>(), r.decay.data_ptr<float>(),
                    r.bound.data_ptr<float>(), of, pc, maps, n0, turns, clocks);
    };
    auto run = [&](auto kernel, size_t needed) {
      const size_t smem = smem_for_blocks_per_sm(needed, g_factors_blocks_an_sm);
      for (int64_t n0 = 0; n0 < N; n0 += 65535)  // the grid's y takes at most 2^16 - 1 chunks
        launch(kernel, dim3(static_cast<unsigned>(H), static_cast<unsigned>(std::min<int64_t>(N - n0, 65535))), smem, n0, 0);
    };
    if (conv != nullptr) {
      if constexpr (DK == 128 && DV == 128 && std::is_same_v<X, c10::BFloat16>) {
        if (g_factors_four_blocks) run(chunk_factors_kernel<DK, DV, X, true, true, 4>, factors_smem<DK, DV, X, true>());
        else run(chunk_factors_kernel<DK, DV, X, true, true>, factors_smem<DK, DV, X, true>());
      } else if constexpr (DK == DV) {
        run(chunk_factors_kernel<DK, DV, X, true, true>, factors_smem<DK, DV, X, true>());
      }
    } else if (q.defined() && g_factors_in_turn > 0) {
      // Chunks in turn: g_factors_in_turn blocks an SM (their shared memory padded so that no more share
      // one), each taking every gridDim.x-th (chunk, head).
      auto kernel = g_factors_phase_clocks ? chunk_factors_kernel<DK, DV, X, true, false, 2, true, true>
                                           : chunk_factors_kernel<DK, DV, X, true, false, 2, true>;
      const size_t smem = smem_for_blocks_per_sm(factors_turn_smem<DK, DV, X>(), g_factors_in_turn);
      const int64_t turns = N * H, blocks = std::min<int64_t>(turns, static_cast<int64_t>(device_sms()) * g_factors_in_turn);
      unsigned long long* clocks = nullptr;
      if (g_factors_phase_clocks) {
        g_factors_clocks = at::empty({blocks * (kFactorsPhases + 1)}, k.options().dtype(at::kLong));  // every block writes its own
        clocks = reinterpret_cast<unsigned long long*>(g_factors_clocks.data_ptr<int64_t>());
      }
      launch(kernel, dim3(static_cast<unsigned>(blocks)), smem, 0, turns, clocks);
      g_factors_turn_launches.fetch_add(1, std::memory_order_relaxed);
    } else if (q.defined()) {
      run(chunk_factors_kernel<DK, DV, X, true, false>, factors_smem<DK, DV, X, true>());
    } else {
      run(chunk_factors_kernel<DK, DV, X, false, false>, factors_smem<DK, DV, X, false>());
    }
  });
  return r;
}

at::Tensor chunk_output(const at::Tensor& q, const at::Tensor& k, const at::Tensor& g, const at::Tensor& S,
                        const at::Tensor& M, const ChunkGrid& grid, double scale) {
  if (q.dim() != 4 || S.dim() != 4) throw std::invalid_argument("hh::kernels::chunk_output: q must be [B, T, H, Dk], S [H, N, Dk, Dv]");
  const int64_t B = q.size(0), T = q.size(1), H = q.size(2), Dk = q.size(3), Dv = S.size(3), N = grid.N;
  need(q, "chunk_output", "q", q.sizes(), true);
  need(k, "chunk_output", "k", q.sizes(), true);
  need(g, "chunk_output", "g", {B, T, H}, false);
  need(S, "chunk_output", "S", {H, N, Dk, Dv}, false);
  need(M, "chunk_output", "M", {H, N, kC, Dv}, false);
  if (k.scalar_type() != q.scalar_type() || !chunk_forward_supported(Dk, Dv, q.scalar_type()))
    throw std::invalid_argument("hh::kernels::chunk_output: q and k of one 16-bit dtype, Dk and Dv in {64, 128} only");
  const SlotRows slots = slot_rows(grid, B, T);
  const c10::cuda::CUDAGuard guard(q.device());
  at::Tensor out = at::empty({B, T, H, Dv}, q.options());
  if (N == 0 || H == 0) return out;
  dispatch(Dk, Dv, q.scalar_type(), [&](auto dk, auto dv, auto x) {
    using X = decltype(x);
    constexpr int DK = decltype(dk)::value, DV = decltype(dv)::value;
    launch_kernel(chunk_output_kernel<DK, DV, X>, dim3(static_cast<unsigned>(N), static_cast<unsigned>(H), DV / kOutCols), kThreads, output_smem<DK, X>(),
                  static_cast<const X*>(q.data_ptr()), static_cast<const X*>(k.data_ptr()), g.data_ptr<float>(), slots,
                  static_cast<int>(H), N, S.data_ptr<float>(), M.data_ptr<float>(), static_cast<float>(scale),
                  static_cast<X*>(out.data_ptr()));
  });
  return out;
}

namespace {
// chunk_output_f16's and chunk_output_f16_fused's checks of the factors and history; H, N and Dv out.
void check_output_f16(const char* fn, const ChunkFactors& f, const at::Tensor& S16, const at::Tensor& S_inv,
                      const at::Tensor& M16, const at::Tensor& M_inv, const ChunkGrid& grid, at::ScalarType dtype,
                      int64_t& H, int64_t& N, int64_t& Dk, int64_t& Dv) {
  const std::string name = std::string("hh::kernels::") + fn + ": ";
  if (!f.Qd.defined() || f.Qd.dim() != 4 || S16.dim() != 4)
    throw std::invalid_argument(name + "needs chunk_factors' output factors (given q) and S16 [H, N, Dk, Dv]");
  H = f.Qd.size(0), N = f.Qd.size(1), Dk = f.Qd.size(3), Dv = S16.size(3);
  need(f.Qd, fn, "Qd", {H, N, kC, Dk}, true);
  need(f.Aq, fn, "Aq", {H, N, kPackedLower}, true);
  need(f.aq_inv, fn, "aq_inv", {H, N}, false);
  need(S16, fn, "S16", {H, N, Dk, Dv}, true);
  need(S_inv, fn, "S_inv", {H, N, Dk / 16, Dv / 16}, false);
  need(M16, fn, "M16", {H, N, kC, Dv}, true);
  need(M_inv, fn, "M_inv", {H, N, kC / 16, Dv / 8}, false);
  if (f.Qd.scalar_type() != at::kHalf || f.Aq.scalar_type() != at::kHalf || S16.scalar_type() != at::kHalf ||
      M16.scalar_type() != at::kHalf)
    throw std::invalid_argument(name + "Qd, Aq, S16 and M16 must be float16");
  if (!chunk_forward_supported(Dk, Dv, dtype) || N != grid.N)
    throw std::invalid_argument(name + "Dk and Dv in {64, 128}, a 16-bit dtype, and the grid's N chunks only");
}

const __half* half_ptr(const at::Tensor& x) { return reinterpret_cast<const __half*>(x.data_ptr<c10::Half>()); }
}  // namespace

at::Tensor chunk_output_f16(const ChunkFactors& f, const at::Tensor& S16, const at::Tensor& S_inv, const at::Tensor& M16,
                            const at::Tensor& M_inv, const ChunkGrid& grid, int64_t B, int64_t T, at::ScalarType dtype) {
  int64_t H, N, Dk, Dv;
  check_output_f16("chunk_output_f16", f, S16, S_inv, M16, M_inv, grid, dtype, H, N, Dk, Dv);
  const SlotRows slots = slot_rows(grid, B, T);
  const c10::cuda::CUDAGuard guard(S16.device());
  at::Tensor out = at::empty({B, T, H, Dv}, S16.options().dtype(dtype));
  if (N == 0 || H == 0) return out;
  dispatch(Dk, Dv, dtype, [&](auto dk, auto dv, auto x) {
    using X = decltype(x);
    constexpr int DK = decltype(dk)::value, DV = decltype(dv)::value;
    launch_kernel(chunk_output_f16_kernel<DK, DV, X, -1>, dim3(static_cast<unsigned>(N), static_cast<unsigned>(H), DV / kOutCols), kThreads, output_f16_smem<DK>(),
                  half_ptr(f.Qd), half_ptr(f.Aq), f.aq_inv.data_ptr<float>(), half_ptr(S16), S_inv.data_ptr<float>(), half_ptr(M16),
                  M_inv.data_ptr<float>(), slots, static_cast<int>(H), N, static_cast<X*>(out.data_ptr()), FusedOutputArgs{});
  });
  return out;
}

bool chunk_output_fusion_supported(int64_t H, int64_t Dv, at::ScalarType dtype) {
  return H > 0 && H <= kMaxFusionHeads && (Dv == 64 || Dv == 128) && (dtype == at::kBFloat16 || dtype == at::kHalf) &&
         copy_engine_available();
}

bool chunk_output_fusion_fits(const OutputFusion& fu, const at::Tensor& y) {
  auto aligned = [](const at::Tensor& x) { return x.defined() && reinterpret_cast<uintptr_t>(x.data_ptr()) % 16 == 0; };
  return aligned(fu.gate) && aligned(fu.gamma) && aligned(y) && fu.gate.dim() == 3 && fu.gate.stride(-1) == 1 &&
         fu.gate.stride(1) % 8 == 0 && (fu.gate.size(0) <= 1 || fu.gate.stride(0) == fu.gate.size(1) * fu.gate.stride(1)) &&
         fu.gamma.is_contiguous() && y.is_contiguous();
}

void chunk_output_f16_fused(const ChunkFactors& f, const at::Tensor& S16, const at::Tensor& S_inv, const at::Tensor& M16,
                            const at::Tensor& M_inv, const ChunkGrid& grid, int64_t B, int64_t T, const OutputFusion& fu,
                            at::Tensor& y) {
  const char* fn = "chunk_output_f16_fused";
  const std::string name = std::string("hh::kernels::") + fn + ": ";
  const at::ScalarType dtype = y.scalar_type();
  int64_t H, N, Dk, Dv;
  check_output_f16(fn, f, S16, S_inv, M16, M_inv, grid, dtype, H, N, Dk, Dv);
  if (!chunk_output_fusion_supported(H, Dv, dtype))
    throw std::invalid_argument(name + "at most 256 heads, Dv 64 or 128, a 16-bit dtype, and a device of compute capability 9.0 or later");
  const FusedOutputArgs fa = fused_output_args(fn, fu, y, B, T, H, Dv, dtype);
  const SlotRows slots = slot_rows(grid, B, T);
  const c10::cuda::CUDAGuard guard(S16.device());
  if (N == 0) return;
  dispatch(Dk, Dv, dtype, [&](auto dk, auto dv, auto x) {
    using X = decltype(x);
    constexpr int DK = decltype(dk)::value, DV = decltype(dv)::value;
    auto launch = [&](auto act) {
      constexpr int A = decltype(act)::value;
      const dim3 blocks(static_cast<unsigned>(N), static_cast<unsigned>(H), DV / kOutCols);
      launch_cluster_kernel(chunk_output_f16_kernel<DK, DV, X, A>, blocks, dim3(1, 1, DV / kOutCols), kThreads,
                            output_f16_smem<DK>() + kFusedExtra, half_ptr(f.Qd), half_ptr(f.Aq), f.aq_inv.data_ptr<float>(),
                            half_ptr(S16), S_inv.data_ptr<float>(), half_ptr(M16), M_inv.data_ptr<float>(), slots,
                            static_cast<int>(H), N, static_cast<X*>(nullptr), fa);
    };
    if (fu.act == GateActivation::kSigmoid) launch(std::integral_constant<int, 1>{});
    else if (fu.act == GateActivation::kSilu) launch(std::integral_constant<int, 2>{});
    else launch(std::integral_constant<int, 0>{});
  });
}

}  // namespace hh::kernels
