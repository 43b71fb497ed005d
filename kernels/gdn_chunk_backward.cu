// The chunk-local half of the chunked gated delta rule's backward for 16-bit inputs (DESIGN.md
// section 9), on either side of the reverse low_rank_scan. Below, dO stands for scale times the output's
// gradient; both kernels read the gradient as given and apply the scale themselves.
//   grad_to_grid_f16:   dO on the chunk grid in float16, one power-of-two scale a chunk and head, for the
//                       reverse scan that forms the direct term itself (LowRankScanArgs::direct; the default).
//   chunk_state_direct: Z_n = (diag(e^G) Q - A W)^T dO_n, the direct effect of chunk n's start state
//                       on its output, with A = (Q K^T * e^{G_t - G_i}, i <= t); the reverse scan's Z where
//                       it does not form the term (kernels::set_direct_in_scan(false)).
//   chunk_backward:     with every chunk's start state S_n and end-state gradient dS_n held fixed, the
//                       gradients of J = sum_n <dO_n, O_n> + <dS_n, S_{n+1}> for q, k, v, g and beta.
// They read q, k, v, g, beta and dO where they lie ([B, T, H, ...]) and chunk_backward writes the
// gradients there, so nothing is copied onto a chunk grid. core/attention/gdn.cpp's
// chunk_local_backward (the same formulas on LibTorch ops) is the reference.
//
// chunk_backward, per chunk, with X = diag(beta) V - diag(beta e^G) K S (so the chunk's new values
// are M = U - W S = T X) and kd = e^{G_C - G}:
//   dM = A^T dO + diag(kd) K dS,  dVb = T^T dM (dV = diag(beta) dVb),  dT = dM X^T,
//   ndKb = dVb S^T,  dqdecay = dO S^T,  dkdecay = M dS^T,  dA = dO M^T,  dL = -(T^T dT T^T) strictly lower,
// then dQ, dK, dbeta and dG as chunk_local_backward assembles them. S and dS stream through shared
// memory 32 columns at a time (64 in the default form: T from the forward, a block a chunk); the products
// contracting over those columns accumulate in registers.
// Given the scans' new values (M from the forward, -dM from the reverse scan that formed the direct
// term), M and dM stream beside S and dS instead of being formed, and dL = -(dVb M^T) (= -(T^T dT T^T)
// with M = T X).
// Both kernels' products are m16n8k16 ones on 16-bit operands with float32 accumulation (see each).
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>

#include <algorithm>
#include <atomic>

#include "kernels/chunk_common.cuh"

