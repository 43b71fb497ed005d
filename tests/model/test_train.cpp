// Training jobs end to end on tiny real checkpoints: each stage lowers its own objective, only the
// parameters a stage owns move, an interrupted job resumes onto the uninterrupted trajectory (in
// process and through `hydrahead train` with SIGINT), a reader follows run.h5 while the job writes it.
#include <torch/torch.h>

#include <gtest/gtest.h>

#include <chrono>
#include <fstream>
#include <optional>
#include <set>
#include <thread>

#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/file.h>
#include <sys/wait.h>
#include <unistd.h>

#include <nlohmann/json.hpp>

#include "core/attention/hybrid_model.h"
#include "core/interp/task_registry.h"
#include "core/io/h5.h"
#include "core/jobs/job.h"
#include "core/select/manifest.h"
#include "core/model/tokenizer.h"
#include "core/model/transformer.h"
#include "core/io/checkpoint.h"
#include "core/train/data.h"
#include "core/train/trainer.h"
#include "support/test_support.h"
#include "support/tiny_config.h"

extern char** environ;

namespace {

namespace fs = std::filesystem;
using nlohmann::json;

// A tiny teacher (2 layers, 4 query heads in 2 KV groups), the tiny tokenizer, a manifest with one FA
// head per layer and a learnable token stream (a repeating pattern with some noise).
struct Fixture {
  fs::path dir, teacher, manifest, corpus;
};

Fixture make_fixture(const std::string& tag) {
  Fixture f;
  f.dir = hh::test::scratch_dir(tag);
  f.teacher = f.dir / "teacher";
  const auto cfg = hh::test::tiny_config(2, 4, 2, 8, 32, 64, 273);
  hh::model::save_model(f.teacher, cfg, hh::model::random_weights(cfg, 11, at::kFloat, 0.05));
  fs::copy_file(hh::test::data_dir() / "tokenizer/tiny-tokenizer.json", f.teacher / "tokenizer.json");
  f.manifest = f.dir / "manifest.json";
  std::ofstream(f.manifest) << R"({"format": "hydrahead-manifest", "format_version": 1,
    "model": {"architecture": "qwen3", "num_layers": 2, "num_heads": 4, "num_kv_heads": 2, "head_dim": 8},
    "fa_heads": [[0, 1], [1, 2]]})";
  f.corpus = f.dir / "corpus.bin";
  std::ofstream out(f.corpus, std::ios::binary);
  uint64_t x = 1;
  for (int i = 0; i < 6000; ++i) {
    x = x * 6364136223846793005ULL + 1442695040888963407ULL;
    const uint32_t id = (x >> 60) == 0 ? static_cast<uint32_t>((x >> 33) % 273) : static_cast<uint32_t>(40 + (i % 23) * 3);
    out.write(reinterpret_cast<const char*>(&id), 4);   // little-endian hosts only, as the format
  }
  return f;
}

json hybrid_job(const Fixture& f, const std::string& out) {
  return {{"teacher", f.teacher.string()},
          {"manifest", f.manifest.string()},
          {"output", (f.dir / out).string()},
          {"seed", 5},
          {"data", json::array({{{"bin", f.corpus.string()}}})}};
}

json stage(const std::string& name, int64_t steps, double lr, int64_t seq, int64_t batch = 2) {
  return {{"name", name}, {"steps", steps}, {"lr", lr}, {"seq_len", seq}, {"batch", batch}, {"eval_batches", 1}};
}

hh::jobs::JobSpec spec(const json& j) { return hh::jobs::JobSpec::parse(j, {}, "job.json"); }

std::vector<double> column(const fs::path& run, const std::string& ds) {
  auto f = hh::io::H5File::open_read(run);
  const at::Tensor t = f.read(ds).to(at::kDouble);
  return std::vector<double>(t.data_ptr<double>(), t.data_ptr<double>() + t.numel());
}

double mean(const std::vector<double>& v, size_t from, size_t to) {
  double s = 0;
  for (size_t i = from; i < to; ++i) s += v[i];
  return s / static_cast<double>(to - from);
}

// A batch no training step sees (a different stream offset), for before/after comparisons.
at::Tensor probe_batch(const fs::path& corpus) {
  std::ifstream in(corpus, std::ios::binary);
  std::vector<uint32_t> ids(2 * 48);
  in.seekg(4 * 3001);
  in.read(reinterpret_cast<char*>(ids.data()), static_cast<std::streamsize>(4 * ids.size()));
  return at::tensor(std::vector<int64_t>(ids.begin(), ids.end()), at::TensorOptions().dtype(at::kLong)).view({2, 48});
}

// KL(teacher || student) per token and the student's next-token cross-entropy, computed here directly.
double kl_to_teacher(const hh::model::Transformer& teacher, const hh::attention::HybridModel& student, const at::Tensor& ids) {
  at::NoGradGuard ng;
  const at::Tensor lt = at::log_softmax(teacher.forward(ids).logits, -1), ls = at::log_softmax(student.forward(ids), -1);
  return (lt.exp() * (lt - ls)).sum(-1).mean().item<double>();
}
double next_token_ce(const hh::attention::HybridModel& student, const at::Tensor& ids) {
  at::NoGradGuard ng;
  const at::Tensor lp = at::log_softmax(student.forward(ids.narrow(1, 0, 47)), -1);
  return -lp.gather(-1, ids.narrow(1, 1, 47).unsqueeze(-1)).mean().item<double>();
}

