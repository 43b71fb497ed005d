// libFuzzer target: config.json text through ModelConfig::from_json_text(). hh::Error is an expected
// rejection; anything else (crash, sanitizer report, other exception) is a finding. An accepted
// config must survive to_json() -> from_json() unchanged and count its parameters without throwing.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>

#include <nlohmann/json.hpp>

#include "core/model/config.h"
#include "core/util/error.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, std::size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  hh::model::ModelConfig c;
  try {
    c = hh::model::ModelConfig::from_json_text(text, "fuzz/config.json");
  } catch (const hh::Error&) {
    return 0;  // expected: a rejected config
  }
  // Past validation nothing may throw: an exception escaping here is reported by libFuzzer.
  const int64_t n = c.num_parameters();
  if (n <= 0) std::abort();
  const auto again = hh::model::ModelConfig::from_json(c.to_json(), "fuzz/roundtrip");
  if (again.num_parameters() != n || again.to_json() != c.to_json()) std::abort();
  return 0;
}
