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

// A long operation stopped because the user asked (Ctrl-C, a Cancel button); nothing was written.
class Cancelled : public Error {
 public:
  Cancelled() : Error("cancelled") {}
};

}  // namespace hh
