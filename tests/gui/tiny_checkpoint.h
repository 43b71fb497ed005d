#pragma once
// Tiny Qwen3-layout checkpoints for the GUI tests: config.json text plus a model.safetensors of
// zero-filled tensors with the HF names and shapes, written without LibTorch.
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "core/io/safetensors.h"

namespace hh::test {

struct TinySpec {
  int64_t layers = 2;
  int64_t heads = 4;          // Hq
  int64_t kv_heads = 2;       // Hkv
  int64_t head_dim = 8;       // Dh
  int64_t hidden = 16;        // d
  int64_t vocab = 64;
  int64_t intermediate = 24;
  bool tied = true;
  hh::io::DType dtype = hh::io::DType::F32;
  std::string skip_tensor;    // a tensor name left out of the file (to break the parameter count)
};

struct TinyTensor {
  std::string name;
  std::vector<int64_t> shape;
  int64_t numel() const {
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    return n;
  }
};

// Every tensor a Qwen3 dense checkpoint of this shape holds, in HF naming.
inline std::vector<TinyTensor> tiny_tensors(const TinySpec& s) {
  std::vector<TinyTensor> t;
  t.push_back({"model.embed_tokens.weight", {s.vocab, s.hidden}});
  for (int64_t l = 0; l < s.layers; ++l) {
    const std::string p = "model.layers." + std::to_string(l) + ".";
    t.push_back({p + "input_layernorm.weight", {s.hidden}});
    t.push_back({p + "self_attn.q_proj.weight", {s.heads * s.head_dim, s.hidden}});
    t.push_back({p + "self_attn.k_proj.weight", {s.kv_heads * s.head_dim, s.hidden}});
    t.push_back({p + "self_attn.v_proj.weight", {s.kv_heads * s.head_dim, s.hidden}});
    t.push_back({p + "self_attn.o_proj.weight", {s.hidden, s.heads * s.head_dim}});
    t.push_back({p + "self_attn.q_norm.weight", {s.head_dim}});
    t.push_back({p + "self_attn.k_norm.weight", {s.head_dim}});
    t.push_back({p + "post_attention_layernorm.weight", {s.hidden}});
    t.push_back({p + "mlp.gate_proj.weight", {s.intermediate, s.hidden}});
    t.push_back({p + "mlp.up_proj.weight", {s.intermediate, s.hidden}});
    t.push_back({p + "mlp.down_proj.weight", {s.hidden, s.intermediate}});
  }
  t.push_back({"model.norm.weight", {s.hidden}});
  if (!s.tied) t.push_back({"lm_head.weight", {s.vocab, s.hidden}});
  return t;
}

inline int64_t tiny_parameter_count(const TinySpec& s) {
  int64_t n = 0;
  for (const auto& t : tiny_tensors(s)) n += t.numel();
  return n;
}

inline std::string tiny_config_json(const TinySpec& s) {
  const char* dtype = s.dtype == hh::io::DType::BF16 ? "bfloat16" : s.dtype == hh::io::DType::F16 ? "float16" : "float32";
  return std::string("{\n") +
         "  \"architectures\": [\"Qwen3ForCausalLM\"],\n"
         "  \"model_type\": \"qwen3\",\n"
         "  \"vocab_size\": " + std::to_string(s.vocab) + ",\n" +
         "  \"hidden_size\": " + std::to_string(s.hidden) + ",\n" +
         "  \"intermediate_size\": " + std::to_string(s.intermediate) + ",\n" +
         "  \"num_hidden_layers\": " + std::to_string(s.layers) + ",\n" +
         "  \"num_attention_heads\": " + std::to_string(s.heads) + ",\n" +
         "  \"num_key_value_heads\": " + std::to_string(s.kv_heads) + ",\n" +
         "  \"head_dim\": " + std::to_string(s.head_dim) + ",\n" +
         "  \"hidden_act\": \"silu\",\n"
         "  \"max_position_embeddings\": 4096,\n"
         "  \"rms_norm_eps\": 1e-06,\n"
         "  \"rope_theta\": 1000000,\n"
         "  \"attention_bias\": false,\n"
         "  \"tie_word_embeddings\": " + (s.tied ? "true" : "false") + ",\n" +
         "  \"torch_dtype\": \"" + dtype + "\",\n" +
         "  \"bos_token_id\": 1,\n"
         "  \"eos_token_id\": 2\n"
         "}\n";
}

inline void write_text(const std::filesystem::path& path, const std::string& text) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out << text;
}

// Writes config.json and model.safetensors into `dir` (created, or emptied first).
inline std::filesystem::path write_tiny_checkpoint(const std::filesystem::path& dir, const TinySpec& s) {
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  write_text(dir / "config.json", tiny_config_json(s));
  const auto tensors = tiny_tensors(s);
  std::vector<std::vector<std::byte>> storage;
  std::vector<hh::io::TensorBlob> blobs;
  storage.reserve(tensors.size());
  for (const auto& t : tensors) {
    if (t.name == s.skip_tensor) continue;
    storage.emplace_back(static_cast<std::size_t>(t.numel()) * hh::io::dtype_size(s.dtype), std::byte{0});
    blobs.push_back({t.name, s.dtype, t.shape, storage.back().data(), storage.back().size()});
  }
  hh::io::write_safetensors(dir / "model.safetensors", blobs);
  return dir;
}

}  // namespace hh::test
