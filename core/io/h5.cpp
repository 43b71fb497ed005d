#include "core/io/h5.h"

#include <torch/torch.h>

#include <fcntl.h>
#include <hdf5.h>
#include <hdf5_hl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <thread>
#include <utility>

#include "core/util/error.h"

namespace hh::io {
namespace fs = std::filesystem;

static_assert(std::is_same_v<hid_t, int64_t>, "h5.h stores hid_t as int64_t (HDF5 >= 1.10)");

namespace {

// Turns off HDF5's automatic printing of its error stack for the lifetime of the object; failures
// are reported through hh::Error instead. Restores the previous handler (the setting is per thread
// in thread-safe builds, so it is set around each call rather than once).
class QuietErrors {
 public:
  QuietErrors() {
    H5Eget_auto2(H5E_DEFAULT, &func_, &data_);
    H5Eset_auto2(H5E_DEFAULT, nullptr, nullptr);
  }
  ~QuietErrors() { H5Eset_auto2(H5E_DEFAULT, func_, data_); }
  QuietErrors(const QuietErrors&) = delete;
  QuietErrors& operator=(const QuietErrors&) = delete;

 private:
  H5E_auto2_t func_ = nullptr;
  void* data_ = nullptr;
};

// The innermost message of HDF5's error stack, which is the most specific one; clears the stack.
std::string hdf5_detail() {
  std::string detail;
  auto visit = [](unsigned, const H5E_error2_t* e, void* out) -> herr_t {
    if (e && e->desc && *e->desc) *static_cast<std::string*>(out) = e->desc;
    return 0;
  };
  H5Ewalk2(H5E_DEFAULT, H5E_WALK_DOWNWARD, visit, &detail);
  H5Eclear2(H5E_DEFAULT);
  return detail.empty() ? std::string() : " (" + detail + ")";
}

// An owned hid_t and the function that releases it.
class Handle {
 public:
  using Closer = herr_t (*)(hid_t);
  Handle() = default;
  Handle(hid_t id, Closer close) : id_(id), close_(close) {}
  Handle(Handle&& o) noexcept : id_(std::exchange(o.id_, -1)), close_(o.close_) {}
  Handle& operator=(Handle&& o) noexcept {
    if (this != &o) {
      reset();
      id_ = std::exchange(o.id_, -1);
      close_ = o.close_;
    }
    return *this;
  }
  Handle(const Handle&) = delete;
  Handle& operator=(const Handle&) = delete;
  ~Handle() { reset(); }
  hid_t get() const { return id_; }
  bool valid() const { return id_ >= 0; }
  void reset() {
    if (id_ >= 0 && close_) close_(id_);
    id_ = -1;
  }

 private:
  hid_t id_ = -1;
  Closer close_ = nullptr;
};

std::string normalise(const std::string& obj_path) {
  if (obj_path.empty()) return "/";
  return obj_path.front() == '/' ? obj_path : "/" + obj_path;
}

// File and memory types for one tensor dtype; bf16/f16 are widened to f32 before writing.
struct TypePair {
  hid_t file;
  hid_t memory;
};
TypePair types_for(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return {H5T_IEEE_F32LE, H5T_NATIVE_FLOAT};
    case at::kDouble: return {H5T_IEEE_F64LE, H5T_NATIVE_DOUBLE};
    case at::kLong: return {H5T_STD_I64LE, H5T_NATIVE_INT64};
    case at::kInt: return {H5T_STD_I32LE, H5T_NATIVE_INT32};
    case at::kShort: return {H5T_STD_I16LE, H5T_NATIVE_INT16};
    case at::kChar: return {H5T_STD_I8LE, H5T_NATIVE_INT8};
    case at::kByte: return {H5T_STD_U8LE, H5T_NATIVE_UINT8};
    default: return {-1, -1};
  }
}

// Chunk shape of about kChunkTargetBytes: whole trailing axes where possible, since readers mostly
// slice along the leading ones (examples, layers).
std::vector<hsize_t> chunk_shape(const std::vector<hsize_t>& dims, std::size_t elem_size) {
  std::vector<hsize_t> chunk = dims;
  std::size_t bytes = elem_size;
  for (const hsize_t d : dims) bytes *= d;
  for (std::size_t i = 0; i < chunk.size() && bytes > H5File::kChunkTargetBytes; ++i) {
    const std::size_t inner = bytes / chunk[i];  // bytes of one step along axis i
    chunk[i] = std::max<hsize_t>(1, H5File::kChunkTargetBytes / std::max<std::size_t>(inner, 1));
    chunk[i] = std::min(chunk[i], dims[i]);
    bytes = inner * chunk[i];
  }
  return chunk;
}

Handle string_type(H5T_cset_t cset = H5T_CSET_UTF8) {
  Handle t(H5Tcopy(H5T_C_S1), H5Tclose);
  H5Tset_size(t.get(), H5T_VARIABLE);
  H5Tset_cset(t.get(), cset);
  return t;
}

herr_t reclaim_strings(hid_t type, hid_t space, void* buf) {
#if H5_VERSION_GE(1, 12, 0)
  return H5Treclaim(type, space, H5P_DEFAULT, buf);
#else
  return H5Dvlen_reclaim(type, space, H5P_DEFAULT, buf);
#endif
}

}  // namespace

H5File::H5File(int64_t id, Mode mode, fs::path path, fs::path open_path)
    : id_(id), mode_(mode), path_(std::move(path)), open_path_(std::move(open_path)) {}

