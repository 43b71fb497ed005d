#pragma once
// Perplexity of a token stream: the stream is cut into windows of `seq` tokens (the last one may be
// shorter) and each window is scored by teacher forcing; ppl = exp(total NLL / predicted tokens).
#include <atomic>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <vector>

#include "core/util/compat.h"

namespace hh::model {
class Tokenizer;
}

namespace hh::eval {

// A language model as two steps, so that a long window's logits need never exist whole: `hidden`, the
// residual stream after the last layer [1, T, d] of a window of token ids [1, T]; `logits`, the final norm
// and lm_head of some of its rows [1, n, d] -> [1, n, V].
struct LanguageModel {
  std::function<at::Tensor(const at::Tensor& ids)> hidden;
  std::function<at::Tensor(const at::Tensor& rows)> logits;
};

struct PerplexityResult {
  double nll = 0;        // mean negative log-likelihood per predicted token (nats)
  double ppl = 0;        // exp(nll)
  int64_t tokens = 0;    // predicted tokens (each window predicts all but its first)
  int64_t windows = 0;
};

// Each window's positions are projected to the vocabulary `chunk` at a time (their log-softmax in
// float64), so a window of 32K tokens of a 152K vocabulary holds [chunk, V], not [32K, V], at once.
// `progress` (may be empty) hears each window done; `cancel`, when set, stops before the next window by
// throwing hh::Cancelled.
PerplexityResult perplexity(const LanguageModel& model, const std::vector<int64_t>& stream, int64_t seq,
                            int64_t chunk = 1024, const std::function<void(int64_t done, int64_t total)>& progress = {},
                            const std::atomic<bool>* cancel = nullptr);

// A token stream from a file: `.bin` = uint32 little-endian ids; `.jsonl` = one object a line with a
// "text" field, each tokenised and the texts concatenated. Errors name the file (and line).
std::vector<int64_t> read_token_stream(const std::filesystem::path& path, const model::Tokenizer* tok, int64_t vocab_size);

}  // namespace hh::eval
