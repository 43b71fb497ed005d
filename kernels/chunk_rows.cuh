#pragma once
// Which input row fills slot r of chunk n of the chunked rule's grid (ChunkGrid in kernels/gdn.h): the
// chunk kernels read their inputs by it, and the forward's scan writes its output by it.
#include <cstdint>
#include <stdexcept>

#include "kernels/gdn.h"

namespace hh::kernels {
namespace device {

constexpr int kGridChunk = 64;  // tokens a chunk

// The input row of slot r of chunk n, or -1 for padding.
struct SlotRows {
  const int64_t* gather;  // [N * C] input row of each slot (rows = padding), or null for B regular sequences:
  int64_t per, T, rows;   // per chunks of T tokens each; rows = B * T
  __device__ __forceinline__ int64_t operator()(int64_t n, int r) const {
    if (gather != nullptr) {
      const int64_t x = gather[n * kGridChunk + r];
      return x < rows ? x : -1;
    }
    const int64_t b = n / per, t = (n % per) * kGridChunk + r;
    return t < T ? b * T + t : -1;
  }
  // The same for chunk n of sequence s whose chunks start at n0, without the divisions (a scan's
  // sequences are the grid's: n0 = s * per for regular sequences, checked where it launches).
  __device__ __forceinline__ int64_t operator()(int64_t n, int64_t n0, int s, int r) const {
    if (gather != nullptr) return (*this)(n, r);
    const int64_t t = (n - n0) * kGridChunk + r;
    return t < T ? s * T + t : -1;
  }
};

}  // namespace device

// The slot map of `grid` over B sequences of T tokens (checked against them).
inline device::SlotRows slot_rows(const ChunkGrid& grid, int64_t B, int64_t T) {
  constexpr int64_t C = device::kGridChunk;
  if (grid.gather.defined()) {
    if (!grid.gather.is_cuda() || grid.gather.scalar_type() != at::kLong || !grid.gather.is_contiguous() ||
        grid.gather.numel() != grid.N * C)
      throw std::invalid_argument("hh::kernels: ChunkGrid::gather must be N * 64 int64 CUDA values");
    return {grid.gather.data_ptr<int64_t>(), 0, T, B * T};
  }
  if (grid.N != B * grid.per || grid.per * C < T || (grid.per > 0 && (grid.per - 1) * C >= T))
    throw std::invalid_argument("hh::kernels: ChunkGrid: N must be B * per with per = ceil(T / 64)");
  return {nullptr, grid.per, T, B * T};
}

}  // namespace hh::kernels
