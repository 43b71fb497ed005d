// Job specs: defaults, path resolution, and a refusal naming the field for each kind of mistake.
#include <fstream>

#include <nlohmann/json.hpp>

#include "core/jobs/job.h"
#include "support/test_support.h"

namespace hh::jobs {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

class JobSpecTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = test::scratch_dir("job_spec");
    fs::create_directories(dir_ / "teacher");
    std::ofstream(dir_ / "teacher/config.json") << "{}";
    std::ofstream(dir_ / "manifest.json") << "{}";
    std::ofstream(dir_ / "corpus.bin") << "";
    std::ofstream(dir_ / "config.json") << "{}";
  }
  json base() const {
    return json::parse(R"({
      "teacher": "teacher", "manifest": "manifest.json", "output": "runs/r1",
      "data": [{"bin": "corpus.bin"}],
      "stages": [{"name": "align", "steps": 10, "lr": 0.001, "seq_len": 64},
                 {"name": "distil", "steps": 5, "lr": 0.0001, "seq_len": 128, "batch": 2, "grad_accum": 4,
                  "schedule": "linear", "warmup": 2, "checkpoint_every": 5}]})");
  }
  std::string refusal(const json& j) const {
    return test::error_of([&] { JobSpec::parse(j, dir_, "job.json"); });
  }
  fs::path dir_;
};

TEST_F(JobSpecTest, ParsesWithDefaultsAndResolvesPaths) {
  const JobSpec s = JobSpec::parse(base(), dir_, "job.json");
  EXPECT_EQ(s.teacher, dir_ / "teacher");
  EXPECT_EQ(s.output, dir_ / "runs/r1");
  ASSERT_EQ(s.data.size(), 1u);
  EXPECT_EQ(s.data[0].kind, "bin");
  EXPECT_EQ(s.data[0].path, dir_ / "corpus.bin");
  ASSERT_EQ(s.stages.size(), 2u);
  EXPECT_EQ(s.stages[0].kind, StageKind::Align);
  EXPECT_EQ(s.stages[0].schedule, train::Schedule::Cosine);
  EXPECT_EQ(s.stages[0].batch, 1);
  EXPECT_DOUBLE_EQ(s.stages[0].clip, 1.0);
  EXPECT_EQ(s.stages[1].kind, StageKind::Distil);
  EXPECT_EQ(s.stages[1].tokens_per_step(), 128 * 2 * 4);
  EXPECT_EQ(s.stages[1].schedule, train::Schedule::Linear);
  EXPECT_FALSE(s.pretrain());
  EXPECT_EQ(s.find_stage("distil"), &s.stages[1]);
  EXPECT_EQ(s.sha256, JobSpec::parse(base(), dir_, "job.json").sha256);
  json changed = base();
  changed["stages"][0]["steps"] = 11;
  EXPECT_NE(s.sha256, JobSpec::parse(changed, dir_, "job.json").sha256);
}

TEST_F(JobSpecTest, RefusalsNameTheField) {
  struct Case {
    std::string pointer;   // JSON pointer of the change
    json value;            // null: remove the field
    std::string expect;    // the message must contain this
  };
  const std::vector<Case> cases = {
      {"/output", nullptr, "output: is required"},
      {"/stages/0/lr_rate", 0.1, "stages[0].lr_rate: unknown field"},
      {"/stages/0/steps", 0, "stages[0].steps: must be >= 1"},
      {"/stages/1/lr", "fast", "stages[1].lr: must be a number"},
      {"/stages/0/schedule", "cosin", "stages[0].schedule"},
      {"/stages/1/warmup", 5, "stages[1].warmup: must be smaller than steps"},
      {"/stages/0/seq_len", nullptr, "stages[0].seq_len: is required"},
      {"/stages/0/name", "distil", "stages[1].name: 'distil' is used twice"},
      {"/stages/0/name", "warmup", "stages[0].name"},
      {"/stages/0/batch", 1.5, "stages[0].batch: must be an integer"},
      {"/data/0/bin", "nope.bin", "data[0].bin: " },
      {"/data/0/task", "niah-single", "data[0]: needs exactly one of"},
      {"/data/0/weight", -1, "data[0].weight"},
      {"/data/0/loss", "answer", "data[0].loss: \"answer\" needs a task source"},
      {"/data/0/loss", "some", "data[0].loss: must be \"all\" or \"answer\""},
      {"/data", nullptr, "data: is required"},
      {"/hybrid", "teacher", "hybrid: give either"},
      {"/manifest", nullptr, "manifest: is required"},
      {"/teacher", nullptr, "teacher: is required"},
      {"/teacher", "nowhere", "teacher: "},
      {"/stages", json::array(), "stages: must be a non-empty array"},
      {"/model", json{{"config", "config.json"}}, "model: is only for pretrain jobs"},
      {"/extra", 1, "extra: unknown field"},
      {"/dtype", "fp8", "dtype: 'fp8' is not f32, bf16, f16, f64 or auto"},
  };
  for (const auto& c : cases) {
    json j = base();
    if (c.value.is_null()) {
      const auto slash = c.pointer.rfind('/');
      json& parent = slash == 0 ? j : j[json::json_pointer(c.pointer.substr(0, slash))];
      parent.erase(c.pointer.substr(slash + 1));
    } else {
      j[json::json_pointer(c.pointer)] = c.value;
    }
    const std::string msg = refusal(j);
    EXPECT_MENTIONS(msg, c.expect) << "case " << c.pointer;
    EXPECT_MENTIONS(msg, "job.json") << "case " << c.pointer;
  }
}

