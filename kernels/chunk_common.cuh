#pragma once
// Pieces the chunk kernels of the gated delta rule share (kernels/gdn_chunk.cu, the forward;
// kernels/gdn_chunk_backward.cu, the backward): the chunk grid's slots, tiles of 16-bit rows in shared
// memory, paired stores and a block's maximum, the chunk's gates, a warp's 16-bit product on ldmatrix
// fragments (product16), the decay-masked Gram products, the unit lower inverse, and the host's
// argument checks, dtype dispatch and tensor maps' encoder. Everything is in an unnamed namespace: each
// kernel file has its own copy.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <cuda.h>
#include <cudaTypedefs.h>

#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <stdexcept>
#include <string>
#include <type_traits>

#include "kernels/device_ops.cuh"
#include "kernels/gdn.h"
#include "kernels/launch_cache.h"

namespace hh::kernels {
namespace {

using namespace device;  // the cp.async and mma.sync helpers

constexpr int kC = 64;                // chunk length
// Row stride of a float [C][C] matrix: 8 mod 32 words, so that a half-warp's float pairs of four rows
// (lower_times' A operand) and a warp's column reads of four rows (the inverse's B operand) fall in
// distinct banks.
constexpr int kLdT = kC + 8;

// Row stride of a 16-bit [C][D] tile in shared memory: D + 8 elements keeps both the A-operand
// (row g, column t) and the B-operand (row t, column g) fragment reads free of bank conflicts, and
// every row 16-byte aligned for cp.async.
template <int D>
constexpr int ld16() {
  return D + 8;
}

// The input row of slot r of one chunk, or -1 for padding: SlotRows::chunk's answer, so that a kernel
// placing several rows of the chunk divides out a regular grid's sequence once, not once a row.
struct ChunkRows {
  const int64_t* gather;  // the chunk's kC slot rows (>= rows: padding), or null for a regular grid:
  int64_t first, rows;    // its first slot's row; for gather, the rows there are
  int valid;              // regular grid: slots 0 .. valid - 1 are rows first .. first + valid - 1
  __device__ __forceinline__ int64_t operator()(int r) const {
    if (gather != nullptr) {
      const int64_t x = gather[r];
      return x < rows ? x : -1;
    }
    return r < valid ? first + r : -1;
  }
};

// The input row of slot r of chunk n, or -1 for padding.
struct SlotRows {
  const int64_t* gather;  // [N * C] input row of each slot (rows = padding), or null for B regular sequences:
  int64_t per, T, rows;   // per chunks of T tokens each; rows = B * T
  __device__ __forceinline__ int64_t operator()(int64_t n, int r) const { return chunk(n)(r); }
  // The same as a row of [rows * H, D] for head h (row * H + h; -1 for padding): the chunk kernels' table
  // for load_rows, chunk_gates and their stores.
  __device__ __forceinline__ int64_t row_h(int64_t n, int r, int h, int H) const {
    const int64_t x = (*this)(n, r);
    return x >= 0 ? x * H + h : -1;
  }
  // Chunk n's slots. A regular grid divides once, in 32 bits where n and per fit (a 64-bit division is
  // a long sequence of instructions; a 32-bit one a few).
  __device__ __forceinline__ ChunkRows chunk(int64_t n) const {
    if (gather != nullptr) return {gather + n * kC, 0, rows, 0};
    int64_t b, t0;
    if (n <= INT32_MAX && per <= INT32_MAX) {
      const int nn = static_cast<int>(n), pp = static_cast<int>(per), bb = nn / pp;
      b = bb, t0 = static_cast<int64_t>(nn - bb * pp) * kC;
    } else {
      b = n / per, t0 = (n % per) * kC;
    }
    return {nullptr, b * T + t0, rows, static_cast<int>(t0 < T ? (T - t0 < kC ? T - t0 : kC) : 0)};
  }
};

// c += a b on 16-bit operands of T's kind (m16n8k16, float32 accumulation).
template <class T>
__device__ __forceinline__ void mma16(float (&c)[4], const unsigned (&a)[4], const unsigned (&b)[2]) {
  if constexpr (std::is_same_v<T, c10::BFloat16>) mma_bf16(c, a, b);
  else mma_f16(c, a, b);
}

template <class T>
__device__ __forceinline__ unsigned bits(T x) {  // a 16-bit value as a TF32 operand (exact)
  return __float_as_uint(static_cast<float>(x));
}

// Two floats rounded to 16-bit values of T's kind, a in the low half.
template <class T>
__device__ __forceinline__ uint32_t pack2(float a, float b) {
  static_assert(sizeof(T) == 2, "a 16-bit pair");
  const T pair[2] = {T(a), T(b)};
  uint32_t bits;
  memcpy(&bits, pair, sizeof(bits));
  return bits;
}

// Two consecutive outputs: floats (8-byte aligned), or 16-bit values of T's kind (4-byte aligned).
__device__ __forceinline__ void store2(float* p, float a, float b) { *reinterpret_cast<float2*>(p) = make_float2(a, b); }
template <class T>
__device__ __forceinline__ void store2(T* p, float a, float b) {
  *reinterpret_cast<uint32_t*>(p) = pack2<T>(a, b);
}

// One row's pairs of four 8-column tiles, held by the four lanes of a quad as the m16n8 accumulator
// layout holds them (lane t: columns 2t, 2t + 1 of tile j in p[j]), become each lane's eight columns
// of one tile (lane t: tile t's columns 2j, 2j + 1 in p[j]): a 4 x 4 transpose of 32-bit values by two
// rounds of shuffles, in which each lane trades the values whose lane bit and position bit differ.
// Every lane of the warp must call it.
__device__ __forceinline__ void quad_transpose(uint32_t (&p)[4]) {
  const int t = threadIdx.x % 4;
#pragma unroll
  for (int bit = 1; bit < 4; bit <<= 1) {
    const bool upper = (t & bit) != 0;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      if ((j & bit) != 0) continue;
      const uint32_t got = __shfl_xor_sync(0xffffffffu, upper ? p[j] : p[j | bit], bit);
      if (upper) p[j] = got;
      else p[j | bit] = got;
    }
  }
}

// One row's 16-bit pairs of four 8-column tiles from tile `tile` (lane t: tile j's columns 2t, 2t + 1 in
// p[j]) stored a tile's 16 bytes a lane after quad_transpose. Every lane must call it; with SKIP_NULL a
// null row transposes but stores nothing (a padding row).
template <bool SKIP_NULL, class T>
__device__ __forceinline__ void store_quad16(uint32_t (&p)[4], T* row, int tile) {
  const int t = threadIdx.x % 4;
  quad_transpose(p);
  if (!SKIP_NULL || row != nullptr) store_global16(row + 8 * (tile + t), make_uint4(p[0], p[1], p[2], p[3]));
}

// The warp's NT 8-column tiles (NT a multiple of 4; the accumulator layout, rows g and g + 8) rounded
// to T's kind, stored a row's 16 bytes a lane: dst(half) is row g + 8 half's first column (the tiles'
// first), or null to skip the row. After quad_transpose lane t holds tile 4q + t's eight columns. Where
// each lane stored its 4-byte pair of every tile, each store wrote half of a 32-byte sector (two writes
// of each sector in L2, the backward's and chunk_factors' largest excess). Every lane must call it.
template <class T, int NT, class Dst>
__device__ __forceinline__ void store_tiles16(const float (&acc)[NT][4], Dst dst) {
  static_assert(NT % 4 == 0, "whole quads of tiles");
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    T* const row = dst(half);
#pragma unroll
    for (int q = 0; q < NT / 4; ++q) {
      uint32_t p[4];
#pragma unroll
      for (int j = 0; j < 4; ++j) p[j] = pack2<T>(acc[4 * q + j][2 * half], acc[4 * q + j][2 * half + 1]);
      store_quad16<true>(p, row, 4 * q);
    }
  }
}

