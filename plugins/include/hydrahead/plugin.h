/* HydraHead plugin ABI, version 1.
 *
 * A plugin is a shared library that exports one C function:
 *
 *     int hydrahead_plugin_v1(const hh_host_v1* host);
 *
 * The host calls it once after dlopen(). The plugin registers what it provides through `host`
 * (calibration-task generators in version 1) and returns 0, or non-zero to refuse loading (after
 * calling host->log with the reason). Everything crossing the boundary is plain C: UTF-8 strings
 * (NUL-terminated unless a length is given), int64 token ids, and JSON text for structured values, so
 * plugins can be written in C or any C++ compiler without sharing the host's C++ ABI.
 *
 * Lifetimes: every pointer the host passes is valid only during the call. Descriptors registered by
 * the plugin (hh_task_v1 and everything it points to) must stay valid until the library is unloaded;
 * static storage is the usual choice.
 */
#ifndef HYDRAHEAD_PLUGIN_H
#define HYDRAHEAD_PLUGIN_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define HH_PLUGIN_ABI_VERSION 1u
#define HH_PLUGIN_ENTRY_V1 "hydrahead_plugin_v1"

#if defined(_WIN32)
#define HH_PLUGIN_EXPORT __declspec(dllexport)
#else
#define HH_PLUGIN_EXPORT __attribute__((visibility("default")))
#endif

/* ---- parameters ------------------------------------------------------------------------------- */

typedef enum hh_param_type {
  HH_PARAM_INT = 0,    /* int64, range [min, max] */
  HH_PARAM_FLOAT = 1,  /* double, range [min, max] */
  HH_PARAM_STRING = 2, /* one of `choices` when choices != NULL */
  HH_PARAM_BOOL = 3
} hh_param_type;

typedef struct hh_param_v1 {
  const char* name;        /* e.g. "length"; [a-z0-9_-]+ */
  const char* description; /* one line, shown by `hydrahead tasks list` */
  hh_param_type type;
  double default_number;   /* INT, FLOAT, BOOL (0/1) */
  double min, max;         /* INT, FLOAT: inclusive range */
  const char* default_string; /* STRING */
  const char* const* choices; /* STRING: NULL-terminated list, or NULL for free text */
} hh_param_v1;

/* ---- what the host gives a generator ---------------------------------------------------------- */

typedef struct hh_tokenizer_v1 {
  void* ctx;
  /* Encodes `len` bytes of UTF-8. Writes at most `cap` ids to `out` and returns the total number of
   * ids (call again with a larger buffer when the result exceeds cap). Returns -1 on error. */
  int64_t (*encode)(void* ctx, const char* text, size_t len, int64_t* out, int64_t cap);
  /* Decodes ids into at most `cap` bytes of `out` (not NUL-terminated); returns the total byte count,
   * or -1 for an id out of range. */
  int64_t (*decode)(void* ctx, const int64_t* ids, int64_t n, char* out, int64_t cap);
  int64_t vocab_size;
} hh_tokenizer_v1;

/* Receives generated examples, one JSON object per call, in the calibration-set line format:
 * {"task": id, "clean_ids": [...], "corrupt_ids": [...], "answer_ids": [...], "wrong_ids": [...],
 *  "meta": {...}}  (text fields "clean", "corrupt", "answer", "wrong" may be added for display).
 * Returns 0 to continue, non-zero to ask the generator to stop (cancelled); the generator then
 * returns 0 without emitting more (the host knows it cancelled). The host validates each example;
 * the first invalid one fails the run with a message naming the plugin file and the task. */
typedef struct hh_sink_v1 {
  void* ctx;
  int (*emit)(void* ctx, const char* example_json, size_t len);
  /* Progress in [0, 1]; may be called as often as the generator likes. */
  void (*progress)(void* ctx, double fraction);
} hh_sink_v1;

/* ---- a task generator ------------------------------------------------------------------------- */

typedef struct hh_task_v1 {
  const char* id;          /* unique across all loaded plugins, e.g. "niah-single" */
  const char* description; /* one line */
  const char* kind;        /* "retrieval" or "reasoning" (groups signals in the analysis) */
  const hh_param_v1* params;
  size_t num_params;
  /* Generates examples. `params_json` is a JSON object holding every declared parameter (defaults
   * filled in and ranges checked by the host): INT as a JSON integer, FLOAT as a number, STRING as a
   * string, BOOL as true or false. Returns 0 on success; on failure writes a message of at most
   * `err_cap` bytes (NUL-terminated) into `err` and returns non-zero. The host may call generators
   * of different tasks, or the same one, from several threads at once. */
  int (*generate)(const char* params_json, const hh_tokenizer_v1* tokenizer, uint64_t seed,
                  const hh_sink_v1* sink, char* err, size_t err_cap);
} hh_task_v1;

/* ---- the host --------------------------------------------------------------------------------- */

typedef enum hh_log_level { HH_LOG_INFO = 0, HH_LOG_WARN = 1, HH_LOG_ERROR = 2 } hh_log_level;

typedef struct hh_host_v1 {
  uint32_t abi_version; /* HH_PLUGIN_ABI_VERSION of the host */
  void* ctx;
  /* Registers a task; returns 0, or non-zero when refused (duplicate id, bad descriptor). */
  int (*register_task)(void* ctx, const hh_task_v1* task);
  void (*log)(void* ctx, hh_log_level level, const char* message);
  /* The directory holding the plugin's shared library, for data files shipped beside it. */
  const char* plugin_dir;
  /* The project's shared data directory (haystack texts and the like), or "" when unknown. */
  const char* data_dir;
} hh_host_v1;

typedef int (*hh_plugin_entry_v1)(const hh_host_v1* host);

#ifdef __cplusplus
}
#endif

#endif /* HYDRAHEAD_PLUGIN_H */
