#include "core/attention/hybrid.h"

#include <torch/torch.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <optional>

#include "core/attention/fusion.h"
#include "core/attention/gdn.h"
#include "core/model/transformer.h"
#include "core/util/error.h"
#ifdef HH_HAVE_KERNELS
#include "kernels/fused_ops.h"
#include "kernels/gdn.h"
#include "kernels/gdn_decode.h"
#include "kernels/streams.h"
#endif

namespace hh::attention {
namespace {

// The process-wide choices of paths (for comparisons) and the decoding kernel's step count.
FlashGate g_flash_gate = FlashGate::kFactors;
bool g_decode_kernel = true;
bool g_graph_kernels = true;
std::atomic<int64_t> g_decode_kernel_steps{0};

// x's entries `idx` along dim, in that order, contiguous: index_select without an index tensor, whose
// copy to a GPU would wait for every queued kernel. Runs of consecutive indices are taken as one slice
// each, so a backward pass forms x's gradient from one zero-filled tensor a run (a whole run: none)
// rather than one an index.
at::Tensor pick(const at::Tensor& x, int64_t dim, const std::vector<int64_t>& idx) {
  if (idx.empty()) return x.narrow(dim, 0, 0);
  std::vector<at::Tensor> runs;
  for (size_t i = 0; i < idx.size();) {
    size_t j = i + 1;
    while (j < idx.size() && idx[j] == idx[j - 1] + 1) ++j;
    runs.push_back(x.narrow(dim, idx[i], static_cast<int64_t>(j - i)));
    i = j;
  }
  if (runs.size() == 1) return runs.front().size(dim) == x.size(dim) ? x : runs.front().contiguous();
  return at::cat(runs, dim);
}

using nlohmann::json;

// Rows [h * Dh, (h + 1) * Dh) of a [H * Dh, d] projection for the listed heads, stacked (every head in
// order: the projection itself, no copy).
at::Tensor head_rows(const at::Tensor& w, const std::vector<int64_t>& heads, int64_t Dh) {
  const int64_t d = w.size(1);
  return pick(w.reshape({w.size(0) / Dh, Dh, d}), 0, heads).reshape({-1, d});
}

// x [.., d] times the listed heads' rows of a [H * Dh, d] projection: [.., n * Dh]. Long inputs multiply
// a copy of those rows (a copy no larger than one read of x). For short ones (decoding a token) the copy
// would cost more than the product, so where the heads are at least a third of the projection's (its
// other rows then cost less than the copy's three passes over theirs), the projection is read in place
// and the heads' columns are taken from its product.
at::Tensor heads_product(const at::Tensor& x, const at::Tensor& w, const std::vector<int64_t>& heads, int64_t Dh) {
  const int64_t n = static_cast<int64_t>(heads.size()), H = w.size(0) / Dh, tokens = x.numel() / x.size(-1);
  if (tokens >= n * Dh || 3 * n < H) return model::linear(x, head_rows(w, heads, Dh));
  const at::Tensor y = model::linear(x, w);  // [.., H * Dh]
  std::vector<int64_t> split = y.sizes().vec(), flat = split;
  split.back() = H;
  split.push_back(Dh);
  flat.back() = n * Dh;
  return pick(y.view(split), y.dim() - 1, heads).reshape(flat);
}

#ifdef HH_HAVE_KERNELS
// short_conv without past inputs on its kernels, with a graph: forward kernels::causal_conv_silu on x
// [B, T, C] as it lies (no transposed copy, no padding), backward kernels::causal_conv_silu_backward.
class ShortConvFunction : public torch::autograd::Function<ShortConvFunction> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x, const at::Tensor& weight) {
    ctx->save_for_backward({x, weight});
    return kernels::causal_conv_silu(x, weight);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx, torch::autograd::variable_list dy) {
    const auto saved = ctx->get_saved_variables();
    auto [dx, dw] = kernels::causal_conv_silu_backward(dy[0].contiguous(), saved[0], saved[1]);
    return {dx, dw};
  }
};
#endif

// The short convolution's last kShortConvKernel - 1 inputs after the rows of `parts` (each [B, T, C_i],
// T >= 1), their channels joined in order, as short_conv keeps them in `past`: [B, sum C_i, K - 1],
// zeros before the first row.
at::Tensor conv_tail(std::initializer_list<at::Tensor> parts) {
  const int64_t T = parts.begin()->size(1), keep = kShortConvKernel - 1, n = std::min(T, keep);
  std::vector<at::Tensor> rows;
  for (const at::Tensor& p : parts) rows.push_back(p.narrow(1, T - n, n));
  at::Tensor x = (rows.size() == 1 ? rows[0] : at::cat(rows, 2)).transpose(1, 2);
  if (n < keep) x = at::cat({at::zeros({x.size(0), x.size(1), keep - n}, x.options()), x}, 2);
  return x.contiguous();
}

