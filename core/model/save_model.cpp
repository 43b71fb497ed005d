#include <torch/torch.h>

#include <nlohmann/json.hpp>

#include "core/io/checkpoint.h"
#include "core/io/safetensors.h"
#include "core/model/transformer.h"
#include "core/util/error.h"

namespace hh::model {

std::string hf_dtype_name(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return "float32";
    case at::kBFloat16: return "bfloat16";
    case at::kHalf: return "float16";
    case at::kDouble: return "float64";
    default: throw Error(std::string("save_model: unsupported weight dtype ") + c10::toString(t));
  }
}

void save_model(const std::filesystem::path& dir, const ModelConfig& cfg, const Weights& w,
                uint64_t max_shard_bytes) {
  Weights copy = w;  // weight_table needs mutable slots; tensors are shared, not copied
  std::vector<std::pair<std::string, at::Tensor>> named;
  for (const auto& e : weight_table(cfg, copy)) {
    if (!e.slot->defined()) throw Error("save_model: tensor " + e.name + " is not set");
    if (e.slot->sizes().vec() != e.shape)
      throw Error("save_model: tensor " + e.name + " has the wrong shape for the config");
    named.emplace_back(e.name, e.slot->detach().to(at::kCPU).contiguous());
  }
  if (named.empty()) throw Error("save_model: no tensors");
  std::filesystem::create_directories(dir);
  ModelConfig out = cfg;
  out.torch_dtype = hf_dtype_name(named.front().second.scalar_type());
  io::save_sharded(dir, named, max_shard_bytes == 0 ? UINT64_MAX : max_shard_bytes);
  io::write_file_atomic(dir / "config.json", out.to_json().dump(2) + "\n");
}

}  // namespace hh::model
