#pragma once
// Random needle contents: numbers, keys, variable names, and corrupt values that keep token lengths.
#include <cstdint>
#include <optional>
#include <set>
#include <string>
#include <unordered_map>
#include <vector>

#include "hydrahead/task_sdk.hpp"

namespace hh::builtin {

// Draws before a generator gives up on a constraint (a same-length value, a distinct key).
inline constexpr int kMaxDraws = 2000;

// A `digits`-digit number (first digit non-zero) not in `taken`; adds it to `taken`.
std::string draw_number(sdk::Rng& rng, int digits, std::set<std::string>& taken);

// A `digits`-digit number that tokenises, as " <number>", to as many tokens as " <value>" does,
// starts with a different digit (so the first differing answer token is a digit, not formatting) and
// is not in `taken`; adds it to `taken`. nullopt after kMaxDraws draws.
std::optional<std::string> try_same_length_number(sdk::Rng& rng, const sdk::Tokenizer& tok, const std::string& value,
                                                  int digits, std::set<std::string>& taken);
// The same, throwing a clear error instead of nullopt.
std::string same_length_number(sdk::Rng& rng, const sdk::Tokenizer& tok, const std::string& value, int digits,
                               std::set<std::string>& taken);

// "adjective-noun" key such as "misty-harbor", not in `taken`; adds it.
std::string draw_key(sdk::Rng& rng, std::set<std::string>& taken);

// Five upper-case letters not in `taken` and not starting with `avoid_first` (0: no restriction).
std::string draw_name(sdk::Rng& rng, std::set<std::string>& taken, char avoid_first = 0);

// Tokens that decode to a plain word piece (optional leading space, then ASCII letters) and encode
// back to exactly themselves: safe material for random token spans (no special, byte or control
// tokens). Ids are drawn uniformly from the vocabulary and tested lazily.
class WordTokens {
 public:
  explicit WordTokens(const sdk::Tokenizer& tok) : tok_(tok) {}
  bool eligible(int64_t id);
  // A token not in `taken`; adds it. Throws when the vocabulary has too few such tokens.
  int64_t draw(sdk::Rng& rng, std::set<int64_t>& taken);

 private:
  const sdk::Tokenizer& tok_;
  std::unordered_map<int64_t, bool> cache_;  // looked up only, never iterated
};

std::string join(const std::vector<std::string>& parts, const std::string& sep);

}  // namespace hh::builtin