namespace hh::kernels {
namespace {

constexpr int kBwdWarps = 16;
constexpr int kBwdThreads = 32 * kBwdWarps;
// Columns of S and dS a step of chunk_backward takes: 64 in the forms that read T (but chunks in turn), so
// that a chunk takes two steps and every warp forms one 16 x 16 tile of a step's dVb; 32 in the others.
template <bool TK, bool LOOP>
constexpr int step_cols() {
  return TK && !LOOP ? 64 : 32;
}
constexpr int kDirectThreads = 256;
constexpr int kSums = 6;         // chunk_backward's row and column sums ([4][C] each)
constexpr int kSdot = kBwdWarps + 4;  // and its parts of <S, dS> (a warp's each) and of sum_i kd_i kk_sum_i (2)
// The sums start 16-byte aligned (zeroed as float4) and the 16-bit tiles after the floats stay so.
static_assert((3 * kC * kLdT + 4 * kC) % 4 == 0 && (kSums * 4 * kC + kSdot) % 4 == 0 && kC % 2 == 0,
              "chunk_backward's shared-memory alignment");
constexpr int kLd16C = ld16<kC>();  // row stride of a 16-bit [C][C] matrix
std::atomic<int64_t> g_backward_launches[3];  // chunk_backward_launches
bool g_backward_chunks_in_turn = false;         // set_backward_chunks_in_turn
std::atomic<int64_t> g_in_turn_launches{0};     // backward_chunks_in_turn_launches

// f(r, c, j, h, acc[j][2h], acc[j][2h + 1]) for every pair of elements of the warp's tiles (rows from m,
// 8-column tiles from n0): columns c (even) and c + 1 of row r, in tile j and half h (rows g or g + 8). The
// tile and half let sums kept by tile or by half be indexed at compile time, so that they stay in registers
// (indexed from r and c, ptxas placed such a sum array in local memory), and a pair of float32 operands be
// read as one float2.
template <int NT, class F>
__device__ __forceinline__ void for_each_pair(float (&acc)[NT][4], int m, int n0, F f) {
  const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
#pragma unroll
  for (int j = 0; j < NT; ++j)
#pragma unroll
    for (int h = 0; h < 2; ++h) f(m + g + 8 * h, n0 + 8 * j + 2 * t, j, h, acc[j][2 * h], acc[j][2 * h + 1]);
}

// f(r, c, acc[j][e]) for every element of the warp's tiles, in the same order.
template <int NT, class F>
__device__ __forceinline__ void for_each(float (&acc)[NT][4], int m, int n0, F f) {
  for_each_pair(acc, m, n0, [&](int r, int c, int, int, float& x0, float& x1) {
    f(r, c, x0);
    f(r, c + 1, x1);
  });
}

// chunk_backward's sums over rows or columns of the warps' tiles are kept in four partial vectors of C
// ([4][C]), one for each warp that shares a row (or column) block, which it alone writes and adds to: so
// plain shared-memory adds, where atomics (a compare-and-swap loop for floats, four warps contending)
// cost more. The vectors' total (sum4) is read once every sum is in.
__device__ __forceinline__ float sum4(const float* p, int r) { return (p[r] + p[kC + r]) + (p[2 * kC + r] + p[3 * kC + r]); }

// Adds a lane's partial sums for its rows g and g + 8 (of the tiles at m) into part[] (the warp's own
// vector of a [4][C] sum, for rows m .. m + 15): over the lanes of a row (t), then one add a row.
__device__ __forceinline__ void add_row_sums(float lo, float hi, int m, float* part) {
  const int lane = threadIdx.x % 32;
#pragma unroll
  for (int o = 1; o < 4; o <<= 1) {
    lo += __shfl_xor_sync(0xffffffffu, lo, o);
    hi += __shfl_xor_sync(0xffffffffu, hi, o);
  }
  if (lane % 4 == 0) {
    part[m + lane / 4] += lo;
    part[m + lane / 4 + 8] += hi;
  }
}

// Adds a lane's partial sums for its columns 2t + e of the warp's two 8-column tiles from n0 (over its
// rows g and g + 8) into part[] (the warp's own vector of a [4][C] sum, for columns n0 .. n0 + 15): over
// the lanes of a column (g), then one add a column.
__device__ __forceinline__ void add_col_sums(float (&col)[2][2], int n0, float* part) {
  const int lane = threadIdx.x % 32;
#pragma unroll
  for (int j = 0; j < 2; ++j)
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      float x = col[j][e];
      x += __shfl_xor_sync(0xffffffffu, x, 4);
      x += __shfl_xor_sync(0xffffffffu, x, 8);
      x += __shfl_xor_sync(0xffffffffu, x, 16);
      if (lane < 4) part[n0 + 8 * j + 2 * lane + e] += x;
    }
}

// sum over the warp's elements of x(r, c) acc(r, c), by row, into part[] (row dot products; as
// add_row_sums), for x a 16-bit [C][ld] tile read a pair of columns at a time.
template <int NT, class T>
__device__ __forceinline__ void row_dots(float (&acc)[NT][4], int m, int n0, const T* x, int ld, float* part) {
  using P2 = typename Pair16<T>::type;
  const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  float s[2] = {0.f, 0.f};
#pragma unroll
  for (int half = 0; half < 2; ++half)
#pragma unroll
    for (int j = 0; j < NT; ++j) {
      const float2 v = Pair16<T>::to_float2(*reinterpret_cast<const P2*>(x + (m + g + 8 * half) * ld + n0 + 8 * j + 2 * t));
      s[half] += acc[j][2 * half] * v.x;
      s[half] += acc[j][2 * half + 1] * v.y;
    }
  add_row_sums(s[0], s[1], m, part);
}

// Writes the warp's tiles (rows from m, 8-column tiles from n0) of a [C][D] gradient to its rows of
// out [rows * H, D] (the chunk's table row_h: row * H + h); padding slots are skipped. WIDE (NT a
// multiple of 4): a row's 16 bytes a lane (store_tiles16), where each lane's 4-byte pairs wrote half
// sectors; not in chunk_backward's form with HIST alone, where the shuffles' registers took its spill
// from 4 to 20-24 bytes.
template <int D, bool WIDE, int NT, class T>
__device__ __forceinline__ void store_rows(float (&acc)[NT][4], int m, int n0, const int64_t* row_h,
                                           T* __restrict__ out) {
  const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  if constexpr (WIDE && NT % 4 == 0) {
    store_tiles16<T>(acc, [&](int half) -> T* {
      const int64_t row = row_h[m + g + 8 * half];
      return row < 0 ? nullptr : out + row * D + n0;
    });
  } else {
#pragma unroll
    for (int e = 0; e < 4; e += 2) {
      const int r = m + g + (e >= 2 ? 8 : 0);
      if (row_h[r] < 0) continue;
      T* dst = out + row_h[r] * D;
#pragma unroll
      for (int j = 0; j < NT; ++j) store2(dst + n0 + 8 * j + 2 * t, acc[j][e], acc[j][e + 1]);
    }
  }
}

// f(r, c, x) of the warp's tiles (rows from m, 8-column tiles from n0) into a 16-bit matrix of row
// stride ld, two columns a store.
template <int NT, class T, class F>
__device__ __forceinline__ void store16(float (&acc)[NT][4], int m, int n0, T* dst, int ld, F f) {
  const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
#pragma unroll
  for (int j = 0; j < NT; ++j)
#pragma unroll
    for (int e = 0; e < 4; e += 2) {
      const int r = m + g + (e >= 2 ? 8 : 0), c = n0 + 8 * j + 2 * t;
      store2(dst + r * ld + c, f(r, c, acc[j][e]), f(r, c + 1, acc[j][e + 1]));
    }
}
template <int NT, class T>
__device__ __forceinline__ void store16(float (&acc)[NT][4], int m, int n0, T* dst, int ld) {
  store16(acc, m, n0, dst, ld, [](int, int, float x) { return x; });
}

// ---------------------------------------------------------------------------------------------------
// chunk_state_direct: one block of 8 warps per (chunk, head), on m16n8k16 float16 products (product16)
// in block float16: A, dO and Qt each brought into float16's range by a power-of-two scale for the chunk
// (pow2_scale), so that they keep 11 significant bits whatever the inputs' kind; W is float16 already.

// Shared memory: A in float32, then Qt in float16 in its place; A in float16; W; G, three largest
// magnitudes, the rows' table; the 16-bit tiles Q, K, dO (dO then float16 in place). Under half of an SM's, so
// that two blocks share one.
template <int DK, int DV, class T>
constexpr size_t direct_smem() {
  return (kC * kLdT + kC + 4) * sizeof(float) + kC * sizeof(int64_t) +
         (kC * kLd16C + kC * ld16<DK>()) * sizeof(__half) + (2 * kC * ld16<DK>() + kC * ld16<DV>()) * sizeof(T);
}

template <int DK, int DV, class T>
__global__ void __launch_bounds__(kDirectThreads)
    chunk_state_direct_kernel(const T* __restrict__ q, const T* __restrict__ k, const float* __restrict__ g,
                              const __half* __restrict__ W, const T* __restrict__ dO, SlotRows slots, int H, int64_t N,
                              float scale, float* __restrict__ Z) {
  constexpr int LDK = ld16<DK>(), LDV = ld16<DV>(), LDA = kLd16C;
  static_assert(kC * LDK * sizeof(__half) <= kC * kLdT * sizeof(float), "Qt fits where A was");
  extern __shared__ float4 smem4[];
  float* const As = reinterpret_cast<float*>(smem4);    // [C][kLdT]: A
  __half* const Qt = reinterpret_cast<__half*>(As);     // [C][LDK]: diag(e^G) Q - A W, once A is read
  float* const Gs = As + kC * kLdT;
  unsigned* const top = reinterpret_cast<unsigned*>(Gs + kC);  // max |A|, |dO|, |Qt|
  int64_t* const row_h = reinterpret_cast<int64_t*>(top + 4);
  __half* const A16 = reinterpret_cast<__half*>(row_h + kC);  // [C][LDA]
  __half* const Ws = A16 + kC * LDA;                          // [C][LDK]
  T* const Qs = reinterpret_cast<T*>(Ws + kC * LDK);
  T* const Ks = Qs + kC * LDK;
  T* const dOs = Ks + kC * LDK;
  __half* const dOh = reinterpret_cast<__half*>(dOs);  // dO in block float16, in place
  const int64_t n = blockIdx.x;
  const int h = blockIdx.y, tid = threadIdx.x, warp = tid / 32;
  const int64_t chunk = static_cast<int64_t>(h) * N + n;
  if (tid < kC) row_h[tid] = slots.row_h(n, tid, h, H);
  if (tid < 3) top[tid] = 0u;
  __syncthreads();
  load_rows<DK, kDirectThreads>(Qs, q, row_h);
  load_rows<DK, kDirectThreads>(Ks, k, row_h);
  load_rows<DV, kDirectThreads>(dOs, dO, row_h);
  for (int i = tid; i < kC * DK / 8; i += kDirectThreads) {
    const int r = (8 * i) / DK, c = (8 * i) % DK;
    cp_async16(Ws + r * LDK + c, W + (chunk * kC + r) * DK + c);
  }
  gates_while_tiles_land(g, nullptr, row_h, Gs, nullptr);

  masked_gram<DK>(Qs, Ks, Gs, nullptr, /*inclusive=*/true, As);
  __syncthreads();
  // A's largest magnitude and dO's, then both in block float16: A four floats a step, dO eight 16-bit
  // values (each pack read and rewritten in place by one thread).
  {
    float a = 0.f, d = 0.f;
    for (int i = tid; i < kC * kC / 4; i += kDirectThreads) {
      const float4 x = *reinterpret_cast<const float4*>(As + (i / (kC / 4)) * kLdT + 4 * (i % (kC / 4)));
      a = fmaxf(a, fmaxf(fmaxf(fabsf(x.x), fabsf(x.y)), fmaxf(fabsf(x.z), fabsf(x.w))));
    }
    for (int i = tid; i < kC * DV / 8; i += kDirectThreads) {
      const Pack<T, 8> x = load_pack<8>(dOs + (i / (DV / 8)) * LDV + 8 * (i % (DV / 8)));
#pragma unroll
      for (int e = 0; e < 8; ++e) d = fmaxf(d, fabsf(pack_float(x, e)));
    }
    block_max(a, top);
    block_max(d, top + 1);
  }
  __syncthreads();
  const Pow2Scale sa = pow2_scale(__uint_as_float(top[0])), sd = pow2_scale(__uint_as_float(top[1]));
  for (int i = tid; i < kC * kC / 4; i += kDirectThreads) {
    const int r = i / (kC / 4), c = 4 * (i % (kC / 4));
    const float4 x = *reinterpret_cast<const float4*>(As + r * kLdT + c);
    *reinterpret_cast<uint2*>(A16 + r * LDA + c) = make_uint2(pack_f16(sa.scale * x.x, sa.scale * x.y), pack_f16(sa.scale * x.z, sa.scale * x.w));
  }
  for (int i = tid; i < kC * DV / 8; i += kDirectThreads) {
    const int r = i / (DV / 8), c = 8 * (i % (DV / 8));
    const Pack<T, 8> x = load_pack<8>(dOs + r * LDV + c);
    unsigned w[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) w[e] = pack_f16(sd.scale * pack_float(x, 2 * e), sd.scale * pack_float(x, 2 * e + 1));
    *reinterpret_cast<uint4*>(dOh + r * LDV + c) = make_uint4(w[0], w[1], w[2], w[3]);
  }
  __syncthreads();  // A is read: Qt takes its place
  Pow2Scale sq;     // Qt's
  {  // Qt = diag(e^G) Q - A W: warp w, rows 16 (w % 4) .., columns (DK / 2)(w / 4) ..
    constexpr int NT = DK / 16;
    const int m = (warp % 4) * 16, n0 = (warp / 4) * (DK / 2);
    float qt[NT][4] = {};
    product16<false, true, NT>(qt, m, n0, 0, m + 16, A16, LDA, Ws, LDK);
    float x = 0.f;
    const float e_lo = expf(Gs[m + (tid % 32) / 4]), e_hi = expf(Gs[m + (tid % 32) / 4 + 8]);  // the lane's two rows
    for_each(qt, m, n0, [&](int r, int c, float& v) {
      v = (r < m + 8 ? e_lo : e_hi) * static_cast<float>(Qs[r * LDK + c]) - sa.inverse * v;
      x = fmaxf(x, fabsf(v));
    });
    block_max(x, top + 2);
    __syncthreads();
    sq = pow2_scale(__uint_as_float(top[2]));
    store16(qt, m, n0, Qt, LDK, [&](int, int, float v) { return sq.scale * v; });
  }
  __syncthreads();
  {  // Z = scale Qt^T dO: DK / 16 row groups of 16 split the 8 warps, each group's columns shared out.
    constexpr int RG = DK / 16, CG = 8 / RG, NT = DV / (8 * CG);
    const int m = (warp % RG) * 16, n0 = (warp / RG) * (DV / CG);
    float z[NT][4] = {};
    product16<true, true, NT>(z, m, n0, 0, kC, Qt, LDK, dOh, LDV);
    const int lane = tid % 32, g8 = lane / 4, t = lane % 4;
    float* dst = Z + chunk * DK * DV;
    auto out = [&](float x) { return scale * (sq.inverse * (sd.inverse * x)); };
#pragma unroll
    for (int j = 0; j < NT; ++j)
#pragma unroll
      for (int e = 0; e < 4; e += 2) {
        const int r = m + g8 + (e >= 2 ? 8 : 0), c = n0 + 8 * j + 2 * t;
        store2(dst + r * DV + c, out(z[j][e]), out(z[j][e + 1]));
      }
  }
}

// ---------------------------------------------------------------------------------------------------
// grad_to_grid_f16: one block of 4 warps per (chunk, head), each thread holding its packs of eight
// 16-bit values between the chunk's largest magnitude and the scaled stores.
constexpr int kGridF16Threads = 128;

template <int DV, class T>
__global__ void __launch_bounds__(kGridF16Threads)
    grad_to_grid_f16_kernel(const T* __restrict__ dO, SlotRows slots, int H, int64_t N, __half* __restrict__ out,
                            float* __restrict__ inv) {
  constexpr int kPacks = kC * DV / 8 / kGridF16Threads;  // a thread's
  static_assert(kPacks * kGridF16Threads * 8 == kC * DV, "the chunk's packs divide among the threads");
  __shared__ unsigned top;
  const int64_t n = blockIdx.x;
  const int h = blockIdx.y, tid = threadIdx.x;
  if (tid == 0) top = 0u;
  const ChunkRows rows = slots.chunk(n);
  Pack<T, 8> x[kPacks];
  float m = 0.f;
#pragma unroll
  for (int p = 0; p < kPacks; ++p) {
    const int i = tid + p * kGridF16Threads, r = i / (DV / 8), c = 8 * (i % (DV / 8));
    const int64_t row = rows(r);
    if (row >= 0) {
      x[p] = load_pack<8>(dO + (row * H + h) * DV + c);
    } else {
#pragma unroll
      for (int e = 0; e < 8; ++e) x[p].v[e] = T(0.f);
    }
#pragma unroll
    for (int e = 0; e < 8; ++e) m = fmaxf(m, fabsf(pack_float(x[p], e)));
  }
  __syncthreads();  // top is zero
  block_max(m, &top);
  __syncthreads();
  const Pow2Scale sc = pow2_scale(__uint_as_float(top));
  __half* dst = out + (static_cast<int64_t>(h) * N + n) * kC * DV;
#pragma unroll
  for (int p = 0; p < kPacks; ++p) {
    const int i = tid + p * kGridF16Threads;
    unsigned w[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) w[e] = pack_f16(sc.scale * pack_float(x[p], 2 * e), sc.scale * pack_float(x[p], 2 * e + 1));
    *reinterpret_cast<uint4*>(dst + 8 * i) = make_uint4(w[0], w[1], w[2], w[3]);
  }
  if (tid == 0) inv[static_cast<int64_t>(h) * N + n] = sc.inverse;
}

// ---------------------------------------------------------------------------------------------------
// chunk_backward: one block of 16 warps per (chunk, head). Its products are m16n8k16 ones on 16-bit
// operands of the inputs' kind with float32 accumulation, each fragment one ldmatrix (product16): the
// Q, K, V and dO tiles as they are, and what the block forms (T, scale A, the slices of S and dS, X, M,
// dM, dVb, then dT, T^T dT, d(Q K^T) and d(K K^T)) rounded once to that kind where it is stored. The
// row and column sums that make dbeta and dg, <S, dS> and the output's scale stay in float32. The decay
// e^{G_t - G_i} of the two masked [C][C] gradients is masked_gram's ex2.approx (an exponent <= 0 there).

// States in block float16 (LowRankScanArgs::S16): [H, N, DK, DV] float16, each 16 x 16 block scaled
// by a power of two whose inverse is in inv [H, N, DK / 16, DV / 16].
struct BlockF16 {
  const __half* x;
  const float* inv;
};
inline BlockF16 block_f16(const at::Tensor& x, const at::Tensor& inv) {
  return {reinterpret_cast<const __half*>(x.data_ptr<c10::Half>()), inv.data_ptr<float>()};
}
// A float16 pair's bits (the lower index in the low half) as two floats.
__device__ __forceinline__ float2 half2_to_float2(unsigned bits) {
  __half2 h;
  memcpy(&h, &bits, sizeof(h));
  return __half22float2(h);
}

// The step region in 16-bit elements: the slices of S and dS [DK][BV], X, M, dM and dVb [C][BV] (row
// stride ld16<BV>(); X not with 64 columns a step, whose forms have the history); after the steps, four
// [C][C] matrices in their place.
template <int DK, int BV>
constexpr int step_elems() {
  constexpr int LD = ld16<BV>();
  const int steps = 2 * DK * LD + (BV == 64 ? 3 : 4) * kC * LD, after = 4 * kC * kLd16C;
  return steps > after ? steps : after;
}
// Shared memory: in float32 T (where the inverse is formed), A and Lg = (K K^T * e^{G_t - G_i}, i < t),
// 4 vectors of C, the kSums sums of four partial vectors each and the parts of <S, dS> and of one more sum;
// the rows' table; then in 16-bit elements T and scale A, the step region and the tiles Q, K, V, dO.
// LOOP adds the next chunk's Q and K, rows' table and gates, and the chunks' indices (ChunkTurns); 64
// columns a step (step_cols) add the staging of a step's dS as it comes (block float16, [DK][BV]).
template <int DK, int DV, class T, bool TK = false, bool LOOP = false>
constexpr size_t backward_smem() {
  constexpr int BV = step_cols<TK, LOOP>();
  return (3 * kC * kLdT + 4 * kC + kSums * 4 * kC + kSdot) * sizeof(float) + kC * sizeof(int64_t) +
         (2 * kC * kLd16C + step_elems<DK, BV>() + 2 * kC * ld16<DK>() + 2 * kC * ld16<DV>()) * sizeof(T) +
         (LOOP ? 2 * kC * ld16<DK>() * sizeof(T) + kC * sizeof(int64_t) + 2 * kC * sizeof(float) + 4 * sizeof(int64_t) : 0) +
         (BV == 64 ? static_cast<size_t>(DK) * BV * sizeof(__half) : 0);
}

static_assert(backward_smem<128, 128, c10::Half, /*TK=*/true>() <= 227 * 1024,
              "chunk_backward's block fits an SM with 64 columns a step");

// A LOOP block's chunks of the N H (chunk, head) pairs, in shared memory: it takes pairs w = blockIdx.x,
// blockIdx.x + gridDim.x, ..., chunk n = w % N of head h = w / N (the order of the grid of one block a
// chunk, chunks fastest). Thread 0 writes them at a chunk's start; the other threads read them (volatile) where they
// need them, rather than keep them in registers through the chunk's steps.
struct ChunkTurns {
  int64_t* x;  // this chunk's n and h, the next one's (h -1: none)
  __device__ __forceinline__ int64_t n() const { return static_cast<const volatile int64_t*>(x)[0]; }
  __device__ __forceinline__ int h() const { return static_cast<int>(static_cast<const volatile int64_t*>(x)[1]); }
  __device__ __forceinline__ int64_t next_n() const { return static_cast<const volatile int64_t*>(x)[2]; }
  __device__ __forceinline__ int next_h() const { return static_cast<int>(static_cast<const volatile int64_t*>(x)[3]); }
  // Thread 0: the block's first chunk (pair w), as the next.
  __device__ __forceinline__ void start(int64_t w, int64_t N) const {
    x[2] = w % N;
    x[3] = w / N;
  }
  // Thread 0: the next chunk becomes this one, and the pair `stride` on from it (none past the last) the
  // next, reached by steps of N rather than a 64-bit division.
  __device__ __forceinline__ void advance(int stride, int64_t N, int H) const {
    int64_t n = x[0] = x[2], h = x[1] = x[3];
    for (n += stride; n >= N; n -= N) ++h;
    x[2] = h < H ? n : 0;
    x[3] = h < H ? h : -1;
  }
};

// HIST: M and dM from the scans' block float16 new values (the forward's M16 and the reverse scan's,
// which is -dM where it formed the direct term) instead of formed from S and dS: a step reads their
// slices beside those of S and dS, forms no X, M or dM, and sums dVb M^T, which is T^T dT T^T, in dT's
// place, so that dL = -(dVb M^T) needs no products after the steps. TK (with HIST): T from the forward's
// chunk_factors (t16 [H, N, C, C], the inputs' kind), copied with the tiles, instead of the inverse of
// I + diag(beta) Lg; scale A's 16-bit copy, which only the steps without HIST read, is not formed.
//
// LOOP (with TK): one block an SM taking chunks in turn (ChunkTurns) instead of one a chunk, so that
// each chunk's loads land while the block works on the one before: the next chunk's Q, K and gates
// (into buffers of their own, copied into place at its start) from the first step on, its V, dO and T
// (in place) once the steps are done with them. A block a chunk waits for its own loads at its start
// with nothing to cover them (one 16-warp block fills an SM); but this form is slower (docs/BENCHMARKS.md
// v59: the copies issued amid the steps stall the warps about as long), so it is off by default.
template <int DK, int DV, class T, bool HIST = false, bool TK = false, bool LOOP = false>
__global__ void __launch_bounds__(kBwdThreads, 1)
    chunk_backward_kernel(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
                          GateIn<T> g, GateIn<T> beta, BlockF16 S, BlockF16 dS,
                          BlockF16 Mh, BlockF16 dMh, const T* __restrict__ dO, SlotRows slots, int H, int64_t N,
                          float scale, T* __restrict__ dq, T* __restrict__ dk, T* __restrict__ dv,
                          GateOut<T> dg, GateOut<T> dbeta, const T* __restrict__ t16) {
  static_assert(HIST || !TK, "T from the forward with M and dM from the scans");
  static_assert(TK || !LOOP, "chunks in turn read T from the forward");
  constexpr bool kWideRows = TK || !HIST;  // store_rows
  constexpr int LDK = ld16<DK>(), LDV = ld16<DV>(), NTK = DK / 32;
  constexpr int kBV = step_cols<TK, LOOP>(), kLd16BV = ld16<kBV>();
  // WIDE (64 columns a step): every warp forms one 16 x 16 tile of dVb, and a thread carries more than one
  // unit of a step's slices (below).
  constexpr bool WIDE = kBV == 64;
  static_assert(!WIDE || HIST, "64 columns a step with the history only");
  constexpr int kUnits = DK * kBV / 8;  // 8-element units of a step's slice of S (and of dS)
  constexpr int kUnitsT = (kUnits + kBwdThreads - 1) / kBwdThreads;  // of them a thread
  static_assert(kUnits % kBwdThreads == 0 || kUnitsT == 1, "whole rounds of units");
  static_assert(DV % kBV == 0 && kBV % 16 == 0, "whole slices");
  constexpr int kMUnits = kC * kBV / 8;  // of M's slice (and of dM's): units 0.. are M's, kMUnits.. dM's
  constexpr int kMUnitsT = (2 * kMUnits + kBwdThreads - 1) / kBwdThreads;  // of them a thread
  extern __shared__ float4 smem4[];
  float* const Ts = reinterpret_cast<float*>(smem4);
  float* const As = Ts + kC * kLdT;
  float* const Lg = As + kC * kLdT;
  float* const Gs = Lg + kC * kLdT;
  float* const eG = Gs + kC;
  float* const bs = eG + kC;
  float* const kd = bs + kC;
  // The sums, [4][C] each (sum4): of rows, the partial vector of the warp's column block (warp / 4); of
  // columns, of its row block (warp % 4).
  float* const db_sum = kd + kC;          // sum_c dVb V + sum_i dL Lg (dbeta but its e^G kb_dot term)
  float* const kb_sum = db_sum + 4 * kC;  // <ndKb_t, k_t>
  float* const qq_sum = kb_sum + 4 * kC;  // <dqdecay_t, q_t>
  float* const kk_sum = qq_sum + 4 * kC;  // <dkdecay_t, k_t>
  float* const x_row = kk_sum + 4 * kC;   // row sums of dA * A and of dL * L
  float* const x_col = x_row + 4 * kC;    // and their column sums
  float* const sdot = x_col + 4 * kC;     // each warp's part of <S, dS>; then warps 0 and 1's of sum_i kd_i kk_sum_i
  int64_t* const row_h = reinterpret_cast<int64_t*>(sdot + kSdot);  // each slot's row of [rows * H, D]
  T* const T16 = reinterpret_cast<T*>(row_h + kC);               // [C][kLd16C]: T
  T* const A16 = T16 + kC * kLd16C;                 // scale A
  T* const step = A16 + kC * kLd16C;
  T* const Sj = step;                // [DK][kLd16BV]: the step's columns of S
  T* const dSj = Sj + DK * kLd16BV;  // and of dS
  T* const Xj = dSj + DK * kLd16BV;  // [C][kLd16BV] each
  T* const Mj = Xj + (WIDE ? 0 : kC * kLd16BV);  // (WIDE: no X)
  T* const dMj = Mj + kC * kLd16BV;
  T* const dVbj = dMj + kC * kLd16BV;
  T* const dQK = step;                // after the steps, [C][kLd16C] each: d(Q K^T) = scale dA * e^{G_t - G_i}
  T* const dTs = dQK + kC * kLd16C;   // dT
  T* const Ys = dTs + kC * kLd16C;    // T^T dT
  T* const dKK = Ys + kC * kLd16C;    // d(K K^T) = diag(beta) dL * e^{G_t - G_i}, strictly lower
  T* const Qs = step + step_elems<DK, kBV>();
  T* const Ks = Qs + kC * LDK;
  T* const Vs = Ks + kC * LDK;
  T* const dOs = Vs + kC * LDV;
  T* const Qn = dOs + kC * LDV;  // LOOP: the next chunk's Q and K, its rows' table and its g and beta
  T* const Kn = Qn + kC * LDK;
  int64_t* const row_h_nx = reinterpret_cast<int64_t*>(Kn + kC * LDK);
  float* const g_nx = reinterpret_cast<float*>(row_h_nx + kC);
  float* const b_nx = g_nx + kC;
  const ChunkTurns turns{reinterpret_cast<int64_t*>(b_nx + kC)};
  // WIDE: a step's S and dS as they come (block float16), each thread's units and their scales by cp.async
  // into staging that only it reads back (put): S's in Ts's float region (T comes from the forward), dS's
  // after the tiles, the scales in A16's (which the forms with the history do not form).
  static_assert(!WIDE || DK * kBV * sizeof(__half) <= kC * kLdT * sizeof(float),
                "S's staging fits where T's float32 inverse would be");
  uint4* const s_stage = reinterpret_cast<uint4*>(Ts);
  uint4* const ds_stage = reinterpret_cast<uint4*>(Qn);
  float* const sc_stage = reinterpret_cast<float*>(A16);  // [2 kUnitsT][kBwdThreads]: S's and dS's of unit i at 2 i, 2 i + 1
  // and after them the step's scales of M's and dM's 16 x 8 tiles, [2][C / 16][kBV / 8], copied by threads
  // 0 .. 2 (C / 16) (kBV / 8) - 1 and read by all after a barrier.
  float* const m_sc_stage = sc_stage + 2 * kUnitsT * kBwdThreads;
  static_assert(!WIDE || (2 * kUnitsT * kBwdThreads + 2 * (kC / 16) * (kBV / 8)) * sizeof(float) <= kC * kLd16C * sizeof(T),
                "the scales' staging fits where scale A's copy would be");

  // T, packed (kPackedLower): its blocks on and below the diagonal, 16 bytes a thread; the six above it are
  // zeros, written once below and never overwritten (in this form only the copies write T's region).
  auto load_t = [&](int64_t chunk) {
    for (int i = threadIdx.x; i < kPackedLower / 8; i += kBwdThreads) {
      const int2 at = packed_lower_at(8 * i);
      cp_async16(T16 + at.x * kLd16C + at.y, t16 + chunk * kPackedLower + 8 * i);
    }
  };
  if constexpr (TK) {  // unit u (8 columns) of row r lies above the diagonal blocks where 8 u >= 16 (r / 16 + 1)
    for (int i = threadIdx.x; i < kC * (kC / 8); i += kBwdThreads) {
      const int r = i / (kC / 8), u = i % (kC / 8);
      if (8 * u >= 16 * (r / 16 + 1)) *reinterpret_cast<uint4*>(T16 + r * kLd16C + 8 * u) = make_uint4(0u, 0u, 0u, 0u);
    }
  }
  // LOOP: the next chunk's Q and K (into Qn and Kn) and gates, then its V, dO and T (in place).
  auto load_next_qk = [&] {
    const int hn = turns.next_h();
    if (hn < 0) return;
    load_rows<DK, kBwdThreads>(Qn, q, row_h_nx);
    load_rows<DK, kBwdThreads>(Kn, k, row_h_nx);
    if (const int tid = threadIdx.x; tid < 2 * kC) {
      const int r = tid % kC;
      const int64_t row = row_h_nx[r];
      float* dst = (tid < kC ? g_nx : b_nx) + r;
      const GateIn<T> src = tid < kC ? g : beta;
      if (row < 0) *dst = 0.f;
      else if (src.wide) cp_async4(dst, static_cast<const float*>(src.x) + row);
      else *dst = src[row];  // 16-bit: loaded and converted here (cp.async copies 4 bytes at least)
    }
  };
  auto load_next_vdt = [&] {
    const int hn = turns.next_h();
    if (hn < 0) return;
    load_rows<DV, kBwdThreads>(Vs, v, row_h_nx);
    load_rows<DV, kBwdThreads>(dOs, dO, row_h_nx);
    load_t(static_cast<int64_t>(hn) * N + turns.next_n());
  };
  if constexpr (LOOP) {  // the first chunk's loads
    if (threadIdx.x == 0) turns.start(blockIdx.x, N);
    __syncthreads();
    if (threadIdx.x < kC) row_h_nx[threadIdx.x] = slots.row_h(turns.next_n(), threadIdx.x, turns.next_h(), H);
    __syncthreads();
    load_next_qk();
    cp_async_commit();
    load_next_vdt();
    cp_async_commit();
  }
  for (;;) {  // LOOP: a chunk a turn; else once
    // LOOP: the thread index read again each turn, so that nothing derived from it is held across turns
    const int tid = LOOP ? thread_index_here() : static_cast<int>(threadIdx.x), warp = tid / 32;
    if constexpr (LOOP) {
      cp_async_wait<1>();  // this thread's copies of the chunk's Q, K and gates (V, dO and T may be in flight)
      __syncthreads();     // and every thread's; the last chunk is done with every buffer
      for (int i = tid; i < 2 * kC * LDK / 8; i += kBwdThreads)  // Q and K (Ks follows Qs as Kn follows Qn)
        reinterpret_cast<uint4*>(Qs)[i] = reinterpret_cast<const uint4*>(Qn)[i];
      if (tid < kC) row_h[tid] = row_h_nx[tid];
      if (tid < 32) put_gates(tid, g_nx[2 * tid], g_nx[2 * tid + 1], b_nx[2 * tid], b_nx[2 * tid + 1], Gs, bs);
      for (int i = tid; i < kSums * kC; i += kBwdThreads)  // the sums
        reinterpret_cast<float4*>(db_sum)[i] = make_float4(0.f, 0.f, 0.f, 0.f);
      if (tid == 0) turns.advance(gridDim.x, N, H);
      __syncthreads();
      if (tid < kC && turns.next_h() >= 0) row_h_nx[tid] = slots.row_h(turns.next_n(), tid, turns.next_h(), H);
    } else {
      if (tid < kC) row_h[tid] = slots.row_h(blockIdx.x, tid, blockIdx.y, H);
      for (int i = tid; i < kSums * kC; i += kBwdThreads)  // the sums
        reinterpret_cast<float4*>(db_sum)[i] = make_float4(0.f, 0.f, 0.f, 0.f);
      __syncthreads();
      load_rows<DK, kBwdThreads>(Qs, q, row_h);
      load_rows<DK, kBwdThreads>(Ks, k, row_h);
      load_rows<DV, kBwdThreads>(Vs, v, row_h);
      load_rows<DV, kBwdThreads>(dOs, dO, row_h);
      if constexpr (TK) load_t(static_cast<int64_t>(blockIdx.y) * N + blockIdx.x);
      cp_async_commit();
    }
    const int64_t chunk =
        LOOP ? static_cast<int64_t>(turns.h()) * N + turns.n() : static_cast<int64_t>(blockIdx.y) * N + blockIdx.x;
    // A step's columns c0.. of S and dS (block float16) pass through registers (fetch) into the step's
    // 16-bit slices of the inputs' kind (put), which also sums <S, dS> in float32. Thread tid < kUnits
    // carries unit tid of the [DK][kBV / 8] grid, in one 16 x 16 block of each, and the blocks' scales;
    // with more units than threads (WIDE at DK = 128), units tid + i kBwdThreads too: the same columns,
    // kRound rows on.
    constexpr int kRound = kBwdThreads / (kBV / 8);
    static_assert(kUnitsT == 1 || kRound % 16 == 0, "a round of units covers whole 16-row blocks");
    const bool carrier = kUnitsT > 1 || tid < kUnits;
    const int ur = tid / (kBV / 8), uc = 8 * (tid % (kBV / 8));
    const int64_t at = chunk * DK * DV + static_cast<int64_t>(ur) * DV + uc;
    const int64_t at_inv = (chunk * (DK / 16) + ur / 16) * (DV / 16) + uc / 16;
    uint4 s_in[WIDE ? 1 : kUnitsT] = {}, ds_in[WIDE ? 1 : kUnitsT] = {};  // (WIDE: in the staging)
    float s_sc[WIDE ? 1 : kUnitsT] = {}, ds_sc[WIDE ? 1 : kUnitsT] = {};
    // HIST: thread tid carries unit tid % kMUnits of M's (tid < kMUnits) or dM's [C][kBV / 8] grid, in one
    // 16 x 8 tile (LowRankScanArgs::M16's), and its scale; with as many units of each as threads (WIDE),
    // unit tid of both.
    constexpr bool kMBoth = kMUnits == kBwdThreads;
    static_assert(kMBoth || 2 * kMUnits <= kBwdThreads, "one unit of M or dM a thread, or one of each");
    const bool m_carrier = HIST && (kMBoth || tid < 2 * kMUnits), of_dm = !kMBoth && tid >= kMUnits;
    const int mu = tid % kMUnits, mr = mu / (kBV / 8), mc = 8 * (mu % (kBV / 8));
    const int64_t m_at = (chunk * kC + mr) * DV + mc, m_at_inv = (chunk * (kC / 16) + mr / 16) * (DV / 8) + mc / 8;
    auto is_dm = [&](int i) { return kMBoth ? i == 1 : of_dm; };  // unit i of the thread's is dM's
    uint4 m_in[kMUnitsT] = {};
    float m_sc[WIDE ? 1 : kMUnitsT] = {};  // (WIDE: in the staging)
    constexpr int kMTiles = (kC / 16) * (kBV / 8);  // M's 16 x 8 tiles in a step
    auto fetch = [&](int c0) {
      if (m_carrier) {
#pragma unroll
        for (int i = 0; i < kMUnitsT; ++i) {
          const BlockF16 mh = is_dm(i) ? dMh : Mh;
          m_in[i] = __ldg(reinterpret_cast<const uint4*>(mh.x + m_at + c0));
          if constexpr (!WIDE) m_sc[i] = __ldg(mh.inv + m_at_inv + c0 / 8);
        }
        if constexpr (WIDE) {
          if (tid < 2 * kMTiles) {  // tile (rb, ct) of M's (tid < kMTiles) or dM's scales
            const int x = tid % kMTiles, rb = x / (kBV / 8), ct = x % (kBV / 8);
            cp_async4(m_sc_stage + tid, (tid < kMTiles ? Mh : dMh).inv + (chunk * (kC / 16) + rb) * (DV / 8) + c0 / 8 + ct);
          }
        }
      }
      if (!carrier) return;
#pragma unroll
      for (int i = 0; i < kUnitsT; ++i) {
        const int64_t o = static_cast<int64_t>(i) * kRound * DV, o_inv = static_cast<int64_t>(i) * (kRound / 16) * (DV / 16);
        if constexpr (WIDE) {  // unit i of thread tid at i kBwdThreads + tid: a warp's copies are 512 bytes in a row
          cp_async16(s_stage + i * kBwdThreads + tid, S.x + at + o + c0);
          cp_async16(ds_stage + i * kBwdThreads + tid, dS.x + at + o + c0);
          cp_async4(sc_stage + (2 * i) * kBwdThreads + tid, S.inv + at_inv + o_inv + c0 / 16);
          cp_async4(sc_stage + (2 * i + 1) * kBwdThreads + tid, dS.inv + at_inv + o_inv + c0 / 16);
        } else {
          s_in[i] = __ldg(reinterpret_cast<const uint4*>(S.x + at + o + c0));
          ds_in[i] = __ldg(reinterpret_cast<const uint4*>(dS.x + at + o + c0));
          s_sc[i] = __ldg(S.inv + at_inv + o_inv + c0 / 16);
          ds_sc[i] = __ldg(dS.inv + at_inv + o_inv + c0 / 16);
        }
      }
      if constexpr (WIDE) cp_async_commit();
    };
    // WIDE: the copies a put reads are waited for before a barrier that precedes it (each thread's slices'
    // copies are its own; the tiles' scales are read by every thread).
    float s_dot = 0.f;
    auto put = [&] {
      if (m_carrier) {  // dM = -(the reverse scan's new values)
#pragma unroll
        for (int i = 0; i < kMUnitsT; ++i) {
          const unsigned a[4] = {m_in[i].x, m_in[i].y, m_in[i].z, m_in[i].w};
          const float msc = WIDE ? m_sc_stage[(is_dm(i) ? kMTiles : 0) + (mr / 16) * (kBV / 8) + mc / 8] : m_sc[WIDE ? 0 : i];
          const float sc = is_dm(i) ? -msc : msc;
          Pack<T, 8> x;
#pragma unroll
          for (int j = 0; j < 4; ++j) {
            const float2 f = half2_to_float2(a[j]);
            x.v[2 * j] = T(sc * f.x), x.v[2 * j + 1] = T(sc * f.y);
          }
          store_pack<8>((is_dm(i) ? dMj : Mj) + mr * kLd16BV + mc, x);
        }
      }
      if (!carrier) return;
#pragma unroll
      for (int i = 0; i < kUnitsT; ++i) {
        const uint4 sv = WIDE ? s_stage[i * kBwdThreads + tid] : s_in[WIDE ? 0 : i];
        const uint4 dsv = WIDE ? ds_stage[i * kBwdThreads + tid] : ds_in[WIDE ? 0 : i];
        const unsigned a[4] = {sv.x, sv.y, sv.z, sv.w}, b[4] = {dsv.x, dsv.y, dsv.z, dsv.w};
        const float ssc = WIDE ? sc_stage[(2 * i) * kBwdThreads + tid] : s_sc[WIDE ? 0 : i];
        const float dssc = WIDE ? sc_stage[(2 * i + 1) * kBwdThreads + tid] : ds_sc[WIDE ? 0 : i];
        Pack<T, 8> sa, sb;
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const float2 x = half2_to_float2(a[j]), y = half2_to_float2(b[j]);
          const float x0 = ssc * x.x, x1 = ssc * x.y, y0 = dssc * y.x, y1 = dssc * y.y;
          s_dot = fmaf(x0, y0, fmaf(x1, y1, s_dot));
          sa.v[2 * j] = T(x0), sa.v[2 * j + 1] = T(x1), sb.v[2 * j] = T(y0), sb.v[2 * j + 1] = T(y1);
        }
        store_pack<8>(Sj + (ur + i * kRound) * kLd16BV + uc, sa);
        store_pack<8>(dSj + (ur + i * kRound) * kLd16BV + uc, sb);
      }
    };
    fetch(0);  // in flight through the prologue
    if constexpr (!LOOP) {
      chunk_gates(g, beta, row_h, Gs, bs);
      cp_async_wait<0>();  // the tiles
      __syncthreads();
    }
    if (tid < kC) {
      eG[tid] = expf(Gs[tid]);
      kd[tid] = expf(Gs[kC - 1] - Gs[tid]);
    }
    // Lg (warps 0..7) and A (warps 8..15); then, unless T came with the tiles (TK), L = diag(beta) Lg into Ts
    // and its inverse there.
    if (warp < 8) masked_gram<DK>(Ks, Ks, Gs, nullptr, /*inclusive=*/false, Lg, warp);
    else masked_gram<DK>(Qs, Ks, Gs, nullptr, /*inclusive=*/true, As, warp - 8);
    if constexpr (TK) {  // T is in place: the first step's slices
      put();
      if constexpr (LOOP) cp_async_wait<0>();  // V, dO and T
      __syncthreads();
      if constexpr (LOOP) {  // the next chunk's Q, K and gates land during this one's steps
        load_next_qk();
        cp_async_commit();
      }
    } else {
      __syncthreads();
      for (int i = tid; i < kC * kC / 4; i += kBwdThreads) {  // four floats a step
        const int r = i / (kC / 4), c = 4 * (i % (kC / 4));
        const float4 x = *reinterpret_cast<const float4*>(Lg + r * kLdT + c);
        const float b = bs[r];
        *reinterpret_cast<float4*>(Ts + r * kLdT + c) = make_float4(b * x.x, b * x.y, b * x.z, b * x.w);
      }
      __syncthreads();
      invert_unit_lower<kBwdThreads, /*ZERO_UPPER=*/true>(Ts, [] {});  // dVb's product reads T's whole columns
      // T and scale A as 16-bit operands (the output's scale rides on A in dM = diag(kd) K dS + A^T scale dO),
      // and the first step's slices.
      for (int i = tid; i < kC * kC / 4; i += kBwdThreads) {  // four floats a step
        const int r = i / (kC / 4), c = 4 * (i % (kC / 4));
        const float4 t = *reinterpret_cast<const float4*>(Ts + r * kLdT + c);
        store2(T16 + r * kLd16C + c, t.x, t.y);
        store2(T16 + r * kLd16C + c + 2, t.z, t.w);
        if constexpr (!HIST) {
          const float4 a = *reinterpret_cast<const float4*>(As + r * kLdT + c);
          store2(A16 + r * kLd16C + c, scale * a.x, scale * a.y);
          store2(A16 + r * kLd16C + c + 2, scale * a.z, scale * a.w);
        }
      }
      put();
      __syncthreads();
    }

    const int m = (warp % 4) * 16;           // every warp's 16 rows
    const int ns = ((warp / 4) % 2) * 16;    // its 16 columns of a step's [C][kBV] products (not WIDE)
    const int nk = (warp / 4) * (DK / 4);    // its DK / 4 columns of the [C][DK] sums
    const int nc = (warp / 4) * 16;          // its 16 columns of the [C][C] sums
    // dqdecay and dA without the output's scale (applied after the steps); ndKb, dkdecay, dT.
    float acc_dq[NTK][4] = {}, acc_kb[NTK][4] = {}, acc_dk[NTK][4] = {};
    float acc_dA[2][4] = {}, acc_dT[2][4] = {};
    // The warp's 16 x 16 tile of dVb = T^T dM at columns n0 of the step at c0, with dV = diag(beta) dVb and
    // sum_c dVb V into partial vector `part` of db_sum (the warp's column block among those of its rows).
    auto form_dvb = [&](int c0, int n0, int part) {
      // Over T's whole columns, not from row m on (T is zero above its diagonal, in every form: the
      // forward's T16 and the inverse here with its upper block zeroed): a loop of known length, unrolled,
      // so that every fragment load is issued ahead of the chain of products.
      float dvb[2][4] = {};
      product16<true, true, 2>(dvb, m, n0, 0, kC, T16, kLd16C, dMj, kLd16BV);
      store16(dvb, m, n0, dVbj, kLd16BV);
      row_dots(dvb, m, n0, Vs + c0, LDV, db_sum + part * kC);
      for_each(dvb, m, n0, [&](int r, int, float& x) { x *= bs[r]; });
      store_rows<DV, kWideRows>(dvb, m, c0 + n0, row_h, dv);
    };
    for (int c0 = 0; c0 < DV; c0 += kBV) {
      const bool more = c0 + kBV < DV;
      if (more) fetch(c0 + kBV);  // the next step's slices land during this one
      // This step's columns of X = diag(beta) (V - diag(e^G) K S) (warps 0..7) and of
      // dM = diag(kd) K dS + A^T scale dO (warps 8..15); then of M = T X (0..7) and dVb = T^T dM (8..15),
      // with dV = diag(beta) dVb and sum_c dVb V into db_sum. Each warp takes 16 rows and 16 columns.
      // HIST: M and dM are in place already; dVb only (WIDE: by every warp, 64 columns a step).
      if constexpr (HIST) {
      } else if (warp < 8) {
        float ks[2][4] = {};
        product16<false, true, 2>(ks, m, ns, 0, DK, Ks, LDK, Sj, kLd16BV);
        store16(ks, m, ns, Xj, kLd16BV, [&](int r, int c, float x) {
          return bs[r] * (static_cast<float>(Vs[r * LDV + c0 + c]) - eG[r] * x);
        });
      } else {
        float dm[2][4] = {};
        product16<false, true, 2>(dm, m, ns, 0, DK, Ks, LDK, dSj, kLd16BV);
        for_each(dm, m, ns, [&](int r, int, float& x) { x *= kd[r]; });
        product16<true, true, 2>(dm, m, ns, m, kC, A16, kLd16C, dOs + c0, LDV);
        store16(dm, m, ns, dMj, kLd16BV);
      }
      if constexpr (!HIST) __syncthreads();
      if constexpr (WIDE) {  // every warp a tile of dVb: its row block's columns 16 (warp / 4)
        form_dvb(c0, (warp / 4) * 16, warp / 4);
      } else if (warp < 8) {
        if constexpr (!HIST) {
          float mm[2][4] = {};
          product16<false, true, 2>(mm, m, ns, 0, m + 16, T16, kLd16C, Xj, kLd16BV);
          store16(mm, m, ns, Mj, kLd16BV);
        }
      } else {
        form_dvb(c0, ns, warp / 4);
      }
      __syncthreads();
      // The sums over this step's columns.
      // dqdecay += dO S^T, ndKb += dVb S^T, dkdecay += M dS^T, dA += dO M^T, dT += dM X^T (HIST: dVb M^T).
      product16<false, false, NTK>(acc_dq, m, nk, 0, kBV, dOs + c0, LDV, Sj, kLd16BV);
      product16<false, false, NTK>(acc_kb, m, nk, 0, kBV, dVbj, kLd16BV, Sj, kLd16BV);
      product16<false, false, NTK>(acc_dk, m, nk, 0, kBV, Mj, kLd16BV, dSj, kLd16BV);
      product16<false, false, 2>(acc_dA, m, nc, 0, kBV, dOs + c0, LDV, Mj, kLd16BV);
      if constexpr (HIST) product16<false, false, 2>(acc_dT, m, nc, 0, kBV, dVbj, kLd16BV, Mj, kLd16BV);  // T^T dT T^T
      else product16<false, false, 2>(acc_dT, m, nc, 0, kBV, dMj, kLd16BV, Xj, kLd16BV);
      if constexpr (WIDE) cp_async_wait<0>();  // the next step's copies (see fetch)
      __syncthreads();  // before the next step's slices (or the matrices after the steps) overwrite these
      if (more) {
        put();
        __syncthreads();
      }
    }

    // <S, dS>; the output's scale on dqdecay and dA; the row dot products of the [C][DK] sums.
    s_dot += __shfl_xor_sync(0xffffffffu, s_dot, 16);
    s_dot += __shfl_xor_sync(0xffffffffu, s_dot, 8);
    s_dot += __shfl_xor_sync(0xffffffffu, s_dot, 4);
    s_dot += __shfl_xor_sync(0xffffffffu, s_dot, 2);
    s_dot += __shfl_xor_sync(0xffffffffu, s_dot, 1);
    if (tid % 32 == 0) sdot[warp] = s_dot;
    for_each(acc_dq, m, nk, [&](int, int, float& x) { x *= scale; });
    const int rp = (warp / 4) * kC, cp = (warp % 4) * kC;  // the warp's partial vectors of row and column sums
    row_dots(acc_dq, m, nk, Qs, LDK, qq_sum + rp);
    row_dots(acc_kb, m, nk, Ks, LDK, kb_sum + rp);
    row_dots(acc_dk, m, nk, Ks, LDK, kk_sum + rp);
    {  // d(Q K^T) = scale dA * e^{G_t - G_i} (i <= t); scale dA * A's row and column sums; dT
      float lo = 0.f, hi = 0.f;
      float col[2][2] = {};
      for_each_pair(acc_dA, m, nc, [&](int r, int c, int j, int h, float& x0, float& x1) {
        const float2 a = *reinterpret_cast<const float2*>(As + r * kLdT + c);
        const float2 gc = *reinterpret_cast<const float2*>(Gs + c);
        const float gr = Gs[r];
        const bool keep0 = c <= r, keep1 = c + 1 <= r;
        const float d0 = scale * x0, d1 = scale * x1;
        const float xa0 = keep0 ? d0 * a.x : 0.f, xa1 = keep1 ? d1 * a.y : 0.f;
        (h == 0 ? lo : hi) += xa0 + xa1;
        col[j][0] += xa0;
        col[j][1] += xa1;
        x0 = keep0 ? d0 * exp_ftz(gr - gc.x) : 0.f;
        x1 = keep1 ? d1 * exp_ftz(gr - gc.y) : 0.f;
      });
      add_row_sums(lo, hi, m, x_row + rp);
      add_col_sums(col, nc, x_col + cp);
      store16(acc_dA, m, nc, dQK, kLd16C);
      if constexpr (!HIST) store16(acc_dT, m, nc, dTs, kLd16C);
    }
    if constexpr (!HIST) {
      __syncthreads();
      {  // Ys = T^T dT
        float y[2][4] = {};
        product16<true, true, 2>(y, m, nc, m, kC, T16, kLd16C, dTs, kLd16C);
        store16(y, m, nc, Ys, kLd16C);
      }
      __syncthreads();
    }
    {  // dL = -(Ys T^T) (HIST: -(dVb M^T), summed over the steps), strictly lower; its sums;
       // d(K K^T) = diag(beta) dL * e^{G_t - G_i}
      float y[2][4] = {};
      if constexpr (HIST) {
#pragma unroll
        for (int j = 0; j < 2; ++j)
#pragma unroll
          for (int e = 0; e < 4; ++e) y[j][e] = acc_dT[j][e];
      } else {
        if (nc < m + 16) product16<false, false, 2>(y, m, nc, 0, nc + 16, Ys, kLd16C, T16, kLd16C);
      }
      float dlo = 0.f, dhi = 0.f, lo = 0.f, hi = 0.f;
      float col[2][2] = {};
      for_each_pair(y, m, nc, [&](int r, int c, int j, int h, float& x0, float& x1) {
        const float2 lg = *reinterpret_cast<const float2*>(Lg + r * kLdT + c);
        const float2 gc = *reinterpret_cast<const float2*>(Gs + c);
        const float gr = Gs[r], b = bs[r];
        const bool keep0 = c < r, keep1 = c + 1 < r;
        const float dl0 = keep0 ? -x0 : 0.f, dl1 = keep1 ? -x1 : 0.f;
        const float dll = dl0 * lg.x + dl1 * lg.y, xl0 = b * dl0 * lg.x, xl1 = b * dl1 * lg.y;
        (h == 0 ? dlo : dhi) += dll;
        (h == 0 ? lo : hi) += xl0 + xl1;
        col[j][0] += xl0;
        col[j][1] += xl1;
        x0 = keep0 ? b * dl0 * exp_ftz(gr - gc.x) : 0.f;
        x1 = keep1 ? b * dl1 * exp_ftz(gr - gc.y) : 0.f;
      });
      add_row_sums(dlo, dhi, m, db_sum + rp);
      add_row_sums(lo, hi, m, x_row + rp);
      add_col_sums(col, nc, x_col + cp);
      store16(y, m, nc, dKK, kLd16C);
    }
    __syncthreads();
    // dQ = diag(e^G) dqdecay + d(Q K^T) K
    for_each(acc_dq, m, nk, [&](int r, int, float& x) { x *= eG[r]; });
    product16<false, true, NTK>(acc_dq, m, nk, 0, m + 16, dQK, kLd16C, Ks, LDK);
    store_rows<DK, kWideRows>(acc_dq, m, nk, row_h, dq);
    // dK = -diag(beta e^G) ndKb + diag(kd) dkdecay + d(Q K^T)^T Q + (d(K K^T) + d(K K^T)^T) K
    {
      const int lane = tid % 32;
#pragma unroll
      for (int j = 0; j < NTK; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int r = m + lane / 4 + (e >= 2 ? 8 : 0);
          acc_kb[j][e] = kd[r] * acc_dk[j][e] - bs[r] * eG[r] * acc_kb[j][e];
        }
    }
    if constexpr (LOOP) {  // V, dO and T are read (the steps): the next chunk's land during dK and the sums
      load_next_vdt();
      cp_async_commit();
    }
    product16<true, true, NTK>(acc_kb, m, nk, m, kC, dQK, kLd16C, Qs, LDK);
    product16<false, true, NTK>(acc_kb, m, nk, 0, m + 16, dKK, kLd16C, Ks, LDK);
    product16<true, true, NTK>(acc_kb, m, nk, m, kC, dKK, kLd16C, Ks, LDK);
    store_rows<DK, kWideRows>(acc_kb, m, nk, row_h, dk);
    __syncthreads();  // every sum is in
    if (tid < kC) {  // dbeta, and dG with its reverse cumulative sum dg (warps 0 and 1, one row a thread)
      const int r = tid;
      const float kb_dot = -sum4(kb_sum, r);  // <dKb_t, k_t>
      const float kd_dot = kd[r] * sum4(kk_sum, r);
      float dG = eG[r] * sum4(qq_sum, r) + bs[r] * eG[r] * kb_dot + sum4(x_row, r) - sum4(x_col, r) - kd_dot;
      float kd_total = kd_dot;
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) kd_total += __shfl_xor_sync(0xffffffffu, kd_total, o);
      if (r % 32 == 0) sdot[kBwdWarps + r / 32] = kd_total;
      if (row_h[r] >= 0) dbeta.put(row_h[r], sum4(db_sum, r) + eG[r] * kb_dot);
      Gs[r] = dG;  // (G itself is no longer read)
    }
    __syncthreads();
    if (tid < 32) {  // through G_C: sum_i kd_i <dkdecay_i, k_i> + e^{G_C} <S, dS>; then the suffix sums
      const int l = tid;
      if (l == 31) {
        float s_dS = 0.f;
#pragma unroll
        for (int w = 0; w < kBwdWarps; ++w) s_dS += sdot[w];
        Gs[kC - 1] += (sdot[kBwdWarps] + sdot[kBwdWarps + 1]) + eG[kC - 1] * s_dS;
      }
      __syncwarp();
      const float a = Gs[2 * l], b = Gs[2 * l + 1];
      float s = a + b;
#pragma unroll
      for (int o = 1; o < 32; o <<= 1) {
        const float y = __shfl_down_sync(0xffffffffu, s, o);
        if (l + o < 32) s += y;
      }
      if (row_h[2 * l] >= 0) dg.put(row_h[2 * l], s);
      if (row_h[2 * l + 1] >= 0) dg.put(row_h[2 * l + 1], s - a);
    }
    if constexpr (!LOOP) break;
    if (turns.next_h() < 0) break;
  }
}

}  // namespace

