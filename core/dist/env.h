#pragma once
// Where this process sits in a distributed job, read from the environment that launchers set:
//   torchrun style:  RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT
//   Slurm (srun):    SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID, SLURM_NTASKS_PER_NODE (fallbacks when
//                    the torchrun variables are absent and MASTER_ADDR is set; MASTER_PORT is needed too)
// No LibTorch here: the launcher and the argument checks use it before anything heavy loads.
#include <cstdint>
#include <functional>
#include <string>

namespace hh::dist {

struct DistEnv {
  int rank = 0, world_size = 1;
  int local_rank = 0, local_world_size = 1;
  std::string master_addr;  // the host of rank 0's TCPStore
  int master_port = 0;
  std::string source;       // "single process", "torchrun variables" or "Slurm variables"
  bool distributed() const { return world_size > 1; }
};

// Reads the variables through `get` (nullptr: unset). One process (rank 0 of 1) when neither RANK nor
// WORLD_SIZE is set and SLURM_PROCID is not set with MASTER_ADDR, or when WORLD_SIZE / SLURM_NTASKS is 1. Throws hh::Error naming the
// variable when a value is not an integer, out of range (rank >= world size, port outside 1..65535),
// or missing (WORLD_SIZE without RANK, MASTER_ADDR or MASTER_PORT in a job of several processes).
DistEnv parse_env(const std::function<const char*(const char*)>& get);
// parse_env over the process environment.
DistEnv env_from_process();

}  // namespace hh::dist
