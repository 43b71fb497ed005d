#pragma once
// Shared helpers for the test executables: where the fixtures and binaries are, scratch dirs.
#include <filesystem>
#include <string>

namespace hh::test {
std::filesystem::path source_dir();   // repository root
std::filesystem::path data_dir();     // tests/data
std::filesystem::path bin_dir();      // build/bin
// Qwen3's tokenizer.json + reference ids fetched by the tokenizer.fetch_reference fixture.
std::filesystem::path qwen3_tokenizer_dir();
// A fresh, empty directory under the build's test-tmp, unique per test.
std::filesystem::path scratch_dir(const std::string& tag);
}  // namespace hh::test
