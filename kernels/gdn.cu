#include "kernels/gdn.h"

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda.h>
#include <cudaTypedefs.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <limits>
#include <map>
#include <mutex>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "kernels/chunk_common.cuh"
#include "kernels/device_ops.cuh"
#include "kernels/device_table.h"
#include "kernels/fused_ops.h"

namespace hh::kernels {
namespace {

using namespace device;  // the cp.async and mma.sync helpers

constexpr int kScanColumns = 16;  // state columns a block owns
constexpr int kShortConvTaps = 4;  // the LA heads' short convolution (kernel::causal_conv_silu)

// Starts the next chunk's copy (when there is one), then waits for the current chunk's copy and for
// every thread: the double-buffered loop of the two scans on a formed transition.
template <class LoadNext>
__device__ __forceinline__ void wait_for_chunk(bool has_next, LoadNext&& load_next) {
  if (has_next) {
    load_next();
    cp_async_wait<1>();
  } else {
    cp_async_wait<0>();
  }
  __syncthreads();  // P_n and the state slice in shared memory are complete
}

// One block per (16 state columns, head, sequence). Thread (rg, cg) owns state rows 4rg..4rg+3 and
// columns 4cg..4cg+3 of the block's slice, in registers; the slice is mirrored in shared memory for
// the product, and P of the next chunk streams into the other half of a double buffer while this
// chunk's product runs.
template <int DK, int BV>
__global__ void __launch_bounds__((DK / 4) * (BV / 4))
    state_scan_kernel(const float* __restrict__ P, const float* __restrict__ Z, const float* __restrict__ y0,
                      float* __restrict__ hist, float* __restrict__ fin, const int64_t* __restrict__ offsets, int H,
                      int64_t N, int Dv, bool reverse) {
  constexpr int RG = DK / 4, NT = (DK / 4) * (BV / 4);
  extern __shared__ float4 smem4[];
  float* smem = reinterpret_cast<float*>(smem4);
  float* const Ps0 = smem;
  float* const Ps1 = smem + DK * DK;
  float* const Ys = smem + 2 * DK * DK;  // [DK][BV]
  const int t = threadIdx.x, rg = t % RG, cg = t / RG;
  const int h = blockIdx.y, s = blockIdx.z;
  const int64_t n0 = offsets[s], n1 = offsets[s + 1], count = n1 - n0;
  const int col = blockIdx.x * BV + cg * 4;  // first of this thread's 4 columns of Dv
  const int64_t state = static_cast<int64_t>(DK) * Dv;

  float y[4][4];
  {
    const float* src = y0 + (static_cast<int64_t>(s) * H + h) * state;
#pragma unroll
    for (int a = 0; a < 4; ++a) {
      const int row = rg * 4 + a;
      const float4 v = *reinterpret_cast<const float4*>(src + static_cast<int64_t>(row) * Dv + col);
      y[a][0] = v.x, y[a][1] = v.y, y[a][2] = v.z, y[a][3] = v.w;
      *reinterpret_cast<float4*>(Ys + row * BV + cg * 4) = v;
    }
  }
  auto chunk = [&](int64_t i) { return reverse ? n1 - 1 - i : n0 + i; };
  auto load_P = [&](int64_t n, float* dst) {
    const float* src = P + (static_cast<int64_t>(h) * N + n) * DK * DK;
    for (int i = t; i < DK * DK / 4; i += NT) cp_async16(dst + 4 * i, src + 4 * i);
    cp_async_commit();
  };
  if (count > 0) load_P(chunk(0), Ps0);
  for (int64_t i = 0; i < count; ++i) {
    const int64_t n = chunk(i);
    wait_for_chunk(i + 1 < count, [&] { load_P(chunk(i + 1), (i & 1) ? Ps0 : Ps1); });
    const int64_t base = (static_cast<int64_t>(h) * N + n) * state;
    float acc[4][4];
#pragma unroll
    for (int a = 0; a < 4; ++a) {
      const int64_t off = base + static_cast<int64_t>(rg * 4 + a) * Dv + col;
      const float4 z = *reinterpret_cast<const float4*>(Z + off);
      acc[a][0] = z.x, acc[a][1] = z.y, acc[a][2] = z.z, acc[a][3] = z.w;
      *reinterpret_cast<float4*>(hist + off) = make_float4(y[a][0], y[a][1], y[a][2], y[a][3]);
    }
    const float* Pn = (i & 1) ? Ps1 : Ps0;
#pragma unroll 8
    for (int j = 0; j < DK; ++j) {
      const float4 p = *reinterpret_cast<const float4*>(Pn + j * DK + rg * 4);  // P[j][rows]
      const float4 v = *reinterpret_cast<const float4*>(Ys + j * BV + cg * 4);  // Y[j][cols]
      const float pa[4] = {p.x, p.y, p.z, p.w}, va[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
      for (int a = 0; a < 4; ++a)
#pragma unroll
        for (int b = 0; b < 4; ++b) acc[a][b] = fmaf(pa[a], va[b], acc[a][b]);
    }
    __syncthreads();  // every thread has read P_n and the old state slice
#pragma unroll
    for (int a = 0; a < 4; ++a) {
#pragma unroll
      for (int b = 0; b < 4; ++b) y[a][b] = acc[a][b];
      *reinterpret_cast<float4*>(Ys + (rg * 4 + a) * BV + cg * 4) = make_float4(y[a][0], y[a][1], y[a][2], y[a][3]);
    }
  }
  float* dst = fin + (static_cast<int64_t>(s) * H + h) * state;
#pragma unroll
  for (int a = 0; a < 4; ++a)
    *reinterpret_cast<float4*>(dst + static_cast<int64_t>(rg * 4 + a) * Dv + col) =
        make_float4(y[a][0], y[a][1], y[a][2], y[a][3]);
}

// ---- the same scan on the tensor cores: mma.sync m16n8k8 TF32 with the 3xTF32 split ----
// Each float32 operand x is split into hi = tf32(x) and lo = tf32(x - hi); a*b is accumulated as
// hi*hi + hi*lo + lo*hi, which keeps float32 accuracy (the dropped lo*lo term is ~2^-22 relative).
// Warp w owns state rows 32w..32w+31 (two 16-row tiles) and the block's 16 columns (two 8-column
// tiles); the accumulators hold Y in the mma C layout from chunk to chunk.
template <int DK>
__global__ void __launch_bounds__(DK)
    state_scan_mma_kernel(const float* __restrict__ P, const float* __restrict__ Z, const float* __restrict__ y0,
                          float* __restrict__ hist, float* __restrict__ fin, const int64_t* __restrict__ offsets, int H,
                          int64_t N, int Dv, bool reverse) {
  constexpr int BV = 16, LDP = DK + 8, LDY = 24, NT = DK;  // padded rows: conflict-free fragment loads
  extern __shared__ float4 smem4[];
  float* smem = reinterpret_cast<float*>(smem4);
  float* const Ps0 = smem;
  float* const Ps1 = smem + DK * LDP;
  float* const Ys = smem + 2 * DK * LDP;  // [DK][LDY]
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, g = lane / 4, t = lane % 4;
  const int h = blockIdx.y, s = blockIdx.z;
  const int64_t n0 = offsets[s], n1 = offsets[s + 1], count = n1 - n0;
  const int col0 = blockIdx.x * BV;
  const int64_t state = static_cast<int64_t>(DK) * Dv;
  // Element (mt, nt, e) of this thread's accumulators sits at row rows(mt, e), column cols(nt, e).
  auto row_of = [&](int mt, int e) { return warp * 32 + mt * 16 + g + (e >= 2 ? 8 : 0); };
  auto col_of = [&](int nt, int e) { return nt * 8 + 2 * t + (e & 1); };

  float y[2][2][4];
  {
    const float* src = y0 + (static_cast<int64_t>(s) * H + h) * state;
#pragma unroll
    for (int mt = 0; mt < 2; ++mt)
#pragma unroll
      for (int nt = 0; nt < 2; ++nt)
#pragma unroll
        for (int e = 0; e < 4; e += 2) {
          const int r = row_of(mt, e), c = col_of(nt, e);
          const float2 v = *reinterpret_cast<const float2*>(src + static_cast<int64_t>(r) * Dv + col0 + c);
          y[mt][nt][e] = v.x, y[mt][nt][e + 1] = v.y;
          Ys[r * LDY + c] = v.x, Ys[r * LDY + c + 1] = v.y;
        }
  }
  auto chunk = [&](int64_t i) { return reverse ? n1 - 1 - i : n0 + i; };
  auto load_P = [&](int64_t n, float* dst) {
    const float* src = P + (static_cast<int64_t>(h) * N + n) * DK * DK;
    for (int i = tid; i < DK * DK / 4; i += NT) {
      const int r = (4 * i) / DK, c = (4 * i) % DK;
      cp_async16(dst + r * LDP + c, src + 4 * i);
    }
    cp_async_commit();
  };
  if (count > 0) load_P(chunk(0), Ps0);
  for (int64_t i = 0; i < count; ++i) {
    const int64_t n = chunk(i);
    wait_for_chunk(i + 1 < count, [&] { load_P(chunk(i + 1), (i & 1) ? Ps0 : Ps1); });
    const int64_t base = (static_cast<int64_t>(h) * N + n) * state + col0;
    float acc[2][2][4];
#pragma unroll
    for (int mt = 0; mt < 2; ++mt)
#pragma unroll
      for (int nt = 0; nt < 2; ++nt)
#pragma unroll
        for (int e = 0; e < 4; e += 2) {
          const int64_t off = base + static_cast<int64_t>(row_of(mt, e)) * Dv + col_of(nt, e);
          const float2 z = *reinterpret_cast<const float2*>(Z + off);
          acc[mt][nt][e] = z.x, acc[mt][nt][e + 1] = z.y;
          *reinterpret_cast<float2*>(hist + off) = make_float2(y[mt][nt][e], y[mt][nt][e + 1]);
        }
    const float* Pn = (i & 1) ? Ps1 : Ps0;
#pragma unroll 4
    for (int k0 = 0; k0 < DK; k0 += 8) {
      unsigned bh[2][2], bl[2][2];
#pragma unroll
      for (int nt = 0; nt < 2; ++nt) {
        split_tf32(Ys[(k0 + t) * LDY + nt * 8 + g], bh[nt][0], bl[nt][0]);
        split_tf32(Ys[(k0 + t + 4) * LDY + nt * 8 + g], bh[nt][1], bl[nt][1]);
      }
#pragma unroll
      for (int mt = 0; mt < 2; ++mt) {
        const int m = warp * 32 + mt * 16;
        unsigned ah[4], al[4];  // A = P^T: A[row][k] = P[k][row]
        split_tf32(Pn[(k0 + t) * LDP + m + g], ah[0], al[0]);
        split_tf32(Pn[(k0 + t) * LDP + m + g + 8], ah[1], al[1]);
        split_tf32(Pn[(k0 + t + 4) * LDP + m + g], ah[2], al[2]);
        split_tf32(Pn[(k0 + t + 4) * LDP + m + g + 8], ah[3], al[3]);
#pragma unroll
        for (int nt = 0; nt < 2; ++nt) {
          const unsigned b_hi[2] = {bh[nt][0], bh[nt][1]}, b_lo[2] = {bl[nt][0], bl[nt][1]};
          mma_tf32(acc[mt][nt], al, b_hi);
          mma_tf32(acc[mt][nt], ah, b_lo);
          mma_tf32(acc[mt][nt], ah, b_hi);
        }
      }
    }
    __syncthreads();  // every warp has read P_n and the old state
#pragma unroll
    for (int mt = 0; mt < 2; ++mt)
#pragma unroll
      for (int nt = 0; nt < 2; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          y[mt][nt][e] = acc[mt][nt][e];
          Ys[row_of(mt, e) * LDY + col_of(nt, e)] = acc[mt][nt][e];
        }
  }
  float* dst = fin + (static_cast<int64_t>(s) * H + h) * state + col0;
#pragma unroll
  for (int mt = 0; mt < 2; ++mt)
#pragma unroll
    for (int nt = 0; nt < 2; ++nt)
#pragma unroll
      for (int e = 0; e < 4; e += 2)
        *reinterpret_cast<float2*>(dst + static_cast<int64_t>(row_of(mt, e)) * Dv + col_of(nt, e)) =
            make_float2(y[mt][nt][e], y[mt][nt][e + 1]);
}

ScanKernel g_scan_kernel = ScanKernel::kLowRank;
int64_t g_scan_segments = kAutoSegments;  // set_scan_segments
thread_local int g_scan_beside = 0;        // ScanBeside objects alive on this thread
int g_scan_columns = 0;                    // set_scan_columns
bool g_output_in_scan = true;              // set_output_in_scan
bool g_scan_warp_columns = true;           // set_scan_warp_columns
bool g_fusion_in_column_scan = false;      // set_fusion_in_column_scan
bool g_scan_wgmma = true;                  // set_scan_wgmma
std::atomic<int64_t> g_column_scan_launches{0};  // column_scan_launches
std::atomic<int64_t> g_dO_in_place_scans{0};     // dO_in_place_scans
bool g_u_in_scan = true;                         // set_u_in_scan
std::atomic<int64_t> g_u_in_scan_launches{0};    // u_in_scan_launches
bool g_qk_in_scan = true;                        // set_qk_in_scan
std::atomic<int64_t> g_qk_in_scan_launches{0};   // qk_in_scan_launches
thread_local int64_t g_last_scan_piece = 0;      // last_scan_piece_chunks
int g_scan_pieces_parity = -1;             // set_scan_pieces_of_parity
bool g_fusion_in_scan = false;             // set_fusion_in_scan
std::atomic<int64_t> g_fused_scan_launches{0};  // fused_scan_launches
bool g_direct_in_scan = true;              // set_direct_in_scan

template <int DK>
void launch_scan(const at::Tensor& P, const at::Tensor& Z, const at::Tensor& y0, at::Tensor& hist, at::Tensor& fin,
                 const at::Tensor& offsets, bool reverse) {
  constexpr int BV = kScanColumns;
  const int H = static_cast<int>(P.size(0)), Dv = static_cast<int>(Z.size(3));
  const int64_t N = P.size(1), S = y0.size(0);
  const bool mma = g_scan_kernel != ScanKernel::kFma;
  const int threads = mma ? DK : (DK / 4) * (BV / 4);
  const size_t smem = mma ? (2 * DK * (DK + 8) + DK * 24) * sizeof(float) : (2 * DK * DK + DK * BV) * sizeof(float);
  auto kernel = mma ? state_scan_mma_kernel<DK> : state_scan_kernel<DK, BV>;
  allow_dynamic_smem(kernel, smem);
  const dim3 grid(static_cast<unsigned>(Dv / BV), static_cast<unsigned>(H), static_cast<unsigned>(S));
  kernel<<<grid, threads, smem, at::cuda::getCurrentCUDAStream()>>>(P.data_ptr<float>(), Z.data_ptr<float>(),
                                                               y0.data_ptr<float>(), hist.data_ptr<float>(),
                                                               fin.data_ptr<float>(), offsets.data_ptr<int64_t>(), H,
                                                               N, Dv, reverse);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// ---- the scan with a low-rank transition, on the tensor cores (3xTF32 as above) ----
// Y_{n+1} = a_n Y_n + A_n^T (U_n - B_n Y_n) + Z_n, with A_n, B_n [C, DK] chunk-local factors: the
// transition is never formed. Per chunk, (1) M = U_n - B_n Y (C x 16, K = DK) and (2) Y' = a_n Y +
// A_n^T M + Z_n (DK x 16, K = C). A_n and B_n of the next chunk stream into shared memory while this
// chunk runs. 2 DK / 32 warps a block, each with 16 state rows.
constexpr int kLowRankChunk = 64;

// A product term of the mma: with PRECISE the 3xTF32 split (hi*hi into acc[0], the cross terms into
// acc[1]: two dependency chains); without it one TF32 product (for 16-bit inputs, whose own rounding is
// coarser than TF32's), alternating between acc[0] and acc[1] by k-step to halve the chain.
template <bool PRECISE>
struct Tf32Operand {
  unsigned hi, lo;
  __device__ __forceinline__ explicit Tf32Operand(float x) {
    if constexpr (PRECISE) split_tf32(x, hi, lo);
    else hi = to_tf32(x), lo = 0;
  }
};

template <bool PRECISE>
__device__ __forceinline__ void mma_terms(float (&acc)[2][4], const Tf32Operand<PRECISE> (&a)[4],
                                          const Tf32Operand<PRECISE> (&b)[2], int kstep) {
  const unsigned ah[4] = {a[0].hi, a[1].hi, a[2].hi, a[3].hi}, bh[2] = {b[0].hi, b[1].hi};
  if constexpr (PRECISE) {
    const unsigned al[4] = {a[0].lo, a[1].lo, a[2].lo, a[3].lo}, bl[2] = {b[0].lo, b[1].lo};
    mma_tf32(acc[1], al, bh);
    mma_tf32(acc[1], ah, bl);
    mma_tf32(acc[0], ah, bh);
  } else {
    mma_tf32(acc[kstep & 1], ah, bh);
  }
}

// The prefetch ring of both low-rank scans, from `base`: kStages slots (three for float16 factors:
// copies for the next two chunks in flight during a step; two for float32 ones, a third would not fit
// at Dk = 128), slot b holding one chunk's A [C][LDA] and B [C][LDB] (F), its U [C][LDY] and Z [DK][LDY]
// column slices and its decay (float32).
template <int DK, class F>
struct ScanRing {
  static constexpr int C = kLowRankChunk, LDA = DK + 8, LDB = sizeof(F) == 2 ? DK + 8 : DK + 4, LDY = 24;
  static constexpr int kStages = sizeof(F) == 2 ? 3 : 2;
  static constexpr size_t kSlotBytes = (C * LDA + C * LDB) * sizeof(F) + (C * LDY + DK * LDY + 4) * sizeof(float);
  static constexpr size_t kBytes = kStages * kSlotBytes;
  char* base;
  __device__ __forceinline__ F* A(int b) const { return reinterpret_cast<F*>(base + b * kSlotBytes); }
  __device__ __forceinline__ F* B(int b) const { return A(b) + C * LDA; }
  __device__ __forceinline__ float* U(int b) const { return reinterpret_cast<float*>(B(b) + C * LDB); }
  __device__ __forceinline__ float* Z(int b) const { return U(b) + C * LDY; }
  __device__ __forceinline__ float* decay(int b) const { return Z(b) + DK * LDY; }
};
static_assert(ScanRing<128, c10::Half>::kSlotBytes % 16 == 0 && ScanRing<128, float>::kSlotBytes % 16 == 0 &&
                  ScanRing<32, c10::Half>::kSlotBytes % 16 == 0,
              "ring slots must keep 16-byte alignment for cp.async");
// low_rank_scan_kernel's shared memory: Ys [DK][24] and Ms [C][24] (float32), then the ring.
template <int DK, class F>
constexpr size_t low_rank_smem_bytes() {
  return (DK * 24 + kLowRankChunk * 24) * sizeof(float) + ScanRing<DK, F>::kBytes;
}

// Where a block's chunks come from: head h's factors (row strides lda, ldb), U (row stride ldu) and Z
// (rows of Dv), read at the block's 16 state columns from col0.
template <class F>
struct ScanSources {
  const F* A;
  const F* B;
  const float* U;
  const float* Z;
  const float* decay;
  int64_t N, lda, ldb, ldu;
  int h, Dv, col0;
};
// Chunk n into ring slot b by the block's NT threads: one cp.async group with the commit that follows
// (a loop step with no chunk left to load commits an empty group).
template <int DK, int NT, class F>
__device__ __forceinline__ void load_scan_chunk(const ScanRing<DK, F>& ring, const ScanSources<F>& src, int64_t n, int b) {
  constexpr int C = kLowRankChunk, BV = 16, V = 16 / sizeof(F), LDY = ScanRing<DK, F>::LDY;
  const int tid = threadIdx.x;
  const int64_t chunk = static_cast<int64_t>(src.h) * src.N + n;
  const F* a_src = src.A + chunk * C * src.lda;
  const F* b_src = src.B + chunk * C * src.ldb;
  F* const da = ring.A(b);
  F* const db = ring.B(b);
  for (int i = tid; i < C * DK / V; i += NT) {
    const int r = (V * i) / DK, c = (V * i) % DK;
    cp_async16(da + r * ScanRing<DK, F>::LDA + c, a_src + r * src.lda + c);
    cp_async16(db + r * ScanRing<DK, F>::LDB + c, b_src + r * src.ldb + c);
  }
  if (src.U != nullptr)
    for (int i = tid; i < C * BV / 4; i += NT) {
      const int r = i / (BV / 4), c = (i % (BV / 4)) * 4;
      cp_async16(ring.U(b) + r * LDY + c, src.U + (chunk * C + r) * src.ldu + src.col0 + c);
    }
  if (src.Z != nullptr)
    for (int i = tid; i < DK * BV / 4; i += NT) {
      const int r = i / (BV / 4), c = (i % (BV / 4)) * 4;
      cp_async16(ring.Z(b) + r * LDY + c,
                 src.Z + chunk * DK * src.Dv + static_cast<int64_t>(r) * src.Dv + src.col0 + c);
    }
  if (tid == 0) cp_async4(ring.decay(b), src.decay + chunk);
}
// A warp's 16 state rows from m2 (both 8-column tiles, in the mma accumulator layout: element e of
// tile nt at row m2 + g (+8 for e >= 2), column 8 nt + 2t (+1 for odd e)) from or to [DK][Dv] rows
// at column col0.
template <int NTB>
__device__ __forceinline__ void load_state_rows(float (&y)[NTB][4], const float* src, int m2, int Dv, int col0) {
  const int g = (threadIdx.x % 32) / 4, t = threadIdx.x % 4;
#pragma unroll
  for (int nt = 0; nt < NTB; ++nt)
#pragma unroll
    for (int e = 0; e < 4; e += 2) {
      const float2 v = *reinterpret_cast<const float2*>(src + static_cast<int64_t>(m2 + g + (e >= 2 ? 8 : 0)) * Dv + col0 +
                                                        nt * 8 + 2 * t);
      y[nt][e] = v.x, y[nt][e + 1] = v.y;
    }
}
template <int NTB>
__device__ __forceinline__ void store_state_rows(const float (&y)[NTB][4], float* dst, int m2, int Dv, int col0) {
  const int g = (threadIdx.x % 32) / 4, t = threadIdx.x % 4;
#pragma unroll
  for (int nt = 0; nt < NTB; ++nt)
#pragma unroll
    for (int e = 0; e < 4; e += 2)
      *reinterpret_cast<float2*>(dst + static_cast<int64_t>(m2 + g + (e >= 2 ? 8 : 0)) * Dv + col0 + nt * 8 + 2 * t) =
          make_float2(y[nt][e], y[nt][e + 1]);
}

// F: how A and B are stored, float32 or float16 (float16 values are exact in TF32, and half the bytes
// to stream per chunk).
template <int DK, bool PRECISE, class F>
__global__ void __launch_bounds__(2 * DK)
    low_rank_scan_kernel(const F* __restrict__ A, const F* __restrict__ Bm, const float* __restrict__ decay,
                         const float* __restrict__ U, const float* __restrict__ Z, const float* __restrict__ y0,
                         float* __restrict__ hist, float* __restrict__ Mout, float* __restrict__ fin,
                         const int64_t* __restrict__ offsets, int H, int64_t N, int Dv, int64_t lda, int64_t ldb,
                         int64_t ldu, bool reverse) {
  // Warp w owns state rows 16w..16w+15 (one 16-row tile, both 8-column tiles) in step (2), and the
  // (16-row, 8-column) tiles w, w + NW, ... of M in step (1).
  constexpr int C = kLowRankChunk, BV = 16, NW = DK / 16, NT = 32 * NW, T1 = (C / 16) * 2 / NW;
  // Padded rows for conflict-free fragment loads: A is read transposed (LDA = 8 mod 32 words), B by
  // rows (LDB = 4 mod 32 words; for 16-bit rows DK + 8 elements serves both), Y and M as the B operand (24).
  constexpr int LDA = ScanRing<DK, F>::LDA, LDB = ScanRing<DK, F>::LDB, LDY = 24;
  static_assert(T1 >= 1 && (C / 16) * 2 % NW == 0, "step (1) tiles must divide among the warps");
  using Op = Tf32Operand<PRECISE>;
  // Shared memory: Ys [DK][LDY], Ms [C][LDY], then STAGES ring slots, each one chunk's A [C][LDA] and
  // B [C][LDB] (F), its U [C][LDY] and Z [DK][LDY] column slices and its decay (float32).
  constexpr int STAGES = ScanRing<DK, F>::kStages;
  extern __shared__ float4 smem4[];
  float* const Ys = reinterpret_cast<float*>(smem4);
  float* const Ms = Ys + DK * LDY;
  const ScanRing<DK, F> ring{reinterpret_cast<char*>(Ms + C * LDY)};
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, g = lane / 4, t = lane % 4;
  const int h = blockIdx.y, s = blockIdx.z;
  const int64_t n0 = offsets[s], n1 = offsets[s + 1], count = n1 - n0;
  const int col0 = blockIdx.x * BV;
  const int64_t state = static_cast<int64_t>(DK) * Dv;
  // Element e of an accumulator tile sits at row (tile row) + g (+8 for e >= 2), column (tile column)
  // + 2t (+1 for odd e).
  auto row_in = [&](int e) { return g + (e >= 2 ? 8 : 0); };
  auto col_of = [&](int nt, int e) { return nt * 8 + 2 * t + (e & 1); };
  const int m2 = warp * 16;  // this warp's state rows in step (2)

  float y[2][4];  // [nt][element]: this warp's rows of the state
  load_state_rows(y, y0 + (static_cast<int64_t>(s) * H + h) * state, m2, Dv, col0);
#pragma unroll
  for (int nt = 0; nt < 2; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e) Ys[(m2 + row_in(e)) * LDY + col_of(nt, e)] = y[nt][e];
  auto chunk = [&](int64_t i) { return reverse ? n1 - 1 - i : n0 + i; };
  const ScanSources<F> sources{A, Bm, U, Z, decay, N, lda, ldb, ldu, h, Dv, col0};
  auto load_chunk = [&](int64_t n, int b) { load_scan_chunk<DK, NT>(ring, sources, n, b); };
  // The ring runs STAGES - 1 chunks ahead, so that global-memory latency spans that many steps.
  for (int b = 0; b < STAGES - 1; ++b) {
    if (b < count) load_chunk(chunk(b), b);
    cp_async_commit();
  }
  for (int64_t i = 0; i < count; ++i) {
    const int64_t n = chunk(i);
    const int buf = static_cast<int>(i % STAGES);
    if (i + STAGES - 1 < count) load_chunk(chunk(i + STAGES - 1), static_cast<int>((i + STAGES - 1) % STAGES));
    cp_async_commit();
    cp_async_wait<STAGES - 1>();  // chunk i's group has landed
    __syncthreads();
    const F* An = ring.A(buf);
    const F* Bn = ring.B(buf);
    const int64_t chunk_rows = (static_cast<int64_t>(h) * N + n) * C * Dv + col0;  // M
    const int64_t chunk_state = (static_cast<int64_t>(h) * N + n) * state + col0;  // hist

    // This chunk's U and Z columns and decay, from its ring slot.
    const float* Un = ring.U(buf);
    const float* Zn = ring.Z(buf);
    const float an = *ring.decay(buf);
    float2 u_pre[T1][2], z_pre[2][2];
#pragma unroll
    for (int i1 = 0; i1 < T1; ++i1) {
      const int tile = warp + i1 * NW, m = (tile / 2) * 16, nt = tile % 2;
#pragma unroll
      for (int e = 0; e < 4; e += 2)
        u_pre[i1][e / 2] = U != nullptr ? *reinterpret_cast<const float2*>(Un + (m + row_in(e)) * LDY + col_of(nt, e))
                                        : make_float2(0.f, 0.f);
    }
#pragma unroll
    for (int nt = 0; nt < 2; ++nt)
#pragma unroll
      for (int e = 0; e < 4; e += 2)
        z_pre[nt][e / 2] = Z != nullptr ? *reinterpret_cast<const float2*>(Zn + (m2 + row_in(e)) * LDY + col_of(nt, e))
                                        : make_float2(0.f, 0.f);

    // (1) M = U_n - B_n Y, tile by tile.
#pragma unroll
    for (int i1 = 0; i1 < T1; ++i1) {
      const int tile = warp + i1 * NW, m = (tile / 2) * 16, nt = tile % 2;
      float acc[2][4] = {};  // [chain][element]
#pragma unroll 4
      for (int k0 = 0; k0 < DK; k0 += 8) {
        const Op a[4] = {Op(Bn[(m + g) * LDB + k0 + t]), Op(Bn[(m + g + 8) * LDB + k0 + t]),
                         Op(Bn[(m + g) * LDB + k0 + t + 4]), Op(Bn[(m + g + 8) * LDB + k0 + t + 4])};  // float(F) exact
        const Op b[2] = {Op(Ys[(k0 + t) * LDY + nt * 8 + g]), Op(Ys[(k0 + t + 4) * LDY + nt * 8 + g])};
        mma_terms<PRECISE>(acc, a, b, k0 / 8);
      }
#pragma unroll
      for (int e = 0; e < 4; e += 2) {
        const int r = m + row_in(e), c = col_of(nt, e);
        const float2 u = u_pre[i1][e / 2];
        const float2 v = make_float2(u.x - (acc[0][e] + acc[1][e]), u.y - (acc[0][e + 1] + acc[1][e + 1]));
        Ms[r * LDY + c] = v.x, Ms[r * LDY + c + 1] = v.y;
        if (Mout != nullptr) *reinterpret_cast<float2*>(Mout + chunk_rows + static_cast<int64_t>(r) * Dv + c) = v;
      }
    }
    __syncthreads();  // M is complete; every warp has read the old state from Ys

    // (2) Y' = a_n Y + A_n^T M + Z_n for this warp's 16 rows, the first chain starting from a_n Y + Z_n.
    float acc[2][2][4];  // [nt][chain][element]
#pragma unroll
    for (int nt = 0; nt < 2; ++nt)
#pragma unroll
      for (int e = 0; e < 4; e += 2) {
        const float2 z = z_pre[nt][e / 2];
        acc[nt][0][e] = fmaf(an, y[nt][e], z.x);
        acc[nt][0][e + 1] = fmaf(an, y[nt][e + 1], z.y);
        acc[nt][1][e] = acc[nt][1][e + 1] = 0.f;
        *reinterpret_cast<float2*>(hist + chunk_state + static_cast<int64_t>(m2 + row_in(e)) * Dv + col_of(nt, e)) =
            make_float2(y[nt][e], y[nt][e + 1]);
      }
#pragma unroll
    for (int k0 = 0; k0 < C; k0 += 8) {
      // A operand = A_n^T: [row][k] = A_n[k][row]
      const Op a[4] = {Op(An[(k0 + t) * LDA + m2 + g]), Op(An[(k0 + t) * LDA + m2 + g + 8]),
                       Op(An[(k0 + t + 4) * LDA + m2 + g]), Op(An[(k0 + t + 4) * LDA + m2 + g + 8])};
#pragma unroll
      for (int nt = 0; nt < 2; ++nt) {
        const Op b[2] = {Op(Ms[(k0 + t) * LDY + nt * 8 + g]), Op(Ms[(k0 + t + 4) * LDY + nt * 8 + g])};
        mma_terms<PRECISE>(acc[nt], a, b, k0 / 8);
      }
    }
#pragma unroll
    for (int nt = 0; nt < 2; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        y[nt][e] = acc[nt][0][e] + acc[nt][1][e];
        Ys[(m2 + row_in(e)) * LDY + col_of(nt, e)] = y[nt][e];
      }
    __syncthreads();  // every warp is done with this slot and M before the slot is refilled and step (1)
  }
  cp_async_wait<0>();  // no copy outstanding at exit
  store_state_rows(y, fin + (static_cast<int64_t>(s) * H + h) * state, m2, Dv, col0);
}

// ---- the low-rank scan with float16 products (block floating point) ----
// The same recurrence for float16 A and B, on m16n8k16 float16 products fed by ldmatrix: Y and M are
// rounded to float16 for the products after scaling each 16-row block by a power of two that puts its
// largest magnitude in [2^14, 2^15). Every element keeps float16's 11 significant bits (as TF32 would)
// at any magnitude, and float16's range cannot overflow. The blocks are the product's k-steps: block j
// of Y is k-step j of step (1) and block i of M k-step i of step (2), so each k-step's product is
// unscaled on its own, by one multiply-add into the float32 sum. Y itself stays float32 in registers.
// The chunks arrive by the copy engine: one producer thread issues each chunk's tiles (A and B in
// boxes of 64 rows by SW bytes, swizzled; U's and Z's column slices) into a ring slot, where they
// complete on the slot's `full` barrier; the compute warps release the slot on its `empty` barrier
// once step (2) has read it. The compute warps issue no copies and sync among themselves on a named
// barrier.
// STAGES slots: three hide the copies' latency best for a block alone on its SM; two let two blocks
// share an SM (the segmented scan with 16-column slices, which has more blocks than SMs). BV: the
// state's columns a block owns (16 or 32; 32 reads each chunk's factors from shared memory once for
// twice the columns). OUT: the forward writing its output (LowRankScanArgs::output), whose slots hold the
// chunk's Qd [C][DK] (boxed and swizzled as A and B) and Aq [C][C] (one box of 128-byte rows) where Z
// would be (the forward has none), and aq_inv beside the decay. DIR: the reverse scan forming its direct
// term (LowRankScanArgs::direct), whose slots hold Qd and Aq as OUT's, dO16's column slice [C][BV]
// (float16, swizzled at its row width BV * 2) where U would be (the backward has none), and aq_inv and
// do_inv beside the decay.
// FUSE: the output through the fusion norm, whose head's column blocks form a cluster and exchange each
// row's sums of squares. The head region also holds, for two chunks in turn: the barriers xbar (the
// cluster's sums landed), ofull (the compute warps' o staged) and ofree (the epilogue warps done with
// it); the sums every block of the cluster sends [2][kMaxFusedBlocks][C]; this block's row sums over
// each half of its columns [2][2][C]; and o rounded to the output's 16-bit type [2][C][BV].
template <int DK, int STAGES, int BV_, bool OUT_ = false, bool DIR_ = false, bool FUSE = false>
struct F16Ring {
  static constexpr int C = kLowRankChunk, BV = BV_, kStages = STAGES, LDH = BV + 8;
  static constexpr bool OUT = OUT_, DIR = DIR_;
  static_assert(!(OUT && DIR), "the output is the forward's, the direct term the backward's");
  static constexpr int SW = DK * 2 >= 128 ? 128 : DK * 2;  // swizzle width in bytes = one box row
  static constexpr int kBoxCols = SW / 2, kBoxes = DK / kBoxCols;
  static_assert(kBoxes * kBoxCols == DK, "the factors' rows are whole boxes");
  static constexpr size_t kTile = static_cast<size_t>(C) * DK * 2;  // A or B, 16-bit
  static constexpr size_t kU = C * BV * 4, kZ = DK * BV * 4;
  // U's and Z's float32 slices land swizzled at the width of their rows (BV * 4 = 64 or 128 bytes), so
  // that the accumulator layout's reads (eight rows, the same columns) fall in distinct banks; both
  // start at multiples of 1024 bytes in the slot, as the swizzle needs.
  static constexpr int kSliceSwizzle = BV * 4;
  static_assert(kSliceSwizzle == 64 || kSliceSwizzle == 128, "the slices' swizzle width");
  static_assert(kTile % 1024 == 0 && kU % 1024 == 0, "U and Z 1024-byte aligned in the slot");
  static constexpr size_t kAq = static_cast<size_t>(C) * C * 2;
  static constexpr size_t kFourth = OUT || DIR ? kTile + kAq : kZ;  // Z, or Qd and Aq
  static constexpr size_t kDo = C * BV * 2;                          // dO16's slice (DIR), in U's place
  static constexpr int kDoSwizzle = BV * 2;
  static_assert(kDoSwizzle == 32 || kDoSwizzle == 64, "dO16's swizzle width");
  static constexpr size_t kSlot = (2 * kTile + kU + kFourth + 16 + 1023) / 1024 * 1024;
  // Ahead of the slots: the barriers (full, empty), Yh [DK][LDH] and Mh [C][LDH] (float16), the
  // inverse scales of Y's (DK / 16) x (BV / 16) blocks (padded to a multiple of 4) and of M's
  // (C / 16) x (BV / 8) tiles, and the chunk the scan starts from.
  static constexpr int kYScales = ((DK / 16) * (BV / 16) + 3) / 4 * 4, kMScales = (C / 16) * (BV / 8);
  static constexpr size_t kBarriers = 2 * kStages * sizeof(unsigned long long);
  static constexpr int kMaxFusedBlocks = 8;  // Dv <= 256 (scan_output_fusion_supported)
  // The fused region, in bytes from the scan's start chunk (`plan`, 8 bytes, 16-byte aligned): six
  // barriers, then at a 16-byte boundary the sums received, this block's halves' sums and the staged o.
  static constexpr size_t kXsumAt = 64, kPsumAt = kXsumAt + 2 * kMaxFusedBlocks * C * sizeof(float),
                          kStageAt = kPsumAt + 4 * C * sizeof(float), kFusedEnd = kStageAt + 2 * C * BV * 2;
  static constexpr size_t kExchange = FUSE ? kFusedEnd - 8 : 0;
  static constexpr size_t kHead =
      (kBarriers + (DK + C) * LDH * 2 + (kYScales + kMScales) * 4 + 8 + kExchange + 1023) / 1024 * 1024;
  static constexpr size_t kBytes = kHead + kStages * kSlot + 1024;  // + the base's alignment to 1024
  char* slots;
  __device__ __forceinline__ char* A(int b) const { return slots + b * kSlot; }
  __device__ __forceinline__ char* B(int b) const { return A(b) + kTile; }
  __device__ __forceinline__ float* U(int b) const { return reinterpret_cast<float*>(B(b) + kTile); }
  __device__ __forceinline__ float* Z(int b) const { return U(b) + C * BV; }
  __device__ __forceinline__ char* Qd(int b) const { return reinterpret_cast<char*>(U(b) + C * BV); }
  __device__ __forceinline__ char* Aq(int b) const { return Qd(b) + kTile; }
  __device__ __forceinline__ float* decay(int b) const { return reinterpret_cast<float*>(Qd(b) + kFourth); }
  __device__ __forceinline__ float* aq_inv(int b) const { return decay(b) + 1; }
  __device__ __forceinline__ float* do_inv(int b) const { return decay(b) + 2; }
  __device__ __forceinline__ char* dO(int b) const { return reinterpret_cast<char*>(U(b)); }
};

// K inverse scales from shared memory (16-byte aligned) by the widest loads that divide K.
template <int K>
__device__ __forceinline__ void load_scales(float (&dst)[K], const float* src) {
  if constexpr (K % 4 == 0) {
#pragma unroll
    for (int i = 0; i < K / 4; ++i) {
      const float4 v = reinterpret_cast<const float4*>(src)[i];
      dst[4 * i] = v.x, dst[4 * i + 1] = v.y, dst[4 * i + 2] = v.z, dst[4 * i + 3] = v.w;
    }
  } else {
#pragma unroll
    for (int i = 0; i < K; ++i) dst[i] = src[i];
  }
}

// The tensor maps of one scan: A and B ([rows = H N C, DK] float16, boxes of 64 x SW bytes), U's and Z's
// column slices ([H N C, Dv] and [H N DK, Dv] float32, boxes of 64 x BV and DK x BV, swizzled at their
// row width BV * 4); has_u, has_z say which of U and Z there are.
struct ScanMaps {
  CUtensorMap A, B, U, Z;
  CUtensorMap Qd;     // the output's factors (OUT and DIR): Qd, and Aq's four block rows (packed_maps)
  CUtensorMap Aq[4];
  CUtensorMap dO;      // dO16 (DIR): [H N C, Dv] float16, boxes of 64 x BV
  CUtensorMap U_inv;   // the column scan's U in float16: its column scales [H N, Dv], a row a chunk
  CUtensorMap S16, M16;  // the column scan's history (HIST), stored: boxes of Dk (S16) or C (M16) rows x 16
  CUtensorMap Tb[4];     // the column scan forming U (UV): T diag(beta)'s block rows, its two parts as chunks 2 c and 2 c + 1
  CUtensorMap QK;        // the column scan reading q and k (QK): their rows' scales [H N, 2 C], a row a chunk
  bool has_u, has_z;
};

// Chunk c of a packed lower matrix (kPackedLower: Aq, or a part of T diag(beta)) into a slot's [C][C] tile of
// 128-byte rows, swizzled as one box of the whole matrix lands: each block row as a box of its 16 rows of 64
// columns, the columns past its width zeros from the copy engine (they lie outside the block row's map,
// packed_maps). The four boxes bring the one box's 8,192 bytes on `bar`.
__device__ __forceinline__ void load_packed(char* tile, const CUtensorMap (&rows)[4], int64_t c, unsigned long long* bar) {
#pragma unroll
  for (int b = 0; b < 4; ++b) tma_load_3d(tile + b * 16 * 128, &rows[b], 0, 0, static_cast<int>(c), bar);
}

// The direct term's scales (DIR): aq_inv and do_inv [H, N]. raw (the column scan): 0 for dO16's tiles
// with do_inv; 1 (bfloat16) or 2 (float16) for dO's own [B T, H Dv] rows, chunk n of the grid's `per` a
// sequence at row (n / per) T + (n % per) C, each tile's rows scaled by the warps (do_inv unused).
struct ScanDirect {
  const float* aq_inv;
  const float* do_inv;
  int raw;
  int64_t T, per;
};

// Where the forward's output goes (OUT): o [rows, H, Dv] of the inputs' 16-bit type (bfloat16 when
// bf16, else float16), chunk n's slot r at row rows(n, r) (none for padding); aq_inv [H, N].
struct ScanOut {
  const float* aq_inv;
  void* o;
  SlotRows rows;
  bool bf16;
};

// The chunks' start states and new values as the scan's products use them (LowRankScanArgs::S16 and
// M16): block float16 with the inverse scales, or null.
struct F16History {
  __half* S;
  float* S_inv;
  __half* M;
  float* M_inv;
};

// The log of the bound on a warm-up's transitions below which a segment may start from zero
// (LowRankScanArgs::segment): 2^-20.
constexpr float kWarmupLogBound = -20.f * 0.69314718f;

// Where the scan of segment [lo, hi) of the sequence of chunks [n0, n1) starts (one warp, 32 chunks a
// round), by each chunk's log_norm (the log of a bound on its transition's norm: the given bound, or
// log(decay)): forward, the latest w <= lo whose chunks [w, lo) have sum log_norm <= log 2^-20, else n0
// (the sequence's start, from its initial state); reverse, the earliest w >= hi whose chunks [hi, w)
// have, else n1. A segment at its sequence's start (forward lo = n0, reverse hi = n1) starts there.
// Bounds that are not numbers never satisfy the bound, so such a segment scans from its sequence's start.
__device__ int64_t warmup_start(const float* decay, const float* bound, int64_t lo, int64_t hi, int64_t n0, int64_t n1,
                                bool reverse, int lane) {
  const int64_t end = reverse ? n1 : n0;
  int64_t at = reverse ? hi : lo;  // taken so far: chunks [at, lo) forward, [hi, at) reverse
  float taken = 0.f;               // the sum of their log_norm
  while (at != end) {
    const int64_t n = reverse ? at + lane : at - 1 - lane;
    const bool in = reverse ? n < n1 : n >= n0;
    float x = in ? (bound != nullptr ? bound[n] : logf(decay[n])) : 0.f;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const float y = __shfl_up_sync(0xffffffffu, x, o);
      if (lane >= o) x += y;
    }
    const unsigned hit = __ballot_sync(0xffffffffu, in && taken + x <= kWarmupLogBound);
    if (hit != 0) {
      const int j = __ffs(static_cast<int>(hit)) - 1;
      return reverse ? at + j + 1 : at - 1 - j;
    }
    taken += __shfl_sync(0xffffffffu, x, 31);
    at = reverse ? min(at + 32, n1) : max(at - 32, n0);
  }
  return end;
}

// The fused scan's epilogue warps (each half the chunk's rows).
constexpr int kEpilogueWarps = 2;
// A block's threads: DK / 16 compute warps and the producer warp; with the fusion (FUSED), also the
// epilogue warps.
template <int DK, bool FUSED>
constexpr int scan_threads() {
  return 2 * DK + 32 + (FUSED ? 32 * kEpilogueWarps : 0);
}

// One block per (segment, BV-column slice of the state) and head: blockIdx.x = segment * (Dv / BV) +
// slice. segs holds (sequence, lo, hi) per segment; offsets the sequences' chunk ranges.
// OUT (the forward only): each chunk's output columns of the slice, o = Qd S_n + aq_inv Aq M_n, as
// chunk_output_f16 forms it from S16 and M16 (the same float16 operands, scales and order of sums): the
// warp's step (1) tiles of o, Qd's product beside B's on Y's same fragments in step (1), Aq's on M's
// after the state's update. FUSE >= 0 (a GateActivation; O the output's 16-bit type): o, rounded to O,
// through the fusion norm into fa.y instead, as chunk_output_f16_fused's epilogue forms it; the head's
// Dv / BV blocks of a segment are one cluster (along x), which adds each row's sums of squares over the
// head's columns through the blocks' shared memory, each chunk; two epilogue warps of each block do that
// and the norm from o staged in shared memory, so that neither is on the chain of the state's products.
// DIR (the reverse scan): the direct term from the slot's Qd, Aq and dO16 slice instead of Z,
// -aq_inv do_inv Aq^T dO16 in U's place in step (1) (over the 16-row blocks of Aq^T's upper triangle) and
// do_inv Qd^T dO16 beside Z's place in step (2), each product summed in float32 and scaled once.
template <int DK, int STAGES, int BV, bool OUT, bool DIR = false, int FUSE = -1, class O = c10::BFloat16>
__global__ void __launch_bounds__(scan_threads<DK, (FUSE >= 0)>(), STAGES == 2 ? 2 : 1)
    low_rank_scan_f16_kernel(const __grid_constant__ ScanMaps maps, const float* __restrict__ decay,
                             const float* __restrict__ bound, const float* __restrict__ y0, float* __restrict__ hist, float* __restrict__ Mout,
                             float* __restrict__ fin, const int64_t* __restrict__ offsets,
                             const int64_t* __restrict__ segs, int H, int64_t N, int Dv, bool reverse, F16History h16,
                             ScanOut so, ScanDirect sd, const __grid_constant__ FusedOutputArgs fa) {
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 900  // the copy engine and its barriers: Hopper on
  // Compute warp w owns state rows 16w..16w+15 (row block w of Y, all BV columns) in step (2). Step (1)
  // splits M's (C / 16) x NTB tiles of 16 rows by 8 columns into runs of T1 consecutive tiles (row
  // block major), one run a warp, so that a warp's tiles of one row block share the factor's fragment:
  // MT row blocks of NTW tiles each. Warp NW is the producer.
  constexpr int C = kLowRankChunk, NW = DK / 16, NT = 32 * NW, NTB = BV / 8, QB = BV / 16;
  constexpr int T1 = (C / 16) * NTB / NW, NTW = T1 < NTB ? T1 : NTB, MT = T1 / NTW;
  static_assert(T1 >= 1 && (C / 16) * NTB % NW == 0 && T1 % NTW == 0, "step (1) tiles must divide among the warps");
  // Y's and M's 16-bit rows padded by 8 elements (16 bytes) for conflict-free ldmatrix: 8 consecutive
  // rows start in distinct 16-byte bank groups; the factors' tiles are swizzled instead (swizzled<>).
  constexpr bool FUSED = FUSE >= 0;
  static_assert(!FUSED || (OUT && MT == 1 && NTB == 2 * NTW), "the fused output: a warp's tiles are half a row block's");
  using Ring = F16Ring<DK, STAGES, BV, OUT, DIR, FUSED>;
  constexpr int LDH = Ring::LDH, SW = Ring::SW, SWF = Ring::kSliceSwizzle, SWD = Ring::kDoSwizzle;
  extern __shared__ float4 smem4[];
  // The swizzled tiles need 1024-byte alignment: from the first such address on.
  char* const base = reinterpret_cast<char*>(smem4) + ((1024 - (smem_addr(smem4) & 1023)) & 1023);
  unsigned long long* const full = reinterpret_cast<unsigned long long*>(base);
  unsigned long long* const empty = full + STAGES;
  __half* const Yh = reinterpret_cast<__half*>(base + Ring::kBarriers);
  __half* const Mh = Yh + DK * LDH;
  float* const y_inv = reinterpret_cast<float*>(Mh + C * LDH);  // [row block][column block]
  float* const m_inv = y_inv + Ring::kYScales;                   // [row block][8-column tile]; 16-byte aligned
  long long* const plan = reinterpret_cast<long long*>(m_inv + Ring::kMScales);
  // FUSED: the epilogue's region (F16Ring's kExchange).
  unsigned long long* const xbar = reinterpret_cast<unsigned long long*>(plan + 1);  // [2] the chunks in turn
  unsigned long long* const ofull = xbar + 2;                                        // [2]
  unsigned long long* const ofree = ofull + 2;                                       // [2]
  char* const fused = reinterpret_cast<char*>(plan);
  float* const xsum = reinterpret_cast<float*>(fused + Ring::kXsumAt);  // [2][kMaxFusedBlocks][C]
  float* const psum = reinterpret_cast<float*>(fused + Ring::kPsumAt);  // [2][2][C]
  using P2 = typename Pair16<O>::type;
  P2* const stage = reinterpret_cast<P2*>(fused + Ring::kStageAt);      // [2][C][BV / 2] pairs
  const Ring ring{base + Ring::kHead};
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, g = lane / 4, t = lane % 4;
  const int h = blockIdx.y, slices = Dv / BV;
  const int64_t* const seg = segs + 3 * (blockIdx.x / slices);
  const int s = static_cast<int>(seg[0]);
  const int64_t n0 = offsets[s], n1 = offsets[s + 1], lo = seg[1], hi = seg[2];
  const int col0 = (blockIdx.x % slices) * BV;
  const int64_t state = static_cast<int64_t>(DK) * Dv;
  if (warp == NW) {
    const int64_t w = warmup_start(decay + static_cast<int64_t>(h) * N,
                                   bound != nullptr ? bound + static_cast<int64_t>(h) * N : nullptr, lo, hi, n0, n1, reverse, lane);
    if (lane == 0) *plan = w;
  }
  const int CS = Dv / BV;  // FUSED: the cluster's blocks
  const unsigned xbytes = static_cast<unsigned>(CS * C * 4);  // FUSED: the sums a block receives a chunk
  if (tid == 0) {
    for (int b = 0; b < STAGES; ++b) mbar_init(&full[b], 1), mbar_init(&empty[b], NW);
    // FUSED: xbar's phases complete on one arrival, which announces the bytes the cluster's blocks send
    // (C floats each), and those bytes landing; each slot's first phase is announced here.
    if constexpr (FUSED)
      for (int b = 0; b < 2; ++b) {
        mbar_init(&ofull[b], NW), mbar_init(&ofree[b], kEpilogueWarps);
        mbar_init(&xbar[b], 1), mbar_arrive_expect_tx(&xbar[b], xbytes);
      }
    mbar_init_fence();
  }
  if constexpr (FUSED) cluster_sync_all();  // the barriers initialised in every block before any arrives
  else __syncthreads();
  // The block scans chunks w .. hi - 1 (reverse: w - 1 down to lo), the first `skip` of them a warm-up
  // that writes nothing: its state starts from y0 at the sequence's start, else from zero.
  const int64_t w = *plan;
  const int64_t count = reverse ? w - lo : hi - w, skip = reverse ? w - hi : lo - w;
  const bool from_y0 = w == (reverse ? n1 : n0), last = reverse ? lo == n0 : hi == n1;
  auto chunk = [&](int64_t i) { return reverse ? w - 1 - i : w + i; };

  if (warp == NW) {
    // The producer (one thread): chunk i into slot i % STAGES once every compute warp has released the
    // slot's previous chunk. It stores the decay, announces the bytes and issues the boxes.
    if (lane != 0) return;
    const unsigned bytes = 2 * Ring::kTile + (maps.has_u ? Ring::kU : 0) + (maps.has_z ? Ring::kZ : 0) +
                           (OUT || DIR ? Ring::kTile + Ring::kAq : 0) + (DIR ? Ring::kDo : 0);
    int b = 0;
    unsigned round = 0;
    for (int64_t i = 0; i < count; ++i) {
      if (round > 0) mbar_wait(&empty[b], (round - 1) & 1);
      const int64_t c = static_cast<int64_t>(h) * N + chunk(i);
      *ring.decay(b) = decay[c];
      if constexpr (OUT) *ring.aq_inv(b) = so.aq_inv[c];
      if constexpr (DIR) *ring.aq_inv(b) = sd.aq_inv[c], *ring.do_inv(b) = sd.do_inv[c];
      mbar_arrive_expect_tx(&full[b], bytes);
      const int row = static_cast<int>(c * C);
      for (int x = 0; x < Ring::kBoxes; ++x) {
        tma_load_2d(ring.A(b) + x * C * SW, &maps.A, x * Ring::kBoxCols, row, &full[b]);
        tma_load_2d(ring.B(b) + x * C * SW, &maps.B, x * Ring::kBoxCols, row, &full[b]);
        if constexpr (OUT || DIR) tma_load_2d(ring.Qd(b) + x * C * SW, &maps.Qd, x * Ring::kBoxCols, row, &full[b]);
      }
      if constexpr (OUT || DIR) load_packed(ring.Aq(b), maps.Aq, c, &full[b]);
      if constexpr (DIR) tma_load_2d(ring.dO(b), &maps.dO, col0, row, &full[b]);
      if (maps.has_u) tma_load_2d(ring.U(b), &maps.U, col0, row, &full[b]);
      if (maps.has_z) tma_load_2d(ring.Z(b), &maps.Z, col0, static_cast<int>(c * DK), &full[b]);
      if (++b == STAGES) b = 0, ++round;
    }
    return;
  }
  // FUSED: where o's pair p (columns 2p, 2p + 1) of row r lies in staging slot `slot`: each row's 16-byte
  // units XOR-ed with bits 1.. of the row, so that the compute warps' stores (eight rows, one unit) fall
  // in distinct banks.
  [[maybe_unused]] auto stage_at = [&](int slot, int r, int p) {
    constexpr int PR = BV / 2, UNITS = BV / 8;
    return stage + (slot * C + r) * PR + (((p / 4) ^ ((r >> 1) & (UNITS - 1))) * 4) + p % 4;
  };
  if constexpr (FUSED) {
    if (warp > NW) {
      // The epilogue warps: each written chunk's output through the fusion norm, off the scan's chain,
      // warp e for rows 32 e .. 32 e + 31. The compute warps stage the chunk's o (rounded to O) and each
      // row's sums of squares over their halves of the block's columns; an epilogue warp sends its rows'
      // sums (the halves added) to every block of the cluster (st.async, completing on the receiver's
      // xbar), waits for the cluster's, and forms
      //   y = act(gate) * (gamma * (o * rsqrt(sum / Dv + eps)))
      // as chunk_output_f16_fused's epilogue does (each rounding to O where it rounds), eight columns a
      // lane. Two slots suffice for the sums: a block reads its slot of chunk j before it sends chunk
      // j + 1, so a block that has everyone's chunk j + 1 knows each has read chunk j's slot before it
      // sends chunk j + 2 there. A slot's next phase is announced (by epilogue warp 0) right after its
      // wait and before this block sends chunk j + 1, without which no block can send chunk j + 2; the
      // other warp cannot miss the phase it waits for, which stays complete until chunk j + 2's sums land.
      static_assert(C == 64 && BV % 8 == 0 && 32 % (BV / 8) == 0, "eight columns a lane, 32 rows a warp");
      constexpr int UR = BV / 8, RPI = 32 / UR, ITS = 32 / RPI;  // 16-byte units a row, rows an iteration, iterations
      const int ew = warp - NW - 1, row0 = 32 * ew, rank = static_cast<int>(blockIdx.x % slices);
      const int ur = lane / UR, u = lane % UR;  // the lane's row in an iteration and its unit of the row
      const uint4 gamma = *reinterpret_cast<const uint4*>(static_cast<const O*>(fa.gamma) + static_cast<int64_t>(h) * Dv + col0 + 8 * u);
      const O* const gate = static_cast<const O*>(fa.gate) + static_cast<int64_t>(h) * Dv + col0 + 8 * u;
      O* const ydst = static_cast<O*>(fa.y) + static_cast<int64_t>(fa.pl.pos[h]) * Dv + col0 + 8 * u;
      auto pairs = [](uint4& x) { return reinterpret_cast<P2*>(&x); };
      for (int64_t i = skip; i < count; ++i) {
        const int64_t j = i - skip;
        const int slot = static_cast<int>(j & 1);
        const unsigned parity = static_cast<unsigned>(j >> 1) & 1;
        // The gate's units first: they land while the compute warps finish the chunk.
        const ChunkRows row_of = so.rows.chunk(chunk(i));
        uint4 gv[ITS];
#pragma unroll
        for (int it = 0; it < ITS; ++it) {
          const int64_t row = row_of(row0 + it * RPI + ur);
          gv[it] = row >= 0 ? *reinterpret_cast<const uint4*>(gate + row * fa.pl.gate_ld) : make_uint4(0, 0, 0, 0);
        }
        mbar_wait(&ofull[slot], parity);
        // Row row0 + lane: the block's sum (its two halves added), to every block at this rank.
        const int rl = row0 + lane;
        const float* ps = psum + slot * 2 * C;
        const float sum = ps[rl] + ps[C + rl];
        float* const xs = xsum + slot * Ring::kMaxFusedBlocks * C;
        for (int c = 0; c < CS; ++c)
          st_async_f32(cluster_addr(xs + rank * C + rl, static_cast<unsigned>(c)), sum,
                       cluster_addr(&xbar[slot], static_cast<unsigned>(c)));
        mbar_wait_cluster(&xbar[slot], parity);
        if (ew == 0 && lane == 0) mbar_arrive_expect_tx(&xbar[slot], xbytes);
        __syncwarp();
        float total = 0.f;
        for (int c = 0; c < CS; ++c) total += xs[c * C + rl];
        const float rs = rsqrtf(total / static_cast<float>(Dv) + fa.eps);
#pragma unroll
        for (int it = 0; it < ITS; ++it) {
          const int r = row0 + it * RPI + ur;
          const float rstd = __shfl_sync(0xffffffffu, rs, it * RPI + ur);
          uint4 v = *reinterpret_cast<const uint4*>(stage_at(slot, r, 4 * u)), out;
          uint4 gm = gamma;
#pragma unroll
          for (int q = 0; q < 4; ++q)
            pairs(out)[q] = fusion_pair<FUSE, O>(Pair16<O>::to_float2(pairs(v)[q]), rstd, Pair16<O>::to_float2(pairs(gv[it])[q]),
                                                 pairs(gm)[q]);
          const int64_t row = row_of(r);
          if (row >= 0) *reinterpret_cast<uint4*>(ydst + row * fa.pl.y_ld) = out;
        }
        __syncwarp();
        if (lane == 0) mbar_arrive(&ofree[slot]);  // the slot's o and sums read
      }
      return;
    }
  }

  auto row_in = [&](int e) { return g + (e >= 2 ? 8 : 0); };
  auto col_of = [&](int nt, int e) { return nt * 8 + 2 * t + (e & 1); };
  auto compute_sync = [] { group_sync<NT>(); };
  const int m2 = warp * 16;
  // This warp's step (1) tiles: row blocks mfirst .. mfirst + MT - 1, tiles ntfirst .. ntfirst + NTW - 1.
  const int mfirst = warp * T1 / NTB, ntfirst = warp * T1 % NTB;
  // The outputs a chunk writes move by one chunk a step (back, for the reverse scan): pointers at
  // chunk(0), advanced by these strides.
  const int64_t c0 = static_cast<int64_t>(h) * N + (count > 0 ? chunk(0) : 0), dir = reverse ? -1 : 1;
  const int64_t step_state = dir * state, step_rows = dir * C * Dv;
  const int64_t step_sinv = dir * NW * (Dv / 16), step_minv = dir * (C / 16) * (Dv / 8);
  // This lane's row and 16-byte column unit in a 16 x 16 block of Y its warp publishes, and in a
  // 16 x 8 tile of M (lanes 0..15).
  const int pub_row = lane / 2, pub_col = (lane % 2) * 8;
  __half* s16 = h16.S != nullptr ? h16.S + c0 * state + col0 + static_cast<int64_t>(m2 + pub_row) * Dv + pub_col : nullptr;
  float* s_inv = h16.S != nullptr ? h16.S_inv + (c0 * NW + warp) * (Dv / 16) + col0 / 16 : nullptr;
  __half* m16 = h16.M != nullptr ? h16.M + c0 * C * Dv + col0 + static_cast<int64_t>(lane % 16) * Dv : nullptr;
  float* m_inv_out = h16.M != nullptr ? h16.M_inv + c0 * (C / 16) * (Dv / 8) + col0 / 8 : nullptr;
  float* hist_at = hist != nullptr ? hist + c0 * state + col0 : nullptr;
  float* mout_at = Mout != nullptr ? Mout + c0 * C * Dv + col0 : nullptr;

  float y[NTB][4];  // [nt][element]: this warp's rows of the state, float32
  // Y's blocks of this warp into Yh, each scaled, with its inverse scale; with `keep`, also into the
  // float16 history (at s16, s_inv) as the start state of the chunk those point at.
  auto publish_y = [&](bool keep) {
#pragma unroll
    for (int q = 0; q < QB; ++q) {
      float flat[8];
#pragma unroll
      for (int e = 0; e < 4; ++e) flat[e] = y[2 * q][e], flat[4 + e] = y[2 * q + 1][e];
      const Pow2Scale sc = pow2_scale(warp_max_abs(flat));
#pragma unroll
      for (int nt = 2 * q; nt < 2 * q + 2; ++nt)
#pragma unroll
        for (int e = 0; e < 4; e += 2)
          *reinterpret_cast<unsigned*>(Yh + (m2 + row_in(e)) * LDH + col_of(nt, e)) =
              pack_f16(y[nt][e] * sc.scale, y[nt][e + 1] * sc.scale);
      if (lane == 0) y_inv[warp * QB + q] = sc.inverse;
      if (keep && s16 != nullptr && lane == 0) s_inv[q] = sc.inverse;
    }
    if (keep && s16 != nullptr) {  // each block by 16-byte units: two a row
      __syncwarp();
#pragma unroll
      for (int q = 0; q < QB; ++q)
        *reinterpret_cast<uint4*>(s16 + 16 * q) = *reinterpret_cast<const uint4*>(Yh + (m2 + pub_row) * LDH + 16 * q + pub_col);
    }
  };
  if (from_y0) {
    load_state_rows(y, y0 + (static_cast<int64_t>(s) * H + h) * state, m2, Dv, col0);
  } else {
#pragma unroll
    for (int nt = 0; nt < NTB; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) y[nt][e] = 0.f;
  }
  publish_y(count > 0 && skip == 0);
  // ldmatrix row addresses of this lane (see device_ops.cuh): the A fragment of rows r..r+15 and k
  // k0..k0+15 of a row-major [r][k] block, the same of a [k][r] block read transposed, and B fragments
  // of a [k][n] block (two 8-column tiles, or one).
  const int a_row = lane % 16, a_col = (lane / 16) * 8;
  const int at_k = (lane % 8) + 8 * (lane / 16), at_m = 8 * ((lane / 8) % 2);
  const int bt_k = (lane % 8) + 8 * ((lane / 8) % 2), bt_n = 8 * (lane / 16);
  int buf = 0;
  unsigned round = 0;
  for (int64_t i = 0; i < count; ++i) {
    mbar_wait(&full[buf], round & 1);  // chunk i has landed in its slot
    compute_sync();                    // Yh holds the state; every warp is past step (2) of chunk i - 1
    const bool write = i >= skip;      // past the warm-up: chunk i's outputs are written
    const char* An = ring.A(buf);
    const char* Bn = ring.B(buf);
    const float* Un = ring.U(buf);
    const float* Zn = ring.Z(buf);
    float yinv[NW * QB];
    load_scales(yinv, y_inv);
    // Element (r, c) of the slot's dO16 slice (DIR), c a multiple of 8.
    auto dO_at = [&](int r, int c) { return ring.dO(buf) + swizzle<SWD>(r * SWD + 2 * c); };

    // (1) M = U_n - B_n Y, tile by tile: one product per block of Y, unscaled into the float32 sum;
    // with OUT, Qd S_n on the same fragments of Y into oq.
    float oq[MT][NTW][4] = {};
#pragma unroll
    for (int mi = 0; mi < MT; ++mi) {
      const int m = (mfirst + mi) * 16;
      float acc[NTW][4] = {};
#pragma unroll
      for (int j = 0; j < NW; ++j) {
        unsigned a[4], aq[4];
        ldmatrix_x4(a, Bn + swizzled<SW, C>(m + a_row, 16 * j + a_col));
        if constexpr (OUT) ldmatrix_x4(aq, ring.Qd(buf) + swizzled<SW, C>(m + a_row, 16 * j + a_col));
#pragma unroll
        for (int ni = 0; ni < NTW; ++ni) {
          const int nt = ntfirst + ni;
          unsigned b[2];
          ldmatrix_x2_trans(b, Yh + (16 * j + lane % 16) * LDH + nt * 8);
          float part[4] = {0.f, 0.f, 0.f, 0.f};
          mma_f16(part, a, b);
          // Y block (j, nt / 2)'s scale, chosen rather than indexed (nt varies by warp; an indexed
          // register array would live in local memory).
          static_assert(QB <= 2, "at most two 16-column blocks");
          const float sy = QB == 1 || nt < 2 ? yinv[j * QB] : yinv[j * QB + QB - 1];
#pragma unroll
          for (int e = 0; e < 4; ++e) acc[ni][e] = fmaf(part[e], sy, acc[ni][e]);
          if constexpr (OUT) {
            float pq[4] = {0.f, 0.f, 0.f, 0.f};
            mma_f16(pq, aq, b);
#pragma unroll
            for (int e = 0; e < 4; ++e) oq[mi][ni][e] = fmaf(pq[e], sy, oq[mi][ni][e]);
          }
        }
      }
      // DIR: Aq^T dO16 for these tiles, over the row blocks i2 >= m / 16 (Aq is zero above its diagonal).
      float ud[NTW][4] = {};
      if constexpr (DIR) {
#pragma unroll
        for (int i2 = 0; i2 < C / 16; ++i2) {
          if (i2 < m / 16) continue;
          unsigned a[4];
          ldmatrix_x4_trans(a, ring.Aq(buf) + swizzled<128, C>(16 * i2 + at_k, m + at_m));  // Aq^T: [row][k] = Aq[k][row]
#pragma unroll
          for (int ni = 0; ni < NTW; ++ni) {
            unsigned b[2];
            ldmatrix_x2_trans(b, dO_at(16 * i2 + lane % 16, (ntfirst + ni) * 8));
            mma_f16(ud[ni], a, b);
          }
        }
      }
      const float du = DIR ? -(*ring.aq_inv(buf) * *ring.do_inv(buf)) : 0.f;
#pragma unroll
      for (int ni = 0; ni < NTW; ++ni) {
        const int nt = ntfirst + ni;
        float mv[4];
#pragma unroll
        for (int e = 0; e < 4; e += 2) {
          float2 u = maps.has_u ? *reinterpret_cast<const float2*>(reinterpret_cast<const char*>(Un) +
                                                                   swizzled_f32<SWF>(m + row_in(e), col_of(nt, e)))
                                : make_float2(0.f, 0.f);
          if constexpr (DIR) u = make_float2(du * ud[ni][e], du * ud[ni][e + 1]);
          mv[e] = u.x - acc[ni][e], mv[e + 1] = u.y - acc[ni][e + 1];
          if (mout_at != nullptr && write)
            *reinterpret_cast<float2*>(mout_at + (m + row_in(e)) * Dv + col_of(nt, e)) = make_float2(mv[e], mv[e + 1]);
        }
        const Pow2Scale sc = pow2_scale(warp_max_abs(mv));
#pragma unroll
        for (int e = 0; e < 4; e += 2)
          *reinterpret_cast<unsigned*>(Mh + (m + row_in(e)) * LDH + col_of(nt, e)) =
              pack_f16(mv[e] * sc.scale, mv[e + 1] * sc.scale);
        if (lane == 0) m_inv[(m / 16) * NTB + nt] = sc.inverse;
        if (m16 != nullptr && write) {  // the tile by 16-byte units: one a row, lanes 0..15
          __syncwarp();
          if (lane < 16)
            *reinterpret_cast<uint4*>(m16 + m * Dv + nt * 8) = *reinterpret_cast<const uint4*>(Mh + (m + lane) * LDH + nt * 8);
          if (lane == 0) m_inv_out[(m / 16) * (Dv / 8) + nt] = sc.inverse;
        }
      }
    }
    compute_sync();  // Mh is complete; every warp has read Yh

    // (2) Y' = a_n Y + A_n^T M + Z_n for this warp's 16 rows: one product per 16-row block of M.
    const float an = *ring.decay(buf);
    float minv[(C / 16) * NTB];
    load_scales(minv, m_inv);
    float acc[NTB][4];
#pragma unroll
    for (int nt = 0; nt < NTB; ++nt)
#pragma unroll
      for (int e = 0; e < 4; e += 2) {
        const float2 z = maps.has_z ? *reinterpret_cast<const float2*>(reinterpret_cast<const char*>(Zn) +
                                                                       swizzled_f32<SWF>(m2 + row_in(e), col_of(nt, e)))
                                    : make_float2(0.f, 0.f);
        acc[nt][e] = fmaf(an, y[nt][e], z.x);
        acc[nt][e + 1] = fmaf(an, y[nt][e + 1], z.y);
        if (hist_at != nullptr && write)
          *reinterpret_cast<float2*>(hist_at + (m2 + row_in(e)) * Dv + col_of(nt, e)) = make_float2(y[nt][e], y[nt][e + 1]);
      }
    if constexpr (DIR) {
      // The direct term's Qd^T dO16 for this warp's 16 rows, in Z's place.
      float pz[NTB][4] = {};
#pragma unroll
      for (int i2 = 0; i2 < C / 16; ++i2) {
        unsigned a[4];
        ldmatrix_x4_trans(a, ring.Qd(buf) + swizzled<SW, C>(16 * i2 + at_k, m2 + at_m));  // Qd^T
#pragma unroll
        for (int q = 0; q < QB; ++q) {
          unsigned b[4];
          ldmatrix_x4_trans(b, dO_at(16 * i2 + bt_k, 16 * q + bt_n));
#pragma unroll
          for (int h2 = 0; h2 < 2; ++h2) {
            const unsigned bn[2] = {b[2 * h2], b[2 * h2 + 1]};
            mma_f16(pz[2 * q + h2], a, bn);
          }
        }
      }
      const float di = *ring.do_inv(buf);
#pragma unroll
      for (int nt = 0; nt < NTB; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[nt][e] = fmaf(di, pz[nt][e], acc[nt][e]);
    }
    float part[C / 16][NTB][4] = {};
#pragma unroll
    for (int i2 = 0; i2 < C / 16; ++i2) {
      unsigned a[4];
      ldmatrix_x4_trans(a, An + swizzled<SW, C>(16 * i2 + at_k, m2 + at_m));  // A_n^T: [row][k] = A_n[k][row]
#pragma unroll
      for (int q = 0; q < QB; ++q) {
        unsigned b[4];
        ldmatrix_x4_trans(b, Mh + (16 * i2 + bt_k) * LDH + 16 * q + bt_n);
#pragma unroll
        for (int h2 = 0; h2 < 2; ++h2) {
          const unsigned bn[2] = {b[2 * h2], b[2 * h2 + 1]};
          mma_f16(part[i2][2 * q + h2], a, bn);
        }
      }
    }
    // This warp is done with the slot (step (1) read B and U, step (2) A, Z and the decay; DIR's Qd, Aq
    // and dO16 both); with OUT, once
    // its output's product has read Aq, below.
    if constexpr (!OUT) {
      __syncwarp();
      if (lane == 0) mbar_arrive(&empty[buf]);
    }
#pragma unroll
    for (int i2 = 0; i2 < C / 16; ++i2)
#pragma unroll
      for (int nt = 0; nt < NTB; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[nt][e] = fmaf(part[i2][nt][e], minv[i2 * NTB + nt], acc[nt][e]);
#pragma unroll
    for (int nt = 0; nt < NTB; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) y[nt][e] = acc[nt][e];
    // The outputs' pointers to the next chunk; Y's blocks are that chunk's start state (read by its
    // step (1) after the barrier at the loop's top).
    if (s16 != nullptr) s16 += step_state, s_inv += step_sinv;
    if (m16 != nullptr) m16 += step_rows, m_inv_out += step_minv;
    if (hist_at != nullptr) hist_at += step_state;
    if (mout_at != nullptr) mout_at += step_rows;
    publish_y(i + 1 < count && i + 1 >= skip);
    if constexpr (OUT) {
      // After the state's update, whose products' registers are free by now: o = Qd S_n + aq_inv Aq M_n
      // for the warp's step (1) tiles, Aq's product over M's row blocks i <= the tile's (Aq is zero above
      // its diagonal), each 16-deep product scaled by its M tile's inverse scale.
      const float a_inv = *ring.aq_inv(buf);
      const ChunkRows row_of = so.rows.chunk(chunk(i));  // the output row of the chunk's slot r
#pragma unroll
      for (int mi = 0; mi < MT; ++mi) {
        const int m = (mfirst + mi) * 16;
        const int64_t r0 = row_of(m + g), r1 = row_of(m + g + 8);
        float am[NTW][4] = {};
#pragma unroll 4
        for (int i2 = 0; i2 <= m / 16; ++i2) {
          unsigned a[4];
          ldmatrix_x4(a, ring.Aq(buf) + swizzled<128, C>(m + a_row, 16 * i2 + a_col));
#pragma unroll
          for (int ni = 0; ni < NTW; ++ni) {
            const int nt = ntfirst + ni;
            unsigned b[2];
            ldmatrix_x2_trans(b, Mh + (16 * i2 + lane % 16) * LDH + nt * 8);
            float pa[4] = {0.f, 0.f, 0.f, 0.f};
            mma_f16(pa, a, b);
            const float x = m_inv[i2 * NTB + nt];
#pragma unroll
            for (int e = 0; e < 4; ++e) am[ni][e] = fmaf(pa[e], x, am[ni][e]);
          }
        }
        if (FUSED && write) {
          // o rounded to O and each row's sum of squares over the warp's 16 columns (the quad's).
          float v[NTW][4], ss[2] = {0.f, 0.f};
#pragma unroll
          for (int ni = 0; ni < NTW; ++ni)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
              v[ni][e] = static_cast<float>(O(fmaf(a_inv, am[ni][e], oq[mi][ni][e])));
              ss[e / 2] += v[ni][e] * v[ni][e];
            }
#pragma unroll
          for (int r = 0; r < 2; ++r) {
            ss[r] += __shfl_xor_sync(0xffffffffu, ss[r], 1);
            ss[r] += __shfl_xor_sync(0xffffffffu, ss[r], 2);
          }
          // Into this chunk's staging slot, once the epilogue warps are done with the chunk two before.
          const int64_t jw = i - skip;
          const int slot = static_cast<int>(jw & 1);
          if (jw >= 2) mbar_wait(&ofree[slot], static_cast<unsigned>((jw >> 1) - 1) & 1);
#pragma unroll
          for (int ni = 0; ni < NTW; ++ni)
#pragma unroll
            for (int e = 0; e < 4; e += 2)
              *stage_at(slot, m + row_in(e), (ntfirst + ni) * 4 + t) = Pair16<O>::round(v[ni][e], v[ni][e + 1]);
          if (t == 0) {
            float* const ps = psum + (slot * 2 + ntfirst / NTW) * C + m + g;
            ps[0] = ss[0], ps[8] = ss[1];
          }
          __syncwarp();
          if (lane == 0) mbar_arrive(&ofull[slot]);
        } else if (write) {
#pragma unroll
          for (int ni = 0; ni < NTW; ++ni)
#pragma unroll
            for (int e = 0; e < 4; e += 2) {
              const int64_t row = e < 2 ? r0 : r1;
              if (row < 0) continue;
              const int64_t at = (row * H + h) * Dv + col0 + col_of(ntfirst + ni, e);
              const float x0 = fmaf(a_inv, am[ni][e], oq[mi][ni][e]), x1 = fmaf(a_inv, am[ni][e + 1], oq[mi][ni][e + 1]);
              if (so.bf16) *reinterpret_cast<__nv_bfloat162*>(static_cast<__nv_bfloat16*>(so.o) + at) = __floats2bfloat162_rn(x0, x1);
              else *reinterpret_cast<__half2*>(static_cast<__half*>(so.o) + at) = __floats2half2_rn(x0, x1);
            }
        }
      }
      __syncwarp();
      if (lane == 0) mbar_arrive(&empty[buf]);  // the slot's Qd and Aq read
    }
    if (++buf == STAGES) buf = 0, ++round;
  }
  if (last) store_state_rows(y, fin + (static_cast<int64_t>(s) * H + h) * state, m2, Dv, col0);
#else
  __trap();  // launch_low_rank_scan refuses below compute capability 9.0
#endif
}

// The forward scan with its output, a whole head a block and 16 of the state's columns a warp
// (column_scan_kernel, set_scan_warp_columns): the same rule as low_rank_scan_f16_kernel with OUT, in the
// transposed form
//   M^T = U_n^T - S_n^T B_n^T,   S_{n+1}^T = a_n S_n^T + M^T A_n,   o^T = S_n^T Qd^T + aq_inv M^T Aq^T,
// where warp w owns rows 16 w .. 16 w + 15 of S^T (the state's columns) over all of Dk. A 16 x 16 block of
// two adjacent 8-column accumulator tiles is the 16-bit A fragment of a 16-deep product, so M^T's
// accumulators feed step (2) and S^T's the next step (1) in registers: no shared memory and no barrier
// between the warps of a step. Block float16: one power-of-two scale a row of S^T and of M^T (each row's
// largest magnitude into [2^14, 2^15)), undone once on each output element. The factors are the B
// operands, read from the ring: B_n, Qd and Aq by ldmatrix of their rows, A_n by ldmatrix.trans; with WG
// (set_scan_wgmma, the default) by the warpgroup's products instead (wgmma: the warps' fragments as the A
// operand, B read by the tensor cores from the slot through a shared-memory descriptor, once for four warps;
// B_n, Qd and Aq K-major, A_n MN-major; Aq's product over the whole tile, zero above its diagonal), the same
// 16-deep steps in the same order, so the same bits. U comes
// in float16 with a power-of-two scale a column (chunk_factors' UForm::kFloat16Columns); ldmatrix.trans of
// its rows gives U^T in the accumulators' layout, and since a column of U is a row of M^T, its scale folds
// into that row's: the scan forms M^T / u_inv (one fused multiply-add an element, as with float32 U) and
// multiplies u_inv into the row's inverse scale. The block's warps share a two-slot ring of the chunk's
// tiles (B_n, A_n, Qd, Aq, U and its scales); lane 0 of warp 0 refills a slot once every warp has released
// it. o goes through a per-warp staging tile, for 16-byte stores.
// DIR (with HIST: the backward's reverse scan that forms the direct term, LowRankScanArgs::direct): the
// chunks from last to first, A = W and B = kdecay as the scan in blocks takes them, U^T's place taken by
// -aq_inv do_inv dO16^T Aq (the slot's dO16 tile where U's lies, Aq zero above its diagonal: token tiles
// p take dO's row blocks k >= p) and the state's update adding do_inv dO16^T Qd, both on the same 16-bit
// fragments of dO16^T (a warp's 16 columns over the chunk's rows); no output. The history is each chunk's
// end-state gradient (S16) and its new values -dM (M16).
// FUSE >= 0 (the activation, as in low_rank_scan_f16_kernel): o goes through the fusion norm into fa.y
// instead, y = act(gate) * (gamma * (o * rsqrt(sum / Dv + eps))) with o rounded to O and each row's sum
// of its rounded squares, as chunk_output_f16_fused's epilogue forms it. A row's sum spans the block's
// warps: each warp adds its 16 columns' squares into a two-chunk table of partial sums, and one barrier
// of the block's warps a chunk makes the table whole. The gate's rows come into a per-warp tile by
// cp.async at the step's start, behind its products.
// UV (1: bfloat16, 2: float16; with WG, not DIR or FUSE: LowRankScanArgs::u_from_v): U formed here, with or
// without HIST (with it, the ring's kStageInHist layout).
// The slot holds v's tile where U's would lie (the chunk's rows where they lie, head h's columns) and
// T diag(beta)'s two parts (chunk_factors' UForm::kScan, landed whole as Aq is); each step issues
// U^T = V^T (hi + lo)^T as one more group of the warpgroup's products, both operands read from the slot (V
// MN-major, the parts K-major), beside S^T B^T and waited for with it; M^T = U^T - S^T B^T in float32.
// QK (with UV, with or without HIST: LowRankScanArgs::UFromV::q; or DIR: Direct::q): Qd's tile and kdecay's (the
// forward's A, the reverse scan's B) hold q's and k's rows where they lie (head h's columns, as v's or dO's),
// with their rows' scales from chunk_factors (qk_in_scan) beside them (with HIST and UV, in the ring's head);
// once the slot has landed, before the step's first products, the block's warps scale each row into float16 in place
// (scaled_half8, chunk_factors' arithmetic, so Qd and kdecay are the same bits). In the inference forward each
// warp then arrives on the slot's `scaled` barrier and issues the step's first products (which read neither
// tile); the products that read Qd and kdecay wait for that barrier. Elsewhere a barrier of the block has the
// tiles whole before the step's first products: the reverse scan's read kdecay, and training's forward was
// slower with the `scaled` barrier (docs/BENCHMARKS.md v83). (Scaled beside the first products instead, the
// forward was as fast, and its Dv 128 forms spilled 16 bytes: v80.)
// HIST (a forward that keeps its states for the backward, and DIR; not with FUSE): the history the
// backward reads (LowRankScanArgs::S16 and M16, whichever is given), in the blocks' form (16 x 16 blocks of
// S, 16 x 8 tiles of M, each with a power-of-two scale; here the blocks of a warp's slab share one):
// each written chunk's start state (DIR: its end-state gradient) at the step's start, and its new values,
// both from the products' 16-bit A fragments of S^T and M^T (slab_ratio). A warp transposes its part (16
// of the state's columns over Dk; 16 of M's columns over the chunk) by stmatrix.trans into a staging tile
// of its own (one for S, one for M), which the copy engine stores (ScanMaps::S16 and M16).
constexpr int kColumnStages = 2;
template <int DK, int DV, bool FUSED = false, bool HIST = false, bool UV = false, bool QK = false>
struct ColumnRing {
  static constexpr int C = kLowRankChunk, kWarps = DV / 16;
  static constexpr int SW = DK * 2 >= 128 ? 128 : DK * 2, kBoxCols = SW / 2, kBoxes = DK / kBoxCols;
  static constexpr size_t kTile = static_cast<size_t>(C) * DK * 2, kAq = static_cast<size_t>(C) * C * 2;
  static constexpr size_t kU = static_cast<size_t>(C) * DV * 2, kUInv = static_cast<size_t>(DV) * 4;  // U float16, its column scales
  // UV: V's tile where U's lies (the inputs' 16-bit values, the same bytes), then T diag(beta)'s two parts,
  // each landed whole as Aq is. With HIST too (kStageInHist): no U scales and the chunk's scalars in the
  // head, so that a slot is whole KB, and o staged in the warp's M history tile (the same [C][16] 16-bit
  // bytes) once that tile's last copy has read it, with no tiles of its own: the ring then fits an SM.
  // QK (the forward forming U, or the reverse scan: HIST without UV): q's rows where Qd's tile lies and k's
  // where kdecay's does (the forward's A, the reverse scan's B), and the scales of their rows (kQk bytes):
  // in the slot, or with kStageInHist in the head's second KB (the slots then fill the SM to its last KB).
  static constexpr size_t kTb = UV ? 2 * kAq : 0, kQk = QK ? 2 * static_cast<size_t>(C) * 4 : 0;
  static constexpr bool kStageInHist = HIST && UV;
  static_assert(!QK || UV || HIST, "q and k read in place by the forward forming U or by the reverse scan");
  static constexpr size_t kQkSlot = kStageInHist ? 0 : kQk;
  static constexpr size_t kSlot = (3 * kTile + kAq + kU + kTb + kQkSlot + (kStageInHist ? 0 : kUInv + 16) + 1023) / 1024 * 1024;
  static constexpr size_t kStage = static_cast<size_t>(C) * 16 * 2;  // a warp's o tile [C][16], 16-bit
  static constexpr size_t kStaging = kStageInHist ? 0 : kWarps * kStage;
  static constexpr size_t kHead = QK && kStageInHist ? 2048 : 1024;  // the barriers (and QK's scales)
  static constexpr size_t kPsum = FUSED ? 2 * static_cast<size_t>(C) * kWarps * 4 : 0;  // [2][C][kWarps] float
  static constexpr size_t kGate = FUSED ? kWarps * kStage : 0;                            // a warp's gate tile [C][16]
  static constexpr size_t kHistS = static_cast<size_t>(DK) * 16 * 2, kHistM = static_cast<size_t>(C) * 16 * 2;  // HIST: [DK][16] of S, [C][16] of M
  static constexpr size_t kHist = HIST ? kWarps * (kHistS + kHistM) : 0;
  static constexpr size_t kBytes = kHead + kColumnStages * kSlot + kStaging + kPsum + kGate + kHist + 1024;
  char* slots;
  __device__ __forceinline__ char* A(int b) const { return slots + b * kSlot; }
  __device__ __forceinline__ char* B(int b) const { return A(b) + kTile; }
  __device__ __forceinline__ char* Qd(int b) const { return B(b) + kTile; }
  __device__ __forceinline__ char* Aq(int b) const { return Qd(b) + kTile; }
  __device__ __forceinline__ char* U(int b) const { return Aq(b) + kAq; }
  __device__ __forceinline__ char* Tb(int b, int part) const { return U(b) + kU + part * kAq; }  // UV
  __device__ __forceinline__ float* qk(int b) const {  // QK: q's row scales, then k's
    return reinterpret_cast<float*>(kStageInHist ? slots - kHead + 1024 + b * kQk : U(b) + kU + kTb);
  }
  __device__ __forceinline__ float* u_inv(int b) const { return reinterpret_cast<float*>(U(b) + kU + kTb + kQkSlot); }
  __device__ __forceinline__ float* decay(int b) const {  // kStageInHist: four floats a slot from the head's byte 512
    return kStageInHist ? reinterpret_cast<float*>(slots - kHead + 512) + 4 * b : u_inv(b) + DV;
  }
  __device__ __forceinline__ float* aq_inv(int b) const { return decay(b) + 1; }
  __device__ __forceinline__ float* do_inv(int b) const { return aq_inv(b) + 1; }  // DIR
  __device__ __forceinline__ char* stage(int w) const { return kStageInHist ? hist_m(w) : slots + kColumnStages * kSlot + w * kStage; }
  __device__ __forceinline__ float* psum(int p) const {
    return reinterpret_cast<float*>(slots + kColumnStages * kSlot + kStaging) + p * C * kWarps;
  }
  __device__ __forceinline__ char* gate(int w) const { return slots + kColumnStages * kSlot + kStaging + kPsum + w * kStage; }
  // A warp's staging tiles of S's and M's history (1024-byte aligned, as the copy engine's swizzle needs).
  static_assert((kColumnStages * kSlot + kStaging + kPsum + kGate) % 1024 == 0 && kHistS % 1024 == 0 && kHistM % 1024 == 0,
                "the history's staging tiles start on 1024-byte boundaries of the ring");
  static_assert(!kStageInHist || kHead >= 512 + 4 * kColumnStages * 4, "the chunks' scalars fit the head");
  static_assert(!QK || !kStageInHist || kHead >= 1024 + kColumnStages * kQk, "the rows' scales fit the head's second KB");
  __device__ __forceinline__ char* hist_s(int w) const { return slots + kColumnStages * kSlot + kStaging + kPsum + kGate + w * kHistS; }
  __device__ __forceinline__ char* hist_m(int w) const {
    return slots + kColumnStages * kSlot + kStaging + kPsum + kGate + kWarps * kHistS + w * kHistM;
  }
};
static_assert(ColumnRing<128, 128, true>::kBytes <= 227 * 1024, "the column scan's ring fits an SM");
static_assert(ColumnRing<128, 128, false, true>::kBytes <= 227 * 1024, "the column scan's ring fits an SM with the history");
static_assert(ColumnRing<128, 128, false, false, true>::kBytes <= 227 * 1024, "the column scan's ring fits an SM with V and T diag(beta)");
static_assert(ColumnRing<128, 128, false, false, true, true>::kBytes <= 227 * 1024,
              "the column scan's ring fits an SM with V, T diag(beta), q, k and their scales");
static_assert(ColumnRing<128, 128, false, true, true>::kBytes <= 227 * 1024,
              "the column scan's ring fits an SM with V, T diag(beta) and the history");
static_assert(ColumnRing<128, 128, false, true, true, true>::kBytes <= 227 * 1024,
              "the column scan's ring fits an SM with V, T diag(beta), q, k, their scales and the history");
static_assert(ColumnRing<128, 128, false, true, false, true>::kBytes <= 227 * 1024,
              "the reverse scan's ring fits an SM with q, k and their scales");

// The history's scales (HIST): one for a warp's whole slab (its 16 columns of the state over Dk, or of M
// over the chunk), so that its 16-bit values are the products' A fragments as they stand, each row
// brought from its own power-of-two scale to the slab's by one exact float16 product. slab_inverse: the
// slab's inverse scale, the largest of its rows' (rows g and g + 8 of each lane; pow2_scale is monotone,
// so it is the scale of the slab's largest magnitude).
__device__ __forceinline__ float slab_inverse(float inv0, float inv1) {
  return __uint_as_float(__reduce_max_sync(0xffffffffu, __float_as_uint(fmaxf(inv0, inv1))));
}
// A row's factor to the slab's scale, row_inv / inv (a power of two <= 1), as a float16 pair; below
// float16's least subnormal it is zero (the row's values are then under 2^-24 of the slab's largest).
__device__ __forceinline__ unsigned slab_ratio(float row_inv, float inv) {
  const __half2 r = __float2half2_rn(row_inv * pow2_reciprocal(inv));
  return *reinterpret_cast<const unsigned*>(&r);
}
__device__ __forceinline__ unsigned hmul2_bits(unsigned a, unsigned b) {
  const __half2 p = __hmul2_rn(*reinterpret_cast<const __half2*>(&a), *reinterpret_cast<const __half2*>(&b));
  return *reinterpret_cast<const unsigned*>(&p);
}
// A row pair's power-of-two scales from this thread's values of rows g and g + 8 (the quad shares them).
__device__ __forceinline__ void row_scales(float mx0, float mx1, Pow2Scale& s0, Pow2Scale& s1) {
#pragma unroll
  for (int o = 1; o < 4; o <<= 1) {
    mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, o));
    mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, o));
  }
  s0 = pow2_scale(mx0), s1 = pow2_scale(mx1);
}
// NT accumulator tiles (rows g, g + 8) as NT / 2 16-bit A fragments, each row scaled by its own scale.
// Fragment k alone: tiles 2 k and 2 k + 1.
template <int NT>
__device__ __forceinline__ void to_a_fragment(const float (&x)[NT][4], int k, float s0, float s1, unsigned (&a)[4]) {
  a[0] = pack_f16(x[2 * k][0] * s0, x[2 * k][1] * s0);
  a[1] = pack_f16(x[2 * k][2] * s1, x[2 * k][3] * s1);
  a[2] = pack_f16(x[2 * k + 1][0] * s0, x[2 * k + 1][1] * s0);
  a[3] = pack_f16(x[2 * k + 1][2] * s1, x[2 * k + 1][3] * s1);
}
template <int NT>
__device__ __forceinline__ void to_a_fragments(const float (&x)[NT][4], float s0, float s1, unsigned (&a)[NT / 2][4]) {
#pragma unroll
  for (int k = 0; k < NT / 2; ++k) to_a_fragment(x, k, s0, s1, a[k]);
}
template <int NT>
__device__ __forceinline__ void row_max_abs(const float (&x)[NT][4], float& mx0, float& mx1) {
  mx0 = 0.f, mx1 = 0.f;
#pragma unroll
  for (int j = 0; j < NT; ++j) {
    mx0 = fmaxf(mx0, fmaxf(fabsf(x[j][0]), fabsf(x[j][1])));
    mx1 = fmaxf(mx1, fmaxf(fabsf(x[j][2]), fabsf(x[j][3])));
  }
}

