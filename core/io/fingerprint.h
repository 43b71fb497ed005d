#pragma once
#include <filesystem>
#include <string>

namespace hh::io {
// Model fingerprint (DESIGN §7): "sha256:<hex>" over config.json's bytes, then, for each
// *.safetensors file of the checkpoint in lexicographic file-name order, its file name and its
// header bytes (the 8-byte length and the JSON). Weights are not read, so it is cheap.
std::string model_fingerprint(const std::filesystem::path& checkpoint_dir);
}  // namespace hh::io
