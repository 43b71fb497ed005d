// hydrahead demo --out DIR [--model DIR] [--device cpu|cuda] [--length T] [--train-steps N]
// The whole pipeline on the bundled demo teacher: calibration sets, analysis, selection at 7:1, a short
// three-stage training of the converted hybrid, evaluation of teacher and hybrid, summary.json. Every
// step is the real sub-command, run as a child process of this binary, so the files are exactly what
// the CLI writes.
#include <torch/torch.h>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <fcntl.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>

#include "app/cli/commands.h"
#include "core/interp/calibration.h"
#include "core/io/h5.h"
#include "core/io/safetensors.h"
#include "core/util/error.h"
#include "core/util/files.h"
#include "hydrahead/version.h"

extern char** environ;

namespace hh::cli {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

struct DemoArgs {
  std::string out, model, device = "cpu";
  int64_t length = 512, n = 8, train_steps = 40, eval_n = 5;
  uint64_t seed = 0;
};

fs::path self_exe() {
  std::error_code ec;
  const fs::path p = fs::read_symlink("/proc/self/exe", ec);
  if (ec) throw Error("cannot locate the running hydrahead binary: " + ec.message());
  return p;
}

// The bundled demo teacher: $HYDRAHEAD_DEMO_MODEL, else datasets/models/hydrahead-demo of the source tree
// the binary was built in, else the installation's share/hydrahead/models/hydrahead-demo.
fs::path default_demo_model() {
  if (const char* env = std::getenv("HYDRAHEAD_DEMO_MODEL"); env && *env) return env;
  const fs::path bin = self_exe().parent_path();
  for (const fs::path& p : {bin / "../../datasets/models/hydrahead-demo", bin / "../share/hydrahead/models/hydrahead-demo"})
    if (fs::is_regular_file(p / "config.json")) return fs::weakly_canonical(p);
  throw Error("the demo model is not where it is expected (datasets/models/hydrahead-demo next to the build, or "
              "share/hydrahead/models/hydrahead-demo); pass --model DIR or set HYDRAHEAD_DEMO_MODEL");
}

// Runs `hydrahead ARGS...` as a child process with this process's stdout and stderr; throws when it fails.
void run_step(const std::vector<std::string>& args) {
  const std::string exe = self_exe().string();
  std::vector<char*> argv{const_cast<char*>(exe.c_str())};
  for (const auto& a : args) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  pid_t pid = 0;
  if (posix_spawn(&pid, exe.c_str(), nullptr, nullptr, argv.data(), environ) != 0)
    throw Error("cannot start " + exe);
  int status = 0;
  while (::waitpid(pid, &status, 0) < 0 && errno == EINTR) {
  }
  if (WIFEXITED(status) && WEXITSTATUS(status) == 0) return;
  std::string cmd = "hydrahead";
  for (const auto& a : args) cmd += " " + a;
  if (WIFEXITED(status) && WEXITSTATUS(status) == kExitInterrupted) throw Cancelled();
  throw Error("demo step failed (" + (WIFEXITED(status) ? "exit status " + std::to_string(WEXITSTATUS(status))
                                                          : "signal " + std::to_string(WTERMSIG(status))) + "): " + cmd);
}

double now_s() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }

int run_demo(const DemoArgs& a) {
  const fs::path out = a.out;
  if (fs::exists(out)) throw Error("--out " + a.out + ": already exists; choose a new directory");
  if (a.length < 64 || a.n < 1 || a.train_steps < 1 || a.eval_n < 1)
    throw Error("--length must be >= 64 and --n, --train-steps, --eval-n >= 1");
  const fs::path model = a.model.empty() ? default_demo_model() : fs::path(a.model);
  if (!fs::is_regular_file(model / "config.json")) throw Error("--model " + model.string() + ": no config.json there");
  const std::string dtype = a.device == "cpu" ? "f32" : "bf16";
  const fs::path work = out.string() + ".tmp." + std::to_string(::getpid());
  fs::create_directories(work);
  const std::string W = work.string(), M = model.string(), L = std::to_string(a.length);
  std::map<std::string, double> seconds;
  const double t_all = now_s();
  auto step = [&](const char* name, int k, const std::function<void()>& body) {
    std::fprintf(stderr, "\n== [%d/5] %s\n", k, name);
    const double t0 = now_s();
    body();
    seconds[name] = now_s() - t0;
  };
  try {
    step("calibration", 1, [&] {
      // Retrieval and reasoning pairs of the same length, in one file.
      run_step({"tasks", "generate", "--task", "niah-single", "--model", M, "--n", std::to_string(a.n), "--length", L,
                "--seed", std::to_string(a.seed), "--out", W + "/calib-retrieval.jsonl"});
      run_step({"tasks", "generate", "--task", "variable-tracking", "--model", M, "--n", std::to_string(a.n), "--length", L,
                "--seed", std::to_string(a.seed), "--out", W + "/calib-reasoning.jsonl"});
      std::ofstream calib(work / "calib.jsonl");
      for (const char* part : {"calib-retrieval.jsonl", "calib-reasoning.jsonl"}) {
        std::ifstream in(work / part);
        calib << in.rdbuf();
      }
      fs::remove(work / "calib-retrieval.jsonl");
      fs::remove(work / "calib-reasoning.jsonl");
    });
    step("analysis", 2, [&] {
      run_step({"analyze", "--model", M, "--calib", W + "/calib.jsonl", "--method", "activation,attribution,similarity",
                "--device", a.device, "--dtype", dtype, "--out", W + "/analysis.h5"});
    });
    step("selection", 3, [&] {
      run_step({"select", "--analysis", W + "/analysis.h5", "--model", M, "--ratio", "7", "--compare", "--out",
                W + "/manifest.json"});
    });
    step("training", 4, [&] {
      // Held-out text for perplexity: the calibration prompts as a token stream (they come from seeds
      // the training data never uses).
      const auto calib = interp::read_calibration(work / "calib.jsonl");
      std::string bytes;
      for (const auto& ex : calib)
        for (const int64_t id : ex.clean_ids)
          for (int b = 0; b < 4; ++b) bytes.push_back(static_cast<char>((static_cast<uint32_t>(id) >> (8 * b)) & 0xff));
      io::write_file_atomic(work / "heldout.bin", bytes);
      const int64_t seq = a.length + 32, steps = a.train_steps;
      const json task_params = {{"length", a.length}};
      const json needle_params = {{"length", a.length}, {"random_depth", true}};
      json job = {
          {"description", "hydrahead demo: a short three-stage transfer of the demo teacher at LA:FA 7:1"},
          {"teacher", M},
          {"manifest", W + "/manifest.json"},
          {"calib", W + "/calib.jsonl"},
          {"output", W + "/train"},
          {"device", a.device},
          {"dtype", dtype},
          {"seed", a.seed + 1},
          {"data", json::array({{{"task", "niah-single"}, {"params", needle_params}},
                                {{"task", "niah-multikey"}, {"params", needle_params}},
                                {{"task", "variable-tracking"}, {"params", task_params}},
                                {{"task", "induction"}, {"params", task_params}}})},
          {"stages", json::array({{{"name", "align"}, {"steps", steps}, {"lr", 2e-3}, {"warmup", steps / 10},
                                   {"seq_len", seq}, {"batch", 2}, {"eval_batches", 1}},
                                  {{"name", "distil"}, {"steps", steps}, {"lr", 5e-4}, {"warmup", steps / 10},
                                   {"seq_len", seq}, {"batch", 2}, {"eval_batches", 1}},
                                  {{"name", "finetune"}, {"steps", std::max<int64_t>(1, steps / 2)}, {"lr", 2e-4},
                                   {"seq_len", 2 * a.length}, {"batch", 1}, {"eval_batches", 1}}})}};
      io::write_file_atomic(work / "job.json", job.dump(2) + "\n");
      run_step({"train", "--job", W + "/job.json"});
      fs::rename(work / "train/model", work / "hybrid");
      fs::rename(work / "train/run.h5", work / "run.h5");
      util::remove_tree(work / "train");
    });
    step("evaluation", 5, [&] {
      for (const auto& [who, dir] : {std::pair<std::string, std::string>{"teacher", M}, {"hybrid", W + "/hybrid"}}) {
        run_step({"eval", "--model", dir, "--task", "niah-grid", "--lengths", L, "--depths", "0,0.5,1", "--n",
                  std::to_string(a.eval_n), "--device", a.device, "--dtype", dtype, "--seed", "777", "--out",
                  W + "/eval-" + who + ".h5"});
        run_step({"eval", "--model", dir, "--task", "ppl", "--data", W + "/heldout.bin", "--seq", L, "--device", a.device,
                  "--dtype", dtype, "--out", W + "/ppl-" + who + ".h5"});
      }
      // One eval.h5: each model's files under /teacher and /hybrid.
      io::H5File f = io::H5File::create(work / "eval.h5");
      f.set_attr("/", "format", "hydrahead-eval");
      f.set_attr("/", "format_version", int64_t{1});
      f.set_attr("/", "created_by", std::string("hydrahead ") + HYDRAHEAD_VERSION);
      for (const char* who : {"teacher", "hybrid"}) {
        for (const std::string part : {"eval-", "ppl-"}) {
          const fs::path src = work / (part + who + ".h5");
          auto in = io::H5File::open_read(src);
          const std::string group = part == "eval-" ? "niah" : "ppl";
          for (const auto& name : in.list("/" + group))
            f.write(std::string("/") + who + "/" + group + "/" + name, in.read("/" + group + "/" + name));
          in.close();
          fs::remove(src);
        }
      }
      f.commit();
    });
    // Mean NIAH accuracy over the grid and perplexity, per model.
    auto scores = [&](const std::string& who) {
      auto f = io::H5File::open_read(work / "eval.h5");
      return json{{"niah_accuracy", f.read("/" + who + "/niah/accuracy").mean().item<double>()},
                  {"ppl", f.read("/" + who + "/ppl/ppl")[0].item<double>()}};
    };
    seconds["total"] = now_s() - t_all;
    const json summary = {{"teacher", scores("teacher")},
                          {"hybrid", scores("hybrid")},
                          {"ratio", "7:1"},
                          {"model", M},
                          {"length", a.length},
                          {"seconds", seconds}};
    io::write_file_atomic(work / "summary.json", summary.dump(2) + "\n");
    fs::rename(work, out);
    std::printf("\n%s\n", summary.dump(2).c_str());
    std::fprintf(stderr, "demo done in %s: %s/{analysis.h5, manifest.json, hybrid/, run.h5, eval.h5, summary.json}\n",
                 format_seconds(seconds["total"]).c_str(), a.out.c_str());
  } catch (...) {
    util::remove_tree(work);
    throw;
  }
  return kExitOk;
}

}  // namespace

