// Qwen3's real tokenizer.json against reference ids from transformers.js (tests/tokenizer/): the
// ctest fixture tokenizer.fetch_reference fills hh::test::qwen3_tokenizer_dir() with tokenizer.json
// and expected.json ({"cases": [{name, text, ids, nfc_stable}]}). Missing files fail, never skip.
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <random>
#include <sstream>

#include "core/model/tokenizer.h"
#include "core/util/error.h"
#include "support/test_support.h"

namespace {

using hh::model::Tokenizer;
using Ids = std::vector<int64_t>;
using json = nlohmann::json;

// A megabyte of mixed text; throughput is measured by `hydrahead bench tokenize`, not asserted here.
constexpr size_t kLongTextBytes = 1u << 20;

std::filesystem::path reference_dir() { return hh::test::qwen3_tokenizer_dir(); }

json read_json(const std::filesystem::path& p) {
  std::ifstream in(p);
  if (!in) throw std::runtime_error("cannot read " + p.string() + " (did tokenizer.fetch_reference run?)");
  return json::parse(in);
}

const Tokenizer& qwen3() {
  static const Tokenizer tok = Tokenizer::load(reference_dir() / "tokenizer.json");
  return tok;
}

const json& cases() {
  static const json j = read_json(reference_dir() / "expected.json")["cases"];
  return j;
}

std::string window(const Ids& ids, size_t at) {
  std::ostringstream os;
  const size_t from = at >= 3 ? at - 3 : 0, to = std::min(ids.size(), at + 4);
  os << "[";
  if (from > 0) os << "... ";
  for (size_t i = from; i < to; ++i) os << (i == at ? "*" : "") << ids[i] << (i + 1 < to ? ", " : "");
  if (to < ids.size()) os << " ...";
  os << "] (" << ids.size() << " ids)";
  return os.str();
}

TEST(Qwen3Tokenizer, Vocabulary) {
  EXPECT_EQ(qwen3().vocab_size(), 151669);
  EXPECT_EQ(qwen3().token_to_id("<|endoftext|>"), 151643);
  EXPECT_EQ(qwen3().token_to_id("<|im_start|>"), 151644);
  EXPECT_EQ(qwen3().token_to_id("<|im_end|>"), 151645);
  EXPECT_EQ(qwen3().token_to_id("</think>"), 151668);
  EXPECT_EQ(qwen3().encode("Hello world"), (Ids{9707, 1879}));
}

TEST(Qwen3Tokenizer, EncodeMatchesReferenceOnEveryCase) {
  ASSERT_GE(cases().size(), 50u);
  for (const json& c : cases()) {
    const std::string name = c["name"], text = c["text"];
    const Ids want = c["ids"].get<Ids>();
    const Ids got = qwen3().encode(text);
    if (got == want) continue;
    size_t at = 0;
    while (at < got.size() && at < want.size() && got[at] == want[at]) ++at;
    ADD_FAILURE() << "case '" << name << "' text " << json(text).dump() << "\n  first difference at id #" << at
                  << "\n  got  " << window(got, at) << "\n  want " << window(want, at);
  }
}

TEST(Qwen3Tokenizer, DecodeOfEncodeRestoresNfcStableText) {
  int checked = 0;
  for (const json& c : cases()) {
    if (!c["nfc_stable"].get<bool>()) continue;
    const std::string text = c["text"];
    EXPECT_EQ(qwen3().decode(qwen3().encode(text)), text) << "case '" << c["name"].get<std::string>() << "'";
    ++checked;
  }
  EXPECT_GE(checked, 40);
}

TEST(Qwen3Tokenizer, DecodeOfEncodeIsNfcForOtherCases) {
  for (const json& c : cases()) {
    const std::string text = c["text"];
    EXPECT_EQ(qwen3().decode(qwen3().encode(text)), hh::model::normalize_nfc(text))
        << "case '" << c["name"].get<std::string>() << "'";
  }
}

TEST(Qwen3Tokenizer, DecodeRejectsIdsPastTheVocabulary) {
  try {
    qwen3().decode({9707, 151669});
    FAIL() << "expected hh::Error";
  } catch (const hh::Error& e) {
    EXPECT_NE(std::string(e.what()).find("151669"), std::string::npos) << e.what();
  }
}

// About 1 MB of mixed text: the reference cases plus runs of random vocabulary words, so the word
// cache sees many distinct words. Prints tokens/s.
TEST(Qwen3Tokenizer, EncodesAMegabyteAndRoundTrips) {
  std::vector<std::string> words;
  for (int64_t id = 0; id < 151643; ++id) {
    const std::string t = qwen3().decode({id});
    if (t.size() >= 2 && t.size() <= 12 &&
        std::all_of(t.begin(), t.end(), [](char ch) { return std::isalpha(static_cast<unsigned char>(ch)); }))
      words.push_back(t);
  }
  ASSERT_GT(words.size(), 10000u);
  std::mt19937 rng(42);
  std::uniform_int_distribution<size_t> pick(0, words.size() - 1);
  const char* seps[] = {" ", " ", " ", ", ", ". ", "\n", " (", ") ", "-", "\t"};
  std::string text;
  while (text.size() < kLongTextBytes) {
    for (const json& c : cases()) text += c["text"].get<std::string>() + "\n";
    for (int i = 0; i < 20000; ++i) text += words[pick(rng)] + seps[rng() % 10];
  }
  const Ids ids = qwen3().encode(text);
  EXPECT_EQ(qwen3().decode(ids), hh::model::normalize_nfc(text));
}

TEST(Qwen3Tokenizer, LongSingleWordRoundTrips) {
  std::mt19937 rng(3);
  std::string word;
  for (int i = 0; i < 200000; ++i) word += static_cast<char>('a' + rng() % 26);
  const Ids ids = qwen3().encode(word);  // a quadratic merge loop would hit the ctest timeout here
  EXPECT_EQ(qwen3().decode(ids), word);
}

}  // namespace
