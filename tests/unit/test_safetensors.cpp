// safetensors container: byte-exact round trips, checkpoints (single and sharded), and one test per
// kind of corrupt file, each checking that the message names the file and the tensor.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <cstring>
#include <iterator>
#include <fstream>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/io/checkpoint.h"
#include "core/io/safetensors.h"
#include "core/util/error.h"
#include "support/test_support.h"

namespace {

namespace fs = std::filesystem;
using hh::io::Checkpoint;
using hh::io::DType;
using hh::io::SafetensorsFile;
using hh::io::TensorBlob;

using hh::test::error_of;

// A hand-made file: 8-byte length (N unless overridden), the JSON, then `data_bytes` bytes.
void write_raw(const fs::path& path, const std::string& json, std::size_t data_bytes,
               std::optional<uint64_t> length_field = std::nullopt) {
  const uint64_t n = length_field.value_or(json.size());
  std::ofstream out(path, std::ios::binary);
  for (int i = 0; i < 8; ++i) out.put(static_cast<char>((n >> (8 * i)) & 0xff));
  out << json;
  out << std::string(data_bytes, '\x5a');
}

std::vector<uint8_t> pattern_bytes(std::size_t n, uint8_t seed) {
  std::vector<uint8_t> v(n);
  for (std::size_t i = 0; i < n; ++i) v[i] = static_cast<uint8_t>(seed + i * 37);
  return v;
}

std::vector<std::string> entries_in(const fs::path& dir) {
  std::vector<std::string> names;
  for (const auto& e : fs::directory_iterator(dir)) names.push_back(e.path().filename().string());
  std::sort(names.begin(), names.end());
  return names;
}

// ---- round trips --------------------------------------------------------------------------------

TEST(Safetensors, RoundTripEveryDtypeByteExact) {
  const auto dir = hh::test::scratch_dir("st");
  const auto path = dir / "all.safetensors";
  struct Spec {
    std::string name;
    DType dtype;
    std::vector<int64_t> shape;
  };
  const std::vector<Spec> specs = {
      {"f64", DType::F64, {3, 2}},    {"f32", DType::F32, {5}},     {"f16", DType::F16, {2, 3, 2}},
      {"bf16", DType::BF16, {7}},     {"i64", DType::I64, {2, 2}},  {"i32", DType::I32, {3}},
      {"i16", DType::I16, {4, 1}},    {"i8", DType::I8, {9}},       {"u8", DType::U8, {3, 3}},
      {"bool", DType::BOOL, {2}},     {"scalar", DType::F32, {}},   {"empty", DType::F32, {0, 4}},
  };
  std::vector<std::vector<uint8_t>> payloads;
  std::vector<TensorBlob> blobs;
  for (std::size_t i = 0; i < specs.size(); ++i) {
    int64_t numel = 1;
    for (const auto d : specs[i].shape) numel *= d;
    payloads.push_back(pattern_bytes(static_cast<std::size_t>(numel) * hh::io::dtype_size(specs[i].dtype),
                                     static_cast<uint8_t>(i)));
    if (specs[i].dtype == DType::BOOL)
      for (auto& b : payloads.back()) b &= 1;
  }
  for (std::size_t i = 0; i < specs.size(); ++i)
    blobs.push_back({specs[i].name, specs[i].dtype, specs[i].shape, payloads[i].data(), payloads[i].size()});
  hh::io::write_safetensors(path, blobs, {{"purpose", "test"}});

  SafetensorsFile f(path);
  EXPECT_EQ(f.header().metadata.at("purpose"), "test");
  EXPECT_EQ(f.header().header_len % 8, 0u) << "data section must start 8-byte aligned";
  EXPECT_EQ(f.header().tensors.size(), specs.size());
  for (std::size_t i = 0; i < specs.size(); ++i) {
    SCOPED_TRACE(specs[i].name);
    const auto& info = f.info(specs[i].name);
    EXPECT_EQ(info.dtype, specs[i].dtype);
    EXPECT_EQ(info.shape, specs[i].shape);
    ASSERT_EQ(info.end - info.begin, payloads[i].size());
    EXPECT_EQ(std::memcmp(f.data(info), payloads[i].data(), payloads[i].size()), 0);
  }
  // Tensors come back in data order, which is the order they were written in.
  EXPECT_EQ(f.header().tensors.front().name, "f64");
  // The file is byte-for-byte: prefix + header + payloads back to back.
  uint64_t expected_size = 8 + f.header().header_len;
  for (const auto& p : payloads) expected_size += p.size();
  EXPECT_EQ(fs::file_size(path), expected_size);
  // No temp file is left next to it.
  EXPECT_EQ(entries_in(dir), std::vector<std::string>{"all.safetensors"});
}

TEST(Safetensors, HeaderIsPaddedWithSpaces) {
  const auto path = hh::test::scratch_dir("st") / "pad.safetensors";
  const float x = 1.5f;
  hh::io::write_safetensors(path, {{"a", DType::F32, {1}, &x, sizeof(x)}});
  SafetensorsFile f(path);
  const std::string& json = f.header_json();
  EXPECT_EQ(json.size() % 8, 0u);
  EXPECT_EQ(json.front(), '{');
  const auto last = json.find_last_not_of(' ');
  EXPECT_EQ(json[last], '}');
  EXPECT_LT(json.size() - last - 1, 8u);
}

TEST(Safetensors, DtypeNames) {
  EXPECT_EQ(hh::io::dtype_from_name("BF16"), DType::BF16);
  EXPECT_EQ(hh::io::dtype_name(DType::I64), "I64");
  EXPECT_EQ(hh::io::dtype_size(DType::F64), 8u);
  const auto msg = error_of([] { hh::io::dtype_from_name("F8_E4M3"); });
  EXPECT_MENTIONS(msg, "F8_E4M3");
}

TEST(Safetensors, TorchRoundTripEveryDtype) {
  const auto dir = hh::test::scratch_dir("st");
  torch::manual_seed(0);
  const std::vector<std::pair<std::string, at::Tensor>> tensors = {
      {"f64", torch::randn({3, 4}, torch::kDouble)},
      {"f32", torch::randn({2, 3, 4})},
      {"f16", torch::randn({5}).to(torch::kHalf)},
      {"bf16", torch::randn({4, 4}).to(torch::kBFloat16)},
      {"i64", torch::arange(-6, 6, torch::kLong).reshape({3, 4})},
      {"i32", torch::arange(0, 10, torch::kInt)},
      {"i16", torch::arange(-3, 3, torch::kShort)},
      {"i8", torch::arange(-4, 4, torch::kChar)},
      {"u8", torch::arange(0, 255, torch::kByte)},
      {"bool", torch::tensor({true, false, true})},
      {"transposed", torch::arange(0, 12, torch::kFloat).reshape({3, 4}).t()},  // non-contiguous input
      {"scalar", torch::tensor(3.25)},
  };
  hh::io::save_tensors(dir / "model.safetensors", tensors);
  Checkpoint ck(dir);
  EXPECT_EQ(ck.tensor_names().size(), tensors.size());
  for (const auto& [name, t] : tensors) {
    SCOPED_TRACE(name);
    const at::Tensor back = ck.load(name);
    EXPECT_EQ(back.scalar_type(), t.scalar_type());
    EXPECT_EQ(back.sizes(), t.sizes());
    EXPECT_TRUE(torch::equal(back, t.contiguous()));
  }
  // HF transformers refuses shards without format=pt metadata.
  SafetensorsFile f(dir / "model.safetensors");
  EXPECT_EQ(f.header().metadata.at("format"), "pt");
}

TEST(Safetensors, SaveRejectsUnsupportedDtype) {
  const auto dir = hh::test::scratch_dir("st");
  const auto msg = error_of([&] {
    hh::io::save_tensors(dir / "model.safetensors", {{"complex", torch::zeros({2}, torch::kComplexFloat)}});
  });
  EXPECT_MENTIONS(msg, "model.safetensors");
  EXPECT_MENTIONS(msg, "'complex'");
  EXPECT_TRUE(entries_in(dir).empty());
}

TEST(Safetensors, ShardedCheckpointRoundTrip) {
  const auto dir = hh::test::scratch_dir("st");
  std::vector<std::pair<std::string, at::Tensor>> tensors;
  for (int l = 0; l < 5; ++l)
    tensors.emplace_back("model.layers." + std::to_string(l) + ".mlp.up_proj.weight",
                         torch::full({16, 8}, float(l), torch::kFloat));  // 512 bytes each
  tensors.emplace_back("model.norm.weight", torch::ones({8}, torch::kBFloat16));
  const auto files = hh::io::save_sharded(dir, tensors, /*max_shard_bytes=*/1100, {{"note", "sharded"}});
  // 512 + 512 fit in 1100, the third does not: shards of 2, 2, 1+norm.
  ASSERT_EQ(files.size(), 4u);
  EXPECT_EQ(files[0], "model-00001-of-00003.safetensors");
  EXPECT_EQ(files[2], "model-00003-of-00003.safetensors");
  EXPECT_EQ(files[3], "model.safetensors.index.json");

  std::ifstream in(dir / "model.safetensors.index.json");
  const auto index = nlohmann::json::parse(in);
  EXPECT_EQ(index["metadata"]["total_size"].get<uint64_t>(), 5u * 512u + 16u);
  EXPECT_EQ(index["weight_map"]["model.norm.weight"], "model-00003-of-00003.safetensors");

  Checkpoint ck(dir);
  const auto names = ck.tensor_names();
  ASSERT_EQ(names.size(), tensors.size());
  EXPECT_TRUE(std::is_sorted(names.begin(), names.end()));
  for (const auto& [name, t] : tensors) EXPECT_TRUE(torch::equal(ck.load(name), t)) << name;
  EXPECT_EQ(ck.info("model.norm.weight").dtype, DType::BF16);
  EXPECT_EQ(ck.load("model.norm.weight", {8}).numel(), 8);
  SafetensorsFile shard(dir / files[0]);
  EXPECT_EQ(shard.header().metadata.at("note"), "sharded");
  EXPECT_EQ(shard.header().metadata.at("format"), "pt");
}

TEST(Safetensors, SingleShardWritesPlainFileAndReplacesOldIndex) {
  const auto dir = hh::test::scratch_dir("st");
  const std::vector<std::pair<std::string, at::Tensor>> big = {{"a", torch::zeros({64})}, {"b", torch::ones({64})}};
  hh::io::save_sharded(dir, big, /*max_shard_bytes=*/256);
  ASSERT_TRUE(fs::exists(dir / "model.safetensors.index.json"));
  const auto files = hh::io::save_sharded(dir, big, /*max_shard_bytes=*/1 << 20);
  EXPECT_EQ(files, std::vector<std::string>{"model.safetensors"});
  EXPECT_FALSE(fs::exists(dir / "model.safetensors.index.json"));
  EXPECT_TRUE(torch::equal(Checkpoint(dir).load("b"), torch::ones({64})));
}

TEST(Safetensors, WriterRejectsBadInputAndLeavesNoFile) {
  const auto dir = hh::test::scratch_dir("st");
  const auto path = dir / "bad.safetensors";
  const float x[3] = {1, 2, 3};
  auto msg = error_of([&] { hh::io::write_safetensors(path, {{"w", DType::F32, {4}, x, sizeof(x)}}); });
  EXPECT_MENTIONS(msg, "bad.safetensors");
  EXPECT_MENTIONS(msg, "'w'");
  msg = error_of([&] {
    hh::io::write_safetensors(path, {{"w", DType::F32, {3}, x, sizeof(x)}, {"w", DType::F32, {3}, x, sizeof(x)}});
  });
  EXPECT_MENTIONS(msg, "'w'");
  EXPECT_TRUE(entries_in(dir).empty());
  // A directory that does not exist: the error names the target, nothing is created.
  msg = error_of([&] { hh::io::write_safetensors(dir / "missing" / "x.safetensors", {{"w", DType::F32, {3}, x, sizeof(x)}}); });
  EXPECT_MENTIONS(msg, "x.safetensors");
  EXPECT_TRUE(entries_in(dir).empty());
}

TEST(Safetensors, ParseBufferAcceptsAValidImage) {
  const auto path = hh::test::scratch_dir("st") / "x.safetensors";
  const int32_t v[2] = {7, -7};
  hh::io::write_safetensors(path, {{"v", DType::I32, {2}, v, sizeof(v)}});
  std::ifstream in(path, std::ios::binary);
  const std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const auto h = hh::io::parse_buffer(bytes.data(), bytes.size(), "mem");
  ASSERT_EQ(h.tensors.size(), 1u);
  EXPECT_EQ(h.tensors[0].name, "v");
  EXPECT_EQ(h.tensors[0].end, 8u);
}

TEST(Safetensors, ZeroSizedTensorsMaySitAnywhere) {
  const auto path = hh::test::scratch_dir("st") / "model.safetensors";
  write_raw(path,
            R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
            R"("e":{"dtype":"F32","shape":[0,5],"data_offsets":[4,4]},"__metadata__":null})",
            8);
  SafetensorsFile f(path);
  EXPECT_EQ(f.info("e").numel(), 0);
  EXPECT_TRUE(f.header().metadata.empty());
}

// ---- corrupt files: every message names the file, and the tensor where there is one --------------

class CorruptFile : public ::testing::Test {
 protected:
  void SetUp() override { path_ = hh::test::scratch_dir("st") / "model.safetensors"; }
  std::string open_error() {
    return error_of([&] { SafetensorsFile f(path_); });
  }
  fs::path path_;
};

TEST_F(CorruptFile, ShorterThanLengthPrefix) {
  std::ofstream(path_, std::ios::binary).write("\x10\x00\x00", 3);
  const auto msg = open_error();
  EXPECT_MENTIONS(msg, path_.string());
  EXPECT_MENTIONS(msg, "3 bytes");
}

TEST_F(CorruptFile, EmptyFile) {
  std::ofstream(path_, std::ios::binary).flush();
  EXPECT_MENTIONS(open_error(), path_.string());
}

TEST_F(CorruptFile, TruncatedInsideHeader) {
  const std::string json = R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})";
  write_raw(path_, json.substr(0, 20), 0, json.size());
  const auto msg = open_error();
  EXPECT_MENTIONS(msg, path_.string());
  EXPECT_MENTIONS(msg, "runs past the end of the file");
}