TEST(Train, AlignLowersTheMismatchAndTrainsOnlyAttention) {
  const Fixture f = make_fixture("train_align");
  json j = hybrid_job(f, "run");
  j["stages"] = json::array({stage("align", 40, 3e-3, 32)});
  EXPECT_EQ(hh::train::run_job(spec(j), {}), hh::train::JobStatus::Completed);
  const fs::path run = f.dir / "run/run.h5";
  const auto loss = column(run, "/train/loss");
  ASSERT_EQ(loss.size(), 40u);
  EXPECT_LT(mean(loss, 35, 40), 0.5 * mean(loss, 0, 5));

  const auto teacher = hh::model::Transformer::load(f.teacher);
  const auto student = hh::attention::HybridModel::load(f.dir / "run/model");
  const auto& tw = teacher.weights();
  const auto& sw = student.teacher().weights();
  for (size_t l = 0; l < 2; ++l) {
    EXPECT_TRUE(at::equal(tw.layers[l].gate_proj, sw.layers[l].gate_proj)) << "the MLP is frozen";
    EXPECT_TRUE(at::equal(tw.layers[l].input_layernorm, sw.layers[l].input_layernorm));
    EXPECT_FALSE(at::equal(tw.layers[l].q_proj, sw.layers[l].q_proj)) << "attention trains";
  }
  EXPECT_TRUE(at::equal(tw.embed_tokens, sw.embed_tokens));
  EXPECT_TRUE(fs::exists(f.dir / "run/model/tokenizer.json"));
}

TEST(Train, StagesRunOneAtATimeAndEachLowersItsObjective) {
  const Fixture f = make_fixture("train_stages");
  json j = hybrid_job(f, "run");
  j["stages"] = json::array({stage("align", 10, 3e-3, 32), stage("distil", 30, 2e-3, 32), stage("finetune", 30, 2e-3, 47)});
  const auto s = spec(j);
  const auto teacher = hh::model::Transformer::load(f.teacher);
  const at::Tensor probe = probe_batch(f.corpus);
  const fs::path ckpts = f.dir / "run/checkpoints";

  hh::train::TrainOptions o;
  o.only_stage = "align";
  hh::train::run_job(s, o);
  EXPECT_FALSE(fs::exists(f.dir / "run/model")) << "the final model comes with the last stage";
  const auto after_align = hh::attention::HybridModel::load(ckpts / "stage1-step0/model");
  o.only_stage = "distil";
  hh::train::run_job(s, o);
  const auto after_distil = hh::attention::HybridModel::load(ckpts / "stage2-step0/model");
  EXPECT_LT(kl_to_teacher(teacher, after_distil, probe), 0.8 * kl_to_teacher(teacher, after_align, probe));

  EXPECT_MENTIONS(hh::test::error_of([&] { o.only_stage = "align"; hh::train::run_job(s, o); }), "already finished");
  o.only_stage = "";
  hh::train::run_job(s, o);
  const auto final_model = hh::attention::HybridModel::load(f.dir / "run/model");
  EXPECT_LT(next_token_ce(final_model, probe), 0.8 * next_token_ce(after_distil, probe));

  auto h5 = hh::io::H5File::open_read(f.dir / "run/run.h5");
  EXPECT_EQ(h5.read_strings("/stages/name"), (std::vector<std::string>{"align", "distil", "finetune"}));
  EXPECT_TRUE(at::equal(h5.read("/stages/first_row"), at::tensor({0, 10, 40}, at::kLong)));
  EXPECT_TRUE(at::equal(h5.read("/stages/end_row"), at::tensor({10, 40, 70}, at::kLong)));
  EXPECT_EQ(h5.read("/eval/loss").size(0), 3);
  EXPECT_TRUE(at::equal(h5.read("/train/step"), at::arange(1, 71, at::kLong)));
}

TEST(Train, AnInterruptedJobResumesOntoTheUninterruptedTrajectory) {
  const Fixture f = make_fixture("train_resume");
  auto job = [&](const std::string& out) {
    json j = hybrid_job(f, out);
    json a = stage("align", 6, 3e-3, 24);
    a["checkpoint_every"] = 2;
    a["eval_every"] = 3;
    json d = stage("distil", 8, 1e-3, 24);
    d["grad_accum"] = 2;
    d["warmup"] = 2;
    j["stages"] = json::array({a, d});
    return j;
  };
  const auto straight = spec(job("straight"));
  ASSERT_EQ(hh::train::run_job(straight, {}), hh::train::JobStatus::Completed);

  const auto stopped = spec(job("stopped"));
  hh::train::TrainOptions o;
  o.max_steps = 3;   // mid align, off the checkpoint interval
  ASSERT_EQ(hh::train::run_job(stopped, o), hh::train::JobStatus::Interrupted);
  o.max_steps = 7;   // into distil, mid stage (optimiser state and accumulation restored)
  ASSERT_EQ(hh::train::run_job(stopped, o), hh::train::JobStatus::Interrupted);
  json changed = job("stopped");
  changed["stages"][1]["lr"] = 2e-3;
  EXPECT_MENTIONS(hh::test::error_of([&] { hh::train::run_job(spec(changed), {}); }), "different job spec");
  o.max_steps = -1;
  ASSERT_EQ(hh::train::run_job(stopped, o), hh::train::JobStatus::Completed);

  for (const char* ds : {"/train/loss", "/train/grad_norm", "/train/lr", "/train/step", "/eval/loss", "/eval/step"})
    EXPECT_EQ(column(f.dir / "straight/run.h5", ds), column(f.dir / "stopped/run.h5", ds)) << ds;
  const auto a = hh::attention::HybridModel::load(f.dir / "straight/model");
  const auto b = hh::attention::HybridModel::load(f.dir / "stopped/model");
  EXPECT_TRUE(at::equal(a.layers()[1].la_k_proj, b.layers()[1].la_k_proj));
  EXPECT_TRUE(at::equal(a.teacher().weights().layers[0].down_proj, b.teacher().weights().layers[0].down_proj));

  // Done is done: running the finished job again changes nothing.
  EXPECT_EQ(hh::train::run_job(stopped, {}), hh::train::JobStatus::Completed);
  EXPECT_EQ(column(f.dir / "stopped/run.h5", "/train/loss").size(), 14u);
}

