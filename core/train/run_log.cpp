#include "core/train/run_log.h"

#include <torch/torch.h>

#include <algorithm>
#include <cstdio>
#include <limits>

#include <nlohmann/json.hpp>

#include "core/util/error.h"
#include "core/util/strings.h"
#include "hydrahead/version.h"

namespace hh::train {

namespace {

const char* const kTrainF64[] = {"loss", "lr", "grad_norm", "tokens_per_s", "elapsed_s"};

at::Tensor i64(int64_t v) { return at::full({1}, v, at::TensorOptions().dtype(at::kLong)); }
at::Tensor i32(int32_t v) { return at::full({1}, v, at::TensorOptions().dtype(at::kInt)); }
at::Tensor f64(double v) { return at::full({1}, v, at::TensorOptions().dtype(at::kDouble)); }

}  // namespace

RunLog RunLog::create(const std::filesystem::path& path, const jobs::JobSpec& job) {
  io::H5File f = io::H5File::create_live(path);
  f.set_attr("/", "format", "hydrahead-run");
  f.set_attr("/", "format_version", int64_t{1});
  f.set_attr("/", "created_by", std::string("hydrahead ") + HYDRAHEAD_VERSION);
  f.set_attr("/", "job", job.raw.dump());
  f.set_attr("/", "job_sha256", job.sha256);
  std::vector<std::string> names, kinds;
  std::vector<int64_t> steps;
  for (const auto& s : job.stages) {
    names.push_back(s.name);
    kinds.push_back(jobs::stage_kind_name(s.kind));
    steps.push_back(s.steps);
  }
  const int64_t n = static_cast<int64_t>(names.size());
  f.write_strings("/stages/name", names);
  f.write_strings("/stages/kind", kinds);
  f.write("/stages/steps", at::tensor(steps, at::TensorOptions().dtype(at::kLong)));
  f.write("/stages/first_row", at::full({n}, int64_t{-1}, at::TensorOptions().dtype(at::kLong)));
  f.write("/stages/end_row", at::full({n}, int64_t{-1}, at::TensorOptions().dtype(at::kLong)));
  f.create_series("/train/step", at::kLong);
  f.create_series("/train/stage", at::kInt);
  f.create_series("/train/stage_step", at::kLong);
  for (const char* name : kTrainF64) f.create_series(std::string("/train/") + name, at::kDouble);
  f.create_series("/eval/step", at::kLong);
  f.create_series("/eval/stage", at::kInt);
  f.create_series("/eval/loss", at::kDouble);
  f.start_swmr_write();
  return RunLog(std::move(f));
}

RunLog RunLog::resume(const std::filesystem::path& path, int64_t train_rows, int64_t eval_rows, int32_t stage) {
  io::H5File f = io::H5File::open_live(path);
  if (!f.has_attr("/", "format") || f.attr_string("/", "format") != "hydrahead-run")
    throw Error(path.string() + ": not a hydrahead run file");
  for (const char* name : {"step", "stage", "stage_step", "loss", "lr", "grad_norm", "tokens_per_s", "elapsed_s"})
    f.truncate(std::string("/train/") + name, train_rows);
  for (const char* name : {"step", "stage", "loss"}) f.truncate(std::string("/eval/") + name, eval_rows);
  const int64_t n = f.shape("/stages/name").at(0);
  at::Tensor first = f.read("/stages/first_row"), end = f.read("/stages/end_row");
  auto* fp = first.data_ptr<int64_t>();
  auto* ep = end.data_ptr<int64_t>();
  for (int64_t s = stage; s < n; ++s) {
    ep[s] = -1;
    if (s > stage || fp[s] > train_rows) fp[s] = -1;  // marks written after the checkpoint
  }
  f.write_at("/stages/first_row", 0, first);
  f.write_at("/stages/end_row", 0, end);
  f.start_swmr_write();
  RunLog log(std::move(f));
  log.train_rows_ = train_rows;
  log.eval_rows_ = eval_rows;
  return log;
}

void RunLog::stage_started(int32_t stage) { f_.write_at("/stages/first_row", stage, i64(train_rows_)); }
void RunLog::stage_ended(int32_t stage) { f_.write_at("/stages/end_row", stage, i64(train_rows_)); }

void RunLog::step(const StepRecord& r) {
  f_.append("/train/step", i64(r.step));
  f_.append("/train/stage", i32(r.stage));
  f_.append("/train/stage_step", i64(r.stage_step));
  const double values[] = {r.loss, r.lr, r.grad_norm, r.tokens_per_s, r.elapsed_s};
  for (std::size_t i = 0; i < 5; ++i) f_.append(std::string("/train/") + kTrainF64[i], f64(values[i]));
  ++train_rows_;
}

void RunLog::eval(int64_t step, int32_t stage, double loss) {
  f_.append("/eval/step", i64(step));
  f_.append("/eval/stage", i32(stage));
  f_.append("/eval/loss", f64(loss));
  ++eval_rows_;
}

int64_t RunSnapshot::total_steps() const {
  int64_t n = 0;
  for (int64_t s : planned_steps) n += s;
  return n;
}

RunSnapshot read_run(const std::filesystem::path& run_h5) {
  if (!std::filesystem::exists(run_h5)) throw Error(run_h5.string() + ": no such file");
  io::H5File f = io::H5File::open_follow(run_h5);
  auto read = [&](const std::string& ds, at::ScalarType type) {
    f.refresh(ds);
    return f.read(ds).to(type).contiguous();
  };
  auto i64 = [&](const std::string& ds) {
    const at::Tensor t = read(ds, at::kLong);
    return std::vector<int64_t>(t.data_ptr<int64_t>(), t.data_ptr<int64_t>() + t.numel());
  };
  auto i32 = [&](const std::string& ds) {
    const at::Tensor t = read(ds, at::kInt);
    return std::vector<int32_t>(t.data_ptr<int32_t>(), t.data_ptr<int32_t>() + t.numel());
  };
  auto f64 = [&](const std::string& ds) {
    const at::Tensor t = read(ds, at::kDouble);
    return std::vector<double>(t.data_ptr<double>(), t.data_ptr<double>() + t.numel());
  };
  RunSnapshot r;
  r.stage_names = f.read_strings("/stages/name");
  r.stage_kinds = f.read_strings("/stages/kind");
  r.planned_steps = i64("/stages/steps");
  r.first_row = i64("/stages/first_row");
  r.end_row = i64("/stages/end_row");
  // Rows are appended dataset by dataset: keep only rows every /train dataset has.
  r.step = i64("/train/step");
  r.stage = i32("/train/stage");
  r.loss = f64("/train/loss");
  r.tokens_per_s = f64("/train/tokens_per_s");
  r.elapsed_s = f64("/train/elapsed_s");
  const size_t n = std::min({r.step.size(), r.stage.size(), r.loss.size(), r.tokens_per_s.size(), r.elapsed_s.size()});
  r.step.resize(n);
  r.stage.resize(n);
  r.loss.resize(n);
  r.tokens_per_s.resize(n);
  r.elapsed_s.resize(n);
  r.eval_step = i64("/eval/step");
  r.eval_stage = i32("/eval/stage");
  r.eval_loss = f64("/eval/loss");
  const size_t e = std::min({r.eval_step.size(), r.eval_stage.size(), r.eval_loss.size()});
  r.eval_step.resize(e);
  r.eval_stage.resize(e);
  r.eval_loss.resize(e);
  // Each stage's tokens a step, from the spec the job recorded (its defaults: batch 1, grad_accum 1).
  r.tokens_per_step.assign(r.stage_names.size(), 0);
  try {
    const auto job = nlohmann::json::parse(f.attr_string("/", "job"));
    const auto& stages = job.at("stages");
    for (size_t s = 0; s < r.stage_names.size() && s < stages.size(); ++s) {
      const auto& st = stages[s];
      r.tokens_per_step[s] = st.value("batch", int64_t{1}) * st.value("grad_accum", int64_t{1}) * st.at("seq_len").get<int64_t>();
    }
  } catch (const std::exception&) {
    // An older or hand-made file: no ETA.
  }
  return r;
}

StageSummary summarize_stage(const RunSnapshot& r, int32_t stage) {
  const double nan = std::numeric_limits<double>::quiet_NaN();
  const auto st = static_cast<size_t>(stage);
  StageSummary out{r.end_row[st] >= 0 ? "done" : r.first_row[st] >= 0 ? "run" : "waiting", 0, nan, nan, nan};
  std::vector<double> recent;
  for (size_t i = 0; i < r.stage.size(); ++i)
    if (r.stage[i] == stage) {
      ++out.done;
      out.loss = r.loss[i];
      recent.push_back(r.tokens_per_s[i]);
    }
  if (recent.size() > 20) recent.erase(recent.begin(), recent.end() - 20);
  if (!recent.empty()) {
    std::sort(recent.begin(), recent.end());
    out.tokens_per_s = recent[(recent.size() - 1) / 2];
  }
  for (size_t i = r.eval_stage.size(); i-- > 0;)
    if (r.eval_stage[i] == stage) {
      out.eval_loss = r.eval_loss[i];
      break;
    }
  return out;
}

RunProgress run_progress(const RunSnapshot& r, bool running) {
  RunProgress p;
  const bool all_ended =
      !r.end_row.empty() && std::all_of(r.end_row.begin(), r.end_row.end(), [](int64_t e) { return e >= 0; });
  p.state = running ? RunProgress::State::Running : all_ended ? RunProgress::State::Finished : RunProgress::State::Stopped;
  p.total = r.total_steps();
  p.done = static_cast<int64_t>(r.step.size());
  p.loss = std::numeric_limits<double>::quiet_NaN();
  p.tokens_per_s = p.loss;
  if (r.step.empty()) return p;
  p.stage = r.stage.back();
  const auto st = static_cast<size_t>(p.stage);
  const StageSummary sum = summarize_stage(r, p.stage);
  p.stage_step = sum.done;
  p.stage_steps = st < r.planned_steps.size() ? r.planned_steps[st] : 0;
  p.loss = r.loss.back();
  p.tokens_per_s = sum.tokens_per_s;
  p.elapsed_s = r.elapsed_s.back();
  if (p.state != RunProgress::State::Running || st >= r.tokens_per_step.size() || r.tokens_per_step[st] <= 0) return p;
  // The trainer's estimate: this stage's mean seconds a token (the mean of 1 / tokens_per_s over its steps).
  double per_token = 0;
  for (size_t i = 0; i < r.stage.size(); ++i)
    if (r.stage[i] == p.stage) per_token += 1.0 / r.tokens_per_s[i];
  per_token /= static_cast<double>(sum.done);
  double tokens = static_cast<double>(std::max<int64_t>(0, p.stage_steps - p.stage_step) * r.tokens_per_step[st]);
  for (size_t later = st + 1; later < r.planned_steps.size(); ++later) {
    if (r.tokens_per_step[later] <= 0) return p;
    tokens += static_cast<double>(r.planned_steps[later] * r.tokens_per_step[later]);
  }
  p.eta_s = per_token * tokens;
  return p;
}

std::string describe(const RunProgress& p, const RunSnapshot& r) {
  char buf[96];
  auto number = [&buf](double v, const char* fmt) {
    std::snprintf(buf, sizeof buf, fmt, v);
    return std::string(buf);
  };
  const std::string stage = p.stage >= 0 ? "stage " + r.stage_names[static_cast<size_t>(p.stage)] + ", step " +
                                               std::to_string(p.stage_step) + " of " + std::to_string(p.stage_steps)
                                         : std::string();
  const std::string in_all = std::to_string(p.done) + " of " + std::to_string(p.total);
  switch (p.state) {
    case RunProgress::State::Finished:
      return "finished: " + std::to_string(p.done) + " steps in " + util::format_seconds(p.elapsed_s);
    case RunProgress::State::Stopped:
      if (p.stage < 0) return "stopped before its first step";
      return "stopped at step " + in_all + " (" + stage + ")";
    case RunProgress::State::Running:
      break;
  }
  if (p.stage < 0) return "running: before its first step";
  std::string line = "running: " + stage + " (" + in_all + " in all), loss " + number(p.loss, "%.4g") + ", " +
                     number(p.tokens_per_s, "%.0f") + " tokens/s";
  if (p.eta_s >= 0) line += ", ETA " + util::format_seconds(p.eta_s);
  return line;
}

}  // namespace hh::train