template <int DK, int DV, int FUSE, class O, bool HIST = false, bool DIR = false, bool WG = false, int UV = 0, bool QK = false>
__global__ void __launch_bounds__(32 * (DV / 16), 1)
    column_scan_kernel(const __grid_constant__ ScanMaps maps, const float* __restrict__ decay, const float* __restrict__ bound,
                       const float* __restrict__ y0, float* __restrict__ fin, const int64_t* __restrict__ offsets,
                       const int64_t* __restrict__ segs, int H, int64_t N, ScanOut so, const __grid_constant__ FusedOutputArgs fa,
                       F16History h16, ScanDirect sd) {
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 900
  constexpr bool FUSED = FUSE >= 0;
  static_assert(!(FUSED && HIST), "the history is written with o, not through the fusion");
  static_assert(!DIR || HIST, "the reverse scan writes the backward's history");
  static_assert(UV == 0 || (WG && !DIR && !FUSED), "U formed from V: the forward with o, by warpgroup");
  static_assert(!QK || (WG && (UV != 0 || DIR)), "q and k read in place by the forward forming U or the reverse scan, by warpgroup");
  using Ring = ColumnRing<DK, DV, FUSED, HIST, (UV != 0), QK>;
  using VT = std::conditional_t<UV == 2, c10::Half, c10::BFloat16>;  // UV: V's and T diag(beta)'s 16-bit kind
  using P2 = typename Pair16<O>::type;
  constexpr int C = kLowRankChunk, NW = Ring::kWarps, SW = Ring::SW, NK = DK / 8, NC = C / 8;
  static_assert(C == 64 && DK % 16 == 0 && DV % 32 == 0, "the column scan's shapes");
  static_assert(!WG || (SW == 128 && DV % 64 == 0), "the warpgroup products: Dk = 128, whole warpgroups");
  extern __shared__ float4 smem4[];
  char* const base = reinterpret_cast<char*>(smem4) + ((1024 - (smem_addr(smem4) & 1023)) & 1023);
  unsigned long long* const full = reinterpret_cast<unsigned long long*>(base);
  unsigned long long* const empty = full + kColumnStages;
  long long* const plan = reinterpret_cast<long long*>(empty + kColumnStages);
  // kScaledBar (QK, the inference forward): each warp announces its part of a slot's q and k scaled on
  // scaled[b] (head bytes 64 on) and goes on to the step's first products, which read neither; the products
  // that read Qd and kdecay wait for every warp's. (The reverse scan's first products read kdecay, and
  // training's forward was slower so: a barrier of the block there.)
  constexpr bool kScaledBar = QK && !DIR && !HIST;
  [[maybe_unused]] unsigned long long* const scaled = full + 8;
  static_assert(2 * kColumnStages + 1 <= 8 && 8 + kColumnStages <= 64,
                "scaled[] lies past full[], empty[] and the plan, and before the head's byte 512 (kStageInHist's scalars)");
  const Ring ring{base + Ring::kHead};
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, g = lane / 4, t = lane % 4;
  const int h = blockIdx.y;
  const int64_t* const seg = segs + 3 * blockIdx.x;
  const int s = static_cast<int>(seg[0]);
  const int64_t n0 = offsets[s], n1 = offsets[s + 1], lo = seg[1], hi = seg[2];
  if (warp == 0) {
    const int64_t w = warmup_start(decay + static_cast<int64_t>(h) * N,
                                   bound != nullptr ? bound + static_cast<int64_t>(h) * N : nullptr, lo, hi, n0, n1, DIR, lane);
    if (lane == 0) *plan = w;
  }
  if (tid == 0) {
    for (int b = 0; b < kColumnStages; ++b) mbar_init(&full[b], 1), mbar_init(&empty[b], NW);
    if constexpr (kScaledBar)
      for (int b = 0; b < kColumnStages; ++b) mbar_init(&scaled[b], NW);
    mbar_init_fence();
  }
  __syncthreads();
  // The block scans chunks w0 .. hi - 1 (DIR: w0 - 1 down to lo), the first `skip` of them a warm-up that
  // writes nothing, from y0 at the sequence's start (DIR: its end), else from zero.
  const int64_t w0 = *plan, count = DIR ? w0 - lo : hi - w0, skip = DIR ? w0 - hi : lo - w0;
  const bool from_y0 = w0 == (DIR ? n1 : n0), last = DIR ? lo == n0 : hi == n1;
  auto chunk = [&](int64_t i) { return DIR ? w0 - 1 - i : w0 + i; };
  const unsigned bytes =
      static_cast<unsigned>(3 * Ring::kTile + Ring::kAq + Ring::kU + (DIR ? 0 : UV ? Ring::kTb : Ring::kUInv) + Ring::kQk);
  auto issue = [&](int64_t i, int b) {  // chunk(i) into slot b (one thread)
    const int64_t c = static_cast<int64_t>(h) * N + chunk(i);
    // The chunk's scalars by cp.async, on the slot's barrier too: the issuing thread does not wait for
    // them (a load and a shared store here held warp 0, and with it its warpgroup, for the load's latency).
    cp_async4(ring.decay(b), decay + c);
    cp_async4(ring.aq_inv(b), (DIR ? sd.aq_inv : so.aq_inv) + c);
    if constexpr (DIR)
      if (sd.raw == 0) cp_async4(ring.do_inv(b), sd.do_inv + c);
    cp_async_mbar_arrive(&full[b]);  // before the arrival below, so that the phase waits for them
    mbar_arrive_expect_tx(&full[b], bytes);
    const int row = static_cast<int>(c * C);
    // The chunk's first token's row where the inputs lie (DIR: as dO's, which the reverse scan with QK reads in place).
    auto in_row = [&] {
      const int64_t n = chunk(i);
      return static_cast<int>(DIR ? (n / sd.per) * sd.T + (n % sd.per) * C : so.rows.chunk(n).first);
    };
    // QK: head h's columns of q's rows (Qd's tile) and k's (the forward's A, the reverse scan's B) from that row.
    int qk_col = 0, qk_row = row;
    if constexpr (QK) qk_col = h * DK, qk_row = in_row();
    constexpr bool kA = QK && !DIR, kB = QK && DIR;  // which of A and B is k's
    for (int x = 0; x < Ring::kBoxes; ++x) {
      tma_load_2d(ring.A(b) + x * C * SW, &maps.A, (kA ? qk_col : 0) + x * Ring::kBoxCols, kA ? qk_row : row, &full[b]);
      tma_load_2d(ring.B(b) + x * C * SW, &maps.B, (kB ? qk_col : 0) + x * Ring::kBoxCols, kB ? qk_row : row, &full[b]);
      tma_load_2d(ring.Qd(b) + x * C * SW, &maps.Qd, qk_col + x * Ring::kBoxCols, qk_row, &full[b]);
    }
    if constexpr (QK) tma_load_2d(ring.qk(b), &maps.QK, 0, static_cast<int>(c), &full[b]);
    load_packed(ring.Aq(b), maps.Aq, c, &full[b]);
    // DIR: dO16's tile in U's place, or dO's own (sd.raw): head h's columns from the chunk's first token's row.
    int u_col = 0, u_row = row;
    if constexpr (DIR)
      if (sd.raw != 0) u_col = h * DV, u_row = QK ? qk_row : in_row();
    if constexpr (UV != 0)  // V's rows where they lie: head h's columns from the chunk's first token's row
      u_col = h * DV, u_row = QK ? qk_row : in_row();
    for (int x = 0; x < (DV + Ring::kBoxCols - 1) / Ring::kBoxCols; ++x)
      tma_load_2d(ring.U(b) + x * C * SW, DIR ? &maps.dO : &maps.U, u_col + x * Ring::kBoxCols, u_row, &full[b]);
    if constexpr (UV != 0) {
      load_packed(ring.Tb(b, 0), maps.Tb, 2 * c, &full[b]);
      load_packed(ring.Tb(b, 1), maps.Tb, 2 * c + 1, &full[b]);
    } else if constexpr (!DIR) {
      tma_load_2d(ring.u_inv(b), &maps.U_inv, 0, static_cast<int>(c), &full[b]);
    }
  };
  if (tid == 0)
    for (int64_t i = 0; i < count && i < kColumnStages; ++i) issue(i, static_cast<int>(i));

  // This warp's rows of S^T (state columns r0 + g and r0 + g + 8) over Dk, float32: tile j holds Dk
  // columns 8 j + 2 t, 8 j + 2 t + 1.
  const int r0 = 16 * warp;
  const int64_t state = static_cast<int64_t>(DK) * DV;
  float sx[NK][4];
  {
    const float* src = y0 + (static_cast<int64_t>(s) * H + h) * state;
#pragma unroll
    for (int j = 0; j < NK; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e)
        sx[j][e] = from_y0 ? src[static_cast<int64_t>(8 * j + 2 * t + (e & 1)) * DV + r0 + g + (e >= 2 ? 8 : 0)] : 0.f;
  }
  float sinv0, sinv1;  // the inverse scales of S^T's rows in sa
  unsigned sa[NK / 2][4];
  auto publish = [&] {
    float m0, m1;
    row_max_abs(sx, m0, m1);
    Pow2Scale p0, p1;
    row_scales(m0, m1, p0, p1);
    to_a_fragments(sx, p0.scale, p1.scale, sa);
    sinv0 = p0.inverse, sinv1 = p1.inverse;
  };
  publish();
  const int a_row = lane % 16, a_col = (lane / 16) * 8;
  // x += (this warp's 16 rows of S^T over Dk) (a K-major 64-row tile of the ring over Dk)^T (B_n or Qd): by the
  // warpgroup's products (WG; eight 16-deep steps, each a 32-byte slice of a box's rows), else by this warp's,
  // two 8-column tiles of tokens a load.
  // WG: x += (this warp's rows of S^T) tile^T, issued as one group of the warpgroup's products and not waited
  // for (wgmma_wait<0> and wgmma_hold(x) before x is read; sa stays untouched until then).
  [[maybe_unused]] auto state_products_issue = [&](float (&x)[NC][4], const char* tile) {
    wgmma_product_issue<0>(x, sa, [&](int k) {
      return wgmma_desc_sw128(tile + (16 * k / Ring::kBoxCols) * C * SW + (16 * k % Ring::kBoxCols) * 2, 16, 8 * SW);
    });
  };
  auto state_products = [&](float (&x)[NC][4], const char* tile) {
    if constexpr (WG) {
      state_products_issue(x, tile);
      wgmma_wait<0>();
      wgmma_hold(x);
    } else {
#pragma unroll
      for (int k = 0; k < NK / 2; ++k)
#pragma unroll
        for (int p = 0; p < NC / 2; ++p) {
          unsigned b4[4];
          ldmatrix_x4(b4, tile + swizzled<SW, C>(16 * p + a_row, 16 * k + a_col));
          const unsigned lo[2] = {b4[0], b4[2]}, hi[2] = {b4[1], b4[3]};
          mma_f16(x[2 * p], sa[k], lo);
          mma_f16(x[2 * p + 1], sa[k], hi);
        }
    }
  };
  const int bt_k = (lane % 8) + 8 * ((lane / 8) % 2), bt_n = 8 * (lane / 16);
  [[maybe_unused]] const int at_k = (lane % 8) + 8 * (lane / 16), at_m = 8 * ((lane / 8) % 2);  // DIR: A fragments stored transposed
  // HIST: this lane's stored row and unit in a 16-row block of the staging tile (stmatrix_x4_trans's
  // address for fragment registers ordered (rows g, first 8 columns), (rows g + 8, first 8), (rows g,
  // last 8), (rows g + 8, last 8)).
  const int h_row = lane % 8 + 8 * (lane / 16), h_part = (lane / 8) % 2;
  // HIST: a staging tile (rows of 32 bytes in the copy engine's 32-byte swizzle, row32_unit) to the box
  // at (r0, row) of S16's or M16's map by the copy engine, which lane 0 issues; before the lanes write the
  // tile again, lane 0 waits until that copy has read it (ready_tile).
  auto store_tile = [&](const CUtensorMap* map, int64_t row, const char* tile) {
    fence_proxy_async_shared();
    __syncwarp();
    if (lane == 0) tma_store_2d(map, r0, static_cast<int>(row), tile);
  };
  const bool both = h16.S != nullptr && h16.M != nullptr;
  auto ready_tile = [&] {
    if (lane == 0) {
      if (both) bulk_wait_read<1>();  // the older of the last two copies: this tile's (S's and M's alternate)
      else bulk_wait_read<0>();
    }
    __syncwarp();
  };
  // HIST: a slab's 16-bit A fragments (16-row blocks; rows g and g + 8 of each lane at inverse scales inv0
  // and inv1) brought to the slab's scale (slab_ratio) and transposed into a staging tile once its last
  // copy has read it; returns the slab's inverse scale.
  auto stage_slab = [&](const auto& frag, float inv0, float inv1, char* tile) {
    constexpr int NB = static_cast<int>(std::extent_v<std::remove_reference_t<decltype(frag)>>);
    const float inv = slab_inverse(inv0, inv1);
    const unsigned two0 = slab_ratio(inv0, inv), two1 = slab_ratio(inv1, inv);
    ready_tile();
#pragma unroll
    for (int k = 0; k < NB; ++k) {
      const unsigned f[4] = {hmul2_bits(frag[k][0], two0), hmul2_bits(frag[k][1], two1), hmul2_bits(frag[k][2], two0),
                             hmul2_bits(frag[k][3], two1)};
      stmatrix_x4_trans(tile + row32_unit(16 * k + h_row, h_part), f);
    }
    return inv;
  };
  // HIST: the chunk's start state into a staging tile as S16's slab, from the float32 state sx itself at the
  // slab's scale (block (16 k .. of Dk, this warp's 16 columns) is to_a_fragment of sx's tiles 2 k and 2 k +
  // 1, as sa[k] holds them at each row's own scale), once the tile's last copy has read it; returns the
  // slab's inverse scale. It reads no register of sa, so it may run while products that take sa as their A
  // operand are in flight (the PTX ISA leaves any access to those registers before the products'
  // wgmma.wait_group undefined). Each value is rounded to float16 once, at the slab's scale: the same bits as
  // sa's values times the row's ratio (stage_slab) except where that ratio (under 2^-24: zero) or the product
  // falls below float16's normal range, where this rounds once instead of twice.
  auto stage_state = [&](char* tile) {
    const float inv = slab_inverse(sinv0, sinv1), sc = pow2_reciprocal(inv);
    ready_tile();
#pragma unroll
    for (int k = 0; k < NK / 2; ++k) {
      unsigned f[4];
      to_a_fragment(sx, k, sc, sc, f);
      stmatrix_x4_trans(tile + row32_unit(16 * k + h_row, h_part), f);
    }
    return inv;
  };
  // QK: slot b's q and k rows (in Qd's tile and in A's, DIR: B's) to Qd = scale e^G q and kdecay = e^{G_C - G} k in float16,
  // in place, by all the block's threads, each row by its scale from chunk_factors (scaled_half8: the same
  // bits as chunk_factors' own). The copy engine's swizzle moves 16-byte units within a row, so unit j of a
  // tile holds row (j / 8) % C. Each thread orders its writes before the products' reads (the async proxy);
  // the `scaled` barrier (the inference forward, waited for before the products that read the tiles) or the
  // block's barrier (the others) has both tiles whole.
  [[maybe_unused]] auto scale_qk = [&](int b) {
    if constexpr (QK) {
      constexpr int kUnits = static_cast<int>(Ring::kTile / 16) / (32 * NW);
      static_assert(kUnits * 32 * NW * 16 == static_cast<int>(Ring::kTile), "whole units a thread");
      const float* const sc = ring.qk(b);
      auto scale_tiles = [&](auto x) {  // the rows of the inputs' 16-bit kind X
        using X = decltype(x);
#pragma unroll
        for (int part = 0; part < 2; ++part) {
          char* const tile = part == 0 ? ring.Qd(b) : DIR ? ring.B(b) : ring.A(b);
#pragma unroll
          for (int m = 0; m < kUnits; ++m) {
            const int j = tid + 32 * NW * m;
            uint4* const unit = reinterpret_cast<uint4*>(tile + 16 * j);
            *unit = scaled_half8(reinterpret_cast<const X*>(unit), sc[part * C + (j / 8) % C]);
          }
        }
      };
      // The forward's kind is V's (UV); the reverse scan's is dO's, which q and k share (sd.raw: 2 for float16).
      if constexpr (DIR) {
        if (sd.raw == 2) scale_tiles(c10::Half{});
        else scale_tiles(c10::BFloat16{});
      } else {
        scale_tiles(VT{});
      }
      fence_proxy_async_shared();
      if constexpr (kScaledBar) {  // this warp's part done (its lanes' writes ordered before lane 0's arrival)
        __syncwarp();
        if (lane == 0) mbar_arrive(&scaled[b]);
      } else {
        __syncthreads();
      }
    }
  };
  int buf = 0;
  unsigned round = 0;
  for (int64_t i = 0; i < count; ++i) {
    const bool write = i >= skip;
    const int64_t chunk_at = static_cast<int64_t>(h) * N + chunk(i);
    // HIST: the chunk's start state into S16 (stage_state). With WG it is staged below, while the products of
    // M^T's first term run on the state's fragments.
    auto store_s_history = [&](float inv) {
      if (lane < DK / 16) h16.S_inv[(chunk_at * (DK / 16) + lane) * (DV / 16) + warp] = inv;
      store_tile(&maps.S16, chunk_at * DK, ring.hist_s(warp));
    };
    if constexpr (HIST && !WG)
      if (write && h16.S != nullptr) store_s_history(stage_state(ring.hist_s(warp)));
    if (FUSED && write) {  // this warp's columns of the chunk's gate rows, into its gate tile (padding rows: none)
      const ChunkRows row_of = so.rows.chunk(w0 + i);
      const O* const gate = static_cast<const O*>(fa.gate) + static_cast<int64_t>(h) * DV + r0;
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        const int u = lane + 32 * q, c = u / 2, part = u % 2;
        const int64_t row = row_of(c);
        if (row >= 0) cp_async16(ring.gate(warp) + c * 32 + part * 16, gate + row * fa.pl.gate_ld + 8 * part);
      }
      cp_async_commit();
    }
    mbar_wait(&full[buf], round & 1);
    scale_qk(buf);  // QK: Qd and kdecay formed before the step's products (fewer registers live than beside them)
    // (1) M^T = U^T - S^T B^T: two 8-column tiles of tokens a B load. (S^T Qd^T comes after M^T's
    // fragments, so that M^T's and o's accumulators are not live together.)
    float mt[NC][4] = {};
    [[maybe_unused]] float ut[UV != 0 ? NC : 1][4] = {};  // UV: U^T = V^T (T diag(beta))^T, this warp's 16 rows
    // UV: U^T with both operands in the slot: V's box of this warpgroup's 64 columns MN-major (its rows are the
    // chunk's tokens) against T diag(beta)'s two parts K-major (zero above their diagonal blocks), as Aq's
    // product reads Aq; issued as a group after S^T B^T's and waited for with it.
    [[maybe_unused]] auto u_products_issue = [&] {
      if constexpr (UV != 0) {
        const char* const vbox = ring.U(buf) + (warp / 4) * C * SW;
        wgmma_fence();
#pragma unroll
        for (int part = 0; part < 2; ++part)
#pragma unroll
          for (int k = 0; k < NC / 2; ++k)
            wgmma_m64n64k16_ss<VT, 1, 0>(ut, wgmma_desc_sw128(vbox + 16 * k * SW, 8 * SW, 8 * SW),
                                         wgmma_desc_sw128(ring.Tb(buf, part) + 32 * k, 16, 8 * 128));
        wgmma_commit();
      }
    };
    if constexpr (UV != 0 && !HIST) {
      state_products_issue(mt, ring.B(buf));
      u_products_issue();
      wgmma_wait<0>();
      wgmma_hold(mt);
      wgmma_hold(ut);
    } else if constexpr (HIST && WG) {
      // Staged on every chunk, so that no branch stands between the products and their wait (ptxas would
      // serialize them); stored for a written one.
      state_products_issue(mt, ring.B(buf));
      if constexpr (UV != 0) u_products_issue();
      const float inv = stage_state(ring.hist_s(warp));
      wgmma_wait<0>();
      wgmma_hold(mt);
      if constexpr (UV != 0) wgmma_hold(ut);
      if (write && h16.S != nullptr) store_s_history(inv);
    } else {
      state_products(mt, ring.B(buf));
    }
    // DIR: dO16^T's A fragments (row block k: the chunk's rows 16 k .. 16 k + 15), for both of its products;
    // M^T = -aq_inv do_inv dO16^T Aq - S^T B^T.
    [[maybe_unused]] unsigned da[NC / 2][4];
    [[maybe_unused]] float di0 = 0.f, di1 = 0.f;  // DIR: the inverse scales of dO^T's rows g and g + 8 in da
    if constexpr (DIR) {
#pragma unroll
      for (int k = 0; k < NC / 2; ++k) ldmatrix_x4_trans(da[k], ring.U(buf) + swizzled<SW, C>(16 * k + at_k, r0 + at_m));
      if (sd.raw != 0) {
        // dO's own 16-bit values: each row of dO^T (a state column over the chunk's tokens; registers 0 and
        // 2 of a fragment hold row g, 1 and 3 row g + 8) to float16 at its own power of two, as M's rows.
        // (Unpacked twice, for the maxima and for the scaling, rather than held: 32 more live registers.)
        const bool bf = sd.raw == 1;
        auto unpack = [bf](unsigned u) {
          return bf ? __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&u))
                    : __half22float2(*reinterpret_cast<const __half2*>(&u));
        };
        float mx0 = 0.f, mx1 = 0.f;
#pragma unroll
        for (int k = 0; k < NC / 2; ++k)
#pragma unroll
          for (int r = 0; r < 4; ++r) {
            const float2 f = unpack(da[k][r]);
            float& mx = r % 2 == 0 ? mx0 : mx1;
            mx = fmaxf(mx, fmaxf(fabsf(f.x), fabsf(f.y)));
          }
        Pow2Scale p0, p1;
        row_scales(mx0, mx1, p0, p1);
#pragma unroll
        for (int k = 0; k < NC / 2; ++k)
#pragma unroll
          for (int r = 0; r < 4; ++r) {
            const float2 f = unpack(da[k][r]);
            const float sc = r % 2 == 0 ? p0.scale : p1.scale;
            da[k][r] = pack_f16(f.x * sc, f.y * sc);
          }
        di0 = p0.inverse, di1 = p1.inverse;
      } else {
        di0 = di1 = *ring.do_inv(buf);
      }
      float ud[NC][4] = {};
      if constexpr (WG) {  // the whole of Aq (zero above its diagonal), MN-major
        wgmma_product<1>(ud, da, [&](int k) { return wgmma_desc_sw128(ring.Aq(buf) + 16 * k * 128, 8 * 128, 8 * 128); });
      } else {
#pragma unroll
        for (int p = 0; p < NC / 2; ++p)
#pragma unroll
          for (int k = p; k < NC / 2; ++k) {
            unsigned b4[4];
            ldmatrix_x4_trans(b4, ring.Aq(buf) + swizzled<128, C>(16 * k + bt_k, 16 * p + bt_n));
            const unsigned bl[2] = {b4[0], b4[1]}, bh[2] = {b4[2], b4[3]};
            mma_f16(ud[2 * p], da[k], bl);
            mma_f16(ud[2 * p + 1], da[k], bh);
          }
      }
      const float aqi = *ring.aq_inv(buf), du0 = -(aqi * di0), du1 = -(aqi * di1);
