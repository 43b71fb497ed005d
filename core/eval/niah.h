#pragma once
// Needle-in-a-haystack accuracy over a grid of context lengths and needle depths (DESIGN.md section
// 10's evaluation): for each cell, a calibration-task plugin (niah-single by default) generates n
// prompts of that length with the needle at that depth; the model decodes greedily as many tokens as
// the answer has, and a prompt counts as correct when they equal the answer exactly.
#include <atomic>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <string>
#include <vector>

#include "core/util/compat.h"

namespace hh::interp {
class TaskRegistry;
}
namespace hh::model {
class Tokenizer;
}

namespace hh::eval {

// Greedy continuation of `prompt` by `n` tokens (a dense model's generate_greedy or a hybrid's generate).
using GenerateFn = std::function<std::vector<int64_t>(const std::vector<int64_t>& prompt, int64_t n)>;

struct NiahGridOptions {
  std::string task = "niah-single";  // any retrieval task plugin with `length` and `depth` parameters
  std::vector<int64_t> lengths;      // prompt tokens
  std::vector<double> depths;        // 0 = start of the haystack, 1 = end
  int64_t n = 10;                    // prompts per cell
  uint64_t seed = 0;                 // cell (i, j) uses seed + 1000 * i + j
  std::function<void(int64_t done, int64_t total)> progress;
  const std::atomic<bool>* cancel = nullptr;
};

struct NiahGridResult {
  at::Tensor accuracy;  // [lengths, depths] float64
  at::Tensor correct;   // [lengths, depths] int64
};

NiahGridResult niah_grid(const GenerateFn& generate, const interp::TaskRegistry& tasks, const model::Tokenizer& tok,
                         const NiahGridOptions& o);

// Writes eval.h5 (atomically): /niah/accuracy and /niah/correct [length, depth], /niah/lengths,
// /niah/depths; attributes task, n, seed, model_fingerprint, created_by (format "hydrahead-eval").
void write_niah(const std::filesystem::path& out, const NiahGridResult& r, const NiahGridOptions& o,
                const std::string& model_fingerprint, const std::string& created_by);

// "1K" -> 1024, "4096" -> 4096, "2k" -> 2048; throws naming the item.
std::vector<int64_t> parse_lengths(const std::string& list);
std::vector<double> parse_depths(const std::string& list);

}  // namespace hh::eval
