#pragma once
// Device helpers the kernels share: asynchronous 16-byte copies into shared memory; bulk copies
// completing on shared-memory barriers; the mma.sync products (m16n8k8 TF32 with its operand
// conversions, m16n8k16 float16 / bfloat16), ldmatrix and stmatrix; vector packs of elements; and rotate-half
// RoPE with HF's roundings.
//
// Fragment layout of mma.sync.m16n8k8 (lane = 4 g + t, g in 0..7, t in 0..3):
//   A (16 x 8, row major): a[0] = A[g][t], a[1] = A[g + 8][t], a[2] = A[g][t + 4], a[3] = A[g + 8][t + 4]
//   B (8 x 8, column):     b[0] = B[t][g], b[1] = B[t + 4][g]
//   C (16 x 8):            c[e] = C[g + 8 (e >= 2)][2 t + (e & 1)]
// and of mma.sync.m16n8k16 with 16-bit operands (each register two elements, the lower index first):
//   A (16 x 16): a[0] = A[g][2t, 2t+1], a[1] = A[g + 8][2t, 2t+1], a[2] = A[g][2t+8, 2t+9], a[3] = A[g + 8][2t+8, 2t+9]
//   B (16 x 8):  b[0] = B[2t, 2t+1][g], b[1] = B[2t+8, 2t+9][g];  C as for m16n8k8.
// ldmatrix loads 8 x 8 blocks of 16-bit elements, lanes 8i..8i+7 giving the row addresses of block i;
// lane 4g + t receives row g, elements 2t and 2t+1 of each block (with .trans, column g, rows 2t and
// 2t+1): with row addresses chosen per fragment, one instruction loads a whole A or B fragment.
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

namespace hh::kernels::device {

// threadIdx.x read again at each call (a volatile move from %tid.x): a kernel that loops over work items
// reads it so at each item's start, so that what it derives from it is formed there rather than hoisted out
// of the loop and held in registers through every item.
__device__ __forceinline__ int thread_index_here() {
  unsigned t;
  asm volatile("mov.u32 %0, %%tid.x;\n" : "=r"(t));
  return static_cast<int>(t);
}

__device__ __forceinline__ void cp_async16(void* smem, const void* gmem) {
  const unsigned addr = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(addr), "l"(gmem));
}
// 4 bytes, through L1 (cp.async.cg takes 16-byte copies only).
__device__ __forceinline__ void cp_async4(void* smem, const void* gmem) {
  const unsigned addr = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(addr), "l"(gmem));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

// Hopper's bulk copies and the shared-memory barriers they complete on (sm_90). A barrier's phase
// completes when its expected arrivals have arrived and the bytes announced by arrive_expect_tx have
// landed; waiters poll the phase's parity.
// The helpers below that issue sm_90 instructions trap when compiled for an older device (no kernel
// reaches them there: the host asks copy_engine_available() before taking a path that uses them), so that
// a kernel with such a path still compiles for every architecture the build targets.
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 900
#define HH_COPY_ENGINE 1
#else
#define HH_COPY_ENGINE 0
#endif
__device__ __forceinline__ unsigned smem_addr(const void* p) { return static_cast<unsigned>(__cvta_generic_to_shared(p)); }
__device__ __forceinline__ void mbar_init(unsigned long long* bar, unsigned arrivals) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_addr(bar)), "r"(arrivals) : "memory");
}
// Makes the barriers' initialisation visible to the copy engine (then a block-wide barrier).
__device__ __forceinline__ void mbar_init_fence() {
#if HH_COPY_ENGINE
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
#else
  __trap();
#endif
}
__device__ __forceinline__ void mbar_arrive(unsigned long long* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(smem_addr(bar)) : "memory");
}
// An arrival on `bar` once this thread's cp.async copies issued so far have landed, the phase's expected
// arrivals raised by one first (so the net count is unchanged): the phase cannot complete before them.
// Issued before the phase's other arrivals.
__device__ __forceinline__ void cp_async_mbar_arrive(unsigned long long* bar) {
  asm volatile("cp.async.mbarrier.arrive.shared::cta.b64 [%0];\n" ::"r"(smem_addr(bar)) : "memory");
}
// One arrival that also announces `bytes` more to land in this phase.
__device__ __forceinline__ void mbar_arrive_expect_tx(unsigned long long* bar, unsigned bytes) {
#if HH_COPY_ENGINE
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem_addr(bar)), "r"(bytes) : "memory");
#else
  __trap();
