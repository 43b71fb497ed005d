// Byte-level BPE on a hand-written tokenizer.json (tests/data/tokenizer/tiny-tokenizer.json):
//   ids 0..255  the byte-level symbol of byte b has id b (so ' ' is 32, 'a' is 97, 0xC3 is 195)
//   256..272   merges, rank = id - 256:
//              0 "Ġ t"  1 "h e"  2 "Ġt he"  3 "l l"  4 "ll o"  5 "he llo"  6 "b c"  7 "a b"
//              8 "ab c"  9 "Ã ©" (é)  10 "a a"  11 "Ġ Ġ"  12 "Ċ Ċ"  13 "1 2"  14 "c a"
//              15 "ca f"  16 "caf Ã©" (café)
//   300, 301   special tokens <|endoftext|>, <|im_start|>; ids 273..299 are unassigned
// Normalizer NFC; pre-tokenizer Qwen2's split regex then ByteLevel without regex or prefix space.
// Every expected id list below was worked out by hand from that table.
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <chrono>
#include <fstream>
#include <random>
#include <sstream>
#include <thread>

#include "core/model/tokenizer.h"
#include "core/util/error.h"
#include "support/test_support.h"

namespace {

using hh::model::Tokenizer;
using Ids = std::vector<int64_t>;
using json = nlohmann::json;

constexpr int64_t kEndOfText = 300;
constexpr int64_t kImStart = 301;

std::filesystem::path tiny_path() { return hh::test::data_dir() / "tokenizer" / "tiny-tokenizer.json"; }

std::string read_text(const std::filesystem::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

json tiny_json() { return json::parse(read_text(tiny_path())); }

const Tokenizer& tiny() {
  static const Tokenizer tok = Tokenizer::load(tiny_path());
  return tok;
}

Tokenizer from(const json& j) { return Tokenizer::from_json_text(j.dump(), "test.json"); }

// Expects `fn` to throw hh::Error whose message contains every string in `parts`.
template <typename Fn>
void expect_error(Fn&& fn, std::initializer_list<std::string> parts) {
  try {
    fn();
    ADD_FAILURE() << "expected hh::Error";
  } catch (const hh::Error& e) {
    const std::string msg = e.what();
    for (const auto& p : parts) EXPECT_NE(msg.find(p), std::string::npos) << "'" << p << "' missing in: " << msg;
  }
}

// ---- encoding -------------------------------------------------------------------------------

TEST(Tokenizer, MergesBuildWordsThroughIntermediateTokens) {
  EXPECT_EQ(tiny().encode("hello"), (Ids{261}));       // he, ll, llo, hello
  EXPECT_EQ(tiny().encode(" the"), (Ids{258}));        // Ġt, he, Ġthe
  EXPECT_EQ(tiny().encode("the"), (Ids{116, 257}));    // no "t he" merge
  EXPECT_EQ(tiny().encode(" hello"), (Ids{32, 261}));  // no "Ġ h" merge
  EXPECT_EQ(tiny().encode("hello the"), (Ids{261, 258}));
}

TEST(Tokenizer, RankNotPositionDecidesMergeOrder) {
  EXPECT_EQ(tiny().encode("abc"), (Ids{97, 262}));  // "b c" (rank 6) beats "a b" (rank 7); "ab c" never fires
  EXPECT_EQ(tiny().encode("aab"), (Ids{97, 263}));  // "a b" (rank 7) beats the leftmost pair "a a" (rank 10)
  EXPECT_EQ(tiny().encode("ab"), (Ids{263}));
  EXPECT_EQ(tiny().encode("aaa"), (Ids{266, 97}));  // equal ranks: leftmost first
  EXPECT_EQ(tiny().encode("aaaa"), (Ids{266, 266}));
}

TEST(Tokenizer, DigitsAreSplitBeforeMerging) {
  EXPECT_EQ(tiny().encode("12"), (Ids{49, 50}));  // the "1 2" merge exists but digits are pre-split
  EXPECT_EQ(tiny().encode("2024"), (Ids{50, 48, 50, 52}));
}

TEST(Tokenizer, NfcComposesBeforeMerging) {
  EXPECT_EQ(tiny().encode("\xC3\xA9"), (Ids{265}));   // é precomposed
  EXPECT_EQ(tiny().encode("e\xCC\x81"), (Ids{265}));  // e + U+0301 composes to é
  EXPECT_EQ(tiny().encode("caf\xC3\xA9"), (Ids{272}));
  EXPECT_EQ(tiny().encode("cafe\xCC\x81"), (Ids{272}));
}

TEST(Tokenizer, SpecialTokensAreSplitFirst) {
  EXPECT_EQ(tiny().encode("<|endoftext|>hello"), (Ids{kEndOfText, 261}));
  EXPECT_EQ(tiny().encode("hello<|im_start|> the"), (Ids{261, kImStart, 258}));
  EXPECT_EQ(tiny().encode("<|endoftext|><|endoftext|>"), (Ids{kEndOfText, kEndOfText}));
  // An unfinished token is ordinary text: "<|", "endoftext", "|", then the real token.
  EXPECT_EQ(tiny().encode("<|endoftext|<|im_start|>"),
            (Ids{60, 124, 101, 110, 100, 111, 102, 116, 101, 120, 116, 124, kImStart}));
  // A mark after a special token is normalised on its own: it does not compose with the '>'
  // (">" + U+0338 would otherwise become U+226F).
  EXPECT_EQ(tiny().encode("<|endoftext|>\xCC\xB8"), (Ids{kEndOfText, 204, 184}));
}

TEST(Tokenizer, SplitRegexPieces) {
  EXPECT_EQ(tiny().encode("it's"), (Ids{105, 116, 39, 115}));  // "it", "'s"
  EXPECT_EQ(tiny().encode("a\r\nb"), (Ids{97, 13, 10, 98}));
  EXPECT_EQ(tiny().encode("\n\n"), (Ids{268}));
  EXPECT_EQ(tiny().encode("a  b"), (Ids{97, 32, 32, 98}));       // "a", " ", " b"
  EXPECT_EQ(tiny().encode("a   b"), (Ids{97, 267, 32, 98}));     // "a", "  ", " b"
  EXPECT_EQ(tiny().encode(""), (Ids{}));
}

TEST(Tokenizer, InvalidUtf8IsReadAsReplacementCharacters) {
  const Ids fffd{239, 191, 189};  // U+FFFD as byte symbols
  EXPECT_EQ(tiny().encode("\xFF"), fffd);
  EXPECT_EQ(tiny().encode("\xE2\x82"), fffd);  // one truncated sequence, one replacement
  Ids three;
  for (int i = 0; i < 3; ++i) three.insert(three.end(), fffd.begin(), fffd.end());
  EXPECT_EQ(tiny().encode("\xED\xA0\x80"), three);  // an encoded surrogate: three ill-formed bytes
}

TEST(Tokenizer, MergesAsPairsEqualMergesAsStrings) {
  json j = tiny_json();
  json pairs = json::array();
  for (const auto& m : j["model"]["merges"]) {
    const std::string s = m.get<std::string>();
    const size_t sp = s.find(' ');
    pairs.push_back(json::array({s.substr(0, sp), s.substr(sp + 1)}));
  }
  j["model"]["merges"] = pairs;
  const Tokenizer tok = from(j);
  for (const char* s : {"hello the", "abc", "aab", "aaa", "cafe\xCC\x81", "<|im_start|>x"})
    EXPECT_EQ(tok.encode(s), tiny().encode(s)) << s;
}

// ---- added token flags ----------------------------------------------------------------------

TEST(Tokenizer, AddedTokenLstripAbsorbsWhitespaceOnTheLeft) {
  EXPECT_EQ(tiny().encode("a  <|im_start|>b"), (Ids{97, 267, kImStart, 98}));
  json j = tiny_json();
  j["added_tokens"][1]["lstrip"] = true;
  EXPECT_EQ(from(j).encode("a  <|im_start|>b"), (Ids{97, kImStart, 98}));
}

TEST(Tokenizer, AddedTokenRstripAbsorbsWhitespaceOnTheRight) {
  EXPECT_EQ(tiny().encode("<|endoftext|>   hello"), (Ids{kEndOfText, 267, 32, 261}));
  json j = tiny_json();
  j["added_tokens"][0]["rstrip"] = true;
  EXPECT_EQ(from(j).encode("<|endoftext|>   hello"), (Ids{kEndOfText, 261}));
}

TEST(Tokenizer, AddedTokenSingleWordMatchesWholeWordsOnly) {
  json j = tiny_json();
  j["added_tokens"].push_back({{"id", 299}, {"content", "cat"}, {"single_word", true}, {"lstrip", false},
                               {"rstrip", false}, {"normalized", false}, {"special", false}});
  const Tokenizer tok = from(j);
  EXPECT_EQ(tok.encode("cat"), (Ids{299}));
  EXPECT_EQ(tok.encode("cat."), (Ids{299, 46}));
  EXPECT_EQ(tok.encode("a cat"), (Ids{97, 32, 299}));
  EXPECT_EQ(tok.encode("cats"), (Ids{270, 116, 115}));           // "ca" + t + s
  EXPECT_EQ(tok.encode("concat"), (Ids{99, 111, 110, 270, 116}));
}

TEST(Tokenizer, NormalizedAddedTokensMatchAfterNfc) {
  json j = tiny_json();
  j["added_tokens"].push_back({{"id", 298}, {"content", "cafe\xCC\x81!"}, {"normalized", true}, {"special", false}});
  const Tokenizer normalized = from(j);
  EXPECT_EQ(normalized.encode("caf\xC3\xA9!"), (Ids{298}));
  EXPECT_EQ(normalized.encode("cafe\xCC\x81!"), (Ids{298}));
  j["added_tokens"][2]["normalized"] = false;
  const Tokenizer raw = from(j);
  EXPECT_EQ(raw.encode("cafe\xCC\x81!"), (Ids{298}));
  EXPECT_EQ(raw.encode("caf\xC3\xA9!"), (Ids{272, 33}));
  EXPECT_EQ(raw.decode({298}), "cafe\xCC\x81!");
}

// ---- other pre-tokenizer shapes -------------------------------------------------------------

Tokenizer with_space_split(const std::string& behavior) {
  json j = tiny_json();
  j["pre_tokenizer"]["pretokenizers"][0] = {
      {"type", "Split"}, {"pattern", {{"String", " "}}}, {"behavior", behavior}, {"invert", false}};
  return from(j);
}

TEST(Tokenizer, SplitBehaviors) {
  EXPECT_EQ(with_space_split("Removed").encode("hello the"), (Ids{261, 116, 257}));
  EXPECT_EQ(with_space_split("Isolated").encode("hello the"), (Ids{261, 32, 116, 257}));
  EXPECT_EQ(with_space_split("MergedWithPrevious").encode("hello the"), (Ids{261, 32, 116, 257}));
  EXPECT_EQ(with_space_split("MergedWithNext").encode("hello the"), (Ids{261, 258}));
  EXPECT_EQ(with_space_split("Contiguous").encode("a   b"), (Ids{97, 267, 32, 98}));
}

TEST(Tokenizer, ByteLevelWithRegexAndPrefixSpace) {
  json j = tiny_json();
  j["pre_tokenizer"] = {{"type", "ByteLevel"}, {"add_prefix_space", true}, {"use_regex", true}};
  const Tokenizer tok = from(j);
  EXPECT_EQ(tok.encode("the"), (Ids{258}));            // " the" after the prefix space
  EXPECT_EQ(tok.encode("hello 12"), (Ids{32, 261, 32, 269}));  // GPT-2 keeps digit runs together
}

// ---- decoding and vocabulary ----------------------------------------------------------------

TEST(Tokenizer, DecodeReversesByteLevelMapping) {
  EXPECT_EQ(tiny().decode({261, 258}), "hello the");
  EXPECT_EQ(tiny().decode({272}), "caf\xC3\xA9");
  EXPECT_EQ(tiny().decode({kEndOfText, 32, kImStart}), "<|endoftext|> <|im_start|>");
  EXPECT_EQ(tiny().decode({195}), std::string("\xC3"));  // half a character stays a raw byte
  EXPECT_EQ(tiny().decode({}), "");
}

TEST(Tokenizer, VocabularyQueries) {
  EXPECT_EQ(tiny().vocab_size(), 302);
  EXPECT_EQ(tiny().id_to_token(258), "\xC4\xA0the");  // "Ġthe"
  EXPECT_EQ(tiny().id_to_token(kImStart), "<|im_start|>");
  EXPECT_EQ(tiny().token_to_id("<|im_start|>"), kImStart);
  EXPECT_EQ(tiny().token_to_id("hello"), 261);
  EXPECT_EQ(tiny().token_to_id("nope"), std::nullopt);
  expect_error([] { tiny().id_to_token(280); }, {"280"});
}

TEST(Tokenizer, DecodeRejectsIdsOutsideTheVocabulary) {
  expect_error([] { tiny().decode({261, 302}); }, {"302", "tiny-tokenizer.json"});
  expect_error([] { tiny().decode({280}); }, {"280"});  // a hole between merges and specials
  expect_error([] { tiny().decode({-1}); }, {"-1"});
}

// ---- round trips ----------------------------------------------------------------------------

// Random valid UTF-8 drawn from ranges that stress each stage: ASCII, Latin, combining marks,
// Hangul jamo and syllables, CJK, Devanagari, emoji with ZWJ and variation selectors.
std::string random_utf8(std::mt19937& rng) {
  static const std::vector<std::pair<uint32_t, uint32_t>> kRanges = {
      {0x20, 0x7E},       {0x09, 0x0D},       {0xA0, 0x24F},  {0x300, 0x36F},     {0x370, 0x3FF},
      {0x400, 0x4FF},     {0x900, 0x97F},     {0x1100, 0x11FF}, {0xAC00, 0xAC00 + 300}, {0x3040, 0x30FF},
      {0x4E00, 0x4E00 + 500}, {0x1F300, 0x1F64F}, {0x200B, 0x200D}, {0xFE0F, 0xFE0F}, {0x1E00, 0x1EFF},
      {0x10000, 0x10FFFF}};
  std::uniform_int_distribution<size_t> len_dist(0, 40), range_dist(0, kRanges.size() - 1);
  std::string s;
  const size_t n = len_dist(rng);
  for (size_t i = 0; i < n; ++i) {
    const auto [lo, hi] = kRanges[range_dist(rng)];
    uint32_t cp = std::uniform_int_distribution<uint32_t>(lo, hi)(rng);
    if (cp >= 0xD800 && cp <= 0xDFFF) cp = 'x';
    if (cp < 0x80) {
      s += static_cast<char>(cp);
    } else if (cp < 0x800) {
      s += static_cast<char>(0xC0 | (cp >> 6));
      s += static_cast<char>(0x80 | (cp & 0x3F));
    } else if (cp < 0x10000) {
      s += static_cast<char>(0xE0 | (cp >> 12));
      s += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
      s += static_cast<char>(0x80 | (cp & 0x3F));
    } else {
      s += static_cast<char>(0xF0 | (cp >> 18));
      s += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
      s += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
      s += static_cast<char>(0x80 | (cp & 0x3F));
    }
  }
  return s;
}

TEST(Tokenizer, DecodeOfEncodeIsNfcOfInput) {
  constexpr int kCases = 3000;
  std::mt19937 rng(20261129);
  for (int i = 0; i < kCases; ++i) {
    const std::string s = random_utf8(rng);
    const std::string nfc = hh::model::normalize_nfc(s);
    ASSERT_EQ(tiny().decode(tiny().encode(s)), nfc) << "case " << i << ": " << json(s).dump();
    ASSERT_EQ(hh::model::normalize_nfc(nfc), nfc) << "NFC not idempotent, case " << i;
  }
}

TEST(Tokenizer, EncodeIsThreadSafe) {
  std::mt19937 rng(7);
  std::vector<std::string> texts;
  for (int i = 0; i < 200; ++i) texts.push_back(random_utf8(rng) + " hello the " + random_utf8(rng));
  std::vector<Ids> want;
  for (const auto& t : texts) want.push_back(tiny().encode(t));
  std::vector<int> mismatches(4, 0);
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      for (int rep = 0; rep < 5; ++rep)
        for (size_t i = 0; i < texts.size(); ++i) mismatches[t] += tiny().encode(texts[i]) != want[i];
    });
  }
  for (auto& th : threads) th.join();
  for (int m : mismatches) EXPECT_EQ(m, 0);
}

