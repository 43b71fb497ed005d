#include "core/io/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <cstring>
#include <limits>
#include <optional>
#include <set>

#include <nlohmann/json.hpp>

#include "core/util/error.h"

namespace hh::io {
namespace {

using nlohmann::json;

constexpr std::string_view kMetadataKey = "__metadata__";
// Real headers nest three levels (root, entry, shape array); anything far deeper is hostile input
// and would only cost memory in the DOM.
constexpr int kMaxHeaderDepth = 32;
// Longest name or value quoted verbatim in an error message; a corrupt header can hold megabytes.
constexpr std::size_t kMaxQuotedChars = 160;
// Linux write(2) transfers at most ~2 GiB per call; larger tensors go in pieces.
constexpr std::size_t kMaxWriteChunk = std::size_t(1) << 30;
constexpr std::size_t kHeaderAlignment = 8;

struct DTypeEntry {
  DType dtype;
  std::string_view name;
  std::size_t size;
};
constexpr std::array<DTypeEntry, 10> kDTypes = {{
    {DType::F64, "F64", 8},
    {DType::F32, "F32", 4},
    {DType::F16, "F16", 2},
    {DType::BF16, "BF16", 2},
    {DType::I64, "I64", 8},
    {DType::I32, "I32", 4},
    {DType::I16, "I16", 2},
    {DType::I8, "I8", 1},
    {DType::U8, "U8", 1},
    {DType::BOOL, "BOOL", 1},
}};

std::optional<DType> lookup_dtype(std::string_view name) {
  for (const auto& e : kDTypes)
    if (e.name == name) return e.dtype;
  return std::nullopt;
}

std::string supported_dtypes() {
  std::string s;
  for (const auto& e : kDTypes) {
    if (!s.empty()) s += ", ";
    s += e.name;
  }
  return s;
}

std::string quote(std::string_view s) {
  if (s.size() <= kMaxQuotedChars) return "'" + std::string(s) + "'";
  return "'" + std::string(s.substr(0, kMaxQuotedChars)) + "...' (" + std::to_string(s.size()) + " bytes)";
}

// A short description of a JSON value for error messages; never dumps a whole (possibly deep) tree.
std::string describe(const json& v) {
  switch (v.type()) {
    case json::value_t::object: return "an object";
    case json::value_t::array: return "an array of " + std::to_string(v.size());
    case json::value_t::string: return "the string " + quote(v.get_ref<const std::string&>());
    case json::value_t::discarded: return "a discarded value";
    default: return v.dump();
  }
}

std::string format_shape(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (std::size_t i = 0; i < shape.size(); ++i) {
    if (i) s += ", ";
    s += std::to_string(shape[i]);
  }
  return s + "]";
}

std::string offsets_text(uint64_t begin, uint64_t end) {
  return "[" + std::to_string(begin) + ", " + std::to_string(end) + "]";
}

// A JSON integer >= 0 (nlohmann keeps non-negative literals as unsigned; "-0" comes back signed).
std::optional<uint64_t> as_nonnegative_integer(const json& v) {
  if (v.is_number_unsigned()) return v.get<uint64_t>();
  if (v.is_number_integer() && v.get<int64_t>() >= 0) return static_cast<uint64_t>(v.get<int64_t>());
  return std::nullopt;
}

// nlohmann silently keeps the last of duplicate keys; a safetensors header with two entries of one
// name is ambiguous, so the parse callback rejects duplicates in every object.
json parse_json_strict(std::string_view text, const std::string& where) {
  std::vector<std::set<std::string>> open_objects;  // keys seen so far in each object being parsed
  auto on_event = [&](int depth, json::parse_event_t event, json& parsed) -> bool {
    if (depth > kMaxHeaderDepth)
      throw Error(where + ": header JSON nests deeper than " + std::to_string(kMaxHeaderDepth) + " levels");
    switch (event) {
      case json::parse_event_t::object_start: open_objects.emplace_back(); break;
      case json::parse_event_t::object_end:
        if (!open_objects.empty()) open_objects.pop_back();
        break;
      case json::parse_event_t::key: {
        const auto& key = parsed.get_ref<const std::string&>();
        if (!open_objects.empty() && !open_objects.back().insert(key).second) {
          if (open_objects.size() == 1) throw Error(where + ": duplicate tensor name " + quote(key) + " in header");
          throw Error(where + ": duplicate key " + quote(key) + " in header");
        }
        break;
      }
      default: break;
    }
    return true;
  };
  try {
    return json::parse(text.begin(), text.end(), on_event);
  } catch (const json::exception& e) {
    throw Error(where + ": header is not valid JSON: " + e.what());
  }
}

void parse_metadata(const json& value, const std::string& where, std::map<std::string, std::string>& out) {
  if (value.is_null()) return;
  if (!value.is_object())
    throw Error(where + ": \"__metadata__\" must be an object of strings, found " + describe(value));
  for (const auto& [key, v] : value.items()) {
    if (!v.is_string())
      throw Error(where + ": \"__metadata__\" entry " + quote(key) + " must be a string, found " + describe(v));
    out.emplace(key, v.get<std::string>());
  }
}

TensorInfo parse_entry(const std::string& name, const json& entry, uint64_t data_len, const std::string& where) {
  const std::string ctx = where + ": tensor " + quote(name) + ": ";
  if (!entry.is_object()) throw Error(ctx + "entry must be an object, found " + describe(entry));

  TensorInfo t;
  t.name = name;

  const auto dtype_it = entry.find("dtype");
  if (dtype_it == entry.end()) throw Error(ctx + "missing \"dtype\"");
  if (!dtype_it->is_string()) throw Error(ctx + "\"dtype\" must be a string, found " + describe(*dtype_it));
  const auto dtype = lookup_dtype(dtype_it->get_ref<const std::string&>());
  if (!dtype)
    throw Error(ctx + "unknown dtype " + quote(dtype_it->get_ref<const std::string&>()) + " (supported: " +
                supported_dtypes() + ")");
  t.dtype = *dtype;

  const auto shape_it = entry.find("shape");
  if (shape_it == entry.end()) throw Error(ctx + "missing \"shape\"");
  if (!shape_it->is_array()) throw Error(ctx + "\"shape\" must be an array, found " + describe(*shape_it));
  // numel * dtype size must fit in 64 bits, or the size comparison below would wrap.
  uint64_t nbytes = dtype_size(t.dtype);
  bool overflow = false;
  for (const auto& dim : *shape_it) {
    const auto d = as_nonnegative_integer(dim);
    if (!d || *d > uint64_t(std::numeric_limits<int64_t>::max()))
      throw Error(ctx + "shape entries must be non-negative integers, found " + describe(dim));
    t.shape.push_back(static_cast<int64_t>(*d));
    overflow = overflow || __builtin_mul_overflow(nbytes, *d, &nbytes);
  }
  // A zero dimension makes the tensor empty however large the others are.
  if (std::find(t.shape.begin(), t.shape.end(), 0) != t.shape.end()) nbytes = 0;
  else if (overflow)
    throw Error(ctx + "shape " + format_shape(t.shape) + " of " + std::string(dtype_name(t.dtype)) +
                " overflows a 64-bit byte count");

  const auto off_it = entry.find("data_offsets");
  if (off_it == entry.end()) throw Error(ctx + "missing \"data_offsets\"");
  if (!off_it->is_array() || off_it->size() != 2)
    throw Error(ctx + "\"data_offsets\" must be an array of 2 integers, found " + describe(*off_it));
  const auto begin = as_nonnegative_integer((*off_it)[0]);
  const auto end = as_nonnegative_integer((*off_it)[1]);
  if (!begin || !end)
    throw Error(ctx + "\"data_offsets\" must hold 2 non-negative integers, found [" + describe((*off_it)[0]) +
                ", " + describe((*off_it)[1]) + "]");
  t.begin = *begin;
  t.end = *end;
  const std::string offs = "data_offsets " + offsets_text(t.begin, t.end);
  if (t.begin > t.end) throw Error(ctx + offs + ": begin is after end");
  if (t.end > data_len)
    throw Error(ctx + offs + " run past the end of the data section (" + std::to_string(data_len) + " bytes)");
  if (t.end - t.begin != nbytes)
    throw Error(ctx + offs + " span " + std::to_string(t.end - t.begin) + " bytes but shape " +
                format_shape(t.shape) + " of " + std::string(dtype_name(t.dtype)) + " needs " +
                std::to_string(nbytes));
  return t;
}

uint64_t load_le64(const unsigned char* p) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}

std::string too_short_message(const std::string& where, uint64_t size) {
  return where + ": file is " + std::to_string(size) + " bytes, shorter than the " +
         std::to_string(kHeaderPrefixBytes) + "-byte header length (truncated or not a safetensors file)";
}

// Writes `<path>.tmp.<pid>` next to the target and renames it over the target on commit(), so a
// reader never sees a half-written file. An uncommitted temp file is removed by the destructor.
class AtomicFile {
 public:
  explicit AtomicFile(const std::filesystem::path& path)
      : path_(path), tmp_(path.string() + ".tmp." + std::to_string(::getpid())) {
    fd_ = ::open(tmp_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd_ < 0) throw Error(path_.string() + ": cannot create temporary file " + tmp_ + ": " + std::strerror(errno));
  }
  ~AtomicFile() {
    if (fd_ >= 0) ::close(fd_);
    if (!committed_) ::unlink(tmp_.c_str());
  }
  AtomicFile(const AtomicFile&) = delete;
  AtomicFile& operator=(const AtomicFile&) = delete;