// A stop asked for before the first step (while the teacher loads, or once the student is made) ends the
// job writing nothing: a new job leaves no run.h5 and no checkpoint, a resumed one its last checkpoint,
// which the `interrupted` event names.
TEST(Train, AStopBeforeTheFirstStepWritesNothing) {
  const Fixture f = make_fixture("train_early_stop");
  json j = hybrid_job(f, "early");
  j["stages"] = json::array({stage("align", 4, 1e-3, 16)});
  const fs::path out = f.dir / "early";
  std::atomic<bool> stop{true};
  std::vector<json> events;
  hh::train::TrainOptions o;
  o.stop = &stop;
  o.on_event = [&](const json& e) { events.push_back(e); };
  EXPECT_EQ(hh::train::run_job(spec(j), o), hh::train::JobStatus::Interrupted);
  ASSERT_EQ(events.size(), 1u);
  EXPECT_EQ(events[0]["event"], "interrupted");
  EXPECT_TRUE(events[0]["checkpoint"].is_null()) << events[0].dump();
  EXPECT_FALSE(fs::exists(out / "run.h5"));
  EXPECT_FALSE(fs::exists(out / "checkpoints"));

  stop = false;
  o.max_steps = 2;  // two steps and a checkpoint
  ASSERT_EQ(hh::train::run_job(spec(j), o), hh::train::JobStatus::Interrupted);
  const std::string written = events.back()["checkpoint"];
  ASSERT_TRUE(fs::exists(written));
  stop = true;
  o.max_steps = -1;
  events.clear();
  EXPECT_EQ(hh::train::run_job(spec(j), o), hh::train::JobStatus::Interrupted);
  ASSERT_EQ(events.size(), 1u);
  EXPECT_EQ(events[0]["checkpoint"], written);
  EXPECT_EQ(column(out / "run.h5", "/train/loss").size(), 2u);
  stop = false;  // and the job goes on from there
  EXPECT_EQ(hh::train::run_job(spec(j), o), hh::train::JobStatus::Completed);
  EXPECT_EQ(column(out / "run.h5", "/train/loss").size(), 4u);
}

// A job that names no dtype trains a 16-bit teacher's hybrid in float32 on the CPU (whose 16-bit matrix
// products are emulated); one that names bf16 gets bf16, also after a resume (teacher and student in distil).
TEST(Train, AJobWithoutADtypeTrainsA16BitTeacherInFloat32OnTheCpu) {
  Fixture f = make_fixture("train_dtype");
  const auto cfg = hh::test::tiny_config(2, 4, 2, 8, 32, 64, 273);
  f.teacher = f.dir / "teacher-bf16";
  hh::model::save_model(f.teacher, cfg, hh::model::random_weights(cfg, 11, at::kBFloat16, 0.05));
  auto saved_dtype = [](const fs::path& model) {
    return std::string(hh::io::dtype_name(hh::io::Checkpoint(model).info("model.embed_tokens.weight").dtype));
  };
  EXPECT_EQ(saved_dtype(f.teacher), "BF16");
  json j = hybrid_job(f, "auto");
  j["stages"] = json::array({stage("align", 1, 1e-3, 16), stage("distil", 1, 1e-3, 16)});
  EXPECT_EQ(hh::train::run_job(spec(j), {}), hh::train::JobStatus::Completed);
  EXPECT_EQ(saved_dtype(f.dir / "auto/model"), "F32");

  j = hybrid_job(f, "bf16");
  j["dtype"] = "bf16";
  j["stages"] = json::array({stage("align", 2, 1e-3, 16), stage("distil", 1, 1e-3, 16)});
  hh::train::TrainOptions stop_after_one;
  stop_after_one.max_steps = 1;
  EXPECT_EQ(hh::train::run_job(spec(j), stop_after_one), hh::train::JobStatus::Interrupted);
  // Resumed: the teacher loads in bf16 beside the saved bf16 student, and distil runs both.
  EXPECT_EQ(hh::train::run_job(spec(j), {}), hh::train::JobStatus::Completed);
  EXPECT_EQ(saved_dtype(f.dir / "bf16/model"), "BF16");
}

TEST(Train, ASecondJobInTheSameDirectoryIsRefused) {
  const Fixture f = make_fixture("train_lock");
  json j = hybrid_job(f, "run");
  j["stages"] = json::array({stage("align", 1, 1e-3, 16)});
  fs::create_directories(f.dir / "run");
  const int fd = ::open((f.dir / "run/.lock").c_str(), O_RDWR | O_CREAT, 0644);
  ASSERT_EQ(::flock(fd, LOCK_EX), 0);
  EXPECT_MENTIONS(hh::test::error_of([&] { hh::train::run_job(spec(j), {}); }), "another training job");
  ::close(fd);
  EXPECT_EQ(hh::train::run_job(spec(j), {}), hh::train::JobStatus::Completed);
}

TEST(Train, PretrainsADenseModelOnTaskData) {
  const Fixture f = make_fixture("train_pretrain");
  hh::interp::TaskRegistry reg;
  reg.load_default();
  std::ofstream(f.dir / "config.json") << R"({"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3",
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "hidden_size": 32,
    "intermediate_size": 64, "vocab_size": 273, "rope_theta": 10000.0, "rms_norm_eps": 1e-6, "eos_token_id": 0})";
  json j = {{"model", {{"config", (f.dir / "config.json").string()},
                       {"tokenizer", (hh::test::data_dir() / "tokenizer/tiny-tokenizer.json").string()}}},
            {"output", (f.dir / "run").string()},
            {"data", json::array({{{"task", "niah-single"}, {"params", {{"length", 400}, {"haystack", "noise"}}}},
                                  {{"bin", f.corpus.string()}, {"weight", 0.5}}})},
            {"stages", json::array({stage("pretrain", 30, 1e-2, 64, 4)})}};
  std::vector<json> events;
  hh::train::TrainOptions o;
  o.tasks = &reg;
  o.on_event = [&](const json& e) { events.push_back(e); };
  ASSERT_EQ(hh::train::run_job(spec(j), o), hh::train::JobStatus::Completed);
  const auto loss = column(f.dir / "run/run.h5", "/train/loss");
  EXPECT_LT(mean(loss, 25, 30), 0.7 * mean(loss, 0, 5));
  const auto m = hh::model::Transformer::load(f.dir / "run/model");
  EXPECT_EQ(m.config().num_hidden_layers, 2);
  EXPECT_TRUE(fs::exists(f.dir / "run/model/tokenizer.json"));
  ASSERT_FALSE(events.empty());
  EXPECT_EQ(events.front()["event"], "start");
  EXPECT_EQ(events.back()["event"], "done");
  int steps = 0;
  for (const auto& e : events)
    if (e["event"] == "step") {
      ++steps;
      for (const char* k : {"loss", "lr", "grad_norm", "tokens_per_s", "eta_s", "global_step"}) EXPECT_TRUE(e.contains(k)) << k;
    }
  EXPECT_EQ(steps, 30);
}

