#pragma once
// A training job (DESIGN.md section 10), read from JSON:
// {
//   "teacher": "models/qwen3-1.7b",          dense HF checkpoint (align and distil need it)
//   "manifest": "manifest.json",             the FA heads; the job converts the teacher itself ...
//   "hybrid": "runs/converted",              ... or starts from an already converted hybrid
//   "calib": "calib.jsonl",                  optional: fusion_gamma for the conversion
//   "model": {"config": "config.json", "tokenizer": "tokenizer.json"}   pretrain: a model from scratch
//   "output": "runs/r1",                     checkpoints, run.h5 and the final model
//   "device": "cuda", "dtype": "bf16", "seed": 0,
//   "data": [{"bin": "corpus.bin", "weight": 1}, {"jsonl": "text.jsonl"},
//            {"task": "niah-single", "params": {"length": 1024}, "weight": 0.5}],
//   "eval_data": [...],                      optional held-out sources (default: the training mixture
//                                            at sample indices no training step reaches)
//   "stages": [{"name": "align", "steps": 500, "lr": 1e-3, ...}, ...]
// }
// Relative paths are resolved against the job file's directory. Unknown fields are refused (typos
// must not silently fall back to defaults); every error names the file and the field.
#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/train/data.h"
#include "core/train/optim.h"

namespace hh::jobs {

enum class StageKind { Align, Distil, Finetune, Pretrain };
StageKind parse_stage_kind(const std::string& name);   // align|distil|finetune|pretrain
const char* stage_kind_name(StageKind k);

struct StageSpec {
  std::string name;                 // unique in the job; defaults to the kind's name
  StageKind kind = StageKind::Align;
  int64_t steps = 0;                // optimiser steps
  double lr = 0, min_lr = 0;
  train::Schedule schedule = train::Schedule::Cosine;
  int64_t warmup = 0;
  int64_t seq_len = 0;
  int64_t batch = 1;                // sequences per micro-batch
  int64_t grad_accum = 1;           // micro-batches per optimiser step
  double clip = 1.0;                // global gradient norm; 0 disables
  double weight_decay = 0.0;
  double beta1 = 0.9, beta2 = 0.95;
  int64_t checkpoint_every = 0;     // optimiser steps; 0: only at the end of the stage and on interrupt
  int64_t eval_every = 0;           // optimiser steps; 0: only at the end of the stage
  int64_t eval_batches = 2;
  uint64_t seed = 0;                // the data order of this stage
  bool activation_checkpointing = false;   // distil, finetune, pretrain: recompute each layer in backward
  std::vector<train::DataSource> data;   // empty: the job's data

  int64_t tokens_per_step() const { return batch * grad_accum * seq_len; }
};

struct JobSpec {
  std::filesystem::path file;       // where it was read from ("" when parsed from memory)
  std::filesystem::path teacher, manifest, hybrid, calib, output;
  std::filesystem::path model_config, tokenizer;   // pretrain
  std::string device = "cpu", dtype;               // dtype "": the checkpoint's, f32 on the CPU (float32 for pretrain)
  uint64_t seed = 0;
  std::vector<train::DataSource> data, eval_data;
  std::vector<StageSpec> stages;
  nlohmann::json raw;               // the document as given
  std::string sha256;               // of raw.dump(): a resumed run must have the same spec

  bool pretrain() const;            // the job trains a dense model from scratch
  const StageSpec* find_stage(const std::string& name) const;
  static JobSpec load(const std::filesystem::path& path);
  // `where` prefixes errors; relative paths resolve against base_dir.
  static JobSpec parse(const nlohmann::json& j, const std::filesystem::path& base_dir, const std::string& where);
};

}  // namespace hh::jobs
