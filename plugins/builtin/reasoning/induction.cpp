// Induction: a span of random word-piece tokens appears once inside filler; the prompt ends with the
// span's prefix again, and the answer is what followed that prefix the first time. Built on token ids
// directly. The corrupt prompt has other tokens after the first occurrence's prefix, so copying now
// gives a different continuation.
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

sdk::Example induction_example(const sdk::Context& ctx, const Haystack& hay, WordTokens& words, int64_t index,
                               sdk::Rng& rng) {
  const sdk::Tokenizer& tok = ctx.tokenizer;
  const int64_t length = ctx.params.integer("length");
  const double depth = ctx.params.number("depth");
  const int64_t span_tokens = ctx.params.integer("span_tokens");
  const int64_t answer_tokens = ctx.params.integer("answer_tokens");

  // All distinct, so the prefix's last token points at one continuation only.
  std::set<int64_t> taken;
  std::vector<int64_t> prefix, answer_ids, wrong_ids;
  for (int64_t i = 0; i < span_tokens; ++i) prefix.push_back(words.draw(rng, taken));
  for (int64_t i = 0; i < answer_tokens; ++i) answer_ids.push_back(words.draw(rng, taken));
  for (int64_t i = 0; i < answer_tokens; ++i) wrong_ids.push_back(words.draw(rng, taken));

  Insert first;
  first.piece.ids(prefix);
  const Span continuation = first.piece.varying_ids(answer_ids, wrong_ids);
  const Answer answer = split_answer(answer_ids, wrong_ids);
  Piece head, tail;
  tail.ids(prefix).ids(answer.prompt_suffix);

  const int64_t fixed = first.piece.size() + tail.size();
  const Filler filler = hay.fill(filler_budget(length, fixed, "the span and its repeated prefix"),
                                 static_cast<size_t>(rng.below(hay.num_sentences())));
  first.boundary = filler.boundary_at(depth);
  const Prompt prompt = assemble(head, filler, {first}, tail);

  const Span at = prompt.inserts[0];
  sdk::Json meta = base_meta(index, ctx.seed, hay.name());
  meta["depth"] = depth;
  meta["needle"] = span_json(at);
  meta["continuation"] = span_json(continuation.shifted(at.begin));
  meta["repeat"] = span_json({prompt.length() - prompt.tail_tokens, prompt.length()});
  meta["needle_depth"] = prompt.insert_depth(0);
  meta["prefix_text"] = tok.decode(prefix);
  return make_example(tok, prompt, answer, meta);
}

struct Induction {
  static constexpr const char* id = "induction";
  static constexpr const char* description = "copy what followed a repeated span of random tokens";
  static constexpr const char* kind = "reasoning";
  static constexpr hh_param_v1 params[] = {
      kLengthParam,
      sdk::float_param("depth", "where the first occurrence sits in the filler: 0 = start, 1 = end", 0.5, 0.0, 1.0),
      kNumExamplesParam,
      kEssaysHaystackParam,
      sdk::int_param("span_tokens", "tokens of the prefix that is repeated at the end", 16, 2, 512),
      sdk::int_param("answer_tokens", "tokens of the continuation to recall", 4, 1, 64)};
  static void generate(const sdk::Context& ctx) {
    const Haystack hay(parse_haystack_kind(ctx.params.string("haystack")), ctx.tokenizer);
    WordTokens words(ctx.tokenizer);
    sdk::generate_examples(ctx, ctx.params.integer("num_examples"),
                           [&](int64_t i, sdk::Rng& rng) { return induction_example(ctx, hay, words, i, rng); });
  }
};

}  // namespace

const hh_task_v1* induction_task() { return sdk::task<Induction>(); }

}  // namespace hh::builtin
