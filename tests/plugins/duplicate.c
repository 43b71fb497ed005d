/* Test plugin: registers a fresh id, then one that good.c already registers. It ignores the refusal
 * and returns 0, so the host itself must refuse the whole library and drop the fresh id too. */
#include <stdio.h>

#include "hydrahead/plugin.h"

static int generate(const char* params_json, const hh_tokenizer_v1* tok, uint64_t seed, const hh_sink_v1* sink,
                    char* err, size_t err_cap) {
  (void)params_json;
  (void)tok;
  (void)seed;
  (void)sink;
  snprintf(err, err_cap, "not meant to run");
  return 1;
}

static const hh_task_v1 kExtra = {"test-dup-extra", "Registered before the duplicate", "reasoning", NULL, 0, generate};
static const hh_task_v1 kCopy = {"test-copy", "Same id as good.c", "reasoning", NULL, 0, generate};

HH_PLUGIN_EXPORT int hydrahead_plugin_v1(const hh_host_v1* host) {
  host->register_task(host->ctx, &kExtra);
  host->register_task(host->ctx, &kCopy);
  return 0;
}