// A tile of 32-byte rows (two 16-byte units a row): the offset of unit `part` of row `row` in elements of
// E bytes (1: bytes; 2: 16-bit elements), the units of rows 4..7 of each eight swapped, so that the eight
// rows of one unit that an ldmatrix or stmatrix matrix spans take distinct banks.
template <int E = 1>
__device__ __forceinline__ int row32_unit(int row, int part) {
  return row * (32 / E) + (16 / E) * (part ^ ((row >> 2) & 1));
}

// The largest x over the block into *top (zero before; non-negative floats order as their bits do).
__device__ __forceinline__ void block_max(float x, unsigned* top) {
  const unsigned m = __reduce_max_sync(0xffffffffu, __float_as_uint(x));
  if (threadIdx.x % 32 == 0) atomicMax(top, m);
}

// A chunk's rows of one head of x [rows, H, D] into dst [C][ld16<D>] by cp.async, for a block of THREADS
// threads (a multiple of the D / 8 16-byte units of a row), from the chunk's table of each slot's row of
// [rows * H, D] (SlotRows::row_h; negative: padding, a zero row): each thread copies one column unit of
// every (THREADS / units)-th row at a compile-time stride, with the table's entry its only per-row value.
// (The loader this replaced formed each unit's row, column and 64-bit address from its index: in
// chunk_factors those lines held 12 % of the kernel's instructions.)
template <int D, int THREADS, class T>
__device__ __forceinline__ void load_rows(T* dst, const T* __restrict__ x, const int64_t* row_h) {
  constexpr int V = 16 / sizeof(T), UNITS = D / V, LD = ld16<D>(), STEP = THREADS / UNITS;
  static_assert(THREADS % UNITS == 0 && kC % STEP == 0, "whole rows a pass");
  const int c = (threadIdx.x % UNITS) * V, r0 = threadIdx.x / UNITS;
  T* const d0 = dst + r0 * LD + c;
  const T* const x0 = x + c;
#pragma unroll
  for (int p = 0; p < kC / STEP; ++p) {
    const int64_t at = row_h[r0 + STEP * p];
    T* const d = d0 + STEP * p * LD;
    if (at >= 0) cp_async16(d, x0 + at * D);
    else *reinterpret_cast<uint4*>(d) = make_uint4(0u, 0u, 0u, 0u);
  }
}

