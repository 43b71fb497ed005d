/* Test plugin: loads fine, but its generators misbehave in the ways the host must catch. */
#include <stdio.h>
#include <string.h>

#include "hydrahead/plugin.h"

static int emit(const hh_sink_v1* sink, const char* json) { return sink->emit(sink->ctx, json, strlen(json)); }

static int bad_json(const char* params_json, const hh_tokenizer_v1* tok, uint64_t seed, const hh_sink_v1* sink,
                    char* err, size_t err_cap) {
  (void)params_json, (void)tok, (void)seed, (void)err, (void)err_cap;
  emit(sink, "{\"task\":\"test-bad-json\",\"clean_ids\":[1,2");
  return 0;
}

static int bad_lengths(const char* params_json, const hh_tokenizer_v1* tok, uint64_t seed, const hh_sink_v1* sink,
                       char* err, size_t err_cap) {
  (void)params_json, (void)tok, (void)seed, (void)err, (void)err_cap;
  if (emit(sink, "{\"task\":\"test-bad-lengths\",\"clean_ids\":[10,11,12],\"corrupt_ids\":[10,13,12],"
                 "\"answer_ids\":[14],\"wrong_ids\":[15],\"meta\":{}}"))
    return 0;
  emit(sink, "{\"task\":\"test-bad-lengths\",\"clean_ids\":[10,11,12],\"corrupt_ids\":[10,11],"
             "\"answer_ids\":[14],\"wrong_ids\":[],\"meta\":{}}");
  return 0;
}

static int out_of_range(const char* params_json, const hh_tokenizer_v1* tok, uint64_t seed, const hh_sink_v1* sink,
                        char* err, size_t err_cap) {
  (void)params_json, (void)seed, (void)err, (void)err_cap;
  char json[256];
  snprintf(json, sizeof json,
           "{\"task\":\"test-out-of-range\",\"clean_ids\":[1,2],\"corrupt_ids\":[1,3],\"answer_ids\":[%lld]}",
           (long long)tok->vocab_size);
  emit(sink, json);
  return 0;
}

static int fails(const char* params_json, const hh_tokenizer_v1* tok, uint64_t seed, const hh_sink_v1* sink,
                 char* err, size_t err_cap) {
  (void)params_json, (void)tok, (void)seed, (void)sink;
  snprintf(err, err_cap, "ran out of haystack");
  return 7;
}

static const hh_task_v1 kTasks[] = {
    {"test-bad-json", "Emits a truncated JSON object", "reasoning", NULL, 0, bad_json},
    {"test-bad-lengths", "Emits clean and corrupt of different lengths", "reasoning", NULL, 0, bad_lengths},
    {"test-out-of-range", "Emits an id equal to the vocabulary size", "reasoning", NULL, 0, out_of_range},
    {"test-fails", "Returns an error", "retrieval", NULL, 0, fails},
};

HH_PLUGIN_EXPORT int hydrahead_plugin_v1(const hh_host_v1* host) {
  for (size_t i = 0; i < sizeof kTasks / sizeof kTasks[0]; ++i)
    if (host->register_task(host->ctx, &kTasks[i]) != 0) return 1;
  return 0;
}
