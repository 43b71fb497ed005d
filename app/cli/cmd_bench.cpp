// hydrahead bench forward --model DIR [--device cuda] [--dtype bf16] [--seq T] [--batch B] [--iters N]
#include <torch/torch.h>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "app/cli/commands.h"
#include "core/model/tokenizer.h"
#include "core/model/transformer.h"
#include "core/util/error.h"

namespace hh::cli {
namespace {

struct BenchArgs {
  std::string model, device = "cpu", dtype = "bf16";
  int64_t seq = 4096, batch = 1, iters = 10, warmup = 3;
  uint64_t seed = 0;
  bool json = false;
};

void sync(const at::Device& d) {
  if (d.is_cuda()) torch::cuda::synchronize(d.index());
}

int run_bench_forward(const BenchArgs& a) {
  if (a.seq < 1 || a.batch < 1 || a.iters < 1 || a.warmup < 0)
    throw Error("--seq, --batch and --iters must be positive and --warmup non-negative");
  const auto model = model::Transformer::load(a.model, a.device, a.dtype);
  const auto dev = model.device();
  torch::manual_seed(a.seed);
  const auto ids = torch::randint(model.config().vocab_size, {a.batch, a.seq},
                                  torch::TensorOptions().dtype(torch::kInt64)).to(dev);  // [B, T]
  torch::NoGradGuard no_grad;
  for (int64_t i = 0; i < a.warmup; ++i) (void)model.forward(ids);
  sync(dev);
  std::vector<double> ms;
  for (int64_t i = 0; i < a.iters; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    auto out = model.forward(ids);
    sync(dev);
    ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
  }
  std::sort(ms.begin(), ms.end());
  const double median = ms[ms.size() / 2];
  // Matmul FLOPs of one forward (2 per multiply-add): projections, MLP, causal attention, lm_head.
  const auto& c = model.config();
  const double T = static_cast<double>(a.seq), B = static_cast<double>(a.batch);
  const double proj = 2.0 * c.hidden_size * c.head_dim * (2.0 * c.num_attention_heads + 2.0 * c.num_key_value_heads);
  const double mlp = 2.0 * 3.0 * c.hidden_size * c.intermediate_size;
  const double attn = 2.0 * 2.0 * c.num_attention_heads * c.head_dim * (T + 1) / 2.0;
  const double flops = B * T * (c.num_hidden_layers * (proj + mlp + attn) + 2.0 * c.hidden_size * c.vocab_size);
  const double tflops = flops / (median * 1e-3) / 1e12;
  if (a.json) {
    nlohmann::json j = {{"what", "forward"}, {"device", a.device}, {"dtype", a.dtype}, {"batch", a.batch},
                        {"seq", a.seq}, {"iters", a.iters}, {"median_ms", median}, {"min_ms", ms.front()},
                        {"max_ms", ms.back()}, {"tflops", tflops}, {"tokens_per_s", B * T / (median * 1e-3)}};
    std::printf("%s\n", j.dump().c_str());
  } else {
    std::printf("forward  B=%lld T=%lld %s on %s: median %.2f ms (min %.2f, max %.2f), %.1f TFLOP/s, %.0f tokens/s\n",
                static_cast<long long>(a.batch), static_cast<long long>(a.seq), a.dtype.c_str(), a.device.c_str(),
                median, ms.front(), ms.back(), tflops, B * T / (median * 1e-3));
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

}  // namespace

Runner add_bench(CLI::App& app) {
  auto args = std::make_shared<BenchArgs>();
  app.require_subcommand(1);
  auto* fwd = app.add_subcommand("forward", "Time the model's forward pass (median of --iters after --warmup)");
  fwd->add_option("--model", args->model, "HF checkpoint directory")->required();
  fwd->add_option("--device", args->device, "cpu or cuda[:N]")->capture_default_str();
  fwd->add_option("--dtype", args->dtype, "f32, bf16 or f16")->capture_default_str();
  fwd->add_option("--seq", args->seq, "Sequence length T")->capture_default_str();
  fwd->add_option("--batch", args->batch, "Batch size B")->capture_default_str();
  fwd->add_option("--iters", args->iters, "Timed iterations")->capture_default_str();
  fwd->add_option("--warmup", args->warmup, "Untimed iterations first")->capture_default_str();
  fwd->add_option("--seed", args->seed, "Seed of the random token ids")->capture_default_str();
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
  return [args, targs, tk] {
    if (tk->parsed()) return run_bench_tokenize(*targs);
    return run_bench_forward(*args);
  };
}

}  // namespace hh::cli