TEST_F(CorruptFile, TruncatedInsideData) {
  write_raw(path_, R"({"model.norm.weight":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}})", 10);
  const auto msg = open_error();
  EXPECT_MENTIONS(msg, path_.string());
  EXPECT_MENTIONS(msg, "'model.norm.weight'");
  EXPECT_MENTIONS(msg, "past the end of the data section (10 bytes)");
}

TEST_F(CorruptFile, AbsurdHeaderLength) {
  write_raw(path_, "{}", 0, uint64_t(1) << 62);
  auto msg = open_error();
  EXPECT_MENTIONS(msg, path_.string());
  EXPECT_MENTIONS(msg, "exceeds the limit");
  write_raw(path_, "{}", 0, hh::io::kMaxHeaderBytes + 1);
  msg = open_error();
  EXPECT_MENTIONS(msg, "exceeds the limit");
}

TEST_F(CorruptFile, OffsetsPastTheEnd) {
  write_raw(path_, R"({"lm_head.weight":{"dtype":"F32","shape":[4],"data_offsets":[16,32]}})", 24);
  const auto msg = open_error();
  EXPECT_MENTIONS(msg, path_.string());
  EXPECT_MENTIONS(msg, "tensor 'lm_head.weight': data_offsets [16, 32]");
}

TEST_F(CorruptFile, OverlappingOffsets) {
  write_raw(path_,
            R"({"a.weight":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
            R"("b.weight":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})",
            12);
  const auto msg = open_error();
  EXPECT_MENTIONS(msg, path_.string());
  EXPECT_MENTIONS(msg, "'b.weight'");
  EXPECT_MENTIONS(msg, "overlap tensor 'a.weight'");
}