// ---- NFC ------------------------------------------------------------------------------------

TEST(Nfc, HandPickedCases) {
  using hh::model::normalize_nfc;
  EXPECT_EQ(normalize_nfc("e\xCC\x81"), "\xC3\xA9");                      // é
  EXPECT_EQ(normalize_nfc("a\xCC\x82\xCC\xA3"), "\xE1\xBA\xAD");          // a + U+0302 + U+0323 -> ậ
  EXPECT_EQ(normalize_nfc("a\xCC\xA3\xCC\x82"), "\xE1\xBA\xAD");          // same, other mark order
  EXPECT_EQ(normalize_nfc("\xE2\x84\xAB"), "\xC3\x85");                   // U+212B ANGSTROM SIGN -> Å
  EXPECT_EQ(normalize_nfc("\xE0\xA5\x98"), "\xE0\xA4\x95\xE0\xA4\xBC");   // U+0958 excluded: stays decomposed
  EXPECT_EQ(normalize_nfc("\xE1\x84\x80\xE1\x85\xA1\xE1\x86\xA8"), "\xEA\xB0\x81");  // jamo G A G -> 각
  EXPECT_EQ(normalize_nfc("\xEA\xB0\x80\xE1\x86\xA8"), "\xEA\xB0\x81");   // 가 + final G -> 각
  EXPECT_EQ(normalize_nfc("\xCC\x81" "abc"), "\xCC\x81" "abc");           // leading mark has no starter
  EXPECT_EQ(normalize_nfc("\xEF\xAC\x81"), "\xEF\xAC\x81");               // ligature ﬁ: compatibility only
  EXPECT_EQ(normalize_nfc("plain ascii"), "plain ascii");
}

