// Training data: packing of token streams into windows, the seeded per-epoch order, mixtures and the
// errors that name the file.
#include <torch/torch.h>

#include <fstream>
#include <set>

#include "core/model/tokenizer.h"
#include "core/train/data.h"
#include "support/test_support.h"

namespace hh::train {
namespace {

namespace fs = std::filesystem;

fs::path write_bin(const fs::path& dir, const std::string& name, const std::vector<uint32_t>& ids) {
  const fs::path p = dir / name;
  std::ofstream out(p, std::ios::binary);
  for (uint32_t v : ids) {
    const unsigned char b[4] = {static_cast<unsigned char>(v), static_cast<unsigned char>(v >> 8),
                                static_cast<unsigned char>(v >> 16), static_cast<unsigned char>(v >> 24)};
    out.write(reinterpret_cast<const char*>(b), 4);
  }
  return p;
}

std::vector<uint32_t> iota_ids(uint32_t n, uint32_t offset = 0) {
  std::vector<uint32_t> v(n);
  for (uint32_t i = 0; i < n; ++i) v[i] = offset + i;
  return v;
}

DataSource bin_source(const fs::path& p, double weight = 1) {
  DataSource s;
  s.kind = "bin";
  s.path = p;
  s.weight = weight;
  return s;
}

TEST(TrainData, BinWindowsCoverTheStreamOncePerEpochInASeededOrder) {
  const auto dir = test::scratch_dir("train_data_bin");
  const auto p = write_bin(dir, "a.bin", iota_ids(101));   // W = (101 - 4) / 4 = 24 windows of 4 + 1 tokens
  DataMixture d({bin_source(p)}, nullptr, nullptr, 1000, -1, 42);
  constexpr int64_t W = 24, kEpochs = 8;
  std::vector<std::vector<int64_t>> epochs(kEpochs);
  std::set<int64_t> shifts;
  for (int64_t i = 0; i < W * kEpochs; ++i) {
    const auto s = d.sample(i, 4);
    ASSERT_EQ(s.size(), 5u);
    for (size_t k = 1; k < s.size(); ++k) ASSERT_EQ(s[k], s[0] + static_cast<int64_t>(k)) << "consecutive tokens";
    ASSERT_LE(s[4], 100) << "inside the stream";
    const int64_t e = i / W;
    if (e == 0) ASSERT_EQ(s[0] % 4, 0) << "the first epoch cuts at multiples of seq_len";
    if (i % W > 0) ASSERT_EQ(s[0] % 4, epochs[static_cast<size_t>(e)][0] % 4) << "one shift per epoch";
    if (i % W == 0) shifts.insert(s[0] % 4);
    epochs[static_cast<size_t>(e)].push_back(s[0]);
  }
  for (int64_t e = 0; e < kEpochs; ++e)
    EXPECT_EQ(std::set<int64_t>(epochs[static_cast<size_t>(e)].begin(), epochs[static_cast<size_t>(e)].end()).size(),
              static_cast<size_t>(W)) << "every window once in epoch " << e;
  EXPECT_GE(shifts.size(), 2u) << "later epochs cut the stream elsewhere";
  std::vector<int64_t> epoch0, epoch1;
  for (int64_t x : epochs[0]) epoch0.push_back(x / 4);
  for (int64_t x : epochs[1]) epoch1.push_back(x / 4);
  EXPECT_NE(epoch0, epoch1) << "a fresh order each epoch";
  std::vector<int64_t> sorted = epoch0;
  std::sort(sorted.begin(), sorted.end());
  EXPECT_NE(sorted, epoch0) << "shuffled";

  // The order is a function of the seed alone, whatever was asked before.
  DataMixture same({bin_source(p)}, nullptr, nullptr, 1000, -1, 42), other({bin_source(p)}, nullptr, nullptr, 1000, -1, 43);
  EXPECT_EQ(same.sample(37, 4), d.sample(37, 4));
  EXPECT_EQ(same.sample(3, 4)[0] / 4, epoch0[3]);
  std::vector<int64_t> other0;
  for (int64_t i = 0; i < W; ++i) other0.push_back(other.sample(i, 4)[0] / 4);
  EXPECT_NE(other0, epoch0);

  at::Tensor mask;
  const at::Tensor b = d.batch(10, 3, 4, &mask);
  EXPECT_FALSE(mask.defined()) << "no answers-only source: every target counts, no mask is made";
  ASSERT_EQ(b.sizes(), (at::IntArrayRef{3, 5}));
  for (int64_t r = 0; r < 3; ++r)
    for (int64_t k = 0; k < 5; ++k) EXPECT_EQ(b[r][k].item<int64_t>(), d.sample(10 + r, 4)[static_cast<size_t>(k)]);
}

TEST(TrainData, MixtureFollowsTheWeights) {
  const auto dir = test::scratch_dir("train_data_mix");
  const auto a = write_bin(dir, "a.bin", iota_ids(64, 0));
  const auto b = write_bin(dir, "b.bin", iota_ids(64, 500));
  DataMixture d({bin_source(a, 3), bin_source(b, 1)}, nullptr, nullptr, 1000, -1, 5);
  int64_t from_a = 0;
  const int64_t n = 8000;
  for (int64_t i = 0; i < n; ++i) {
    const auto s = d.sample(i, 7);
    const bool is_a = s[0] < 500;
    EXPECT_EQ(is_a, d.source_of(i) == 0);
    from_a += is_a;
  }
  // Binomial(8000, 0.75): standard deviation ~ 0.0048; allow 4 of them.
  EXPECT_NEAR(static_cast<double>(from_a) / n, 0.75, 0.02);
}

TEST(TrainData, JsonlTextIsTokenisedAndPacked) {
  const auto dir = test::scratch_dir("train_data_jsonl");
  const auto tok = model::Tokenizer::load(test::data_dir() / "tokenizer/tiny-tokenizer.json");
  {
    std::ofstream out(dir / "t.jsonl");
    out << R"({"text": "hello world, this is a line of text"})" << "\n\n" << R"({"text": " and another one follows it"})" << "\n";
  }
  std::vector<int64_t> stream = tok.encode("hello world, this is a line of text");
  const auto more = tok.encode(" and another one follows it");
  stream.insert(stream.end(), more.begin(), more.end());
  DataSource s;
  s.kind = "jsonl";
  s.path = dir / "t.jsonl";
  DataMixture d({s}, &tok, nullptr, tok.vocab_size(), -1, 0);
  const int64_t seq = 5, windows = (static_cast<int64_t>(stream.size()) - seq) / seq;  // the first epoch
  ASSERT_GE(windows, 2);
  std::set<int64_t> starts;
  for (int64_t i = 0; i < windows; ++i) {
    const auto x = d.sample(i, seq);
    bool found = false;
    for (int64_t w = 0; w < windows && !found; ++w)
      if (std::equal(x.begin(), x.end(), stream.begin() + w * seq)) {
        found = true;
        starts.insert(w);
      }
    EXPECT_TRUE(found) << "sample " << i << " is a window of the tokenised text";
  }
  EXPECT_EQ(static_cast<int64_t>(starts.size()), windows);

  std::ofstream(dir / "bad.jsonl") << R"({"text": "fine"})" << "\n" << R"({"txt": "typo"})" << "\n";
  s.path = dir / "bad.jsonl";
  const std::string msg = test::error_of([&] { DataMixture({s}, &tok, nullptr, tok.vocab_size(), -1, 0); });
  EXPECT_MENTIONS(msg, "bad.jsonl:2");
}

TEST(TrainData, ErrorsNameTheFile) {
  const auto dir = test::scratch_dir("train_data_errors");
  const auto big = write_bin(dir, "big.bin", {1, 2, 3, 999, 4});
  std::string msg = test::error_of([&] { DataMixture({bin_source(big)}, nullptr, nullptr, 100, -1, 0); });
  EXPECT_MENTIONS(msg, "big.bin");
  EXPECT_MENTIONS(msg, "token 3 = 999");

  std::ofstream(dir / "odd.bin", std::ios::binary) << "abcdef";
  msg = test::error_of([&] { DataMixture({bin_source(dir / "odd.bin")}, nullptr, nullptr, 100, -1, 0); });
  EXPECT_MENTIONS(msg, "odd.bin");
  EXPECT_MENTIONS(msg, "6 bytes");

  const auto small = write_bin(dir, "small.bin", iota_ids(8));
  DataMixture d({bin_source(small)}, nullptr, nullptr, 100, -1, 0);
  msg = test::error_of([&] { d.sample(0, 8); });
  EXPECT_MENTIONS(msg, "small.bin");
  EXPECT_MENTIONS(msg, "8 tokens");

  msg = test::error_of([&] { DataMixture({bin_source(dir / "missing.bin")}, nullptr, nullptr, 100, -1, 0); });
  EXPECT_MENTIONS(msg, "missing.bin");
}

TEST(TrainData, SeedMixIsStableAndSpreads) {
  // Deterministic, and sensitive to every argument and its position.
  EXPECT_EQ(mix_seed(0, 0), mix_seed(0, 0));
  EXPECT_NE(mix_seed(0, 1), mix_seed(0, 2));
  EXPECT_NE(mix_seed(1, 0), mix_seed(0, 1));
  EXPECT_NE(mix_seed(0, 0, 1), mix_seed(0, 0, 0, 1));
}

}  // namespace
}  // namespace hh::train