TEST_F(CorruptFile, SizeMismatch) {
  write_raw(path_, R"({"model.norm.weight":{"dtype":"BF16","shape":[4],"data_offsets":[0,12]}})", 12);
  const auto msg = open_error();
  EXPECT_MENTIONS(msg, "model.safetensors: tensor 'model.norm.weight': data_offsets [0, 12] span 12 bytes but "
                       "shape [4] of BF16 needs 8");
}

TEST_F(CorruptFile, UnknownDtype) {
  write_raw(path_, R"({"q.weight":{"dtype":"F8_E4M3","shape":[4],"data_offsets":[0,4]}})", 4);
  const auto msg = open_error();
  EXPECT_MENTIONS(msg, path_.string());
  EXPECT_MENTIONS(msg, "'q.weight'");
  EXPECT_MENTIONS(msg, "unknown dtype 'F8_E4M3'");
}

TEST_F(CorruptFile, BadJson) {
  write_raw(path_, R"({"w":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},)", 4);
  const auto msg = open_error();
  EXPECT_MENTIONS(msg, path_.string());
  EXPECT_MENTIONS(msg, "not valid JSON");
}

TEST_F(CorruptFile, HeaderNotAnObject) {
  write_raw(path_, "[1, 2]  ", 0);
  EXPECT_MENTIONS(open_error(), "must be a JSON object");
}

