#include "core/model/transformer.h"

#include <torch/torch.h>

#include <ATen/CPUGeneratorImpl.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <sstream>
#include <tuple>
#include <utility>

#include "core/io/checkpoint.h"
#ifdef HH_HAVE_KERNELS
#include "kernels/fused_ops.h"
#endif
#include "core/model/fused_autograd.h"
#include "core/util/error.h"

namespace hh::model {
namespace {

// Query rows per block on the blockwise attention path: scores are [B, Hkv, G*rows, T_kv], so memory
// grows linearly with the context instead of quadratically. Rows shrink for wide inputs so that one
// block holds about kScoreBudget scores (256 MiB in float32).
constexpr int64_t kQueryBlock = 512;
constexpr int64_t kMinQueryBlock = 16;
constexpr int64_t kScoreBudget = int64_t{64} << 20;
// Std of the norm weights around 1 in random_weights().
constexpr double kNormWeightStd = 0.1;

std::string shape_str(at::IntArrayRef shape) {
  std::ostringstream os;
  os << '[';
  for (size_t i = 0; i < shape.size(); ++i) os << (i ? ", " : "") << shape[i];
  os << ']';
  return os.str();
}

// HF upcasts norm statistics and softmax to float32; a float64 model stays in float64.
at::ScalarType accum_dtype(at::ScalarType t) { return t == at::kDouble ? at::kDouble : at::kFloat; }

void check_config(const ModelConfig& c) {
  auto positive = [](int64_t v, const char* field) {
    if (v <= 0) throw Error(std::string("model config: ") + field + " must be > 0, got " + std::to_string(v));
  };
  positive(c.vocab_size, "vocab_size");
  positive(c.hidden_size, "hidden_size");
  positive(c.intermediate_size, "intermediate_size");
  positive(c.num_hidden_layers, "num_hidden_layers");
  positive(c.num_attention_heads, "num_attention_heads");
  positive(c.num_key_value_heads, "num_key_value_heads");
  positive(c.head_dim, "head_dim");
  if (c.num_attention_heads % c.num_key_value_heads != 0)
    throw Error("model config: num_attention_heads (" + std::to_string(c.num_attention_heads) +
                ") is not a multiple of num_key_value_heads (" + std::to_string(c.num_key_value_heads) + ")");
  if (c.head_dim % 2 != 0)
    throw Error("model config: head_dim must be even for rotate-half RoPE, got " + std::to_string(c.head_dim));
  if (!(c.rms_norm_eps > 0)) throw Error("model config: rms_norm_eps must be > 0");
  if (!(c.rope_theta > 0)) throw Error("model config: rope_theta must be > 0");
}

// ---- shared blocks (the per-layer recipe below reads as HF's Qwen3DecoderLayer) ----------------


struct RopeTables {
  at::Tensor cos, sin;  // [1, T, 1, Dh] model dtype, broadcast over batch and heads
};

// HF Qwen3RotaryEmbedding: angles pos * inv_freq and their cos/sin in float32, then cast (on CUDA
// kernels::rope_tables forms the same values in one launch).
RopeTables rope_tables_ops(const at::Tensor& inv_freq, int64_t offset, int64_t T, at::ScalarType dtype) {
  const auto long_opts = at::TensorOptions().dtype(at::kLong).device(inv_freq.device());
  at::Tensor pos = at::arange(offset, offset + T, long_opts).to(at::kFloat);  // [T]
  at::Tensor freqs = pos.unsqueeze(1) * inv_freq.unsqueeze(0);               // [T, Dh/2]
  at::Tensor emb = at::cat({freqs, freqs}, -1);                               // [T, Dh]
  const int64_t Dh = emb.size(1);
  return {emb.cos().to(dtype).view({1, T, 1, Dh}), emb.sin().to(dtype).view({1, T, 1, Dh})};
}

RopeTables rope_tables(const at::Tensor& inv_freq, int64_t offset, int64_t T, at::ScalarType dtype) {
#ifdef HH_HAVE_KERNELS
  // On CUDA one kernel forms both tables with the ops' values below (eight small launches otherwise).
  if (inv_freq.is_cuda() && inv_freq.dim() == 1 && inv_freq.scalar_type() == at::kFloat && inv_freq.is_contiguous() &&
      (dtype == at::kFloat || dtype == at::kHalf || dtype == at::kBFloat16) && T > 0) {
    const auto [c, s] = kernels::rope_tables(inv_freq, offset, T, dtype);
    return {c.view({1, T, 1, c.size(1)}), s.view({1, T, 1, s.size(1)})};
  }
#endif
  return rope_tables_ops(inv_freq, offset, T, dtype);
}

// Non-interleaved layout: pairs are (i, i + Dh/2). rotate_half(x) = [-x2, x1].
at::Tensor apply_rope(const at::Tensor& x, const RopeTables& rope) {  // x [B, T, H, Dh]
  const int64_t half = x.size(-1) / 2;
  at::Tensor x1 = x.narrow(-1, 0, half);
  at::Tensor x2 = x.narrow(-1, half, half);
  at::Tensor rotated = at::cat({-x2, x1}, -1);  // [B, T, H, Dh]
  return x * rope.cos + rotated * rope.sin;
}

// The fused CUDA kernels (kernels/fused_ops.h, with their backwards in fused_autograd.h) stand in for
// the op sequences above when a forward asks for them and the tensors are float32/16-bit on CUDA.
// Gradients reach the activations only, so a weight that needs one keeps the op sequence.
bool use_fused(bool requested, const at::Tensor& x) {
#ifdef HH_HAVE_KERNELS
  return requested && x.is_cuda() && x.scalar_type() != at::kDouble;
#else
  (void)requested;
  (void)x;
  return false;
#endif
}

at::Tensor rms_norm_maybe_fused(const at::Tensor& x, const at::Tensor& weight, double eps, bool fused) {
#ifdef HH_HAVE_KERNELS
  if (fused && !weight.requires_grad()) return fused_rms_norm(x, weight, eps);
#endif
  (void)fused;
  return rms_norm(x, weight, eps);
}

at::Tensor norm_rope_maybe_fused(const at::Tensor& x, const at::Tensor& weight, const RopeTables& rope, double eps,
                                 bool fused) {
#ifdef HH_HAVE_KERNELS
  if (fused && !weight.requires_grad()) {
    const int64_t T = rope.cos.size(1), Dh = rope.cos.size(3);
    return fused_norm_rope(x, weight, rope.cos.reshape({T, Dh}), rope.sin.reshape({T, Dh}), eps);
  }
#endif
  (void)fused;
  return apply_rope(rms_norm(x, weight, eps), rope);
}

// [B, R, Hq, Dh] -> [B, Hkv, G*R, Dh]: the G query heads that share KV head j are stacked along the
// row axis, so one matmul against K of head j serves all of them (no K/V copy per query head).
at::Tensor group_queries(const at::Tensor& q_rows, int64_t Hkv) {
  const int64_t B = q_rows.size(0), R = q_rows.size(1), Hq = q_rows.size(2), Dh = q_rows.size(3);
  const int64_t G = Hq / Hkv;
  return q_rows.reshape({B, R, Hkv, G, Dh}).permute({0, 2, 3, 1, 4}).reshape({B, Hkv, G * R, Dh});
}

// Inverse of group_queries for per-row results: [B, Hkv, G*R, X] -> [B, R, Hq, X].
at::Tensor ungroup_rows(const at::Tensor& o, int64_t R) {
  const int64_t B = o.size(0), Hkv = o.size(1), G = o.size(2) / R, X = o.size(3);
  return o.view({B, Hkv, G, R, X}).permute({0, 3, 1, 2, 4}).reshape({B, R, Hkv * G, X});
}

// Attention probabilities of the query rows `rows` (indices into q's T axis) over keys [0, n_keys),
// causal by absolute position `abs_pos` of each row, eager-HF order: (q k^T) * scale, mask, softmax in
// float32, cast to the model dtype.
at::Tensor softmax_rows(const at::Tensor& q, const at::Tensor& kh, const at::Tensor& rows, const at::Tensor& abs_pos,
                        int64_t n_keys, double scale) {
  // q [B, T, Hq, Dh], kh [B, Hkv, >= n_keys, Dh], rows/abs_pos [R] int64 -> [B, Hkv, G, R, n_keys]
  const int64_t B = q.size(0), Hq = q.size(2), Hkv = kh.size(1), R = rows.size(0);
  const int64_t G = Hq / Hkv;
  at::Tensor qg = group_queries(q.index_select(1, rows), Hkv);                          // [B, Hkv, G*R, Dh]
  at::Tensor scores = at::matmul(qg, kh.narrow(2, 0, n_keys).transpose(2, 3)) * scale;  // [B, Hkv, G*R, n]
  at::Tensor keys = at::arange(n_keys, rows.options());                                  // [n]
  at::Tensor future = keys.unsqueeze(0) > abs_pos.unsqueeze(1);                          // [R, n]
  scores = scores.view({B, Hkv, G, R, n_keys}).masked_fill(future, -std::numeric_limits<double>::infinity());
  return at::softmax(scores, -1, accum_dtype(q.scalar_type())).to(q.scalar_type());
}

// Rows per query block for n_keys keys: at most kQueryBlock, fewer when B * Hq * n_keys is large.
int64_t query_block_rows(int64_t B, int64_t Hq, int64_t n_keys) {
  return std::clamp(kScoreBudget / std::max<int64_t>(1, B * Hq * n_keys), kMinQueryBlock, kQueryBlock);
}

// Causal attention in query blocks; never holds more than query_block_rows x T scores per head.
// With a key prefix (k/v longer than q by P tokens), query i sits at absolute position P + i.
at::Tensor blockwise_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale) {
  // q [B, Tq, Hq, Dh], k/v [B, P + Tq, Hkv, Dh] -> z [B, Tq, Hq, Dh]
  const int64_t B = q.size(0), Tq = q.size(1), Hkv = k.size(2);
  const int64_t P = k.size(1) - Tq;
  const int64_t block = query_block_rows(B, q.size(2), P + Tq);
  // [B, Hkv, P + Tq, Dh]; one query row (decoding) reads the keys and values in place, the blocks of
  // longer inputs from a contiguous copy.
  at::Tensor kh = Tq == 1 ? k.transpose(1, 2) : k.transpose(1, 2).contiguous();
  at::Tensor vh = Tq == 1 ? v.transpose(1, 2) : v.transpose(1, 2).contiguous();
  const auto long_opts = at::TensorOptions().dtype(at::kLong).device(q.device());
  std::vector<at::Tensor> blocks;
  for (int64_t r0 = 0; r0 < Tq; r0 += block) {
    const int64_t r1 = std::min(Tq, r0 + block);
    const int64_t R = r1 - r0;
    // Keys after the block's last row are masked for every row of the block: skip them.
    at::Tensor rows = at::arange(r0, r1, long_opts);                                                   // [R] into q
    at::Tensor probs = softmax_rows(q, kh, rows, rows + P, /*n_keys=*/P + r1, scale);                  // [B, Hkv, G, R, n]
    at::Tensor out = at::matmul(probs.view({B, Hkv, -1, P + r1}), vh.narrow(2, 0, P + r1));           // [B, Hkv, G*R, Dh]
    blocks.push_back(ungroup_rows(out, R));                                                             // [B, R, Hq, Dh]
  }
  return blocks.size() == 1 ? blocks[0] : at::cat(blocks, 1);
}

#if HH_TORCH_AT_LEAST(2, 0)
// Fused causal attention (flash / memory-efficient kernels on CUDA, flash-style on CPU).
// With a key prefix of P tokens the causal mask is bottom-right aligned (query i sees keys <= P + i);
// is_causal means top-left alignment in SDPA, so that case passes an explicit boolean mask, built for
// query blocks that keep it under kMaskBudget bytes.
constexpr int64_t kMaskBudget = int64_t{256} << 20;

at::Tensor sdpa_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale) {
  // q [B, Tq, Hq, Dh], k/v [B, P + Tq, Hkv, Dh] -> z [B, Tq, Hq, Dh]
  const int64_t B = q.size(0), Tq = q.size(1), Hq = q.size(2), Dh = q.size(3), Hkv = k.size(2), Tk = k.size(1);
  const int64_t G = Hq / Hkv, P = Tk - Tq;
  at::Tensor qh = q.transpose(1, 2);  // [B, Hq, Tq, Dh]
  at::Tensor kh = k.transpose(1, 2);  // [B, Hkv, Tk, Dh]
  at::Tensor vh = v.transpose(1, 2);
  if (G > 1) {
    // Query head h reads KV head h / G. O(T) extra memory; keeps every SDPA backend eligible.
    kh = kh.unsqueeze(2).expand({B, Hkv, G, Tk, Dh}).reshape({B, Hq, Tk, Dh});
    vh = vh.unsqueeze(2).expand({B, Hkv, G, Tk, Dh}).reshape({B, Hq, Tk, Dh});
  }
  // No mask: is_causal. An undefined tensor must not be passed as a present (optional) mask.
  auto sdpa = [&](const at::Tensor& qq, const at::Tensor& kk, const at::Tensor& vv, const at::Tensor& mask) {
    const hh::opt<at::Tensor> m = mask.defined() ? hh::opt<at::Tensor>(mask) : hh::opt<at::Tensor>();
#if HH_TORCH_AT_LEAST(2, 1)
    return at::scaled_dot_product_attention(qq, kk, vv, m, /*dropout_p=*/0.0, /*is_causal=*/!mask.defined(), scale);
#else
    // 2.0 has no scale argument; its default 1/sqrt(Dh) is the Qwen3 scale.
    return at::scaled_dot_product_attention(qq, kk, vv, m, /*dropout_p=*/0.0, /*is_causal=*/!mask.defined());
#endif
  };
  at::Tensor out;
  if (P == 0) {
    out = sdpa(qh, kh, vh, {});
  } else {
    const int64_t block = std::max<int64_t>(kMinQueryBlock, kMaskBudget / Tk);
    const auto long_opts = at::TensorOptions().dtype(at::kLong).device(q.device());
    std::vector<at::Tensor> parts;
    for (int64_t r0 = 0; r0 < Tq; r0 += block) {
      const int64_t R = std::min(Tq - r0, block), n = P + r0 + R;  // keys after the block's last row: unused
      at::Tensor rows = at::arange(P + r0, P + r0 + R, long_opts);                        // [R] absolute
      at::Tensor allowed = at::arange(n, long_opts).unsqueeze(0) <= rows.unsqueeze(1);    // [R, n]
      parts.push_back(sdpa(qh.narrow(2, r0, R), kh.narrow(2, 0, n), vh.narrow(2, 0, n), allowed));
    }
    out = parts.size() == 1 ? parts[0] : at::cat(parts, 2);
  }
  return out.transpose(1, 2).contiguous();  // [B, Tq, Hq, Dh]
}
#endif