#pragma unroll
      for (int j = 0; j < NC; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) mt[j][e] = fmaf(e < 2 ? du0 : du1, ud[j][e], -(e < 2 ? sinv0 : sinv1) * mt[j][e]);
    } else if constexpr (UV != 0) {
      // M^T = U^T - S^T B^T, S^T's rows at their own scales.
#pragma unroll
      for (int j = 0; j < NC; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) mt[j][e] = fmaf(-(e < 2 ? sinv0 : sinv1), mt[j][e], ut[j][e]);
    } else {
      // M^T / u_inv = U16^T - (S^T B^T) / u_inv, row by row of M^T (U's columns r0 + g and r0 + g + 8, whose
      // scales are powers of two, so the quotients are exact): U16^T's tiles 2 p and 2 p + 1 by one
      // ldmatrix.trans of U's rows 16 p .. 16 p + 15 (matrices: rows + 0 / + 8 by columns r0 / r0 + 8).
      const float k0 = sinv0 * pow2_reciprocal(ring.u_inv(buf)[r0 + g]), k1 = sinv1 * pow2_reciprocal(ring.u_inv(buf)[r0 + g + 8]);
#pragma unroll
      for (int p = 0; p < NC / 2; ++p) {
        unsigned u4[4];
        ldmatrix_x4_trans(u4, ring.U(buf) + swizzled<SW, C>(16 * p + 8 * (lane / 16) + lane % 8, r0 + 8 * ((lane / 8) % 2)));
#pragma unroll
        for (int x = 0; x < 4; ++x) {
          const float2 u = __half22float2(*reinterpret_cast<const __half2*>(&u4[x]));
          float* const m = mt[2 * p + x / 2] + 2 * (x % 2);
          const float kx = x % 2 == 0 ? k0 : k1;
          m[0] = fmaf(-kx, m[0], u.x);
          m[1] = fmaf(-kx, m[1], u.y);
        }
      }
    }
    float m0, m1;
    row_max_abs(mt, m0, m1);
    Pow2Scale q0, q1;
    row_scales(m0, m1, q0, q1);
    unsigned ma[NC / 2][4];
    to_a_fragments(mt, q0.scale, q1.scale, ma);
    if constexpr (!DIR && UV == 0) q0.inverse *= ring.u_inv(buf)[r0 + g], q1.inverse *= ring.u_inv(buf)[r0 + g + 8];  // M^T's own inverse scales
    // HIST: the new values into M16: tile (16 p .. of the chunk, 8 of this warp's columns) is ma[p], the
    // fragments of M^T's tiles 2 p and 2 p + 1 (staged on every chunk, so that no branch stands between
    // the fragments and the reverse scan's wgmma on them; stored for a written one).
    auto write_m_history = [&] {
      if constexpr (HIST) {
        const float inv = stage_slab(ma, q0.inverse, q1.inverse, ring.hist_m(warp));
        if (write && h16.M != nullptr) {
          if (lane < 2 * (C / 16)) h16.M_inv[(chunk_at * (C / 16) + lane / 2) * (DV / 8) + 2 * warp + lane % 2] = inv;
          store_tile(&maps.M16, chunk_at * C, ring.hist_m(warp));
        }
      }
    };
    if constexpr (DIR) write_m_history();  // before the state's update, whose products hold more registers here
    if constexpr (kScaledBar) mbar_wait(&scaled[buf], round & 1);  // every warp's part of Qd and kdecay scaled
    // S^T Qd^T for a written chunk, on the same fragments of the state.
    float oq[NC][4] = {};
    if (write && !DIR) state_products(oq, ring.Qd(buf));
    // (2) S^T <- a S^T + M^T A_n, in two halves of Dk (the products' partial sums beside the state); DIR:
    // + do_inv dO16^T Qd.
    const float an = *ring.decay(buf);
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      float part[NK / 2][4] = {};
      [[maybe_unused]] float pz[NK / 2][4] = {};
      if constexpr (WG) {  // A_n's rows of this half (DIR: and Qd's): one 64-column box, MN-major
        wgmma_fence();
        constexpr unsigned rows8 = 8 * SW;
#pragma unroll
        for (int k = 0; k < NC / 2; ++k)
          wgmma_m64n64k16<1>(part, ma[k], wgmma_desc_sw128(ring.A(buf) + half * C * SW + 16 * k * SW, rows8, rows8));
        if constexpr (DIR)
#pragma unroll
          for (int k = 0; k < NC / 2; ++k)
            wgmma_m64n64k16<1>(pz, da[k], wgmma_desc_sw128(ring.Qd(buf) + half * C * SW + 16 * k * SW, rows8, rows8));
        wgmma_commit();
        wgmma_wait<0>();
        wgmma_hold(part);
        if constexpr (DIR) wgmma_hold(pz);
      } else {
#pragma unroll
        for (int k = 0; k < NC / 2; ++k)
#pragma unroll
          for (int p = 0; p < NK / 4; ++p) {
            unsigned b4[4];
            ldmatrix_x4_trans(b4, ring.A(buf) + swizzled<SW, C>(16 * k + bt_k, half * (DK / 2) + 16 * p + bt_n));
            const unsigned bl[2] = {b4[0], b4[1]}, bh[2] = {b4[2], b4[3]};
            mma_f16(part[2 * p], ma[k], bl);
            mma_f16(part[2 * p + 1], ma[k], bh);
            if constexpr (DIR) {
              unsigned z4[4];
              ldmatrix_x4_trans(z4, ring.Qd(buf) + swizzled<SW, C>(16 * k + bt_k, half * (DK / 2) + 16 * p + bt_n));
              const unsigned zl[2] = {z4[0], z4[1]}, zh[2] = {z4[2], z4[3]};
              mma_f16(pz[2 * p], da[k], zl);
              mma_f16(pz[2 * p + 1], da[k], zh);
            }
          }
      }