  void write(const void* data, std::size_t len) {
    const auto* p = static_cast<const char*>(data);
    while (len > 0) {
      const ssize_t n = ::write(fd_, p, std::min(len, kMaxWriteChunk));
      if (n < 0) {
        if (errno == EINTR) continue;
        throw Error(path_.string() + ": write failed: " + std::strerror(errno));
      }
      p += n;
      len -= static_cast<std::size_t>(n);
    }
  }

  void commit() {
    if (::fsync(fd_) != 0) throw Error(path_.string() + ": fsync failed: " + std::strerror(errno));
    const int fd = fd_;
    fd_ = -1;
    if (::close(fd) != 0) throw Error(path_.string() + ": close failed: " + std::strerror(errno));
    if (std::rename(tmp_.c_str(), path_.c_str()) != 0)
      throw Error(path_.string() + ": cannot rename " + tmp_ + " into place: " + std::strerror(errno));
    committed_ = true;
    // Persist the rename itself; best effort, the data is already safe.
    const auto dir = path_.has_parent_path() ? path_.parent_path() : std::filesystem::path(".");
    const int dfd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (dfd >= 0) {
      ::fsync(dfd);
      ::close(dfd);
    }
  }

 private:
  std::filesystem::path path_;
  std::string tmp_;
  int fd_ = -1;
  bool committed_ = false;
};

}  // namespace