// The fixture's teacher and its hybrid (conversion seed 2), the models of align and distil.
hh::train::StageModels teacher_and_hybrid(const Fixture& f) {
  hh::train::StageModels m;
  m.teacher.emplace(hh::model::Transformer::load(f.teacher));
  hh::attention::ConvertOptions co;
  co.seed = 2;
  m.student.emplace(hh::attention::convert(hh::model::Transformer::load(f.teacher), hh::select::read_manifest(f.manifest), co));
  return m;
}

// The stage's loss and every trainable weight's gradient without and with activation checkpointing: the
// same loss, and gradients equal to float32 rounding.
void expect_checkpointing_changes_nothing(const hh::train::StageModels& m, hh::jobs::StageKind kind, const at::Tensor& ids) {
  const auto params = hh::train::stage_params(m, kind);
  const double plain = hh::train::stage_loss(m, kind, ids, 1.0, true, false);
  std::vector<at::Tensor> g_plain;
  for (const auto& p : params) {
    ASSERT_TRUE(p.tensor.grad().defined()) << p.name;
    g_plain.push_back(p.tensor.grad().clone());
    p.tensor.mutable_grad() = at::Tensor();
  }
  const double ckpt = hh::train::stage_loss(m, kind, ids, 1.0, true, true);
  EXPECT_EQ(plain, ckpt);
  for (size_t i = 0; i < params.size(); ++i) {
    ASSERT_TRUE(params[i].tensor.grad().defined()) << params[i].name;
    EXPECT_TRUE(at::allclose(params[i].tensor.grad(), g_plain[i], 1e-5, 1e-7)) << params[i].name;
    params[i].tensor.mutable_grad() = at::Tensor();
  }
}

// Activation checkpointing changes memory, not math: the same loss and the same gradient for every
// weight, including the layers' (accumulated by the re-run in the backward pass).
TEST(Train, ActivationCheckpointingGivesTheSameLossAndGradients) {
  const Fixture f = make_fixture("train_ckpt_layers");
  const hh::train::StageModels m = teacher_and_hybrid(f);
  const at::Tensor ids = probe_batch(f.corpus);
  for (auto kind : {hh::jobs::StageKind::Finetune, hh::jobs::StageKind::Distil}) {
    SCOPED_TRACE(hh::jobs::stage_kind_name(kind));
    expect_checkpointing_changes_nothing(m, kind, ids);
  }
}

// The same for the dense model (pretrain): each layer run again in the backward pass from its input alone.
// hidden() is forward()'s residual with or without it, and a forward asked for no logits gives none,
// also when it runs every layer.
TEST(Train, ActivationCheckpointingOfTheDenseModelGivesTheSameLossAndGradients) {
  const Fixture f = make_fixture("train_ckpt_dense");
  hh::train::StageModels m;
  m.dense.emplace(hh::model::Transformer::load(f.teacher));
  const at::Tensor ids = probe_batch(f.corpus);
  expect_checkpointing_changes_nothing(m, hh::jobs::StageKind::Pretrain, ids);
  at::NoGradGuard ng;
  const auto full = m.dense->forward(ids);
  EXPECT_TRUE(at::equal(m.dense->hidden(ids), full.resid));
  EXPECT_TRUE(at::equal(m.dense->hidden(ids, true), full.resid));  // (no graph: no checkpointing to do)
  hh::model::ForwardOptions o;
  o.logits = false;
  const auto bare = m.dense->forward(ids, o);
  EXPECT_FALSE(bare.logits.defined());
  EXPECT_TRUE(at::equal(bare.resid, full.resid));
  o.stop_layer = m.dense->config().num_hidden_layers;
  EXPECT_FALSE(m.dense->forward(ids, o).logits.defined());
  EXPECT_TRUE(at::equal(m.dense->unembed(full.resid), full.logits));
}

// Task samples are generated on several threads; the batch must equal the samples made one by one,
// in any order, from their indices alone.
TEST(TrainData, TaskSamplesInParallelEqualSerialOnes) {
  hh::interp::TaskRegistry reg;
  reg.load_default();
  const auto tok = hh::model::Tokenizer::load(hh::test::data_dir() / "tokenizer/tiny-tokenizer.json");
  hh::train::DataSource a, b;
  a.kind = b.kind = "task";
  a.task = "niah-single";
  a.params = {{"length", 400}, {"haystack", "noise"}};
  b.task = "induction";
  b.params = {{"length", 200}};
  hh::train::DataMixture mix({a, b}, &tok, &reg, tok.vocab_size(), 0, 9);
  const at::Tensor batch = mix.batch(100, 12, 300);
  std::set<std::vector<int64_t>> distinct;
  for (int64_t i = 11; i >= 0; --i) {
    const auto one = mix.sample(100 + i, 300);
    distinct.insert(one);
    EXPECT_TRUE(at::equal(batch[i], at::tensor(one, at::kLong))) << "row " << i;
  }
  EXPECT_EQ(distinct.size(), 12u);
  // A 200-token induction example does not fill 301 tokens: the sample is that example (prompt, answer),
  // the separator (eos 0), then the start of the sample's next example.
  int induction_rows = 0;
  for (int64_t i = 0; i < 12; ++i) {
    if (mix.source_of(100 + i) != 1) continue;
    ++induction_rows;
    auto example = [&](uint64_t k) {
      return reg.generate("induction", {{"length", 200}, {"num_examples", 1}}, tok,
                          hh::train::mix_seed(9, 0x7a5c00 + 1, static_cast<uint64_t>(100 + i), k))[0];
    };
    std::vector<int64_t> expect = example(0).clean_ids;
    const auto first = example(0), second = example(1);
    expect.insert(expect.end(), first.answer_ids.begin(), first.answer_ids.end());
    expect.push_back(0);
    expect.insert(expect.end(), second.clean_ids.begin(), second.clean_ids.end());
    expect.resize(301);
    EXPECT_TRUE(at::equal(batch[i], at::tensor(expect, at::kLong))) << "row " << i;
  }
  EXPECT_GT(induction_rows, 0);
}