#endif
}
// The suspend time of the barrier waits here (10 ms, far beyond any phase's wait).
constexpr unsigned kSuspendNs = 10'000'000;
// Waits for the phase of the given parity to complete. Each try names the suspend time: the waiting warp
// sleeps until the phase completes instead of retrying after the device's own short limit. Without it the
// scan's producer warp spun on its `empty` barrier: 13 % of the kernel's issued instructions (the scan
// took the same cycles either way). CLUSTER: acquiring at cluster scope what other blocks' stores
// completed on the barrier (mbar_wait_cluster).
template <bool CLUSTER = false>
__device__ __forceinline__ void mbar_wait(unsigned long long* bar, unsigned parity) {
#if HH_COPY_ENGINE
  unsigned done = 0;
  do {
    if constexpr (CLUSTER)
      asm volatile(
          "{\n .reg .pred p;\n mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 p, [%1], %2, %3;\n selp.u32 %0, 1, 0, p;\n}\n"
          : "=r"(done)
          : "r"(smem_addr(bar)), "r"(parity), "r"(kSuspendNs)
          : "memory");
    else
      asm volatile(
          "{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2, %3;\n selp.u32 %0, 1, 0, p;\n}\n"
          : "=r"(done)
          : "r"(smem_addr(bar)), "r"(parity), "r"(kSuspendNs)
          : "memory");
  } while (!done);
#else
  __trap();
#endif
}
// The box at (x, y) (x the inner coordinate) of a 2-D tensor map from global to shared memory by the
// copy engine, completing on `bar`. `map` is a __grid_constant__ kernel parameter.
__device__ __forceinline__ void tma_load_2d(void* smem, const void* map, int x, int y, unsigned long long* bar) {
#if HH_COPY_ENGINE
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];\n" ::"r"(
          smem_addr(smem)),
      "l"(map), "r"(x), "r"(y), "r"(smem_addr(bar))
      : "memory");
#else
  __trap();
#endif
}
// The box at (x, y, z) of a 3-D tensor map, as tma_load_2d. The copy engine fills the box's elements that
// lie outside the tensor (at negative coordinates too) with zeros, and counts them among its bytes.
__device__ __forceinline__ void tma_load_3d(void* smem, const void* map, int x, int y, int z, unsigned long long* bar) {
#if HH_COPY_ENGINE
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4}], [%5];\n" ::"r"(
          smem_addr(smem)),
      "l"(map), "r"(x), "r"(y), "r"(z), "r"(smem_addr(bar))
      : "memory");
#else
  __trap();
#endif
}
// The box at (x, y) of a 2-D tensor map from shared memory to global memory by the copy engine (one
// thread), in a bulk group of its own. Each thread that wrote the box calls fence_proxy_async_shared
// first, then a barrier orders it before this call; bulk_wait_read<0>() (the same thread) before the box
// is written again.
__device__ __forceinline__ void tma_store_2d(const void* map, int x, int y, const void* smem) {
#if HH_COPY_ENGINE
  asm volatile("cp.async.bulk.tensor.2d.global.shared::cta.bulk_group [%0, {%1, %2}], [%3];\n"
               "cp.async.bulk.commit_group;\n" ::"l"(map),
               "r"(x), "r"(y), "r"(smem_addr(smem))
               : "memory");
#else
  __trap();
#endif
}
// Until at most N of this thread's bulk groups still read their shared memory.
template <int N>
__device__ __forceinline__ void bulk_wait_read() {
#if HH_COPY_ENGINE
  asm volatile("cp.async.bulk.wait_group.read %0;\n" ::"n"(N) : "memory");
#else
  __trap();
#endif
}
// Until at most N of this thread's bulk groups are still in flight (their writes done too).
template <int N>
__device__ __forceinline__ void bulk_wait() {
#if HH_COPY_ENGINE
  asm volatile("cp.async.bulk.wait_group %0;\n" ::"n"(N) : "memory");
#else
  __trap();
#endif
}
// Named barriers for some of a block's warps, while the others go on (barrier 0 is __syncthreads'). A
// kernel uses one of the two forms. group_sync: barrier 1, until THREADS threads (whole warps) reach it.
template <int THREADS>
__device__ __forceinline__ void group_sync() {
  asm volatile("bar.sync 1, %0;\n" ::"n"(THREADS) : "memory");
}
// warp_pair_sync: warps 2i and 2i + 1 alone (barrier 1 + i), for a step whose reads cross only between the
// two warps of a pair.
__device__ __forceinline__ void warp_pair_sync(int warp) {
  asm volatile("bar.sync %0, 64;\n" ::"r"(1 + warp / 2) : "memory");
}
// Orders this thread's earlier accesses to shared memory (the generic proxy) before later bulk copies
// into it or out of it (the async proxy): each thread that touched a region calls it before the barrier
// after which a copy overwrites the region (or stores it).
__device__ __forceinline__ void fence_proxy_async_shared() {
#if HH_COPY_ENGINE
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
#else
  __trap();
#endif
}
// Where the copy engine's SW-byte swizzle (SW = 32, 64 or 128; the tile 1024-byte aligned) puts the
// byte at `linear` of an unswizzled tile of SW-byte rows: the row's 16-byte unit XOR-ed with bits 7..
// of the offset, so that the same unit of eight consecutive rows falls in distinct banks.
template <int SW>
__device__ __forceinline__ int swizzle(int linear) {
  static_assert(SW == 32 || SW == 64 || SW == 128, "swizzle width");
  return linear ^ (((linear >> 7) & (SW / 16 - 1)) << 4);
}
// The byte offset of element (r, c) of a ROWS-row 16-bit tile the copy engine wrote in boxes of SW / 2
// columns one after the other, swizzled. c must be a multiple of 8 (an ldmatrix row address).
template <int SW, int ROWS>
__device__ __forceinline__ int swizzled(int r, int c) {
  constexpr int kBoxCols = SW / 2;
  return swizzle<SW>((c / kBoxCols) * ROWS * SW + r * SW + (c % kBoxCols) * 2);
}
// The same for a float32 tile one box (SW bytes) wide; c even for 8-byte accesses.
template <int SW>
__device__ __forceinline__ int swizzled_f32(int r, int c) {
  return swizzle<SW>(r * SW + c * 4);
}

