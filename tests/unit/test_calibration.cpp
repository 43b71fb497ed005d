// Calibration sets (DESIGN.md section 5): the JSONL round trip, and every validation error names the
// file, the line and the field.
#include <gtest/gtest.h>

#include <fstream>
#include <sstream>
#include <string>

#include "core/interp/calibration.h"
#include "core/io/sha256.h"
#include "core/model/tokenizer.h"
#include "core/util/error.h"
#include "support/test_support.h"

namespace {

namespace fs = std::filesystem;
using hh::interp::CalibExample;
using hh::interp::read_calibration;

const hh::model::Tokenizer& tiny_tokenizer() {
  static const auto tok = hh::model::Tokenizer::load(hh::test::data_dir() / "tokenizer" / "tiny-tokenizer.json");
  return tok;
}

fs::path write_lines(const std::string& name, const std::string& text) {
  const auto path = hh::test::scratch_dir("calibration") / name;
  std::ofstream(path, std::ios::binary) << text;
  return path;
}

std::string slurp(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// The message of the hh::Error that reading `text` raises (with an optional tokenizer and vocabulary).
std::string read_error(const std::string& text, const hh::model::Tokenizer* tok = nullptr, int64_t vocab = -1,
                       fs::path* where = nullptr) {
  const auto path = write_lines("bad.jsonl", text);
  if (where) *where = path;
  try {
    read_calibration(path, tok, vocab);
  } catch (const hh::Error& e) {
    return e.what();
  }
  ADD_FAILURE() << "no error for:\n" << text;
  return "";
}

// Asserts the message starts with "FILE:LINE: " and contains `needle`.
void expect_error_at(const std::string& text, int line, const std::string& needle,
                     const hh::model::Tokenizer* tok = nullptr, int64_t vocab = -1) {
  fs::path path;
  const auto msg = read_error(text, tok, vocab, &path);
  const std::string prefix = path.string() + ":" + std::to_string(line) + ": ";
  EXPECT_EQ(msg.rfind(prefix, 0), 0u) << "expected prefix '" << prefix << "' in: " << msg;
  EXPECT_NE(msg.find(needle), std::string::npos) << "expected '" << needle << "' in: " << msg;
}

constexpr const char* kGood =
    R"({"task": "t", "clean_ids": [1, 2, 3], "corrupt_ids": [1, 4, 3], "answer_ids": [5], "wrong_ids": [6]})";

CalibExample example(const std::string& task, std::vector<int64_t> clean, std::vector<int64_t> corrupt) {
  CalibExample ex;
  ex.task = task;
  ex.clean_ids = std::move(clean);
  ex.corrupt_ids = std::move(corrupt);
  ex.answer_ids = {7, 8};
  return ex;
}

TEST(Calibration, RoundTripKeepsEveryField) {
  std::vector<CalibExample> in;
  in.push_back(example("niah-single", {1, 2, 3, 4}, {1, 2, 9, 4}));
  in[0].wrong_ids = {9};
  in[0].meta = {{"depth", 0.25}, {"needle", "71432"}};
  in[0].clean = "The key is 1";
  in[0].corrupt = "The key is 2";
  in[0].answer = " 1";
  in[0].wrong = " 2";
  in.push_back(example("copy", {10}, {11}));  // no wrong, no texts, empty meta

  const auto dir = hh::test::scratch_dir("calibration");
  const auto path = dir / "calib.jsonl";
  hh::interp::write_calibration(path, in);
  const auto out = read_calibration(path);
  ASSERT_EQ(out.size(), 2u);
  for (std::size_t i = 0; i < out.size(); ++i) {
    EXPECT_EQ(out[i].task, in[i].task);
    EXPECT_EQ(out[i].clean_ids, in[i].clean_ids);
    EXPECT_EQ(out[i].corrupt_ids, in[i].corrupt_ids);
    EXPECT_EQ(out[i].answer_ids, in[i].answer_ids);
    EXPECT_EQ(out[i].wrong_ids, in[i].wrong_ids);
    EXPECT_EQ(out[i].meta, in[i].meta);
    EXPECT_EQ(out[i].clean, in[i].clean);
    EXPECT_EQ(out[i].wrong, in[i].wrong);
  }
  const std::string bytes = slurp(path);
  EXPECT_EQ(bytes.rfind(R"({"task":"niah-single","clean_ids":[1,2,3,4],"corrupt_ids":[1,2,9,4],)", 0), 0u) << bytes;
  EXPECT_EQ(std::count(bytes.begin(), bytes.end(), '\n'), 2);
  EXPECT_EQ(bytes.back(), '\n');
  // Atomic write: nothing but the file itself in the directory.
  EXPECT_EQ(std::distance(fs::directory_iterator(dir), fs::directory_iterator()), 1);
  EXPECT_EQ(hh::interp::calibration_sha256(path), hh::io::sha256_hex(bytes));
}

TEST(Calibration, WriteRefusesAnInvalidSetAndKeepsTheOldFile) {
  const auto dir = hh::test::scratch_dir("calibration");
  const auto path = dir / "calib.jsonl";
  hh::interp::write_calibration(path, {example("t", {1, 2}, {1, 3})});
  const std::string before = slurp(path);
  try {
    hh::interp::write_calibration(path, {example("t", {1, 2}, {1, 3}), example("t", {1, 2}, {1})});
    FAIL() << "no error";
  } catch (const hh::Error& e) {
    const std::string expected = path.string() + ": example 2: field 'corrupt_ids' has 1 token but 'clean_ids' has 2";
    EXPECT_NE(std::string(e.what()).find(expected), std::string::npos) << e.what();
  }
  EXPECT_EQ(slurp(path), before);
  EXPECT_EQ(std::distance(fs::directory_iterator(dir), fs::directory_iterator()), 1);
  EXPECT_THROW(hh::interp::write_calibration(path, {}), hh::Error);
}

TEST(Calibration, BadJsonNamesFileAndLine) {
  expect_error_at(std::string(kGood) + "\n{\"task\": \"t\", \"clean_ids\": [1, 2\n", 2, "not valid JSON");
  expect_error_at("[1, 2, 3]\n", 1, "expected a JSON object, got array");
}

TEST(Calibration, MissingFieldsAreNamed) {
  expect_error_at(R"({"task": "t", "corrupt_ids": [1], "answer_ids": [2]})", 1,
                  "missing field 'clean_ids' (or its text form 'clean')");
  expect_error_at(R"({"task": "t", "clean_ids": [1], "answer_ids": [2]})", 1, "missing field 'corrupt_ids'");
  expect_error_at(R"({"task": "t", "clean_ids": [1], "corrupt_ids": [2]})", 1, "missing field 'answer_ids'");
  expect_error_at(R"({"clean_ids": [1], "corrupt_ids": [2], "answer_ids": [3]})", 1, "missing field 'task'");
  expect_error_at(R"({"task": 3, "clean_ids": [1], "corrupt_ids": [2], "answer_ids": [3]})", 1,
                  "field 'task' must be a string");
}

TEST(Calibration, UnequalLengthsAreNamed) {
  expect_error_at(std::string(kGood) + "\n" + kGood + "\n" +
                      R"({"task": "t", "clean_ids": [1, 2, 3], "corrupt_ids": [1, 2], "answer_ids": [5]})" + "\n",
                  3, "field 'corrupt_ids' has 2 tokens but 'clean_ids' has 3");
}

TEST(Calibration, IdsOutOfRangeAreNamed) {
  expect_error_at(R"({"task": "t", "clean_ids": [1, 2], "corrupt_ids": [1, 3], "answer_ids": [12]})", 1,
                  "field 'answer_ids' item 0: id 12 is out of range [0, 10)", nullptr, /*vocab=*/10);
  expect_error_at(R"({"task": "t", "clean_ids": [1, -2], "corrupt_ids": [1, 3], "answer_ids": [1]})", 1,
                  "field 'clean_ids' item 1: id -2 is out of range");
  expect_error_at(R"({"task": "t", "clean_ids": [1, 2], "corrupt_ids": [1, 3], "answer_ids": [1], "wrong_ids": [10]})",
                  1, "field 'wrong_ids' item 0: id 10 is out of range [0, 10)", nullptr, 10);
  expect_error_at(R"({"task": "t", "clean_ids": [1, 2.5], "corrupt_ids": [1, 3], "answer_ids": [1]})", 1,
                  "field 'clean_ids' item 1 (2.5) is not an integer token id");
  expect_error_at(R"({"task": "t", "clean_ids": "1 2", "corrupt_ids": [1, 3], "answer_ids": [1]})", 1,
                  "field 'clean_ids' must be an array of token ids, got string");
  expect_error_at(R"({"task": "t", "clean_ids": [1, 18446744073709551615], "corrupt_ids": [1, 3], "answer_ids": [1]})",
                  1, "field 'clean_ids' item 1: id 18446744073709551615 is out of range");
}

TEST(Calibration, EmptySequencesAreNamed) {
  expect_error_at(R"({"task": "t", "clean_ids": [1], "corrupt_ids": [2], "answer_ids": []})", 1,
                  "field 'answer_ids' is empty");
  expect_error_at(R"({"task": "t", "clean_ids": [], "corrupt_ids": [], "answer_ids": [3]})", 1,
                  "field 'clean_ids' is empty");
  expect_error_at(R"({"task": "t", "clean_ids": [1], "corrupt_ids": [2], "answer_ids": [3], "meta": [1]})", 1,
                  "field 'meta' must be an object");
}

TEST(Calibration, BlankLinesAreSkippedButCounted) {
  const std::string text = std::string(kGood) + "\r\n\n   \n" + kGood + "\n\n" +
                           R"({"task": "t", "clean_ids": [1], "corrupt_ids": [2], "answer_ids": []})" + "\n";
  expect_error_at(text, 6, "field 'answer_ids' is empty");
  const auto path = write_lines("ok.jsonl", std::string(kGood) + "\r\n\n" + kGood);  // no final newline
  const auto set = read_calibration(path);
  ASSERT_EQ(set.size(), 2u);
  EXPECT_TRUE(set[0].wrong_ids == std::vector<int64_t>{6});
  EXPECT_TRUE(set[0].meta.is_object());
}

TEST(Calibration, EmptyOrMissingFileIsNamed) {
  fs::path path;
  const auto msg = read_error("\n\n", nullptr, -1, &path);
  EXPECT_EQ(msg, path.string() + ": holds no examples");
  const auto missing = hh::test::scratch_dir("calibration") / "none.jsonl";
  try {
    read_calibration(missing);
    FAIL() << "no error";
  } catch (const hh::Error& e) {
    EXPECT_NE(std::string(e.what()).find(missing.string()), std::string::npos) << e.what();
  }
}

TEST(Calibration, TextOnlyLinesAreTokenised) {
  const auto& tok = tiny_tokenizer();
  const auto path = write_lines(
      "text.jsonl",
      R"({"task": "passkey", "clean": "The key is 12", "corrupt": "The key is 34", "answer": " 12", "wrong": " 34"})"
      "\n");
  const auto set = read_calibration(path, &tok, tok.vocab_size());
  ASSERT_EQ(set.size(), 1u);
  EXPECT_EQ(set[0].clean_ids, tok.encode("The key is 12"));
  EXPECT_EQ(set[0].corrupt_ids, tok.encode("The key is 34"));
  EXPECT_EQ(set[0].answer_ids, tok.encode(" 12"));
  EXPECT_EQ(set[0].wrong_ids, tok.encode(" 34"));
  EXPECT_EQ(set[0].clean, "The key is 12");

  // Without a tokenizer, the text field is named as the reason.
  expect_error_at(R"({"task": "t", "clean": "a", "corrupt": "b", "answer": "c"})", 1,
                  "field 'clean' is text without 'clean_ids'; a tokenizer is needed");
  // Lengths are compared after tokenisation, and the error names the text fields.
  const auto n_clean = std::to_string(tok.encode("The key is 12").size());
  const auto n_corrupt = std::to_string(tok.encode("The key is 345").size());
  expect_error_at(R"({"task": "t", "clean": "The key is 12", "corrupt": "The key is 345", "answer": " 1"})", 1,
                  "field 'corrupt' has " + n_corrupt + " tokens but 'clean' has " + n_clean, &tok);
  expect_error_at(R"({"task": "t", "clean": "a", "corrupt": "b", "answer": ""})", 1, "field 'answer' is empty", &tok);
  expect_error_at(R"({"task": "t", "clean": 5, "corrupt": "b", "answer": "c"})", 1, "field 'clean' must be a string",
                  &tok);
}

TEST(Calibration, IdsWinOverTextWhenBothArePresent) {
  const auto& tok = tiny_tokenizer();
  const auto path = write_lines(
      "both.jsonl",
      R"({"task": "t", "clean_ids": [1, 2], "clean": "anything at all", "corrupt_ids": [3, 4], "corrupt": "zzz",)"
      R"( "answer_ids": [3], "answer": "q"})"
      "\n");
  const auto set = read_calibration(path, &tok, tok.vocab_size());
  EXPECT_EQ(set[0].clean_ids, (std::vector<int64_t>{1, 2}));
  EXPECT_EQ(set[0].corrupt_ids, (std::vector<int64_t>{3, 4}));
  EXPECT_EQ(set[0].answer_ids, (std::vector<int64_t>{3}));
  EXPECT_EQ(set[0].clean, "anything at all");
  // With ids present no tokenizer is needed at all.
  EXPECT_NO_THROW(read_calibration(path));
}

TEST(Calibration, FirstDifference) {
  using hh::interp::first_difference;
  EXPECT_EQ(first_difference({1, 2, 3}, {1, 2, 4}), 2);
  EXPECT_EQ(first_difference({1, 2, 3}, {9, 2, 3}), 0);
  EXPECT_EQ(first_difference({1, 2, 3}, {1, 2, 3}), -1);
  EXPECT_EQ(first_difference({1, 2}, {1, 2, 3}), 2);
  EXPECT_EQ(first_difference({}, {}), -1);
}

}  // namespace
