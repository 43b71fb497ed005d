// hydrahead train --job job.json [--stage NAME] [--progress bar|json|none] [--validate] | --status DIR | --stop DIR
#include <torch/torch.h>

#include <CLI/CLI.hpp>

#include <algorithm>
#include <nlohmann/json.hpp>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <optional>

#include "app/cli/commands.h"
#include "core/dist/process_group.h"
#include "core/interp/task_registry.h"
#include "core/io/h5.h"
#include "core/jobs/job.h"
#include "core/train/job_lock.h"
#include "core/train/run_log.h"
#include "core/train/trainer.h"
#include "core/util/error.h"

namespace hh::cli {
namespace {

namespace fs = std::filesystem;

struct TrainArgs {
  std::string job, stage, progress = "bar", status, stop;
  bool validate = false, shard_optimizer = false, json = false;
  double bucket_mb = 25;
  int64_t max_steps = -1;
  DistArgs dist;
};

// --status --json: the same as one JSON object (NaN, before a stage's first step, as null).
nlohmann::json status_json(const fs::path& dir, const train::RunSnapshot& r, const train::RunProgress& p,
                           const std::optional<train::JobOwner>& owner, const std::string& latest) {
  using nlohmann::json;
  auto num = [](double v) { return std::isnan(v) ? json(nullptr) : json(v); };
  const char* state = p.state == train::RunProgress::State::Running    ? "running"
                      : p.state == train::RunProgress::State::Finished ? "finished"
                                                                       : "stopped";
  json stages = json::array();
  for (size_t s = 0; s < r.stage_names.size(); ++s) {
    const train::StageSummary sum = train::summarize_stage(r, static_cast<int32_t>(s));
    stages.push_back({{"name", r.stage_names[s]},
                      {"kind", r.stage_kinds[s]},
                      {"steps_done", sum.done},
                      {"steps", r.planned_steps[s]},
                      {"state", sum.state},
                      {"loss", num(sum.loss)},
                      {"eval_loss", num(sum.eval_loss)},
                      {"tokens_per_s", num(sum.tokens_per_s)}});
  }
  return {{"run", (dir / "run.h5").string()},
          {"state", state},
          {"summary", train::describe(p, r)},
          {"stage", p.stage >= 0 ? json(r.stage_names[static_cast<size_t>(p.stage)]) : json(nullptr)},
          {"steps_done", p.done},
          {"steps", p.total},
          {"loss", num(p.loss)},
          {"tokens_per_s", num(p.tokens_per_s)},
          {"elapsed_s", p.elapsed_s},
          {"eta_s", p.eta_s >= 0 ? json(p.eta_s) : json(nullptr)},
          {"process", owner && owner->pid > 0 ? json{{"pid", owner->pid}, {"host", owner->host}} : json(nullptr)},
          {"stages", stages},
          {"latest_checkpoint", latest.empty() ? json(nullptr) : json((dir / "checkpoints" / latest).string())},
          {"final_model", fs::is_regular_file(dir / "model/config.json") ? json((dir / "model").string()) : json(nullptr)}};
}

// The state of a run directory, read from run.h5 (SWMR: also while the job writes it), and whether a
// job holds the directory now.
int print_status(const fs::path& dir, bool as_json) {
  const fs::path run = dir / "run.h5";
  if (!fs::exists(run)) throw Error(dir.string() + ": no run.h5 (not a training run directory, or the job has not started)");
  const train::RunSnapshot r = train::read_run(run);
  const std::optional<train::JobOwner> owner = train::job_owner(dir);
  const train::RunProgress p = train::run_progress(r, owner.has_value());
  std::string latest_name;
  if (std::ifstream latest(dir / "checkpoints/LATEST"); latest) std::getline(latest, latest_name);
  if (as_json) {
    std::printf("%s\n", status_json(dir, r, p, owner, latest_name).dump().c_str());
    return kExitOk;
  }
  std::string who;
  if (owner && owner->pid > 0) who = " (process " + std::to_string(owner->pid) + " on " + owner->host + ")";
  std::printf("%s\n%s%s\n%-12s %-9s %13s %10s %10s %10s\n", run.string().c_str(), train::describe(p, r).c_str(),
              who.c_str(), "stage", "kind", "steps", "loss", "eval", "tokens/s");
  auto number = [](double v, const char* fmt) {
    if (std::isnan(v)) return std::string("-");
    char buf[64];
    std::snprintf(buf, sizeof buf, fmt, v);
    return std::string(buf);
  };
  for (size_t s = 0; s < r.stage_names.size(); ++s) {
    const train::StageSummary sum = train::summarize_stage(r, static_cast<int32_t>(s));
    char steps[64];
    std::snprintf(steps, sizeof steps, "%lld/%lld%5s", static_cast<long long>(sum.done),
                  static_cast<long long>(r.planned_steps[s]), std::strcmp(sum.state, "waiting") == 0 ? "" : sum.state);
    std::printf("%-12s %-9s %13s %10s %10s %10s\n", r.stage_names[s].c_str(), r.stage_kinds[s].c_str(), steps,
                number(sum.loss, "%.4g").c_str(), number(sum.eval_loss, "%.4g").c_str(),
                number(sum.tokens_per_s, "%.0f").c_str());
  }
  if (!r.elapsed_s.empty()) std::printf("elapsed %s\n", format_seconds(r.elapsed_s.back()).c_str());
  if (!latest_name.empty()) std::printf("latest checkpoint: %s\n", (dir / "checkpoints" / latest_name).string().c_str());
  if (fs::is_regular_file(dir / "model/config.json")) std::printf("final model: %s\n", (dir / "model").string().c_str());
  if (p.state == train::RunProgress::State::Stopped && r.step.size() > 0)
    std::printf("run its job again (hydrahead train --job FILE) to continue from the latest checkpoint\n");
  return kExitOk;
}

int run_train(const TrainArgs& a) {
  if (!a.status.empty()) return print_status(a.status, a.json);
  if (!a.stop.empty()) {
    std::string why;
    if (!train::interrupt_job(a.stop, &why)) throw Error(why);
    std::printf("asked the job in %s to stop: it writes a checkpoint, then exits (status 130)\n", a.stop.c_str());
    return kExitOk;
  }
  if (a.job.empty()) throw Error("--job is required (or --status DIR, --stop DIR)");
  jobs::JobSpec job = jobs::JobSpec::load(a.job);
  interp::TaskRegistry tasks;
  tasks.load_default();
  if (a.validate) {
    train::check_job_data(job, &tasks);   // data files, task names and parameters, with the model's tokenizer
    std::printf("%s: valid; %zu stage(s):\n", a.job.c_str(), job.stages.size());
    for (const auto& s : job.stages)
      std::printf("  %-10s %-8s %6lld steps  lr %-8g %-8s seq %-6lld batch %lld x %lld = %lld tokens/step\n", s.name.c_str(),
                  jobs::stage_kind_name(s.kind), static_cast<long long>(s.steps), s.lr, train::schedule_name(s.schedule),
                  static_cast<long long>(s.seq_len), static_cast<long long>(s.batch), static_cast<long long>(s.grad_accum),
                  static_cast<long long>(s.tokens_per_step()));
    return kExitOk;
  }
  if (a.progress != "bar" && a.progress != "json" && a.progress != "none")
    throw Error("--progress " + a.progress + ": expected bar, json or none");
  std::string progress = a.progress;
  if (const int status = maybe_launch(a.dist); status >= 0) return status;
  const auto group = join_group(a.dist, job.device);
  const bool lead = !group || group->rank() == 0;
  if (group) {
    job.device = dist::rank_device(job.device, group->env(), a.job + ": device");
    if (group->rank() != 0) progress = "none";   // rank 0 reports for the job
  } else if (a.shard_optimizer) {
    std::fprintf(stderr, "note: --shard-optimizer has no effect in a single process\n");
  }

  std::unique_ptr<ProgressBar> bar;
  std::string bar_stage;
  bool stepped = false;  // a step ran in this call
  train::TrainOptions o;
  o.only_stage = a.stage;
  o.tasks = &tasks;
  o.stop = install_interrupt_flag();
  o.max_steps = a.max_steps;
  o.dist = group;
  o.shard_optimizer = a.shard_optimizer;
  o.bucket_mb = a.bucket_mb;
  o.on_event = [&](const nlohmann::json& e) {
    const std::string kind = e.at("event");
    stepped = stepped || kind == "step";
    if (progress == "json") {
      std::fputs((e.dump() + "\n").c_str(), stdout);
      std::fflush(stdout);
      return;
    }
    if (progress == "none") return;
    if (kind == "stage") {
      if (bar) bar->finish();
      bar_stage = e.at("stage");
      bar = std::make_unique<ProgressBar>("train " + bar_stage);
      std::fprintf(stderr, "stage %s (%s): %lld steps, %lld trainable parameters, %lld tokens a step\n", bar_stage.c_str(),
                   e.at("kind").get<std::string>().c_str(), static_cast<long long>(e.at("steps").get<int64_t>()),
                   static_cast<long long>(e.at("params").get<int64_t>()), static_cast<long long>(e.at("tokens_per_step").get<int64_t>()));
    } else if (kind == "step" && bar) {
      char detail[160];
      std::snprintf(detail, sizeof detail, "step %lld/%lld loss %.4f lr %.2e %.0f tok/s", static_cast<long long>(e.at("step").get<int64_t>()),
                    static_cast<long long>(e.at("steps").get<int64_t>()), e.at("loss").get<double>(), e.at("lr").get<double>(),
                    e.at("tokens_per_s").get<double>());
      bar->update(static_cast<double>(e.at("step").get<int64_t>()) / static_cast<double>(e.at("steps").get<int64_t>()), detail);
    } else if (kind == "eval") {
      if (bar) bar->finish();
      std::fprintf(stderr, "eval %s step %lld: loss %.4f\n", e.at("stage").get<std::string>().c_str(),
                   static_cast<long long>(e.at("step").get<int64_t>()), e.at("loss").get<double>());
      if (bar) bar = std::make_unique<ProgressBar>("train " + bar_stage);
    } else if (kind == "done" || kind == "interrupted") {
      if (bar) bar->finish();
    }
  };
  try {
    const auto status = train::run_job(job, o);
    if (status == train::JobStatus::Interrupted) {
      const bool signalled = o.stop && o.stop->load();
      if (progress != "json" && lead) {
        if (signalled && !stepped)
          std::fprintf(stderr, "interrupted before the first step; nothing new was written. Run the same command again to "
                               "continue.\n");
        else
          std::fprintf(stderr, "%s; checkpoint written. Run the same command again to resume.\n",
                       signalled ? "interrupted" : "stopped after --max-steps");
      }
      return signalled ? kExitInterrupted : kExitOk;
    }
  } catch (const Error& e) {
    if (progress == "json") {
      std::fputs((nlohmann::json{{"event", "error"}, {"message", e.what()}}.dump() + "\n").c_str(), stdout);
      std::fflush(stdout);
    }
    throw;
  }
  if (progress != "json" && lead) std::fprintf(stderr, "done: %s\n", (job.output / "model").string().c_str());
  return kExitOk;
}

}  // namespace

Runner add_train(CLI::App& app) {
  auto a = std::make_shared<TrainArgs>();
  app.footer(
      "The job file (JSON) names the teacher, the manifest (or an already converted hybrid), the data, the\n"
      "output directory and the stages: align (per-layer attention-output MSE against the frozen teacher),\n"
      "distil (token KL(teacher || student)), finetune (next-token cross-entropy) or pretrain (a dense model\n"
      "from scratch). See resources/jobs/ for complete examples and docs/TRAINING.md for every field.\n"
      "The output directory receives run.h5 (live, readable while the job runs), checkpoints/ and, at the\n"
      "end, model/. Running the same command again resumes from the last checkpoint; Ctrl-C or SIGTERM\n"
      "writes a checkpoint and exits with status 130.\n"
      "Several processes (data parallel, docs/DISTRIBUTED.md): --nproc-per-node N on one host, or torchrun /\n"
      "srun setting RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT. A stage's batch is the global batch, split\n"
      "evenly over the ranks; rank 0 writes run.h5 and the checkpoints, which resume with any number of ranks.");
  app.add_option("--job", a->job, "Job spec (JSON)")->check(CLI::ExistingFile);
  CLI::Option* status =
      app.add_option("--status", a->status, "Print the state of a run directory (its run.h5, also while the job runs) and exit");
  app.add_flag("--json", a->json, "With --status: print it as one JSON object (state, steps, loss, ETA, process, stages)")
      ->needs(status);
  app.add_option("--stop", a->stop,
                 "Ask the job running in this run directory (on this host) to stop as Ctrl-C does: it writes a "
                 "checkpoint and exits; running its job again continues");
  app.add_option("--stage", a->stage, "Run only this stage of the job (by name)");
  app.add_option("--progress", a->progress, "bar (stderr, for people), json (one JSON event a line on stdout, for tools) or none")
      ->capture_default_str();
  app.add_flag("--validate", a->validate, "Check the job spec and print its stages; train nothing");
  app.add_option("--max-steps", a->max_steps, "Stop after this many optimiser steps (with a checkpoint), e.g. to test a job");
  add_dist_options(app, a->dist);
  app.add_flag("--shard-optimizer", a->shard_optimizer,
               "With several ranks: each keeps the AdamW state (moments, float32 masters) of its share of the "
               "parameters only, steps those and broadcasts them (less memory per GPU; checkpoints are unchanged)");
  app.add_option("--bucket-mb", a->bucket_mb,
                 "With several ranks: MiB of gradients per all-reduce bucket; buckets start while the backward pass runs")
      ->capture_default_str();
  return [a] { return run_train(*a); };
}

}  // namespace hh::cli
