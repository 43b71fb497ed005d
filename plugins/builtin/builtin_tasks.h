#pragma once
// The built-in calibration tasks, as ABI descriptors. The plugin libraries register these lists;
// tests call the descriptors' generate() directly.
#include <vector>

#include "hydrahead/plugin.h"

namespace hh::builtin {

const hh_task_v1* niah_single_task();
const hh_task_v1* niah_multikey_task();
const hh_task_v1* niah_multivalue_task();
const hh_task_v1* niah_multiquery_task();
const hh_task_v1* passkey_task();
const hh_task_v1* variable_tracking_task();
const hh_task_v1* induction_task();
const hh_task_v1* arithmetic_task();

// niah-single, niah-multikey, niah-multivalue, niah-multiquery, passkey
std::vector<const hh_task_v1*> retrieval_tasks();
// variable-tracking, induction, arithmetic
std::vector<const hh_task_v1*> reasoning_tasks();

}  // namespace hh::builtin