// Depthwise causal conv over time of x [B, T, C] with weight [C, 1, K], then SiLU. `past` [B, C, K-1]
// holds the K-1 inputs before x (zeros at the start of a sequence) and is replaced by the last K-1.
at::Tensor short_conv(const at::Tensor& x, const at::Tensor& weight, at::Tensor* past) {
  const int64_t T = x.size(1), C = x.size(2), K = weight.size(2);
  const std::vector<int64_t> one = {1};  // stride, dilation
  at::Tensor y;                          // [B, C, T]
  if (past != nullptr && past->defined()) {
    const at::Tensor full = at::cat({*past, x.transpose(1, 2)}, 2);  // [B, C, K-1+T]
    *past = full.narrow(2, T, K - 1).contiguous();
    const std::vector<int64_t> zero = {0};  // the past supplies the left context
    y = at::conv1d(full, weight, at::Tensor(), one, zero, one, C);
  } else {
    // Zeros before the first input as the convolution's padding (its last K - 1 outputs, past the end,
    // dropped). The gradient then reaches x in rows of T, which the projections' backward products
    // read as they are; after a concatenation with the zeros it would come at a row stride of T + K - 1
    // from an odd offset, which cuBLAS multiplies only on its slow unaligned kernels.
    if (past != nullptr) *past = conv_tail({x});
    const std::vector<int64_t> pad = {K - 1};
    y = at::conv1d(x.transpose(1, 2), weight, at::Tensor(), one, pad, one, C).narrow(2, 0, T);
  }
  return at::silu(y.transpose(1, 2));  // [B, T, C]
}

#ifdef HH_HAVE_KERNELS
// Whether the convolution kernels may take short_conv's work on x (without a graph inside chunk_factors
// or short_conv_apart, with one as ShortConvFunction): CUDA, not float64, the kernels' tap count,
// weights of x's dtype, and no past inputs (no decoding cache, or one that holds none yet: the kernels
// start from zeros as short_conv does without a past).
bool short_conv_on_kernels(const at::Tensor& x, const at::Tensor& weight, const HybridLayerCache* cache) {
  return (cache == nullptr || !cache->la_conv.defined()) && x.is_cuda() && x.scalar_type() != at::kDouble &&
         weight.size(2) == 4 && weight.scalar_type() == x.scalar_type();
}
#endif

// x * rsqrt(sum(x^2) + 1e-6) over the last axis, in float32.
at::Tensor l2_normalise(const at::Tensor& x) {
  const at::Tensor f = x.to(x.scalar_type() == at::kDouble ? at::kDouble : at::kFloat);
  return (f * at::rsqrt(f.pow(2).sum(-1, true) + 1e-6)).to(x.scalar_type());
}

#ifdef HH_HAVE_KERNELS
// kernels::rope_l2norm with a graph: its backward is kernels::rope_l2norm_backward.
class RopeL2Function : public torch::autograd::Function<RopeL2Function> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x, const at::Tensor& cos,
                            const at::Tensor& sin) {
    ctx->save_for_backward({x, cos, sin});
    return kernels::rope_l2norm(x, cos, sin, 1e-6);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx, torch::autograd::variable_list dy) {
    const auto saved = ctx->get_saved_variables();
    return {kernels::rope_l2norm_backward(dy[0].contiguous(), saved[0], saved[1], saved[2], 1e-6), at::Tensor(), at::Tensor()};
  }
};
#endif

// The LA heads' q and k: l2_normalise(rotary(x)) of each on the layer's RoPE tables `rope` ([T, Dh] in
// q's dtype), as one kernel each on CUDA (with a graph, RopeL2Function).
std::pair<at::Tensor, at::Tensor> rope_l2(const at::Tensor& q, const at::Tensor& k, const std::pair<at::Tensor, at::Tensor>& rope) {
  const auto& [cos, sin] = rope;
#ifdef HH_HAVE_KERNELS
  if (q.is_cuda() && q.scalar_type() != at::kDouble && k.scalar_type() == q.scalar_type() &&
      cos.scalar_type() == q.scalar_type() && q.size(-1) <= 256 && q.size(-1) % 2 == 0) {
    if (!at::GradMode::is_enabled())
      return {kernels::rope_l2norm(q.contiguous(), cos, sin, 1e-6), kernels::rope_l2norm(k.contiguous(), cos, sin, 1e-6)};
    if (g_graph_kernels)
      return {RopeL2Function::apply(q.contiguous(), cos, sin), RopeL2Function::apply(k.contiguous(), cos, sin)};
  }
#endif
  return {l2_normalise(model::rotary(q, cos, sin)), l2_normalise(model::rotary(k, cos, sin))};
}

}  // namespace