Runner add_demo(CLI::App& app) {
  auto a = std::make_shared<DemoArgs>();
  app.footer(
      "Steps, each a hydrahead sub-command: tasks generate (niah-single and variable-tracking pairs), analyze\n"
      "(activation, attribution, similarity), select (7:1, with the baselines), train (align, distil,\n"
      "finetune of the converted hybrid), eval (NIAH grid and perplexity of teacher and hybrid). DIR receives\n"
      "calib.jsonl, analysis.h5, manifest.json, job.json, hybrid/, run.h5, eval.h5 and summary.json; it\n"
      "appears only when every step has succeeded.");
  app.add_option("--out", a->out, "Directory to create")->required();
  app.add_option("--model", a->model, "Teacher checkpoint (default: the bundled demo model)");
  app.add_option("--device", a->device, "cpu or cuda")->capture_default_str();
  app.add_option("--length", a->length, "Prompt length of calibration, training tasks and NIAH")->capture_default_str();
  app.add_option("--n", a->n, "Calibration pairs per task")->capture_default_str();
  app.add_option("--train-steps", a->train_steps, "Steps of align and distil (finetune: half)")->capture_default_str();
  app.add_option("--eval-n", a->eval_n, "NIAH prompts per grid cell")->capture_default_str();
  app.add_option("--seed", a->seed, "Seed of every step")->capture_default_str();
  return [a] { return run_demo(*a); };
}

}  // namespace hh::cli