std::size_t dtype_size(DType d) {
  for (const auto& e : kDTypes)
    if (e.dtype == d) return e.size;
  throw Error("invalid safetensors dtype enum value " + std::to_string(static_cast<int>(d)));
}

std::string_view dtype_name(DType d) {
  for (const auto& e : kDTypes)
    if (e.dtype == d) return e.name;
  throw Error("invalid safetensors dtype enum value " + std::to_string(static_cast<int>(d)));
}

DType dtype_from_name(std::string_view name) {
  if (const auto d = lookup_dtype(name)) return *d;
  throw Error("unknown safetensors dtype " + quote(name) + " (supported: " + supported_dtypes() + ")");
}

int64_t TensorInfo::numel() const {
  int64_t n = 1;
  for (const int64_t d : shape) n *= d;
  return n;
}

Header parse_header(std::string_view text, uint64_t data_len, const std::string& where) {
  const json root = parse_json_strict(text, where);
  if (!root.is_object()) throw Error(where + ": header must be a JSON object, found " + describe(root));

  Header h;
  h.header_len = text.size();
  for (const auto& [key, value] : root.items()) {
    if (key == kMetadataKey) parse_metadata(value, where, h.metadata);
    else h.tensors.push_back(parse_entry(key, value, data_len, where));
  }

  std::sort(h.tensors.begin(), h.tensors.end(), [](const TensorInfo& a, const TensorInfo& b) {
    if (a.begin != b.begin) return a.begin < b.begin;
    if (a.end != b.end) return a.end < b.end;
    return a.name < b.name;
  });
  // Sorted by begin, two non-empty ranges overlap exactly when one starts before the furthest end
  // seen so far. Empty tensors hold no bytes and may sit anywhere.
  const TensorInfo* furthest = nullptr;
  for (const auto& t : h.tensors) {
    if (t.begin == t.end) continue;
    if (furthest && t.begin < furthest->end)
      throw Error(where + ": tensor " + quote(t.name) + ": data_offsets " + offsets_text(t.begin, t.end) +
                  " overlap tensor " + quote(furthest->name) + " at " + offsets_text(furthest->begin, furthest->end));
    if (!furthest || t.end > furthest->end) furthest = &t;
  }
  return h;
}