H5File::H5File(H5File&& o) noexcept
    : id_(std::exchange(o.id_, -1)),
      mode_(std::exchange(o.mode_, Mode::Closed)),
      swmr_(std::exchange(o.swmr_, false)),
      path_(std::move(o.path_)),
      open_path_(std::move(o.open_path_)) {}

H5File& H5File::operator=(H5File&& o) noexcept {
  if (this != &o) {
    release();
    id_ = std::exchange(o.id_, -1);
    mode_ = std::exchange(o.mode_, Mode::Closed);
    swmr_ = std::exchange(o.swmr_, false);
    path_ = std::move(o.path_);
    open_path_ = std::move(o.open_path_);
  }
  return *this;
}

H5File::~H5File() { release(); }

void H5File::release() noexcept {
  if (id_ >= 0) {
    QuietErrors quiet;
    H5Fclose(id_);
  }
  if (mode_ == Mode::Created) ::unlink(open_path_.c_str());
  id_ = -1;
  mode_ = Mode::Closed;
  swmr_ = false;
}

void H5File::close() { release(); }

H5File H5File::create(const fs::path& path) {
  QuietErrors quiet;
  const fs::path tmp = path.string() + ".tmp." + std::to_string(::getpid());
  // CLOSE_STRONG: closing the file also closes any object handle a failed call may have left.
  Handle fapl(H5Pcreate(H5P_FILE_ACCESS), H5Pclose);
  H5Pset_fclose_degree(fapl.get(), H5F_CLOSE_STRONG);
  const hid_t id = H5Fcreate(tmp.c_str(), H5F_ACC_TRUNC, H5P_DEFAULT, fapl.get());
  if (id < 0) throw Error(path.string() + ": cannot create HDF5 file at " + tmp.string() + hdf5_detail());
  return H5File(id, Mode::Created, path, tmp);
}

// Opens an existing file read-only or read-write (`flags`), with CLOSE_STRONG as in create().
static hid_t open_existing(const fs::path& path, unsigned flags, const char* failure) {
  if (!fs::is_regular_file(path)) throw Error(path.string() + ": no such file");
  Handle fapl(H5Pcreate(H5P_FILE_ACCESS), H5Pclose);
  H5Pset_fclose_degree(fapl.get(), H5F_CLOSE_STRONG);
  const hid_t id = H5Fopen(path.c_str(), flags, fapl.get());
  if (id < 0) throw Error(path.string() + ": " + failure + hdf5_detail());
  return id;
}

H5File H5File::open_read(const fs::path& path) {
  QuietErrors quiet;
  return H5File(open_existing(path, H5F_ACC_RDONLY, "cannot open as HDF5"), Mode::ReadOnly, path, path);
}

H5File H5File::open_rw(const fs::path& path) {
  QuietErrors quiet;
  return H5File(open_existing(path, H5F_ACC_RDWR, "cannot open HDF5 file for writing"), Mode::ReadWrite, path,
                path);
}

H5File H5File::update(const fs::path& path) {
  QuietErrors quiet;
  if (!fs::is_regular_file(path)) throw Error(path.string() + ": no such file");
  const fs::path tmp = path.string() + ".tmp." + std::to_string(::getpid());
  std::error_code ec;
  fs::copy_file(path, tmp, fs::copy_options::overwrite_existing, ec);
  if (ec) {
    ::unlink(tmp.c_str());
    throw Error(path.string() + ": cannot copy to " + tmp.string() + ": " + ec.message());
  }
  try {
    return H5File(open_existing(tmp, H5F_ACC_RDWR, "cannot open HDF5 file for writing"), Mode::Created, path, tmp);
  } catch (...) {
    ::unlink(tmp.c_str());
    throw;
  }
}

void H5File::commit() {
  if (id_ < 0) throw Error(path_.string() + ": commit() on a closed file");
  QuietErrors quiet;
  const hid_t id = std::exchange(id_, -1);
  if (H5Fclose(id) < 0) {
    const std::string detail = hdf5_detail();
    release();
    throw Error(path_.string() + ": closing the HDF5 file failed" + detail);
  }
  if (mode_ != Mode::Created) {
    mode_ = Mode::Closed;
    return;
  }
  // HDF5 does not fsync; do it so the rename never publishes a file whose data is still in flight.
  const int fd = ::open(open_path_.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0 || ::fsync(fd) != 0) {
    const std::string err = std::strerror(errno);
    if (fd >= 0) ::close(fd);
    release();
    throw Error(path_.string() + ": fsync of " + open_path_.string() + " failed: " + err);
  }
  ::close(fd);
  if (std::rename(open_path_.c_str(), path_.c_str()) != 0) {
    const std::string err = std::strerror(errno);
    release();
    throw Error(path_.string() + ": cannot rename " + open_path_.string() + " into place: " + err);
  }
  mode_ = Mode::Closed;
}

void H5File::require_writable(const std::string& what) const {
  if (id_ < 0) throw Error(path_.string() + ": " + what + ": the file is closed");
  if (mode_ == Mode::ReadOnly) throw Error(path_.string() + ": " + what + ": the file is open read-only");
}

