#pragma once
// Data-parallel gradient averaging with the communication overlapped with the backward pass.
//
// The parameters are packed, in reverse order (the order the backward pass reaches them in), into
// buckets of about `bucket_bytes` of one dtype each. A hook on every parameter sees its gradient as
// autograd produces it; on a synchronising micro-step the hook writes the parameter's accumulated
// gradient (earlier micro-steps' .grad plus this one) into its slot of the bucket, and a bucket whose
// parameters have all arrived is divided by the world size and all-reduced asynchronously, while the
// backward pass goes on. finish() launches what is left (parameters that got no gradient count as
// zeros), waits for every bucket, and makes each .grad the averaged slot. On other micro-steps
// (gradient accumulation) the hooks do nothing: only the last micro-step communicates.
//
// Buckets start in index order on every rank, whatever order the hooks fire in, so the collectives
// match across ranks. A parameter whose hook fires twice in one synchronising step (a weight used by
// two separate backward calls) makes finish() fall back to one plain all-reduce per bucket after the
// backward, which is still exact.
#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "core/util/compat.h"

namespace hh::dist {

class ProcessGroup;

inline constexpr std::size_t kDefaultBucketBytes = std::size_t{25} << 20;  // as torch's DDP

class GradSync {
 public:
  GradSync(ProcessGroup& group, std::vector<at::Tensor> params, std::size_t bucket_bytes = kDefaultBucketBytes);
  ~GradSync();  // removes the hooks
  GradSync(const GradSync&) = delete;
  GradSync& operator=(const GradSync&) = delete;

  // Whether the coming backward pass(es) are the last micro-step of an optimiser step.
  void set_sync(bool sync);
  // Ends a synchronising step: every parameter's .grad is the mean over ranks.
  void finish();
  int64_t num_buckets() const;

 private:
  struct Impl;
  std::shared_ptr<Impl> impl_;
};

// Which rank owns each parameter's optimiser state (--shard-optimizer): parameters in order go to the
// rank with the fewest elements so far (ties: the lowest rank), so every rank computes the same map.
std::vector<int> partition_params(const std::vector<int64_t>& numels, int world_size);

}  // namespace hh::dist
