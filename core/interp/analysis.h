#pragma once
// The analysis driver: every DESIGN.md section 6 method over a calibration set, and analysis.h5
// (section 7) written from the results. The CLI (`hydrahead analyze`) and the workbench both call
// run_analysis() and write_analysis(); neither reimplements any of it.
#include <atomic>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "core/interp/calibration.h"
#include "core/interp/patching.h"
#include "core/interp/similarity.h"

namespace hh::model {
class Transformer;
}
namespace hh::dist {
class ProcessGroup;
}

namespace hh::interp {

struct AnalyzeOptions {
  bool activation = false, path = false, attribution = false, retrieval = false, similarity = false;
  bool layers = true;           // with activation: also attn_out / mlp_out / resid per layer
  bool reference = false;       // exact patching one forward per head (slow; the ground truth)
  Mode mode = Mode::Noising;    // activation and attribution; path patching is always noising
  Metric metric = Metric::LogProb;
  std::vector<HeadRef> heads;      // empty: every head (activation, path, attribution reports all)
  std::vector<HeadRef> receivers;  // path patching receivers; empty: the logits
  int64_t max_batch = 0;           // variants per forward; 0: sized from free memory
  int64_t cka_tokens = 1024;       // tokens sampled for CKA over the whole set
  // Called as work completes: a short label of the current step, units done, units in all.
  std::function<void(const std::string& step, int64_t done, int64_t total)> progress;
  const std::atomic<bool>* cancel = nullptr;  // throws hh::Cancelled between forwards when set
  // Several ranks share the work (docs/DISTRIBUTED.md): every rank calls run_analysis with the same
  // model, examples and options. Work units are (example, head batch) pairs, dealt round-robin: one unit
  // per example when there are at least as many examples as ranks, else each example's heads split into
  // ceil(ranks / examples) batches. The layer sweep, attribution and retrieval of an example run with
  // its first unit; similarity runs on rank 0 for every example. The per-example results are gathered
  // on every rank and reduced in example order, so the result equals a single-process run's (bit for
  // bit when each example stays on one rank). Progress counts this rank's units.
  dist::ProcessGroup* dist = nullptr;
};

// Parses "activation,path,..." or "all" into the method flags; names the bad item.
void parse_methods(const std::string& list, AnalyzeOptions& opts);

struct AnalysisResult {
  int64_t num_layers = 0, num_heads = 0;
  Metric metric = Metric::LogProb;
  Mode mode = Mode::Noising;
  bool reference = false;
  std::vector<HeadRef> heads, receivers;
  // Per example.
  std::vector<std::string> tasks;
  at::Tensor metric_clean, metric_corrupt;  // [N] float64
  at::Tensor first_difference;              // [N] int64
  at::Tensor kept;                          // [N] bool: |M_clean - M_corrupt| >= kMinMetricGap
  // Per method, undefined when it did not run. Patched/estimated metrics are float32 [N, ...];
  // effects are means over kept examples of the normalised effect (NaN where a head was not run
  // or no example was kept).
  at::Tensor act_patched, act_effect;          // [N, L, Hq], [L, Hq]
  at::Tensor layer_patched, layer_effect;      // [N, 3, L], [3, L] (kLayerSites order)
  at::Tensor attr_estimate, attr_effect;       // [N, L, Hq], [L, Hq]
  at::Tensor path_patched, path_effect;        // [N, L, Hq], [L, Hq]
  at::Tensor retrieval;                        // [L, Hq]
  int64_t retrieval_examples = 0;              // examples with a needle span
  bool has_similarity = false;
  SimilarityAccumulator::Result similarity;
  std::map<std::string, double> seconds;       // wall time per method
};

AnalysisResult run_analysis(const model::Transformer& model, const std::vector<CalibExample>& examples,
                            const AnalyzeOptions& opts, const std::string& calib_name = "calibration set");

struct AnalysisProvenance {
  std::string model_fingerprint, calib_sha256, config_json, created_by;
  std::string model_path, calib_path, dtype, device;
};

// Writes the methods that `r` holds into `path`. A new file is created whole; an existing file must
// come from the same model fingerprint, calibration hash and metric (else hh::Error naming which),
// and gets the new methods added or replaced while the rest is kept. Either way the file is built
// at a temporary path and renamed, so an interruption leaves the old file (or none).
void write_analysis(const std::filesystem::path& path, const AnalysisResult& r, const AnalysisProvenance& prov);
// The check write_analysis() makes on an existing file, for front ends to run before the analysis.
void check_can_extend(const std::filesystem::path& path, const AnalysisProvenance& prov, Metric metric);

// `hydrahead analyze` after its arguments are parsed, for every front end: checks what can be checked
// before the weights load (device, dtype, output directory, an existing output's model and
// calibration set), loads the checkpoint and the calibration set (text fields through the model's
// tokenizer.json when it has one), runs the analysis and writes (or extends) `out`. Cancelling through
// options.cancel throws hh::Cancelled and writes nothing. `started` (may be empty) is told what runs.
struct AnalyzeCheckpoint {
  std::filesystem::path model_dir, calib, out;
  std::string device = "cpu", dtype = "auto";  // as model::resolve_dtype takes it
  std::string created_by;
  AnalyzeOptions options;
};
AnalysisResult analyze_checkpoint(const AnalyzeCheckpoint& job,
                                  const std::function<void(const std::string&)>& started = {});

inline constexpr const char* kAnalysisFormat = "hydrahead-analysis";
inline constexpr int64_t kAnalysisFormatVersion = 1;

}  // namespace hh::interp
