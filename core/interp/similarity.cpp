#include "core/interp/similarity.h"

#include <torch/torch.h>

#include <algorithm>
#include <cmath>

#include "core/util/error.h"

namespace hh::interp {
namespace {

// Rows normalised to unit length (zero rows stay zero), float32.
at::Tensor unit_rows(const at::Tensor& x) {
  const at::Tensor f = x.to(at::kFloat);
  return f / f.norm(2, -1, /*keepdim=*/true).clamp_min(1e-12);
}

// Centred HSIC-style product for linear_cka: the [n, n] Gram form when n <= d, else [d, d] features.
double hsic(const at::Tensor& xc, const at::Tensor& yc) {
  if (xc.size(0) <= xc.size(1)) {
    const at::Tensor kx = at::matmul(xc, xc.t()), ky = at::matmul(yc, yc.t());
    return (kx * ky).sum().item<double>();
  }
  const at::Tensor c = at::matmul(yc.t(), xc);  // [d, d]
  return c.pow(2).sum().item<double>();
}

}  // namespace

double linear_cka(const at::Tensor& x, const at::Tensor& y) {
  if (x.dim() != 2 || y.dim() != 2 || x.size(0) != y.size(0))
    throw Error("linear_cka: expected two [n, d] tensors with the same n");
  const at::Tensor xc = x.to(at::kDouble) - x.to(at::kDouble).mean(0, true);
  const at::Tensor yc = y.to(at::kDouble) - y.to(at::kDouble).mean(0, true);
  const double xy = hsic(xc, yc), xx = hsic(xc, xc), yy = hsic(yc, yc);
  if (xx <= 0 || yy <= 0) return 0.0;
  return xy / std::sqrt(xx * yy);
}

SimilarityAccumulator::SimilarityAccumulator(int64_t num_layers, int64_t tokens_per_example, int64_t max_tokens)
    : L_(num_layers), per_example_(std::max<int64_t>(1, tokens_per_example)), max_tokens_(max_tokens) {
  if (L_ <= 0) throw Error("layer similarity: need at least one layer");
  cos_sum_ = at::zeros({L_, L_}, at::TensorOptions().dtype(at::kDouble));
  ang_sum_ = at::zeros({L_, L_}, at::TensorOptions().dtype(at::kDouble));
  sample_.resize(static_cast<size_t>(L_));
}

void SimilarityAccumulator::add(const std::vector<at::Tensor>& states) {
  if (static_cast<int64_t>(states.size()) != L_ + 1)
    throw Error("layer similarity: expected " + std::to_string(L_ + 1) + " residual states, got " +
                std::to_string(states.size()));
  at::NoGradGuard no_grad;
  const int64_t T = states[0].size(0);
  // Unit updates [T, L, d] and unit outputs [T, L, d]: per-token Gram matrices [T, L, L] summed over T.
  std::vector<at::Tensor> deltas, outs;
  for (int64_t l = 0; l < L_; ++l) {
    const at::Tensor a = states[static_cast<size_t>(l)].to(at::kFloat);
    const at::Tensor b = states[static_cast<size_t>(l + 1)].to(at::kFloat);
    deltas.push_back(unit_rows(b - a));
    outs.push_back(unit_rows(b));
  }
  const at::Tensor du = at::stack(deltas, 1), ou = at::stack(outs, 1);  // [T, L, d]
  cos_sum_ += at::matmul(du, du.transpose(1, 2)).sum(0).to(at::kDouble).cpu();
  const at::Tensor oc = at::matmul(ou, ou.transpose(1, 2)).to(at::kDouble).clamp(-1.0, 1.0);  // [T, L, L]
  ang_sum_ += (at::acos(oc) / M_PI).sum(0).cpu();
  tokens_ += T;

  // CKA sample: evenly spaced rows, while the total stays under max_tokens.
  const int64_t room = max_tokens_ - sampled_;
  const int64_t take = std::min({per_example_, T, room});
  if (take <= 0) return;
  const at::Tensor rows =
      at::linspace(0, static_cast<double>(T - 1), take, at::TensorOptions().dtype(at::kDouble)).round().to(at::kLong);
  for (int64_t l = 0; l < L_; ++l) {
    const at::Tensor& s = states[static_cast<size_t>(l + 1)];
    sample_[static_cast<size_t>(l)] = sample_[static_cast<size_t>(l)].defined()
        ? at::cat({sample_[static_cast<size_t>(l)], s.index_select(0, rows.to(s.device())).to(at::kFloat)})
        : s.index_select(0, rows.to(s.device())).to(at::kFloat);
  }
  sampled_ += take;
}

SimilarityAccumulator::Result SimilarityAccumulator::finish() const {
  if (tokens_ == 0) throw Error("layer similarity: no tokens were added");
  Result r;
  r.tokens = tokens_;
  r.cka_tokens = sampled_;
  r.cosine_delta = (cos_sum_ / static_cast<double>(tokens_)).to(at::kFloat);
  r.angular = (ang_sum_ / static_cast<double>(tokens_)).to(at::kFloat);
  // Linear CKA from centred Gram matrices, each computed once: <Kc_i, Kc_j> / (|Kc_i| |Kc_j|),
  // float32 products on the samples' device, sums in float64.
  at::Tensor cka = at::eye(L_, at::TensorOptions().dtype(at::kDouble));
  std::vector<at::Tensor> grams;
  for (int64_t l = 0; l < L_; ++l) {
    const at::Tensor& x = sample_[static_cast<size_t>(l)];  // [n, d]
    const at::Tensor xc = x - x.mean(0, /*keepdim=*/true);
    grams.push_back(at::matmul(xc, xc.t()));                 // [n, n]
  }
  std::vector<double> norm(static_cast<size_t>(L_));
  for (int64_t l = 0; l < L_; ++l)
    norm[static_cast<size_t>(l)] = std::sqrt(grams[static_cast<size_t>(l)].to(at::kDouble).pow(2).sum().item<double>());
  for (int64_t i = 0; i < L_; ++i)
    for (int64_t j = i + 1; j < L_; ++j) {
      const double den = norm[static_cast<size_t>(i)] * norm[static_cast<size_t>(j)];
      const double num = (grams[static_cast<size_t>(i)].to(at::kDouble) * grams[static_cast<size_t>(j)].to(at::kDouble)).sum().item<double>();
      const double v = den > 0 ? num / den : 0.0;
      cka[i][j] = v;
      cka[j][i] = v;
    }
  r.cka = cka.to(at::kFloat);
  // Exact symmetry and diagonals (the float sums above can differ in the last bit).
  r.cosine_delta = ((r.cosine_delta + r.cosine_delta.t()) / 2).fill_diagonal_(1.0);
  r.angular = ((r.angular + r.angular.t()) / 2).fill_diagonal_(0.0);
  return r;
}

std::vector<std::pair<int64_t, int64_t>> similarity_blocks(const at::Tensor& sim, double threshold, bool distance) {
  if (sim.dim() != 2 || sim.size(0) != sim.size(1)) throw Error("similarity_blocks: expected a square [L, L] matrix");
  const at::Tensor m = sim.to(at::kDouble).cpu();
  const int64_t L = m.size(0);
  std::vector<std::pair<int64_t, int64_t>> blocks;
  if (L == 0) return blocks;
  int64_t first = 0;
  for (int64_t l = 1; l < L; ++l) {
    const double v = m[l - 1][l].item<double>();
    if ((distance ? 1.0 - v : v) < threshold) {
      blocks.push_back({first, l - 1});
      first = l;
    }
  }
  blocks.push_back({first, L - 1});
  return blocks;
}

}  // namespace hh::interp
