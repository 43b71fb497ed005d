// hh-tasks-reasoning: variable-tracking, induction, arithmetic.
#include "builtin_tasks.h"
#include "hydrahead/task_sdk.hpp"

HH_SDK_PLUGIN_ENTRY(hh::builtin::reasoning_tasks())