void H5File::create_group(const std::string& group_path) {
  const std::string p = normalise(group_path);
  require_writable("group '" + p + "'");
  QuietErrors quiet;
  if (exists(p)) return;
  Handle lcpl(H5Pcreate(H5P_LINK_CREATE), H5Pclose);
  H5Pset_create_intermediate_group(lcpl.get(), 1);
  Handle g(H5Gcreate2(id_, p.c_str(), lcpl.get(), H5P_DEFAULT, H5P_DEFAULT), H5Gclose);
  if (!g.valid()) throw Error(path_.string() + ": cannot create group '" + p + "'" + hdf5_detail());
}

bool H5File::exists(const std::string& obj_path) const {
  if (id_ < 0) throw Error(path_.string() + ": exists('" + obj_path + "'): the file is closed");
  QuietErrors quiet;
  const std::string p = normalise(obj_path);
  if (p == "/") return true;
  // H5Lexists fails (rather than returning false) when an intermediate group is missing, so walk down.
  std::size_t pos = 0;
  while (pos != std::string::npos) {
    pos = p.find('/', pos + 1);
    const std::string prefix = p.substr(0, pos);
    if (prefix.size() <= 1 || prefix.back() == '/') continue;
    if (H5Lexists(id_, prefix.c_str(), H5P_DEFAULT) <= 0) {
      H5Eclear2(H5E_DEFAULT);
      return false;
    }
  }
  return true;
}

std::vector<std::string> H5File::list(const std::string& group_path) const {
  const std::string p = normalise(group_path);
  if (id_ < 0) throw Error(path_.string() + ": group '" + p + "': the file is closed");
  QuietErrors quiet;
  Handle g(H5Gopen2(id_, p.c_str(), H5P_DEFAULT), H5Gclose);
  if (!g.valid()) throw Error(path_.string() + ": cannot open group '" + p + "'" + hdf5_detail());
  H5G_info_t info{};
  if (H5Gget_info(g.get(), &info) < 0) throw Error(path_.string() + ": group '" + p + "': cannot read" + hdf5_detail());
  std::vector<std::string> names;
  for (hsize_t i = 0; i < info.nlinks; ++i) {
    const ssize_t len = H5Lget_name_by_idx(g.get(), ".", H5_INDEX_NAME, H5_ITER_INC, i, nullptr, 0, H5P_DEFAULT);
    if (len < 0) throw Error(path_.string() + ": group '" + p + "': cannot list" + hdf5_detail());
    std::string name(static_cast<std::size_t>(len) + 1, '\0');
    H5Lget_name_by_idx(g.get(), ".", H5_INDEX_NAME, H5_ITER_INC, i, name.data(), name.size(), H5P_DEFAULT);
    name.resize(static_cast<std::size_t>(len));
    names.push_back(std::move(name));
  }
  std::sort(names.begin(), names.end());
  return names;
}

void H5File::write(const std::string& dataset_path, const at::Tensor& tensor, const std::vector<std::string>& dim_labels) {
  const std::string p = normalise(dataset_path);
  const std::string ctx = path_.string() + ": dataset '" + p + "': ";
  require_writable("dataset '" + p + "'");
  if (!tensor.defined()) throw Error(ctx + "the tensor is undefined");

  at::Tensor t = tensor.detach().to(at::kCPU);
  if (t.scalar_type() == at::kBFloat16 || t.scalar_type() == at::kHalf) t = t.to(at::kFloat);
  if (t.scalar_type() == at::kBool) t = t.to(at::kByte);
  t = t.contiguous();
  const TypePair types = types_for(t.scalar_type());
  if (types.file < 0) throw Error(ctx + std::string("tensor dtype ") + c10::toString(t.scalar_type()) + " is not supported");
  const std::size_t rank = static_cast<std::size_t>(t.dim());
  if (!dim_labels.empty() && dim_labels.size() != rank)
    throw Error(ctx + std::to_string(dim_labels.size()) + " dimension labels for a tensor of rank " + std::to_string(rank));

  QuietErrors quiet;
  std::vector<hsize_t> dims(t.sizes().begin(), t.sizes().end());
  Handle space(rank == 0 ? H5Screate(H5S_SCALAR) : H5Screate_simple(static_cast<int>(rank), dims.data(), nullptr),
               H5Sclose);
  if (!space.valid()) throw Error(ctx + "cannot create the dataspace" + hdf5_detail());

  Handle dcpl(H5Pcreate(H5P_DATASET_CREATE), H5Pclose);
  const std::size_t nbytes = static_cast<std::size_t>(t.numel()) * t.element_size();
  if (rank > 0 && nbytes > kCompressMinBytes) {
    const auto chunk = chunk_shape(dims, t.element_size());
    H5Pset_chunk(dcpl.get(), static_cast<int>(rank), chunk.data());
    if (H5Zfilter_avail(H5Z_FILTER_SHUFFLE) > 0) H5Pset_shuffle(dcpl.get());
    if (H5Zfilter_avail(H5Z_FILTER_DEFLATE) > 0) H5Pset_deflate(dcpl.get(), kGzipLevel);
  }

  if (exists(p) && H5Ldelete(id_, p.c_str(), H5P_DEFAULT) < 0)
    throw Error(ctx + "cannot replace the existing object" + hdf5_detail());
  Handle lcpl(H5Pcreate(H5P_LINK_CREATE), H5Pclose);
  H5Pset_create_intermediate_group(lcpl.get(), 1);
  Handle ds(H5Dcreate2(id_, p.c_str(), types.file, space.get(), lcpl.get(), dcpl.get(), H5P_DEFAULT), H5Dclose);
  if (!ds.valid()) throw Error(ctx + "cannot create" + hdf5_detail());
  if (t.numel() > 0 && H5Dwrite(ds.get(), types.memory, H5S_ALL, H5S_ALL, H5P_DEFAULT, t.data_ptr()) < 0)
    throw Error(ctx + "write failed" + hdf5_detail());
  for (std::size_t i = 0; i < dim_labels.size(); ++i) {
    if (dim_labels[i].empty()) continue;
    if (H5DSset_label(ds.get(), static_cast<unsigned>(i), dim_labels[i].c_str()) < 0)
      throw Error(ctx + "cannot set the label of axis " + std::to_string(i) + hdf5_detail());
  }
}

