#pragma once
// SHA-256 (FIPS 180-4) for artifact provenance: model fingerprints, input hashes.
#include <array>
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <string>
#include <string_view>

namespace hh::io {

class Sha256 {
 public:
  Sha256();
  void update(const void* data, std::size_t len);
  void update(std::string_view s) { update(s.data(), s.size()); }
  std::array<uint8_t, 32> digest();   // finalises; the object must not be updated afterwards
  std::string hex_digest();           // lower-case hex of digest()

 private:
  void block(const uint8_t* p);
  uint32_t h_[8];
  uint8_t buf_[64];
  std::size_t buf_len_ = 0;
  uint64_t total_ = 0;
};

std::string sha256_hex(std::string_view data);
std::string sha256_file_hex(const std::filesystem::path& path);  // throws hh::Error naming the file

}  // namespace hh::io