// Lane l of warp 0 with the chunk's g and beta at rows 2l and 2l + 1: G = the inclusive cumulative sum
// of g into Gs, and beta into bs (when asked for).
__device__ __forceinline__ void put_gates(int l, float g0, float g1, float b0, float b1, float* Gs, float* bs) {
  float s = g0 + g1;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const float y = __shfl_up_sync(0xffffffffu, s, o);
    if (l >= o) s += y;
  }
  Gs[2 * l] = s - g1;
  Gs[2 * l + 1] = s;
  if (bs != nullptr) {
    bs[2 * l] = b0;
    bs[2 * l + 1] = b1;
  }
}

// A gate vector ([rows, H]: g or beta) in float32 (wide) or in the inputs' 16-bit kind T, as the caller's
// tensor holds it: the chunk kernels convert each value where they read it, the same bits as a conversion
// of the whole tensor before them (the conversion is exact). bits() loads, value() converts: a caller with
// several to read issues every load before the first conversion, so that the loads are in flight together
// (a load and its conversion side by side in each arm of `wide` made ptxas wait for each load in turn).
template <class T>
struct GateIn {
  const void* x;
  bool wide;
  __device__ __forceinline__ unsigned bits(int64_t i) const {
    return wide ? __ldg(static_cast<const unsigned*>(x) + i) : __ldg(static_cast<const unsigned short*>(x) + i);
  }
  __device__ __forceinline__ float value(unsigned b) const {
    return wide ? __uint_as_float(b) : static_cast<float>(T(static_cast<uint16_t>(b), T::from_bits()));
  }
  __device__ __forceinline__ float operator[](int64_t i) const { return value(bits(i)); }
};
// The same two steps for a float32 gate pointer.
__device__ __forceinline__ unsigned gate_bits(const float* g, int64_t i) { return __float_as_uint(__ldg(g + i)); }
__device__ __forceinline__ float gate_value(const float*, unsigned b) { return __uint_as_float(b); }
template <class T>
__device__ __forceinline__ unsigned gate_bits(const GateIn<T>& g, int64_t i) { return g.bits(i); }
template <class T>
__device__ __forceinline__ float gate_value(const GateIn<T>& g, unsigned b) { return g.value(b); }
// A gate's gradient vector ([rows, H]: dg or dbeta), written in its gate's dtype: float32 (wide) or T,
// rounded to nearest even where it is stored, the same bits as a conversion of a float32 result after
// the kernel.
template <class T>
struct GateOut {
  void* x;
  bool wide;
  __device__ __forceinline__ void put(int64_t i, float v) const {
    if (wide) static_cast<float*>(x)[i] = v;
    else static_cast<T*>(x)[i] = static_cast<T>(v);
  }
};

// A lane of warp 0's share of a chunk's gates as loaded and not yet converted (chunk_gates): its two rows'
// g and beta bits, and whether each row is one (not padding). Kept in registers, it lets a kernel issue
// the next chunk's gate loads long before it needs their values (chunk_factors' chunks in turn).
struct GateBits {
  unsigned g0, g1, b0, b1;
  bool in0, in1;
};
// Warp 0's lane: the loads of its rows 2 l and 2 l + 1, from g and beta [rows, H] at the chunk's table of
// row * H + h (SlotRows::row_h; negative: padding). Padding reads row 0 (there is one) and drops it: every
// load unconditional, all four in flight before the first value is used (beta's with g's: after the sum,
// the two waits were in series).
template <class G, class Beta>
__device__ __forceinline__ GateBits chunk_gate_bits(G g, Beta beta, const int64_t* row_h, bool with_beta) {
  const int l = threadIdx.x;  // warp 0's lanes only
  const int64_t r0 = row_h[2 * l], r1 = row_h[2 * l + 1];
  const int64_t i0 = r0 >= 0 ? r0 : 0, i1 = r1 >= 0 ? r1 : 0;
  GateBits b{gate_bits(g, i0), gate_bits(g, i1), 0u, 0u, r0 >= 0, r1 >= 0};
  if constexpr (!std::is_same_v<Beta, std::nullptr_t>)
    if (with_beta) b.b0 = gate_bits(beta, i0), b.b1 = gate_bits(beta, i1);
  return b;
}
// Warp 0: the loaded bits' values, G = their inclusive cumulative sum of g (Gs) and beta (bs, when given).
template <class G, class Beta>
__device__ __forceinline__ void put_gate_bits(G g, Beta beta, const GateBits& b, float* Gs, float* bs) {
  const float g0 = b.in0 ? gate_value(g, b.g0) : 0.f, g1 = b.in1 ? gate_value(g, b.g1) : 0.f;
  float b0 = 0.f, b1 = 0.f;
  if constexpr (!std::is_same_v<Beta, std::nullptr_t>)
    if (bs != nullptr) b0 = b.in0 ? gate_value(beta, b.b0) : 0.f, b1 = b.in1 ? gate_value(beta, b.b1) : 0.f;
  put_gates(threadIdx.x, g0, g1, b0, b1, Gs, bs);  // warp 0's lanes only
}

// Warp 0: G = the chunk's inclusive cumulative sum of g (Gs), and beta (bs, when asked for), from g and beta
// [rows, H] at the chunk's table of row * H + h (SlotRows::row_h; negative: padding, zero). G: a float
// pointer or a GateIn; beta: the same, or nullptr (with bs nullptr).
template <class G, class Beta>
__device__ __forceinline__ void chunk_gates(G g, Beta beta, const int64_t* row_h, float* Gs, float* bs) {
  if (threadIdx.x >= 32) return;
  put_gate_bits(g, beta, chunk_gate_bits(g, beta, row_h, bs != nullptr), Gs, bs);
}

