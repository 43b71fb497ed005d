// Several processes through `hydrahead ... --nproc-per-node 2` on the CPU (Gloo), against the same
// command in one process: training (losses, gradient norms, the optimiser's moments after one step,
// the final weights), resuming with another number of ranks, the sharded optimiser, the sharded
// analysis (analysis.h5 compared dataset by dataset), and a rank that is killed or hangs.
#include <torch/torch.h>

#include <gtest/gtest.h>

#include <array>
#include <chrono>
#include <fstream>
#include <map>
#include <thread>

#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <nlohmann/json.hpp>

#include "core/io/h5.h"
#include "core/io/checkpoint.h"
#include "core/model/transformer.h"
#include "support/test_support.h"
#include "support/tiny_config.h"

extern char** environ;

namespace {

namespace fs = std::filesystem;
using nlohmann::json;

using Result = hh::test::CommandResult;
using hh::test::run_command;

std::string hydrahead() { return (hh::test::bin_dir() / "hydrahead").string(); }

// ---- training ------------------------------------------------------------------------------------

// A tiny dense model trained from scratch on a learnable token stream: the job file and its folder.
fs::path make_pretrain_job(const fs::path& dir, int64_t steps, int64_t checkpoint_every) {
  fs::create_directories(dir);
  const auto cfg = hh::test::tiny_config(2, 4, 2, 8, 32, 64, 273);
  std::ofstream(dir / "config.json") << cfg.to_json().dump(2);
  fs::copy_file(hh::test::data_dir() / "tokenizer/tiny-tokenizer.json", dir / "tokenizer.json", fs::copy_options::overwrite_existing);
  std::ofstream out(dir / "corpus.bin", std::ios::binary);
  uint64_t x = 7;
  for (int i = 0; i < 8000; ++i) {
    x = x * 6364136223846793005ULL + 1442695040888963407ULL;
    const uint32_t id = (x >> 61) == 0 ? static_cast<uint32_t>((x >> 33) % 273) : static_cast<uint32_t>(40 + (i % 19) * 5);
    out.write(reinterpret_cast<const char*>(&id), 4);
  }
  // batch 4 = 2 ranks x 2 sequences, two micro-batches a step, no clipping (the moments after one
  // step are then 0.1 g and 0.05 g^2 exactly: the gradient itself).
  const json job = {{"model", {{"config", "config.json"}, {"tokenizer", "tokenizer.json"}}},
                    {"output", "run"},
                    {"seed", 3},
                    {"data", json::array({{{"bin", "corpus.bin"}}})},
                    {"stages", json::array({{{"name", "pre"}, {"kind", "pretrain"}, {"steps", steps}, {"lr", 3e-3},
                                             {"warmup", 1}, {"seq_len", 16}, {"batch", 4}, {"grad_accum", 2}, {"clip", 0.0},
                                             {"weight_decay", 0.1}, {"checkpoint_every", checkpoint_every},
                                             {"eval_batches", 1}}})}};
  std::ofstream(dir / "job.json") << job.dump(2);
  return dir / "job.json";
}

// A copy of the job folder in `to` (its own output directory).
fs::path copy_job(const fs::path& job, const fs::path& to) {
  fs::create_directories(to);
  for (const char* f : {"job.json", "config.json", "tokenizer.json", "corpus.bin"})
    fs::copy_file(job.parent_path() / f, to / f, fs::copy_options::overwrite_existing);
  return to / "job.json";
}

Result train(const fs::path& job, const std::string& extra) {
  return run_command(hydrahead() + " train --job " + job.string() + " --progress none " + extra);
}

std::vector<double> column(const fs::path& run_h5, const std::string& ds) {
  const at::Tensor t = hh::io::H5File::open_read(run_h5).read(ds).to(at::kDouble).contiguous();
  return std::vector<double>(t.data_ptr<double>(), t.data_ptr<double>() + t.numel());
}

void expect_close(const std::vector<double>& a, const std::vector<double>& b, double rtol, const std::string& what) {
  ASSERT_EQ(a.size(), b.size()) << what;
  for (size_t i = 0; i < a.size(); ++i) EXPECT_NEAR(a[i], b[i], rtol * std::max(1e-6, std::abs(a[i]))) << what << " row " << i;   // relative
}

std::string latest(const fs::path& run) {
  std::ifstream in(run / "checkpoints/LATEST");
  std::string name;
  std::getline(in, name);
  return name;
}

// Largest absolute difference over the tensors two safetensors files share (and they share all).
double max_diff(const fs::path& a, const fs::path& b) {
  const auto ta = hh::io::load_tensors(a), tb = hh::io::load_tensors(b);
  EXPECT_EQ(ta.size(), tb.size());
  double d = 0;
  for (const auto& [name, t] : ta) {
    const auto it = tb.find(name);
    if (it == tb.end()) {
      ADD_FAILURE() << name << " missing from " << b;
      continue;
    }
    d = std::max(d, (t.to(at::kDouble) - it->second.to(at::kDouble)).abs().max().item<double>());
  }
  return d;
}

constexpr double kLossRtol = 2e-5;    // float32 sums in another order
constexpr double kWeightTol = 2e-5;

TEST(DistTrain, TwoRanksMatchOneProcessAndResumeWithAnyNumberOfRanks) {
  const fs::path dir = hh::test::scratch_dir("dist_train");
  const fs::path one = make_pretrain_job(dir / "one", 4, 1);

  // The reference: one process, uninterrupted.
  Result r = train(one, "");
  ASSERT_EQ(r.status, 0) << r.output;
  const fs::path ref = dir / "one/run";

  // One optimiser step with 1 and with 2 ranks: the same gradient (first and second moments).
  const fs::path g1 = copy_job(one, dir / "g1"), g2 = copy_job(one, dir / "g2");
  r = train(g1, "--max-steps 1");
  ASSERT_EQ(r.status, 0) << r.output;
  // Buckets of 16 KiB: the 36K float32 parameters' gradients travel in several all-reduces that start
  // during the backward pass.
  r = train(g2, "--max-steps 1 --nproc-per-node 2 --bucket-mb 0.015625");
  ASSERT_EQ(r.status, 0) << r.output;
  {
    const auto at = r.output.find(" ranks in ");
    ASSERT_NE(at, std::string::npos) << r.output;
    EXPECT_GE(std::stoi(r.output.substr(at + 10)), 5) << r.output;
  }
  ASSERT_EQ(latest(dir / "g1/run"), "stage0-step1");
  ASSERT_EQ(latest(dir / "g2/run"), "stage0-step1");
  const auto m1 = hh::io::load_tensors(dir / "g1/run/checkpoints/stage0-step1/optimizer.safetensors");
  const auto m2 = hh::io::load_tensors(dir / "g2/run/checkpoints/stage0-step1/optimizer.safetensors");
  ASSERT_EQ(m1.size(), m2.size());
  double grad_scale = 0;
  for (const auto& [name, t] : m1) {
    ASSERT_TRUE(m2.count(name)) << name;
    const at::Tensor& u = m2.at(name);
    EXPECT_TRUE(at::allclose(t, u, 1e-4, 1e-9)) << name << ": max |diff| " << (t - u).abs().max().item<double>();
    grad_scale = std::max(grad_scale, t.abs().max().item<double>());
  }
  EXPECT_GT(grad_scale, 1e-4) << "the gradients are not trivially zero";
  expect_close(column(dir / "g1/run/run.h5", "/train/loss"), column(dir / "g2/run/run.h5", "/train/loss"), kLossRtol, "step-1 loss");
  expect_close(column(dir / "g1/run/run.h5", "/train/grad_norm"), column(dir / "g2/run/run.h5", "/train/grad_norm"), kLossRtol,
               "step-1 gradient norm");

  // Resume: the 2-rank checkpoint on 1 process, the 1-process checkpoint on 2 ranks with a sharded
  // optimiser. Both end on the reference trajectory.
  r = train(g2, "");
  ASSERT_EQ(r.status, 0) << r.output;
  r = train(g1, "--nproc-per-node 2 --shard-optimizer");
  ASSERT_EQ(r.status, 0) << r.output;
  for (const fs::path& run : {dir / "g1/run", dir / "g2/run"}) {
    expect_close(column(ref / "run.h5", "/train/loss"), column(run / "run.h5", "/train/loss"), kLossRtol, run.string() + " loss");
    expect_close(column(ref / "run.h5", "/train/grad_norm"), column(run / "run.h5", "/train/grad_norm"), kLossRtol,
                 run.string() + " gradient norm");
    expect_close(column(ref / "run.h5", "/eval/loss"), column(run / "run.h5", "/eval/loss"), kLossRtol, run.string() + " eval");
    EXPECT_LT(max_diff(ref / "model/model.safetensors", run / "model/model.safetensors"), kWeightTol) << run;
  }

  // Two ranks from the start, optimiser sharded: the same trajectory; only rank 0 wrote files.
  const fs::path b = copy_job(one, dir / "b");
  r = train(b, "--nproc-per-node 2 --shard-optimizer --bucket-mb 0.015625");
  ASSERT_EQ(r.status, 0) << r.output;
  expect_close(column(ref / "run.h5", "/train/loss"), column(dir / "b/run/run.h5", "/train/loss"), kLossRtol, "sharded loss");
  EXPECT_LT(max_diff(ref / "model/model.safetensors", dir / "b/run/model/model.safetensors"), kWeightTol);
}

// The hybrid stages: align (one backward pass per layer), distil with activation checkpointing (the
// layers run again inside the backward pass) and finetune, on 1 and on 2 ranks.
TEST(DistTrain, HybridStagesMatchOneProcess) {
  const fs::path dir = hh::test::scratch_dir("dist_hybrid");
  const auto cfg = hh::test::tiny_config(2, 4, 2, 8, 32, 64, 273);
  hh::model::save_model(dir / "teacher", cfg, hh::model::random_weights(cfg, 11, at::kFloat, 0.05));
  fs::copy_file(hh::test::data_dir() / "tokenizer/tiny-tokenizer.json", dir / "teacher/tokenizer.json");
  std::ofstream(dir / "manifest.json") << R"({"format": "hydrahead-manifest", "format_version": 1,
    "model": {"architecture": "qwen3", "num_layers": 2, "num_heads": 4, "num_kv_heads": 2, "head_dim": 8},
    "fa_heads": [[0, 1], [1, 2]]})";
  make_pretrain_job(dir, 1, 0);   // for its corpus
  for (const char* name : {"one", "two"}) {
    const json job = {{"teacher", (dir / "teacher").string()}, {"manifest", (dir / "manifest.json").string()},
                      {"output", (dir / name).string()}, {"seed", 5}, {"data", json::array({{{"bin", (dir / "corpus.bin").string()}}})},
                      {"stages", json::array({{{"name", "align"}, {"steps", 3}, {"lr", 3e-3}, {"seq_len", 16}, {"batch", 4},
                                               {"grad_accum", 2}, {"eval_batches", 1}},
                                              {{"name", "distil"}, {"steps", 3}, {"lr", 1e-3}, {"seq_len", 16}, {"batch", 4},
                                               {"eval_batches", 1}, {"activation_checkpointing", true}},
                                              {{"name", "finetune"}, {"steps", 2}, {"lr", 1e-3}, {"seq_len", 16}, {"batch", 2},
                                               {"eval_batches", 1}}})}};
    std::ofstream(dir / (std::string(name) + ".json")) << job.dump(2);
  }
  Result r = train(dir / "one.json", "");
  ASSERT_EQ(r.status, 0) << r.output;
  r = train(dir / "two.json", "--nproc-per-node 2 --bucket-mb 0.01");
  ASSERT_EQ(r.status, 0) << r.output;
  expect_close(column(dir / "one/run.h5", "/train/loss"), column(dir / "two/run.h5", "/train/loss"), 1e-4, "loss");
  expect_close(column(dir / "one/run.h5", "/train/grad_norm"), column(dir / "two/run.h5", "/train/grad_norm"), 1e-4, "gradient norm");
  EXPECT_EQ(column(dir / "two/run.h5", "/train/loss").size(), 8u);
  EXPECT_LT(max_diff(dir / "one/model/model.safetensors", dir / "two/model/model.safetensors"), 1e-4);
}

