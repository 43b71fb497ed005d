#include "core/interp/task_registry.h"

#include <dlfcn.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <set>
#include <string_view>
#include <system_error>

#include "core/model/tokenizer.h"
#include "core/util/log.h"
#include "hydrahead/version.h"
#include "plugins/include/hydrahead/plugin.h"

namespace hh::interp {
namespace fs = std::filesystem;
using nlohmann::json;

namespace {

constexpr std::size_t kMaxIdChars = 64;          // task and parameter names
constexpr std::size_t kMaxParams = 64;           // per task; more means a garbled descriptor
constexpr std::size_t kMaxChoices = 1024;        // per string parameter
constexpr std::size_t kGeneratorErrorCap = 2048; // bytes the generator may write as its error message
// Entry points of other ABI versions probed to explain a refusal ("exports hydrahead_plugin_v2").
constexpr int kMaxProbedAbiVersion = 9;
// int64 limits as doubles: parameters of type INT carry their range and default as double.
constexpr double kInt64Lo = -9223372036854775808.0;
constexpr double kInt64Hi = 9223372036854775808.0;  // exclusive

std::string join(const std::vector<std::string>& items, const char* sep = ", ") {
  std::string s;
  for (std::size_t i = 0; i < items.size(); ++i) {
    if (i) s += sep;
    s += items[i];
  }
  return s;
}

bool valid_name(const char* s) {
  if (!s || !*s) return false;
  std::size_t n = 0;
  for (const char* p = s; *p; ++p, ++n) {
    const char c = *p;
    if (!((c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '_' || c == '-')) return false;
    if (n >= kMaxIdChars) return false;
  }
  return true;
}

// The name as it may appear in a message: a bad descriptor can point anywhere, so print at most a bit.
std::string shown(const char* s) {
  if (!s) return "(null)";
  std::string out;
  for (const char* p = s; *p && out.size() < kMaxIdChars; ++p)
    out += (static_cast<unsigned char>(*p) >= 0x20 && *p != 0x7f) ? *p : '?';
  return "'" + out + "'";
}

bool is_integral(double v) { return std::isfinite(v) && std::floor(v) == v && v >= kInt64Lo && v < kInt64Hi; }

std::string format_number(ParamType type, double v) {
  if (type == ParamType::Int && is_integral(v)) return std::to_string(static_cast<int64_t>(v));
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.17g", v);
  // Prefer the shortest form that reads back to the same double.
  for (int prec = 1; prec <= 17; ++prec) {
    char shorter[64];
    std::snprintf(shorter, sizeof shorter, "%.*g", prec, v);
    if (std::strtod(shorter, nullptr) == v) return shorter;
  }
  return buf;
}

std::string range_text(const TaskParam& p) {
  return "[" + format_number(p.type, p.min) + ", " + format_number(p.type, p.max) + "]";
}

// Turns a registered descriptor into a TaskInfo; throws std::runtime_error naming what is malformed.
TaskInfo describe(const hh_task_v1* t) {
  using std::runtime_error;
  if (!t) throw runtime_error("register_task was given a NULL task");
  if (!valid_name(t->id))
    throw runtime_error("task id " + shown(t->id) + " is not a name of 1-64 characters [a-z0-9_-]");
  TaskInfo info;
  info.id = t->id;
  const std::string what = "task '" + info.id + "'";
  if (!t->description) throw runtime_error(what + ": description is NULL");
  if (!t->kind) throw runtime_error(what + ": kind is NULL");
  info.description = t->description;
  info.kind = t->kind;
  if (info.kind != "retrieval" && info.kind != "reasoning")
    throw runtime_error(what + ": kind " + shown(t->kind) + " is neither 'retrieval' nor 'reasoning'");
  if (!t->generate) throw runtime_error(what + ": generate is NULL");
  if (t->num_params > kMaxParams)
    throw runtime_error(what + ": " + std::to_string(t->num_params) + " parameters (at most " +
                        std::to_string(kMaxParams) + ")");
  if (t->num_params > 0 && !t->params) throw runtime_error(what + ": params is NULL with num_params > 0");

  std::set<std::string> seen;
  for (std::size_t i = 0; i < t->num_params; ++i) {
    const hh_param_v1& d = t->params[i];
    if (!valid_name(d.name))
      throw runtime_error(what + ": parameter " + std::to_string(i) + " name " + shown(d.name) +
                          " is not a name of 1-64 characters [a-z0-9_-]");
    TaskParam p;
    p.name = d.name;
    const std::string pw = what + ": parameter '" + p.name + "'";
    if (!seen.insert(p.name).second) throw runtime_error(pw + " is declared twice");
    p.description = d.description ? d.description : "";
    switch (static_cast<int>(d.type)) {
      case HH_PARAM_INT:
      case HH_PARAM_FLOAT: {
        const bool is_int = static_cast<int>(d.type) == HH_PARAM_INT;
        p.type = is_int ? ParamType::Int : ParamType::Float;
        p.min = d.min;
        p.max = d.max;
        if (std::isnan(d.min) || std::isnan(d.max) || d.min > d.max)
          throw runtime_error(pw + ": range [" + format_number(p.type, d.min) + ", " + format_number(p.type, d.max) +
                              "] is empty");
        if (is_int && (!is_integral(d.min) || !is_integral(d.max)))
          throw runtime_error(pw + ": range " + range_text(p) + " does not hold int64 bounds");
        if (!std::isfinite(d.default_number) || (is_int && !is_integral(d.default_number)))
          throw runtime_error(pw + ": default " + format_number(p.type, d.default_number) + " is not " +
                              (is_int ? "an integer" : "a finite number"));
        if (d.default_number < d.min || d.default_number > d.max)
          throw runtime_error(pw + ": default " + format_number(p.type, d.default_number) + " is outside " +
                              range_text(p));
        p.default_value = is_int ? json(static_cast<int64_t>(d.default_number)) : json(d.default_number);
        break;
      }
      case HH_PARAM_STRING: {
        p.type = ParamType::String;
        if (d.choices) {
          for (std::size_t c = 0; d.choices[c]; ++c) {
            if (c >= kMaxChoices)
              throw runtime_error(pw + ": more than " + std::to_string(kMaxChoices) + " choices (missing NULL end?)");
            p.choices.emplace_back(d.choices[c]);
          }
          if (p.choices.empty()) throw runtime_error(pw + ": choices is an empty list");
        }
        const std::string def = d.default_string ? d.default_string : "";
        if (!p.choices.empty() && std::find(p.choices.begin(), p.choices.end(), def) == p.choices.end())
          throw runtime_error(pw + ": default '" + def + "' is not one of its choices (" + join(p.choices) + ")");
        p.default_value = def;
        break;
      }
      case HH_PARAM_BOOL:
        p.type = ParamType::Bool;
        if (d.default_number != 0 && d.default_number != 1)
          throw runtime_error(pw + ": bool default must be 0 or 1, got " +
                              format_number(ParamType::Float, d.default_number));
        p.default_value = d.default_number != 0;
        break;
      default:
        throw runtime_error(pw + ": unknown type " + std::to_string(static_cast<int>(d.type)));
    }
    info.params.push_back(std::move(p));
  }
  return info;
}

fs::path executable_dir() {
  std::error_code ec;
  const fs::path exe = fs::read_symlink("/proc/self/exe", ec);
  return ec ? fs::path() : exe.parent_path();
}

std::string default_data_dir() {
  if (const char* env = std::getenv("HYDRAHEAD_DATA_DIR"); env && *env) return env;
  const fs::path exe_dir = executable_dir();
  if (exe_dir.empty()) return "";
  const fs::path share = (exe_dir / ".." / "share" / "hydrahead").lexically_normal();
  std::error_code ec;
  return fs::is_directory(share, ec) ? share.string() : "";
}

// ---- the host side of the ABI: registration ----------------------------------------------------

struct LoadContext {
  const std::vector<TaskInfo>* loaded;   // tasks of libraries accepted before this one
  std::string file;
  std::vector<TaskInfo> tasks;
  std::vector<const hh_task_v1*> descs;
  std::vector<std::string> problems;     // malformed or duplicate registrations
  std::vector<std::string> errors;       // what the plugin logged at HH_LOG_ERROR
};

int host_register_task(void* ctx, const hh_task_v1* task) {
  auto* lc = static_cast<LoadContext*>(ctx);
  try {
    TaskInfo info = describe(task);
    for (const auto& t : *lc->loaded)
      if (t.id == info.id) {
        lc->problems.push_back("task id '" + info.id + "' is already registered by " + t.library.string());
        return 1;
      }
    for (const auto& t : lc->tasks)
      if (t.id == info.id) {
        lc->problems.push_back("task id '" + info.id + "' is registered twice");
        return 1;
      }
    info.library = lc->file;
    lc->tasks.push_back(std::move(info));
    lc->descs.push_back(task);
    return 0;
  } catch (const std::exception& e) {
    lc->problems.emplace_back(e.what());
    return 1;
  }
}

void host_log(void* ctx, hh_log_level level, const char* message) {
  auto* lc = static_cast<LoadContext*>(ctx);
  try {
    const std::string msg = message ? message : "";
    switch (level) {
      case HH_LOG_INFO: hh::log::debug(lc->file + ": " + msg); break;
      case HH_LOG_WARN: hh::log::warn(lc->file + ": " + msg); break;
      default: lc->errors.push_back(msg); break;
    }
  } catch (...) {
    // Logging must never unwind into the plugin's C frames.
  }
}

// ---- the host side of the ABI: generation -----------------------------------------------------

int64_t tokenizer_encode(void* ctx, const char* text, size_t len, int64_t* out, int64_t cap) {
  try {
    if (!text && len > 0) return -1;
    const auto* tok = static_cast<const model::Tokenizer*>(ctx);
    const auto ids = tok->encode(std::string_view(text ? text : "", len));
    const auto n = static_cast<int64_t>(ids.size());
    if (out && cap > 0) std::copy_n(ids.begin(), std::min(n, cap), out);
    return n;
  } catch (...) {
    return -1;
  }
}

int64_t tokenizer_decode(void* ctx, const int64_t* ids, int64_t n, char* out, int64_t cap) {
  try {
    if (n < 0 || (!ids && n > 0)) return -1;
    const auto* tok = static_cast<const model::Tokenizer*>(ctx);
    const std::string text = tok->decode(std::vector<int64_t>(ids, ids + n));
    const auto bytes = static_cast<int64_t>(text.size());
    if (out && cap > 0) std::memcpy(out, text.data(), static_cast<std::size_t>(std::min(bytes, cap)));
    return bytes;
  } catch (...) {
    return -1;
  }
}

struct GenContext {
  std::string file;
  std::string task;
  const model::Tokenizer* tok = nullptr;
  int64_t vocab_size = -1;
  const GenerateProgressFn* progress = nullptr;
  const CancelFn* cancel = nullptr;
  std::vector<CalibExample> out;
  std::string error;     // the first invalid example or callback failure
  bool cancelled = false;
};

int sink_emit(void* ctx, const char* text, size_t len) {
  auto* g = static_cast<GenContext*>(ctx);
  if (!g->error.empty() || g->cancelled) return 1;
  try {
    const std::string where =
        g->file + ": task '" + g->task + "', example " + std::to_string(g->out.size() + 1);
    if (!text) {
      g->error = where + ": emitted NULL";
      return 1;
    }
    json obj;
    try {
      obj = json::parse(text, text + len);
    } catch (const json::parse_error& e) {
      std::string what = e.what();
      if (auto close = what.find("] "); !what.empty() && what[0] == '[' && close != std::string::npos)
        what = what.substr(close + 2);
      g->error = where + ": not valid JSON: " + what;
      return 1;
    }
    CalibExample ex = parse_calibration_example(obj, where, g->tok, g->vocab_size);
    if (ex.task != g->task) {
      g->error = where + ": field 'task' is '" + ex.task + "', expected '" + g->task + "'";
      return 1;
    }
    g->out.push_back(std::move(ex));
    if (g->cancel && *g->cancel && (*g->cancel)()) {
      g->cancelled = true;
      return 1;
    }
    return 0;
  } catch (const std::exception& e) {
    g->error = e.what();
    return 1;
  } catch (...) {
    g->error = g->file + ": task '" + g->task + "': unknown failure while receiving an example";
    return 1;
  }
}

void sink_progress(void* ctx, double fraction) {
  auto* g = static_cast<GenContext*>(ctx);
  if (!g->progress || !*g->progress || std::isnan(fraction)) return;
  try {
    (*g->progress)(std::clamp(fraction, 0.0, 1.0), g->out.size());
  } catch (...) {
    // A failing progress display must not abort generation or unwind through the plugin.
  }
}

json check_value(const TaskInfo& task, const TaskParam& p, const json& v) {
  const std::string what = "task '" + task.id + "': parameter '" + p.name + "'";
  auto out_of_range = [&](const std::string& shown_value) {
    return Error(what + " = " + shown_value + " is out of range " + range_text(p));
  };
  switch (p.type) {
    case ParamType::Int: {
      int64_t x = 0;
      if (v.is_number_unsigned()) {
        const auto u = v.get<uint64_t>();
        if (u > static_cast<uint64_t>(INT64_MAX)) throw out_of_range(std::to_string(u));
        x = static_cast<int64_t>(u);
      } else if (v.is_number_integer()) {
        x = v.get<int64_t>();
      } else if (v.is_number_float() && is_integral(v.get<double>())) {
        x = static_cast<int64_t>(v.get<double>());
      } else {
        throw Error(what + " must be an integer, got " + v.dump(-1, ' ', false, json::error_handler_t::replace));
      }
      if (static_cast<double>(x) < p.min || static_cast<double>(x) > p.max) throw out_of_range(std::to_string(x));
      return x;
    }
    case ParamType::Float: {
      if (!v.is_number())
        throw Error(what + " must be a number, got " + v.dump(-1, ' ', false, json::error_handler_t::replace));
      const double x = v.get<double>();
      if (x < p.min || x > p.max) throw out_of_range(format_number(p.type, x));
      return x;
    }
    case ParamType::String: {
      if (!v.is_string())
        throw Error(what + " must be a string, got " + v.dump(-1, ' ', false, json::error_handler_t::replace));
      const auto s = v.get<std::string>();
      if (!p.choices.empty() && std::find(p.choices.begin(), p.choices.end(), s) == p.choices.end())
        throw Error(what + " = '" + s + "' is not one of " + join(p.choices));
      return s;
    }
    case ParamType::Bool:
      if (!v.is_boolean())
        throw Error(what + " must be true or false, got " + v.dump(-1, ' ', false, json::error_handler_t::replace));
      return v.get<bool>();
  }
  return v;
}

}  // namespace

const char* param_type_name(ParamType t) {
  switch (t) {
    case ParamType::Int: return "int";
    case ParamType::Float: return "float";
    case ParamType::String: return "string";
    case ParamType::Bool: return "bool";
  }
  return "?";
}

const TaskParam* TaskInfo::param(const std::string& name) const {
  for (const auto& p : params)
    if (p.name == name) return &p;
  return nullptr;
}

json parse_param_text(const TaskParam& p, const std::string& text) {
  const std::string what = "parameter '" + p.name + "'";
  switch (p.type) {
    case ParamType::Int: {
      errno = 0;
      char* end = nullptr;
      const long long v = std::strtoll(text.c_str(), &end, 10);
      if (text.empty() || *end != '\0' || errno == ERANGE || std::isspace(static_cast<unsigned char>(text[0])))
        throw Error(what + ": '" + text + "' is not an integer");
      return static_cast<int64_t>(v);
    }
    case ParamType::Float: {
      char* end = nullptr;
      const double v = std::strtod(text.c_str(), &end);
      if (text.empty() || *end != '\0' || !std::isfinite(v) || std::isspace(static_cast<unsigned char>(text[0])))
        throw Error(what + ": '" + text + "' is not a number");
      return v;
    }
    case ParamType::Bool:
      if (text == "true" || text == "1" || text == "yes") return true;
      if (text == "false" || text == "0" || text == "no") return false;
      throw Error(what + ": '" + text + "' is not a boolean (true/false, 1/0, yes/no)");
    case ParamType::String:
      return text;
  }
  return text;
}

// ---- the registry ------------------------------------------------------------------------------

namespace {

struct Library {
  std::string file;     // as given, for messages
  fs::path canonical;   // for recognising a library loaded twice
  void* handle = nullptr;
  Library() = default;
  Library(const Library&) = delete;
  Library& operator=(const Library&) = delete;
  ~Library() {
    if (handle) dlclose(handle);
  }
};

}  // namespace

struct TaskRegistry::Impl {
  // Declared first so they are destroyed last: the descriptors below point into these libraries.
  std::vector<std::unique_ptr<Library>> libs;
  std::vector<TaskInfo> tasks;
  std::vector<const hh_task_v1*> descs;  // parallel to tasks
  std::vector<std::string> diagnostics;
  std::vector<std::string> searched;     // directories scanned, for "no plugins" messages
  std::string data_dir = default_data_dir();

