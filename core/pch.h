// Precompiled header for translation units that use LibTorch. Headers of the core never include
// <torch/torch.h> themselves (see core/util/compat.h for the light-weight forward includes).
#pragma once
#include <torch/torch.h>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>
#include <map>
#include <memory>
#include <functional>