TEST(DistTrain, ABatchThatDoesNotSplitOverTheRanksIsRefusedNamingTheField) {
  const fs::path dir = hh::test::scratch_dir("dist_train_batch");
  const fs::path job = make_pretrain_job(dir, 2, 0);
  const Result r = train(job, "--nproc-per-node 3");
  EXPECT_NE(r.status, 0);
  EXPECT_MENTIONS(r.output, "stages[0].batch (4) must be a multiple of the number of ranks (3)");
  EXPECT_FALSE(fs::exists(dir / "run/checkpoints/LATEST"));
}

// ---- faults --------------------------------------------------------------------------------------

pid_t spawn_shell(const std::string& cmd) {
  const std::string sh = "/bin/sh", c = "-c";
  char* argv[] = {const_cast<char*>(sh.c_str()), const_cast<char*>(c.c_str()), const_cast<char*>(cmd.c_str()), nullptr};
  pid_t pid = 0;
  EXPECT_EQ(posix_spawn(&pid, sh.c_str(), nullptr, nullptr, argv, environ), 0);
  return pid;
}

// The pid of the rank `rank` among the children of the launcher `launcher` (by their RANK variable).
pid_t rank_pid(pid_t launcher, int rank) {
  std::ifstream in("/proc/" + std::to_string(launcher) + "/task/" + std::to_string(launcher) + "/children");
  pid_t child = 0;
  while (in >> child) {
    std::ifstream env("/proc/" + std::to_string(child) + "/environ", std::ios::binary);
    std::string var;
    while (std::getline(env, var, '\0'))
      if (var == "RANK=" + std::to_string(rank)) return child;
  }
  return -1;
}