// x rounded to TF32 (round to nearest, ties away), as the bits the tensor cores read.
__device__ __forceinline__ unsigned to_tf32(float x) {
  unsigned r;
  asm("cvt.rna.tf32.f32 %0, %1;\n" : "=r"(r) : "f"(x));
  return r;
}
// x = hi + lo with both TF32: the 3xTF32 split (hi*hi + hi*lo + lo*hi keeps float32 accuracy).
__device__ __forceinline__ void split_tf32(float x, unsigned& hi, unsigned& lo) {
  hi = to_tf32(x);
  lo = to_tf32(x - __uint_as_float(hi));
}
// The same split by truncation: three instructions for both halves, where the rounded split takes nine
// (cvt.rna is an infinity test, an add, a select and a mask for each half, and the subtraction between).
// hi = x's top 19 bits, lo = x - hi (exact) with its own low 13 bits cleared. hi + lo is within
// 2^-21 |x| of x, against 2^-23 for the rounded split. Infinity stays infinite in hi, and the device's
// own NaN (all mantissa bits set) stays NaN.
__device__ __forceinline__ void split_tf32_truncated(float x, unsigned& hi, unsigned& lo) {
  hi = __float_as_uint(x) & 0xffffe000u;
  lo = __float_as_uint(x - __uint_as_float(hi)) & 0xffffe000u;
}
// c += a b on the tensor cores (TF32 operands, float32 accumulation).
__device__ __forceinline__ void mma_tf32(float (&c)[4], const unsigned (&a)[4], const unsigned (&b)[2]) {
  asm volatile(
      "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// c += a b on the tensor cores (float16 operands, float32 accumulation).
__device__ __forceinline__ void mma_f16(float (&c)[4], const unsigned (&a)[4], const unsigned (&b)[2]) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
// The same with bfloat16 operands.
__device__ __forceinline__ void mma_bf16(float (&c)[4], const unsigned (&a)[4], const unsigned (&b)[2]) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
__device__ __forceinline__ void ldmatrix_x4(unsigned (&r)[4], const void* smem) {
  const unsigned addr = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
__device__ __forceinline__ void ldmatrix_x4_trans(unsigned (&r)[4], const void* smem) {
  const unsigned addr = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
// Lanes 0..15 give the row addresses (the others' are ignored).
__device__ __forceinline__ void ldmatrix_x2_trans(unsigned (&r)[2], const void* smem) {
  const unsigned addr = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0,%1}, [%2];\n" : "=r"(r[0]), "=r"(r[1]) : "r"(addr));
}
// ldmatrix's inverse with .trans (sm_90): the fragments in r (lane 4g + t holding row g, elements 2t and
// 2t + 1 of block i in r[i]) stored as four 8 x 8 blocks each transposed, lanes 8i..8i+7 giving the
// addresses of the stored rows of block i (row j of the stored block is column j of the fragment's).
__device__ __forceinline__ void stmatrix_x4_trans(void* smem, const unsigned (&r)[4]) {
#if HH_COPY_ENGINE
  asm volatile("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1,%2,%3,%4};\n" ::"r"(smem_addr(smem)), "r"(r[0]),
               "r"(r[1]), "r"(r[2]), "r"(r[3])
               : "memory");
#else
  __trap();
#endif
}
// ---- Warpgroup products (wgmma, sm_90a): four warps, a 64-row tile, the B operand read from shared
// memory once for all four ----
// A warp's part of a wgmma m64nNk16 is its 16 rows, in mma.sync m16n8k16's layouts: its A fragment (16 x
// 16, four registers) is m16n8k16's A, and its accumulators are N / 8 tiles of m16n8's C, tile j holding
// columns 8 j .. 8 j + 7. The B operand (16 x N) lies in shared memory as the copy engine writes a 16-bit
// tile with the 128-byte swizzle (each 8 rows of 128 bytes a 1024-byte-aligned atom), described by
//   K-major (B[k][n] at row n, element k: rows of the N dimension, k contiguous): the start address of
//     the 16-element slice (a row's 128 bytes hold four slices of 32 bytes), the stride between 8-row
//     groups of N (sbo, 1024 bytes for packed rows);
//   MN-major (B[k][n] at row k, element n): the start address of rows k0 .. k0 + 15, the stride between
//     their two 8-row groups and, for N > 64, between 64-column boxes (one is the descriptor's leading
//     offset, the other its stride offset: with N = 64 and both given as the 8-row stride, either reading
//     is right).
#if defined(__CUDA_ARCH_FEAT_SM90_ALL) || !defined(__CUDA_ARCH__)
#define HH_WGMMA 1
#else
#define HH_WGMMA 0
#endif
__device__ __forceinline__ uint64_t wgmma_desc_sw128(const void* smem, unsigned lbo, unsigned sbo) {
  return static_cast<uint64_t>((smem_addr(smem) >> 4) & 0x3fffu) | static_cast<uint64_t>((lbo >> 4) & 0x3fffu) << 16 |
         static_cast<uint64_t>((sbo >> 4) & 0x3fffu) << 32 | 1ull << 62;  // layout 1: the 128-byte swizzle
}
// Before a warpgroup's products whose A fragments or accumulators other instructions wrote.
__device__ __forceinline__ void wgmma_fence() {
#if HH_WGMMA
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#else
  __trap();
#endif
}
__device__ __forceinline__ void wgmma_commit() {
#if HH_WGMMA
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
#else
  __trap();
#endif
}
// Until at most N committed groups of this warpgroup's products are still running.
template <int N>
__device__ __forceinline__ void wgmma_wait() {
#if HH_WGMMA
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
#else
  __trap();
#endif
}
// Ties d's registers to this point (after wgmma_wait), so that no read of them is placed before it.
template <int NT>
__device__ __forceinline__ void wgmma_hold(float (&d)[NT][4]) {
#pragma unroll
  for (int j = 0; j < NT; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) asm volatile("" : "+f"(d[j][e])::"memory");
}
// d += a b for the warpgroup's 64 x 64 tile (float16 operands, float32 accumulators): a this warp's A
// fragment (registers), b by its descriptor, TRANS_B for an MN-major B. Asynchronous: d and a stay
// untouched until wgmma_wait has seen the group committed after it.
template <int TRANS_B>
__device__ __forceinline__ void wgmma_m64n64k16(float (&d)[8][4], const unsigned (&a)[4], uint64_t b) {
#if HH_WGMMA
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %38, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "
      "{%32, %33, %34, %35}, %36, p, 1, 1, %37;\n}\n"
      : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]),
        "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]),
        "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]),
        "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]), "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "n"(TRANS_B), "r"(1));
#else
  (void)d, (void)a, (void)b;
  __trap();
#endif
}

