#pragma once
// Layer similarity (DESIGN.md section 6), accumulated over the tokens of many examples. With h_0
// the embeddings and h_l the residual after layer l (l = 1..L), for layers i, j in [0, L):
//  - cosine_delta[i, j]: mean over tokens of cos(h_{i+1} - h_i, h_{j+1} - h_j), how alike two layers'
//    updates to the residual are;
//  - cka[i, j]: linear CKA (Kornblith et al. 2019) of the layer outputs h_{i+1}, h_{j+1}, over a
//    sample of at most `max_tokens` tokens (rows centred per feature);
//  - angular[i, j]: mean over tokens of arccos(cos(h_{i+1}, h_{j+1})) / pi, in [0, 1].
// cosine_delta and cka are symmetric with unit diagonal; angular is symmetric with zero diagonal.
#include <cstdint>
#include <utility>
#include <vector>

#include "core/util/compat.h"

namespace hh::interp {

class SimilarityAccumulator {
 public:
  // tokens_per_example: rows of each example kept for CKA (evenly spaced); max_tokens caps the total.
  SimilarityAccumulator(int64_t num_layers, int64_t tokens_per_example, int64_t max_tokens);

  // states: L + 1 tensors [T, d] (any device and float dtype): embeddings, then each layer's output.
  void add(const std::vector<at::Tensor>& states);

  struct Result {
    at::Tensor cosine_delta, cka, angular;  // [L, L] float32
    int64_t tokens = 0;                     // tokens averaged for cosine_delta and angular
    int64_t cka_tokens = 0;                 // tokens in the CKA sample
  };
  Result finish() const;

 private:
  int64_t L_, per_example_, max_tokens_;
  at::Tensor cos_sum_, ang_sum_;  // [L, L] float64 on the CPU
  int64_t tokens_ = 0;
  std::vector<at::Tensor> sample_;  // per layer output: [n, d] float32 chunks
  int64_t sampled_ = 0;
};

// Linear CKA of two [n, d] representations (rows are samples), computed in float64.
double linear_cka(const at::Tensor& x, const at::Tensor& y);

// Blocks of consecutive layers in a similarity matrix [L, L]: a new block starts at layer l when
// sim[l - 1, l] < threshold. With `distance` the matrix holds distances (angular): the test is
// 1 - sim[l - 1, l] < threshold. Returns [first, last] layer pairs covering 0..L-1 in order.
std::vector<std::pair<int64_t, int64_t>> similarity_blocks(const at::Tensor& sim, double threshold, bool distance = false);

}  // namespace hh::interp
