// Built-in calibration tasks (plugins/builtin), called through their ABI descriptors with the tiny
// byte-level BPE tokenizer: exact lengths, clean/corrupt pairs that differ only where they should,
// answers at the recorded positions, determinism, parameter errors, cancellation, and the plugin
// libraries' entry points.
#include <dlfcn.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <regex>
#include <set>
#include <string>
#include <vector>

#include "builtin_tasks.h"
#include "core/model/tokenizer.h"
#include "hydrahead/plugin.h"
#include "support/test_support.h"

namespace {

using hh::model::Tokenizer;
using nlohmann::json;

// ---- the host side, as the tests need it -----------------------------------------------------------

// hh::model::Tokenizer behind the ABI's callbacks.
struct TokenizerAdapter {
  explicit TokenizerAdapter(const Tokenizer& t) : tok(&t) {
    abi.ctx = this;
    abi.encode = &encode;
    abi.decode = &decode;
    abi.vocab_size = t.vocab_size();
  }
  static int64_t encode(void* ctx, const char* text, size_t len, int64_t* out, int64_t cap) {
    try {
      const auto ids = static_cast<TokenizerAdapter*>(ctx)->tok->encode(std::string_view(text, len));
      const int64_t n = static_cast<int64_t>(ids.size());
      std::copy_n(ids.begin(), std::min(n, cap), out);
      return n;
    } catch (...) {
      return -1;
    }
  }
  static int64_t decode(void* ctx, const int64_t* ids, int64_t n, char* out, int64_t cap) {
    try {
      const std::string s = static_cast<TokenizerAdapter*>(ctx)->tok->decode(std::vector<int64_t>(ids, ids + n));
      const int64_t len = static_cast<int64_t>(s.size());
      std::memcpy(out, s.data(), static_cast<size_t>(std::min(len, cap)));
      return len;
    } catch (...) {
      return -1;
    }
  }
  const Tokenizer* tok;
  hh_tokenizer_v1 abi{};
};

struct Generated {
  int rc = 0;
  std::string err;
  std::vector<std::string> lines;
  std::vector<json> examples;
  std::vector<double> progress;
};

struct Collector {
  Generated* run;
  size_t stop_after;  // 0: never
};

Generated generate(const hh_task_v1* task, const json& params, uint64_t seed, const hh_tokenizer_v1& tok,
                   size_t stop_after = 0, size_t err_cap = 1024) {
  Generated run;
  Collector col{&run, stop_after};
  hh_sink_v1 sink{};
  sink.ctx = &col;
  sink.emit = [](void* ctx, const char* text, size_t len) {
    auto* c = static_cast<Collector*>(ctx);
    c->run->lines.emplace_back(text, len);
    return c->stop_after != 0 && c->run->lines.size() >= c->stop_after ? 1 : 0;
  };
  sink.progress = [](void* ctx, double f) { static_cast<Collector*>(ctx)->run->progress.push_back(f); };
  std::vector<char> err(err_cap + 1, 'x');  // one guard byte past the capacity
  const std::string text = params.dump();
  run.rc = task->generate(text.c_str(), &tok, seed, &sink, err.data(), err_cap);
  EXPECT_EQ(err[err_cap], 'x') << "generate wrote past err_cap";
  if (run.rc != 0) run.err = std::string(err.data(), strnlen(err.data(), err_cap));
  for (const auto& l : run.lines) run.examples.push_back(json::parse(l));
  return run;
}

// ---- fixtures ----------------------------------------------------------------------------------------

const Tokenizer& tiny() {
  static const Tokenizer t = Tokenizer::load(hh::test::data_dir() / "tokenizer" / "tiny-tokenizer.json");
  return t;
}

std::vector<const hh_task_v1*> all_tasks() {
  auto tasks = hh::builtin::retrieval_tasks();
  for (auto* t : hh::builtin::reasoning_tasks()) tasks.push_back(t);
  return tasks;
}

const hh_task_v1* task_by_id(const std::string& id) {
  for (auto* t : all_tasks())
    if (id == t->id) return t;
  ADD_FAILURE() << "no task " << id;
  return nullptr;
}

bool has_param(const hh_task_v1* t, const std::string& name) {
  for (size_t i = 0; i < t->num_params; ++i)
    if (name == t->params[i].name) return true;
  return false;
}

std::vector<int64_t> ids_of(const json& j) { return j.get<std::vector<int64_t>>(); }

std::vector<int64_t> slice(const std::vector<int64_t>& v, const json& span) {
  const auto b = span.at(0).get<int64_t>(), e = span.at(1).get<int64_t>();
  EXPECT_LE(0, b);
  EXPECT_LE(b, e);
  EXPECT_LE(e, static_cast<int64_t>(v.size()));
  return {v.begin() + b, v.begin() + e};
}

bool inside(const json& inner, const json& outer) {
  return outer[0].get<int64_t>() <= inner[0].get<int64_t>() && inner[1].get<int64_t>() <= outer[1].get<int64_t>();
}

// The prompt's last answer_prefix_tokens ids followed by the given answer ids: the text the model
// would produce after the question.
std::vector<int64_t> continuation(const json& ex, const std::vector<int64_t>& prompt, const char* which) {
  const auto p = ex["meta"]["answer_prefix_tokens"].get<size_t>();
  std::vector<int64_t> out(prompt.end() - static_cast<std::ptrdiff_t>(p), prompt.end());
  for (int64_t id : ids_of(ex[which])) out.push_back(id);
  return out;
}

std::string join(const std::vector<std::string>& parts, const std::string& sep) {
  std::string out;
  for (size_t i = 0; i < parts.size(); ++i) out += (i ? sep : "") + parts[i];
  return out;
}

// Every invariant of one generated example.
void check_example(const json& ex, const std::string& task, int64_t length, const Tokenizer& tok) {
  SCOPED_TRACE(task + " length " + std::to_string(length) + " example " + ex["meta"].value("index", json()).dump());
  const json& m = ex.at("meta");
  EXPECT_EQ(ex.at("task"), task);
  const auto clean = ids_of(ex.at("clean_ids")), corrupt = ids_of(ex.at("corrupt_ids"));
  const auto answer = ids_of(ex.at("answer_ids")), wrong = ids_of(ex.at("wrong_ids"));
  ASSERT_EQ(static_cast<int64_t>(clean.size()), length);
  ASSERT_EQ(corrupt.size(), clean.size());
  EXPECT_EQ(m.at("length"), length);
  ASSERT_FALSE(answer.empty());
  ASSERT_FALSE(wrong.empty());
  EXPECT_NE(answer[0], wrong[0]) << "logit-diff needs different first tokens";
  for (const auto* v : {&clean, &corrupt, &answer, &wrong})
    for (int64_t id : *v) ASSERT_TRUE(id >= 0 && id < tok.vocab_size()) << id;
  EXPECT_EQ(ex.at("clean"), tok.decode(clean));
  EXPECT_EQ(ex.at("corrupt"), tok.decode(corrupt));
  EXPECT_EQ(ex.at("answer"), tok.decode(answer));
  EXPECT_EQ(ex.at("wrong"), tok.decode(wrong));
  const auto prefix = m.at("answer_prefix_tokens").get<int64_t>();
  EXPECT_LE(prefix, m.at("question_tokens").get<int64_t>());
  EXPECT_LE(m.at("header_tokens").get<int64_t>() + m.at("question_tokens").get<int64_t>(), length);

  // Clean and corrupt differ somewhere, and only inside the recorded spans.
  const json& diff = m.at("diff_spans");
  ASSERT_FALSE(diff.empty());
  bool any = false;
  for (int64_t i = 0; i < length; ++i) {
    if (clean[i] == corrupt[i]) continue;
    any = true;
    bool covered = false;
    for (const auto& d : diff) covered = covered || (d[0].get<int64_t>() <= i && i < d[1].get<int64_t>());
    ASSERT_TRUE(covered) << "clean and corrupt differ at " << i << " outside every diff span";
  }
  EXPECT_TRUE(any) << "clean and corrupt are identical";

  const std::string clean_answer = tok.decode(continuation(ex, clean, "answer_ids"));
  const std::string wrong_answer = tok.decode(continuation(ex, corrupt, "wrong_ids"));

  if (m.contains("needles")) {  // retrieval: niah-*, passkey
    std::vector<std::string> asked_values, corrupt_values;
    for (const auto& n : m.at("needles")) {
      const json& span = n.at("span");
      for (const auto& vs : n.at("value_spans")) {
        ASSERT_TRUE(inside(vs, span));
        EXPECT_EQ(tok.decode(slice(clean, vs)), " " + n.at("value").get<std::string>());
        if (n.at("asked").get<bool>()) {
          EXPECT_EQ(tok.decode(slice(corrupt, vs)), " " + n.at("corrupt_value").get<std::string>());
          EXPECT_EQ(slice(clean, vs).size(), slice(corrupt, vs).size());
        } else {
          EXPECT_EQ(slice(clean, vs), slice(corrupt, vs)) << "a distractor changed";
        }
      }
      if (n.at("asked").get<bool>()) {
        asked_values.push_back(n.at("value").get<std::string>());
        corrupt_values.push_back(n.at("corrupt_value").get<std::string>());
      }
    }
    for (const auto& d : diff) {
      bool in_asked = false;
      for (const auto& n : m.at("needles"))
        in_asked = in_asked || (n.at("asked").get<bool>() && inside(d, n.at("span")));
      EXPECT_TRUE(in_asked) << "a difference lies outside the asked needles: " << d.dump();
    }
    EXPECT_EQ(clean_answer, " " + join(asked_values, ", "));
    EXPECT_EQ(wrong_answer, " " + join(corrupt_values, ", "));
    EXPECT_EQ(m.at("needle"), m.at("needles")[0].at("span"));
    EXPECT_EQ(m.at("value"), m.at("needles")[0].at("value"));
    EXPECT_NE(m.at("value"), m.at("corrupt_value"));
    const std::string needle_text = tok.decode(slice(clean, m.at("needle")));
    EXPECT_NE(needle_text.find(m.at("value").get<std::string>()), std::string::npos) << needle_text;
  } else if (m.contains("chains")) {  // variable-tracking
    const json& chains = m.at("chains");
    ASSERT_GE(chains.size(), 2u);
    const std::string v = chains[0]["value"], w = chains[1]["value"];
    EXPECT_EQ(tok.decode(slice(clean, chains[0]["value_span"])), " " + v);
    EXPECT_EQ(tok.decode(slice(corrupt, chains[0]["value_span"])), " " + w);
    EXPECT_EQ(tok.decode(slice(clean, chains[1]["value_span"])), " " + w);
    EXPECT_EQ(tok.decode(slice(corrupt, chains[1]["value_span"])), " " + v);
    EXPECT_EQ(clean_answer, " " + join(chains[0]["names"].get<std::vector<std::string>>(), " "));
    EXPECT_EQ(wrong_answer, " " + join(chains[1]["names"].get<std::vector<std::string>>(), " "));
    for (const auto& ch : chains) {
      const auto names = ch["names"].get<std::vector<std::string>>();
      int64_t last_end = 0;
      for (size_t h = 0; h < names.size(); ++h) {
        const json& st = ch["statements"][h];
        const std::string text = tok.decode(slice(clean, st));
        EXPECT_EQ(text.rfind(" VAR " + names[h] + " =", 0), 0u) << text;
        if (h > 0) EXPECT_EQ(text, " VAR " + names[h] + " = VAR " + names[h - 1] + ".");
        EXPECT_GE(st[0].get<int64_t>(), last_end) << "a variable is used before it is assigned";
        last_end = st[1].get<int64_t>();
      }
    }
  } else if (m.contains("continuation")) {  // induction
    const auto first = slice(clean, m.at("needle"));
    const auto cont = slice(clean, m.at("continuation"));
    const auto repeat = slice(clean, m.at("repeat"));
    ASSERT_TRUE(inside(m.at("continuation"), m.at("needle")));
    EXPECT_EQ(m.at("continuation")[1], m.at("needle")[1]);
    EXPECT_EQ(std::vector<int64_t>(first.begin(), first.end() - static_cast<std::ptrdiff_t>(cont.size())), repeat);
    EXPECT_EQ(cont, continuation(ex, clean, "answer_ids"));
    EXPECT_EQ(slice(corrupt, m.at("continuation")), continuation(ex, corrupt, "wrong_ids"));
    EXPECT_EQ(m.at("repeat")[1], length);
    EXPECT_EQ(diff.size(), 1u);
  } else if (m.contains("operands")) {  // arithmetic
    const auto operands = m.at("operands").get<std::vector<int64_t>>();
    const auto ops = m.at("ops").get<std::vector<std::string>>();
    int64_t total = operands[0];
    for (size_t i = 0; i < ops.size(); ++i) total += ops[i] == "+" ? operands[i + 1] : -operands[i + 1];
    EXPECT_EQ(std::to_string(total), m.at("result"));
    EXPECT_EQ(clean_answer, " " + m.at("result").get<std::string>());
    EXPECT_EQ(wrong_answer, " " + m.at("corrupt_result").get<std::string>());
    const auto which = m.at("corrupt_index").get<size_t>();
    for (size_t i = 0; i < operands.size(); ++i) {
      const json& s = m.at("operand_spans")[i];
      EXPECT_EQ(tok.decode(slice(clean, s)), " " + std::to_string(operands[i]));
      EXPECT_EQ(tok.decode(slice(corrupt, s)),
                " " + (i == which ? m.at("corrupt_operand").get<std::string>() : std::to_string(operands[i])));
    }
    EXPECT_EQ(m.at("problem")[1], length);
  } else {
    ADD_FAILURE() << "unrecognised meta: " << m.dump();
  }
}

// Smallest length the task accepts for example 0 of `seed`, read from the error at length 64
// (64 itself when that already fits).
int64_t min_length(const hh_task_v1* task, json params, uint64_t seed, const hh_tokenizer_v1& tok) {
  params["length"] = 64;
  params["num_examples"] = 1;
  const Generated r = generate(task, params, seed, tok);
  if (r.rc == 0) return 64;
  std::smatch m;
  static const std::regex kUse("use length >= ([0-9]+)");
  EXPECT_TRUE(std::regex_search(r.err, m, kUse)) << r.err;
  return m.empty() ? 64 : std::stoll(m[1]);
}

// ---- every task --------------------------------------------------------------------------------------

class BuiltinTask : public ::testing::TestWithParam<std::string> {
 protected:
  const hh_task_v1* task() const { return task_by_id(GetParam()); }
  TokenizerAdapter adapter{tiny()};
};

TEST_P(BuiltinTask, DescriptorIsComplete) {
  const hh_task_v1* t = task();
  ASSERT_NE(t, nullptr);
  EXPECT_TRUE(std::string(t->kind) == "retrieval" || std::string(t->kind) == "reasoning");
  EXPECT_GT(std::strlen(t->description), 0u);
  for (const char* p : {"length", "num_examples", "haystack"}) EXPECT_TRUE(has_param(t, p)) << p;
  for (size_t i = 0; i < t->num_params; ++i) {
    const hh_param_v1& p = t->params[i];
    EXPECT_TRUE(std::regex_match(p.name, std::regex("[a-z0-9_-]+"))) << p.name;
    if (p.type == HH_PARAM_INT || p.type == HH_PARAM_FLOAT) {
      EXPECT_LE(p.min, p.default_number) << p.name;
      EXPECT_LE(p.default_number, p.max) << p.name;
    }
    if (std::string(p.name) == "length") {
      EXPECT_EQ(p.default_number, 1024);
      EXPECT_EQ(p.min, 64);
      EXPECT_EQ(p.max, 1048576);
    }
  }
}

TEST_P(BuiltinTask, PromptsHaveExactlyTheRequestedLength) {
  const uint64_t seed = 11;
  const int64_t lo = min_length(task(), json::object(), seed, adapter.abi);
  // Fixed parts (needles, question) vary between examples, so the smallest length is tested with
  // example 0 alone and larger ones with several examples.
  std::vector<std::pair<int64_t, int64_t>> cases = {{lo, 1}, {lo + 1, 1}, {lo + 400, 4}, {lo + 977, 3}, {6000, 2}};
  if (lo > 64) {
    json p = {{"length", lo - 1}, {"num_examples", 1}};
    const Generated r = generate(task(), p, seed, adapter.abi);
    EXPECT_NE(r.rc, 0) << "length " << lo - 1 << " should be too small";
  }
  for (const auto& [length, n] : cases) {
    for (const char* hay : {"essays", "noise"}) {
      json p = {{"length", length}, {"num_examples", n}, {"haystack", hay}};
      const Generated r = generate(task(), p, seed, adapter.abi);
      ASSERT_EQ(r.rc, 0) << r.err;
      ASSERT_EQ(r.examples.size(), static_cast<size_t>(n));
      for (const auto& ex : r.examples) {
        check_example(ex, GetParam(), length, tiny());
        EXPECT_EQ(ex["meta"]["haystack"], hay);
      }
    }
  }
}

TEST_P(BuiltinTask, SameSeedSameBytesOtherSeedOtherBytes) {
  json p = {{"length", 1500}, {"num_examples", 3}};
  const Generated a = generate(task(), p, 42, adapter.abi);
  const Generated b = generate(task(), p, 42, adapter.abi);
  const Generated c = generate(task(), p, 43, adapter.abi);
  ASSERT_EQ(a.rc, 0) << a.err;
  ASSERT_EQ(c.rc, 0) << c.err;
  EXPECT_EQ(a.lines, b.lines);
  ASSERT_EQ(c.lines.size(), a.lines.size());
  for (size_t i = 0; i < a.lines.size(); ++i) EXPECT_NE(a.lines[i], c.lines[i]) << i;
  std::set<std::string> distinct(a.lines.begin(), a.lines.end());
  EXPECT_EQ(distinct.size(), a.lines.size()) << "examples of one set repeat";

  // Example i does not depend on how many examples are generated.
  p["num_examples"] = 5;
  const Generated more = generate(task(), p, 42, adapter.abi);
  ASSERT_EQ(more.rc, 0) << more.err;
  EXPECT_TRUE(std::equal(a.lines.begin(), a.lines.end(), more.lines.begin()));
}

TEST_P(BuiltinTask, ParameterErrorsAreClear) {
  const std::string id = GetParam();
  const std::vector<std::pair<json, std::string>> cases = {
      {{{"length", 10}}, "outside its range"},
      {{{"length", 1048577}}, "outside its range"},
      {{{"length", "long"}}, "must be an integer"},
      {{{"haystack", "poems"}}, "not one of: essays, noise"},
      {{{"no_such_param", 1}}, "unknown parameter 'no_such_param'"},
  };
  for (const auto& [params, expect] : cases) {
    const Generated r = generate(task(), params, 1, adapter.abi);
    EXPECT_NE(r.rc, 0) << params.dump();
    EXPECT_EQ(r.err.rfind(id + ": ", 0), 0u) << r.err;
    EXPECT_NE(r.err.find(expect), std::string::npos) << r.err;
    EXPECT_TRUE(r.lines.empty());
  }
  // Not valid JSON at all.
  hh_sink_v1 sink{nullptr, [](void*, const char*, size_t) { return 0; }, nullptr};
  char err[256];
  EXPECT_NE(task()->generate("{length:", &adapter.abi, 1, &sink, err, sizeof err), 0);
  EXPECT_NE(std::string(err).find("not valid JSON"), std::string::npos) << err;
}

TEST_P(BuiltinTask, LengthTooSmallForTheNeedleSaysSo) {
  json p = {{"length", 64}, {"num_examples", 1}};
  if (GetParam() == "induction") p["span_tokens"] = 40;  // its default needle fits in 64 tokens
  const Generated r = generate(task(), p, 3, adapter.abi);
  ASSERT_NE(r.rc, 0);
  EXPECT_NE(r.err.find("length 64 is too small"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("use length >= "), std::string::npos) << r.err;
}

TEST_P(BuiltinTask, StopsWhenTheSinkSaysSoAndReportsProgress) {
  json p = {{"length", 800}, {"num_examples", 6}};
  const Generated stopped = generate(task(), p, 5, adapter.abi, /*stop_after=*/2);
  EXPECT_EQ(stopped.rc, 0) << stopped.err;
  EXPECT_EQ(stopped.lines.size(), 2u);

  const Generated full = generate(task(), p, 5, adapter.abi);
  ASSERT_EQ(full.rc, 0) << full.err;
  EXPECT_EQ(full.lines.size(), 6u);
  ASSERT_FALSE(full.progress.empty());
  EXPECT_TRUE(std::is_sorted(full.progress.begin(), full.progress.end()));
  EXPECT_DOUBLE_EQ(full.progress.back(), 1.0);
  EXPECT_EQ(std::vector<std::string>(full.lines.begin(), full.lines.begin() + 2), stopped.lines);
}

TEST_P(BuiltinTask, ErrorMessagesRespectTheBufferSize) {
  const Generated r = generate(task(), {{"length", 3}}, 1, adapter.abi, 0, /*err_cap=*/16);
  EXPECT_NE(r.rc, 0);
  EXPECT_EQ(r.err.size(), 15u);
  EXPECT_EQ(r.err, (GetParam() + ": parameter 'length'").substr(0, 15));
}

INSTANTIATE_TEST_SUITE_P(All, BuiltinTask,
                         ::testing::Values("niah-single", "niah-multikey", "niah-multivalue", "niah-multiquery",
                                           "passkey", "variable-tracking", "induction", "arithmetic"),
                         [](const auto& info) {
                           std::string n = info.param;
                           std::replace(n.begin(), n.end(), '-', '_');
                           return n;
                         });

TEST(BuiltinTasks, IdsAndKindsAreAsDocumented) {
  std::map<std::string, std::string> kinds;
  for (auto* t : all_tasks()) EXPECT_TRUE(kinds.emplace(t->id, t->kind).second) << "duplicate " << t->id;
  const std::map<std::string, std::string> want = {{"niah-single", "retrieval"},     {"niah-multikey", "retrieval"},
                                                   {"niah-multivalue", "retrieval"}, {"niah-multiquery", "retrieval"},
                                                   {"passkey", "retrieval"},         {"variable-tracking", "reasoning"},
                                                   {"induction", "reasoning"},       {"arithmetic", "reasoning"}};
  EXPECT_EQ(kinds, want);
}

// ---- depth -------------------------------------------------------------------------------------------

TEST(BuiltinTasks, DepthZeroAndOnePutTheNeedleAtTheEdges) {
  TokenizerAdapter adapter(tiny());
  for (const char* id :
       {"niah-single", "niah-multikey", "niah-multivalue", "niah-multiquery", "passkey", "induction"}) {
    for (double depth : {0.0, 1.0}) {
      SCOPED_TRACE(std::string(id) + " depth " + std::to_string(depth));
      const int64_t length = 2500;
      const Generated r =
          generate(task_by_id(id), {{"length", length}, {"num_examples", 3}, {"depth", depth}}, 9, adapter.abi);
      ASSERT_EQ(r.rc, 0) << r.err;
      for (const auto& ex : r.examples) {
        const json& m = ex["meta"];
        check_example(ex, id, length, tiny());
        EXPECT_EQ(m["needle_depth"].get<double>(), depth);
        const auto needle = m["needle"];
        const bool alone =
            std::string(id) == "niah-single" || std::string(id) == "passkey" || std::string(id) == "induction";
        if (depth == 0.0) {
          // The first asked needle is listed first, so it leads even when others share its place.
          EXPECT_EQ(needle[0].get<int64_t>(), m["header_tokens"].get<int64_t>());
        } else if (alone) {
          EXPECT_EQ(needle[1].get<int64_t>(), length - m["question_tokens"].get<int64_t>());
        }
      }
    }
  }
}

TEST(BuiltinTasks, MiddleDepthIsNearTheMiddle) {
  TokenizerAdapter adapter(tiny());
  const Generated r =
      generate(task_by_id("niah-single"), {{"length", 8000}, {"num_examples", 4}, {"depth", 0.5}}, 2, adapter.abi);
  ASSERT_EQ(r.rc, 0) << r.err;
  for (const auto& ex : r.examples) {
    const double d = ex["meta"]["needle_depth"].get<double>();
    EXPECT_NEAR(d, 0.5, 0.05);  // within about one sentence of the middle at this length
  }
}

TEST(BuiltinTasks, MultivalueAnswersInTheOrderOfAppearance) {
  TokenizerAdapter adapter(tiny());
  const Generated r =
      generate(task_by_id("niah-multivalue"), {{"length", 3000}, {"values", 5}, {"num_examples", 4}}, 4, adapter.abi);
  ASSERT_EQ(r.rc, 0) << r.err;
  for (const auto& ex : r.examples) {
    const json& needles = ex["meta"]["needles"];
    ASSERT_EQ(needles.size(), 5u);
    for (size_t i = 1; i < needles.size(); ++i) {
      EXPECT_EQ(needles[i]["key"], needles[0]["key"]);
      EXPECT_LT(needles[i - 1]["span"][0].get<int64_t>(), needles[i]["span"][0].get<int64_t>());
    }
  }
}

TEST(BuiltinTasks, MultikeyAndMultiqueryAskTheRightKeys) {
  TokenizerAdapter adapter(tiny());
  const Generated mk = generate(task_by_id("niah-multikey"),
                                {{"length", 3000}, {"distractors", 5}, {"num_examples", 2}}, 8, adapter.abi);
  ASSERT_EQ(mk.rc, 0) << mk.err;
  for (const auto& ex : mk.examples) {
    const json& needles = ex["meta"]["needles"];
    ASSERT_EQ(needles.size(), 6u);
    std::set<std::string> keys;
    for (const auto& n : needles) keys.insert(n["key"].get<std::string>());
    EXPECT_EQ(keys.size(), 6u);
    EXPECT_TRUE(needles[0]["asked"].get<bool>());
    for (size_t i = 1; i < needles.size(); ++i) EXPECT_FALSE(needles[i]["asked"].get<bool>());
    EXPECT_NE(ex["clean"].get<std::string>().find("special magic number for " + needles[0]["key"].get<std::string>() +
                                                  " mentioned in the provided text is"),
              std::string::npos);
  }
  const Generated mq =
      generate(task_by_id("niah-multiquery"),
               {{"length", 3000}, {"queries", 3}, {"distractors", 2}, {"num_examples", 2}}, 8, adapter.abi);
  ASSERT_EQ(mq.rc, 0) << mq.err;
  for (const auto& ex : mq.examples) {
    const json& n = ex["meta"]["needles"];
    ASSERT_EQ(n.size(), 5u);
    const std::string keys = n[0]["key"].get<std::string>() + ", " + n[1]["key"].get<std::string>() + " and " +
                             n[2]["key"].get<std::string>();
    EXPECT_NE(ex["clean"].get<std::string>().find("special magic numbers for " + keys + " mentioned"),
              std::string::npos);
    EXPECT_FALSE(n[3]["asked"].get<bool>());
  }
}

// ---- long contexts and other parameters -------------------------------------------------------------

TEST(BuiltinTasks, LongContextsCycleTheHaystack) {
  TokenizerAdapter adapter(tiny());
  for (const char* id : {"niah-single", "variable-tracking"}) {
    const int64_t length = 60000;  // several times the essays' length in tiny-tokenizer tokens
    const Generated r = generate(task_by_id(id), {{"length", length}, {"num_examples", 1}}, 21, adapter.abi);
    ASSERT_EQ(r.rc, 0) << r.err;
    check_example(r.examples[0], id, length, tiny());
  }
}

TEST(BuiltinTasks, OtherParametersTakeEffect) {
  TokenizerAdapter adapter(tiny());
  const Generated vt =
      generate(task_by_id("variable-tracking"),
               {{"length", 3000}, {"hops", 6}, {"distractors", 3}, {"num_examples", 2}}, 3, adapter.abi);
  ASSERT_EQ(vt.rc, 0) << vt.err;
  for (const auto& ex : vt.examples) {
    check_example(ex, "variable-tracking", 3000, tiny());
    ASSERT_EQ(ex["meta"]["chains"].size(), 4u);
    EXPECT_EQ(ex["meta"]["chains"][0]["names"].size(), 6u);
  }
  const Generated ind =
      generate(task_by_id("induction"),
               {{"length", 2000}, {"span_tokens", 30}, {"answer_tokens", 7}, {"num_examples", 2}}, 3, adapter.abi);
  ASSERT_EQ(ind.rc, 0) << ind.err;
  for (const auto& ex : ind.examples) {
    check_example(ex, "induction", 2000, tiny());
    EXPECT_EQ(ex["answer_ids"].size(), 7u);
    EXPECT_EQ(ex["meta"]["repeat"][1].get<int64_t>() - ex["meta"]["repeat"][0].get<int64_t>(), 30);
  }
  const Generated ar = generate(task_by_id("arithmetic"),
                                {{"length", 1000}, {"steps", 5}, {"digits", 3}, {"num_examples", 3}}, 3, adapter.abi);
  ASSERT_EQ(ar.rc, 0) << ar.err;
  for (const auto& ex : ar.examples) {
    check_example(ex, "arithmetic", 1000, tiny());
    EXPECT_EQ(ex["meta"]["operands"].size(), 6u);
    for (const auto& v : ex["meta"]["operands"]) EXPECT_EQ(std::to_string(v.get<int64_t>()).size(), 3u);
  }
  const Generated pk =
      generate(task_by_id("passkey"), {{"length", 700}, {"value_digits", 9}, {"num_examples", 2}}, 3, adapter.abi);
  ASSERT_EQ(pk.rc, 0) << pk.err;
  for (const auto& ex : pk.examples) {
    check_example(ex, "passkey", 700, tiny());
    EXPECT_EQ(ex["meta"]["value"].get<std::string>().size(), 9u);
    EXPECT_EQ(ex["meta"]["value_spans"].size(), 2u);
  }
}

// Training draws thousands of arithmetic problems; one whose operands cannot
// be changed to move the result's first digit is drawn again rather than failing the generator.
TEST(BuiltinTasks, ArithmeticRedrawsProblemsWithoutACorruption) {
  TokenizerAdapter adapter(tiny());
  for (uint64_t seed : {1u, 2u, 3u}) {
    const Generated ar = generate(task_by_id("arithmetic"), {{"length", 400}, {"num_examples", 1000}, {"digits", 1}},
                                  seed, adapter.abi);
    ASSERT_EQ(ar.rc, 0) << ar.err;
    ASSERT_EQ(ar.examples.size(), 1000u);
    for (const auto& ex : ar.examples) {
      const std::string r = ex["meta"]["result"], c = ex["meta"]["corrupt_result"];
      ASSERT_NE(r[0], c[0]) << r << " vs " << c;
    }
  }
}

TEST(BuiltinTasks, ImpossibleContentsFailClearly) {
  TokenizerAdapter adapter(tiny());
  // Twelve distinct one-digit numbers do not exist.
  const Generated r = generate(task_by_id("niah-multivalue"),
                               {{"values", 12}, {"value_digits", 1}, {"num_examples", 1}}, 1, adapter.abi);
  ASSERT_NE(r.rc, 0);
  EXPECT_NE(r.err.find("distinct 1-digit number"), std::string::npos) << r.err;
}

// ---- the plugin libraries ----------------------------------------------------------------------------

struct FakeHost {
  std::vector<const hh_task_v1*> tasks;
  std::vector<std::string> logs;
  bool refuse_all = false;
};

hh_host_v1 make_host(FakeHost& h) {
  hh_host_v1 host{};
  host.abi_version = HH_PLUGIN_ABI_VERSION;
  host.ctx = &h;
  host.register_task = [](void* ctx, const hh_task_v1* t) {
    auto* fh = static_cast<FakeHost*>(ctx);
    if (fh->refuse_all) return 1;
    fh->tasks.push_back(t);
    return 0;
  };
  host.log = [](void* ctx, hh_log_level, const char* msg) { static_cast<FakeHost*>(ctx)->logs.emplace_back(msg); };
  host.plugin_dir = "";
  host.data_dir = "";
  return host;
}

struct Library {
  explicit Library(const std::filesystem::path& p) : handle(dlopen(p.c_str(), RTLD_NOW | RTLD_LOCAL)) {}
  ~Library() {
    if (handle) dlclose(handle);
  }
  void* handle;
};

TEST(BuiltinPlugins, LoadRegisterAndGenerateLikeTheLinkedGenerators) {
  const auto dir = hh::test::bin_dir().parent_path() / "lib" / "hydrahead" / "plugins";
  const std::map<std::string, std::vector<std::string>> want = {
      {"libhh-tasks-retrieval.so", {"niah-single", "niah-multikey", "niah-multivalue", "niah-multiquery", "passkey"}},
      {"libhh-tasks-reasoning.so", {"variable-tracking", "induction", "arithmetic"}}};
  TokenizerAdapter adapter(tiny());
  for (const auto& [file, ids] : want) {
    SCOPED_TRACE(file);
    Library lib(dir / file);
    ASSERT_NE(lib.handle, nullptr) << dlerror();
    auto entry = reinterpret_cast<hh_plugin_entry_v1>(dlsym(lib.handle, HH_PLUGIN_ENTRY_V1));
    ASSERT_NE(entry, nullptr);

    FakeHost fh;
    const hh_host_v1 host = make_host(fh);
    ASSERT_EQ(entry(&host), 0);
    std::vector<std::string> got;
    for (auto* t : fh.tasks) got.push_back(t->id);
    EXPECT_EQ(got, ids);
    // The library's copy of a generator writes the same bytes as the statically linked one.
    const json p = {{"length", 900}, {"num_examples", 2}};
    for (auto* t : fh.tasks) {
      const Generated a = generate(t, p, 77, adapter.abi);
      const Generated b = generate(task_by_id(t->id), p, 77, adapter.abi);
      ASSERT_EQ(a.rc, 0) << a.err;
      EXPECT_EQ(a.lines, b.lines) << t->id;
    }

    FakeHost refusing;
    refusing.refuse_all = true;
    const hh_host_v1 host2 = make_host(refusing);
    EXPECT_NE(entry(&host2), 0) << "nothing registered, so loading is refused";
    EXPECT_EQ(refusing.logs.size(), ids.size());

    FakeHost old;
    hh_host_v1 host3 = make_host(old);
    host3.abi_version = 0;
    EXPECT_NE(entry(&host3), 0);
    EXPECT_TRUE(old.tasks.empty());
  }
}

}  // namespace