// q [B, T, Hq, Dh], k/v [B, T, Hkv, Dh] for the same T rows, and optionally keys/values of P earlier
// tokens pk/pv [1 or B, P, Hkv, Dh] (undefined: none).
at::Tensor causal_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& pk,
                            const at::Tensor& pv, double scale, bool eager) {
#if HH_TORCH_AT_LEAST(2, 1)
  if (!eager && pk.defined() && flash_eligible(q)) return prefix_split_attention(q, k, v, pk, pv, scale);
#endif
  at::Tensor k_all = k, v_all = v;
  if (pk.defined()) {
    const int64_t B = q.size(0);
    k_all = at::cat({pk.expand({B, -1, -1, -1}), k}, 1);
    v_all = at::cat({pv.expand({B, -1, -1, -1}), v}, 1);
  }
#if HH_TORCH_AT_LEAST(2, 0)
  if (!eager) return sdpa_attention(q, k_all, v_all, scale);
#endif
  return blockwise_attention(q, k_all, v_all, scale);
}

// causal_attention_after (transformer.h).
at::Tensor attention_after(const at::Tensor& q, const at::Tensor& k_all, const at::Tensor& v_all, double scale, bool eager) {
  const int64_t B = q.size(0), T = q.size(1), Hq = q.size(2), Dh = q.size(3), Hkv = k_all.size(2), Tk = k_all.size(1);
  if (k_all.size(0) != B || !v_all.sizes().equals(k_all.sizes()) || Tk < T || k_all.size(3) != Dh || Hkv < 1 || Hq % Hkv != 0)
    throw Error("causal_attention_after: keys and values " + shape_str(k_all.sizes()) + " / " + shape_str(v_all.sizes()) +
                " cannot follow queries " + shape_str(q.sizes()));
  const int64_t P = Tk - T;
  if (P == 0) return causal_attention(q, k_all, v_all, {}, {}, scale, eager);
#if HH_TORCH_AT_LEAST(2, 1)
  if (!eager && T == 1) {
    // One new token sees every key: no mask, and each KV head's G query heads as G query rows of it,
    // so the keys and values are read in place rather than repeated for each query head.
    const at::Tensor qh = q.reshape({B, Hkv, Hq / Hkv, Dh});  // query head h = kv * G + g
    const at::Tensor out = at::scaled_dot_product_attention(qh, k_all.transpose(1, 2), v_all.transpose(1, 2), {},
                                                            /*dropout_p=*/0.0, /*is_causal=*/false, scale);
    return out.reshape({B, 1, Hq, Dh});
  }
  if (!eager && flash_eligible(q))
    return prefix_split_attention(q, k_all.narrow(1, P, T), v_all.narrow(1, P, T), k_all.narrow(1, 0, P),
                                  v_all.narrow(1, 0, P), scale);
#endif
#if HH_TORCH_AT_LEAST(2, 0)
  if (!eager) return sdpa_attention(q, k_all, v_all, scale);
#endif
  return blockwise_attention(q, k_all, v_all, scale);
}