// The end of a chunk kernel's loads: commits the tile copies the block has issued, reads the chunk's
// gates while they land (chunk_gates), then waits for them in every thread.
template <class G, class Beta>
__device__ __forceinline__ void gates_while_tiles_land(G g, Beta beta, const int64_t* row_h, float* Gs, float* bs) {
  cp_async_commit();
  chunk_gates(g, beta, row_h, Gs, bs);
  cp_async_wait<0>();
  __syncthreads();
}

// acc += A B for a warp's 16 rows from m and NT 8-column tiles from n0 (NT even), over k in [k0, k1)
// (multiples of 16), on m16n8k16 products of 16-bit operands of T's kind in shared memory, each
// fragment one ldmatrix (two 8-column tiles of B a load):
//   A(r, k) = a[r * lda + k], or a[k * lda + r] when TA (A stored transposed: ldmatrix.trans);
//   B(k, n) = b[n * ldb + k] (B stored as B^T, one row a column), or b[k * ldb + n] when TB.
// Row strides are multiples of 8 elements (16-byte rows); a stride of 8 mod 64 is free of bank conflicts.
template <bool TA, bool TB, int NT, class T>
__device__ __forceinline__ void product16(float (&acc)[NT][4], int m, int n0, int k0, int k1, const T* a, int lda,
                                          const T* b, int ldb) {
  static_assert(NT % 2 == 0, "two 8-column tiles a B load");
  const int l = threadIdx.x % 32, lo = l % 8, b3 = (l / 8) % 2, b4 = l / 16;
  // Lane l gives the row address of block l / 8, row l % 8: the A blocks are (rows, k) = (0, 0), (8, 0),
  // (0, 8), (8, 8) from (m, k); the B blocks (k, columns) = (0, 0), (8, 0), (0, 8), (8, 8) from (k, n0).
  const T* a_at = TA ? a + (lo + 8 * b4) * lda + m + 8 * b3 : a + (m + lo + 8 * b3) * lda + 8 * b4;
  const T* b_at = TB ? b + (lo + 8 * b3) * ldb + n0 + 8 * b4 : b + (n0 + lo + 8 * b4) * ldb + 8 * b3;
  for (int k = k0; k < k1; k += 16) {
    unsigned af[4];
    if constexpr (TA) ldmatrix_x4_trans(af, a_at + k * lda);
    else ldmatrix_x4(af, a_at + k);
#pragma unroll
    for (int j = 0; j < NT; j += 2) {
      unsigned bf[4];
      if constexpr (TB) ldmatrix_x4_trans(bf, b_at + k * ldb + 8 * j);
      else ldmatrix_x4(bf, b_at + 8 * j * ldb + k);
      const unsigned b0[2] = {bf[0], bf[1]}, b1[2] = {bf[2], bf[3]};
      mma16<T>(acc[j], af, b0);
      mma16<T>(acc[j + 1], af, b1);
    }
  }
}

// X Y^T for rows X, Y of two 16-bit [C][D] tiles, masked by the decay, into the calling warp's registers:
// warp w computes rows m = 16 (w / 2) .. + 15 and columns n0 = 32 (w % 2) .. + 31 of
//   out[t][i] = row_scale[t] e^{G_t - G_i} x_t.y_i   where i < t (i <= t when inclusive), else 0
// in the accumulator layout (acc[j]: rows m + g, m + g + 8 of columns n0 + 8 j + 2 t, + 1; w in 0..7, the
// calling warp's index unless given: eight warps cover the product), and, given diag, diag[t] =
// row_scale[t] x_t.y_t.
template <int D, class T>
__device__ __forceinline__ void masked_gram_tiles(const T* Xs, const T* Ys, const float* Gs, const float* row_scale,
                                                  bool inclusive, float (&acc)[4][4], int warp = threadIdx.x / 32,
                                                  float* diag = nullptr) {
  constexpr int LD = ld16<D>();
  const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const int m = (warp / 2) * 16, n0 = (warp % 2) * 32;
#pragma unroll
  for (int j = 0; j < 4; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.f;
  // 16-bit products (exact, as the TF32 ones of 16-bit values are): Y [n][k] is B stored as B^T.
  if (n0 < m + 16) product16<false, false, 4>(acc, m, n0, 0, D, Xs, LD, Ys, LD);  // else all above the diagonal
  // The decay e^{G_r - G_c} (an exponent <= 0 on and below the diagonal) by ex2.approx of the difference
  // times log2 e: about two float32 ulp, where expf's range reduction took four times the instructions
  // of the rest of the epilogue. Each row's G and scale are read once, the columns' G in pairs.
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int r = m + g + 8 * half;
    const float gr = Gs[r], s = row_scale != nullptr ? row_scale[r] : 1.f;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int c = n0 + 8 * j + 2 * t;
      const float2 gc = *reinterpret_cast<const float2*>(Gs + c);
      const float x0 = acc[j][2 * half], x1 = acc[j][2 * half + 1];
      const bool keep0 = inclusive ? c <= r : c < r, keep1 = inclusive ? c + 1 <= r : c + 1 < r;
      acc[j][2 * half] = keep0 ? s * x0 * exp_ftz(gr - gc.x) : 0.f;
      acc[j][2 * half + 1] = keep1 ? s * x1 * exp_ftz(gr - gc.y) : 0.f;
      if (diag != nullptr && c == r) diag[r] = s * x0;
      if (diag != nullptr && c + 1 == r) diag[r] = s * x1;
    }
  }
}
// The same into out [C][kLdT] (float32), each warp its own tile.
template <int D, class T>
__device__ __forceinline__ void masked_gram(const T* Xs, const T* Ys, const float* Gs, const float* row_scale,
                                            bool inclusive, float* out, int warp = threadIdx.x / 32,
                                            float* diag = nullptr) {
  float acc[4][4];
  masked_gram_tiles<D>(Xs, Ys, Gs, row_scale, inclusive, acc, warp, diag);
  const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const int m = (warp / 2) * 16, n0 = (warp % 2) * 32;
#pragma unroll
  for (int half = 0; half < 2; ++half)
#pragma unroll
    for (int j = 0; j < 4; ++j)
      *reinterpret_cast<float2*>(out + (m + g + 8 * half) * kLdT + n0 + 8 * j + 2 * t) =
          make_float2(acc[j][2 * half], acc[j][2 * half + 1]);
}

