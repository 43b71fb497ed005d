// NIAH grid evaluation: the grid logic against a generator that answers a known subset, and
// `hydrahead eval` end to end on a real tiny checkpoint against greedy decoding recomputed here.
#include <torch/torch.h>

#include <gtest/gtest.h>

#include <array>
#include <cmath>
#include <atomic>
#include <fstream>
#include <map>
#include <sstream>

#include <nlohmann/json.hpp>

#include "core/eval/niah.h"
#include "core/eval/perplexity.h"
#include "core/interp/task_registry.h"
#include "core/io/h5.h"
#include "core/model/tokenizer.h"
#include "core/model/transformer.h"
#include "support/test_support.h"
#include "support/tiny_config.h"

namespace {

namespace fs = std::filesystem;

const hh::model::Tokenizer& tiny_tokenizer() {
  static const auto t = hh::model::Tokenizer::load(hh::test::data_dir() / "tokenizer" / "tiny-tokenizer.json");
  return t;
}

TEST(NiahGrid, CountsExactMatchesPerCellWithTheDocumentedSeeds) {
  hh::interp::TaskRegistry reg;
  reg.load_default();
  hh::eval::NiahGridOptions o;
  o.lengths = {400, 500};
  o.depths = {0.0, 0.5, 1.0};
  o.n = 3;
  o.seed = 7;
  // The answers, from the same generator calls the grid makes (cell (i, j): seed + 1000 i + j).
  std::map<std::vector<int64_t>, std::vector<int64_t>> answer;
  for (size_t i = 0; i < o.lengths.size(); ++i)
    for (size_t j = 0; j < o.depths.size(); ++j)
      for (const auto& ex : reg.generate("niah-single", {{"num_examples", 3}, {"length", o.lengths[i]}, {"depth", o.depths[j]}},
                                          tiny_tokenizer(), 7 + 1000 * i + j))
        answer[ex.clean_ids] = ex.answer_ids;
  // A generator that is right on the first prompt of every cell and wrong on the others.
  int64_t calls = 0;
  const auto gen = [&](const std::vector<int64_t>& prompt, int64_t n) {
    const auto& a = answer.at(prompt);  // every prompt is one the grid generated
    EXPECT_EQ(n, static_cast<int64_t>(a.size()));
    std::vector<int64_t> out = a;
    if (calls++ % 3 != 0) out[0] = out[0] + 1;
    return out;
  };
  const auto r = hh::eval::niah_grid(gen, reg, tiny_tokenizer(), o);
  EXPECT_EQ(calls, 18);
  EXPECT_TRUE(torch::equal(r.correct, torch::ones({2, 3}, torch::kLong)));
  EXPECT_TRUE(torch::allclose(r.accuracy, torch::full({2, 3}, 1.0 / 3, torch::kDouble)));
}

TEST(Perplexity, IsTheExpOfTheMeanTeacherForcedNllOverWindows) {
  const auto c = hh::test::tiny_config(1, 2, 1, 8, 16, 24, 30);
  const hh::model::Transformer m(c, hh::model::random_weights(c, 2, torch::kDouble, 0.3));
  const std::vector<int64_t> stream = {1, 5, 9, 2, 7, 7, 3, 0, 29, 4};
  hh::eval::LanguageModel lm;
  lm.hidden = [&](const torch::Tensor& ids) { return m.hidden(ids); };
  lm.logits = [&](const torch::Tensor& rows) { return m.unembed(rows); };
  const auto r = hh::eval::perplexity(lm, stream, 4);
  // Windows [0, 4), [4, 8), [8, 10): 3 + 3 + 1 predicted tokens, summed by hand.
  double nll = 0;
  for (auto [s, e] : {std::pair<int, int>{0, 4}, {4, 8}, {8, 10}}) {
    const std::vector<int64_t> w(stream.begin() + s, stream.begin() + e);
    const auto lp = torch::log_softmax(m.forward(torch::tensor(w).unsqueeze(0)).logits[0], -1);
    for (int t = 0; t + 1 < e - s; ++t) nll -= lp[t][w[static_cast<size_t>(t + 1)]].item<double>();
  }
  EXPECT_EQ(r.tokens, 7);
  EXPECT_EQ(r.windows, 3);
  EXPECT_NEAR(r.nll, nll / 7, 1e-12);
  EXPECT_NEAR(r.ppl, std::exp(nll / 7), 1e-9);
  // The positions projected a chunk at a time (2 rows, 1 row: 3 predicted rows a window split unevenly):
  // the same sum.
  for (int64_t chunk : {2, 1}) {
    const auto rc = hh::eval::perplexity(lm, stream, 4, chunk);
    EXPECT_EQ(rc.tokens, 7);
    EXPECT_NEAR(rc.nll, nll / 7, 1e-12) << "chunk " << chunk;
  }
  EXPECT_THROW(hh::eval::perplexity(lm, stream, 4, 0), hh::Error);

  // Progress: each window once, with the count of windows (a 1-token rest is no window); a cancel flag
  // stops before the next window.
  std::vector<std::pair<int64_t, int64_t>> heard;
  auto listen = [&heard](int64_t done, int64_t total) { heard.emplace_back(done, total); };
  hh::eval::perplexity(lm, stream, 4, 1024, listen);
  EXPECT_EQ(heard, (std::vector<std::pair<int64_t, int64_t>>{{1, 3}, {2, 3}, {3, 3}}));
  heard.clear();
  hh::eval::perplexity(lm, std::vector<int64_t>(stream.begin(), stream.begin() + 9), 4, 1024, listen);
  EXPECT_EQ(heard, (std::vector<std::pair<int64_t, int64_t>>{{1, 2}, {2, 2}}));
  std::atomic<bool> stop{false};
  heard.clear();
  EXPECT_THROW(hh::eval::perplexity(lm, stream, 4, 1024,
                                    [&](int64_t done, int64_t total) {
                                      listen(done, total);
                                      stop = true;
                                    },
                                    &stop),
               hh::Cancelled);
  EXPECT_EQ(heard.size(), 1u);

  // .bin streams: uint32 little-endian; an id outside the vocabulary is named.
  const fs::path dir = hh::test::scratch_dir("ppl_bin");
  {
    std::ofstream f(dir / "t.bin", std::ios::binary);
    for (uint32_t v : {3u, 258u, 7u}) f.write(reinterpret_cast<const char*>(&v), 4);
  }
  EXPECT_EQ(hh::eval::read_token_stream(dir / "t.bin", nullptr, 300), (std::vector<int64_t>{3, 258, 7}));
  EXPECT_MENTIONS(hh::test::error_of([&] { hh::eval::read_token_stream(dir / "t.bin", nullptr, 100); }),
                  "token 1 = 258 is outside the vocabulary");
}

TEST(NiahGrid, ParsesLengthsAndDepthsAndRefusesBadItems) {
  EXPECT_EQ(hh::eval::parse_lengths("512, 1K,4k"), (std::vector<int64_t>{512, 1024, 4096}));
  EXPECT_EQ(hh::eval::parse_depths("0,0.25,1"), (std::vector<double>{0.0, 0.25, 1.0}));
  EXPECT_MENTIONS(hh::test::error_of([] { hh::eval::parse_lengths("1M"); }), "'1M' is not a token count");
  EXPECT_MENTIONS(hh::test::error_of([] { hh::eval::parse_depths("0.5,1.5"); }), "'1.5' is not a number in [0, 1]");
}

TEST(NiahGrid, CliOnATinyCheckpointMatchesGreedyDecodingRecomputedHere) {
  const fs::path dir = hh::test::scratch_dir("eval_cli");
  const auto c = hh::test::tiny_config(2, 4, 2, 8, 32, 48, tiny_tokenizer().vocab_size());
  const auto w = hh::model::random_weights(c, 3, torch::kFloat, 0.3);
  hh::model::save_model(dir / "model", c, w);
  fs::copy_file(hh::test::data_dir() / "tokenizer" / "tiny-tokenizer.json", dir / "model" / "tokenizer.json");
  const auto [status, out] = hh::test::run_hydrahead("eval --model " + (dir / "model").string() +
                                                      " --lengths 400,450 --depths 0,1 --n 2 --seed 5 --out " +
                                                      (dir / "eval.h5").string());
  ASSERT_EQ(status, 0) << out;
  EXPECT_MENTIONS(out, "NIAH exact-match accuracy");
  EXPECT_EQ(out.find("\"event\""), std::string::npos);  // no JSON unless asked

  // --progress json: one line a prompt, done counting to total.
  const auto [status2, out2] = hh::test::run_hydrahead("eval --model " + (dir / "model").string() +
                                                       " --lengths 400 --depths 0,1 --n 2 --progress json --out " +
                                                       (dir / "eval2.h5").string());
  ASSERT_EQ(status2, 0) << out2;
  std::istringstream lines(out2);
  std::string line;
  int64_t events = 0;
  while (std::getline(lines, line)) {
    if (line.rfind("{", 0) != 0) continue;
    const auto e = nlohmann::json::parse(line);
    EXPECT_EQ(e["event"], "progress");
    EXPECT_EQ(e["done"], ++events);
    EXPECT_EQ(e["total"], 4);
    EXPECT_GE(e["eta_s"].get<double>(), 0);
  }
  EXPECT_EQ(events, 4);
  EXPECT_MENTIONS(hh::test::run_hydrahead("eval --model " + (dir / "model").string() + " --lengths 400 --progress text --out " +
                                          (dir / "eval3.h5").string()).output,
                  "--progress text: expected bar, json or none");

  const auto f = hh::io::H5File::open_read(dir / "eval.h5");
  EXPECT_EQ(f.attr_string("/", "format"), "hydrahead-eval");
  EXPECT_EQ(f.shape("/niah/accuracy"), (std::vector<int64_t>{2, 2}));
  EXPECT_EQ(f.dim_labels("/niah/accuracy"), (std::vector<std::string>{"length", "depth"}));
  const auto correct = f.read("/niah/correct");
  hh::interp::TaskRegistry reg;
  reg.load_default();
  const hh::model::Transformer model(c, w);
  const std::vector<int64_t> lengths = {400, 450};
  const std::vector<double> depths = {0.0, 1.0};
  for (int64_t i = 0; i < 2; ++i)
    for (int64_t j = 0; j < 2; ++j) {
      int64_t hits = 0;
      for (const auto& ex : reg.generate("niah-single", {{"num_examples", 2}, {"length", lengths[static_cast<size_t>(i)]},
                                                         {"depth", depths[static_cast<size_t>(j)]}},
                                          tiny_tokenizer(), 5 + 1000 * i + j))
        hits += hh::model::generate_greedy(model, ex.clean_ids, static_cast<int64_t>(ex.answer_ids.size())) == ex.answer_ids;
      EXPECT_EQ(correct[i][j].item<int64_t>(), hits) << i << "," << j;
    }
}

}  // namespace
