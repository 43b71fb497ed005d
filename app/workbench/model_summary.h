#pragma once
// The checkpoint summary lives in the core (core/model/summary.h); the workbench uses its names.
#include "core/model/summary.h"

namespace hh::workbench {
using hh::model::dtype_summary;
using hh::model::fingerprint_prefix;
using hh::model::format_parameter_count;
using hh::model::format_shape;
using hh::model::group_digits;
using hh::model::ModelSummary;
using hh::model::natural_less;
using hh::model::summarize_checkpoint;
using hh::model::TensorEntry;
}  // namespace hh::workbench
