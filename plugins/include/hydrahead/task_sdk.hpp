#pragma once
// C++17 convenience layer over the C plugin ABI (plugin.h) for authors of calibration-task plugins.
// Header-only; needs nlohmann/json and nothing of the host (no LibTorch, no hydrahead-core).
//
// A task is a class with static members:
//
//   struct MyTask {
//     static constexpr const char* id = "my-task";
//     static constexpr const char* description = "one line";
//     static constexpr const char* kind = "retrieval";          // or "reasoning"
//     static constexpr hh_param_v1 params[] = {hh::sdk::int_param("length", "...", 1024, 64, 4096)};
//     static void generate(const hh::sdk::Context& ctx);         // throws on failure
//   };
//   HH_SDK_PLUGIN_ENTRY({hh::sdk::task<MyTask>(), hh::sdk::task<OtherTask>()})
//
// task<T>() returns a static hh_task_v1 whose generate() parses and checks the parameters, wraps the
// tokenizer and the sink, calls T::generate, and turns any exception into the err buffer (prefixed
// with the task id), so no exception ever crosses the C boundary.
//
// Determinism: Rng is std::mt19937_64 (its output sequence is fixed by the C++ standard) with bounded
// draws written here, not the <random> distributions (whose output differs between standard
// libraries). The same seed therefore gives the same draws with any compiler and library.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <iterator>
#include <limits>
#include <nlohmann/json.hpp>
#include <optional>
#include <random>
#include <sstream>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "hydrahead/plugin.h"

namespace hh::sdk {

using Json = nlohmann::ordered_json;  // insertion order kept, so output bytes are reproducible

// Every failure a generator reports; the message reaches the user through the host.
class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

namespace detail {
// Shortest readable form of a parameter bound or value for messages: 1048576, 0.5.
inline std::string format_number(double v) {
  if (std::isfinite(v) && std::floor(v) == v && std::fabs(v) < 9.0e15) {
    return std::to_string(static_cast<int64_t>(v));
  }
  std::ostringstream os;
  os.precision(15);
  os << v;
  return os.str();
}

inline std::string quote_excerpt(std::string_view text) {
  constexpr size_t kMaxShown = 60;  // keep error messages one line
  std::string s(text.substr(0, kMaxShown));
  if (text.size() > kMaxShown) s += "...";
  return "\"" + s + "\"";
}
}  // namespace detail

// ---- parameter descriptors -------------------------------------------------------------------------

constexpr hh_param_v1 int_param(const char* name, const char* description, int64_t def, int64_t min, int64_t max) {
  const double d = static_cast<double>(def), lo = static_cast<double>(min), hi = static_cast<double>(max);
  return hh_param_v1{name, description, HH_PARAM_INT, d, lo, hi, nullptr, nullptr};
}
constexpr hh_param_v1 float_param(const char* name, const char* description, double def, double min, double max) {
  return hh_param_v1{name, description, HH_PARAM_FLOAT, def, min, max, nullptr, nullptr};
}
// `choices`: a NULL-terminated array with static storage, or nullptr for free text.
constexpr hh_param_v1 string_param(const char* name, const char* description, const char* def,
                                   const char* const* choices) {
  return hh_param_v1{name, description, HH_PARAM_STRING, 0.0, 0.0, 0.0, def, choices};
}
constexpr hh_param_v1 bool_param(const char* name, const char* description, bool def) {
  return hh_param_v1{name, description, HH_PARAM_BOOL, def ? 1.0 : 0.0, 0.0, 1.0, nullptr, nullptr};
}

// ---- parameter values ------------------------------------------------------------------------------

// The params JSON of one generate() call, checked against the task's descriptors. The host fills
// defaults and checks ranges already; doing it again here lets tests and other callers pass partial
// objects ("{}" means all defaults) and still get the same errors.
class Params {
 public:
  Params(std::string_view json_text, const hh_param_v1* specs, size_t num_specs) {
    Json given = Json::object();
    if (!json_text.empty()) {
      try {
        given = Json::parse(json_text.begin(), json_text.end());
      } catch (const Json::parse_error& e) {
        throw Error(std::string("parameters are not valid JSON: ") + e.what());
      }
      if (given.is_null()) given = Json::object();
      if (!given.is_object()) throw Error("parameters must be a JSON object");
    }
    for (auto it = given.begin(); it != given.end(); ++it) {
      bool known = false;
      for (size_t i = 0; i < num_specs; ++i) known = known || it.key() == specs[i].name;
      if (!known) throw Error("unknown parameter '" + it.key() + "'");
    }
    values_ = Json::object();
    for (size_t i = 0; i < num_specs; ++i) {
      const hh_param_v1& spec = specs[i];
      auto found = given.find(spec.name);
      values_[spec.name] = found == given.end() ? default_of(spec) : checked(spec, *found);
    }
  }