at::Tensor chunk_state_direct(const at::Tensor& q, const at::Tensor& k, const at::Tensor& g, const at::Tensor& W,
                              const at::Tensor& dO, const ChunkGrid& grid, double scale) {
  if (q.dim() != 4 || dO.dim() != 4)
    throw std::invalid_argument("hh::kernels::chunk_state_direct: q and dO must be [B, T, H, D]");
  const int64_t B = q.size(0), T = q.size(1), H = q.size(2), Dk = q.size(3), Dv = dO.size(3), N = grid.N;
  need(q, "chunk_state_direct", "q", q.sizes(), true);
  need(k, "chunk_state_direct", "k", q.sizes(), true);
  need(g, "chunk_state_direct", "g", {B, T, H}, false);
  need(dO, "chunk_state_direct", "dO", {B, T, H, Dv}, true);
  need(W, "chunk_state_direct", "W", {H, N, kC, Dk}, true);
  if (k.scalar_type() != q.scalar_type() || dO.scalar_type() != q.scalar_type() || W.scalar_type() != at::kHalf ||
      !chunk_forward_supported(Dk, Dv, q.scalar_type()))
    throw std::invalid_argument(
        "hh::kernels::chunk_state_direct: q, k and dO of one 16-bit dtype, W float16, Dk and Dv in {64, 128} only");
  const SlotRows slots = slot_rows(grid, B, T);
  const c10::cuda::CUDAGuard guard(q.device());
  at::Tensor Z = at::empty({H, N, Dk, Dv}, q.options().dtype(at::kFloat));
  if (N == 0 || H == 0) return Z;
  dispatch(Dk, Dv, q.scalar_type(), [&](auto dk, auto dv, auto x) {
    using X = decltype(x);
    constexpr int DK = decltype(dk)::value, DV = decltype(dv)::value;
    launch_kernel(chunk_state_direct_kernel<DK, DV, X>, dim3(static_cast<unsigned>(N), static_cast<unsigned>(H)), kDirectThreads, direct_smem<DK, DV, X>(),
                  static_cast<const X*>(q.data_ptr()), static_cast<const X*>(k.data_ptr()), g.data_ptr<float>(),
                  reinterpret_cast<const __half*>(W.data_ptr<c10::Half>()), static_cast<const X*>(dO.data_ptr()), slots,
                  static_cast<int>(H), N, static_cast<float>(scale), Z.data_ptr<float>());
  });
  return Z;
}

