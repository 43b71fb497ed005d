// Model fingerprint: depends on config.json and the safetensors headers, not on where the directory
// lives or on the weights themselves.
#include <gtest/gtest.h>

#include <fstream>
#include <string>
#include <vector>

#include "core/io/fingerprint.h"
#include "core/io/safetensors.h"
#include "core/io/sha256.h"
#include "core/util/error.h"
#include "support/test_support.h"

namespace {

namespace fs = std::filesystem;
using hh::io::DType;
using hh::io::model_fingerprint;

constexpr const char* kConfig = R"({"model_type": "qwen3", "vocab_size": 8})";

// A two-shard checkpoint whose weights are all `fill`.
void make_checkpoint(const fs::path& dir, float fill = 1.0f, const std::string& note = "v1") {
  fs::create_directories(dir);
  std::ofstream(dir / "config.json") << kConfig;
  const std::vector<float> w(6, fill);
  hh::io::write_safetensors(dir / "model-00001-of-00002.safetensors",
                            {{"a", DType::F32, {2, 3}, w.data(), w.size() * sizeof(float)}}, {{"note", note}});
  hh::io::write_safetensors(dir / "model-00002-of-00002.safetensors",
                            {{"b", DType::F32, {6}, w.data(), w.size() * sizeof(float)}});
}

std::string read_bytes(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

TEST(Fingerprint, FormatAndDefinition) {
  const auto dir = hh::test::scratch_dir("fp") / "ckpt";
  make_checkpoint(dir);
  const std::string fp = model_fingerprint(dir);
  ASSERT_EQ(fp.size(), 7u + 64u);
  EXPECT_EQ(fp.substr(0, 7), "sha256:");

  // Spelled out: config bytes, NUL, then per shard in name order: name, NUL, prefix + JSON header.
  hh::io::Sha256 h;
  h.update(read_bytes(dir / "config.json"));
  h.update(std::string(1, '\0'));
  for (const char* shard : {"model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"}) {
    const hh::io::SafetensorsFile f(dir / shard);
    h.update(std::string(shard) + '\0');
    h.update(read_bytes(dir / shard).substr(0, 8 + f.header().header_len));
  }
  EXPECT_EQ(fp, "sha256:" + h.hex_digest());
}

TEST(Fingerprint, SurvivesCopyAndUnrelatedFiles) {
  const auto root = hh::test::scratch_dir("fp");
  make_checkpoint(root / "a");
  const std::string fp = model_fingerprint(root / "a");
  fs::create_directories(root / "elsewhere");
  fs::copy(root / "a", root / "elsewhere" / "b", fs::copy_options::recursive);
  EXPECT_EQ(model_fingerprint(root / "elsewhere" / "b"), fp);
  std::ofstream(root / "a" / "README.md") << "notes";
  std::ofstream(root / "a" / "model.safetensors.tmp.1234") << "partial write";
  EXPECT_EQ(model_fingerprint(root / "a"), fp);
}

TEST(Fingerprint, ChangesWhenAHeaderChanges) {
  const auto root = hh::test::scratch_dir("fp");
  make_checkpoint(root / "a", 1.0f, "v1");
  make_checkpoint(root / "b", 1.0f, "v2");  // only shard 1's metadata differs
  EXPECT_NE(model_fingerprint(root / "a"), model_fingerprint(root / "b"));
}

TEST(Fingerprint, ChangesWhenConfigOrShardNameChanges) {
  const auto root = hh::test::scratch_dir("fp");
  make_checkpoint(root / "a");
  const std::string fp = model_fingerprint(root / "a");
  std::ofstream(root / "a" / "config.json") << R"({"model_type": "qwen3", "vocab_size": 9})";
  EXPECT_NE(model_fingerprint(root / "a"), fp);

  make_checkpoint(root / "b");
  fs::rename(root / "b" / "model-00002-of-00002.safetensors", root / "b" / "model-00002-of-00002.renamed.safetensors");
  EXPECT_NE(model_fingerprint(root / "b"), fp);
}

// Weights are not read: equal headers with different data give equal fingerprints (cheap by design).
TEST(Fingerprint, IgnoresWeightBytes) {
  const auto root = hh::test::scratch_dir("fp");
  make_checkpoint(root / "a", 1.0f);
  make_checkpoint(root / "b", 2.0f);
  EXPECT_EQ(model_fingerprint(root / "a"), model_fingerprint(root / "b"));
}

TEST(Fingerprint, ErrorsNameTheProblem) {
  const auto root = hh::test::scratch_dir("fp");
  fs::create_directories(root / "noconfig");
  try {
    model_fingerprint(root / "noconfig");
    FAIL();
  } catch (const hh::Error& e) {
    EXPECT_NE(std::string(e.what()).find("config.json"), std::string::npos) << e.what();
  }
  make_checkpoint(root / "broken");
  fs::resize_file(root / "broken" / "model-00002-of-00002.safetensors", 5);
  try {
    model_fingerprint(root / "broken");
    FAIL();
  } catch (const hh::Error& e) {
    EXPECT_NE(std::string(e.what()).find("model-00002-of-00002.safetensors"), std::string::npos) << e.what();
  }
}

}  // namespace