  int64_t integer(const std::string& name) const { return at(name).get<int64_t>(); }
  double number(const std::string& name) const { return at(name).get<double>(); }
  std::string string(const std::string& name) const { return at(name).get<std::string>(); }
  bool boolean(const std::string& name) const { return at(name).get<bool>(); }
  // Every declared parameter with its effective value, in declaration order (for example meta).
  const Json& json() const { return values_; }

 private:
  const Json& at(const std::string& name) const {
    auto it = values_.find(name);
    if (it == values_.end()) throw Error("task reads undeclared parameter '" + name + "'");
    return *it;
  }

  static Json default_of(const hh_param_v1& spec) {
    switch (spec.type) {
      case HH_PARAM_INT:
        return static_cast<int64_t>(spec.default_number);
      case HH_PARAM_FLOAT:
        return spec.default_number;
      case HH_PARAM_BOOL:
        return spec.default_number != 0.0;
      case HH_PARAM_STRING:
        return std::string(spec.default_string ? spec.default_string : "");
    }
    throw Error(std::string("parameter '") + spec.name + "' has an unknown type");
  }

  static Json checked(const hh_param_v1& spec, const Json& v) {
    const std::string name = spec.name;
    const std::string range = "[" + detail::format_number(spec.min) + ", " + detail::format_number(spec.max) + "]";
    switch (spec.type) {
      case HH_PARAM_INT: {
        if (!v.is_number()) throw Error("parameter '" + name + "' must be an integer, got " + v.dump());
        const double d = v.get<double>();
        if (v.is_number_float() && std::floor(d) != d) {
          throw Error("parameter '" + name + "' must be an integer, got " + v.dump());
        }
        if (d < spec.min || d > spec.max) {
          throw Error("parameter '" + name + "' = " + v.dump() + " is outside its range " + range);
        }
        return v.is_number_float() ? Json(static_cast<int64_t>(d)) : Json(v.get<int64_t>());
      }
      case HH_PARAM_FLOAT: {
        if (!v.is_number()) throw Error("parameter '" + name + "' must be a number, got " + v.dump());
        const double d = v.get<double>();
        if (!(d >= spec.min && d <= spec.max)) {
          throw Error("parameter '" + name + "' = " + v.dump() + " is outside its range " + range);
        }
        return d;
      }
      case HH_PARAM_BOOL:
        if (!v.is_boolean()) throw Error("parameter '" + name + "' must be true or false, got " + v.dump());
        return v;
      case HH_PARAM_STRING: {
        if (!v.is_string()) throw Error("parameter '" + name + "' must be a string, got " + v.dump());
        if (spec.choices) {
          std::string allowed;
          for (const char* const* c = spec.choices; *c; ++c) {
            if (v.get<std::string>() == *c) return v;
            allowed += std::string(allowed.empty() ? "" : ", ") + *c;
          }
          throw Error("parameter '" + name + "' = " + v.dump() + " is not one of: " + allowed);
        }
        return v;
      }
    }
    throw Error("parameter '" + name + "' has an unknown type");
  }

