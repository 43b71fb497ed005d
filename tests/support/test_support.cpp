#include "support/test_support.h"

#include <gtest/gtest.h>

#include <cstdlib>
#include <stdexcept>

namespace hh::test {
namespace {
std::filesystem::path env_path(const char* name) {
  const char* v = std::getenv(name);
  if (!v || !*v) throw std::runtime_error(std::string("test environment variable not set: ") + name);
  return v;
}
}  // namespace

std::filesystem::path source_dir() { return env_path("HH_SOURCE_DIR"); }
std::filesystem::path data_dir() { return env_path("HH_TEST_DATA"); }
std::filesystem::path bin_dir() { return env_path("HH_BIN_DIR"); }

std::filesystem::path scratch_dir(const std::string& tag) {
  const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
  std::string name = tag;
  if (info) name += std::string("_") + info->test_suite_name() + "_" + info->name();
  for (auto& c : name)
    if (!isalnum(static_cast<unsigned char>(c)) && c != '_' && c != '-') c = '_';
  auto dir = env_path("HH_TEST_TMP") / name;
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  return dir;
}
}  // namespace hh::test
