// Training on CUDA: every stage's loss and gradients equal the CPU's in float32, and a bf16 job
// (float32 masters) lowers its losses and resumes after an interruption.
#include <torch/torch.h>

#include <gtest/gtest.h>

#include <fstream>

#include <nlohmann/json.hpp>

#include "core/io/h5.h"
#include "core/jobs/job.h"
#include "core/train/trainer.h"
#include "support/test_support.h"
#include "support/tiny_config.h"

namespace {

namespace fs = std::filesystem;
using hh::jobs::StageKind;

hh::train::StageModels models_on(const hh::model::ModelConfig& c, torch::Device d, torch::Dtype t) {
  auto w = hh::model::random_weights(c, 4, torch::kFloat, 0.1);
  for (auto& e : hh::model::weight_table(c, w)) *e.slot = e.slot->to(d, t);
  hh::train::StageModels m;
  m.teacher.emplace(c, w);
  auto w2 = w;
  for (auto& e : hh::model::weight_table(c, w2)) *e.slot = e.slot->clone();
  hh::select::Manifest man;
  man.model = hh::select::shape_of(c);
  man.fa_heads = {{0, 1}, {1, 4}};
  hh::attention::ConvertOptions o;
  o.seed = 1;
  m.student.emplace(hh::attention::convert(hh::model::Transformer(c, w2), man, o));
  m.dense.emplace(c, w);
  return m;
}

TEST(CudaTrain, StageLossesAndGradientsMatchTheCpu) {
  ASSERT_TRUE(torch::cuda::is_available());
  const auto c = hh::test::tiny_config(2, 8, 2, 32, 128, 256, 300);
  const auto ids = torch::randint(300, {2, 97}, torch::TensorOptions().dtype(torch::kLong));
  for (StageKind kind : {StageKind::Align, StageKind::Distil, StageKind::Finetune, StageKind::Pretrain}) {
    auto cpu = models_on(c, torch::kCPU, torch::kFloat);
    auto gpu = models_on(c, torch::kCUDA, torch::kFloat);
    for (auto* m : {&cpu, &gpu}) {
      if (kind == StageKind::Pretrain) m->student.reset(), m->teacher.reset();
      else m->dense.reset();
    }
    const auto pc = hh::train::stage_params(cpu, kind);
    const auto pg = hh::train::stage_params(gpu, kind);
    ASSERT_EQ(pc.size(), pg.size());
    const double lc = hh::train::stage_loss(cpu, kind, ids, 1.0, true);
    const double lg = hh::train::stage_loss(gpu, kind, ids.to(torch::kCUDA), 1.0, true);
    EXPECT_NEAR(lg, lc, 1e-4 * std::max(1.0, std::abs(lc))) << hh::jobs::stage_kind_name(kind);
    double worst = 0;
    for (size_t i = 0; i < pc.size(); ++i) {
      ASSERT_TRUE(pc[i].tensor.grad().defined() && pg[i].tensor.grad().defined()) << pc[i].name;
      const auto gc = pc[i].tensor.grad(), gg = pg[i].tensor.grad().cpu();
      worst = std::max(worst, ((gg - gc).abs().max() / (gc.abs().max() + 1e-12)).item<double>());
    }
    EXPECT_LT(worst, 1e-3) << hh::jobs::stage_kind_name(kind);
  }
}

TEST(CudaTrain, Bf16JobLowersItsLossesAndResumes) {
  const fs::path dir = hh::test::scratch_dir("cuda_train");
  const auto cfg = hh::test::tiny_config(2, 8, 2, 32, 128, 256, 300);
  hh::model::save_model(dir / "teacher", cfg, hh::model::random_weights(cfg, 3, torch::kFloat, 0.05));
  std::ofstream(dir / "manifest.json") << R"({"format": "hydrahead-manifest", "format_version": 1,
    "model": {"architecture": "qwen3", "num_layers": 2, "num_heads": 8, "num_kv_heads": 2, "head_dim": 32},
    "fa_heads": [[0, 0], [1, 5]]})";
  {
    std::ofstream out(dir / "corpus.bin", std::ios::binary);
    for (uint32_t i = 0; i < 20000; ++i) {
      const uint32_t id = (i * 7 + (i / 13)) % 300;
      out.write(reinterpret_cast<const char*>(&id), 4);
    }
  }
  nlohmann::json j = {{"teacher", (dir / "teacher").string()}, {"manifest", (dir / "manifest.json").string()},
                      {"output", (dir / "run").string()}, {"device", "cuda"}, {"dtype", "bf16"},
                      {"data", {{{"bin", (dir / "corpus.bin").string()}}}},
                      {"stages", {{{"name", "align"}, {"steps", 30}, {"lr", 3e-3}, {"seq_len", 256}, {"batch", 4}},
                                  {{"name", "finetune"}, {"steps", 30}, {"lr", 2e-3}, {"seq_len", 256}, {"batch", 4}}}}};
  const auto spec = hh::jobs::JobSpec::parse(j, {}, "job.json");
  hh::train::TrainOptions o;
  o.max_steps = 40;
  ASSERT_EQ(hh::train::run_job(spec, o), hh::train::JobStatus::Interrupted);
  ASSERT_EQ(hh::train::run_job(spec, {}), hh::train::JobStatus::Completed);
  auto f = hh::io::H5File::open_read(dir / "run/run.h5");
  const auto loss = f.read("/train/loss");
  ASSERT_EQ(loss.size(0), 60);
  EXPECT_TRUE(torch::isfinite(loss).all().item<bool>());
  EXPECT_LT(loss.slice(0, 25, 30).mean().item<double>(), 0.5 * loss.slice(0, 0, 5).mean().item<double>()) << "align";
  EXPECT_LT(loss.slice(0, 55, 60).mean().item<double>(), 0.8 * loss.slice(0, 30, 35).mean().item<double>()) << "finetune";
  EXPECT_TRUE(fs::exists(dir / "run/model/config.json"));
}

}  // namespace
