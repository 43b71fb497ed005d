// config.json of Qwen3 dense checkpoints: the real Qwen3-0.6B file, defaults, and one test per
// validation rule checking that the message names the field.
#include <gtest/gtest.h>

#include <fstream>
#include <string>

#include <nlohmann/json.hpp>

#include "core/model/config.h"
#include "core/util/error.h"
#include "support/test_support.h"

namespace {

using hh::model::ModelConfig;
using nlohmann::json;

// config.json of Qwen/Qwen3-0.6B as published.
constexpr const char* kQwen3_0_6B = R"({
  "architectures": [
    "Qwen3ForCausalLM"
  ],
  "attention_bias": false,
  "attention_dropout": 0.0,
  "bos_token_id": 151643,
  "eos_token_id": 151645,
  "head_dim": 128,
  "hidden_act": "silu",
  "hidden_size": 1024,
  "initializer_range": 0.02,
  "intermediate_size": 3072,
  "max_position_embeddings": 40960,
  "max_window_layers": 28,
  "model_type": "qwen3",
  "num_attention_heads": 16,
  "num_hidden_layers": 28,
  "num_key_value_heads": 8,
  "rms_norm_eps": 1e-06,
  "rope_scaling": null,
  "rope_theta": 1000000,
  "sliding_window": null,
  "tie_word_embeddings": true,
  "torch_dtype": "bfloat16",
  "transformers_version": "4.51.0",
  "use_cache": true,
  "use_sliding_window": false,
  "vocab_size": 151936
}
)";

// embed 151936*1024 + 28 * (q 2048*1024 + k,v 2*1024*1024 + o 1024*2048 + q/k norm 2*128
// + 2 layer norms 2*1024 + MLP 3*3072*1024) + final norm 1024; lm_head tied.
constexpr int64_t kQwen3_0_6B_Params = 596049920;

json qwen3_json() { return json::parse(kQwen3_0_6B); }

using hh::test::error_of;

// The error from parsing Qwen3-0.6B's config with `field` set to `value` (null erases it).
std::string error_with(const std::string& field, const json& value) {
  json j = qwen3_json();
  if (value.is_null()) j.erase(field);
  else j[field] = value;
  return error_of([&] { ModelConfig::from_json(j, "config.json"); });
}

TEST(ModelConfig, Qwen3_0_6B) {
  const auto c = ModelConfig::from_json_text(kQwen3_0_6B, "config.json");
  EXPECT_EQ(c.architecture, "Qwen3ForCausalLM");
  EXPECT_EQ(c.model_type, "qwen3");
  EXPECT_EQ(c.vocab_size, 151936);
  EXPECT_EQ(c.hidden_size, 1024);
  EXPECT_EQ(c.intermediate_size, 3072);
  EXPECT_EQ(c.num_hidden_layers, 28);
  EXPECT_EQ(c.num_attention_heads, 16);
  EXPECT_EQ(c.num_key_value_heads, 8);
  EXPECT_EQ(c.head_dim, 128);  // from the file, not hidden/heads (= 64)
  EXPECT_EQ(c.kv_group_size(), 2);
  EXPECT_DOUBLE_EQ(c.rms_norm_eps, 1e-6);
  EXPECT_DOUBLE_EQ(c.rope_theta, 1e6);
  EXPECT_EQ(c.max_position_embeddings, 40960);
  EXPECT_TRUE(c.tie_word_embeddings);
  EXPECT_FALSE(c.attention_bias);
  EXPECT_EQ(c.torch_dtype, "bfloat16");
  EXPECT_EQ(c.bos_token_id, 151643);
  EXPECT_EQ(c.eos_token_id, 151645);
  EXPECT_EQ(c.num_parameters(), kQwen3_0_6B_Params);
}

TEST(ModelConfig, UntiedAddsLmHead) {
  json j = qwen3_json();
  j["tie_word_embeddings"] = false;
  EXPECT_EQ(ModelConfig::from_json(j, "config.json").num_parameters(), kQwen3_0_6B_Params + 151936LL * 1024);
}

TEST(ModelConfig, AttentionBiasAddsBiases) {
  json j = qwen3_json();
  j["attention_bias"] = true;
  // q bias Hq*Dh + k, v biases Hkv*Dh each, per layer.
  const int64_t biases = 28LL * (16 * 128 + 2 * 8 * 128);
  EXPECT_EQ(ModelConfig::from_json(j, "config.json").num_parameters(), kQwen3_0_6B_Params + biases);
}