// hook_pattern rows, in blocks of rows so the float32 softmax temporaries stay small. `rows` index q;
// with a key prefix of P = kh.size(2) - q.size(1) tokens, row r sits at absolute position P + r.
at::Tensor attention_pattern(const at::Tensor& q, const at::Tensor& kh, const at::Tensor& rows, double scale) {
  // q [B, Tq, Hq, Dh], kh [B, Hkv, Tk, Dh], rows [R] -> [B, Hq, R, Tk]
  const int64_t B = q.size(0), Hq = q.size(2), R = rows.size(0), Tk = kh.size(2);
  const int64_t P = Tk - q.size(1);
  const int64_t block = query_block_rows(B, Hq, Tk);
  std::vector<at::Tensor> parts;
  for (int64_t r0 = 0; r0 < R; r0 += block) {
    const int64_t n = std::min(R - r0, block);
    at::Tensor r = rows.narrow(0, r0, n);
    at::Tensor p = softmax_rows(q, kh, r, r + P, /*n_keys=*/Tk, scale);  // [B, Hkv, G, n, Tk]
    parts.push_back(p.reshape({B, Hq, n, Tk}));
  }
  return parts.size() == 1 ? parts[0] : at::cat(parts, 2);
}

// Calls the hooks of one point; the name string is built only when some hook is registered.
class HookPoints {
 public:
  explicit HookPoints(const Hooks* hooks) : hooks_(hooks != nullptr && !hooks->empty() ? hooks : nullptr) {}

  bool active(int64_t layer, HookKind kind) const {
    return hooks_ != nullptr && hooks_->active(hook_name(layer, kind));
  }

  // A replacement must keep the shape; it is moved to the activation's dtype and device.
  void operator()(int64_t layer, HookKind kind, at::Tensor& t) const {
    if (hooks_ == nullptr) return;
    const std::string name = hook_name(layer, kind);
    if (!hooks_->active(name)) return;
    const at::Tensor before = t;
    hooks_->run(name, t);
    if (!t.defined()) throw Error("hook '" + name + "' left its tensor undefined");
    if (t.sizes() != before.sizes())
      throw Error("hook '" + name + "' replaced a " + shape_str(before.sizes()) + " tensor with " +
                  shape_str(t.sizes()));
    if (t.scalar_type() != before.scalar_type() || t.device() != before.device())
      t = t.to(before.device(), before.scalar_type());
  }

 private:
  const Hooks* hooks_;
};

}  // namespace

