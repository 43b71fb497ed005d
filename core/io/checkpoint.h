#pragma once
// An HF-format checkpoint directory: config.json, model.safetensors or sharded
// model-0000x-of-0000y.safetensors + model.safetensors.index.json, tokenizer.json.
#include <filesystem>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "core/io/safetensors.h"
#include "core/util/compat.h"

namespace hh::io {

class Checkpoint {
 public:
  // Opens (mmaps) every shard; validates the index (each listed file exists and holds the tensor).
  // model.safetensors wins when both it and an index are present (HF's order). With an index, only
  // the tensors its weight_map lists are visible.
  explicit Checkpoint(const std::filesystem::path& dir);
  const std::filesystem::path& dir() const { return dir_; }
  std::vector<std::string> tensor_names() const;   // sorted
  bool contains(const std::string& name) const;
  const TensorInfo& info(const std::string& name) const;
  // Copies the tensor out of the mapping into a new CPU tensor of its stored dtype.
  // Throws hh::Error naming the file and tensor when absent.
  at::Tensor load(const std::string& name) const;
  // As load(), and checks the shape; the error names tensor, expected and found shapes.
  at::Tensor load(const std::string& name, const std::vector<int64_t>& expected_shape) const;

 private:
  // Names where tensors are listed in errors: model.safetensors or the index file.
  std::string source_;
  std::filesystem::path dir_;
  std::vector<std::unique_ptr<SafetensorsFile>> files_;
  std::map<std::string, const SafetensorsFile*> where_;
};

// Every tensor of one safetensors file, copied into CPU tensors of their stored dtype.
std::map<std::string, at::Tensor> load_tensors(const std::filesystem::path& file);

// Writes named tensors as one safetensors file (atomic), in the given order. Each tensor is made a
// contiguous CPU copy first; its dtype must be one safetensors knows. Unless `metadata` sets
// "format", it records "format": "pt" as HF transformers expects of the files it loads.
void save_tensors(const std::filesystem::path& path, const std::vector<std::pair<std::string, at::Tensor>>& tensors,
                  const std::map<std::string, std::string>& metadata = {});

// Writes an HF-style sharded checkpoint into `dir` (created when missing): tensors in the given order,
// a new shard whenever the next tensor would push the current one past `max_shard_bytes` (a tensor
// larger than that gets a shard of its own), files model-00001-of-0000N.safetensors and
// model.safetensors.index.json {"metadata": {"total_size": bytes}, "weight_map": {name: file}}.
// When everything fits in one shard it writes model.safetensors and no index, as HF does. The other
// layout's file, left by an earlier save, is removed so that it cannot shadow the new one.
// Returns the file names written (the index last).
std::vector<std::string> save_sharded(const std::filesystem::path& dir,
                                      const std::vector<std::pair<std::string, at::Tensor>>& tensors,
                                      uint64_t max_shard_bytes, const std::map<std::string, std::string>& metadata = {});

inline constexpr const char* kSingleWeightsFile = "model.safetensors";
inline constexpr const char* kWeightsIndexFile = "model.safetensors.index.json";

at::ScalarType to_scalar_type(DType d);
DType from_scalar_type(at::ScalarType t);  // throws hh::Error for unsupported types

}  // namespace hh::io
