// Block detection on layer-similarity matrices, on matrices written out by hand.
#include <torch/torch.h>

#include <gtest/gtest.h>

#include "core/interp/similarity.h"
#include "support/test_support.h"

namespace {

using Blocks = std::vector<std::pair<int64_t, int64_t>>;

TEST(SimilarityBlocks, CutWhereNeighbouringLayersDiffer) {
  // Adjacent similarities 0.57, 0.98, 0.97, 0.67, 0.99 (the demo teacher's CKA, rounded).
  const auto m = torch::tensor({{1.00, 0.57, 0.56, 0.56, 0.25, 0.25},
                                {0.57, 1.00, 0.98, 0.95, 0.67, 0.66},
                                {0.56, 0.98, 1.00, 0.97, 0.73, 0.72},
                                {0.56, 0.95, 0.97, 1.00, 0.67, 0.67},
                                {0.25, 0.67, 0.73, 0.67, 1.00, 0.99},
                                {0.25, 0.66, 0.72, 0.67, 0.99, 1.00}}, torch::kDouble);
  EXPECT_EQ(hh::interp::similarity_blocks(m, 0.9), (Blocks{{0, 0}, {1, 3}, {4, 5}}));
  EXPECT_EQ(hh::interp::similarity_blocks(m, 0.5), (Blocks{{0, 5}}));            // nothing below 0.5
  EXPECT_EQ(hh::interp::similarity_blocks(m, 0.975), (Blocks{{0, 0}, {1, 2}, {3, 3}, {4, 5}}));
  EXPECT_EQ(hh::interp::similarity_blocks(m, 1.5), (Blocks{{0, 0}, {1, 1}, {2, 2}, {3, 3}, {4, 4}, {5, 5}}));
  // The same as distances: 1 - m.
  EXPECT_EQ(hh::interp::similarity_blocks(1 - m, 0.9, true), (Blocks{{0, 0}, {1, 3}, {4, 5}}));
}

TEST(SimilarityBlocks, EdgeCases) {
  EXPECT_TRUE(hh::interp::similarity_blocks(torch::zeros({0, 0}), 0.9).empty());
  EXPECT_EQ(hh::interp::similarity_blocks(torch::ones({1, 1}), 0.9), (Blocks{{0, 0}}));
  EXPECT_MENTIONS(hh::test::error_of([] { hh::interp::similarity_blocks(torch::ones({2, 3}), 0.9); }), "square");
}

}  // namespace
