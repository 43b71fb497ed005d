/* Test plugin: one valid task, then descriptors a host must reject (unknown kind, default outside
 * its range). Returns 0 regardless, so the host itself must refuse the library. */
#include "hydrahead/plugin.h"

static int generate(const char* params_json, const hh_tokenizer_v1* tok, uint64_t seed, const hh_sink_v1* sink,
                    char* err, size_t err_cap) {
  (void)params_json;
  (void)tok;
  (void)seed;
  (void)sink;
  (void)err;
  (void)err_cap;
  return 1;
}

static const hh_param_v1 kBadRange[] = {
    {"length", "Prompt length", HH_PARAM_INT, 5, 10, 20, NULL, NULL},
};

static const hh_task_v1 kOk = {"test-malformed-ok", "Valid", "reasoning", NULL, 0, generate};
static const hh_task_v1 kBadKind = {"test-malformed-kind", "Bad kind", "banana", NULL, 0, generate};
static const hh_task_v1 kBadParam = {"test-malformed-param", "Bad default", "retrieval", kBadRange, 1, generate};

HH_PLUGIN_EXPORT int hydrahead_plugin_v1(const hh_host_v1* host) {
  host->register_task(host->ctx, &kOk);
  host->register_task(host->ctx, &kBadKind);
  host->register_task(host->ctx, &kBadParam);
  return 0;
}
