// hh-tasks-retrieval: niah-single, niah-multikey, niah-multivalue, niah-multiquery, passkey.
#include "builtin_tasks.h"
#include "hydrahead/task_sdk.hpp"

HH_SDK_PLUGIN_ENTRY(hh::builtin::retrieval_tasks())
