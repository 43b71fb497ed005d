#include "core/attention/hybrid_model.h"

#include <torch/torch.h>

#include <ATen/CPUGeneratorImpl.h>

#include <unistd.h>

#include <cmath>
#include <fstream>

#include "core/io/checkpoint.h"
#include "core/io/safetensors.h"
#include "core/model/hooks.h"
#include "core/model/summary.h"
#include "core/util/error.h"
#include "core/util/files.h"

namespace hh::attention {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

json read_json(const fs::path& p) {
  std::ifstream in(p);
  if (!in) throw Error(p.string() + ": cannot read");
  try {
    return json::parse(in);
  } catch (const json::parse_error& e) {
    throw Error(p.string() + ": not valid JSON: " + e.what());
  }
}

std::string shape_str(at::IntArrayRef s) { return model::format_shape(s.vec()); }

}  // namespace

bool is_hybrid_checkpoint(const fs::path& dir) {
  if (!fs::is_regular_file(dir / "config.json")) return false;
  const json j = read_json(dir / "config.json");
  return j.is_object() && j.contains("hydrahead");
}

HybridModel::HybridModel(model::Transformer teacher, HybridOptions options, std::vector<HybridLayerWeights> layers)
    : teacher_(std::move(teacher)), options_(std::move(options)), layers_(std::move(layers)) {
  const auto& cfg = teacher_.config();
  splits_ = split_heads(options_, cfg);
  if (static_cast<int64_t>(layers_.size()) != cfg.num_hidden_layers)
    throw Error("hybrid model: " + std::to_string(layers_.size()) + " layers of new tensors for a " +
                std::to_string(cfg.num_hidden_layers) + "-layer model");
  for (int64_t l = 0; l < cfg.num_hidden_layers; ++l)
    for (const auto& e : hybrid_weight_table(cfg, options_, splits_[static_cast<size_t>(l)], l, layers_[static_cast<size_t>(l)])) {
      if (!e.slot->defined()) throw Error("hybrid model: " + e.name + " is missing (expected " + shape_str(e.shape) + ")");
      if (e.slot->sizes() != at::IntArrayRef(e.shape))
        throw Error("hybrid model: " + e.name + " has shape " + shape_str(e.slot->sizes()) + ", expected " + shape_str(e.shape));
      if (e.slot->scalar_type() != teacher_.dtype() || e.slot->device() != teacher_.device())
        throw Error("hybrid model: " + e.name + " is not " + std::string(c10::toString(teacher_.dtype())) + " on " +
                    teacher_.device().str() + " like the teacher's tensors");
    }
}

HybridModel HybridModel::load(const fs::path& dir, const std::string& device, const std::string& dtype,
                              const std::atomic<bool>* cancel) {
  json block;
  const std::string where = (dir / "config.json").string();
  const model::ModelConfig cfg = model::ModelConfig::load_teacher_view(dir / "config.json", &block);
  if (block.is_null()) throw Error(where + ": not a HydraHead hybrid (no \"hydrahead\" block)");
  HybridOptions o = HybridOptions::from_json(block, cfg, where);
  model::Transformer teacher = model::Transformer::load(dir, cfg, device, dtype, cancel);
  const auto splits = split_heads(o, cfg);
  io::Checkpoint ckpt(dir);
  std::vector<HybridLayerWeights> layers(static_cast<size_t>(cfg.num_hidden_layers));
  for (int64_t l = 0; l < cfg.num_hidden_layers; ++l)
    for (const auto& e : hybrid_weight_table(cfg, o, splits[static_cast<size_t>(l)], l, layers[static_cast<size_t>(l)])) {
      if (!ckpt.contains(e.name))
        throw Error(dir.string() + ": tensor '" + e.name + "' is missing (expected " + shape_str(e.shape) + ")");
      if (ckpt.info(e.name).shape != e.shape)
        throw Error(dir.string() + ": tensor '" + e.name + "' has shape " + shape_str(ckpt.info(e.name).shape) +
                    ", expected " + shape_str(e.shape));
      if (cancel && cancel->load()) throw Cancelled();
      *e.slot = ckpt.load(e.name).to(teacher.device(), teacher.dtype());
    }
  return HybridModel(std::move(teacher), std::move(o), std::move(layers));
}

