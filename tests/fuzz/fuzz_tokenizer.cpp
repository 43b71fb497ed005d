// libFuzzer target: arbitrary bytes as text through Tokenizer::encode() and decode(). The tokenizer
// is tests/data/tokenizer/tiny-tokenizer.json, or the file named by HH_FUZZ_TOKENIZER (for example
// Qwen3's real tokenizer.json). hh::Error is an expected rejection (e.g. invalid UTF-8); a crash, a
// sanitizer report, another exception, an id out of range, or ASCII text that does not survive
// encode -> decode (byte-level BPE is lossless and NFC leaves ASCII alone) is a finding.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string_view>

#include "core/model/tokenizer.h"
#include "core/util/error.h"

namespace {
std::unique_ptr<hh::model::Tokenizer> g_tokenizer;
}

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  const char* env = std::getenv("HH_FUZZ_TOKENIZER");
  const std::string path = (env && *env) ? env : HH_FUZZ_DEFAULT_TOKENIZER;
  try {
    g_tokenizer = std::make_unique<hh::model::Tokenizer>(hh::model::Tokenizer::load(path));
  } catch (const std::exception& e) {
    std::fprintf(stderr, "fuzz_tokenizer: cannot load %s: %s\n", path.c_str(), e.what());
    std::exit(1);
  }
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, std::size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  try {
    const auto ids = g_tokenizer->encode(text);
    const int64_t vocab = g_tokenizer->vocab_size();
    for (const int64_t id : ids)
      if (id < 0 || id >= vocab) std::abort();
    const std::string back = g_tokenizer->decode(ids);
    bool ascii = true;
    for (const char c : text) ascii = ascii && static_cast<unsigned char>(c) < 0x80;
    if (ascii && back != text) std::abort();
  } catch (const hh::Error&) {
    // expected: input the tokenizer rejects
  }
  return 0;
}
