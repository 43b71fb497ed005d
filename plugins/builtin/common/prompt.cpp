#include "common/prompt.h"

#include <algorithm>
#include <numeric>

namespace hh::builtin {

sdk::Json span_json(Span s) { return sdk::Json::array({s.begin, s.end}); }

Piece& Piece::text(const sdk::Tokenizer& tok, std::string_view s) { return ids(tok.encode(s)); }

Piece& Piece::ids(const std::vector<int64_t>& same) {
  clean_.insert(clean_.end(), same.begin(), same.end());
  corrupt_.insert(corrupt_.end(), same.begin(), same.end());
  return *this;
}

Span Piece::varying(const sdk::Tokenizer& tok, std::string_view clean, std::string_view corrupt) {
  const std::vector<int64_t> a = tok.encode(clean), b = tok.encode(corrupt);
  if (a.size() != b.size()) {
    throw sdk::Error("\"" + std::string(clean) + "\" and \"" + std::string(corrupt) + "\" tokenise to " +
                     std::to_string(a.size()) + " and " + std::to_string(b.size()) + " tokens");
  }
  return varying_ids(a, b);
}

Span Piece::varying_ids(const std::vector<int64_t>& clean, const std::vector<int64_t>& corrupt) {
  if (clean.size() != corrupt.size()) throw sdk::Error("clean and corrupt ids differ in length");
  const Span s{size(), size() + static_cast<int64_t>(clean.size())};
  clean_.insert(clean_.end(), clean.begin(), clean.end());
  corrupt_.insert(corrupt_.end(), corrupt.begin(), corrupt.end());
  if (clean != corrupt) diff_.push_back(s);
  return s;
}

double Prompt::insert_depth(size_t i) const {
  return filler_tokens == 0 ? 0.0 : static_cast<double>(insert_offsets.at(i)) / static_cast<double>(filler_tokens);
}

Prompt assemble(const Piece& head, const Filler& filler, const std::vector<Insert>& inserts, const Piece& tail) {
  Prompt p;
  int64_t total = head.size() + filler.tokens() + tail.size();
  for (const Insert& in : inserts) {
    if (in.boundary >= filler.num_boundaries()) throw sdk::Error("insert boundary out of range");
    total += in.piece.size();
  }
  p.clean.reserve(static_cast<size_t>(total));
  p.corrupt.reserve(static_cast<size_t>(total));
  p.inserts.resize(inserts.size());
  p.insert_offsets.resize(inserts.size());

  auto append = [&p](const Piece& piece) {
    const int64_t at = p.length();
    p.clean.insert(p.clean.end(), piece.clean().begin(), piece.clean().end());
    p.corrupt.insert(p.corrupt.end(), piece.corrupt().begin(), piece.corrupt().end());
    for (Span d : piece.diff()) p.diff.push_back(d.shifted(at));
    return Span{at, p.length()};
  };

  // Inserts by boundary, ties in the order given (a stable order, so the layout is reproducible).
  std::vector<size_t> order(inserts.size());
  std::iota(order.begin(), order.end(), size_t{0});
  std::stable_sort(order.begin(), order.end(),
                   [&](size_t a, size_t b) { return inserts[a].boundary < inserts[b].boundary; });

  append(head);
  p.head_tokens = head.size();
  size_t next = 0;
  for (size_t b = 0; b < filler.num_boundaries(); ++b) {
    for (; next < order.size() && inserts[order[next]].boundary == b; ++next) {
      p.inserts[order[next]] = append(inserts[order[next]].piece);
      p.insert_offsets[order[next]] = filler.offsets[b];
    }
    if (b < filler.units.size()) {
      const auto& u = filler.units[b];
      p.clean.insert(p.clean.end(), u.begin(), u.end());
      p.corrupt.insert(p.corrupt.end(), u.begin(), u.end());
    }
  }
  append(tail);
  p.tail_tokens = tail.size();
  p.filler_tokens = filler.tokens();
  std::sort(p.diff.begin(), p.diff.end(), [](Span a, Span b) { return a.begin < b.begin; });
  return p;
}

int64_t filler_budget(int64_t length, int64_t fixed_tokens, std::string_view what) {
  if (fixed_tokens > length) {
    throw sdk::Error("length " + std::to_string(length) + " is too small: " + std::string(what) + " take " +
                     std::to_string(fixed_tokens) +
                     " tokens with this tokenizer (use length >= " + std::to_string(fixed_tokens) + ")");
  }
  return length - fixed_tokens;
}

Answer split_answer(const std::vector<int64_t>& answer, const std::vector<int64_t>& wrong) {
  size_t common = 0;
  while (common < answer.size() && common < wrong.size() && answer[common] == wrong[common]) ++common;
  if (common == answer.size() || common == wrong.size()) {
    throw sdk::Error("the corrupt answer is a prefix of the clean answer (or the other way round)");
  }
  Answer a;
  a.prompt_suffix.assign(answer.begin(), answer.begin() + static_cast<std::ptrdiff_t>(common));
  a.answer.assign(answer.begin() + static_cast<std::ptrdiff_t>(common), answer.end());
  a.wrong.assign(wrong.begin() + static_cast<std::ptrdiff_t>(common), wrong.end());
  return a;
}

sdk::Example make_example(const sdk::Tokenizer& tok, const Prompt& prompt, const Answer& answer,
                          const sdk::Json& meta) {
  sdk::Example ex;
  ex.clean_ids = prompt.clean;
  ex.corrupt_ids = prompt.corrupt;
  ex.answer_ids = answer.answer;
  ex.wrong_ids = answer.wrong;
  ex.clean = tok.decode(prompt.clean);
  ex.corrupt = tok.decode(prompt.corrupt);
  ex.answer = tok.decode(answer.answer);
  ex.wrong = tok.decode(answer.wrong);

  sdk::Json m = meta;
  m["length"] = prompt.length();
  m["header_tokens"] = prompt.head_tokens;
  m["question_tokens"] = prompt.tail_tokens;  // includes the answer prefix
  m["answer_prefix_tokens"] = static_cast<int64_t>(answer.prompt_suffix.size());
  sdk::Json diff = sdk::Json::array();
  for (Span d : prompt.diff) diff.push_back(span_json(d));
  m["diff_spans"] = diff;
  ex.meta = std::move(m);
  return ex;
}

sdk::Json base_meta(int64_t index, uint64_t seed, const char* haystack) {
  sdk::Json m = sdk::Json::object();
  m["index"] = index;
  m["seed"] = seed;
  m["haystack"] = haystack;
  return m;
}

}  // namespace hh::builtin
