#pragma once
// The training job runner (DESIGN.md section 10): stages run in order over one model, each with its own
// AdamW and schedule; progress goes to an event callback (JSON objects, one per event) and to run.h5;
// checkpoints let a killed or interrupted job continue exactly where it stopped.
//
// Output directory:
//   run.h5                       the live record (core/train/run_log.h)
//   checkpoints/LATEST           the name of the newest complete checkpoint
//   checkpoints/<name>/          model/ (an HF checkpoint: hybrid or dense, with the tokenizer),
//                                optimizer.safetensors (mid-stage only), state.json
//   model/                       the final model, written when the last stage ends
//   .lock                        held while a job runs in the directory
// Every checkpoint is written under a temporary name and renamed when complete; LATEST is replaced
// atomically after it, so a kill at any moment leaves the previous checkpoint usable.
//
// Determinism: the sample indices of optimiser step k are a function of (job seed, stage seed, k) and
// no training step draws random numbers, so a resumed job computes the same losses as one that was
// never stopped (bit for bit on the CPU).
#include <atomic>
#include <cstdint>
#include <functional>
#include <string>

#include <nlohmann/json.hpp>

#include "core/jobs/job.h"

namespace hh::interp {
class TaskRegistry;
}

namespace hh::train {

// Events, each a JSON object with "event":
//   start       {stages: [names], resumed: bool, stage, stage_step}
//   stage       {stage, index, kind, steps, params (trainable count)}
//   step        {stage, index, step, steps, global_step, loss, lr, grad_norm, tokens_per_s, elapsed_s, eta_s}
//   eval        {stage, step, global_step, loss}
//   checkpoint  {path, resume_stage (index; = stage count when the job is complete), resume_step}
//   done        {model: path}  or  interrupted {checkpoint: path}
using EventFn = std::function<void(const nlohmann::json&)>;

struct TrainOptions {
  std::string only_stage;                    // run just this stage (it must not be finished already)
  EventFn on_event;
  const std::atomic<bool>* stop = nullptr;   // polled after every optimiser step: checkpoint and return
  const interp::TaskRegistry* tasks = nullptr;   // needed by task data sources
  int64_t max_steps = -1;                    // >= 0: behave as if stopped after this many steps in this call
};

enum class JobStatus { Completed, Interrupted };

JobStatus run_job(const jobs::JobSpec& job, const TrainOptions& options);

}  // namespace hh::train
