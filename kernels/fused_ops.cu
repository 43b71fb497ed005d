#include "kernels/fused_ops.h"

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>

#include <algorithm>
#include <cstdint>
#include <initializer_list>
#include <optional>
#include <type_traits>
#include <utility>
#include <stdexcept>
#include <string>

#include "kernels/device_ops.cuh"

namespace hh::kernels {
namespace {

using namespace device;  // Pack, load_pack / store_pack, rope_element

constexpr int kWarpsPerBlock = 8;
constexpr int kMaxHeadDim = 256;

__device__ __forceinline__ float warp_sum(float v) {
  for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
  return v;
}

// Elements per 16-byte pack when every pointer is 16-byte aligned and n a multiple of it; else 1.
template <class T>
int pack_width(int64_t n, std::initializer_list<const void*> ptrs) {
  constexpr int v = 16 / sizeof(T);
  if (n % v != 0) return 1;
  for (const void* p : ptrs)
    if (reinterpret_cast<uintptr_t>(p) % 16 != 0) return 1;
  return v;
}

// One warp per row of n elements. x's rows come in groups of `group` packed rows, the groups `ld`
// elements apart (ld = group * n when x is contiguous); y is contiguous. Each lane reads V consecutive
// elements at a time (V = 1 where rows or pointers are not aligned to V elements). A lane's first
// kHeldPacks packs of x and of the weight are loaded together up front and held for the second pass
// (a row of a head, or of up to 32 kHeldPacks V elements, waits on one round of loads instead of
// two); longer rows read the rest again.
// Given token_scale, each output element is then multiplied by its token's scale and rounded again, as
// to_dtype(y * s) does (row r's token is r / per_token % tokens).
constexpr int kHeldPacks = 2;
struct TokenScale {
  const void* s = nullptr;  // [tokens] of the kernel's T, or null: none
  int64_t per_token = 1, tokens = 1;
};
template <class T, int V>
__global__ void rms_norm_kernel(const T* __restrict__ x, int64_t group, int64_t ld, const T* __restrict__ w,
                                T* __restrict__ y, int64_t rows, int64_t n, float eps, TokenScale ts) {
  const int lane = threadIdx.x & 31;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + (threadIdx.x >> 5);
  if (row >= rows) return;
  const int64_t outer = row / group;
  const T* xr = x + outer * ld + (row - outer * group) * n;
  T* yr = y + row * n;
  auto pack_at = [&](int k) { return (static_cast<int64_t>(lane) + 32 * k) * V; };  // the lane's k-th pack
  Pack<T, V> held[kHeldPacks], held_w[kHeldPacks];
#pragma unroll
  for (int k = 0; k < kHeldPacks; ++k)
    if (pack_at(k) < n) held[k] = load_pack<V>(xr + pack_at(k)), held_w[k] = load_pack<V>(w + pack_at(k));
  float ss = 0.f;
  auto add_squares = [&](const Pack<T, V>& p) {
#pragma unroll
    for (int e = 0; e < V; ++e) {
      const float v = static_cast<float>(p.v[e]);
      ss += v * v;
    }
  };
#pragma unroll
  for (int k = 0; k < kHeldPacks; ++k)
    if (pack_at(k) < n) add_squares(held[k]);
  for (int64_t i = pack_at(kHeldPacks); i < n; i += 32 * V) add_squares(load_pack<V>(xr + i));
  const float inv = rsqrtf(warp_sum(ss) / static_cast<float>(n) + eps);
  const bool scaled = ts.s != nullptr;
  const float s = scaled ? static_cast<float>(static_cast<const T*>(ts.s)[row / ts.per_token % ts.tokens]) : 1.f;
  auto normed = [&](const Pack<T, V>& p, const Pack<T, V>& wp) {
    Pack<T, V> o;
#pragma unroll
    for (int e = 0; e < V; ++e) {
      const T nv = static_cast<T>(static_cast<float>(p.v[e]) * inv);  // HF: to(input dtype)
      o.v[e] = static_cast<T>(static_cast<float>(wp.v[e]) * static_cast<float>(nv));
      if (scaled) o.v[e] = static_cast<T>(static_cast<float>(o.v[e]) * s);
    }
    return o;
  };
#pragma unroll
  for (int k = 0; k < kHeldPacks; ++k)
    if (pack_at(k) < n) store_pack<V>(yr + pack_at(k), normed(held[k], held_w[k]));
  for (int64_t i = pack_at(kHeldPacks); i < n; i += 32 * V)
    store_pack<V>(yr + i, normed(load_pack<V>(xr + i), load_pack<V>(w + i)));
}

// One warp per (token, head) row of Dh elements: RMSNorm, then RoPE with the token's cos/sin. x's
// tokens lie `ld` elements apart (H * Dh when contiguous; more for a column slice of a wider
// projection), y is contiguous.
template <class T>
__global__ void norm_rope_kernel(const T* __restrict__ x, int64_t ld, const T* __restrict__ w, const T* __restrict__ cos,
                                 const T* __restrict__ sin, T* __restrict__ y, int64_t rows, int64_t T_len, int64_t H,
                                 int64_t Dh, float eps) {
  __shared__ float normed[kWarpsPerBlock][kMaxHeadDim];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + warp;
  if (row >= rows) return;
  const int64_t token = row / H;  // rows are (b, t, h) in order
  const int64_t t = token % T_len;
  const T* xr = x + token * ld + (row - token * H) * Dh;
  T* yr = y + row * Dh;
  float ss = 0.f;
  for (int64_t i = lane; i < Dh; i += 32) {
    const float v = static_cast<float>(xr[i]);
    ss += v * v;
  }
  const float inv = rsqrtf(warp_sum(ss) / static_cast<float>(Dh) + eps);
  for (int64_t i = lane; i < Dh; i += 32) {
    const T n1 = static_cast<T>(static_cast<float>(xr[i]) * inv);
    normed[warp][i] = static_cast<float>(static_cast<T>(static_cast<float>(w[i]) * static_cast<float>(n1)));
  }
  __syncwarp();
  const int64_t half = Dh / 2;
  const T* c = cos + t * Dh;
  const T* s = sin + t * Dh;
  for (int64_t i = lane; i < Dh; i += 32) {
    const float rot = i < half ? -normed[warp][i + half] : normed[warp][i - half];
    yr[i] = rope_element<T>(normed[warp][i], rot, static_cast<float>(c[i]), static_cast<float>(s[i]));
  }
}

// A warp's row of Dh elements x through RoPE with its token's cos and sin c, s (rounded as HF rounds):
// x into xs, r into rs (this warp's rows of shared memory); returns this lane's part of sum(r^2).
template <class T>
__device__ __forceinline__ float rope_row(const T* __restrict__ x, const T* __restrict__ c, const T* __restrict__ s,
                                          int64_t Dh, int lane, float* xs, float* rs) {
  for (int64_t i = lane; i < Dh; i += 32) xs[i] = static_cast<float>(x[i]);
  __syncwarp();
  const int64_t half = Dh / 2;
  float ss = 0.f;
  for (int64_t i = lane; i < Dh; i += 32) {
    const float rot = i < half ? -xs[i + half] : xs[i - half];
    rs[i] = static_cast<float>(rope_element<T>(xs[i], rot, static_cast<float>(c[i]), static_cast<float>(s[i])));
    ss += rs[i] * rs[i];
  }
  return ss;
}

// One warp per (token, head) row of Dh elements: RoPE with the token's cos/sin (rounded as HF rounds),
// then the L2 normalisation of the LA heads' q and k in float32: y = r * rsqrt(sum(r^2) + eps).
template <class T>
__global__ void rope_l2norm_kernel(const T* __restrict__ x, const T* __restrict__ cos, const T* __restrict__ sin,
                                   T* __restrict__ y, int64_t rows, int64_t T_len, int64_t H, int64_t Dh, float eps) {
  __shared__ float xs[kWarpsPerBlock][kMaxHeadDim];
  __shared__ float rs[kWarpsPerBlock][kMaxHeadDim];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + warp;
  if (row >= rows) return;
  const int64_t t = (row / H) % T_len;  // rows are (b, t, h) in order
  const float ss = rope_row(x + row * Dh, cos + t * Dh, sin + t * Dh, Dh, lane, xs[warp], rs[warp]);
  const float inv = rsqrtf(warp_sum(ss) + eps);
  __syncwarp();
  T* yr = y + row * Dh;
  for (int64_t i = lane; i < Dh; i += 32) yr[i] = static_cast<T>(rs[warp][i] * inv);
}

// rope_l2norm's backward, one warp per row as above: r = RoPE(x) and inv = rsqrt(sum(r^2) + eps) formed
// again, then dr = inv dy - r inv^3 <r, dy> and dx = RoPE^T(dr) (dx_i = dr_i cos_i + dr_{i + Dh/2} sin_{i + Dh/2}
// in the first half, dr_i cos_i - dr_{i - Dh/2} sin_{i - Dh/2} in the second), in float32, rounded once.
// The forward's roundings pass the gradient through unchanged.
template <class T>
__global__ void rope_l2norm_backward_kernel(const T* __restrict__ dy, const T* __restrict__ x, const T* __restrict__ cos,
                                            const T* __restrict__ sin, T* __restrict__ dx, int64_t rows, int64_t T_len,
                                            int64_t H, int64_t Dh, float eps) {
  __shared__ float xs[kWarpsPerBlock][kMaxHeadDim];  // x, then dr
  __shared__ float rs[kWarpsPerBlock][kMaxHeadDim];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + warp;
  if (row >= rows) return;
  const int64_t t = (row / H) % T_len;  // rows are (b, t, h) in order
  const T* dyr = dy + row * Dh;
  const T* c = cos + t * Dh;
  const T* s = sin + t * Dh;
  const int64_t half = Dh / 2;
  const float ss = rope_row(x + row * Dh, c, s, Dh, lane, xs[warp], rs[warp]);
  float dot = 0.f;
  for (int64_t i = lane; i < Dh; i += 32) dot += rs[warp][i] * static_cast<float>(dyr[i]);  // this lane's own rs
  const float inv = rsqrtf(warp_sum(ss) + eps), proj = warp_sum(dot) * inv * inv * inv;
  __syncwarp();  // every lane's reads of xs are done
  for (int64_t i = lane; i < Dh; i += 32) xs[warp][i] = inv * static_cast<float>(dyr[i]) - rs[warp][i] * proj;
  __syncwarp();
  T* dxr = dx + row * Dh;
  for (int64_t i = lane; i < Dh; i += 32) {
    const float other = i < half ? xs[warp][i + half] * static_cast<float>(s[i + half])
                                 : -xs[warp][i - half] * static_cast<float>(s[i - half]);
    dxr[i] = static_cast<T>(xs[warp][i] * static_cast<float>(c[i]) + other);
  }
}

// The same with P = Dh / V threads a row, each on one 16-byte pack (V elements) and its rotate-half
// partner pack; P a power of two <= 32, so a row's threads are consecutive lanes of one warp.
template <class T, int V>
__global__ void rope_l2norm_packed_kernel(const T* __restrict__ x, const T* __restrict__ cos, const T* __restrict__ sin,
                                          T* __restrict__ y, int64_t rows, int64_t T_len, int64_t H, int64_t Dh, int P,
                                          float eps) {
  const int64_t id = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t row = id / P;
  const int j = static_cast<int>(id % P);
  const bool live = row < rows;  // every lane takes part in the shuffles below
  float r[V];
  float ss = 0.f;
  if (live) {
    const int64_t t = (row / H) % T_len;
    const bool first = j < P / 2;  // rotate_half: -x[i + Dh/2] in the first half, x[i - Dh/2] in the second
    const int partner = first ? j + P / 2 : j - P / 2;
    const Pack<T, V> xp = load_pack<V>(x + row * Dh + j * V), pp = load_pack<V>(x + row * Dh + partner * V);
    const Pack<T, V> cp = load_pack<V>(cos + t * Dh + j * V), sp = load_pack<V>(sin + t * Dh + j * V);
    ss = rope_pack<T, V>(xp, pp, first, cp, sp, r);
  }
  for (int off = P / 2; off > 0; off >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, off);
  if (!live) return;
  const float inv = rsqrtf(ss + eps);
  Pack<T, V> out;
#pragma unroll
  for (int e = 0; e < V; ++e) out.v[e] = static_cast<T>(r[e] * inv);
  store_pack<V>(y + row * Dh + j * V, out);
}

// n elements in packs of V (n a multiple of V).
template <class T, int V>
__global__ void silu_mul_kernel(const T* __restrict__ g, const T* __restrict__ u, T* __restrict__ y, int64_t n) {
  for (int64_t i = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) * V; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x * V) {
    const Pack<T, V> gp = load_pack<V>(g + i), up = load_pack<V>(u + i);
    Pack<T, V> yp;
#pragma unroll
    for (int j = 0; j < V; ++j) {
      const float gv = static_cast<float>(gp.v[j]);
      const T act = static_cast<T>(gv / (1.0f + ::expf(-gv)));  // LibTorch's silu, rounded to the dtype
      yp.v[j] = static_cast<T>(static_cast<float>(act) * static_cast<float>(up.v[j]));
    }
    store_pack<V>(y + i, yp);
  }
}

// ---- backward kernels: float32 arithmetic from the saved inputs; the forward's roundings to the
// model dtype are treated as the identity (straight-through), as autograd does for a dtype cast ----

// d/dx of weight * (x * inv), inv = rsqrt(mean(x^2) + eps), for one row held by one warp:
//   g = dy * weight;  dx = inv * g - x * inv^3 * mean(g * x).
template <class T>
__global__ void rms_norm_backward_kernel(const T* __restrict__ dy, const T* __restrict__ x, const T* __restrict__ w,
                                         T* __restrict__ dx, int64_t rows, int64_t n, float eps) {
  const int lane = threadIdx.x & 31;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + (threadIdx.x >> 5);
  if (row >= rows) return;
  const T* xr = x + row * n;
  const T* dyr = dy + row * n;
  T* dxr = dx + row * n;
  float ss = 0.f, gx = 0.f;
  for (int64_t i = lane; i < n; i += 32) {
    const float v = static_cast<float>(xr[i]);
    ss += v * v;
    gx += static_cast<float>(dyr[i]) * static_cast<float>(w[i]) * v;
  }
  const float inv = rsqrtf(warp_sum(ss) / static_cast<float>(n) + eps);
  const float c = inv * inv * inv * warp_sum(gx) / static_cast<float>(n);
  for (int64_t i = lane; i < n; i += 32) {
    const float g = static_cast<float>(dyr[i]) * static_cast<float>(w[i]);
    dxr[i] = static_cast<T>(inv * g - static_cast<float>(xr[i]) * c);
  }
}

// Backward of norm_rope for one (token, head) row: undo the rotation (its transpose), then the
// RMSNorm backward above. y_i = a_i cos_i + r_i sin_i with r_i = -a_{i+h} (i < h), a_{i-h} (i >= h),
// so da_i = dy_i cos_i + (i < h ? dy_{i+h} sin_{i+h} : -dy_{i-h} sin_{i-h}).
template <class T>
__global__ void norm_rope_backward_kernel(const T* __restrict__ dy, const T* __restrict__ x, const T* __restrict__ w,
                                          const T* __restrict__ cos, const T* __restrict__ sin, T* __restrict__ dx,
                                          int64_t rows, int64_t T_len, int64_t H, int64_t Dh, float eps) {
  __shared__ float g[kWarpsPerBlock][kMaxHeadDim];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + warp;
  if (row >= rows) return;
  const int64_t t = (row / H) % T_len;
  const T* xr = x + row * Dh;
  const T* dyr = dy + row * Dh;
  const T* c = cos + t * Dh;
  const T* s = sin + t * Dh;
  const int64_t half = Dh / 2;
  float ss = 0.f, gx = 0.f;
  for (int64_t i = lane; i < Dh; i += 32) {
    const int64_t j = i < half ? i + half : i - half;
    const float partner = static_cast<float>(dyr[j]) * static_cast<float>(s[j]);
    const float da = static_cast<float>(dyr[i]) * static_cast<float>(c[i]) + (i < half ? partner : -partner);
    const float gi = da * static_cast<float>(w[i]);
    g[warp][i] = gi;
    const float v = static_cast<float>(xr[i]);
    ss += v * v;
    gx += gi * v;
  }
  const float inv = rsqrtf(warp_sum(ss) / static_cast<float>(Dh) + eps);
  const float k = inv * inv * inv * warp_sum(gx) / static_cast<float>(Dh);
  __syncwarp();
  for (int64_t i = lane; i < Dh; i += 32) dx[row * Dh + i] = static_cast<T>(inv * g[warp][i] - static_cast<float>(xr[i]) * k);
}

// y = silu(g) * u:  du = dy * silu(g);  dg = dy * u * sigmoid(g) * (1 + g * (1 - sigmoid(g))).
template <class T, int V>
__global__ void silu_mul_backward_kernel(const T* __restrict__ dy, const T* __restrict__ gate, const T* __restrict__ up,
                                         T* __restrict__ dgate, T* __restrict__ dup, int64_t n) {
  for (int64_t i = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) * V; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x * V) {
    const Pack<T, V> dp = load_pack<V>(dy + i), gp = load_pack<V>(gate + i), upk = load_pack<V>(up + i);
    Pack<T, V> dg, du;
#pragma unroll
    for (int j = 0; j < V; ++j) {
      const float gv = static_cast<float>(gp.v[j]), d = static_cast<float>(dp.v[j]);
      const float sg = 1.0f / (1.0f + ::expf(-gv));
      du.v[j] = static_cast<T>(d * gv * sg);
      dg.v[j] = static_cast<T>(d * static_cast<float>(upk.v[j]) * sg * (1.0f + gv * (1.0f - sg)));
    }
    store_pack<V>(dgate + i, dg);
    store_pack<V>(dup + i, du);
  }
}

