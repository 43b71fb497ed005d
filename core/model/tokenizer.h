#pragma once
// HF tokenizer.json byte-level BPE as Qwen2/Qwen3 use it: NFC normalizer, the pre-tokenizer split
// regex (PCRE2, UTF mode), GPT-2 byte-to-unicode mapping, ranked merges, and added/special tokens
// matched first. encode() equals HF `encode(text, add_special_tokens=False)`. No LibTorch here.
//
// Supported tokenizer.json subset (anything else is rejected at load with an hh::Error naming the
// field): normalizer null | NFC | Sequence of those; pre_tokenizer Split (Regex or String pattern,
// any behavior, invert) and ByteLevel (must come last), alone or in a Sequence; model BPE with merges
// as "a b" strings or [a, b] pairs, unk_token, ignore_merges; decoder null | ByteLevel.
// Added tokens honour single_word, lstrip, rstrip and normalized as HF's AddedVocabulary does.
//
// Input that is not valid UTF-8 is read with each maximal invalid subsequence replaced by U+FFFD
// (as Python's `errors="replace"` and JS TextDecoder do); HF itself only accepts valid strings.
// A Tokenizer is immutable after load; encode/decode may be called from several threads at once.
#include <cstdint>
#include <filesystem>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace hh::model {

class Tokenizer {
 public:
  static Tokenizer load(const std::filesystem::path& tokenizer_json);  // throws hh::Error naming file
  static Tokenizer from_json_text(const std::string& text, const std::string& where);
  Tokenizer(Tokenizer&&) noexcept;
  Tokenizer& operator=(Tokenizer&&) noexcept;
  ~Tokenizer();

  std::vector<int64_t> encode(std::string_view text) const;
  // Ids out of range throw hh::Error naming the id. Invalid UTF-8 produced by partial byte tokens
  // is kept as bytes (callers print it as is). Added tokens decode to their content.
  std::string decode(const std::vector<int64_t>& ids) const;
  int64_t vocab_size() const;        // max id + 1 over the vocabulary and added tokens
  std::string id_to_token(int64_t id) const;   // raw token string; throws when out of range
  std::optional<int64_t> token_to_id(const std::string& token) const;

 private:
  struct Impl;
  explicit Tokenizer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// Unicode NFC (canonical decomposition, canonical ordering, canonical composition incl. Hangul),
// the normalizer the tokenizer applies. Tables: core/model/unicode_tables.inc. Invalid UTF-8 is
// replaced by U+FFFD first.
std::string normalize_nfc(std::string_view text);

}  // namespace hh::model
