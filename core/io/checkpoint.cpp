#include "core/io/checkpoint.h"

#include <torch/torch.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <iterator>
#include <set>

#include <nlohmann/json.hpp>

#include "core/util/error.h"

namespace hh::io {
namespace fs = std::filesystem;
using nlohmann::json;

namespace {

constexpr const char* kFormatKey = "format";
constexpr const char* kFormatPyTorch = "pt";  // what HF transformers checks in a shard's metadata

std::string format_shape(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (std::size_t i = 0; i < shape.size(); ++i) {
    if (i) s += ", ";
    s += std::to_string(shape[i]);
  }
  return s + "]";
}

// A shard name from an index must be a plain file name inside the checkpoint directory.
bool is_plain_file_name(const std::string& name) {
  return !name.empty() && name != "." && name != ".." && name.find('/') == std::string::npos &&
         name.find('\0') == std::string::npos;
}

json read_json_file(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw Error(path.string() + ": cannot open: " + std::strerror(errno));
  const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  try {
    return json::parse(text);
  } catch (const json::exception& e) {
    throw Error(path.string() + ": not valid JSON: " + e.what());
  }
}

std::string shard_file_name(std::size_t index, std::size_t count) {
  char buf[64];
  std::snprintf(buf, sizeof(buf), "model-%05zu-of-%05zu.safetensors", index + 1, count);
  return buf;
}

}  // namespace

at::ScalarType to_scalar_type(DType d) {
  switch (d) {
    case DType::F64: return at::kDouble;
    case DType::F32: return at::kFloat;
    case DType::F16: return at::kHalf;
    case DType::BF16: return at::kBFloat16;
    case DType::I64: return at::kLong;
    case DType::I32: return at::kInt;
    case DType::I16: return at::kShort;
    case DType::I8: return at::kChar;
    case DType::U8: return at::kByte;
    case DType::BOOL: return at::kBool;
  }
  throw Error("invalid safetensors dtype enum value " + std::to_string(static_cast<int>(d)));
}

DType from_scalar_type(at::ScalarType t) {
  switch (t) {
    case at::kDouble: return DType::F64;
    case at::kFloat: return DType::F32;
    case at::kHalf: return DType::F16;
    case at::kBFloat16: return DType::BF16;
    case at::kLong: return DType::I64;
    case at::kInt: return DType::I32;
    case at::kShort: return DType::I16;
    case at::kChar: return DType::I8;
    case at::kByte: return DType::U8;
    case at::kBool: return DType::BOOL;
    default: break;
  }
  throw Error(std::string("tensor dtype ") + c10::toString(t) + " cannot be stored in safetensors");
}

Checkpoint::Checkpoint(const fs::path& dir) : dir_(dir) {
  if (!fs::is_directory(dir)) throw Error(dir.string() + ": not a checkpoint directory");
  const fs::path single = dir / kSingleWeightsFile;
  const fs::path index_path = dir / kWeightsIndexFile;

  if (fs::exists(single)) {
    source_ = single.string();
    files_.push_back(std::make_unique<SafetensorsFile>(single));
    for (const auto& t : files_.back()->header().tensors) where_.emplace(t.name, files_.back().get());
    return;
  }
  if (!fs::exists(index_path))
    throw Error(dir.string() + ": no " + kSingleWeightsFile + " and no " + kWeightsIndexFile);

  source_ = index_path.string();
  const json index = read_json_file(index_path);
  if (!index.is_object()) throw Error(source_ + ": expected a JSON object");
  const auto map_it = index.find("weight_map");
  if (map_it == index.end() || !map_it->is_object())
    throw Error(source_ + ": \"weight_map\" must be an object {tensor name: shard file}");

  std::map<std::string, const SafetensorsFile*> shards;  // file name -> opened shard
  for (const auto& [name, file] : map_it->items()) {
    if (!file.is_string())
      throw Error(source_ + ": tensor '" + name + "': shard must be a file name string, found " + file.dump());
    const std::string& shard_name = file.get_ref<const std::string&>();
    if (!is_plain_file_name(shard_name))
      throw Error(source_ + ": tensor '" + name + "': shard '" + shard_name + "' is not a file name in " + dir.string());

    auto it = shards.find(shard_name);
    if (it == shards.end()) {
      const fs::path shard_path = dir / shard_name;
      if (!fs::is_regular_file(shard_path))
        throw Error(source_ + ": tensor '" + name + "' is mapped to shard '" + shard_name + "', which does not exist");
      files_.push_back(std::make_unique<SafetensorsFile>(shard_path));
      it = shards.emplace(shard_name, files_.back().get()).first;
    }
    if (!it->second->contains(name))
      throw Error(source_ + ": tensor '" + name + "' is mapped to shard '" + shard_name +
                  "', but that shard does not contain it");
    where_.emplace(name, it->second);
  }
}

std::vector<std::string> Checkpoint::tensor_names() const {
  std::vector<std::string> names;
  names.reserve(where_.size());
  for (const auto& [name, file] : where_) names.push_back(name);
  return names;
}

bool Checkpoint::contains(const std::string& name) const { return where_.count(name) != 0; }

const TensorInfo& Checkpoint::info(const std::string& name) const {
  const auto it = where_.find(name);
  if (it == where_.end()) throw Error(source_ + ": no tensor named '" + name + "'");
  return it->second->info(name);
}

at::Tensor Checkpoint::load(const std::string& name) const {
  const auto it = where_.find(name);
  if (it == where_.end()) throw Error(source_ + ": no tensor named '" + name + "'");
  const SafetensorsFile& file = *it->second;
  const TensorInfo& ti = file.info(name);
  at::Tensor out = at::empty(ti.shape, at::TensorOptions().dtype(to_scalar_type(ti.dtype)));  // stored shape
  // Safetensors data is little-endian, as is every host we build for; a plain copy suffices.
  const std::size_t nbytes = ti.end - ti.begin;
  if (nbytes > 0) std::memcpy(out.data_ptr(), file.data(ti), nbytes);
  return out;
}

std::map<std::string, at::Tensor> load_tensors(const fs::path& file) {
  const SafetensorsFile f(file);
  std::map<std::string, at::Tensor> out;
  for (const TensorInfo& ti : f.header().tensors) {
    at::Tensor t = at::empty(ti.shape, at::TensorOptions().dtype(to_scalar_type(ti.dtype)));
    const std::size_t nbytes = ti.end - ti.begin;
    if (nbytes > 0) std::memcpy(t.data_ptr(), f.data(ti), nbytes);
    out.emplace(ti.name, std::move(t));
  }
  return out;
}

at::Tensor Checkpoint::load(const std::string& name, const std::vector<int64_t>& expected_shape) const {
  const TensorInfo& ti = info(name);
  if (ti.shape != expected_shape)
    throw Error(where_.at(name)->path().string() + ": tensor '" + name + "': expected shape " +
                format_shape(expected_shape) + " but the file holds " + format_shape(ti.shape));
  return load(name);
}

void save_tensors(const fs::path& path, const std::vector<std::pair<std::string, at::Tensor>>& tensors,
                  const std::map<std::string, std::string>& metadata) {
  std::vector<at::Tensor> keep_alive;  // contiguous CPU copies the blobs point into
  std::vector<TensorBlob> blobs;
  keep_alive.reserve(tensors.size());
  blobs.reserve(tensors.size());
  for (const auto& [name, tensor] : tensors) {
    if (!tensor.defined()) throw Error(path.string() + ": tensor '" + name + "' is undefined");
    DType dtype;
    try {
      dtype = from_scalar_type(tensor.scalar_type());
    } catch (const Error& e) {
      throw Error(path.string() + ": tensor '" + name + "': " + e.what());
    }
    keep_alive.push_back(tensor.detach().to(at::kCPU).contiguous());
    const at::Tensor& t = keep_alive.back();
    blobs.push_back(TensorBlob{name, dtype, t.sizes().vec(), t.data_ptr(),
                               static_cast<std::size_t>(t.numel() * t.element_size())});
  }
  std::map<std::string, std::string> meta = metadata;
  meta.emplace(kFormatKey, kFormatPyTorch);  // keeps a caller's own "format"
  write_safetensors(path, blobs, meta);
}

std::vector<std::string> save_sharded(const fs::path& dir, const std::vector<std::pair<std::string, at::Tensor>>& tensors,
                                      uint64_t max_shard_bytes, const std::map<std::string, std::string>& metadata) {
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) throw Error(dir.string() + ": cannot create directory: " + ec.message());

