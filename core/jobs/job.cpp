#include "core/jobs/job.h"

#include <fstream>
#include <set>

#include "core/io/sha256.h"
#include "core/model/config.h"
#include "core/util/error.h"

namespace hh::jobs {

namespace fs = std::filesystem;
using nlohmann::json;

StageKind parse_stage_kind(const std::string& name) {
  if (name == "align") return StageKind::Align;
  if (name == "distil" || name == "distill") return StageKind::Distil;
  if (name == "finetune") return StageKind::Finetune;
  if (name == "pretrain") return StageKind::Pretrain;
  throw Error("unknown stage kind '" + name + "' (align, distil, finetune or pretrain)");
}

const char* stage_kind_name(StageKind k) {
  switch (k) {
    case StageKind::Align: return "align";
    case StageKind::Distil: return "distil";
    case StageKind::Finetune: return "finetune";
    case StageKind::Pretrain: return "pretrain";
  }
  return "?";
}

namespace {

// Typed access to one object's fields; every error names "<where>: <path>.<field>".
class Fields {
 public:
  Fields(const json& j, std::string where, std::string path) : j_(j), where_(std::move(where)), path_(std::move(path)) {
    if (!j_.is_object()) fail("", "must be an object");
  }
  [[noreturn]] void fail(const std::string& field, const std::string& msg) const {
    const std::string n = field.empty() ? path_ : name(field);
    throw Error(where_ + ": " + (n.empty() ? "" : n + ": ") + msg);
  }
  std::string name(const std::string& field) const { return path_.empty() ? field : path_ + "." + field; }
  bool has(const std::string& f) const { return j_.contains(f) && !j_.at(f).is_null(); }
  const json& at(const std::string& f) const { return j_.at(f); }
  void only(const std::set<std::string>& allowed) const {
    for (const auto& [k, v] : j_.items())
      if (!allowed.count(k)) {
        std::string list;
        for (const auto& a : allowed) list += (list.empty() ? "" : ", ") + a;
        fail(k, "unknown field (allowed: " + list + ")");
      }
  }
  std::string str(const std::string& f, const std::string& def, bool required = false) const {
    if (!has(f)) {
      if (required) fail(f, "is required");
      return def;
    }
    if (!j_.at(f).is_string() || j_.at(f).get<std::string>().empty()) fail(f, "must be a non-empty string");
    return j_.at(f).get<std::string>();
  }
  int64_t integer(const std::string& f, int64_t def, int64_t min, bool required = false) const {
    if (!has(f)) {
      if (required) fail(f, "is required");
      return def;
    }
    const json& v = j_.at(f);
    if (!v.is_number_integer() && !(v.is_number_float() && v.get<double>() == static_cast<double>(static_cast<int64_t>(v.get<double>()))))
      fail(f, "must be an integer, got " + v.dump());
    const int64_t x = v.is_number_integer() ? v.get<int64_t>() : static_cast<int64_t>(v.get<double>());
    if (x < min) fail(f, "must be >= " + std::to_string(min) + ", got " + std::to_string(x));
    return x;
  }
  double number(const std::string& f, double def, double min, double max, bool required = false) const {
    if (!has(f)) {
      if (required) fail(f, "is required");
      return def;
    }
    const json& v = j_.at(f);
    if (!v.is_number()) fail(f, "must be a number, got " + v.dump());
    const double x = v.get<double>();
    if (!(x >= min && x <= max)) fail(f, "must lie in [" + json(min).dump() + ", " + json(max).dump() + "], got " + v.dump());
    return x;
  }
  bool boolean(const std::string& f, bool def) const {
    if (!has(f)) return def;
    if (!j_.at(f).is_boolean()) fail(f, "must be true or false");
    return j_.at(f).get<bool>();
  }

