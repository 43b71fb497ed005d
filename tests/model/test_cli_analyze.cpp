// `hydrahead analyze` end to end on a real checkpoint directory and calibration file: the file has
// DESIGN section 7's layout (read back here and by h5py), holds what the in-process engine computes,
// grows when methods are added, refuses other models and calibration sets, and Ctrl-C leaves nothing.
#include <torch/torch.h>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <array>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <thread>

#include "core/interp/analysis.h"
#include "core/io/fingerprint.h"
#include "core/io/h5.h"
#include "core/model/transformer.h"
#include "core/select/manifest.h"
#include "support/test_support.h"
#include "support/tiny_config.h"

namespace {

namespace fs = std::filesystem;
using hh::model::ModelConfig;
using hh::model::Transformer;

using Result = hh::test::CommandResult;
using hh::test::run_command;

std::string hydrahead() { return (hh::test::bin_dir() / "hydrahead").string(); }

ModelConfig tiny_config() {
  return hh::test::tiny_config(3, 4, 2, 8, 32, 48, 64);
}

// n copy-style examples: the answer repeats the needle at [3, 6); corrupt changes the needle.
void write_calib(const fs::path& path, int n, int len, uint64_t seed) {
  std::ofstream out(path);
  std::srand(static_cast<unsigned>(seed));
  for (int i = 0; i < n; ++i) {
    std::vector<int64_t> clean(static_cast<size_t>(len));
    for (auto& t : clean) t = std::rand() % 64;
    std::vector<int64_t> corrupt = clean;
    for (int k = 3; k < 6; ++k) corrupt[static_cast<size_t>(k)] = (clean[static_cast<size_t>(k)] + 5) % 64;
    const std::vector<int64_t> answer = {clean[3], clean[4], clean[5]};
    nlohmann::json j = {{"task", i % 2 ? "niah_single" : "passkey"},
                        {"clean_ids", clean},
                        {"corrupt_ids", corrupt},
                        {"answer_ids", answer},
                        {"wrong_ids", {corrupt[3]}},
                        {"meta", {{"needle", {3, 6}}}}};
    out << j.dump() << "\n";
  }
}

class CliAnalyze : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = hh::test::scratch_dir("cli_analyze");
    cfg_ = tiny_config();
    weights_ = hh::model::random_weights(cfg_, 5, torch::kFloat32, 0.3);
    hh::model::save_model(dir_ / "model", cfg_, weights_);
    write_calib(dir_ / "calib.jsonl", 4, 12, 1);
  }
  std::string base_args() const {
    return hydrahead() + " analyze --model " + (dir_ / "model").string() + " --calib " + (dir_ / "calib.jsonl").string();
  }
  fs::path dir_;
  ModelConfig cfg_;
  hh::model::Weights weights_;
};