  // Plan the shards first so every file name carries the final count.
  std::vector<std::vector<std::pair<std::string, at::Tensor>>> shards;
  uint64_t current = 0, total = 0;
  std::set<std::string> seen;
  for (const auto& entry : tensors) {
    if (!seen.insert(entry.first).second) throw Error(dir.string() + ": tensor '" + entry.first + "' given twice");
    if (!entry.second.defined()) throw Error(dir.string() + ": tensor '" + entry.first + "' is undefined");
    const uint64_t bytes = uint64_t(entry.second.numel()) * entry.second.element_size();
    if (shards.empty() || (current > 0 && current + bytes > max_shard_bytes)) {
      shards.emplace_back();
      current = 0;
    }
    shards.back().push_back(entry);
    current += bytes;
    total += bytes;
  }

  std::vector<std::string> written;
  if (shards.size() <= 1) {
    save_tensors(dir / kSingleWeightsFile, shards.empty() ? tensors : shards[0], metadata);
    fs::remove(dir / kWeightsIndexFile, ec);
    written.push_back(kSingleWeightsFile);
    return written;
  }

  json weight_map = json::object();
  for (std::size_t i = 0; i < shards.size(); ++i) {
    const std::string name = shard_file_name(i, shards.size());
    save_tensors(dir / name, shards[i], metadata);
    for (const auto& entry : shards[i]) weight_map[entry.first] = name;
    written.push_back(name);
  }
  const json index = {{"metadata", {{"total_size", total}}}, {"weight_map", weight_map}};
  write_file_atomic(dir / kWeightsIndexFile, index.dump(2) + "\n");
  fs::remove(dir / kSingleWeightsFile, ec);
  written.push_back(kWeightsIndexFile);
  return written;
}

}  // namespace hh::io
