// hydrahead bench forward|tokenize|analyze|train ... (see --help of each)
#include <torch/torch.h>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <optional>
#include <functional>
#include <set>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "core/util/compat.h"
#if __has_include(<torch/csrc/autograd/profiler_kineto.h>) && HH_TORCH_AT_LEAST(2, 0)
#include <torch/csrc/autograd/profiler_kineto.h>
#define HH_HAVE_KINETO 1
#endif

#if defined(HH_HAVE_CUDA) && __has_include(<c10/cuda/CUDACachingAllocator.h>)
#include <c10/cuda/CUDACachingAllocator.h>
#define HH_HAVE_CUDA_ALLOCATOR_STATS 1
#endif

#include "app/cli/commands.h"
#include "core/attention/hybrid_model.h"
#include "core/dist/grad_sync.h"
#include "core/dist/process_group.h"
#include "core/interp/patching.h"
#include "core/train/trainer.h"
#include "core/model/config.h"
#include "core/model/tokenizer.h"
#include "core/model/transformer.h"
#include "core/util/error.h"

namespace hh::cli {
namespace {

struct BenchArgs {
  std::string model, device = "cpu", dtype = "bf16";
  int64_t seq = 4096, batch = 1, iters = 10, warmup = 3;
  int64_t decode = 0;  // also time greedy decoding of this many tokens after a --seq prompt
  bool decode_ops = false;  // a hybrid's LA heads decode as the op sequence, not one kernel
  uint64_t seed = 0;
  bool json = false;
};

int run_bench_forward(const BenchArgs& a) {
  if (a.seq < 1 || a.batch < 1 || a.iters < 1 || a.warmup < 0 || a.decode < 0)
    throw Error("--seq, --batch and --iters must be positive and --warmup and --decode non-negative");
  attention::set_decode_kernel(!a.decode_ops);
  // A dense checkpoint or a HydraHead hybrid: the hybrid's forward and decoding, its teacher's config.
  std::optional<model::Transformer> dense;
  std::optional<attention::HybridModel> hybrid;
  if (attention::is_hybrid_checkpoint(a.model)) hybrid.emplace(attention::HybridModel::load(a.model, a.device, a.dtype));
  else dense.emplace(model::Transformer::load(a.model, a.device, a.dtype));
  const model::Transformer& base = hybrid ? hybrid->teacher() : *dense;
  const auto dev = base.device();
  torch::manual_seed(a.seed);
  const auto ids = torch::randint(base.config().vocab_size, {a.batch, a.seq},
                                  torch::TensorOptions().dtype(torch::kInt64)).to(dev);  // [B, T]
  torch::NoGradGuard no_grad;
  const std::vector<double> ms = sample_ms(dev, a.warmup, a.iters, [&] {
    if (hybrid) (void)hybrid->forward(ids);
    else (void)dense->forward(ids);
  });
  const double median = ms[ms.size() / 2];
  // Greedy decoding of --decode tokens after the first sequence as the prompt, as generate_greedy and
  // HybridModel::generate run it: the prompt's time (its forward into an empty cache and the first new
  // token), and each single-token step timed on its own. A step's time is the median over every run's
  // steps, so that it does not inherit the prompt's run-to-run spread.
  std::optional<double> prefill_ms, token_ms;
  if (a.decode > 0) {
    const at::Tensor first = ids[0].cpu();
    const std::vector<int64_t> prompt(first.data_ptr<int64_t>(), first.data_ptr<int64_t>() + a.seq);
    std::vector<double> prompts, steps;
    for (int64_t run = 0; run < a.warmup + a.iters; ++run) {
      model::KvCache kv(base.config().num_hidden_layers);
      attention::HybridModel::Cache hc;
      auto next_after = [&](const std::vector<int64_t>& t) {
        return hybrid ? hybrid->greedy_next(t, hc) : model::greedy_next(*dense, kv, t);
      };
      const bool timed = run >= a.warmup;
      sync_device(dev);
      auto t0 = std::chrono::steady_clock::now();
      int64_t next = next_after(prompt);
      auto since = [&] { return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count(); };
      if (timed) prompts.push_back(since());
      for (int64_t n = 0; n < a.decode; ++n) {
        t0 = std::chrono::steady_clock::now();
        next = next_after({next});  // the argmax's item() waits for the device
        if (timed) steps.push_back(since());
      }
    }
    std::sort(prompts.begin(), prompts.end());
    std::sort(steps.begin(), steps.end());
    prefill_ms = prompts[prompts.size() / 2];
    token_ms = steps[steps.size() / 2];
  }
  // Matmul FLOPs of one forward (2 per multiply-add): projections, MLP, causal attention, lm_head (a
  // hybrid's are counted as its teacher's).
  const auto& c = base.config();
  const double T = static_cast<double>(a.seq), B = static_cast<double>(a.batch);
  const double proj = 2.0 * c.hidden_size * c.head_dim * (2.0 * c.num_attention_heads + 2.0 * c.num_key_value_heads);
  const double mlp = 2.0 * 3.0 * c.hidden_size * c.intermediate_size;
  const double attn = 2.0 * 2.0 * c.num_attention_heads * c.head_dim * (T + 1) / 2.0;
  const double flops = B * T * (c.num_hidden_layers * (proj + mlp + attn) + 2.0 * c.hidden_size * c.vocab_size);
  const double tflops = flops / (median * 1e-3) / 1e12;
  if (a.json) {
    nlohmann::json j = {{"what", "forward"}, {"model", hybrid ? "hybrid" : "dense"}, {"device", a.device},
                        {"dtype", a.dtype}, {"batch", a.batch}, {"seq", a.seq}, {"iters", a.iters}, {"median_ms", median},
                        {"min_ms", ms.front()}, {"max_ms", ms.back()}, {"tflops", tflops},
                        {"tokens_per_s", B * T / (median * 1e-3)}};
    if (token_ms) {
      j["decode"] = a.decode;
      if (hybrid) j["decode_step"] = a.decode_ops ? "ops" : "kernel";
      j["prefill_ms"] = *prefill_ms;
      j["decode_token_ms"] = *token_ms;
      j["decode_tokens_per_s"] = *token_ms > 0 ? 1e3 / *token_ms : 0.0;
    }
    std::printf("%s\n", j.dump().c_str());
  } else {
    std::printf("forward  %s B=%lld T=%lld %s on %s: median %.2f ms (min %.2f, max %.2f), %.1f TFLOP/s, %.0f tokens/s\n",
                hybrid ? "hybrid" : "dense", static_cast<long long>(a.batch), static_cast<long long>(a.seq),
                a.dtype.c_str(), a.device.c_str(), median, ms.front(), ms.back(), tflops, B * T / (median * 1e-3));
    if (token_ms)
      std::printf("decode   %lld more tokens after a prompt of %lld: prompt %.2f ms, then %.3f ms a token (%.1f tokens/s)\n",
                  static_cast<long long>(a.decode), static_cast<long long>(a.seq), *prefill_ms, *token_ms,
                  *token_ms > 0 ? 1e3 / *token_ms : 0.0);
  }
  return kExitOk;
}

struct TokenizeBenchArgs {
  std::string tokenizer, model, file;
  int64_t iters = 3;
  bool json = false;
};

int run_bench_tokenize(const TokenizeBenchArgs& a) {
  const std::filesystem::path tok_path =
      a.tokenizer.empty() ? std::filesystem::path(a.model) / "tokenizer.json" : std::filesystem::path(a.tokenizer);
  const auto t_load = std::chrono::steady_clock::now();
  const auto tok = model::Tokenizer::load(tok_path);
  const double load_ms =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t_load).count();
  std::ifstream in(a.file, std::ios::binary);
  if (!in) throw Error(a.file + ": cannot read");
  std::stringstream ss;
  ss << in.rdbuf();
  const std::string text = ss.str();
  std::vector<double> secs;
  size_t n_tokens = 0;
  for (int64_t i = 0; i < std::max<int64_t>(1, a.iters); ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    n_tokens = tok.encode(text).size();
    secs.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  // The first pass fills the word cache; report it and the best later pass.
  const double first = secs.front();
  const double best = *std::min_element(secs.begin(), secs.end());
  if (a.json) {
    nlohmann::json j = {{"what", "tokenize"}, {"bytes", text.size()}, {"tokens", n_tokens},
                        {"load_ms", load_ms}, {"first_s", first}, {"best_s", best},
                        {"tokens_per_s_first", n_tokens / first}, {"tokens_per_s_best", n_tokens / best}};
    std::printf("%s\n", j.dump().c_str());
  } else {
    std::printf("tokenize %zu bytes -> %zu tokens: load %.0f ms, first pass %.3f s (%.2f M tokens/s), "
                "best of %zu %.3f s (%.2f M tokens/s)\n",
                text.size(), n_tokens, load_ms, first, n_tokens / first / 1e6, secs.size(), best,
                n_tokens / best / 1e6);
  }
  return kExitOk;
}

struct AnalyzeBenchArgs {
  std::string model, config, device = "cpu", dtype = "bf16", method = "activation,attribution";
  int64_t seq = 1024, diff = -1, answer_len = 4, iters = 3, warmup = 1, max_batch = 0, reference_heads = 0;
  double peak_tflops = 813.0;  // bf16 dense GEMM measured on the H200 (docs/BENCHMARKS.md)
  uint64_t seed = 0;
  bool json = false;
  std::string profile;  // chrome trace of one more run of each method
};

}  // namespace

// Records a Chrome trace (CPU ops and CUDA kernels) of fn() into `path`, where LibTorch has Kineto.
void profile_to(const std::string& path, const std::function<void()>& fn) {
#ifdef HH_HAVE_KINETO
  namespace prof = torch::autograd::profiler;
  using torch::profiler::impl::ActivityType;
  const torch::profiler::impl::ProfilerConfig cfg(torch::profiler::impl::ProfilerState::KINETO);
  const std::set<ActivityType> acts = {ActivityType::CPU, ActivityType::CUDA};
  prof::prepareProfiler(cfg, acts);
  prof::enableProfiler(cfg, acts);
  fn();
  auto result = prof::disableProfiler();
  result->save(path);
  std::printf("  profile written to %s\n", path.c_str());
#else
  (void)fn;
  throw Error("--profile " + path + ": this LibTorch has no Kineto profiler");
#endif
}

void sync_device(const at::Device& d) {
  if (d.is_cuda()) torch::cuda::synchronize(d.index());
}

std::vector<double> sample_ms(const at::Device& dev, int64_t warmup, int64_t iters, const std::function<void()>& fn) {
  for (int64_t i = 0; i < warmup; ++i) fn();
  sync_device(dev);
  std::vector<double> ms;
  for (int64_t i = 0; i < iters; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    fn();
    sync_device(dev);
    ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
  }
  std::sort(ms.begin(), ms.end());
  return ms;
}

double median_ms(const at::Device& dev, int64_t warmup, int64_t iters, const std::function<void()>& fn) {
  const std::vector<double> ms = sample_ms(dev, warmup, iters, fn);
  return ms[ms.size() / 2];
}

BackToBack back_to_back(const at::Device& dev, int64_t warmup, int64_t iters, const std::function<void()>& fn) {
  for (int64_t i = 0; i < warmup; ++i) fn();
  sync_device(dev);
  using Ms = std::chrono::duration<double, std::milli>;
  const auto t0 = std::chrono::steady_clock::now();
  for (int64_t i = 0; i < iters; ++i) fn();
  const auto queued = std::chrono::steady_clock::now();
  sync_device(dev);
  const auto t1 = std::chrono::steady_clock::now();
  const double n = static_cast<double>(iters);
  return {Ms(t1 - t0).count() / n, Ms(queued - t0).count() / n};
}

double back_to_back_ms(const at::Device& dev, int64_t warmup, int64_t iters, const std::function<void()>& fn) {
  return back_to_back(dev, warmup, iters, fn).ms;
}

namespace {

// A model of `cfg`'s shape with N(0, 0.02^2) weights drawn on the device (no checkpoint needed).
model::Transformer random_model(const model::ModelConfig& cfg, const std::string& device, const std::string& dtype,
                                uint64_t seed) {
  model::Weights w;
  const auto opts = torch::TensorOptions().dtype(model::parse_dtype(dtype)).device(model::parse_device(device));
  torch::manual_seed(seed);
  for (const auto& e : model::weight_table(cfg, w)) {
    const bool norm = e.name.size() >= 11 && e.name.compare(e.name.size() - 11, 11, "norm.weight") == 0;
    *e.slot = norm ? torch::ones(e.shape, opts) : torch::randn(e.shape, opts) * 0.02;
  }
  return model::Transformer(cfg, std::move(w));
}

// Matmul FLOPs of the least work exact patching of every head can do: for a head of layer l, the
// rows from the first difference on through o_proj and the MLP of layer l, every later layer in
// full (projections, MLP, attention over the prefix and the new rows), and the vocabulary
// projection at the answer rows.
double patching_flop_floor(const model::ModelConfig& c, int64_t T, int64_t diff, int64_t A) {
  const double rows = static_cast<double>(T - diff), d = static_cast<double>(c.hidden_size);
  const double qkv = 2.0 * d * c.head_dim * (c.num_attention_heads + 2.0 * c.num_key_value_heads);
  const double o = 2.0 * d * c.head_dim * c.num_attention_heads;
  const double mlp = 6.0 * d * c.intermediate_size;
  const double attn = 4.0 * c.num_attention_heads * c.head_dim * (diff + rows / 2.0);  // per row
  const double layer_full = rows * (qkv + o + mlp + attn);
  double total = 0;
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
    const double later = static_cast<double>(c.num_hidden_layers - 1 - l);
    total += c.num_attention_heads * (rows * (o + mlp) + later * layer_full + 2.0 * A * d * c.vocab_size);
  }
  return total;
}

int run_bench_analyze(const AnalyzeBenchArgs& a) {
  if (a.model.empty() == a.config.empty()) throw Error("give exactly one of --model DIR and --config config.json");
  if (a.seq < 2 || a.answer_len < 1 || a.iters < 1 || a.warmup < 0 || a.answer_len >= a.seq)
    throw Error("--seq must be >= 2, --answer-len in [1, seq), --iters >= 1, --warmup >= 0");
  const model::Transformer model = a.model.empty()
      ? random_model(model::ModelConfig::load(a.config), a.device, a.dtype, a.seed)
      : model::Transformer::load(a.model, a.device, a.dtype);
  const auto& c = model.config();
  const int64_t prompt = a.seq - a.answer_len + 1;  // T = prompt + answer - 1
  const int64_t diff = a.diff < 0 ? prompt / 2 : a.diff;
  if (diff >= prompt) throw Error("--diff must be below the prompt length " + std::to_string(prompt));
  bool act = false, attr = false, path = false;
  for (const auto& m : split_list(a.method)) {
    if (m == "activation") act = true;
    else if (m == "attribution") attr = true;
    else if (m == "path") path = true;
    else if (m == "all") act = attr = path = true;
    else throw Error("--method: unknown '" + m + "' (activation, attribution, path or all)");
  }

  // One clean/corrupt pair: random tokens, a 4-token "needle" changed at `diff`.
  torch::manual_seed(a.seed + 1);
  const auto rand_ids = [&](int64_t n) {
    const auto t = torch::randint(c.vocab_size, {n}, torch::TensorOptions().dtype(torch::kInt64));
    return std::vector<int64_t>(t.data_ptr<int64_t>(), t.data_ptr<int64_t>() + n);
  };
  interp::CalibExample raw;
  raw.task = "bench";
  raw.clean_ids = rand_ids(prompt);
  raw.corrupt_ids = raw.clean_ids;
  for (int64_t i = diff; i < std::min(prompt, diff + 4); ++i) raw.corrupt_ids[i] = (raw.clean_ids[i] + 1) % c.vocab_size;
  raw.answer_ids = rand_ids(a.answer_len);
  raw.wrong_ids = {(raw.answer_ids[0] + 1) % c.vocab_size};
  const auto ex = interp::prepare_example(raw, model, interp::Metric::LogProb, "bench");
  const auto dev = model.device();

  interp::SweepOptions o;
  o.max_batch = a.max_batch;
  auto time_it = [&](const std::function<void()>& fn) { return median_ms(dev, a.warmup, a.iters, fn) * 1e-3; };  // seconds
  const int64_t heads = c.num_hidden_layers * c.num_attention_heads;
  nlohmann::json j = {{"what", "analyze"}, {"device", a.device}, {"dtype", a.dtype}, {"seq", a.seq},
                      {"diff", diff}, {"answer_len", a.answer_len}, {"layers", c.num_hidden_layers},
                      {"heads", c.num_attention_heads}, {"iters", a.iters}};
  std::printf("analyze bench: %lld layers x %lld heads, T=%lld (first difference at %lld, %lld answer tokens), %s on %s\n",
              static_cast<long long>(c.num_hidden_layers), static_cast<long long>(c.num_attention_heads),
              static_cast<long long>(a.seq), static_cast<long long>(diff), static_cast<long long>(a.answer_len),
              a.dtype.c_str(), a.device.c_str());
  interp::RunCache cache;
  const double runs_s = time_it([&] { cache = interp::run_clean_corrupt(model, ex, interp::Metric::LogProb); });
  j["clean_corrupt_s"] = runs_s;
  std::printf("  clean + corrupt runs (cached)      %8.3f s\n", runs_s);
  if (act) {
    const double s = time_it([&] { (void)interp::head_sweep(model, ex, cache, o); });
    const double floor = patching_flop_floor(c, ex.T, diff, a.answer_len);
    const double tflops = floor / s / 1e12;
    j["activation_sweep_s"] = s + runs_s;
    j["activation_sweep_only_s"] = s;
    j["flop_floor"] = floor;
    j["fraction_of_peak"] = tflops / a.peak_tflops;
    std::printf("  activation sweep, %lld heads        %8.3f s  (+ runs = %.3f s per pair; %.2f ms/head)\n",
                static_cast<long long>(heads), s, s + runs_s, 1e3 * s / heads);
    std::printf("    FLOP floor %.1f TFLOP -> %.0f TFLOP/s = %.0f%% of %.0f TFLOP/s\n", floor / 1e12, tflops,
                100.0 * tflops / a.peak_tflops, a.peak_tflops);
    if (a.reference_heads > 0) {
      interp::SweepOptions r = o;
      for (int64_t i = 0; i < std::min(a.reference_heads, heads); ++i)
        r.heads.push_back({(i * 7) % c.num_hidden_layers, (i * 3) % c.num_attention_heads});
      const double rs = time_it([&] { (void)interp::head_sweep_reference(model, ex, r); });
      const double per_head = rs / static_cast<double>(r.heads.size());
      j["reference_ms_per_head"] = 1e3 * per_head;
      j["reference_sweep_s_extrapolated"] = per_head * heads;
      std::printf("  reference (one forward per head)   %8.2f ms/head -> %.2f s for all heads (x%.1f slower)\n",
                  1e3 * per_head, per_head * heads, per_head * heads / (s + runs_s));
    }
  }
  if (attr) {
    const double s = time_it([&] { (void)interp::attribution(model, ex, cache, o); });
    j["attribution_s"] = s;
    j["attribution_with_runs_s"] = s + runs_s;
    std::printf("  attribution (fwd + bwd, all heads) %8.1f ms (+ runs = %.1f ms per pair)\n", 1e3 * s, 1e3 * (s + runs_s));
  }
  if (path) {
    const double s = time_it([&] { (void)interp::path_sweep(model, ex, cache, {}, o); });
    j["path_sweep_s"] = s;
    std::printf("  path patching -> logits, all heads %8.3f s\n", s);
  }
  if (!a.profile.empty())
    profile_to(a.profile, [&] {
      if (act) (void)interp::head_sweep(model, ex, cache, o);
      if (attr) (void)interp::attribution(model, ex, cache, o);
      sync_device(dev);
    });
  if (a.json) std::printf("%s\n", j.dump().c_str());
  return kExitOk;
}

}  // namespace