 private:
  const json& j_;
  std::string where_, path_;
};

fs::path resolve(const fs::path& base, const std::string& p) {
  if (p.empty()) return {};
  const fs::path x(p);
  return x.is_absolute() || base.empty() ? x : base / x;
}

std::vector<train::DataSource> parse_sources(const json& j, const fs::path& base, const std::string& where,
                                            const std::string& path) {
  if (!j.is_array() || j.empty()) throw Error(where + ": " + path + ": must be a non-empty array of sources");
  std::vector<train::DataSource> out;
  for (std::size_t i = 0; i < j.size(); ++i) {
    const Fields f(j[i], where, path + "[" + std::to_string(i) + "]");
    f.only({"bin", "jsonl", "task", "params", "weight", "loss"});
    train::DataSource s;
    const int kinds = int(f.has("bin")) + int(f.has("jsonl")) + int(f.has("task"));
    if (kinds != 1) f.fail("", "needs exactly one of \"bin\", \"jsonl\" or \"task\"");
    if (f.has("bin")) {
      s.kind = "bin";
      s.path = resolve(base, f.str("bin", ""));
    } else if (f.has("jsonl")) {
      s.kind = "jsonl";
      s.path = resolve(base, f.str("jsonl", ""));
    } else {
      s.kind = "task";
      s.task = f.str("task", "");
    }
    if (f.has("params")) {
      if (s.kind != "task") f.fail("params", "only task sources take parameters");
      if (!f.at("params").is_object()) f.fail("params", "must be an object");
      s.params = f.at("params");
    }
    s.weight = f.number("weight", 1.0, 1e-12, 1e12);
    const std::string loss = f.str("loss", "all");
    if (loss != "all" && loss != "answer") f.fail("loss", "must be \"all\" or \"answer\", got \"" + loss + "\"");
    if (loss == "answer" && s.kind != "task") f.fail("loss", "\"answer\" needs a task source (its examples have answers)");
    s.answer_loss_only = loss == "answer";
    if (s.kind != "task" && !fs::is_regular_file(s.path)) f.fail(s.kind, s.path.string() + ": no such file");
    out.push_back(std::move(s));
  }
  return out;
}

StageSpec parse_stage(const json& j, const fs::path& base, const std::string& where, const std::string& path) {
  const Fields f(j, where, path);
  f.only({"name", "kind", "steps", "lr", "min_lr", "schedule", "warmup", "seq_len", "batch", "grad_accum", "clip",
          "weight_decay", "beta1", "beta2", "checkpoint_every", "eval_every", "eval_batches", "seed",
          "activation_checkpointing", "data"});
  StageSpec s;
  // "kind" defaults to the name, so {"name": "align"} is enough for the usual stages.
  const std::string name = f.str("name", "", !f.has("kind"));
  const std::string kind = f.str("kind", name);
  try {
    s.kind = parse_stage_kind(kind);
  } catch (const Error& e) {
    f.fail(f.has("kind") ? "kind" : "name", e.what());
  }
  s.name = name.empty() ? stage_kind_name(s.kind) : name;
  s.steps = f.integer("steps", 0, 1, true);
  s.lr = f.number("lr", 0, 1e-12, 10, true);
  s.min_lr = f.number("min_lr", 0, 0, s.lr);
  try {
    s.schedule = train::parse_schedule(f.str("schedule", "cosine"));
  } catch (const Error& e) {
    f.fail("schedule", e.what());
  }
  s.warmup = f.integer("warmup", 0, 0);
  if (s.warmup >= s.steps && s.warmup > 0) f.fail("warmup", "must be smaller than steps (" + std::to_string(s.steps) + ")");
  s.seq_len = f.integer("seq_len", 0, 2, true);
  s.batch = f.integer("batch", 1, 1);
  s.grad_accum = f.integer("grad_accum", 1, 1);
  s.clip = f.number("clip", 1.0, 0, 1e9);
  s.weight_decay = f.number("weight_decay", 0.0, 0, 10);
  s.beta1 = f.number("beta1", 0.9, 0, 0.999999);
  s.beta2 = f.number("beta2", 0.95, 0, 0.999999);
  s.checkpoint_every = f.integer("checkpoint_every", 0, 0);
  s.eval_every = f.integer("eval_every", 0, 0);
  s.eval_batches = f.integer("eval_batches", 2, 0);
  s.seed = static_cast<uint64_t>(f.integer("seed", 0, 0));
  s.activation_checkpointing = f.boolean("activation_checkpointing", false);
  if (f.has("data")) s.data = parse_sources(f.at("data"), base, where, f.name("data"));
  return s;
}

}  // namespace

bool JobSpec::pretrain() const {
  return !stages.empty() && stages.front().kind == StageKind::Pretrain;
}

const StageSpec* JobSpec::find_stage(const std::string& name) const {
  for (const auto& s : stages)
    if (s.name == name) return &s;
  return nullptr;
}

JobSpec JobSpec::parse(const json& j, const fs::path& base, const std::string& where) {
  const Fields f(j, where, "");
  f.only({"teacher", "manifest", "hybrid", "calib", "model", "output", "device", "dtype", "seed", "data", "eval_data",
          "stages", "description"});
  JobSpec s;
  s.raw = j;
  s.sha256 = io::sha256_hex(j.dump());
  s.teacher = resolve(base, f.str("teacher", ""));
  s.manifest = resolve(base, f.str("manifest", ""));
  s.hybrid = resolve(base, f.str("hybrid", ""));
  s.calib = resolve(base, f.str("calib", ""));
  s.output = resolve(base, f.str("output", "", true));
  s.device = f.str("device", "cpu");
  s.dtype = f.str("dtype", "");
  if (!model::is_dtype_option(s.dtype))
    f.fail("dtype", "'" + s.dtype + "' is not f32, bf16, f16, f64 or auto");
  s.seed = static_cast<uint64_t>(f.integer("seed", 0, 0));
  if (!f.has("stages") || !f.at("stages").is_array() || f.at("stages").empty())
    f.fail("stages", "must be a non-empty array of stages");
  std::set<std::string> names;
  for (std::size_t i = 0; i < f.at("stages").size(); ++i) {
    const std::string path = "stages[" + std::to_string(i) + "]";
    s.stages.push_back(parse_stage(f.at("stages")[i], base, where, path));
    if (!names.insert(s.stages.back().name).second) f.fail(path + ".name", "'" + s.stages.back().name + "' is used twice");
  }
  if (f.has("data")) s.data = parse_sources(f.at("data"), base, where, "data");
  if (f.has("eval_data")) s.eval_data = parse_sources(f.at("eval_data"), base, where, "eval_data");
  for (std::size_t i = 0; i < s.stages.size(); ++i)
    if (s.stages[i].data.empty() && s.data.empty())
      f.fail("data", "is required (stages[" + std::to_string(i) + "] has no data of its own)");

  const bool pre = s.stages.front().kind == StageKind::Pretrain;
  for (std::size_t i = 0; i < s.stages.size(); ++i)
    if ((s.stages[i].kind == StageKind::Pretrain) != pre)
      f.fail("stages[" + std::to_string(i) + "].name",
             "a job either pretrains a dense model or trains a hybrid; it cannot mix pretrain with align/distil/finetune");
  auto check_dir = [&](const char* field, const fs::path& p) {
    if (!p.empty() && !fs::is_regular_file(p / "config.json")) f.fail(field, p.string() + ": no config.json there");
  };
  auto check_file = [&](const char* field, const fs::path& p) {
    if (!p.empty() && !fs::is_regular_file(p)) f.fail(field, p.string() + ": no such file");
  };
  check_dir("teacher", s.teacher);
  check_dir("hybrid", s.hybrid);
  check_file("manifest", s.manifest);
  check_file("calib", s.calib);
  if (pre) {
    if (!f.has("model")) f.fail("model", "is required by pretrain ({\"config\": \"config.json\", \"tokenizer\": \"tokenizer.json\"})");
    const Fields m(f.at("model"), where, "model");
    m.only({"config", "tokenizer"});
    s.model_config = resolve(base, m.str("config", "", true));
    s.tokenizer = resolve(base, m.str("tokenizer", ""));
    check_file("model.config", s.model_config);
    check_file("model.tokenizer", s.tokenizer);
    for (const char* field : {"teacher", "manifest", "hybrid", "calib"})
      if (f.has(field)) f.fail(field, "has no use in a pretrain job");
  } else {
    if (f.has("model")) f.fail("model", "is only for pretrain jobs");
    if (!s.manifest.empty() && !s.hybrid.empty()) f.fail("hybrid", "give either \"manifest\" (convert the teacher) or \"hybrid\", not both");
    if (s.manifest.empty() && s.hybrid.empty()) f.fail("manifest", "is required (or \"hybrid\": an already converted checkpoint)");
    if (!s.manifest.empty() && s.teacher.empty()) f.fail("teacher", "is required to convert with a manifest");
    for (std::size_t i = 0; i < s.stages.size(); ++i)
      if ((s.stages[i].kind == StageKind::Align || s.stages[i].kind == StageKind::Distil) && s.teacher.empty())
        f.fail("teacher", std::string("is required by the ") + stage_kind_name(s.stages[i].kind) + " stage");
  }
  return s;
}

JobSpec JobSpec::load(const fs::path& path) {
  std::ifstream in(path);
  if (!in) throw Error(path.string() + ": cannot read the job file");
  json j;
  try {
    j = json::parse(in);
  } catch (const json::parse_error& e) {
    throw Error(path.string() + ": not valid JSON: " + e.what());
  }
  JobSpec s = parse(j, path.parent_path(), path.string());
  s.file = path;
  return s;
}

}  // namespace hh::jobs
