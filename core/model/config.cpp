#include "core/model/config.h"

#include <cerrno>
#include <cmath>
#include <cstring>
#include <fstream>
#include <iterator>
#include <limits>
#include <utility>

#include <nlohmann/json.hpp>

#include "core/util/error.h"

namespace hh::model {
namespace {

using nlohmann::json;

constexpr const char* kArchitecture = "Qwen3ForCausalLM";
constexpr const char* kModelType = "qwen3";
constexpr const char* kActivation = "silu";
// Rope types that mean "plain RoPE, no scaling" (HF writes rope_type or the older type).
constexpr const char* kRopeDefault = "default";
// Longest JSON value quoted in an error message.
constexpr std::size_t kMaxQuotedChars = 80;

// Short rendering of a JSON value for messages; never dumps a whole (possibly deep) tree.
std::string describe(const json& v) {
  switch (v.type()) {
    case json::value_t::object: return "an object";
    case json::value_t::array: return "an array";
    case json::value_t::string: {
      const auto& s = v.get_ref<const std::string&>();
      if (s.size() <= kMaxQuotedChars) return "the string \"" + s + "\"";
      return "the string \"" + s.substr(0, kMaxQuotedChars) + "...\"";
    }
    default: return v.dump();
  }
}

// Field access with messages of the form `<file>: field "x": expected ..., found ...`.
class Reader {
 public:
  Reader(const json& j, const std::string& where) : j_(j), where_(where) {}

  // Absent and null both mean "use the default".
  const json* find(const char* field) const {
    const auto it = j_.find(field);
    if (it == j_.end() || it->is_null()) return nullptr;
    return &*it;
  }

  [[noreturn]] void fail(const char* field, const std::string& what) const {
    throw Error(where_ + ": field \"" + field + "\": " + what);
  }

  int64_t positive_int(const char* field, const json& v) const {
    if (v.is_number_unsigned()) {
      if (v.get<uint64_t>() > uint64_t(std::numeric_limits<int64_t>::max())) fail(field, "value " + v.dump() + " is too large");
    } else if (!v.is_number_integer()) {
      fail(field, "expected a positive integer, found " + describe(v));
    }
    const int64_t x = v.get<int64_t>();
    if (x <= 0) fail(field, "expected a positive integer, found " + std::to_string(x));
    return x;
  }
  int64_t required_positive_int(const char* field) const {
    const json* v = find(field);
    if (!v) fail(field, "required but missing");
    return positive_int(field, *v);
  }
  int64_t optional_positive_int(const char* field, int64_t fallback) const {
    const json* v = find(field);
    return v ? positive_int(field, *v) : fallback;
  }

  // Integers and floats alike (rope_theta is written as 1000000 or 1000000.0 depending on the tool).
  double positive_number(const char* field, const json& v) const {
    if (!v.is_number()) fail(field, "expected a positive number, found " + describe(v));
    const double x = v.get<double>();
    if (!(x > 0) || !std::isfinite(x))
      fail(field, "expected a positive number, found " + v.dump());
    return x;
  }
  double optional_positive_number(const char* field, double fallback) const {
    const json* v = find(field);
    return v ? positive_number(field, *v) : fallback;
  }

  bool optional_bool(const char* field, bool fallback) const {
    const json* v = find(field);
    if (!v) return fallback;
    if (!v->is_boolean()) fail(field, "expected true or false, found " + describe(*v));
    return v->get<bool>();
  }

  std::optional<std::string> optional_string(const char* field) const {
    const json* v = find(field);
    if (!v) return std::nullopt;
    if (!v->is_string()) fail(field, "expected a string, found " + describe(*v));
    return v->get<std::string>();
  }

  // Token ids: a non-negative integer, or a list whose first entry is used (some exports write lists).
  std::optional<int64_t> optional_token_id(const char* field) const {
    const json* v = find(field);
    if (!v) return std::nullopt;
    const json* id = v;
    if (v->is_array()) {
      if (v->empty()) return std::nullopt;
      id = &(*v)[0];
    }
    if (id->is_number_unsigned() && id->get<uint64_t>() <= uint64_t(std::numeric_limits<int64_t>::max()))
      return id->get<int64_t>();
    if (id->is_number_integer() && id->get<int64_t>() >= 0) return id->get<int64_t>();
    fail(field, "expected a non-negative token id, found " + describe(*id));
  }