struct Strides4 {
  int64_t s[4];
};
struct Strides5 {
  int64_t s[5];
};

// One thread per V consecutive elements of a (b, t, h) row. With V > 1 the head dimension is
// contiguous in both inputs and every other stride a multiple of V (checked by the caller).
template <class T, int V>
__global__ void merge_attention_kernel(const T* __restrict__ o_new, Strides4 on, const float* __restrict__ lse_new,
                                       Strides4 ln, const T* __restrict__ o_pre, Strides5 op,
                                       const float* __restrict__ lse_pre, Strides4 lp, T* __restrict__ out, int64_t B,
                                       int64_t Tq, int64_t Hq, int64_t G, int64_t Dh) {
  const int64_t n = B * Tq * Hq * Dh;
  for (int64_t i = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) * V; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x * V) {
    const int64_t d = i % Dh, h = (i / Dh) % Hq, t = (i / (Dh * Hq)) % Tq, b = i / (Dh * Hq * Tq);
    const int64_t kv = h / G, g = h % G;
    const float x = lse_pre[kv * lp.s[0] + b * lp.s[1] + g * lp.s[2] + t * lp.s[3]] - lse_new[b * ln.s[0] + h * ln.s[1] + t * ln.s[2]];
    const float w = 1.0f / (1.0f + ::expf(-x));
    const T* a_row = o_new + b * on.s[0] + h * on.s[1] + t * on.s[2];
    const T* p_row = o_pre + kv * op.s[0] + b * op.s[1] + g * op.s[2] + t * op.s[3];
    if constexpr (V > 1) {
      const Pack<T, V> ap = load_pack<V>(a_row + d), pp = load_pack<V>(p_row + d);
      Pack<T, V> o;
#pragma unroll
      for (int j = 0; j < V; ++j) {
        const float a = static_cast<float>(ap.v[j]), p = static_cast<float>(pp.v[j]);
        o.v[j] = static_cast<T>(a + (p - a) * w);
      }
      store_pack<V>(out + i, o);
    } else {
      const float a = static_cast<float>(a_row[d * on.s[3]]), p = static_cast<float>(p_row[d * op.s[4]]);
      out[i] = static_cast<T>(a + (p - a) * w);
    }
  }
}

