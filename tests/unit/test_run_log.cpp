// run.h5 as a reader sees it (the per-stage summary, where the run stands, its ETA) and the run
// directory's job lock, against values worked out by hand.
#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <fstream>
#include <optional>
#include <thread>

#include <nlohmann/json.hpp>

#include "core/jobs/job.h"
#include "core/train/job_lock.h"
#include "core/train/run_log.h"
#include "core/util/strings.h"
#include "support/test_support.h"

namespace hh::train {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

// A job of two stages: align 4 steps of 2 x 64 tokens, distil 3 steps of 1 x 128 x 3 accumulated.
jobs::JobSpec two_stages() {
  jobs::JobSpec job;
  job.raw = json::parse(R"({"stages": [{"name": "align", "steps": 4, "lr": 0.001, "seq_len": 64, "batch": 2},
                                       {"name": "distil", "steps": 3, "lr": 0.0001, "seq_len": 128, "grad_accum": 3}]})");
  jobs::StageSpec a, d;
  a.name = "align";
  a.kind = jobs::StageKind::Align;
  a.steps = 4;
  d.name = "distil";
  d.kind = jobs::StageKind::Distil;
  d.steps = 3;
  job.stages = {a, d};
  return job;
}

void add_step(RunLog& log, int64_t step, int32_t stage, int64_t stage_step, double loss, double tokens_per_s,
              double elapsed_s) {
  StepRecord r;
  r.step = step;
  r.stage = stage;
  r.stage_step = stage_step;
  r.loss = loss;
  r.tokens_per_s = tokens_per_s;
  r.elapsed_s = elapsed_s;
  log.step(r);
}

// The file as a reader in another process sees it now. HDF5 does not open a file for reading in the
// process that writes it, so the log closes for the read and reopens after, as a resumed job's does.
RunSnapshot read_now(std::optional<RunLog>& log, const fs::path& file, int32_t stage) {
  const int64_t rows = log->train_rows(), evals = log->eval_rows();
  log->close();
  log.reset();
  RunSnapshot r = read_run(file);
  log.emplace(RunLog::resume(file, rows, evals, stage));
  return r;
}

TEST(RunLog, AReaderSeesWhereTheRunStandsAndItsEta) {
  const fs::path file = test::scratch_dir("run_log") / "run.h5";
  std::optional<RunLog> log(RunLog::create(file, two_stages()));

  RunSnapshot r = read_now(log, file, 0);
  EXPECT_EQ(r.tokens_per_step, (std::vector<int64_t>{128, 384}));  // batch x grad_accum x seq_len, defaults 1
  RunProgress p = run_progress(r, true);
  EXPECT_EQ(p.state, RunProgress::State::Running);
  EXPECT_EQ(p.stage, -1);
  EXPECT_EQ(p.total, 7);
  EXPECT_EQ(describe(p, r), "running: before its first step");
  EXPECT_EQ(describe(run_progress(r, false), r), "stopped before its first step");

  // Two align steps: 128 tokens at 64 and at 32 tokens/s, i.e. 2 s and 4 s a step.
  log->stage_started(0);
  add_step(*log, 1, 0, 1, 5.0, 64, 2);
  add_step(*log, 2, 0, 2, 4.0, 32, 6);
  log->eval(2, 0, 4.5);
  r = read_now(log, file, 0);
  p = run_progress(r, true);
  EXPECT_EQ(p.stage, 0);
  EXPECT_EQ(p.stage_step, 2);
  EXPECT_EQ(p.stage_steps, 4);
  EXPECT_EQ(p.done, 2);
  EXPECT_EQ(p.loss, 4.0);
  EXPECT_EQ(p.tokens_per_s, 32);  // the lower median of {32, 64}
  EXPECT_EQ(p.elapsed_s, 6);
  // Mean seconds a token (1/64 + 1/32) / 2 = 3/128, for 2 x 128 align tokens and 3 x 384 distil tokens.
  EXPECT_DOUBLE_EQ(p.eta_s, 3.0 / 128.0 * (2 * 128 + 3 * 384));
  EXPECT_EQ(describe(p, r), "running: stage align, step 2 of 4 (2 of 7 in all), loss 4, 32 tokens/s, ETA " +
                                util::format_seconds(p.eta_s));
  const StageSummary align = summarize_stage(r, 0);
  EXPECT_STREQ(align.state, "run");
  EXPECT_EQ(align.done, 2);
  EXPECT_EQ(align.eval_loss, 4.5);
  const StageSummary distil = summarize_stage(r, 1);
  EXPECT_STREQ(distil.state, "waiting");
  EXPECT_EQ(distil.done, 0);
  EXPECT_TRUE(std::isnan(distil.loss) && std::isnan(distil.eval_loss) && std::isnan(distil.tokens_per_s));

  // Not running: no ETA, and the run stopped where its last step was.
  p = run_progress(r, false);
  EXPECT_EQ(p.state, RunProgress::State::Stopped);
  EXPECT_EQ(p.eta_s, -1);
  EXPECT_EQ(describe(p, r), "stopped at step 2 of 7 (stage align, step 2 of 4)");

  // Into the second stage: its ETA counts only its own steps' time, 3 tokens/s -> 1/3 s a token.
  add_step(*log, 3, 0, 3, 3.0, 64, 8);
  add_step(*log, 4, 0, 4, 2.0, 64, 10);
  log->stage_ended(0);
  log->stage_started(1);
  add_step(*log, 5, 1, 1, 1.5, 3, 138);
  r = read_now(log, file, 1);
  p = run_progress(r, true);
  EXPECT_EQ(p.stage, 1);
  EXPECT_EQ(p.stage_step, 1);
  EXPECT_DOUBLE_EQ(p.eta_s, 2 * 384 / 3.0);
  EXPECT_EQ(summarize_stage(r, 0).tokens_per_s, 64);  // lower median of {64, 32, 64, 64}
  EXPECT_STREQ(summarize_stage(r, 0).state, "done");
  EXPECT_STREQ(summarize_stage(r, 1).state, "run");

  add_step(*log, 6, 1, 2, 1.25, 3, 266);
  add_step(*log, 7, 1, 3, 1.0, 3, 394);
  log->stage_ended(1);
  log->close();
  log.reset();
  r = read_run(file);
  p = run_progress(r, false);
  EXPECT_EQ(p.state, RunProgress::State::Finished);
  EXPECT_EQ(describe(p, r), "finished: 7 steps in " + util::format_seconds(394));
}

