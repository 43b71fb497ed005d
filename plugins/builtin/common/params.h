#pragma once
// Parameter descriptors shared by the built-in tasks, so the same name always means the same thing.
#include "common/haystack.h"
#include "hydrahead/task_sdk.hpp"

namespace hh::builtin {

inline constexpr int64_t kMinLength = 64;
inline constexpr int64_t kMaxLength = 1048576;

inline constexpr hh_param_v1 kLengthParam = sdk::int_param(
    "length", "prompt length in the model's tokens (clean and corrupt alike)", 1024, kMinLength, kMaxLength);
inline constexpr hh_param_v1 kNumExamplesParam =
    sdk::int_param("num_examples", "number of clean/corrupt pairs to generate", 32, 1, 1000000);
inline constexpr hh_param_v1 kDepthParam =
    sdk::float_param("depth", "where the (first asked) needle sits in the filler: 0 = start, 1 = end", 0.5, 0.0, 1.0);
inline constexpr hh_param_v1 kRandomDepthParam = sdk::bool_param(
    "random_depth", "draw each example's needle depth uniformly from [0, 1] (depth is then ignored); for training data",
    false);
inline constexpr hh_param_v1 kEssaysHaystackParam = sdk::string_param(
    "haystack", "filler text: essays (prose) or noise (a few repeated sentences)", "essays", kHaystackChoices);
inline constexpr hh_param_v1 kNoiseHaystackParam = sdk::string_param(
    "haystack", "filler text: essays (prose) or noise (a few repeated sentences)", "noise", kHaystackChoices);

// The depth of one example's (first asked) needle: the `depth` parameter, or a uniform draw when
// `random_depth` is set (drawn first, so a fixed depth leaves the example stream as it was).
inline double needle_depth(const sdk::Params& params, sdk::Rng& rng) {
  return params.boolean("random_depth") ? rng.unit() : params.number("depth");
}

}  // namespace hh::builtin
