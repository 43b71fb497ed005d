#pragma once
// Haystack text (datasets/haystack, embedded at build time) and exact-length filler built from it in
// the model's own tokens.
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "hydrahead/task_sdk.hpp"

namespace hh::builtin {

enum class HaystackKind { essays, noise };

// Choices of the `haystack` parameter, NULL-terminated as hh_param_v1 wants.
inline constexpr const char* kHaystackChoices[] = {"essays", "noise", nullptr};

HaystackKind parse_haystack_kind(const std::string& name);  // throws sdk::Error for anything else
const char* haystack_name(HaystackKind kind);

// Sentences of `text` in order: whitespace runs (line breaks included) collapse to one space, and a
// sentence ends at '.', '?' or '!' (plus any closing quotes or brackets) followed by whitespace or
// the end. Empty pieces are dropped.
std::vector<std::string> split_sentences(std::string_view text);

// The embedded haystack's sentences (essays in file-name order, or the noise sentences).
const std::vector<std::string>& haystack_sentences(HaystackKind kind);

// Filler of an exact token count, as units that needles may be placed between.
struct Filler {
  std::vector<std::vector<int64_t>> units;  // whole sentences; the first may be the tail of one
  std::vector<int64_t> offsets;             // [units + 1] tokens before each boundary

  int64_t tokens() const { return offsets.back(); }
  size_t num_boundaries() const { return offsets.size(); }
  // The boundary whose offset is closest to depth * tokens() (the earlier one on a tie); depth 0 is
  // boundary 0 (before all filler), depth 1 the last boundary (after all of it).
  size_t boundary_at(double depth) const;
};

// The haystack's sentences tokenised by the model's tokenizer, each with a leading space so that
// consecutive sentences read as continuous prose and tokenise as they would in running text (the
// byte-level BPE pre-tokenisers split before a space).
class Haystack {
 public:
  Haystack(HaystackKind kind, const sdk::Tokenizer& tok);

  HaystackKind kind() const { return kind_; }
  const char* name() const { return haystack_name(kind_); }
  size_t num_sentences() const { return sentences_.size(); }

  // Exactly `budget` tokens of consecutive text that end with the whole sentence `last`, cycling
  // through the haystack backwards as often as needed. When whole sentences do not add up to the
  // budget, the first unit is the tail (last tokens) of the sentence before them, so the filler
  // reads like an excerpt that starts mid-sentence and always ends at a sentence boundary.
  Filler fill(int64_t budget, size_t last) const;

 private:
  HaystackKind kind_;
  std::vector<std::vector<int64_t>> sentences_;
};

}  // namespace hh::builtin