at::Device parse_device(const std::string& name) {
  at::Device d = at::kCPU;
  try {
    d = at::Device(name);
  } catch (const c10::Error&) {
    throw Error("unknown device '" + name + "' (expected cpu, cuda or cuda:N)");
  }
  if (d.is_cuda()) {
    const int64_t count = static_cast<int64_t>(torch::cuda::device_count());
    if (count == 0) throw Error("device '" + name + "': this build or machine has no CUDA device (use cpu)");
    // The index as written: at::Device keeps it in 8 bits, so cuda:1000 would read as a small one.
    const size_t colon = name.find(':');
    int64_t index = -1;
    if (colon != std::string::npos) {
      try {
        index = std::stoll(name.substr(colon + 1));
      } catch (const std::exception&) {  // past int64_t
        index = std::numeric_limits<int64_t>::max();
      }
    }
    if (index >= count)
      throw Error("device '" + name + "': this machine has " + std::to_string(count) + " CUDA device" +
                  (count == 1 ? "" : "s") + " (cuda:0 .. cuda:" + std::to_string(count - 1) + ")");
  } else if (!d.is_cpu()) {
    throw Error("device '" + name + "': only cpu and cuda[:N] are supported");
  }
  return d;
}

namespace {

at::Tensor checked_positions(const at::Tensor& p, int64_t T, const at::Device& device, const char* what) {
  if (p.dim() != 1 || !at::isIntegralType(p.scalar_type(), /*includeBool=*/false))
    throw Error(std::string(what) + " must be a 1-D integer tensor, got " + shape_str(p.sizes()) + " of " +
                std::string(c10::toString(p.scalar_type())));
  at::Tensor pos = p.to(device, at::kLong);
  if (pos.numel() > 0) {
    const int64_t lo = pos.min().item<int64_t>(), hi = pos.max().item<int64_t>();
    if (lo < 0 || hi >= T)
      throw Error(std::string(what) + " holds position " + std::to_string(lo < 0 ? lo : hi) +
                  ", outside the input's [0, " + std::to_string(T) + ")");
  }
  return pos;
}

}  // namespace

// ---- weights --------------------------------------------------------------------------------------

std::vector<WeightEntry> weight_table(const ModelConfig& cfg, Weights& w) {
  const int64_t V = cfg.vocab_size, d = cfg.hidden_size, I = cfg.intermediate_size;
  const int64_t Hq = cfg.num_attention_heads, Hkv = cfg.num_key_value_heads, Dh = cfg.head_dim;
  const bool bias = cfg.attention_bias;
  w.layers.resize(static_cast<size_t>(std::max<int64_t>(cfg.num_hidden_layers, 0)));

  std::vector<WeightEntry> t;
  t.push_back({"model.embed_tokens.weight", &w.embed_tokens, {V, d}});
  for (int64_t l = 0; l < cfg.num_hidden_layers; ++l) {
    LayerWeights& lw = w.layers[static_cast<size_t>(l)];
    const std::string p = "model.layers." + std::to_string(l) + ".";
    t.push_back({p + "input_layernorm.weight", &lw.input_layernorm, {d}});
    t.push_back({p + "self_attn.q_proj.weight", &lw.q_proj, {Hq * Dh, d}});
    t.push_back({p + "self_attn.k_proj.weight", &lw.k_proj, {Hkv * Dh, d}});
    t.push_back({p + "self_attn.v_proj.weight", &lw.v_proj, {Hkv * Dh, d}});
    t.push_back({p + "self_attn.o_proj.weight", &lw.o_proj, {d, Hq * Dh}});
    if (bias) {
      t.push_back({p + "self_attn.q_proj.bias", &lw.q_bias, {Hq * Dh}});
      t.push_back({p + "self_attn.k_proj.bias", &lw.k_bias, {Hkv * Dh}});
      t.push_back({p + "self_attn.v_proj.bias", &lw.v_bias, {Hkv * Dh}});
      t.push_back({p + "self_attn.o_proj.bias", &lw.o_bias, {d}});
    }
    t.push_back({p + "self_attn.q_norm.weight", &lw.q_norm, {Dh}});
    t.push_back({p + "self_attn.k_norm.weight", &lw.k_norm, {Dh}});
    t.push_back({p + "post_attention_layernorm.weight", &lw.post_attention_layernorm, {d}});
    t.push_back({p + "mlp.gate_proj.weight", &lw.gate_proj, {I, d}});
    t.push_back({p + "mlp.up_proj.weight", &lw.up_proj, {I, d}});
    t.push_back({p + "mlp.down_proj.weight", &lw.down_proj, {d, I}});
  }
  t.push_back({"model.norm.weight", &w.norm, {d}});
  if (!cfg.tie_word_embeddings) t.push_back({"lm_head.weight", &w.lm_head, {V, d}});
  return t;
}

Weights random_weights(const ModelConfig& cfg, uint64_t seed, at::ScalarType dtype, double std) {
  check_config(cfg);
  Weights w;
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  const auto f32 = at::TensorOptions().dtype(at::kFloat);
  for (const WeightEntry& e : weight_table(cfg, w)) {
    at::Tensor t = at::randn(e.shape, gen, f32);
    const bool is_norm = e.name.size() >= 11 && e.name.compare(e.name.size() - 11, 11, "norm.weight") == 0;
    t = is_norm ? t * kNormWeightStd + 1.0 : t * std;
    *e.slot = t.to(dtype);
  }
  if (cfg.tie_word_embeddings) w.lm_head = w.embed_tokens;
  return w;
}

at::ScalarType parse_dtype(const std::string& name) {
  const std::string c = canonical_dtype(name);
  if (c == "f32") return at::kFloat;
  if (c == "bf16") return at::kBFloat16;
  if (c == "f16") return at::kHalf;
  if (c == "f64") return at::kDouble;
  throw Error("unknown dtype '" + name + "' (expected f32, bf16, f16 or f64)");
}

at::ScalarType resolve_dtype(const std::string& dtype, const at::Device& device, at::ScalarType stored) {
  if (dtype.empty()) return stored;
  if (dtype == "auto")
    return device.is_cpu() && (stored == at::kBFloat16 || stored == at::kHalf) ? at::kFloat : stored;
  return parse_dtype(dtype);
}

at::ScalarType stored_dtype(const std::filesystem::path& dir) {
  return io::to_scalar_type(io::Checkpoint(dir).info("model.embed_tokens.weight").dtype);
}

void check_dtype(const std::string& dtype) {
  if (!is_dtype_option(dtype)) (void)parse_dtype(dtype);  // throws, naming it
}

// ---- Transformer ----------------------------------------------------------------------------------

