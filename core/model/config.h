#pragma once
// config.json of a Qwen3 dense checkpoint (HF field names). No LibTorch here (this file is fuzzed).
#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>

#include <nlohmann/json_fwd.hpp>

namespace hh::model {

struct ModelConfig {
  std::string architecture = "Qwen3ForCausalLM";  // architectures[0]
  std::string model_type = "qwen3";
  int64_t vocab_size = 0;
  int64_t hidden_size = 0;           // d
  int64_t intermediate_size = 0;     // MLP width
  int64_t num_hidden_layers = 0;     // L
  int64_t num_attention_heads = 0;   // Hq
  int64_t num_key_value_heads = 0;   // Hkv (defaults to Hq when absent)
  int64_t head_dim = 0;              // Dh (defaults to d / Hq when absent)
  double rms_norm_eps = 1e-6;
  double rope_theta = 1000000.0;
  int64_t max_position_embeddings = 32768;
  bool tie_word_embeddings = false;
  bool attention_bias = false;
  std::string torch_dtype = "float32";  // "torch_dtype" or "dtype"
  std::optional<int64_t> bos_token_id, eos_token_id;

  int64_t kv_group_size() const { return num_attention_heads / num_key_value_heads; }
  int64_t num_parameters() const;    // exact count implied by the config

  // Parses and validates: required fields present and positive, Hq % Hkv == 0, hidden_act silu,
  // no rope_scaling (unsupported) ... `where` names the file. Throws hh::Error naming the field.
  static ModelConfig from_json(const nlohmann::json& j, const std::string& where);
  static ModelConfig from_json_text(const std::string& text, const std::string& where);
  static ModelConfig load(const std::filesystem::path& config_json);
  // The same for a HydraHead hybrid's config.json too: its teacher fields, with the "hydrahead" block
  // handed back in `hydrahead` (null for a dense checkpoint). load() refuses hybrids.
  static ModelConfig load_teacher_view(const std::filesystem::path& config_json, nlohmann::json* hydrahead = nullptr);
  nlohmann::json to_json() const;
};

// A dtype option's canonical name: "f32", "bf16", "f16" or "f64" for those and their long forms
// (float32, bfloat16, half, fp64, ...); "" for any other name. model::parse_dtype maps these.
std::string canonical_dtype(const std::string& name);
// Whether a dtype option is one model::resolve_dtype takes: "" (the checkpoint's), "auto" or a dtype name.
inline bool is_dtype_option(const std::string& name) {
  return name.empty() || name == "auto" || !canonical_dtype(name).empty();
}

}  // namespace hh::model
