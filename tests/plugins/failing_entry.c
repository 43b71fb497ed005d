/* Test plugin: logs why and refuses to load. */
#include "hydrahead/plugin.h"

HH_PLUGIN_EXPORT int hydrahead_plugin_v1(const hh_host_v1* host) {
  host->log(host->ctx, HH_LOG_ERROR, "haystack.txt not found beside the plugin");
  return 3;
}