TEST_F(CorruptFile, EntryNotAnObject) {
  write_raw(path_, R"({"w":[0,4]})", 4);
  const auto msg = open_error();
  EXPECT_MENTIONS(msg, "tensor 'w': entry must be an object");
}

TEST_F(CorruptFile, BeginAfterEnd) {
  write_raw(path_, R"({"w":{"dtype":"U8","shape":[0],"data_offsets":[4,2]}})", 4);
  EXPECT_MENTIONS(open_error(), "tensor 'w': data_offsets [4, 2]: begin is after end");
}

TEST_F(CorruptFile, NegativeShape) {
  write_raw(path_, R"({"w":{"dtype":"F32","shape":[-1,4],"data_offsets":[0,4]}})", 4);
  const auto msg = open_error();
  EXPECT_MENTIONS(msg, "tensor 'w'");
  EXPECT_MENTIONS(msg, "non-negative integers, found -1");
}

TEST_F(CorruptFile, FloatShape) {
  write_raw(path_, R"({"w":{"dtype":"F32","shape":[1.5],"data_offsets":[0,4]}})", 4);
  EXPECT_MENTIONS(open_error(), "tensor 'w'");
}

TEST_F(CorruptFile, ShapeOverflowsByteCount) {
  // 2^62 * 2^2 elements of 4 bytes: numel fits in int64 but the byte count wraps to 0.
  write_raw(path_, R"({"w":{"dtype":"F32","shape":[4611686018427387904,4],"data_offsets":[0,0]}})", 0);
  const auto msg = open_error();
  EXPECT_MENTIONS(msg, "tensor 'w'");
  EXPECT_MENTIONS(msg, "overflows");
}

