#pragma once
// HF tokenizer.json byte-level BPE as Qwen2/Qwen3 use it: NFC normalizer, the pre-tokenizer split
// regex (PCRE2, UTF mode), GPT-2 byte-to-unicode mapping, ranked merges, and added/special tokens
// matched first. encode() equals HF `encode(text, add_special_tokens=False)`. No LibTorch here.
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
  // is kept as bytes (callers print it as is).
  std::string decode(const std::vector<int64_t>& ids) const;
  int64_t vocab_size() const;        // max id + 1 over the vocabulary and added tokens
  std::string id_to_token(int64_t id) const;   // raw token string; throws when out of range
  std::optional<int64_t> token_to_id(const std::string& token) const;

 private:
  struct Impl;
  explicit Tokenizer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace hh::model