TEST_F(CliAnalyze, WritesTheDesignLayoutWithTheEnginesNumbersAndGrowsWhenMethodsAreAdded) {
  const fs::path out = dir_ / "analysis.h5";
  auto r = run_command(base_args() + " --method activation,attribution --out " + out.string());
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("activation noising effect (top"), std::string::npos) << r.output;

  {
    const auto f = hh::io::H5File::open_read(out);
    EXPECT_EQ(f.attr_string("/", "format"), "hydrahead-analysis");
    EXPECT_EQ(f.attr_int("/", "format_version"), 1);
    EXPECT_EQ(f.attr_string("/", "model_fingerprint"), hh::io::model_fingerprint(dir_ / "model"));
    EXPECT_EQ(f.attr_string("/", "calib_sha256"), hh::interp::calibration_sha256(dir_ / "calib.jsonl"));
    EXPECT_NE(f.attr_string("/", "config_json").find("\"num_hidden_layers\""), std::string::npos);
    EXPECT_EQ(f.shape("/examples/metric_clean"), (std::vector<int64_t>{4}));
    EXPECT_EQ(f.read_strings("/examples/task"), (std::vector<std::string>{"passkey", "niah_single", "passkey", "niah_single"}));
    EXPECT_EQ(f.shape("/activation/noising/metric_patched"), (std::vector<int64_t>{4, 3, 4}));
    EXPECT_EQ(f.dim_labels("/activation/noising/metric_patched"), (std::vector<std::string>{"example", "layer", "head"}));
    EXPECT_EQ(f.shape("/activation/noising/effect"), (std::vector<int64_t>{3, 4}));
    EXPECT_EQ(f.shape("/activation/noising/layer_effect"), (std::vector<int64_t>{3, 3}));
    EXPECT_EQ(f.shape("/attribution/noising/metric_estimate"), (std::vector<int64_t>{4, 3, 4}));
    EXPECT_FALSE(f.exists("/similarity"));

    // The same numbers as the engine in this process.
    const Transformer model(cfg_, weights_);
    hh::interp::AnalyzeOptions o;
    o.activation = o.attribution = true;
    const auto examples = hh::interp::read_calibration(dir_ / "calib.jsonl");
    const auto res = hh::interp::run_analysis(model, examples, o);
    EXPECT_TRUE(at::allclose(f.read("/activation/noising/effect"), res.act_effect, 1e-4, 1e-5));
    EXPECT_TRUE(at::allclose(f.read("/attribution/noising/effect"), res.attr_effect, 1e-4, 1e-5));
    EXPECT_TRUE(at::allclose(f.read("/examples/metric_clean"), res.metric_clean, 1e-6, 1e-6));
    // Effect = mean over examples of the normalised per-example effect, recomputed from the file.
    const at::Tensor patched = f.read("/activation/noising/metric_patched").to(at::kDouble);  // [N, L, H]
    const at::Tensor mc = f.read("/examples/metric_clean").view({4, 1, 1});
    const at::Tensor mk = f.read("/examples/metric_corrupt").view({4, 1, 1});
    const at::Tensor by_hand = ((mc - patched) / (mc - mk)).mean(0).to(at::kFloat);
    EXPECT_TRUE(at::allclose(f.read("/activation/noising/effect"), by_hand, 1e-4, 1e-5));
  }

  r = run_command(base_args() + " --method similarity,retrieval,path --mode denoising --out " + out.string());
  ASSERT_EQ(r.status, 0) << r.output;
  {
    const auto f = hh::io::H5File::open_read(out);
    EXPECT_TRUE(f.exists("/activation/noising/effect")) << "earlier methods are kept";
    EXPECT_EQ(f.shape("/similarity/cka"), (std::vector<int64_t>{3, 3}));
    EXPECT_EQ(f.shape("/retrieval/score"), (std::vector<int64_t>{3, 4}));
    EXPECT_EQ(f.attr_int("/retrieval", "n_examples"), 4);
    EXPECT_EQ(f.shape("/path/effect"), (std::vector<int64_t>{3, 4}));
    EXPECT_EQ(f.attr_string("/path", "receivers"), "logits");
  }

  // h5py reads everything, with the dimension labels.
  const std::string py =
      "import h5py,sys\n"
      "f=h5py.File(sys.argv[1],'r')\n"
      "assert f.attrs['format']=='hydrahead-analysis', f.attrs['format']\n"
      "d=f['activation/noising/metric_patched']\n"
      "assert d.shape==(4,3,4) and [x.label for x in d.dims]==['example','layer','head'], d\n"
      "assert list(f['examples/task'].asstr()[:])==['passkey','niah_single','passkey','niah_single']\n"
      "for k in ['cosine_delta','cka','angular']: assert f['similarity/'+k].shape==(3,3)\n"
      "print('h5py ok')\n";
  std::ofstream(dir_ / "check.py") << py;
  const std::string python = hh::test::python_with_h5py();
  ASSERT_FALSE(python.empty()) << "h5py is not importable by python3 or /usr/bin/python3 (scripts/test installs python3-h5py)";
  r = run_command(python + " " + (dir_ / "check.py").string() + " " + out.string());
  EXPECT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("h5py ok"), std::string::npos) << r.output;
}

TEST_F(CliAnalyze, RefusesAnotherModelOrCalibrationSetAndLeavesTheFileAlone) {
  const fs::path out = dir_ / "analysis.h5";
  ASSERT_EQ(run_command(base_args() + " --method attribution --out " + out.string()).status, 0);
  const auto before = fs::last_write_time(out);
  const auto size = fs::file_size(out);

  write_calib(dir_ / "other.jsonl", 3, 12, 2);
  auto r = run_command(hydrahead() + " analyze --model " + (dir_ / "model").string() + " --calib " + (dir_ / "other.jsonl").string() +
               " --method attribution --out " + out.string());
  EXPECT_EQ(r.status, 1);
  EXPECT_MENTIONS(r.output, "another calibration set");

  // The fingerprint covers config.json and the safetensors headers: another architecture.
  ModelConfig other = cfg_;
  other.rope_theta = 5000.0;
  hh::model::save_model(dir_ / "model2", other, hh::model::random_weights(other, 6, torch::kFloat32, 0.3));
  r = run_command(hydrahead() + " analyze --model " + (dir_ / "model2").string() + " --calib " + (dir_ / "calib.jsonl").string() +
          " --method attribution --out " + out.string());
  EXPECT_EQ(r.status, 1);
  EXPECT_MENTIONS(r.output, "another model");

  r = run_command(base_args() + " --method attribution --metric logit-diff --out " + out.string());
  EXPECT_EQ(r.status, 1);
  EXPECT_MENTIONS(r.output, "holds metric logprob");
  EXPECT_EQ(fs::last_write_time(out), before);
  EXPECT_EQ(fs::file_size(out), size);

  r = run_command(base_args() + " --method activation --heads 0:9 --out " + (dir_ / "x.h5").string());
  EXPECT_EQ(r.status, 1);
  EXPECT_MENTIONS(r.output, "head 9 outside [0, 4)");
  r = run_command(base_args() + " --method everything --out " + (dir_ / "x.h5").string());
  EXPECT_EQ(r.status, 1);
  EXPECT_MENTIONS(r.output, "unknown method 'everything'");
  EXPECT_FALSE(fs::exists(dir_ / "x.h5"));
}