std::vector<int64_t> H5File::shape(const std::string& dataset_path) const {
  const std::string p = normalise(dataset_path);
  if (id_ < 0) throw Error(path_.string() + ": dataset '" + p + "': the file is closed");
  QuietErrors quiet;
  Handle ds(H5Dopen2(id_, p.c_str(), H5P_DEFAULT), H5Dclose);
  if (!ds.valid()) throw Error(path_.string() + ": no dataset '" + p + "'" + hdf5_detail());
  Handle space(H5Dget_space(ds.get()), H5Sclose);
  const int rank = H5Sget_simple_extent_ndims(space.get());
  if (rank < 0) throw Error(path_.string() + ": dataset '" + p + "': cannot read its shape" + hdf5_detail());
  std::vector<hsize_t> dims(static_cast<std::size_t>(rank));
  H5Sget_simple_extent_dims(space.get(), dims.data(), nullptr);
  return std::vector<int64_t>(dims.begin(), dims.end());
}

at::Tensor H5File::read(const std::string& dataset_path) const {
  const std::string p = normalise(dataset_path);
  const std::string ctx = path_.string() + ": dataset '" + p + "': ";
  if (id_ < 0) throw Error(ctx + "the file is closed");
  const std::vector<int64_t> dims = shape(p);
  QuietErrors quiet;
  Handle ds(H5Dopen2(id_, p.c_str(), H5P_DEFAULT), H5Dclose);
  if (!ds.valid()) throw Error(path_.string() + ": no dataset '" + p + "'" + hdf5_detail());
  Handle type(H5Dget_type(ds.get()), H5Tclose);
  const H5T_class_t cls = H5Tget_class(type.get());
  const std::size_t size = H5Tget_size(type.get());

  // The tensor dtype follows the stored type; HDF5 converts where the memory type differs.
  at::ScalarType st;
  hid_t mem;
  if (cls == H5T_FLOAT) {
    st = size > 4 ? at::kDouble : at::kFloat;
    mem = size > 4 ? H5T_NATIVE_DOUBLE : H5T_NATIVE_FLOAT;
  } else if (cls == H5T_INTEGER) {
    const bool is_signed = H5Tget_sign(type.get()) == H5T_SGN_2;
    if (!is_signed && size == 1) { st = at::kByte; mem = H5T_NATIVE_UINT8; }
    else if (size == 1) { st = at::kChar; mem = H5T_NATIVE_INT8; }
    else if (size == 2 && is_signed) { st = at::kShort; mem = H5T_NATIVE_INT16; }
    else if (size <= 4 && (is_signed || size < 4)) { st = at::kInt; mem = H5T_NATIVE_INT32; }
    else { st = at::kLong; mem = H5T_NATIVE_INT64; }  // u32 and u64 widen (u64 above 2^63 clips)
  } else if (cls == H5T_STRING) {
    throw Error(ctx + "holds strings; use read_strings()");
  } else {
    throw Error(ctx + "has an HDF5 type class (" + std::to_string(static_cast<int>(cls)) + ") that is not numeric");
  }
  at::Tensor out = at::empty(dims, at::TensorOptions().dtype(st));
  if (out.numel() > 0 && H5Dread(ds.get(), mem, H5S_ALL, H5S_ALL, H5P_DEFAULT, out.data_ptr()) < 0)
    throw Error(ctx + "read failed" + hdf5_detail());
  return out;
}

std::vector<std::string> H5File::dim_labels(const std::string& dataset_path) const {
  const std::string p = normalise(dataset_path);
  const std::size_t rank = shape(p).size();
  QuietErrors quiet;
  Handle ds(H5Dopen2(id_, p.c_str(), H5P_DEFAULT), H5Dclose);
  if (!ds.valid()) throw Error(path_.string() + ": no dataset '" + p + "'" + hdf5_detail());
  std::vector<std::string> labels(rank);
  for (std::size_t i = 0; i < rank; ++i) {
    const ssize_t len = H5DSget_label(ds.get(), static_cast<unsigned>(i), nullptr, 0);
    if (len <= 0) {
      H5Eclear2(H5E_DEFAULT);
      continue;
    }
    std::string label(static_cast<std::size_t>(len) + 1, '\0');
    H5DSget_label(ds.get(), static_cast<unsigned>(i), label.data(), label.size());
    label.resize(static_cast<std::size_t>(len));
    labels[i] = std::move(label);
  }
  return labels;
}

