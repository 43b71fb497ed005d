#include "core/model/kv_cache.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <string>

#include "core/model/summary.h"
#include "core/util/error.h"

namespace hh::model {
namespace {
std::string shape_str(at::IntArrayRef s) { return format_shape(s.vec()); }
}  // namespace

const at::Tensor& GrowingRows::append(const at::Tensor& x) {
  if (x.dim() != 4 || x.size(1) < 1)
    throw Error("GrowingRows::append: rows must be [B, t >= 1, H, D], got " + shape_str(x.sizes()));
  const int64_t t = x.size(1);
  if (store_.defined()) {
    if (x.size(0) != store_.size(0) || x.size(2) != store_.size(2) || x.size(3) != store_.size(3) ||
        x.scalar_type() != store_.scalar_type() || x.device() != store_.device())
      throw Error("GrowingRows::append: rows " + shape_str(x.sizes()) + " (" + std::string(c10::toString(x.scalar_type())) +
                  ") do not continue the cache's " + shape_str(rows_.sizes()) + " (" +
                  std::string(c10::toString(store_.scalar_type())) + ")");
  }
  if (len_ + t > capacity()) {
    const int64_t cap = std::max(len_ + t, 2 * capacity());
    at::Tensor grown = at::empty({x.size(0), cap, x.size(2), x.size(3)}, x.options().memory_format(at::MemoryFormat::Contiguous));
    if (len_ > 0) grown.narrow(1, 0, len_).copy_(rows_);
    store_ = grown;
  }
  store_.narrow(1, len_, t).copy_(x);
  len_ += t;
  rows_ = store_.narrow(1, 0, len_);
  return rows_;
}

}  // namespace hh::model