json HybridOptions::to_json() const {
  json heads = json::array();
  for (const auto& [l, h] : fa_heads) heads.push_back({l, h});
  return {{"fa_rope", fa_rope},
          {"fa_log_scale", fa_log_scale},
          {"fa_log_scale_alpha", fa_log_scale_alpha},
          {"gdn_short_conv", gdn_short_conv},
          {"gdn_allow_neg_eigval", gdn_allow_neg_eigval},
          {"gdn_chunk", gdn_chunk},
          {"fusion", fusion_concat ? "concat" : "scale-normalised"},
          {"fa_heads", heads}};
}

HybridOptions HybridOptions::from_json(const json& j, const model::ModelConfig& cfg, const std::string& where) {
  if (!j.is_object()) throw Error(where + ": \"hydrahead\" must be an object");
  HybridOptions o;
  auto flag = [&](const char* key, bool& out) {
    if (auto it = j.find(key); it != j.end()) {
      if (!it->is_boolean()) throw Error(where + ": hydrahead." + key + " must be true or false, got " + it->dump());
      out = it->get<bool>();
    }
  };
  flag("fa_rope", o.fa_rope);
  flag("fa_log_scale", o.fa_log_scale);
  flag("gdn_short_conv", o.gdn_short_conv);
  flag("gdn_allow_neg_eigval", o.gdn_allow_neg_eigval);
  if (auto it = j.find("fa_log_scale_alpha"); it != j.end()) {
    if (!it->is_number() || !(it->get<double>() > 1.0))
      throw Error(where + ": hydrahead.fa_log_scale_alpha must be a number > 1, got " + it->dump());
    o.fa_log_scale_alpha = it->get<double>();
  }
  if (auto it = j.find("gdn_chunk"); it != j.end()) {
    if (!it->is_number_integer() || it->get<int64_t>() < 1)
      throw Error(where + ": hydrahead.gdn_chunk must be a positive integer, got " + it->dump());
    o.gdn_chunk = it->get<int64_t>();
  }
  if (auto f = j.find("fusion"); f != j.end()) {
    if (!f->is_string() || (*f != "scale-normalised" && *f != "concat"))
      throw Error(where + ": hydrahead.fusion must be \"scale-normalised\" or \"concat\", got " + f->dump());
    o.fusion_concat = *f == "concat";
  }
  auto it = j.find("fa_heads");
  if (it == j.end() || !it->is_array()) throw Error(where + ": hydrahead.fa_heads must be a list of [layer, head] pairs");
  for (size_t i = 0; i < it->size(); ++i) {
    const json& p = (*it)[i];
    if (!p.is_array() || p.size() != 2 || !p[0].is_number_integer() || !p[1].is_number_integer())
      throw Error(where + ": hydrahead.fa_heads[" + std::to_string(i) + "] must be [layer, head], got " + p.dump());
    const int64_t l = p[0].get<int64_t>(), h = p[1].get<int64_t>();
    if (l < 0 || l >= cfg.num_hidden_layers || h < 0 || h >= cfg.num_attention_heads)
      throw Error(where + ": hydrahead.fa_heads[" + std::to_string(i) + "] = " + p.dump() + " is outside the model's " +
                  std::to_string(cfg.num_hidden_layers) + " layers x " + std::to_string(cfg.num_attention_heads) + " heads");
    o.fa_heads.push_back({l, h});
  }
  std::sort(o.fa_heads.begin(), o.fa_heads.end());
  if (auto d = std::adjacent_find(o.fa_heads.begin(), o.fa_heads.end()); d != o.fa_heads.end())
    throw Error(where + ": hydrahead.fa_heads lists [" + std::to_string(d->first) + ", " + std::to_string(d->second) + "] twice");
  return o;
}

std::vector<HeadSplit> split_heads(const HybridOptions& o, const model::ModelConfig& cfg) {
  std::vector<HeadSplit> s(static_cast<size_t>(cfg.num_hidden_layers));
  for (int64_t l = 0; l < cfg.num_hidden_layers; ++l)
    for (int64_t h = 0; h < cfg.num_attention_heads; ++h) {
      const bool fa = std::binary_search(o.fa_heads.begin(), o.fa_heads.end(), std::make_pair(l, h));
      (fa ? s[static_cast<size_t>(l)].fa : s[static_cast<size_t>(l)].la).push_back(h);
    }
  return s;
}