#pragma unroll
      for (int j = 0; j < NK / 2; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          float& x = sx[half * (NK / 2) + j][e];
          x = fmaf(part[j][e], e < 2 ? q0.inverse : q1.inverse, DIR ? fmaf(e < 2 ? di0 : di1, pz[j][e], an * x) : an * x);
        }
    }
    // This warp is done with the slot once Aq's product has read it (after the state's update on a warm-up chunk):
    // the forward's forms without the fusion release it there, before o's staging and stores and the next state's
    // fragments, and warp 0 refills it with chunk i + 2 once every warp has (with two slots a chunk's copies can
    // start only once the step two before has released their slot, so each release is as early as its last read).
    // The reverse scan and the fused forms release it at the step's end (earlier, ptxas spilled in them).
    constexpr bool kEarlyRelease = !DIR && !FUSED;
    [[maybe_unused]] auto release_slot = [&] {
      __syncwarp();
      if (lane == 0) mbar_arrive(&empty[buf]);
      if (warp == 0) {
        if (lane == 0 && i + kColumnStages < count) {
          mbar_wait(&empty[buf], round & 1);
          issue(i + kColumnStages, buf);
        }
        __syncwarp();
      }
    };
    if (kEarlyRelease && !write) release_slot();
    if (write && !DIR) {
      // o^T += aq_inv M^T Aq^T (Aq is zero above its diagonal: token tiles p take M's blocks k <= p).
      float oa[NC][4] = {};
      if constexpr (WG) {  // the whole of Aq (zero above its diagonal), K-major
        wgmma_product<0>(oa, ma, [&](int k) { return wgmma_desc_sw128(ring.Aq(buf) + 32 * k, 16, 8 * 128); });
      } else {
#pragma unroll
        for (int p = 0; p < NC / 2; ++p)
#pragma unroll
          for (int k = 0; k <= p; ++k) {
            unsigned b4[4];
            ldmatrix_x4(b4, ring.Aq(buf) + swizzled<128, C>(16 * p + a_row, 16 * k + a_col));
            const unsigned bl[2] = {b4[0], b4[2]}, bh[2] = {b4[1], b4[3]};
            mma_f16(oa[2 * p], ma[k], bl);
            mma_f16(oa[2 * p + 1], ma[k], bh);
          }
      }
      const float ai = *ring.aq_inv(buf);
      if constexpr (kEarlyRelease) release_slot();
      if constexpr (Ring::kStageInHist) ready_tile();  // the M history tile's last copy has read it
      // o^T's rows (this warp's 16 columns) into the warp's staging tile [C][16] as o's rows, then 16 bytes a lane.
      __half* const st16 = reinterpret_cast<__half*>(ring.stage(warp));
      __nv_bfloat16* const stb = reinterpret_cast<__nv_bfloat16*>(ring.stage(warp));
#pragma unroll
      for (int j = 0; j < NC; ++j) {
        float ss[2] = {0.f, 0.f};  // FUSED: the squares of rows 8 j + 2 t and 8 j + 2 t + 1 over the lane's two columns
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const float sc = e < 2 ? sinv0 : sinv1, mi = ai * (e < 2 ? q0.inverse : q1.inverse);
          const float x = fmaf(mi, oa[j][e], sc * oq[j][e]);
          const int c = 8 * j + 2 * t + (e & 1), r = g + (e >= 2 ? 8 : 0);
          if constexpr (FUSED) {
            const O xr = O(x);
            reinterpret_cast<O*>(ring.stage(warp))[c * 16 + r] = xr;
            const float v = static_cast<float>(xr);
            ss[e & 1] += v * v;
          } else if (so.bf16) stb[c * 16 + r] = __float2bfloat16_rn(x);
          else st16[c * 16 + r] = __float2half_rn(x);
        }
        if constexpr (FUSED) {  // over the warp's 16 columns (the lanes of one t), into the table
#pragma unroll
          for (int o = 4; o < 32; o <<= 1) {
            ss[0] += __shfl_xor_sync(0xffffffffu, ss[0], o);
            ss[1] += __shfl_xor_sync(0xffffffffu, ss[1], o);
          }
          if (g == 0) {
            float* const ps = ring.psum(static_cast<int>(i & 1));
            ps[(8 * j + 2 * t) * NW + warp] = ss[0];
            ps[(8 * j + 2 * t + 1) * NW + warp] = ss[1];
          }
        }
      }
    }
    if constexpr (!kEarlyRelease) {
      __syncwarp();
      if (lane == 0) mbar_arrive(&empty[buf]);  // this warp is done with the slot
    }
    if (FUSED && write) {
      // Every warp's sums of the chunk in the table (the barrier also keeps a warp from writing the table's
      // other half for chunk i + 1 before all have read it for chunk i - 1).
      group_sync<32 * NW>();
      cp_async_wait<0>();  // this lane's gate units (each lane reads only those it copied)
      const ChunkRows row_of = so.rows.chunk(w0 + i);
      const float* const ps = ring.psum(static_cast<int>(i & 1));
      const uint4 gamma = *reinterpret_cast<const uint4*>(static_cast<const O*>(fa.gamma) + static_cast<int64_t>(h) * DV + r0 +
                                                          8 * (lane % 2));
      O* const ydst = static_cast<O*>(fa.y) + static_cast<int64_t>(fa.pl.pos[h]) * DV + r0;
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        const int u = lane + 32 * q, c = u / 2, part = u % 2;
        float total = 0.f;
#pragma unroll
        for (int w = 0; w < NW; ++w) total += ps[c * NW + w];
        const float rstd = rsqrtf(total / static_cast<float>(DV) + fa.eps);
        uint4 v = *reinterpret_cast<const uint4*>(ring.stage(warp) + c * 32 + part * 16);
        uint4 gv = *reinterpret_cast<const uint4*>(ring.gate(warp) + c * 32 + part * 16), gm = gamma, out;
        const P2* const vp = reinterpret_cast<const P2*>(&v);
        const P2* const gp = reinterpret_cast<const P2*>(&gv);
        const P2* const mp = reinterpret_cast<const P2*>(&gm);
        P2* const op = reinterpret_cast<P2*>(&out);
#pragma unroll
        for (int k = 0; k < 4; ++k)
          op[k] = fusion_pair<FUSE, O>(Pair16<O>::to_float2(vp[k]), rstd, Pair16<O>::to_float2(gp[k]), mp[k]);
        const int64_t row = row_of(c);
        if (row >= 0) store_global16(ydst + row * fa.pl.y_ld + 8 * part, out);  // one store (the assignment compiled to pieces)
      }
    } else if (write && !DIR) {
      const ChunkRows row_of = so.rows.chunk(w0 + i);
#pragma unroll
      for (int q = 0; q < 4; ++q) {  // C rows of two 16-byte units
        const int u = lane + 32 * q, c = u / 2, part = u % 2;
        const int64_t row = row_of(c);
        const uint4 v = *reinterpret_cast<const uint4*>(ring.stage(warp) + c * 32 + part * 16);
        if (row >= 0) {
          char* const dst = static_cast<char*>(so.o) + ((row * H + h) * DV + r0 + 8 * part) * 2;
          *reinterpret_cast<uint4*>(dst) = v;
        }
      }
    }
    if constexpr (!DIR) write_m_history();  // here, where the step's accumulators are free
    // The state's 16-bit fragments for the next chunk (its start state).
    publish();
    if constexpr (!kEarlyRelease) {
      if (warp == 0) {  // refill this slot with chunk i + 2 once every warp has released it
        if (lane == 0 && i + kColumnStages < count) {
          mbar_wait(&empty[buf], round & 1);
          issue(i + kColumnStages, buf);
        }
        __syncwarp();
      }
    }
    __syncwarp();  // the staging tile is read before the next chunk writes it
    if (++buf == kColumnStages) buf = 0, ++round;
  }
  if constexpr (HIST)
    if (lane == 0) bulk_wait<0>();  // the history's copies done before the block's shared memory goes
  if (last) {
    float* dst = fin + (static_cast<int64_t>(s) * H + h) * state;
#pragma unroll
    for (int j = 0; j < NK; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) dst[static_cast<int64_t>(8 * j + 2 * t + (e & 1)) * DV + r0 + g + (e >= 2 ? 8 : 0)] = sx[j][e];
  }
