#pragma once
// Clean/corrupt prompt pairs built on token ids: pieces are tokenised separately and concatenated,
// so every length is exact and every span (needle, value) is known by construction. The text shown
// to users is the decoded ids.
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "common/haystack.h"
#include "hydrahead/task_sdk.hpp"

namespace hh::builtin {

struct Span {
  int64_t begin = 0, end = 0;  // [begin, end) token positions
  int64_t size() const { return end - begin; }
  Span shifted(int64_t by) const { return {begin + by, end + by}; }
};
sdk::Json span_json(Span s);  // [begin, end]

// One piece of the prompt in both versions. The clean and corrupt ids always have the same length;
// diff() lists the places where they may differ.
class Piece {
 public:
  // Text that is the same in both prompts.
  Piece& text(const sdk::Tokenizer& tok, std::string_view s);
  Piece& ids(const std::vector<int64_t>& same);
  // Text that may differ; both versions must tokenise to the same number of tokens. Returns its span
  // relative to the start of the piece, which diff() lists when the ids differ.
  Span varying(const sdk::Tokenizer& tok, std::string_view clean, std::string_view corrupt);
  Span varying_ids(const std::vector<int64_t>& clean, const std::vector<int64_t>& corrupt);

  const std::vector<int64_t>& clean() const { return clean_; }
  const std::vector<int64_t>& corrupt() const { return corrupt_; }
  const std::vector<Span>& diff() const { return diff_; }
  int64_t size() const { return static_cast<int64_t>(clean_.size()); }

 private:
  std::vector<int64_t> clean_, corrupt_;
  std::vector<Span> diff_;
};

// A piece placed in the filler at a boundary (see Filler::boundary_at).
struct Insert {
  Piece piece;
  size_t boundary = 0;
};

struct Prompt {
  std::vector<int64_t> clean, corrupt;
  std::vector<Span> inserts;            // absolute span of each insert, in the order given
  std::vector<int64_t> insert_offsets;  // filler tokens before each insert
  std::vector<Span> diff;               // absolute spans where clean and corrupt may differ
  int64_t head_tokens = 0, tail_tokens = 0, filler_tokens = 0;

  int64_t length() const { return static_cast<int64_t>(clean.size()); }
  // Filler tokens before insert i over all filler tokens: where the insert sits, 0 (start) to 1 (end).
  double insert_depth(size_t i) const;
};

// head ++ filler (with the inserts at their boundaries; inserts at the same boundary keep their
// order) ++ tail.
Prompt assemble(const Piece& head, const Filler& filler, const std::vector<Insert>& inserts, const Piece& tail);

// Filler tokens left for a prompt of `length` once `fixed_tokens` (instructions, needles, question)
// are in; throws a clear error when the length cannot hold them.
int64_t filler_budget(int64_t length, int64_t fixed_tokens, std::string_view what);

// What the model is scored on. When the clean and the wrong answer start with the same tokens (Qwen
// tokenises " 7234981" as a lone space token and then digits), those tokens move to the end of the
// prompt: prompt ++ answer is unchanged, and answer[0] != wrong[0], which logit-diff needs.
struct Answer {
  std::vector<int64_t> prompt_suffix;  // appended to both prompts
  std::vector<int64_t> answer, wrong;
};
Answer split_answer(const std::vector<int64_t>& answer, const std::vector<int64_t>& wrong);

// The example from an assembled prompt: ids, decoded texts, and the meta every task records
// (length, header/question token counts, answer prefix, diff spans) followed by `meta`.
sdk::Example make_example(const sdk::Tokenizer& tok, const Prompt& prompt, const Answer& answer, const sdk::Json& meta);

// Meta fields every example starts with.
sdk::Json base_meta(int64_t index, uint64_t seed, const char* haystack);

}  // namespace hh::builtin