  ~Impl() {
    descs.clear();
    tasks.clear();
    while (!libs.empty()) libs.pop_back();  // unload in reverse load order
  }

  void diagnose(const std::string& line) {
    diagnostics.push_back(line);
    hh::log::warn(line);
  }
  void refuse(const std::string& file, const std::string& why) { diagnose(file + ": refused: " + why); }

  [[noreturn]] void unknown_task(const std::string& id) const {
    if (tasks.empty()) {
      std::string where = searched.empty() ? "no plugin directory was searched" : "searched " + join(searched);
      throw Error("unknown task '" + id + "': no task plugins are loaded (" + where + ")");
    }
    std::vector<std::string> ids;
    for (const auto& t : tasks) ids.push_back(t.id);
    throw Error("unknown task '" + id + "'; available: " + join(ids));
  }
};

TaskRegistry::TaskRegistry() : impl_(std::make_unique<Impl>()) {}
TaskRegistry::~TaskRegistry() = default;

std::vector<fs::path> TaskRegistry::default_search_path() {
  std::vector<fs::path> dirs;
  if (const fs::path exe_dir = executable_dir(); !exe_dir.empty())
    dirs.push_back((exe_dir / ".." / "lib" / "hydrahead" / "plugins").lexically_normal());
  const char* xdg = std::getenv("XDG_DATA_HOME");
  const char* home = std::getenv("HOME");
  // The XDG base-directory spec ignores relative values.
  if (xdg && *xdg && fs::path(xdg).is_absolute())
    dirs.push_back(fs::path(xdg) / "hydrahead" / "plugins");
  else if (home && *home)
    dirs.push_back(fs::path(home) / ".local" / "share" / "hydrahead" / "plugins");
  if (const char* env = std::getenv("HYDRAHEAD_PLUGIN_PATH")) {
    std::string_view rest(env);
    while (!rest.empty()) {
      const auto colon = rest.find(':');
      const std::string_view item = rest.substr(0, colon);
      if (!item.empty()) dirs.emplace_back(std::string(item));
      if (colon == std::string_view::npos) break;
      rest.remove_prefix(colon + 1);
    }
  }
  return dirs;
}

void TaskRegistry::load_default() {
  for (const auto& dir : default_search_path()) {
    std::error_code ec;
    if (fs::is_directory(dir, ec))
      load_dir(dir);
    else
      impl_->searched.push_back(dir.string());
  }
}

void TaskRegistry::load_dir(const fs::path& dir) {
  impl_->searched.push_back(dir.string());
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) {
    impl_->diagnose(dir.string() + ": plugin directory does not exist or is not a directory");
    return;
  }
  std::vector<fs::path> files;
  fs::directory_iterator it(dir, ec);
  for (; !ec && it != fs::directory_iterator(); it.increment(ec)) {
    std::error_code type_ec;
    if (it->path().extension() == ".so" && it->is_regular_file(type_ec)) files.push_back(it->path());
  }
  if (ec) impl_->diagnose(dir.string() + ": cannot read plugin directory: " + ec.message());
  std::sort(files.begin(), files.end(),
            [](const fs::path& a, const fs::path& b) { return a.filename().string() < b.filename().string(); });
  for (const auto& f : files) load_library(f);
}

bool TaskRegistry::load_library(const fs::path& file) {
  Impl& im = *impl_;
  const std::string name = file.string();
  std::error_code ec;
  fs::path canonical = fs::weakly_canonical(fs::absolute(file, ec), ec);
  if (ec) canonical = fs::absolute(file);
  for (const auto& lib : im.libs)
    if (lib->canonical == canonical) return true;

  auto lib = std::make_unique<Library>();
  lib->file = name;
  lib->canonical = canonical;
  dlerror();
  // An absolute path, so that dlopen never searches the system library path for a bare name.
  lib->handle = dlopen(canonical.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (!lib->handle) {
    const char* why = dlerror();
    im.refuse(name, std::string("cannot load: ") + (why ? why : "unknown dlopen error"));
    return false;
  }

  void* sym = dlsym(lib->handle, HH_PLUGIN_ENTRY_V1);
  if (!sym) {
    std::vector<std::string> others;
    for (int v = 0; v <= kMaxProbedAbiVersion; ++v) {
      if (v == static_cast<int>(HH_PLUGIN_ABI_VERSION)) continue;
      const std::string entry = "hydrahead_plugin_v" + std::to_string(v);
      if (dlsym(lib->handle, entry.c_str())) others.push_back(entry);
    }
    if (!others.empty())
      im.refuse(name, "exports " + join(others) + " but this host speaks plugin ABI version " +
                          std::to_string(HH_PLUGIN_ABI_VERSION) + " (" + HH_PLUGIN_ENTRY_V1 + ")");
    else
      im.refuse(name, std::string("no entry point ") + HH_PLUGIN_ENTRY_V1 + " (not a HydraHead plugin)");
    return false;
  }
  hh_plugin_entry_v1 entry = nullptr;
  static_assert(sizeof(entry) == sizeof(sym), "function and object pointers differ in size");
  std::memcpy(&entry, &sym, sizeof(entry));

  LoadContext lc;
  lc.loaded = &im.tasks;
  lc.file = name;
  const std::string plugin_dir = canonical.parent_path().string();
  hh_host_v1 host{};
  host.abi_version = HH_PLUGIN_ABI_VERSION;
  host.ctx = &lc;
  host.register_task = &host_register_task;
  host.log = &host_log;
  host.plugin_dir = plugin_dir.c_str();
  host.data_dir = im.data_dir.c_str();

  int rc = 0;
  try {
    rc = entry(&host);
  } catch (...) {
    im.refuse(name, std::string(HH_PLUGIN_ENTRY_V1) + " threw an exception");
    return false;
  }
  if (rc != 0) {
    // What the plugin logged and what the host refused both explain a failing entry.
    std::vector<std::string> reasons = lc.errors;
    reasons.insert(reasons.end(), lc.problems.begin(), lc.problems.end());
    std::string why = std::string(HH_PLUGIN_ENTRY_V1) + " returned " + std::to_string(rc);
    if (!reasons.empty()) why += ": " + join(reasons, "; ");
    im.refuse(name, why);
    return false;
  }
  if (!lc.problems.empty()) {
    im.refuse(name, join(lc.problems, "; "));
    return false;
  }
  for (const auto& e : lc.errors) hh::log::error(name + ": " + e);

  for (std::size_t i = 0; i < lc.tasks.size(); ++i) {
    im.tasks.push_back(std::move(lc.tasks[i]));
    im.descs.push_back(lc.descs[i]);
  }
  im.libs.push_back(std::move(lib));
  return true;
}

void TaskRegistry::set_data_dir(const fs::path& dir) { impl_->data_dir = dir.string(); }

const std::vector<TaskInfo>& TaskRegistry::tasks() const { return impl_->tasks; }

const TaskInfo* TaskRegistry::find(const std::string& id) const {
  for (const auto& t : impl_->tasks)
    if (t.id == id) return &t;
  return nullptr;
}

std::vector<std::string> TaskRegistry::diagnostics() const { return impl_->diagnostics; }

json TaskRegistry::resolve_params(const std::string& id, const json& partial) const {
  const TaskInfo* task = find(id);
  if (!task) impl_->unknown_task(id);
  if (!partial.is_null() && !partial.is_object())
    throw Error("task '" + id + "': parameters must be a JSON object, got " + partial.type_name());
  if (partial.is_object()) {
    for (const auto& [key, value] : partial.items()) {
      if (task->param(key)) continue;
      std::vector<std::string> names;
      for (const auto& p : task->params) names.push_back(p.name);
      if (names.empty()) throw Error("task '" + id + "' has no parameter '" + key + "'; it takes no parameters");
      throw Error("task '" + id + "' has no parameter '" + key + "'; valid: " + join(names));
    }
  }
  json out = json::object();
  for (const auto& p : task->params) {
    const json* given = nullptr;
    if (partial.is_object())
      if (auto it = partial.find(p.name); it != partial.end() && !it->is_null()) given = &*it;
    out[p.name] = given ? check_value(*task, p, *given) : p.default_value;
  }
  return out;
}

std::vector<CalibExample> TaskRegistry::generate(const std::string& id, const json& partial,
                                                 const model::Tokenizer& tok, uint64_t seed,
                                                 const GenerateProgressFn& progress, const CancelFn& cancel) const {
  const TaskInfo* task = find(id);
  if (!task) impl_->unknown_task(id);
  const auto index = static_cast<std::size_t>(task - impl_->tasks.data());
  const hh_task_v1* desc = impl_->descs[index];
  const std::string params = resolve_params(id, partial).dump();
  const std::string file = task->library.string();

  if (cancel && cancel()) throw Cancelled("task '" + id + "': generation cancelled before it started");

  hh_tokenizer_v1 adapter{};
  adapter.ctx = const_cast<model::Tokenizer*>(&tok);  // the callbacks only read it
  adapter.encode = &tokenizer_encode;
  adapter.decode = &tokenizer_decode;
  adapter.vocab_size = tok.vocab_size();

  GenContext g;
  g.file = file;
  g.task = id;
  g.tok = &tok;
  g.vocab_size = tok.vocab_size();
  g.progress = &progress;
  g.cancel = &cancel;
  hh_sink_v1 sink{};
  sink.ctx = &g;
  sink.emit = &sink_emit;
  sink.progress = &sink_progress;

  std::vector<char> err(kGeneratorErrorCap, '\0');
  int rc = 0;
  try {
    rc = desc->generate(params.c_str(), &adapter, seed, &sink, err.data(), err.size());
  } catch (...) {
    if (g.error.empty()) g.error = file + ": task '" + id + "': the generator threw an exception";
  }
  err.back() = '\0';
  if (!g.error.empty()) throw Error(g.error);
  if (g.cancelled)
    throw Cancelled("task '" + id + "': generation cancelled after " + std::to_string(g.out.size()) + " examples");
  if (rc != 0) {
    const std::string msg = err[0] ? std::string(err.data()) : "no message";
    throw Error(file + ": task '" + id + "' failed (status " + std::to_string(rc) + "): " + msg);
  }
  if (g.out.empty()) throw Error(file + ": task '" + id + "' produced no examples");
  // Provenance (DESIGN §3): every example says what produced it, so a calibration file is reproducible.
  const json resolved = json::parse(params);
  for (std::size_t i = 0; i < g.out.size(); ++i) {
    auto& meta = g.out[i].meta;
    if (!meta.is_object()) meta = json::object();
    meta["source"] = {{"task", id},          {"params", resolved},
                      {"seed", seed},        {"index", i},
                      {"plugin", task->library.filename().string()},
                      {"created_by", std::string("hydrahead ") + HYDRAHEAD_VERSION}};
  }
  if (progress) progress(1.0, g.out.size());
  return std::move(g.out);
}

}  // namespace hh::interp
