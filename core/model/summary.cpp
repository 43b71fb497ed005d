#include "core/model/summary.h"

#include <algorithm>
#include <cctype>
#include <cinttypes>
#include <cstdio>
#include <map>
#include <system_error>

#include "core/io/checkpoint.h"
#include "core/io/fingerprint.h"
#include "core/util/error.h"

namespace fs = std::filesystem;

namespace hh::model {
namespace {

bool is_digit(char c) { return std::isdigit(static_cast<unsigned char>(c)) != 0; }

std::vector<std::string> list_weight_files(const fs::path& dir) {
  std::vector<std::string> files;
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(dir, ec)) {
    if (entry.path().extension() == ".safetensors" && entry.is_regular_file(ec))
      files.push_back(entry.path().filename().string());
  }
  if (ec) throw hh::Error(dir.string() + ": cannot list the folder: " + ec.message());
  std::sort(files.begin(), files.end());
  return files;
}

}  // namespace

ModelSummary summarize_checkpoint(const fs::path& dir_in) {
  std::error_code ec;
  const fs::path dir = fs::weakly_canonical(fs::absolute(dir_in), ec).lexically_normal();
  if (ec || !fs::exists(dir)) throw hh::Error(dir_in.string() + ": no such folder");
  if (!fs::is_directory(dir))
    throw hh::Error(dir.string() + ": not a folder (a checkpoint is a folder holding config.json and *.safetensors)");
  if (!fs::is_regular_file(dir / "config.json"))
    throw hh::Error(dir.string() + ": no config.json (not an HF-format checkpoint folder)");

  ModelSummary s;
  s.dir = dir;
  s.name = dir.filename().string();
  if (s.name.empty()) s.name = dir.string();
  s.weight_files = list_weight_files(dir);
  if (s.weight_files.empty()) throw hh::Error(dir.string() + ": no *.safetensors weight files");

  s.config = hh::model::ModelConfig::load_teacher_view(dir / "config.json", &s.hydrahead);
  s.params_from_config = s.config.num_parameters();

  const hh::io::Checkpoint checkpoint(dir);
  for (const auto& name : checkpoint.tensor_names()) {
    const auto& info = checkpoint.info(name);
    TensorEntry t;
    t.name = name;
    t.dtype = std::string(hh::io::dtype_name(info.dtype));
    t.shape = info.shape;
    t.numel = info.numel();
    s.params_from_tensors += t.numel;
    s.tensors.push_back(std::move(t));
  }
  std::stable_sort(s.tensors.begin(), s.tensors.end(),
                   [](const TensorEntry& a, const TensorEntry& b) { return natural_less(a.name, b.name); });
  s.weights_dtype = dtype_summary(s.tensors);
  s.fingerprint = hh::io::model_fingerprint(dir);
  return s;
}

std::string format_parameter_count(int64_t n) {
  struct Unit {
    double scale;
    const char* suffix;
    const char* format;
  };
  // Billions get two decimals: 8.19 B separates sizes that 8.2 B would merge.
  static const Unit kUnits[] = {{1e9, "B", "%.2f %s"}, {1e6, "M", "%.1f %s"}, {1e3, "K", "%.1f %s"}};
  const double magnitude = n < 0 ? -static_cast<double>(n) : static_cast<double>(n);
  for (const auto& u : kUnits) {
    if (magnitude >= u.scale) {
      char buf[64];
      std::snprintf(buf, sizeof buf, u.format, static_cast<double>(n) / u.scale, u.suffix);
      return buf;
    }
  }
  return std::to_string(n);
}

std::string group_digits(int64_t n) {
  const bool negative = n < 0;
  // Work on the unsigned magnitude so INT64_MIN does not overflow.
  uint64_t m = negative ? 0 - static_cast<uint64_t>(n) : static_cast<uint64_t>(n);
  std::string digits = std::to_string(m);
  std::string out;
  const std::size_t lead = digits.size() % 3 == 0 ? 3 : digits.size() % 3;
  out.append(digits, 0, lead);
  for (std::size_t i = lead; i < digits.size(); i += 3) {
    out.push_back(',');
    out.append(digits, i, 3);
  }
  return negative ? "-" + out : out;
}

std::string format_shape(const std::vector<int64_t>& shape) {
  std::string out = "[";
  for (std::size_t i = 0; i < shape.size(); ++i) {
    if (i) out += ", ";
    out += std::to_string(shape[i]);
  }
  return out + "]";
}

std::string fingerprint_prefix(const std::string& fingerprint, int hex_chars) {
  const auto colon = fingerprint.find(':');
  const std::size_t start = colon == std::string::npos ? 0 : colon + 1;
  return fingerprint.substr(0, std::min(fingerprint.size(), start + static_cast<std::size_t>(hex_chars)));
}

bool natural_less(const std::string& a, const std::string& b) {
  std::size_t i = 0, j = 0;
  while (i < a.size() && j < b.size()) {
    if (is_digit(a[i]) && is_digit(b[j])) {
      std::size_t ie = i, je = j;
      while (ie < a.size() && is_digit(a[ie])) ++ie;
      while (je < b.size() && is_digit(b[je])) ++je;
      std::size_t is = i, js = j;  // skip leading zeros, then longer means larger
      while (is + 1 < ie && a[is] == '0') ++is;
      while (js + 1 < je && b[js] == '0') ++js;
      const std::size_t la = ie - is, lb = je - js;
      if (la != lb) return la < lb;
      const int c = a.compare(is, la, b, js, lb);
      if (c != 0) return c < 0;
      i = ie;
      j = je;
    } else {
      if (a[i] != b[j]) return a[i] < b[j];
      ++i;
      ++j;
    }
  }
  if ((a.size() - i) != (b.size() - j)) return (a.size() - i) < (b.size() - j);
  return a < b;  // equal under the natural order ("01" vs "1"): fall back to a total order
}

std::string dtype_summary(const std::vector<TensorEntry>& tensors) {
  std::map<std::string, int> counts;
  for (const auto& t : tensors) ++counts[t.dtype];
  if (counts.empty()) return "";
  if (counts.size() == 1) return counts.begin()->first;
  std::vector<std::pair<std::string, int>> sorted(counts.begin(), counts.end());
  std::stable_sort(sorted.begin(), sorted.end(), [](const auto& x, const auto& y) { return x.second > y.second; });
  std::string out;
  for (const auto& [name, count] : sorted) {
    if (!out.empty()) out += ", ";
    out += name + " \u00d7" + std::to_string(count);
  }
  return out;
}

}  // namespace hh::model
