#include "kernels/optim.h"

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cstring>
#include <stdexcept>
#include <string>

namespace hh::kernels {
namespace {

constexpr int kThreads = 256;
constexpr int64_t kRun = 8192;  // elements a block
constexpr int kUnroll = 4;      // elements a thread loads before it computes

enum DtypeCode : int { kF32 = 0, kF16 = 1, kBF16 = 2 };

// One tensor of a launch: its elements are runs run0 .. run0 + ceil(n / kRun) - 1 of the grid.
struct Entry {
  void* x;             // the param (AdamW) or the tensor (sum_squares, scale_)
  const void* g;       // the gradient (AdamW)
  float *m, *v, *w;    // the moments and the master (null for a float32 param)
  int64_t n, run0;
  int dtype, decay;
};

struct AdamWArgs {
  float decay_mul, b1, one_b1, b2, one_b2, inv_bias2, eps, step;
};

__device__ __forceinline__ float to_f(float x) { return x; }
__device__ __forceinline__ float to_f(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_f(__nv_bfloat16 x) { return __bfloat162float(x); }
template <class T>
__device__ __forceinline__ T from_f(float x);
template <>
__device__ __forceinline__ float from_f<float>(float x) { return x; }
template <>
__device__ __forceinline__ __half from_f<__half>(float x) { return __float2half_rn(x); }
template <>
__device__ __forceinline__ __nv_bfloat16 from_f<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }

// The entry whose runs hold this block: the last with run0 <= blockIdx.x.
__device__ __forceinline__ const Entry& block_entry(const Entry* es, int count) {
  __shared__ int found;
  if (threadIdx.x == 0) {
    int lo = 0, hi = count - 1;
    while (lo < hi) {
      const int mid = (lo + hi + 1) / 2;
      if (es[mid].run0 <= static_cast<int64_t>(blockIdx.x)) lo = mid;
      else hi = mid - 1;
    }
    found = lo;
  }
  __syncthreads();
  return es[found];
}

template <class E>
struct Type {
  using T = E;
};

// Calls f(Type<T>{}, e, lo, hi) with this block's entry e, its run of elements [lo, hi) and their type T.
template <class F>
__device__ __forceinline__ void on_block_run(const Entry* es, int count, F&& f) {
  const Entry e = block_entry(es, count);
  const int64_t lo = (static_cast<int64_t>(blockIdx.x) - e.run0) * kRun, hi = std::min(e.n, lo + kRun);
  switch (e.dtype) {
    case kF32: f(Type<float>{}, e, lo, hi); break;
    case kF16: f(Type<__half>{}, e, lo, hi); break;
    default: f(Type<__nv_bfloat16>{}, e, lo, hi); break;
  }
}

// AdamW over elements [lo, hi) of one tensor, in core/train/optim.cpp's order of operations, each step
// rounded where LibTorch's CUDA ops round it: a * s (mul_), fma(alpha, b, a) (add_), fma(alpha b, c, a)
// (addcmul_), a * (1 / s) (division by a scalar), fma(alpha, b / c, a) (addcdiv_), all float32.
template <class T>
__device__ void adamw_run(const Entry& e, int64_t lo, int64_t hi, const AdamWArgs& a) {
  const T* __restrict__ g = static_cast<const T*>(e.g);
  T* __restrict__ p = static_cast<T*>(e.x);
  float* __restrict__ m = e.m;
  float* __restrict__ v = e.v;
  float* __restrict__ w = e.w;
  for (int64_t base = lo + threadIdx.x; base < hi; base += kThreads * kUnroll) {
    float gi[kUnroll], mi[kUnroll], vi[kUnroll], wi[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t i = base + u * kThreads;
      if (i < hi) {
        gi[u] = to_f(g[i]);
        mi[u] = m[i];
        vi[u] = v[i];
        wi[u] = w != nullptr ? w[i] : to_f(p[i]);
      }
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t i = base + u * kThreads;
      if (i < hi) {
        float x = wi[u];
        if (e.decay) x = __fmul_rn(x, a.decay_mul);
        const float mm = __fmaf_rn(a.one_b1, gi[u], __fmul_rn(mi[u], a.b1));
        const float vv = __fmaf_rn(__fmul_rn(a.one_b2, gi[u]), gi[u], __fmul_rn(vi[u], a.b2));
        const float denom = __fadd_rn(__fsqrt_rn(__fmul_rn(vv, a.inv_bias2)), a.eps);
        x = __fmaf_rn(a.step, __fdiv_rn(mm, denom), x);
        m[i] = mm;
        v[i] = vv;
        if (w != nullptr) w[i] = x;
        p[i] = from_f<T>(x);
      }
    }
  }
}

__global__ void __launch_bounds__(kThreads) adamw_kernel(const Entry* __restrict__ es, int count, AdamWArgs a) {
  on_block_run(es, count, [&](auto type, const Entry& e, int64_t lo, int64_t hi) {
    adamw_run<typename decltype(type)::T>(e, lo, hi, a);
  });
}

template <class T>
__device__ float squares_run(const Entry& e, int64_t lo, int64_t hi) {
  const T* __restrict__ x = static_cast<const T*>(e.x);
  float acc = 0.f;
  for (int64_t i = lo + threadIdx.x; i < hi; i += kThreads) {
    const float f = to_f(x[i]);
    acc += f * f;
  }
  return acc;
}

// partial[run] = the float32 sum of the run's squares (then summed in float64 by the caller).
__global__ void __launch_bounds__(kThreads) sum_squares_kernel(const Entry* __restrict__ es, int count,
                                                               double* __restrict__ partial) {
  float acc = 0.f;
  on_block_run(es, count, [&](auto type, const Entry& e, int64_t lo, int64_t hi) {
    acc = squares_run<typename decltype(type)::T>(e, lo, hi);
  });
  __shared__ float warps[kThreads / 32];
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
  if (threadIdx.x % 32 == 0) warps[threadIdx.x / 32] = acc;
  __syncthreads();
  if (threadIdx.x == 0) {
    float s = 0.f;
#pragma unroll
    for (int i = 0; i < kThreads / 32; ++i) s += warps[i];
    partial[blockIdx.x] = s;
  }
}

template <class T>
__device__ void scale_run(const Entry& e, int64_t lo, int64_t hi, float s) {
  T* __restrict__ x = static_cast<T*>(e.x);
  for (int64_t i = lo + threadIdx.x; i < hi; i += kThreads) x[i] = from_f<T>(to_f(x[i]) * s);
}

__global__ void __launch_bounds__(kThreads) scale_kernel(const Entry* __restrict__ es, int count, float s) {
  on_block_run(es, count, [&](auto type, const Entry& e, int64_t lo, int64_t hi) {
    scale_run<typename decltype(type)::T>(e, lo, hi, s);
  });
}

int dtype_code(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return kF32;
    case at::kHalf: return kF16;
    case at::kBFloat16: return kBF16;
    default: return -1;
  }
}

// Empty when the tensors are taken, else why not (naming the tensor).
std::string adamw_refusal(const std::vector<AdamWTensor>& ts) {
  if (ts.empty()) return "no tensors";
  const at::Device dev = ts.front().param.defined() ? ts.front().param.device() : at::Device(at::kCPU);
  auto bad = [&](const at::Tensor& t, at::ScalarType want, int64_t n) {
    return !t.defined() || !t.is_cuda() || t.device() != dev || !t.is_contiguous() || t.scalar_type() != want ||
           t.numel() != n;
  };
  for (size_t i = 0; i < ts.size(); ++i) {
    const AdamWTensor& t = ts[i];
    const std::string at_i = " of tensor " + std::to_string(i);
    if (!t.param.defined() || !t.param.is_cuda() || t.param.device() != dev || !t.param.is_contiguous())
      return "param" + at_i + " must be a contiguous CUDA tensor on the first one's device";
    const auto type = t.param.scalar_type();
    if (dtype_code(type) < 0) return "param" + at_i + " must be float32, float16 or bfloat16";
    const int64_t n = t.param.numel();
    if (bad(t.grad, type, n)) return "grad" + at_i + " must be contiguous on param's device, of its dtype and size";
    if (bad(t.exp_avg, at::kFloat, n)) return "exp_avg" + at_i + " must be float32, contiguous, of param's size";
    if (bad(t.exp_avg_sq, at::kFloat, n)) return "exp_avg_sq" + at_i + " must be float32, contiguous, of param's size";
    if (type == at::kFloat ? t.master.defined() : bad(t.master, at::kFloat, n))
      return "master" + at_i + (type == at::kFloat ? " must be undefined for a float32 param"
                                                   : " must be float32, contiguous, of param's size");
  }
  return {};
}

std::string multi_refusal(const std::vector<at::Tensor>& xs) {
  if (xs.empty()) return "no tensors";
  for (size_t i = 0; i < xs.size(); ++i) {
    const at::Tensor& x = xs[i];
    if (!x.defined() || !x.is_cuda() || x.device() != xs.front().device() || !x.is_contiguous() ||
        dtype_code(x.scalar_type()) < 0)
      return "tensor " + std::to_string(i) + " must be a contiguous float32, float16 or bfloat16 CUDA tensor on the first one's device";
  }
  return {};
}

// The entries' table on the device (through pinned memory, on the current stream) and the grid's runs.
struct Table {
  at::Tensor device;
  int64_t runs = 0;
  int count = 0;
  const Entry* ptr() const { return reinterpret_cast<const Entry*>(device.data_ptr()); }
};

Table upload(std::vector<Entry>& es, const at::Device& dev) {
  Table t;
  for (Entry& e : es) {
    e.run0 = t.runs;
    t.runs += (e.n + kRun - 1) / kRun;
  }
  // Empty tensors take no run; a launch's blocks never land on them, as the search takes the last
  // entry with run0 <= block.
  t.count = static_cast<int>(es.size());
  const int64_t bytes = static_cast<int64_t>(es.size() * sizeof(Entry));
  at::Tensor host = at::empty({bytes}, at::TensorOptions().dtype(at::kByte).pinned_memory(true));
  std::memcpy(host.data_ptr(), es.data(), static_cast<size_t>(bytes));
  t.device = host.to(at::TensorOptions().device(dev), /*non_blocking=*/true);
  if (t.runs > 0x7fffffff) throw std::invalid_argument("hh::kernels: too many elements for one launch");
  return t;
}

// The table of plain tensors (sum_squares, scale_), checked first; errors name the function fn.
Table plain_table(const char* fn, const std::vector<at::Tensor>& xs) {
  const std::string why = multi_refusal(xs);
  if (!why.empty()) throw std::invalid_argument(std::string("hh::kernels::") + fn + ": " + why);
  std::vector<Entry> es;
  es.reserve(xs.size());
  for (const at::Tensor& x : xs) {
    Entry e{};
    e.x = x.data_ptr();
    e.n = x.numel();
    e.dtype = dtype_code(x.scalar_type());
    es.push_back(e);
  }
  return upload(es, xs.front().device());
}

}  // namespace