Header parse_buffer(const void* bytes, std::size_t size, const std::string& where) {
  if (size < kHeaderPrefixBytes) throw Error(too_short_message(where, size));
  const auto* p = static_cast<const unsigned char*>(bytes);
  const uint64_t n = load_le64(p);
  if (n > kMaxHeaderBytes)
    throw Error(where + ": header length " + std::to_string(n) + " exceeds the limit of " +
                std::to_string(kMaxHeaderBytes) + " bytes (corrupt length field?)");
  const uint64_t available = size - kHeaderPrefixBytes;
  if (n > available)
    throw Error(where + ": header length " + std::to_string(n) + " runs past the end of the file (" +
                std::to_string(size) + " bytes; truncated?)");
  const std::string_view text(reinterpret_cast<const char*>(p + kHeaderPrefixBytes), n);
  return parse_header(text, available - n, where);
}

SafetensorsFile::SafetensorsFile(const std::filesystem::path& path) : path_(path) {
  const std::string where = path.string();
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) throw Error(where + ": cannot open: " + std::strerror(errno));
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    const int err = errno;
    ::close(fd);
    throw Error(where + ": cannot stat: " + std::strerror(err));
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    throw Error(where + ": not a regular file");
  }
  const auto size = static_cast<std::size_t>(st.st_size);
  if (size < kHeaderPrefixBytes) {  // also keeps mmap away from an empty file
    ::close(fd);
    throw Error(too_short_message(where, size));
  }
  void* map = ::mmap(nullptr, size, PROT_READ, MAP_PRIVATE, fd, 0);
  const int map_errno = errno;
  ::close(fd);  // the mapping keeps its own reference to the file
  if (map == MAP_FAILED) throw Error(where + ": mmap failed: " + std::strerror(map_errno));

  try {
    header_ = parse_buffer(map, size, where);
  } catch (...) {
    ::munmap(map, size);
    throw;
  }
  map_ = map;
  map_len_ = size;
  const auto* bytes = static_cast<const char*>(map);
  header_json_.assign(bytes + kHeaderPrefixBytes, header_.header_len);
  data_begin_ = reinterpret_cast<const std::byte*>(bytes + kHeaderPrefixBytes + header_.header_len);
  for (std::size_t i = 0; i < header_.tensors.size(); ++i) index_.emplace(header_.tensors[i].name, i);
}

SafetensorsFile::~SafetensorsFile() {
  if (map_) ::munmap(map_, map_len_);
}