std::vector<HybridWeightEntry> hybrid_weight_table(const model::ModelConfig& cfg, const HybridOptions& o,
                                                   const HeadSplit& split, int64_t layer, HybridLayerWeights& w) {
  const int64_t d = cfg.hidden_size, Dh = cfg.head_dim;
  const int64_t nF = static_cast<int64_t>(split.fa.size()), nL = static_cast<int64_t>(split.la.size());
  const std::string p = "model.layers." + std::to_string(layer) + ".self_attn.";
  std::vector<HybridWeightEntry> t;
  const bool fused = !o.fusion_concat;
  if (nF > 0 && fused) t.push_back({p + "fa_gate.weight", &w.fa_gate, {nF * Dh, d}});
  if (nL > 0) {
    t.push_back({p + "la_k_proj.weight", &w.la_k_proj, {nL * Dh, d}});
    t.push_back({p + "la_v_proj.weight", &w.la_v_proj, {nL * Dh, d}});
    if (fused) t.push_back({p + "la_gate.weight", &w.la_gate, {nL * Dh, d}});
    t.push_back({p + "la_a_proj.weight", &w.la_a_proj, {nL, d}});
    t.push_back({p + "la_b_proj.weight", &w.la_b_proj, {nL, d}});
    t.push_back({p + "la_A_log", &w.la_A_log, {nL}});
    t.push_back({p + "la_dt_bias", &w.la_dt_bias, {nL}});
    if (o.gdn_short_conv) t.push_back({p + "la_conv.weight", &w.la_conv, {3 * nL * Dh, 1, kShortConvKernel}});
  }
  if (fused) t.push_back({p + "fusion_gamma", &w.fusion_gamma, {cfg.num_attention_heads, Dh}});
  return t;
}

void set_flash_gate(FlashGate gate) { g_flash_gate = gate; }
FlashGate flash_gate() { return g_flash_gate; }
void set_decode_kernel(bool on) { g_decode_kernel = on; }
void set_graph_kernels(bool on) { g_graph_kernels = on; }
int64_t decode_kernel_steps() { return g_decode_kernel_steps.load(); }

