#include "core/interp/patching.h"

#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <map>
#include <set>

#if defined(HH_HAVE_CUDA) && __has_include(<cuda_runtime_api.h>) && __has_include(<c10/cuda/CUDACachingAllocator.h>)
#include <c10/cuda/CUDACachingAllocator.h>
#include <cuda_runtime_api.h>
#define HH_CUDA_MEMINFO 1
#endif

#include "core/model/hooks.h"
#include "core/model/transformer.h"
#include "core/util/error.h"
#include "core/util/strings.h"

namespace hh::interp {

using model::HookKind;
using model::hook_name;
using model::Hooks;
using model::Transformer;

namespace {

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();
// Memory the automatic batch size may use on the CPU (on CUDA: half of what is free).
constexpr int64_t kCpuBatchBudget = int64_t{1} << 30;
constexpr int64_t kMaxAutoBatch = 512;

at::TensorOptions long_on(const at::Device& d) { return at::TensorOptions().dtype(at::kLong).device(d); }

void check_cancel(const SweepOptions& o) {
  if (o.cancel != nullptr && o.cancel->load(std::memory_order_relaxed)) throw Cancelled();
}

at::Tensor nan_map(int64_t L, int64_t Hq) {
  return at::full({L, Hq}, kNaN, at::TensorOptions().dtype(at::kDouble));
}

std::vector<HeadRef> heads_or_all(const SweepOptions& o, const Transformer& m) {
  return o.heads.empty() ? all_heads(m.config().num_hidden_layers, m.config().num_attention_heads) : o.heads;
}

// Heads grouped by layer, layers ascending, heads in the order given.
std::map<int64_t, std::vector<int64_t>> by_layer(const std::vector<HeadRef>& heads) {
  std::map<int64_t, std::vector<int64_t>> out;
  for (const HeadRef& h : heads) out[h.layer].push_back(h.head);
  return out;
}

// Bytes one patched variant needs at the peak of one layer's forward over Tq new rows with P prefix
// keys, no autograd: residual and norm copies, q/k/v/z, the GQA-expanded keys/values SDPA reads, the
// MLP's three [Tq, I] tensors, and the float32 logits at the answer positions.
int64_t bytes_per_variant(const Transformer& m, int64_t Tq, int64_t P, int64_t A) {
  const auto& c = m.config();
  const int64_t e = at::elementSize(m.dtype());
  const int64_t per_row = 6 * c.hidden_size + 3 * c.intermediate_size + 4 * c.num_attention_heads * c.head_dim;
  const int64_t kv = 4 * (P + Tq) * c.num_attention_heads * c.head_dim;
  return e * (Tq * per_row + kv) + 3 * A * c.vocab_size * 4;
}

int64_t free_bytes(const at::Device& d) {
#ifdef HH_CUDA_MEMINFO
  if (d.is_cuda()) {
    c10::cuda::CUDACachingAllocator::emptyCache();
    size_t free = 0, total = 0;
    if (cudaMemGetInfo(&free, &total) == cudaSuccess) return static_cast<int64_t>(free) / 2;
  }
#endif
  return kCpuBatchBudget;
}

int64_t batch_size(const SweepOptions& o, const Transformer& m, const PreparedExample& ex) {
  if (o.max_batch > 0) return o.max_batch;
  const int64_t per = bytes_per_variant(m, ex.T - ex.diff, ex.diff, ex.answer_pos.size(0));
  return std::clamp<int64_t>(free_bytes(m.device()) / std::max<int64_t>(per, 1), 1, kMaxAutoBatch);
}

// Forward options shared by the fast sweeps: prefix reuse and logits at the answer rows only.
struct SuffixRun {
  at::Tensor logit_rows;  // answer positions relative to the recomputed rows
  const std::vector<at::Tensor>* pk = nullptr;
  const std::vector<at::Tensor>* pv = nullptr;