TEST_F(CorruptFile, DataOffsetsNotTwoIntegers) {
  write_raw(path_, R"({"w":{"dtype":"F32","shape":[1],"data_offsets":[0]}})", 4);
  EXPECT_MENTIONS(open_error(), "tensor 'w': \"data_offsets\" must be an array of 2 integers");
  write_raw(path_, R"({"w":{"dtype":"F32","shape":[1],"data_offsets":[0,"4"]}})", 4);
  EXPECT_MENTIONS(open_error(), "tensor 'w': \"data_offsets\" must hold 2 non-negative integers");
  write_raw(path_, R"({"w":{"dtype":"F32","shape":[1],"data_offsets":[-4,4]}})", 4);
  EXPECT_MENTIONS(open_error(), "tensor 'w'");
}

TEST_F(CorruptFile, MissingField) {
  write_raw(path_, R"({"w":{"dtype":"F32","data_offsets":[0,4]}})", 4);
  EXPECT_MENTIONS(open_error(), "tensor 'w': missing \"shape\"");
}

TEST_F(CorruptFile, DuplicateTensorName) {
  write_raw(path_,
            R"({"w":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},)"
            R"("w":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})",
            8);
  const auto msg = open_error();
  EXPECT_MENTIONS(msg, path_.string());
  EXPECT_MENTIONS(msg, "duplicate tensor name 'w'");
}

TEST_F(CorruptFile, MetadataMustBeStrings) {
  write_raw(path_, R"({"__metadata__":{"format":"pt","step":3}})", 0);
  auto msg = open_error();
  EXPECT_MENTIONS(msg, path_.string());
  EXPECT_MENTIONS(msg, "\"__metadata__\" entry 'step' must be a string");
  write_raw(path_, R"({"__metadata__":["pt"]})", 0);
  EXPECT_MENTIONS(open_error(), "\"__metadata__\" must be an object");
}

// ---- checkpoint directories ---------------------------------------------------------------------

