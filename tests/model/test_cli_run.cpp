// `hydrahead run` and `hydrahead inspect` end to end on a real checkpoint directory: the file the CLI
// writes holds exactly what the in-process forward computes, and bad input fails cleanly.
#include <torch/torch.h>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <array>
#include <cstdio>
#include <fstream>

#include "core/io/checkpoint.h"
#include "core/io/fingerprint.h"
#include "core/io/h5.h"
#include "core/model/hooks.h"
#include "core/model/transformer.h"
#include "support/test_support.h"

namespace {

using hh::model::ModelConfig;
using hh::model::Transformer;
namespace fs = std::filesystem;

using Result = hh::test::CommandResult;
const auto run_cli = hh::test::run_hydrahead;

ModelConfig tiny_config(bool tied) {
  ModelConfig c;
  c.vocab_size = 97;
  c.hidden_size = 48;
  c.intermediate_size = 80;
  c.num_hidden_layers = 2;
  c.num_attention_heads = 6;
  c.num_key_value_heads = 2;
  c.head_dim = 12;  // != hidden / heads
  c.rope_theta = 10000.0;
  c.tie_word_embeddings = tied;
  return c;
}

class CliRun : public ::testing::TestWithParam<bool> {
 protected:
  void SetUp() override {
    dir_ = hh::test::scratch_dir("cli_run");
    cfg_ = tiny_config(GetParam());
    weights_ = hh::model::random_weights(cfg_, /*seed=*/11, torch::kFloat32, /*std=*/0.1);
    hh::model::save_model(dir_ / "model", cfg_, weights_);
  }
  fs::path dir_;
  ModelConfig cfg_;
  hh::model::Weights weights_;
};

TEST_P(CliRun, LogitsAndHooksEqualInProcessForward) {
  const auto out = dir_ / "out.h5";
  const auto r = run_cli("run --model " + (dir_ / "model").string() + " --tokens 5,17,3,96,0,42 --out " +
                         out.string() + " --hooks blocks.1.attn.hook_z,blocks.0.hook_resid_post");
  ASSERT_EQ(r.status, 0) << r.output;

  const Transformer model(cfg_, weights_);
  hh::model::Hooks hooks;
  std::map<std::string, torch::Tensor> cache;
  hooks.cache("blocks.1.attn.hook_z", &cache);
  hooks.cache("blocks.0.hook_resid_post", &cache);
  const auto ids = torch::tensor(std::vector<int64_t>{5, 17, 3, 96, 0, 42}).unsqueeze(0);
  torch::NoGradGuard ng;
  hh::model::ForwardOptions opts;
  opts.hooks = &hooks;
  const auto expect = model.forward(ids, opts).logits.squeeze(0);  // [T, V]

  const auto f = hh::io::H5File::open_read(out);
  EXPECT_EQ(f.attr_string("/", "format"), "hydrahead-run");
  EXPECT_EQ(f.attr_string("/", "model_fingerprint"), hh::io::model_fingerprint(dir_ / "model"));
  const auto logits = f.read("/logits");
  ASSERT_EQ(logits.sizes().vec(), (std::vector<int64_t>{6, cfg_.vocab_size}));
  EXPECT_TRUE(torch::allclose(logits, expect, /*rtol=*/1e-6, /*atol=*/1e-6));
  EXPECT_TRUE(torch::equal(f.read("/tokens"), ids.squeeze(0)));
  const auto z = f.read("/hooks/blocks.1.attn.hook_z");  // [T, Hq, Dh]
  ASSERT_EQ(z.sizes().vec(), (std::vector<int64_t>{6, 6, 12}));
  EXPECT_TRUE(torch::allclose(z, cache.at("blocks.1.attn.hook_z").squeeze(0), 1e-6, 1e-6));
  EXPECT_EQ(f.dim_labels("/hooks/blocks.1.attn.hook_z"), (std::vector<std::string>{"position", "head", "head_dim"}));
  EXPECT_TRUE(torch::allclose(f.read("/hooks/blocks.0.hook_resid_post"),
                              cache.at("blocks.0.hook_resid_post").squeeze(0), 1e-6, 1e-6));
}

TEST_P(CliRun, InspectJsonReportsTheCheckpoint) {
  const auto r = run_cli("inspect --json --model " + (dir_ / "model").string());
  ASSERT_EQ(r.status, 0) << r.output;
  const auto j = nlohmann::json::parse(r.output);
  EXPECT_EQ(j["num_layers"], 2);
  EXPECT_EQ(j["num_heads"], 6);
  EXPECT_EQ(j["num_kv_heads"], 2);
  EXPECT_EQ(j["head_dim"], 12);
  EXPECT_EQ(j["dtype"], "F32");
  EXPECT_EQ(j["parameters"], j["stored_parameters"]);
  // Hand count: embed 97*48; per layer q 72*48, k,v 24*48 each, o 48*72, norms 12+12+48+48,
  // MLP 3*80*48; final norm 48; lm_head 97*48 unless tied.
  const int64_t per_layer = 72 * 48 + 2 * 24 * 48 + 48 * 72 + 12 + 12 + 48 + 48 + 3 * 80 * 48;
  const int64_t expected = 97 * 48 + 2 * per_layer + 48 + (GetParam() ? 0 : 97 * 48);
  EXPECT_EQ(j["parameters"].get<int64_t>(), expected);
  EXPECT_EQ(j["kv_groups"], nlohmann::json::parse("[[0,1,2],[3,4,5]]"));
  EXPECT_EQ(j["fingerprint"], hh::io::model_fingerprint(dir_ / "model"));
}

TEST_P(CliRun, OutOfRangeTokenFailsWithoutOutput) {
  const auto out = dir_ / "bad.h5";
  const auto r = run_cli("run --model " + (dir_ / "model").string() + " --tokens 1,97 --out " + out.string());
  EXPECT_EQ(r.status, 1) << r.output;
  EXPECT_NE(r.output.find("token id 97 at position 1"), std::string::npos) << r.output;
  EXPECT_FALSE(fs::exists(out));
}

TEST_P(CliRun, MissingTensorIsNamed) {
  // Rewrite the checkpoint without one tensor.
  hh::io::Checkpoint ck(dir_ / "model");
  std::vector<std::pair<std::string, torch::Tensor>> kept;
  for (const auto& name : ck.tensor_names())
    if (name != "model.layers.1.mlp.up_proj.weight") kept.emplace_back(name, ck.load(name));
  const auto broken = dir_ / "broken";
  fs::create_directories(broken);
  fs::copy_file(dir_ / "model" / "config.json", broken / "config.json");
  hh::io::save_tensors(broken / "model.safetensors", kept);
  const auto out = dir_ / "broken.h5";
  const auto r = run_cli("run --model " + broken.string() + " --tokens 1,2 --out " + out.string());
  EXPECT_EQ(r.status, 1) << r.output;
  EXPECT_NE(r.output.find("model.layers.1.mlp.up_proj.weight"), std::string::npos) << r.output;
  EXPECT_FALSE(fs::exists(out));
}

TEST_P(CliRun, UnknownHookIsRefused) {
  const auto r = run_cli("run --model " + (dir_ / "model").string() + " --tokens 1 --out " +
                         (dir_ / "x.h5").string() + " --hooks blocks.9.attn.hook_z");
  EXPECT_EQ(r.status, 1) << r.output;
  EXPECT_NE(r.output.find("blocks.9.attn.hook_z"), std::string::npos) << r.output;
}

TEST_P(CliRun, H5pyReadsTheOutput) {
  const std::string python = hh::test::python_with_h5py();
  ASSERT_FALSE(python.empty()) << "h5py is not importable by python3 or /usr/bin/python3 (scripts/test installs python3-h5py)";
  const auto out = dir_ / "py.h5";
  ASSERT_EQ(run_cli("run --model " + (dir_ / "model").string() + " --tokens 3,4,5 --out " + out.string() +
                    " --hooks blocks.0.attn.hook_q").status, 0);
  const std::string py =
      python + " -c \"import h5py,sys; f=h5py.File(sys.argv[1],'r'); "
      "assert f['logits'].shape==(3,97), f['logits'].shape; assert list(f['tokens'][...])==[3,4,5]; "
      "assert f['logits'].dims[1].label=='vocab'; assert f['hooks/blocks.0.attn.hook_q'].shape==(3,6,12); "
      "assert f.attrs['format']=='hydrahead-run'\" " + out.string();
  EXPECT_EQ(std::system(py.c_str()), 0);
}

INSTANTIATE_TEST_SUITE_P(TiedAndUntied, CliRun, ::testing::Bool(),
                         [](const auto& info) { return info.param ? "tied" : "untied"; });

}  // namespace