// d += a b for the warpgroup's 64 x 64 tile with both operands in shared memory, 16-bit values of X's kind
// (bfloat16 or float16) and float32 accumulators: a (64 x 16) and b (16 x 64) by their descriptors,
// TRANS_A / TRANS_B for an MN-major a / b (a: its rows of the M dimension contiguous, as b's MN-major
// form). Asynchronous, as wgmma_m64n64k16.
template <class X, int TRANS_A, int TRANS_B>
__device__ __forceinline__ void wgmma_m64n64k16_ss(float (&d)[8][4], uint64_t a, uint64_t b) {
#if HH_WGMMA
#define HH_WGMMA_SS(TYPE)                                                                                                       \
  asm volatile(                                                                                                                 \
      "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"                                                                             \
      "wgmma.mma_async.sync.aligned.m64n64k16.f32." TYPE "." TYPE " "                                                            \
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "                                                 \
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "                                       \
      "%32, %33, p, 1, 1, %35, %36;\n}\n"                                                                                        \
      : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]), \
        "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]), \
        "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]), \
        "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]), "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3]) \
      : "l"(a), "l"(b), "r"(1), "n"(TRANS_A), "n"(TRANS_B))
  if constexpr (std::is_same_v<X, c10::BFloat16>) HH_WGMMA_SS("bf16");
  else HH_WGMMA_SS("f16");