TEST_F(CliAnalyze, SelectTurnsTheAnalysisIntoAManifestThatFitsTheModel) {
  const fs::path out = dir_ / "analysis.h5";
  ASSERT_EQ(run_command(base_args() + " --method activation,path --out " + out.string()).status, 0);
  const fs::path manifest = dir_ / "manifest.json";
  auto r = run_command(hydrahead() + " select --analysis " + out.string() + " --model " + (dir_ / "model").string() +
               " --ratio 3:1 --retrieval-tasks passkey --compare --out " + manifest.string());
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_MENTIONS(r.output, "FA heads per layer (3 of 12)");
  EXPECT_MENTIONS(r.output, "512K");
  EXPECT_MENTIONS(r.output, "overlap with baselines");
  const auto m = hh::select::read_manifest(manifest);
  EXPECT_EQ(m.fa_heads.size(), 3u);  // round(12 / 4)
  EXPECT_EQ(m.model.fingerprint, hh::io::model_fingerprint(dir_ / "model"));
  EXPECT_EQ(m.ratio_la, 3);
  EXPECT_EQ(m.notes.at("budget").size(), 12u);  // 3 contexts x (dense, layer-wise, random, selection)
  EXPECT_MENTIONS(r.output, "random (seed 0)");

  r = run_command(hydrahead() + " select --validate " + manifest.string() + " --model " + (dir_ / "model").string());
  EXPECT_EQ(r.status, 0) << r.output;
  // Another architecture: refused, naming the field.
  ModelConfig other = cfg_;
  other.num_hidden_layers = 4;
  hh::model::save_model(dir_ / "deeper", other, hh::model::random_weights(other, 1, torch::kFloat32, 0.3));
  r = run_command(hydrahead() + " select --validate " + manifest.string() + " --model " + (dir_ / "deeper").string());
  EXPECT_EQ(r.status, 1);
  EXPECT_MENTIONS(r.output, "model.num_layers is 3, this model's is 4");
  r = run_command(hydrahead() + " select --analysis " + out.string() + " --ratio 3 --weights path=1,bogus=2 --out " +
          (dir_ / "x.json").string());
  EXPECT_EQ(r.status, 1);
  EXPECT_MENTIONS(r.output, "unknown signal 'bogus'");
  EXPECT_FALSE(fs::exists(dir_ / "x.json"));
}

TEST_F(CliAnalyze, CtrlCStopsCleanlyAndWritesNothing) {
  // Enough reference work to still be running when the signal arrives.
  write_calib(dir_ / "big.jsonl", 400, 40, 3);
  const fs::path out = dir_ / "interrupted.h5";
  const fs::path log = dir_ / "stderr.txt";
  const pid_t pid = fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    FILE* e = std::freopen(log.c_str(), "w", stderr);
    (void)e;
    const std::string bin = hydrahead();
    execl(bin.c_str(), bin.c_str(), "analyze", "--model", (dir_ / "model").c_str(), "--calib", (dir_ / "big.jsonl").c_str(),
          "--method", "activation", "--reference", "--out", out.c_str(), static_cast<char*>(nullptr));
    _exit(127);
  }
  // Wait until the analysis has started (the model is loaded and the handler installed).
  for (int i = 0; i < 600; ++i) {
    std::ifstream in(log);
    std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    if (text.find("analyzing") != std::string::npos) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  kill(pid, SIGINT);
  int status = 0;
  waitpid(pid, &status, 0);
  ASSERT_TRUE(WIFEXITED(status)) << "killed by a signal instead of stopping cleanly";
  EXPECT_EQ(WEXITSTATUS(status), 130);
  std::ifstream in(log);
  const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  EXPECT_MENTIONS(text, "interrupted: nothing was written");
  EXPECT_FALSE(fs::exists(out));
  for (const auto& e : fs::directory_iterator(dir_))
    EXPECT_EQ(e.path().filename().string().find(".tmp."), std::string::npos) << e.path();
}

TEST_F(CliAnalyze, ACancelRaisedBeforeTheStartStopsWhileTheModelLoads) {
  hh::interp::AnalyzeCheckpoint job;
  job.model_dir = dir_ / "model";
  job.calib = dir_ / "calib.jsonl";
  job.out = dir_ / "cancelled.h5";
  job.options.activation = true;
  std::atomic<bool> cancel{true};
  job.options.cancel = &cancel;
  bool announced = false;  // "analyzing ..." comes once the model is loaded
  EXPECT_THROW(hh::interp::analyze_checkpoint(job, [&](const std::string&) { announced = true; }), hh::Cancelled);
  EXPECT_FALSE(announced);
  EXPECT_FALSE(fs::exists(job.out));
  cancel = false;  // the same job, not cancelled, runs and writes the file
  hh::interp::analyze_checkpoint(job, [&](const std::string&) { announced = true; });
  EXPECT_TRUE(announced);
  EXPECT_TRUE(fs::exists(job.out));
}

}  // namespace
