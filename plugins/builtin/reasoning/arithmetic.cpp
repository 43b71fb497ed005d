// Multi-step arithmetic: a short word problem of additions and subtractions after the filler; the
// answer is the final count. The corrupt prompt changes one operand (same token length), which changes
// the result to another number with a different first digit.
#include <optional>
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

const char* const kContainers[] = {"jar", "box", "basket", "crate", "bag", "tin"};
const char* const kItems[] = {"marbles", "buttons", "shells", "stamps", "beads", "coins"};

// Running total after each step; nullopt when it would go below zero.
std::optional<int64_t> evaluate(const std::vector<int64_t>& operands, const std::vector<char>& ops) {
  int64_t total = operands[0];
  for (size_t i = 0; i < ops.size(); ++i) {
    total += ops[i] == '+' ? operands[i + 1] : -operands[i + 1];
    if (total < 0) return std::nullopt;
  }
  return total;
}

// The answers must differ from their first digit on, so that the first answer tokens differ; their
// lengths may differ (a result near a power of ten cannot always keep its digit count).
bool differs_at_first_digit(const std::string& a, const std::string& b) { return a[0] != b[0]; }

sdk::Example arithmetic_example(const sdk::Context& ctx, const Haystack& hay, int64_t index, sdk::Rng& rng) {
  const sdk::Tokenizer& tok = ctx.tokenizer;
  const int64_t length = ctx.params.integer("length");
  const int64_t steps = ctx.params.integer("steps");
  const int digits = static_cast<int>(ctx.params.integer("digits"));
  const std::string container = rng.pick(kContainers), items = rng.pick(kItems);

  // A problem, then one operand changed so that the result changes its first digit. Some problems
  // have no such change (e.g. a small total that every same-length operand keeps below ten); those
  // are drawn again.
  std::vector<int64_t> operands;
  std::vector<char> ops;
  std::string result;
  size_t which = 0;
  std::string corrupt_operand, corrupt_result;
  for (int problem = 0; problem < 64 && corrupt_result.empty(); ++problem) {
    std::set<std::string> taken;
    operands = {std::stoll(draw_number(rng, digits, taken))};
    ops.clear();
    int64_t total = operands[0];
    for (int64_t s = 0; s < steps; ++s) {
      // Numbers may repeat across steps, so draw from a fresh set each time.
      std::set<std::string> any;
      const int64_t n = std::stoll(draw_number(rng, digits, any));
      const char op = rng.below(2) == 0 || n > total ? '+' : '-';
      total += op == '+' ? n : -n;
      operands.push_back(n);
      ops.push_back(op);
    }
    result = std::to_string(total);
    for (int attempt = 0; attempt < kMaxDraws && corrupt_result.empty(); ++attempt) {
      which = static_cast<size_t>(rng.below(operands.size()));
      std::set<std::string> seen{std::to_string(operands[which])};
      auto candidate = try_same_length_number(rng, tok, std::to_string(operands[which]), digits, seen);
      if (!candidate) continue;
      std::vector<int64_t> changed = operands;
      changed[which] = std::stoll(*candidate);
      const auto r = evaluate(changed, ops);
      if (!r || !differs_at_first_digit(result, std::to_string(*r))) continue;
      corrupt_operand = *candidate;
      corrupt_result = std::to_string(*r);
    }
  }
  if (corrupt_result.empty()) {
    throw sdk::Error(
        "could not change an operand so that the result changes its first digit; "
        "use more digits");
  }

  Piece tail;
  std::vector<Span> operand_spans;
  auto number = [&](size_t i) {
    const std::string clean = std::to_string(operands[i]);
    operand_spans.push_back(tail.varying(tok, " " + clean, " " + (i == which ? corrupt_operand : clean)));
  };
  tail.text(tok, "\nQuestion: A " + container + " holds");
  number(0);
  tail.text(tok, " " + items + ".");
  for (size_t s = 0; s < ops.size(); ++s) {
    tail.text(tok, " Then");
    number(s + 1);
    tail.text(tok, ops[s] == '+' ? " more are put in." : " are taken out.");
  }
  tail.text(tok, " How many " + items + " are in the " + container + " now? Answer: The " + container + " now holds");
  const Answer answer = split_answer(tok.encode(" " + result), tok.encode(" " + corrupt_result));
  tail.ids(answer.prompt_suffix);

  const Piece head;
  const Filler filler = hay.fill(filler_budget(length, tail.size(), "the problem and question"),
                                 static_cast<size_t>(rng.below(hay.num_sentences())));
  const Prompt prompt = assemble(head, filler, {}, tail);

  const int64_t tail_at = prompt.length() - prompt.tail_tokens;
  sdk::Json meta = base_meta(index, ctx.seed, hay.name());
  meta["operands"] = operands;
  meta["ops"] = sdk::Json::array();
  for (char op : ops) meta["ops"].push_back(std::string(1, op));
  meta["result"] = result;
  meta["corrupt_index"] = static_cast<int64_t>(which);
  meta["corrupt_operand"] = corrupt_operand;
  meta["corrupt_result"] = corrupt_result;
  meta["problem"] = span_json({tail_at, prompt.length()});
  sdk::Json spans = sdk::Json::array();
  for (Span s : operand_spans) spans.push_back(span_json(s.shifted(tail_at)));
  meta["operand_spans"] = std::move(spans);
  return make_example(tok, prompt, answer, meta);
}

struct Arithmetic {
  static constexpr const char* id = "arithmetic";
  static constexpr const char* description = "a word problem of several additions and subtractions; give the result";
  static constexpr const char* kind = "reasoning";
  static constexpr hh_param_v1 params[] = {
      kLengthParam, kNumExamplesParam, kEssaysHaystackParam,
      sdk::int_param("steps", "additions or subtractions after the start", 3, 1, 16),
      sdk::int_param("digits", "digits of each operand", 2, 1, 6)};
  static void generate(const sdk::Context& ctx) {
    const Haystack hay(parse_haystack_kind(ctx.params.string("haystack")), ctx.tokenizer);
    sdk::generate_examples(ctx, ctx.params.integer("num_examples"),
                           [&](int64_t i, sdk::Rng& rng) { return arithmetic_example(ctx, hay, i, rng); });
  }
};

}  // namespace

const hh_task_v1* arithmetic_task() { return sdk::task<Arithmetic>(); }

std::vector<const hh_task_v1*> reasoning_tasks() {
  return {variable_tracking_task(), induction_task(), arithmetic_task()};
}

}  // namespace hh::builtin
