// Needle-in-a-haystack tasks in the style of RULER: "One of the special magic numbers for {key} is:
// {value}." hidden in filler, a question about the key at the end. The corrupt prompt replaces the
// asked needles' values by other values of the same token length, so the right answer changes and
// nothing else does.
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

enum class Variant { single, multikey, multivalue, multiquery };

constexpr const char* kHeader =
    "The passage below contains special magic numbers mixed in with ordinary sentences. Keep track of "
    "each number and the name it belongs to; there is a question at the end.\n";

constexpr hh_param_v1 kValueDigitsParam = sdk::int_param("value_digits", "digits of each magic number", 7, 1, 18);

struct Needle {
  std::string key, value, corrupt;  // corrupt empty: not corrupted (a distractor)
  bool asked = false;
};

std::string needle_text(const Needle& n) { return " One of the special magic numbers for " + n.key + " is:"; }

std::string question_text(Variant v, const std::vector<std::string>& keys) {
  if (v == Variant::single || v == Variant::multikey) {
    return "\nWhat is the special magic number for " + keys[0] +
           " mentioned in the provided text? The special magic number for " + keys[0] +
           " mentioned in the provided text is";
  }
  if (v == Variant::multivalue) {
    return "\nWhat are all the special magic numbers for " + keys[0] +
           " mentioned in the provided text? The special magic numbers for " + keys[0] +
           " mentioned in the provided text are";
  }
  std::string list;
  for (size_t i = 0; i < keys.size(); ++i) {
    list += (i == 0 ? "" : (i + 1 == keys.size() ? " and " : ", ")) + keys[i];
  }
  return "\nWhat are the special magic numbers for " + list +
         " mentioned in the provided text? The special magic numbers for " + list +
         " mentioned in the provided text are";
}

sdk::Example niah_example(const sdk::Context& ctx, Variant variant, const Haystack& hay, int64_t index, sdk::Rng& rng) {
  const sdk::Tokenizer& tok = ctx.tokenizer;
  const int64_t length = ctx.params.integer("length");
  const double depth = needle_depth(ctx.params, rng);
  const int digits = static_cast<int>(ctx.params.integer("value_digits"));
  const int64_t distractors =
      variant == Variant::multikey || variant == Variant::multiquery ? ctx.params.integer("distractors") : 0;
  const int64_t values = variant == Variant::multivalue ? ctx.params.integer("values") : 1;
  const int64_t queries = variant == Variant::multiquery ? ctx.params.integer("queries") : 1;

  // ---- contents: the asked needles first (needle 0 sits at `depth`), then the distractors
  std::set<std::string> keys_taken, values_taken;
  std::vector<Needle> needles;
  const std::string shared_key = draw_key(rng, keys_taken);
  for (int64_t i = 0; i < values * queries; ++i) {
    Needle n;
    n.key = variant == Variant::multiquery && i > 0 ? draw_key(rng, keys_taken) : shared_key;
    n.value = draw_number(rng, digits, values_taken);
    n.asked = true;
    needles.push_back(n);
  }
  for (int64_t i = 0; i < distractors; ++i) {
    Needle n;
    n.key = draw_key(rng, keys_taken);
    n.value = draw_number(rng, digits, values_taken);
    needles.push_back(n);
  }
  for (Needle& n : needles) {
    if (n.asked) n.corrupt = same_length_number(rng, tok, n.value, digits, values_taken);
  }

  // ---- pieces
  std::vector<Insert> inserts;
  std::vector<Span> value_spans;  // relative to each needle
  int64_t fixed = 0;
  for (const Needle& n : needles) {
    Insert in;
    in.piece.text(tok, needle_text(n));
    value_spans.push_back(in.piece.varying(tok, " " + n.value, " " + (n.asked ? n.corrupt : n.value)));
    in.piece.text(tok, ".");
    fixed += in.piece.size();
    inserts.push_back(std::move(in));
  }
  std::vector<std::string> asked_keys, answer_values, wrong_values;
  for (const Needle& n : needles) {
    if (!n.asked) continue;
    if (asked_keys.empty() || variant == Variant::multiquery) asked_keys.push_back(n.key);
    answer_values.push_back(n.value);
    wrong_values.push_back(n.corrupt);
  }
  const Answer answer =
      split_answer(tok.encode(" " + join(answer_values, ", ")), tok.encode(" " + join(wrong_values, ", ")));
  Piece head, tail;
  head.text(tok, kHeader);
  tail.text(tok, question_text(variant, asked_keys)).ids(answer.prompt_suffix);
  fixed += head.size() + tail.size();

  // ---- layout
  const Filler filler = hay.fill(filler_budget(length, fixed, "the instructions, needles and question"),
                                 static_cast<size_t>(rng.below(hay.num_sentences())));
  inserts[0].boundary = filler.boundary_at(depth);
  if (variant == Variant::multivalue) {
    // The other values follow the first in order, so the answer lists them as they appear.
    std::vector<size_t> bs;
    for (int64_t i = 1; i < values; ++i) {
      bs.push_back(inserts[0].boundary + static_cast<size_t>(rng.below(filler.num_boundaries() - inserts[0].boundary)));
    }
    std::sort(bs.begin(), bs.end());
    for (size_t i = 0; i < bs.size(); ++i) inserts[i + 1].boundary = bs[i];
  } else {
    for (size_t i = 1; i < inserts.size(); ++i)
      inserts[i].boundary = static_cast<size_t>(rng.below(filler.num_boundaries()));
  }
  const Prompt prompt = assemble(head, filler, inserts, tail);

  // ---- meta
  sdk::Json meta = base_meta(index, ctx.seed, hay.name());
  meta["depth"] = depth;
  meta["key"] = needles[0].key;
  meta["value"] = needles[0].value;
  meta["corrupt_value"] = needles[0].corrupt;
  meta["needle"] = span_json(prompt.inserts[0]);
  meta["value_spans"] = sdk::Json::array({span_json(value_spans[0].shifted(prompt.inserts[0].begin))});
  meta["needle_depth"] = prompt.insert_depth(0);
  sdk::Json list = sdk::Json::array();
  for (size_t i = 0; i < needles.size(); ++i) {
    sdk::Json n = sdk::Json::object();
    n["key"] = needles[i].key;
    n["value"] = needles[i].value;
    n["corrupt_value"] = needles[i].asked ? sdk::Json(needles[i].corrupt) : sdk::Json();
    n["asked"] = needles[i].asked;
    n["span"] = span_json(prompt.inserts[i]);
    n["value_spans"] = sdk::Json::array({span_json(value_spans[i].shifted(prompt.inserts[i].begin))});
    n["depth"] = prompt.insert_depth(i);
    list.push_back(std::move(n));
  }
  meta["needles"] = std::move(list);
  return make_example(tok, prompt, answer, meta);
}