TEST(RunLog, TheStageSummaryTakesTheLowerMedianOfTheLast20Steps) {
  const fs::path file = test::scratch_dir("run_log_median") / "run.h5";
  RunLog log = RunLog::create(file, two_stages());
  // 25 steps at 1000, 1, 2, ..., 24 tokens/s: the last 20 are 5..24, lower median 14.
  for (int i = 0; i < 25; ++i) add_step(log, i + 1, 0, i + 1, 1.0, i == 0 ? 1000 : i, i);
  log.close();
  EXPECT_EQ(summarize_stage(read_run(file), 0).tokens_per_s, 14);
}

TEST(RunLog, AFileWithoutItsJobsStagesHasNoEta) {
  const fs::path file = test::scratch_dir("run_log_no_spec") / "run.h5";
  jobs::JobSpec job = two_stages();
  job.raw = json::object();  // a spec that does not say its stages' sizes
  RunLog log = RunLog::create(file, job);
  add_step(log, 1, 0, 1, 5.0, 64, 2);
  log.close();
  const RunSnapshot r = read_run(file);
  EXPECT_EQ(r.tokens_per_step, (std::vector<int64_t>{0, 0}));
  EXPECT_EQ(run_progress(r, true).eta_s, -1);
  EXPECT_EQ(describe(run_progress(r, true), r), "running: stage align, step 1 of 4 (1 of 7 in all), loss 5, 64 tokens/s");
}

TEST(JobLock, ADirectoryIsTakenWhileALockIsHeldAndFreeAfter) {
  const fs::path dir = test::scratch_dir("job_lock");
  EXPECT_FALSE(job_running(dir));  // no .lock at all
  {
    JobLock lock(dir);
    EXPECT_TRUE(fs::exists(dir / ".lock"));
    EXPECT_TRUE(job_running(dir));
    EXPECT_TRUE(job_running(dir));  // the probe leaves the lock as it was
    EXPECT_MENTIONS(test::error_of([&] { JobLock second(dir); }), "another training job is running");
  }
  EXPECT_FALSE(job_running(dir));
  JobLock again(dir);
  EXPECT_TRUE(job_running(dir));
}

TEST(JobLock, TheHolderNamesItselfAndOnlyAJobOfThisHostCanBeAskedToStop) {
  const fs::path dir = test::scratch_dir("job_owner");
  std::string why;
  EXPECT_FALSE(job_owner(dir).has_value());
  EXPECT_FALSE(interrupt_job(dir, &why));
  EXPECT_MENTIONS(why, "no job is running there");
  {
    JobLock lock(dir);
    const auto owner = job_owner(dir);
    ASSERT_TRUE(owner.has_value());
    EXPECT_EQ(owner->pid, ::getpid());
    EXPECT_EQ(owner->host, this_host());
    EXPECT_FALSE(owner->host.empty());
  }
  EXPECT_FALSE(job_owner(dir).has_value());  // the text stays, but no one holds the lock

  // A holder on another host, and one that does not say who it is (an older version's lock).
  const int fd = ::open((dir / ".lock").c_str(), O_RDWR | O_TRUNC);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(::flock(fd, LOCK_EX), 0);
  const std::string other = "4242 elsewhere.example\n";
  ASSERT_EQ(::write(fd, other.data(), other.size()), static_cast<ssize_t>(other.size()));
  EXPECT_EQ(job_owner(dir)->pid, 4242);
  EXPECT_FALSE(interrupt_job(dir, &why));
  EXPECT_MENTIONS(why, "runs on elsewhere.example, not on this host");
  ASSERT_EQ(::ftruncate(fd, 0), 0);
  EXPECT_EQ(job_owner(dir)->pid, 0);
  EXPECT_FALSE(interrupt_job(dir, &why));
  EXPECT_MENTIONS(why, "does not say its process id");
  ::close(fd);
}

// A reader's probe holds a shared lock for an instant; a job starting in that instant waits it out
// instead of refusing the directory.
TEST(JobLock, AJobWaitsOutAShortSharedHold) {
  const fs::path dir = test::scratch_dir("job_lock_probe");
  std::ofstream(dir / ".lock").close();
  const int fd = ::open((dir / ".lock").c_str(), O_RDONLY);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(::flock(fd, LOCK_SH | LOCK_NB), 0);
  std::thread reader([fd] {
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
    ::flock(fd, LOCK_UN);
  });
  EXPECT_NO_THROW(JobLock lock(dir));
  reader.join();
  ::close(fd);
}

}  // namespace
}  // namespace hh::train