void H5File::write_strings(const std::string& dataset_path, const std::vector<std::string>& values) {
  const std::string p = normalise(dataset_path);
  const std::string ctx = path_.string() + ": dataset '" + p + "': ";
  require_writable("dataset '" + p + "'");
  std::vector<const char*> ptrs;  // HDF5 takes variable-length strings as NUL-terminated pointers
  ptrs.reserve(values.size());
  for (std::size_t i = 0; i < values.size(); ++i) {
    if (values[i].find('\0') != std::string::npos)
      throw Error(ctx + "string " + std::to_string(i) + " holds a NUL byte, which HDF5 strings cannot store");
    ptrs.push_back(values[i].c_str());
  }
  QuietErrors quiet;
  const hsize_t n = values.size();
  Handle space(H5Screate_simple(1, &n, nullptr), H5Sclose);
  Handle type = string_type();
  if (exists(p) && H5Ldelete(id_, p.c_str(), H5P_DEFAULT) < 0)
    throw Error(ctx + "cannot replace the existing object" + hdf5_detail());
  Handle lcpl(H5Pcreate(H5P_LINK_CREATE), H5Pclose);
  H5Pset_create_intermediate_group(lcpl.get(), 1);
  Handle ds(H5Dcreate2(id_, p.c_str(), type.get(), space.get(), lcpl.get(), H5P_DEFAULT, H5P_DEFAULT), H5Dclose);
  if (!ds.valid()) throw Error(ctx + "cannot create" + hdf5_detail());
  if (n > 0 && H5Dwrite(ds.get(), type.get(), H5S_ALL, H5S_ALL, H5P_DEFAULT, ptrs.data()) < 0)
    throw Error(ctx + "write failed" + hdf5_detail());
}

std::vector<std::string> H5File::read_strings(const std::string& dataset_path) const {
  const std::string p = normalise(dataset_path);
  const std::string ctx = path_.string() + ": dataset '" + p + "': ";
  if (id_ < 0) throw Error(ctx + "the file is closed");
  QuietErrors quiet;
  Handle ds(H5Dopen2(id_, p.c_str(), H5P_DEFAULT), H5Dclose);
  if (!ds.valid()) throw Error(path_.string() + ": no dataset '" + p + "'" + hdf5_detail());
  Handle ftype(H5Dget_type(ds.get()), H5Tclose);
  if (H5Tget_class(ftype.get()) != H5T_STRING) throw Error(ctx + "does not hold strings");
  Handle space(H5Dget_space(ds.get()), H5Sclose);
  const hssize_t count = H5Sget_simple_extent_npoints(space.get());
  if (count < 0) throw Error(ctx + "cannot read its size" + hdf5_detail());
  std::vector<std::string> out;
  out.reserve(static_cast<std::size_t>(count));
  if (count == 0) return out;

  if (H5Tis_variable_str(ftype.get()) > 0) {
    Handle mtype = string_type(H5Tget_cset(ftype.get()));
    std::vector<char*> ptrs(static_cast<std::size_t>(count), nullptr);
    if (H5Dread(ds.get(), mtype.get(), H5S_ALL, H5S_ALL, H5P_DEFAULT, ptrs.data()) < 0)
      throw Error(ctx + "read failed" + hdf5_detail());
    for (const char* s : ptrs) out.emplace_back(s ? s : "");
    reclaim_strings(mtype.get(), space.get(), ptrs.data());
  } else {
    // Fixed-length strings: `size` bytes each, padded with NULs or spaces.
    const std::size_t size = H5Tget_size(ftype.get());
    std::string buf(size * static_cast<std::size_t>(count), '\0');
    if (H5Dread(ds.get(), ftype.get(), H5S_ALL, H5S_ALL, H5P_DEFAULT, buf.data()) < 0)
      throw Error(ctx + "read failed" + hdf5_detail());
    const bool space_padded = H5Tget_strpad(ftype.get()) == H5T_STR_SPACEPAD;
    for (hssize_t i = 0; i < count; ++i) {
      std::string s = buf.substr(static_cast<std::size_t>(i) * size, size);
      s.resize(std::min(s.find('\0'), s.size()));
      if (space_padded) s.erase(s.find_last_not_of(' ') + 1);
      out.push_back(std::move(s));
    }
  }
  return out;
}

namespace {

// Opens the object an attribute lives on; the returned handle is closed with H5Oclose.
Handle open_object(hid_t file, const std::string& file_name, const std::string& obj_path) {
  Handle obj(H5Oopen(file, obj_path.c_str(), H5P_DEFAULT), H5Oclose);
  if (!obj.valid()) throw Error(file_name + ": no object '" + obj_path + "' to hold attributes" + hdf5_detail());
  return obj;
}

// Creates (replacing) a scalar attribute and writes one value of `mem_type` from `value`.
void write_scalar_attr(hid_t file, const std::string& file_name, const std::string& obj_path, const std::string& name,
                       hid_t file_type, hid_t mem_type, const void* value) {
  const std::string ctx = file_name + ": attribute '" + name + "' of '" + obj_path + "': ";
  Handle obj = open_object(file, file_name, obj_path);
  if (H5Aexists(obj.get(), name.c_str()) > 0 && H5Adelete(obj.get(), name.c_str()) < 0)
    throw Error(ctx + "cannot replace" + hdf5_detail());
  Handle space(H5Screate(H5S_SCALAR), H5Sclose);
  Handle attr(H5Acreate2(obj.get(), name.c_str(), file_type, space.get(), H5P_DEFAULT, H5P_DEFAULT), H5Aclose);
  if (!attr.valid()) throw Error(ctx + "cannot create" + hdf5_detail());
  if (H5Awrite(attr.get(), mem_type, value) < 0) throw Error(ctx + "write failed" + hdf5_detail());
}

Handle open_attr(hid_t obj, const std::string& ctx, const std::string& name) {
  if (H5Aexists(obj, name.c_str()) <= 0) throw Error(ctx + "not found");
  Handle attr(H5Aopen(obj, name.c_str(), H5P_DEFAULT), H5Aclose);
  if (!attr.valid()) throw Error(ctx + "cannot open" + hdf5_detail());
  return attr;
}

}  // namespace

