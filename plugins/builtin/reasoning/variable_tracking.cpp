// Variable tracking (RULER's multi-hop tracing): chains "VAR A = 12345." "VAR B = VAR A." ... spread
// through filler; the question asks which variables end up holding a value. The corrupt prompt swaps
// the root values of the asked chain and one distractor chain (values of the same token length), so
// the same question now has the distractor chain's names as its answer.
#include <algorithm>
#include <set>
#include <string>
#include <vector>

#include "builtin_tasks.h"
#include "common/haystack.h"
#include "common/params.h"
#include "common/prompt.h"
#include "common/values.h"

namespace hh::builtin {
namespace {

constexpr const char* kHeader =
    "Keep track of the variable assignments in the text below. Some variables are given numbers and "
    "others copy another variable. A question about them follows the text.\n";

struct Chain {
  std::vector<std::string> names;
  std::string value, corrupt;  // root value in the clean and the corrupt prompt
};

std::string question_text(const std::string& value, int64_t hops) {
  const std::string count = std::to_string(hops) + (hops == 1 ? " variable holds" : " variables hold");
  return "\nQuestion: Which variables in the text above end up holding the value " + value +
         "? Answer: Following the assignments in the text above, " + count + " the value " + value + ". They are:";
}

sdk::Example vt_example(const sdk::Context& ctx, const Haystack& hay, int64_t index, sdk::Rng& rng) {
  const sdk::Tokenizer& tok = ctx.tokenizer;
  const int64_t length = ctx.params.integer("length");
  const int64_t hops = ctx.params.integer("hops");
  const int64_t distractors = ctx.params.integer("distractors");
  const int digits = static_cast<int>(ctx.params.integer("value_digits"));

  // Chain 0 is asked about; chain 1 trades root values with it in the corrupt prompt.
  std::set<std::string> names_taken, values_taken;
  std::vector<Chain> chains(static_cast<size_t>(1 + distractors));
  for (size_t c = 0; c < chains.size(); ++c) {
    for (int64_t h = 0; h < hops; ++h) {
      const char avoid = c == 1 && h == 0 ? chains[0].names[0][0] : 0;  // answers differ in their first letter
      chains[c].names.push_back(draw_name(rng, names_taken, avoid));
    }
  }
  chains[0].value = draw_number(rng, digits, values_taken);
  chains[1].value = same_length_number(rng, tok, chains[0].value, digits, values_taken);
  chains[0].corrupt = chains[1].value;
  chains[1].corrupt = chains[0].value;
  for (size_t c = 2; c < chains.size(); ++c)
    chains[c].corrupt = chains[c].value = draw_number(rng, digits, values_taken);

  // One insert per statement, chain by chain.
  std::vector<Insert> inserts;
  std::vector<Span> root_values;  // relative to each chain's first statement
  int64_t fixed = 0;
  for (const Chain& ch : chains) {
    for (int64_t h = 0; h < hops; ++h) {
      Insert in;
      in.piece.text(tok, " VAR " + ch.names[static_cast<size_t>(h)] + " =");
      if (h == 0) {
        root_values.push_back(in.piece.varying(tok, " " + ch.value, " " + ch.corrupt));
      } else {
        in.piece.text(tok, " VAR " + ch.names[static_cast<size_t>(h - 1)]);
      }
      in.piece.text(tok, ".");
      fixed += in.piece.size();
      inserts.push_back(std::move(in));
    }
  }
  const Answer answer =
      split_answer(tok.encode(" " + join(chains[0].names, " ")), tok.encode(" " + join(chains[1].names, " ")));
  Piece head, tail;
  head.text(tok, kHeader);
  tail.text(tok, question_text(chains[0].value, hops)).ids(answer.prompt_suffix);
  fixed += head.size() + tail.size();

  const Filler filler = hay.fill(filler_budget(length, fixed, "the instructions, assignments and question"),
                                 static_cast<size_t>(rng.below(hay.num_sentences())));
  // Each chain's statements at sorted random boundaries, so every variable is assigned before use.
  for (size_t c = 0; c < chains.size(); ++c) {
    std::vector<size_t> bs;
    for (int64_t h = 0; h < hops; ++h) bs.push_back(static_cast<size_t>(rng.below(filler.num_boundaries())));
    std::sort(bs.begin(), bs.end());
    for (size_t h = 0; h < bs.size(); ++h) inserts[c * static_cast<size_t>(hops) + h].boundary = bs[h];
  }
  const Prompt prompt = assemble(head, filler, inserts, tail);

  sdk::Json meta = base_meta(index, ctx.seed, hay.name());
  meta["value"] = chains[0].value;
  meta["corrupt_value"] = chains[1].value;  // the asked chain's root in the corrupt prompt
  sdk::Json list = sdk::Json::array();
  for (size_t c = 0; c < chains.size(); ++c) {
    sdk::Json j = sdk::Json::object();
    j["names"] = chains[c].names;
    j["value"] = chains[c].value;
    j["corrupt_value"] = chains[c].corrupt;
    sdk::Json statements = sdk::Json::array();
    for (int64_t h = 0; h < hops; ++h) {
      statements.push_back(span_json(prompt.inserts[c * static_cast<size_t>(hops) + static_cast<size_t>(h)]));
    }
    j["statements"] = std::move(statements);
    j["value_span"] = span_json(root_values[c].shifted(prompt.inserts[c * static_cast<size_t>(hops)].begin));
    list.push_back(std::move(j));
  }
  meta["chains"] = std::move(list);
  return make_example(tok, prompt, answer, meta);
}

struct VariableTracking {
  static constexpr const char* id = "variable-tracking";
  static constexpr const char* description = "follow chains of variable assignments to the variables holding a value";
  static constexpr const char* kind = "reasoning";
  static constexpr hh_param_v1 params[] = {
      kLengthParam,
      kNumExamplesParam,
      kNoiseHaystackParam,
      sdk::int_param("hops", "variables in each chain (the answer's length)", 4, 1, 32),
      sdk::int_param("distractors", "chains besides the asked one (one of them swaps values with it)", 1, 1, 32),
      sdk::int_param("value_digits", "digits of each chain's value", 5, 1, 18)};
  static void generate(const sdk::Context& ctx) {
    const Haystack hay(parse_haystack_kind(ctx.params.string("haystack")), ctx.tokenizer);
    sdk::generate_examples(ctx, ctx.params.integer("num_examples"),
                           [&](int64_t i, sdk::Rng& rng) { return vt_example(ctx, hay, i, rng); });
  }
};

}  // namespace

const hh_task_v1* variable_tracking_task() { return sdk::task<VariableTracking>(); }

}  // namespace hh::builtin