 private:
  const json& j_;
  const std::string& where_;
};

// Checked arithmetic for num_parameters(): a hostile config must not overflow int64.
struct Count {
  int64_t v = 0;
  bool overflow = false;
};
Count mul(Count a, int64_t b) {
  Count r = a;
  r.overflow = a.overflow || __builtin_mul_overflow(a.v, b, &r.v);
  return r;
}
Count add(Count a, Count b) {
  Count r;
  r.overflow = a.overflow || b.overflow || __builtin_add_overflow(a.v, b.v, &r.v);
  return r;
}
Count product(std::initializer_list<int64_t> xs) {
  Count r{1, false};
  for (const int64_t x : xs) r = mul(r, x);
  return r;
}

Count count_parameters(const ModelConfig& c) {
  const int64_t d = c.hidden_size, V = c.vocab_size, I = c.intermediate_size;
  const int64_t Hq = c.num_attention_heads, Hkv = c.num_key_value_heads, Dh = c.head_dim;

  Count layer;
  layer = add(layer, product({Hq, Dh, d}));        // q_proj   [Hq*Dh, d]
  layer = add(layer, product({2, Hkv, Dh, d}));    // k_proj, v_proj [Hkv*Dh, d] each
  layer = add(layer, product({d, Hq, Dh}));        // o_proj   [d, Hq*Dh]
  layer = add(layer, product({2, Dh}));            // q_norm, k_norm [Dh]
  layer = add(layer, product({2, d}));             // input_layernorm, post_attention_layernorm [d]
  layer = add(layer, product({3, I, d}));          // gate_proj, up_proj [I, d]; down_proj [d, I]
  if (c.attention_bias) {
    layer = add(layer, product({Hq, Dh}));         // q_proj.bias
    layer = add(layer, product({2, Hkv, Dh}));     // k_proj.bias, v_proj.bias
  }

  Count total = product({V, d});                   // embed_tokens [V, d]
  total = add(total, mul(layer, c.num_hidden_layers));
  total = add(total, Count{d, false});             // final norm [d]
  if (!c.tie_word_embeddings) total = add(total, product({V, d}));  // lm_head [V, d]
  return total;
}

void check_architecture(const json& j, const std::string& where, ModelConfig& c) {
  Reader r(j, where);
  const auto model_type = r.optional_string("model_type");
  const json* arch = r.find("architectures");
  if (arch) {
    if (!arch->is_array()) r.fail("architectures", "expected a list of strings, found " + describe(*arch));
    bool found = false;
    for (const auto& a : *arch) {
      if (!a.is_string()) r.fail("architectures", "expected a list of strings, found an entry " + describe(a));
      found = found || a.get_ref<const std::string&>() == kArchitecture;
    }
    if (!found) {
      std::string listed;
      for (const auto& a : *arch) listed += (listed.empty() ? "" : ", ") + a.get<std::string>();
      r.fail("architectures", "[" + listed + "] does not contain " + kArchitecture + " (only Qwen3 dense is supported)");
    }
  } else if (!model_type) {
    r.fail("architectures", std::string("missing, and no \"model_type\" either; expected ") + kArchitecture);
  }
  if (model_type && *model_type != kModelType)
    r.fail("model_type", "\"" + *model_type + "\" is not supported (expected \"" + kModelType + "\")");
  c.architecture = kArchitecture;
  c.model_type = kModelType;
}

// Plain RoPE only. HF >= 5 writes "rope_parameters" ({"rope_type": "default", "rope_theta": ...});
// older files write "rope_theta" and "rope_scaling" (null unless scaled).
void check_rope(const json& j, const std::string& where, ModelConfig& c) {
  Reader r(j, where);
  auto rope_type_of = [&](const char* field, const json& block) -> std::string {
    if (!block.is_object()) r.fail(field, "expected an object or null, found " + describe(block));
    for (const char* key : {"rope_type", "type"}) {
      const auto it = block.find(key);
      if (it != block.end() && !it->is_null()) {
        if (!it->is_string()) r.fail(field, std::string("\"") + key + "\" must be a string, found " + describe(*it));
        return it->get<std::string>();
      }
    }
    return kRopeDefault;
  };
  if (const json* scaling = r.find("rope_scaling")) {
    const std::string type = rope_type_of("rope_scaling", *scaling);
    if (type != kRopeDefault)
      r.fail("rope_scaling", "RoPE scaling (\"" + type + "\") is not supported; only plain RoPE is");
  }
  c.rope_theta = r.optional_positive_number("rope_theta", c.rope_theta);
  if (const json* params = r.find("rope_parameters")) {
    const std::string type = rope_type_of("rope_parameters", *params);
    if (type != kRopeDefault)
      r.fail("rope_parameters", "RoPE scaling (\"" + type + "\") is not supported; only plain RoPE is");
    const auto theta = params->find("rope_theta");
    if (theta != params->end() && !theta->is_null()) c.rope_theta = r.positive_number("rope_parameters", *theta);
  }
}

void check_attention_kind(const json& j, const std::string& where) {
  Reader r(j, where);
  if (r.optional_bool("use_sliding_window", false))
    r.fail("use_sliding_window", "sliding-window attention is not supported");
  if (const json* types = r.find("layer_types")) {
    if (!types->is_array()) r.fail("layer_types", "expected a list of strings, found " + describe(*types));
    for (const auto& t : *types)
      if (!t.is_string() || t.get_ref<const std::string&>() != "full_attention")
        r.fail("layer_types", "only \"full_attention\" layers are supported, found " + describe(t));
  }
}

}  // namespace

int64_t ModelConfig::num_parameters() const {
  const Count c = count_parameters(*this);
  if (c.overflow) throw Error("config: parameter count overflows a 64-bit integer");
  return c.v;
}

ModelConfig ModelConfig::from_json(const nlohmann::json& j, const std::string& where) {
  if (!j.is_object()) throw Error(where + ": config must be a JSON object, found " + describe(j));
  Reader r(j, where);
  ModelConfig c;
  check_architecture(j, where, c);

  c.vocab_size = r.required_positive_int("vocab_size");
  c.hidden_size = r.required_positive_int("hidden_size");
  c.intermediate_size = r.required_positive_int("intermediate_size");
  c.num_hidden_layers = r.required_positive_int("num_hidden_layers");
  c.num_attention_heads = r.required_positive_int("num_attention_heads");
  c.num_key_value_heads = r.optional_positive_int("num_key_value_heads", c.num_attention_heads);
  if (c.num_attention_heads % c.num_key_value_heads != 0)
    r.fail("num_key_value_heads", std::to_string(c.num_key_value_heads) + " does not divide num_attention_heads " +
                                      std::to_string(c.num_attention_heads));
  if (r.find("head_dim")) {
    c.head_dim = r.optional_positive_int("head_dim", 0);
  } else {
    if (c.hidden_size % c.num_attention_heads != 0)
      r.fail("head_dim", "absent, and hidden_size " + std::to_string(c.hidden_size) +
                             " is not a multiple of num_attention_heads " + std::to_string(c.num_attention_heads));
    c.head_dim = c.hidden_size / c.num_attention_heads;
  }
  c.rms_norm_eps = r.optional_positive_number("rms_norm_eps", c.rms_norm_eps);
  c.max_position_embeddings = r.optional_positive_int("max_position_embeddings", c.max_position_embeddings);
  c.tie_word_embeddings = r.optional_bool("tie_word_embeddings", false);
  c.attention_bias = r.optional_bool("attention_bias", false);

  if (const auto act = r.optional_string("hidden_act"); act && *act != kActivation)
    r.fail("hidden_act", "\"" + *act + "\" is not supported (expected \"" + kActivation + "\")");
  check_rope(j, where, c);
  check_attention_kind(j, where);

  // HF >= 5 writes "dtype"; older files "torch_dtype".
  const char* dtype_field = r.find("dtype") ? "dtype" : "torch_dtype";
  if (const auto dtype = r.optional_string(dtype_field)) {
    if (*dtype != "float32" && *dtype != "bfloat16" && *dtype != "float16" && *dtype != "float64")
      r.fail(dtype_field, "\"" + *dtype + "\" is not one of float32, bfloat16, float16, float64");
    c.torch_dtype = *dtype;
  }
  c.bos_token_id = r.optional_token_id("bos_token_id");
  c.eos_token_id = r.optional_token_id("eos_token_id");

  if (count_parameters(c).overflow)
    throw Error(where + ": the sizes in this config imply more than 2^63 parameters");
  return c;
}

ModelConfig ModelConfig::from_json_text(const std::string& text, const std::string& where) {
  json j;
  try {
    j = json::parse(text);
  } catch (const json::parse_error& e) {
    // e.what() carries nlohmann's line and column; e.byte is the offset into the text.
    throw Error(where + ": not valid JSON (byte " + std::to_string(e.byte) + "): " + e.what());
  } catch (const json::exception& e) {
    // e.g. out_of_range for a number literal beyond double's range (1e999)
    throw Error(where + ": not valid JSON: " + e.what());
  }
  return from_json(j, where);
}

ModelConfig ModelConfig::load_teacher_view(const std::filesystem::path& config_json, nlohmann::json* hydrahead) {
  std::ifstream in(config_json, std::ios::binary);
  if (!in) throw Error(config_json.string() + ": cannot open: " + std::strerror(errno));
  const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  json j;
  try {
    j = json::parse(text);
  } catch (const json::exception& e) {
    throw Error(config_json.string() + ": not valid JSON: " + e.what());
  }
  if (hydrahead != nullptr) *hydrahead = json();
  if (j.is_object() && j.contains("hydrahead")) {
    if (hydrahead != nullptr) *hydrahead = j["hydrahead"];
    j.erase("hydrahead");
    j["architectures"] = json::array({kArchitecture});
    j["model_type"] = kModelType;
  }
  return from_json(j, config_json.string());
}

ModelConfig ModelConfig::load(const std::filesystem::path& config_json) {
  std::ifstream in(config_json, std::ios::binary);
  if (!in) throw Error(config_json.string() + ": cannot open: " + std::strerror(errno));
  const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  if (in.bad()) throw Error(config_json.string() + ": read error");
  return from_json_text(text, config_json.string());
}

nlohmann::json ModelConfig::to_json() const {
  json j = {
      {"architectures", json::array({architecture})},
      {"model_type", model_type},
      {"vocab_size", vocab_size},
      {"hidden_size", hidden_size},
      {"intermediate_size", intermediate_size},
      {"num_hidden_layers", num_hidden_layers},
      {"num_attention_heads", num_attention_heads},
      {"num_key_value_heads", num_key_value_heads},
      {"head_dim", head_dim},
      {"hidden_act", kActivation},
      {"rms_norm_eps", rms_norm_eps},
      {"rope_theta", rope_theta},
      {"rope_scaling", nullptr},
      {"max_position_embeddings", max_position_embeddings},
      {"tie_word_embeddings", tie_word_embeddings},
      {"attention_bias", attention_bias},
      {"use_sliding_window", false},
      {"torch_dtype", torch_dtype},
  };
  if (bos_token_id) j["bos_token_id"] = *bos_token_id;
  if (eos_token_id) j["eos_token_id"] = *eos_token_id;
  return j;
}

std::string canonical_dtype(const std::string& name) {
  static const std::pair<const char*, const char*> kNames[] = {
      {"f32", "f32"},      {"fp32", "f32"},     {"float32", "f32"}, {"float", "f32"},   {"bf16", "bf16"},
      {"bfloat16", "bf16"}, {"f16", "f16"},     {"fp16", "f16"},    {"float16", "f16"}, {"half", "f16"},
      {"f64", "f64"},      {"fp64", "f64"},     {"float64", "f64"}, {"double", "f64"}};
  for (const auto& [n, c] : kNames)
    if (name == n) return c;
  return {};
}

}  // namespace hh::model
