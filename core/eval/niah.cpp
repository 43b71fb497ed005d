#include "core/eval/niah.h"

#include <torch/torch.h>

#include <nlohmann/json.hpp>

#include "core/interp/task_registry.h"
#include "core/io/h5.h"
#include "core/util/error.h"
#include "core/util/strings.h"

namespace hh::eval {

std::vector<int64_t> parse_lengths(const std::string& list) {
  std::vector<int64_t> out;
  for (const auto& item : util::split_list(list)) {
    std::string digits = item;
    int64_t mult = 1;
    if (!digits.empty() && (digits.back() == 'K' || digits.back() == 'k')) {
      mult = 1024;
      digits.pop_back();
    }
    if (digits.empty() || digits.size() > 9 || digits.find_first_not_of("0123456789") != std::string::npos)
      throw Error("--lengths: '" + item + "' is not a token count (e.g. 512, 1K, 4K)");
    const int64_t v = std::stoll(digits) * mult;
    if (v < 1) throw Error("--lengths: '" + item + "' must be positive");
    out.push_back(v);
  }
  if (out.empty()) throw Error("--lengths: no lengths given");
  return out;
}

std::vector<double> parse_depths(const std::string& list) {
  std::vector<double> out;
  for (const auto& item : util::split_list(list)) {
    size_t used = 0;
    double v = 0;
    try {
      v = std::stod(item, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    if (used != item.size() || !(v >= 0.0 && v <= 1.0)) throw Error("--depths: '" + item + "' is not a number in [0, 1]");
    out.push_back(v);
  }
  if (out.empty()) throw Error("--depths: no depths given");
  return out;
}

NiahGridResult niah_grid(const GenerateFn& generate, const interp::TaskRegistry& tasks, const model::Tokenizer& tok,
                         const NiahGridOptions& o) {
  if (o.lengths.empty() || o.depths.empty()) throw Error("NIAH grid: give at least one length and one depth");
  if (o.n < 1) throw Error("NIAH grid: --n must be at least 1");
  const int64_t NL = static_cast<int64_t>(o.lengths.size()), ND = static_cast<int64_t>(o.depths.size());
  NiahGridResult r;
  r.correct = at::zeros({NL, ND}, at::TensorOptions().dtype(at::kLong));
  const int64_t total = NL * ND * o.n;
  int64_t done = 0;
  for (int64_t i = 0; i < NL; ++i)
    for (int64_t j = 0; j < ND; ++j) {
      const nlohmann::json params = {{"num_examples", o.n}, {"length", o.lengths[static_cast<size_t>(i)]},
                                     {"depth", o.depths[static_cast<size_t>(j)]}};
      const auto examples = tasks.generate(o.task, params, tok, o.seed + static_cast<uint64_t>(1000 * i + j));
      int64_t hits = 0;
      for (const auto& ex : examples) {
        if (o.cancel != nullptr && o.cancel->load()) throw Cancelled();
        const auto out = generate(ex.clean_ids, static_cast<int64_t>(ex.answer_ids.size()));
        hits += out == ex.answer_ids ? 1 : 0;
        if (o.progress) o.progress(++done, total);
      }
      r.correct[i][j] = hits;
    }
  r.accuracy = r.correct.to(at::kDouble) / static_cast<double>(o.n);
  return r;
}

void write_niah(const std::filesystem::path& out, const NiahGridResult& r, const NiahGridOptions& o,
                const std::string& model_fingerprint, const std::string& created_by) {
  io::H5File f = io::H5File::create(out);
  f.set_attr("/", "format", "hydrahead-eval");
  f.set_attr("/", "format_version", int64_t{1});
  f.set_attr("/", "created_by", created_by);
  f.set_attr("/", "model_fingerprint", model_fingerprint);
  f.write("/niah/accuracy", r.accuracy, {"length", "depth"});
  f.write("/niah/correct", r.correct, {"length", "depth"});
  f.write("/niah/lengths", at::tensor(at::ArrayRef<int64_t>(o.lengths), at::TensorOptions().dtype(at::kLong)), {"length"});
  f.write("/niah/depths", at::tensor(at::ArrayRef<double>(o.depths), at::TensorOptions().dtype(at::kDouble)), {"depth"});
  f.set_attr("/niah", "task", o.task);
  f.set_attr("/niah", "n", o.n);
  f.set_attr("/niah", "seed", static_cast<int64_t>(o.seed));
  f.set_attr("/niah", "metric", "exact match of the greedy continuation with the answer tokens");
  f.commit();
}

}  // namespace hh::eval