void generate_niah(const sdk::Context& ctx, Variant variant) {
  const Haystack hay(parse_haystack_kind(ctx.params.string("haystack")), ctx.tokenizer);
  sdk::generate_examples(ctx, ctx.params.integer("num_examples"),
                         [&](int64_t i, sdk::Rng& rng) { return niah_example(ctx, variant, hay, i, rng); });
}

struct NiahSingle {
  static constexpr const char* id = "niah-single";
  static constexpr const char* description = "one needle (key -> number) in a haystack; recall its number";
  static constexpr const char* kind = "retrieval";
  static constexpr hh_param_v1 params[] = {kLengthParam, kDepthParam, kRandomDepthParam, kNumExamplesParam, kEssaysHaystackParam,
                                           kValueDigitsParam};
  static void generate(const sdk::Context& ctx) { generate_niah(ctx, Variant::single); }
};

struct NiahMultikey {
  static constexpr const char* id = "niah-multikey";
  static constexpr const char* description = "one asked needle among needles with other keys";
  static constexpr const char* kind = "retrieval";
  static constexpr hh_param_v1 params[] = {
      kLengthParam,      kDepthParam, kRandomDepthParam,
      kNumExamplesParam, kEssaysHaystackParam,
      kValueDigitsParam, sdk::int_param("distractors", "needles with other keys placed at random", 3, 1, 64)};
  static void generate(const sdk::Context& ctx) { generate_niah(ctx, Variant::multikey); }
};

struct NiahMultivalue {
  static constexpr const char* id = "niah-multivalue";
  static constexpr const char* description = "one key with several numbers; recall all of them in order";
  static constexpr const char* kind = "retrieval";
  static constexpr hh_param_v1 params[] = {
      kLengthParam,
      kDepthParam, kRandomDepthParam,
      kNumExamplesParam,
      kEssaysHaystackParam,
      kValueDigitsParam,
      sdk::int_param("values", "numbers for the key; the first at depth, the rest after it", 4, 2, 32)};
  static void generate(const sdk::Context& ctx) { generate_niah(ctx, Variant::multivalue); }
};

struct NiahMultiquery {
  static constexpr const char* id = "niah-multiquery";
  static constexpr const char* description = "several keys asked at once; recall each one's number";
  static constexpr const char* kind = "retrieval";
  static constexpr hh_param_v1 params[] = {
      kLengthParam,
      kDepthParam, kRandomDepthParam,
      kNumExamplesParam,
      kEssaysHaystackParam,
      kValueDigitsParam,
      sdk::int_param("queries", "keys asked; the first at depth, the rest at random", 4, 2, 32),
      sdk::int_param("distractors", "needles with keys that are not asked", 0, 0, 64)};
  static void generate(const sdk::Context& ctx) { generate_niah(ctx, Variant::multiquery); }
};

}  // namespace

const hh_task_v1* niah_single_task() { return sdk::task<NiahSingle>(); }
const hh_task_v1* niah_multikey_task() { return sdk::task<NiahMultikey>(); }
const hh_task_v1* niah_multivalue_task() { return sdk::task<NiahMultivalue>(); }
const hh_task_v1* niah_multiquery_task() { return sdk::task<NiahMultiquery>(); }

}  // namespace hh::builtin
