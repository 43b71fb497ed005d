// hydrahead tokenize (--tokenizer FILE | --model DIR) (--text "..." | --decode 1,2,3)
#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <cstdio>
#include <filesystem>

#include "app/cli/commands.h"
#include "core/model/tokenizer.h"
#include "core/util/error.h"

namespace hh::cli {
namespace {

struct TokenizeArgs {
  std::string tokenizer, model, text, decode;
};

int run_tokenize(const TokenizeArgs& a) {
  std::filesystem::path file = a.tokenizer;
  if (file.empty()) file = std::filesystem::path(a.model) / "tokenizer.json";
  const auto tok = model::Tokenizer::load(file);
  if (!a.decode.empty()) {
    std::vector<int64_t> ids;
    for (long long v : parse_id_list(a.decode, "--decode")) ids.push_back(v);
    const std::string text = tok.decode(ids);
    std::fwrite(text.data(), 1, text.size(), stdout);
    std::fputc('\n', stdout);
    return kExitOk;
  }
  const auto ids = tok.encode(a.text);
  std::printf("%s\n", nlohmann::json(ids).dump().c_str());
  return kExitOk;
}

}  // namespace

Runner add_tokenize(CLI::App& app) {
  auto args = std::make_shared<TokenizeArgs>();
  auto* t = app.add_option("--tokenizer", args->tokenizer, "tokenizer.json file");
  auto* m = app.add_option("--model", args->model, "Checkpoint directory holding tokenizer.json");
  t->excludes(m);
  m->excludes(t);
  auto* text = app.add_option("--text", args->text, "Text to encode; prints the ids as one JSON array");
  auto* dec = app.add_option("--decode", args->decode, "Comma-separated ids to decode; prints the text");
  text->excludes(dec);
  dec->excludes(text);
  app.callback([t, m, text, dec] {
    if (t->count() + m->count() == 0) throw CLI::RequiredError("--tokenizer or --model");
    if (text->count() + dec->count() == 0) throw CLI::RequiredError("--text or --decode");
  });
  return [args] { return run_tokenize(*args); };
}

}  // namespace hh::cli
