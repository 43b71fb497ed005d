// Built-in calibration tasks with Qwen3's real tokenizer (fetched by the ctest fixture
// tokenizer.fetch_reference into hh::test::qwen3_tokenizer_dir()): exact lengths, clean/corrupt
// differing only in the recorded spans, values decoded at their recorded positions, and answers that
// continue the prompt exactly as Qwen3 would tokenise the whole text. Missing files fail, never skip.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "builtin_tasks.h"
#include "core/model/tokenizer.h"
#include "hydrahead/plugin.h"
#include "support/test_support.h"

namespace {

using hh::model::Tokenizer;
using nlohmann::json;
using Ids = std::vector<int64_t>;

const Tokenizer& qwen3() {
  static const Tokenizer tok = Tokenizer::load(hh::test::qwen3_tokenizer_dir() / "tokenizer.json");
  return tok;
}

struct Adapter {
  explicit Adapter(const Tokenizer& t) : tok(&t) {
    abi.ctx = this;
    abi.vocab_size = t.vocab_size();
    abi.encode = [](void* ctx, const char* text, size_t len, int64_t* out, int64_t cap) -> int64_t {
      try {
        const Ids ids = static_cast<Adapter*>(ctx)->tok->encode(std::string_view(text, len));
        std::copy_n(ids.begin(), std::min<int64_t>(static_cast<int64_t>(ids.size()), cap), out);
        return static_cast<int64_t>(ids.size());
      } catch (...) {
        return -1;
      }
    };
    abi.decode = [](void* ctx, const int64_t* ids, int64_t n, char* out, int64_t cap) -> int64_t {
      try {
        const std::string s = static_cast<Adapter*>(ctx)->tok->decode(Ids(ids, ids + n));
        std::memcpy(out, s.data(), static_cast<size_t>(std::min<int64_t>(static_cast<int64_t>(s.size()), cap)));
        return static_cast<int64_t>(s.size());
      } catch (...) {
        return -1;
      }
    };
  }
  const Tokenizer* tok;
  hh_tokenizer_v1 abi{};
};

std::vector<json> generate(const hh_task_v1* task, const json& params, uint64_t seed) {
  static Adapter adapter(qwen3());
  std::vector<json> out;
  hh_sink_v1 sink{};
  sink.ctx = &out;
  sink.emit = [](void* ctx, const char* text, size_t len) {
    static_cast<std::vector<json>*>(ctx)->push_back(json::parse(std::string(text, len)));
    return 0;
  };
  char err[1024] = "";
  const std::string p = params.dump();
  EXPECT_EQ(task->generate(p.c_str(), &adapter.abi, seed, &sink, err, sizeof err), 0) << err;
  return out;
}

Ids slice(const Ids& v, const json& span) {
  return Ids(v.begin() + span[0].get<int64_t>(), v.begin() + span[1].get<int64_t>());
}

std::vector<const hh_task_v1*> all_tasks() {
  auto tasks = hh::builtin::retrieval_tasks();
  for (auto* t : hh::builtin::reasoning_tasks()) tasks.push_back(t);
  return tasks;
}

TEST(BuiltinTasksQwen3, ExactLengthsAndSpansForEveryTask) {
  const Tokenizer& tok = qwen3();
  for (const hh_task_v1* task : all_tasks()) {
    for (int64_t length : {256, 1000, 4096}) {
      for (const char* hay : {"essays", "noise"}) {
        SCOPED_TRACE(std::string(task->id) + " " + hay + " length " + std::to_string(length));
        const auto examples = generate(task, {{"length", length}, {"num_examples", 3}, {"haystack", hay}}, 1234);
        ASSERT_EQ(examples.size(), 3u);
        for (const json& ex : examples) {
          const json& m = ex["meta"];
          const Ids clean = ex["clean_ids"], corrupt = ex["corrupt_ids"], answer = ex["answer_ids"],
                    wrong = ex["wrong_ids"];
          ASSERT_EQ(static_cast<int64_t>(clean.size()), length);
          ASSERT_EQ(corrupt.size(), clean.size());
          ASSERT_FALSE(answer.empty());
          ASSERT_FALSE(wrong.empty());
          EXPECT_NE(answer[0], wrong[0]);
          for (int64_t i = 0; i < length; ++i) {
            if (clean[i] == corrupt[i]) continue;
            bool covered = false;
            for (const auto& d : m["diff_spans"]) covered = covered || (d[0] <= i && i < d[1]);
            ASSERT_TRUE(covered) << "difference at " << i;
          }
          if (m.contains("needles")) {
            for (const auto& n : m["needles"]) {
              for (const auto& vs : n["value_spans"]) {
                EXPECT_EQ(tok.decode(slice(clean, vs)), " " + n["value"].get<std::string>());
                if (n["asked"].get<bool>()) {
                  EXPECT_EQ(tok.decode(slice(corrupt, vs)), " " + n["corrupt_value"].get<std::string>());
                }
              }
            }
          }
        }
      }
    }
  }
}

// With Qwen3 a number after a space is a lone space token and then one token per digit; the space is
// moved into the prompt, so the answer starts with the first digit, and the question followed by the
// answer re-tokenises to exactly the same ids.
TEST(BuiltinTasksQwen3, AnswersContinueThePromptAsQwen3TokenisesIt) {
  const Tokenizer& tok = qwen3();
  for (const char* id : {"niah-single", "niah-multikey", "niah-multivalue", "niah-multiquery", "passkey",
                         "variable-tracking", "arithmetic"}) {
    SCOPED_TRACE(id);
    const hh_task_v1* task = nullptr;
    for (auto* t : all_tasks())
      if (std::string(t->id) == id) task = t;
    ASSERT_NE(task, nullptr);
    for (const json& ex : generate(task, {{"length", 2000}, {"num_examples", 4}}, 99)) {
      const json& m = ex["meta"];
      const Ids clean = ex["clean_ids"], answer = ex["answer_ids"];
      const int64_t q = m["question_tokens"];
      Ids tail(clean.end() - q, clean.end());
      tail.insert(tail.end(), answer.begin(), answer.end());
      const std::string text = tok.decode(tail);
      EXPECT_EQ(tok.encode(text), tail) << text;
      if (std::string(id) != "variable-tracking") {
        EXPECT_EQ(m["answer_prefix_tokens"], 1) << "the lone space before the digits";
        const std::string first = tok.decode(Ids{answer[0]});
        EXPECT_TRUE(first.size() == 1 && first[0] >= '0' && first[0] <= '9') << first;
      }
    }
  }
}

TEST(BuiltinTasksQwen3, DepthEdgesAndLongContext) {
  const hh_task_v1* single = hh::builtin::niah_single_task();
  for (double depth : {0.0, 1.0}) {
    for (const json& ex : generate(single, {{"length", 3000}, {"num_examples", 2}, {"depth", depth}}, 5)) {
      const json& m = ex["meta"];
      if (depth == 0.0) EXPECT_EQ(m["needle"][0], m["header_tokens"]);
      if (depth == 1.0) EXPECT_EQ(m["needle"][1].get<int64_t>(), 3000 - m["question_tokens"].get<int64_t>());
    }
  }
  const int64_t length = 32768;  // several passes through the essays
  const auto ex = generate(single, {{"length", length}, {"num_examples", 1}}, 6);
  ASSERT_EQ(ex.size(), 1u);
  EXPECT_EQ(ex[0]["clean_ids"].size(), static_cast<size_t>(length));
  EXPECT_EQ(ex[0]["corrupt_ids"].size(), static_cast<size_t>(length));
}

}  // namespace
