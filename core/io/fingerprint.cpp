#include "core/io/fingerprint.h"

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <iterator>
#include <vector>

#include "core/io/safetensors.h"
#include "core/io/sha256.h"
#include "core/util/error.h"

namespace hh::io {
namespace {

constexpr char kSeparator = '\0';

std::string read_whole_file(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw Error(path.string() + ": cannot open: " + std::strerror(errno));
  std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  if (in.bad()) throw Error(path.string() + ": read error");
  return bytes;
}

// The 8-byte length prefix and the JSON header of one shard; the tensor data is never touched.
std::string read_header_bytes(const std::filesystem::path& path) {
  const std::string where = path.string();
  std::ifstream in(path, std::ios::binary);
  if (!in) throw Error(where + ": cannot open: " + std::strerror(errno));
  std::error_code ec;
  const uint64_t file_size = std::filesystem::file_size(path, ec);
  if (ec) throw Error(where + ": cannot read size: " + ec.message());

  std::string bytes(kHeaderPrefixBytes, '\0');
  if (file_size < kHeaderPrefixBytes || !in.read(bytes.data(), kHeaderPrefixBytes))
    throw Error(where + ": file is " + std::to_string(file_size) + " bytes, too short for a safetensors header");
  uint64_t n = 0;
  for (int i = kHeaderPrefixBytes - 1; i >= 0; --i) n = (n << 8) | static_cast<unsigned char>(bytes[i]);
  if (n > kMaxHeaderBytes || n > file_size - kHeaderPrefixBytes)
    throw Error(where + ": header length " + std::to_string(n) + " is invalid for a file of " +
                std::to_string(file_size) + " bytes");
  bytes.resize(kHeaderPrefixBytes + n);
  if (!in.read(bytes.data() + kHeaderPrefixBytes, static_cast<std::streamsize>(n)))
    throw Error(where + ": could not read the " + std::to_string(n) + "-byte header");
  return bytes;
}

}  // namespace

std::string model_fingerprint(const std::filesystem::path& checkpoint_dir) {
  namespace fs = std::filesystem;
  const fs::path config = checkpoint_dir / "config.json";
  if (!fs::is_regular_file(config))
    throw Error(checkpoint_dir.string() + ": no config.json, cannot fingerprint the model");

  std::vector<std::string> shards;  // file names, not paths: the fingerprint must survive a copy
  std::error_code ec;
  for (fs::directory_iterator it(checkpoint_dir, ec), end; !ec && it != end; it.increment(ec)) {
    const fs::path& p = it->path();
    if (p.extension() == ".safetensors" && it->is_regular_file()) shards.push_back(p.filename().string());
  }
  if (ec) throw Error(checkpoint_dir.string() + ": cannot list directory: " + ec.message());
  if (shards.empty()) throw Error(checkpoint_dir.string() + ": no *.safetensors files, cannot fingerprint the model");
  std::sort(shards.begin(), shards.end());

  Sha256 h;
  h.update(read_whole_file(config));
  h.update(&kSeparator, 1);
  for (const auto& name : shards) {
    h.update(name);
    h.update(&kSeparator, 1);
    h.update(read_header_bytes(checkpoint_dir / name));
  }
  return "sha256:" + h.hex_digest();
}

}  // namespace hh::io
