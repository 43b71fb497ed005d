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
  std::filesystem::path dir_;
  std::vector<std::unique_ptr<SafetensorsFile>> files_;
  std::map<std::string, const SafetensorsFile*> where_;
};

// Writes named CPU tensors as one safetensors file (atomic). Tensors must be contiguous-able and of a
// dtype safetensors knows.
void save_tensors(const std::filesystem::path& path, const std::vector<std::pair<std::string, at::Tensor>>& tensors,
                  const std::map<std::string, std::string>& metadata = {});

at::ScalarType to_scalar_type(DType d);
DType from_scalar_type(at::ScalarType t);  // throws hh::Error for unsupported types

}  // namespace hh::io