#else
  __trap();
#endif
}

// A 2-D tensor map over x's leading dimensions flattened into rows, with boxes of box_rows x box_cols.
// low_rank_scan has checked the layout the map assumes: unit column stride, rows packed one after
// another at a stride of a multiple of 16 bytes, a 16-byte aligned start.
CUtensorMap tensor_map_2d(const at::Tensor& x, int64_t box_rows, int64_t box_cols, CUtensorMapSwizzle swizzle,
                          const char* what) {
  const int64_t cols = x.size(-1), rows = x.numel() / cols, ld = x.stride(-2), elem = x.element_size();
  if (rows > std::numeric_limits<int32_t>::max())  // the copy's row coordinate is a 32-bit integer
    throw std::invalid_argument(std::string("hh::kernels::low_rank_scan: ") + what + " has more than 2^31 - 1 rows");
  const cuuint64_t dims[2] = {static_cast<cuuint64_t>(cols), static_cast<cuuint64_t>(rows)};
  const cuuint64_t strides[1] = {static_cast<cuuint64_t>(ld * elem)};
  const cuuint32_t box[2] = {static_cast<cuuint32_t>(box_cols), static_cast<cuuint32_t>(box_rows)};
  return encode_tensor_map(elem == 2 ? CU_TENSOR_MAP_DATA_TYPE_FLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT32, 2, x.data_ptr(), dims,
                           strides, box, swizzle, "low_rank_scan", what);
}
// The four maps of packed lower matrices of 16-bit values ([..., kPackedLower], contiguous: Aq, or T diag(beta)'s
// two parts as chunks 2 c and 2 c + 1) for load_packed: block row b as a [chunks][16][16 (b + 1)] tensor from
// packed_lower_row(b), a chunk's kPackedLower values apart, in boxes of one chunk's 16 rows of 64 columns
// swizzled at 128 bytes (the scans' [C][C] tile).
void packed_maps(const at::Tensor& x, const char* what, CUtensorMap (&maps)[4]) {
  const int64_t chunks = x.numel() / kPackedLower;
  if (chunks > std::numeric_limits<int32_t>::max())  // the copy's chunk coordinate is a 32-bit integer
    throw std::invalid_argument(std::string("hh::kernels::low_rank_scan: ") + what + " has more than 2^31 - 1 chunks");
  for (int b = 0; b < 4; ++b) {
    const cuuint64_t dims[3] = {static_cast<cuuint64_t>(16 * (b + 1)), 16, static_cast<cuuint64_t>(chunks)};
    const cuuint64_t strides[2] = {static_cast<cuuint64_t>(16 * (b + 1) * 2), static_cast<cuuint64_t>(kPackedLower * 2)};
    const cuuint32_t box[3] = {64, 16, 1};
    maps[b] = encode_tensor_map(CU_TENSOR_MAP_DATA_TYPE_FLOAT16, 3, static_cast<char*>(x.data_ptr()) + 2 * packed_lower_row(b), dims,
                                strides, box, CU_TENSOR_MAP_SWIZZLE_128B, "low_rank_scan", what);
  }
}
// The factor that gives a scan's shapes and dtype: B, or A where B is not given (the reverse scan reading k
// where it lies, LowRankScanArgs::Direct::k).
const at::Tensor& scan_factor(const LowRankScanArgs& a) { return a.B.defined() ? a.B : a.A; }

// With blocks_do false, the caller encodes dO16's map in its own boxes (the column scan's), and it is not
// encoded here in the blocks' too.
template <int DK, int BV>
ScanMaps scan_maps(const LowRankScanArgs& a, bool blocks_do = true) {
  using Ring = F16Ring<DK, 3, BV>;  // the boxes do not depend on the ring's depth or OUT
  const CUtensorMapSwizzle sw = Ring::SW == 128  ? CU_TENSOR_MAP_SWIZZLE_128B
                                : Ring::SW == 64 ? CU_TENSOR_MAP_SWIZZLE_64B
                                                 : CU_TENSOR_MAP_SWIZZLE_32B;
  const CUtensorMapSwizzle slice_sw = Ring::kSliceSwizzle == 128 ? CU_TENSOR_MAP_SWIZZLE_128B : CU_TENSOR_MAP_SWIZZLE_64B;
  ScanMaps m{};
  if (a.A.defined()) m.A = tensor_map_2d(a.A, Ring::C, Ring::kBoxCols, sw, "A");  // (not given with UFromV::q: k's rows instead)
  if (a.B.defined()) m.B = tensor_map_2d(a.B, Ring::C, Ring::kBoxCols, sw, "B");  // (not given with Direct::k: k's rows)
  m.has_u = a.U.defined();
  m.has_z = a.Z.defined();
  if (m.has_u && a.U.scalar_type() == at::kHalf) {  // the column scan's: A's boxes, and a chunk's scales a row
    m.U = tensor_map_2d(a.U, Ring::C, Ring::kBoxCols, sw, "U");
    m.U_inv = tensor_map_2d(a.U_inv, 1, a.U_inv.size(-1), CU_TENSOR_MAP_SWIZZLE_NONE, "U_inv");
  } else if (m.has_u) {
    m.U = tensor_map_2d(a.U, Ring::C, Ring::BV, slice_sw, "U");
  }
  if (m.has_z) m.Z = tensor_map_2d(a.Z, DK, Ring::BV, slice_sw, "Z");
  if (a.output.o.defined() || a.output.fusion != nullptr) {  // the output written, or through the fusion
    if (a.output.Qd.defined()) m.Qd = tensor_map_2d(a.output.Qd, Ring::C, Ring::kBoxCols, sw, "Qd");  // (likewise: q's rows)
    packed_maps(a.output.Aq, "Aq", m.Aq);
  }
  if (a.direct.Aq.defined()) {  // the direct term, with dO16 or (the column scan's, encoded by its caller) dO
    if (a.direct.Qd.defined()) m.Qd = tensor_map_2d(a.direct.Qd, Ring::C, Ring::kBoxCols, sw, "direct.Qd");  // (likewise: q's rows)
    packed_maps(a.direct.Aq, "direct.Aq", m.Aq);
    if (blocks_do && a.direct.dO16.defined())
      m.dO = tensor_map_2d(a.direct.dO16, Ring::C, Ring::BV, Ring::kDoSwizzle == 64 ? CU_TENSOR_MAP_SWIZZLE_64B : CU_TENSOR_MAP_SWIZZLE_32B,
                           "direct.dO16");
  }
  return m;
}

// The blocks of one scan: `table` on the device holds the S + 1 sequence offsets, then (sequence,
// lo, hi) for each of the block float16 kernel's `segments`; with two_stages, that kernel's two-slot
// ring (two blocks an SM); `columns` the state's columns a block of that kernel owns (16 or 32).
struct ScanPlan {
  at::Tensor table;
  int64_t segments = 0;
  bool two_stages = false;
  int columns = 16;
  FusedOutputArgs fused;  // LowRankScanArgs::Output::fusion's tensors, as low_rank_scan checked them
};

// At least n float32 zeros on the current device, never written once zeroed: the start states of scans
// whose sequences all start from zero (LowRankScanArgs::zero_start), read where y0 would be, so that no
// kernel zeroes states on every call. A larger need zeroes a larger buffer once (the device then synced,
// so that every stream sees the zeros); the smaller ones stay, since kernels queued on other streams may
// still read them.
const float* zero_states(int64_t n) {
  static std::mutex mutex;
  static std::map<int, std::vector<at::Tensor>> by_device;  // each device's buffers, the largest last
  const std::lock_guard<std::mutex> lock(mutex);
  std::vector<at::Tensor>& held = by_device[at::cuda::current_device()];
  if (held.empty() || held.back().numel() < n) {
    held.push_back(at::zeros({std::max<int64_t>(n, int64_t{1} << 20)}, at::TensorOptions().dtype(at::kFloat).device(at::kCUDA)));
    C10_CUDA_CHECK(cudaDeviceSynchronize());
  }
  return held.back().data_ptr<float>();
}
// The start states a scan reads: y0's, or zeros where every sequence starts from zero.
const float* start_states(const LowRankScanArgs& a) { return a.zero_start ? zero_states(a.y0.numel()) : a.y0.data_ptr<float>(); }

template <int DK, int STAGES, int BV, bool OUT, bool DIR = false, int FUSE = -1, class O = c10::BFloat16>
void launch_low_rank_scan_f16(const LowRankScanArgs& a, const ScanPlan& plan, at::Tensor& fin) {
  const int H = static_cast<int>(a.B.size(0)), Dv = static_cast<int>(a.y0.size(3));
  const int64_t N = a.B.size(1), S = a.y0.size(0);
  auto ptr = [](const at::Tensor& x) { return x.defined() ? x.data_ptr<float>() : nullptr; };
  auto half = [](const at::Tensor& x) { return x.defined() ? reinterpret_cast<__half*>(x.data_ptr<c10::Half>()) : nullptr; };
  constexpr size_t smem = F16Ring<DK, STAGES, BV, OUT, DIR, (FUSE >= 0)>::kBytes;
  static_assert(smem <= 227 * 1024, "the ring must fit in an SM's shared memory");
  auto kernel = low_rank_scan_f16_kernel<DK, STAGES, BV, OUT, DIR, FUSE, O>;
  ScanOut so{};
  ScanDirect sd{};
  FusedOutputArgs fa{};
  if constexpr (DIR) sd = {a.direct.aq_inv.data_ptr<float>(), a.direct.do_inv.data_ptr<float>()};
  if constexpr (OUT) {
    const LowRankScanArgs::Output& o = a.output;
    if constexpr (FUSE >= 0) fa = plan.fused;
    so = {o.aq_inv.data_ptr<float>(), FUSE >= 0 ? nullptr : o.o.data_ptr(), slot_rows(o.grid, o.B, o.T),
          o.o.defined() && o.o.scalar_type() == at::kBFloat16};
  }
  allow_dynamic_smem(kernel, smem);
  const F16History h16{half(a.S16), ptr(a.S_inv), half(a.M16), ptr(a.M_inv)};
  const int64_t* table = plan.table.data_ptr<int64_t>();
  const dim3 grid(static_cast<unsigned>(plan.segments * (Dv / BV)), static_cast<unsigned>(H));
  if constexpr (FUSE >= 0) {  // a segment's Dv / BV blocks of a head in one cluster
    g_fused_scan_launches.fetch_add(1, std::memory_order_relaxed);
    launch_cluster_kernel(kernel, grid, dim3(static_cast<unsigned>(Dv / BV), 1, 1), scan_threads<DK, true>(), smem, scan_maps<DK, BV>(a),
                          a.decay.data_ptr<float>(), ptr(a.bound), start_states(a), ptr(a.hist), ptr(a.M),
                          fin.data_ptr<float>(), table, table + S + 1, H, N, Dv, a.reverse, h16, so, sd, fa);
    return;
  }
  kernel<<<grid, scan_threads<DK, false>(), smem, at::cuda::getCurrentCUDAStream()>>>(
      scan_maps<DK, BV>(a), a.decay.data_ptr<float>(), ptr(a.bound), start_states(a), ptr(a.hist), ptr(a.M), fin.data_ptr<float>(),
      table, table + S + 1, H, N, Dv, a.reverse, h16, so, sd, fa);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// The column scan (column_scan_kernel): one block a (segment, head), Dv / 16 warps; FUSE >= 0 with the
// fusion norm into y of O; HIST writing S16 and M16, whichever is given; DIR the reverse scan forming the
// direct term (with HIST).
template <int DK, int DV, int FUSE = -1, class O = c10::BFloat16, bool HIST = false, bool DIR = false, bool WG = false, int UV = 0,
          bool QK = false>
void launch_column_scan(const LowRankScanArgs& a, const ScanPlan& plan, at::Tensor& fin) {
  using Ring = ColumnRing<DK, DV, (FUSE >= 0), HIST, (UV != 0), QK>;
  const int H = static_cast<int>(scan_factor(a).size(0));
  const int64_t N = scan_factor(a).size(1), S = a.y0.size(0);
  constexpr size_t smem = Ring::kBytes;
  auto kernel = column_scan_kernel<DK, DV, FUSE, O, HIST, DIR, WG, UV, QK>;
  auto half = [](const at::Tensor& x) { return x.defined() ? reinterpret_cast<__half*>(x.data_ptr<c10::Half>()) : nullptr; };
  auto ptr = [](const at::Tensor& x) { return x.defined() ? x.data_ptr<float>() : nullptr; };
  const F16History h16{half(a.S16), ptr(a.S_inv), half(a.M16), ptr(a.M_inv)};
  const LowRankScanArgs::Output& o = a.output;
  ScanOut so{};
  ScanDirect sd{};
  ScanMaps maps = scan_maps<DK, 32>(a, /*blocks_do=*/false);
  if constexpr (HIST) {  // a warp's staging tile of 16 columns (32 bytes a row, their swizzle) a box
    if (a.S16.defined()) maps.S16 = tensor_map_2d(a.S16, DK, 16, CU_TENSOR_MAP_SWIZZLE_32B, "S16");
    if (a.M16.defined()) maps.M16 = tensor_map_2d(a.M16, Ring::C, 16, CU_TENSOR_MAP_SWIZZLE_32B, "M16");
  }
  if constexpr (DIR) {
    const LowRankScanArgs::Direct& d = a.direct;
    if (d.dO.defined()) {  // dO where it lies (reverse_scan_reads_dO_in_place): its [B T, H Dv] rows, the factors' boxes and swizzle
      const int64_t B = d.dO.size(0), T = d.dO.size(1);
      sd = {d.aq_inv.data_ptr<float>(), nullptr, d.dO.scalar_type() == at::kBFloat16 ? 1 : 2, T, d.grid.per};
      g_dO_in_place_scans.fetch_add(1, std::memory_order_relaxed);
      maps.dO = tensor_map_2d(d.dO.view({B * T, -1}), Ring::C, Ring::kBoxCols, CU_TENSOR_MAP_SWIZZLE_128B, "direct.dO");
    } else {
      sd = {d.aq_inv.data_ptr<float>(), d.do_inv.data_ptr<float>(), 0, 0, 0};
      // dO16's tile in U's place: the factors' boxes and swizzle.
      maps.dO = tensor_map_2d(d.dO16, Ring::C, Ring::kBoxCols, CU_TENSOR_MAP_SWIZZLE_128B, "direct.dO16");
    }
  } else {
    so = {o.aq_inv.data_ptr<float>(), FUSE >= 0 ? nullptr : o.o.data_ptr(), slot_rows(o.grid, o.B, o.T),
          FUSE < 0 && o.o.scalar_type() == at::kBFloat16};
  }
  if constexpr (UV != 0) {  // v's [B T, H Dv] rows in the factors' boxes and swizzle; T diag(beta)'s parts as 2 H N chunks
    const at::Tensor& v = a.u_from_v.v;
    maps.U = tensor_map_2d(v.view({v.size(0) * v.size(1), -1}), Ring::C, Ring::kBoxCols, CU_TENSOR_MAP_SWIZZLE_128B, "u_from_v.v");
    packed_maps(a.u_from_v.Tb, "u_from_v.Tb", maps.Tb);
    g_u_in_scan_launches.fetch_add(1, std::memory_order_relaxed);
  }
  if constexpr (QK) {  // q's and k's rows in the same boxes, where Qd's and kdecay's tiles lie; their rows' scales a chunk a row
    const at::Tensor &q = DIR ? a.direct.q : a.u_from_v.q, &k = DIR ? a.direct.k : a.u_from_v.k, &QKs = DIR ? a.direct.QK : a.u_from_v.QK;
    const std::string from = DIR ? "direct." : "u_from_v.";
    maps.Qd = tensor_map_2d(q.view({q.size(0) * q.size(1), -1}), Ring::C, Ring::kBoxCols, CU_TENSOR_MAP_SWIZZLE_128B, (from + "q").c_str());
    (DIR ? maps.B : maps.A) =
        tensor_map_2d(k.view({k.size(0) * k.size(1), -1}), Ring::C, Ring::kBoxCols, CU_TENSOR_MAP_SWIZZLE_128B, (from + "k").c_str());
    maps.QK = tensor_map_2d(QKs.view({-1, 2 * Ring::C}), 1, 2 * Ring::C, CU_TENSOR_MAP_SWIZZLE_NONE, (from + "QK").c_str());
    g_qk_in_scan_launches.fetch_add(1, std::memory_order_relaxed);
  }
  FusedOutputArgs fa{};
  if constexpr (FUSE >= 0) fa = plan.fused;
  allow_dynamic_smem(kernel, smem);
  const int64_t* table = plan.table.data_ptr<int64_t>();
  const dim3 grid(static_cast<unsigned>(plan.segments), static_cast<unsigned>(H));
  g_column_scan_launches.fetch_add(1, std::memory_order_relaxed);
  kernel<<<grid, 32 * (DV / 16), smem, at::cuda::getCurrentCUDAStream()>>>(
      maps, a.decay.data_ptr<float>(), a.bound.defined() ? a.bound.data_ptr<float>() : nullptr, start_states(a),
      fin.data_ptr<float>(), table, table + S + 1, H, N, so, fa, h16, sd);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// 1 in the code the device runs where that code has the warpgroup products (a build for sm_90a), else 0.
__global__ void wgmma_built_kernel(int* out) { *out = HH_WGMMA; }

}  // namespace

bool scan_wgmma_available() {
  if (!at::cuda::is_available()) return false;
  static std::mutex mutex;
  static std::map<int, bool> known;  // by device
  const int device = at::cuda::current_device();
  const std::lock_guard<std::mutex> lock(mutex);
  if (const auto it = known.find(device); it != known.end()) return it->second;
  bool built = false;
  if (copy_engine_available()) {
    const at::Tensor flag = at::zeros({1}, at::TensorOptions().dtype(at::kInt).device(at::kCUDA, device));
    wgmma_built_kernel<<<1, 1, 0, at::cuda::getCurrentCUDAStream()>>>(flag.data_ptr<int>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    built = flag.item<int>() != 0;
  }
  return known[device] = built;
}

// Every instance of the scan with the fusion has the same shared memory and threads (one block an SM);
// the bfloat16 SiLU one stands for them.
int64_t fused_scan_slots(int cs) {
  if (cs < 1 || cs > 8) throw std::invalid_argument("hh::kernels::fused_scan_slots: 1 to 8 blocks a cluster");
  static std::mutex mutex;
  static std::map<std::pair<int, int>, int64_t> known;  // (device, cs)
  const int device = at::cuda::current_device();
  const std::lock_guard<std::mutex> lock(mutex);
  if (const auto it = known.find({device, cs}); it != known.end()) return it->second;
  auto kernel = low_rank_scan_f16_kernel<128, 3, 32, true, false, static_cast<int>(GateActivation::kSilu), c10::BFloat16>;
  constexpr size_t smem = F16Ring<128, 3, 32, true, false, true>::kBytes;
  allow_dynamic_smem(kernel, smem);
  const ClusterLaunch one(dim3(static_cast<unsigned>(cs)), dim3(static_cast<unsigned>(cs)), scan_threads<128, true>(), smem);
  int clusters = 0;
  C10_CUDA_CHECK(cudaOccupancyMaxActiveClusters(&clusters, kernel, &one.cfg));
  return known[{device, cs}] = static_cast<int64_t>(clusters) * cs;
}

namespace {

template <int DK, class F>
void launch_low_rank_scan(const LowRankScanArgs& a, const ScanPlan& plan, at::Tensor& fin) {
  const int H = static_cast<int>(scan_factor(a).size(0)), Dv = static_cast<int>(a.y0.size(3));
  const int64_t N = scan_factor(a).size(1), S = a.y0.size(0);
  const dim3 grid(static_cast<unsigned>(Dv / 16), static_cast<unsigned>(H), static_cast<unsigned>(S));
  auto ptr = [](const at::Tensor& x) { return x.defined() ? x.data_ptr<float>() : nullptr; };
  const at::Tensor& offsets = plan.table;
  if constexpr (std::is_same_v<F, c10::Half>) {
    if (a.precision == ScanPrecision::kBlockFloat16) {
      if (!copy_engine_available())
        throw std::invalid_argument("hh::kernels::low_rank_scan: block float16 products need compute capability 9.0 (Hopper)");
      // With the output or the direct term, two blocks no longer fit an SM (their slots hold Qd and Aq):
      // three slots.
      if (a.output.fusion != nullptr) {
        if constexpr (DK == 128) {  // scan_output_fusion_supported
          const bool bf16 = a.output.y.scalar_type() == at::kBFloat16;
          auto launch = [&](auto act) {  // the column scan where it takes the fusion, else a cluster of column blocks
            constexpr int A = decltype(act)::value;
            if (plan.columns == 128 && bf16) launch_column_scan<128, 128, A, c10::BFloat16>(a, plan, fin);
            else if (plan.columns == 128) launch_column_scan<128, 128, A, c10::Half>(a, plan, fin);
            else if (plan.columns == 64 && bf16) launch_column_scan<128, 64, A, c10::BFloat16>(a, plan, fin);
            else if (plan.columns == 64) launch_column_scan<128, 64, A, c10::Half>(a, plan, fin);
            else if (bf16) launch_low_rank_scan_f16<DK, 3, 32, true, false, A, c10::BFloat16>(a, plan, fin);
            else launch_low_rank_scan_f16<DK, 3, 32, true, false, A, c10::Half>(a, plan, fin);
          };
          switch (a.output.fusion->act) {
            case GateActivation::kSigmoid: launch(std::integral_constant<int, 1>{}); break;
            case GateActivation::kSilu: launch(std::integral_constant<int, 2>{}); break;
            default: launch(std::integral_constant<int, 0>{}); break;
          }
        }
      } else if (a.output.o.defined() && plan.columns >= 64) {  // the column scan (low_rank_scan's plan)
        if constexpr (DK == 128) {
          const bool hist = a.S16.defined() || a.M16.defined();
          const int uv = !a.u_from_v.v.defined() ? 0 : a.u_from_v.v.scalar_type() == at::kBFloat16 ? 1 : 2;
          auto launch = [&](auto wg) {  // the products by warpgroup (scan_wgmma) or by warp
            constexpr bool W = decltype(wg)::value;
            if constexpr (W) {  // U formed from V (low_rank_scan has checked the path: by warpgroup)
              if (uv != 0) {  // with or without the history, q and k read in place or their factors
                auto with = [&](auto h, auto qk) {
                  constexpr bool HI = decltype(h)::value, Q = decltype(qk)::value;
                  if (plan.columns == 128 && uv == 1) launch_column_scan<128, 128, -1, c10::BFloat16, HI, false, true, 1, Q>(a, plan, fin);
                  else if (plan.columns == 128) launch_column_scan<128, 128, -1, c10::BFloat16, HI, false, true, 2, Q>(a, plan, fin);
                  else if (uv == 1) launch_column_scan<128, 64, -1, c10::BFloat16, HI, false, true, 1, Q>(a, plan, fin);
                  else launch_column_scan<128, 64, -1, c10::BFloat16, HI, false, true, 2, Q>(a, plan, fin);
                };
                const bool qk = a.u_from_v.q.defined();
                if (hist && qk) with(std::true_type{}, std::true_type{});
                else if (hist) with(std::true_type{}, std::false_type{});
                else if (qk) with(std::false_type{}, std::true_type{});
                else with(std::false_type{}, std::false_type{});
                return;
              }
            }
            if (plan.columns == 128 && hist) launch_column_scan<128, 128, -1, c10::BFloat16, true, false, W>(a, plan, fin);
            else if (plan.columns == 128) launch_column_scan<128, 128, -1, c10::BFloat16, false, false, W>(a, plan, fin);
            else if (hist) launch_column_scan<128, 64, -1, c10::BFloat16, true, false, W>(a, plan, fin);
            else launch_column_scan<128, 64, -1, c10::BFloat16, false, false, W>(a, plan, fin);
          };
          if (g_scan_wgmma && scan_wgmma_available()) launch(std::true_type{});
          else launch(std::false_type{});
        }
      } else if (a.output.o.defined()) {
        if constexpr (DK >= 64) {  // chunk_factors' head sizes (low_rank_scan refuses the output for others)
          if (plan.columns == 32) launch_low_rank_scan_f16<DK, 3, 32, true>(a, plan, fin);
          else launch_low_rank_scan_f16<DK, 3, 16, true>(a, plan, fin);
        }
      } else if ((a.direct.dO16.defined() || a.direct.dO.defined()) && plan.columns >= 64) {  // the column scan, reverse (low_rank_scan's plan)
        if constexpr (DK == 128) {
          auto launch = [&](auto wg) {  // the products by warpgroup (scan_wgmma) or by warp
            constexpr bool W = decltype(wg)::value;
            if constexpr (W)
              if (a.direct.q.defined()) {  // q and k read in place (low_rank_scan has checked the path: by warpgroup)
                if (plan.columns == 128) launch_column_scan<128, 128, -1, c10::BFloat16, true, true, true, 0, true>(a, plan, fin);
                else launch_column_scan<128, 64, -1, c10::BFloat16, true, true, true, 0, true>(a, plan, fin);
                return;
              }
            if (plan.columns == 128) launch_column_scan<128, 128, -1, c10::BFloat16, true, true, W>(a, plan, fin);
            else launch_column_scan<128, 64, -1, c10::BFloat16, true, true, W>(a, plan, fin);
          };
          if (g_scan_wgmma && scan_wgmma_available()) launch(std::true_type{});
          else launch(std::false_type{});
        }
      } else if (a.direct.dO16.defined()) {
        if constexpr (DK >= 64) {  // likewise
          if (plan.columns == 32) launch_low_rank_scan_f16<DK, 3, 32, false, true>(a, plan, fin);
          else launch_low_rank_scan_f16<DK, 3, 16, false, true>(a, plan, fin);
        }
      } else if (plan.columns == 32) launch_low_rank_scan_f16<DK, 3, 32, false>(a, plan, fin);
      else if (plan.two_stages) launch_low_rank_scan_f16<DK, 2, 16, false>(a, plan, fin);
      else launch_low_rank_scan_f16<DK, 3, 16, false>(a, plan, fin);
      return;
    }
  }
  constexpr size_t smem = low_rank_smem_bytes<DK, F>();
  const bool precise = a.precision == ScanPrecision::kFloat32;
  auto kernel = precise ? low_rank_scan_kernel<DK, true, F> : low_rank_scan_kernel<DK, false, F>;
  allow_dynamic_smem(kernel, smem);
  kernel<<<grid, 2 * DK, smem, at::cuda::getCurrentCUDAStream()>>>(
      a.A.data_ptr<F>(), a.B.data_ptr<F>(), a.decay.data_ptr<float>(), ptr(a.U), ptr(a.Z), start_states(a),
      ptr(a.hist), ptr(a.M), fin.data_ptr<float>(), offsets.data_ptr<int64_t>(), H, N, Dv, a.A.stride(2),
      a.B.stride(2), a.U.defined() ? a.U.stride(2) : Dv, a.reverse);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <class F>
void launch_low_rank_scan(int64_t Dk, const LowRankScanArgs& a, const ScanPlan& plan, at::Tensor& fin) {
  switch (Dk) {
    case 32: launch_low_rank_scan<32, F>(a, plan, fin); break;
    case 64: launch_low_rank_scan<64, F>(a, plan, fin); break;
    default: launch_low_rank_scan<128, F>(a, plan, fin); break;
  }
}

// ---- copies between [B, T, H, D] and the chunk grid [H, B * per, C, D]: one thread an 8-element pack ----
template <class T>
__global__ void to_grid_kernel(const T* __restrict__ x, float* __restrict__ y, int64_t packs, int64_t Tn, int64_t H,
                               int64_t D8, int64_t C, int64_t per, int64_t B, float scale) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < packs;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t p = i % D8, R = i / D8;  // R = (h * B * per + n) * C + c
    const int64_t c = R % C, rest = R / C, n = rest % (B * per), h = rest / (B * per);
    const int64_t b = n / per, t = (n % per) * C + c;
    float4* dst = reinterpret_cast<float4*>(y + i * 8);
    if (t >= Tn) {
      dst[0] = dst[1] = make_float4(0.f, 0.f, 0.f, 0.f);
      continue;
    }
    const uint4 raw = *reinterpret_cast<const uint4*>(x + ((b * Tn + t) * H + h) * D8 * 8 + p * 8);
    const T* v = reinterpret_cast<const T*>(&raw);
    dst[0] = make_float4(scale * static_cast<float>(v[0]), scale * static_cast<float>(v[1]),
                         scale * static_cast<float>(v[2]), scale * static_cast<float>(v[3]));
    dst[1] = make_float4(scale * static_cast<float>(v[4]), scale * static_cast<float>(v[5]),
                         scale * static_cast<float>(v[6]), scale * static_cast<float>(v[7]));
  }
}

template <class T>
__global__ void from_grid_kernel(const float* __restrict__ y, T* __restrict__ x, int64_t packs, int64_t Tn, int64_t H,
                                 int64_t D8, int64_t C, int64_t per, int64_t N, float scale) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < packs;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t p = i % D8, r = i / D8;  // r = (b * Tn + t) * H + h
    const int64_t h = r % H, bt = r / H, t = bt % Tn, b = bt / Tn;
    const int64_t n = b * per + t / C, c = t % C;
    const float4* src = reinterpret_cast<const float4*>(y + ((h * N + n) * C + c) * D8 * 8 + p * 8);
    const float4 u = src[0], w = src[1];
    T v[8] = {T(scale * u.x), T(scale * u.y), T(scale * u.z), T(scale * u.w),
              T(scale * w.x), T(scale * w.y), T(scale * w.z), T(scale * w.w)};
    *reinterpret_cast<uint4*>(x + i * 8) = *reinterpret_cast<const uint4*>(v);
  }
}