#undef HH_WGMMA_SS
#else
  (void)d, (void)a, (void)b;
  __trap();
#endif
}

// d += sum over k of a[k] b_k as one group of the warpgroup's products, issued and not waited for: desc(k)
// describes b_k. Until wgmma_wait and wgmma_hold(d), d and a's registers must not be touched (the PTX ISA
// leaves any access to them before the products' wgmma.wait_group undefined).
template <int TRANS_B, int K16, class Desc>
__device__ __forceinline__ void wgmma_product_issue(float (&d)[8][4], const unsigned (&a)[K16][4], Desc desc) {
  wgmma_fence();
#pragma unroll
  for (int k = 0; k < K16; ++k) wgmma_m64n64k16<TRANS_B>(d, a[k], desc(k));
  wgmma_commit();
}
// The same, waited for.
template <int TRANS_B, int K16, class Desc>
__device__ __forceinline__ void wgmma_product(float (&d)[8][4], const unsigned (&a)[K16][4], Desc desc) {
  wgmma_product_issue<TRANS_B>(d, a, desc);
  wgmma_wait<0>();
  wgmma_hold(d);
}

// Two floats as a float16 pair in one register (x in the low half), rounded to nearest.
__device__ __forceinline__ unsigned pack_f16(float x, float y) {
  const __half2 h = __floats2half2_rn(x, y);
  return *reinterpret_cast<const unsigned*>(&h);
}

// V consecutive elements moved as one vector load or store (16 bytes for 8 16-bit values).
template <class T, int V>
struct alignas(sizeof(T) * V) Pack {
  T v[V];
};
template <int V, class T>
__device__ __forceinline__ Pack<T, V> load_pack(const T* p) {
  return *reinterpret_cast<const Pack<T, V>*>(p);
}
template <int V, class T>
__device__ __forceinline__ void store_pack(T* p, const Pack<T, V>& x) {
  *reinterpret_cast<Pack<T, V>*>(p) = x;
}

// 16 bytes to global memory at p (16-byte aligned) in one vector store. An assignment through a vector
// type (`*reinterpret_cast<uint4*>(p) = v`, store_pack) is lowered element by element, and the compiler
// merges the elements' stores again only where it can prove p's alignment from the address arithmetic.
// Where it cannot (a row and a column from a division and a remainder, say), four 4-byte stores remain
// (eight 2-byte ones for a Pack of 16-bit values), and each writes a part of a 32-byte sector in L2:
// chunk_factors' output tiles moved through L2 in 2.5 times the sectors their bytes need.
__device__ __forceinline__ void store_global16(void* p, uint4 v) { __stwb(static_cast<uint4*>(p), v); }
// 8 bytes to global memory at p (8-byte aligned) in one vector store, as store_global16.
__device__ __forceinline__ void store_global8(void* p, uint2 v) { __stwb(static_cast<uint2*>(p), v); }
// store_pack into global memory: a pack of 16 or 8 bytes as one vector store (store_global16 / 8), others
// as store_pack.
template <int V, class T>
__device__ __forceinline__ void store_pack_global(T* p, const Pack<T, V>& x) {
  if constexpr (sizeof(x) == 16) {
    uint4 v;
    memcpy(&v, &x, sizeof(v));
    store_global16(p, v);
  } else if constexpr (sizeof(x) == 8) {
    uint2 v;
    memcpy(&v, &x, sizeof(v));
    store_global8(p, v);
  } else {
    store_pack<V>(p, x);
  }
}

// One element of rotate-half RoPE, y = x cos + rot sin with rot = -x[i + Dh/2] or x[i - Dh/2],
// each product rounded to the dtype and then their sum, as HF's op sequence rounds.
template <class T>
__device__ __forceinline__ T rope_element(float x, float rot, float c, float s) {
  const T a = static_cast<T>(x * c);
  const T b = static_cast<T>(rot * s);
  return static_cast<T>(static_cast<float>(a) + static_cast<float>(b));
}

// A 16-bit type's packed pair (two elements in one register), its conversion to two floats, and two
// floats rounded to a pair (each as static_cast<T> rounds it).
template <class T>
struct Pair16;
template <>
struct Pair16<c10::BFloat16> {
  using type = __nv_bfloat162;
  static __device__ __forceinline__ float2 to_float2(type v) { return __bfloat1622float2(v); }
  static __device__ __forceinline__ type round(float a, float b) { return __floats2bfloat162_rn(a, b); }
};
template <>
struct Pair16<c10::Half> {
  using type = __half2;
  static __device__ __forceinline__ float2 to_float2(type v) { return __half22float2(v); }
  static __device__ __forceinline__ type round(float a, float b) { return __floats2half2_rn(a, b); }
};