void H5File::set_attr(const std::string& obj_path, const std::string& name, std::string_view value) {
  const std::string p = normalise(obj_path);
  require_writable("attribute '" + name + "' of '" + p + "'");
  const std::string text(value);
  if (text.find('\0') != std::string::npos)
    throw Error(path_.string() + ": attribute '" + name + "' of '" + p + "': value holds a NUL byte");
  QuietErrors quiet;
  Handle type = string_type();
  const char* ptr = text.c_str();
  write_scalar_attr(id_, path_.string(), p, name, type.get(), type.get(), &ptr);
}

void H5File::set_attr_i64(const std::string& obj_path, const std::string& name, int64_t value) {
  const std::string p = normalise(obj_path);
  require_writable("attribute '" + name + "' of '" + p + "'");
  QuietErrors quiet;
  write_scalar_attr(id_, path_.string(), p, name, H5T_STD_I64LE, H5T_NATIVE_INT64, &value);
}

void H5File::set_attr_f64(const std::string& obj_path, const std::string& name, double value) {
  const std::string p = normalise(obj_path);
  require_writable("attribute '" + name + "' of '" + p + "'");
  QuietErrors quiet;
  write_scalar_attr(id_, path_.string(), p, name, H5T_IEEE_F64LE, H5T_NATIVE_DOUBLE, &value);
}

bool H5File::has_attr(const std::string& obj_path, const std::string& name) const {
  const std::string p = normalise(obj_path);
  if (id_ < 0) throw Error(path_.string() + ": attribute '" + name + "' of '" + p + "': the file is closed");
  if (!exists(p)) return false;
  QuietErrors quiet;
  Handle obj = open_object(id_, path_.string(), p);
  return H5Aexists(obj.get(), name.c_str()) > 0;
}

std::string H5File::attr_string(const std::string& obj_path, const std::string& name) const {
  const std::string p = normalise(obj_path);
  const std::string ctx = path_.string() + ": attribute '" + name + "' of '" + p + "': ";
  if (id_ < 0) throw Error(ctx + "the file is closed");
  QuietErrors quiet;
  Handle obj = open_object(id_, path_.string(), p);
  Handle attr = open_attr(obj.get(), ctx, name);
  Handle ftype(H5Aget_type(attr.get()), H5Tclose);
  if (H5Tget_class(ftype.get()) != H5T_STRING) throw Error(ctx + "is not a string");
  if (H5Tis_variable_str(ftype.get()) > 0) {
    Handle mtype = string_type(H5Tget_cset(ftype.get()));
    char* s = nullptr;
    if (H5Aread(attr.get(), mtype.get(), &s) < 0) throw Error(ctx + "read failed" + hdf5_detail());
    std::string out = s ? s : "";
    H5free_memory(s);
    return out;
  }
  const std::size_t size = H5Tget_size(ftype.get());
  std::string buf(size, '\0');
  if (H5Aread(attr.get(), ftype.get(), buf.data()) < 0) throw Error(ctx + "read failed" + hdf5_detail());
  buf.resize(std::min(buf.find('\0'), buf.size()));
  if (H5Tget_strpad(ftype.get()) == H5T_STR_SPACEPAD) buf.erase(buf.find_last_not_of(' ') + 1);
  return buf;
}

int64_t H5File::attr_int(const std::string& obj_path, const std::string& name) const {
  const std::string p = normalise(obj_path);
  const std::string ctx = path_.string() + ": attribute '" + name + "' of '" + p + "': ";
  if (id_ < 0) throw Error(ctx + "the file is closed");
  QuietErrors quiet;
  Handle obj = open_object(id_, path_.string(), p);
  Handle attr = open_attr(obj.get(), ctx, name);
  Handle ftype(H5Aget_type(attr.get()), H5Tclose);
  if (H5Tget_class(ftype.get()) != H5T_INTEGER) throw Error(ctx + "is not an integer");
  int64_t v = 0;
  if (H5Aread(attr.get(), H5T_NATIVE_INT64, &v) < 0) throw Error(ctx + "read failed" + hdf5_detail());
  return v;
}

double H5File::attr_double(const std::string& obj_path, const std::string& name) const {
  const std::string p = normalise(obj_path);
  const std::string ctx = path_.string() + ": attribute '" + name + "' of '" + p + "': ";
  if (id_ < 0) throw Error(ctx + "the file is closed");
  QuietErrors quiet;
  Handle obj = open_object(id_, path_.string(), p);
  Handle attr = open_attr(obj.get(), ctx, name);
  Handle ftype(H5Aget_type(attr.get()), H5Tclose);
  const H5T_class_t cls = H5Tget_class(ftype.get());
  if (cls != H5T_FLOAT && cls != H5T_INTEGER) throw Error(ctx + "is not a number");
  double v = 0;
  if (H5Aread(attr.get(), H5T_NATIVE_DOUBLE, &v) < 0) throw Error(ctx + "read failed" + hdf5_detail());
  return v;
}


// ---- live files -----------------------------------------------------------------------------------

