#include "support/test_support.h"

#include <gtest/gtest.h>

#include "test_paths.h"

#include <ftw.h>
#include <sys/wait.h>
#include <unistd.h>

#include <array>
#include <cstdio>
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
// Removes a directory tree with POSIX calls. pip torch's libtorch.so exports its own copy of
// std::filesystem::remove_all, which crashes (a call through a null pointer) on a non-empty directory
// when the test binary resolves the symbol there; the tests must not depend on it.
int remove_entry(const char* path, const struct stat*, int, struct FTW*) { return ::remove(path); }
void remove_tree(const std::filesystem::path& dir) {
  if (::access(dir.c_str(), F_OK) != 0) return;
  if (::nftw(dir.c_str(), remove_entry, /*fd_limit=*/16, FTW_DEPTH | FTW_PHYS) != 0)
    throw std::runtime_error("cannot remove " + dir.string());
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
  remove_tree(dir);
  std::filesystem::create_directories(dir);
  return dir;
}
std::string python_with_h5py() {
  for (const char* candidate : {"python3", "/usr/bin/python3"})
    if (std::system((std::string(candidate) + " -c 'import h5py' >/dev/null 2>&1").c_str()) == 0) return candidate;
  return {};
}

CommandResult run_command(const std::string& cmd) {
  CommandResult r{-1, ""};
  FILE* p = popen((cmd + " 2>&1").c_str(), "r");
  if (!p) return r;
  std::array<char, 4096> buf{};
  size_t n;
  while ((n = fread(buf.data(), 1, buf.size(), p)) > 0) r.output.append(buf.data(), n);
  const int st = pclose(p);
  r.status = WIFEXITED(st) ? WEXITSTATUS(st) : -1;
  return r;
}

CommandResult run_hydrahead(const std::string& args) { return run_command((bin_dir() / "hydrahead").string() + " " + args); }

}  // namespace hh::test
