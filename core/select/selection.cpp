#include "core/select/selection.h"

#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>

#include "core/io/h5.h"
#include "core/io/sha256.h"
#include "core/model/config.h"
#include "core/util/error.h"

namespace hh::select {
namespace {

std::string head_str(const Head& h) { return std::to_string(h.first) + ":" + std::to_string(h.second); }

std::vector<double> to_vec(const at::Tensor& t) {
  const at::Tensor c = t.to(at::kDouble).contiguous().cpu();
  return std::vector<double>(c.data_ptr<double>(), c.data_ptr<double>() + c.numel());
}

// Heads in descending score order; ties by (layer, head) ascending so every strategy is deterministic.
std::vector<Head> by_score(const ModelShape& s, const std::vector<double>& score) {
  std::vector<Head> heads;
  for (int64_t l = 0; l < s.num_layers; ++l)
    for (int64_t h = 0; h < s.num_heads; ++h) heads.push_back({l, h});
  std::stable_sort(heads.begin(), heads.end(), [&](const Head& a, const Head& b) {
    return score[static_cast<size_t>(a.first * s.num_heads + a.second)] >
           score[static_cast<size_t>(b.first * s.num_heads + b.second)];
  });
  return heads;
}

}  // namespace

// ---- budget --------------------------------------------------------------------------------------

Budget budget(const ModelShape& s, const std::vector<Head>& fa, int64_t context, int64_t bytes_per_elem) {
  Budget b;
  b.context = context;
  const int64_t G = s.group_size();
  std::set<std::pair<int64_t, int64_t>> groups;
  for (const Head& h : fa) groups.insert({h.first, h.second / G});
  b.fa_heads = static_cast<int64_t>(fa.size());
  b.la_heads = s.num_layers * s.num_heads - b.fa_heads;
  b.kv_groups = static_cast<int64_t>(groups.size());
  const double N = static_cast<double>(context), Dh = static_cast<double>(s.head_dim);
  b.kv_bytes = 2.0 * N * Dh * static_cast<double>(bytes_per_elem) * static_cast<double>(b.kv_groups);
  b.state_bytes = static_cast<double>(b.la_heads) * Dh * Dh * 4.0;
  b.attn_flops = static_cast<double>(b.fa_heads) * 2.0 * N * N * Dh + static_cast<double>(b.la_heads) * 6.0 * N * Dh * Dh;
  return b;
}

// ---- signals -------------------------------------------------------------------------------------

std::map<std::string, double> default_weights() {
  return {{"retrieval_noising", 1.0}, {"reasoning_noising", 1.0}, {"path", 1.0}};
}

std::set<std::string> default_retrieval_tasks() {
  return {"niah-single", "niah-multikey", "niah-multivalue", "niah-multiquery", "passkey"};
}

Signals load_signals(const std::filesystem::path& path, const std::set<std::string>& retrieval_tasks) {
  const io::H5File f = io::H5File::open_read(path);
  const std::string file = path.string();
  if (!f.has_attr("/", "format") || f.attr_string("/", "format") != "hydrahead-analysis")
    throw Error(file + ": not an analysis file (run `hydrahead analyze` to make one)");
  Signals s;
  s.analysis_sha256 = io::sha256_file_hex(path);
  s.model_fingerprint = f.has_attr("/", "model_fingerprint") ? f.attr_string("/", "model_fingerprint") : "";
  if (!f.has_attr("/", "config_json")) throw Error(file + ": has no config_json attribute");
  const auto cfg = model::ModelConfig::from_json_text(f.attr_string("/", "config_json"), file + ": config_json");
  s.shape = shape_of(cfg, s.model_fingerprint);
  s.num_layers = cfg.num_hidden_layers;
  s.num_heads = cfg.num_attention_heads;
  const std::vector<int64_t> lh = {s.num_layers, s.num_heads};

  auto effect_map = [&](const std::string& name, const std::string& ds) {
    if (!f.exists(ds)) {
      s.absent[name] = ds + " is not in the file";
      return;
    }
    if (f.shape(ds) != lh) throw Error(file + ": " + ds + " is not [" + std::to_string(s.num_layers) + ", " + std::to_string(s.num_heads) + "]");
    s.maps[name] = to_vec(f.read(ds));
  };
  effect_map("noising", "/activation/noising/effect");
  effect_map("denoising", "/activation/denoising/effect");
  effect_map("path", "/path/effect");
  effect_map("attribution", "/attribution/noising/effect");
  effect_map("retrieval_score", "/retrieval/score");

  // Noising effect over a subset of examples, from the per-example patched metrics.
  const std::string patched = "/activation/noising/metric_patched";
  if (!f.exists(patched)) {
    s.absent["retrieval_noising"] = s.absent["reasoning_noising"] = patched + " is not in the file";
    return s;
  }
  const at::Tensor mp = f.read(patched).to(at::kDouble);  // [N, L, Hq]
  const at::Tensor mc = f.read("/examples/metric_clean").to(at::kDouble);
  const at::Tensor mk = f.read("/examples/metric_corrupt").to(at::kDouble);
  const auto tasks = f.read_strings("/examples/task");
  const at::Tensor kept = (mc - mk).abs() >= 1e-3;
  for (bool retrieval : {true, false}) {
    const std::string name = retrieval ? "retrieval_noising" : "reasoning_noising";
    std::vector<int64_t> rows;
    for (size_t i = 0; i < tasks.size(); ++i)
      if (kept[static_cast<int64_t>(i)].item<bool>() && (retrieval_tasks.count(tasks[i]) != 0) == retrieval)
        rows.push_back(static_cast<int64_t>(i));
    if (rows.empty()) {
      s.absent[name] = std::string("no kept example of a ") + (retrieval ? "retrieval" : "non-retrieval") + " task";
      continue;
    }
    const at::Tensor idx = at::tensor(at::ArrayRef<int64_t>(rows), at::TensorOptions().dtype(at::kLong));
    const at::Tensor c = mc.index_select(0, idx).view({-1, 1, 1}), k = mk.index_select(0, idx).view({-1, 1, 1});
    s.maps[name] = to_vec(((c - mp.index_select(0, idx)) / (c - k)).mean(0));
  }
  return s;
}

std::vector<double> rank_normalise(const std::vector<double>& v) {
  const size_t n = v.size();
  std::vector<size_t> order;
  for (size_t i = 0; i < n; ++i)
    if (!std::isnan(v[i])) order.push_back(i);
  std::sort(order.begin(), order.end(), [&](size_t a, size_t b) { return v[a] < v[b]; });
  std::vector<double> r(n, 0.0);
  const double denom = order.size() > 1 ? static_cast<double>(order.size() - 1) : 1.0;
  for (size_t i = 0; i < order.size();) {
    size_t j = i;
    while (j + 1 < order.size() && v[order[j + 1]] == v[order[i]]) ++j;
    const double avg = (static_cast<double>(i) + static_cast<double>(j)) / 2.0;
    for (size_t t = i; t <= j; ++t) r[order[t]] = order.size() > 1 ? avg / denom : 1.0;
    i = j + 1;
  }
  return r;
}

Composite composite(const Signals& s, const std::map<std::string, double>& weights) {
  Composite c;
  const size_t n = static_cast<size_t>(s.num_layers * s.num_heads);
  c.score.assign(n, 0.0);
  double total = 0;
  for (const auto& [name, w] : weights) {
    if (std::find(kSignalNames.begin(), kSignalNames.end(), name) == kSignalNames.end()) {
      std::string known;
      for (const auto& k : kSignalNames) known += (known.empty() ? "" : ", ") + k;
      throw Error("unknown signal '" + name + "' (known: " + known + ")");
    }
    if (!(w >= 0)) throw Error("signal '" + name + "': weight must be >= 0");
    if (w == 0) continue;
    auto it = s.maps.find(name);
    if (it == s.maps.end()) {
      auto why = s.absent.find(name);
      c.notes.push_back(name + " is missing (" + (why != s.absent.end() ? why->second : std::string("not in the file")) +
                        "); its weight is dropped");
      continue;
    }
    const auto nan_count = std::count_if(it->second.begin(), it->second.end(), [](double x) { return std::isnan(x); });
    if (nan_count > 0)
      c.notes.push_back(name + ": " + std::to_string(nan_count) + " heads were not measured and rank lowest");
    const std::vector<double> r = rank_normalise(it->second);
    for (size_t i = 0; i < n; ++i) c.score[i] += w * r[i];
    c.used[name] = w;
    total += w;
  }
  if (total <= 0) {
    std::string notes;
    for (const auto& x : c.notes) notes += "\n  " + x;
    throw Error("none of the weighted signals is in the analysis file:" + notes);
  }
  for (double& x : c.score) x /= total;
  for (auto& [name, w] : c.used) w /= total;
  return c;
}

// ---- strategies ----------------------------------------------------------------------------------

int64_t fa_count(const ModelShape& s, int64_t ratio) {
  if (ratio < 0) throw Error("--ratio must be >= 0 (LA:FA = ratio:1)");
  return static_cast<int64_t>(std::llround(static_cast<double>(s.num_layers * s.num_heads) / static_cast<double>(ratio + 1)));
}

double jaccard(const std::vector<Head>& a, const std::vector<Head>& b) {
  std::set<Head> sa(a.begin(), a.end()), sb(b.begin(), b.end());
  if (sa.empty() && sb.empty()) return 1.0;
  int64_t inter = 0;
  for (const Head& h : sa) inter += sb.count(h);
  return static_cast<double>(inter) / static_cast<double>(sa.size() + sb.size() - inter);
}

std::vector<Head> select_heads(const ModelShape& s, const std::vector<double>& score, const SelectOptions& o_in) {
  SelectOptions o = o_in;
  check_heads(o.exclude, s, "--exclude");
  check_heads(o.force, s, "--force");
  for (const Head& h : o.force)
    if (std::binary_search(o.exclude.begin(), o.exclude.end(), h)) throw Error("head " + head_str(h) + " is both forced and excluded");
  const int64_t L = s.num_layers, H = s.num_heads, G = s.group_size();
  const std::set<Head> excluded(o.exclude.begin(), o.exclude.end());
  const bool needs_score = o.strategy == "global" || o.strategy == "per-layer" || o.strategy == "kv-group";
  if (needs_score && score.size() != static_cast<size_t>(L * H))
    throw Error("strategy " + o.strategy + " needs a score for each of the " + std::to_string(L * H) + " heads");
  if (std::find(kStrategies.begin(), kStrategies.end(), o.strategy) == kStrategies.end())
    throw Error("unknown strategy '" + o.strategy + "' (global, per-layer, kv-group, manual, layerwise or random)");

  if (o.strategy == "manual") {
    check_heads(o.manual, s, "--heads");
    if (o.manual.empty()) throw Error("strategy manual needs --heads L:H,...");
    return o.manual;
  }
  if (o.strategy == "layerwise") {
    // Qwen3-Next style: every (r+1)-th layer is full attention, counting from the first.
    std::vector<Head> out;
    for (int64_t l = 0; l < L; ++l)
      if (l % (o.ratio + 1) == o.ratio)
        for (int64_t h = 0; h < H; ++h) out.push_back({l, h});
    return out;
  }

  const int64_t k = fa_count(s, o.ratio);
  if (static_cast<int64_t>(o.force.size()) > k)
    throw Error(std::to_string(o.force.size()) + " forced heads exceed the " + std::to_string(k) + " FA heads of ratio " +
                std::to_string(o.ratio) + ":1");
  if (o.min_per_layer * L > k)
    throw Error("--min-per-layer " + std::to_string(o.min_per_layer) + " needs " + std::to_string(o.min_per_layer * L) +
                " FA heads, ratio " + std::to_string(o.ratio) + ":1 gives " + std::to_string(k));
  if (o.min_per_layer > H) throw Error("--min-per-layer exceeds the " + std::to_string(H) + " heads of a layer");
  auto score_of = [&](const Head& h) { return score.empty() ? 0.0 : score[static_cast<size_t>(h.first * H + h.second)]; };

  // Candidates in preference order: by score, or a seeded shuffle for `random`.
  std::vector<Head> order;
  if (o.strategy == "random") {
    for (int64_t l = 0; l < L; ++l)
      for (int64_t h = 0; h < H; ++h) order.push_back({l, h});
    std::mt19937_64 rng(o.seed);
    std::shuffle(order.begin(), order.end(), rng);
  } else {
    order = by_score(s, score);
  }

  std::set<Head> chosen(o.force.begin(), o.force.end());
  if (o.strategy == "per-layer") {
    // Equal quotas; the k % L leftover heads go to the layers whose next-best head scores highest.
    std::vector<int64_t> quota(static_cast<size_t>(L), k / L);
    std::vector<std::vector<Head>> per(static_cast<size_t>(L));
    for (const Head& h : order)
      if (!excluded.count(h)) per[static_cast<size_t>(h.first)].push_back(h);
    std::vector<int64_t> layers(static_cast<size_t>(L));
    std::iota(layers.begin(), layers.end(), 0);
    auto next_score = [&](int64_t l) {
      const auto& p = per[static_cast<size_t>(l)];
      const size_t q = static_cast<size_t>(k / L);
      return q < p.size() ? score_of(p[q]) : -INFINITY;
    };
    std::stable_sort(layers.begin(), layers.end(), [&](int64_t a, int64_t b) { return next_score(a) > next_score(b); });
    for (int64_t i = 0; i < k % L; ++i) ++quota[static_cast<size_t>(layers[static_cast<size_t>(i)])];
    for (int64_t l = 0; l < L; ++l) {
      int64_t have = static_cast<int64_t>(std::count_if(chosen.begin(), chosen.end(), [&](const Head& h) { return h.first == l; }));
      for (const Head& h : per[static_cast<size_t>(l)]) {
        if (have >= quota[static_cast<size_t>(l)]) break;
        if (chosen.insert(h).second) ++have;
      }
      if (have < quota[static_cast<size_t>(l)])
        throw Error("layer " + std::to_string(l) + " has too few selectable heads for its quota of " + std::to_string(quota[static_cast<size_t>(l)]));
    }
    return {chosen.begin(), chosen.end()};
  }
  if (o.strategy == "kv-group") {
    // Whole GQA groups, so every chosen KV head serves only FA heads: round(k / G) groups by mean score.
    const int64_t groups_wanted = std::max<int64_t>(1, std::llround(static_cast<double>(k) / static_cast<double>(G)));
    struct Group { int64_t layer, group; double score; bool forced; };
    std::vector<Group> groups;
    for (int64_t l = 0; l < L; ++l)
      for (int64_t g = 0; g < s.num_kv_heads; ++g) {
        double sum = 0;
        bool blocked = false, forced = false;
        for (int64_t h = g * G; h < (g + 1) * G; ++h) {
          sum += score_of({l, h});
          blocked |= excluded.count({l, h}) != 0;
          forced |= chosen.count({l, h}) != 0;
        }
        if (blocked && forced) throw Error("KV group " + std::to_string(g) + " of layer " + std::to_string(l) + " holds both a forced and an excluded head");
        if (!blocked) groups.push_back({l, g, sum / static_cast<double>(G), forced});
      }
    std::stable_sort(groups.begin(), groups.end(), [](const Group& a, const Group& b) {
      return a.forced != b.forced ? a.forced : a.score > b.score;
    });
    if (static_cast<int64_t>(groups.size()) < groups_wanted) throw Error("too few KV groups are left after --exclude");
    std::set<Head> out;
    for (int64_t i = 0; i < groups_wanted || (i < static_cast<int64_t>(groups.size()) && groups[static_cast<size_t>(i)].forced); ++i)
      for (int64_t h = groups[static_cast<size_t>(i)].group * G; h < (groups[static_cast<size_t>(i)].group + 1) * G; ++h)
        out.insert({groups[static_cast<size_t>(i)].layer, h});
    return {out.begin(), out.end()};
  }

  // global and random: the k preferred heads, then the per-layer minimum.
  for (const Head& h : order) {
    if (static_cast<int64_t>(chosen.size()) >= k) break;
    if (!excluded.count(h)) chosen.insert(h);
  }
  if (o.min_per_layer > 0) {
    const std::set<Head> forced(o.force.begin(), o.force.end());
    auto count_in = [&](int64_t l) {
      return std::count_if(chosen.begin(), chosen.end(), [&](const Head& h) { return h.first == l; });
    };
    for (int64_t l = 0; l < L; ++l) {
      while (count_in(l) < o.min_per_layer) {
        // The layer's most preferred unchosen head comes in...
        const Head* best = nullptr;
        for (const Head& h : order)
          if (h.first == l && !chosen.count(h) && !excluded.count(h)) { best = &h; break; }
        if (!best) throw Error("layer " + std::to_string(l) + " has fewer than --min-per-layer selectable heads");
        // ...and the least preferred removable head of a layer above its minimum goes out.
        const Head* worst = nullptr;
        for (auto it = order.rbegin(); it != order.rend(); ++it)
          if (chosen.count(*it) && !forced.count(*it) && it->first != l && count_in(it->first) > o.min_per_layer) { worst = &*it; break; }
        if (!worst) throw Error("cannot meet --min-per-layer " + std::to_string(o.min_per_layer) + " with these forced heads");
        chosen.insert(*best);
        chosen.erase(*worst);
      }
    }
  }
  return {chosen.begin(), chosen.end()};
}

std::map<std::string, double> parse_weights(const std::string& spec) {
  if (spec.find_first_not_of(" ,") == std::string::npos) return default_weights();
  std::map<std::string, double> w;
  size_t pos = 0;
  while (pos <= spec.size()) {
    const size_t comma = std::min(spec.find(',', pos), spec.size());
    std::string item = spec.substr(pos, comma - pos);
    item.erase(0, item.find_first_not_of(' '));
    item.erase(item.find_last_not_of(' ') + 1);
    pos = comma + 1;
    if (item.empty()) continue;
    const auto eq = item.find('=');
    if (eq == std::string::npos) throw Error("'" + item + "' is not NAME=WEIGHT");
    try {
      size_t used = 0;
      const double v = std::stod(item.substr(eq + 1), &used);
      if (used != item.size() - eq - 1) throw std::invalid_argument("trailing");
      w[item.substr(0, eq)] = v;
    } catch (const std::exception&) {
      throw Error("'" + item + "': the weight is not a number");
    }
  }
  return w;
}

nlohmann::json budget_json(const Budget& b) {
  return {{"context", b.context}, {"fa_heads", b.fa_heads}, {"la_heads", b.la_heads}, {"kv_groups", b.kv_groups},
          {"kv_cache_bytes", b.kv_bytes}, {"gdn_state_bytes", b.state_bytes}, {"attention_flops", b.attn_flops}};
}

SelectionReport make_selection(const ModelShape& shape, const Signals* signals,
                               const std::map<std::string, double>& weights, const SelectOptions& o, bool compare,
                               int64_t kv_bytes, const std::string& created_by) {
  if (kv_bytes <= 0) throw Error("kv bytes per element must be positive");
  const bool ranks = o.strategy == "global" || o.strategy == "per-layer" || o.strategy == "kv-group";
  if (ranks && signals == nullptr) throw Error("strategy " + o.strategy + " ranks heads: it needs an analysis file");
  SelectionReport r;
  if (ranks) r.composite = composite(*signals, weights);
  r.heads = select_heads(shape, r.composite.score, o);

  SelectOptions lw = o;
  lw.strategy = "layerwise";
  r.layerwise = select_heads(shape, {}, lw);
  if (r.layerwise.empty() && o.ratio > 0) {  // every (r+1)-th layer: none in a model of r layers or fewer
    const std::string pattern = "layer-wise " + std::to_string(o.ratio) + ":1";
    r.notes.push_back(pattern + " makes layer " + std::to_string(o.ratio) + " (and every " + std::to_string(o.ratio + 1) +
                      "th after it) full attention, which this model's " + std::to_string(shape.num_layers) +
                      " layers do not reach: " + (o.strategy == "layerwise" ? "this selection has" : "that baseline has") +
                      " no full-attention head");
  }
  std::vector<Head> dense;
  for (int64_t l = 0; l < shape.num_layers; ++l)
    for (int64_t h = 0; h < shape.num_heads; ++h) dense.push_back({l, h});
  if (compare) {  // the seeded random baseline: same k, no quotas
    SelectOptions rnd = o;
    rnd.strategy = "random";
    rnd.exclude.clear();
    rnd.force.clear();
    rnd.min_per_layer = 0;
    r.random = select_heads(shape, {}, rnd);
    r.layerwise_jaccard = jaccard(r.heads, r.layerwise);
    r.random_jaccard = jaccard(r.heads, r.random);
  }
  std::vector<std::pair<std::string, const std::vector<Head>*>> configs = {
      {"dense", &dense}, {"layer-wise " + std::to_string(o.ratio) + ":1", &r.layerwise}};
  if (compare) configs.push_back({"random (seed " + std::to_string(o.seed) + ")", &r.random});
  configs.push_back({"this selection", &r.heads});
  nlohmann::json notes_budget = nlohmann::json::array();
  for (int64_t n : kBudgetContexts)
    for (const auto& [name, set] : configs) {
      r.budget.push_back({name, budget(shape, *set, n, kv_bytes)});
      nlohmann::json j = budget_json(r.budget.back().budget);
      j["configuration"] = name;
      notes_budget.push_back(j);
    }

  Manifest& m = r.manifest;
  m.model = shape;
  m.ratio_la = o.ratio;
  m.ratio_fa = 1;
  m.strategy = o.strategy;
  if (signals != nullptr) m.analysis_sha256 = signals->analysis_sha256;
  m.signals = nlohmann::json(r.composite.used);
  m.fa_heads = r.heads;
  m.created = iso8601_now();
  m.created_by = created_by;
  m.notes = {{"budget", notes_budget}, {"kv_bytes_per_element", kv_bytes}};
  if (!r.composite.notes.empty()) m.notes["signal_notes"] = r.composite.notes;
  if (!r.notes.empty()) m.notes["selection_notes"] = r.notes;
  if (compare)
    m.notes["compare"] = {{"layerwise_jaccard", r.layerwise_jaccard}, {"random_jaccard", r.random_jaccard}};
  if (o.strategy == "random") m.notes["seed"] = o.seed;
  return r;
}

}  // namespace hh::select
