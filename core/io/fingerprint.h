#pragma once
#include <filesystem>
#include <string>

namespace hh::io {
// Model fingerprint (DESIGN §7): "sha256:<hex>" over config.json's bytes, then, for each
// *.safetensors file of the checkpoint in lexicographic file-name order, its file name and its
// header bytes (the 8-byte length and the JSON). Weights are not read, so it is cheap.
// A NUL byte follows config.json and each file name, so no two layouts hash the same stream
// (neither JSON text nor file names can hold NUL). Only names and contents enter the hash: a copied
// or moved directory keeps its fingerprint. Throws hh::Error naming the directory when config.json
// or every *.safetensors file is missing, or naming the shard whose header cannot be read.
std::string model_fingerprint(const std::filesystem::path& checkpoint_dir);
}  // namespace hh::io
