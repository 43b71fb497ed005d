#pragma once
// safetensors container: an 8-byte little-endian header length N, N bytes of JSON
// {"name": {"dtype": "F32", "shape": [..], "data_offsets": [begin, end]}, "__metadata__": {..}},
// then the raw little-endian data. No LibTorch here (this file is fuzzed); see io/checkpoint.h
// for the at::Tensor view.
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

namespace hh::io {

enum class DType { F64, F32, F16, BF16, I64, I32, I16, I8, U8, BOOL };

std::size_t dtype_size(DType d);
std::string_view dtype_name(DType d);            // "F32", "BF16", ...
DType dtype_from_name(std::string_view name);     // throws hh::Error naming the value

struct TensorInfo {
  std::string name;
  DType dtype = DType::F32;
  std::vector<int64_t> shape;
  uint64_t begin = 0;  // byte offsets relative to the start of the data section
  uint64_t end = 0;
  int64_t numel() const;
};

struct Header {
  std::vector<TensorInfo> tensors;                // in file order of data_offsets
  std::map<std::string, std::string> metadata;    // "__metadata__" (string -> string)
  uint64_t header_len = 0;                        // N
};

// Upper bound on the JSON header (N), as the reference implementation enforces; a larger N is
// treated as a corrupt length field rather than a reason to allocate.
inline constexpr uint64_t kMaxHeaderBytes = 100'000'000;
// Size of the little-endian length prefix in front of the JSON.
inline constexpr std::size_t kHeaderPrefixBytes = 8;

// Parses and validates a header: JSON well formed, a top-level object without duplicate keys, known
// dtypes, non-negative shapes whose byte size does not overflow, data_offsets [begin, end] with
// begin <= end <= data_len, non-overlapping, (end - begin) == numel * dtype size, and
// "__metadata__" (optional, may be null) an object of strings. Gaps between tensors are allowed.
// `where` names the file in error messages. Throws hh::Error.
Header parse_header(std::string_view json, uint64_t data_len, const std::string& where);

// Parses a whole file image: the 8-byte length N (checked against the buffer and kMaxHeaderBytes),
// then parse_header() over the N JSON bytes with data_len = size - 8 - N. The mmap reader uses this.
Header parse_buffer(const void* bytes, std::size_t size, const std::string& where);

// Read-only mmap of one .safetensors file. Validates the whole header at open.
class SafetensorsFile {
 public:
  explicit SafetensorsFile(const std::filesystem::path& path);
  ~SafetensorsFile();
  SafetensorsFile(const SafetensorsFile&) = delete;
  SafetensorsFile& operator=(const SafetensorsFile&) = delete;

  const std::filesystem::path& path() const { return path_; }
  const Header& header() const { return header_; }
  const std::string& header_json() const { return header_json_; }
  bool contains(const std::string& name) const;
  const TensorInfo& info(const std::string& name) const;  // throws naming file and tensor
  const std::byte* data(const TensorInfo& t) const;       // pointer into the mapping

 private:
  std::filesystem::path path_;
  Header header_;
  std::string header_json_;
  std::map<std::string, std::size_t> index_;
  void* map_ = nullptr;
  std::size_t map_len_ = 0;
  const std::byte* data_begin_ = nullptr;
};

// One tensor to write: raw little-endian bytes of numel * dtype_size.
struct TensorBlob {
  std::string name;
  DType dtype = DType::F32;
  std::vector<int64_t> shape;
  const void* data = nullptr;
  std::size_t nbytes = 0;
};

// Writes a file atomically (temp file `<path>.tmp.<pid>` in the same dir, fsync, rename). Tensors
// are written back to back in the given order; metadata goes to "__metadata__". The JSON header is
// padded with spaces to a multiple of 8 bytes so that the data section starts 8-byte aligned.
// Throws hh::Error on bad input (duplicate name, nbytes != numel * dtype size) or I/O failure; no
// file and no temp file is left behind then.
void write_safetensors(const std::filesystem::path& path, const std::vector<TensorBlob>& tensors,
                       const std::map<std::string, std::string>& metadata = {});

// Replaces `path` with `bytes` the same atomic way (used for index.json and other small files).
void write_file_atomic(const std::filesystem::path& path, std::string_view bytes);

}  // namespace hh::io
