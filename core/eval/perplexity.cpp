#include "core/eval/perplexity.h"

#include <torch/torch.h>

#include <nlohmann/json.hpp>

#include <cmath>
#include <cstring>
#include <fstream>

#include "core/model/tokenizer.h"
#include "core/util/error.h"

namespace hh::eval {

PerplexityResult perplexity(const LanguageModel& model, const std::vector<int64_t>& stream, int64_t seq, int64_t chunk,
                            const std::function<void(int64_t done, int64_t total)>& progress,
                            const std::atomic<bool>* cancel) {
  if (seq < 2) throw Error("perplexity: --seq must be at least 2");
  if (chunk < 1) throw Error("perplexity: chunk must be at least 1");
  if (stream.size() < 2) throw Error("perplexity: the data holds fewer than 2 tokens");
  at::NoGradGuard no_grad;
  PerplexityResult r;
  double total = 0;
  // Windows of at least 2 tokens: every full one, and the rest when it has 2 or more.
  const int64_t S = static_cast<int64_t>(stream.size());
  const int64_t windows = S / seq + (S % seq >= 2 ? 1 : 0);
  for (size_t start = 0; start + 1 < stream.size(); start += static_cast<size_t>(seq)) {
    const size_t len = std::min(stream.size() - start, static_cast<size_t>(seq));
    if (len < 2) break;
    if (cancel != nullptr && cancel->load()) throw Cancelled();
    const std::vector<int64_t> window(stream.begin() + static_cast<std::ptrdiff_t>(start),
                                      stream.begin() + static_cast<std::ptrdiff_t>(start + len));
    const at::Tensor ids = at::tensor(at::ArrayRef<int64_t>(window), at::TensorOptions().dtype(at::kLong)).unsqueeze(0);
    const at::Tensor h = model.hidden(ids);                                               // [1, T, d]
    const int64_t predicted = static_cast<int64_t>(len) - 1;                              // rows 0 .. T-2
    const at::Tensor target = ids[0].narrow(0, 1, predicted).to(h.device());             // [T-1]
    at::Tensor sum = at::zeros({}, h.options().dtype(at::kDouble));
    for (int64_t t0 = 0; t0 < predicted; t0 += chunk) {
      const int64_t n = std::min(chunk, predicted - t0);
      const at::Tensor lp = at::log_softmax(model.logits(h.narrow(1, t0, n))[0].to(at::kDouble), -1);  // [n, V]
      sum += lp.gather(1, target.narrow(0, t0, n).unsqueeze(1)).sum();
    }
    total -= sum.item<double>();
    r.tokens += static_cast<int64_t>(len) - 1;
    ++r.windows;
    if (progress) progress(r.windows, windows);
  }
  r.nll = total / static_cast<double>(r.tokens);
  r.ppl = std::exp(r.nll);
  return r;
}

std::vector<int64_t> read_token_stream(const std::filesystem::path& path, const model::Tokenizer* tok, int64_t vocab) {
  const std::string file = path.string();
  std::ifstream in(path, std::ios::binary);
  if (!in) throw Error(file + ": cannot read");
  std::vector<int64_t> out;
  if (path.extension() == ".bin") {
    const std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    if (bytes.size() % 4 != 0) throw Error(file + ": " + std::to_string(bytes.size()) + " bytes is not a whole number of uint32 ids");
    for (size_t i = 0; i < bytes.size(); i += 4) {
      uint32_t v = 0;
      for (int b = 3; b >= 0; --b) v = (v << 8) | static_cast<unsigned char>(bytes[i + static_cast<size_t>(b)]);
      if (static_cast<int64_t>(v) >= vocab)
        throw Error(file + ": token " + std::to_string(i / 4) + " = " + std::to_string(v) + " is outside the vocabulary [0, " +
                    std::to_string(vocab) + ")");
      out.push_back(v);
    }
    return out;
  }
  if (path.extension() != ".jsonl") throw Error(file + ": expected a .bin (uint32 ids) or .jsonl (\"text\" per line) file");
  if (tok == nullptr) throw Error(file + ": text needs the model's tokenizer.json");
  std::string line;
  int64_t n = 0;
  while (std::getline(in, line)) {
    ++n;
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    nlohmann::json j;
    try {
      j = nlohmann::json::parse(line);
    } catch (const nlohmann::json::exception& e) {
      throw Error(file + ":" + std::to_string(n) + ": not valid JSON: " + e.what());
    }
    if (!j.is_object() || !j.contains("text") || !j["text"].is_string())
      throw Error(file + ":" + std::to_string(n) + ": expected an object with a \"text\" string");
    const auto ids = tok->encode(j["text"].get<std::string>());
    out.insert(out.end(), ids.begin(), ids.end());
  }
  return out;
}

}  // namespace hh::eval