void check(const at::Tensor& t, const char* what) {
  if (!t.is_cuda()) throw std::invalid_argument(std::string("hh::kernels: ") + what + " must be a CUDA tensor");
  if (!t.is_contiguous()) throw std::invalid_argument(std::string("hh::kernels: ") + what + " must be contiguous");
}

// Grid of an elementwise kernel over `items` (grid-stride loops cover the rest).
constexpr unsigned kThreads = 256;
unsigned elementwise_blocks(int64_t items) {
  return static_cast<unsigned>(std::min<int64_t>((items + kThreads - 1) / kThreads, 65535 * 8));
}

unsigned blocks_for_rows(int64_t rows) {
  return static_cast<unsigned>((rows + kWarpsPerBlock - 1) / kWarpsPerBlock);
}

// RoPE's tables for positions offset .. offset + T - 1 in one pass: element (t, j) of cos and sin
// [T, Dh] is cos / sin of float(offset + t) * inv_freq[j mod Dh / 2], rounded to T_ once, the values
// of core/model/transformer.cpp's rope_tables (arange, to float, outer product, cat, cos / sin, to
// dtype) bit for bit: the same float32 product and the same cosf / sinf. One thread a (t, j < Dh / 2)
// pair, writing columns j and j + Dh / 2.
template <class T_>
__global__ void rope_tables_kernel(const float* __restrict__ inv_freq, int64_t offset, int64_t T, int64_t half,
                                   T_* __restrict__ cos_out, T_* __restrict__ sin_out) {
  const int64_t items = T * half;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < items;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t t = i / half, j = i - t * half;
    const float f = __fmul_rn(static_cast<float>(offset + t), inv_freq[j]);
    const T_ c = static_cast<T_>(cosf(f)), s = static_cast<T_>(sinf(f));
    const int64_t at = t * 2 * half + j;
    cos_out[at] = c, cos_out[at + half] = c;
    sin_out[at] = s, sin_out[at + half] = s;
  }
}

