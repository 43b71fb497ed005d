#include "core/dist/env.h"

#include <cstdlib>
#include <string>

#include "core/util/error.h"

namespace hh::dist {
namespace {

// The integer value of variable `name`, or `fallback` when it is unset (nullptr) or empty.
long long int_var(const std::function<const char*(const char*)>& get, const char* name, long long fallback, long long min,
                  long long max) {
  const char* v = get(name);
  if (v == nullptr || *v == '\0') return fallback;
  const std::string s(v);
  size_t used = 0;
  long long x = 0;
  try {
    x = std::stoll(s, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  if (used != s.size() || used == 0) throw Error(std::string("environment variable ") + name + "='" + s + "' is not an integer");
  if (x < min || x > max)
    throw Error(std::string("environment variable ") + name + "=" + s + " is out of range (" + std::to_string(min) + ".." +
                std::to_string(max) + ")");
  return x;
}

bool is_set(const std::function<const char*(const char*)>& get, const char* name) {
  const char* v = get(name);
  return v != nullptr && *v != '\0';
}

}  // namespace

DistEnv parse_env(const std::function<const char*(const char*)>& get) {
  constexpr long long kMaxRanks = 1 << 20;
  DistEnv e;
  e.source = "single process";
  const bool torchrun = is_set(get, "RANK") || is_set(get, "WORLD_SIZE");
  // Slurm's variables count only with MASTER_ADDR set: a batch script's own shell carries SLURM_PROCID and
  // SLURM_NTASKS too, and a single `hydrahead` run there must not wait for peers that never come.
  const bool slurm = !torchrun && is_set(get, "SLURM_PROCID") && is_set(get, "MASTER_ADDR");
  if (!torchrun && !slurm) return e;
  const char* rank_var = torchrun ? "RANK" : "SLURM_PROCID";
  const char* size_var = torchrun ? "WORLD_SIZE" : "SLURM_NTASKS";
  const char* local_var = torchrun ? "LOCAL_RANK" : "SLURM_LOCALID";
  const char* local_size_var = torchrun ? "LOCAL_WORLD_SIZE" : "SLURM_NTASKS_PER_NODE";
  e.source = torchrun ? "torchrun variables" : "Slurm variables";
  if (!is_set(get, size_var)) throw Error(std::string(rank_var) + " is set but " + size_var + " is not");
  if (!is_set(get, rank_var)) throw Error(std::string(size_var) + " is set but " + rank_var + " is not");
  e.world_size = static_cast<int>(int_var(get, size_var, 1, 1, kMaxRanks));
  e.rank = static_cast<int>(int_var(get, rank_var, 0, 0, kMaxRanks));
  if (e.rank >= e.world_size)
    throw Error(std::string(rank_var) + "=" + std::to_string(e.rank) + " must be smaller than " + size_var + "=" +
                std::to_string(e.world_size));
  e.local_rank = static_cast<int>(int_var(get, local_var, e.rank, 0, kMaxRanks));
  // SLURM_NTASKS_PER_NODE may read "2(x3)" on heterogeneous allocations; only a plain number is used.
  const char* lws = get(local_size_var);
  if (!torchrun && lws != nullptr && std::string(lws).find('(') != std::string::npos) lws = nullptr;
  e.local_world_size = lws == nullptr ? e.world_size : static_cast<int>(int_var(get, local_size_var, e.world_size, 1, kMaxRanks));
  if (e.local_rank >= e.local_world_size) e.local_world_size = e.local_rank + 1;
  if (e.world_size == 1) return e;
  const char* addr = get("MASTER_ADDR");
  if (addr == nullptr || *addr == '\0')
    throw Error(std::string("MASTER_ADDR is not set (") + size_var + "=" + std::to_string(e.world_size) +
                "): set it to the host of rank 0, e.g. the first name of `scontrol show hostnames`");
  e.master_addr = addr;
  if (!is_set(get, "MASTER_PORT")) throw Error("MASTER_PORT is not set: choose a free TCP port on the host of rank 0");
  e.master_port = static_cast<int>(int_var(get, "MASTER_PORT", 0, 1, 65535));
  return e;
}

DistEnv env_from_process() {
  return parse_env([](const char* name) { return std::getenv(name); });
}

}  // namespace hh::dist
