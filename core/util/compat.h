#pragma once
// LibTorch 1.13 (Debian, CPU) vs 2.x (pip torch on the GPU machine).
// Headers include only <ATen/core/Tensor.h> for the at::Tensor type; .cpp files use the PCH.
#include <ATen/core/Tensor.h>
#include <c10/util/Optional.h>
#include <torch/version.h>

#define HH_TORCH_AT_LEAST(major, minor) \
  (TORCH_VERSION_MAJOR > (major) || (TORCH_VERSION_MAJOR == (major) && TORCH_VERSION_MINOR >= (minor)))

namespace hh {
// LibTorch 2.x aliases c10::optional to std::optional; 1.13 has its own type. Use this alias.
template <class T>
using opt = c10::optional<T>;
inline constexpr auto nullopt = c10::nullopt;
// scaled_dot_product_attention exists in 2.0+.
inline constexpr bool kHasSdpa = HH_TORCH_AT_LEAST(2, 0);
}  // namespace hh