// The LA heads' gates from their projections (device::gdn_gate_values). b and a: rows of H values, ld_b
// and ld_a apart; g and beta [rows, H] contiguous.
template <class T>
__global__ void gdn_gates_kernel(const T* __restrict__ b, int64_t ld_b, const T* __restrict__ a, int64_t ld_a,
                                 const T* __restrict__ A_log, const T* __restrict__ dt_bias, int64_t rows, int H,
                                 bool two, float* __restrict__ g, float* __restrict__ beta) {
  const int64_t items = rows * H;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < items;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = i / H;
    const int h = static_cast<int>(i - r * H);
    const float2 gb = gdn_gate_values<T>(static_cast<float>(b[r * ld_b + h]), static_cast<float>(a[r * ld_a + h]),
                                         static_cast<float>(A_log[h]), static_cast<float>(dt_bias[h]), two);
    g[i] = gb.x;
    beta[i] = gb.y;
  }
}

}  // namespace

// x [..., g, n] read in place: its last two axes packed (unit stride, rows n apart) and the axes before
// them one run of evenly spaced groups, `ld` elements apart, as in a column slice [B, T, H, Dh] of a
// wider projection. Else nullopt (the caller copies x first).
struct PackedGroups {
  int64_t group, ld;
};
std::optional<PackedGroups> packed_groups(const at::Tensor& x) {
  const int64_t d = x.dim();
  if (x.is_contiguous()) return PackedGroups{d >= 2 ? x.size(-2) : 1, d >= 2 ? x.size(-2) * x.size(-1) : x.size(-1)};
  if (d < 3 || x.stride(-1) != 1 || x.stride(-2) != x.size(-1)) return std::nullopt;
  const int64_t ld = x.stride(d - 3);
  if (ld < x.size(-2) * x.size(-1)) return std::nullopt;  // overlapping groups
  int64_t expected = ld;  // each axis before the last two: the stride one run of groups needs
  for (int64_t i = d - 3; i >= 0; --i) {
    if (x.size(i) != 1 && x.stride(i) != expected) return std::nullopt;
    expected *= x.size(i);
  }
  return PackedGroups{x.size(-2), ld};
}
// x as the kernels read it, with its groups: itself where packed_groups allows, else a contiguous copy.
std::pair<at::Tensor, PackedGroups> in_groups(const at::Tensor& x) {
  if (const std::optional<PackedGroups> pg = packed_groups(x)) return {x, *pg};
  const at::Tensor c = x.contiguous();
  return {c, *packed_groups(c)};
}

