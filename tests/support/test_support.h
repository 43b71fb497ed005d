#pragma once
// Shared helpers for the test executables: where the fixtures and binaries are, scratch dirs.
#include <gtest/gtest.h>

#include <filesystem>
#include <string>

#include "core/util/error.h"

namespace hh::test {
std::filesystem::path source_dir();   // repository root
std::filesystem::path data_dir();     // tests/data
std::filesystem::path bin_dir();      // build/bin
// Qwen3's tokenizer.json + reference ids fetched by the tokenizer.fetch_reference fixture.
std::filesystem::path qwen3_tokenizer_dir();
// A fresh, empty directory under the build's test-tmp, unique per test.
std::filesystem::path scratch_dir(const std::string& tag);
// A shell command's exit status (-1 when it did not exit normally) and its stdout + stderr.
struct CommandResult {
  int status;
  std::string output;
};
CommandResult run_command(const std::string& cmd);
// `hydrahead ARGS` from the build's bin directory.
CommandResult run_hydrahead(const std::string& args);
// A python interpreter that imports h5py: python3 on PATH, else Debian's /usr/bin/python3 (which owns
// python3-h5py); "" when neither does.
std::string python_with_h5py();
// The message of the hh::Error `f` throws; a test failure when it throws nothing.
template <class F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const hh::Error& e) {
    return e.what();
  }
  ADD_FAILURE() << "expected hh::Error";
  return {};
}

}  // namespace hh::test

// The message contains `part` (a file, tensor, field or value it must name).
#define EXPECT_MENTIONS(message, part) \
  EXPECT_NE((message).find(part), std::string::npos) << "message: " << (message) << "\nmissing: " << (part)
