#pragma once
// One exception type for user-facing failures. The message must name what is wrong and where
// (file, line, tensor, field, value); front ends print it and exit with status 1.
#include <stdexcept>
#include <string>

namespace hh {

class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& what) : std::runtime_error(what) {}
};

}  // namespace hh