// RoPE of a pack of V elements x (rotate-half layout: rot = -partner in the first half of the head, the
// partner in the second) with their cos and sin, each element rounded as rope_element rounds it, into
// r; returns the sum of r's squares, in element order. For 16-bit T as packed pairs: a product of two
// 16-bit values is exact in float32 and a sum of two such products' roundings is exact there too
// (or far below half the 16-bit ulp), so the pairs' rounded multiplies and add give rope_element's
// values bit for bit, in fewer instructions. The _rn forms keep the compiler from contracting a
// multiply and the add into one fused multiply-add, which would round once where HF rounds twice.
template <class T, int V>
__device__ __forceinline__ float rope_pack(const Pack<T, V>& x, const Pack<T, V>& partner, bool first,
                                           const Pack<T, V>& c, const Pack<T, V>& s, float (&r)[V]) {
  float ss = 0.f;
  if constexpr (sizeof(T) == 2 && V % 2 == 0) {
    using P2 = typename Pair16<T>::type;
    const P2* xp = reinterpret_cast<const P2*>(x.v);
    const P2* pp = reinterpret_cast<const P2*>(partner.v);
    const P2* cp = reinterpret_cast<const P2*>(c.v);
    const P2* sp = reinterpret_cast<const P2*>(s.v);
#pragma unroll
    for (int q = 0; q < V / 2; ++q) {
      const P2 rot = first ? __hneg2(pp[q]) : pp[q];
      const float2 f = Pair16<T>::to_float2(__hadd2_rn(__hmul2_rn(xp[q], cp[q]), __hmul2_rn(rot, sp[q])));
      r[2 * q] = f.x;
      r[2 * q + 1] = f.y;
      ss += f.x * f.x;
      ss += f.y * f.y;
    }
  } else {
#pragma unroll
    for (int e = 0; e < V; ++e) {
      const float rot = first ? -static_cast<float>(partner.v[e]) : static_cast<float>(partner.v[e]);
      r[e] = static_cast<float>(rope_element<T>(static_cast<float>(x.v[e]), rot, static_cast<float>(c.v[e]),
                                                static_cast<float>(s.v[e])));
      ss += r[e] * r[e];
    }
  }
  return ss;
}

// RoPE and the row's L2 norm on pack y of a row whose P packs lie in consecutive lanes (`group`, this
// lane's pack first in the row's first half or not): the rotate-half partner swapped by a shuffle,
// rope_pack, the squares summed over the group by shuffles, then to_dtype(r * rsqrt(sum r^2 + eps)).
// rope_l2norm_packed_kernel's order (fused_ops.cu), for causal_conv_silu_rope_l2norm and chunk_factors'
// short convolution, which form the pack in registers.
template <class T, int V>
__device__ __forceinline__ Pack<T, V> rope_l2_lanes(const Pack<T, V>& y, unsigned group, int P, bool first,
                                                   const Pack<T, V>& c, const Pack<T, V>& s, float eps) {
  static_assert(V * sizeof(T) == 16, "16-byte packs");
  Pack<T, V> partner;
#pragma unroll
  for (int q = 0; q < 4; ++q)
    reinterpret_cast<unsigned*>(partner.v)[q] = __shfl_xor_sync(group, reinterpret_cast<const unsigned*>(y.v)[q], P / 2);
  float r[V];
  float ss = rope_pack<T, V>(y, partner, first, c, s, r);
  for (int off = P / 2; off > 0; off >>= 1) ss += __shfl_xor_sync(group, ss, off);
  const float inv = rsqrtf(ss + eps);
  Pack<T, V> o;
  if constexpr (sizeof(T) == 2) {  // a pair rounded a conversion, as each alone
    using P2 = typename Pair16<T>::type;
#pragma unroll
    for (int e = 0; e < V; e += 2) *reinterpret_cast<P2*>(o.v + e) = Pair16<T>::round(r[e] * inv, r[e + 1] * inv);
  } else {
#pragma unroll
    for (int e = 0; e < V; ++e) o.v[e] = static_cast<T>(r[e] * inv);
  }
  return o;
}

