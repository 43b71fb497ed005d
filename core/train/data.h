#pragma once
// Training data: a weighted mixture of sources, each yielding sequences of seq_len + 1 token ids
// (inputs and next-token targets), addressed by a global sample index so that any batch can be
// rebuilt from (seed, index) alone: a resumed run sees exactly the data an uninterrupted one sees.
//  - "bin":   a uint32 little-endian token stream, packed into consecutive windows of seq_len + 1
//             tokens (window w starts at w * seq_len, so every token is predicted once per epoch);
//             the windows are visited in a fresh seeded permutation every epoch.
//  - "jsonl": one {"text": ...} object a line, tokenised when the source is opened and concatenated,
//             then as "bin".
//  - "task":  examples of a calibration-task plugin (prompt followed by its answer), each generated from
//             a seed derived from the sample index; an example shorter than the window is followed by
//             more (separated by the end-of-sequence id when the model has one). batch() generates
//             them on several threads.
// Sample i takes its source from a seeded draw over the weights, then that source's i-th sample.
#include <cstdint>
#include <filesystem>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/util/compat.h"

namespace hh::model {
class Tokenizer;
}
namespace hh::interp {
class TaskRegistry;
struct CalibExample;
}

namespace hh::train {

struct DataSource {
  std::string kind;                 // "bin" | "jsonl" | "task"
  std::filesystem::path path;       // bin, jsonl
  std::string task;                 // task id
  nlohmann::json params = nlohmann::json::object();   // task parameters
  double weight = 1.0;
  bool answer_loss_only = false;    // task: only the answer tokens are prediction targets
  std::string describe() const;     // "corpus.bin", "task niah-single"
};

// 64-bit mix of a seed and a few integers (splitmix64 rounds): the one hash every draw derives from.
uint64_t mix_seed(uint64_t seed, uint64_t a, uint64_t b = 0, uint64_t c = 0);

class DataMixture {
 public:
  // Streams are read (and JSONL tokenised) here; errors name the file. `tok` is needed by jsonl and
  // task sources, `tasks` by task sources. eos < 0: no separator between task examples.
  DataMixture(std::vector<DataSource> sources, const model::Tokenizer* tok, const interp::TaskRegistry* tasks,
              int64_t vocab_size, int64_t eos, uint64_t seed);
  ~DataMixture();
  DataMixture(DataMixture&&) noexcept;
  DataMixture& operator=(DataMixture&&) noexcept;

  // Token ids [n, seq_len + 1] (int64, CPU) of samples first .. first + n - 1. With target_mask, also
  // which next-token targets count [n, seq_len] (uint8; column j is the prediction of token j + 1):
  // in samples of answer_loss_only task sources only the answer tokens, elsewhere all of them. Left
  // undefined when no source is answer_loss_only (every target counts).
  at::Tensor batch(int64_t first, int64_t n, int64_t seq_len, at::Tensor* target_mask = nullptr);
  // One sample; its source index is source_of(index).
  std::vector<int64_t> sample(int64_t index, int64_t seq_len);
  // Makes one sample of every task source (its first), so that a generator that cannot run with
  // these parameters and this tokenizer (a length too small for its prompt, say) fails now, naming
  // the source, rather than in the middle of training.
  void probe_tasks(int64_t seq_len) const;
  std::size_t source_of(int64_t index) const;
  const std::vector<DataSource>& sources() const { return sources_; }

  struct Stream;  // a token stream (defined in data.cpp)

 private:
  struct Sample {
    std::vector<int64_t> ids;       // seq_len + 1
    std::vector<uint8_t> targets;   // seq_len: 1 where predicting ids[j + 1] counts
  };
  Sample make_sample(int64_t index, int64_t seq_len);
  std::vector<int64_t> stream_sample(std::size_t s, int64_t index, int64_t seq_len);
  Sample task_sample(std::size_t s, int64_t index, int64_t seq_len) const;

  std::vector<DataSource> sources_;
  std::vector<double> cumulative_;   // normalised cumulative weights
  std::vector<std::unique_ptr<Stream>> streams_;   // per source; null for task sources
  const model::Tokenizer* tok_;
  const interp::TaskRegistry* tasks_;
  int64_t vocab_, eos_;
  uint64_t seed_;
};

}  // namespace hh::train