bool adamw_supported(const std::vector<AdamWTensor>& ts) { return adamw_refusal(ts).empty(); }

void adamw_step(const std::vector<AdamWTensor>& ts, const AdamWScalars& s) {
  const std::string why = adamw_refusal(ts);
  if (!why.empty()) throw std::invalid_argument("hh::kernels::adamw_step: " + why);
  const at::Device dev = ts.front().param.device();
  c10::cuda::CUDAGuard guard(dev);
  std::vector<Entry> es;
  es.reserve(ts.size());
  for (const AdamWTensor& t : ts) {
    Entry e{};
    e.x = t.param.data_ptr();
    e.g = t.grad.data_ptr();
    e.m = t.exp_avg.data_ptr<float>();
    e.v = t.exp_avg_sq.data_ptr<float>();
    e.w = t.master.defined() ? t.master.data_ptr<float>() : nullptr;
    e.n = t.param.numel();
    e.dtype = dtype_code(t.param.scalar_type());
    e.decay = t.decay ? 1 : 0;
    es.push_back(e);
  }
  const Table table = upload(es, dev);
  if (table.runs == 0) return;
  AdamWArgs a;
  a.decay_mul = static_cast<float>(1.0 - s.lr * s.weight_decay);
  a.b1 = static_cast<float>(s.beta1);
  a.one_b1 = static_cast<float>(1.0 - s.beta1);
  a.b2 = static_cast<float>(s.beta2);
  a.one_b2 = static_cast<float>(1.0 - s.beta2);
  a.inv_bias2 = 1.0f / static_cast<float>(s.bias2);
  a.eps = static_cast<float>(s.eps);
  a.step = static_cast<float>(-s.lr / s.bias1);
  adamw_kernel<<<static_cast<unsigned>(table.runs), kThreads, 0, at::cuda::getCurrentCUDAStream()>>>(table.ptr(),
                                                                                                     table.count, a);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

bool multi_supported(const std::vector<at::Tensor>& xs) { return multi_refusal(xs).empty(); }

at::Tensor sum_squares(const std::vector<at::Tensor>& xs) {
  const Table table = plain_table("sum_squares", xs);
  const at::Device dev = xs.front().device();
  c10::cuda::CUDAGuard guard(dev);
  at::Tensor partial = at::empty({table.runs}, at::TensorOptions().dtype(at::kDouble).device(dev));
  if (table.runs == 0) return partial.sum();
  sum_squares_kernel<<<static_cast<unsigned>(table.runs), kThreads, 0, at::cuda::getCurrentCUDAStream()>>>(
      table.ptr(), table.count, partial.data_ptr<double>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return partial.sum();
}

void scale_(const std::vector<at::Tensor>& xs, double s) {
  const Table table = plain_table("scale_", xs);
  c10::cuda::CUDAGuard guard(xs.front().device());
  if (table.runs == 0) return;
  scale_kernel<<<static_cast<unsigned>(table.runs), kThreads, 0, at::cuda::getCurrentCUDAStream()>>>(
      table.ptr(), table.count, static_cast<float>(s));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace hh::kernels
