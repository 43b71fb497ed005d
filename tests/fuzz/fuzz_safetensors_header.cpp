// libFuzzer target: a whole safetensors file image through parse_buffer(), the function the mmap
// reader uses (8-byte length prefix, header length limits, JSON validation, offset checks).
// hh::Error is an expected rejection; a crash, a sanitizer report, another exception, or a header
// accepted in violation of the invariants below is a finding.
#include <cstddef>
#include <cstdint>
#include <cstdlib>

#include "core/io/safetensors.h"
#include "core/util/error.h"

namespace {

// What every reader relies on once parse_buffer() accepts a header.
void check_invariants(const hh::io::Header& h, std::size_t size) {
  const uint64_t data_len = size - hh::io::kHeaderPrefixBytes - h.header_len;
  uint64_t furthest_end = 0;  // over non-empty tensors, in data order
  bool any = false;
  for (const auto& t : h.tensors) {
    if (t.begin > t.end || t.end > data_len) std::abort();
    uint64_t bytes = hh::io::dtype_size(t.dtype);
    bool has_zero = false;
    for (const int64_t d : t.shape) {
      if (d < 0) std::abort();
      has_zero = has_zero || d == 0;
      if (!has_zero && __builtin_mul_overflow(bytes, uint64_t(d), &bytes)) std::abort();
    }
    if (has_zero) bytes = 0;
    if (t.end - t.begin != bytes) std::abort();
    if (t.begin == t.end) continue;
    if (any && t.begin < furthest_end) std::abort();
    if (t.end > furthest_end) furthest_end = t.end;
    any = true;
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, std::size_t size) {
  try {
    const hh::io::Header h = hh::io::parse_buffer(data, size, "fuzz.safetensors");
    check_invariants(h, size);
  } catch (const hh::Error&) {
    // expected: a rejected header
  }
  return 0;
}