struct TrainBenchArgs {
  std::string config, device = "cpu", dtype = "bf16", stages = "align,distil,finetune,dense";
  int64_t seq = 4096, batch = 1, ratio = 7, iters = 5, warmup = 2;
  uint64_t seed = 0;
  bool json = false, checkpoint_layers = false;
  DistArgs dist;   // --nproc-per-node: data parallel, --batch sequences per rank
  std::string profile;  // Chrome trace of one more step of each stage: STEM-STAGE.EXT
  bool graph_ops = false;  // the LA heads' convolution, RoPE and L2 norm as LibTorch ops with a graph
  bool optimizer_ops = false;  // AdamW, the gradient norm and clipping as LibTorch ops per tensor
};

// `path` with "-label" before its extension (trace.json -> trace-align.json).
std::string labelled_path(const std::string& path, const std::string& label) {
  std::filesystem::path p(path);
  p.replace_filename(p.stem().string() + "-" + label + p.extension().string());
  return p.string();
}

// Peak bytes the caching allocator handed out since the last reset (CUDA only; -1 elsewhere).
int64_t peak_memory(const at::Device& d, bool reset) {
#ifdef HH_HAVE_CUDA_ALLOCATOR_STATS
  if (d.is_cuda()) {
    const auto idx = static_cast<c10::DeviceIndex>(d.has_index() ? d.index() : 0);
    sync_device(d);
    const int64_t peak = c10::cuda::CUDACachingAllocator::getDeviceStats(idx).allocated_bytes[0].peak;
    if (reset) c10::cuda::CUDACachingAllocator::resetPeakStats(idx);
    return peak;
  }
#endif
  (void)d;
  (void)reset;
  return -1;
}