// acc += A B for a warp's 16 x 8 tile, over k in [k0, k1) (multiples of 8), on the tensor cores with the
// 3xTF32 split by truncation (split_tf32_truncated: operands within 2^-21 of float32's): A(r, k) =
// a[r * lda + k] from row m, B(k, n) = b[k * ldb + n] from column n0, both float32 in shared memory.
__device__ __forceinline__ void product_3xtf32(float (&acc)[4], int m, int n0, int k0, int k1, const float* a, int lda,
                                               const float* b, int ldb) {
  const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  float cross[4] = {};
  for (int k = k0; k < k1; k += 8) {
    unsigned ah[4], al[4], bh[2], bl[2];
    split_tf32_truncated(a[(m + g) * lda + k + t], ah[0], al[0]);
    split_tf32_truncated(a[(m + g + 8) * lda + k + t], ah[1], al[1]);
    split_tf32_truncated(a[(m + g) * lda + k + t + 4], ah[2], al[2]);
    split_tf32_truncated(a[(m + g + 8) * lda + k + t + 4], ah[3], al[3]);
    split_tf32_truncated(b[(k + t) * ldb + n0 + g], bh[0], bl[0]);
    split_tf32_truncated(b[(k + t + 4) * ldb + n0 + g], bh[1], bl[1]);
    mma_tf32(acc, ah, bh);
    mma_tf32(cross, ah, bl);
    mma_tf32(cross, al, bh);
  }
#pragma unroll
  for (int e = 0; e < 4; ++e) acc[e] += cross[e];
}

// A warp's 16 x 8 tile from row m, column n0 of a float32 matrix (row stride ld), times s, from
// product_3xtf32's accumulator.
__device__ __forceinline__ void store_tile(float* x, int ld, int m, int n0, const float (&acc)[4], float s) {
  const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  *reinterpret_cast<float2*>(x + (m + g) * ld + n0 + 2 * t) = make_float2(s * acc[0], s * acc[1]);
  *reinterpret_cast<float2*>(x + (m + g + 8) * ld + n0 + 2 * t) = make_float2(s * acc[2], s * acc[3]);
}

// Where the 8 values from e (a multiple of 8) of a packed lower matrix (kPackedLower) lie in the whole
// 64 x 64 matrix: x its row, y its column.
__device__ __forceinline__ int2 packed_lower_at(int e) {
  const int b = e < packed_lower_row(1) ? 0 : e < packed_lower_row(2) ? 1 : e < packed_lower_row(3) ? 2 : 3;
  const int width = 16 * (b + 1), off = e - static_cast<int>(packed_lower_row(b));
  return make_int2(16 * b + off / width, off % width);
}
// The 8 values from e of a packed lower matrix as they lie in the whole float32 matrix Ls [C][kLdT], into x;
// returns where they lie (packed_lower_at).
__device__ __forceinline__ int2 packed_lower_floats(const float* Ls, int e, float (&x)[8]) {
  const int2 at = packed_lower_at(e);
  const float4 x0 = *reinterpret_cast<const float4*>(Ls + at.x * kLdT + at.y);
  const float4 x1 = *reinterpret_cast<const float4*>(Ls + at.x * kLdT + at.y + 4);
  x[0] = x0.x, x[1] = x0.y, x[2] = x0.z, x[3] = x0.w, x[4] = x1.x, x[5] = x1.y, x[6] = x1.z, x[7] = x1.w;
  return at;
}

