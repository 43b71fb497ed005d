// `hydrahead bench gdn`: the LA heads' gated delta rule (our CUDA path against the LibTorch chunked
// reference), forward and forward + backward, and one attention layer of a hybrid against the dense
// teacher's attention at long context.
#include <torch/torch.h>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <functional>
#include <memory>
#include <optional>
#include <sstream>
#include <thread>
#include <type_traits>
#include <vector>

#include "app/cli/commands.h"
#include "core/attention/gdn.h"
#include "core/attention/hybrid_model.h"
#include "core/model/config.h"
#include "core/model/transformer.h"
#include "core/util/error.h"
#include "core/util/gpu_energy.h"
#ifdef HH_HAVE_KERNELS
#include "kernels/gdn.h"
#endif

namespace hh::cli {
namespace {

struct GdnBenchArgs {
  std::string device = "cuda", dtype = "bf16", shapes = "1x8192,1x32768,1x131072,4x8192";
  int64_t heads = 16, dim = 128, chunk = 64, iters = 10, warmup = 3;
  int64_t reference_max_seq = 32768;  // the LibTorch reference loops over chunks: skip it above this
  std::string layer_config, layer_shapes = "1x32768,1x131072";
  int64_t ratio = 7;
  bool json = false;
  uint64_t seed = 0;
  std::string profile;  // Chrome trace of one forward and one forward + backward at the first shape
  std::string scan_kernel = "lowrank";
  std::string history = "f16";
  bool output_apart = false;  // the output by a kernel of its own from the scan's history
  bool direct_apart = false;  // the backward's direct term by chunk_state_direct instead of in the reverse scan
  bool backward_chunks_in_turn = false;  // chunk_backward one block an SM taking chunks in turn, not one a chunk
  bool fusion_in_scan = false;  // the layer's fusion norm inside the scan that writes the output
  bool u_from_factors = false;  // chunk_factors forms U, which the forward's scan reads (not U from v)
  bool qk_from_factors = false;  // chunk_factors forms Qd and kdecay, which the scans read (not from q and k)
  bool factors_occupancy = false;  // chunk_factors alone and the forward at 4, 3, 2, 1 blocks an SM and in turn; its phases
  int64_t rest_ms = 50;  // the device idle this long before each timed figure (rest)
  std::string backward = "kernels";
  std::string scan_segments = "auto";
  std::string scan_columns = "auto";
  double gate_max = 0.5;  // per-token log decays g drawn from -U(0, gate_max)
  // The ceilings the achieved rates are set against: an H200's bf16 matrix product (8192^3 through
  // LibTorch) and its device-to-device copy (bytes read plus written), both measured.
  double peak_tflops = 813, peak_gbps = 4300;
};

struct Shape {
  int64_t B, T;
};

std::vector<Shape> parse_shapes(const std::string& s, const char* flag) {
  std::vector<Shape> out;
  std::stringstream ss(s);
  std::string item;
  while (std::getline(ss, item, ',')) {
    const auto x = item.find('x');
    try {
      if (x == std::string::npos) throw std::invalid_argument(item);
      out.push_back({std::stoll(item.substr(0, x)), std::stoll(item.substr(x + 1))});
    } catch (const std::exception&) {
      throw Error(std::string(flag) + ": expected BxT items such as 1x32768, got '" + item + "'");
    }
    if (out.back().B < 1 || out.back().T < 1) throw Error(std::string(flag) + ": B and T must be positive in '" + item + "'");
  }
  if (out.empty()) throw Error(std::string(flag) + " is empty");
  return out;
}

// Matmul FLOPs of the chunked forward (2 per multiply-add), per chunk and head: K K^T, Q K^T, the
// triangular solve for W and U (C^2 (Dk + Dv) / 2 each way), attn U, and W S, Q S, K^T U against the state.
double gdn_forward_flops(int64_t B, int64_t T, int64_t H, int64_t D, int64_t C) {
  const double n = static_cast<double>((T + C - 1) / C) * B * H, c = static_cast<double>(C), d = static_cast<double>(D);
  return 2.0 * n * (2 * c * c * d + c * c * d + c * c * d + 3 * c * d * d);
}

// The other paths a CUDA run also times, for a comparison in the same run: the forward's chunk-local
// part in LibTorch (the chunk kernels off), and the scan on TF32 products instead of block float16.
// kConvApart: the LA heads' short convolution as kernels of its own; kFactorsThreeBlocks: chunk_factors
// with the convolution inside at three blocks an SM instead of four; kOutputApart: the output formed by
// chunk_output_f16 (fused with the norm in the layer) from the scan's history instead of by the scan;
// kDirectApart: the backward's direct term by chunk_state_direct instead of in the reverse scan;
// kFusionInScan: the layer's fusion norm inside the scan that writes the output (a cluster of a head's
// column blocks) instead of by a kernel of its own after it; kScanColumnBlocks: the forward's scan in blocks of
// 32 state columns instead of a whole head a block with 16 columns a warp (kernels::set_scan_warp_columns);
// kFusionInColumnScan: the layer's fusion norm inside the column scan instead of by the fusion kernel after it;
// kScanWarpProducts: the column scan's products by warp (mma.sync) instead of by warpgroup (kernels::set_scan_wgmma);
// kBackwardChunksInTurn: chunk_backward one block an SM taking chunks in turn instead of one block a chunk
// (kernels::set_backward_chunks_in_turn); kUFromFactors: the forward's U (inference and training) formed by chunk_factors and read
// by the scan instead of formed by the scan from v and T diag(beta) (kernels::set_u_in_scan); kQkFromFactors: the
// forward's Qd and kdecay (inference and training, and then the backward's) formed by chunk_factors and read by the
// scans instead of formed by them from q's and k's rows (kernels::set_qk_in_scan).
enum class OtherPath {
  kLibTorchLocal,
  kTf32Scan,
  kConvApart,
  kFactorsThreeBlocks,
  kOutputApart,
  kDirectApart,
  kFusionInScan,
  kScanColumnBlocks,
  kFusionInColumnScan,
  kScanWarpProducts,
  kBackwardChunksInTurn,
  kUFromFactors,
  kQkFromFactors
};

// A process-wide setting at `value` (set and get: its setter and getter) for the object's lifetime.
template <class T>
class SettingFor {
 public:
  SettingFor(void (*set)(T), T (*get)(), T value) : set_(set), was_(get()) { set(value); }
  ~SettingFor() { set_(was_); }
  SettingFor(const SettingFor&) = delete;
  SettingFor& operator=(const SettingFor&) = delete;

