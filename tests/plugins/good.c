/* Test plugin: registers two valid tasks over digit strings. Every digit is a pre-token of its own
 * in the byte-level tokenizers we test with, so changing one digit keeps the token count; the
 * generator still checks the lengths through the tokenizer callbacks. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "hydrahead/plugin.h"

enum { kMaxDigits = 64, kMaxIds = 256 };

struct buf {
  char* data;
  size_t len, cap;
};

static int buf_add(struct buf* b, const char* s) {
  size_t n = strlen(s);
  if (b->len + n + 1 > b->cap) {
    size_t cap = b->cap ? b->cap * 2 : 256;
    while (cap < b->len + n + 1) cap *= 2;
    char* p = (char*)realloc(b->data, cap);
    if (!p) return -1;
    b->data = p;
    b->cap = cap;
  }
  memcpy(b->data + b->len, s, n + 1);
  b->len += n;
  return 0;
}

static int buf_add_ids(struct buf* b, const int64_t* ids, int64_t n) {
  char num[32];
  if (buf_add(b, "[")) return -1;
  for (int64_t i = 0; i < n; ++i) {
    snprintf(num, sizeof num, i ? ",%lld" : "%lld", (long long)ids[i]);
    if (buf_add(b, num)) return -1;
  }
  return buf_add(b, "]");
}

/* Reads `"key":<number>` from the host's parameter object (keys are unique, values compact). */
static double param_number(const char* json, const char* key, double fallback) {
  char pattern[64];
  snprintf(pattern, sizeof pattern, "\"%s\":", key);
  const char* p = strstr(json, pattern);
  if (!p) return fallback;
  p += strlen(pattern);
  if (strncmp(p, "true", 4) == 0) return 1;
  if (strncmp(p, "false", 5) == 0) return 0;
  return strtod(p, NULL);
}

