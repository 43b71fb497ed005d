// hydrahead tasks [--plugin-dir DIR]... list [--json]
// hydrahead tasks generate --task ID (--model DIR | --tokenizer FILE) [--n N] [--length T] [--depth D]
//                          [--param KEY=VALUE]... [--seed S] --out calib.jsonl
// hydrahead tasks validate --calib F.jsonl [--model DIR | --tokenizer FILE] [--json]
#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <map>
#include <optional>

#include "app/cli/commands.h"
#include "core/interp/calibration.h"
#include "core/interp/task_registry.h"
#include "core/model/tokenizer.h"
#include "core/util/error.h"

namespace hh::cli {
namespace {

namespace fs = std::filesystem;
using interp::ParamType;
using interp::TaskInfo;
using interp::TaskParam;
using interp::TaskRegistry;
using nlohmann::json;

struct TasksArgs {
  std::vector<std::string> plugin_dirs;
  bool json = false;
  // generate
  std::string task, model, tokenizer, out;
  std::string n, length, depth;  // converted by the type the task declares
  std::vector<std::string> params;
  uint64_t seed = 0;
  // validate
  std::string calib;
};

void load_plugins(TaskRegistry& reg, const TasksArgs& a) {
  reg.load_default();
  for (const auto& dir : a.plugin_dirs) reg.load_dir(dir);
}

std::vector<std::string> search_path(const TasksArgs& a) {
  std::vector<std::string> dirs;
  for (const auto& d : TaskRegistry::default_search_path()) dirs.push_back(d.string());
  dirs.insert(dirs.end(), a.plugin_dirs.begin(), a.plugin_dirs.end());
  return dirs;
}

model::Tokenizer load_tokenizer(const std::string& tokenizer, const std::string& model_dir) {
  return model::Tokenizer::load(tokenizer.empty() ? fs::path(model_dir) / "tokenizer.json" : fs::path(tokenizer));
}

std::string number_text(ParamType type, double v) {
  if (type == ParamType::Int) return std::to_string(static_cast<int64_t>(v));
  for (int prec = 1; prec <= 17; ++prec) {
    char buf[64];
    std::snprintf(buf, sizeof buf, "%.*g", prec, v);
    if (std::strtod(buf, nullptr) == v) return buf;
  }
  return std::to_string(v);
}

std::string range_text(const TaskParam& p) {
  switch (p.type) {
    case ParamType::Int:
    case ParamType::Float: return "[" + number_text(p.type, p.min) + ", " + number_text(p.type, p.max) + "]";
    case ParamType::String: {
      std::string s;
      for (const auto& c : p.choices) s += (s.empty() ? "" : "|") + c;
      return s;
    }
    case ParamType::Bool: return "";
  }
  return "";
}

json param_json(const TaskParam& p) {
  json j = {{"name", p.name}, {"type", interp::param_type_name(p.type)}, {"description", p.description},
            {"default", p.default_value}};
  if (p.type == ParamType::Int) {
    j["min"] = static_cast<int64_t>(p.min);
    j["max"] = static_cast<int64_t>(p.max);
  } else if (p.type == ParamType::Float) {
    j["min"] = p.min;
    j["max"] = p.max;
  } else if (p.type == ParamType::String && !p.choices.empty()) {
    j["choices"] = p.choices;
  }
  return j;
}

int run_list(const TasksArgs& a) {
  TaskRegistry reg;
  load_plugins(reg, a);
  if (a.json) {
    json tasks = json::array();
    for (const auto& t : reg.tasks()) {
      json params = json::array();
      for (const auto& p : t.params) params.push_back(param_json(p));
      tasks.push_back({{"id", t.id}, {"kind", t.kind}, {"description", t.description},
                       {"library", t.library.string()}, {"params", params}});
    }
    const json out = {{"tasks", tasks}, {"search_path", search_path(a)}, {"diagnostics", reg.diagnostics()}};
    std::printf("%s\n", out.dump(2).c_str());
    return kExitOk;
  }
  if (reg.tasks().empty()) {
    std::fprintf(stderr, "no calibration tasks found; searched:\n");
    for (const auto& d : search_path(a)) std::fprintf(stderr, "  %s\n", d.c_str());
    return kExitOk;
  }
  for (const auto& t : reg.tasks()) {
    std::printf("%s  (%s)  %s\n", t.id.c_str(), t.kind.c_str(), t.description.c_str());
    std::printf("    from %s\n", t.library.string().c_str());
    std::size_t w_name = 0, w_default = 0, w_range = 0;
    for (const auto& p : t.params) {
      w_name = std::max(w_name, p.name.size());
      w_default = std::max(w_default, p.default_value.dump().size());
      w_range = std::max(w_range, range_text(p).size());
    }
    for (const auto& p : t.params)
      std::printf("    %-*s  %-6s  default %-*s  %-*s  %s\n", static_cast<int>(w_name), p.name.c_str(),
                  interp::param_type_name(p.type), static_cast<int>(w_default), p.default_value.dump().c_str(),
                  static_cast<int>(w_range), range_text(p).c_str(), p.description.c_str());
  }
  return kExitOk;
}

int run_generate(const TasksArgs& a) {
  const auto tok = load_tokenizer(a.tokenizer, a.model);
  TaskRegistry reg;
  load_plugins(reg, a);
  const TaskInfo* task = reg.find(a.task);
  if (!task) reg.resolve_params(a.task, json::object());  // throws, naming the tasks there are

  json partial = json::object();
  auto set = [&](const std::string& key, const std::string& text, const std::string& flag) {
    if (partial.contains(key)) throw Error(flag + ": parameter '" + key + "' is given twice");
    // Undeclared keys go through as text; resolve_params names them with the valid ones.
    const TaskParam* p = task->param(key);
    partial[key] = p ? interp::parse_param_text(*p, text) : json(text);
  };
  if (!a.n.empty()) set("num_examples", a.n, "--n");
  if (!a.length.empty()) set("length", a.length, "--length");
  if (!a.depth.empty()) set("depth", a.depth, "--depth");
  for (const auto& kv : a.params) {
    const auto eq = kv.find('=');
    if (eq == std::string::npos || eq == 0) throw Error("--param '" + kv + "': expected KEY=VALUE");
    set(kv.substr(0, eq), kv.substr(eq + 1), "--param");
  }
  const json resolved = reg.resolve_params(a.task, partial);

  std::vector<interp::CalibExample> examples;
  {
    ProgressBar bar(a.task);
    examples = reg.generate(a.task, partial, tok, a.seed, [&bar](double f, std::size_t n) {
      bar.update(f, std::to_string(n) + " examples");
    });
  }
  interp::write_calibration(a.out, examples);
  std::printf("wrote %zu examples of %s (seed %llu, %s) to %s\n", examples.size(), a.task.c_str(),
              static_cast<unsigned long long>(a.seed), resolved.dump().c_str(), a.out.c_str());
  return kExitOk;
}

struct Stats {
  std::size_t count = 0;
  std::size_t min = 0, max = 0, total = 0;
  void add(std::size_t v) {
    min = count ? std::min(min, v) : v;
    max = count ? std::max(max, v) : v;
    total += v;
    ++count;
  }
  double mean() const { return count ? static_cast<double>(total) / static_cast<double>(count) : 0.0; }
  json to_json() const { return {{"min", min}, {"mean", mean()}, {"max", max}}; }
};

int run_validate(const TasksArgs& a) {
  std::optional<model::Tokenizer> tok;
  if (!a.tokenizer.empty() || !a.model.empty()) tok.emplace(load_tokenizer(a.tokenizer, a.model));
  const auto set = interp::read_calibration(a.calib, tok ? &*tok : nullptr, tok ? tok->vocab_size() : -1);
  std::map<std::string, std::size_t> per_task;
  Stats prompt, answer;
  std::size_t with_wrong = 0;
  for (const auto& ex : set) {
    ++per_task[ex.task];
    prompt.add(ex.clean_ids.size());
    answer.add(ex.answer_ids.size());
    if (!ex.wrong_ids.empty()) ++with_wrong;
  }
  const std::string sha = interp::calibration_sha256(a.calib);
  if (a.json) {
    const json out = {{"file", a.calib},         {"sha256", sha},         {"examples", set.size()},
                      {"tasks", per_task},       {"prompt_tokens", prompt.to_json()},
                      {"answer_tokens", answer.to_json()}, {"with_wrong", with_wrong},
                      {"vocab_checked", tok.has_value()}};
    std::printf("%s\n", out.dump(2).c_str());
    return kExitOk;
  }
  std::printf("%s: %zu examples, sha256 %s\n", a.calib.c_str(), set.size(), sha.c_str());
  std::string tasks;
  for (const auto& [id, n] : per_task) tasks += (tasks.empty() ? "" : ", ") + id + " " + std::to_string(n);
  std::printf("  tasks: %s\n", tasks.c_str());
  std::printf("  prompt tokens: min %zu, mean %.1f, max %zu\n", prompt.min, prompt.mean(), prompt.max);
  std::printf("  answer tokens: min %zu, mean %.1f, max %zu\n", answer.min, answer.mean(), answer.max);
  std::printf("  with a wrong answer: %zu of %zu\n", with_wrong, set.size());
  if (!tok) std::printf("  token ids not checked against a vocabulary (pass --model or --tokenizer)\n");
  return kExitOk;
}

// --model DIR or --tokenizer FILE, never both.
std::pair<CLI::Option*, CLI::Option*> add_tokenizer_options(CLI::App& app, TasksArgs& a) {
  auto* m = app.add_option("--model", a.model, "Checkpoint directory holding tokenizer.json")->type_name("DIR");
  auto* t = app.add_option("--tokenizer", a.tokenizer, "tokenizer.json file")->type_name("FILE");
  m->excludes(t);
  t->excludes(m);
  return {m, t};
}

}  // namespace

Runner add_tasks(CLI::App& app) {
  auto a = std::make_shared<TasksArgs>();
  app.add_option("--plugin-dir", a->plugin_dirs,
                 "Also load task plugins from DIR (repeatable; after the build's, the user's and "
                 "$HYDRAHEAD_PLUGIN_PATH's folders)")
      ->type_name("DIR")
      ->allow_extra_args(false);
  app.require_subcommand(1);

  auto* list = app.add_subcommand("list", "List the tasks of every loaded plugin with their parameters; "
                                          "refused plugins are reported on stderr");
  list->add_flag("--json", a->json, "Print one JSON object (tasks, search_path, diagnostics)");

  auto* gen = app.add_subcommand("generate", "Generate a calibration set (JSONL) with a task plugin");
  gen->add_option("--task", a->task, "Task id (see `hydrahead tasks list`)")->required()->type_name("ID");
  auto [gm, gt] = add_tokenizer_options(*gen, *a);
  gen->add_option("--n", a->n, "Number of examples (the task's num_examples parameter)")->type_name("N");
  gen->add_option("--length", a->length, "The task's length parameter (prompt length for most tasks)")
      ->type_name("T");
  gen->add_option("--depth", a->depth, "The task's depth parameter (where the needle sits)")->type_name("D");
  gen->add_option("--param", a->params, "Any parameter of the task as KEY=VALUE (repeatable)")
      ->type_name("KEY=VALUE")
      ->allow_extra_args(false);
  gen->add_option("--seed", a->seed, "Random seed; the same seed and parameters give the same file")
      ->default_val(0)
      ->type_name("S");
  gen->add_option("--out", a->out, "Output JSONL file (written atomically)")->required()->type_name("FILE");
  gen->callback([gm = gm, gt = gt] {
    if (gm->count() + gt->count() == 0) throw CLI::RequiredError("--model or --tokenizer");
  });

  auto* val = app.add_subcommand("validate", "Check a calibration JSONL file and summarise it");
  val->add_option("--calib", a->calib, "Calibration set to check")->required()->type_name("FILE");
  add_tokenizer_options(*val, *a);
  val->add_flag("--json", a->json, "Print the summary as one JSON object");

  // `tasks list --plugin-dir X` as well as `tasks --plugin-dir X list`.
  for (auto* sub : {list, gen, val}) sub->fallthrough();

  // Refused plugins are logged by the registry through hh::log, on stderr, so stdout keeps only the
  // listing or the JSON.
  return [a, list, gen, val]() -> int {
    if (list->parsed()) return run_list(*a);
    if (gen->parsed()) return run_generate(*a);
    if (val->parsed()) return run_validate(*a);
    return kExitUnavailable;
  };
}

}  // namespace hh::cli