TEST(ModelConfig, Defaults) {
  const json j = {{"model_type", "qwen3"},      {"vocab_size", 100},        {"hidden_size", 64},
                  {"intermediate_size", 128}, {"num_hidden_layers", 2}, {"num_attention_heads", 4}};
  const auto c = ModelConfig::from_json(j, "config.json");
  EXPECT_EQ(c.num_key_value_heads, 4);
  EXPECT_EQ(c.head_dim, 16);
  EXPECT_DOUBLE_EQ(c.rms_norm_eps, 1e-6);
  EXPECT_DOUBLE_EQ(c.rope_theta, 1e6);
  EXPECT_FALSE(c.tie_word_embeddings);
  EXPECT_FALSE(c.attention_bias);
  EXPECT_FALSE(c.eos_token_id.has_value());
  // embed + lm_head 2*100*64 + 2 * (q,k,v,o 4*64*64 + norms 2*16 + 2*64 + MLP 3*128*64) + 64
  EXPECT_EQ(c.num_parameters(), 2 * 100 * 64 + 2 * (4 * 64 * 64 + 2 * 16 + 2 * 64 + 3 * 128 * 64) + 64);
}

TEST(ModelConfig, AcceptsFloatThetaNewerFieldNamesAndNulls) {
  json j = qwen3_json();
  j["rope_theta"] = 500000.0;
  j["num_key_value_heads"] = nullptr;  // null means "absent": Hkv = Hq
  EXPECT_DOUBLE_EQ(ModelConfig::from_json(j, "c").rope_theta, 5e5);
  EXPECT_EQ(ModelConfig::from_json(j, "c").num_key_value_heads, 16);

  // HF >= 5 writes "dtype" and "rope_parameters".
  json k = qwen3_json();
  k.erase("torch_dtype");
  k.erase("rope_theta");
  k["dtype"] = "float32";
  k["rope_parameters"] = {{"rope_type", "default"}, {"rope_theta", 10000}};
  const auto c = ModelConfig::from_json(k, "c");
  EXPECT_EQ(c.torch_dtype, "float32");
  EXPECT_DOUBLE_EQ(c.rope_theta, 1e4);
}

TEST(ModelConfig, ModelTypeWithoutArchitectures) {
  json j = qwen3_json();
  j.erase("architectures");
  EXPECT_EQ(ModelConfig::from_json(j, "c").architecture, "Qwen3ForCausalLM");
}

TEST(ModelConfig, ToJsonRoundTrips) {
  const auto a = ModelConfig::from_json_text(kQwen3_0_6B, "config.json");
  const json j = a.to_json();
  EXPECT_EQ(j["architectures"][0], "Qwen3ForCausalLM");
  EXPECT_EQ(j["head_dim"], 128);
  const auto b = ModelConfig::from_json(j, "roundtrip");
  EXPECT_EQ(b.num_parameters(), a.num_parameters());
  EXPECT_EQ(b.to_json(), j);
}

TEST(ModelConfig, LoadFromFile) {
  const auto dir = hh::test::scratch_dir("config");
  std::ofstream(dir / "config.json") << kQwen3_0_6B;
  EXPECT_EQ(ModelConfig::load(dir / "config.json").num_parameters(), kQwen3_0_6B_Params);
  EXPECT_MENTIONS(error_of([&] { ModelConfig::load(dir / "absent.json"); }), "absent.json");
}

// ---- validation: each message names the file and the field -----------------------------------

TEST(ModelConfigErrors, TruncatedFileNamesFileAndPosition) {
  const std::string text = std::string(kQwen3_0_6B).substr(0, 200);
  const auto msg = error_of([&] { ModelConfig::from_json_text(text, "/ckpt/config.json"); });
  EXPECT_MENTIONS(msg, "/ckpt/config.json");
  EXPECT_MENTIONS(msg, "line");
  EXPECT_MENTIONS(msg, "column");
}

// nlohmann reports a literal beyond double's range as out_of_range, not as a parse error.
TEST(ModelConfigErrors, NumberOutOfRange) {
  const auto msg = error_of([] { ModelConfig::from_json_text(R"({"rope_theta": 1e999})", "config.json"); });
  EXPECT_MENTIONS(msg, "config.json");
  EXPECT_MENTIONS(msg, "1e999");
}

TEST(ModelConfigErrors, NotAnObject) {
  EXPECT_MENTIONS(error_of([] { ModelConfig::from_json_text("[1]", "config.json"); }), "config.json");
}

TEST(ModelConfigErrors, MissingRequiredField) {
  for (const char* field : {"vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"}) {
    const auto msg = error_with(field, nullptr);
    EXPECT_MENTIONS(msg, "config.json");
    EXPECT_MENTIONS(msg, std::string("\"") + field + "\"");
    EXPECT_MENTIONS(msg, "missing");
  }
}

