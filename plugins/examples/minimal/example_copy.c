/* example-copy: a minimal calibration-task plugin for HydraHead (plugin ABI version 1).
 *
 *   clean    "Copy: q w e ->"     answer " q w e"
 *   corrupt  "Copy: x k p ->"     wrong  " x k p"   (every letter changed, so the answer changes)
 *
 * Each letter is written as " <letter>", which byte-level BPE tokenizers split into a word of its own;
 * only letters whose " <letter>" has the same token count are drawn (one token each in real
 * vocabularies), so clean and corrupt have the same token length by construction. The generator
 * still encodes both prompts through the host's tokenizer and checks that, retrying with new letters
 * on the rare tokenizer where it fails.
 *
 * Plain C99 and the one header, so it builds with any compiler and shares no C++ ABI with the host. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "hydrahead/plugin.h"

#define TASK_ID "example-copy"

enum {
  kMaxLetters = 64,      /* upper bound of the `length` parameter */
  kAlphabetSize = 26,
  kMaxAttempts = 16,     /* fresh letters to try when clean and corrupt differ in length */
  kMaxWordTokens = 8,    /* a " <letter>" longer than this is not drawn from */
};

/* ---- small helpers: a growable string and a growable id array ---------------------------------- */

typedef struct {
  char* data;
  size_t len, cap;
  int failed; /* out of memory at some point */
} strbuf;

static void sb_reserve(strbuf* b, size_t extra) {
  if (b->failed || b->len + extra + 1 <= b->cap) return;
  size_t cap = b->cap ? b->cap : 256;
  while (cap < b->len + extra + 1) cap *= 2;
  char* p = (char*)realloc(b->data, cap);
  if (!p) {
    b->failed = 1;
    return;
  }
  b->data = p;
  b->cap = cap;
}

static void sb_append(strbuf* b, const char* s, size_t n) {
  sb_reserve(b, n);
  if (b->failed) return;
  memcpy(b->data + b->len, s, n);
  b->len += n;
  b->data[b->len] = '\0';
}

static void sb_puts(strbuf* b, const char* s) { sb_append(b, s, strlen(s)); }

static void sb_json_string(strbuf* b, const char* s) {
  sb_puts(b, "\"");
  for (; *s; ++s) {
    char esc[8];
    const unsigned char c = (unsigned char)*s;
    if (c == '"' || c == '\\') {
      esc[0] = '\\';
      esc[1] = (char)c;
      sb_append(b, esc, 2);
    } else if (c < 0x20) {
      snprintf(esc, sizeof esc, "\\u%04x", c);
      sb_puts(b, esc);
    } else {
      sb_append(b, s, 1);
    }
  }
  sb_puts(b, "\"");
}

typedef struct {
  int64_t* v;
  int64_t n, cap;
} idbuf;

static void sb_ids(strbuf* b, const idbuf* ids) {
  char num[24];
  sb_puts(b, "[");
  for (int64_t i = 0; i < ids->n; ++i) {
    snprintf(num, sizeof num, i ? ",%lld" : "%lld", (long long)ids->v[i]);
    sb_puts(b, num);
  }
  sb_puts(b, "]");
}

/* Encodes `text` with the host's tokenizer into `out`, growing it when the ids do not fit. */
static int encode(const hh_tokenizer_v1* tok, const char* text, idbuf* out) {
  int64_t n = tok->encode(tok->ctx, text, strlen(text), out->v, out->cap);
  if (n < 0) return -1;
  if (n > out->cap) {
    int64_t* p = (int64_t*)realloc(out->v, (size_t)n * sizeof *p);
    if (!p) return -1;
    out->v = p;
    out->cap = n;
    n = tok->encode(tok->ctx, text, strlen(text), out->v, out->cap);
    if (n < 0 || n > out->cap) return -1;
  }
  out->n = n;
  return 0;
}