TEST(CheckpointErrors, IndexNamesTensorMissingFromItsShard) {
  const auto dir = hh::test::scratch_dir("ck");
  std::vector<std::pair<std::string, at::Tensor>> tensors = {{"a", torch::zeros({64})}, {"b", torch::ones({64})}};
  hh::io::save_sharded(dir, tensors, /*max_shard_bytes=*/256);
  // Point "b" at the shard that holds only "a".
  auto index = nlohmann::json::parse(std::ifstream(dir / "model.safetensors.index.json"));
  index["weight_map"]["b"] = "model-00001-of-00002.safetensors";
  std::ofstream(dir / "model.safetensors.index.json") << index.dump();
  const auto msg = error_of([&] { Checkpoint ck(dir); });
  EXPECT_MENTIONS(msg, "model.safetensors.index.json");
  EXPECT_MENTIONS(msg, "model-00001-of-00002.safetensors");
  EXPECT_MENTIONS(msg, "'b'");
}

TEST(CheckpointErrors, IndexNamesMissingShard) {
  const auto dir = hh::test::scratch_dir("ck");
  hh::io::save_sharded(dir, {{"a", torch::zeros({64})}, {"b", torch::ones({64})}}, /*max_shard_bytes=*/256);
  fs::remove(dir / "model-00002-of-00002.safetensors");
  const auto msg = error_of([&] { Checkpoint ck(dir); });
  EXPECT_MENTIONS(msg, "model.safetensors.index.json");
  EXPECT_MENTIONS(msg, "model-00002-of-00002.safetensors");
  EXPECT_MENTIONS(msg, "'b'");
}

TEST(CheckpointErrors, IndexShardMustBeAPlainFileName) {
  const auto dir = hh::test::scratch_dir("ck");
  std::ofstream(dir / "model.safetensors.index.json") << R"({"weight_map":{"a":"../elsewhere.safetensors"}})";
  const auto msg = error_of([&] { Checkpoint ck(dir); });
  EXPECT_MENTIONS(msg, "model.safetensors.index.json");
  EXPECT_MENTIONS(msg, "'a'");
}

TEST(CheckpointErrors, NoWeights) {
  const auto dir = hh::test::scratch_dir("ck");
  EXPECT_MENTIONS(error_of([&] { Checkpoint ck(dir); }), dir.string());
}

TEST(CheckpointErrors, ShapeMismatchOnCheckedLoad) {
  const auto dir = hh::test::scratch_dir("ck");
  hh::io::save_tensors(dir / "model.safetensors", {{"model.embed_tokens.weight", torch::zeros({10, 4})}});
  Checkpoint ck(dir);
  EXPECT_EQ(ck.load("model.embed_tokens.weight", {10, 4}).sizes(), (std::vector<int64_t>{10, 4}));
  const auto msg = error_of([&] { ck.load("model.embed_tokens.weight", {12, 4}); });
  EXPECT_MENTIONS(msg, "model.safetensors");
  EXPECT_MENTIONS(msg, "'model.embed_tokens.weight'");
  EXPECT_MENTIONS(msg, "expected shape [12, 4] but the file holds [10, 4]");
}

TEST(CheckpointErrors, AbsentTensorNamesFileAndTensor) {
  const auto dir = hh::test::scratch_dir("ck");
  hh::io::save_tensors(dir / "model.safetensors", {{"a", torch::zeros({2})}});
  Checkpoint ck(dir);
  EXPECT_FALSE(ck.contains("lm_head.weight"));
  const auto msg = error_of([&] { ck.load("lm_head.weight"); });
  EXPECT_MENTIONS(msg, "model.safetensors");
  EXPECT_MENTIONS(msg, "'lm_head.weight'");
}

TEST(CheckpointErrors, CorruptShardIsNamed) {
  const auto dir = hh::test::scratch_dir("ck");
  hh::io::save_sharded(dir, {{"a", torch::zeros({64})}, {"b", torch::ones({64})}}, /*max_shard_bytes=*/256);
  fs::resize_file(dir / "model-00002-of-00002.safetensors", 100);
  const auto msg = error_of([&] { Checkpoint ck(dir); });
  EXPECT_MENTIONS(msg, "model-00002-of-00002.safetensors");
}

}  // namespace