at::Tensor rms_norm(const at::Tensor& x_in, const at::Tensor& weight, double eps) {
  return rms_norm_token_scaled(x_in, weight, eps, at::Tensor());
}

at::Tensor rms_norm_token_scaled(const at::Tensor& x_in, const at::Tensor& weight, double eps, const at::Tensor& scale) {
  if (!x_in.is_cuda()) throw std::invalid_argument("hh::kernels: x must be a CUDA tensor");
  check(weight, "weight");
  TokenScale ts;
  if (scale.defined()) {
    check(scale, "scale");
    if (x_in.dim() != 4 || scale.dim() != 1 || scale.size(0) != x_in.size(1) || scale.scalar_type() != x_in.scalar_type() ||
        scale.device() != x_in.device())
      throw std::invalid_argument("hh::kernels::rms_norm_token_scaled: expected x [B, T, H, n] and scale [T] of x's dtype, "
                                  "on x's device");
    ts = {scale.data_ptr(), x_in.size(2), x_in.size(1)};
  }
  const std::pair<at::Tensor, PackedGroups> xg = in_groups(x_in);
  const at::Tensor& x = xg.first;
  const PackedGroups pg = xg.second;
  const int64_t n = x.size(-1), rows = x.numel() / n;
  if (weight.numel() != n || weight.scalar_type() != x.scalar_type())
    throw std::invalid_argument("hh::kernels::rms_norm: weight must be [n] of x's dtype");
  const c10::cuda::CUDAGuard guard(x.device());
  at::Tensor y = at::empty(x.sizes(), x.options());
  if (rows == 0) return y;
  auto stream = at::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "hh_rms_norm", [&] {
    // The widest vector of at most 16 bytes that keeps every lane busy (n >= 32 V) and that the rows'
    // starts and the pointers are aligned to; V = 1 always fits.
    auto try_launch = [&](auto v) {
      constexpr int V = decltype(v)::value;
      if constexpr (V * sizeof(scalar_t) > 16) {
        return false;
      } else {
        const uintptr_t bytes = V * sizeof(scalar_t);
        auto aligned = [&](const void* p) { return reinterpret_cast<uintptr_t>(p) % bytes == 0; };
        if (V > 1 && (n < 32 * V || n % V != 0 || pg.ld % V != 0 || !aligned(x.data_ptr()) ||
                      !aligned(weight.data_ptr()) || !aligned(y.data_ptr())))
          return false;
        rms_norm_kernel<scalar_t, V><<<blocks_for_rows(rows), kWarpsPerBlock * 32, 0, stream>>>(
            x.data_ptr<scalar_t>(), pg.group, pg.ld, weight.data_ptr<scalar_t>(), y.data_ptr<scalar_t>(), rows, n,
            static_cast<float>(eps), ts);
        return true;
      }
    };
    try_launch(std::integral_constant<int, 8>{}) || try_launch(std::integral_constant<int, 4>{}) ||
        try_launch(std::integral_constant<int, 2>{}) || try_launch(std::integral_constant<int, 1>{});
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return y;
}

// b or a [B, T, H] as gdn_gates_kernel reads it: unit stride over heads, rows evenly spaced.
bool gate_rows(const at::Tensor& x) {
  return x.is_cuda() && x.dim() == 3 && (x.size(2) <= 1 || x.stride(2) == 1) &&
         (x.size(0) <= 1 || x.stride(0) == x.size(1) * x.stride(1));
}

bool gdn_gates_supported(const at::Tensor& b, const at::Tensor& a, const at::Tensor& A_log, const at::Tensor& dt_bias) {
  const at::ScalarType dt = b.scalar_type();
  if (dt != at::kBFloat16 && dt != at::kHalf) return false;
  for (const at::Tensor* t : {&a, &A_log, &dt_bias})
    if (t->scalar_type() != dt || !t->is_cuda()) return false;
  return gate_rows(b) && gate_rows(a) && a.sizes() == b.sizes() && A_log.dim() == 1 && dt_bias.dim() == 1 &&
         A_log.size(0) == b.size(2) && dt_bias.size(0) == b.size(2) && A_log.is_contiguous() && dt_bias.is_contiguous();
}

std::pair<at::Tensor, at::Tensor> gdn_gates(const at::Tensor& b, const at::Tensor& a, const at::Tensor& A_log,
                                            const at::Tensor& dt_bias, bool beta_times_two) {
  if (!gdn_gates_supported(b, a, A_log, dt_bias))
    throw std::invalid_argument("hh::kernels::gdn_gates: expected b and a [B, T, H] (unit stride over heads, rows evenly "
                                "spaced), A_log and dt_bias [H], all CUDA tensors of one 16-bit dtype");
  const c10::cuda::CUDAGuard guard(b.device());
  const int64_t H = b.size(2), rows = b.size(0) * b.size(1);
  const auto f32 = b.options().dtype(at::kFloat);
  at::Tensor g = at::empty(b.sizes(), f32), beta = at::empty(b.sizes(), f32);
  if (rows * H == 0) return {g, beta};
  auto stream = at::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, b.scalar_type(), "hh_gdn_gates", [&] {
    gdn_gates_kernel<scalar_t><<<elementwise_blocks(rows * H), kThreads, 0, stream>>>(
        b.data_ptr<scalar_t>(), b.stride(1), a.data_ptr<scalar_t>(), a.stride(1), A_log.data_ptr<scalar_t>(),
        dt_bias.data_ptr<scalar_t>(), rows, static_cast<int>(H), beta_times_two, g.data_ptr<float>(), beta.data_ptr<float>());
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {g, beta};
}

std::pair<at::Tensor, at::Tensor> rope_tables(const at::Tensor& inv_freq, int64_t offset, int64_t T, at::ScalarType dtype) {
  check(inv_freq, "inv_freq");
  if (inv_freq.dim() != 1 || inv_freq.scalar_type() != at::kFloat)
    throw std::invalid_argument("hh::kernels::rope_tables: inv_freq must be [Dh / 2] float32");
  if (T < 0) throw std::invalid_argument("hh::kernels::rope_tables: T must be >= 0");
  if (dtype != at::kFloat && dtype != at::kHalf && dtype != at::kBFloat16)
    throw std::invalid_argument("hh::kernels::rope_tables: dtype must be float32, float16 or bfloat16");
  const int64_t half = inv_freq.size(0);
  const c10::cuda::CUDAGuard guard(inv_freq.device());
  const auto opts = inv_freq.options().dtype(dtype);
  at::Tensor c = at::empty({T, 2 * half}, opts), s = at::empty({T, 2 * half}, opts);
  if (T * half == 0) return {c, s};
  auto stream = at::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, dtype, "hh_rope_tables", [&] {
    rope_tables_kernel<scalar_t><<<elementwise_blocks(T * half), kThreads, 0, stream>>>(
        inv_freq.data_ptr<float>(), offset, T, half, c.data_ptr<scalar_t>(), s.data_ptr<scalar_t>());
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {c, s};
}

at::Tensor rope_l2norm(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, double eps) {
  check(x, "x");
  check(cos, "cos");
  check(sin, "sin");
  if (x.dim() != 4) throw std::invalid_argument("hh::kernels::rope_l2norm: x must be [B, T, H, Dh]");
  const int64_t T = x.size(1), H = x.size(2), Dh = x.size(3), rows = x.numel() / std::max<int64_t>(Dh, 1);
  if (Dh > kMaxHeadDim || Dh % 2 != 0) throw std::invalid_argument("hh::kernels::rope_l2norm: head_dim must be even and <= 256");
  if (cos.numel() != T * Dh || sin.numel() != T * Dh)
    throw std::invalid_argument("hh::kernels::rope_l2norm: cos/sin must be [T, Dh]");
  const c10::cuda::CUDAGuard guard(x.device());
  at::Tensor y = at::empty_like(x);
  if (rows == 0) return y;
  auto stream = at::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "hh_rope_l2norm", [&] {
    constexpr int kV = 16 / sizeof(scalar_t);
    const int64_t P = Dh / kV;  // threads a row on the packed path
    const bool packed = Dh % (2 * kV) == 0 && P <= 32 && (P & (P - 1)) == 0 &&
                        pack_width<scalar_t>(Dh, {x.data_ptr(), cos.data_ptr(), sin.data_ptr(), y.data_ptr()}) == kV;
    if (packed) {
      const int64_t threads = rows * P, per_block = 256;
      rope_l2norm_packed_kernel<scalar_t, kV><<<static_cast<unsigned>((threads + per_block - 1) / per_block), per_block, 0,
                                                stream>>>(x.data_ptr<scalar_t>(), cos.data_ptr<scalar_t>(),
                                                          sin.data_ptr<scalar_t>(), y.data_ptr<scalar_t>(), rows, T, H, Dh,
                                                          static_cast<int>(P), static_cast<float>(eps));
    } else {
      rope_l2norm_kernel<scalar_t><<<blocks_for_rows(rows), kWarpsPerBlock * 32, 0, stream>>>(
          x.data_ptr<scalar_t>(), cos.data_ptr<scalar_t>(), sin.data_ptr<scalar_t>(), y.data_ptr<scalar_t>(), rows, T, H,
          Dh, static_cast<float>(eps));
    }
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return y;
}

at::Tensor rope_l2norm_backward(const at::Tensor& dy, const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
                                double eps) {
  check(dy, "dy");
  check(x, "x");
  check(cos, "cos");
  check(sin, "sin");
  if (x.dim() != 4) throw std::invalid_argument("hh::kernels::rope_l2norm_backward: x must be [B, T, H, Dh]");
  if (dy.sizes() != x.sizes() || dy.scalar_type() != x.scalar_type())
    throw std::invalid_argument("hh::kernels::rope_l2norm_backward: dy must match x");
  const int64_t T = x.size(1), H = x.size(2), Dh = x.size(3), rows = x.numel() / std::max<int64_t>(Dh, 1);
  if (Dh > kMaxHeadDim || Dh % 2 != 0) throw std::invalid_argument("hh::kernels::rope_l2norm_backward: head_dim must be even and <= 256");
  if (cos.numel() != T * Dh || sin.numel() != T * Dh || cos.scalar_type() != x.scalar_type() || sin.scalar_type() != x.scalar_type())
    throw std::invalid_argument("hh::kernels::rope_l2norm_backward: cos/sin must be [T, Dh] of x's dtype");
  const c10::cuda::CUDAGuard guard(x.device());
  at::Tensor dx = at::empty_like(x);
  if (rows == 0) return dx;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "hh_rope_l2norm_backward", [&] {
    rope_l2norm_backward_kernel<scalar_t><<<blocks_for_rows(rows), kWarpsPerBlock * 32, 0, at::cuda::getCurrentCUDAStream()>>>(
        dy.data_ptr<scalar_t>(), x.data_ptr<scalar_t>(), cos.data_ptr<scalar_t>(), sin.data_ptr<scalar_t>(),
        dx.data_ptr<scalar_t>(), rows, T, H, Dh, static_cast<float>(eps));
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return dx;
}

at::Tensor norm_rope(const at::Tensor& x_in, const at::Tensor& weight, const at::Tensor& cos, const at::Tensor& sin,
                     double eps) {
  if (!x_in.is_cuda()) throw std::invalid_argument("hh::kernels: x must be a CUDA tensor");
  if (x_in.dim() != 4) throw std::invalid_argument("hh::kernels::norm_rope: x must be [B, T, H, Dh]");
  // A column slice of a wider projection (packed_groups: heads packed, tokens evenly spaced) is read in
  // place; any other layout is copied first. Its groups are a token's H heads.
  const std::pair<at::Tensor, PackedGroups> xg = in_groups(x_in);
  const at::Tensor& x = xg.first;
  const int64_t ld = xg.second.ld;
  check(weight, "weight");
  check(cos, "cos");
  check(sin, "sin");
  if (x.dim() != 4) throw std::invalid_argument("hh::kernels::norm_rope: x must be [B, T, H, Dh]");
  const int64_t T = x.size(1), H = x.size(2), Dh = x.size(3), rows = x.numel() / Dh;
  if (Dh > kMaxHeadDim || Dh % 2 != 0) throw std::invalid_argument("hh::kernels::norm_rope: head_dim must be even and <= 256");
  if (cos.numel() != T * Dh || sin.numel() != T * Dh)
    throw std::invalid_argument("hh::kernels::norm_rope: cos/sin must be [T, Dh]");
  const c10::cuda::CUDAGuard guard(x.device());
  at::Tensor y = at::empty(x.sizes(), x.options());
  if (rows == 0) return y;
  auto stream = at::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "hh_norm_rope", [&] {
    norm_rope_kernel<scalar_t><<<blocks_for_rows(rows), kWarpsPerBlock * 32, 0, stream>>>(
        x.data_ptr<scalar_t>(), ld, weight.data_ptr<scalar_t>(), cos.data_ptr<scalar_t>(), sin.data_ptr<scalar_t>(),
        y.data_ptr<scalar_t>(), rows, T, H, Dh, static_cast<float>(eps));
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return y;
}

at::Tensor silu_mul(const at::Tensor& gate, const at::Tensor& up) {
  check(gate, "gate");
  check(up, "up");
  if (gate.sizes() != up.sizes() || gate.scalar_type() != up.scalar_type())
    throw std::invalid_argument("hh::kernels::silu_mul: gate and up must match in shape and dtype");
  const c10::cuda::CUDAGuard guard(gate.device());
  at::Tensor y = at::empty_like(gate);
  const int64_t n = gate.numel();
  if (n == 0) return y;
  auto stream = at::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, gate.scalar_type(), "hh_silu_mul", [&] {
    const scalar_t *g = gate.data_ptr<scalar_t>(), *u = up.data_ptr<scalar_t>();
    scalar_t* yp = y.data_ptr<scalar_t>();
    constexpr int kV = 16 / sizeof(scalar_t);
    if (pack_width<scalar_t>(n, {g, u, yp}) == kV)
      silu_mul_kernel<scalar_t, kV><<<elementwise_blocks(n / kV), kThreads, 0, stream>>>(g, u, yp, n);
    else
      silu_mul_kernel<scalar_t, 1><<<elementwise_blocks(n), kThreads, 0, stream>>>(g, u, yp, n);
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return y;
}

at::Tensor merge_attention(const at::Tensor& o_new, const at::Tensor& lse_new, const at::Tensor& o_pre,
                           const at::Tensor& lse_pre) {
  if (!o_new.is_cuda() || o_new.dim() != 4 || lse_new.dim() != 3 || o_pre.dim() != 5 || lse_pre.dim() != 4)
    throw std::invalid_argument("hh::kernels::merge_attention: expected CUDA o_new [B,Hq,Tq,Dh], lse_new [B,Hq,Tq], "
                                "o_pre [Hkv,B,G,Tq,Dh], lse_pre [Hkv,B,G,Tq]");
  if (lse_new.scalar_type() != at::kFloat || lse_pre.scalar_type() != at::kFloat || o_pre.scalar_type() != o_new.scalar_type())
    throw std::invalid_argument("hh::kernels::merge_attention: log-sum-exps must be float32, outputs of one dtype");
  const int64_t B = o_new.size(0), Hq = o_new.size(1), Tq = o_new.size(2), Dh = o_new.size(3), G = o_pre.size(2);
  if (o_pre.size(0) * G != Hq || o_pre.size(1) != B || o_pre.size(3) != Tq || o_pre.size(4) != Dh)
    throw std::invalid_argument("hh::kernels::merge_attention: o_pre does not match o_new");
  const c10::cuda::CUDAGuard guard(o_new.device());
  at::Tensor out = at::empty({B, Tq, Hq, Dh}, o_new.options());
  const int64_t n = out.numel();
  if (n == 0) return out;
  Strides4 on{{o_new.stride(0), o_new.stride(1), o_new.stride(2), o_new.stride(3)}};
  Strides4 ln{{lse_new.stride(0), lse_new.stride(1), lse_new.stride(2), 0}};
  Strides5 op{{o_pre.stride(0), o_pre.stride(1), o_pre.stride(2), o_pre.stride(3), o_pre.stride(4)}};
  Strides4 lp{{lse_pre.stride(0), lse_pre.stride(1), lse_pre.stride(2), lse_pre.stride(3)}};
  auto stream = at::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, o_new.scalar_type(), "hh_merge_attention", [&] {
    const scalar_t *a = o_new.data_ptr<scalar_t>(), *p = o_pre.data_ptr<scalar_t>();
    scalar_t* o = out.data_ptr<scalar_t>();
    constexpr int kV = 16 / sizeof(scalar_t);
    bool packed = on.s[3] == 1 && op.s[4] == 1 && pack_width<scalar_t>(Dh, {a, p, o}) == kV;
    for (int i = 0; i < 3; ++i) packed = packed && on.s[i] % kV == 0;
    for (int i = 0; i < 4; ++i) packed = packed && op.s[i] % kV == 0;
    if (packed)
      merge_attention_kernel<scalar_t, kV><<<elementwise_blocks(n / kV), kThreads, 0, stream>>>(
          a, on, lse_new.data_ptr<float>(), ln, p, op, lse_pre.data_ptr<float>(), lp, o, B, Tq, Hq, G, Dh);
    else
      merge_attention_kernel<scalar_t, 1><<<elementwise_blocks(n), kThreads, 0, stream>>>(
          a, on, lse_new.data_ptr<float>(), ln, p, op, lse_pre.data_ptr<float>(), lp, o, B, Tq, Hq, G, Dh);
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

at::Tensor rms_norm_backward(const at::Tensor& dy, const at::Tensor& x, const at::Tensor& weight, double eps) {
  check(dy, "dy");
  check(x, "x");
  check(weight, "weight");
  if (dy.sizes() != x.sizes() || dy.scalar_type() != x.scalar_type())
    throw std::invalid_argument("hh::kernels::rms_norm_backward: dy must match x");
  const int64_t n = x.size(-1), rows = x.numel() / n;
  const c10::cuda::CUDAGuard guard(x.device());
  at::Tensor dx = at::empty_like(x);
  if (rows == 0) return dx;
  auto stream = at::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "hh_rms_norm_backward", [&] {
    rms_norm_backward_kernel<scalar_t><<<blocks_for_rows(rows), kWarpsPerBlock * 32, 0, stream>>>(
        dy.data_ptr<scalar_t>(), x.data_ptr<scalar_t>(), weight.data_ptr<scalar_t>(), dx.data_ptr<scalar_t>(), rows, n,
        static_cast<float>(eps));
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return dx;
}

at::Tensor norm_rope_backward(const at::Tensor& dy, const at::Tensor& x, const at::Tensor& weight, const at::Tensor& cos,
                              const at::Tensor& sin, double eps) {
  check(dy, "dy");
  check(x, "x");
  if (dy.sizes() != x.sizes() || dy.scalar_type() != x.scalar_type())
    throw std::invalid_argument("hh::kernels::norm_rope_backward: dy must match x");
  if (x.dim() != 4) throw std::invalid_argument("hh::kernels::norm_rope_backward: x must be [B, T, H, Dh]");
  const int64_t T = x.size(1), H = x.size(2), Dh = x.size(3), rows = x.numel() / Dh;
  if (Dh > kMaxHeadDim || Dh % 2 != 0) throw std::invalid_argument("hh::kernels::norm_rope_backward: head_dim must be even and <= 256");
  if (cos.numel() != T * Dh || sin.numel() != T * Dh)
    throw std::invalid_argument("hh::kernels::norm_rope_backward: cos/sin must be [T, Dh]");
  const c10::cuda::CUDAGuard guard(x.device());
  at::Tensor dx = at::empty_like(x);
  if (rows == 0) return dx;
  auto stream = at::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "hh_norm_rope_backward", [&] {
    norm_rope_backward_kernel<scalar_t><<<blocks_for_rows(rows), kWarpsPerBlock * 32, 0, stream>>>(
        dy.data_ptr<scalar_t>(), x.data_ptr<scalar_t>(), weight.data_ptr<scalar_t>(), cos.data_ptr<scalar_t>(),
        sin.data_ptr<scalar_t>(), dx.data_ptr<scalar_t>(), rows, T, H, Dh, static_cast<float>(eps));
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return dx;
}

std::pair<at::Tensor, at::Tensor> silu_mul_backward(const at::Tensor& dy, const at::Tensor& gate, const at::Tensor& up) {
  check(dy, "dy");
  check(gate, "gate");
  check(up, "up");
  if (gate.sizes() != up.sizes() || dy.sizes() != gate.sizes() || gate.scalar_type() != up.scalar_type() ||
      dy.scalar_type() != gate.scalar_type())
    throw std::invalid_argument("hh::kernels::silu_mul_backward: dy, gate and up must match in shape and dtype");
  const c10::cuda::CUDAGuard guard(gate.device());
  at::Tensor dg = at::empty_like(gate), du = at::empty_like(up);
  const int64_t n = gate.numel();
  if (n == 0) return {dg, du};
  auto stream = at::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, gate.scalar_type(), "hh_silu_mul_backward", [&] {
    const scalar_t *d = dy.data_ptr<scalar_t>(), *g = gate.data_ptr<scalar_t>(), *u = up.data_ptr<scalar_t>();
    scalar_t *dgp = dg.data_ptr<scalar_t>(), *dup = du.data_ptr<scalar_t>();
    constexpr int kV = 16 / sizeof(scalar_t);
    if (pack_width<scalar_t>(n, {d, g, u, dgp, dup}) == kV)
      silu_mul_backward_kernel<scalar_t, kV><<<elementwise_blocks(n / kV), kThreads, 0, stream>>>(d, g, u, dgp, dup, n);
    else
      silu_mul_backward_kernel<scalar_t, 1><<<elementwise_blocks(n), kThreads, 0, stream>>>(d, g, u, dgp, dup, n);
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {dg, du};
}

}  // namespace hh::kernels