TEST(Nfc, LongRunOfMarksIsSorted) {
  constexpr int kPairs = 100000;
  std::string s = "a";
  for (int i = 0; i < kPairs; ++i) s += "\xCC\x81\xCC\x96";  // U+0301 (class 230), U+0316 (class 220)
  const std::string nfc = hh::model::normalize_nfc(s);
  // Class 220 marks move first; the first U+0301 then composes with 'a' past them.
  std::string want = "\xC3\xA1";
  for (int i = 0; i < kPairs; ++i) want += "\xCC\x96";
  for (int i = 1; i < kPairs; ++i) want += "\xCC\x81";
  EXPECT_TRUE(nfc == want) << "sizes " << nfc.size() << " vs " << want.size();
}

TEST(Nfc, MatchesPythonUnicodedataVectors) {
  const json j = json::parse(read_text(hh::test::data_dir() / "tokenizer" / "nfc-vectors.json"));
  ASSERT_GE(j["cases"].size(), 100u);
  int failures = 0;
  for (const auto& c : j["cases"]) {
    const std::string in = c["in"], want = c["nfc"];
    const std::string got = hh::model::normalize_nfc(in);
    if (got != want && ++failures <= 10)
      ADD_FAILURE() << "NFC(" << json(in).dump() << ") = " << json(got).dump() << ", want " << json(want).dump();
  }
  EXPECT_EQ(failures, 0) << "of " << j["cases"].size() << " vectors (Unicode " << j["unicode"] << ")";
}

