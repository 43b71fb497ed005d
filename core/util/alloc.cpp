#include "core/util/alloc.h"

#if defined(__GLIBC__)
#include <malloc.h>
#endif

namespace hh::util {

void tune_allocator_for_tensors() {
#if defined(__GLIBC__)
  mallopt(M_MMAP_THRESHOLD, 1 << 30);
  mallopt(M_TRIM_THRESHOLD, 0x7fffffff);
  mallopt(M_TOP_PAD, 256 << 20);
#endif
}

}  // namespace hh::util