std::string gib(int64_t bytes) {
  if (bytes < 0) return "n/a";
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.2f GiB", static_cast<double>(bytes) / 1073741824.0);
  return buf;
}

// Training throughput of each stage on a random model of `config`'s shape and its hybrid at
// LA:FA = ratio:1 (evenly spaced FA heads in every layer), and the teacher's forward for comparison.
int run_bench_train(const TrainBenchArgs& a) {
  if (a.seq < 2 || a.batch < 1 || a.iters < 1 || a.warmup < 0 || a.ratio < 1)
    throw Error("--seq must be >= 2, --batch, --iters and --ratio >= 1, --warmup >= 0");
  attention::set_graph_kernels(!a.graph_ops);
  train::set_fused_optimizer(!a.optimizer_ops);
  const auto cfg = model::ModelConfig::load(a.config);
  if (const int status = maybe_launch(a.dist); status >= 0) return status;
  const auto group = join_group(a.dist, a.device);
  const std::string device = group ? dist::rank_device(a.device, group->env(), "--device") : a.device;
  const int world = group ? group->size() : 1;
  const bool lead = !group || group->rank() == 0;   // prints for the job
  const at::Device dev = model::parse_device(device);
  train::StageModels m;
  m.teacher.emplace(random_model(cfg, device, a.dtype, a.seed));
  select::Manifest manifest;
  manifest.model = select::shape_of(cfg, "");
  const int64_t per_layer = std::max<int64_t>(1, cfg.num_attention_heads / (a.ratio + 1));
  for (int64_t l = 0; l < cfg.num_hidden_layers; ++l)
    for (int64_t k = 0; k < per_layer; ++k) manifest.fa_heads.emplace_back(l, k * cfg.num_attention_heads / per_layer);
  {
    model::Weights w = m.teacher->weights();
    for (const auto& e : model::weight_table(cfg, w)) *e.slot = e.slot->clone();
    if (cfg.tie_word_embeddings) w.lm_head = torch::Tensor();
    attention::ConvertOptions co;
    co.seed = a.seed;
    m.student.emplace(attention::convert(model::Transformer(cfg, std::move(w)), manifest, co));
  }
  torch::manual_seed(a.seed + 1 + static_cast<uint64_t>(group ? group->rank() : 0));
  const auto ids = torch::randint(cfg.vocab_size, {a.batch, a.seq + 1}, torch::TensorOptions().dtype(torch::kInt64)).to(dev);
  const double tokens = static_cast<double>(a.batch * a.seq * world);   // over every rank
  if (lead)
  std::printf("bench train: %s-shaped random model, %lld layers x %lld heads, hybrid %lld FA heads (LA:FA %lld:1), "
              "B=%lld T=%lld %s on %s x %d\n", a.config.c_str(), static_cast<long long>(cfg.num_hidden_layers),
              static_cast<long long>(cfg.num_attention_heads), static_cast<long long>(manifest.fa_heads.size()),
              static_cast<long long>(a.ratio), static_cast<long long>(a.batch), static_cast<long long>(a.seq),
              a.dtype.c_str(), dev.str().c_str(), world);
  nlohmann::json out = {{"config", a.config}, {"seq", a.seq}, {"batch", a.batch}, {"ranks", world}, {"dtype", a.dtype},
                        {"fa_heads", manifest.fa_heads.size()}, {"graph_kernels", !a.graph_ops},
                        {"fused_optimizer", !a.optimizer_ops},
                        {"stages", nlohmann::json::object()}};
  {
    torch::NoGradGuard ng;
    const auto input = ids.narrow(1, 0, a.seq);
    peak_memory(dev, true);
    const double t = median_ms(dev, a.warmup, a.iters, [&] { (void)m.teacher->forward(input); });
    const int64_t peak = peak_memory(dev, true);
    if (lead)
    std::printf("  %-16s %9.1f ms  %10.0f tokens/s  peak %s\n", "teacher forward", t, tokens / t * 1e3, gib(peak).c_str());
    out["stages"]["teacher_forward"] = {{"ms", t}, {"tokens_per_s", tokens / t * 1e3}, {"peak_bytes", peak}};
  }
  for (const auto& name : split_list(a.stages)) {
    train::StageModels sm;
    jobs::StageKind kind;
    if (name == "dense") {
      kind = jobs::StageKind::Pretrain;   // the teacher itself trained on next-token cross-entropy
      sm.dense = m.teacher;
    } else {
      kind = jobs::parse_stage_kind(name);
      if (kind == jobs::StageKind::Pretrain) throw Error("--stages: use 'dense' for the teacher's own training step");
      sm.student = m.student;
      sm.teacher = m.teacher;
    }
    auto params = train::stage_params(sm, kind);
    {
      train::AdamW opt(params, {});
      std::optional<dist::GradSync> grad_sync;   // bucketed all-reduce overlapped with the backward pass
      if (group) {
        std::vector<torch::Tensor> tensors;
        for (const auto& p : params) tensors.push_back(p.tensor);
        grad_sync.emplace(*group, tensors);
        grad_sync->set_sync(true);
      }
      peak_memory(dev, true);
      double loss = 0;
      auto step = [&] {
        loss = train::stage_loss(sm, kind, ids, 1.0, true, a.checkpoint_layers);
        if (grad_sync) grad_sync->finish();
        train::clip_grad_norm(params, 1.0);
        opt.step(1e-5);
        opt.zero_grad();
      };
      const double t = median_ms(dev, a.warmup, a.iters, step);
      const int64_t peak = peak_memory(dev, true);
      // The optimiser's part of a step alone (the norm, clipping and AdamW), on one step's gradients. Each
      // pass clips them to half their norm, so that every pass scales them as a clipped step does.
      (void)train::stage_loss(sm, kind, ids, 1.0, true, a.checkpoint_layers);
      if (grad_sync) grad_sync->finish();
      double limit = train::grad_norm(params) / 2;
      const double t_opt = median_ms(dev, 1, a.iters, [&] {
        limit = train::clip_grad_norm(params, limit) / 4;
        opt.step(1e-5);
      });
      opt.zero_grad();
      if (!a.profile.empty() && lead)
        profile_to(labelled_path(a.profile, name), [&] {
          step();
          sync_device(dev);
        });
      int64_t n = 0;
      for (const auto& p : params) n += p.tensor.numel();
      const std::string label = name == "dense" ? "dense train" : name;
      if (lead)
      std::printf("  %-16s %9.1f ms  %10.0f tokens/s  peak %s  (%.3fB trainable, loss %.4g; optimizer %.2f ms)\n",
                  label.c_str(), t, tokens / t * 1e3, gib(peak).c_str(), static_cast<double>(n) / 1e9, loss, t_opt);
      out["stages"][label] = {{"ms", t},         {"tokens_per_s", tokens / t * 1e3}, {"peak_bytes", peak},
                              {"trainable", n},  {"optimizer_ms", t_opt}};
    }
    for (auto& p : params) p.tensor.requires_grad_(false);
  }
  if (a.json && lead) std::printf("%s\n", out.dump().c_str());
  return kExitOk;
}

