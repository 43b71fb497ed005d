#pragma once
// The small random-model configurations the tests build (rope_theta 10000, no bias, untied).
#include <cstdint>

#include "core/model/config.h"

namespace hh::test {

inline model::ModelConfig tiny_config(int64_t layers, int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t hidden,
                                      int64_t mlp, int64_t vocab) {
  model::ModelConfig c;
  c.num_hidden_layers = layers;
  c.num_attention_heads = heads;
  c.num_key_value_heads = kv_heads;
  c.head_dim = head_dim;
  c.hidden_size = hidden;
  c.intermediate_size = mlp;
  c.vocab_size = vocab;
  c.rope_theta = 10000.0;
  return c;
}

}  // namespace hh::test
