#include "core/interp/calibration.h"

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <limits>
#include <string_view>

#include "core/io/safetensors.h"
#include "core/io/sha256.h"
#include "core/model/tokenizer.h"
#include "core/util/error.h"

namespace hh::interp {
namespace {

using nlohmann::json;

// Longest JSON value quoted verbatim in an error message; a bad line can be megabytes long.
constexpr std::size_t kMaxQuotedChars = 60;

// The four token sequences of an example: the ids key, the text key, and whether it may be absent.
struct FieldSpec {
  const char* ids_key;
  const char* text_key;
  bool required;
};
constexpr FieldSpec kClean{"clean_ids", "clean", true};
constexpr FieldSpec kCorrupt{"corrupt_ids", "corrupt", true};
constexpr FieldSpec kAnswer{"answer_ids", "answer", true};
constexpr FieldSpec kWrong{"wrong_ids", "wrong", false};

std::string dump_safe(const json& j) { return j.dump(-1, ' ', false, json::error_handler_t::replace); }

std::string quote(const json& j) {
  std::string s = dump_safe(j);
  if (s.size() > kMaxQuotedChars) s = s.substr(0, kMaxQuotedChars) + "...";
  return s;
}

const char* type_name(const json& j) {
  return j.type_name();  // "null", "object", "array", "string", "boolean", "number"
}

// nlohmann prefixes its messages with "[json.exception.parse_error.101] "; the rest is what users need.
std::string strip_json_prefix(const std::string& what) {
  if (!what.empty() && what[0] == '[') {
    auto close = what.find("] ");
    if (close != std::string::npos) return what.substr(close + 2);
  }
  return what;
}

std::string token_count(std::size_t n) { return std::to_string(n) + (n == 1 ? " token" : " tokens"); }

void check_ids(const std::vector<int64_t>& ids, const std::string& where, const std::string& field,
               int64_t vocab_size) {
  for (std::size_t i = 0; i < ids.size(); ++i) {
    const int64_t id = ids[i];
    if (id < 0 || (vocab_size >= 0 && id >= vocab_size)) {
      std::string range = vocab_size >= 0 ? "[0, " + std::to_string(vocab_size) + ")" : "[0, inf)";
      throw Error(where + ": field '" + field + "' item " + std::to_string(i) + ": id " + std::to_string(id) +
                  " is out of range " + range);
    }
  }
}

std::vector<int64_t> ids_from_json(const json& arr, const std::string& where, const std::string& field) {
  if (!arr.is_array())
    throw Error(where + ": field '" + field + "' must be an array of token ids, got " + type_name(arr));
  std::vector<int64_t> ids;
  ids.reserve(arr.size());
  for (std::size_t i = 0; i < arr.size(); ++i) {
    const json& v = arr[i];
    if (v.is_number_unsigned()) {
      const auto u = v.get<uint64_t>();
      if (u > static_cast<uint64_t>(std::numeric_limits<int64_t>::max()))
        throw Error(where + ": field '" + field + "' item " + std::to_string(i) + ": id " + std::to_string(u) +
                    " is out of range");
      ids.push_back(static_cast<int64_t>(u));
    } else if (v.is_number_integer()) {
      ids.push_back(v.get<int64_t>());
    } else {
      throw Error(where + ": field '" + field + "' item " + std::to_string(i) + " (" + quote(v) +
                  ") is not an integer token id");
    }
  }
  return ids;
}

// Reads one token sequence: its ids when present, else its text encoded with `tok`. `name` receives
// the key that supplied the ids (errors about length or emptiness name that key).
std::vector<int64_t> read_field(const json& obj, const FieldSpec& f, const std::string& where,
                                const model::Tokenizer* tok, std::string& text, std::string& name) {
  name = f.ids_key;
  auto t = obj.find(f.text_key);
  if (t != obj.end() && !t->is_null()) {
    if (!t->is_string())
      throw Error(where + ": field '" + f.text_key + "' must be a string, got " + type_name(*t));
    text = t->get<std::string>();
  }
  auto i = obj.find(f.ids_key);
  if (i != obj.end() && !i->is_null()) return ids_from_json(*i, where, f.ids_key);
  if (t != obj.end() && !t->is_null()) {
    name = f.text_key;
    if (!tok)
      throw Error(where + ": field '" + f.text_key + "' is text without '" + f.ids_key +
                  "'; a tokenizer is needed to encode it (pass the model)");
    try {
      return tok->encode(text);
    } catch (const Error& e) {
      throw Error(where + ": field '" + f.text_key + "': " + e.what());
    }
  }
  if (f.required)
    throw Error(where + ": missing field '" + f.ids_key + "' (or its text form '" + f.text_key + "')");
  return {};
}

// The rules shared by parsed and in-memory examples; `names` are the keys the sequences came from.
void check_example(const CalibExample& ex, const std::string& where, int64_t vocab_size,
                   const std::string& clean_name, const std::string& corrupt_name, const std::string& answer_name,
                   const std::string& wrong_name) {
  if (ex.task.empty()) throw Error(where + ": field 'task' is empty");
  if (ex.clean_ids.empty()) throw Error(where + ": field '" + clean_name + "' is empty");
  if (ex.corrupt_ids.size() != ex.clean_ids.size())
    throw Error(where + ": field '" + corrupt_name + "' has " + token_count(ex.corrupt_ids.size()) + " but '" +
                clean_name + "' has " + token_count(ex.clean_ids.size()) +
                "; clean and corrupt must be the same length");
  if (ex.answer_ids.empty()) throw Error(where + ": field '" + answer_name + "' is empty");
  check_ids(ex.clean_ids, where, clean_name, vocab_size);
  check_ids(ex.corrupt_ids, where, corrupt_name, vocab_size);
  check_ids(ex.answer_ids, where, answer_name, vocab_size);
  check_ids(ex.wrong_ids, where, wrong_name, vocab_size);
  if (!ex.meta.is_object()) throw Error(where + ": field 'meta' must be an object");
}

}  // namespace

CalibExample parse_calibration_example(const json& obj, const std::string& where, const model::Tokenizer* tok,
                                       int64_t vocab_size) {
  if (!obj.is_object()) throw Error(where + ": expected a JSON object, got " + std::string(type_name(obj)));
  CalibExample ex;
  auto task = obj.find("task");
  if (task == obj.end() || task->is_null()) throw Error(where + ": missing field 'task'");
  if (!task->is_string()) throw Error(where + ": field 'task' must be a string, got " + type_name(*task));
  ex.task = task->get<std::string>();

  std::string clean_name, corrupt_name, answer_name, wrong_name;
  ex.clean_ids = read_field(obj, kClean, where, tok, ex.clean, clean_name);
  ex.corrupt_ids = read_field(obj, kCorrupt, where, tok, ex.corrupt, corrupt_name);
  ex.answer_ids = read_field(obj, kAnswer, where, tok, ex.answer, answer_name);
  ex.wrong_ids = read_field(obj, kWrong, where, tok, ex.wrong, wrong_name);

  auto meta = obj.find("meta");
  if (meta != obj.end() && !meta->is_null()) {
    if (!meta->is_object()) throw Error(where + ": field 'meta' must be an object, got " + type_name(*meta));
    ex.meta = *meta;
  }
  check_example(ex, where, vocab_size, clean_name, corrupt_name, answer_name, wrong_name);
  return ex;
}

void validate_calibration_example(const CalibExample& ex, const std::string& where, int64_t vocab_size) {
  check_example(ex, where, vocab_size, kClean.ids_key, kCorrupt.ids_key, kAnswer.ids_key, kWrong.ids_key);
}

std::vector<CalibExample> read_calibration(const std::filesystem::path& path, const model::Tokenizer* tok,
                                           int64_t vocab_size) {
  const std::string file = path.string();
  std::ifstream in(path, std::ios::binary);
  if (!in) throw Error(file + ": cannot open: " + std::strerror(errno));
  std::vector<CalibExample> out;
  std::string line;
  std::size_t lineno = 0;
  while (std::getline(in, line)) {
    ++lineno;
    if (!line.empty() && line.back() == '\r') line.pop_back();
    if (line.find_first_not_of(" \t") == std::string::npos) continue;
    const std::string where = file + ":" + std::to_string(lineno);
    json obj;
    try {
      obj = json::parse(line);
    } catch (const json::parse_error& e) {
      throw Error(where + ": not valid JSON: " + strip_json_prefix(e.what()));
    }
    out.push_back(parse_calibration_example(obj, where, tok, vocab_size));
  }
  if (in.bad()) throw Error(file + ": read error after line " + std::to_string(lineno));
  if (out.empty()) throw Error(file + ": holds no examples");
  return out;
}

std::string calibration_line(const CalibExample& ex) {
  std::string s;
  s += "{\"task\":" + dump_safe(ex.task);
  s += ",\"clean_ids\":" + json(ex.clean_ids).dump();
  s += ",\"corrupt_ids\":" + json(ex.corrupt_ids).dump();
  s += ",\"answer_ids\":" + json(ex.answer_ids).dump();
  s += ",\"wrong_ids\":" + json(ex.wrong_ids).dump();
  s += ",\"meta\":" + (ex.meta.is_null() ? std::string("{}") : dump_safe(ex.meta));
  auto text = [&s](const char* key, const std::string& value) {
    if (!value.empty()) s += std::string(",\"") + key + "\":" + dump_safe(value);
  };
  text("clean", ex.clean);
  text("corrupt", ex.corrupt);
  text("answer", ex.answer);
  text("wrong", ex.wrong);
  s += "}";
  return s;
}

void write_calibration(const std::filesystem::path& path, const std::vector<CalibExample>& examples) {
  const std::string file = path.string();
  if (examples.empty()) throw Error(file + ": no examples to write");
  std::string bytes;
  for (std::size_t i = 0; i < examples.size(); ++i) {
    validate_calibration_example(examples[i], file + ": example " + std::to_string(i + 1), /*vocab_size=*/-1);
    bytes += calibration_line(examples[i]);
    bytes += '\n';
  }
  io::write_file_atomic(path, bytes);
}

std::string calibration_sha256(const std::filesystem::path& path) { return io::sha256_file_hex(path); }

int64_t first_difference(const std::vector<int64_t>& clean, const std::vector<int64_t>& corrupt) {
  const std::size_t n = std::min(clean.size(), corrupt.size());
  for (std::size_t i = 0; i < n; ++i)
    if (clean[i] != corrupt[i]) return static_cast<int64_t>(i);
  if (clean.size() != corrupt.size()) return static_cast<int64_t>(n);
  return -1;
}

}  // namespace hh::interp