void HybridModel::save(const fs::path& dir, uint64_t max_shard_bytes, std::optional<at::ScalarType> dtype) const {
  const at::ScalarType file_dtype = dtype.value_or(teacher_.dtype());
  if (fs::exists(dir)) throw Error(dir.string() + ": already exists; choose a new output directory");
  const fs::path tmp = dir.string() + ".tmp." + std::to_string(::getpid());
  std::error_code ec;
  fs::remove(tmp, ec);
  fs::create_directories(tmp);
  try {
    // Teacher tensors under their HF names, then every layer's new tensors, in one checkpoint.
    std::vector<std::pair<std::string, at::Tensor>> named;
    model::Weights tw = teacher_.weights();
    for (const auto& e : model::weight_table(config(), tw))
      named.emplace_back(e.name, e.slot->detach().to(at::kCPU, file_dtype).contiguous());
    std::vector<HybridLayerWeights> copy = layers_;
    for (int64_t l = 0; l < config().num_hidden_layers; ++l)
      for (const auto& e : hybrid_weight_table(config(), options_, splits_[static_cast<size_t>(l)], l, copy[static_cast<size_t>(l)]))
        named.emplace_back(e.name, e.slot->detach().to(at::kCPU, file_dtype).contiguous());
    io::save_sharded(tmp, named, max_shard_bytes == 0 ? UINT64_MAX : max_shard_bytes);
    model::ModelConfig c = config();
    c.torch_dtype = model::hf_dtype_name(file_dtype);
    json cfg = c.to_json();
    cfg["architectures"] = json::array({kHybridArchitecture});
    cfg["model_type"] = kHybridModelType;
    cfg["hydrahead"] = options_.to_json();
    io::write_file_atomic(tmp / "config.json", cfg.dump(2) + "\n");
    fs::rename(tmp, dir);
  } catch (...) {
    util::remove_tree(tmp);
    throw;
  }
}

at::Tensor HybridModel::layer_forward(int64_t l, const at::Tensor& x_in, bool chunked) const {
  const auto& cfg = config();
  const auto& lw = teacher_.weights().layers[static_cast<size_t>(l)];
  const at::Tensor xn = model::rms_norm(x_in, lw.input_layernorm, cfg.rms_norm_eps);
  const at::Tensor y = hybrid_attention(cfg, options_, splits_[static_cast<size_t>(l)], lw, layers_[static_cast<size_t>(l)],
                                        xn, teacher_.inv_freq(), chunked);
  const at::Tensor x = x_in + teacher_.attn_out(l, y);
  return x + teacher_.mlp_out(l, x);
}

