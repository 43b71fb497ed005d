#pragma once
// A checkpoint described without reading any weights: config.json, the safetensors headers and the
// model fingerprint. `hydrahead inspect` prints it and the workbench's Model view shows it.
#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/model/config.h"

namespace hh::model {

struct TensorEntry {
  std::string name;
  std::string dtype;            // safetensors spelling: "BF16", "F32", ...
  std::vector<int64_t> shape;
  int64_t numel = 0;
};

struct ModelSummary {
  std::filesystem::path dir;               // absolute, normalised
  std::string name;                        // the folder's name
  ModelConfig config;
  std::string fingerprint;                 // "sha256:<hex>" (DESIGN §7)
  std::vector<std::string> weight_files;   // *.safetensors file names, sorted
  std::vector<TensorEntry> tensors;        // in natural name order (layers.2 before layers.10)
  std::string weights_dtype;               // "BF16", or "BF16 ×310, F32 ×3" when mixed
  int64_t params_from_config = 0;          // implied by config.json
  int64_t params_from_tensors = 0;         // sum of the stored tensors' element counts

  nlohmann::json hydrahead;                // a hybrid's "hydrahead" block; null for a dense checkpoint

  bool is_hybrid() const { return !hydrahead.is_null(); }
  bool params_match() const { return params_from_config == params_from_tensors; }
};

// Reads config.json, opens the checkpoint's safetensors headers and computes the fingerprint.
// Throws hh::Error naming the folder, file and field when something is missing or malformed.
ModelSummary summarize_checkpoint(const std::filesystem::path& dir);

// 596049920 -> "596.0 M", 8190735360 -> "8.19 B", 1500 -> "1.5 K", 999 -> "999".
std::string format_parameter_count(int64_t n);
// 151936 -> "151,936"; negative numbers keep their sign.
std::string group_digits(int64_t n);
// {1024, 151936} -> "[1024, 151936]"; a scalar is "[]".
std::string format_shape(const std::vector<int64_t>& shape);
// "sha256:0123abcd..." -> "sha256:0123abcd0123" (the algorithm tag plus `hex_chars` digits).
std::string fingerprint_prefix(const std::string& fingerprint, int hex_chars = 12);
// Orders digit runs by value, so "layers.2.x" < "layers.10.x".
bool natural_less(const std::string& a, const std::string& b);
// The stored dtype(s): one name when uniform, else "NAME ×count" by decreasing count.
std::string dtype_summary(const std::vector<TensorEntry>& tensors);

}  // namespace hh::model
