// hydrahead bench forward --model DIR [--device cuda] [--dtype bf16] [--seq T] [--batch B] [--iters N]
#include <torch/torch.h>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>

#include "app/cli/commands.h"
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
  return [args] { return run_bench_forward(*args); };
}

}  // namespace hh::cli
