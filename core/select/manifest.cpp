#include "core/select/manifest.h"

#include <algorithm>
#include <ctime>
#include <fstream>
#include <sstream>

#include "core/io/safetensors.h"
#include "core/model/config.h"
#include "core/util/error.h"

namespace hh::select {
namespace {

using nlohmann::json;

std::string head_str(const Head& h) { return "[" + std::to_string(h.first) + ", " + std::to_string(h.second) + "]"; }

const json& field(const json& obj, const char* key, const std::string& where) {
  auto it = obj.find(key);
  if (it == obj.end()) throw Error(where + ": '" + key + "' is missing");
  return *it;
}

int64_t positive_int(const json& obj, const char* key, const std::string& where) {
  const json& v = field(obj, key, where);
  if (!v.is_number_integer() || v.get<int64_t>() <= 0)
    throw Error(where + ": '" + key + "' must be a positive integer, got " + v.dump());
  return v.get<int64_t>();
}

std::string opt_string(const json& obj, const char* key, const std::string& where) {
  auto it = obj.find(key);
  if (it == obj.end() || it->is_null()) return {};
  if (!it->is_string()) throw Error(where + ": '" + key + "' must be a string, got " + it->dump());
  return it->get<std::string>();
}

}  // namespace

ModelShape shape_of(const model::ModelConfig& cfg, const std::string& fingerprint) {
  ModelShape s;
  s.architecture = cfg.model_type.empty() ? "qwen3" : cfg.model_type;
  s.num_layers = cfg.num_hidden_layers;
  s.num_heads = cfg.num_attention_heads;
  s.num_kv_heads = cfg.num_key_value_heads;
  s.head_dim = cfg.head_dim;
  s.fingerprint = fingerprint;
  return s;
}

void check_heads(std::vector<Head>& heads, const ModelShape& shape, const std::string& where) {
  for (const Head& h : heads) {
    if (h.first < 0 || h.first >= shape.num_layers)
      throw Error(where + ": fa_heads entry " + head_str(h) + ": layer " + std::to_string(h.first) + " is outside [0, " +
                  std::to_string(shape.num_layers) + ")");
    if (h.second < 0 || h.second >= shape.num_heads)
      throw Error(where + ": fa_heads entry " + head_str(h) + ": head " + std::to_string(h.second) + " is outside [0, " +
                  std::to_string(shape.num_heads) + ")");
  }
  std::sort(heads.begin(), heads.end());
  auto dup = std::adjacent_find(heads.begin(), heads.end());
  if (dup != heads.end()) throw Error(where + ": fa_heads lists " + head_str(*dup) + " twice");
}

Manifest parse_manifest(const json& j, const std::string& where) {
  if (!j.is_object()) throw Error(where + ": a manifest is a JSON object");
  Manifest m;
  const json& format = field(j, "format", where);
  if (!format.is_string() || format.get<std::string>() != kManifestFormat)
    throw Error(where + ": 'format' must be \"" + std::string(kManifestFormat) + "\", got " + format.dump());
  const json& version = field(j, "format_version", where);
  if (!version.is_number_integer() || version.get<int64_t>() != kManifestFormatVersion)
    throw Error(where + ": format_version " + version.dump() + " is not supported (this version reads " +
                std::to_string(kManifestFormatVersion) + ")");
  const json& model = field(j, "model", where);
  if (!model.is_object()) throw Error(where + ": 'model' must be an object");
  const std::string mw = where + ": model";
  m.model.num_layers = positive_int(model, "num_layers", mw);
  m.model.num_heads = positive_int(model, "num_heads", mw);
  m.model.num_kv_heads = positive_int(model, "num_kv_heads", mw);
  m.model.head_dim = positive_int(model, "head_dim", mw);
  if (m.model.num_heads % m.model.num_kv_heads != 0)
    throw Error(mw + ": num_heads " + std::to_string(m.model.num_heads) + " is not a multiple of num_kv_heads " +
                std::to_string(m.model.num_kv_heads));
  m.model.architecture = opt_string(model, "architecture", mw);
  m.model.fingerprint = opt_string(model, "fingerprint", mw);

  if (auto r = j.find("ratio"); r != j.end() && !r->is_null()) {
    if (!r->is_object()) throw Error(where + ": 'ratio' must be an object {\"la\": r, \"fa\": 1}");
    m.ratio_la = positive_int(*r, "la", where + ": ratio");
    m.ratio_fa = positive_int(*r, "fa", where + ": ratio");
  }
  m.strategy = opt_string(j, "strategy", where);
  if (auto s = j.find("score"); s != j.end() && !s->is_null()) {
    if (!s->is_object()) throw Error(where + ": 'score' must be an object");
    m.analysis_sha256 = opt_string(*s, "analysis_sha256", where + ": score");
    if (auto sig = s->find("signals"); sig != s->end()) m.signals = *sig;
  }
  const json& heads = field(j, "fa_heads", where);
  if (!heads.is_array()) throw Error(where + ": 'fa_heads' must be an array of [layer, head] pairs");
  for (size_t i = 0; i < heads.size(); ++i) {
    const json& h = heads[i];
    if (!h.is_array() || h.size() != 2 || !h[0].is_number_integer() || !h[1].is_number_integer())
      throw Error(where + ": fa_heads[" + std::to_string(i) + "] must be [layer, head] integers, got " + h.dump());
    m.fa_heads.push_back({h[0].get<int64_t>(), h[1].get<int64_t>()});
  }
  check_heads(m.fa_heads, m.model, where);
  m.created = opt_string(j, "created", where);
  m.created_by = opt_string(j, "created_by", where);
  if (auto n = j.find("notes"); n != j.end() && !n->is_null()) m.notes = *n;
  return m;
}

Manifest read_manifest(const std::filesystem::path& path) {
  std::ifstream in(path);
  if (!in) throw Error(path.string() + ": cannot read");
  json j;
  try {
    in >> j;
  } catch (const json::parse_error& e) {
    throw Error(path.string() + ": not valid JSON: " + e.what());
  }
  return parse_manifest(j, path.string());
}

json to_json(const Manifest& m) {
  json model = {{"architecture", m.model.architecture.empty() ? "qwen3" : m.model.architecture},
                {"num_layers", m.model.num_layers},
                {"num_heads", m.model.num_heads},
                {"num_kv_heads", m.model.num_kv_heads},
                {"head_dim", m.model.head_dim}};
  if (!m.model.fingerprint.empty()) model["fingerprint"] = m.model.fingerprint;
  json j = {{"format", kManifestFormat}, {"format_version", m.format_version}, {"model", model}};
  if (m.ratio_la > 0 && m.ratio_fa > 0) j["ratio"] = {{"la", m.ratio_la}, {"fa", m.ratio_fa}};
  if (!m.strategy.empty()) j["strategy"] = m.strategy;
  if (!m.analysis_sha256.empty() || !m.signals.empty())
    j["score"] = {{"analysis_sha256", m.analysis_sha256}, {"signals", m.signals}};
  json heads = json::array();
  for (const Head& h : m.fa_heads) heads.push_back({h.first, h.second});
  j["fa_heads"] = heads;
  if (!m.created.empty()) j["created"] = m.created;
  if (!m.created_by.empty()) j["created_by"] = m.created_by;
  j["notes"] = m.notes;
  return j;
}

void write_manifest(const std::filesystem::path& path, Manifest m) {
  check_heads(m.fa_heads, m.model, path.string());
  // Indented, with flat number arrays (the [layer, head] pairs) on one line each, so a hand edit
  // shows as a one-line diff.
  // Keys in the order DESIGN section 8 lists them (json sorts keys; ordered_json keeps insertion order).
  const json plain = to_json(m);
  nlohmann::ordered_json j;
  for (const char* key : {"format", "format_version", "model", "ratio", "strategy", "score", "fa_heads", "created",
                          "created_by", "notes"}) {
    auto it = plain.find(key);
    if (it == plain.end()) continue;
    if (std::string(key) == "model") {
      nlohmann::ordered_json model;
      for (const char* k : {"architecture", "num_layers", "num_heads", "num_kv_heads", "head_dim", "fingerprint"})
        if (it->contains(k)) model[k] = (*it)[k];
      j[key] = model;
    } else {
      j[key] = *it;
    }
  }
  std::string text = j.dump(2);
  std::string out;
  out.reserve(text.size());
  for (size_t i = 0; i < text.size(); ++i) {
    if (text[i] == '[') {
      size_t close = text.find(']', i);
      const std::string inner = text.substr(i + 1, close - i - 1);
      if (inner.find('[') == std::string::npos && inner.find('{') == std::string::npos &&
          inner.find('"') == std::string::npos && inner.find(',') != std::string::npos) {
        std::string compact = "[";
        for (char c : inner) {
          if (c == '\n' || c == ' ') continue;
          compact += c;
          if (c == ',') compact += ' ';
        }
        out += compact + "]";
        i = close;
        continue;
      }
    }
    out += text[i];
  }
  io::write_file_atomic(path, out + "\n");
}

void check_fits(const Manifest& m, const ModelShape& model, const std::string& where) {
  auto same = [&](int64_t a, int64_t b, const char* what) {
    if (a != b)
      throw Error(where + ": the manifest's model." + what + " is " + std::to_string(a) + ", this model's is " +
                  std::to_string(b));
  };
  same(m.model.num_layers, model.num_layers, "num_layers");
  same(m.model.num_heads, model.num_heads, "num_heads");
  same(m.model.num_kv_heads, model.num_kv_heads, "num_kv_heads");
  same(m.model.head_dim, model.head_dim, "head_dim");
  if (!m.model.fingerprint.empty() && !model.fingerprint.empty() && m.model.fingerprint != model.fingerprint)
    throw Error(where + ": model fingerprint " + m.model.fingerprint + " does not match this model's " + model.fingerprint);
}

std::string iso8601_now() {
  const std::time_t t = std::time(nullptr);
  std::tm tm{};
  gmtime_r(&t, &tm);
  char buf[32];
  std::strftime(buf, sizeof buf, "%Y-%m-%dT%H:%M:%SZ", &tm);
  return buf;
}

}  // namespace hh::select