  Json values_;
};

// ---- tokenizer -------------------------------------------------------------------------------------

// The host's tokenizer (the model's own), through the ABI callbacks. Valid for one generate() call.
class Tokenizer {
 public:
  explicit Tokenizer(const hh_tokenizer_v1* tok) : tok_(tok) {
    if (!tok || !tok->encode || !tok->decode) throw Error("the host passed no tokenizer");
  }

  std::vector<int64_t> encode(std::string_view text) const {
    if (text.empty()) return {};
    std::vector<int64_t> out(text.size() + 8);
    for (int attempt = 0; attempt < 2; ++attempt) {
      const int64_t n = tok_->encode(tok_->ctx, text.data(), text.size(), out.data(), static_cast<int64_t>(out.size()));
      if (n < 0) throw Error("the tokenizer failed to encode " + detail::quote_excerpt(text));
      if (static_cast<size_t>(n) <= out.size()) {
        out.resize(static_cast<size_t>(n));
        return out;
      }
      out.resize(static_cast<size_t>(n));
    }
    throw Error("the tokenizer gave inconsistent lengths for " + detail::quote_excerpt(text));
  }

  // nullopt when an id is out of range for the tokenizer.
  std::optional<std::string> try_decode(const int64_t* ids, size_t n) const {
    if (n == 0) return std::string();
    std::string out(n * 8, '\0');
    for (int attempt = 0; attempt < 2; ++attempt) {
      const int64_t bytes =
          tok_->decode(tok_->ctx, ids, static_cast<int64_t>(n), out.data(), static_cast<int64_t>(out.size()));
      if (bytes < 0) return std::nullopt;
      if (static_cast<size_t>(bytes) <= out.size()) {
        out.resize(static_cast<size_t>(bytes));
        return out;
      }
      out.resize(static_cast<size_t>(bytes));
    }
    throw Error("the tokenizer gave inconsistent decode lengths");
  }

  std::string decode(const int64_t* ids, size_t n) const {
    auto text = try_decode(ids, n);
    if (!text) throw Error("the tokenizer could not decode " + std::to_string(n) + " ids");
    return *text;
  }
  std::string decode(const std::vector<int64_t>& ids) const { return decode(ids.data(), ids.size()); }

  int64_t vocab_size() const { return tok_->vocab_size; }
  const hh_tokenizer_v1* raw() const { return tok_; }

 private:
  const hh_tokenizer_v1* tok_;
};

// ---- randomness ------------------------------------------------------------------------------------

// splitmix64's finaliser: a bijective 64-bit mix.
constexpr uint64_t mix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

// Seed of example `index` of a set generated with `seed`: examples are independent of each other, so
// example i is the same whether 1 or 1000 examples are generated.
constexpr uint64_t derive_seed(uint64_t seed, uint64_t index) { return mix64(mix64(seed) ^ mix64(~index)); }

class Rng {
 public:
  explicit Rng(uint64_t seed) : engine_(seed) {}

  uint64_t next() { return engine_(); }

  // Uniform in [0, n), n > 0. Rejection sampling: draws below 2^64 mod n are discarded so every
  // residue is equally likely.
  uint64_t below(uint64_t n) {
    if (n == 0) throw Error("Rng::below(0)");
    const uint64_t threshold = (0 - n) % n;  // = 2^64 mod n
    for (;;) {
      const uint64_t x = engine_();
      if (x >= threshold) return x % n;
    }
  }

  // Uniform in [lo, hi], lo <= hi.
  int64_t between(int64_t lo, int64_t hi) {
    if (lo > hi) throw Error("Rng::between: empty range");
    const uint64_t span = static_cast<uint64_t>(hi) - static_cast<uint64_t>(lo) + 1;
    const uint64_t off = span == 0 ? engine_() : below(span);
    return static_cast<int64_t>(static_cast<uint64_t>(lo) + off);
  }

