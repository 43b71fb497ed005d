#include "support/test_support.h"

#include <gtest/gtest.h>

#include "test_paths.h"

#include <cstdlib>
#include <stdexcept>

namespace hh::test {
namespace {
// The environment wins (tests run from another tree); the build's paths are the fallback.
std::filesystem::path env_path(const char* name, const char* fallback) {
  const char* v = std::getenv(name);
  if (v && *v) return v;
  return fallback;
}
}  // namespace

std::filesystem::path source_dir() { return env_path("HH_SOURCE_DIR", HH_DEFAULT_SOURCE_DIR); }
std::filesystem::path data_dir() { return env_path("HH_TEST_DATA", HH_DEFAULT_TEST_DATA); }
std::filesystem::path qwen3_tokenizer_dir() {
  return env_path("HH_QWEN3_TOKENIZER_DIR", HH_DEFAULT_QWEN3_TOKENIZER_DIR);
}
std::filesystem::path bin_dir() { return env_path("HH_BIN_DIR", HH_DEFAULT_BIN_DIR); }

std::filesystem::path scratch_dir(const std::string& tag) {
  const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
  std::string name = tag;
  if (info) name += std::string("_") + info->test_suite_name() + "_" + info->name();
  for (auto& c : name)
    if (!isalnum(static_cast<unsigned char>(c)) && c != '_' && c != '-') c = '_';
  auto dir = env_path("HH_TEST_TMP", HH_DEFAULT_TEST_TMP) / name;
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  return dir;
}
}  // namespace hh::test