GridF16 grad_to_grid_f16(const at::Tensor& dO, const ChunkGrid& grid) {
  if (dO.dim() != 4) throw std::invalid_argument("hh::kernels::grad_to_grid_f16: dO must be [B, T, H, Dv]");
  const int64_t B = dO.size(0), T = dO.size(1), H = dO.size(2), Dv = dO.size(3), N = grid.N;
  need(dO, "grad_to_grid_f16", "dO", dO.sizes(), true);
  if (Dv != 64 && Dv != 128)
    throw std::invalid_argument("hh::kernels::grad_to_grid_f16: Dv must be 64 or 128, got " + std::to_string(Dv));
  const SlotRows slots = slot_rows(grid, B, T);
  const c10::cuda::CUDAGuard guard(dO.device());
  GridF16 r{at::empty({H, N, kC, Dv}, dO.options().dtype(at::kHalf)), at::empty({H, N}, dO.options().dtype(at::kFloat))};
  if (N == 0 || H == 0) return r;
  dispatch(Dv, Dv, dO.scalar_type(), [&](auto, auto dv, auto x) {
    using X = decltype(x);
    constexpr int DV = decltype(dv)::value;
    launch_kernel(grad_to_grid_f16_kernel<DV, X>, dim3(static_cast<unsigned>(N), static_cast<unsigned>(H)), kGridF16Threads, 0,
                  static_cast<const X*>(dO.data_ptr()), slots, static_cast<int>(H), N,
                  reinterpret_cast<__half*>(r.x16.data_ptr<c10::Half>()), r.inv.data_ptr<float>());
  });
  return r;
}

