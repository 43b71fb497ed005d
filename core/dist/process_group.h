#pragma once
// The process group of a distributed job, over PyTorch's c10d: a TCPStore rendezvous (rank 0 hosts
// the store at MASTER_ADDR:MASTER_PORT), then ProcessGroupNCCL for CUDA tensors (when this LibTorch
// has NCCL) or ProcessGroupGloo for CPU tensors. The c10d headers stay in process_group.cpp: the
// LibTorch 1.13 / 2.x differences (a ProcessGroup in 1.13 is a Backend in 2.x) live there alone.
//
// Every collective must be called by every rank in the same order. A failure (a peer that died, a
// timeout after `timeout_s`) throws hh::Error naming this rank, the collective and, when the failing
// rank managed to say so (report_failure), that rank and its message.
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "core/dist/env.h"
#include "core/util/compat.h"

namespace hh::dist {

enum class ReduceOp { Sum, Max };

class ProcessGroup;

// An asynchronous collective in flight. wait() blocks until it completes (CPU) or until the current
// CUDA stream is ordered after it (NCCL); it throws hh::Error on failure. Waiting twice is a no-op.
class Pending {
 public:
  Pending();
  ~Pending();
  Pending(Pending&&) noexcept;
  Pending& operator=(Pending&&) noexcept;
  void wait();
  bool valid() const;

 private:
  friend class ProcessGroup;
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

class ProcessGroup {
 public:
  // Joins the group described by `env` (a group of one works too). device "cpu" -> Gloo; "cuda" or
  // "cuda:N" -> NCCL on cuda:LOCAL_RANK (the current CUDA device is set to it). timeout_s bounds the
  // rendezvous and every collective.
  static std::shared_ptr<ProcessGroup> create(const DistEnv& env, const std::string& device, double timeout_s);
  ~ProcessGroup();
  ProcessGroup(const ProcessGroup&) = delete;
  ProcessGroup& operator=(const ProcessGroup&) = delete;

  int rank() const;
  int size() const;
  const DistEnv& env() const;
  const char* backend_name() const;  // "gloo" or "nccl"
  at::Device device() const;         // where the tensors of collectives must live

  // In place on `t` (contiguous, on device()).
  Pending all_reduce_async(const at::Tensor& t, ReduceOp op = ReduceOp::Sum);
  void all_reduce(const at::Tensor& t, ReduceOp op = ReduceOp::Sum);
  Pending broadcast_async(const at::Tensor& t, int root);
  void broadcast(const at::Tensor& t, int root);
  // Every rank's `t` (same shape and dtype on every rank), in rank order.
  std::vector<at::Tensor> all_gather(const at::Tensor& t);
  void barrier();

  // Tells the other ranks (through the store) that this rank is failing, with why; they name it
  // when their next collective fails. Never throws.
  void report_failure(const std::string& message) noexcept;

 private:
  ProcessGroup();
  // Numbers the collective `op`, starts it with issue() (which returns the c10d work), and names the
  // failure the way every collective does. Defined and used in process_group.cpp only.
  template <class Issue>
  Pending start_collective(const char* op, Issue&& issue);
  friend class Pending;
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// The device string this rank uses for `device`: "cuda" -> "cuda:LOCAL_RANK" in a distributed job;
// "cpu" unchanged. An explicit "cuda:N" with several processes on the node is refused (they would
// share one GPU), naming the option `what`.
std::string rank_device(const std::string& device, const DistEnv& env, const std::string& what);

// Whether this build can run NCCL (a CUDA LibTorch with c10d's NCCL backend).
bool have_nccl();

}  // namespace hh::dist
