// The distributed runtime's pieces that need no peers: the launcher environment (torchrun and Slurm
// variables), the optimizer-state partition, and the local launcher's handling of a failing rank
// (real child processes: /bin/sh commands stand in for the ranks).
#include <gtest/gtest.h>

#include <chrono>
#include <fstream>
#include <map>
#include <numeric>
#include <string>

#include "core/dist/env.h"
#include "core/dist/grad_sync.h"
#include "core/dist/launcher.h"
#include "support/test_support.h"

namespace {

using hh::dist::DistEnv;

DistEnv parse(const std::map<std::string, std::string>& vars) {
  return hh::dist::parse_env([&](const char* name) -> const char* {
    const auto it = vars.find(name);
    return it == vars.end() ? nullptr : it->second.c_str();
  });
}

TEST(DistEnv, NoVariablesIsOneProcess) {
  const DistEnv e = parse({});
  EXPECT_FALSE(e.distributed());
  EXPECT_EQ(e.rank, 0);
  EXPECT_EQ(e.world_size, 1);
  EXPECT_EQ(e.source, "single process");
}

TEST(DistEnv, TorchrunVariables) {
  const DistEnv e = parse({{"RANK", "5"}, {"WORLD_SIZE", "8"}, {"LOCAL_RANK", "1"}, {"LOCAL_WORLD_SIZE", "4"},
                           {"MASTER_ADDR", "node17"}, {"MASTER_PORT", "29511"}});
  EXPECT_TRUE(e.distributed());
  EXPECT_EQ(e.rank, 5);
  EXPECT_EQ(e.world_size, 8);
  EXPECT_EQ(e.local_rank, 1);
  EXPECT_EQ(e.local_world_size, 4);
  EXPECT_EQ(e.master_addr, "node17");
  EXPECT_EQ(e.master_port, 29511);
  EXPECT_EQ(e.source, "torchrun variables");
}

TEST(DistEnv, LocalRankDefaultsToRankOnOneNode) {
  const DistEnv e = parse({{"RANK", "1"}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", "127.0.0.1"}, {"MASTER_PORT", "1234"}});
  EXPECT_EQ(e.local_rank, 1);
  EXPECT_EQ(e.local_world_size, 2);
}

TEST(DistEnv, SlurmVariablesAreTheFallbackWhenMasterAddrIsSet) {
  const DistEnv e = parse({{"SLURM_PROCID", "3"}, {"SLURM_NTASKS", "4"}, {"SLURM_LOCALID", "1"}, {"SLURM_NTASKS_PER_NODE", "2"},
                           {"MASTER_ADDR", "gpu-a01"}, {"MASTER_PORT", "29500"}});
  EXPECT_EQ(e.rank, 3);
  EXPECT_EQ(e.world_size, 4);
  EXPECT_EQ(e.local_rank, 1);
  EXPECT_EQ(e.local_world_size, 2);
  EXPECT_EQ(e.source, "Slurm variables");
  // "2(x2)" (Slurm's compressed form) is not a plain count: the local size then follows the local rank.
  const DistEnv h = parse({{"SLURM_PROCID", "3"}, {"SLURM_NTASKS", "4"}, {"SLURM_LOCALID", "1"},
                           {"SLURM_NTASKS_PER_NODE", "2(x2)"}, {"MASTER_ADDR", "gpu-a01"}, {"MASTER_PORT", "29500"}});
  EXPECT_EQ(h.local_rank, 1);
  EXPECT_EQ(h.world_size, 4);
}

TEST(DistEnv, SlurmVariablesWithoutMasterAddrAreABatchShellNotAJob) {
  const DistEnv e = parse({{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "4"}});
  EXPECT_FALSE(e.distributed());
}

TEST(DistEnv, TorchrunVariablesWinOverSlurm) {
  const DistEnv e = parse({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"SLURM_PROCID", "1"}, {"SLURM_NTASKS", "2"},
                           {"MASTER_ADDR", "h"}, {"MASTER_PORT", "2000"}});
  EXPECT_EQ(e.rank, 0);
  EXPECT_EQ(e.source, "torchrun variables");
}

TEST(DistEnv, ErrorsNameTheVariable) {
  using hh::test::error_of;
  EXPECT_MENTIONS(error_of([] { parse({{"RANK", "x1"}, {"WORLD_SIZE", "2"}}); }), "RANK='x1'");
  EXPECT_MENTIONS(error_of([] { parse({{"RANK", "2"}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", "h"}, {"MASTER_PORT", "1"}}); }),
                  "RANK=2 must be smaller than WORLD_SIZE=2");
  EXPECT_MENTIONS(error_of([] { parse({{"RANK", "0"}}); }), "WORLD_SIZE is not");
  EXPECT_MENTIONS(error_of([] { parse({{"WORLD_SIZE", "2"}}); }), "RANK is not");
  EXPECT_MENTIONS(error_of([] { parse({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"MASTER_PORT", "1"}}); }), "MASTER_ADDR");
  EXPECT_MENTIONS(error_of([] { parse({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", "h"}}); }), "MASTER_PORT");
  EXPECT_MENTIONS(error_of([] { parse({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", "h"}, {"MASTER_PORT", "70000"}}); }),
                  "MASTER_PORT=70000 is out of range");
  EXPECT_MENTIONS(error_of([] { parse({{"RANK", "0"}, {"WORLD_SIZE", "0"}}); }), "WORLD_SIZE=0 is out of range");
  EXPECT_MENTIONS(error_of([] { parse({{"SLURM_PROCID", "1"}, {"SLURM_NTASKS", "two"}, {"MASTER_ADDR", "h"}}); }),
                  "SLURM_NTASKS='two'");
  // One process needs no rendezvous address.
  EXPECT_FALSE(parse({{"RANK", "0"}, {"WORLD_SIZE", "1"}}).distributed());
}

TEST(DistPartition, BalancesElementsGreedilyAndIsTheSameEverywhere) {
  const std::vector<int64_t> numels = {100, 10, 10, 60, 30, 5};
  const auto owner = hh::dist::partition_params(numels, 2);
  // Loads after each: (100, 0) (100, 10) (100, 20) (100, 80) (100, 110) (105, 110).
  EXPECT_EQ(owner, (std::vector<int>{0, 1, 1, 1, 1, 0}));
  std::vector<int64_t> load(2, 0);
  for (size_t i = 0; i < numels.size(); ++i) load[static_cast<size_t>(owner[i])] += numels[i];
  EXPECT_EQ(load[0], 105);
  EXPECT_EQ(load[1], 110);
  EXPECT_EQ(hh::dist::partition_params(numels, 1), std::vector<int>(numels.size(), 0));
}

// Ranks are /bin/sh scripts: each sees the launcher's variables, one of them fails.
hh::dist::LaunchResult launch(const std::string& script, int nproc, double grace_s, std::string* log = nullptr) {
  hh::dist::LaunchOptions o;
  o.argv = {"/bin/sh", "-c", script};
  o.nproc = nproc;
  o.grace_s = grace_s;
  return hh::dist::launch_local(o, [log](const std::string& line) {
    if (log) *log += line + "\n";
  });
}

TEST(DistLauncher, EveryRankGetsItsVariablesAndSuccessIsZero) {
  const std::string dir = hh::test::scratch_dir("dist_launcher_env").string();
  const auto r = launch("echo \"$RANK $WORLD_SIZE $LOCAL_RANK $MASTER_ADDR $MASTER_PORT $NCCL_NVLS_ENABLE\" > " + dir + "/r$RANK", 3, 5);
  EXPECT_EQ(r.exit_status, 0);
  EXPECT_EQ(r.failed_rank, -1);
  std::string port;
  for (int k = 0; k < 3; ++k) {
    std::ifstream in(dir + "/r" + std::to_string(k));
    std::string rank, world, local, addr, p, nvls;
    in >> rank >> world >> local >> addr >> p >> nvls;
    EXPECT_EQ(rank, std::to_string(k));
    EXPECT_EQ(world, "3");
    EXPECT_EQ(local, std::to_string(k));
    EXPECT_EQ(addr, "127.0.0.1");
    EXPECT_GT(std::stoi(p), 0);
    if (k > 0) EXPECT_EQ(p, port) << "every rank meets at one port";
    port = p;
    EXPECT_EQ(nvls, "0");
  }
}

TEST(DistLauncher, AKilledRankStopsTheOthersAndIsNamedWithItsSignal) {
  std::string log;
  const auto t0 = std::chrono::steady_clock::now();
  // Rank 1 kills itself; rank 0 would sleep a minute but must be stopped by SIGTERM at once.
  const auto r = launch("if [ \"$RANK\" = 1 ]; then sleep 0.2; kill -9 $$; fi; sleep 60", 2, 5, &log);
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_EQ(r.failed_rank, 1);
  EXPECT_EQ(r.exit_status, 128 + 9);
  EXPECT_MENTIONS(r.message, "rank 1");
  EXPECT_MENTIONS(r.message, "signal 9");
  EXPECT_MENTIONS(log, "stopping the other 1 rank(s)");
  EXPECT_LT(s, 5.0);
}

TEST(DistLauncher, ARankThatIgnoresSigtermIsKilledAfterTheGracePeriod) {
  std::string log;
  const auto t0 = std::chrono::steady_clock::now();
  const auto r = launch("if [ \"$RANK\" = 0 ]; then sleep 0.2; exit 3; fi; trap '' TERM; sleep 60 & wait; sleep 60", 2, 1.0, &log);
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_EQ(r.failed_rank, 0);
  EXPECT_EQ(r.exit_status, 3);
  EXPECT_MENTIONS(r.message, "rank 0");
  EXPECT_MENTIONS(r.message, "exited with status 3");
  EXPECT_MENTIONS(log, "sending SIGKILL");
  EXPECT_LT(s, 10.0);
}

}  // namespace