at::Tensor hybrid_attention(const model::ModelConfig& cfg, const HybridOptions& o, const HeadSplit& split,
                            const model::LayerWeights& tw, const HybridLayerWeights& w, const at::Tensor& xn,
                            const at::Tensor& inv_freq, bool chunked, HybridLayerCache* cache, bool side_by_side) {
  const int64_t B = xn.size(0), T = xn.size(1), Hq = cfg.num_attention_heads, Hkv = cfg.num_key_value_heads;
  const int64_t pos = cache != nullptr ? cache->pos : 0;
  const int64_t Dh = cfg.head_dim, G = Hq / Hkv;
  const double eps = cfg.rms_norm_eps, scale = 1.0 / std::sqrt(static_cast<double>(Dh));
  const int64_t nF = static_cast<int64_t>(split.fa.size()), nL = static_cast<int64_t>(split.la.size());
  at::Tensor out;  // [B, T, Hq, Dh]
  // The RoPE tables of positions pos .. pos + T - 1, built once for the FA heads' q and k and the LA
  // heads (before the two branches part: with side_by_side both streams read them).
  const std::pair<at::Tensor, at::Tensor> rope =
      (nF > 0 && o.fa_rope) || nL > 0 ? model::rope_cos_sin(inv_freq.to(xn.device()), pos, T, xn.scalar_type())
                                      : std::pair<at::Tensor, at::Tensor>();
  // The heads' contributions act(gate) * (gamma_h * RMSNorm(o_h)), or o itself under fusion_concat,
  // placed at their original head positions. o_grp [B, T, n, Dh] and gate_pre [B, T, n * Dh] (before
  // its activation) for the n heads of `heads` (ascending). Without a graph on CUDA one kernel applies
  // the activation and writes each head into place; otherwise one copy per run of consecutive heads.
  auto fuse = [&](const at::Tensor& o_grp, const at::Tensor& gate_pre, bool silu_gate, const std::vector<int64_t>& heads) {
    if (!out.defined()) out = at::empty({B, T, Hq, Dh}, o_grp.options());
    const at::Tensor gamma = o.fusion_concat ? at::Tensor() : pick(w.fusion_gamma, 0, heads);
#ifdef HH_HAVE_KERNELS
    if (!o.fusion_concat && o_grp.is_cuda() && o_grp.scalar_type() != at::kDouble && Dh <= 256 &&
        gamma.scalar_type() == o_grp.scalar_type() && gate_pre.scalar_type() == o_grp.scalar_type() &&
        !(at::GradMode::is_enabled() && (o_grp.requires_grad() || gate_pre.requires_grad() || gamma.requires_grad()))) {
      kernels::fusion_norm_forward_into(o_grp.contiguous(), gate_pre, silu_gate ? kernels::GateActivation::kSilu
                                                                                 : kernels::GateActivation::kSigmoid,
                                        gamma.contiguous(), eps, out, heads);
      return;
    }
#endif
    at::Tensor y = o_grp;
    if (!o.fusion_concat) {
      const at::Tensor gate = (silu_gate ? at::silu(gate_pre) : at::sigmoid(gate_pre)).view(o_grp.sizes());
      y = fusion_norm(o_grp, gate, gamma, eps);
    }
    for (size_t i = 0; i < heads.size();) {
      size_t j = i + 1;
      while (j < heads.size() && heads[j] == heads[j - 1] + 1) ++j;
      const int64_t len = static_cast<int64_t>(j - i);
      out.narrow(2, heads[i], len).copy_(y.narrow(2, static_cast<int64_t>(i), len));
      i = j;
    }
  };

  // FA: the teacher's q (q_norm) for these heads over the teacher's keys and values (k_norm), in two
  // parts: fa_prepare forms the attention's inputs, fa_attend runs it and fuses its output.
  struct FaInputs {
    at::Tensor q, kf, vf, gate_pre;  // [B, T, nF, Dh] x 3, [B, T, nF * Dh]
    at::Tensor k_all, v_all;         // with a cache: its keys and values, these last ([B, P + T, nF, Dh])
  };
  auto fa_prepare = [&] {
    FaInputs f;
    // Keys and values of the KV groups these heads read only (the groups in order; slot[i] is FA head
    // i's group among them).
    std::vector<int64_t> used, slot;
    for (int64_t h : split.fa) used.push_back(h / G);
    std::sort(used.begin(), used.end());
    used.erase(std::unique(used.begin(), used.end()), used.end());
    for (int64_t h : split.fa) slot.push_back(std::lower_bound(used.begin(), used.end(), h / G) - used.begin());
    const int64_t nU = static_cast<int64_t>(used.size());
    // For long inputs, one product for q, k, v and the gate of these heads (each a column slice of its
    // output): xn is read once instead of four times, for a copy of the weight rows no larger than one
    // read of xn. Short inputs (decoding) take each product apart, without copies of weight rows where
    // those would cost more (heads_product). The gate joins only when it trains as the teacher's rows
    // do: a trained gate must not pull gradients through frozen q, k and v.
    const bool gate_joins = !o.fusion_concat && (!at::GradMode::is_enabled() || w.fa_gate.requires_grad() == tw.q_proj.requires_grad());
    at::Tensor q, k, v, fa_gate_pre;
    if (B * T >= (nF + 2 * nU + (gate_joins ? nF : 0)) * Dh) {
      std::vector<at::Tensor> rows = {head_rows(tw.q_proj, split.fa, Dh), head_rows(tw.k_proj, used, Dh),
                                      head_rows(tw.v_proj, used, Dh)};
      if (gate_joins) rows.push_back(w.fa_gate);
      const at::Tensor proj = model::linear(xn, at::cat(rows, 0));  // [B, T, (nF + 2 nU) Dh], then the gate's nF Dh if it joins
      q = proj.narrow(2, 0, nF * Dh);
      k = proj.narrow(2, nF * Dh, nU * Dh);
      v = proj.narrow(2, (nF + nU) * Dh, nU * Dh);
      if (gate_joins) fa_gate_pre = proj.narrow(2, (nF + 2 * nU) * Dh, nF * Dh);
    } else {
      q = heads_product(xn, tw.q_proj, split.fa, Dh);
      k = heads_product(xn, tw.k_proj, used, Dh);
      v = heads_product(xn, tw.v_proj, used, Dh);
    }
    if (!o.fusion_concat && !fa_gate_pre.defined()) fa_gate_pre = model::linear(xn, w.fa_gate);
    q = q.view({B, T, nF, Dh});
    k = k.view({B, T, nU, Dh});
    v = v.view({B, T, nU, Dh});
    // The log scale of the queries, log(t + a) / log(a) at absolute positions t, in q's dtype.
    at::Tensor log_scale;
    if (o.fa_log_scale) {
      const double a = o.fa_log_scale_alpha;
      const auto acc = q.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;  // float32 for 16-bit models
      const at::Tensor t = at::arange(pos, pos + T, xn.options().dtype(acc));
      log_scale = ((t + a).log() / std::log(a)).to(q.scalar_type());
    }
    bool q_scaled = false;
#ifdef HH_HAVE_KERNELS
    // Without RoPE on CUDA and without a graph, the norm's kernel applies the scale as it writes q (the
    // same two roundings as norm, then times the scale), instead of a pass of its own over q.
    if (log_scale.defined() && !o.fa_rope && q.is_cuda() && q.scalar_type() != at::kDouble &&
        tw.q_norm.scalar_type() == q.scalar_type() &&
        !(at::GradMode::is_enabled() && (q.requires_grad() || tw.q_norm.requires_grad()))) {
      q = kernels::rms_norm_token_scaled(q, tw.q_norm, eps, log_scale);
      q_scaled = true;
    }
#endif
    if (!q_scaled)
      q = o.fa_rope ? model::norm_rotary(q, tw.q_norm, eps, rope.first, rope.second) : model::norm_fused(q, tw.q_norm, eps);
    k = o.fa_rope ? model::norm_rotary(k, tw.k_norm, eps, rope.first, rope.second) : model::norm_fused(k, tw.k_norm, eps);
    if (log_scale.defined() && !q_scaled) q = q * log_scale.view({1, T, 1, 1});
    // Each FA head reads its own KV group: gather the groups into per-head keys (MHA layout).
    f.kf = pick(k, 2, slot), f.vf = pick(v, 2, slot);  // [B, T, nF, Dh]
    if (cache != nullptr) {  // copied in (kf and vf may be views into the merged projection)
      f.k_all = cache->fa_k.append(f.kf);
      f.v_all = cache->fa_v.append(f.vf);
    }
    f.q = q;
    f.gate_pre = fa_gate_pre;
    return f;
  };
  auto fa_attend = [&](const FaInputs& f) {
    const at::Tensor o_fa = f.k_all.defined() ? model::causal_attention_after(f.q, f.k_all, f.v_all, scale)
                                              : model::causal_attention(f.q, f.kf, f.vf, scale);  // [B, T, nF, Dh]
    fuse(o_fa, f.gate_pre, /*silu_gate=*/false, split.fa);
  };
  // A decoding step's LA heads after their projections in one kernel (kernels::gdn_decode_step), where
  // it takes them: one token with a cache on CUDA, no graph, the chunked rule (not the oracle), the
  // kernel's head sizes and dtypes. Returns false where it does not, leaving the step to the op sequence
  // (which reads the zero state and past this may have put in an empty cache as it would read none).
  auto la_decode_step = [&]() -> bool {
#ifdef HH_HAVE_KERNELS
    const at::ScalarType dt = xn.scalar_type();
    if (cache == nullptr || T != 1 || !chunked || !g_decode_kernel || !xn.is_cuda() || dt == at::kDouble ||
        at::GradMode::is_enabled() || (Dh != 32 && Dh != 64 && Dh != 128) || nL > kernels::kMaxDecodeHeads ||
        w.la_k_proj.scalar_type() != dt || w.la_A_log.scalar_type() != dt || w.la_dt_bias.scalar_type() != dt ||
        (o.gdn_short_conv && (w.la_conv.size(2) != 4 || w.la_conv.scalar_type() != dt)) ||
        (!o.fusion_concat && w.fusion_gamma.scalar_type() != dt) ||
        (cache->la_state.defined() && cache->la_state.scalar_type() != at::kFloat))
      return false;
    const int64_t C = nL * Dh;
    kernels::DecodeStep s;
    // q from the whole projection where heads_product would take it so (the LA heads' columns read in
    // place), else from the LA heads' rows.
    if (3 * nL >= Hq) {
      s.q = model::linear(xn, tw.q_proj).view({B, Hq * Dh});
      s.q_heads = split.la;
    } else {
      s.q = model::linear(xn, head_rows(tw.q_proj, split.la, Dh)).view({B, C});
      for (int64_t i = 0; i < nL; ++i) s.q_heads.push_back(i);
    }
    s.k = model::linear(xn, w.la_k_proj).view({B, C});
    s.v = model::linear(xn, w.la_v_proj).view({B, C});
    if (o.gdn_short_conv) {
      if (!cache->la_conv.defined()) cache->la_conv = at::zeros({B, 3 * C, kShortConvKernel - 1}, xn.options());
      if (!cache->la_conv.is_contiguous()) cache->la_conv = cache->la_conv.contiguous();
      s.conv_weight = w.la_conv;
      s.conv_past = cache->la_conv;
    }
    std::tie(s.cos, s.sin) = rope;
    s.b = model::linear(xn, w.la_b_proj).view({B, nL});
    s.a = model::linear(xn, w.la_a_proj).view({B, nL});
    s.A_log = w.la_A_log;
    s.dt_bias = w.la_dt_bias;
    s.beta_times_two = o.gdn_allow_neg_eigval;
    if (!cache->la_state.defined()) cache->la_state = at::zeros({B, nL, Dh, Dh}, xn.options().dtype(at::kFloat));
    if (!cache->la_state.is_contiguous()) cache->la_state = cache->la_state.contiguous();
    s.state = cache->la_state;
    s.scale = scale;
    if (!o.fusion_concat) {
      s.gate = model::linear(xn, w.la_gate).view({B, C});
      s.gamma = w.fusion_gamma;
      s.norm_eps = eps;
    }
    s.heads = split.la;
    if (!out.defined()) out = at::empty({B, T, Hq, Dh}, xn.options());
    if (!kernels::try_gdn_decode_step(s, out)) return false;
    ++g_decode_kernel_steps;
    return true;
#else
    return false;
#endif
  };
  // on_queued, where given, is called as the rule's stages are queued (the fused output's path).
  auto la_branch = [&](const std::function<void(GdnStage)>& on_queued) {
    if (la_decode_step()) return;
    at::Tensor q = heads_product(xn, tw.q_proj, split.la, Dh);  // [B, T, nL*Dh]
    at::Tensor k = model::linear(xn, w.la_k_proj);
    at::Tensor v = model::linear(xn, w.la_v_proj);
    // Where the short convolution, RoPE and the L2 norm run. Without a cache or a graph on CUDA, on
    // kernels: inside the rule's first kernel where its output goes through the fusion norm inside its
    // last (gdn_fused_output: q, k, v and o are never written), else as kernels of their own
    // (short_conv_apart). Otherwise at::conv1d over the three blocks, then rope_l2.
    bool on_kernels = false, fuse_out = false;
#ifdef HH_HAVE_KERNELS
    fuse_out = chunked && !o.fusion_concat && q.is_cuda() && q.scalar_type() != at::kDouble && Dh <= 256 &&
                          !at::GradMode::is_enabled() && w.fusion_gamma.scalar_type() == q.scalar_type();
    kernels::ShortConvInputs conv;
    on_kernels = o.gdn_short_conv && !at::GradMode::is_enabled() && q.is_contiguous() && short_conv_on_kernels(q, w.la_conv, cache);
    if (on_kernels) {
      const int64_t C = nL * Dh;
      conv.wq = w.la_conv.narrow(0, 0, C);
      conv.wk = w.la_conv.narrow(0, C, C);
      conv.wv = w.la_conv.narrow(0, 2 * C, C);
      std::tie(conv.cos, conv.sin) = rope;
      conv.eps = 1e-6;
      if (cache != nullptr) cache->la_conv = conv_tail({q, k, v});  // q, k, v before the convolution
      if (!fuse_out) {
        const kernels::ConvolvedQkv c = kernels::short_conv_apart(q.view({B, T, nL, Dh}), k.view({B, T, nL, Dh}),
                                                                  v.view({B, T, nL, Dh}), conv);
        q = c.q, k = c.k, v = c.v;
      }
    }
#endif
    if (!on_kernels) {
      bool convolved = false;
#ifdef HH_HAVE_KERNELS
      if (o.gdn_short_conv && g_graph_kernels && at::GradMode::is_enabled() && short_conv_on_kernels(q, w.la_conv, cache)) {
        // Each of q, k, v on the kernels with its block of la_conv.weight.
        const int64_t C = nL * Dh;
        if (cache != nullptr) cache->la_conv = conv_tail({q, k, v});
        q = ShortConvFunction::apply(q.contiguous(), w.la_conv.narrow(0, 0, C));
        k = ShortConvFunction::apply(k.contiguous(), w.la_conv.narrow(0, C, C));
        v = ShortConvFunction::apply(v.contiguous(), w.la_conv.narrow(0, 2 * C, C));
        convolved = true;
      }
#endif
      if (o.gdn_short_conv && !convolved) {
        // One convolution over the q, k, v channel blocks (the layout of la_conv.weight).
        const int64_t C = nL * Dh;
        at::Tensor* past = cache != nullptr ? &cache->la_conv : nullptr;
        const at::Tensor qkv = short_conv(at::cat({q, k, v}, 2), w.la_conv, past);  // [B, T, 3*nL*Dh]
        q = qkv.narrow(2, 0, C);
        k = qkv.narrow(2, C, C);
        v = qkv.narrow(2, 2 * C, C);
      }
      std::tie(q, k) = rope_l2(q.reshape({B, T, nL, Dh}), k.reshape({B, T, nL, Dh}), rope);
    }
    q = q.reshape({B, T, nL, Dh});
    k = k.reshape({B, T, nL, Dh});
    v = v.reshape({B, T, nL, Dh});
    // b and a [B, T, 2 nL] from one product with the gate's rows where the layer has a gate (not
    // fusion_concat; gate_pre [B, T, nL Dh] its first columns), else from one of their own. On CUDA the product's rows are padded
    // with zero weights to a multiple of 8 outputs (16-byte output rows, which cuBLAS's faster kernels
    // need; the fused output reads the gate's rows at that stride).
    std::vector<at::Tensor> ab_rows = {w.la_b_proj, w.la_a_proj};
    if (!o.fusion_concat) ab_rows.insert(ab_rows.begin(), w.la_gate);
    // Short inputs (decoding) multiply each weight in place and join the products' columns instead: the
    // same layout without a copy of the weights, which would cost more than the product.
    if (const int64_t pad = xn.is_cuda() ? (8 - 2 * nL % 8) % 8 : 0; pad > 0)
      ab_rows.push_back(at::zeros({pad, w.la_b_proj.size(1)}, w.la_b_proj.options().requires_grad(false)));
    int64_t ab_width = 0;
    for (const at::Tensor& r : ab_rows) ab_width += r.size(0);
    at::Tensor prod;
    if (B * T >= ab_width) {
      prod = model::linear(xn, at::cat(ab_rows, 0));
    } else {
      std::vector<at::Tensor> cols;
      for (const at::Tensor& r : ab_rows) cols.push_back(model::linear(xn, r));
      prod = at::cat(cols, 2);
    }
    const int64_t gate_cols = o.fusion_concat ? 0 : nL * Dh;
    const at::Tensor gate_pre = o.fusion_concat ? at::Tensor() : prod.narrow(2, 0, gate_cols);
    const at::Tensor b_pre = prod.narrow(2, gate_cols, nL), a_pre = prod.narrow(2, gate_cols + nL, nL);  // [B, T, nL]
    at::Tensor beta, g;  // [B, T, nL]
#ifdef HH_HAVE_KERNELS
    // Where the output is fused (CUDA, no graph), one kernel forms both in float32 with the values of the
    // ops below, as the rule's kernels read them.
    if (fuse_out && kernels::gdn_gates_supported(b_pre, a_pre, w.la_A_log, w.la_dt_bias))
      std::tie(g, beta) = kernels::gdn_gates(b_pre, a_pre, w.la_A_log, w.la_dt_bias, o.gdn_allow_neg_eigval);
#endif
    if (!g.defined()) {
      beta = at::sigmoid(b_pre);
      if (o.gdn_allow_neg_eigval) beta = beta * 2;
      g = -w.la_A_log.exp() * at::softplus(a_pre + w.la_dt_bias);
    }
    const at::Tensor s0 = cache != nullptr ? cache->la_state : at::Tensor();
#ifdef HH_HAVE_KERNELS
    if (fuse_out) {  // gate_pre is q's dtype: both are products of xn
      kernels::OutputFusion fu;
      fu.gate = gate_pre;
      fu.gamma = pick(w.fusion_gamma, 0, split.la).contiguous();
      fu.act = kernels::GateActivation::kSilu;
      fu.eps = eps;
      fu.heads = split.la;
      if (!out.defined()) out = at::empty({B, T, Hq, Dh}, q.options());
      const at::Tensor state = gdn_fused_output(q, k, v, g, beta, s0, scale, o.gdn_chunk, fu, out,
                                                on_kernels ? &conv : nullptr, on_queued);
      if (cache != nullptr) cache->la_state = state;
    }
#endif
    if (!fuse_out) {
      // One token (a decoding step) takes the recurrence, which is the chunked rule's one step without
      // its padding to a whole chunk and the chunk's triangular solve.
      const GdnOutput r = chunked && T > 1 ? gdn(q, k, v, g, beta, s0, scale, o.gdn_chunk)
                                           : gdn_recurrent(q, k, v, g, beta, s0, scale);
      if (cache != nullptr) cache->la_state = r.state;
      fuse(r.o, gate_pre, /*silu_gate=*/true, split.la);
    }
  };
#ifdef HH_HAVE_KERNELS
  // With a cache, side by side only while it is empty (a prompt; pos 0): what the call keeps in it is
  // then new, and nothing the current stream holds is freed while the second stream reads it. Not with
  // the kInputs gate, whose run_side_by_side keeps nothing past the call.
  const bool fresh = cache == nullptr || (cache->pos == 0 && g_flash_gate != FlashGate::kInputs);
  if (side_by_side && nF > 0 && nL > 0 && xn.is_cuda() && fresh && !at::GradMode::is_enabled()) {
    // The LA heads on a second stream while the FA heads run on this one: both write their heads into
    // `out`, allocated here before the two start, and keep nothing else past the call but the cache's
    // keys, values, state and past inputs, which later calls read on this stream.
    out = at::empty({B, T, Hq, Dh}, xn.options());
    const FlashGate gate = flash_gate();
    if (gate == FlashGate::kInputs) {
      kernels::run_side_by_side(
          xn.device(),
          [&] {
            const kernels::ScanBeside beside;
            la_branch({});
          },
          [&] { fa_attend(fa_prepare()); });
      return out;
    }
    // The FA heads' inputs first, at the second stream's priority; their attention waits for a chosen
    // stage of the LA heads. Flash attention keeps every SM it gets until it ends: started earlier, it
    // would hold SMs the LA heads' products and chunk_factors need, and, gated on its inputs alone, those
    // inputs' small kernels starve behind the LA heads' and release it at no chosen point.
    const GdnStage after = gate == FlashGate::kScan ? GdnStage::kScan : GdnStage::kFactors;
    kernels::SideBySide sb(xn.device());
    FaInputs fa;
    sb.on_side([&] {
      fa = fa_prepare();
      sb.current_waits_for_side();
      // The LA heads' scan in short pieces that fill the SMs flash frees as it ends (not with the kScan
      // gate, where flash waits for the scan, which then runs alone).
      std::optional<kernels::ScanBeside> beside;
      if (after != GdnStage::kScan) beside.emplace();
      la_branch([&](GdnStage s) {
        if (s == after) sb.current_waits_for_side();
      });
    });
    for (const at::Tensor* t : {&fa.q, &fa.kf, &fa.vf, &fa.gate_pre, &fa.k_all, &fa.v_all}) sb.used_on_current(*t);
    fa_attend(fa);
    sb.join();
    if (cache != nullptr) {
      for (const at::Tensor* t : {&cache->la_state, &cache->la_conv}) sb.used_on_current(*t);
      cache->pos += T;
    }
    return out;
  }
#endif
  if (nF > 0) fa_attend(fa_prepare());
  if (nL > 0) la_branch({});
  if (cache != nullptr) cache->pos += T;
  return out;  // [B, T, Hq, Dh], heads in their original order
}

}  // namespace hh::attention
