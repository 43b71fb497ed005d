/* Test plugin: speaks a future ABI only, so a version-1 host must refuse it. */
#include "hydrahead/plugin.h"

HH_PLUGIN_EXPORT int hydrahead_plugin_v2(const void* host) {
  (void)host;
  return 0;
}
