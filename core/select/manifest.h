#pragma once
// manifest.json (DESIGN.md section 8): which query heads keep full attention. Read, validated and
// written here only; the CLI, the workbench and conversion all go through these functions.
//
// Required: format = "hydrahead-manifest", format_version = 1, model.{num_layers, num_heads,
// num_kv_heads, head_dim}, fa_heads = [[layer, head], ...]. Everything else is optional, so a
// hand-written manual manifest is valid. fa_heads are stored sorted and unique; a reader sorts them
// and refuses duplicates and heads outside the model.
#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

namespace hh::model {
struct ModelConfig;
}

namespace hh::select {

inline constexpr const char* kManifestFormat = "hydrahead-manifest";
inline constexpr int64_t kManifestFormatVersion = 1;

struct ModelShape {
  std::string architecture = "qwen3";
  int64_t num_layers = 0, num_heads = 0, num_kv_heads = 0, head_dim = 0;
  std::string fingerprint;  // "sha256:..."; empty when unknown
  int64_t group_size() const { return num_heads / num_kv_heads; }
};
ModelShape shape_of(const model::ModelConfig& cfg, const std::string& fingerprint = {});

using Head = std::pair<int64_t, int64_t>;  // (layer, query head)

struct Manifest {
  int64_t format_version = kManifestFormatVersion;
  ModelShape model;
  int64_t ratio_la = 0, ratio_fa = 0;  // 0:0 when absent
  std::string strategy;                // "" when absent
  std::string analysis_sha256;         // score.analysis_sha256
  nlohmann::json signals = nlohmann::json::object();  // score.signals: weights used
  std::vector<Head> fa_heads;          // sorted, unique
  std::string created, created_by;
  nlohmann::json notes = "";           // free text, or an object (select stores its budget table here)
};

// Parses and validates a manifest object; `where` (a file name) prefixes every error.
Manifest parse_manifest(const nlohmann::json& j, const std::string& where);
Manifest read_manifest(const std::filesystem::path& path);
nlohmann::json to_json(const Manifest& m);
// Validates, then writes atomically (temp file + rename). Sorts fa_heads.
void write_manifest(const std::filesystem::path& path, Manifest m);

// The manifest fits this model: same layer/head/KV-head counts and head_dim, and when both
// fingerprints are known they agree. Throws hh::Error naming the mismatch.
void check_fits(const Manifest& m, const ModelShape& model, const std::string& where);

// Sorted, unique heads inside the shape; throws naming the offending head (prefixed by `where`).
void check_heads(std::vector<Head>& heads, const ModelShape& shape, const std::string& where);

// "2026-11-30T03:41:07Z"
std::string iso8601_now();

}  // namespace hh::select
