#include "core/interp/analysis.h"

#include <torch/torch.h>

#include <chrono>
#include <cmath>
#include <fstream>
#include <limits>
#include <optional>

#include "core/dist/process_group.h"
#include "core/interp/calibration.h"
#include "core/io/fingerprint.h"
#include "core/io/h5.h"
#include "core/model/config.h"
#include "core/model/tokenizer.h"
#include "core/model/transformer.h"
#include "core/util/error.h"
#include "core/util/log.h"
#include "core/util/strings.h"

namespace hh::interp {
namespace {

using Clock = std::chrono::steady_clock;

double since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

std::string heads_text(const std::vector<HeadRef>& heads) {
  if (heads.empty()) return "all";
  std::string s;
  for (const HeadRef& h : heads) s += (s.empty() ? "" : ",") + std::to_string(h.layer) + ":" + std::to_string(h.head);
  return s;
}

// Mean over kept examples of the normalised effect; per[n] [..] float64 patched metrics.
at::Tensor mean_effect(const std::vector<at::Tensor>& per, const AnalysisResult& r, Mode mode) {
  at::Tensor sum, count;
  const auto clean = r.metric_clean.accessor<double, 1>();
  const auto corrupt = r.metric_corrupt.accessor<double, 1>();
  for (size_t n = 0; n < per.size(); ++n) {
    if (!r.kept[static_cast<int64_t>(n)].item<bool>()) continue;
    const at::Tensor e = normalise_effect(per[n], clean[static_cast<int64_t>(n)], corrupt[static_cast<int64_t>(n)], mode);
    sum = sum.defined() ? sum + e : e;
  }
  const int64_t kept = r.kept.sum().item<int64_t>();
  if (!sum.defined()) return at::full(per.front().sizes(), std::numeric_limits<double>::quiet_NaN(),
                                      at::TensorOptions().dtype(at::kDouble)).to(at::kFloat);
  return (sum / static_cast<double>(kept)).to(at::kFloat);
}

}  // namespace

void parse_methods(const std::string& list, AnalyzeOptions& o) {
  o.activation = o.path = o.attribution = o.retrieval = o.similarity = false;
  const auto items = util::split_list(list);
  for (const std::string& m : items) {
    if (m == "all") o.activation = o.path = o.attribution = o.retrieval = o.similarity = true;
    else if (m == "activation") o.activation = true;
    else if (m == "path") o.path = true;
    else if (m == "attribution") o.attribution = true;
    else if (m == "retrieval") o.retrieval = true;
    else if (m == "similarity") o.similarity = true;
    else throw Error("unknown method '" + m + "' (expected activation, path, attribution, retrieval, similarity or all)");
  }
  if (items.empty()) throw Error("no analysis method given (expected activation, path, attribution, retrieval, similarity or all)");
}

AnalysisResult run_analysis(const model::Transformer& model, const std::vector<CalibExample>& examples,
                            const AnalyzeOptions& o, const std::string& calib_name) {
  if (examples.empty()) throw Error(calib_name + ": no examples");
  const int64_t L = model.config().num_hidden_layers, Hq = model.config().num_attention_heads;
  const int64_t N = static_cast<int64_t>(examples.size());
  for (const HeadRef& h : o.heads)
    if (h.layer >= L || h.head >= Hq) throw Error("head " + std::to_string(h.layer) + ":" + std::to_string(h.head) + " is outside the model");
  AnalysisResult r;
  r.num_layers = L;
  r.num_heads = Hq;
  r.metric = o.metric;
  r.mode = o.mode;
  r.reference = o.reference;
  r.heads = o.heads;
  r.receivers = o.receivers;
  r.metric_clean = at::zeros({N}, at::TensorOptions().dtype(at::kDouble));
  r.metric_corrupt = at::zeros({N}, at::TensorOptions().dtype(at::kDouble));
  r.first_difference = at::zeros({N}, at::TensorOptions().dtype(at::kLong));
  r.kept = at::zeros({N}, at::TensorOptions().dtype(at::kBool));
  for (const auto& ex : examples) r.tasks.push_back(ex.task);

  // ---- who does what: units (example n, head batch c) dealt round-robin over the ranks ----
  const int64_t world = o.dist ? o.dist->size() : 1, rank = o.dist ? o.dist->rank() : 0;
  const std::vector<HeadRef> swept = o.heads.empty() ? all_heads(L, Hq) : o.heads;
  const int64_t n_heads = static_cast<int64_t>(swept.size());
  const int64_t chunks = std::max<int64_t>(1, std::min<int64_t>(n_heads, (world + N - 1) / N));
  const auto owner = [&](int64_t n, int64_t c) { return (n * chunks + c) % world; };
  auto chunk_heads = [&](int64_t c) {
    if (chunks == 1) return o.heads;
    return std::vector<HeadRef>(swept.begin() + c * n_heads / chunks, swept.begin() + (c + 1) * n_heads / chunks);
  };
  std::vector<int64_t> chunk_of(static_cast<size_t>(L * Hq), 0);  // per head: its batch (heads not swept: 0)
  for (int64_t c = 0; c < chunks; ++c)
    for (const HeadRef& h : chunk_heads(c)) chunk_of[static_cast<size_t>(h.layer * Hq + h.head)] = c;

  int64_t total = 0;
  for (int64_t n = 0; n < N; ++n)
    for (int64_t c = 0; c < chunks; ++c) {
      if (owner(n, c) != rank) continue;
      const int64_t nh = static_cast<int64_t>(chunks == 1 ? n_heads : chunk_heads(c).size());
      total += 2 + (o.activation ? nh : 0) + (o.path ? nh : 0);
      if (c == 0) total += (o.activation && o.layers ? L : 0) + (o.attribution ? 1 : 0) + (o.retrieval ? 1 : 0);
    }
  if (o.similarity && rank == 0) total += N;
  int64_t base = 0;
  auto report = [&](const std::string& step, int64_t done) {
    if (o.progress) o.progress(step, base + done, total);
  };
  auto check_cancel = [&] {
    if (o.cancel != nullptr && o.cancel->load()) throw Cancelled();
  };
  SweepOptions sweep;
  sweep.metric = o.metric;
  sweep.mode = o.mode;
  sweep.max_batch = o.max_batch;
  sweep.cancel = o.cancel;

  // Per example; undefined where this rank did not compute it (gathered below).
  std::vector<at::Tensor> act(static_cast<size_t>(N)), lay(static_cast<size_t>(N)), attr(static_cast<size_t>(N)),
      path(static_cast<size_t>(N)), retrieval(static_cast<size_t>(N));
  std::vector<double> m_clean(static_cast<size_t>(N), 0), m_corrupt(static_cast<size_t>(N), 0), first_diff(static_cast<size_t>(N), 0);
  const int64_t per_example_tokens = std::max<int64_t>(1, o.cka_tokens / N);
  SimilarityAccumulator sim(L, per_example_tokens, o.cka_tokens);
  auto timed = [&](const char* method, auto&& fn) {
    const auto t0 = Clock::now();
    fn();
    r.seconds[method] += since(t0);
  };
  // Merges a head sweep of one batch into the example's map (NaN outside the batch's heads).
  auto merge = [](at::Tensor& into, const at::Tensor& part) { into = into.defined() ? at::where(at::isnan(part), into, part) : part; };

  for (int64_t n = 0; n < N; ++n) {
    check_cancel();
    const CalibExample& raw = examples[static_cast<size_t>(n)];
    const std::string where = calib_name + ": example " + std::to_string(n + 1);
    bool mine = false;
    for (int64_t c = 0; c < chunks; ++c) mine |= owner(n, c) == rank;
    const bool similarity_here = o.similarity && rank == 0;
    if (!mine && !similarity_here) continue;
    const PreparedExample ex = prepare_example(raw, model, o.metric, where);
    for (int64_t c = 0; c < chunks && mine; ++c) {
      if (owner(n, c) != rank) continue;
      const std::vector<HeadRef> heads = chunk_heads(c);
      const int64_t nh = static_cast<int64_t>(chunks == 1 ? n_heads : heads.size());
      sweep.heads = heads;
      RunCache cache;
      timed("runs", [&] { cache = run_clean_corrupt(model, ex, o.metric); });
      m_clean[static_cast<size_t>(n)] = cache.metric_clean;
      m_corrupt[static_cast<size_t>(n)] = cache.metric_corrupt;
      first_diff[static_cast<size_t>(n)] = static_cast<double>(ex.diff < ex.T ? ex.diff : -1);
      report("clean/corrupt runs", 2);
      int64_t offset = 2;
      if (o.activation) {
        timed("activation", [&] {
          sweep.progress = [&](int64_t d, int64_t) { report("activation patching", offset + d); };
          merge(act[static_cast<size_t>(n)], o.reference ? head_sweep_reference(model, ex, sweep) : head_sweep(model, ex, cache, sweep));
          offset += nh;
          if (o.layers && c == 0) {
            sweep.progress = [&](int64_t d, int64_t) { report("layer patching", offset + d); };
            lay[static_cast<size_t>(n)] = o.reference ? layer_sweep_reference(model, ex, sweep) : layer_sweep(model, ex, cache, sweep);
            offset += L;
          }
        });
      }
      if (o.path) {
        timed("path", [&] {
          sweep.progress = [&](int64_t d, int64_t) { report("path patching", offset + d); };
          SweepOptions noising = sweep;
          noising.mode = Mode::Noising;
          merge(path[static_cast<size_t>(n)], o.reference ? path_sweep_reference(model, ex, o.receivers, noising)
                                                           : path_sweep(model, ex, cache, o.receivers, noising));
          offset += nh;
        });
      }
      if (o.attribution && c == 0) {
        check_cancel();
        sweep.heads = o.heads;
        timed("attribution", [&] { attr[static_cast<size_t>(n)] = attribution(model, ex, cache, sweep); });
        report("attribution patching", ++offset);
      }
      if (o.retrieval && c == 0) {
        check_cancel();
        timed("retrieval", [&] { retrieval[static_cast<size_t>(n)] = retrieval_score(model, raw, ex); });
        report("retrieval score", ++offset);
      }
      base += offset;
    }
    if (similarity_here) {
      check_cancel();
      timed("similarity", [&] {
        at::NoGradGuard no_grad;
        std::vector<at::Tensor> states(static_cast<size_t>(L + 1));
        model::Hooks hooks;
        hooks.add(model::hook_name(0, model::HookKind::ResidPre), [&](at::Tensor& t) { states[0] = t[0]; });
        for (int64_t l = 0; l < L; ++l)
          hooks.add(model::hook_name(l, model::HookKind::ResidPost),
                    [&states, l](at::Tensor& t) { states[static_cast<size_t>(l + 1)] = t[0]; });
        model::ForwardOptions f;
        f.hooks = &hooks;
        f.logits = false;  // the residuals only
        model.forward(ex.clean, f);
        sim.add(states);
      });
      report("layer similarity", 1);
      ++base;
    }
  }

  if (o.dist != nullptr) {
    // Every rank's per-example rows, packed into one float64 table [N, K] each; then each value is
    // taken from the rank that computed it.
    const int64_t LH = L * Hq;
    const int64_t k_act = 3, k_lay = k_act + (o.activation ? LH : 0), k_attr = k_lay + (o.activation && o.layers ? 3 * L : 0);
    const int64_t k_path = k_attr + (o.attribution ? LH : 0), k_ret = k_path + (o.path ? LH : 0);
    const int64_t K = k_ret + (o.retrieval ? 1 + LH : 0);
    at::Tensor table = at::zeros({N, K}, at::TensorOptions().dtype(at::kDouble));
    auto put = [&](int64_t n, int64_t col, const at::Tensor& t) {
      if (t.defined()) table[n].narrow(0, col, t.numel()).copy_(t.reshape({-1}).to(at::kCPU, at::kDouble));
    };
    for (int64_t n = 0; n < N; ++n) {
      table[n][0] = m_clean[static_cast<size_t>(n)];
      table[n][1] = m_corrupt[static_cast<size_t>(n)];
      table[n][2] = first_diff[static_cast<size_t>(n)];
      if (o.activation) put(n, k_act, act[static_cast<size_t>(n)]);
      if (o.activation && o.layers) put(n, k_lay, lay[static_cast<size_t>(n)]);
      if (o.attribution) put(n, k_attr, attr[static_cast<size_t>(n)]);
      if (o.path) put(n, k_path, path[static_cast<size_t>(n)]);
      if (o.retrieval && retrieval[static_cast<size_t>(n)].defined()) {
        table[n][k_ret] = 1.0;
        put(n, k_ret + 1, retrieval[static_cast<size_t>(n)]);
      }
    }
    std::vector<at::Tensor> all = o.dist->all_gather(table.to(o.dist->device()));
    for (auto& t : all) t = t.cpu();
    const at::Tensor head_chunk = at::tensor(std::vector<int64_t>(chunk_of.begin(), chunk_of.end()), at::TensorOptions().dtype(at::kLong));
    for (int64_t n = 0; n < N; ++n) {
      const at::Tensor row = all[static_cast<size_t>(owner(n, 0))][n];
      m_clean[static_cast<size_t>(n)] = row[0].item<double>();
      m_corrupt[static_cast<size_t>(n)] = row[1].item<double>();
      first_diff[static_cast<size_t>(n)] = row[2].item<double>();
      // A head map: each head from the rank of its batch.
      auto heads_of = [&](int64_t col) {
        at::Tensor v = row.narrow(0, col, LH).clone();
        for (int64_t c = 1; c < chunks; ++c)
          v = at::where(head_chunk == c, all[static_cast<size_t>(owner(n, c))][n].narrow(0, col, LH), v);
        return v.view({L, Hq});
      };
      if (o.activation) act[static_cast<size_t>(n)] = heads_of(k_act);
      if (o.activation && o.layers) lay[static_cast<size_t>(n)] = row.narrow(0, k_lay, 3 * L).view({3, L}).clone();
      if (o.attribution) attr[static_cast<size_t>(n)] = row.narrow(0, k_attr, LH).view({L, Hq}).clone();
      if (o.path) path[static_cast<size_t>(n)] = heads_of(k_path);
      if (o.retrieval)
        retrieval[static_cast<size_t>(n)] = row[k_ret].item<double>() > 0 ? row.narrow(0, k_ret + 1, LH).view({L, Hq}).clone() : at::Tensor();
    }
  }

  for (int64_t n = 0; n < N; ++n) {
    r.metric_clean[n] = m_clean[static_cast<size_t>(n)];
    r.metric_corrupt[n] = m_corrupt[static_cast<size_t>(n)];
    r.first_difference[n] = static_cast<int64_t>(first_diff[static_cast<size_t>(n)]);
    r.kept[n] = std::abs(m_clean[static_cast<size_t>(n)] - m_corrupt[static_cast<size_t>(n)]) >= kMinMetricGap;
  }
  const int64_t kept = r.kept.sum().item<int64_t>();
  const bool lead = rank == 0;
  if (kept < N && lead)
    log::warn(std::to_string(N - kept) + " of " + std::to_string(N) + " examples have |M_clean - M_corrupt| < " +
              std::to_string(kMinMetricGap) + " and are left out of the effect means");
  auto stack_f32 = [](const std::vector<at::Tensor>& v) { return at::stack(v).to(at::kFloat); };
  auto on_cpu = [](std::vector<at::Tensor>& v) {
    for (auto& t : v) t = t.to(at::kCPU, at::kDouble);
  };
  if (o.activation) {
    on_cpu(act);
    r.act_patched = stack_f32(act);
    r.act_effect = mean_effect(act, r, o.mode);
    if (o.layers) {
      on_cpu(lay);
      r.layer_patched = stack_f32(lay);
      r.layer_effect = mean_effect(lay, r, o.mode);
    }
  }
  if (o.attribution) {
    on_cpu(attr);
    r.attr_estimate = stack_f32(attr);
    r.attr_effect = mean_effect(attr, r, o.mode);
  }
  if (o.path) {
    on_cpu(path);
    r.path_patched = stack_f32(path);
    r.path_effect = mean_effect(path, r, Mode::Noising);
  }
  if (o.retrieval) {
    at::Tensor retrieval_sum = at::zeros({L, Hq}, at::TensorOptions().dtype(at::kDouble));
    for (const at::Tensor& s : retrieval)
      if (s.defined()) {
        retrieval_sum += s.to(at::kCPU, at::kDouble);
        ++r.retrieval_examples;
      }
    if (r.retrieval_examples == 0) {
      if (lead)
        log::warn(calib_name + ": no example has a needle span (meta.needles[].span or meta.needle); the retrieval score is not computed");
    } else {
      r.retrieval = (retrieval_sum / static_cast<double>(r.retrieval_examples)).to(at::kFloat);
    }
  }
  if (o.similarity && lead) {
    r.similarity = sim.finish();
    r.has_similarity = true;
  }
  return r;
}

// ---- analysis.h5 ---------------------------------------------------------------------------------

void check_can_extend(const std::filesystem::path& path, const AnalysisProvenance& prov, Metric metric) {
  io::H5File old = io::H5File::open_read(path);
  const auto attr = [&](const char* name) {
    return old.has_attr("/", name) ? old.attr_string("/", name) : std::string("(none)");
  };
  if (attr("format") != kAnalysisFormat)
    throw Error(path.string() + ": not an analysis file (format attribute is '" + attr("format") + "'); choose another --out");
  const int64_t version = old.has_attr("/", "format_version") ? old.attr_int("/", "format_version") : -1;
  if (version != kAnalysisFormatVersion)
    throw Error(path.string() + ": format_version " + std::to_string(version) + " cannot be extended by this version (" +
                std::to_string(kAnalysisFormatVersion) + "); write to a new file");
  if (attr("model_fingerprint") != prov.model_fingerprint)
    throw Error(path.string() + ": was made from another model (fingerprint " + attr("model_fingerprint") +
                ", this model's is " + prov.model_fingerprint + "); write to a new file");
  if (attr("calib_sha256") != prov.calib_sha256)
    throw Error(path.string() + ": was made from another calibration set (sha256 " + attr("calib_sha256") +
                ", this set's is " + prov.calib_sha256 + "); write to a new file");
  if (attr("metric") != metric_name(metric))
    throw Error(path.string() + ": holds metric " + attr("metric") + ", this run uses " + metric_name(metric) +
                "; write to a new file or use --metric " + attr("metric"));
}

void write_analysis(const std::filesystem::path& path, const AnalysisResult& r, const AnalysisProvenance& prov) {
  const bool exists = std::filesystem::exists(path);
  if (exists) check_can_extend(path, prov, r.metric);
  io::H5File f = exists ? io::H5File::update(path) : io::H5File::create(path);
  f.set_attr("/", "format", kAnalysisFormat);
  f.set_attr("/", "format_version", kAnalysisFormatVersion);
  f.set_attr("/", "created_by", prov.created_by);
  f.set_attr("/", "model_fingerprint", prov.model_fingerprint);
  f.set_attr("/", "calib_sha256", prov.calib_sha256);
  f.set_attr("/", "config_json", prov.config_json);
  f.set_attr("/", "metric", metric_name(r.metric));
  f.set_attr("/", "num_layers", r.num_layers);
  f.set_attr("/", "num_heads", r.num_heads);
  if (!prov.model_path.empty()) f.set_attr("/", "model_path", prov.model_path);
  if (!prov.calib_path.empty()) f.set_attr("/", "calib_path", prov.calib_path);
  if (!prov.dtype.empty()) f.set_attr("/", "dtype", prov.dtype);

  f.write("/examples/metric_clean", r.metric_clean, {"example"});
  f.write("/examples/metric_corrupt", r.metric_corrupt, {"example"});
  f.write("/examples/first_difference", r.first_difference, {"example"});
  f.write("/examples/kept", r.kept, {"example"});
  f.write_strings("/examples/task", r.tasks);
  f.set_attr("/examples", "n_kept", r.kept.sum().item<int64_t>());
  f.set_attr("/examples", "min_metric_gap", kMinMetricGap);

  const std::vector<std::string> nlh = {"example", "layer", "head"}, lh = {"layer", "head"};
  auto group_attrs = [&](const std::string& g, Mode mode, const std::vector<HeadRef>& heads) {
    f.set_attr(g, "metric", metric_name(r.metric));
    f.set_attr(g, "mode", mode_name(mode));
    f.set_attr(g, "heads", heads_text(heads));
    f.set_attr(g, "n_kept", r.kept.sum().item<int64_t>());
    f.set_attr(g, "n_skipped", static_cast<int64_t>(r.kept.size(0)) - r.kept.sum().item<int64_t>());
  };
  if (r.act_patched.defined()) {
    const std::string g = std::string("/activation/") + mode_name(r.mode);
    f.write(g + "/metric_patched", r.act_patched, nlh);
    f.write(g + "/effect", r.act_effect, lh);
    group_attrs(g, r.mode, r.heads);
    f.set_attr(g, "implementation", r.reference ? "reference: one forward per head" : "batched, prefix reuse");
    if (r.layer_patched.defined()) {
      f.write(g + "/layer_metric_patched", r.layer_patched, {"example", "site", "layer"});
      f.write(g + "/layer_effect", r.layer_effect, {"site", "layer"});
      f.set_attr(g, "layer_sites", "attn_out,mlp_out,resid");
    }
  }
  if (r.attr_estimate.defined()) {
    const std::string g = std::string("/attribution/") + mode_name(r.mode);
    f.write(g + "/metric_estimate", r.attr_estimate, nlh);
    f.write(g + "/effect", r.attr_effect, lh);
    group_attrs(g, r.mode, {});
  }
  if (r.path_patched.defined()) {
    f.write("/path/metric_patched", r.path_patched, nlh);
    f.write("/path/effect", r.path_effect, lh);
    group_attrs("/path", Mode::Noising, r.heads);
    f.set_attr("/path", "receivers", r.receivers.empty() ? std::string("logits") : heads_text(r.receivers));
  }
  if (r.retrieval.defined()) {
    f.write("/retrieval/score", r.retrieval, lh);
    f.set_attr("/retrieval", "n_examples", r.retrieval_examples);
  }
  if (r.has_similarity) {
    const std::vector<std::string> ll = {"layer", "layer"};
    f.write("/similarity/cosine_delta", r.similarity.cosine_delta, ll);
    f.write("/similarity/cka", r.similarity.cka, ll);
    f.write("/similarity/angular", r.similarity.angular, ll);
    f.set_attr("/similarity", "tokens", r.similarity.tokens);
    f.set_attr("/similarity", "cka_tokens", r.similarity.cka_tokens);
  }
  f.commit();
}

AnalysisResult analyze_checkpoint(const AnalyzeCheckpoint& job, const std::function<void(const std::string&)>& started) {
  namespace fs = std::filesystem;
  const fs::path& dir = job.model_dir;
  const auto cfg = model::ModelConfig::load(dir / "config.json");
  const AnalyzeOptions& o = job.options;
  // Messages name the CLI's options, which the other front ends mirror in their fields.
  if (!o.receivers.empty() && !o.path) throw Error("--receivers applies to --method path only");
  if (job.device != "cpu" && job.device.rfind("cuda", 0) != 0)
    throw Error("--device: '" + job.device + "' is not cpu or cuda[:N]");
  if (job.device.rfind("cuda", 0) == 0 && !torch::cuda::is_available())
    throw Error("--device " + job.device + ": this build or machine has no CUDA device");
  model::check_dtype(job.dtype);
  if (job.out.has_parent_path() && !fs::is_directory(job.out.parent_path()))
    throw Error("--out " + job.out.string() + ": directory " + job.out.parent_path().string() + " does not exist");

  std::optional<model::Tokenizer> tok;
  if (fs::exists(dir / "tokenizer.json")) tok = model::Tokenizer::load(dir / "tokenizer.json");
  const auto examples = read_calibration(job.calib, tok ? &*tok : nullptr, cfg.vocab_size);

  AnalysisProvenance prov;
  prov.model_fingerprint = io::model_fingerprint(dir);
  prov.calib_sha256 = calibration_sha256(job.calib);
  {
    std::ifstream in(dir / "config.json", std::ios::binary);
    prov.config_json.assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  }
  prov.created_by = job.created_by;
  prov.model_path = fs::absolute(dir).string();
  prov.calib_path = fs::absolute(job.calib).string();
  // An incompatible existing output is refused now, before the (long) analysis.
  if (fs::exists(job.out)) check_can_extend(job.out, prov, o.metric);

  const bool lead = o.dist == nullptr || o.dist->rank() == 0;
  const std::string device = o.dist ? dist::rank_device(job.device, o.dist->env(), "--device") : job.device;
  const auto model = model::Transformer::load(dir, device, job.dtype, o.cancel);
  prov.dtype = c10::toString(model.dtype());
  prov.device = job.device;
  if (started)
    started("analyzing " + std::to_string(examples.size()) + " examples of " + job.calib.string() + " on " + job.device +
            " (" + prov.dtype + "), " + std::to_string(cfg.num_hidden_layers) + " layers x " +
            std::to_string(cfg.num_attention_heads) + " heads");
  AnalysisResult r = run_analysis(model, examples, o, job.calib.string());
  if (lead) write_analysis(job.out, r, prov);   // with several ranks, rank 0 writes the gathered result
  return r;
}

}  // namespace hh::interp
