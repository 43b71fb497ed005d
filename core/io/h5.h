#pragma once
// Thin RAII wrapper over the HDF5 C API (the C++ API has no SWMR) for the files the core writes:
// `run --out` captures, analysis.h5 (DESIGN §7), eval.h5. Conventions every reader (h5py included)
// can rely on:
//  - dataset paths are absolute ("/activation/noising/effect"); a path without the leading '/' is
//    taken from the root; intermediate groups are created on write;
//  - tensors keep their dtype for f32, f64, i64, i32, i16, i8, u8; bf16 and f16 are stored as f32
//    (HDF5 has no portable 16-bit float type); bool is stored as u8;
//  - datasets larger than kCompressMinBytes are chunked (about kChunkTargetBytes a chunk) with
//    shuffle + gzip; smaller ones are contiguous;
//  - strings are variable-length UTF-8, as datasets and as attributes;
//  - axes can carry dimension labels (H5DS), which h5py shows as `ds.dims[i].label`.
// Errors throw hh::Error naming the file and the dataset or attribute. An H5File is not safe to
// share between threads.
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

#include "core/util/compat.h"

namespace hh::io {

class H5File {
 public:
  static constexpr std::size_t kCompressMinBytes = 16 * 1024;   // below this, compression costs more than it saves
  static constexpr std::size_t kChunkTargetBytes = 1 << 20;     // chunk size aimed for on compressed datasets
  static constexpr unsigned kGzipLevel = 4;                     // deflate level: most of the gain, little CPU

  // A new file, written at `<path>.tmp.<pid>` in the same directory; commit() renames it to `path`.
  // An H5File dropped without commit() deletes its temp file, so a failed job leaves no half file.
  static H5File create(const std::filesystem::path& path);
  static H5File open_read(const std::filesystem::path& path);
  // An existing file changed in place (no temp file; commit() flushes and closes).
  static H5File open_rw(const std::filesystem::path& path);
  // An existing file changed as a whole: a copy at `<path>.tmp.<pid>` is edited and commit() renames
  // it over `path`; dropped without commit(), the copy is deleted and `path` is untouched.
  static H5File update(const std::filesystem::path& path);

  H5File(H5File&& other) noexcept;
  H5File& operator=(H5File&& other) noexcept;
  H5File(const H5File&) = delete;
  H5File& operator=(const H5File&) = delete;
  ~H5File();

  const std::filesystem::path& path() const { return path_; }   // the final path
  bool is_open() const { return id_ >= 0; }
  // Flushes and closes; for a created file, fsyncs and renames it into place. The object is closed after.
  void commit();
  // Closes without publishing: a created file's temp file is deleted.
  void close();

  void create_group(const std::string& group_path);
  bool exists(const std::string& obj_path) const;
  std::vector<std::string> list(const std::string& group_path = "/") const;   // member names, sorted

  // Writes (or replaces) a dataset holding a copy of `t` (any device, any layout).
  // dim_labels, when given, must have one entry per axis ("" leaves an axis unlabelled).
  void write(const std::string& dataset_path, const at::Tensor& t, const std::vector<std::string>& dim_labels = {});
  at::Tensor read(const std::string& dataset_path) const;               // a CPU tensor of the stored type
  std::vector<int64_t> shape(const std::string& dataset_path) const;
  std::vector<std::string> dim_labels(const std::string& dataset_path) const;   // "" where unlabelled

  // A 1-D dataset of variable-length UTF-8 strings (no embedded NUL bytes).
  void write_strings(const std::string& dataset_path, const std::vector<std::string>& values);
  std::vector<std::string> read_strings(const std::string& dataset_path) const;   // fixed-length too

  // Scalar attributes on a group or dataset ("/" is the file's root). Setting replaces.
  void set_attr(const std::string& obj_path, const std::string& name, std::string_view value);
  template <class T, std::enable_if_t<std::is_arithmetic_v<T>, int> = 0>
  void set_attr(const std::string& obj_path, const std::string& name, T value) {
    if constexpr (std::is_floating_point_v<T>) set_attr_f64(obj_path, name, static_cast<double>(value));
    else set_attr_i64(obj_path, name, static_cast<int64_t>(value));
  }
  bool has_attr(const std::string& obj_path, const std::string& name) const;
  std::string attr_string(const std::string& obj_path, const std::string& name) const;
  int64_t attr_int(const std::string& obj_path, const std::string& name) const;
  double attr_double(const std::string& obj_path, const std::string& name) const;   // integers convert

  // ---- Live files (HDF5 SWMR): one writer appends while readers follow ----------------------------
  // Written in place (readers follow the file while it grows, so there is no temp file), in the
  // file format SWMR needs. Protocol: create every dataset and set every attribute, then
  // start_swmr_write(); from then on only append() and write_at() are allowed.
  // A new live file at `path`, replacing one that exists.
  static H5File create_live(const std::filesystem::path& path);
  // An existing live file reopened by its writer (e.g. a resumed job), not yet in SWMR mode, so
  // truncate() and attribute changes are still allowed before start_swmr_write(). Both wait out HDF5's
  // file lock held by another process that is opening or reading the file (up to 30 s).
  static H5File open_live(const std::filesystem::path& path);
  // Read-only, following a writer (SWMR read). Call refresh() on a dataset before reading it again.
  // Takes no file lock (SWMR reading needs none), so a follower never holds up the writer's reopening.
  static H5File open_follow(const std::filesystem::path& path);

  // A 1-D dataset with no rows and no size limit (chunks of `chunk` rows) of f64, f32, i64 or i32.
  void create_series(const std::string& dataset_path, at::ScalarType dtype, int64_t chunk = 256);
  void start_swmr_write();
  bool swmr_writing() const { return swmr_; }
  // Appends the values of a 1-D tensor to a series and flushes it, so readers see the new rows.
  void append(const std::string& dataset_path, const at::Tensor& values);
  // Overwrites elements [index, index + n) of a 1-D dataset in place (n = values' length) and flushes.
  void write_at(const std::string& dataset_path, int64_t index, const at::Tensor& values);
  // Keeps the first n rows of a series (not allowed once SWMR writing has started).
  void truncate(const std::string& dataset_path, int64_t n);
  // A follower's view of the dataset catches up with what the writer has flushed.
  void refresh(const std::string& dataset_path) const;

  // The hid_t of the open file, for features this wrapper does not cover yet.
  int64_t native_handle() const { return id_; }

 private:
  enum class Mode { Closed, Created, ReadOnly, ReadWrite };
  H5File(int64_t id, Mode mode, std::filesystem::path path, std::filesystem::path open_path);
  void set_attr_i64(const std::string& obj_path, const std::string& name, int64_t value);
  void set_attr_f64(const std::string& obj_path, const std::string& name, double value);
  void require_writable(const std::string& what) const;
  void release() noexcept;

  int64_t id_ = -1;                      // hid_t of the file
  Mode mode_ = Mode::Closed;
  bool swmr_ = false;                    // SWMR writing has started
  std::filesystem::path path_;           // final path, used in messages
  std::filesystem::path open_path_;      // what HDF5 has open: the temp file for created files
};

}  // namespace hh::io
