#pragma once
// Perplexity of a token stream: the stream is cut into windows of `seq` tokens (the last one may be
// shorter) and each window is scored by teacher forcing; ppl = exp(total NLL / predicted tokens).
#include <cstdint>
#include <filesystem>
#include <functional>
#include <vector>

#include "core/util/compat.h"

namespace hh::model {
class Tokenizer;
}

namespace hh::eval {

// Logits [1, T, V] of one window of token ids [1, T].
using LogitsFn = std::function<at::Tensor(const at::Tensor& ids)>;

struct PerplexityResult {
  double nll = 0;        // mean negative log-likelihood per predicted token (nats)
  double ppl = 0;        // exp(nll)
  int64_t tokens = 0;    // predicted tokens (each window predicts all but its first)
  int64_t windows = 0;
};

PerplexityResult perplexity(const LogitsFn& logits, const std::vector<int64_t>& stream, int64_t seq);

// A token stream from a file: `.bin` = uint32 little-endian ids; `.jsonl` = one object a line with a
// "text" field, each tokenised and the texts concatenated. Errors name the file (and line).
std::vector<int64_t> read_token_stream(const std::filesystem::path& path, const model::Tokenizer* tok, int64_t vocab_size);

}  // namespace hh::eval