// "loss": "answer" task sources count only their answers: the mask marks exactly the answer tokens of
// each example, and the cross-entropy averages each row over them.
TEST(TrainData, AnswerOnlySourcesMaskEverythingButTheAnswers) {
  hh::interp::TaskRegistry reg;
  reg.load_default();
  const auto tok = hh::model::Tokenizer::load(hh::test::data_dir() / "tokenizer/tiny-tokenizer.json");
  hh::train::DataSource a;
  a.kind = "task";
  a.task = "niah-single";
  a.params = {{"length", 400}, {"haystack", "noise"}};
  a.answer_loss_only = true;
  hh::train::DataMixture mix({a}, &tok, &reg, tok.vocab_size(), -1, 4);
  // The examples the source makes: seed mix(seed, 0x7a5c00 + source, index, k) for example k of a sample.
  auto example = [&](uint64_t index, uint64_t k) {
    return reg.generate("niah-single", {{"length", 400}, {"haystack", "noise"}, {"num_examples", 1}}, tok,
                        hh::train::mix_seed(4, 0x7a5c00, index, k))[0];
  };
  const auto first = example(7, 0);
  const int64_t p = static_cast<int64_t>(first.clean_ids.size()), n = static_cast<int64_t>(first.answer_ids.size());
  const int64_t seq = p + n + 20;   // one example and the start of the next, whose answer is cut off
  at::Tensor mask;
  const at::Tensor ids = mix.batch(7, 2, seq, &mask);
  ASSERT_EQ(mask.sizes(), (at::IntArrayRef{2, seq}));
  for (int64_t r = 0; r < 2; ++r) {
    const auto ex = example(static_cast<uint64_t>(7 + r), 0);
    ASSERT_EQ(static_cast<int64_t>(ex.clean_ids.size()), p);
    ASSERT_EQ(static_cast<int64_t>(ex.answer_ids.size()), n);
    const auto next = example(static_cast<uint64_t>(7 + r), 1);
    for (int64_t j = 0; j < seq; ++j) {
      const bool answer = j + 1 >= p && j + 1 < p + n;
      EXPECT_EQ(mask[r][j].item<int>(), answer ? 1 : 0) << "row " << r << " target " << j;
      if (answer) EXPECT_EQ(ids[r][j + 1].item<int64_t>(), ex.answer_ids[static_cast<size_t>(j + 1 - p)]);
      if (j + 1 >= p + n) EXPECT_EQ(ids[r][j + 1].item<int64_t>(), next.clean_ids[static_cast<size_t>(j + 1 - p - n)]);
    }
  }
}

TEST(Train, MaskedCrossEntropyAveragesEachRowOverItsCountedTargets) {
  const Fixture f = make_fixture("train_masked_ce");
  hh::train::StageModels m;
  m.dense.emplace(hh::model::Transformer::load(f.teacher));
  const at::Tensor ids = probe_batch(f.corpus);   // [2, 48]
  const at::Tensor input = ids.narrow(1, 0, 47), target = ids.narrow(1, 1, 47);
  at::Tensor nll;
  {
    at::NoGradGuard ng;
    nll = -at::log_softmax(m.dense->forward(input).logits, -1).gather(-1, target.unsqueeze(-1)).squeeze(-1);  // [2, 47]
  }
  at::Tensor mask = at::zeros({2, 47}, at::kByte);
  mask[0].narrow(0, 10, 3).fill_(1);   // row 0 counts 3 targets, row 1 all 47
  mask[1].fill_(1);
  const double expect = 0.5 * (nll[0].narrow(0, 10, 3).mean().item<double>() + nll[1].mean().item<double>());
  EXPECT_NEAR(hh::train::stage_loss(m, hh::jobs::StageKind::Pretrain, ids, 1.0, false, false, mask), expect, 1e-5);
  EXPECT_NEAR(hh::train::stage_loss(m, hh::jobs::StageKind::Pretrain, ids, 1.0, false, false, at::ones({2, 47}, at::kByte)),
              nll.mean().item<double>(), 1e-5);
  mask[1].zero_();   // a row without counted targets drops out
  EXPECT_NEAR(hh::train::stage_loss(m, hh::jobs::StageKind::Pretrain, ids, 1.0, false, false, mask),
              nll[0].narrow(0, 10, 3).mean().item<double>(), 1e-5);
}

