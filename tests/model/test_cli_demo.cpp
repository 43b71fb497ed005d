// `hydrahead demo` end to end on a tiny random teacher (the bundled demo model's pipeline, small sizes):
// every artifact is there, summary.json agrees with eval.h5, and a failing step leaves nothing behind.
#include <torch/torch.h>

#include <gtest/gtest.h>

#include <cstdlib>
#include <fstream>

#include <nlohmann/json.hpp>

#include "core/attention/hybrid_model.h"
#include "core/io/h5.h"
#include "core/model/transformer.h"
#include "core/select/manifest.h"
#include "support/test_support.h"
#include "support/tiny_config.h"

namespace {

namespace fs = std::filesystem;

fs::path tiny_teacher(const fs::path& dir) {
  const auto cfg = hh::test::tiny_config(2, 4, 2, 8, 32, 64, 302);
  hh::model::save_model(dir, cfg, hh::model::random_weights(cfg, 21, at::kFloat, 0.05));
  fs::copy_file(hh::test::data_dir() / "tokenizer/tiny-tokenizer.json", dir / "tokenizer.json");
  return dir;
}

int hydrahead(const std::string& args) {
  const std::string cmd = (hh::test::bin_dir() / "hydrahead").string() + " " + args + " > /dev/null 2>&1";
  const int rc = std::system(cmd.c_str());
  return WIFEXITED(rc) ? WEXITSTATUS(rc) : -1;
}

TEST(CliDemo, RunsThePipelineAndSummarises) {
  const fs::path dir = hh::test::scratch_dir("cli_demo");
  const fs::path teacher = tiny_teacher(dir / "teacher"), out = dir / "demo";
  ASSERT_EQ(hydrahead("demo --model " + teacher.string() + " --out " + out.string() +
                      " --length 600 --n 2 --train-steps 2 --eval-n 1"), 0);
  for (const char* f : {"calib.jsonl", "analysis.h5", "manifest.json", "job.json", "run.h5", "eval.h5", "summary.json",
                        "hybrid/config.json", "hybrid/tokenizer.json"})
    EXPECT_TRUE(fs::exists(out / f)) << f;
  EXPECT_FALSE(fs::exists(out / "train")) << "the training run's scratch is cleaned up";

  const auto manifest = hh::select::read_manifest(out / "manifest.json");
  EXPECT_EQ(manifest.fa_heads.size(), 1u) << "8 heads at 7:1";
  const auto hybrid = hh::attention::HybridModel::load(out / "hybrid");
  EXPECT_EQ(hybrid.options().fa_heads, manifest.fa_heads);

  std::ifstream in(out / "summary.json");
  const auto summary = nlohmann::json::parse(in);
  EXPECT_EQ(summary["ratio"], "7:1");
  auto eval = hh::io::H5File::open_read(out / "eval.h5");
  for (const char* who : {"teacher", "hybrid"}) {
    EXPECT_DOUBLE_EQ(summary[who]["niah_accuracy"].get<double>(),
                     eval.read(std::string("/") + who + "/niah/accuracy").mean().item<double>()) << who;
    EXPECT_DOUBLE_EQ(summary[who]["ppl"].get<double>(), eval.read(std::string("/") + who + "/ppl/ppl")[0].item<double>()) << who;
    EXPECT_GT(summary[who]["ppl"].get<double>(), 1.0) << who;
  }
  for (const char* step : {"calibration", "analysis", "selection", "training", "evaluation", "total"})
    EXPECT_GT(summary["seconds"][step].get<double>(), 0.0) << step;
  auto run = hh::io::H5File::open_read(out / "run.h5");
  EXPECT_EQ(run.read("/train/loss").size(0), 2 + 2 + 1);

  EXPECT_NE(hydrahead("demo --model " + teacher.string() + " --out " + out.string()), 0) << "an existing --out is refused";
}

TEST(CliDemo, AFailingStepLeavesNothingBehind) {
  const fs::path dir = hh::test::scratch_dir("cli_demo_fail");
  const fs::path teacher = tiny_teacher(dir / "teacher"), out = dir / "demo";
  // Too short for the tiny tokenizer's NIAH prompts: the calibration step fails.
  EXPECT_EQ(hydrahead("demo --model " + teacher.string() + " --out " + out.string() + " --length 100"), 1);
  for (const auto& e : fs::directory_iterator(dir)) EXPECT_EQ(e.path().filename(), "teacher") << e.path();
}

}  // namespace