namespace {

// Activation checkpointing of one layer: the forward runs without recording a graph and keeps only
// the layer's input; the backward runs the layer again with autograd and back-propagates through it,
// which accumulates the weights' gradients and returns the input's. The model outlives the backward
// (it is the model being trained), so the node refers to it by address.
struct CheckpointedLayer : public torch::autograd::Function<CheckpointedLayer> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x, int64_t model, int64_t layer,
                            bool chunked) {
    ctx->saved_data["model"] = model;
    ctx->saved_data["layer"] = layer;
    ctx->saved_data["chunked"] = chunked;
    ctx->save_for_backward({x});
    return reinterpret_cast<const HybridModel*>(model)->layer_forward(layer, x, chunked);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx, torch::autograd::variable_list grad) {
    const auto* model = reinterpret_cast<const HybridModel*>(ctx->saved_data["model"].toInt());
    const at::Tensor x = ctx->get_saved_variables()[0].detach().requires_grad_(true);
    at::Tensor y;
    {
      at::AutoGradMode enable(true);
      y = model->layer_forward(ctx->saved_data["layer"].toInt(), x, ctx->saved_data["chunked"].toBool());
    }
    torch::autograd::backward({y}, {grad[0]});
    return {x.grad(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

}  // namespace

at::Tensor HybridModel::forward(const at::Tensor& ids, bool chunked, bool checkpoint_layers) const {
  return teacher_.unembed(hidden(ids, chunked, checkpoint_layers));
}

at::Tensor HybridModel::hidden(const at::Tensor& ids, bool chunked, bool checkpoint_layers) const {
  const auto& cfg = config();
  const auto& w = teacher_.weights();
  if (ids.dim() != 2) throw Error("hybrid forward: token ids must be [B, T], got " + shape_str(ids.sizes()));
  at::Tensor x = at::embedding(w.embed_tokens, ids.to(teacher_.device(), at::kLong));  // [B, T, d]
  const bool checkpoint = checkpoint_layers && at::GradMode::is_enabled();
  // A checkpointed layer's weights get their gradients only when its node runs, which needs an input
  // that requires grad even when the embeddings are frozen.
  if (checkpoint && !x.requires_grad()) x = x.detach().requires_grad_(true);
  for (int64_t l = 0; l < cfg.num_hidden_layers; ++l)
    x = checkpoint ? CheckpointedLayer::apply(x, reinterpret_cast<int64_t>(this), l, chunked) : layer_forward(l, x, chunked);
  return x;
}

at::Tensor HybridModel::step(const at::Tensor& ids, Cache& cache, bool chunked, bool last_only) const {
  const auto& cfg = config();
  const auto& w = teacher_.weights();
  if (ids.dim() != 2) throw Error("hybrid step: token ids must be [B, T], got " + shape_str(ids.sizes()));
  if (cache.layers.empty()) cache.layers.resize(static_cast<size_t>(cfg.num_hidden_layers));
  at::NoGradGuard no_grad;
  at::Tensor x = at::embedding(w.embed_tokens, ids.to(teacher_.device(), at::kLong));
  for (int64_t l = 0; l < cfg.num_hidden_layers; ++l) {
    const auto& lw = w.layers[static_cast<size_t>(l)];
    const at::Tensor xn = model::rms_norm(x, lw.input_layernorm, cfg.rms_norm_eps);
    const at::Tensor y = hybrid_attention(cfg, options_, splits_[static_cast<size_t>(l)], lw, layers_[static_cast<size_t>(l)],
                                          xn, teacher_.inv_freq(), chunked, &cache.layers[static_cast<size_t>(l)]);
    x = x + teacher_.attn_out(l, y);
    x = x + teacher_.mlp_out(l, x);
  }
  cache.pos += ids.size(1);
  return teacher_.unembed(last_only ? x.narrow(1, x.size(1) - 1, 1) : x);
}

std::vector<int64_t> HybridModel::generate(const std::vector<int64_t>& prompt, int64_t n) const {
  if (prompt.empty()) throw Error("generate: the prompt has no tokens");
  Cache cache;
  std::vector<int64_t> out;
  if (n <= 0) return out;
  out.push_back(greedy_next(prompt, cache));
  while (static_cast<int64_t>(out.size()) < n) out.push_back(greedy_next({out.back()}, cache));
  return out;
}

int64_t HybridModel::greedy_next(const std::vector<int64_t>& ids, Cache& cache) const {
  if (ids.empty()) throw Error("generate: no tokens to add to the cache");
  const auto input = at::tensor(at::ArrayRef<int64_t>(ids), at::TensorOptions().dtype(at::kLong)).unsqueeze(0);
  return step(input, cache, /*chunked=*/true, /*last_only=*/true)[0][0].argmax().item<int64_t>();  // of [1, 1, V]
}

// ---- conversion ----------------------------------------------------------------------------------

HybridModel convert(const model::Transformer& teacher, const select::Manifest& manifest, const ConvertOptions& co) {
  const auto& cfg = teacher.config();
  select::check_fits(manifest, select::shape_of(cfg), "manifest");
  HybridOptions o = co.hybrid;
  o.fa_heads = manifest.fa_heads;
  const auto splits = split_heads(o, cfg);
  const int64_t Hq = cfg.num_attention_heads, Dh = cfg.head_dim, G = cfg.kv_group_size();
  const auto& tw = teacher.weights();

  // fusion_gamma: per-channel RMS of each head's z on the calibration prompts (clean), else 1.
  at::Tensor gamma_all = at::ones({cfg.num_hidden_layers, Hq, Dh}, at::TensorOptions().dtype(at::kDouble));
  if (co.calib != nullptr && !co.calib->empty()) {
    at::NoGradGuard no_grad;
    at::Tensor sumsq = at::zeros_like(gamma_all);
    int64_t tokens = 0, total = 0;
    for (const auto& ex : *co.calib) total += static_cast<int64_t>(ex.clean_ids.size());
    total = std::min(total, co.max_calib_tokens);
    for (const auto& ex : *co.calib) {
      if (tokens >= co.max_calib_tokens) break;
      std::vector<int64_t> ids = ex.clean_ids;
      if (static_cast<int64_t>(ids.size()) > co.max_calib_tokens - tokens) ids.resize(static_cast<size_t>(co.max_calib_tokens - tokens));
      for (int64_t id : ids)
        if (id < 0 || id >= cfg.vocab_size) throw Error("calibration set: token id " + std::to_string(id) + " is outside the vocabulary");
      model::Hooks hooks;
      for (int64_t l = 0; l < cfg.num_hidden_layers; ++l)
        hooks.add(model::hook_name(l, model::HookKind::Z), [&sumsq, l](at::Tensor& z) {
          sumsq[l] += z[0].to(at::kDouble).pow(2).sum(0).cpu();  // [Hq, Dh]
        });
      model::ForwardOptions f;
      f.hooks = &hooks;
      f.logits = false;  // the hooks' sums only
      teacher.forward(at::tensor(at::ArrayRef<int64_t>(ids), at::TensorOptions().dtype(at::kLong)).unsqueeze(0), f);
      tokens += static_cast<int64_t>(ids.size());
      if (co.progress) co.progress(tokens, total);
    }
    if (tokens > 0) gamma_all = (sumsq / static_cast<double>(tokens)).sqrt();
  }

  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(co.seed);
  const auto f32 = at::TensorOptions().dtype(at::kFloat);
  auto normal = [&](std::vector<int64_t> shape) { return at::randn(shape, gen, f32) * 0.02; };
  std::vector<HybridLayerWeights> layers(static_cast<size_t>(cfg.num_hidden_layers));
  for (int64_t l = 0; l < cfg.num_hidden_layers; ++l) {
    const HeadSplit& s = splits[static_cast<size_t>(l)];
    HybridLayerWeights& w = layers[static_cast<size_t>(l)];
    const auto& lw = tw.layers[static_cast<size_t>(l)];
    const int64_t nF = static_cast<int64_t>(s.fa.size()), nL = static_cast<int64_t>(s.la.size()), d = cfg.hidden_size;
    const bool fused = !o.fusion_concat;
    if (nF > 0 && fused) w.fa_gate = at::zeros({nF * Dh, d}, f32);
    if (nL > 0) {
      std::vector<at::Tensor> krows, vrows;
      for (int64_t h : s.la) {
        krows.push_back(lw.k_proj.narrow(0, (h / G) * Dh, Dh).to(at::kCPU, at::kFloat));
        vrows.push_back(lw.v_proj.narrow(0, (h / G) * Dh, Dh).to(at::kCPU, at::kFloat));
      }
      w.la_k_proj = at::cat(krows, 0);
      w.la_v_proj = at::cat(vrows, 0);
      const at::Tensor gate = normal({nL * Dh, d});  // drawn either way: the other tensors keep their values
      if (fused) w.la_gate = gate;
      w.la_a_proj = normal({nL, d});
      w.la_b_proj = normal({nL, d});
      w.la_A_log = (at::rand({nL}, gen, f32) * 15 + 1).log();                                   // A ~ U(1, 16)
      const at::Tensor dt = (at::rand({nL}, gen, f32) * (std::log(0.1) - std::log(1e-3)) + std::log(1e-3)).exp();
      w.la_dt_bias = dt + at::log(-at::expm1(-dt));                                            // softplus^-1(dt)
      if (o.gdn_short_conv) {
        w.la_conv = at::zeros({3 * nL * Dh, 1, kShortConvKernel}, f32);
        w.la_conv.select(2, kShortConvKernel - 1).fill_(1.0);                                  // identity
      }
    }
    if (fused) w.fusion_gamma = gamma_all[l].clone();  // float64 sums; cast to the model dtype below
    for (const auto& e : hybrid_weight_table(cfg, o, s, l, w)) *e.slot = e.slot->to(teacher.device(), teacher.dtype());
  }
  return HybridModel(teacher, std::move(o), std::move(layers));
}

}  // namespace hh::attention
