#include "kernels/gdn_decode.h"

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>

#include <stdexcept>
#include <string>

#include "kernels/device_ops.cuh"

namespace hh::kernels {
namespace {

using namespace device;  // rope_element, gate_activation, gdn_gate_values

constexpr int kDecodeThreads = 256;
constexpr int kTaps = 4;  // the short convolution's kernel (kShortConvKernel)

// DecodeStep as raw pointers, with the heads' positions carried in the launch.
struct DecodeParams {
  const void *q, *k, *v;
  int64_t ld_q, ld_k, ld_v;
  const void* conv_w;  // null: no convolution
  void* conv_past;
  const void *cos, *sin;
  const void *b, *a;
  int64_t ld_b, ld_a;
  const void *A_log, *dt_bias;
  bool two;
  float* state;
  const void* gate;  // null: no fusion
  int64_t ld_gate;
  const void* gamma;
  void* out;
  int64_t ld_out;  // between sequences in out (Hq Dh)
  int n;
  float scale, l2_eps, norm_eps;
  int pos[kMaxDecodeHeads];  // LA head i's position among out's heads
  int qh[kMaxDecodeHeads];   // its q columns' head in q's row
};

__device__ __forceinline__ float warp_sum(float v) {
  for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
  return v;
}

// One block per (LA head i, sequence b). The state's column j lives in threads j, j + DH, ...: each holds
// DH / PARTS of its rows in registers between the prediction S^T k and the update.
template <class T, int DH>
__global__ void __launch_bounds__(kDecodeThreads) gdn_decode_kernel(const DecodeParams p) {
  constexpr int PARTS = kDecodeThreads / DH, ROWS = DH / PARTS, HALF = DH / 2;
  static_assert(DH % 32 == 0 && kDecodeThreads % DH == 0, "whole warps a row");
  __shared__ float qs[DH], ks[DH], vs[DH], roped[2][DH], red[PARTS][DH], sums[DH / 32];
  __shared__ float2 gates;
  const int i = blockIdx.x, tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int64_t b = blockIdx.y, C = static_cast<int64_t>(p.n) * DH;

  // The short convolution and its SiLU on the token's q, k and v, each rounded to T as at::conv1d and
  // at::silu round (the taps summed oldest first); the cached inputs slide by one.
  for (int c = tid; c < 3 * DH; c += kDecodeThreads) {
    const int which = c / DH, d = c % DH;
    const T* src = static_cast<const T*>(which == 0 ? p.q : which == 1 ? p.k : p.v);
    const int64_t ld = which == 0 ? p.ld_q : which == 1 ? p.ld_k : p.ld_v;
    const T x = src[b * ld + static_cast<int64_t>(which == 0 ? p.qh[i] : i) * DH + d];
    float y = static_cast<float>(x);
    if (p.conv_w != nullptr) {
      const int64_t ch = which * C + static_cast<int64_t>(i) * DH + d;
      const T* w = static_cast<const T*>(p.conv_w) + ch * kTaps;
      T* past = static_cast<T*>(p.conv_past) + (b * 3 * C + ch) * (kTaps - 1);
      const T p0 = past[0], p1 = past[1], p2 = past[2];
      float acc = static_cast<float>(w[0]) * static_cast<float>(p0);
      acc = fmaf(static_cast<float>(w[1]), static_cast<float>(p1), acc);
      acc = fmaf(static_cast<float>(w[2]), static_cast<float>(p2), acc);
      acc = fmaf(static_cast<float>(w[3]), y, acc);
      y = static_cast<float>(static_cast<T>(gate_activation<2, T>(static_cast<float>(static_cast<T>(acc)))));
      past[0] = p1;
      past[1] = p2;
      past[2] = x;
    }
    (which == 0 ? qs : which == 1 ? ks : vs)[d] = y;
  }
  if (tid == 0)
    gates = gdn_gate_values<T>(static_cast<float>(static_cast<const T*>(p.b)[b * p.ld_b + i]),
                               static_cast<float>(static_cast<const T*>(p.a)[b * p.ld_a + i]),
                               static_cast<float>(static_cast<const T*>(p.A_log)[i]),
                               static_cast<float>(static_cast<const T*>(p.dt_bias)[i]), p.two);
  __syncthreads();

  // RoPE, then the L2 norm in float32, of q (warp 0) and k (warp 1), as rope_l2norm rounds them.
  if (warp < 2) {
    float* x = warp == 0 ? qs : ks;
    float* r = roped[warp];
    const T* cs = static_cast<const T*>(p.cos);
    const T* sn = static_cast<const T*>(p.sin);
    float ss = 0.f;
    for (int d = lane; d < DH; d += 32) {
      const float rot = d < HALF ? -x[d + HALF] : x[d - HALF];
      r[d] = static_cast<float>(rope_element<T>(x[d], rot, static_cast<float>(cs[d]), static_cast<float>(sn[d])));
      ss += r[d] * r[d];
    }
    const float inv = rsqrtf(warp_sum(ss) + p.l2_eps);
    __syncwarp();
    for (int d = lane; d < DH; d += 32) x[d] = static_cast<float>(static_cast<T>(r[d] * inv));
  }
  __syncthreads();

  // One step of the rule in float32: S = e^g S; u = beta (v - S^T k); S += k u^T; o = scale S^T q.
  const float decay = expf(gates.x), beta = gates.y;
  const int j = tid % DH, part = tid / DH, r0 = part * ROWS;
  float* S = p.state + ((b * p.n + i) * DH + r0) * DH + j;
  float s[ROWS];
  float pred = 0.f;
#pragma unroll
  for (int r = 0; r < ROWS; ++r) {
    s[r] = S[r * DH] * decay;
    pred = fmaf(s[r], ks[r0 + r], pred);
  }
  red[part][j] = pred;
  __syncthreads();
  pred = 0.f;
#pragma unroll
  for (int q = 0; q < PARTS; ++q) pred += red[q][j];
  const float u = beta * (vs[j] - pred);
  __syncthreads();  // red is taken again below
  float o = 0.f;
#pragma unroll
  for (int r = 0; r < ROWS; ++r) {
    s[r] += ks[r0 + r] * u;
    S[r * DH] = s[r];
    o = fmaf(s[r], qs[r0 + r], o);
  }
  red[part][j] = o;
  __syncthreads();

  // o rounded to T, then the fusion (as fusion_forward_kernel): act(gate) * (gamma * RMSNorm(o)).
  float ov = 0.f;
  if (tid < DH) {
    float acc = 0.f;
#pragma unroll
    for (int q = 0; q < PARTS; ++q) acc += red[q][tid];
    ov = static_cast<float>(static_cast<T>(acc * p.scale));
  }
  const float sq = warp_sum(ov * ov);
  if (lane == 0 && warp < DH / 32) sums[warp] = sq;
  __syncthreads();
  if (tid >= DH) return;
  T y;
  if (p.gamma != nullptr) {
    float total = 0.f;
#pragma unroll
    for (int w = 0; w < DH / 32; ++w) total += sums[w];
    const float rstd = rsqrtf(total / static_cast<float>(DH) + p.norm_eps);
    const T normed = static_cast<T>(ov * rstd);
    const T scaled = static_cast<T>(static_cast<float>(static_cast<const T*>(p.gamma)[p.pos[i] * DH + tid]) *
                                    static_cast<float>(normed));
    const float gv = static_cast<float>(static_cast<const T*>(p.gate)[b * p.ld_gate + static_cast<int64_t>(i) * DH + tid]);
    const float act = static_cast<float>(static_cast<T>(gate_activation<2, T>(gv)));
    y = static_cast<T>(act * static_cast<float>(scaled));
  } else {
    y = static_cast<T>(ov);
  }
  static_cast<T*>(p.out)[b * p.ld_out + static_cast<int64_t>(p.pos[i]) * DH + tid] = y;
}

// What keeps gdn_decode_step from these inputs, or "" when nothing does.
std::string decode_step_problem(const DecodeStep& s, const at::Tensor& out) {
  if (!out.defined() || !out.is_cuda() || out.dim() != 4 || out.size(1) != 1 || !out.is_contiguous())
    return "out must be a contiguous CUDA tensor [B, 1, Hq, Dh]";
  const at::ScalarType t = out.scalar_type();
  if (t != at::kFloat && t != at::kHalf && t != at::kBFloat16) return "out must be float32, float16 or bfloat16";
  const int64_t B = out.size(0), Hq = out.size(2), Dh = out.size(3), n = static_cast<int64_t>(s.heads.size()), C = n * Dh;
  if (Dh != 32 && Dh != 64 && Dh != 128) return "head_dim must be 32, 64 or 128, got " + std::to_string(Dh);
  if (n < 1 || n > kMaxDecodeHeads) return "between 1 and " + std::to_string(kMaxDecodeHeads) + " LA heads, got " + std::to_string(n);
  if (static_cast<int64_t>(s.q_heads.size()) != n) return "q_heads must name one q head per LA head";
  for (int64_t h : s.heads)
    if (h < 0 || h >= Hq) return "head position " + std::to_string(h) + " outside out's " + std::to_string(Hq) + " heads";
  const at::Device dev = out.device();
  auto bad = [&](const at::Tensor& x, const char* what, std::vector<int64_t> sizes, bool rows, at::ScalarType dtype) -> std::string {
    const std::string name = what;
    if (!x.defined() || x.device() != dev) return name + " must be defined on out's device";
    if (x.scalar_type() != dtype) return name + " must be " + std::string(c10::toString(dtype));
    if (x.sizes() != at::IntArrayRef(sizes)) return name + " has the wrong shape " + std::string(c10::str(x.sizes()));
    if (rows ? x.stride(1) != 1 || x.stride(0) < x.size(1) : !x.is_contiguous())
      return name + (rows ? " must have unit column stride" : " must be contiguous");
    return "";
  };
  if (s.q.defined() && s.q.dim() == 2 && s.q.size(1) % Dh != 0) return "q's row must be whole heads";
  const int64_t q_cols = s.q.defined() && s.q.dim() == 2 ? s.q.size(1) : C;
  for (int64_t h : s.q_heads)
    if (h < 0 || h * Dh >= q_cols) return "q head " + std::to_string(h) + " outside q's row";
  // RoPE's tables: any shape of Dh values ([1, Dh] from model::rope_cos_sin).
  auto table = [&](const at::Tensor& x, const char* what) -> std::string {
    if (!x.defined() || x.numel() != Dh) return std::string(what) + " must hold Dh values";
    return bad(x, what, x.sizes().vec(), false, t);
  };
  for (const std::string& e : {bad(s.q, "q", {B, q_cols}, true, t), bad(s.k, "k", {B, C}, true, t), bad(s.v, "v", {B, C}, true, t),
                               table(s.cos, "cos"), table(s.sin, "sin"), bad(s.b, "b", {B, n}, true, t),
                               bad(s.a, "a", {B, n}, true, t), bad(s.A_log, "A_log", {n}, false, t),
                               bad(s.dt_bias, "dt_bias", {n}, false, t), bad(s.state, "state", {B, n, Dh, Dh}, false, at::kFloat)})
    if (!e.empty()) return e;
  if (s.conv_weight.defined() != s.conv_past.defined()) return "conv_weight and conv_past come together";
  if (s.conv_weight.defined())
    for (const std::string& e : {bad(s.conv_weight, "conv_weight", {3 * C, 1, kTaps}, false, t),
                                 bad(s.conv_past, "conv_past", {B, 3 * C, kTaps - 1}, false, t)})
      if (!e.empty()) return e;
  if (s.gate.defined() != s.gamma.defined()) return "gate and gamma come together";
  if (s.gate.defined())
    for (const std::string& e : {bad(s.gate, "gate", {B, C}, true, t), bad(s.gamma, "gamma", {Hq, Dh}, false, t)})
      if (!e.empty()) return e;
  if (B > 65535) return "at most 65535 sequences";
  return "";
}

// The launch, on inputs decode_step_problem passed.
void launch_decode_step(const DecodeStep& s, at::Tensor& out) {
  const int64_t B = out.size(0), Hq = out.size(2), Dh = out.size(3), n = static_cast<int64_t>(s.heads.size());
  DecodeParams p{};
  p.q = s.q.data_ptr(), p.k = s.k.data_ptr(), p.v = s.v.data_ptr();
  p.ld_q = s.q.stride(0), p.ld_k = s.k.stride(0), p.ld_v = s.v.stride(0);
  if (s.conv_weight.defined()) p.conv_w = s.conv_weight.data_ptr(), p.conv_past = s.conv_past.data_ptr();
  p.cos = s.cos.data_ptr(), p.sin = s.sin.data_ptr();
  p.b = s.b.data_ptr(), p.a = s.a.data_ptr(), p.ld_b = s.b.stride(0), p.ld_a = s.a.stride(0);
  p.A_log = s.A_log.data_ptr(), p.dt_bias = s.dt_bias.data_ptr(), p.two = s.beta_times_two;
  p.state = s.state.data_ptr<float>();
  if (s.gate.defined()) p.gate = s.gate.data_ptr(), p.ld_gate = s.gate.stride(0), p.gamma = s.gamma.data_ptr();
  p.out = out.data_ptr(), p.ld_out = Hq * Dh;
  p.n = static_cast<int>(n);
  p.scale = static_cast<float>(s.scale), p.l2_eps = static_cast<float>(s.l2_eps), p.norm_eps = static_cast<float>(s.norm_eps);
  for (int64_t i = 0; i < n; ++i) p.pos[i] = static_cast<int>(s.heads[i]), p.qh[i] = static_cast<int>(s.q_heads[i]);
  const c10::cuda::CUDAGuard guard(out.device());
  const dim3 grid(static_cast<unsigned>(n), static_cast<unsigned>(B));
  auto stream = at::cuda::getCurrentCUDAStream();
  auto launch = [&](auto x) {
    using X = decltype(x);
    if (Dh == 32) gdn_decode_kernel<X, 32><<<grid, kDecodeThreads, 0, stream>>>(p);
    else if (Dh == 64) gdn_decode_kernel<X, 64><<<grid, kDecodeThreads, 0, stream>>>(p);
    else gdn_decode_kernel<X, 128><<<grid, kDecodeThreads, 0, stream>>>(p);
  };
  switch (out.scalar_type()) {
    case at::kFloat: launch(float{}); break;
    case at::kHalf: launch(c10::Half{}); break;
    default: launch(c10::BFloat16{}); break;
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace

bool try_gdn_decode_step(const DecodeStep& s, at::Tensor& out) {
  if (!decode_step_problem(s, out).empty()) return false;
  launch_decode_step(s, out);
  return true;
}

void gdn_decode_step(const DecodeStep& s, at::Tensor& out) {
  if (const std::string e = decode_step_problem(s, out); !e.empty())
    throw std::invalid_argument("hh::kernels::gdn_decode_step: " + e);
  launch_decode_step(s, out);
}

}  // namespace hh::kernels