namespace {

// File access properties of live files: CLOSE_STRONG as elsewhere and the newest file format, which
// SWMR requires (HDF5 >= 1.10 readers, h5py included, open it).
Handle live_fapl() {
  Handle fapl(H5Pcreate(H5P_FILE_ACCESS), H5Pclose);
  H5Pset_fclose_degree(fapl.get(), H5F_CLOSE_STRONG);
  H5Pset_libver_bounds(fapl.get(), H5F_LIBVER_LATEST, H5F_LIBVER_LATEST);
  return fapl;
}

// HDF5 locks a file (flock) while a process opens it, and a writer's reopening or its start of SWMR
// writing fails while another process holds that lock: a reader in the middle of opening the file, say.
// attempt() (an HDF5 call, negative on failure) is retried while its failure is the lock, with short
// pauses, for up to 30 s; any other failure returns at once. detail: the last failure's HDF5 message.
template <class Attempt>
auto retry_while_locked(Attempt attempt, std::string& detail) {
  using namespace std::chrono;
  const auto deadline = steady_clock::now() + seconds(30);
  auto pause = milliseconds(1);
  for (;;) {
    const auto r = attempt();
    if (r >= 0) return r;
    detail = hdf5_detail();
    if (detail.find("unable to lock file") == std::string::npos || steady_clock::now() >= deadline) return r;
    std::this_thread::sleep_for(pause);
    pause = std::min(pause * 2, milliseconds(32));
  }
}

}  // namespace

H5File H5File::create_live(const fs::path& path) {
  QuietErrors quiet;
  Handle fapl = live_fapl();
  const hid_t id = H5Fcreate(path.c_str(), H5F_ACC_TRUNC, H5P_DEFAULT, fapl.get());
  if (id < 0) throw Error(path.string() + ": cannot create HDF5 file" + hdf5_detail());
  return H5File(id, Mode::ReadWrite, path, path);
}

H5File H5File::open_live(const fs::path& path) {
  QuietErrors quiet;
  if (!fs::is_regular_file(path)) throw Error(path.string() + ": no such file");
  Handle fapl = live_fapl();
  std::string detail;
  const hid_t id = retry_while_locked([&] { return H5Fopen(path.c_str(), H5F_ACC_RDWR, fapl.get()); }, detail);
  if (id < 0) throw Error(path.string() + ": cannot open HDF5 file for writing" + detail);
  return H5File(id, Mode::ReadWrite, path, path);
}

H5File H5File::open_follow(const fs::path& path) {
  QuietErrors quiet;
  if (!fs::is_regular_file(path)) throw Error(path.string() + ": no such file");
  Handle fapl(H5Pcreate(H5P_FILE_ACCESS), H5Pclose);
  H5Pset_fclose_degree(fapl.get(), H5F_CLOSE_STRONG);
#if H5_VERSION_GE(1, 10, 7)
  // A follower takes no file lock: SWMR reading needs none, and its lock, held while it opens the file,
  // would make the writer's reopening wait (retry_while_locked).
  H5Pset_file_locking(fapl.get(), false, true);
#endif
  const hid_t id = H5Fopen(path.c_str(), H5F_ACC_RDONLY | H5F_ACC_SWMR_READ, fapl.get());
  if (id < 0) throw Error(path.string() + ": cannot open as HDF5 (SWMR read)" + hdf5_detail());
  return H5File(id, Mode::ReadOnly, path, path);
}

void H5File::create_series(const std::string& dataset_path, at::ScalarType dtype, int64_t chunk) {
  const std::string p = normalise(dataset_path);
  const std::string ctx = path_.string() + ": dataset '" + p + "': ";
  require_writable("dataset '" + p + "'");
  if (swmr_) throw Error(ctx + "cannot create datasets once SWMR writing has started");
  const TypePair types = types_for(dtype);
  if (types.file < 0 || !(dtype == at::kDouble || dtype == at::kFloat || dtype == at::kLong || dtype == at::kInt))
    throw Error(ctx + "series hold f64, f32, i64 or i32, not " + c10::toString(dtype));
  if (chunk < 1) throw Error(ctx + "chunk must be >= 1");
  QuietErrors quiet;
  const hsize_t dims[1] = {0}, maxdims[1] = {H5S_UNLIMITED}, chunk_dims[1] = {static_cast<hsize_t>(chunk)};
  Handle space(H5Screate_simple(1, dims, maxdims), H5Sclose);
  Handle dcpl(H5Pcreate(H5P_DATASET_CREATE), H5Pclose);
  H5Pset_chunk(dcpl.get(), 1, chunk_dims);
  Handle lcpl(H5Pcreate(H5P_LINK_CREATE), H5Pclose);
  H5Pset_create_intermediate_group(lcpl.get(), 1);
  if (exists(p)) throw Error(ctx + "already exists");
  Handle ds(H5Dcreate2(id_, p.c_str(), types.file, space.get(), lcpl.get(), dcpl.get(), H5P_DEFAULT), H5Dclose);
  if (!ds.valid()) throw Error(ctx + "cannot create" + hdf5_detail());
}

void H5File::start_swmr_write() {
  require_writable("start SWMR writing");
  if (swmr_) return;
  QuietErrors quiet;
  std::string detail;
  if (retry_while_locked([&] { return H5Fstart_swmr_write(id_); }, detail) < 0)
    throw Error(path_.string() + ": cannot start SWMR writing" + detail);
  swmr_ = true;
}