unsigned copy_blocks(int64_t packs) {
  return static_cast<unsigned>(std::min<int64_t>((packs + 255) / 256, int64_t{1} << 20));
}

// ---- row dot products: one warp a row ----
constexpr int kRowDotWarps = 8;

__global__ void __launch_bounds__(kRowDotWarps * 32)
    row_dot_kernel(const float* __restrict__ a, const float* __restrict__ b, float* __restrict__ out, int64_t rows,
                   int64_t D, bool vec) {
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kRowDotWarps + threadIdx.x / 32;
  if (row >= rows) return;
  const int lane = threadIdx.x % 32;
  const float* x = a + row * D;
  const float* y = b + row * D;
  float s = 0.f;
  if (vec) {
    for (int64_t i = 4 * lane; i < D; i += 128) {
      const float4 u = *reinterpret_cast<const float4*>(x + i), v = *reinterpret_cast<const float4*>(y + i);
      s = fmaf(u.x, v.x, fmaf(u.y, v.y, fmaf(u.z, v.z, fmaf(u.w, v.w, s))));
    }
  } else {
    for (int64_t i = lane; i < D; i += 32) s = fmaf(x[i], y[i], s);
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
  if (lane == 0) out[row] = s;
}

// ---- unit lower triangular inverse: T = (I + L)^{-1}, column j of T by forward substitution ----
constexpr int kMaxInverse = 64;

__global__ void __launch_bounds__(kMaxInverse) unit_lower_inverse_kernel(const float* __restrict__ L, float* __restrict__ T,
                                                                         int C) {
  __shared__ float Ls[kMaxInverse][kMaxInverse + 1];
  __shared__ float Ts[kMaxInverse][kMaxInverse + 1];
  const int j = threadIdx.x;  // this thread's column
  const int64_t base = static_cast<int64_t>(blockIdx.x) * C * C;
  for (int i = 0; i < C; ++i) Ls[i][j] = j < C ? L[base + static_cast<int64_t>(i) * C + j] : 0.f;
  __syncthreads();
  if (j < C) {
    for (int i = 0; i < C; ++i) {
      // T[i][j] = [i == j] - sum_{k=j}^{i-1} L[i][k] T[k][j]   (zero above the diagonal)
      float t = i == j ? 1.f : 0.f;
      if (i > j) {
        float acc = 0.f;
        for (int k = j; k < i; ++k) acc = fmaf(Ls[i][k], Ts[k][j], acc);
        t = -acc;
      }
      Ts[i][j] = t;
    }
    for (int i = 0; i < C; ++i) T[base + static_cast<int64_t>(i) * C + j] = Ts[i][j];
  }
}

// The same for C = 64, right-looking: once row k of T is final, every later row takes its update
// at once, so thread j's 64 accumulators (registers, fully unrolled) see independent multiply-adds
// instead of one long dependent sum (the kernel above is bound by that latency).
__global__ void __launch_bounds__(64) unit_lower_inverse64_kernel(const float* __restrict__ L, float* __restrict__ T) {
  constexpr int C = 64;
  __shared__ float Ls[C][C];
  const int j = threadIdx.x;
  const int64_t base = static_cast<int64_t>(blockIdx.x) * C * C;
#pragma unroll 8
  for (int i = 0; i < C; ++i) Ls[i][j] = L[base + static_cast<int64_t>(i) * C + j];
  __syncthreads();
  float acc[C];
#pragma unroll
  for (int i = 0; i < C; ++i) acc[i] = 0.f;
#pragma unroll
  for (int k = 0; k < C; ++k) {
    // T[k][j]: final now (rows < k have all been applied); 1 on the diagonal, 0 above it.
    const float tk = k == j ? 1.f : (k > j ? acc[k] : 0.f);
    acc[k] = tk;
#pragma unroll
    for (int i = k + 1; i < C; ++i) acc[i] = fmaf(-Ls[i][k], tk, acc[i]);
  }
#pragma unroll
  for (int i = 0; i < C; ++i) T[base + static_cast<int64_t>(i) * C + j] = acc[i];
}

// ---- the LA heads' short convolution: depthwise, causal, then SiLU, in the [B, T, C] layout ----
// y[b, t, c] = silu(sum_j w[c, j] x[b, t - (K-1) + j, c]), inputs before t = 0 zero. The sum is rounded
// to the dtype before the SiLU, as at::conv1d then at::silu round. One thread per V consecutive
// channels (a pack: V = 16 bytes of them when every row is aligned, else 1) and kConvSteps consecutive
// time steps of one sequence; a block's lanes take 32 packs and its warps consecutive runs of steps.
// The kernels are bound by their instructions (the inputs' 16-bit unpacking most of them), so a thread
// converts its taps' weights once and each input row once, keeping the last K - 1 in float32 as the
// window slides, and each step's loads are issued one step ahead, in flight while the step before is
// worked.
constexpr int kConvSteps = 8;
constexpr int kConvWarps = 8;

// N values of T at src: in 16-byte loads where N values fill whole ones (src then 16-byte aligned, as
// the packed kernels' callers check), else one by one.
template <int N, class T>
__device__ __forceinline__ Pack<T, N> load_values(const T* src) {
  Pack<T, N> v;
  if constexpr (N * sizeof(T) % 16 == 0) {
#pragma unroll
    for (int q = 0; q < static_cast<int>(N * sizeof(T) / 16); ++q)
      reinterpret_cast<float4*>(v.v)[q] = reinterpret_cast<const float4*>(src)[q];
  } else {
#pragma unroll
    for (int i = 0; i < N; ++i) v.v[i] = src[i];
  }
  return v;
}
template <int N, class T>
__device__ __forceinline__ void to_float(float (&dst)[N], const Pack<T, N>& v) {
#pragma unroll
  for (int i = 0; i < N; ++i) dst[i] = static_cast<float>(v.v[i]);
}

// A thread's place on conv_grid's grid (runs of kConvSteps steps along x, in blocks of kConvWarps; blocks
// of 32 packs along y; sequences along z): its pack and first step, false where it has none (whole
// warps past the sequence's end; whole lanes past the row's last pack).
__device__ __forceinline__ bool conv_item(int64_t Tn, int64_t packs, int64_t& t0, int64_t& pack) {
  pack = static_cast<int64_t>(blockIdx.y) * 32 + threadIdx.x % 32;
  t0 = (static_cast<int64_t>(blockIdx.x) * kConvWarps + threadIdx.x / 32) * kConvSteps;
  return t0 < Tn && pack < packs;
}

// The conv's state for one thread: its V channels' K taps and the window of inputs t - K + 1 .. t in
// float32, the next step's input row in flight.
template <class T, int V, int K>
struct ConvWindow {
  float wv[V * K];   // the V channels' K taps: V * K consecutive weights
  float win[K][V];   // rows t - K + 1 .. t (the last filled by enter)
  Pack<T, V> next;   // the row the next step enters
  __device__ __forceinline__ ConvWindow(const T* xs, const T* wc, int64_t t0, int64_t C) {
    next = load_values<V>(xs + t0 * C);
    to_float<V * K>(wv, load_values<V * K>(wc));
#pragma unroll
    for (int j = 0; j < K - 1; ++j) {
      const int64_t src = t0 - (K - 1) + j;
      if (src >= 0) to_float<V>(win[j], load_values<V>(xs + src * C));
      else
#pragma unroll
        for (int i = 0; i < V; ++i) win[j][i] = 0.f;
    }
  }
  // Step t: the row loaded for it enters the window, and row t + 1's load is issued when `more`.
  __device__ __forceinline__ void enter(const T* xs, int64_t t, int64_t C, bool more) {
    to_float<V>(win[K - 1], next);
    if (more) next = load_values<V>(xs + (t + 1) * C);
  }
  // silu(to_dtype(sum_j wv[i K + j] win[j][i])) for each channel i, to the dtype; then the window slides.
  __device__ __forceinline__ Pack<T, V> step() {
    Pack<T, V> out;
#pragma unroll
    for (int i = 0; i < V; ++i) {
      float acc = 0.f;
#pragma unroll
      for (int j = 0; j < K; ++j) acc = fmaf(wv[i * K + j], win[j][i], acc);
      const float a = static_cast<float>(static_cast<T>(acc));  // the convolution's output, in the dtype
      out.v[i] = static_cast<T>(gate_activation<2, T>(a));        // SiLU (fast forms for 16-bit outputs)
    }
#pragma unroll
    for (int j = 0; j < K - 1; ++j)
#pragma unroll
      for (int i = 0; i < V; ++i) win[j][i] = win[j + 1][i];
    return out;
  }
};

template <class T, int V, int K>
__global__ void __launch_bounds__(32 * kConvWarps, 2)
    causal_conv_silu_kernel(const T* __restrict__ x, const T* __restrict__ w, T* __restrict__ y, int64_t Tn, int64_t C) {
  int64_t t0, pack;
  if (!conv_item(Tn, C / V, t0, pack)) return;
  const int64_t b = blockIdx.z, c0 = pack * V, t1 = std::min<int64_t>(t0 + kConvSteps, Tn);
  const T* xs = x + b * Tn * C + c0;
  T* ys = y + b * Tn * C + c0;
  ConvWindow<T, V, K> cw(xs, w + c0 * K, t0, C);
#pragma unroll 1
  for (int64_t t = t0; t < t1; ++t) {
    cw.enter(xs, t, C, t + 1 < t1);
    store_pack_global<V>(ys + t * C, cw.step());  // one vector store (store_pack's assignment compiled to six pieces)
  }
}

// The convolution's backward (kernels::causal_conv_silu_backward): one thread per channel and run of
// kConvBackSteps steps of one sequence; a warp's lanes take 32 consecutive channels of one run and a
// block's kConvBackRuns warps consecutive runs of them. Walking t from the run's first step to K - 2 past
// its last, it forms z_t (the forward's rounded sum) from the window of inputs, the rounded
// dz_t = dy_t silu'(z_t) as at::silu_backward rounds it, keeps the last K of them, and writes
// dx_{t - K + 1} = sum_j w_j dz_{t - j} (in float32, rounded once). The steps' inputs are loaded
// kConvBackAhead at a time before any of them is used, so that a thread has that many loads in flight.
// Its run's dz_t x_{t - K + 1 + j} sum into the taps' float32 gradients: the block's runs in shared
// memory, in order, then one atomic add per channel and tap.
constexpr int kConvBackSteps = 32;
constexpr int kConvBackRuns = 4;
constexpr int kConvBackThreads = 32 * kConvBackRuns;
constexpr int kConvBackAhead = 8;

template <class T, int K>
__global__ void __launch_bounds__(kConvBackThreads)
    causal_conv_silu_backward_kernel(const T* __restrict__ x, const T* __restrict__ w, const T* __restrict__ dy,
                                     T* __restrict__ dx, float* __restrict__ dw, int64_t Tn, int64_t C) {
  const int lane = threadIdx.x % 32, run = threadIdx.x / 32;
  const int64_t c = static_cast<int64_t>(blockIdx.y) * 32 + lane;
  const int64_t t0 = (static_cast<int64_t>(blockIdx.x) * kConvBackRuns + run) * kConvBackSteps;
  float dwa[K];
#pragma unroll
  for (int j = 0; j < K; ++j) dwa[j] = 0.f;
  if (c < C && t0 < Tn) {
    const int64_t b = blockIdx.z, t1 = std::min<int64_t>(t0 + kConvBackSteps, Tn), end = t1 + K - 1;
    const T* xs = x + b * Tn * C + c;
    const T* dys = dy + b * Tn * C + c;
    T* dxs = dx + b * Tn * C + c;
    float wv[K], win[K], dz[K];
#pragma unroll
    for (int j = 0; j < K; ++j) {
      wv[j] = static_cast<float>(w[c * K + j]);
      const int64_t t = t0 - (K - 1) + j;  // win[K - 1] is entered in the loop
      win[j] = j < K - 1 && t >= 0 ? static_cast<float>(xs[t * C]) : 0.f;
      dz[j] = 0.f;
    }
#pragma unroll 1
    for (int64_t tb = t0; tb < end; tb += kConvBackAhead) {
      float xa[kConvBackAhead], dya[kConvBackAhead];
#pragma unroll
      for (int u = 0; u < kConvBackAhead; ++u) {
        const int64_t t = tb + u;
        const bool in = t < end && t < Tn;
        xa[u] = in ? static_cast<float>(xs[t * C]) : 0.f;
        dya[u] = in ? static_cast<float>(dys[t * C]) : 0.f;
      }
#pragma unroll
      for (int u = 0; u < kConvBackAhead; ++u) {
        const int64_t t = tb + u;
        if (t < end) {
          float d = 0.f;
          if (t < Tn) {
            win[K - 1] = xa[u];
            float acc = 0.f;
#pragma unroll
            for (int j = 0; j < K; ++j) acc = fmaf(wv[j], win[j], acc);
            const float z = static_cast<float>(static_cast<T>(acc));
            const float sg = 1.f / (1.f + expf(-z));
            d = static_cast<float>(static_cast<T>(dya[u] * sg * (1.f + z * (1.f - sg))));
            if (t < t1)
#pragma unroll
              for (int j = 0; j < K; ++j) dwa[j] = fmaf(d, win[j], dwa[j]);
          }
#pragma unroll
          for (int j = 0; j < K - 1; ++j) dz[j] = dz[j + 1];
          dz[K - 1] = d;
          if (const int64_t s = t - (K - 1); s >= t0) {
            float acc = 0.f;
#pragma unroll
            for (int j = 0; j < K; ++j) acc = fmaf(wv[j], dz[K - 1 - j], acc);
            dxs[s * C] = static_cast<T>(acc);
          }
#pragma unroll
          for (int j = 0; j < K - 1; ++j) win[j] = win[j + 1];
        }
      }
    }
  }
  __shared__ float part[kConvBackRuns][K][32];
#pragma unroll
  for (int j = 0; j < K; ++j) part[run][j][lane] = dwa[j];
  __syncthreads();
  if (run == 0 && c < C) {
#pragma unroll
    for (int j = 0; j < K; ++j) {
      float sum = part[0][j][lane];
#pragma unroll
      for (int r = 1; r < kConvBackRuns; ++r) sum += part[r][j][lane];
      atomicAdd(dw + c * K + j, sum);
    }
  }
}

// The LA heads' q or k in one pass (kernels::causal_conv_silu_rope_l2norm): the short convolution as
// above, then RoPE and the head's L2 norm as rope_l2norm_packed_kernel forms them, on the convolution's
// output in registers (the RoPE tables' rows also loaded a step ahead). The P = Dh / V threads of a head
// are consecutive lanes (a head's P packs start at a multiple of P), which swap their rotate-half
// partners and sum the head's squares by shuffles within their group, in rope_l2norm_packed_kernel's
// order; a warp's lanes share their steps.
template <class T, int V, int K>
__global__ void __launch_bounds__(32 * kConvWarps, 2)
    conv_rope_l2norm_kernel(const T* __restrict__ x, const T* __restrict__ w, const T* __restrict__ cos,
                            const T* __restrict__ sin, T* __restrict__ y, int64_t Tn, int64_t C, int Dh, int P,
                            float eps) {
  static_assert(V * sizeof(T) == 16, "16-byte packs");
  int64_t t0, pack;
  if (!conv_item(Tn, C / V, t0, pack)) return;  // whole groups: C is a multiple of Dh
  const int lane = threadIdx.x % 32;
  const unsigned group = P == 32 ? 0xffffffffu : ((1u << P) - 1u) << (lane / P * P);
  const int64_t b = blockIdx.z, c0 = pack * V, t1 = std::min<int64_t>(t0 + kConvSteps, Tn);
  const int j = lane % P, d0 = j * V;  // a row's packs begin at a multiple of 32, each head's at one of P
  const bool first = j < P / 2;        // rotate_half: -x[i + Dh/2] in the first half, x[i - Dh/2] in the second
  const T* xs = x + b * Tn * C + c0;
  T* ys = y + b * Tn * C + c0;
  ConvWindow<T, V, K> cw(xs, w + c0 * K, t0, C);
  Pack<T, V> cn = load_pack<V>(cos + t0 * Dh + d0), sn = load_pack<V>(sin + t0 * Dh + d0);
#pragma unroll 1
  for (int64_t t = t0; t < t1; ++t) {
    const bool more = t + 1 < t1;
    cw.enter(xs, t, C, more);
    const Pack<T, V> cp = cn, sp = sn;
    if (more) cn = load_pack<V>(cos + (t + 1) * Dh + d0), sn = load_pack<V>(sin + (t + 1) * Dh + d0);
    store_pack_global<V>(ys + t * C, rope_l2_lanes<T, V>(cw.step(), group, P, first, cp, sp, eps));  // as causal_conv_silu's
  }
}

// conv_item's grid for B sequences of Tn steps with `packs` packs a row.
dim3 conv_grid(int64_t B, int64_t Tn, int64_t packs) {
  const int64_t per_block = static_cast<int64_t>(kConvSteps) * kConvWarps;
  const int64_t tblocks = (Tn + per_block - 1) / per_block, cblocks = (packs + 31) / 32;
  if (tblocks > std::numeric_limits<int32_t>::max() || cblocks > 65535 || B > 65535)
    throw std::invalid_argument("hh::kernels: the short convolution takes at most 65535 sequences and 65535 x 32 packs "
                                "of channels");
  return dim3(static_cast<unsigned>(tblocks), static_cast<unsigned>(cblocks), static_cast<unsigned>(B));
}

// ---- scale-normalised fusion: one warp per row of Dh <= 256 elements (8 a lane) ----
constexpr int kFusionWarps = 8;
constexpr int kMaxPerLane = 8;

// The gate's activation rounded to T (device_ops.cuh's gate_activation, GateActivation's numbering).
template <int ACT, class T>
__device__ __forceinline__ float activate(float x) {
  return static_cast<float>(static_cast<T>(gate_activation<ACT, T>(x)));
}

// One warp a row. VEC = 1: lane l takes elements l, l + 32, ... (any Dh <= 256); VEC > 1 (Dh = 32 VEC,
// rows aligned to VEC elements): lane l takes elements VEC l .. VEC l + VEC - 1, in one vector access.
template <class T, int ACT, int VEC>
__global__ void fusion_forward_kernel(const T* __restrict__ o, const T* __restrict__ gate, const T* __restrict__ gamma,
                                      T* __restrict__ y, int64_t rows, int n, int Dh, float eps, FusionPlacement pl) {
  constexpr int PER = VEC == 1 ? kMaxPerLane : VEC;
  const int lane = threadIdx.x & 31;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kFusionWarps + (threadIdx.x >> 5);
  if (row >= rows) return;
  // Row = r n + i: in 32 bits where the rows fit (a 64-bit division is most of a row's index arithmetic).
  int64_t r;
  int i;
  if (rows <= std::numeric_limits<uint32_t>::max()) {
    const uint32_t q = static_cast<uint32_t>(row) / static_cast<uint32_t>(n);
    r = q;
    i = static_cast<int>(static_cast<uint32_t>(row) - q * static_cast<uint32_t>(n));
  } else {
    r = row / n;
    i = static_cast<int>(row % n);
  }
  const T* orow = o + row * Dh;
  const T* grow = gate + r * pl.gate_ld + static_cast<int64_t>(i) * Dh;
  T* yrow = y + r * pl.y_ld + static_cast<int64_t>(pl.pos[i]) * Dh;
  const T* gm = gamma + static_cast<int64_t>(i) * Dh;
  float x[PER], gv[PER], gmv[PER];
  Pack<T, PER> gm_pack;  // gamma as stored (VEC > 1)
  if constexpr (VEC == 1) {
#pragma unroll
    for (int k = 0; k < PER; ++k) {
      const int d = lane + 32 * k;
      x[k] = d < Dh ? static_cast<float>(orow[d]) : 0.f;
      gv[k] = d < Dh ? static_cast<float>(grow[d]) : 0.f;
      gmv[k] = d < Dh ? static_cast<float>(gm[d]) : 0.f;
    }
  } else {
    const Pack<T, VEC> xo = reinterpret_cast<const Pack<T, VEC>*>(orow)[lane];
    const Pack<T, VEC> xg = reinterpret_cast<const Pack<T, VEC>*>(grow)[lane];
    gm_pack = reinterpret_cast<const Pack<T, VEC>*>(gm)[lane];
#pragma unroll
    for (int k = 0; k < PER; ++k)
      x[k] = static_cast<float>(xo.v[k]), gv[k] = static_cast<float>(xg.v[k]), gmv[k] = static_cast<float>(gm_pack.v[k]);
  }
  float ss = 0.f;
#pragma unroll
  for (int k = 0; k < PER; ++k) ss += x[k] * x[k];
  for (int off = 16; off > 0; off >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, off);
  const float rstd = rsqrtf(ss / static_cast<float>(Dh) + eps);
  Pack<T, PER> out;
  if constexpr (sizeof(T) == 2 && VEC % 2 == 0) {
    // On 16-bit pairs (fusion_pair: bit for bit the float32 products' roundings).
    using P2 = typename Pair16<T>::type;
#pragma unroll
    for (int k = 0; k < PER; k += 2)
      *reinterpret_cast<P2*>(&out.v[k]) = fusion_pair<ACT, T>(make_float2(x[k], x[k + 1]), rstd, make_float2(gv[k], gv[k + 1]),
                                                              *reinterpret_cast<const P2*>(&gm_pack.v[k]));
  } else {
#pragma unroll
    for (int k = 0; k < PER; ++k) {
      const T normed = static_cast<T>(x[k] * rstd);
      const T scaled = static_cast<T>(gmv[k] * static_cast<float>(normed));
      out.v[k] = static_cast<T>(activate<ACT, T>(gv[k]) * static_cast<float>(scaled));
    }
  }
  if constexpr (VEC == 1) {
#pragma unroll
    for (int k = 0; k < PER; ++k)
      if (lane + 32 * k < Dh) yrow[lane + 32 * k] = out.v[k];
  } else {
    reinterpret_cast<Pack<T, VEC>*>(yrow)[lane] = out;
  }
}

template <class T>
__global__ void fusion_backward_kernel(const T* __restrict__ dy, const T* __restrict__ o, const T* __restrict__ gate,
                                       const T* __restrict__ gamma, T* __restrict__ d_o, T* __restrict__ d_gate,
                                       float* __restrict__ d_gamma_rows, int64_t rows, int n, int Dh, float eps) {
  const int lane = threadIdx.x & 31;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kFusionWarps + (threadIdx.x >> 5);
  if (row >= rows) return;
  const int64_t base = row * Dh;
  const T* gm = gamma + (row % n) * Dh;
  float x[kMaxPerLane], dn[kMaxPerLane];
  float ss = 0.f;
#pragma unroll
  for (int k = 0; k < kMaxPerLane; ++k) {
    const int d = lane + 32 * k;
    x[k] = d < Dh ? static_cast<float>(o[base + d]) : 0.f;
    ss += x[k] * x[k];
  }
  for (int off = 16; off > 0; off >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, off);
  const float rstd = rsqrtf(ss / static_cast<float>(Dh) + eps);
  float dot = 0.f;  // sum(dn * normed)
#pragma unroll
  for (int k = 0; k < kMaxPerLane; ++k) {
    const int d = lane + 32 * k;
    dn[k] = 0.f;
    if (d >= Dh) continue;
    const float normed = x[k] * rstd;
    const float nr = static_cast<float>(static_cast<T>(normed));
    const float g = static_cast<float>(gm[d]);
    const float dyv = static_cast<float>(dy[base + d]);
    const float a = dyv * static_cast<float>(gate[base + d]);
    d_gate[base + d] = static_cast<T>(dyv * static_cast<float>(static_cast<T>(g * nr)));
    d_gamma_rows[base + d] = a * nr;
    dn[k] = a * g;
    dot += dn[k] * normed;
  }
  for (int off = 16; off > 0; off >>= 1) dot += __shfl_xor_sync(0xffffffffu, dot, off);
  const float mean = dot / static_cast<float>(Dh);
#pragma unroll
  for (int k = 0; k < kMaxPerLane; ++k) {
    const int d = lane + 32 * k;
    if (d < Dh) d_o[base + d] = static_cast<T>(rstd * (dn[k] - x[k] * rstd * mean));
  }
}

void check(const at::Tensor& t, const char* what) {
  if (!t.is_cuda()) throw std::invalid_argument(std::string("hh::kernels: ") + what + " must be a CUDA tensor");
  if (!t.is_contiguous()) throw std::invalid_argument(std::string("hh::kernels: ") + what + " must be contiguous");
}

void check_fusion(const at::Tensor& o, const at::Tensor& gate, const at::Tensor& gamma) {
  check(o, "o");
  check(gate, "gate");
  check(gamma, "gamma");
  if (o.dim() != 3 || gate.sizes() != o.sizes() || gamma.dim() != 2 || gamma.size(0) != o.size(1) ||
      gamma.size(1) != o.size(2))
    throw std::invalid_argument("hh::kernels::fusion_norm: expected o and gate [R, n, Dh], gamma [n, Dh]");
  if (gate.scalar_type() != o.scalar_type() || gamma.scalar_type() != o.scalar_type())
    throw std::invalid_argument("hh::kernels::fusion_norm: o, gate and gamma must share a dtype");
  if (o.size(2) > 32 * kMaxPerLane) throw std::invalid_argument("hh::kernels::fusion_norm: head_dim must be <= 256");
}

}  // namespace