// The chunked cross-entropy (vocabulary projected a few positions at a time, recomputed in backward)
// equals the plain one: loss and every gradient, with and without a mask, tied and untied embeddings.
// The chunked distillation loss equals KL(teacher || student) from the full logits: the loss, and the gradient
// of every student weight (through its hidden states and its final norm and lm_head), tied and untied, with a
// chunk that does not divide T; the teacher gets no gradient. Mismatched batches are refused.
TEST(Train, ChunkedKlEqualsThePlainOne) {
  for (bool tied : {false, true}) {
    auto cfg = hh::test::tiny_config(2, 4, 2, 8, 32, 64, 97);
    cfg.tie_word_embeddings = tied;
    auto ws = hh::model::random_weights(cfg, 5, at::kFloat, 0.1), wt = hh::model::random_weights(cfg, 6, at::kFloat, 0.1);
    if (tied) ws.lm_head = at::Tensor(), wt.lm_head = at::Tensor();
    const hh::model::Transformer student(cfg, ws), teacher(cfg, wt);
    for (const auto& t : {teacher.weights().embed_tokens, teacher.weights().norm}) t.requires_grad_(true);
    hh::train::StageModels m;
    m.dense.emplace(student);
    const auto params = hh::train::stage_params(m, hh::jobs::StageKind::Pretrain);
    at::manual_seed(4);
    const at::Tensor input = at::randint(97, {3, 29}, at::kLong);
    hh::model::ForwardOptions bare;
    bare.logits = false;
    auto grads = [&](bool chunked) {
      for (const auto& p : params) p.tensor.mutable_grad() = at::Tensor();
      at::Tensor loss;
      if (chunked) {
        at::Tensor th;
        {
          at::NoGradGuard ng;
          th = teacher.forward(input, bare).resid;
        }
        loss = hh::train::chunked_kl_divergence(teacher, th, student, student.forward(input, bare).resid, 7);
      } else {  // the reference: both models' full logits, sum_v p_t (log p_t - log p_s), the mean over tokens
        at::Tensor lt;
        {
          at::NoGradGuard ng;
          lt = at::log_softmax(teacher.forward(input).logits, -1);
        }
        const at::Tensor ls = at::log_softmax(student.forward(input).logits, -1);
        loss = (lt.exp() * (lt - ls)).sum(-1).mean();
      }
      loss.backward();
      std::vector<at::Tensor> g{loss.detach().clone()};
      for (const auto& p : params) {
        EXPECT_TRUE(p.tensor.grad().defined()) << p.name;
        g.push_back(p.tensor.grad().clone());
      }
      return g;
    };
    const auto a = grads(false), b = grads(true);
    EXPECT_GT(a[0].item<double>(), 1e-3);  // the two models differ
    EXPECT_NEAR(a[0].item<double>(), b[0].item<double>(), 1e-6) << "tied " << tied;
    for (size_t i = 1; i < a.size(); ++i)
      EXPECT_TRUE(at::allclose(a[i], b[i], 1e-4, 1e-7)) << params[i - 1].name << " tied " << tied;
    for (const auto& p : params) p.tensor.mutable_grad() = at::Tensor();
    for (const auto& t : {teacher.weights().embed_tokens, teacher.weights().norm}) EXPECT_FALSE(t.grad().defined());
  }
  const auto cfg = hh::test::tiny_config(2, 4, 2, 8, 32, 64, 97);
  const hh::model::Transformer model(cfg, hh::model::random_weights(cfg, 5, at::kFloat, 0.1));
  EXPECT_THROW(hh::train::chunked_kl_divergence(model, at::zeros({2, 5, 32}), model, at::zeros({2, 6, 32}), 4), hh::Error);
  EXPECT_THROW(hh::train::chunked_kl_divergence(model, at::zeros({2, 5, 32}), model, at::zeros({2, 5, 32}), 0), hh::Error);
}

// Past 2048 tokens the distil stage takes the chunked KL: its loss is still the KL of the two models'
// full logits.
TEST(Train, DistilOnALongBatchIsTheKlOfTheFullLogits) {
  const Fixture f = make_fixture("train_distil_long");
  const hh::train::StageModels m = teacher_and_hybrid(f);
  at::manual_seed(5);
  const at::Tensor ids = at::randint(m.teacher->config().vocab_size, {2, 2100}, at::kLong);  // 2 x 2099 inputs
  const double loss = hh::train::stage_loss(m, hh::jobs::StageKind::Distil, ids, 1.0, false);
  at::NoGradGuard ng;
  const at::Tensor input = ids.narrow(1, 0, 2099);
  const at::Tensor lt = at::log_softmax(m.teacher->forward(input).logits, -1);
  const at::Tensor ls = at::log_softmax(m.student->forward(input, true), -1);
  EXPECT_NEAR(loss, (lt.exp() * (lt - ls)).sum(-1).mean().item<double>(), 1e-6);
}

TEST(Train, ChunkedCrossEntropyEqualsThePlainOne) {
  for (bool tied : {false, true}) {
    auto cfg = hh::test::tiny_config(2, 4, 2, 8, 32, 64, 97);
    cfg.tie_word_embeddings = tied;
    auto w = hh::model::random_weights(cfg, 5, at::kFloat, 0.1);
    if (tied) w.lm_head = at::Tensor();
    const hh::model::Transformer model(cfg, w);
    hh::train::StageModels m;
    m.dense.emplace(model);
    const auto params = hh::train::stage_params(m, hh::jobs::StageKind::Pretrain);
    at::manual_seed(3);
    const at::Tensor ids = at::randint(97, {3, 30}, at::kLong);
    const at::Tensor input = ids.narrow(1, 0, 29), target = ids.narrow(1, 1, 29);
    at::Tensor mask = (at::rand({3, 29}) > 0.6).to(at::kByte);
    mask[2].zero_();
    for (const at::Tensor& msk : {at::Tensor(), mask}) {
      auto grads = [&](bool chunked) {
        for (const auto& p : params) p.tensor.mutable_grad() = at::Tensor();
        at::Tensor loss;
        if (chunked) {
          hh::model::ForwardOptions fo;
          fo.stop_layer = cfg.num_hidden_layers;
          loss = hh::train::chunked_next_token_loss(model, model.forward(input, fo).resid, target, msk, 7);
        } else {
          // The reference: full logits, per-token NLL, the documented averages.
          const at::Tensor nll = -at::log_softmax(model.forward(input).logits, -1).gather(-1, target.unsqueeze(-1)).squeeze(-1);
          if (!msk.defined()) {
            loss = nll.mean();
          } else {
            const at::Tensor mf = msk.to(at::kFloat), count = mf.sum(1);
            loss = ((nll * mf).sum(1) / count.clamp_min(1)).sum() / (count > 0).sum();
          }
        }
        loss.backward();
        std::vector<at::Tensor> g{loss.detach().clone()};
        for (const auto& p : params) g.push_back(p.tensor.grad().clone());
        return g;
      };
      const auto a = grads(false), b = grads(true);
      EXPECT_NEAR(a[0].item<double>(), b[0].item<double>(), 1e-5) << "tied " << tied;
      for (size_t i = 1; i < a.size(); ++i)
        EXPECT_TRUE(at::allclose(a[i], b[i], 1e-4, 1e-6)) << params[i - 1].name << " tied " << tied << " masked " << msk.defined();
    }
  }
}

