#pragma once
// Calibration sets (DESIGN.md section 5): JSONL, one example a line, either token ids
//   {"task": "...", "clean_ids": [..], "corrupt_ids": [..], "answer_ids": [..], "wrong_ids": [..], "meta": {..}}
// or the same with text fields "clean", "corrupt", "answer", "wrong" that the model's tokenizer encodes.
// This is the one reader and validator that every consumer (task plugins' output, `tasks validate`,
// the sweeps, the GUI) goes through, so a set that passes here is usable everywhere.
//
// Per field, ids win when both the ids and the text are present (the text is kept for display).
// Rules: "task" is a non-empty string; clean is non-empty and corrupt has the same token count;
// answer is non-empty; wrong is optional (absent or []); every id lies in [0, vocab_size) when the
// vocabulary size is known; "meta", when present, is an object. Every error is an hh::Error that
// starts with "FILE:LINE: " and names the field.
#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace hh::model {
class Tokenizer;
}

namespace hh::interp {

struct CalibExample {
  std::string task;
  std::vector<int64_t> clean_ids, corrupt_ids, answer_ids, wrong_ids;  // wrong_ids may be empty
  nlohmann::json meta = nlohmann::json::object();
  // Texts as given in the file (empty when the line had ids only); for display, never re-tokenised.
  std::string clean, corrupt, answer, wrong;
};

// Parses one example object. `where` prefixes every error (e.g. "calib.jsonl:12"). `tok` encodes text
// fields that come without ids (an error names the field when it is needed and null); `vocab_size` < 0
// leaves ids unchecked against the vocabulary (negative ids are always an error).
CalibExample parse_calibration_example(const nlohmann::json& obj, const std::string& where,
                                       const model::Tokenizer* tok, int64_t vocab_size);

// Checks an example built in memory against the same rules; throws hh::Error prefixed with `where`.
void validate_calibration_example(const CalibExample& ex, const std::string& where, int64_t vocab_size);

// Reads and validates a whole file; blank lines are skipped, a file without examples is an error.
// `tok` is needed only when some line has text fields without ids.
std::vector<CalibExample> read_calibration(const std::filesystem::path& path, const model::Tokenizer* tok = nullptr,
                                           int64_t vocab_size = -1);

// One example as its JSONL line (no newline), fields in the order of DESIGN.md section 5; texts are
// written only when non-empty, invalid UTF-8 in them is replaced by U+FFFD.
std::string calibration_line(const CalibExample& ex);

// Validates every example (vocabulary unchecked) and writes the file atomically: a temporary file in
// the same directory, renamed when complete, so a failure leaves no partial file behind.
void write_calibration(const std::filesystem::path& path, const std::vector<CalibExample>& examples);

// sha256 (lower-case hex) of the file's bytes, the provenance every artifact records.
std::string calibration_sha256(const std::filesystem::path& path);

// First position where clean and corrupt differ (where patching starts to matter); -1 when they are
// identical. With different lengths and a common prefix, the shorter length.
int64_t first_difference(const std::vector<int64_t>& clean, const std::vector<int64_t>& corrupt);

}  // namespace hh::interp
