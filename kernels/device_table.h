#pragma once
// Small int64 tables the kernels read (the scans' sequence offsets and segments), uploaded once for each
// content and device and then reused.

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

namespace hh::kernels {

// `values` as an int64 tensor on `device`, ready for work queued on the device's current stream from now
// on. A table the kernels have been given before on that device (the same values) is the tensor made
// then: a batch of one shape gives the same tables call after call, and each upload cost the host a
// pinned buffer, a copy and the pinned allocator's event queries on every launch. The tables are read
// only; a kept one waits for its copy on any other stream that reads it, and the allocator keeps its
// memory until every stream that read it is past. The last kKeptTables are kept. While the current
// stream captures a graph, every call uploads afresh, as before. CPU tensors for a CPU device.
at::Tensor device_table(const std::vector<int64_t>& values, const at::Device& device);

constexpr size_t kKeptTables = 64;

// Uploads device_table has made since the process started (for tests).
int64_t device_table_uploads();

}  // namespace hh::kernels