/* splitmix64: small, fast, and the same sequence on every platform for a given seed. */
static uint64_t next_random(uint64_t* state) {
  uint64_t z = (*state += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

/* Reads `"key":<integer>` from the host's parameter object (compact JSON, every declared key present). */
static long long param_int(const char* json, const char* key, long long fallback) {
  char pattern[64];
  snprintf(pattern, sizeof pattern, "\"%s\":", key);
  const char* p = strstr(json, pattern);
  return p ? strtoll(p + strlen(pattern), NULL, 10) : fallback;
}

/* " a w k" from the letters "awk". */
static void spaced(const char* letters, char* out) {
  for (; *letters; ++letters) {
    *out++ = ' ';
    *out++ = *letters;
  }
  *out = '\0';
}

/* ---- the generator ------------------------------------------------------------------------------ */

static int generate(const char* params_json, const hh_tokenizer_v1* tok, uint64_t seed, const hh_sink_v1* sink,
                    char* err, size_t err_cap) {
  const long long num = param_int(params_json, "num_examples", 16);
  const long long length = param_int(params_json, "length", 5);
  if (length < 1 || length > kMaxLetters) {
    snprintf(err, err_cap, "length %lld is outside [1, %d]", length, kMaxLetters);
    return 1;
  }

  char alphabet[kAlphabetSize + 1];
  int alphabet_size = 0;
  idbuf clean_ids = {NULL, 0, 0}, corrupt_ids = {NULL, 0, 0}, answer_ids = {NULL, 0, 0}, wrong_ids = {NULL, 0, 0};
  strbuf line = {NULL, 0, 0, 0};
  int status = 0;

  /* Letters whose " <letter>" has the token count most letters share (one, in real vocabularies). */
  int tokens_of[kAlphabetSize];
  int letters_with[kMaxWordTokens + 1] = {0};
  for (int c = 0; c < kAlphabetSize; ++c) {
    const char word[3] = {' ', (char)('a' + c), '\0'};
    if (encode(tok, word, &answer_ids) != 0) {
      snprintf(err, err_cap, "the tokenizer failed to encode \"%s\"", word);
      status = 1;
      goto done;
    }
    tokens_of[c] = (int)answer_ids.n;
    if (answer_ids.n >= 1 && answer_ids.n <= kMaxWordTokens) ++letters_with[answer_ids.n];
  }
  int best = 1;
  for (int n = 2; n <= kMaxWordTokens; ++n)
    if (letters_with[n] > letters_with[best]) best = n;
  for (int c = 0; c < kAlphabetSize; ++c)
    if (tokens_of[c] == best) alphabet[alphabet_size++] = (char)('a' + c);
  alphabet[alphabet_size] = '\0';
  if (alphabet_size < 2) {
    snprintf(err, err_cap, "fewer than two letters tokenise alike with a leading space in this vocabulary");
    status = 1;
    goto done;
  }

  uint64_t rng = seed;
  for (long long i = 0; i < num; ++i) {
    char letters[kMaxLetters + 1], changed[kMaxLetters + 1];
    char clean[2 * kMaxLetters + 16], corrupt[2 * kMaxLetters + 16];
    char answer[2 * kMaxLetters + 1], wrong[2 * kMaxLetters + 1];
    int attempt = 0;
    for (;; ++attempt) {
      if (attempt == kMaxAttempts) {
        snprintf(err, err_cap, "example %lld: clean and corrupt prompts kept tokenising to different lengths", i);
        status = 1;
        goto done;
      }
      for (long long k = 0; k < length; ++k) {
        const int a = (int)(next_random(&rng) % (uint64_t)alphabet_size);
        const int shift = 1 + (int)(next_random(&rng) % (uint64_t)(alphabet_size - 1));
        letters[k] = alphabet[a];
        changed[k] = alphabet[(a + shift) % alphabet_size];  /* always a different letter */
      }
      letters[length] = changed[length] = '\0';
      spaced(letters, answer);
      spaced(changed, wrong);
      snprintf(clean, sizeof clean, "Copy:%s ->", answer);
      snprintf(corrupt, sizeof corrupt, "Copy:%s ->", wrong);
      if (encode(tok, clean, &clean_ids) || encode(tok, corrupt, &corrupt_ids) || encode(tok, answer, &answer_ids) ||
          encode(tok, wrong, &wrong_ids)) {
        snprintf(err, err_cap, "example %lld: the tokenizer failed", i);
        status = 1;
        goto done;
      }
      if (clean_ids.n == corrupt_ids.n && answer_ids.n > 0) break;
    }

    line.len = 0;
    sb_puts(&line, "{\"task\":\"" TASK_ID "\",\"clean_ids\":");
    sb_ids(&line, &clean_ids);
    sb_puts(&line, ",\"corrupt_ids\":");
    sb_ids(&line, &corrupt_ids);
    sb_puts(&line, ",\"answer_ids\":");
    sb_ids(&line, &answer_ids);
    sb_puts(&line, ",\"wrong_ids\":");
    sb_ids(&line, &wrong_ids);
    sb_puts(&line, ",\"meta\":{\"letters\":");
    sb_json_string(&line, letters);
    sb_puts(&line, ",\"corrupt_letters\":");
    sb_json_string(&line, changed);
    sb_puts(&line, "},\"clean\":");
    sb_json_string(&line, clean);
    sb_puts(&line, ",\"corrupt\":");
    sb_json_string(&line, corrupt);
    sb_puts(&line, ",\"answer\":");
    sb_json_string(&line, answer);
    sb_puts(&line, ",\"wrong\":");
    sb_json_string(&line, wrong);
    sb_puts(&line, "}");
    if (line.failed) {
      snprintf(err, err_cap, "out of memory");
      status = 1;
      goto done;
    }
    if (sink->emit(sink->ctx, line.data, line.len) != 0) break; /* the host asked us to stop */
    sink->progress(sink->ctx, (double)(i + 1) / (double)num);
  }

done:
  free(clean_ids.v);
  free(corrupt_ids.v);
  free(answer_ids.v);
  free(wrong_ids.v);
  free(line.data);
  return status;
}

/* ---- registration ------------------------------------------------------------------------------- */

static const hh_param_v1 kParams[] = {
    {"num_examples", "Number of examples to generate", HH_PARAM_INT, 16, 1, 100000, NULL, NULL},
    {"length", "Letters to copy", HH_PARAM_INT, 5, 1, kMaxLetters, NULL, NULL},
};

static const hh_task_v1 kTask = {
    TASK_ID,
    "Copy a few random letters; the corrupt prompt has other letters, so the answer changes",
    "reasoning",
    kParams,
    sizeof kParams / sizeof kParams[0],
    generate,
};

HH_PLUGIN_EXPORT int hydrahead_plugin_v1(const hh_host_v1* host) {
  if (host->abi_version != HH_PLUGIN_ABI_VERSION) {
    host->log(host->ctx, HH_LOG_ERROR, TASK_ID ": built for plugin ABI version 1");
    return 1;
  }
  return host->register_task(host->ctx, &kTask);
}