bool SafetensorsFile::contains(const std::string& name) const { return index_.count(name) != 0; }

const TensorInfo& SafetensorsFile::info(const std::string& name) const {
  const auto it = index_.find(name);
  if (it == index_.end()) throw Error(path_.string() + ": no tensor named " + quote(name));
  return header_.tensors[it->second];
}

const std::byte* SafetensorsFile::data(const TensorInfo& t) const { return data_begin_ + t.begin; }

void write_safetensors(const std::filesystem::path& path, const std::vector<TensorBlob>& tensors,
                       const std::map<std::string, std::string>& metadata) {
  const std::string where = path.string();
  // The header is assembled by hand (nlohmann only escapes strings) so that entries keep the
  // caller's order and the cost stays linear in the number of tensors.
  std::string header = "{";
  try {
    if (!metadata.empty()) header += "\"__metadata__\":" + json(metadata).dump();
    std::set<std::string_view> names;
    uint64_t offset = 0;
    for (const auto& t : tensors) {
      const std::string ctx = where + ": tensor " + quote(t.name) + ": ";
      if (t.name == kMetadataKey) throw Error(ctx + "the name is reserved for metadata");
      if (!names.insert(t.name).second) throw Error(ctx + "written twice");
      uint64_t nbytes = dtype_size(t.dtype);
      bool overflow = false;
      for (const int64_t d : t.shape) {
        if (d < 0) throw Error(ctx + "negative dimension in shape " + format_shape(t.shape));
        overflow = overflow || __builtin_mul_overflow(nbytes, uint64_t(d), &nbytes);
      }
      if (std::find(t.shape.begin(), t.shape.end(), 0) != t.shape.end()) nbytes = 0;
      else if (overflow) throw Error(ctx + "shape " + format_shape(t.shape) + " overflows a 64-bit byte count");
      if (nbytes != t.nbytes)
        throw Error(ctx + "shape " + format_shape(t.shape) + " of " + std::string(dtype_name(t.dtype)) + " needs " +
                    std::to_string(nbytes) + " bytes but " + std::to_string(t.nbytes) + " were given");
      if (t.nbytes > 0 && t.data == nullptr) throw Error(ctx + "no data pointer");

      if (header.size() > 1) header += ',';
      header += json(t.name).dump();
      header += ":{\"dtype\":\"" + std::string(dtype_name(t.dtype)) + "\",\"shape\":[";
      for (std::size_t i = 0; i < t.shape.size(); ++i) {
        if (i) header += ',';
        header += std::to_string(t.shape[i]);
      }
      header += "],\"data_offsets\":[" + std::to_string(offset) + "," + std::to_string(offset + nbytes) + "]}";
      offset += nbytes;
    }
  } catch (const json::exception& e) {
    // dump() refuses strings that are not valid UTF-8.
    throw Error(where + ": cannot encode header (names and metadata must be UTF-8): " + e.what());
  }
  header += '}';
  // Spaces are valid trailing JSON whitespace; aligning the data section lets readers view it in place.
  header.append((kHeaderAlignment - header.size() % kHeaderAlignment) % kHeaderAlignment, ' ');
  if (header.size() > kMaxHeaderBytes)
    throw Error(where + ": header of " + std::to_string(header.size()) + " bytes exceeds the format's limit");

  unsigned char prefix[kHeaderPrefixBytes];
  for (std::size_t i = 0; i < kHeaderPrefixBytes; ++i) prefix[i] = static_cast<unsigned char>(uint64_t(header.size()) >> (8 * i));

  AtomicFile out(path);
  out.write(prefix, sizeof(prefix));
  out.write(header.data(), header.size());
  for (const auto& t : tensors) out.write(t.data, t.nbytes);
  out.commit();
}

void write_file_atomic(const std::filesystem::path& path, std::string_view bytes) {
  AtomicFile out(path);
  out.write(bytes.data(), bytes.size());
  out.commit();
}

}  // namespace hh::io