void set_state_scan_kernel(ScanKernel k) { g_scan_kernel = k; }

bool copy_engine_available() {
  return at::cuda::is_available() && at::cuda::getCurrentDeviceProperties()->major >= 9;
}
ScanKernel state_scan_kernel() { return g_scan_kernel; }

bool state_scan_supported(int64_t Dk, int64_t Dv, at::ScalarType dtype) {
  return dtype == at::kFloat && (Dk == 32 || Dk == 64 || Dk == 128) && Dv > 0 && Dv % kScanColumns == 0;
}

at::Tensor state_scan(const at::Tensor& P, const at::Tensor& Z, const at::Tensor& y0, const std::vector<int64_t>& offsets,
                      bool reverse, at::Tensor& hist) {
  check(P, "P");
  check(Z, "Z");
  check(y0, "y0");
  check(hist, "hist");
  if (P.dim() != 4 || Z.dim() != 4 || y0.dim() != 4 || P.size(2) != P.size(3))
    throw std::invalid_argument("hh::kernels::state_scan: expected P [H, N, Dk, Dk], Z [H, N, Dk, Dv], y0 [S, H, Dk, Dv]");
  const int64_t H = P.size(0), N = P.size(1), Dk = P.size(2), Dv = Z.size(3), S = y0.size(0);
  if (Z.size(0) != H || Z.size(1) != N || Z.size(2) != Dk || y0.size(1) != H || y0.size(2) != Dk || y0.size(3) != Dv ||
      hist.sizes() != Z.sizes())
    throw std::invalid_argument("hh::kernels::state_scan: P, Z, y0 and hist disagree in shape");
  if (!state_scan_supported(Dk, Dv, P.scalar_type()) || Z.scalar_type() != at::kFloat ||
      y0.scalar_type() != at::kFloat || hist.scalar_type() != at::kFloat)
    throw std::invalid_argument("hh::kernels::state_scan: float32 with Dk in {32, 64, 128} and Dv a multiple of 16 only");
  if (static_cast<int64_t>(offsets.size()) != S + 1 || offsets.front() != 0 || offsets.back() != N)
    throw std::invalid_argument("hh::kernels::state_scan: offsets must hold S + 1 values from 0 to N");
  for (size_t i = 1; i < offsets.size(); ++i)
    if (offsets[i] < offsets[i - 1]) throw std::invalid_argument("hh::kernels::state_scan: offsets must not decrease");
  const c10::cuda::CUDAGuard guard(P.device());
  at::Tensor fin = at::empty_like(y0);
  if (S == 0 || H == 0) return fin;
  const at::Tensor off = device_table(offsets, P.device());
  switch (Dk) {
    case 32: launch_scan<32>(P, Z, y0, hist, fin, off, reverse); break;
    case 64: launch_scan<64>(P, Z, y0, hist, fin, off, reverse); break;
    default: launch_scan<128>(P, Z, y0, hist, fin, off, reverse); break;
  }
  return fin;
}

int64_t auto_segment_chunks(int64_t blocks, int64_t longest, int64_t slots) {
  if (blocks < 1 || longest < 1) return 0;
  const int64_t pieces = std::max<int64_t>(1, slots / blocks);
  const int64_t len = std::max<int64_t>(kMinAutoSegment, (longest + pieces - 1) / pieces);
  return scan_beside() ? std::min(len, kBesideSegment) : len;
}

ScanBeside::ScanBeside() { ++g_scan_beside; }
ScanBeside::~ScanBeside() { --g_scan_beside; }
bool scan_beside() { return g_scan_beside > 0; }

void set_scan_segments(int64_t chunks) {
  if (chunks < kAutoSegments) throw std::invalid_argument("hh::kernels::set_scan_segments: kAutoSegments, 0 or a number of chunks");
  g_scan_segments = chunks;
}
int64_t scan_segments() { return g_scan_segments; }
void set_scan_columns(int columns) {
  if (columns != 0 && columns != 16 && columns != 32)
    throw std::invalid_argument("hh::kernels::set_scan_columns: 0 (automatic), 16 or 32");
  g_scan_columns = columns;
}
int scan_columns() { return g_scan_columns; }
void set_output_in_scan(bool on) { g_output_in_scan = on; }
void set_scan_warp_columns(bool on) { g_scan_warp_columns = on; }
bool scan_warp_columns_enabled() { return g_scan_warp_columns; }
int64_t column_scan_launches() { return g_column_scan_launches.load(std::memory_order_relaxed); }
int64_t dO_in_place_scans() { return g_dO_in_place_scans.load(std::memory_order_relaxed); }
void set_u_in_scan(bool on) { g_u_in_scan = on; }
void set_qk_in_scan(bool on) { g_qk_in_scan = on; }
bool qk_in_scan_enabled() { return g_qk_in_scan; }
int64_t qk_in_scan_launches() { return g_qk_in_scan_launches.load(std::memory_order_relaxed); }
bool u_in_scan_enabled() { return g_u_in_scan; }
int64_t u_in_scan_launches() { return g_u_in_scan_launches.load(std::memory_order_relaxed); }
int64_t last_scan_piece_chunks() { return g_last_scan_piece; }
void set_scan_pieces_of_parity(int parity) {
  if (parity < -1 || parity > 1) throw std::invalid_argument("hh::kernels::set_scan_pieces_of_parity: -1 (every piece), 0 or 1");
  g_scan_pieces_parity = parity;
}
int scan_pieces_of_parity() { return g_scan_pieces_parity; }
void set_fusion_in_column_scan(bool on) { g_fusion_in_column_scan = on; }
void set_scan_wgmma(bool on) { g_scan_wgmma = on; }
bool scan_wgmma_enabled() { return g_scan_wgmma; }
bool fusion_in_column_scan_enabled() { return g_fusion_in_column_scan; }
namespace {
// Whether the column scan may take a scan at these head sizes (its switch on, set_scan_columns automatic).
bool column_scan_fits(int64_t Dk, int64_t Dv) {
  return g_scan_warp_columns && g_scan_columns == 0 && Dk == 128 && (Dv == 64 || Dv == 128);
}
// Whether the reverse scan with the direct term is the column scan (low_rank_scan's plan): with its block
// float16 history (S16 and M16) and no float32 one.
bool direct_in_column_scan(const LowRankScanArgs& a, int64_t Dk, int64_t Dv) {
  return column_scan_fits(Dk, Dv) && a.S16.defined() && a.M16.defined() && !a.hist.defined() && !a.M.defined();
}
}  // namespace
// Whether the column scan can copy each chunk's tile of x [B, T, H, D] where it lies, as one box: x a
// contiguous, 16-byte aligned CUDA tensor of a 16-bit dtype whose chunks' slots are consecutive rows (B
// regular sequences of T tokens, `per` chunks each, T a multiple of C or B = 1: the rows past the last token
// lie beyond the tensor, which the copy engine reads as zeros), within its 32-bit row coordinate.
namespace {
bool tiles_in_place(const at::Tensor& x, const ChunkGrid& grid) {
  constexpr int64_t C = kLowRankChunk;
  if (x.dim() != 4 || !x.is_cuda() || !x.is_contiguous() || (x.scalar_type() != at::kBFloat16 && x.scalar_type() != at::kHalf) ||
      reinterpret_cast<uintptr_t>(x.data_ptr()) % 16 != 0)
    return false;
  const int64_t B = x.size(0), T = x.size(1);
  return !grid.gather.defined() && grid.per > 0 && grid.per == (T + C - 1) / C && grid.N == B * grid.per && (T % C == 0 || B == 1) &&
         B * T <= std::numeric_limits<int32_t>::max();
}
}  // namespace
// The plan will be the column scan (direct_in_column_scan), and dO's tiles can be copied where they lie.
bool reverse_scan_reads_dO_in_place(const LowRankScanArgs& a) {
  const at::Tensor& dO = a.direct.dO;
  if (!tiles_in_place(dO, a.direct.grid) || a.A.dim() != 4 || a.y0.dim() != 4) return false;
  const int64_t Dk = a.A.size(3), Dv = a.y0.size(3);
  return a.direct.grid.N == a.A.size(1) && dO.size(2) == a.A.size(0) && a.reverse && a.precision == ScanPrecision::kBlockFloat16 &&
         dO.size(3) == Dv && !a.Z.defined() && !a.U.defined() && direct_in_column_scan(a, Dk, Dv);
}
bool column_scan_forms_u(int64_t Dk, const at::Tensor& v, const ChunkGrid& grid) {
  return g_u_in_scan && tiles_in_place(v, grid) && column_scan_takes(Dk, v.size(3), false) && g_scan_wgmma && scan_wgmma_available();
}
namespace {
// q's or k's tiles copied where they lie, as `like`'s (v's or dO's [B, T, H, D]): of its dtype, batch, length
// and heads, Dk columns a head.
bool laid_out_as(const at::Tensor& x, const at::Tensor& like, int64_t Dk, const ChunkGrid& grid) {
  return tiles_in_place(x, grid) && like.dim() == 4 && x.scalar_type() == like.scalar_type() && x.size(0) == like.size(0) &&
         x.size(1) == like.size(1) && x.size(2) == like.size(2) && x.size(3) == Dk;
}
}  // namespace
bool column_scan_reads_qk(int64_t Dk, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const ChunkGrid& grid) {
  return g_qk_in_scan && laid_out_as(q, v, Dk, grid) && laid_out_as(k, v, Dk, grid);
}
bool reverse_scan_takes_qk(int64_t Dk, const at::Tensor& q, const at::Tensor& k, const at::Tensor& dO, const ChunkGrid& grid) {
  return Dk == 128 && laid_out_as(q, dO, Dk, grid) && laid_out_as(k, dO, Dk, grid) && g_scan_wgmma && scan_wgmma_available();
}
bool column_scan_fuses(int64_t Dk, int64_t Dv) { return column_scan_fits(Dk, Dv) && g_fusion_in_column_scan && !g_fusion_in_scan; }
bool column_scan_takes(int64_t Dk, int64_t Dv, bool fused) { return fused ? column_scan_fuses(Dk, Dv) : column_scan_fits(Dk, Dv); }
bool scan_output_fusion_supported(int64_t Dk, int64_t Dv) { return Dk == 128 && Dv % 32 == 0 && Dv / 32 <= 8; }
void set_fusion_in_scan(bool on) { g_fusion_in_scan = on; }
bool fusion_in_scan_enabled() { return g_fusion_in_scan; }
int64_t fused_scan_launches() { return g_fused_scan_launches.load(std::memory_order_relaxed); }
bool output_in_scan_enabled() { return g_output_in_scan; }
void set_direct_in_scan(bool on) { g_direct_in_scan = on; }
bool direct_in_scan_enabled() { return g_direct_in_scan; }

bool low_rank_scan_supported(int64_t C, int64_t Dk, int64_t Dv) {
  return C == kLowRankChunk && (Dk == 32 || Dk == 64 || Dk == 128) && Dv > 0 && Dv % 16 == 0;
}

at::Tensor low_rank_scan(const LowRankScanArgs& a, const std::vector<int64_t>& offsets) {
  // The direct term's dO as it lies: read so by the column scan where it can, else brought to the chunk
  // grid in block float16 first, for the scans that read that.
  if (a.direct.dO.defined()) {
    if (a.direct.dO16.defined() || a.direct.do_inv.defined())
      throw std::invalid_argument("hh::kernels::low_rank_scan: the direct term takes dO, or dO16 and do_inv, not both");
    if (!reverse_scan_reads_dO_in_place(a)) {
      LowRankScanArgs b = a;
      const GridF16 g16 = grad_to_grid_f16(a.direct.dO, a.direct.grid);
      b.direct.dO16 = g16.x16, b.direct.do_inv = g16.inv, b.direct.dO = at::Tensor();
      return low_rank_scan(b, offsets);
    }
  }
  // A, B and U may be column slices of wider rows (W and U are the two halves of one solve):
  // [H, N, C, D] with unit column stride, rows 16-byte aligned and packed one after another.
  auto need = [](const at::Tensor& x, const char* what, bool optional, bool rows_may_be_wider = false) {
    if (!x.defined()) {
      if (!optional) throw std::invalid_argument(std::string("hh::kernels::low_rank_scan: ") + what + " is required");
      return;
    }
    const bool factor = what == std::string("A") || what == std::string("B") || what == std::string("U");
    if (x.scalar_type() != at::kFloat && !(factor && x.scalar_type() == at::kHalf))
      throw std::invalid_argument(std::string("hh::kernels::low_rank_scan: ") + what +
                                  (factor ? " must be float32 or float16" : " must be float32"));
    if (!rows_may_be_wider) return check(x, what);
    if (!x.is_cuda()) throw std::invalid_argument(std::string("hh::kernels::low_rank_scan: ") + what + " must be a CUDA tensor");
    const int64_t ld = x.stride(2);
    if (x.dim() != 4 || x.stride(3) != 1 || ld < x.size(3) || ld % (16 / x.element_size()) != 0 || x.stride(1) != x.size(2) * ld ||
        x.stride(0) != x.size(1) * x.stride(1) || reinterpret_cast<uintptr_t>(x.data_ptr()) % 16 != 0)
      throw std::invalid_argument(std::string("hh::kernels::low_rank_scan: ") + what +
                                  " must be [H, N, C, D] with packed rows (a row stride of a multiple of 16 bytes)");
  };
  // The scan that reads k where it lies forms its factor itself: A is not given to the forward (UFromV::k), where
  // B gives the shapes, nor B to the reverse scan (Direct::k), where A does (scan_factor).
  const bool qk = a.u_from_v.q.defined() || a.u_from_v.k.defined() || a.u_from_v.QK.defined();
  const bool dqk = a.direct.q.defined() || a.direct.k.defined() || a.direct.QK.defined();
  if (qk && dqk) throw std::invalid_argument("hh::kernels::low_rank_scan: q and k are read by the forward (u_from_v) or the reverse scan (direct), not both");
  need(a.A, "A", qk, true);
  need(a.B, "B", dqk, true);
  need(a.decay, "decay", false);
  need(a.bound, "bound", true);
  need(a.U, "U", true, true);
  need(a.U_inv, "U_inv", true);
  need(a.Z, "Z", true);
  need(a.y0, "y0", false);
  need(a.hist, "hist", true);
  need(a.M, "M", true);
  if (qk && a.A.defined())
    throw std::invalid_argument("hh::kernels::low_rank_scan: A is not given when the scan forms it from k (u_from_v.k)");
  if (dqk && a.B.defined())
    throw std::invalid_argument("hh::kernels::low_rank_scan: B is not given when the reverse scan forms it from k (direct.k)");
  const at::Tensor& F = scan_factor(a);
  // chunk_factors' row scales of q and k (qk_in_scan) for the scan `fn` names, once the shapes are known.
  auto need_qk_scales = [](const at::Tensor& QK, int64_t H, int64_t N, int64_t C, const std::string& fn) {
    if (QK.scalar_type() != at::kFloat || QK.sizes() != at::IntArrayRef({H, N, 2, C}) || !QK.is_contiguous() ||
        reinterpret_cast<uintptr_t>(QK.data_ptr()) % 16 != 0)
      throw std::invalid_argument(fn + "needs QK [H, N, 2, 64] float32, contiguous and 16-byte aligned (chunk_factors' qk_in_scan)");
  };
  if (a.A.defined() && a.B.defined() && a.B.scalar_type() != a.A.scalar_type())
    throw std::invalid_argument("hh::kernels::low_rank_scan: A and B must have one dtype");
  if (a.precision == ScanPrecision::kBlockFloat16 && F.scalar_type() != at::kHalf)
    throw std::invalid_argument("hh::kernels::low_rank_scan: block float16 products need float16 A and B");
  if ((a.A.defined() && a.B.defined() && a.B.sizes() != a.A.sizes()) || a.y0.dim() != 4)
    throw std::invalid_argument("hh::kernels::low_rank_scan: expected A, B [H, N, C, Dk] and y0 [S, H, Dk, Dv]");
  const int64_t H = F.size(0), N = F.size(1), C = F.size(2), Dk = F.size(3), S = a.y0.size(0), Dv = a.y0.size(3);
  if (a.y0.size(1) != H || a.y0.size(2) != Dk || a.decay.sizes() != at::IntArrayRef({H, N}) ||
      (a.bound.defined() && a.bound.sizes() != at::IntArrayRef({H, N})) ||
      (a.hist.defined() && a.hist.sizes() != at::IntArrayRef({H, N, Dk, Dv})) ||
      (a.U.defined() && a.U.sizes() != at::IntArrayRef({H, N, C, Dv})) ||
      (a.U_inv.defined() && a.U_inv.sizes() != at::IntArrayRef({H, N, Dv})) ||
      (a.M.defined() && a.M.sizes() != at::IntArrayRef({H, N, C, Dv})) ||
      (a.Z.defined() && a.Z.sizes() != at::IntArrayRef({H, N, Dk, Dv})))
    throw std::invalid_argument("hh::kernels::low_rank_scan: decay and bound [H, N], U and M [H, N, C, Dv], U_inv [H, N, Dv], Z and "
                                "hist [H, N, Dk, Dv] must agree with A and y0");
  const bool u16 = a.U.defined() && a.U.scalar_type() == at::kHalf;
  if (u16 != a.U_inv.defined())
    throw std::invalid_argument("hh::kernels::low_rank_scan: U in float16 comes with its column scales U_inv, and only then");
  const bool u_from_v = a.u_from_v.v.defined() || a.u_from_v.Tb.defined();
  if (u_from_v) {
    const LowRankScanArgs::UFromV& uv = a.u_from_v;
    const std::string fn = "hh::kernels::low_rank_scan: U formed from v (u_from_v) ";
    if (!uv.v.defined() || !uv.Tb.defined()) throw std::invalid_argument(fn + "needs both v and Tb");
    if (a.U.defined() || a.Z.defined() || a.reverse || a.hist.defined() || a.M.defined() || !a.output.o.defined() ||
        a.output.fusion != nullptr || a.precision != ScanPrecision::kBlockFloat16)
      throw std::invalid_argument(fn + "is the forward's with o written: block float16, no U, Z, float32 history or fusion");
    if (!column_scan_forms_u(Dk, uv.v, a.output.grid) || uv.v.size(2) != H || uv.v.size(3) != Dv || uv.v.size(0) != a.output.B ||
        uv.v.size(1) != a.output.T)
      throw std::invalid_argument(fn + "needs the column scan by warpgroup (Dk = 128, Dv 64 or 128) and v [B, T, H, Dv] as the "
                                       "output's, contiguous, each chunk's slots consecutive tokens (column_scan_forms_u)");
    if (uv.Tb.scalar_type() != uv.v.scalar_type() || uv.Tb.sizes() != at::IntArrayRef({H, N, 2, kPackedLower}) ||
        !uv.Tb.is_contiguous() || reinterpret_cast<uintptr_t>(uv.Tb.data_ptr()) % 16 != 0)
      throw std::invalid_argument(fn + "needs Tb [H, N, 2, kPackedLower] of v's dtype, contiguous and 16-byte aligned");
    if (qk) {
      if (!uv.q.defined() || !uv.k.defined() || !uv.QK.defined())
        throw std::invalid_argument(fn + "reads q and k with all of q, k and QK");
      if (a.output.Qd.defined()) throw std::invalid_argument(fn + "reads q and k and forms output.Qd itself (not given)");
      if (!column_scan_reads_qk(Dk, uv.q, uv.k, uv.v, a.output.grid) || uv.q.size(2) != H || uv.q.sizes() != uv.k.sizes())
        throw std::invalid_argument(fn + "needs q and k [B, T, H, Dk] of v's dtype, laid out as v (column_scan_reads_qk)");
      need_qk_scales(uv.QK, H, N, C, fn);
    }
  } else if (qk) {
    throw std::invalid_argument("hh::kernels::low_rank_scan: q and k are read in place by the scan that forms U from v (u_from_v.v)");
  }
  if (!low_rank_scan_supported(C, Dk, Dv))
    throw std::invalid_argument("hh::kernels::low_rank_scan: chunk 64, Dk in {32, 64, 128} and Dv a multiple of 16 only");
  if (static_cast<int64_t>(offsets.size()) != S + 1 || offsets.front() != 0 || offsets.back() != N)
    throw std::invalid_argument("hh::kernels::low_rank_scan: offsets must hold S + 1 values from 0 to N");
  for (size_t i = 1; i < offsets.size(); ++i)
    if (offsets[i] < offsets[i - 1]) throw std::invalid_argument("hh::kernels::low_rank_scan: offsets must not decrease");
  if (!a.hist.defined() && a.precision != ScanPrecision::kBlockFloat16)
    throw std::invalid_argument("hh::kernels::low_rank_scan: the float32 and TF32 scans always write hist");
  const bool s16 = a.S16.defined(), m16 = a.M16.defined();
  if (s16 != a.S_inv.defined() || m16 != a.M_inv.defined())
    throw std::invalid_argument("hh::kernels::low_rank_scan: give S16 with S_inv and M16 with M_inv");
  if ((s16 || m16) && a.precision != ScanPrecision::kBlockFloat16)
    throw std::invalid_argument("hh::kernels::low_rank_scan: the float16 history is written by the block float16 scan only");
  if (a.segment < kAutoSegments)
    throw std::invalid_argument("hh::kernels::low_rank_scan: segment must be kAutoSegments, 0 or a number of chunks");
  if (a.segment != 0 && a.precision != ScanPrecision::kBlockFloat16)
    throw std::invalid_argument("hh::kernels::low_rank_scan: segmented scans run on the block float16 kernel only");
  FusedOutputArgs fused;  // the output's fusion, checked
  {
    auto want = [&](const at::Tensor& x, const char* what, at::ScalarType dt, at::IntArrayRef sizes) {
      check(x, what);
      if (x.scalar_type() != dt || x.sizes() != sizes)
        throw std::invalid_argument(std::string("hh::kernels::low_rank_scan: ") + what + " must be " +
                                    c10::toString(dt) + " " + c10::str(sizes));
    };
    if (s16) {
      want(a.S16, "S16", at::kHalf, {H, N, Dk, Dv});
      want(a.S_inv, "S_inv", at::kFloat, {H, N, Dk / 16, Dv / 16});
    }
    if (m16) {
      want(a.M16, "M16", at::kHalf, {H, N, C, Dv});
      want(a.M_inv, "M_inv", at::kFloat, {H, N, C / 16, Dv / 8});
    }
    const LowRankScanArgs::Output& o = a.output;
    if (o.fusion != nullptr) {
      if (o.o.defined())
        throw std::invalid_argument("hh::kernels::low_rank_scan: the output goes to o or through the fusion into y, not both");
      if (!scan_output_fusion_supported(Dk, Dv) || g_scan_columns == 16)
        throw std::invalid_argument("hh::kernels::low_rank_scan: the output's fusion needs Dk = 128, Dv a multiple of 32 up to 256 "
                                    "and 32 columns a block");
      if (o.y.scalar_type() != at::kBFloat16 && o.y.scalar_type() != at::kHalf)
        throw std::invalid_argument("hh::kernels::low_rank_scan: the output's fusion writes bfloat16 or float16");
      fused = fused_output_args("low_rank_scan", *o.fusion, o.y, o.B, o.T, H, Dv, o.y.scalar_type());
    }
    if (o.o.defined() || o.fusion != nullptr) {
      if (a.precision != ScanPrecision::kBlockFloat16 || a.reverse || a.Z.defined())
        throw std::invalid_argument("hh::kernels::low_rank_scan: the output is written by the forward block float16 scan only (no Z)");
      if (Dk != 64 && Dk != 128)
        throw std::invalid_argument("hh::kernels::low_rank_scan: the output needs Dk 64 or 128 (chunk_factors' head sizes)");
      if (!qk) want(o.Qd, "output.Qd", at::kHalf, {H, N, C, Dk});
      want(o.Aq, "output.Aq", at::kHalf, {H, N, kPackedLower});
      want(o.aq_inv, "output.aq_inv", at::kFloat, {H, N});
      if (o.o.defined()) check(o.o, "output.o");
      if (o.o.defined() && ((o.o.scalar_type() != at::kBFloat16 && o.o.scalar_type() != at::kHalf) ||
                            o.o.sizes() != at::IntArrayRef({o.B, o.T, H, Dv})))
        throw std::invalid_argument("hh::kernels::low_rank_scan: output.o must be bfloat16 or float16 [B, T, H, Dv] = " +
                                    c10::str(at::IntArrayRef({o.B, o.T, H, Dv})) + ", got " +
                                    c10::toString(o.o.scalar_type()) + " " + c10::str(o.o.sizes()));
      if (o.grid.N != N)
        throw std::invalid_argument("hh::kernels::low_rank_scan: output.grid has " + std::to_string(o.grid.N) +
                                    " chunks, the factors " + std::to_string(N));
      (void)slot_rows(o.grid, o.B, o.T);  // checks the grid against B and T
      if (N > std::numeric_limits<int32_t>::max() || o.grid.per > std::numeric_limits<int32_t>::max())
        throw std::invalid_argument("hh::kernels::low_rank_scan: the output's grid has more than 2^31 - 1 chunks");
      for (const at::Tensor* x : {&o.Qd, &o.Aq})
        if (x->defined() && reinterpret_cast<uintptr_t>(x->data_ptr()) % 16 != 0)
          throw std::invalid_argument("hh::kernels::low_rank_scan: output.Qd and output.Aq must be 16-byte aligned");
    }
    const LowRankScanArgs::Direct& d = a.direct;
    const bool in_place = d.dO.defined();  // reverse_scan_reads_dO_in_place holds (checked on entry)
    const int given = (d.Qd.defined() || dqk) + d.Aq.defined() + d.aq_inv.defined() + (in_place ? 2 : d.dO16.defined() + d.do_inv.defined());
    if (given != 0 && given != 5)
      throw std::invalid_argument("hh::kernels::low_rank_scan: the direct term needs all of direct.Qd (or q, k and QK), Aq, aq_inv, "
                                  "and dO16 and do_inv or dO");
    if (dqk) {
      const std::string fn = "hh::kernels::low_rank_scan: the reverse scan reading q and k (direct.q) ";
      if (!d.q.defined() || !d.k.defined() || !d.QK.defined()) throw std::invalid_argument(fn + "needs all of q, k and QK");
      if (d.Qd.defined()) throw std::invalid_argument(fn + "forms direct.Qd itself (not given)");
      if (!in_place || !reverse_scan_takes_qk(Dk, d.q, d.k, d.dO, d.grid) || d.q.size(2) != H)
        throw std::invalid_argument(fn + "needs dO read where it lies (reverse_scan_reads_dO_in_place), the column scan by "
                                         "warpgroup, and q and k [B, T, H, Dk] of dO's dtype laid out as dO (reverse_scan_takes_qk)");
      need_qk_scales(d.QK, H, N, C, fn);
    }
    if (given == 5) {
      if (a.precision != ScanPrecision::kBlockFloat16 || !a.reverse || a.Z.defined() || a.U.defined() || o.o.defined())
        throw std::invalid_argument("hh::kernels::low_rank_scan: the direct term is formed by the reverse block float16 scan only "
                                    "(no Z, no U, no output)");
      if (Dk != 64 && Dk != 128)
        throw std::invalid_argument("hh::kernels::low_rank_scan: the direct term needs Dk 64 or 128 (chunk_factors' head sizes)");
      if (!dqk) want(d.Qd, "direct.Qd", at::kHalf, {H, N, C, Dk});
      want(d.Aq, "direct.Aq", at::kHalf, {H, N, kPackedLower});
      want(d.aq_inv, "direct.aq_inv", at::kFloat, {H, N});
      // dO's shape and alignment are reverse_scan_reads_dO_in_place's conditions; dO16 is read only elsewhere.
      if (!in_place) {
        want(d.dO16, "direct.dO16", at::kHalf, {H, N, C, Dv});
        want(d.do_inv, "direct.do_inv", at::kFloat, {H, N});
      }
      for (const at::Tensor* x : {&d.Qd, &d.Aq, &d.dO16})
        if (x->defined() && reinterpret_cast<uintptr_t>(x->data_ptr()) % 16 != 0)
          throw std::invalid_argument("hh::kernels::low_rank_scan: direct.Qd, Aq and dO16 must be 16-byte aligned");
    }
  }
  const c10::cuda::CUDAGuard guard(F.device());
  at::Tensor fin = at::empty_like(a.y0);
  if (S == 0 || H == 0) return fin;
  // The block float16 kernel's columns a block: 32 where they divide Dv (each chunk's factors read from
  // shared memory once for twice the columns; one block an SM), else 16 (two blocks an SM when
  // segmented). The segments: whole sequences, or pieces of `len` chunks (a sequence's last shorter).
  ScanPlan plan;
  plan.fused = fused;
  plan.columns = a.precision == ScanPrecision::kBlockFloat16 && Dv % 32 == 0 && g_scan_columns != 16 ? 32 : 16;
  // The column scan (set_scan_warp_columns) takes the forward with its output at Dk = 128, Dv 64 or 128 (a
  // block a head, Dv / 16 warps), 16-byte aligned rows of o, U in float16 by columns, no float32 history,
  // unless set_scan_columns asks for blocks of 16 or 32 columns; with the fusion (checked above), unless
  // set_fusion_in_scan asks for the cluster of column blocks or set_fusion_in_column_scan is off: the
  // switches column_scan_takes reads, which gdn's forward asks before it picks U's form. It writes the
  // float16 history (S16, M16) with o, not with the fusion.
  const bool fusion = a.output.fusion != nullptr;
  const bool o_fits = fusion || (a.output.o.defined() && reinterpret_cast<uintptr_t>(a.output.o.data_ptr()) % 16 == 0);
  // The backward's reverse scan forming the direct term takes it too, with its history (S16 and M16) and
  // no float32 one.
  const bool direct = a.direct.dO16.defined() || a.direct.dO.defined();
  if (column_scan_takes(Dk, Dv, fusion) && o_fits && !a.reverse && F.scalar_type() == at::kHalf && !a.hist.defined() &&
      !a.M.defined() && !(fusion && (s16 || m16)) && !a.Z.defined() && (u16 || u_from_v))
    plan.columns = static_cast<int>(Dv);
  else if (u_from_v)
    throw std::invalid_argument("hh::kernels::low_rank_scan: U formed from v needs the column scan (o 16-byte aligned)");
  else if (direct && direct_in_column_scan(a, Dk, Dv))
    plan.columns = static_cast<int>(Dv);
  else if (u16)
    throw std::invalid_argument("hh::kernels::low_rank_scan: U in float16 is read by the column scan only (the forward with its "
                                "output at Dk = 128, Dv 64 or 128, no float32 history, the float16 history only with o, the "
                                "column scan on: column_scan_takes)");
  if (a.direct.dO.defined() && plan.columns < 64)
    throw std::logic_error("hh::kernels::low_rank_scan: direct.dO is read in place by the column scan only (reverse_scan_reads_dO_in_place)");
  const int64_t blocks_whole = (Dv / plan.columns) * H * S, sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  int64_t longest = 0;
  for (int64_t s = 0; s < S; ++s) longest = std::max(longest, offsets[s + 1] - offsets[s]);
  // Two blocks of 16 columns share an SM, except with the output or the direct term (three slots of Qd
  // and Aq besides).
  const bool two_a_sm = plan.columns == 16 && !a.output.o.defined() && a.output.fusion == nullptr && !direct;
  // With the fusion, whole clusters of a head's Dv / 32 column blocks: those the device places at once.
  const bool cluster = fusion && plan.columns == 32;
  const int64_t slots = cluster && a.segment == kAutoSegments ? fused_scan_slots(static_cast<int>(Dv / 32)) : (two_a_sm ? 2 : 1) * sms;
  if (cluster && slots < Dv / 32)
    throw std::invalid_argument("hh::kernels::low_rank_scan: this device cannot run a cluster of " + std::to_string(Dv / 32) +
                                " blocks of the scan with the fusion (set_fusion_in_scan(false) takes the fusion kernel after it)");
  const int64_t len = a.segment == kAutoSegments ? auto_segment_chunks(blocks_whole, longest, slots) : a.segment;
  g_last_scan_piece = len;
  std::vector<int64_t> table(offsets);
  const int parity = g_scan_pieces_parity;
  for (int64_t s = 0; s < S; ++s) {
    const int64_t n0 = offsets[s], n1 = offsets[s + 1];
    if (len == 0 || n1 - n0 <= len) {
      if (parity != 1) table.insert(table.end(), {s, n0, n1});
      continue;
    }
    for (int64_t lo = n0, i = 0; lo < n1; lo += len, ++i)
      if (parity < 0 || i % 2 == parity) table.insert(table.end(), {s, lo, std::min(lo + len, n1)});
  }
  plan.segments = static_cast<int64_t>(table.size() - offsets.size()) / 3;
  // Only set_scan_pieces_of_parity(1) leaves no piece (no sequence of two); the block float16 scans then
  // launch nothing (the other scans read the offsets alone).
  if (plan.segments == 0 && a.precision == ScanPrecision::kBlockFloat16) return fin;
  plan.two_stages = two_a_sm && a.segment != 0 && plan.segments * (Dv / 16) * H > sms;
  if (plan.segments * (Dv / plan.columns) > std::numeric_limits<int32_t>::max())
    throw std::invalid_argument("hh::kernels::low_rank_scan: more than 2^31 - 1 blocks of segments");
  plan.table = device_table(table, F.device());
  if (F.scalar_type() == at::kHalf) launch_low_rank_scan<c10::Half>(Dk, a, plan, fin);
  else launch_low_rank_scan<float>(Dk, a, plan, fin);
  return fin;
}

