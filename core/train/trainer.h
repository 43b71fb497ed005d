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

#include <memory>
#include <optional>
#include <utility>
#include <vector>

#include "core/attention/hybrid_model.h"
#include "core/jobs/job.h"
#include "core/model/transformer.h"
#include "core/train/optim.h"

namespace hh::interp {
class TaskRegistry;
}
namespace hh::dist {
class ProcessGroup;
}

namespace hh::train {

// Events, each a JSON object with "event":
//   start       {stages: [names], resumed: bool, stage, stage_step, device, ranks}
//   stage       {stage, index, kind, steps, params (trainable count)}
//   step        {stage, index, step, steps, global_step, loss, lr, grad_norm, tokens_per_s, elapsed_s, eta_s}
//   eval        {stage, step, global_step, loss}
//   checkpoint  {path, resume_stage (index; = stage count when the job is complete), resume_step}
//   done        {model: path}  or  interrupted {checkpoint: path}
using EventFn = std::function<void(const nlohmann::json&)>;

struct TrainOptions {
  std::string only_stage;                    // run just this stage (it must not be finished already)
  EventFn on_event;
  // Polled after every optimiser step: checkpoint and return. In a single process it is also read while
  // the models load and once they are made: a stop asked by then returns before the first step, writing
  // nothing (the `interrupted` event's checkpoint is then the one to resume from, or null).
  const std::atomic<bool>* stop = nullptr;
  const interp::TaskRegistry* tasks = nullptr;   // needed by task data sources
  int64_t max_steps = -1;                    // >= 0: behave as if stopped after this many steps in this call
  // Data parallelism (docs/DISTRIBUTED.md): every rank runs run_job with its group. A stage's `batch` is
  // the global micro-batch, split evenly over the ranks (it must divide), so the trajectory does not
  // depend on the number of ranks and a checkpoint resumes with any number. Gradients are averaged in
  // buckets overlapped with the backward pass, only on the last micro-step of an optimiser step; the
  // reported loss is the mean over ranks; rank 0 alone writes run.h5, checkpoints and the final model
  // and emits events.
  std::shared_ptr<dist::ProcessGroup> dist;
  // With dist: each rank keeps the AdamW state of a share of the parameters (dist::partition_params),
  // steps those and broadcasts them; checkpoints still hold the whole state.
  bool shard_optimizer = false;
  double bucket_mb = 25;   // with dist: gradient bucket size (MiB) of the overlapped all-reduce
};

enum class JobStatus { Completed, Interrupted };

JobStatus run_job(const jobs::JobSpec& job, const TrainOptions& options);

// Opens every stage's data (files read, task names and parameters checked against `tasks`) with the
// model's configuration and tokenizer, loading no weights; throws hh::Error naming the source at fault.
// run_job does the same before it loads the models.
void check_job_data(const jobs::JobSpec& job, const interp::TaskRegistry* tasks);

// Next-token cross-entropy from the residual stream after the last layer, hidden [B, T, d], through
// `base`'s final norm and lm_head, for targets [B, T]: the mean over tokens, or with target_mask the
// mean over sequences of each one's mean over its counted targets (as stage_loss). The vocabulary
// projection runs `chunk` positions at a time, in the forward pass and again in the backward pass, so
// the float32 logits of the whole sequence never exist at once (at T = 16K and a 152K vocabulary they
// alone take 10 GiB, their log-softmax as much again). Differentiable in hidden and the weights.
at::Tensor chunked_next_token_loss(const model::Transformer& base, const at::Tensor& hidden, const at::Tensor& targets,
                                   const at::Tensor& target_mask, int64_t chunk);

// The distillation loss, the mean over tokens of KL(teacher || student) at temperature 1, from the two
// models' residual streams after their last layers ([B, T, d] each) through each model's final norm and
// lm_head, `chunk` positions at a time in the forward pass and again in the backward pass: the teacher's
// and the student's float32 logits and log-softmaxes (five [B T, V] tensors at once unchunked) never exist
// for the whole batch. Differentiable in student_hidden and the student's weights; the teacher's are not
// touched.
at::Tensor chunked_kl_divergence(const model::Transformer& teacher, const at::Tensor& teacher_hidden,
                                 const model::Transformer& student, const at::Tensor& student_hidden, int64_t chunk);

// ---- the pieces run_job is made of (benchmarks and tools use them directly) ----------------------

// The models of a stage: a dense model (pretrain) or a hybrid student, and the frozen teacher that
// align and distil need.
struct StageModels {
  std::optional<model::Transformer> dense;
  std::optional<attention::HybridModel> student;
  std::optional<model::Transformer> teacher;
};

// Every weight of the dense model (when set) or else the hybrid under its checkpoint name (handles:
// shared storage).
std::vector<std::pair<std::string, at::Tensor>> named_weights(const StageModels& m);
// The parameters a stage trains, with requires_grad set on them and cleared on every other weight:
// align trains the attention blocks (teacher projections and norms of self_attn, and every new
// hybrid tensor); the other stages train everything. Matrices other than embeddings decay.
std::vector<Param> stage_params(const StageModels& m, jobs::StageKind kind);
// One micro-batch's loss (ids [B, T + 1] on the model's device: inputs and next-token targets):
//   pretrain, finetune  mean next-token cross-entropy
//   distil              mean over tokens of KL(teacher || student), temperature 1
//   align               mean over layers of the MSE between the student's attention output on the
//                       teacher's layer input and the teacher's attention output
// With `backward`, the gradients of scale * loss are accumulated (align: layer by layer, so only one
// layer's graph is alive at a time). checkpoint_layers: activation checkpointing of the student's layers
// in distil and finetune (HybridModel::forward) and of the dense model's in pretrain (Transformer::hidden).
// target_mask [B, T] (DataMixture::batch): the cross-entropy stages then average each sequence over its counted targets and the sequences that have
// any, so an answers-only sample weighs as much as a fully counted one; align and distil ignore it.
// Returns the loss.
double stage_loss(const StageModels& m, jobs::StageKind kind, const at::Tensor& ids, double scale, bool backward,
                  bool checkpoint_layers = false, const at::Tensor& target_mask = {});

}  // namespace hh::train