Transformer::Transformer(ModelConfig cfg, Weights w) : cfg_(std::move(cfg)), w_(std::move(w)) {
  check_config(cfg_);
  if (static_cast<int64_t>(w_.layers.size()) != cfg_.num_hidden_layers)
    throw Error("weights hold " + std::to_string(w_.layers.size()) + " layers, config.num_hidden_layers is " +
                std::to_string(cfg_.num_hidden_layers));
  if (!w_.embed_tokens.defined()) throw Error("weights: model.embed_tokens.weight is missing");
  if (cfg_.tie_word_embeddings && !w_.lm_head.defined()) w_.lm_head = w_.embed_tokens;
  if (!w_.lm_head.defined()) throw Error("weights: lm_head.weight is missing and tie_word_embeddings is false");

  const at::ScalarType dtype = w_.embed_tokens.scalar_type();
  const at::Device device = w_.embed_tokens.device();
  std::vector<WeightEntry> table = weight_table(cfg_, w_);
  if (cfg_.tie_word_embeddings) table.push_back({"lm_head.weight (tied)", &w_.lm_head, {cfg_.vocab_size, cfg_.hidden_size}});
  for (const WeightEntry& e : table) {
    const at::Tensor& t = *e.slot;
    if (!t.defined()) throw Error("weights: " + e.name + " is missing (expected " + shape_str(e.shape) + ")");
    if (t.sizes() != at::IntArrayRef(e.shape))
      throw Error("weights: " + e.name + " has shape " + shape_str(t.sizes()) + ", expected " + shape_str(e.shape));
    if (t.scalar_type() != dtype || t.device() != device)
      throw Error("weights: " + e.name + " is " + std::string(c10::toString(t.scalar_type())) + " on " +
                  t.device().str() + ", the model is " + std::string(c10::toString(dtype)) + " on " + device.str());
  }

  // HF: inv_freq = 1 / (theta ** (arange(0, Dh, 2).float() / Dh)), built in float32 on the CPU.
  inv_freq_ = rope_inv_freq(cfg_.rope_theta, cfg_.head_dim, device);  // [Dh/2]
}

Transformer Transformer::load(const std::filesystem::path& dir, const std::string& device,
                              const std::string& dtype, const std::atomic<bool>* cancel) {
  return load(dir, ModelConfig::load(dir / "config.json"), device, dtype, cancel);
}

Transformer Transformer::load(const std::filesystem::path& dir, ModelConfig cfg, const std::string& device,
                              const std::string& dtype, const std::atomic<bool>* cancel) {
  check_config(cfg);
  const at::Device dev = parse_device(device);
  io::Checkpoint ckpt(dir);

  Weights w;
  const std::vector<WeightEntry> table = weight_table(cfg, w);
  // Check presence and shapes of everything before copying anything.
  for (const WeightEntry& e : table) {
    if (!ckpt.contains(e.name))
      throw Error(dir.string() + ": tensor '" + e.name + "' is missing from the checkpoint (expected shape " +
                  shape_str(e.shape) + " from config.json)");
    const io::TensorInfo& info = ckpt.info(e.name);
    if (info.shape != e.shape)
      throw Error(dir.string() + ": tensor '" + e.name + "' has shape " + shape_str(info.shape) + ", expected " +
                  shape_str(e.shape) + " from config.json");
  }
  const at::ScalarType target = resolve_dtype(dtype, dev, stored_dtype(dir));
  try {
    for (const WeightEntry& e : table) {
      if (cancel && cancel->load()) throw Cancelled();
      *e.slot = ckpt.load(e.name).to(dev, target);
    }
  } catch (const c10::Error& e) {
    throw Error(dir.string() + ": cannot place the weights on device '" + device + "' as " +
                std::string(c10::toString(target)) + ": " + e.what_without_backtrace());
  }
  return Transformer(std::move(cfg), std::move(w));
}

at::Device Transformer::device() const { return w_.embed_tokens.device(); }
at::ScalarType Transformer::dtype() const { return w_.embed_tokens.scalar_type(); }