// Waits for `pid` up to `limit_s`; returns its wait status, or -1 (and kills it) on time-out.
int wait_for(pid_t pid, double limit_s, double* took_s) {
  const auto t0 = std::chrono::steady_clock::now();
  while (true) {
    int st = 0;
    if (waitpid(pid, &st, WNOHANG) == pid) {
      *took_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      return st;
    }
    if (std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() > limit_s) {
      kill(pid, SIGKILL);
      waitpid(pid, &st, 0);
      return -1;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
}

std::string read_all(const fs::path& p) {
  std::ifstream in(p);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

// Starts a long 2-rank job and returns the launcher's pid once a checkpoint exists.
pid_t start_long_job(const fs::path& dir, const std::string& extra) {
  const fs::path job = make_pretrain_job(dir, 100000, 2);
  const pid_t pid = spawn_shell("exec " + hydrahead() + " train --job " + job.string() + " --progress none --nproc-per-node 2 " +
                                extra + " > " + (dir / "out.txt").string() + " 2>&1");
  for (int i = 0; i < 1200 && !fs::exists(dir / "run/checkpoints/LATEST"); ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  return pid;
}

// The checkpoint LATEST names is whole: it resumes (one more step, on one process).
void expect_last_checkpoint_resumes(const fs::path& dir) {
  const std::string name = latest(dir / "run");
  ASSERT_FALSE(name.empty());
  EXPECT_TRUE(fs::exists(dir / "run/checkpoints" / name / "state.json"));
  const Result r = train(dir / "job.json", "--max-steps 1");
  EXPECT_EQ(r.status, 0) << r.output;
}

TEST(DistFaults, AKilledRankEndsTheJobNamingItAndTheLastCheckpointResumes) {
  const fs::path dir = hh::test::scratch_dir("dist_kill");
  const pid_t launcher = start_long_job(dir, "--dist-timeout 60");
  ASSERT_TRUE(fs::exists(dir / "run/checkpoints/LATEST")) << read_all(dir / "out.txt");
  const pid_t victim = rank_pid(launcher, 1);
  ASSERT_GT(victim, 0);
  ASSERT_EQ(kill(victim, SIGKILL), 0);
  double took = 0;
  const int st = wait_for(launcher, 30, &took);
  const std::string out = read_all(dir / "out.txt");
  ASSERT_NE(st, -1) << "the job did not end within 30 s of a rank's death\n" << out;
  EXPECT_TRUE(WIFEXITED(st) && WEXITSTATUS(st) == 128 + SIGKILL) << out;
  EXPECT_MENTIONS(out, "rank 1 (pid " + std::to_string(victim) + ") was killed by signal 9");
  EXPECT_EQ(rank_pid(launcher, 0), -1);
  expect_last_checkpoint_resumes(dir);
}

TEST(DistFaults, AHungRankIsNamedByTheOthersAfterTheTimeout) {
  const fs::path dir = hh::test::scratch_dir("dist_hang");
  const pid_t launcher = start_long_job(dir, "--dist-timeout 4");
  ASSERT_TRUE(fs::exists(dir / "run/checkpoints/LATEST")) << read_all(dir / "out.txt");
  const pid_t victim = rank_pid(launcher, 1);
  ASSERT_GT(victim, 0);
  ASSERT_EQ(kill(victim, SIGSTOP), 0);
  double took = 0;
  const int st = wait_for(launcher, 40, &took);
  const std::string out = read_all(dir / "out.txt");
  ASSERT_NE(st, -1) << "the job did not end after the collective timeout\n" << out;
  EXPECT_TRUE(WIFEXITED(st) && WEXITSTATUS(st) != 0) << out;
  // Rank 0 gives up after --dist-timeout and names rank 1; the launcher then stops rank 1.
  EXPECT_MENTIONS(out, "rank 0 of 2");
  EXPECT_MENTIONS(out, "rank 1 (at collective #");
  EXPECT_MENTIONS(out, "rank 0 (pid");
  EXPECT_LT(took, 4 + 10 + 10) << out;   // timeout + grace + start-up slack
  expect_last_checkpoint_resumes(dir);
}

// ---- analysis ------------------------------------------------------------------------------------

// n copy-style examples over a vocabulary of 64: the answer repeats the needle at [3, 6).
void write_calib(const fs::path& path, int n, int len) {
  std::ofstream out(path);
  uint64_t x = 11;
  auto next = [&] {
    x = x * 6364136223846793005ULL + 1442695040888963407ULL;
    return static_cast<int64_t>((x >> 33) % 64);
  };
  for (int i = 0; i < n; ++i) {
    std::vector<int64_t> clean(static_cast<size_t>(len));
    for (auto& t : clean) t = next();
    std::vector<int64_t> corrupt = clean;
    for (int k = 3; k < 6; ++k) corrupt[static_cast<size_t>(k)] = (clean[static_cast<size_t>(k)] + 5) % 64;
    const json j = {{"task", i % 2 ? "niah_single" : "passkey"}, {"clean_ids", clean}, {"corrupt_ids", corrupt},
                    {"answer_ids", {clean[3], clean[4], clean[5]}}, {"wrong_ids", {corrupt[3]}}, {"meta", {{"needle", {3, 6}}}}};
    out << j.dump() << "\n";
  }
}

const char* const kAnalysisDatasets[] = {
    "/examples/metric_clean", "/examples/metric_corrupt", "/examples/first_difference", "/examples/kept",
    "/activation/noising/metric_patched", "/activation/noising/effect", "/activation/noising/layer_metric_patched",
    "/activation/noising/layer_effect", "/attribution/noising/metric_estimate", "/attribution/noising/effect",
    "/path/metric_patched", "/path/effect", "/retrieval/score", "/similarity/cosine_delta", "/similarity/cka",
    "/similarity/angular"};

// Bytes of a tensor (NaN compares by its bits).
std::vector<uint8_t> bytes_of(const at::Tensor& t) {
  const at::Tensor c = t.contiguous();
  const auto* p = static_cast<const uint8_t*>(c.data_ptr());
  return std::vector<uint8_t>(p, p + c.numel() * static_cast<int64_t>(c.element_size()));
}

class DistAnalyze : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = hh::test::scratch_dir("dist_analyze");
    const auto cfg = hh::test::tiny_config(3, 4, 2, 8, 32, 48, 64);
    hh::model::save_model(dir_ / "model", cfg, hh::model::random_weights(cfg, 5, at::kFloat, 0.3));
  }
  Result analyze(int examples, const std::string& out, const std::string& methods, const std::string& extra) {
    write_calib(dir_ / "calib.jsonl", examples, 12);
    return run_command(hydrahead() + " analyze --model " + (dir_ / "model").string() + " --calib " + (dir_ / "calib.jsonl").string() +
               " --method " + methods + " --out " + (dir_ / out).string() + " " + extra);
  }
  fs::path dir_;
};

TEST_F(DistAnalyze, TwoRanksWriteTheSameDatasetsAsOneProcess) {
  Result r = analyze(5, "one.h5", "all", "");
  ASSERT_EQ(r.status, 0) << r.output;
  r = analyze(5, "two.h5", "all", "--nproc-per-node 2");
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_MENTIONS(r.output, "wrote " + (dir_ / "two.h5").string());
  const auto a = hh::io::H5File::open_read(dir_ / "one.h5"), b = hh::io::H5File::open_read(dir_ / "two.h5");
  EXPECT_EQ(a.list("/"), b.list("/"));
  for (const char* ds : kAnalysisDatasets) {
    const at::Tensor x = a.read(ds), y = b.read(ds);
    EXPECT_EQ(x.sizes(), y.sizes()) << ds;
    EXPECT_EQ(x.scalar_type(), y.scalar_type()) << ds;
    EXPECT_TRUE(bytes_of(x) == bytes_of(y)) << ds << " differs";
  }
  EXPECT_EQ(a.read_strings("/examples/task"), b.read_strings("/examples/task"));
  EXPECT_GT(a.read("/activation/noising/effect").abs().nan_to_num(0).max().item<double>(), 0.0);
}

TEST_F(DistAnalyze, FewerExamplesThanRanksSplitTheHeadsAndAgree) {
  Result r = analyze(1, "one.h5", "activation,path", "");
  ASSERT_EQ(r.status, 0) << r.output;
  r = analyze(1, "two.h5", "activation,path", "--nproc-per-node 2");
  ASSERT_EQ(r.status, 0) << r.output;
  const auto a = hh::io::H5File::open_read(dir_ / "one.h5"), b = hh::io::H5File::open_read(dir_ / "two.h5");
  for (const char* ds : {"/activation/noising/metric_patched", "/path/metric_patched", "/examples/metric_clean"}) {
    const at::Tensor x = a.read(ds).to(at::kDouble), y = b.read(ds).to(at::kDouble);
    EXPECT_TRUE(at::allclose(x, y, 1e-5, 1e-6)) << ds << ": max |diff| " << (x - y).abs().max().item<double>();
    EXPECT_FALSE(at::isnan(y).any().item<bool>()) << ds << ": every head was swept by some rank";
  }
}

}  // namespace
