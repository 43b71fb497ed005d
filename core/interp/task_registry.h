#pragma once
// Calibration-task plugins (plugins/include/hydrahead/plugin.h, ABI version 1): finds and loads the
// shared libraries, keeps what they register, resolves a task's parameters and runs its generator
// with the model's tokenizer, validating every example it emits (core/interp/calibration.h).
//
// Search path, in load order (the first library to register an id keeps it):
//   1. the build's or installation's plugin folder, <dir of the running executable>/../lib/hydrahead/plugins
//   2. the user's folder, $XDG_DATA_HOME/hydrahead/plugins (default ~/.local/share/hydrahead/plugins)
//   3. every directory in $HYDRAHEAD_PLUGIN_PATH (colon-separated)
// A library that cannot be opened, lacks `hydrahead_plugin_v1` (wrong ABI version or not a plugin),
// whose entry fails, or that registers a malformed task or an id already taken is refused as a
// whole: nothing it registered stays, a diagnostic naming the file is recorded and logged, and
// loading goes on with the next library.
//
// Libraries stay loaded (RTLD_NOW | RTLD_LOCAL) for the registry's lifetime, since the registered
// descriptors live in them. Loading is not thread-safe; once loaded, tasks(), find(),
// resolve_params() and generate() may be called from several threads.
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/interp/calibration.h"
#include "core/util/error.h"

namespace hh::model {
class Tokenizer;
}

namespace hh::interp {

enum class ParamType { Int, Float, String, Bool };
const char* param_type_name(ParamType t);  // "int", "float", "string", "bool"

struct TaskParam {
  std::string name;
  std::string description;
  ParamType type = ParamType::Int;
  nlohmann::json default_value;       // int64, double, string or bool, by type
  double min = 0, max = 0;            // Int, Float: inclusive range
  std::vector<std::string> choices;   // String: allowed values; empty means free text
};

struct TaskInfo {
  std::string id;
  std::string description;
  std::string kind;                   // "retrieval" or "reasoning"
  std::vector<TaskParam> params;
  std::filesystem::path library;      // the shared library that registered it
  const TaskParam* param(const std::string& name) const;  // nullptr when not declared
};

// Progress of a generator: fraction in [0, 1] and the number of examples received so far.
using GenerateProgressFn = std::function<void(double fraction, std::size_t examples)>;
// Polled after every example; returning true stops the generator.
using CancelFn = std::function<bool()>;

// Thrown by generate() when CancelFn asked it to stop.
class Cancelled : public Error {
 public:
  using Error::Error;
};

// Converts command-line text ("42", "0.5", "true", "niah") to the JSON value of the parameter's type;
// throws hh::Error naming the parameter when the text does not parse.
nlohmann::json parse_param_text(const TaskParam& param, const std::string& text);

class TaskRegistry {
 public:
  TaskRegistry();
  ~TaskRegistry();  // unloads the libraries
  TaskRegistry(const TaskRegistry&) = delete;
  TaskRegistry& operator=(const TaskRegistry&) = delete;

  // The three places above, in order; directories that do not exist are included.
  static std::vector<std::filesystem::path> default_search_path();
  // load_dir() on each existing directory of default_search_path().
  void load_default();
  // Loads every `*.so` in `dir` (not recursive), in file-name order. A missing directory is a
  // diagnostic, not an error.
  void load_dir(const std::filesystem::path& dir);
  // Loads one library; returns false when it was refused (see diagnostics()). A library already
  // loaded (same canonical path) is skipped and counts as loaded.
  bool load_library(const std::filesystem::path& file);

  // Overrides the data directory handed to plugins (host->data_dir). By default: $HYDRAHEAD_DATA_DIR,
  // else <dir of the running executable>/../share/hydrahead when it exists, else "".
  void set_data_dir(const std::filesystem::path& dir);

  const std::vector<TaskInfo>& tasks() const;   // in load order
  const TaskInfo* find(const std::string& id) const;
  // One line per refused library or unreadable directory, each naming the path.
  std::vector<std::string> diagnostics() const;

  // Every declared parameter of task `id`: the values of `partial` (a JSON object or null) with
  // defaults for the rest, types and ranges checked. An unknown task or parameter is an hh::Error
  // that names it and lists the valid ones.
  nlohmann::json resolve_params(const std::string& id, const nlohmann::json& partial) const;

  // Runs the generator of task `id` with resolve_params(id, partial). Each emitted example is parsed
  // and validated against `tok`'s vocabulary; an invalid one, or a failing generator, is an hh::Error
  // naming the plugin file and the task. Throws Cancelled when `cancel` returned true.
  std::vector<CalibExample> generate(const std::string& id, const nlohmann::json& partial,
                                     const model::Tokenizer& tok, uint64_t seed, const GenerateProgressFn& progress = {},
                                     const CancelFn& cancel = {}) const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace hh::interp