  SuffixRun(const PreparedExample& ex, const RunCache& c) : logit_rows(ex.answer_pos - ex.diff) {
    if (ex.diff > 0) {
      pk = &c.prefix_k;
      pv = &c.prefix_v;
    }
  }
  model::ForwardOptions options(const Hooks* hooks, int64_t start_layer) const {
    model::ForwardOptions f;
    f.hooks = hooks;
    f.start_layer = start_layer;
    f.logit_positions = logit_rows;
    f.prefix_k = pk;
    f.prefix_v = pv;
    f.fused_kernels = true;  // where built and on CUDA (with their backwards under autograd)
    f.trim_last_layer = true;
    return f;
  }
};

// Input of a fast forward starting at `layer` for n variants: the base run's ids (layer 0) or its
// cached residual, rows diff.. only.
at::Tensor suffix_input(const PreparedExample& ex, const RunCache& c, bool clean_base, int64_t layer, int64_t n) {
  if (layer == 0) {
    const at::Tensor& ids = clean_base ? ex.clean : ex.corrupt;
    return ids.narrow(1, ex.diff, ex.T - ex.diff).expand({n, -1});
  }
  const auto& resid = clean_base ? c.resid_pre_clean : c.resid_pre_corrupt;
  return resid[static_cast<size_t>(layer)].expand({n, -1, -1});
}

// Full-length activations of one plain forward (no logits needed), for the reference paths.
struct FullRun {
  std::map<std::string, at::Tensor> acts;
};

FullRun full_run(const Transformer& m, const at::Tensor& ids, const std::vector<std::string>& cache_names) {
  Hooks hooks;
  FullRun r;
  for (const auto& n : cache_names) hooks.cache(n, &r.acts);
  model::ForwardOptions f;
  f.hooks = &hooks;
  f.logits = false;  // the cached activations only
  m.forward(ids, f);
  return r;
}

double full_metric(const Transformer& m, const at::Tensor& ids, const PreparedExample& ex, Metric metric,
                   const Hooks* hooks) {
  model::ForwardOptions f;
  f.hooks = hooks;
  at::Tensor logits = m.forward(ids, f).logits.index_select(1, ex.answer_pos);  // all T rows, then the answers
  return metric_from_logits(logits, ex, metric).item<double>();
}

int64_t json_int(const nlohmann::json& j) {
  if (!j.is_number_integer()) throw Error("not an integer");
  return j.get<int64_t>();
}

}  // namespace

// ---- names ------------------------------------------------------------------------------------

Metric parse_metric(const std::string& s) {
  if (s == "logprob") return Metric::LogProb;
  if (s == "logit-diff") return Metric::LogitDiff;
  throw Error("unknown metric '" + s + "' (expected logprob or logit-diff)");
}
Mode parse_mode(const std::string& s) {
  if (s == "noising") return Mode::Noising;
  if (s == "denoising") return Mode::Denoising;
  throw Error("unknown mode '" + s + "' (expected noising or denoising)");
}
const char* metric_name(Metric m) { return m == Metric::LogProb ? "logprob" : "logit-diff"; }
const char* mode_name(Mode m) { return m == Mode::Noising ? "noising" : "denoising"; }
const char* site_name(LayerSite s) {
  switch (s) {
    case LayerSite::AttnOut: return "attn_out";
    case LayerSite::MlpOut: return "mlp_out";
    case LayerSite::Resid: return "resid";
  }
  return "?";
}

std::vector<HeadRef> all_heads(int64_t num_layers, int64_t num_heads) {
  std::vector<HeadRef> out;
  for (int64_t l = 0; l < num_layers; ++l)
    for (int64_t h = 0; h < num_heads; ++h) out.push_back({l, h});
  return out;
}

std::vector<HeadRef> parse_heads(const std::string& s, int64_t num_layers, int64_t num_heads) {
  std::vector<HeadRef> out;
  std::set<std::pair<int64_t, int64_t>> seen;
  for (const std::string& item : util::split_list(s)) {
    const size_t colon = item.find(':');
    auto number = [&](const std::string& t) -> int64_t {
      if (t.empty() || t.size() > 9 || t.find_first_not_of("0123456789") != std::string::npos)
        throw Error("head '" + item + "': expected LAYER:HEAD with non-negative integers");
      return std::stoll(t);
    };
    if (colon == std::string::npos) throw Error("head '" + item + "': expected LAYER:HEAD, e.g. 12:3");
    const int64_t l = number(item.substr(0, colon)), h = number(item.substr(colon + 1));
    if (l >= num_layers)
      throw Error("head '" + item + "': layer " + std::to_string(l) + " outside [0, " + std::to_string(num_layers) + ")");
    if (h >= num_heads)
      throw Error("head '" + item + "': head " + std::to_string(h) + " outside [0, " + std::to_string(num_heads) + ")");
    if (!seen.insert({l, h}).second) throw Error("head '" + item + "' is listed twice");
    out.push_back({l, h});
  }
  return out;
}

// ---- example, metric, clean/corrupt runs ----------------------------------------------------------

PreparedExample prepare_example(const CalibExample& ex, const Transformer& model, Metric metric,
                                const std::string& where) {
  const int64_t V = model.config().vocab_size;
  auto check = [&](const std::vector<int64_t>& ids, const char* field) {
    for (size_t i = 0; i < ids.size(); ++i)
      if (ids[i] < 0 || ids[i] >= V)
        throw Error(where + ": " + field + "[" + std::to_string(i) + "] = " + std::to_string(ids[i]) +
                    " is outside the model's vocabulary [0, " + std::to_string(V) + ")");
  };
  check(ex.clean_ids, "clean_ids");
  check(ex.corrupt_ids, "corrupt_ids");
  check(ex.answer_ids, "answer_ids");
  check(ex.wrong_ids, "wrong_ids");
  if (ex.clean_ids.empty() || ex.answer_ids.empty()) throw Error(where + ": empty prompt or answer");
  if (ex.clean_ids.size() != ex.corrupt_ids.size())
    throw Error(where + ": clean has " + std::to_string(ex.clean_ids.size()) + " tokens, corrupt " +
                std::to_string(ex.corrupt_ids.size()) + "; they must be equal");
  if (metric == Metric::LogitDiff && ex.wrong_ids.empty())
    throw Error(where + ": metric logit-diff needs wrong_ids, and this example has none (use --metric logprob)");

  PreparedExample p;
  p.prompt_len = static_cast<int64_t>(ex.clean_ids.size());
  const int64_t A = static_cast<int64_t>(ex.answer_ids.size());
  p.T = p.prompt_len + A - 1;
  std::vector<int64_t> clean = ex.clean_ids, corrupt = ex.corrupt_ids;
  clean.insert(clean.end(), ex.answer_ids.begin(), ex.answer_ids.end() - 1);
  corrupt.insert(corrupt.end(), ex.answer_ids.begin(), ex.answer_ids.end() - 1);
  const at::Device dev = model.device();
  auto to_tensor = [&](const std::vector<int64_t>& v) {
    return at::tensor(at::ArrayRef<int64_t>(v), at::TensorOptions().dtype(at::kLong)).to(dev);
  };
  p.clean = to_tensor(clean).unsqueeze(0);
  p.corrupt = to_tensor(corrupt).unsqueeze(0);
  p.answer_ids = to_tensor(ex.answer_ids);
  p.answer_pos = at::arange(p.prompt_len - 1, p.prompt_len - 1 + A, long_on(dev));
  p.wrong_id = ex.wrong_ids.empty() ? -1 : ex.wrong_ids[0];
  const int64_t d = first_difference(ex.clean_ids, ex.corrupt_ids);
  p.diff = d < 0 ? p.T : d;
  return p;
}

at::Tensor metric_from_logits(const at::Tensor& logits, const PreparedExample& ex, Metric metric) {
  // logits [B, A, V]
  const int64_t B = logits.size(0), A = logits.size(1);
  if (metric == Metric::LogProb) {
    at::Tensor lp = at::log_softmax(logits, -1);                                       // [B, A, V]
    at::Tensor idx = ex.answer_ids.to(logits.device()).view({1, A, 1}).expand({B, A, 1});
    return lp.gather(2, idx).squeeze(2).to(at::kDouble).sum(1).cpu();                  // [B]
  }
  at::Tensor first = logits.select(1, 0).to(at::kDouble);                              // [B, V]
  const int64_t right = ex.answer_ids[0].item<int64_t>();
  return (first.select(1, right) - first.select(1, ex.wrong_id)).cpu();               // [B]
}

RunCache run_clean_corrupt(const Transformer& model, const PreparedExample& ex, Metric metric) {
  at::NoGradGuard no_grad;
  const int64_t L = model.config().num_hidden_layers;
  const int64_t D = ex.diff, Tq = ex.T - ex.diff;
  RunCache c;
  c.resid_pre_clean.resize(L);
  c.resid_pre_corrupt.resize(L);
  c.z_clean.resize(L);
  c.z_corrupt.resize(L);
  c.prefix_k.resize(L);
  c.prefix_v.resize(L);

  // Clean run over all T tokens: rows diff.. of the residuals and z, rows ..diff of k and v.
  Hooks clean_hooks;
  for (int64_t l = 0; l < L; ++l) {
    const size_t i = static_cast<size_t>(l);
    clean_hooks.add(hook_name(l, HookKind::ResidPre), [&, i](at::Tensor& t) { c.resid_pre_clean[i] = t.narrow(1, D, Tq).clone(); });
    clean_hooks.add(hook_name(l, HookKind::Z), [&, i](at::Tensor& t) { c.z_clean[i] = t.narrow(1, D, Tq).clone(); });
    if (D > 0) {
      clean_hooks.add(hook_name(l, HookKind::K), [&, i](at::Tensor& t) { c.prefix_k[i] = t.narrow(1, 0, D).clone(); });
      clean_hooks.add(hook_name(l, HookKind::V), [&, i](at::Tensor& t) { c.prefix_v[i] = t.narrow(1, 0, D).clone(); });
    }
  }
  model::ForwardOptions f;
  f.hooks = &clean_hooks;
  f.logit_positions = ex.answer_pos;
  f.fused_kernels = true;
  c.metric_clean = metric_from_logits(model.forward(ex.clean, f).logits, ex, metric).item<double>();

  if (Tq == 0) {  // clean == corrupt: nothing differs
    c.metric_corrupt = c.metric_clean;
    c.resid_pre_corrupt = c.resid_pre_clean;
    c.z_corrupt = c.z_clean;
    return c;
  }
  // Corrupt run: only rows diff.. differ, so it starts there on the clean prefix's keys and values.
  Hooks corrupt_hooks;
  for (int64_t l = 0; l < L; ++l) {
    const size_t i = static_cast<size_t>(l);
    corrupt_hooks.add(hook_name(l, HookKind::ResidPre), [&, i](at::Tensor& t) { c.resid_pre_corrupt[i] = t.clone(); });
    corrupt_hooks.add(hook_name(l, HookKind::Z), [&, i](at::Tensor& t) { c.z_corrupt[i] = t.clone(); });
  }
  const SuffixRun suffix(ex, c);
  const model::ForwardOptions g = suffix.options(&corrupt_hooks, 0);
  c.metric_corrupt =
      metric_from_logits(model.forward(ex.corrupt.narrow(1, D, Tq), g).logits, ex, metric).item<double>();
  return c;
}

at::Tensor normalise_effect(const at::Tensor& patched, double m_clean, double m_corrupt, Mode mode) {
  const double gap = m_clean - m_corrupt;
  return mode == Mode::Noising ? (m_clean - patched) / gap : (patched - m_corrupt) / gap;
}

// ---- activation patching: heads ------------------------------------------------------------------

at::Tensor head_sweep(const Transformer& model, const PreparedExample& ex, const RunCache& cache,
                      const SweepOptions& opts) {
  at::NoGradGuard no_grad;
  const int64_t L = model.config().num_hidden_layers, Hq = model.config().num_attention_heads;
  const std::vector<HeadRef> heads = heads_or_all(opts, model);
  at::Tensor out = nan_map(L, Hq);
  auto acc = out.accessor<double, 2>();
  const int64_t total = static_cast<int64_t>(heads.size());
  int64_t done = 0;
  if (ex.diff >= ex.T) {  // nothing differs: every patch is a no-op
    for (const HeadRef& h : heads) acc[h.layer][h.head] = cache.metric_clean;
    if (opts.progress) opts.progress(total, total);
    return out;
  }
  const bool noising = opts.mode == Mode::Noising;
  const auto& source_z = noising ? cache.z_corrupt : cache.z_clean;
  const auto& base_z = noising ? cache.z_clean : cache.z_corrupt;
  const auto& base_resid = noising ? cache.resid_pre_clean : cache.resid_pre_corrupt;
  const SuffixRun suffix(ex, cache);
  const int64_t batch = batch_size(opts, model, ex);
  const at::Device dev = model.device();

  for (const auto& [layer, hs] : by_layer(heads)) {
    const size_t li = static_cast<size_t>(layer);
    for (size_t b0 = 0; b0 < hs.size(); b0 += static_cast<size_t>(batch)) {
      check_cancel(opts);
      const size_t b1 = std::min(hs.size(), b0 + static_cast<size_t>(batch));
      const int64_t n = static_cast<int64_t>(b1 - b0);
      std::vector<int64_t> chunk(hs.begin() + static_cast<std::ptrdiff_t>(b0), hs.begin() + static_cast<std::ptrdiff_t>(b1));
      // Variant i patches head chunk[i]: a [n, 1, Hq, 1] mask selects the source's values there. Layer
      // `layer`'s attention is the base run's (cached), so each variant starts at its o_proj.
      at::Tensor which = at::tensor(at::ArrayRef<int64_t>(chunk), at::TensorOptions().dtype(at::kLong)).to(dev);
      at::Tensor mask = at::one_hot(which, Hq).to(at::kBool).view({n, 1, Hq, 1});
      const at::Tensor z = at::where(mask, source_z[li], base_z[li]);                 // [n, Tq, Hq, Dh]
      const at::Tensor mid = base_resid[li] + model.attn_out(layer, z);               // [n, Tq, d]
      const at::Tensor x = mid + model.mlp_out(layer, mid, /*fused_kernels=*/true);    // resid_post
      const at::Tensor logits = layer + 1 < L ? model.forward(x, suffix.options(nullptr, layer + 1)).logits
                                               : model.unembed(x.index_select(1, suffix.logit_rows));
      const at::Tensor m = metric_from_logits(logits, ex, opts.metric);  // [n]
      auto ma = m.accessor<double, 1>();
      for (int64_t i = 0; i < n; ++i) acc[layer][chunk[static_cast<size_t>(i)]] = ma[i];
      done += n;
      if (opts.progress) opts.progress(done, total);
    }
  }
  return out;
}

at::Tensor head_sweep_reference(const Transformer& model, const PreparedExample& ex, const SweepOptions& opts) {
  at::NoGradGuard no_grad;
  const int64_t L = model.config().num_hidden_layers, Hq = model.config().num_attention_heads;
  const bool noising = opts.mode == Mode::Noising;
  const at::Tensor& base = noising ? ex.clean : ex.corrupt;
  const at::Tensor& source = noising ? ex.corrupt : ex.clean;
  std::vector<std::string> names;
  for (int64_t l = 0; l < L; ++l) names.push_back(hook_name(l, HookKind::Z));
  const FullRun src = full_run(model, source, names);

  const std::vector<HeadRef> heads = heads_or_all(opts, model);
  at::Tensor out = nan_map(L, Hq);
  auto acc = out.accessor<double, 2>();
  int64_t done = 0;
  for (const HeadRef& h : heads) {
    check_cancel(opts);
    const at::Tensor& z_src = src.acts.at(hook_name(h.layer, HookKind::Z));  // [1, T, Hq, Dh]
    Hooks hooks;
    hooks.add(hook_name(h.layer, HookKind::Z), [&](at::Tensor& z) {
      z = z.clone();
      z.select(2, h.head).copy_(z_src.select(2, h.head));
    });
    acc[h.layer][h.head] = full_metric(model, base, ex, opts.metric, &hooks);
    if (opts.progress) opts.progress(++done, static_cast<int64_t>(heads.size()));
  }
  return out;
}

// ---- activation patching: layers -----------------------------------------------------------------

namespace {
HookKind site_hook(LayerSite s) {
  switch (s) {
    case LayerSite::AttnOut: return HookKind::AttnOut;
    case LayerSite::MlpOut: return HookKind::MlpOut;
    case LayerSite::Resid: return HookKind::ResidPost;
  }
  return HookKind::ResidPost;
}
}  // namespace

at::Tensor layer_sweep(const Transformer& model, const PreparedExample& ex, const RunCache& cache,
                       const SweepOptions& opts) {
  at::NoGradGuard no_grad;
  const int64_t L = model.config().num_hidden_layers;
  const int64_t S = static_cast<int64_t>(std::size(kLayerSites));
  at::Tensor out = at::full({S, L}, kNaN, at::TensorOptions().dtype(at::kDouble));
  auto acc = out.accessor<double, 2>();
  if (ex.diff >= ex.T) {
    out.fill_(cache.metric_clean);
    return out;
  }
  const bool noising = opts.mode == Mode::Noising;
  const SuffixRun suffix(ex, cache);

  // The source run's outputs at every site, rows diff.. (one forward on the shared prefix).
  std::map<std::string, at::Tensor> src;
  {
    Hooks hooks;
    for (int64_t l = 0; l < L; ++l)
      for (LayerSite s : kLayerSites) hooks.cache(hook_name(l, site_hook(s)), &src);
    const at::Tensor& ids = noising ? ex.corrupt : ex.clean;
    model::ForwardOptions f = suffix.options(&hooks, 0);
    f.logits = false;  // the sites' outputs only
    model.forward(ids.narrow(1, ex.diff, ex.T - ex.diff), f);
  }
  // One forward per layer holds its S variants: row s patches site s.
  const at::Device dev = model.device();
  for (int64_t l = 0; l < L; ++l) {
    check_cancel(opts);
    Hooks hooks;
    for (int64_t s = 0; s < S; ++s) {
      const std::string name = hook_name(l, site_hook(kLayerSites[s]));
      at::Tensor row_mask = (at::arange(S, long_on(dev)) == s).view({S, 1, 1});
      hooks.add(name, [row_mask, &src, name](at::Tensor& t) { t = at::where(row_mask, src.at(name), t); });
    }
    const at::Tensor logits = model.forward(suffix_input(ex, cache, noising, l, S), suffix.options(&hooks, l)).logits;
    const at::Tensor m = metric_from_logits(logits, ex, opts.metric);
    for (int64_t s = 0; s < S; ++s) acc[s][l] = m[s].item<double>();
    if (opts.progress) opts.progress(l + 1, L);
  }
  return out;
}

at::Tensor layer_sweep_reference(const Transformer& model, const PreparedExample& ex, const SweepOptions& opts) {
  at::NoGradGuard no_grad;
  const int64_t L = model.config().num_hidden_layers;
  const int64_t S = static_cast<int64_t>(std::size(kLayerSites));
  const bool noising = opts.mode == Mode::Noising;
  std::vector<std::string> names;
  for (int64_t l = 0; l < L; ++l)
    for (LayerSite s : kLayerSites) names.push_back(hook_name(l, site_hook(s)));
  const FullRun src = full_run(model, noising ? ex.corrupt : ex.clean, names);
  at::Tensor out = at::full({S, L}, kNaN, at::TensorOptions().dtype(at::kDouble));
  auto acc = out.accessor<double, 2>();
  for (int64_t s = 0; s < S; ++s)
    for (int64_t l = 0; l < L; ++l) {
      check_cancel(opts);
      const std::string name = hook_name(l, site_hook(kLayerSites[s]));
      Hooks hooks;
      hooks.add(name, [&](at::Tensor& t) { t = src.acts.at(name); });
      acc[s][l] = full_metric(model, noising ? ex.clean : ex.corrupt, ex, opts.metric, &hooks);
    }
  return out;
}

// ---- path patching -------------------------------------------------------------------------------

namespace {

// Path patching with attention frozen: the clean residual where each sender's z comes from the
// corrupt run, every later head keeps its clean output, and the MLPs recompute. Nothing mixes rows
// then, so only `rows` (indices into the diff.. suffix) are computed. Returns the residual after
// the last layer, [n, R, d] for the n senders; visit(j, x) sees the residual entering layer j > the
// first sender's layer (rows of senders that start later are placeholders until they start).
at::Tensor frozen_attention_walk(const Transformer& model, const RunCache& cache, const std::vector<HeadRef>& senders,
                                 const at::Tensor& rows, const std::function<void(int64_t, const at::Tensor&)>& visit) {
  const int64_t L = model.config().num_hidden_layers, Hq = model.config().num_attention_heads;
  const int64_t n = static_cast<int64_t>(senders.size());
  const at::Device dev = model.device();
  std::vector<int64_t> heads(senders.size()), layers(senders.size());
  for (size_t i = 0; i < senders.size(); ++i) {
    heads[i] = senders[i].head;
    layers[i] = senders[i].layer;
  }
  const auto cpu_long = at::TensorOptions().dtype(at::kLong);
  const at::Tensor layer_of = at::tensor(at::ArrayRef<int64_t>(layers), cpu_long).to(dev);                 // [n]
  const at::Tensor head_mask =
      at::one_hot(at::tensor(at::ArrayRef<int64_t>(heads), cpu_long).to(dev), Hq).to(at::kBool).view({n, 1, Hq, 1});
  const int64_t first = *std::min_element(layers.begin(), layers.end());

  at::Tensor x;  // [n, R, d]
  for (int64_t j = first; j < L; ++j) {
    const size_t sj = static_cast<size_t>(j);
    const at::Tensor resid = cache.resid_pre_clean[sj].index_select(1, rows);  // [1, R, d]
    const at::Tensor z_clean = cache.z_clean[sj].index_select(1, rows);        // [1, R, Hq, Dh]
    if (!x.defined()) x = resid.expand({n, -1, -1});
    at::Tensor mid = x + model.attn_out(j, z_clean);  // frozen clean attention
    if (std::find(layers.begin(), layers.end(), j) != layers.end()) {
      const at::Tensor z_corrupt = cache.z_corrupt[sj].index_select(1, rows);             // [1, R, Hq, Dh]
      const at::Tensor z_patched = at::where(head_mask, z_corrupt, z_clean);              // [n, R, Hq, Dh]
      const at::Tensor start_mid = resid + model.attn_out(j, z_patched);                  // [n, R, d]
      mid = at::where((layer_of == j).view({n, 1, 1}), start_mid, mid);
    }
    x = mid + model.mlp_out(j, mid, /*fused_kernels=*/true);
    if (j + 1 < L && visit) visit(j + 1, x);
  }
  return x;
}

}  // namespace

at::Tensor path_sweep(const Transformer& model, const PreparedExample& ex, const RunCache& cache,
                      const std::vector<HeadRef>& receivers, const SweepOptions& opts) {
  at::NoGradGuard no_grad;
  const int64_t L = model.config().num_hidden_layers, Hq = model.config().num_attention_heads;
  const std::vector<HeadRef> senders = heads_or_all(opts, model);
  at::Tensor out = nan_map(L, Hq);
  auto acc = out.accessor<double, 2>();
  const int64_t total = static_cast<int64_t>(senders.size());
  if (ex.diff >= ex.T) {
    for (const HeadRef& h : senders) acc[h.layer][h.head] = cache.metric_clean;
    return out;
  }
  const at::Device dev = model.device();
  const int64_t Tq = ex.T - ex.diff;
  const int64_t batch = batch_size(opts, model, ex);

  if (receivers.empty()) {
    // Receiver = logits: only the answer rows matter, since nothing mixes rows.
    const at::Tensor rows = ex.answer_pos - ex.diff;
    int64_t done = 0;
    for (size_t b0 = 0; b0 < senders.size(); b0 += static_cast<size_t>(batch)) {
      check_cancel(opts);
      const size_t b1 = std::min(senders.size(), b0 + static_cast<size_t>(batch));
      std::vector<HeadRef> chunk(senders.begin() + static_cast<std::ptrdiff_t>(b0),
                                 senders.begin() + static_cast<std::ptrdiff_t>(b1));
      const at::Tensor x = frozen_attention_walk(model, cache, chunk, rows, {});
      const at::Tensor m = metric_from_logits(model.unembed(x), ex, opts.metric);
      for (size_t i = 0; i < chunk.size(); ++i) acc[chunk[i].layer][chunk[i].head] = m[static_cast<int64_t>(i)].item<double>();
      done += static_cast<int64_t>(chunk.size());
      if (opts.progress) opts.progress(done, total);
    }
    return out;
  }

  // Receivers: pass 1 takes the sender-modified residual (all rows) to each receiver layer and
  // recomputes that layer's heads from it; pass 2 patches only the receivers into a clean run.
  std::set<int64_t> receiver_layers;
  for (const HeadRef& r : receivers) receiver_layers.insert(r.layer);
  const at::Tensor all_rows = at::arange(Tq, long_on(dev));
  const SuffixRun suffix(ex, cache);
  int64_t done = 0;
  for (const HeadRef& s : senders) {
    check_cancel(opts);
    const int64_t last = *receiver_layers.rbegin();
    if (s.layer >= last) {  // no receiver after the sender: nothing changes
      acc[s.layer][s.head] = cache.metric_clean;
      if (opts.progress) opts.progress(++done, total);
      continue;
    }
    std::map<int64_t, at::Tensor> z_new;  // receiver layer -> z of all heads recomputed there [1, Tq, Hq, Dh]
    frozen_attention_walk(model, cache, {s}, all_rows, [&](int64_t j, const at::Tensor& x) {
      if (!receiver_layers.count(j)) return;
      std::map<std::string, at::Tensor> got;
      Hooks hooks;
      hooks.cache(hook_name(j, HookKind::Z), &got);
      model::ForwardOptions f = suffix.options(&hooks, j);
      f.stop_layer = j + 1;
      f.logits = false;  // (j may be the last layer)
      f.logit_positions = at::Tensor();
      model.forward(x, f);
      z_new[j] = got.at(hook_name(j, HookKind::Z));
    });
    Hooks hooks;
    int64_t first_receiver = L;
    for (const HeadRef& r : receivers) {
      if (r.layer <= s.layer) continue;  // not downstream of this sender: stays clean
      first_receiver = std::min(first_receiver, r.layer);
      const at::Tensor value = z_new.at(r.layer).select(2, r.head);  // [1, Tq, Dh]
      const int64_t h = r.head;
      hooks.add(hook_name(r.layer, HookKind::Z), [value, h](at::Tensor& z) {
        z = z.clone();
        z.select(2, h).copy_(value);
      });
    }
    const at::Tensor logits =
        model.forward(suffix_input(ex, cache, /*clean_base=*/true, first_receiver, 1), suffix.options(&hooks, first_receiver)).logits;
    acc[s.layer][s.head] = metric_from_logits(logits, ex, opts.metric).item<double>();
    if (opts.progress) opts.progress(++done, total);
  }
  return out;
}

at::Tensor path_sweep_reference(const Transformer& model, const PreparedExample& ex,
                                const std::vector<HeadRef>& receivers, const SweepOptions& opts) {
  at::NoGradGuard no_grad;
  const int64_t L = model.config().num_hidden_layers, Hq = model.config().num_attention_heads;
  std::vector<std::string> names;
  for (int64_t l = 0; l < L; ++l) names.push_back(hook_name(l, HookKind::Z));
  const FullRun clean = full_run(model, ex.clean, names);
  const FullRun corrupt = full_run(model, ex.corrupt, names);
  const std::vector<HeadRef> senders = heads_or_all(opts, model);
  at::Tensor out = nan_map(L, Hq);
  auto acc = out.accessor<double, 2>();
  for (const HeadRef& s : senders) {
    check_cancel(opts);
    // Pass 1: every z frozen at its clean value except the sender's, taken from the corrupt run.
    // Before freezing, record what each receiver layer computed from its (modified) inputs.
    std::map<std::string, at::Tensor> computed;
    Hooks freeze;
    for (int64_t l = 0; l < L; ++l) {
      const std::string name = hook_name(l, HookKind::Z);
      freeze.add(name, [&computed, name](at::Tensor& z) { computed[name] = z.clone(); });
      freeze.add(name, [&, l, name](at::Tensor& z) {
        z = clean.acts.at(name).clone();
        if (l == s.layer) z.select(2, s.head).copy_(corrupt.acts.at(name).select(2, s.head));
      });
    }
    const double frozen_metric = full_metric(model, ex.clean, ex, opts.metric, &freeze);
    if (receivers.empty()) {
      acc[s.layer][s.head] = frozen_metric;
      continue;
    }
    // Pass 2: a plain clean run with only the downstream receivers' outputs replaced.
    Hooks patch;
    for (const HeadRef& r : receivers) {
      if (r.layer <= s.layer) continue;
      const std::string name = hook_name(r.layer, HookKind::Z);
      const at::Tensor value = computed.at(name).select(2, r.head);
      const int64_t h = r.head;
      patch.add(name, [value, h](at::Tensor& z) {
        z = z.clone();
        z.select(2, h).copy_(value);
      });
    }
    acc[s.layer][s.head] = full_metric(model, ex.clean, ex, opts.metric, &patch);
  }
  return out;
}

// ---- attribution patching ------------------------------------------------------------------------

at::Tensor attribution(const Transformer& model, const PreparedExample& ex, const RunCache& cache,
                       const SweepOptions& opts) {
  const int64_t L = model.config().num_hidden_layers, Hq = model.config().num_attention_heads;
  const bool noising = opts.mode == Mode::Noising;
  const double m_base = noising ? cache.metric_clean : cache.metric_corrupt;
  if (ex.diff >= ex.T) return at::full({L, Hq}, m_base, at::TensorOptions().dtype(at::kDouble));
  const int64_t Tq = ex.T - ex.diff;
  const auto& source_z = noising ? cache.z_corrupt : cache.z_clean;

  at::AutoGradMode grad(true);
  std::vector<at::Tensor> zs(static_cast<size_t>(L));
  Hooks hooks;
  for (int64_t l = 0; l < L; ++l) {
    const size_t i = static_cast<size_t>(l);
    // The first z becomes a leaf; later ones already depend on it and stay in the graph, so each
    // gradient includes every downstream path (through later attention too).
    hooks.add(hook_name(l, HookKind::Z), [&zs, i](at::Tensor& z) {
      if (!z.requires_grad()) z = z.detach().requires_grad_(true);
      zs[i] = z;
    });
  }
  // Rows before diff hold z_source == z_base, so only rows diff.. are run (on the shared prefix).
  const SuffixRun suffix(ex, cache);
  const at::Tensor& base = noising ? ex.clean : ex.corrupt;
  const at::Tensor logits = model.forward(base.narrow(1, ex.diff, Tq), suffix.options(&hooks, 0)).logits;
  // The metric (moved to the CPU in float64 by metric_from_logits; autograd follows both) and its
  // gradient with respect to every layer's z in one backward pass.
  const at::Tensor m = metric_from_logits(logits, ex, opts.metric).sum();
  const std::vector<at::Tensor> grads = torch::autograd::grad({m}, zs);
  at::NoGradGuard no_grad;
  std::vector<at::Tensor> per_layer;
  for (int64_t l = 0; l < L; ++l) {
    const size_t i = static_cast<size_t>(l);
    const at::Tensor delta = (source_z[i] - zs[i].detach()).to(at::kFloat);   // [1, Tq, Hq, Dh]
    per_layer.push_back((delta * grads[i].to(at::kFloat)).sum({0, 1, 3}));    // [Hq]
  }
  return at::stack(per_layer).to(at::kDouble).cpu() + m_base;
}

// ---- retrieval score -----------------------------------------------------------------------------

std::vector<std::pair<int64_t, int64_t>> needle_spans(const CalibExample& raw) {
  std::vector<std::pair<int64_t, int64_t>> spans;
  auto add = [&](const nlohmann::json& s) {
    if (!s.is_array() || s.size() != 2) return;
    try {
      const int64_t b = json_int(s[0]), e = json_int(s[1]);
      if (0 <= b && b < e) spans.push_back({b, e});
    } catch (const Error&) {
    }
  };
  const nlohmann::json& meta = raw.meta;
  if (!meta.is_object()) return spans;
  if (auto it = meta.find("needles"); it != meta.end() && it->is_array()) {
    for (const auto& n : *it) {
      if (!n.is_object()) continue;
      const auto asked = n.find("asked");
      if (asked != n.end() && asked->is_boolean() && !asked->get<bool>()) continue;
      if (auto s = n.find("span"); s != n.end()) add(*s);
    }
  }
  if (spans.empty())
    if (auto it = meta.find("needle"); it != meta.end()) add(*it);
  return spans;
}

at::Tensor retrieval_score(const Transformer& model, const CalibExample& raw, const PreparedExample& ex) {
  const auto spans = needle_spans(raw);
  if (spans.empty()) return {};
  at::NoGradGuard no_grad;
  const int64_t L = model.config().num_hidden_layers, Hq = model.config().num_attention_heads;
  const int64_t A = ex.answer_pos.size(0);
  // in_needle[t]: position t of the clean input lies in some needle span.
  at::Tensor in_needle = at::zeros({ex.T}, at::TensorOptions().dtype(at::kBool));
  for (auto [b, e] : spans) {
    const int64_t lo = std::min(b, ex.T), hi = std::min(e, ex.T);
    if (lo < hi) in_needle.narrow(0, lo, hi - lo).fill_(true);
  }
  std::vector<at::Tensor> top(static_cast<size_t>(L));  // [Hq, A] argmax key per head and answer row
  Hooks hooks;
  for (int64_t l = 0; l < L; ++l) {
    const size_t i = static_cast<size_t>(l);
    hooks.add(hook_name(l, HookKind::Pattern), [&top, i](at::Tensor& p) { top[i] = p[0].argmax(-1).cpu(); });
  }
  model::ForwardOptions f;
  f.hooks = &hooks;
  f.pattern_rows = ex.answer_pos;    // only the rows that predict answer tokens
  f.logits = false;                   // the patterns only
  model.forward(ex.clean, f);

  const at::Tensor ids = ex.clean[0].cpu();       // [T]
  const at::Tensor answer = ex.answer_ids.cpu();  // [A]
  at::Tensor score = at::empty({L, Hq}, at::TensorOptions().dtype(at::kDouble));
  for (int64_t l = 0; l < L; ++l) {
    const at::Tensor pos = top[static_cast<size_t>(l)];                    // [Hq, A]
    const at::Tensor hit = in_needle.index({pos}).logical_and(ids.index({pos}) == answer.view({1, A}));
    score.select(0, l).copy_(hit.to(at::kDouble).sum(1) / static_cast<double>(A));
  }
  return score;
}

at::Tensor answer_attention(const Transformer& model, const PreparedExample& ex, int64_t layer, int64_t head,
                            const std::atomic<bool>* cancel) {
  const auto& cfg = model.config();
  if (layer < 0 || layer >= cfg.num_hidden_layers || head < 0 || head >= cfg.num_attention_heads)
    throw Error("head " + std::to_string(layer) + ":" + std::to_string(head) + " is outside the model's " +
                std::to_string(cfg.num_hidden_layers) + " layers x " + std::to_string(cfg.num_attention_heads) + " heads");
  at::NoGradGuard no_grad;
  at::Tensor rows;
  Hooks hooks;
  hooks.add(hook_name(layer, HookKind::Pattern), [&rows, head](at::Tensor& p) { rows = p[0][head].to(at::kDouble).cpu(); });
  if (cancel)
    for (int64_t l = 0; l <= layer; ++l)
      hooks.add(hook_name(l, HookKind::ResidPre), [cancel](at::Tensor&) {
        if (cancel->load()) throw Cancelled();
      });
  model::ForwardOptions f;
  f.hooks = &hooks;
  f.pattern_rows = ex.answer_pos;
  f.stop_layer = layer + 1;  // nothing after the layer is needed
  f.logits = false;
  model.forward(ex.clean, f);
  return rows;
}

}  // namespace hh::interp