TEST(ModelConfigErrors, RequiredFieldsMustBePositiveIntegers) {
  for (const char* field : {"vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"}) {
    SCOPED_TRACE(field);
    auto msg = error_with(field, 1024.0);
    EXPECT_MENTIONS(msg, std::string("\"") + field + "\"");
    EXPECT_MENTIONS(msg, "1024.0");
    msg = error_with(field, "1024");
    EXPECT_MENTIONS(msg, std::string("\"") + field + "\"");
    EXPECT_MENTIONS(msg, "\"1024\"");
    msg = error_with(field, -4);
    EXPECT_MENTIONS(msg, std::string("\"") + field + "\"");
    EXPECT_MENTIONS(msg, "-4");
    EXPECT_MENTIONS(error_with(field, 0), std::string("\"") + field + "\"");
  }
}

TEST(ModelConfigErrors, KvHeadsMustDivideHeads) {
  const auto msg = error_with("num_key_value_heads", 6);
  EXPECT_MENTIONS(msg, "\"num_key_value_heads\"");
  EXPECT_MENTIONS(msg, "6 does not divide num_attention_heads 16");
}

TEST(ModelConfigErrors, HeadDimMustDivideWhenAbsent) {
  json j = qwen3_json();
  j.erase("head_dim");
  j["num_attention_heads"] = 24;
  j["num_key_value_heads"] = 8;
  const auto msg = error_of([&] { ModelConfig::from_json(j, "config.json"); });
  EXPECT_MENTIONS(msg, "\"head_dim\"");
  EXPECT_MENTIONS(msg, "1024");
}

TEST(ModelConfigErrors, HiddenActMustBeSilu) {
  const auto msg = error_with("hidden_act", "gelu");
  EXPECT_MENTIONS(msg, "\"hidden_act\"");
  EXPECT_MENTIONS(msg, "gelu");
}

TEST(ModelConfigErrors, RopeScalingUnsupported) {
  const auto msg = error_with("rope_scaling", json{{"rope_type", "yarn"}, {"factor", 4.0}});
  EXPECT_MENTIONS(msg, "\"rope_scaling\"");
  EXPECT_MENTIONS(msg, "not supported");
  EXPECT_MENTIONS(error_with("rope_parameters", json{{"rope_type", "linear"}}), "\"rope_parameters\"");
}

TEST(ModelConfigErrors, ArchitectureMustBeQwen3) {
  auto msg = error_with("architectures", json::array({"LlamaForCausalLM"}));
  EXPECT_MENTIONS(msg, "\"architectures\"");
  EXPECT_MENTIONS(msg, "LlamaForCausalLM");
  msg = error_with("model_type", "llama");
  EXPECT_MENTIONS(msg, "\"model_type\"");
  json j = qwen3_json();
  j.erase("architectures");
  j.erase("model_type");
  EXPECT_MENTIONS(error_of([&] { ModelConfig::from_json(j, "config.json"); }), "\"architectures\"");
}

TEST(ModelConfigErrors, SlidingWindowUnsupported) {
  auto msg = error_with("use_sliding_window", true);
  EXPECT_MENTIONS(msg, "\"use_sliding_window\"");
  EXPECT_MENTIONS(msg, "not supported");
  msg = error_with("layer_types", json::array({"full_attention", "sliding_attention"}));
  EXPECT_MENTIONS(msg, "\"layer_types\"");
}

TEST(ModelConfigErrors, OptionalFieldsAreTypeChecked) {
  EXPECT_MENTIONS(error_with("tie_word_embeddings", "yes"), "\"tie_word_embeddings\"");
  EXPECT_MENTIONS(error_with("attention_bias", 1), "\"attention_bias\"");
  EXPECT_MENTIONS(error_with("rms_norm_eps", -1e-6), "\"rms_norm_eps\"");
  EXPECT_MENTIONS(error_with("rope_theta", "1e6"), "\"rope_theta\"");
  EXPECT_MENTIONS(error_with("head_dim", 128.5), "\"head_dim\"");
  EXPECT_MENTIONS(error_with("torch_dtype", "float8"), "\"torch_dtype\"");
  EXPECT_MENTIONS(error_with("eos_token_id", -1), "\"eos_token_id\"");
}

TEST(ModelConfigErrors, ParameterCountOverflow) {
  json j = qwen3_json();
  j["vocab_size"] = int64_t(1) << 40;
  j["hidden_size"] = int64_t(1) << 40;
  j["head_dim"] = 64;
  EXPECT_MENTIONS(error_of([&] { ModelConfig::from_json(j, "config.json"); }), "config.json");
}

}  // namespace
