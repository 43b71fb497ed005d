#pragma once
// Keys or values of sequences that grow by appends, for decoding: [B, len, H, D] held in storage with
// room for more rows. An append copies only its own rows, and the storage doubles when full, so
// generating n tokens one at a time copies O(n) rows in all, where concatenating the cache with each
// token's rows copies the whole cache every step (O(n^2)).
#include <cstdint>
#include <vector>

#include "core/util/compat.h"

namespace hh::model {

class GrowingRows {
 public:
  // Appends x [B, t, H, D] (t >= 1; B, H, D, dtype and device as the rows already held) and returns
  // every row so far. x is copied: the rows never alias it. Throws hh::Error naming both shapes when x
  // does not fit. A tensor rows() returned earlier keeps its values: an append writes past its end,
  // and a reallocation leaves the old storage to the tensors that still view it.
  const at::Tensor& append(const at::Tensor& x);
  // [B, len, H, D], a view of the storage (contiguous when B = 1); undefined before the first append.
  const at::Tensor& rows() const { return rows_; }
  int64_t size() const { return len_; }
  // Rows the storage holds before it must grow.
  int64_t capacity() const { return store_.defined() ? store_.size(1) : 0; }

 private:
  at::Tensor store_, rows_;
  int64_t len_ = 0;
};

// A decoder's key/value cache: one GrowingRows of keys and one of values a layer (keys after k_norm and
// RoPE, as blocks.{l}.attn.hook_k holds them).
struct KvCache {
  std::vector<GrowingRows> k, v;
  explicit KvCache(int64_t layers = 0) : k(static_cast<size_t>(layers)), v(static_cast<size_t>(layers)) {}
  int64_t tokens() const { return k.empty() ? 0 : k.front().size(); }
};

}  // namespace hh::model