Runner add_bench(CLI::App& app) {
  auto args = std::make_shared<BenchArgs>();
  app.require_subcommand(1);
  auto* fwd = app.add_subcommand("forward", "Time the model's forward pass (median of --iters after --warmup)");
  fwd->add_option("--model", args->model, "HF checkpoint directory, dense or a HydraHead hybrid")->required();
  fwd->add_option("--device", args->device, "cpu or cuda[:N]")->capture_default_str();
  fwd->add_option("--dtype", args->dtype, "f32, bf16 or f16")->capture_default_str();
  fwd->add_option("--seq", args->seq, "Sequence length T")->capture_default_str();
  fwd->add_option("--batch", args->batch, "Batch size B")->capture_default_str();
  fwd->add_option("--iters", args->iters, "Timed iterations")->capture_default_str();
  fwd->add_option("--warmup", args->warmup, "Untimed iterations first")->capture_default_str();
  fwd->add_option("--seed", args->seed, "Seed of the random token ids")->capture_default_str();
  fwd->add_option("--decode", args->decode,
                  "Also time greedy decoding of N more tokens after the first sequence as the prompt (batch 1), "
                  "with the key/value cache (and a hybrid's recurrent state): the prompt's time (its forward and "
                  "first new token) and a decoding step's (the median of every run's N steps, each timed alone)")
      ->capture_default_str();
  fwd->add_flag("--decode-ops", args->decode_ops,
                "With --decode on a hybrid on CUDA: its LA heads' decoding step as the op sequence (convolution, "
                "RoPE and norm, gates, recurrence, fusion one after the other) instead of one kernel, for comparison");
  fwd->add_flag("--json", args->json, "Print one JSON object");

  auto targs = std::make_shared<TokenizeBenchArgs>();
  auto* tk = app.add_subcommand("tokenize", "Time encoding a text file (tokens/s, cold and warm cache)");
  auto* t = tk->add_option("--tokenizer", targs->tokenizer, "tokenizer.json file");
  auto* m = tk->add_option("--model", targs->model, "Checkpoint directory holding tokenizer.json");
  t->excludes(m);
  m->excludes(t);
  tk->add_option("--file", targs->file, "UTF-8 text file to encode")->required();
  tk->add_option("--iters", targs->iters, "Passes over the file")->capture_default_str();
  tk->add_flag("--json", targs->json, "Print one JSON object");
  tk->callback([t, m] {
    if (t->count() + m->count() == 0) throw CLI::RequiredError("--tokenizer or --model");
  });
  auto aargs = std::make_shared<AnalyzeBenchArgs>();
  auto* an = app.add_subcommand("analyze", "Time a full exact head-patching sweep, attribution and path patching on one "
                                           "clean/corrupt pair (random tokens)");
  auto* am = an->add_option("--model", aargs->model, "HF checkpoint directory");
  auto* ac = an->add_option("--config", aargs->config, "config.json: a model of that shape with random weights on the device");
  am->excludes(ac);
  ac->excludes(am);
  an->add_option("--device", aargs->device, "cpu or cuda[:N]")->capture_default_str();
  an->add_option("--dtype", aargs->dtype, "f32, bf16 or f16")->capture_default_str();
  an->add_option("--seq", aargs->seq, "Tokens T the model runs (prompt + answer - 1)")->capture_default_str();
  an->add_option("--diff", aargs->diff, "First position where clean and corrupt differ (-1: middle of the prompt)")
      ->capture_default_str();
  an->add_option("--answer-len", aargs->answer_len, "Answer tokens")->capture_default_str();
  an->add_option("--method", aargs->method, "activation, attribution, path or all")->capture_default_str();
  an->add_option("--max-batch", aargs->max_batch, "Variants per forward (0: from free memory)")->capture_default_str();
  an->add_option("--reference-heads", aargs->reference_heads,
                 "Also time this many heads with one forward each and extrapolate")->capture_default_str();
  an->add_option("--peak-tflops", aargs->peak_tflops, "Dense GEMM peak the FLOP floor is compared with")->capture_default_str();
  an->add_option("--iters", aargs->iters, "Timed repetitions (median)")->capture_default_str();
  an->add_option("--warmup", aargs->warmup, "Untimed repetitions first")->capture_default_str();
  an->add_option("--seed", aargs->seed, "Seed of weights and tokens")->capture_default_str();
  an->add_flag("--json", aargs->json, "Also print one JSON object");
  an->add_option("--profile", aargs->profile, "Write a Chrome trace of one more sweep and attribution to this file");
  auto rargs = std::make_shared<TrainBenchArgs>();
  auto* tr = app.add_subcommand("train", "Time one optimiser step of each training stage (tokens/s, peak memory) on a random "
                                         "model of a config's shape and its hybrid, and the teacher's forward");
  tr->add_option("--config", rargs->config, "config.json of the teacher's shape (random weights on the device)")->required();
  tr->add_option("--device", rargs->device, "cpu or cuda[:N]")->capture_default_str();
  tr->add_option("--dtype", rargs->dtype, "f32, bf16 or f16")->capture_default_str();
  tr->add_option("--seq", rargs->seq, "Sequence length")->capture_default_str();
  tr->add_option("--batch", rargs->batch, "Sequences per step")->capture_default_str();
  tr->add_option("--ratio", rargs->ratio, "LA:FA ratio r of the hybrid (r:1)")->capture_default_str();
  tr->add_option("--stages", rargs->stages, "align, distil, finetune and dense (the teacher's own training step)")
      ->capture_default_str();
  tr->add_option("--iters", rargs->iters, "Timed steps (median)")->capture_default_str();
  tr->add_option("--warmup", rargs->warmup, "Untimed steps first")->capture_default_str();
  tr->add_option("--seed", rargs->seed, "Seed of weights and tokens")->capture_default_str();
  add_dist_options(*tr, rargs->dist);   // with N ranks: --batch per rank, tokens/s over all of them
  tr->add_flag("--activation-checkpointing", rargs->checkpoint_layers,
               "Recompute each layer in the backward pass (distil and finetune: the student's; dense: the teacher's own)");
  tr->add_flag("--graph-ops", rargs->graph_ops,
               "On CUDA: the hybrid's LA heads' short convolution, RoPE and L2 norm as LibTorch ops with autograd "
               "instead of their kernels with CUDA backwards, for comparison");
  tr->add_flag("--optimizer-ops", rargs->optimizer_ops,
               "On CUDA: the gradient norm, clipping and AdamW as LibTorch ops on each tensor instead of one launch "
               "each over every tensor, for comparison");
  tr->add_option("--profile", rargs->profile,
                 "Write a Chrome trace of one more step of each stage, FILE with the stage's name before its extension "
                 "(trace.json -> trace-align.json)");
  tr->add_flag("--json", rargs->json, "Also print one JSON object");
  const BenchSub gdn = add_bench_gdn(app);
  return [args, targs, tk, aargs, an, rargs, tr, gdn] {
    if (gdn.command->parsed()) return gdn.run();
    if (tr->parsed()) return run_bench_train(*rargs);
    if (an->parsed()) return run_bench_analyze(*aargs);
    if (tk->parsed()) return run_bench_tokenize(*targs);
    return run_bench_forward(*args);
  };
}

}  // namespace hh::cli