// Where a fusion of n heads places its rows (the fusion kernel's and chunk_output_f16_fused's): head i
// of row r (= b T + t) reads its gate at r gate_ld + i Dh and writes y at r y_ld + pos[i] Dh (elements).
constexpr int kMaxFusionHeads = 256;
struct FusionPlacement {
  int64_t gate_ld = 0, y_ld = 0;
  int32_t pos[kMaxFusionHeads] = {};
};
// Host side: pos[i] = heads[i] for the heads (at most kMaxFusionHeads), each a head of y's Hy, else
// std::invalid_argument naming `fn`.
inline void place_heads(FusionPlacement& pl, const std::vector<int64_t>& heads, int64_t Hy, const std::string& fn) {
  if (heads.size() > static_cast<size_t>(kMaxFusionHeads))
    throw std::invalid_argument(fn + ": at most " + std::to_string(kMaxFusionHeads) + " heads");
  for (size_t i = 0; i < heads.size(); ++i) {
    if (heads[i] < 0 || heads[i] >= Hy)
      throw std::invalid_argument(fn + ": head position " + std::to_string(heads[i]) + " is outside y's " + std::to_string(Hy));
    pl.pos[i] = static_cast<int32_t>(heads[i]);
  }
}

// e^x as __expf forms it (ex2.approx of x log2 e) with subnormal inputs and results flushed to zero:
// one instruction after the product instead of __expf's five, which rescale around a subnormal result.
// Where it only enters as 1 + e^x the two agree bit for bit: a result below 2^-126 leaves 1 unchanged
// either way, and an input below 2^-126 in magnitude gives 1 either way.
__device__ __forceinline__ float exp_ftz(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x * 1.4426950408889634f));
  return y;
}

// The cluster barrier in two halves (sm_90): an arrival without memory ordering, for a block whose
// reads of another block's shared memory are done (their values in registers), and the wait for every
// block's arrival, before the block may leave.
__device__ __forceinline__ void cluster_arrive_relaxed() { asm volatile("barrier.cluster.arrive.relaxed.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void cluster_wait() { asm volatile("barrier.cluster.wait.aligned;\n" ::: "memory"); }
// The whole cluster barrier with release and acquire (every thread of every block of the cluster).
__device__ __forceinline__ void cluster_sync_all() {
  asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;\n" ::: "memory");
}
// The address of `p` (in this block's shared memory) at the same offset in block `rank` of the cluster.
__device__ __forceinline__ unsigned cluster_addr(const void* p, unsigned rank) {
  unsigned r;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(r) : "r"(smem_addr(p)), "r"(rank));
  return r;
}
// mbar_wait, acquiring at cluster scope (what other blocks' st.async stores completed on the barrier).
__device__ __forceinline__ void mbar_wait_cluster(unsigned long long* bar, unsigned parity) { mbar_wait<true>(bar, parity); }
// A float to a cluster address (another block's shared memory) whose landing the barrier at the cluster
// address `bar` (in the same block) counts as 4 bytes of its current phase: nothing waits for this
// thread's other memory operations, as a releasing arrival after a plain store would.
__device__ __forceinline__ void st_async_f32(unsigned addr, float x, unsigned bar) {
  asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.f32 [%0], %1, [%2];\n" ::"r"(addr), "f"(x), "r"(bar)
               : "memory");
}