namespace {

// Opens a 1-D dataset, checks the values' type against it and returns (dataset, current length).
std::pair<Handle, hsize_t> open_series(hid_t file, const std::string& p, const std::string& ctx) {
  Handle ds(H5Dopen2(file, p.c_str(), H5P_DEFAULT), H5Dclose);
  if (!ds.valid()) throw Error(ctx + "no such dataset" + hdf5_detail());
  Handle space(H5Dget_space(ds.get()), H5Sclose);
  if (H5Sget_simple_extent_ndims(space.get()) != 1) throw Error(ctx + "not a 1-D dataset");
  hsize_t n = 0;
  H5Sget_simple_extent_dims(space.get(), &n, nullptr);
  return {std::move(ds), n};
}

at::Tensor values_for(const at::Tensor& values, hid_t ds, const std::string& ctx) {
  if (!values.defined() || values.dim() != 1) throw Error(ctx + "values must be a 1-D tensor");
  Handle ftype(H5Dget_type(ds), H5Tclose);
  const H5T_class_t cls = H5Tget_class(ftype.get());
  const std::size_t size = H5Tget_size(ftype.get());
  at::ScalarType want;
  if (cls == H5T_FLOAT) want = size == 8 ? at::kDouble : at::kFloat;
  else if (cls == H5T_INTEGER && size == 8) want = at::kLong;
  else if (cls == H5T_INTEGER && size == 4) want = at::kInt;
  else throw Error(ctx + "holds a type series cannot write");
  return values.detach().to(at::kCPU, want).contiguous();
}

// Writes v (values_for's result) into elements [start, start + numel) of a 1-D dataset, then flushes
// it so that SWMR readers see the change.
void write_range(hid_t ds, hsize_t start, const at::Tensor& v, const std::string& ctx) {
  const hsize_t count = static_cast<hsize_t>(v.numel());
  Handle fspace(H5Dget_space(ds), H5Sclose);
  H5Sselect_hyperslab(fspace.get(), H5S_SELECT_SET, &start, nullptr, &count, nullptr);
  Handle mspace(H5Screate_simple(1, &count, nullptr), H5Sclose);
  if (H5Dwrite(ds, types_for(v.scalar_type()).memory, mspace.get(), fspace.get(), H5P_DEFAULT, v.data_ptr()) < 0)
    throw Error(ctx + "write failed" + hdf5_detail());
  if (H5Dflush(ds) < 0) throw Error(ctx + "flush failed" + hdf5_detail());
}

}  // namespace

void H5File::append(const std::string& dataset_path, const at::Tensor& values) {
  const std::string p = normalise(dataset_path);
  const std::string ctx = path_.string() + ": dataset '" + p + "': ";
  require_writable("append to '" + p + "'");
  QuietErrors quiet;
  auto [ds, n] = open_series(id_, p, ctx);
  const at::Tensor v = values_for(values, ds.get(), ctx);
  const hsize_t add = static_cast<hsize_t>(v.numel());
  if (add == 0) return;
  const hsize_t total = n + add;
  if (H5Dset_extent(ds.get(), &total) < 0) throw Error(ctx + "cannot grow" + hdf5_detail());
  write_range(ds.get(), n, v, ctx);
}

void H5File::write_at(const std::string& dataset_path, int64_t index, const at::Tensor& values) {
  const std::string p = normalise(dataset_path);
  const std::string ctx = path_.string() + ": dataset '" + p + "': ";
  require_writable("write to '" + p + "'");
  QuietErrors quiet;
  auto [ds, n] = open_series(id_, p, ctx);
  const at::Tensor v = values_for(values, ds.get(), ctx);
  const hsize_t count = static_cast<hsize_t>(v.numel()), start = static_cast<hsize_t>(index);
  if (index < 0 || start + count > n)
    throw Error(ctx + "elements [" + std::to_string(index) + ", " + std::to_string(index + v.numel()) +
                ") are outside its " + std::to_string(n) + " rows");
  if (count == 0) return;
  write_range(ds.get(), start, v, ctx);
}

void H5File::truncate(const std::string& dataset_path, int64_t n) {
  const std::string p = normalise(dataset_path);
  const std::string ctx = path_.string() + ": dataset '" + p + "': ";
  require_writable("truncate '" + p + "'");
  if (swmr_) throw Error(ctx + "cannot shrink a dataset once SWMR writing has started");
  QuietErrors quiet;
  auto [ds, rows] = open_series(id_, p, ctx);
  if (n < 0 || static_cast<hsize_t>(n) > rows)
    throw Error(ctx + "cannot keep " + std::to_string(n) + " of its " + std::to_string(rows) + " rows");
  const hsize_t size = static_cast<hsize_t>(n);
  if (H5Dset_extent(ds.get(), &size) < 0) throw Error(ctx + "cannot shrink" + hdf5_detail());
}

void H5File::refresh(const std::string& dataset_path) const {
  const std::string p = normalise(dataset_path);
  if (id_ < 0) throw Error(path_.string() + ": refresh('" + p + "'): the file is closed");
  QuietErrors quiet;
  Handle ds(H5Dopen2(id_, p.c_str(), H5P_DEFAULT), H5Dclose);
  if (!ds.valid()) throw Error(path_.string() + ": no dataset '" + p + "'" + hdf5_detail());
  if (H5Drefresh(ds.get()) < 0) throw Error(path_.string() + ": dataset '" + p + "': refresh failed" + hdf5_detail());
}

}  // namespace hh::io