bool chunk_grid_copy_supported(int64_t D, at::ScalarType sixteen_bit) {
  return D > 0 && D % 8 == 0 && (sixteen_bit == at::kBFloat16 || sixteen_bit == at::kHalf);
}

at::Tensor to_chunk_grid(const at::Tensor& x, int64_t C, double scale) {
  check(x, "x");
  if (x.dim() != 4 || C < 1 || !chunk_grid_copy_supported(x.size(3), x.scalar_type()) ||
      reinterpret_cast<uintptr_t>(x.data_ptr()) % 16 != 0)
    throw std::invalid_argument("hh::kernels::to_chunk_grid: x must be 16-byte aligned bfloat16 or float16 [B, T, H, D], D a multiple of 8");
  const c10::cuda::CUDAGuard guard(x.device());
  const int64_t B = x.size(0), T = x.size(1), H = x.size(2), D = x.size(3), per = (T + C - 1) / C;
  at::Tensor y = at::empty({H, B * per, C, D}, x.options().dtype(at::kFloat));
  const int64_t packs = y.numel() / 8;
  if (packs == 0) return y;
  AT_DISPATCH_SWITCH(x.scalar_type(), "to_chunk_grid", AT_DISPATCH_CASE(at::kBFloat16, [&] {
                       to_grid_kernel<scalar_t><<<copy_blocks(packs), 256, 0, at::cuda::getCurrentCUDAStream()>>>(
                           x.data_ptr<scalar_t>(), y.data_ptr<float>(), packs, T, H, D / 8, C, per, B, static_cast<float>(scale));
                     }) AT_DISPATCH_CASE(at::kHalf, [&] {
                       to_grid_kernel<scalar_t><<<copy_blocks(packs), 256, 0, at::cuda::getCurrentCUDAStream()>>>(
                           x.data_ptr<scalar_t>(), y.data_ptr<float>(), packs, T, H, D / 8, C, per, B, static_cast<float>(scale));
                     }));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return y;
}

at::Tensor from_chunk_grid(const at::Tensor& y, int64_t B, int64_t T, at::ScalarType dtype, double scale) {
  check(y, "y");
  if (y.dim() != 4 || y.scalar_type() != at::kFloat || !chunk_grid_copy_supported(y.size(3), dtype) || B < 1 ||
      y.size(1) % B != 0 || y.size(1) / B * y.size(2) < T)
    throw std::invalid_argument("hh::kernels::from_chunk_grid: y must be float32 [H, B * per, C, D] with per * C >= T, D a "
                                "multiple of 8, and dtype bfloat16 or float16");
  const c10::cuda::CUDAGuard guard(y.device());
  const int64_t H = y.size(0), N = y.size(1), C = y.size(2), D = y.size(3);
  at::Tensor x = at::empty({B, T, H, D}, y.options().dtype(dtype));
  const int64_t packs = x.numel() / 8;
  if (packs == 0) return x;
  AT_DISPATCH_SWITCH(dtype, "from_chunk_grid", AT_DISPATCH_CASE(at::kBFloat16, [&] {
                       from_grid_kernel<scalar_t><<<copy_blocks(packs), 256, 0, at::cuda::getCurrentCUDAStream()>>>(
                           y.data_ptr<float>(), x.data_ptr<scalar_t>(), packs, T, H, D / 8, C, N / B, N, static_cast<float>(scale));
                     }) AT_DISPATCH_CASE(at::kHalf, [&] {
                       from_grid_kernel<scalar_t><<<copy_blocks(packs), 256, 0, at::cuda::getCurrentCUDAStream()>>>(
                           y.data_ptr<float>(), x.data_ptr<scalar_t>(), packs, T, H, D / 8, C, N / B, N, static_cast<float>(scale));
                     }));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return x;
}

at::Tensor row_dot(const at::Tensor& a, const at::Tensor& b) {
  check(a, "a");
  check(b, "b");
  if (a.scalar_type() != at::kFloat || b.scalar_type() != at::kFloat || a.sizes() != b.sizes() || a.dim() < 1)
    throw std::invalid_argument("hh::kernels::row_dot: a and b must be float32 tensors of one shape [..., D]");
  const c10::cuda::CUDAGuard guard(a.device());
  const int64_t D = a.size(-1), rows = D > 0 ? a.numel() / D : 0;
  at::Tensor out = at::empty(a.sizes().slice(0, a.dim() - 1), a.options());
  if (rows == 0) return out;
  if (D == 0) return out.zero_();
  const bool vec = D % 4 == 0 && reinterpret_cast<uintptr_t>(a.data_ptr()) % 16 == 0 &&
                   reinterpret_cast<uintptr_t>(b.data_ptr()) % 16 == 0;
  const auto blocks = static_cast<unsigned>((rows + kRowDotWarps - 1) / kRowDotWarps);
  row_dot_kernel<<<blocks, kRowDotWarps * 32, 0, at::cuda::getCurrentCUDAStream()>>>(
      a.data_ptr<float>(), b.data_ptr<float>(), out.data_ptr<float>(), rows, D, vec);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

at::Tensor unit_lower_inverse(const at::Tensor& L) {
  check(L, "L");
  if (L.dim() < 2 || L.size(-1) != L.size(-2) || L.size(-1) > kMaxInverse || L.scalar_type() != at::kFloat)
    throw std::invalid_argument("hh::kernels::unit_lower_inverse: L must be float32 [..., C, C] with C <= 64");
  const c10::cuda::CUDAGuard guard(L.device());
  at::Tensor T = at::empty_like(L);
  const int C = static_cast<int>(L.size(-1));
  const int64_t mats = C == 0 ? 0 : L.numel() / (static_cast<int64_t>(C) * C);
  if (mats == 0) return T;
  if (C == 64)
    unit_lower_inverse64_kernel<<<static_cast<unsigned>(mats), 64, 0, at::cuda::getCurrentCUDAStream()>>>(
        L.data_ptr<float>(), T.data_ptr<float>());
  else
    unit_lower_inverse_kernel<<<static_cast<unsigned>(mats), kMaxInverse, 0, at::cuda::getCurrentCUDAStream()>>>(
        L.data_ptr<float>(), T.data_ptr<float>(), C);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return T;
}

at::Tensor causal_conv_silu(const at::Tensor& x, const at::Tensor& weight) {
  check(x, "x");
  check(weight, "weight");
  if (x.dim() != 3 || weight.dim() != 3 || weight.size(0) != x.size(2) || weight.size(1) != 1 ||
      weight.size(2) != kShortConvTaps || weight.scalar_type() != x.scalar_type())
    throw std::invalid_argument("hh::kernels::causal_conv_silu: expected x [B, T, C] and weight [C, 1, 4] of x's dtype");
  const c10::cuda::CUDAGuard guard(x.device());
  at::Tensor y = at::empty_like(x);
  const int64_t B = x.size(0), T = x.size(1), C = x.size(2);
  if (y.numel() == 0) return y;
  auto stream = at::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "hh_causal_conv_silu", [&] {
    constexpr int kV = 16 / sizeof(scalar_t);
    const scalar_t* xp = x.data_ptr<scalar_t>();
    scalar_t* yp = y.data_ptr<scalar_t>();
    const scalar_t* wp = weight.data_ptr<scalar_t>();
    const bool packed = C % kV == 0 && reinterpret_cast<uintptr_t>(xp) % 16 == 0 && reinterpret_cast<uintptr_t>(yp) % 16 == 0 &&
                        reinterpret_cast<uintptr_t>(wp) % 16 == 0;
    const dim3 blocks = conv_grid(B, T, packed ? C / kV : C);
    const unsigned threads = 32 * kConvWarps;
    if (packed)
      causal_conv_silu_kernel<scalar_t, kV, kShortConvTaps><<<blocks, threads, 0, stream>>>(xp, wp, yp, T, C);
    else
      causal_conv_silu_kernel<scalar_t, 1, kShortConvTaps><<<blocks, threads, 0, stream>>>(xp, wp, yp, T, C);
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return y;
}

std::pair<at::Tensor, at::Tensor> causal_conv_silu_backward(const at::Tensor& dy, const at::Tensor& x, const at::Tensor& weight) {
  check(dy, "dy");
  check(x, "x");
  check(weight, "weight");
  if (x.dim() != 3 || dy.sizes() != x.sizes() || dy.scalar_type() != x.scalar_type() || weight.dim() != 3 ||
      weight.size(0) != x.size(2) || weight.size(1) != 1 || weight.size(2) != kShortConvTaps ||
      weight.scalar_type() != x.scalar_type())
    throw std::invalid_argument(
        "hh::kernels::causal_conv_silu_backward: expected dy and x [B, T, C] of one dtype and weight [C, 1, 4] of it");
  const int64_t B = x.size(0), T = x.size(1), C = x.size(2);
  if (B > 65535 || (C + 31) / 32 > 65535)
    throw std::invalid_argument("hh::kernels::causal_conv_silu_backward: at most 65535 sequences and 65535 x 32 channels");
  const c10::cuda::CUDAGuard guard(x.device());
  at::Tensor dx = at::empty_like(x);
  at::Tensor dw = at::zeros({C, 1, kShortConvTaps}, x.options().dtype(at::kFloat));
  if (x.numel() > 0) {
    constexpr int64_t kBlockSteps = static_cast<int64_t>(kConvBackSteps) * kConvBackRuns;
    const dim3 blocks(static_cast<unsigned>((T + kBlockSteps - 1) / kBlockSteps), static_cast<unsigned>((C + 31) / 32),
                      static_cast<unsigned>(B));
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "hh_causal_conv_silu_backward", [&] {
      causal_conv_silu_backward_kernel<scalar_t, kShortConvTaps><<<blocks, kConvBackThreads, 0, at::cuda::getCurrentCUDAStream()>>>(
          x.data_ptr<scalar_t>(), weight.data_ptr<scalar_t>(), dy.data_ptr<scalar_t>(), dx.data_ptr<scalar_t>(),
          dw.data_ptr<float>(), T, C);
    });
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  return {dx, dw.to(x.scalar_type())};
}

bool conv_rope_l2norm_supported(int64_t C, int64_t Dh, at::ScalarType dtype) {
  if (dtype != at::kFloat && dtype != at::kHalf && dtype != at::kBFloat16) return false;
  const int64_t V = 16 / c10::elementSize(dtype), P = Dh / std::max<int64_t>(V, 1);
  return Dh > 0 && C > 0 && C % Dh == 0 && Dh % (2 * V) == 0 && P <= 32 && (P & (P - 1)) == 0;
}

at::Tensor causal_conv_silu_rope_l2norm(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& cos,
                                        const at::Tensor& sin, int64_t Dh, double eps) {
  check(x, "x");
  check(weight, "weight");
  check(cos, "cos");
  check(sin, "sin");
  const std::string fn = "hh::kernels::causal_conv_silu_rope_l2norm: ";
  if (x.dim() != 3 || weight.dim() != 3 || weight.size(0) != x.size(2) || weight.size(1) != 1 ||
      weight.size(2) != kShortConvTaps || weight.scalar_type() != x.scalar_type())
    throw std::invalid_argument(fn + "expected x [B, T, C] and weight [C, 1, 4] of x's dtype");
  const int64_t B = x.size(0), T = x.size(1), C = x.size(2);
  if (!conv_rope_l2norm_supported(C, Dh, x.scalar_type()))
    throw std::invalid_argument(fn + "C a multiple of Dh, and Dh / (16 bytes of elements) a power of two <= 32 with an even count of packs");
  if (cos.scalar_type() != x.scalar_type() || sin.scalar_type() != x.scalar_type() || cos.numel() != T * Dh || sin.numel() != T * Dh)
    throw std::invalid_argument(fn + "cos and sin must be [T, Dh] of x's dtype");
  for (const at::Tensor* t : {&x, &weight, &cos, &sin})
    if (reinterpret_cast<uintptr_t>(t->data_ptr()) % 16 != 0) throw std::invalid_argument(fn + "x, weight, cos and sin must be 16-byte aligned");
  const c10::cuda::CUDAGuard guard(x.device());
  at::Tensor y = at::empty({B, T, C / Dh, Dh}, x.options());
  if (y.numel() == 0) return y;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "hh_conv_rope_l2norm", [&] {
    constexpr int kV = 16 / sizeof(scalar_t);
    conv_rope_l2norm_kernel<scalar_t, kV, kShortConvTaps>
        <<<conv_grid(B, T, C / kV), 32 * kConvWarps, 0, at::cuda::getCurrentCUDAStream()>>>(
            x.data_ptr<scalar_t>(), weight.data_ptr<scalar_t>(), cos.data_ptr<scalar_t>(), sin.data_ptr<scalar_t>(),
            y.data_ptr<scalar_t>(), T, C, static_cast<int>(Dh), static_cast<int>(Dh / kV), static_cast<float>(eps));
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return y;
}

ConvolvedQkv short_conv_apart(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const ShortConvInputs& c) {
  if (q.dim() != 4 || k.sizes() != q.sizes() || v.dim() != 4)
    throw std::invalid_argument("hh::kernels::short_conv_apart: expected q and k [B, T, H, D] of one shape, v [B, T, H, Dv]");
  const int64_t B = q.size(0), T = q.size(1), H = q.size(2), D = q.size(3);
  auto flat = [&](const at::Tensor& x) { return x.reshape({B, T, -1}).contiguous(); };
  auto aligned = [](const at::Tensor& t) { return reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0; };
  const at::Tensor qf = flat(q), kf = flat(k);
  ConvolvedQkv r;
  if (conv_rope_l2norm_supported(H * D, D, q.scalar_type()) && aligned(qf) && aligned(kf) && aligned(c.wq) &&
      aligned(c.wk) && aligned(c.cos) && aligned(c.sin)) {
    r.q = causal_conv_silu_rope_l2norm(qf, c.wq, c.cos, c.sin, D, c.eps);
    r.k = causal_conv_silu_rope_l2norm(kf, c.wk, c.cos, c.sin, D, c.eps);
  } else {
    r.q = rope_l2norm(causal_conv_silu(qf, c.wq).view({B, T, H, D}), c.cos, c.sin, c.eps);
    r.k = rope_l2norm(causal_conv_silu(kf, c.wk).view({B, T, H, D}), c.cos, c.sin, c.eps);
  }
  r.v = causal_conv_silu(flat(v), c.wv).view(v.sizes());
  return r;
}

void launch_fusion_forward(const at::Tensor& o, const at::Tensor& gate, GateActivation act, const at::Tensor& gamma,
                           double eps, at::Tensor& y, const FusionPlacement& pl) {
  const int64_t n = o.size(-2), rows = o.numel() / o.size(-1);
  if (rows == 0) return;
  const unsigned blocks = static_cast<unsigned>((rows + kFusionWarps - 1) / kFusionWarps);
  const int64_t Dh = o.size(-1);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, o.scalar_type(), "hh_fusion_forward", [&] {
    // Vector accesses when every row of o, gate, gamma and y starts on a multiple of Dh / 32 elements.
    const int64_t vec = Dh % 32 == 0 ? Dh / 32 : 1;
    auto aligned = [&](const at::Tensor& t) { return reinterpret_cast<uintptr_t>(t.data_ptr()) % (vec * sizeof(scalar_t)) == 0; };
    const bool vector = (vec == 2 || vec == 4 || vec == 8) && pl.gate_ld % vec == 0 && pl.y_ld % vec == 0 && aligned(o) &&
                        aligned(gate) && aligned(gamma) && aligned(y);
    auto pick = [&](auto act_c) {
      constexpr int A = decltype(act_c)::value;
      if (!vector) return fusion_forward_kernel<scalar_t, A, 1>;
      return vec == 2 ? fusion_forward_kernel<scalar_t, A, 2>
             : vec == 4 ? fusion_forward_kernel<scalar_t, A, 4>
                        : fusion_forward_kernel<scalar_t, A, 8>;
    };
    using None = std::integral_constant<int, static_cast<int>(GateActivation::kNone)>;
    using Sigmoid = std::integral_constant<int, static_cast<int>(GateActivation::kSigmoid)>;
    using Silu = std::integral_constant<int, static_cast<int>(GateActivation::kSilu)>;
    auto kernel = act == GateActivation::kSigmoid ? pick(Sigmoid{}) : act == GateActivation::kSilu ? pick(Silu{}) : pick(None{});
    kernel<<<blocks, kFusionWarps * 32, 0, at::cuda::getCurrentCUDAStream()>>>(
        o.data_ptr<scalar_t>(), gate.data_ptr<scalar_t>(), gamma.data_ptr<scalar_t>(), y.data_ptr<scalar_t>(), rows,
        static_cast<int>(n), static_cast<int>(Dh), static_cast<float>(eps), pl);
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

at::Tensor fusion_norm_forward(const at::Tensor& o, const at::Tensor& gate, const at::Tensor& gamma, double eps) {
  check_fusion(o, gate, gamma);
  const c10::cuda::CUDAGuard guard(o.device());
  at::Tensor y = at::empty_like(o);
  const int64_t n = o.size(1), Dh = o.size(2);
  if (n > kMaxFusionHeads) throw std::invalid_argument("hh::kernels::fusion_norm_forward: at most 256 heads");
  FusionPlacement pl{n * Dh, n * Dh, {}};
  for (int i = 0; i < n; ++i) pl.pos[i] = i;
  launch_fusion_forward(o, gate, GateActivation::kNone, gamma, eps, y, pl);
  return y;
}

void fusion_norm_forward_into(const at::Tensor& o, const at::Tensor& gate, GateActivation act, const at::Tensor& gamma,
                              double eps, at::Tensor& y, const std::vector<int64_t>& heads) {
  auto fail = [](const std::string& what) { throw std::invalid_argument("hh::kernels::fusion_norm_forward_into: " + what); };
  check(o, "o");
  check(gamma, "gamma");
  check(y, "y");
  if (o.dim() != 4 || y.dim() != 4 || gate.dim() != 3) fail("expected o [B, T, n, Dh], gate [B, T, n Dh], y [B, T, Hy, Dh]");
  const int64_t B = o.size(0), T = o.size(1), n = o.size(2), Dh = o.size(3), Hy = y.size(2);
  if (Dh > 32 * kMaxPerLane || n > kMaxFusionHeads) fail("Dh <= 256 and at most 256 heads");
  if (gate.scalar_type() != o.scalar_type() || gamma.scalar_type() != o.scalar_type() || y.scalar_type() != o.scalar_type())
    fail("o, gate, gamma and y must have one dtype");
  if (!gate.is_cuda() || gate.device() != o.device() || gate.size(0) != B || gate.size(1) != T || gate.size(2) != n * Dh ||
      gate.stride(2) != 1 || (B > 1 && gate.stride(0) != T * gate.stride(1)))
    fail("gate must be [B, T, n Dh] with unit stride on its last axis and evenly spaced rows");
  if (y.size(0) != B || y.size(1) != T || y.size(3) != Dh || gamma.sizes() != at::IntArrayRef({n, Dh}))
    fail("y must be [B, T, Hy, Dh] and gamma [n, Dh]");
  if (static_cast<int64_t>(heads.size()) != n) fail("heads must name one position per head of o");
  FusionPlacement pl{gate.stride(1), Hy * Dh, {}};
  place_heads(pl, heads, Hy, "hh::kernels::fusion_norm_forward_into");
  const c10::cuda::CUDAGuard guard(o.device());
  launch_fusion_forward(o, gate, act, gamma, eps, y, pl);
}

FusionNormGrads fusion_norm_backward(const at::Tensor& dy, const at::Tensor& o, const at::Tensor& gate,
                                     const at::Tensor& gamma, double eps) {
  check_fusion(o, gate, gamma);
  check(dy, "dy");
  if (dy.sizes() != o.sizes() || dy.scalar_type() != o.scalar_type())
    throw std::invalid_argument("hh::kernels::fusion_norm_backward: dy must match o");
  const c10::cuda::CUDAGuard guard(o.device());
  FusionNormGrads g;
  g.d_o = at::empty_like(o);
  g.d_gate = at::empty_like(o);
  at::Tensor rows_grad = at::empty(o.sizes(), o.options().dtype(at::kFloat));
  const int64_t rows = o.size(0) * o.size(1);
  if (rows > 0) {
    const unsigned blocks = static_cast<unsigned>((rows + kFusionWarps - 1) / kFusionWarps);
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, o.scalar_type(), "hh_fusion_backward", [&] {
      fusion_backward_kernel<scalar_t><<<blocks, kFusionWarps * 32, 0, at::cuda::getCurrentCUDAStream()>>>(
          dy.data_ptr<scalar_t>(), o.data_ptr<scalar_t>(), gate.data_ptr<scalar_t>(), gamma.data_ptr<scalar_t>(),
          g.d_o.data_ptr<scalar_t>(), g.d_gate.data_ptr<scalar_t>(), rows_grad.data_ptr<float>(), rows,
          static_cast<int>(o.size(1)), static_cast<int>(o.size(2)), static_cast<float>(eps));
    });
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  g.d_gamma = rows_grad.sum(0);  // [n, Dh]
  return g;
}

}  // namespace hh::kernels