 private:
  void (*set_)(T);
  T was_;
};

// fn() with a process-wide setting at `value` (SettingFor), restored after; nothing off CUDA or without the
// CUDA kernels, where the settings change nothing, so that no run is timed twice.
template <class T, class Fn>
auto with_setting(void (*set)(T), T (*get)(), T value, const at::Device& dev, Fn&& fn)
    -> std::optional<std::invoke_result_t<Fn>> {
#ifdef HH_HAVE_KERNELS
  if (!dev.is_cuda()) return std::nullopt;
  const SettingFor<T> setting(set, get, value);
  return fn();
#else
  (void)set, (void)get, (void)value, (void)dev, (void)fn;
  return std::nullopt;
#endif
}

// fn() with that path's process-wide switch off (with_setting).
template <class Fn>
auto on_other_path(OtherPath p, const at::Device& dev, Fn&& fn) -> std::optional<std::invoke_result_t<Fn>> {
#ifdef HH_HAVE_KERNELS
  switch (p) {
    case OtherPath::kLibTorchLocal: return with_setting(kernels::set_chunk_kernels, kernels::chunk_kernels_enabled, false, dev, fn);
    case OtherPath::kTf32Scan: return with_setting(kernels::set_block_f16_scan, kernels::block_f16_scan_enabled, false, dev, fn);
    case OtherPath::kConvApart: return with_setting(kernels::set_conv_in_factors, kernels::conv_in_factors_enabled, false, dev, fn);
    case OtherPath::kOutputApart: return with_setting(kernels::set_output_in_scan, kernels::output_in_scan_enabled, false, dev, fn);
    case OtherPath::kDirectApart: return with_setting(kernels::set_direct_in_scan, kernels::direct_in_scan_enabled, false, dev, fn);
    case OtherPath::kFusionInScan: return with_setting(kernels::set_fusion_in_scan, kernels::fusion_in_scan_enabled, true, dev, fn);
    case OtherPath::kFusionInColumnScan:
      return with_setting(kernels::set_fusion_in_column_scan, kernels::fusion_in_column_scan_enabled, true, dev, fn);
    case OtherPath::kScanColumnBlocks:
      return with_setting(kernels::set_scan_warp_columns, kernels::scan_warp_columns_enabled, false, dev, fn);
    case OtherPath::kScanWarpProducts:  // the same path twice where the device's code has no warpgroup products
      if (dev.is_cuda() && !kernels::scan_wgmma_available()) return std::nullopt;
      return with_setting(kernels::set_scan_wgmma, kernels::scan_wgmma_enabled, false, dev, fn);
    case OtherPath::kFactorsThreeBlocks:
      return with_setting(kernels::set_factors_four_blocks, kernels::factors_four_blocks_enabled, false, dev, fn);
    case OtherPath::kBackwardChunksInTurn:
      return with_setting(kernels::set_backward_chunks_in_turn, kernels::backward_chunks_in_turn_enabled, true, dev, fn);
    case OtherPath::kUFromFactors: return with_setting(kernels::set_u_in_scan, kernels::u_in_scan_enabled, false, dev, fn);
    case OtherPath::kQkFromFactors: return with_setting(kernels::set_qk_in_scan, kernels::qk_in_scan_enabled, false, dev, fn);
  }
#endif
  (void)p, (void)dev, (void)fn;
  return std::nullopt;
}

// fn() with the hybrid layer's FA heads' attention gated at `gate` (with_setting).
template <class Fn>
std::optional<double> on_flash_gate(attention::FlashGate gate, const at::Device& dev, Fn&& fn) {
  return with_setting(attention::set_flash_gate, attention::flash_gate, gate, dev, fn);
}

// Waits for the device, then leaves it idle for ms milliseconds, so that the runs timed next start below its
// power limit: timed runs queued back to back at full load for tens of milliseconds hold an H100 at its 700 W
// cap, its SM clock down from 1980 to 1635-1890 MHz, and a path timed right after another ran up to 10 %
// slower than after a pause (docs/BENCHMARKS.md v85). Nothing off CUDA, or for ms 0.
void rest(const at::Device& dev, int64_t ms) {
  if (!dev.is_cuda() || ms <= 0) return;
  sync_device(dev);
  std::this_thread::sleep_for(std::chrono::milliseconds(ms));
}

// median_ms or back_to_back_ms (app/cli/commands.h), or a row's windows of back_to_back_ms (below).
using Timer = std::function<double(const at::Device&, int64_t, int64_t, const std::function<void()>&)>;

// Windows of back-to-back runs behind each of a row's own b2b figures: a window that a host stall or a slow
// start stretches stays one figure of several, where a single window's mean would carry it whole.
constexpr int64_t kRowWindows = 3;

// Every figure of the bench: timer's time of fn (a.warmup runs, then a.iters) from a rested device (rest).
double rested(const Timer& timer, const at::Device& dev, const GdnBenchArgs& a, const std::function<void()>& fn) {
  rest(dev, a.rest_ms);
  return timer(dev, a.warmup, a.iters, fn);
}

// The median of v (the upper one of an even count), or nothing for none.
std::optional<double> median_of(std::vector<double> v) {
  if (v.empty()) return std::nullopt;
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// x with `decimals` decimals, or "-" for a figure not taken.
std::string figure(std::optional<double> x, int decimals) {
  if (!x) return "-";
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.*f", decimals, *x);
  return buf;
}

int run_bench_gdn(const GdnBenchArgs& a) {
  if (a.iters < 1 || a.warmup < 0 || a.heads < 1 || a.dim < 1 || a.chunk < 1)
    throw Error("--iters, --heads, --dim and --chunk must be positive and --warmup non-negative");
  if (!(a.peak_tflops > 0) || !(a.peak_gbps > 0)) throw Error("--peak-tflops and --peak-gbps must be positive");
  if (!(a.gate_max >= 0)) throw Error("--gate-max must be non-negative");
  if (a.ratio < 0) throw Error("--ratio must be non-negative (r LA heads to each FA head; 0: every head full attention)");
  // Everything the run will read, before the first timing: a bad layer shape or config must not wait
  // for minutes of the rule's benchmark to be reported.
  const std::vector<Shape> shapes = parse_shapes(a.shapes, "--shapes");
  std::optional<model::ModelConfig> layer_cfg;
  std::vector<Shape> layer_shapes;
  if (!a.layer_config.empty()) {
    layer_cfg = model::ModelConfig::load(a.layer_config);
    layer_shapes = parse_shapes(a.layer_shapes, "--layer-shapes");
  }
  int64_t segments = -1;  // auto
  if (a.scan_segments != "auto") {
    try {
      size_t used = 0;
      segments = std::stoll(a.scan_segments, &used);
      if (used != a.scan_segments.size() || segments < 0) throw std::invalid_argument(a.scan_segments);
    } catch (const std::exception&) {
      throw Error("--scan-segments: expected auto, 0 or a number of chunks, got '" + a.scan_segments + "'");
    }
  }
  const at::Device dev = model::parse_device(a.device);
  const auto dt = model::parse_dtype(a.dtype);
#ifdef HH_HAVE_KERNELS
  kernels::set_scan_segments(segments < 0 ? kernels::kAutoSegments : segments);
  kernels::set_scan_columns(a.scan_columns == "16" ? 16 : a.scan_columns == "32" ? 32 : 0);
  kernels::set_state_scan_kernel(a.scan_kernel == "fma"      ? kernels::ScanKernel::kFma
                                 : a.scan_kernel == "tensor" ? kernels::ScanKernel::kTensorCores
                                                             : kernels::ScanKernel::kLowRank);
  kernels::set_f16_history(a.history == "f16");
  kernels::set_output_in_scan(!a.output_apart);
  kernels::set_direct_in_scan(!a.direct_apart);
  kernels::set_backward_chunks_in_turn(a.backward_chunks_in_turn);
  kernels::set_fusion_in_scan(a.fusion_in_scan);
  kernels::set_u_in_scan(!a.u_from_factors);
  kernels::set_qk_in_scan(!a.qk_from_factors);
#endif
  attention::set_gdn_backward(a.backward == "autograd"   ? attention::GdnBackward::kAutograd
                              : a.backward == "explicit" ? attention::GdnBackward::kExplicit
                                                         : attention::GdnBackward::kKernels);
  const auto opts = torch::TensorOptions().dtype(dt).device(dev);
  torch::manual_seed(a.seed);
  nlohmann::json out = {{"device", a.device},
                         {"dtype", a.dtype},
                         {"heads", a.heads},
                         {"dim", a.dim},
                         {"history", a.history},
                         {"output_apart", a.output_apart},
                         {"direct_apart", a.direct_apart},
                         {"backward_chunks_in_turn", a.backward_chunks_in_turn},
                         {"fusion_in_scan", a.fusion_in_scan},
                         {"u_from_factors", a.u_from_factors},
                         {"qk_from_factors", a.qk_from_factors},
                         {"factors_occupancy", a.factors_occupancy},
                         {"rest_ms", a.rest_ms},
                         {"scan_kernel", a.scan_kernel},
                         {"scan_segments", a.scan_segments},
                         {"scan_columns", a.scan_columns},
                         {"backward", a.backward},
                         {"gate_max", a.gate_max},
                         {"peak_tflops", a.peak_tflops},
                         {"peak_gbps", a.peak_gbps},
                         {"rows", nlohmann::json::array()}};
  const double scale = 1.0 / std::sqrt(static_cast<double>(a.dim));
  std::printf("gated delta rule, H=%lld Dk=Dv=%lld, chunk %lld, %s on %s, g ~ -U(0, %g), scan segments %s, columns %s; "
              "median of %lld after %lld warm-up\n",
              static_cast<long long>(a.heads), static_cast<long long>(a.dim), static_cast<long long>(a.chunk),
              a.dtype.c_str(), a.device.c_str(), a.gate_max, a.scan_segments.c_str(), a.scan_columns.c_str(),
              static_cast<long long>(a.iters), static_cast<long long>(a.warmup));
  std::printf("  (b2b: ours with %lld runs queued back to back and one sync at the end, the time a run takes once\n"
              "   the host keeps ahead of the device, the median of three such windows (the JSON keeps each\n"
              "   window's); on CUDA, LT-local: the same forward with its chunk-local part in LibTorch instead of\n"
              "   the chunk kernels; TF32 scan: with the scan's products in TF32 instead of block float16;\n"
              "   out-apart b2b: back to back with the output formed by a kernel of its own from the\n"
              "   scan's history instead of by the scan, medians of three rounds alternating with ours; b2b f+b /\n"
              "   direct-apart: forward + backward back to back with the reverse scan forming its direct term\n"
              "   against chunk_state_direct forming it, likewise; the forward's rates against the\n"
              "   ceilings %g TFLOP/s and %g GB/s)\n",
              static_cast<long long>(a.iters), a.peak_tflops, a.peak_gbps);
  std::printf("  %-10s %12s %12s %9s %9s %10s %6s %10s %6s %14s %14s %18s %21s %14s %14s\n", "B x T", "fwd ms", "fwd+bwd ms",
              "b2b fwd", "b2b f+b", "TFLOP/s", "of", "GB/s", "of", "LT-local fwd", "TF32-scan fwd", "b2b fwd / out-apart",
              "b2b f+b / direct-apart", "ref fwd ms", "ref fwd+bwd ms");
  for (const Shape& s : shapes) {
    namespace F = torch::nn::functional;
    const auto nrm = F::NormalizeFuncOptions().dim(-1);
    const auto q = F::normalize(torch::randn({s.B, s.T, a.heads, a.dim}, opts.dtype(torch::kFloat)), nrm).to(dt);
    const auto k = F::normalize(torch::randn({s.B, s.T, a.heads, a.dim}, opts.dtype(torch::kFloat)), nrm).to(dt);
    const auto v = torch::randn({s.B, s.T, a.heads, a.dim}, opts);
    const auto g = (-a.gate_max * torch::rand({s.B, s.T, a.heads}, opts.dtype(torch::kFloat))).to(dt);
    const auto beta = torch::rand({s.B, s.T, a.heads}, opts);
    const auto dO = torch::randn_like(v);
    using Fn = std::function<attention::GdnOutput(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                                  const at::Tensor&, const at::Tensor&)>;
    const Fn ours = [&](auto& q_, auto& k_, auto& v_, auto& g_, auto& b_) {
      return attention::gdn_chunked_scan(q_, k_, v_, g_, b_, {}, scale, a.chunk);
    };
    const Fn reference = [&](auto& q_, auto& k_, auto& v_, auto& g_, auto& b_) {
      return attention::gdn_chunked(q_, k_, v_, g_, b_, {}, scale, a.chunk);
    };
    auto forward = [&](const Fn& fn, Timer timer = median_ms) {
      return rested(timer, dev, a, [&] {
        torch::NoGradGuard no_grad;
        (void)fn(q, k, v, g, beta);
      });
    };
    auto forward_backward = [&](const Fn& fn, Timer timer = median_ms) {
      std::vector<at::Tensor> leaves = {q.detach().requires_grad_(true), k.detach().requires_grad_(true),
                                        v.detach().requires_grad_(true), g.detach().requires_grad_(true),
                                        beta.detach().requires_grad_(true)};
      return rested(timer, dev, a, [&] {
        const auto r = fn(leaves[0], leaves[1], leaves[2], leaves[3], leaves[4]);
        torch::autograd::backward({r.o}, {dO});
        for (auto& l : leaves) l.mutable_grad() = at::Tensor();
      });
    };
    const double f = forward(ours), fb = forward_backward(ours);
    // The row's own back-to-back figures: the median of kRowWindows windows, each taken as any other figure
    // (rested, warmed up, then a.iters runs; rested() rests before the first), each window's mean kept in the
    // order taken, and beside it the host's part of it (BackToBack::host_ms).
    std::vector<double> f_windows, fb_windows, f_host, fb_host;
    auto windows_into = [&](std::vector<double>& out, std::vector<double>& host) -> Timer {
      return [&out, &host, &a](const at::Device& d, int64_t warmup, int64_t iters, const std::function<void()>& fn) {
        out.clear();
        host.clear();
        for (int64_t w = 0; w < kRowWindows; ++w) {
          if (w > 0) rest(d, a.rest_ms);
          const BackToBack b = back_to_back(d, warmup, iters, fn);
          out.push_back(b.ms);
          host.push_back(b.host_ms);
        }
        return *median_of(out);
      };
    };
    const double f_b2b = forward(ours, windows_into(f_windows, f_host)),
                 fb_b2b = forward_backward(ours, windows_into(fb_windows, fb_host));
    const std::optional<double> f_lt = on_other_path(OtherPath::kLibTorchLocal, dev, [&] { return forward(ours); });
    const std::optional<double> f_tf32 = on_other_path(OtherPath::kTf32Scan, dev, [&] { return forward(ours); });
    // fn() on the default path and on path p, alternating in three rounds (the device slows as it warms): the
    // medians of each; none off CUDA, or where `same` (a flag made p the path throughout).
    // Each side of a round starts from a rested device (rested).
    auto alternating = [&](OtherPath p, bool same, const std::function<double()>& fn) {
      std::vector<double> default_rounds, other_rounds;
      for (int round = 0; round < 3 && dev.is_cuda() && !same; ++round) {
        if (const auto t = on_other_path(p, dev, fn)) {
          other_rounds.push_back(*t);
          default_rounds.push_back(fn());
        }
      }
      return std::make_pair(median_of(default_rounds), median_of(other_rounds));
    };
    // The output in the scan against a kernel of its own, back to back; the backward's direct term in the
    // reverse scan against chunk_state_direct, forward + backward back to back.
    const auto [f_in_scan, f_apart] =
        alternating(OtherPath::kOutputApart, a.output_apart, [&] { return forward(ours, back_to_back_ms); });
    const auto [fb_direct_in, fb_direct_apart] =
        alternating(OtherPath::kDirectApart, a.direct_apart, [&] { return forward_backward(ours, back_to_back_ms); });
    // The forward's scan a whole head a block (the default) against blocks of 32 state columns: the forward,
    // and forward + backward (whose forward scan also writes the history the backward reads).
    const bool same_scan = a.output_apart || a.scan_columns != "auto";
    const auto [f_head, f_blocks] =
        alternating(OtherPath::kScanColumnBlocks, same_scan, [&] { return forward(ours, back_to_back_ms); });
    const auto [fb_head, fb_blocks] =
        alternating(OtherPath::kScanColumnBlocks, same_scan, [&] { return forward_backward(ours, back_to_back_ms); });
    // The column scan's products by warpgroup (the default) against by warp.
    const auto [f_wg, f_warp] = alternating(OtherPath::kScanWarpProducts, same_scan, [&] { return forward(ours, back_to_back_ms); });
    const auto [fb_wg, fb_warp] =
        alternating(OtherPath::kScanWarpProducts, same_scan, [&] { return forward_backward(ours, back_to_back_ms); });
    // The forward's scan forming U from v (the default) against reading chunk_factors' U: the inference forward,
    // and forward + backward (whose forward scan also writes the history); nothing where the forward never formed
    // U in the scan (column_scan_forms_u false), which would time one path twice.
#ifdef HH_HAVE_KERNELS
    const int64_t u_in_scan_before = kernels::u_in_scan_launches();
#endif
    const bool same_u = a.u_from_factors || same_scan;
    auto [f_u_scan, f_u_factors] = alternating(OtherPath::kUFromFactors, same_u, [&] { return forward(ours, back_to_back_ms); });
    auto [fb_u_scan, fb_u_factors] =
        alternating(OtherPath::kUFromFactors, same_u, [&] { return forward_backward(ours, back_to_back_ms); });
#ifdef HH_HAVE_KERNELS
    if (kernels::u_in_scan_launches() == u_in_scan_before) f_u_scan.reset(), f_u_factors.reset(), fb_u_scan.reset(), fb_u_factors.reset();
#endif
    // The forward's scans forming Qd and kdecay from q's and k's rows (the default; training's, and then the
    // backward's reverse scan, too) against reading chunk_factors': the inference forward, and forward + backward;
    // nothing where no scan read q and k (column_scan_reads_qk false).
#ifdef HH_HAVE_KERNELS
    const int64_t qk_in_scan_before = kernels::qk_in_scan_launches();
#endif
    auto [f_qk_scan, f_qk_factors] =
        alternating(OtherPath::kQkFromFactors, a.qk_from_factors || same_u, [&] { return forward(ours, back_to_back_ms); });
    auto [fb_qk_scan, fb_qk_factors] =
        alternating(OtherPath::kQkFromFactors, a.qk_from_factors || same_u, [&] { return forward_backward(ours, back_to_back_ms); });
#ifdef HH_HAVE_KERNELS
    if (kernels::qk_in_scan_launches() == qk_in_scan_before) f_qk_scan.reset(), f_qk_factors.reset(), fb_qk_scan.reset(), fb_qk_factors.reset();
#endif
    // chunk_backward one block a chunk (the default) against one block an SM taking chunks in turn; nothing
    // where the backward never reached the in-turn kernel (not the form that reads T with Dk = Dv = 128: other
    // head sizes or dtypes, the direct term apart, the backward off the kernels), which would time one path twice.
#ifdef HH_HAVE_KERNELS
    const int64_t in_turn_before = kernels::backward_chunks_in_turn_launches();
#endif
    auto [fb_each, fb_turns] = alternating(OtherPath::kBackwardChunksInTurn, a.backward_chunks_in_turn,
                                           [&] { return forward_backward(ours, back_to_back_ms); });
#ifdef HH_HAVE_KERNELS
    if (kernels::backward_chunks_in_turn_launches() == in_turn_before) fb_each.reset(), fb_turns.reset();
#endif
    if (!a.profile.empty() && out["rows"].empty()) {
      std::vector<at::Tensor> leaves = {q.detach().requires_grad_(true), k.detach().requires_grad_(true),
                                        v.detach().requires_grad_(true), g.detach().requires_grad_(true),
                                        beta.detach().requires_grad_(true)};
      profile_to(a.profile, [&] {
        {
          torch::NoGradGuard no_grad;
          (void)ours(q, k, v, g, beta);
        }
        const auto r = ours(leaves[0], leaves[1], leaves[2], leaves[3], leaves[4]);
        torch::autograd::backward({r.o}, {dO});
        sync_device(dev);
      });
    }
    const bool with_ref = s.T <= a.reference_max_seq;
    const double rf = with_ref ? forward(reference) : 0, rfb = with_ref ? forward_backward(reference) : 0;
    const double flops = gdn_forward_flops(s.B, s.T, a.heads, a.dim, a.chunk);
    const double bytes = static_cast<double>(s.B * s.T * a.heads) * (4.0 * a.dim + 2.0) * static_cast<double>(v.element_size());
    const std::string label = std::to_string(s.B) + " x " + std::to_string(s.T);
    auto ref = [&](double x) { return with_ref ? std::optional<double>(x) : std::nullopt; };
    const double tflops = flops / f * 1e-9, gbps = bytes / f * 1e-6;
    std::printf("  %-10s %12.3f %12.3f %9.3f %9.3f %10.1f %5.1f%% %10.0f %5.1f%% %14s %14s %18s %21s %14s %14s\n", label.c_str(),
                f, fb, f_b2b, fb_b2b, tflops, 100 * tflops / a.peak_tflops, gbps, 100 * gbps / a.peak_gbps,
                figure(f_lt, 3).c_str(), figure(f_tf32, 3).c_str(),
                (figure(f_in_scan, 3) + " / " + figure(f_apart, 3)).c_str(),
                (figure(fb_direct_in, 3) + " / " + figure(fb_direct_apart, 3)).c_str(), figure(ref(rf), 3).c_str(),
                figure(ref(rfb), 3).c_str());
    nlohmann::json row = {{"B", s.B},
                          {"T", s.T},
                          {"fwd_ms", f},
                          {"fwd_bwd_ms", fb},
                          {"fwd_b2b_ms", f_b2b},
                          {"fwd_bwd_b2b_ms", fb_b2b},
                          {"fwd_b2b_windows_ms", f_windows},
                          {"fwd_bwd_b2b_windows_ms", fb_windows},
                          {"fwd_b2b_host_windows_ms", f_host},
                          {"fwd_bwd_b2b_host_windows_ms", fb_host},
                          {"fwd_tflops", tflops},
                          {"fwd_gbps", gbps},
                          {"fwd_tflops_of_peak", tflops / a.peak_tflops},
                          {"fwd_gbps_of_peak", gbps / a.peak_gbps}};
    if (f_lt) row["fwd_local_libtorch_ms"] = *f_lt;
    if (f_tf32) row["fwd_tf32_scan_ms"] = *f_tf32;
    if (f_in_scan) row["fwd_output_in_scan_b2b_ms"] = *f_in_scan;
    if (f_apart) row["fwd_output_apart_b2b_ms"] = *f_apart;
    if (fb_direct_in) row["fwd_bwd_direct_in_scan_b2b_ms"] = *fb_direct_in;
    if (fb_direct_apart) row["fwd_bwd_direct_apart_b2b_ms"] = *fb_direct_apart;
    std::printf("  %-10s the host queues a run in %.3f ms forward, %.3f ms forward + backward (medians of the windows; where\n"
                "  %-10s near the b2b figures %.3f / %.3f ms, the host sets their pace)\n",
                "", *median_of(f_host), *median_of(fb_host), "", f_b2b, fb_b2b);
    // A line and four keys for a path alternated with the default (medians of three rounds, back to back).
    auto alternated = [&](std::optional<double> f0, std::optional<double> f1, std::optional<double> fb0, std::optional<double> fb1,
                          const std::string& key0, const std::string& key1, const char* paths) {
      if (!f0 || !f1 || !fb0 || !fb1) return;
      row["fwd_" + key0 + "_b2b_ms"] = *f0, row["fwd_" + key1 + "_b2b_ms"] = *f1;
      row["fwd_bwd_" + key0 + "_b2b_ms"] = *fb0, row["fwd_bwd_" + key1 + "_b2b_ms"] = *fb1;
      std::printf("  %-10s back to back, %s (medians of three alternating rounds): forward %.3f / %.3f ms, forward + backward "
                  "%.3f / %.3f ms\n",
                  "", paths, *f0, *f1, *fb0, *fb1);
    };
    alternated(f_head, f_blocks, fb_head, fb_blocks, "scan_head", "scan_column_blocks",
               "the forward's scan a head a block (default) / in blocks of 32 state columns");
    alternated(f_wg, f_warp, fb_wg, fb_warp, "scan_wgmma", "scan_mma_sync",
               "the column scan's products by warpgroup (default) / by warp");
    alternated(f_u_scan, f_u_factors, fb_u_scan, fb_u_factors, "u_in_scan", "u_from_factors",
               "the forward's scan forming U from v (default) / reading chunk_factors' U");
    alternated(f_qk_scan, f_qk_factors, fb_qk_scan, fb_qk_factors, "qk_in_scan", "qk_from_factors",
               "the scans forming Qd and kdecay from q and k (default) / reading chunk_factors'");
    if (fb_each && fb_turns) {
      row["fwd_bwd_backward_block_a_chunk_b2b_ms"] = *fb_each, row["fwd_bwd_backward_in_turn_b2b_ms"] = *fb_turns;
      std::printf("  %-10s back to back, chunk_backward one block a chunk (default) / one block an SM taking chunks in turn\n"
                  "  %-10s (medians of three alternating rounds): forward + backward %.3f / %.3f ms\n",
                  "", "", *fb_each, *fb_turns);
    }
#ifdef HH_HAVE_KERNELS
    // chunk_factors alone (the form that forms U, as the forward with U from chunk_factors calls it) and that
    // forward, back to back, at each cap on its blocks an SM: how a chunk's factors take longer as fewer blocks
    // share an SM, which bounds what a kernel forming them where it scans (one block a piece of a head) could
    // reach. (Chunks in turn form U in chunk_factors, so the forward reads U from it throughout here.)
    if (a.factors_occupancy && dev.is_cuda() && (dt == torch::kBFloat16 || dt == torch::kHalf) &&
        kernels::chunk_forward_supported(a.dim, a.dim, dt) && a.chunk == 64) {
      const SettingFor<bool> u_from_factors(kernels::set_u_in_scan, kernels::u_in_scan_enabled, false);
      const int64_t per = (s.T + 63) / 64, N = s.B * per;
      const kernels::ChunkGrid grid{N, per, {}};
      auto factors = [&] {
        return rested(back_to_back_ms, dev, a, [&] {
          (void)kernels::chunk_factors(k, v, g, beta, grid, q, scale, nullptr, kernels::UForm::kFloat16Columns, false);
        });
      };
      // The settings timed, in three rounds: at most 4 (as built: 0, as many as fit), 3, 2 and 1 blocks a chunk
      // an SM; then 1 and 2 blocks an SM taking chunks in turn, each chunk's loads landing during the one before.
      struct Setting {
        void (*set)(int);
        int (*get)();
        int value;
      };
      const std::vector<Setting> settings = {{kernels::set_factors_blocks_per_sm, kernels::factors_blocks_per_sm, 0},
                                             {kernels::set_factors_blocks_per_sm, kernels::factors_blocks_per_sm, 3},
                                             {kernels::set_factors_blocks_per_sm, kernels::factors_blocks_per_sm, 2},
                                             {kernels::set_factors_blocks_per_sm, kernels::factors_blocks_per_sm, 1},
                                             {kernels::set_factors_in_turn, kernels::factors_in_turn, 1},
                                             {kernels::set_factors_in_turn, kernels::factors_in_turn, 2}};
      constexpr size_t kCaps = 4;  // settings[0 .. 3] one block a chunk, then chunks in turn
      std::vector<std::vector<double>> alone(settings.size()), fwd(settings.size());
      std::vector<int> held(settings.size(), 0);
      for (int round = 0; round < 3; ++round) {
        for (size_t i = 0; i < settings.size(); ++i) {
          const auto t = with_setting(settings[i].set, settings[i].get, settings[i].value, dev, [&] {
            const double f_alone = factors();
            held[i] = kernels::factors_resident_blocks();
            return std::make_pair(f_alone, forward(ours, back_to_back_ms));
          });
          if (t) alone[i].push_back(t->first), fwd[i].push_back(t->second);
        }
      }
      // Each setting's figures as "a / b / ..." for settings [from, to), and a block's time on its chunk
      // (the kernel's time x blocks an SM x SMs / chunks).
      const double slots_per_chunk = static_cast<double>(kernels::device_sms()) / static_cast<double>(N * a.heads);
      std::vector<double> chunk_us(settings.size());
      struct Lines {
        std::string blocks, alone, fwd, chunk;
      };
      auto lines = [&](size_t from, size_t to, const char* key) {
        Lines l;
        nlohmann::json js = nlohmann::json::array();
        for (size_t i = from; i < to; ++i) {
          const double fa = *median_of(alone[i]), ff = *median_of(fwd[i]);
          chunk_us[i] = 1e3 * fa * held[i] * slots_per_chunk;
          const std::string sep = i == from ? "" : " / ";
          l.blocks += sep + std::to_string(held[i]);
          l.alone += sep + figure(fa, 3), l.fwd += sep + figure(ff, 3), l.chunk += sep + figure(chunk_us[i], 1);
          js.push_back({{"blocks_an_sm", held[i]}, {"factors_b2b_ms", fa}, {"fwd_b2b_ms", ff}, {"block_us_a_chunk", chunk_us[i]}});
        }
        row[key] = js;
        return l;
      };
      const Lines caps = lines(0, kCaps, "factors_occupancy"), turns = lines(kCaps, settings.size(), "factors_in_turn");
      std::printf("  %-10s chunk_factors at %s blocks an SM, back to back (medians of three rounds): alone %s ms, the\n"
                  "  %-10s forward %s ms; a block's time on its chunk %s us\n",
                  "", caps.blocks.c_str(), caps.alone.c_str(), "", caps.fwd.c_str(), caps.chunk.c_str());
      std::printf("  %-10s chunk_factors taking chunks in turn at %s blocks an SM (each chunk's loads landing during\n"
                  "  %-10s the one before): alone %s ms, the forward %s ms; a block's time on its chunk %s us\n",
                  "", turns.blocks.c_str(), "", turns.alone.c_str(), turns.fwd.c_str(), turns.chunk.c_str());
      // One more run in turn at one block an SM with the phases' clocks: each phase's share of a chunk's
      // cycles, and that share of the chunk's time above.
      kernels::FactorsPhases ph;
      with_setting(kernels::set_factors_in_turn, kernels::factors_in_turn, 1, dev, [&] {
        kernels::set_factors_phase_clocks(true);
        (void)kernels::chunk_factors(k, v, g, beta, grid, q, scale, nullptr, kernels::UForm::kFloat16Columns, false);
        ph = kernels::factors_turn_phases();
        kernels::set_factors_phase_clocks(false);
        return 0;
      });
      double total = 0;
      for (double c : ph.cycles) total += c;
      if (ph.chunks > 0 && total > 0) {
        static const char* names[kernels::kFactorsPhases] = {"Aq, Qd and L", "L's inverse", "W and V's wait", "the split",
                                                             "U and the next chunk's rows"};
        std::string line;
        nlohmann::json phases = nlohmann::json::array();
        for (int i = 0; i < kernels::kFactorsPhases; ++i) {
          const double share = ph.cycles[i] / total;
          line += std::string(i ? "; " : "") + names[i] + " " + figure(share * chunk_us[kCaps], 2) + " us";
          phases.push_back({{"phase", names[i]}, {"cycles", ph.cycles[i]}, {"share", share}});
        }
        row["factors_in_turn_phases"] = phases;
        std::printf("  %-10s a chunk's phases at one block an SM in turn (%.0f cycles, shares of %.1f us): %s\n", "", total,
                    chunk_us[kCaps], line.c_str());
      }
    }
#endif
    if (with_ref) row["ref_fwd_ms"] = rf, row["ref_fwd_bwd_ms"] = rfb;
    out["rows"].push_back(row);
  }

  if (layer_cfg) {
    // One attention layer of a config's shape (random weights, a tiny vocabulary: the embedding is not
    // used), dense against its hybrid at LA:FA = ratio:1, both up to the per-head outputs (o_proj
    // excluded from both).
    model::ModelConfig cfg = *layer_cfg;
    cfg.num_hidden_layers = 1;
    cfg.vocab_size = 256;
    model::Weights w = model::random_weights(cfg, a.seed, torch::kFloat, 0.02);
    for (const auto& e : model::weight_table(cfg, w)) *e.slot = e.slot->to(dev, dt);
    if (cfg.tie_word_embeddings) w.lm_head = at::Tensor();  // the constructor ties it to the moved embedding
    const model::Transformer teacher(cfg, w);
    select::Manifest manifest;
    manifest.model = select::shape_of(cfg, "");
    const int64_t per_layer = std::max<int64_t>(1, cfg.num_attention_heads / (a.ratio + 1));
    for (int64_t k = 0; k < per_layer; ++k) manifest.fa_heads.emplace_back(0, k * cfg.num_attention_heads / per_layer);
    attention::ConvertOptions co;
    co.seed = a.seed;
    const attention::HybridModel hybrid = attention::convert(teacher, manifest, co);
    const auto& lw = teacher.weights().layers[0];
    const int64_t Hq = cfg.num_attention_heads, Hkv = cfg.num_key_value_heads, Dh = cfg.head_dim;
    const double eps = cfg.rms_norm_eps, sc = 1.0 / std::sqrt(static_cast<double>(Dh));
    std::printf("attention layer of %s (d=%lld, Hq=%lld, Hkv=%lld, Dh=%lld), hybrid %lld FA + %lld LA heads:\n",
                a.layer_config.c_str(), static_cast<long long>(cfg.hidden_size), static_cast<long long>(Hq),
                static_cast<long long>(Hkv), static_cast<long long>(Dh), static_cast<long long>(per_layer),
                static_cast<long long>(Hq - per_layer));
    std::printf("  (each side's runs in a block of their own after its warm-up, each synced; b2b: each side's runs\n"
                "   queued back to back, one sync at the end, as in a model's stack of layers)\n");
    std::printf("  (1-stream b2b: the hybrid back to back with its FA and LA heads one after the other on one\n"
                "   stream instead of side by side on two; conv-apart b2b: back to back with the LA heads' short\n"
                "   convolution as kernels of its own instead of inside chunk_factors; cf 4 / 3 b2b: back to back\n"
                "   with chunk_factors at four (the default) or three blocks an SM; ungated / after-scan b2b: back\n"
                "   to back with the FA heads' attention started once its inputs are formed, or after the LA\n"
                "   heads' scan, instead of after their chunk_factors; out-apart b2b: back to back with the LA\n"
                "   heads' output and its norm formed by a kernel of their own from the scan's history instead of\n"
                "   by the scan; these are medians of three rounds that alternate them with the default; CUDA only)\n");
    std::printf("  %-10s %14s %14s %10s %11s %11s %8s %14s %15s %14s %14s %15s %26s %15s\n", "B x T", "dense ms", "hybrid ms",
                "speed-up", "dense b2b", "hybrid b2b", "b2b x", "1-stream b2b", "conv-apart b2b", "LT-local ms",
                "TF32-scan ms", "cf 4 / 3 b2b", "ungated / after-scan b2b", "out-apart b2b");
    out["layer"] = nlohmann::json::array();
    // Sustained: each side back to back for about two seconds, longer than the one-second window over
    // which a GPU averages its power, so that under a power limit both sides run at the clock the limit
    // holds (ten back-to-back calls of a short layer end before it bites). Where NVML reads the device,
    // also the energy a call (the device updates its counter every 20-100 ms); at the limit, time
    // follows energy.
    std::optional<util::GpuEnergy> energy;  // CUDA only: the driver's library is not loaded for a CPU run
    if (dev.is_cuda()) {
      energy.emplace(static_cast<unsigned>(std::max<int>(0, dev.index())));
      if (!energy->available()) std::printf("  (no energy figures: %s)\n", energy->why_unavailable().c_str());
    }
    struct Sustained {
      double ms;                            // a call, over the batch
      std::optional<double> joules, watts;  // a call's, and the mean power over the batch
    };
    auto sustained = [&](const std::function<void()>& run, double ms) -> std::optional<Sustained> {
      if (!dev.is_cuda()) return std::nullopt;
      const int n = std::max(10, static_cast<int>(std::ceil(2000.0 / std::max(ms, 0.01))));
      rest(dev, a.rest_ms);
      const auto t0 = std::chrono::steady_clock::now();
      const std::optional<uint64_t> e0 = energy->millijoules();
      for (int i = 0; i < n; ++i) run();
      sync_device(dev);
      const std::optional<uint64_t> e1 = energy->millijoules();
      const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      Sustained r{seconds * 1e3 / n, std::nullopt, std::nullopt};
      if (e0 && e1 && *e1 >= *e0) {
        const double joules = static_cast<double>(*e1 - *e0) * 1e-3;
        r.joules = joules / n, r.watts = joules / seconds;
      }
      return r;
    };
    for (const Shape& s : layer_shapes) {
      torch::NoGradGuard no_grad;
      const auto x = torch::randn({s.B, s.T, cfg.hidden_size}, opts);
      const auto xn = model::rms_norm(x, lw.input_layernorm, eps);
      const std::function<void()> dense_run = [&] {
        // As the transformer's own layer runs it: q/k norm + RoPE through the fused kernel where it applies,
        // one build of the RoPE tables for both (as the hybrid layer builds one for all its heads).
        const auto [cos, sin] = model::rope_cos_sin(teacher.inv_freq().to(xn.device()), 0, s.T, xn.scalar_type());
        const auto q = model::norm_rotary(at::linear(xn, lw.q_proj).view({s.B, s.T, Hq, Dh}), lw.q_norm, eps, cos, sin);
        const auto k = model::norm_rotary(at::linear(xn, lw.k_proj).view({s.B, s.T, Hkv, Dh}), lw.k_norm, eps, cos, sin);
        const auto v = at::linear(xn, lw.v_proj).view({s.B, s.T, Hkv, Dh});
        (void)model::causal_attention(q, k, v, sc);
      };
      const std::function<void()> hybrid_run = [&] {
        (void)attention::hybrid_attention(cfg, hybrid.options(), hybrid.splits()[0], lw, hybrid.layers()[0], xn,
                                          teacher.inv_freq());
      };
      const std::function<void()> hybrid_one_stream = [&] {
        (void)attention::hybrid_attention(cfg, hybrid.options(), hybrid.splits()[0], lw, hybrid.layers()[0], xn,
                                          teacher.inv_freq(), true, nullptr, /*side_by_side=*/false);
      };
      auto hybrid_ms = [&] { return rested(median_ms, dev, a, hybrid_run); };
      // Each side in a block of its own: with the runs alternating, every hybrid run followed a dense run
      // at full load and took about 2.5 ms more at 128K than hybrid runs following each other.
      const double dense = rested(median_ms, dev, a, dense_run), hyb = hybrid_ms(), speedup = dense / hyb;
      const double dense_b2b = rested(back_to_back_ms, dev, a, dense_run),
                   hyb_b2b = rested(back_to_back_ms, dev, a, hybrid_run), speedup_b2b = dense_b2b / hyb_b2b;
      const std::optional<double> hyb_lt = on_other_path(OtherPath::kLibTorchLocal, dev, hybrid_ms),
                                  hyb_tf32 = on_other_path(OtherPath::kTf32Scan, dev, hybrid_ms);
      std::optional<double> hyb_one_b2b;
      if (dev.is_cuda()) hyb_one_b2b = rested(back_to_back_ms, dev, a, hybrid_one_stream);
      const std::optional<double> hyb_conv_apart_b2b =
          on_other_path(OtherPath::kConvApart, dev, [&] { return rested(back_to_back_ms, dev, a, hybrid_run); });
      // chunk_factors at four blocks an SM against three, and the FA heads' attention gated on
      // chunk_factors against on its inputs alone, alternating with the default: the device slows as it
      // warms up.
      std::vector<double> four, three, ungated, after_scan, out_apart, fusion_default, fusion_in, fusion_col, one_default, one_in,
          head_scan, block_scan, wg_scan, warp_scan;
      for (int round = 0; round < 3 && dev.is_cuda(); ++round) {
        four.push_back(rested(back_to_back_ms, dev, a, hybrid_run));
        if (const auto t = on_other_path(OtherPath::kFactorsThreeBlocks, dev,
                                         [&] { return rested(back_to_back_ms, dev, a, hybrid_run); }))
          three.push_back(*t);
        auto b2b = [&] { return rested(back_to_back_ms, dev, a, hybrid_run); };
        if (const auto t = on_flash_gate(attention::FlashGate::kInputs, dev, b2b)) ungated.push_back(*t);
        if (const auto t = on_flash_gate(attention::FlashGate::kScan, dev, b2b)) after_scan.push_back(*t);
        const auto t = a.output_apart ? std::nullopt : on_other_path(OtherPath::kOutputApart, dev, b2b);  // else the default
        if (t) out_apart.push_back(*t);
        if (!a.output_apart && a.scan_columns == "auto") {  // the scan a head a block against blocks of 32 columns
          head_scan.push_back(b2b());
          if (const auto f = on_other_path(OtherPath::kScanColumnBlocks, dev, b2b)) block_scan.push_back(*f);
          wg_scan.push_back(b2b());  // and its products by warpgroup against by warp
          if (const auto f = on_other_path(OtherPath::kScanWarpProducts, dev, b2b)) warp_scan.push_back(*f);
        }
        if (!a.fusion_in_scan && !a.output_apart) {  // else that is the default, or (the output apart) no path
          fusion_default.push_back(b2b());
          if (const auto f = on_other_path(OtherPath::kFusionInScan, dev, b2b)) fusion_in.push_back(*f);
          if (a.scan_columns == "auto")  // the fusion inside the column scan
            if (const auto f = on_other_path(OtherPath::kFusionInColumnScan, dev, b2b)) fusion_col.push_back(*f);
          // The same on one stream, where the scan's clusters need not wait for SMs flash attention holds.
          auto one = [&] { return rested(back_to_back_ms, dev, a, hybrid_one_stream); };
          one_default.push_back(one());
          if (const auto f = on_other_path(OtherPath::kFusionInScan, dev, one)) one_in.push_back(*f);
        }
      }
      const std::optional<double> cf_four = median_of(four), cf_three = median_of(three), fa_ungated = median_of(ungated),
                                  fa_after_scan = median_of(after_scan), output_apart = median_of(out_apart),
                                  fused_in = median_of(fusion_in), fused_default = median_of(fusion_default),
                                  fused_col = median_of(fusion_col), one_fused_in = median_of(one_in),
                                  one_fused_default = median_of(one_default),
                                  scan_head = median_of(head_scan), scan_blocks = median_of(block_scan),
                                  scan_wg = median_of(wg_scan), scan_warp = median_of(warp_scan);
      const std::optional<Sustained> dense_e = sustained(dense_run, dense_b2b), hyb_e = sustained(hybrid_run, hyb_b2b);
      // The same for the hybrid with its output apart (kernels::set_output_in_scan): under a power limit the
      // energy a call is the figure that decides.
      const std::optional<Sustained> hyb_apart_e =
          a.output_apart ? std::nullopt
                         : on_other_path(OtherPath::kOutputApart, dev, [&] { return *sustained(hybrid_run, hyb_b2b); });
      // And with the scan in blocks of 32 columns (kernels::set_scan_warp_columns off).
      const std::optional<Sustained> hyb_blocks_e =
          a.output_apart || a.scan_columns != "auto"
              ? std::nullopt
              : on_other_path(OtherPath::kScanColumnBlocks, dev, [&] { return *sustained(hybrid_run, hyb_b2b); });
      // And with the fusion norm inside the column scan (kernels::set_fusion_in_column_scan).
      const std::optional<Sustained> hyb_fusion_col_e =
          a.fusion_in_scan || a.output_apart || a.scan_columns != "auto"
              ? std::nullopt
              : on_other_path(OtherPath::kFusionInColumnScan, dev, [&] { return *sustained(hybrid_run, hyb_b2b); });
      // And with the fusion norm inside the cluster scan (kernels::set_fusion_in_scan).
      const std::optional<Sustained> hyb_fusion_in_e =
          a.fusion_in_scan || a.output_apart
              ? std::nullopt
              : on_other_path(OtherPath::kFusionInScan, dev, [&] { return *sustained(hybrid_run, hyb_b2b); });
      const std::string label = std::to_string(s.B) + " x " + std::to_string(s.T);
      std::printf("  %-10s %14.2f %14.2f %9.2fx %11.2f %11.2f %7.2fx %14s %15s %14s %14s %15s %26s %15s\n", label.c_str(), dense,
                  hyb, speedup, dense_b2b, hyb_b2b, speedup_b2b, figure(hyb_one_b2b, 2).c_str(),
                  figure(hyb_conv_apart_b2b, 2).c_str(), figure(hyb_lt, 2).c_str(), figure(hyb_tf32, 2).c_str(),
                  (figure(cf_four, 2) + " / " + figure(cf_three, 2)).c_str(),
                  (figure(fa_ungated, 2) + " / " + figure(fa_after_scan, 2)).c_str(), figure(output_apart, 2).c_str());
      nlohmann::json layer = {{"B", s.B},          {"T", s.T},         {"dense_ms", dense},
                              {"hybrid_ms", hyb},  {"speedup", speedup}, {"dense_b2b_ms", dense_b2b},
                              {"hybrid_b2b_ms", hyb_b2b}, {"speedup_b2b", speedup_b2b}};
      if (hyb_one_b2b) layer["hybrid_one_stream_b2b_ms"] = *hyb_one_b2b;
      if (hyb_conv_apart_b2b) layer["hybrid_conv_apart_b2b_ms"] = *hyb_conv_apart_b2b;
      if (hyb_lt) layer["hybrid_local_libtorch_ms"] = *hyb_lt;
      if (hyb_tf32) layer["hybrid_tf32_scan_ms"] = *hyb_tf32;
      if (cf_four) layer["hybrid_factors_four_blocks_b2b_ms"] = *cf_four;
      if (cf_three) layer["hybrid_factors_three_blocks_b2b_ms"] = *cf_three;
      if (fa_ungated) layer["hybrid_flash_ungated_b2b_ms"] = *fa_ungated;
      if (fa_after_scan) layer["hybrid_flash_after_scan_b2b_ms"] = *fa_after_scan;
      if (output_apart) layer["hybrid_output_apart_b2b_ms"] = *output_apart;
      if (scan_head && scan_blocks) {
        layer["hybrid_scan_head_b2b_ms"] = *scan_head, layer["hybrid_scan_column_blocks_b2b_ms"] = *scan_blocks;
        std::printf("  %-10s the scan a head a block (default) / in blocks of 32 state columns, back to back (medians of "
                    "three alternating rounds): %.2f / %.2f ms\n",
                    "", *scan_head, *scan_blocks);
      }
      if (scan_wg && scan_warp) {
        layer["hybrid_scan_wgmma_b2b_ms"] = *scan_wg, layer["hybrid_scan_mma_sync_b2b_ms"] = *scan_warp;
        std::printf("  %-10s the column scan's products by warpgroup (default) / by warp, back to back (medians of three "
                    "alternating rounds): %.2f / %.2f ms\n",
                    "", *scan_wg, *scan_warp);
      }
      if (fused_in && fused_default) {
        layer["hybrid_fusion_apart_b2b_ms"] = *fused_default, layer["hybrid_fusion_in_cluster_scan_b2b_ms"] = *fused_in;
        std::printf("  %-10s fusion norm apart (default) / in the cluster scan", "");
        if (fused_col) std::printf(" / in the column scan");
        std::printf(", back to back (medians of three alternating rounds): %.2f / %.2f", *fused_default, *fused_in);
        if (fused_col) layer["hybrid_fusion_in_column_scan_b2b_ms"] = *fused_col, std::printf(" / %.2f", *fused_col);
        std::printf(" ms");
        if (one_fused_in && one_fused_default) {
          layer["hybrid_one_stream_fusion_apart_b2b_ms"] = *one_fused_default;
          layer["hybrid_one_stream_fusion_in_cluster_scan_b2b_ms"] = *one_fused_in;
          std::printf("; on one stream %.2f / %.2f ms", *one_fused_default, *one_fused_in);
        }
#ifdef HH_HAVE_KERNELS
        if (kernels::scan_output_fusion_supported(Dh, Dh)) {
          const int cs = static_cast<int>(Dh / 32);
          const int64_t at_once = kernels::fused_scan_slots(cs);
          layer["fusion_in_scan_blocks_at_once"] = at_once;
          std::printf("; the scan's clusters of %d place %lld blocks at once", cs, static_cast<long long>(at_once));
        }
#endif
        std::printf("\n");
      }
      if (dense_e && hyb_e) {
        layer["dense_sustained_ms"] = dense_e->ms, layer["hybrid_sustained_ms"] = hyb_e->ms;
        layer["speedup_sustained"] = dense_e->ms / hyb_e->ms;
        std::printf("  %-10s sustained, back to back for 2 s: dense %.2f ms, hybrid %.2f ms, x%.2f", "", dense_e->ms, hyb_e->ms,
                    dense_e->ms / hyb_e->ms);
        if (dense_e->joules && hyb_e->joules) {
          layer["dense_j"] = *dense_e->joules, layer["hybrid_j"] = *hyb_e->joules;
          layer["dense_w"] = *dense_e->watts, layer["hybrid_w"] = *hyb_e->watts;
          std::printf("; energy a call: dense %.3f J at %.0f W, hybrid %.3f J at %.0f W, ratio %.2f", *dense_e->joules,
                      *dense_e->watts, *hyb_e->joules, *hyb_e->watts, *dense_e->joules / *hyb_e->joules);
        }
        // The hybrid on another path: its time a call and energy, as JSON hybrid_<key>_sustained_ms and _j.
        auto other = [&](const std::optional<Sustained>& e, const std::string& key, const char* label) {
          if (!e) return;
          layer["hybrid_" + key + "_sustained_ms"] = e->ms;
          std::printf("; %s: %.2f ms", label, e->ms);
          if (e->joules) {
            layer["hybrid_" + key + "_j"] = *e->joules;
            std::printf(", %.3f J", *e->joules);
          }
        };
        other(hyb_fusion_col_e, "fusion_in_column_scan", "fusion in the column scan");
        other(hyb_fusion_in_e, "fusion_in_scan", "fusion in the cluster scan");
        other(hyb_blocks_e, "scan_column_blocks", "scan in blocks of 32 columns");
        other(hyb_apart_e, "output_apart", "output apart");
        std::printf("\n");
      }
      out["layer"].push_back(layer);
      if (!a.profile.empty() && out["layer"].size() == layer_shapes.size()) {
        // The hybrid layer at the last (longest) shape, in a trace of its own beside --profile's: on one
        // stream, so that each kernel's time is its own (side by side they share the device).
        std::filesystem::path lp(a.profile);
        lp.replace_filename(lp.stem().string() + "-layer" + lp.extension().string());
        profile_to(lp.string(), [&] {
          hybrid_one_stream();
          sync_device(dev);
        });
        // And as it runs by default, the LA heads beside the FA heads, for where the two streams overlap.
        if (dev.is_cuda()) {
          lp.replace_filename(std::filesystem::path(a.profile).stem().string() + "-layer-streams" + lp.extension().string());
          profile_to(lp.string(), [&] {
            hybrid_run();
            sync_device(dev);
          });
        }
      }
    }
  }
  if (a.json) std::printf("%s\n", out.dump().c_str());
  return kExitOk;
}

}  // namespace

BenchSub add_bench_gdn(CLI::App& bench) {
  auto a = std::make_shared<GdnBenchArgs>();
  auto* c = bench.add_subcommand("gdn", "Time the gated delta rule of the LA heads (forward, forward + backward) against the "
                                        "LibTorch chunked reference, and optionally one hybrid attention layer against "
                                        "the dense one");
  c->add_option("--device", a->device, "cuda[:N] (cpu works, slowly)")->capture_default_str();
  c->add_option("--dtype", a->dtype, "bf16, f16 or f32 inputs (the state is float32)")->capture_default_str();
  c->add_option("--shapes", a->shapes, "Comma-separated BxT sizes")->capture_default_str();
  c->add_option("--heads", a->heads, "Heads H")->capture_default_str();
  c->add_option("--dim", a->dim, "Head dimension Dk = Dv")->capture_default_str();
  c->add_option("--chunk", a->chunk, "Chunk length")->capture_default_str();
  c->add_option("--reference-max-seq", a->reference_max_seq, "Time the LibTorch reference only up to this T")
      ->capture_default_str();
  c->add_option("--layer-config", a->layer_config,
                "config.json: also time one attention layer of this shape, dense vs hybrid (random weights)");
  c->add_option("--layer-shapes", a->layer_shapes, "BxT sizes of the layer comparison")->capture_default_str();
  c->add_option("--ratio", a->ratio, "LA:FA ratio r of the hybrid layer (r:1)")->capture_default_str();
  c->add_option("--iters", a->iters, "Timed repetitions (median)")->capture_default_str();
  c->add_option("--warmup", a->warmup, "Untimed repetitions first")->capture_default_str();
  c->add_option("--seed", a->seed, "Seed of the random inputs")->capture_default_str();
  c->add_flag("--json", a->json, "Also print one JSON object");
  c->add_option("--peak-tflops", a->peak_tflops,
                "The matrix-unit ceiling the forward's TFLOP/s is set against (default: an H200's bf16 matrix "
                "product, 8192^3, measured)")
      ->capture_default_str();
  c->add_option("--peak-gbps", a->peak_gbps,
                "The memory ceiling the forward's GB/s (its inputs read and output written once) is set against "
                "(default: an H200's device-to-device copy, bytes read plus written, measured)")
      ->capture_default_str();
  c->add_option("--scan-kernel", a->scan_kernel,
                 "The state scan's CUDA kernel: lowrank (on the transition's factors), or tensor (TF32 x3) / fma "
                 "on the materialised transition")
      ->check(CLI::IsMember({"lowrank", "tensor", "fma"}))
      ->capture_default_str();
  c->add_flag("--output-apart", a->output_apart,
              "On CUDA with 16-bit inputs, form the output (and in the layer its fusion norm) with a kernel of its own "
              "from the scan's block float16 history, instead of in the scan itself");
  c->add_flag("--u-from-factors", a->u_from_factors,
              "On CUDA with 16-bit inputs, have chunk_factors form each chunk's U and the forward's scan (inference and training) "
              "read it, instead of the scan forming U from v and T diag(beta)");
  c->add_flag("--qk-from-factors", a->qk_from_factors,
              "On CUDA with 16-bit inputs, have chunk_factors form each chunk's Qd = scale e^G q and kdecay = e^{G_C - G} k "
              "and the forward's scans (inference and training) and the backward's reverse scan read them, instead of the scans "
              "forming both from q's and k's rows");
  c->add_flag("--direct-apart", a->direct_apart,
              "On CUDA with 16-bit inputs, form the backward's direct term (the effect of each chunk's start state on "
              "its output) with chunk_state_direct, instead of in the reverse scan from the forward's output factors");
  c->add_flag("--backward-chunks-in-turn", a->backward_chunks_in_turn,
              "On CUDA with 16-bit inputs, Dk = Dv = 128: run the backward's chunk_backward as one block an SM taking "
              "chunks in turn (each chunk's loads landing during the chunk before), instead of one block a chunk (and "
              "leave that comparison out)");
  c->add_flag("--factors-occupancy", a->factors_occupancy,
              "On CUDA with 16-bit inputs: under each row, time chunk_factors alone and the forward, back to back, "
              "with at most 4 (as built), 3, 2 and 1 blocks of chunk_factors an SM (its shared memory padded), and "
              "with 1 and 2 blocks an SM taking chunks in turn (each chunk's loads landing during the one before), "
              "each block's time on its chunk, and the share of a chunk's time each of its phases takes (SM clocks, "
              "one block an SM in turn)");
  c->add_option("--rest-ms", a->rest_ms,
                "On CUDA, leave the device idle this long before each timed figure, so that each starts below the "
                "device's power limit, whatever ran before it (0: none; runs queued back to back at full load hold "
                "an H100 at its power cap, and a path timed right after another ran up to 10 % slower)")
      ->check(CLI::Range(int64_t{0}, int64_t{60000}))
      ->capture_default_str();
  c->add_flag("--fusion-in-scan", a->fusion_in_scan,
              "On CUDA with 16-bit inputs, Dh 128, in the layer: apply the LA heads' fusion norm inside the scan that "
              "writes the output (a head's column blocks as one cluster exchanging each row's sums every chunk) instead "
              "of by a kernel of its own after it, and leave that comparison out (no effect with --output-apart)");
  c->add_option("--history", a->history,
                 "On CUDA with 16-bit inputs, the chunks' states and new values the forward's scan hands its output "
                 "kernel: f16 (block float16, as its products use them) or f32")
      ->check(CLI::IsMember({"f16", "f32"}))
      ->capture_default_str();
  c->add_option("--backward", a->backward,
                 "How the backward differentiates the chunk-local function: kernels (the CUDA chunk kernels for "
                 "16-bit CUDA inputs, else explicit), explicit (its formulas written out on LibTorch ops) or "
                 "autograd (through the forward's LibTorch ops)")
      ->check(CLI::IsMember({"kernels", "explicit", "autograd"}))
      ->capture_default_str();
  c->add_option("--scan-segments", a->scan_segments,
                 "On CUDA with 16-bit inputs, how the block float16 scans split long sequences: auto (pieces that "
                 "fill the device, each started from zero where the chunks' transition norm bounds have shrunk "
                 "the state below 2^-20 of its size; in the hybrid layer, beside the FA heads' attention, pieces of "
                 "at most 32 chunks), 0 (whole sequences) or a number of chunks a piece")
      ->capture_default_str();
  c->add_option("--scan-columns", a->scan_columns,
                 "On CUDA with 16-bit inputs, the state's columns a block of the block float16 scans owns: auto (the "
                 "forward's scan, with or without the states a backward keeps, and the backward's reverse scan, a "
                 "whole head a block with 16 columns a warp where Dk is 128 and Dv 64 or 128; else 32 where they "
                 "divide Dv, else 16), 32 or 16 (and the bench's comparisons of the scan a head a block left out)")
      ->check(CLI::IsMember({"auto", "32", "16"}))
      ->capture_default_str();
  c->add_option("--gate-max", a->gate_max,
                 "Draw the per-token log decays g from -U(0, X): smaller X, slower decay, longer warm-ups for "
                 "the segmented scan")
      ->capture_default_str();
  c->add_option("--profile", a->profile,
                 "Write a Chrome trace of one forward and one forward + backward at the first shape (and, with "
                 "--layer-config, one hybrid layer at the last layer shape to FILE-layer.json, on one stream, and on CUDA "
                 "to FILE-layer-streams.json as it runs by default, its LA heads on a second stream)");
  return {c, [a] { return run_bench_gdn(*a); }};
}

}  // namespace hh::cli