// Long batches take the chunked path inside stage_loss; its value is the plain cross-entropy's.
TEST(Train, LongBatchesUseTheChunkedLossWithTheSameValue) {
  const Fixture f = make_fixture("train_long_ce");
  hh::train::StageModels m;
  hh::attention::ConvertOptions co;
  m.student.emplace(hh::attention::convert(hh::model::Transformer::load(f.teacher), hh::select::read_manifest(f.manifest), co));
  at::manual_seed(4);
  const at::Tensor ids = at::randint(273, {1, 2101}, at::kLong);   // 2100 inputs: above the chunking threshold (2,048)
  double plain;
  {
    at::NoGradGuard ng;
    const at::Tensor lp = at::log_softmax(m.student->forward(ids.narrow(1, 0, 2100)), -1);
    plain = -lp.gather(-1, ids.narrow(1, 1, 2100).unsqueeze(-1)).mean().item<double>();
  }
  EXPECT_NEAR(hh::train::stage_loss(m, hh::jobs::StageKind::Finetune, ids, 1.0, false), plain, 1e-5);
  hh::train::stage_params(m, hh::jobs::StageKind::Finetune);
  EXPECT_NEAR(hh::train::stage_loss(m, hh::jobs::StageKind::Finetune, ids, 1.0, true), plain, 1e-5);
  EXPECT_TRUE(m.student->teacher().weights().lm_head.grad().defined()) << "the chunked backward reaches lm_head";
}

// A mistake in the data (an unknown task, a bad parameter) is reported before any model loads and
// before run.h5 exists.
TEST(Train, DataMistakesAreReportedBeforeAnythingIsWritten) {
  const Fixture f = make_fixture("train_data_mistake");
  hh::interp::TaskRegistry reg;
  reg.load_default();
  json j = hybrid_job(f, "run");
  j["stages"] = json::array({stage("align", 2, 1e-3, 16)});
  j["data"] = json::array({{{"task", "niah-singel"}}});
  EXPECT_MENTIONS(hh::test::error_of([&] { hh::train::check_job_data(spec(j), &reg); }), "niah-singel");
  j["data"] = json::array({{{"task", "niah-single"}, {"params", {{"lenght", 400}}}}});
  EXPECT_MENTIONS(hh::test::error_of([&] { hh::train::check_job_data(spec(j), &reg); }), "lenght");
  hh::train::TrainOptions o;
  o.tasks = &reg;
  EXPECT_MENTIONS(hh::test::error_of([&] { hh::train::run_job(spec(j), o); }), "lenght");
  EXPECT_FALSE(fs::exists(f.dir / "run/run.h5"));
  // Parameters in range that the generator still cannot honour with this tokenizer fail here too.
  j["data"] = json::array({{{"task", "niah-single"}, {"params", {{"length", 64}}}}});
  const std::string small = hh::test::error_of([&] { hh::train::check_job_data(spec(j), &reg); });
  EXPECT_MENTIONS(small, "task niah-single");
  EXPECT_MENTIONS(small, "too small");
  EXPECT_MENTIONS(hh::test::error_of([&] { hh::train::run_job(spec(j), o); }), "too small");
  EXPECT_FALSE(fs::exists(f.dir / "run/run.h5"));
  j["data"] = json::array({{{"task", "niah-single"}, {"params", {{"length", 400}}}}});
  EXPECT_NO_THROW(hh::train::check_job_data(spec(j), &reg));
}

// The task sources of the shipped job specs name real tasks with valid parameters.
TEST(Train, ShippedJobSpecsUseRealTasks) {
  hh::interp::TaskRegistry reg;
  reg.load_default();
  const auto tok = hh::model::Tokenizer::load(hh::test::data_dir() / "tokenizer/tiny-tokenizer.json");
  int tasks = 0;
  for (const auto& e : fs::directory_iterator(hh::test::source_dir() / "resources/jobs")) {
    std::ifstream in(e.path());
    const json j = json::parse(in);
    std::vector<hh::train::DataSource> sources;
    for (const auto& src : j["data"])
      if (src.contains("task")) {
        hh::train::DataSource s;
        s.kind = "task";
        s.task = src["task"];
        if (src.contains("params")) s.params = src["params"];
        sources.push_back(s);
      }
    if (sources.empty()) continue;
    tasks += static_cast<int>(sources.size());
    EXPECT_NO_THROW(hh::train::DataMixture(sources, &tok, &reg, tok.vocab_size(), -1, 0)) << e.path();
  }
  EXPECT_GT(tasks, 0);
}

// ---- the CLI: SIGINT, resume, and a reader following run.h5 ----------------------------------------