// ---- load errors ----------------------------------------------------------------------------

TEST(TokenizerErrors, UnreadableFileNamesThePath) {
  const auto missing = hh::test::scratch_dir("tok") / "missing-tokenizer.json";
  expect_error([&] { Tokenizer::load(missing); }, {"missing-tokenizer.json"});
}

TEST(TokenizerErrors, BadJsonNamesTheSource) {
  expect_error([] { Tokenizer::from_json_text("{\"model\": ", "broken.json"); }, {"broken.json", "JSON"});
  const auto dir = hh::test::scratch_dir("tok");
  { std::ofstream(dir / "truncated.json") << "{\"model\": {\"vocab\": {"; }
  expect_error([&] { Tokenizer::load(dir / "truncated.json"); }, {"truncated.json", "JSON"});
}

TEST(TokenizerErrors, MissingVocabNamesTheField) {
  json j = tiny_json();
  j["model"].erase("vocab");
  expect_error([&] { from(j); }, {"test.json", "model.vocab"});
  j.erase("model");
  expect_error([&] { from(j); }, {"test.json", "model"});
}

TEST(TokenizerErrors, MergeWithUnknownTokenNamesTheMerge) {
  json j = tiny_json();
  j["model"]["merges"].push_back("h zz");
  const std::string field = "model.merges[" + std::to_string(j["model"]["merges"].size() - 1) + "]";
  expect_error([&] { from(j); }, {"test.json", field, "zz"});
  j["model"]["merges"].back() = "x y";  // both known, but "xy" is not in the vocabulary
  expect_error([&] { from(j); }, {field, "xy"});
  j["model"]["merges"].back() = "nospace";
  expect_error([&] { from(j); }, {field});
}

TEST(TokenizerErrors, BadFieldsAreNamed) {
  {
    json j = tiny_json();
    j["model"]["vocab"]["hello"] = -3;
    expect_error([&] { from(j); }, {"model.vocab[\"hello\"]", "-3"});
  }
  {
    json j = tiny_json();
    j["added_tokens"][0]["id"] = "x";
    expect_error([&] { from(j); }, {"added_tokens[0].id"});
  }
  {
    json j = tiny_json();
    j["normalizer"] = {{"type", "Lowercase"}};
    expect_error([&] { from(j); }, {"normalizer.type", "Lowercase"});
  }
  {
    json j = tiny_json();
    j["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"] = "(unclosed";
    expect_error([&] { from(j); }, {"pre_tokenizer.pretokenizers[0].pattern.Regex", "(unclosed"});
  }
  {
    json j = tiny_json();
    j["pre_tokenizer"] = {{"type", "Whitespace"}};
    expect_error([&] { from(j); }, {"pre_tokenizer.type", "Whitespace"});
  }
  {
    json j = tiny_json();
    j["model"]["type"] = "WordPiece";
    expect_error([&] { from(j); }, {"model.type", "WordPiece"});
  }
}

}  // namespace