ForwardOutput Transformer::forward(const at::Tensor& input, const ForwardOptions& opts) const {
  const int64_t L = cfg_.num_hidden_layers, V = cfg_.vocab_size, d = cfg_.hidden_size;
  const int64_t Hq = cfg_.num_attention_heads, Hkv = cfg_.num_key_value_heads, Dh = cfg_.head_dim;
  const double eps = cfg_.rms_norm_eps;
  const double scale = std::pow(static_cast<double>(Dh), -0.5);
  const at::ScalarType dt = dtype();
  const at::Device dev = device();

  const int64_t start = opts.start_layer;
  const int64_t stop = opts.stop_layer < 0 ? L : opts.stop_layer;
  if (start < 0 || start > L) throw Error("start_layer " + std::to_string(start) + " outside [0, " + std::to_string(L) + "]");
  if (opts.stop_layer < -1 || stop > L || stop < start)
    throw Error("stop_layer " + std::to_string(opts.stop_layer) + " outside [start_layer=" + std::to_string(start) +
                ", " + std::to_string(L) + "] (or -1 for all layers)");
  if (opts.position_offset < 0) throw Error("position_offset must be >= 0, got " + std::to_string(opts.position_offset));

  // ---- input: embeddings or a cached residual ----
  at::Tensor x;  // [B, T, d]
  if (start == 0 && !opts.residual_input) {
    if (input.dim() != 2 || !at::isIntegralType(input.scalar_type(), /*includeBool=*/false))
      throw Error("forward: token ids must be a [B, T] integer tensor, got " + shape_str(input.sizes()) + " of " +
                  std::string(c10::toString(input.scalar_type())));
    at::Tensor ids = input.to(dev, at::kLong);  // [B, T]
    at::Tensor bad = (ids < 0).logical_or(ids >= V);
    if (bad.any().item<bool>()) {
      at::Tensor where = bad.nonzero()[0].cpu();  // [2]
      const int64_t b = where[0].item<int64_t>(), t = where[1].item<int64_t>();
      throw Error("forward: token id " + std::to_string(ids[b][t].item<int64_t>()) + " at batch " + std::to_string(b) +
                  ", position " + std::to_string(t) + " is outside the vocabulary [0, " + std::to_string(V) + ")");
    }
    x = at::embedding(w_.embed_tokens, ids);
  } else {
    if (input.dim() != 3 || input.size(2) != d)
      throw Error("forward from layer " + std::to_string(start) + ": the residual must be [B, T, " + std::to_string(d) +
                  "], got " + shape_str(input.sizes()));
    x = input.to(dev, dt);
  }
  const int64_t B = x.size(0), T = x.size(1);
  if (B == 0 || T == 0) throw Error("forward: empty input " + shape_str(x.sizes()));

  const bool has_prefix = opts.prefix_k != nullptr || opts.prefix_v != nullptr;
  if (has_prefix && (opts.prefix_k == nullptr || opts.prefix_v == nullptr))
    throw Error("forward: prefix_k and prefix_v must be given together");
  KvCache* const cache = opts.cache;
  if (cache != nullptr) {
    if (has_prefix) throw Error("forward: a cache and prefix_k / prefix_v cannot be given together");
    if (static_cast<int64_t>(cache->k.size()) < stop || static_cast<int64_t>(cache->v.size()) < stop)
      throw Error("forward: the cache holds " + std::to_string(cache->k.size()) + " layers, the forward runs up to layer " +
                  std::to_string(stop - 1));
    for (int64_t l = start; l < stop; ++l)
      if (cache->k[static_cast<size_t>(l)].size() != cache->k[static_cast<size_t>(start)].size() ||
          cache->v[static_cast<size_t>(l)].size() != cache->k[static_cast<size_t>(start)].size())
        throw Error("forward: the cache's layers hold different numbers of tokens (layer " + std::to_string(l) + ": " +
                    std::to_string(cache->k[static_cast<size_t>(l)].size()) + ", layer " + std::to_string(start) + ": " +
                    std::to_string(cache->k[static_cast<size_t>(start)].size()) + ")");
  }
  // The prefix tensors of layer l, checked against the input; {undefined, undefined} without a prefix.
  auto prefix_of = [&](int64_t l) -> std::pair<at::Tensor, at::Tensor> {
    if (!has_prefix) return {};
    const auto at_layer = [&](const std::vector<at::Tensor>* list, const char* what) {
      if (static_cast<int64_t>(list->size()) <= l || !(*list)[static_cast<size_t>(l)].defined())
        throw Error(std::string("forward: ") + what + " has no tensor for layer " + std::to_string(l));
      const at::Tensor& t = (*list)[static_cast<size_t>(l)];
      if (t.dim() != 4 || (t.size(0) != 1 && t.size(0) != B) || t.size(2) != Hkv || t.size(3) != Dh)
        throw Error(std::string("forward: ") + what + "[" + std::to_string(l) + "] must be [1 or " + std::to_string(B) +
                    ", P, " + std::to_string(Hkv) + ", " + std::to_string(Dh) + "], got " + shape_str(t.sizes()));
      return t.to(dev, dt);
    };
    at::Tensor pk = at_layer(opts.prefix_k, "prefix_k"), pv = at_layer(opts.prefix_v, "prefix_v");
    if (pk.size(1) != pv.size(1) || pk.size(0) != pv.size(0))
      throw Error("forward: prefix_k and prefix_v of layer " + std::to_string(l) + " differ in shape: " +
                  shape_str(pk.sizes()) + " vs " + shape_str(pv.sizes()));
    return {pk, pv};  // batch 1 or B; broadcast where used
  };
  const int64_t prefix_len = has_prefix && start < stop ? prefix_of(start).first.size(1)
                             : cache != nullptr && start < stop ? cache->k[static_cast<size_t>(start)].size()
                                                                : 0;

  const HookPoints hook(opts.hooks);
  const bool fused = use_fused(opts.fused_kernels, x);
  const RopeTables rope = rope_tables(inv_freq_, prefix_len + opts.position_offset, T, dt);
  at::Tensor pattern_rows;  // [R], resolved on first use
  auto rows_for_pattern = [&]() -> const at::Tensor& {
    if (!pattern_rows.defined())
      pattern_rows = opts.pattern_rows.defined() ? checked_positions(opts.pattern_rows, T, dev, "pattern_rows")
                                                 : at::arange(T, at::TensorOptions().dtype(at::kLong).device(dev));
    return pattern_rows;
  };

  // The last layer at the logit rows only (see ForwardOptions::trim_last_layer).
  bool trim = opts.trim_last_layer && opts.logits && opts.logit_positions.defined() && stop == L && start < L;
  if (trim)
    for (HookKind kind : {HookKind::ResidPre, HookKind::Q, HookKind::K, HookKind::V, HookKind::Pattern, HookKind::Z,
                          HookKind::AttnOut, HookKind::ResidMid, HookKind::MlpOut, HookKind::ResidPost})
      trim = trim && !hook.active(L - 1, kind);
  const int64_t full_stop = trim ? L - 1 : stop;

  for (int64_t l = start; l < full_stop; ++l) {
    const LayerWeights& lw = w_.layers[static_cast<size_t>(l)];

    // ---- self-attention ----
    hook(l, HookKind::ResidPre, x);
    at::Tensor h = rms_norm_maybe_fused(x, lw.input_layernorm, eps, fused);   // [B, T, d]
    at::Tensor q = model::linear(h, lw.q_proj, lw.q_bias).view({B, T, Hq, Dh});       // [B, T, Hq, Dh]
    at::Tensor k = model::linear(h, lw.k_proj, lw.k_bias).view({B, T, Hkv, Dh});      // [B, T, Hkv, Dh]
    at::Tensor v = model::linear(h, lw.v_proj, lw.v_bias).view({B, T, Hkv, Dh});      // [B, T, Hkv, Dh]
    q = norm_rope_maybe_fused(q, lw.q_norm, rope, eps, fused);  // per-head norm before RoPE (Qwen3)
    k = norm_rope_maybe_fused(k, lw.k_norm, rope, eps, fused);
    hook(l, HookKind::Q, q);
    hook(l, HookKind::K, k);
    hook(l, HookKind::V, v);

    at::Tensor pk, pv;  // [1 or B, P, Hkv, Dh] or undefined
    if (has_prefix) {
      std::tie(pk, pv) = prefix_of(l);
      if (pk.size(1) != prefix_len)
        throw Error("forward: prefix of layer " + std::to_string(l) + " holds " + std::to_string(pk.size(1)) +
                    " tokens, layer " + std::to_string(start) + "'s holds " + std::to_string(prefix_len));
    }
    at::Tensor z;  // [B, T, Hq, Dh]
    if (cache != nullptr) {
      GrowingRows& ck = cache->k[static_cast<size_t>(l)];
      GrowingRows& cv = cache->v[static_cast<size_t>(l)];
      if (prefix_len > 0) pk = ck.rows().narrow(1, 0, prefix_len), pv = cv.rows().narrow(1, 0, prefix_len);
      z = attention_after(q, ck.append(k), cv.append(v), scale, opts.eager_attention);
    } else {
      z = causal_attention(q, k, v, pk, pv, scale, opts.eager_attention);
    }
    if (hook.active(l, HookKind::Pattern)) {
      const at::Tensor& rows = rows_for_pattern();                                        // [R]
      const at::Tensor k_all = pk.defined() ? at::cat({pk.expand({B, -1, -1, -1}), k}, 1) : k;  // [B, P + T, Hkv, Dh]
      const at::Tensor v_all = pv.defined() ? at::cat({pv.expand({B, -1, -1, -1}), v}, 1) : v;
      const int64_t Tk = k_all.size(1);
      at::Tensor vh = v_all.transpose(1, 2).contiguous();                                // [B, Hkv, Tk, Dh]
      at::Tensor pattern = attention_pattern(q, k_all.transpose(1, 2).contiguous(), rows, scale);  // [B, Hq, R, Tk]
      const at::Tensor original = pattern;
      const int64_t version = original._version();
      hook(l, HookKind::Pattern, pattern);
      const bool changed = original._version() != version ||
                           (!pattern.is_same(original) && !at::equal(pattern, original));
      if (changed || pattern.requires_grad()) {
        // The hook patched the pattern (or wants its gradient): those rows of z now come from it.
        const int64_t R = rows.size(0);
        at::Tensor grouped = pattern.reshape({B, Hkv, -1, Tk});                  // [B, Hkv, G*R, Tk]
        at::Tensor z_rows = ungroup_rows(at::matmul(grouped, vh), R);            // [B, R, Hq, Dh]
        z = z.index_copy(1, rows, z_rows);
      }
    }
    hook(l, HookKind::Z, z);

    at::Tensor attn = attn_out(l, z);  // [B, T, d]
    hook(l, HookKind::AttnOut, attn);
    x = x + attn;
    hook(l, HookKind::ResidMid, x);

    // ---- MLP ----
    at::Tensor mlp = mlp_out(l, x, opts.fused_kernels);  // [B, T, d]
    hook(l, HookKind::MlpOut, mlp);
    x = x + mlp;
    hook(l, HookKind::ResidPost, x);
  }

  ForwardOutput out;
  if (trim) {
    // Keys and values of every row, queries and everything after attention at the logit rows only.
    const int64_t l = L - 1;
    const LayerWeights& lw = w_.layers[static_cast<size_t>(l)];
    const at::Tensor rows = checked_positions(opts.logit_positions, T, dev, "logit_positions");  // [R]
    const int64_t R = rows.size(0);
    at::Tensor h = rms_norm_maybe_fused(x, lw.input_layernorm, eps, fused);                        // [B, T, d]
    at::Tensor k = model::linear(h, lw.k_proj, lw.k_bias).view({B, T, Hkv, Dh});
    at::Tensor v = model::linear(h, lw.v_proj, lw.v_bias).view({B, T, Hkv, Dh});
    k = norm_rope_maybe_fused(k, lw.k_norm, rope, eps, fused);
    const RopeTables rope_rows{rope.cos.index_select(1, rows).contiguous(), rope.sin.index_select(1, rows).contiguous()};
    at::Tensor q = model::linear(h.index_select(1, rows), lw.q_proj, lw.q_bias).view({B, R, Hq, Dh});   // [B, R, Hq, Dh]
    q = norm_rope_maybe_fused(q, lw.q_norm, rope_rows, eps, fused);
    at::Tensor k_all = k, v_all = v;
    if (cache != nullptr) {
      k_all = cache->k[static_cast<size_t>(l)].append(k);
      v_all = cache->v[static_cast<size_t>(l)].append(v);
    } else if (has_prefix) {
      auto [pk, pv] = prefix_of(l);
      k_all = at::cat({pk.expand({B, -1, -1, -1}), k}, 1);
      v_all = at::cat({pv.expand({B, -1, -1, -1}), v}, 1);
    }
    const int64_t Tk = k_all.size(1);
    const at::Tensor kh = k_all.transpose(1, 2).contiguous(), vh = v_all.transpose(1, 2).contiguous();  // [B, Hkv, Tk, Dh]
    const at::Tensor local = at::arange(R, rows.options());
    const at::Tensor probs = softmax_rows(q, kh, local, rows + prefix_len, Tk, scale);     // [B, Hkv, G, R, Tk]
    const at::Tensor z = ungroup_rows(at::matmul(probs.view({B, Hkv, -1, Tk}), vh), R);   // [B, R, Hq, Dh]
    at::Tensor xr = x.index_select(1, rows) + attn_out(l, z);                               // [B, R, d]
    xr = xr + mlp_out(l, xr, opts.fused_kernels);
    out.resid = xr;
    out.logits = unembed(xr);  // [B, R, V]
    return out;
  }
  out.resid = x;
  if (stop < L || !opts.logits) return out;  // stopped early (or asked for none): no logits

  at::Tensor h = x;  // [B, T, d]
  if (opts.logit_positions.defined())
    h = h.index_select(1, checked_positions(opts.logit_positions, T, dev, "logit_positions"));  // [B, P, d]
  out.logits = unembed(h);  // [B, T or P, V]
  return out;
}

