#pragma once
// Device helpers the kernels share: asynchronous 16-byte copies into shared memory, and the
// mma.sync m16n8k8 TF32 product with its operand conversions.
//
// Fragment layout of mma.sync.m16n8k8 (lane = 4 g + t, g in 0..7, t in 0..3):
//   A (16 x 8, row major): a[0] = A[g][t], a[1] = A[g + 8][t], a[2] = A[g][t + 4], a[3] = A[g + 8][t + 4]
//   B (8 x 8, column):     b[0] = B[t][g], b[1] = B[t + 4][g]
//   C (16 x 8):            c[e] = C[g + 8 (e >= 2)][2 t + (e & 1)]
namespace hh::kernels::device {

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
// c += a b on the tensor cores (TF32 operands, float32 accumulation).
__device__ __forceinline__ void mma_tf32(float (&c)[4], const unsigned (&a)[4], const unsigned (&b)[2]) {
  asm volatile(
      "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

}  // namespace hh::kernels::device