// T = (I + L)^{-1} in place for the strictly lower triangular L in Ls [C][kLdT] (zero on and above the
// diagonal), with THREADS >= 256 threads: first the inverses of the four 16 x 16 diagonal blocks
// (threads 0..63, one column each, right-looking: once row i is final every later row takes its
// update), while the other threads run other(); then, on the tensor cores (3xTF32, float32 accuracy),
// the blocks below them by the block inverse of a lower triangular [[A, 0], [C, D]], whose lower left
// block is -D^{-1} C A^{-1}: the 16 x 16 blocks (1, 0) and (3, 2) from the diagonal ones, then the
// 32 x 32 block rows 32.., columns ..31 from the two 32 x 32 diagonal blocks. The product C A^{-1}
// passes through the upper right 32 x 32 block, which is zero again at the end when ZERO_UPPER (T is
// then unit lower triangular, zero above the diagonal); without it that block is left as it was, for
// callers that never read it.
//
// Four barriers of the block (five with ZERO_UPPER): where a phase reads what other warps wrote. A
// diagonal block is read and written by its own 16 threads (half a warp), and each 16 x 16 block's warp
// reads back only its own columns of C A^{-1}, so those steps wait for their warp or their pair of warps
// alone (warp_pair_sync).
template <int THREADS, bool ZERO_UPPER = true, class Other>
__device__ __forceinline__ void invert_unit_lower(float* Ls, Other&& other) {
  static_assert(THREADS >= 256, "eight warps for the 32 x 32 block");
  const int tid = threadIdx.x, warp = tid / 32;
  if (tid < kC) {  // warps 0 and 1, whole
    const int j = tid % 16;
    float* const Ld = Ls + (tid / 16) * 16 * (kLdT + 1);  // diagonal block tid / 16
    float col[16];
#pragma unroll
    for (int i = 0; i < 16; ++i) col[i] = 0.f;
#pragma unroll
    for (int i = 0; i < 16; ++i) {
      const float ti = i == j ? 1.f : (i > j ? col[i] : 0.f);
      col[i] = ti;
#pragma unroll
      for (int r = i + 1; r < 16; ++r) col[r] = fmaf(-Ld[r * kLdT + i], ti, col[r]);
    }
    __syncwarp();  // the block's other columns are read by this warp alone
#pragma unroll
    for (int r = 0; r < 16; ++r) Ld[r * kLdT + j] = col[r];
  } else {
    other();
  }
  __syncthreads();
  float* const Y = Ls + 32;  // rows 0..31, columns 32..63: the products C A^{-1}
  // Blocks (1, 0) and (3, 2): warp w < 4 forms columns 8 (w % 2) .. + 7 of block (a, a - 1), a = 1 + 2 (w / 2),
  // through rows 16 (w / 2) .. + 15 of Y. Its second product reads only its own columns of Y; it then
  // writes C's columns, which the other warp of its pair reads in its first: a barrier of the pair between.
  const int a = 16 * (1 + 2 * (warp / 2)), y = 16 * (warp / 2), c = 8 * (warp % 2);
  if (warp < 4) {
    float acc[4] = {};  // C A^{-1}; A^{-1} is zero above its diagonal, so k starts at the column
    product_3xtf32(acc, a, a - 16 + c, c, 16, Ls + (a - 16), kLdT, Ls + (a - 16) * kLdT, kLdT);
    store_tile(Y, kLdT, y, c, acc, 1.f);
    warp_pair_sync(warp);
  }
  if (warp < 4) {
    float acc[4] = {};
    product_3xtf32(acc, a, c, 0, 16, Ls + a, kLdT, Y + y * kLdT, kLdT);
    store_tile(Ls + (a - 16), kLdT, a, c, acc, -1.f);
  }
  __syncthreads();
  // Rows 32..63, columns 0..31: warp w < 8 forms rows 32 + 16 (w / 4) .. + 15, columns 8 (w % 4) .. + 7.
  const int r2 = 16 * (warp / 4), n2 = 8 * (warp % 4);
  if (warp < 8) {
    float acc[4] = {};
    product_3xtf32(acc, 32 + r2, n2, n2, 32, Ls, kLdT, Ls, kLdT);  // C A^{-1}: A^{-1} zero above its diagonal
    store_tile(Y, kLdT, r2, n2, acc, 1.f);
  }
  __syncthreads();
  if (warp < 8) {
    float acc[4] = {};
    product_3xtf32(acc, 32 + r2, n2, 0, r2 + 16, Ls + 32, kLdT, Y, kLdT);  // D^{-1} zero right of row r2 + 15
    store_tile(Ls, kLdT, 32 + r2, n2, acc, -1.f);
  }
  __syncthreads();
  if constexpr (ZERO_UPPER) {
    for (int e = tid; e < 32 * 8; e += THREADS)
      *reinterpret_cast<float4*>(Y + (e / 8) * kLdT + 4 * (e % 8)) = make_float4(0.f, 0.f, 0.f, 0.f);
    __syncthreads();
  }
}