at::Tensor Transformer::attn_out(int64_t layer, const at::Tensor& z) const {
  const LayerWeights& lw = w_.layers.at(static_cast<size_t>(layer));
  return model::linear(z.flatten(-2, -1), lw.o_proj, lw.o_bias);  // [..., Hq * Dh] -> [..., d]
}

at::Tensor Transformer::mlp_out(int64_t layer, const at::Tensor& resid_mid, bool fused_kernels) const {
  const LayerWeights& lw = w_.layers.at(static_cast<size_t>(layer));
  const bool fused = use_fused(fused_kernels, resid_mid);
  at::Tensor h = rms_norm_maybe_fused(resid_mid, lw.post_attention_layernorm, cfg_.rms_norm_eps, fused);  // [..., d]
  at::Tensor act;                                                                                        // [..., I]
#ifdef HH_HAVE_KERNELS
  if (fused) act = fused_silu_mul(model::linear(h, lw.gate_proj), model::linear(h, lw.up_proj));
#endif
  if (!act.defined()) act = at::silu(model::linear(h, lw.gate_proj)) * model::linear(h, lw.up_proj);
  return model::linear(act, lw.down_proj);  // [..., d]
}

namespace {

// Activation checkpointing of one dense layer: the forward runs it without recording a graph and keeps
// only its input; the backward runs it again with autograd and back-propagates through it, which
// accumulates the weights' gradients and returns the input's. The model outlives the backward (it is the
// model being trained), so the node refers to it by address.
at::Tensor run_layer(const Transformer& m, int64_t layer, const at::Tensor& x) {
  ForwardOptions o;
  o.start_layer = layer;
  o.stop_layer = layer + 1;
  o.residual_input = true;
  o.logits = false;
  return m.forward(x, o).resid;
}

struct CheckpointedDenseLayer : public torch::autograd::Function<CheckpointedDenseLayer> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x, int64_t model, int64_t layer) {
    ctx->saved_data["model"] = model;
    ctx->saved_data["layer"] = layer;
    ctx->save_for_backward({x});
    return run_layer(*reinterpret_cast<const Transformer*>(model), layer, x);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx, torch::autograd::variable_list grad) {
    const auto* model = reinterpret_cast<const Transformer*>(ctx->saved_data["model"].toInt());
    const at::Tensor x = ctx->get_saved_variables()[0].detach().requires_grad_(true);
    at::Tensor y;
    {
      at::AutoGradMode enable(true);
      y = run_layer(*model, ctx->saved_data["layer"].toInt(), x);
    }
    torch::autograd::backward({y}, {grad[0]});
    return {x.grad(), at::Tensor(), at::Tensor()};
  }
};

}  // namespace