// 1 / sqrt(x) as rsqrtf gives it for normal x (the same MUFU.RSQ), without rsqrtf's rescaling of
// subnormal inputs (flushed to zero here): for sums of squares plus a norm's epsilon, never subnormal.
__device__ __forceinline__ float rsqrt_ftz(float x) {
  float y;
  asm("rsqrt.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// A gate's activation in float32 before its rounding to T: ACT 1 the sigmoid, 2 SiLU, 0 none
// (GateActivation's kSigmoid, kSilu, kNone). at::sigmoid's and at::silu's float formulas; for 16-bit T
// with the fast exponential and division (a few float32 ulp, far below T's rounding: the kernels that
// apply them are bound by their instructions, and the accurate forms are most of them).
template <int ACT, class T>
__device__ __forceinline__ float gate_activation(float x) {
  constexpr bool fast = sizeof(T) == 2;
  if constexpr (ACT == 1) return fast ? __fdividef(1.f, 1.f + exp_ftz(-x)) : 1.f / (1.f + expf(-x));
  else if constexpr (ACT == 2) return fast ? __fdividef(x, 1.f + exp_ftz(-x)) : x / (1.f + expf(-x));
  else return x;
}

// The scale-normalised fusion of one pair of a 16-bit output row, act(gate) * (gamma * (o * rstd)), each
// factor rounded to T where the LibTorch reference rounds it: o a pair of values (16-bit or held in
// float32), g the gate's pair in float32. gamma times the rounded norm and the rounded gate times that
// are products of two 16-bit values, exact in float32, so one rounded pair multiply gives the float32
// product's rounding bit for bit (the _rn form: no contraction into a fused multiply-add).
template <int ACT, class T>
__device__ __forceinline__ typename Pair16<T>::type fusion_pair(float2 o, float rstd, float2 g, typename Pair16<T>::type gamma) {
  const auto normed = Pair16<T>::round(o.x * rstd, o.y * rstd);
  const auto act = Pair16<T>::round(gate_activation<ACT, T>(g.x), gate_activation<ACT, T>(g.y));
  return __hmul2_rn(act, __hmul2_rn(gamma, normed));
}

// The LA heads' gates (g, beta) in float32 from their projections b and a, with the values (in the
// model's dtype T) of core/attention/hybrid.cpp's op sequence, each op's result rounded to T as LibTorch
// rounds it:
//   beta = sigmoid(b) (times 2 with two), g = -exp(A_log) * softplus(a + dt_bias)
// (sigmoid as 1 / (1 + exp(-x)), softplus as x above 20, else log1p(exp(x)), both in float32).
template <class T>
__device__ __forceinline__ float2 gdn_gate_values(float b, float a, float A_log, float dt_bias, bool two) {
  T be = static_cast<T>(1.f / (1.f + expf(-b)));
  if (two) be = static_cast<T>(static_cast<float>(be) * 2.f);
  const float x = static_cast<float>(static_cast<T>(a + dt_bias));
  const T sp = static_cast<T>(x > 20.f ? x : log1pf(expf(x)));
  const T decay_rate = static_cast<T>(-static_cast<float>(static_cast<T>(expf(A_log))));
  return make_float2(static_cast<float>(static_cast<T>(static_cast<float>(decay_rate) * static_cast<float>(sp))),
                     static_cast<float>(be));
}

// Element e of a pack of 16-bit values as float: for bfloat16 the bits moved into place in one
// instruction (a shift for the low half of a 32-bit word, a mask for the high half), where converting
// the element alone takes two for the high half. e must be known when compiled (unrolled loops).
template <class T, int V>
__device__ __forceinline__ float pack_float(const Pack<T, V>& p, int e) {
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    const unsigned w = reinterpret_cast<const unsigned*>(p.v)[e / 2];
    return __uint_as_float(e % 2 != 0 ? (w & 0xffff0000u) : (w << 16));
  } else {
    return static_cast<float>(p.v[e]);
  }
}
// Eight consecutive 16-bit values of T's kind at x (16-byte aligned) times s, rounded to float16 as
// c10::Half rounds (to nearest even), in one 16-byte vector: chunk_factors' Qd and kdecay, and the column
// scan's, formed from q's and k's rows in its slot, the same bits.
template <class T>
__device__ __forceinline__ uint4 scaled_half8(const T* x, float s) {
  const Pack<T, 8> in = load_pack<8>(x);  // pack_float: bfloat16 unpacked in one instruction an element
  return make_uint4(pack_f16(s * pack_float(in, 0), s * pack_float(in, 1)), pack_f16(s * pack_float(in, 2), s * pack_float(in, 3)),
                    pack_f16(s * pack_float(in, 4), s * pack_float(in, 5)), pack_f16(s * pack_float(in, 6), s * pack_float(in, 7)));
}

// Block float16 (the low-rank scan, the output factors of chunk_factors): a power-of-two scale per
// block of values brings its largest magnitude into [2^14, 2^15), where float16 keeps 11 significant
// bits and cannot overflow.
struct Pow2Scale {
  float scale, inverse;
};
// The power of two s with s * max_abs in [2^14, 2^15) (max_abs clamped to [2^-100, 2^127]: zero and
// tiny blocks get a finite scale, and infinity and NaN propagate through the products).
__device__ __forceinline__ Pow2Scale pow2_scale(float max_abs) {
  const int e = min(max(static_cast<int>((__float_as_uint(max_abs) >> 23) & 0xff) - 127, -100), 127);
  return {__uint_as_float(static_cast<unsigned>(127 + 14 - e) << 23), __uint_as_float(static_cast<unsigned>(127 + e - 14) << 23)};
}
// 1 / x for x a normal power of two (Pow2Scale's values), exactly, by its exponent's bits alone.
__device__ __forceinline__ float pow2_reciprocal(float x) { return __uint_as_float(0x7f000000u - __float_as_uint(x)); }
// The largest |x| over the warp, in one redux.sync on the bits (non-negative floats order as their
// bit patterns do). A NaN may be left out of the maximum; it stays NaN through any scale.
template <int V>
__device__ __forceinline__ float warp_max_abs(const float (&x)[V]) {
  float m = fabsf(x[0]);
#pragma unroll
  for (int i = 1; i < V; ++i) m = fmaxf(m, fabsf(x[i]));
  return __uint_as_float(__reduce_max_sync(0xffffffffu, __float_as_uint(m)));
}

}  // namespace hh::kernels::device