static uint64_t next_random(uint64_t* state) {
  uint64_t z = (*state += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

static int64_t encode(const hh_tokenizer_v1* tok, const char* text, int64_t* ids) {
  int64_t n = tok->encode(tok->ctx, text, strlen(text), ids, kMaxIds);
  return n > kMaxIds ? -1 : n;
}

static int generate_digits(const char* task_id, const char* params_json, const hh_tokenizer_v1* tok, uint64_t seed,
                           const hh_sink_v1* sink, char* err, size_t err_cap) {
  const int num = (int)param_number(params_json, "num_examples", 3);
  const int length = (int)param_number(params_json, "length", 4);
  const double depth = param_number(params_json, "depth", 0.5);
  const int with_text = (int)param_number(params_json, "with_text", 1);
  uint64_t rng = seed;
  int64_t clean_ids[kMaxIds], corrupt_ids[kMaxIds], answer_ids[kMaxIds], wrong_ids[kMaxIds];
  char clean[kMaxDigits + 1], corrupt[kMaxDigits + 1], answer[2] = {0}, wrong[2] = {0};
  struct buf b = {NULL, 0, 0};
  if (length < 1 || length > kMaxDigits) {
    snprintf(err, err_cap, "length %d is outside [1, %d]", length, kMaxDigits);
    return 1;
  }
  for (int i = 0; i < num; ++i) {
    const int pos = (int)(depth * (length - 1) + 0.5);
    for (int k = 0; k < length; ++k) clean[k] = (char)('0' + next_random(&rng) % 10);
    clean[length] = '\0';
    memcpy(corrupt, clean, (size_t)length + 1);
    corrupt[pos] = (char)('0' + (clean[pos] - '0' + 1 + next_random(&rng) % 9) % 10);
    answer[0] = clean[pos];
    wrong[0] = corrupt[pos];
    int64_t nc = encode(tok, clean, clean_ids), nk = encode(tok, corrupt, corrupt_ids);
    int64_t na = encode(tok, answer, answer_ids), nw = encode(tok, wrong, wrong_ids);
    if (nc < 0 || nk < 0 || na < 0 || nw < 0 || nc != nk) {
      snprintf(err, err_cap, "example %d: clean and corrupt tokenise to %lld and %lld tokens", i, (long long)nc,
               (long long)nk);
      free(b.data);
      return 1;
    }
    char meta[160];
    b.len = 0;
    buf_add(&b, "{\"task\":\"");
    buf_add(&b, task_id);
    buf_add(&b, "\",\"clean_ids\":");
    buf_add_ids(&b, clean_ids, nc);
    buf_add(&b, ",\"corrupt_ids\":");
    buf_add_ids(&b, corrupt_ids, nk);
    buf_add(&b, ",\"answer_ids\":");
    buf_add_ids(&b, answer_ids, na);
    buf_add(&b, ",\"wrong_ids\":");
    buf_add_ids(&b, wrong_ids, nw);
    snprintf(meta, sizeof meta, ",\"meta\":{\"index\":%d,\"pos\":%d}", i, pos);
    buf_add(&b, meta);
    if (with_text) {
      buf_add(&b, ",\"clean\":\"");
      buf_add(&b, clean);
      buf_add(&b, "\",\"corrupt\":\"");
      buf_add(&b, corrupt);
      buf_add(&b, "\",\"answer\":\"");
      buf_add(&b, answer);
      buf_add(&b, "\",\"wrong\":\"");
      buf_add(&b, wrong);
      buf_add(&b, "\"");
    }
    if (buf_add(&b, "}")) {
      snprintf(err, err_cap, "out of memory");
      free(b.data);
      return 1;
    }
    if (sink->emit(sink->ctx, b.data, b.len) != 0) break; /* cancelled */
    sink->progress(sink->ctx, (double)(i + 1) / num);
  }
  free(b.data);
  return 0;
}

static int generate_copy(const char* params_json, const hh_tokenizer_v1* tok, uint64_t seed, const hh_sink_v1* sink,
                         char* err, size_t err_cap) {
  return generate_digits("test-copy", params_json, tok, seed, sink, err, err_cap);
}

static int generate_echo(const char* params_json, const hh_tokenizer_v1* tok, uint64_t seed, const hh_sink_v1* sink,
                         char* err, size_t err_cap) {
  return generate_digits("test-echo", params_json, tok, seed, sink, err, err_cap);
}

static const char* const kModes[] = {"last", "first", NULL};

static const hh_param_v1 kCopyParams[] = {
    {"num_examples", "Examples to generate", HH_PARAM_INT, 3, 1, 1000, NULL, NULL},
    {"length", "Digits in the prompt", HH_PARAM_INT, 6, 2, 64, NULL, NULL},
    {"depth", "Where the changed digit sits (0 start, 1 end)", HH_PARAM_FLOAT, 0.5, 0, 1, NULL, NULL},
    {"mode", "Recorded only", HH_PARAM_STRING, 0, 0, 0, "last", kModes},
    {"with_text", "Add the text fields", HH_PARAM_BOOL, 1, 0, 0, NULL, NULL},
};

static const hh_param_v1 kEchoParams[] = {
    {"num_examples", "Examples to generate", HH_PARAM_INT, 2, 1, 100, NULL, NULL},
};

static const hh_task_v1 kTasks[] = {
    {"test-copy", "Digits with one changed; the answer is the changed digit", "reasoning", kCopyParams,
     sizeof kCopyParams / sizeof kCopyParams[0], generate_copy},
    {"test-echo", "Four digits, answer in the middle", "retrieval", kEchoParams,
     sizeof kEchoParams / sizeof kEchoParams[0], generate_echo},
};

HH_PLUGIN_EXPORT int hydrahead_plugin_v1(const hh_host_v1* host) {
  if (host->abi_version != HH_PLUGIN_ABI_VERSION) return 1;
  for (size_t i = 0; i < sizeof kTasks / sizeof kTasks[0]; ++i)
    if (host->register_task(host->ctx, &kTasks[i]) != 0) return 1;
  host->log(host->ctx, HH_LOG_INFO, "registered test-copy and test-echo");
  return 0;
}
