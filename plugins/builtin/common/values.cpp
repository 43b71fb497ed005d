#include "common/values.h"

namespace hh::builtin {
namespace {
const char* const kAdjectives[] = {
    "amber",  "brisk",  "calm",  "dusty", "eager", "faint",  "gentle", "hollow", "icy",    "jolly", "keen",   "lively",
    "mellow", "narrow", "odd",   "pale",  "quiet", "rapid",  "rusty",  "silent", "tidy",   "vivid", "wary",   "young",
    "bold",   "crisp",  "damp",  "early", "fancy", "grand",  "hazy",   "humble", "lofty",  "lucky", "misty",  "noble",
    "plain",  "proud",  "rough", "sandy", "shiny", "sleepy", "sturdy", "sunny",  "tender", "windy", "woolen", "golden"};
const char* const kNouns[] = {"anchor",  "badger", "beacon", "bridge",  "candle", "canyon",  "cedar",  "comet",
                              "falcon",  "ferry",  "garden", "glacier", "harbor", "hedge",   "island", "kettle",
                              "lantern", "meadow", "mirror", "orchard", "otter",  "pebble",  "pepper", "pillow",
                              "quarry",  "raven",  "ribbon", "saddle",  "signal", "spruce",  "teapot", "thimble",
                              "timber",  "tulip",  "valley", "violin",  "walnut", "willow",  "window", "harvest",
                              "pigeon",  "marble", "canoe",  "button",  "ladder", "compass", "maple",  "river"};

bool word_like(const std::string& s) {
  size_t i = s.size() > 0 && s[0] == ' ' ? 1 : 0;
  if (i == s.size()) return false;
  for (; i < s.size(); ++i) {
    const char c = s[i];
    if (!((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z'))) return false;
  }
  return true;
}
}  // namespace

std::string draw_number(sdk::Rng& rng, int digits, std::set<std::string>& taken) {
  for (int i = 0; i < kMaxDraws; ++i) {
    std::string v = rng.digits(static_cast<size_t>(digits));
    if (taken.insert(v).second) return v;
  }
  throw sdk::Error("could not draw another distinct " + std::to_string(digits) +
                   "-digit number; use more digits or fewer needles");
}

std::optional<std::string> try_same_length_number(sdk::Rng& rng, const sdk::Tokenizer& tok, const std::string& value,
                                                  int digits, std::set<std::string>& taken) {
  const size_t want = tok.encode(" " + value).size();
  for (int i = 0; i < kMaxDraws; ++i) {
    std::string v = rng.digits(static_cast<size_t>(digits));
    if (v[0] == value[0] || taken.count(v)) continue;
    if (tok.encode(" " + v).size() != want) continue;
    taken.insert(v);
    return v;
  }
  return std::nullopt;
}

std::string same_length_number(sdk::Rng& rng, const sdk::Tokenizer& tok, const std::string& value, int digits,
                               std::set<std::string>& taken) {
  auto v = try_same_length_number(rng, tok, value, digits, taken);
  if (!v) {
    throw sdk::Error("could not find a corrupt value for " + value + " with the same token length (" +
                     std::to_string(tok.encode(" " + value).size()) + " tokens) and a different first digit in " +
                     std::to_string(kMaxDraws) + " draws");
  }
  return *v;
}

std::string draw_key(sdk::Rng& rng, std::set<std::string>& taken) {
  for (int i = 0; i < kMaxDraws; ++i) {
    std::string k = std::string(rng.pick(kAdjectives)) + "-" + rng.pick(kNouns);
    if (taken.insert(k).second) return k;
  }
  throw sdk::Error("could not draw another distinct key; use fewer needles");
}

std::string draw_name(sdk::Rng& rng, std::set<std::string>& taken, char avoid_first) {
  constexpr size_t kNameLetters = 5;
  for (int i = 0; i < kMaxDraws; ++i) {
    std::string n;
    for (size_t j = 0; j < kNameLetters; ++j) n += static_cast<char>('A' + rng.below(26));
    if (n[0] == avoid_first) continue;
    if (taken.insert(n).second) return n;
  }
  throw sdk::Error("could not draw another distinct variable name");
}

bool WordTokens::eligible(int64_t id) {
  auto it = cache_.find(id);
  if (it != cache_.end()) return it->second;
  bool ok = false;
  if (auto text = tok_.try_decode(&id, 1); text && word_like(*text)) {
    const std::vector<int64_t> back = tok_.encode(*text);
    ok = back.size() == 1 && back[0] == id;
  }
  cache_.emplace(id, ok);
  return ok;
}

int64_t WordTokens::draw(sdk::Rng& rng, std::set<int64_t>& taken) {
  constexpr int kMaxTokenDraws = 200000;  // vocabularies are mostly word pieces; this is generous
  const int64_t vocab = tok_.vocab_size();
  if (vocab <= 0) throw sdk::Error("the tokenizer reports no vocabulary size");
  for (int i = 0; i < kMaxTokenDraws; ++i) {
    const int64_t id = static_cast<int64_t>(rng.below(static_cast<uint64_t>(vocab)));
    if (taken.count(id) || !eligible(id)) continue;
    taken.insert(id);
    return id;
  }
  throw sdk::Error("the vocabulary has too few distinct word-like tokens: found " + std::to_string(taken.size()) +
                   ", the span needs more (span_tokens + 2 x answer_tokens)");
}

std::string join(const std::vector<std::string>& parts, const std::string& sep) {
  std::string out;
  for (size_t i = 0; i < parts.size(); ++i) out += (i ? sep : "") + parts[i];
  return out;
}

}  // namespace hh::builtin