at::Tensor Transformer::hidden(const at::Tensor& ids, bool checkpoint_layers) const {
  ForwardOptions o;
  o.logits = false;
  if (!checkpoint_layers || !at::GradMode::is_enabled()) return forward(ids, o).resid;
  o.stop_layer = 0;  // the embedding alone (its checks of the ids included)
  at::Tensor x = forward(ids, o).resid;
  // A checkpointed layer's weights get their gradients only when its node runs, which needs an input
  // that requires grad even when the embeddings are frozen.
  if (!x.requires_grad()) x = x.detach().requires_grad_(true);
  for (int64_t l = 0; l < cfg_.num_hidden_layers; ++l) x = CheckpointedDenseLayer::apply(x, reinterpret_cast<int64_t>(this), l);
  return x;
}

at::Tensor Transformer::unembed(const at::Tensor& resid) const {
  at::Tensor h = rms_norm(resid, w_.norm, cfg_.rms_norm_eps);
  return model::linear(h, w_.lm_head).to(accum_dtype(dtype()));
}

// ---- shared building blocks ----------------------------------------------------------------------

// HF Qwen3RMSNorm: statistics in float32, normalised value cast back, then `weight * x`.
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  const at::ScalarType in_dtype = x.scalar_type();
  at::Tensor h = x.to(accum_dtype(in_dtype));                // [..., n]
  at::Tensor variance = h.pow(2).mean(-1, /*keepdim=*/true);  // [..., 1]
  h = h * at::rsqrt(variance + eps);
  return weight.defined() ? weight * h.to(in_dtype) : h.to(in_dtype);
}

at::Tensor rotary(const at::Tensor& x, const at::Tensor& inv_freq, int64_t offset) {
  return apply_rope(x, rope_tables(inv_freq.to(x.device()), offset, x.size(1), x.scalar_type()));
}

at::Tensor norm_rotary(const at::Tensor& x, const at::Tensor& weight, double eps, const at::Tensor& inv_freq,
                       int64_t offset) {
  return norm_rope_maybe_fused(x, weight, rope_tables(inv_freq.to(x.device()), offset, x.size(1), x.scalar_type()), eps,
                               use_fused(true, x));
}

// rope_cos_sin's [T, Dh] tables for x [B, T, H, Dh], checked, in the broadcast shape apply_rope takes.
RopeTables given_tables(const char* fn, const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  const int64_t T = x.size(1), Dh = x.size(3);
  if (cos.dim() != 2 || cos.size(0) != T || cos.size(1) != Dh || !sin.sizes().equals(cos.sizes()))
    throw Error(std::string(fn) + ": the cos and sin tables must be [" + std::to_string(T) + ", " + std::to_string(Dh) +
                "] for x " + shape_str(x.sizes()) + ", got " + shape_str(cos.sizes()) + " and " + shape_str(sin.sizes()));
  return {cos.view({1, T, 1, Dh}), sin.view({1, T, 1, Dh})};
}
at::Tensor rotary(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  return apply_rope(x, given_tables("rotary", x, cos, sin));
}
at::Tensor norm_rotary(const at::Tensor& x, const at::Tensor& weight, double eps, const at::Tensor& cos,
                       const at::Tensor& sin) {
  return norm_rope_maybe_fused(x, weight, given_tables("norm_rotary", x, cos, sin), eps, use_fused(true, x));
}

at::Tensor norm_fused(const at::Tensor& x, const at::Tensor& weight, double eps) {
  return rms_norm_maybe_fused(x, weight, eps, use_fused(true, x));
}

std::pair<at::Tensor, at::Tensor> rope_cos_sin(const at::Tensor& inv_freq, int64_t offset, int64_t T, at::ScalarType dtype) {
  const RopeTables r = rope_tables(inv_freq, offset, T, dtype);
  const int64_t Dh = r.cos.size(3);
  return {r.cos.reshape({T, Dh}), r.sin.reshape({T, Dh})};
}

at::Tensor causal_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale,
                            const at::Tensor& prefix_k, const at::Tensor& prefix_v) {
  return causal_attention(q, k, v, prefix_k, prefix_v, scale, /*eager=*/false);
}

at::Tensor causal_attention_after(const at::Tensor& q, const at::Tensor& k_all, const at::Tensor& v_all, double scale,
                                  bool eager) {
  return attention_after(q, k_all, v_all, scale, eager);
}

at::Tensor linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& b) {
  const bool one_row = x.dim() >= 1 && x.numel() == x.size(-1) && w.dim() == 2 && x.size(-1) == w.size(1);
  if (one_row && x.is_cpu() && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kDouble)) {
    std::vector<int64_t> shape = x.sizes().vec();
    shape.back() = w.size(0);
    const at::Tensor xv = x.reshape({x.size(-1)});
    return (b.defined() ? at::addmv(b, w, xv) : at::mv(w, xv)).view(shape);
  }
  return b.defined() ? at::linear(x, w, b) : at::linear(x, w);
}

at::Tensor rope_inv_freq(double theta, int64_t head_dim, const at::Device& device) {
  at::Tensor exponent = at::arange(0, head_dim, 2, at::TensorOptions().dtype(at::kLong)).to(at::kFloat) / head_dim;
  return at::pow(theta, exponent).reciprocal().to(device);
}

std::vector<int64_t> generate_greedy(const Transformer& model, const std::vector<int64_t>& prompt, int64_t n) {
  if (prompt.empty()) throw Error("generate: the prompt has no tokens");
  if (n < 0) throw Error("generate: the number of new tokens must be >= 0");
  KvCache cache(model.config().num_hidden_layers);
  std::vector<int64_t> out;
  if (n == 0) return out;
  out.push_back(greedy_next(model, cache, prompt));
  while (static_cast<int64_t>(out.size()) < n) out.push_back(greedy_next(model, cache, {out.back()}));
  return out;
}

int64_t greedy_next(const Transformer& model, KvCache& cache, const std::vector<int64_t>& ids) {
  if (ids.empty()) throw Error("generate: no tokens to add to the cache");
  at::NoGradGuard no_grad;
  ForwardOptions f;
  f.cache = &cache;
  // A prompt's logits at its last position only (its last layer's queries and MLP at that row alone); a
  // single token's are that already, and its last layer then reads the cache in place like the others.
  if (ids.size() > 1)
    f.logit_positions = at::full({1}, static_cast<int64_t>(ids.size()) - 1, at::TensorOptions().dtype(at::kLong));
  const at::Tensor input = at::tensor(at::ArrayRef<int64_t>(ids), at::TensorOptions().dtype(at::kLong)).unsqueeze(0);
  const at::Tensor logits = model.forward(input, f).logits;  // [1, 1, V]
  return logits[0][0].argmax().item<int64_t>();
}

}  // namespace hh::model