// cuTensorMapEncodeTiled, from the driver through the runtime (no link against libcuda).
inline PFN_cuTensorMapEncodeTiled_v12000 tensor_map_encoder() {
  static const PFN_cuTensorMapEncodeTiled_v12000 fn = [] {
    void* f = nullptr;
    cudaDriverEntryPointQueryResult found{};
    C10_CUDA_CHECK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &f, 12000, cudaEnableDefault, &found));
    if (found != cudaDriverEntryPointSuccess || f == nullptr)
      throw std::runtime_error("hh::kernels: the CUDA driver has no cuTensorMapEncodeTiled");
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(f);
  }();
  return fn;
}
// A tiled tensor map of `rank` dimensions over base (dims innermost first, the byte strides of the outer
// rank - 1, the box), one element a step, with L2 promotion of 256 bytes and the copy engine's zero fill
// outside the tensor; a failure throws, naming fn and the tensor.
inline CUtensorMap encode_tensor_map(CUtensorMapDataType type, int rank, void* base, const cuuint64_t* dims,
                                     const cuuint64_t* strides, const cuuint32_t* box, CUtensorMapSwizzle swizzle, const char* fn,
                                     const char* what) {
  const cuuint32_t unit[5] = {1, 1, 1, 1, 1};
  CUtensorMap map{};
  const CUresult r = tensor_map_encoder()(&map, type, static_cast<cuuint32_t>(rank), base, dims, strides, box, unit,
                                          CU_TENSOR_MAP_INTERLEAVE_NONE, swizzle, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                                          CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS)
    throw std::runtime_error(std::string("hh::kernels::") + fn + ": cuTensorMapEncodeTiled failed for " + what + " (CUresult " +
                             std::to_string(static_cast<int>(r)) + ")");
  return map;
}
// x a contiguous CUDA tensor of `sizes`, 16-byte aligned (the checks need and need_gate share); returns
// the name the errors give it.
inline std::string need_layout(const at::Tensor& x, const char* fn, const char* what, at::IntArrayRef sizes) {
  std::string name = std::string("hh::kernels::") + fn + ": " + what;
  if (!x.defined() || !x.is_cuda() || !x.is_contiguous()) throw std::invalid_argument(name + " must be a contiguous CUDA tensor");
  if (x.sizes() != sizes) throw std::invalid_argument(name + " has the wrong shape");
  if (reinterpret_cast<uintptr_t>(x.data_ptr()) % 16 != 0) throw std::invalid_argument(name + " must be 16-byte aligned");
  return name;
}
// A gate vector (g or beta) for a chunk kernel: float32 or `kind` (the inputs' 16-bit dtype).
inline void need_gate(const at::Tensor& x, const char* fn, const char* what, at::IntArrayRef sizes, at::ScalarType kind) {
  const std::string name = need_layout(x, fn, what, sizes);
  if (x.scalar_type() != at::kFloat && x.scalar_type() != kind)
    throw std::invalid_argument(name + " must be float32 or " + c10::toString(kind) + " (the inputs' dtype), not " +
                                c10::toString(x.scalar_type()));
}
template <class T>
GateIn<T> gate_in(const at::Tensor& x) {
  return {x.data_ptr(), x.scalar_type() == at::kFloat};
}
template <class T>
GateOut<T> gate_out(const at::Tensor& x) {
  return {x.data_ptr(), x.scalar_type() == at::kFloat};
}
inline void need(const at::Tensor& x, const char* fn, const char* what, at::IntArrayRef sizes, bool sixteen_bit) {
  const std::string name = need_layout(x, fn, what, sizes);
  if (sixteen_bit ? x.scalar_type() != at::kBFloat16 && x.scalar_type() != at::kHalf : x.scalar_type() != at::kFloat)
    throw std::invalid_argument(name + (sixteen_bit ? " must be bfloat16 or float16" : " must be float32"));
}

// The fusion norm in an output kernel's epilogue (chunk_output_f16_fused, and the scan writing the
// output): where head h's output row r would go, it reads the gate, gamma at gamma + h Dv, and writes y
// as pl places them (elements of the output's 16-bit type).
struct FusedOutputArgs {
  const void* gate = nullptr;
  const void* gamma = nullptr;
  void* y = nullptr;
  float eps = 0.f;
  FusionPlacement pl;
};
// The fusion's tensors checked against the rule's B, T, H heads of Dv and its output dtype
// (kernels::OutputFusion's contract; std::invalid_argument naming `fn`), as FusedOutputArgs.
inline FusedOutputArgs fused_output_args(const char* fn, const OutputFusion& fu, const at::Tensor& y, int64_t B, int64_t T,
                                         int64_t H, int64_t Dv, at::ScalarType dtype) {
  const std::string name = std::string("hh::kernels::") + fn + ": ";
  const at::Tensor& gate = fu.gate;
  if (!y.is_cuda() || y.dim() != 4 || y.size(0) != B || y.size(1) != T || y.size(3) != Dv || !y.is_contiguous())
    throw std::invalid_argument(name + "y must be a contiguous CUDA tensor [B, T, Hy, Dv]");
  if (!gate.defined() || gate.dim() != 3 || gate.device() != y.device() || gate.size(0) != B || gate.size(1) != T ||
      gate.size(2) != H * Dv || gate.stride(2) != 1 || (B > 1 && gate.stride(0) != T * gate.stride(1)) ||
      gate.stride(1) % 8 != 0)
    throw std::invalid_argument(name + "gate must be [B, T, H Dv] with unit stride on its last axis and evenly spaced rows 16 bytes apart");
  if (!fu.gamma.defined() || fu.gamma.device() != y.device() || fu.gamma.sizes() != at::IntArrayRef({H, Dv}) ||
      !fu.gamma.is_contiguous())
    throw std::invalid_argument(name + "gamma must be a contiguous [H, Dv] tensor on y's device");
  if (gate.scalar_type() != dtype || fu.gamma.scalar_type() != dtype || y.scalar_type() != dtype)
    throw std::invalid_argument(name + "gate, gamma and y must have the output's dtype");
  for (const at::Tensor* x : std::initializer_list<const at::Tensor*>{&gate, &fu.gamma, &y})
    if (reinterpret_cast<uintptr_t>(x->data_ptr()) % 16 != 0) throw std::invalid_argument(name + "gate, gamma and y must be 16-byte aligned");
  if (static_cast<int64_t>(fu.heads.size()) != H) throw std::invalid_argument(name + "heads must name one position per head");
  FusedOutputArgs fa;
  fa.gate = gate.data_ptr();
  fa.gamma = fu.gamma.data_ptr();
  fa.y = y.data_ptr();
  fa.eps = static_cast<float>(fu.eps);
  fa.pl.gate_ld = gate.stride(1);
  fa.pl.y_ld = y.size(2) * Dv;
  place_heads(fa.pl, fu.heads, y.size(2), std::string("hh::kernels::") + fn);
  return fa;
}