  // Uniform in [0, 1) with 53 random bits.
  double unit() { return static_cast<double>(engine_() >> 11) * (1.0 / 9007199254740992.0); }

  bool chance(double p) { return unit() < p; }

  template <class T>
  void shuffle(std::vector<T>& v) {  // Fisher-Yates
    for (size_t i = v.size(); i > 1; --i) std::swap(v[i - 1], v[static_cast<size_t>(below(i))]);
  }

  template <class T>
  const T& pick(const std::vector<T>& v) {
    if (v.empty()) throw Error("Rng::pick from an empty list");
    return v[static_cast<size_t>(below(v.size()))];
  }
  template <class T, size_t N>
  const T& pick(const T (&arr)[N]) {
    return arr[static_cast<size_t>(below(N))];
  }

  // `count` decimal digits, the first one non-zero.
  std::string digits(size_t count) {
    std::string s;
    for (size_t i = 0; i < count; ++i) s += static_cast<char>('0' + (i == 0 ? 1 + below(9) : below(10)));
    return s;
  }

 private:
  std::mt19937_64 engine_;
};

// ---- output ----------------------------------------------------------------------------------------

// One calibration example (DESIGN.md section 5); texts are optional and only for display.
struct Example {
  std::string task;
  std::vector<int64_t> clean_ids, corrupt_ids, answer_ids, wrong_ids;
  Json meta = Json::object();
  std::string clean, corrupt, answer, wrong;

  Json to_json() const {
    Json j = Json::object();
    j["task"] = task;
    j["clean_ids"] = clean_ids;
    j["corrupt_ids"] = corrupt_ids;
    j["answer_ids"] = answer_ids;
    j["wrong_ids"] = wrong_ids;
    j["meta"] = meta;
    if (!clean.empty()) j["clean"] = clean;
    if (!corrupt.empty()) j["corrupt"] = corrupt;
    if (!answer.empty()) j["answer"] = answer;
    if (!wrong.empty()) j["wrong"] = wrong;
    return j;
  }
  // One line; bytes that are not valid UTF-8 (a text cut inside a character) become U+FFFD.
  std::string dump() const { return to_json().dump(-1, ' ', false, Json::error_handler_t::replace); }
};

class Sink {
 public:
  explicit Sink(const hh_sink_v1* sink) : sink_(sink) {
    if (!sink || !sink->emit) throw Error("the host passed no sink");
  }
  // false when the host asks the generator to stop.
  bool emit(const Example& ex) const {
    const std::string line = ex.dump();
    return sink_->emit(sink_->ctx, line.data(), line.size()) == 0;
  }
  void progress(double fraction) const {
    if (sink_->progress) sink_->progress(sink_->ctx, fraction);
  }