ChunkInputGrads chunk_backward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
                               const at::Tensor& beta, const at::Tensor& S16, const at::Tensor& S_inv,
                               const at::Tensor& dS16, const at::Tensor& dS_inv, const at::Tensor& dO,
                               const ChunkGrid& grid, double scale, const at::Tensor& M16, const at::Tensor& M_inv,
                               const at::Tensor& dM16, const at::Tensor& dM_inv, const at::Tensor& T16) {
  if (q.dim() != 4 || v.dim() != 4) throw std::invalid_argument("hh::kernels::chunk_backward: q and v must be [B, T, H, D]");
  const int64_t B = q.size(0), T = q.size(1), H = q.size(2), Dk = q.size(3), Dv = v.size(3), N = grid.N;
  need(q, "chunk_backward", "q", q.sizes(), true);
  need(k, "chunk_backward", "k", q.sizes(), true);
  need(v, "chunk_backward", "v", {B, T, H, Dv}, true);
  need(dO, "chunk_backward", "dO", {B, T, H, Dv}, true);
  need_gate(g, "chunk_backward", "g", {B, T, H}, q.scalar_type());
  need_gate(beta, "chunk_backward", "beta", {B, T, H}, q.scalar_type());
  need(S16, "chunk_backward", "S16", {H, N, Dk, Dv}, true);
  need(dS16, "chunk_backward", "dS16", {H, N, Dk, Dv}, true);
  need(S_inv, "chunk_backward", "S_inv", {H, N, Dk / 16, Dv / 16}, false);
  need(dS_inv, "chunk_backward", "dS_inv", {H, N, Dk / 16, Dv / 16}, false);
  if (S16.scalar_type() != at::kHalf || dS16.scalar_type() != at::kHalf)
    throw std::invalid_argument("hh::kernels::chunk_backward: S16 and dS16 must be float16 (block float16 states)");
  const int given = M16.defined() + M_inv.defined() + dM16.defined() + dM_inv.defined();
  if (given != 0 && given != 4)
    throw std::invalid_argument("hh::kernels::chunk_backward: give M16, M_inv, dM16 and dM_inv together, or none");
  const bool hist = given == 4;
  if (hist) {
    need(M16, "chunk_backward", "M16", {H, N, kC, Dv}, true);
    need(dM16, "chunk_backward", "dM16", {H, N, kC, Dv}, true);
    need(M_inv, "chunk_backward", "M_inv", {H, N, kC / 16, Dv / 8}, false);
    need(dM_inv, "chunk_backward", "dM_inv", {H, N, kC / 16, Dv / 8}, false);
    if (M16.scalar_type() != at::kHalf || dM16.scalar_type() != at::kHalf)
      throw std::invalid_argument("hh::kernels::chunk_backward: M16 and dM16 must be float16 (block float16 new values)");
  }
  const bool tk = T16.defined();
  if (tk) {
    if (!hist) throw std::invalid_argument("hh::kernels::chunk_backward: T16 comes with M16, M_inv, dM16 and dM_inv");
    need(T16, "chunk_backward", "T16", {H, N, kPackedLower}, true);
    if (T16.scalar_type() != q.scalar_type()) throw std::invalid_argument("hh::kernels::chunk_backward: T16 must have q's dtype");
  }
  if (k.scalar_type() != q.scalar_type() || v.scalar_type() != q.scalar_type() || dO.scalar_type() != q.scalar_type() ||
      !chunk_forward_supported(Dk, Dv, q.scalar_type()))
    throw std::invalid_argument("hh::kernels::chunk_backward: q, k, v and dO of one 16-bit dtype, Dk and Dv in {64, 128} only");
  const SlotRows slots = slot_rows(grid, B, T);
  const c10::cuda::CUDAGuard guard(q.device());
  // dg and dbeta in g's and beta's dtypes (float32 or q's)
  ChunkInputGrads r{at::empty(q.sizes(), q.options()), at::empty(q.sizes(), q.options()), at::empty(v.sizes(), v.options()),
                    at::empty({B, T, H}, g.options()), at::empty({B, T, H}, beta.options())};
  if (N == 0 || H == 0) return r;
  dispatch(Dk, Dv, q.scalar_type(), [&](auto dk, auto dv, auto x) {
    using X = decltype(x);
    constexpr int DK = decltype(dk)::value, DV = decltype(dv)::value;
    auto in = [](const at::Tensor& t) { return static_cast<const X*>(t.data_ptr()); };
    auto out = [](const at::Tensor& t) { return static_cast<X*>(t.data_ptr()); };
    const BlockF16 mh = hist ? block_f16(M16, M_inv) : BlockF16{}, dmh = hist ? block_f16(dM16, dM_inv) : BlockF16{};
    g_backward_launches[tk ? 2 : hist ? 1 : 0].fetch_add(1, std::memory_order_relaxed);
    auto run = [&](auto kernel, dim3 blocks, size_t smem) {
      launch_kernel(kernel, blocks, kBwdThreads, smem, in(q), in(k), in(v), gate_in<X>(g), gate_in<X>(beta),
                    block_f16(S16, S_inv), block_f16(dS16, dS_inv), mh, dmh, in(dO), slots, static_cast<int>(H), N,
                    static_cast<float>(scale), out(r.dq), out(r.dk), out(r.dv), gate_out<X>(r.dg),
                    gate_out<X>(r.dbeta), tk ? in(T16) : nullptr);
    };
    const dim3 each(static_cast<unsigned>(N), static_cast<unsigned>(H));
    if constexpr (DK == 128 && DV == 128) {
      if (tk && g_backward_chunks_in_turn) {
        const int64_t sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
        g_in_turn_launches.fetch_add(1, std::memory_order_relaxed);
        run(chunk_backward_kernel<DK, DV, X, true, true, true>, dim3(static_cast<unsigned>(std::min(N * H, sms))),
            backward_smem<DK, DV, X, true, true>());
        return;
      }
    }
    if (tk) run(chunk_backward_kernel<DK, DV, X, true, true>, each, backward_smem<DK, DV, X, true>());
    else if (hist) run(chunk_backward_kernel<DK, DV, X, true>, each, backward_smem<DK, DV, X>());
    else run(chunk_backward_kernel<DK, DV, X, false>, each, backward_smem<DK, DV, X>());
  });
  return r;
}

void set_backward_chunks_in_turn(bool on) { g_backward_chunks_in_turn = on; }
bool backward_chunks_in_turn_enabled() { return g_backward_chunks_in_turn; }
int64_t backward_chunks_in_turn_launches() { return g_in_turn_launches.load(std::memory_order_relaxed); }

std::array<int64_t, 3> chunk_backward_launches() {
  std::array<int64_t, 3> r{};
  for (size_t i = 0; i < r.size(); ++i) r[i] = g_backward_launches[i].load(std::memory_order_relaxed);
  return r;
}

}  // namespace hh::kernels
