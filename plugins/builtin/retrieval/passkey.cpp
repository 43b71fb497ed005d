// Passkey retrieval: "The pass key is {n}. Remember it. {n} is the pass key." inside filler (by
// default a few monotonous sentences repeated), asked for at the end. The corrupt prompt carries
// another key of the same token length in both places.
#include <set>
#include <string>

#include "builtin_tasks.h"
#include "common/haystack.h"
#include "common/params.h"
#include "common/prompt.h"
#include "common/values.h"

namespace hh::builtin {
namespace {

constexpr const char* kHeader =
    "A pass key is hidden somewhere in the filler text below. Find it and keep it in mind, because you "
    "will be asked for it at the end.\n";
constexpr const char* kQuestion = "\nWhat is the pass key? The pass key is";

sdk::Example passkey_example(const sdk::Context& ctx, const Haystack& hay, int64_t index, sdk::Rng& rng) {
  const sdk::Tokenizer& tok = ctx.tokenizer;
  const int64_t length = ctx.params.integer("length");
  const double depth = needle_depth(ctx.params, rng);
  const int digits = static_cast<int>(ctx.params.integer("value_digits"));

  std::set<std::string> taken;
  const std::string value = draw_number(rng, digits, taken);
  const std::string corrupt = same_length_number(rng, tok, value, digits, taken);

  Insert needle;
  needle.piece.text(tok, " The pass key is");
  const Span first = needle.piece.varying(tok, " " + value, " " + corrupt);
  needle.piece.text(tok, ". Remember it.");
  const Span second = needle.piece.varying(tok, " " + value, " " + corrupt);
  needle.piece.text(tok, " is the pass key.");

  const Answer answer = split_answer(tok.encode(" " + value), tok.encode(" " + corrupt));
  Piece head, tail;
  head.text(tok, kHeader);
  tail.text(tok, kQuestion).ids(answer.prompt_suffix);

  const int64_t fixed = head.size() + needle.piece.size() + tail.size();
  const Filler filler = hay.fill(filler_budget(length, fixed, "the instructions, pass key and question"),
                                 static_cast<size_t>(rng.below(hay.num_sentences())));
  needle.boundary = filler.boundary_at(depth);
  const Prompt prompt = assemble(head, filler, {needle}, tail);

  const Span at = prompt.inserts[0];
  sdk::Json meta = base_meta(index, ctx.seed, hay.name());
  meta["depth"] = depth;
  meta["key"] = "pass key";
  meta["value"] = value;
  meta["corrupt_value"] = corrupt;
  meta["needle"] = span_json(at);
  meta["value_spans"] = sdk::Json::array({span_json(first.shifted(at.begin)), span_json(second.shifted(at.begin))});
  meta["needle_depth"] = prompt.insert_depth(0);
  sdk::Json n = sdk::Json::object();
  n["key"] = "pass key";
  n["value"] = value;
  n["corrupt_value"] = corrupt;
  n["asked"] = true;
  n["span"] = meta["needle"];
  n["value_spans"] = meta["value_spans"];
  n["depth"] = meta["needle_depth"];
  meta["needles"] = sdk::Json::array({n});
  return make_example(tok, prompt, answer, meta);
}

struct Passkey {
  static constexpr const char* id = "passkey";
  static constexpr const char* description = "a pass key stated twice inside filler; recall it";
  static constexpr const char* kind = "retrieval";
  static constexpr hh_param_v1 params[] = {kLengthParam, kDepthParam, kRandomDepthParam, kNumExamplesParam, kNoiseHaystackParam,
                                           sdk::int_param("value_digits", "digits of the pass key", 5, 1, 18)};
  static void generate(const sdk::Context& ctx) {
    const Haystack hay(parse_haystack_kind(ctx.params.string("haystack")), ctx.tokenizer);
    sdk::generate_examples(ctx, ctx.params.integer("num_examples"),
                           [&](int64_t i, sdk::Rng& rng) { return passkey_example(ctx, hay, i, rng); });
  }
};

}  // namespace

const hh_task_v1* passkey_task() { return sdk::task<Passkey>(); }

std::vector<const hh_task_v1*> retrieval_tasks() {
  return {niah_single_task(), niah_multikey_task(), niah_multivalue_task(), niah_multiquery_task(), passkey_task()};
}

}  // namespace hh::builtin