 private:
  const hh_sink_v1* sink_;
};

// Everything a task's generate() receives.
struct Context {
  const char* task_id;
  const Params& params;
  const Tokenizer& tokenizer;
  uint64_t seed;
  const Sink& sink;
};

// Calls make(index, rng) for index 0..count-1, each with its own Rng seeded by derive_seed(seed, index),
// emits the results in order, reports progress, and stops early when the host cancels.
// Returns the number of examples emitted.
template <class Make>
int64_t generate_examples(const Context& ctx, int64_t count, Make&& make) {
  for (int64_t i = 0; i < count; ++i) {
    Rng rng(derive_seed(ctx.seed, static_cast<uint64_t>(i)));
    Example ex = make(i, rng);
    if (ex.task.empty()) ex.task = ctx.task_id;
    if (!ctx.sink.emit(ex)) return i + 1;
    ctx.sink.progress(static_cast<double>(i + 1) / static_cast<double>(count));
  }
  return count;
}

// ---- the ABI boundary ------------------------------------------------------------------------------

namespace detail {
// Copies `msg` into err (NUL-terminated, cut at a UTF-8 character boundary when it does not fit).
inline void write_error(char* err, size_t cap, const std::string& msg) noexcept {
  if (!err || cap == 0) return;
  size_t n = msg.size() < cap - 1 ? msg.size() : cap - 1;
  if (n < msg.size()) {
    while (n > 0 && (static_cast<unsigned char>(msg[n]) & 0xC0) == 0x80) --n;
  }
  std::memcpy(err, msg.data(), n);
  err[n] = '\0';
}

template <class Fn>
int guarded(const char* what, char* err, size_t cap, Fn&& fn) noexcept {
  try {
    fn();
    return 0;
  } catch (const std::exception& e) {
    try {
      write_error(err, cap, std::string(what) + ": " + e.what());
    } catch (...) {
      write_error(err, cap, "out of memory");
    }
  } catch (...) {
    write_error(err, cap, std::string(what) + ": unknown error");
  }
  return 1;
}

template <class Task>
struct TaskBinding {
  static int generate(const char* params_json, const hh_tokenizer_v1* tokenizer, uint64_t seed, const hh_sink_v1* sink,
                      char* err, size_t err_cap) noexcept {
    return guarded(Task::id, err, err_cap, [&] {
      const Params params(params_json ? std::string_view(params_json) : std::string_view(), std::data(Task::params),
                          std::size(Task::params));
      const Tokenizer tok(tokenizer);
      const Sink out(sink);
      const Context ctx{Task::id, params, tok, seed, out};
      Task::generate(ctx);
    });
  }
  static inline const hh_task_v1 descriptor{
      Task::id, Task::description, Task::kind, std::data(Task::params), std::size(Task::params), &generate};
};
}  // namespace detail

// The static descriptor of Task, valid for the lifetime of the library.
template <class Task>
const hh_task_v1* task() {
  return &detail::TaskBinding<Task>::descriptor;
}

inline void log(const hh_host_v1* host, hh_log_level level, const std::string& message) noexcept {
  if (host && host->log) host->log(host->ctx, level, message.c_str());
}

// Registers every task with the host. A task the host refuses (duplicate id, bad descriptor) is
// logged and skipped; loading is refused only when nothing could be registered.
inline int register_tasks(const hh_host_v1* host, const std::vector<const hh_task_v1*>& tasks) noexcept {
  if (!host || !host->register_task) return 1;
  if (host->abi_version < 1) {
    log(host, HH_LOG_ERROR, "plugin needs plugin ABI version 1 or later");
    return 1;
  }
  size_t registered = 0;
  for (const hh_task_v1* t : tasks) {
    if (host->register_task(host->ctx, t) == 0) {
      ++registered;
    } else {
      try {
        log(host, HH_LOG_WARN, std::string("task '") + t->id + "' was refused by the host");
      } catch (...) {
      }
    }
  }
  return registered > 0 || tasks.empty() ? 0 : 1;
}

namespace detail {
template <class ListTasks>
int plugin_entry(const hh_host_v1* host, ListTasks&& list) noexcept {
  try {
    return register_tasks(host, list());
  } catch (const std::exception& e) {
    try {
      log(host, HH_LOG_ERROR, std::string("plugin failed to load: ") + e.what());
    } catch (...) {
    }
    return 1;
  } catch (...) {
    return 1;
  }
}
}  // namespace detail

}  // namespace hh::sdk

// Defines the plugin's exported entry point. The argument is a list of task descriptors, either a
// braced list of hh::sdk::task<T>() or an expression returning std::vector<const hh_task_v1*>.
#define HH_SDK_PLUGIN_ENTRY(...)                                                                                  \
  extern "C" HH_PLUGIN_EXPORT int hydrahead_plugin_v1(const hh_host_v1* host) {                                   \
    return ::hh::sdk::detail::plugin_entry(host, []() -> std::vector<const hh_task_v1*> { return __VA_ARGS__; }); \
  }
