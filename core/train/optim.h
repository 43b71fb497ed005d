#pragma once
// Optimisation pieces of the training stages: AdamW with float32 master weights for low-precision
// parameters, the learning-rate schedules and global gradient-norm clipping.
#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "core/util/compat.h"

namespace hh::train {

// One trainable tensor. `decay`: weight decay applies (matrices); norms, gains and biases do not decay.
struct Param {
  std::string name;
  at::Tensor tensor;  // a leaf that requires grad
  bool decay = true;
};

struct AdamWOptions {
  double beta1 = 0.9, beta2 = 0.95, eps = 1e-8;
  double weight_decay = 0.0;
};

// Decoupled weight decay Adam (Loshchilov & Hutter), PyTorch's update order:
//   p -= lr * wd * p;  m = b1 m + (1 - b1) g;  v = b2 v + (1 - b2) g^2;
//   p -= lr * (m / (1 - b1^t)) / (sqrt(v / (1 - b2^t)) + eps).
// The moments are float32 (float64 for float64 parameters). A bf16/f16 parameter is updated through a
// float32 master copy that the optimiser keeps, then rounded into the parameter, so small updates are
// not lost to bf16 rounding. Parameters without a gradient are skipped for that step.
class AdamW {
 public:
  AdamW(std::vector<Param> params, AdamWOptions options);
  void step(double lr);
  void zero_grad();
  int64_t steps() const { return steps_; }

  // Named state for checkpoints: "<param>.exp_avg", "<param>.exp_avg_sq" and, for low-precision
  // parameters, "<param>.master"; plus the step count.
  std::vector<std::pair<std::string, at::Tensor>> state() const;
  // Restores state() output; every tensor must be present with the parameter's shape (errors name it).
  void load_state(const std::map<std::string, at::Tensor>& state, int64_t steps);

 private:
  struct Slot {
    at::Tensor exp_avg, exp_avg_sq, master;  // master undefined for float32/float64 parameters
  };
  std::vector<Param> params_;
  std::vector<Slot> slots_;
  AdamWOptions o_;
  int64_t steps_ = 0;
};

// On CUDA, AdamW::step, grad_norm and clip_grad_norm's scaling each run in one launch over every tensor
// (kernels/optim.h) where the tensors allow, else the op sequences below run. false: the op sequences
// always (a process-wide switch, for comparison).
void set_fused_optimizer(bool on);

// sqrt of the sum of squared gradient entries over all parameters (float64 accumulation).
double grad_norm(const std::vector<Param>& params);
// Scales every gradient by max_norm / norm when norm > max_norm (max_norm <= 0: no clipping).
// Returns the norm before clipping.
double clip_grad_norm(const std::vector<Param>& params, double max_norm);

enum class Schedule { Constant, Linear, Cosine };
Schedule parse_schedule(const std::string& name);  // "constant" | "linear" | "cosine"; throws naming it
const char* schedule_name(Schedule s);

// Learning rate of optimiser step `step` (0-based) of `total`: linear warmup from lr/warmup to lr over
// the first `warmup` steps, then constant, or a linear or cosine decay from lr towards min_lr, with
// progress (step - warmup) / (total - warmup), so the last step still learns and min_lr would be the
// next one's.
double schedule_lr(Schedule s, double lr, double min_lr, int64_t warmup, int64_t step, int64_t total);

}  // namespace hh::train