pid_t spawn_train(const fs::path& job, const fs::path& stdout_file) {
  const std::string exe = (hh::test::bin_dir() / "hydrahead").string();
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_addopen(&fa, 1, stdout_file.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  const std::string job_s = job.string();
  char* argv[] = {const_cast<char*>(exe.c_str()), const_cast<char*>("train"), const_cast<char*>("--job"),
                  const_cast<char*>(job_s.c_str()), const_cast<char*>("--progress"), const_cast<char*>("json"), nullptr};
  pid_t pid = 0;
  const int rc = posix_spawn(&pid, exe.c_str(), &fa, nullptr, argv, environ);
  posix_spawn_file_actions_destroy(&fa);
  EXPECT_EQ(rc, 0);
  return pid;
}

std::string status_of(const fs::path& run_dir) {
  return hh::test::run_hydrahead("train --status " + run_dir.string()).output;
}

int wait_exit(pid_t pid) {
  int status = 0;
  ::waitpid(pid, &status, 0);
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

TEST(TrainCli, SigintCheckpointsAndTheRerunFinishesTheSameTrajectoryWhileAReaderFollows) {
  const Fixture f = make_fixture("train_cli");
  auto write_job = [&](const std::string& name) {
    json j = hybrid_job(f, name);
    j["stages"] = json::array({stage("align", 600, 1e-3, 32)});
    std::ofstream(f.dir / (name + ".json")) << j.dump(2);
    return f.dir / (name + ".json");
  };
  const fs::path job = write_job("cli"), run = f.dir / "cli/run.h5";
  const pid_t pid = spawn_train(job, f.dir / "events1.jsonl");

  // Follow run.h5 as it grows, then interrupt.
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(120);
  std::optional<hh::io::H5File> follower;
  std::set<int64_t> seen;
  while (std::chrono::steady_clock::now() < deadline && seen.size() < 3) {
    if (!follower) {
      try {
        if (fs::exists(run)) follower.emplace(hh::io::H5File::open_follow(run));
      } catch (const hh::Error&) {
        // created but not yet in SWMR mode: try again
      }
    } else {
      follower->refresh("/train/loss");
      const int64_t rows = follower->shape("/train/loss").at(0);
      if (rows > 0) seen.insert(rows);
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  ASSERT_GE(seen.size(), 3u) << "a reader saw run.h5 grow while the job wrote it";
  follower.reset();
  // `train --status` reads the live file from another process too, and sees the job's lock.
  const std::string live = status_of(f.dir / "cli");
  EXPECT_NE(live.find("/600  run"), std::string::npos) << live;
  EXPECT_NE(live.find("running: stage align, step "), std::string::npos) << live;
  EXPECT_NE(live.find(" tokens/s, ETA "), std::string::npos) << live;
  EXPECT_NE(live.find("(process " + std::to_string(pid) + " on "), std::string::npos) << live;
  // The same as JSON, for tools.
  auto status_json = [&](const std::string& dir) {
    return json::parse(hh::test::run_hydrahead("train --status " + dir + " --json").output);
  };
  const json live_json = status_json((f.dir / "cli").string());
  EXPECT_EQ(live_json["state"], "running");
  EXPECT_EQ(live_json["process"]["pid"], pid);
  EXPECT_EQ(live_json["steps"], 600);
  EXPECT_EQ(live_json["stage"], "align");
  EXPECT_GT(live_json["steps_done"].get<int64_t>(), 0);
  EXPECT_GE(live_json["eta_s"].get<double>(), 0);
  EXPECT_EQ(live_json["stages"][0]["state"], "run");
  // `train --stop` asks it to stop as Ctrl-C does.
  const auto stop = hh::test::run_hydrahead("train --stop " + (f.dir / "cli").string());
  EXPECT_EQ(stop.status, 0) << stop.output;
  EXPECT_EQ(wait_exit(pid), 130);
  std::ifstream ev(f.dir / "events1.jsonl");
  std::string line, last;
  while (std::getline(ev, line)) last = line;
  EXPECT_EQ(json::parse(last)["event"], "interrupted") << last;
  const int64_t rows_at_stop = static_cast<int64_t>(column(run, "/train/loss").size());
  EXPECT_GT(rows_at_stop, 0);
  EXPECT_LT(rows_at_stop, 600);
  const std::string stopped = status_of(f.dir / "cli");
  EXPECT_NE(stopped.find("stopped at step " + std::to_string(rows_at_stop) + " of 600 (stage align, step " +
                         std::to_string(rows_at_stop) + " of 600)"), std::string::npos) << stopped;
  EXPECT_NE(stopped.find("run its job again"), std::string::npos) << stopped;
  const json stopped_json = status_json((f.dir / "cli").string());
  EXPECT_EQ(stopped_json["state"], "stopped");
  EXPECT_EQ(stopped_json["steps_done"], rows_at_stop);
  EXPECT_TRUE(stopped_json["process"].is_null());
  EXPECT_TRUE(stopped_json["eta_s"].is_null());
  EXPECT_FALSE(stopped_json["latest_checkpoint"].is_null());
  const auto nobody = hh::test::run_hydrahead("train --stop " + (f.dir / "cli").string());
  EXPECT_EQ(nobody.status, 1);
  EXPECT_MENTIONS(nobody.output, "no job is running there");

  const pid_t again = spawn_train(job, f.dir / "events2.jsonl");
  EXPECT_EQ(wait_exit(again), 0);
  const auto straight = write_job("straight");
  EXPECT_EQ(wait_exit(spawn_train(straight, f.dir / "events3.jsonl")), 0);
  EXPECT_EQ(column(run, "/train/loss"), column(f.dir / "straight/run.h5", "/train/loss"));
  const std::string done = status_of(f.dir / "cli");
  EXPECT_NE(done.find("600/600 done"), std::string::npos) << done;
  EXPECT_NE(done.find("finished: 600 steps in "), std::string::npos) << done;
  const json done_json = status_json((f.dir / "cli").string());
  EXPECT_EQ(done_json["state"], "finished");
  EXPECT_EQ(done_json["stages"][0]["state"], "done");
  EXPECT_EQ(done_json["stages"][0]["steps_done"], 600);
  EXPECT_FALSE(done_json["final_model"].is_null());
  const auto json_alone = hh::test::run_hydrahead("train --json");  // a usage error
  EXPECT_EQ(json_alone.status, 2) << json_alone.output;
  EXPECT_MENTIONS(json_alone.output, "--status");
  EXPECT_NE(done.find("final model: "), std::string::npos) << done;

  // h5py reads the finished file (SWMR mode as the workbench does).
  const std::string py = hh::test::python_with_h5py();
  if (py.empty()) GTEST_SKIP() << "no python3 with h5py";
  const std::string cmd = py + " -c \"import h5py; f = h5py.File('" + run.string() +
                          "', 'r', swmr=True); assert f.attrs['format'] == 'hydrahead-run'; "
                          "assert f['train/loss'].shape == (600,); assert f['train/step'][-1] == 600; "
                          "assert list(f['stages/name'].asstr()[:]) == ['align']\"";
  EXPECT_EQ(std::system(cmd.c_str()), 0);
}

}  // namespace