TEST_F(JobSpecTest, TakesEveryDtypeNameTheModelLoaderTakes) {
  for (const char* name : {"auto", "f32", "float32", "bf16", "bfloat16", "f16", "half", "f64", "double"}) {
    json j = base();
    j["dtype"] = name;
    EXPECT_EQ(JobSpec::parse(j, dir_, "job.json").dtype, name);
  }
}

TEST_F(JobSpecTest, PretrainJobsNeedAModelAndCannotMixStages) {
  json j = json::parse(R"({"model": {"config": "config.json"}, "output": "out", "data": [{"bin": "corpus.bin"}],
                           "stages": [{"name": "pretrain", "steps": 3, "lr": 0.01, "seq_len": 16}]})");
  const JobSpec s = JobSpec::parse(j, dir_, "job.json");
  EXPECT_TRUE(s.pretrain());
  EXPECT_EQ(s.model_config, dir_ / "config.json");

  json mixed = j;
  mixed["stages"].push_back({{"name", "align"}, {"steps", 1}, {"lr", 0.1}, {"seq_len", 8}});
  EXPECT_MENTIONS(refusal(mixed), "cannot mix pretrain");
  json no_model = j;
  no_model.erase("model");
  EXPECT_MENTIONS(refusal(no_model), "model: is required by pretrain");
  json with_teacher = j;
  with_teacher["teacher"] = "teacher";
  EXPECT_MENTIONS(refusal(with_teacher), "teacher: has no use in a pretrain job");
  json named = j;
  named["stages"][0] = {{"name", "warm"}, {"kind", "pretrain"}, {"steps", 1}, {"lr", 0.1}, {"seq_len", 8}};
  EXPECT_EQ(JobSpec::parse(named, dir_, "job.json").stages[0].name, "warm");
}

TEST_F(JobSpecTest, LoadNamesTheFileOnBadJson) {
  std::ofstream(dir_ / "broken.json") << "{\"output\": ";
  EXPECT_MENTIONS(test::error_of([&] { JobSpec::load(dir_ / "broken.json"); }), "broken.json");
  std::ofstream(dir_ / "ok.json") << base().dump();
  const JobSpec s = JobSpec::load(dir_ / "ok.json");
  EXPECT_EQ(s.teacher, dir_ / "teacher") << "paths resolve against the job file's directory";
}

// The job specs shipped in resources/jobs are valid once their paths point at real files.
TEST_F(JobSpecTest, ShippedDefaultSpecsAreValid) {
  std::ofstream(dir_ / "text.jsonl") << "{\"text\": \"x\"}\n";
  std::ofstream(dir_ / "tok.json") << "{}";
  std::ofstream(dir_ / "calib.jsonl") << "";
  int checked = 0;
  for (const auto& e : fs::directory_iterator(test::source_dir() / "resources/jobs")) {
    if (e.path().extension() != ".json") continue;
    std::ifstream in(e.path());
    json j = json::parse(in);
    for (const char* k : {"teacher", "hybrid"})
      if (j.contains(k)) j[k] = (dir_ / "teacher").string();
    if (j.contains("manifest")) j["manifest"] = (dir_ / "manifest.json").string();
    if (j.contains("calib")) j["calib"] = (dir_ / "calib.jsonl").string();
    if (j.contains("model")) j["model"] = {{"config", (dir_ / "config.json").string()}, {"tokenizer", (dir_ / "tok.json").string()}};
    for (auto& src : j["data"]) {
      if (src.contains("bin")) src["bin"] = (dir_ / "corpus.bin").string();
      if (src.contains("jsonl")) src["jsonl"] = (dir_ / "text.jsonl").string();
    }
    const JobSpec s = JobSpec::parse(j, dir_, e.path().string());
    EXPECT_FALSE(s.stages.empty()) << e.path();
    ++checked;
  }
  EXPECT_GE(checked, 3);
}

}  // namespace
}  // namespace hh::jobs
