#pragma once
// run.h5: the live record of a training job, appended under HDF5 SWMR so that the workbench (or h5py
// with swmr=True) can read it while the job writes. Every dataset exists from the start:
//   /                 attrs format = "hydrahead-run", format_version = 1, created_by, job (the spec's
//                     JSON), job_sha256
//   /stages/name      [S] strings   stage names in job order
//   /stages/kind      [S] strings   align | distil | finetune | pretrain
//   /stages/steps     [S] i64       planned optimiser steps
//   /stages/first_row [S] i64       first /train row of the stage, -1 until it starts
//   /stages/end_row   [S] i64       one past its last row, -1 until it ends
//   /train/{step, stage, stage_step}            i64, i32, i64: global step (1-based), stage index, step in stage
//   /train/{loss, lr, grad_norm, tokens_per_s, elapsed_s}   f64, one row per optimiser step
//   /eval/{step, stage}, /eval/loss            one row per evaluation (held-out batches, no grad)
// A resumed job truncates the rows written after its checkpoint, so the file shows one trajectory.
#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

#include "core/io/h5.h"
#include "core/jobs/job.h"

namespace hh::train {

struct StepRecord {
  int64_t step = 0, stage_step = 0;
  int32_t stage = 0;
  double loss = 0, lr = 0, grad_norm = 0, tokens_per_s = 0, elapsed_s = 0;
};

class RunLog {
 public:
  // A new file (replacing any) with every dataset, in SWMR-write mode.
  static RunLog create(const std::filesystem::path& path, const jobs::JobSpec& job);
  // Reopens an existing file, keeps the first train_rows / eval_rows rows, resets the stage marks of
  // stages from `stage` on, and starts SWMR writing.
  static RunLog resume(const std::filesystem::path& path, int64_t train_rows, int64_t eval_rows, int32_t stage);

  void stage_started(int32_t stage);
  void stage_ended(int32_t stage);
  void step(const StepRecord& r);
  void eval(int64_t step, int32_t stage, double loss);
  int64_t train_rows() const { return train_rows_; }
  int64_t eval_rows() const { return eval_rows_; }
  void close() { f_.commit(); }

 private:
  explicit RunLog(io::H5File f) : f_(std::move(f)) {}
  io::H5File f_;
  int64_t train_rows_ = 0, eval_rows_ = 0;
};

// What a reader sees of a run.h5 at one moment (SWMR: also while the job writes it).
struct RunSnapshot {
  std::vector<std::string> stage_names, stage_kinds;
  std::vector<int64_t> planned_steps, first_row, end_row;  // per stage; -1 until it starts / ends
  std::vector<int64_t> step;                               // per /train row: global step
  std::vector<int32_t> stage;                              // per row: stage index
  std::vector<double> loss, tokens_per_s, elapsed_s;       // per row
  std::vector<int64_t> eval_step;                          // per /eval row
  std::vector<int32_t> eval_stage;
  std::vector<double> eval_loss;
  std::vector<int64_t> tokens_per_step;  // per stage, from the job's spec in the file (0 where it is unreadable)
  int64_t total_steps() const;  // planned, all stages
};
// Reads `run_h5` as it is now (opened for SWMR reading, every dataset refreshed). Throws naming the file.
RunSnapshot read_run(const std::filesystem::path& run_h5);

// One stage of a snapshot: whether it has started and ended ("waiting", "run", "done", from its marks),
// its steps done, last loss and held-out loss (NaN before the first), and the lower median of its last 20
// steps' tokens/s (NaN before the first step).
struct StageSummary {
  const char* state = "waiting";
  int64_t done = 0;
  double loss, eval_loss, tokens_per_s;
};
StageSummary summarize_stage(const RunSnapshot& r, int32_t stage);

// Where a run stands: its snapshot, and whether a job holds its directory (job_running()).
struct RunProgress {
  enum class State {
    Running,   // a job holds the directory
    Stopped,   // no job does, and a stage has not ended: interrupted, crashed, killed, or run by --stage
    Finished,  // every stage has ended
  };
  State state = State::Stopped;
  int32_t stage = -1;                       // the stage of the last step (-1 before the first)
  int64_t stage_step = 0, stage_steps = 0;  // that stage's steps done and planned
  int64_t done = 0, total = 0;              // steps done and planned, every stage
  double loss = 0;                          // the last step's (NaN before the first)
  double tokens_per_s = 0;                  // that stage's, as summarize_stage
  double elapsed_s = 0;                     // the job's time at its last step
  // While running: that stage's mean time a token (its steps' tokens/s) times the tokens left in it and
  // in every later stage, as the job's own progress events estimate it; -1 otherwise or when unknown.
  double eta_s = -1;
};
RunProgress run_progress(const RunSnapshot& r, bool running);
// One line for people: "running: stage distil, step 120 of 400 (320 of 1000 in all), loss 2.31,
// 9876 tokens/s, ETA 5m12s", "stopped at step 320 of 1000 (stage distil, step 120 of 400)", "finished:
// 1000 steps in 1h02m".
std::string describe(const RunProgress& p, const RunSnapshot& r);

}  // namespace hh::train