inline SlotRows slot_rows(const ChunkGrid& grid, int64_t B, int64_t T) {
  if (grid.gather.defined()) {
    if (!grid.gather.is_cuda() || grid.gather.scalar_type() != at::kLong || !grid.gather.is_contiguous() ||
        grid.gather.numel() != grid.N * kC)
      throw std::invalid_argument("hh::kernels: ChunkGrid::gather must be N * 64 int64 CUDA values");
    return {grid.gather.data_ptr<int64_t>(), 0, T, B * T};
  }
  if (grid.N != B * grid.per || grid.per * kC < T || (grid.per > 0 && (grid.per - 1) * kC >= T))
    throw std::invalid_argument("hh::kernels: ChunkGrid: N must be B * per with per = ceil(T / 64)");
  return {nullptr, grid.per, T, B * T};
}

// Allows `kernel` smem bytes of dynamic shared memory on the current device. The attribute is set only
// where smem_allowance has no record of those bytes for that kernel and device, not on every launch.
template <class... Params>
void allow_dynamic_smem(void (*kernel)(Params...), size_t smem) {
  const void* key = reinterpret_cast<const void*>(kernel);
  const int device = at::cuda::current_device();
  if (!smem_allowance().needs(key, device, smem)) return;
  C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
  smem_allowance().given(key, device, smem);
}

// kernel<<<blocks, threads, smem>>>(args...) on the current stream, with its dynamic shared memory allowed.
template <class... Params, class... Args>
void launch_kernel(void (*kernel)(Params...), dim3 blocks, int threads, size_t smem, Args... args) {
  allow_dynamic_smem(kernel, smem);
  kernel<<<blocks, threads, smem, at::cuda::getCurrentCUDAStream()>>>(args...);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// The launch configuration of `blocks` in clusters of `cluster` blocks (the grid a multiple of it in each
// dimension) on the current stream: for cudaLaunchKernelEx and cudaOccupancyMaxActiveClusters. Not
// copyable: cfg points at attr.
struct ClusterLaunch {
  cudaLaunchAttribute attr[1];
  cudaLaunchConfig_t cfg = {};
  ClusterLaunch(dim3 blocks, dim3 cluster, int threads, size_t smem) {
    cfg.gridDim = blocks;
    cfg.blockDim = dim3(static_cast<unsigned>(threads));
    cfg.dynamicSmemBytes = smem;
    cfg.stream = at::cuda::getCurrentCUDAStream();
    attr[0].id = cudaLaunchAttributeClusterDimension;
    attr[0].val.clusterDim.x = cluster.x;
    attr[0].val.clusterDim.y = cluster.y;
    attr[0].val.clusterDim.z = cluster.z;
    cfg.attrs = attr;
    cfg.numAttrs = 1;
  }
  ClusterLaunch(const ClusterLaunch&) = delete;
  ClusterLaunch& operator=(const ClusterLaunch&) = delete;
};

// launch_kernel with the blocks in clusters of `cluster` blocks (ClusterLaunch).
template <class... Params, class... Args>
void launch_cluster_kernel(void (*kernel)(Params...), dim3 blocks, dim3 cluster, int threads, size_t smem,
                           Args... args) {
  allow_dynamic_smem(kernel, smem);
  const ClusterLaunch launch(blocks, cluster, threads, smem);
  C10_CUDA_CHECK(cudaLaunchKernelEx(&launch.cfg, kernel, static_cast<Params>(args)...));
}

// f(Dim<DK>, Dim<DV>, X) for the runtime head sizes and 16-bit dtype (chunk_forward_supported has
// checked them): the caller's generic lambda instantiates its kernel for them.
template <int D>
using Dim = std::integral_constant<int, D>;
template <class F>
void dispatch(int64_t Dk, int64_t Dv, at::ScalarType dt, F&& f) {
  auto dims = [&](auto x) {
    if (Dk == 64 && Dv == 64) f(Dim<64>{}, Dim<64>{}, x);
    else if (Dk == 64) f(Dim<64>{}, Dim<128>{}, x);
    else if (Dv == 64) f(Dim<128>{}, Dim<64>{}, x);
    else f(Dim<128>{}, Dim<128>{}, x);
  };
  if (dt == at::kBFloat16) dims(c10::BFloat16());
  else dims(c10::Half());
}

}  // namespace
}  // namespace hh::kernels
