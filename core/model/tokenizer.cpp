// Byte-level BPE from an HF tokenizer.json. The pipeline follows HF tokenizers' order:
//   raw text -> split out non-normalized added tokens -> normalizer (NFC) per remaining piece
//   -> split out normalized added tokens -> pre-tokenizer (regex splits, byte-level) -> BPE merges.
// Pieces are kept as byte ranges into one buffer; byte-level mapping never materialises strings on
// the hot path because every byte maps to exactly one vocabulary symbol.
#include "core/model/tokenizer.h"

#include <algorithm>
#include <array>
#include <cstring>
#include <fstream>
#include <limits>
#include <mutex>
#include <shared_mutex>
#include <queue>
#include <tuple>
#include <unordered_map>

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include <nlohmann/json.hpp>

#include "core/util/error.h"

namespace hh::model {
namespace {

#include "unicode_tables.inc"

using json = nlohmann::json;

// ---- UTF-8 ---------------------------------------------------------------------------------

constexpr uint32_t kReplacementChar = 0xFFFD;

// Length of the well-formed sequence starting at p (Unicode table 3-7), or 0 with `*subpart` set to
// the length of the maximal ill-formed prefix (at least 1) that one U+FFFD replaces.
size_t utf8_sequence(const unsigned char* p, size_t n, size_t* subpart) {
  const unsigned char b0 = p[0];
  if (b0 < 0x80) return 1;
  size_t need = 0;
  unsigned char lo = 0x80, hi = 0xBF;
  if (b0 >= 0xC2 && b0 <= 0xDF) {
    need = 1;
  } else if (b0 >= 0xE0 && b0 <= 0xEF) {
    need = 2;
    if (b0 == 0xE0) lo = 0xA0;
    if (b0 == 0xED) hi = 0x9F;
  } else if (b0 >= 0xF0 && b0 <= 0xF4) {
    need = 3;
    if (b0 == 0xF0) lo = 0x90;
    if (b0 == 0xF4) hi = 0x8F;
  } else {
    *subpart = 1;
    return 0;
  }
  size_t i = 1;
  for (; i <= need; ++i) {
    if (i >= n) break;
    const unsigned char b = p[i];
    const unsigned char l = i == 1 ? lo : 0x80, h = i == 1 ? hi : 0xBF;
    if (b < l || b > h) break;
  }
  if (i == need + 1) return i;
  *subpart = i;
  return 0;
}

void append_utf8(std::string& out, uint32_t cp) {
  if (cp < 0x80) {
    out.push_back(static_cast<char>(cp));
  } else if (cp < 0x800) {
    out.push_back(static_cast<char>(0xC0 | (cp >> 6)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else if (cp < 0x10000) {
    out.push_back(static_cast<char>(0xE0 | (cp >> 12)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else {
    out.push_back(static_cast<char>(0xF0 | (cp >> 18)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 12) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  }
}

// Returns `text` itself when it is valid UTF-8, else a repaired copy stored in `storage`.
std::string_view valid_utf8(std::string_view text, std::string& storage) {
  const auto* p = reinterpret_cast<const unsigned char*>(text.data());
  const size_t n = text.size();
  size_t i = 0;
  while (i < n) {
    if (p[i] < 0x80) { ++i; continue; }
    size_t bad = 0;
    const size_t len = utf8_sequence(p + i, n - i, &bad);
    if (len == 0) break;
    i += len;
  }
  if (i == n) return text;
  storage.assign(text.data(), i);
  while (i < n) {
    size_t bad = 0;
    const size_t len = utf8_sequence(p + i, n - i, &bad);
    if (len == 0) {
      append_utf8(storage, kReplacementChar);
      i += bad;
    } else {
      storage.append(text.data() + i, len);
      i += len;
    }
  }
  return storage;
}

// Decodes the code point at s[i] of valid UTF-8 and advances i.
inline uint32_t next_code_point(std::string_view s, size_t& i) {
  const auto* p = reinterpret_cast<const unsigned char*>(s.data());
  const unsigned char b0 = p[i];
  if (b0 < 0x80) { ++i; return b0; }
  if (b0 < 0xE0) {
    const uint32_t cp = ((b0 & 0x1Fu) << 6) | (p[i + 1] & 0x3Fu);
    i += 2;
    return cp;
  }
  if (b0 < 0xF0) {
    const uint32_t cp = ((b0 & 0x0Fu) << 12) | ((p[i + 1] & 0x3Fu) << 6) | (p[i + 2] & 0x3Fu);
    i += 3;
    return cp;
  }
  const uint32_t cp = ((b0 & 0x07u) << 18) | ((p[i + 1] & 0x3Fu) << 12) | ((p[i + 2] & 0x3Fu) << 6) |
                      (p[i + 3] & 0x3Fu);
  i += 4;
  return cp;
}

// Start of the code point that ends at s[end - 1].
inline size_t previous_code_point_start(std::string_view s, size_t end) {
  size_t i = end - 1;
  while (i > 0 && (static_cast<unsigned char>(s[i]) & 0xC0) == 0x80) --i;
  return i;
}

// Unicode White_Space, the set Rust's and Oniguruma's `\s` use.
bool is_white_space(uint32_t cp) {
  return (cp >= 0x09 && cp <= 0x0D) || cp == 0x20 || cp == 0x85 || cp == 0xA0 || cp == 0x1680 ||
         (cp >= 0x2000 && cp <= 0x200A) || cp == 0x2028 || cp == 0x2029 || cp == 0x202F ||
         cp == 0x205F || cp == 0x3000;
}

// ---- NFC -----------------------------------------------------------------------------------

constexpr uint32_t kFirstNonTrivial = 0x300;  // below: combining class 0 and NFC_QC Yes
constexpr uint32_t kFirstDecomposable = 0xC0;
constexpr uint32_t kHangulSBase = 0xAC00, kHangulLBase = 0x1100, kHangulVBase = 0x1161,
                   kHangulTBase = 0x11A7;
constexpr uint32_t kHangulLCount = 19, kHangulVCount = 21, kHangulTCount = 28;
constexpr uint32_t kHangulNCount = kHangulVCount * kHangulTCount;  // 588
constexpr uint32_t kHangulSCount = kHangulLCount * kHangulNCount;  // 11172

template <typename Range, size_t N>
const Range* find_range(const Range (&table)[N], uint32_t cp) {
  const Range* end = table + N;
  const Range* it =
      std::upper_bound(table, end, cp, [](uint32_t v, const Range& r) { return v < r.first; });
  if (it == table) return nullptr;
  --it;
  return cp <= it->last ? it : nullptr;
}

uint8_t combining_class(uint32_t cp) {
  if (cp < kFirstNonTrivial) return 0;
  const CccRange* r = find_range(kCccRanges, cp);
  return r ? r->ccc : 0;
}

uint8_t nfc_quick_check(uint32_t cp) {  // 0 Yes, 1 No, 2 Maybe
  if (cp < kFirstNonTrivial) return 0;
  const QcRange* r = find_range(kNfcQcRanges, cp);
  return r ? r->kind : 0;
}

void decompose(uint32_t cp, std::vector<uint32_t>& out) {
  if (cp >= kHangulSBase && cp < kHangulSBase + kHangulSCount) {
    const uint32_t s = cp - kHangulSBase;
    out.push_back(kHangulLBase + s / kHangulNCount);
    out.push_back(kHangulVBase + (s % kHangulNCount) / kHangulTCount);
    if (s % kHangulTCount != 0) out.push_back(kHangulTBase + s % kHangulTCount);
    return;
  }
  if (cp >= kFirstDecomposable) {
    const DecompEntry* end = std::end(kDecompIndex);
    const DecompEntry* it = std::lower_bound(std::begin(kDecompIndex), end, cp,
                                             [](const DecompEntry& e, uint32_t v) { return e.cp < v; });
    if (it != end && it->cp == cp) {
      out.insert(out.end(), kDecompPool + it->offset, kDecompPool + it->offset + it->len);
      return;
    }
  }
  out.push_back(cp);
}

// Primary composite of (a, b), or 0 when there is none.
uint32_t compose(uint32_t a, uint32_t b) {
  if (a >= kHangulLBase && a < kHangulLBase + kHangulLCount && b >= kHangulVBase &&
      b < kHangulVBase + kHangulVCount) {
    return kHangulSBase + ((a - kHangulLBase) * kHangulVCount + (b - kHangulVBase)) * kHangulTCount;
  }
  if (a >= kHangulSBase && a < kHangulSBase + kHangulSCount && (a - kHangulSBase) % kHangulTCount == 0 &&
      b > kHangulTBase && b < kHangulTBase + kHangulTCount) {
    return a + (b - kHangulTBase);
  }
  const Composition* end = std::end(kCompositions);
  const Composition* it = std::lower_bound(
      std::begin(kCompositions), end, std::make_pair(a, b), [](const Composition& c, const std::pair<uint32_t, uint32_t>& v) {
        return c.first < v.first || (c.first == v.first && c.second < v.second);
      });
  return (it != end && it->first == a && it->second == b) ? it->composite : 0;
}

// UAX #15 quick check: true when `s` (valid UTF-8) is certainly NFC already.
bool is_nfc_quick(std::string_view s) {
  uint8_t last_ccc = 0;
  size_t i = 0;
  while (i < s.size()) {
    if (static_cast<unsigned char>(s[i]) < 0x80) {
      ++i;
      last_ccc = 0;
      continue;
    }
    const uint32_t cp = next_code_point(s, i);
    if (cp < kFirstNonTrivial) { last_ccc = 0; continue; }
    const uint8_t ccc = combining_class(cp);
    if (ccc != 0 && last_ccc > ccc) return false;
    if (nfc_quick_check(cp) != 0) return false;
    last_ccc = ccc;
  }
  return true;
}

std::string nfc_valid(std::string_view s) {
  if (is_nfc_quick(s)) return std::string(s);
  // Canonical decomposition.
  std::vector<uint32_t> cps;
  cps.reserve(s.size() + 8);
  for (size_t i = 0; i < s.size();) decompose(next_code_point(s, i), cps);
  std::vector<uint8_t> ccc(cps.size());
  for (size_t i = 0; i < cps.size(); ++i) ccc[i] = combining_class(cps[i]);
  // Canonical ordering: stable sort of each run of non-starters by combining class (a sort, not
  // insertion, so that a long adversarial run of marks stays O(n log n)).
  std::vector<std::pair<uint8_t, uint32_t>> run;
  for (size_t i = 0; i < cps.size();) {
    if (ccc[i] == 0) { ++i; continue; }
    size_t j = i + 1;
    bool sorted = true;
    for (; j < cps.size() && ccc[j] != 0; ++j) sorted = sorted && ccc[j - 1] <= ccc[j];
    if (!sorted) {
      run.clear();
      for (size_t k = i; k < j; ++k) run.emplace_back(ccc[k], cps[k]);
      std::stable_sort(run.begin(), run.end(), [](const auto& x, const auto& y) { return x.first < y.first; });
      for (size_t k = i; k < j; ++k) std::tie(ccc[k], cps[k]) = run[k - i];
    }
    i = j;
  }
  // Canonical composition: a mark joins the last starter unless something between them is blocking.
  std::string out;
  out.reserve(s.size());
  std::vector<uint32_t> composed;
  composed.reserve(cps.size());
  ptrdiff_t starter = -1;
  int last_ccc = -1;  // combining class of the last character kept after the starter; -1 = none
  for (size_t i = 0; i < cps.size(); ++i) {
    const int c = ccc[i];
    if (starter >= 0 && (last_ccc == -1 || (last_ccc != 0 && last_ccc < c))) {
      const uint32_t comp = compose(composed[starter], cps[i]);
      if (comp != 0) {
        composed[starter] = comp;
        continue;
      }
    }
    if (c == 0) {
      starter = static_cast<ptrdiff_t>(composed.size());
      last_ccc = -1;
    } else {
      last_ccc = c;
    }
    composed.push_back(cps[i]);
  }
  for (uint32_t cp : composed) append_utf8(out, cp);
  return out;
}

// ---- byte-level alphabet (GPT-2's bytes_to_unicode) ----------------------------------------

struct ByteAlphabet {
  std::array<uint32_t, 256> byte_to_cp{};
  std::array<int16_t, 324> cp_to_byte{};  // every mapped code point is below 256 + 68

  ByteAlphabet() {
    cp_to_byte.fill(-1);
    uint32_t extra = 256;
    for (uint32_t b = 0; b < 256; ++b) {
      const bool printable = (b >= 0x21 && b <= 0x7E) || (b >= 0xA1 && b <= 0xAC) || b >= 0xAE;
      byte_to_cp[b] = printable ? b : extra++;
      cp_to_byte[byte_to_cp[b]] = static_cast<int16_t>(b);
    }
  }
  std::string symbol(unsigned char b) const {
    std::string s;
    append_utf8(s, byte_to_cp[b]);
    return s;
  }
  // Bytes behind a vocabulary token, or nullopt when a character is outside the alphabet.
  std::optional<std::string> bytes_of(std::string_view token) const {
    std::string out;
    out.reserve(token.size());
    for (size_t i = 0; i < token.size();) {
      const uint32_t cp = next_code_point(token, i);
      if (cp >= cp_to_byte.size() || cp_to_byte[cp] < 0) return std::nullopt;
      out.push_back(static_cast<char>(cp_to_byte[cp]));
    }
    return out;
  }
};

const ByteAlphabet& byte_alphabet() {
  static const ByteAlphabet alphabet;
  return alphabet;
}

// ---- PCRE2 ---------------------------------------------------------------------------------

struct CodeDeleter {
  void operator()(pcre2_code* c) const { pcre2_code_free(c); }
};
struct MatchDataDeleter {
  void operator()(pcre2_match_data* m) const { pcre2_match_data_free(m); }
};
using MatchData = std::unique_ptr<pcre2_match_data, MatchDataDeleter>;

std::string pcre2_message(int code) {
  PCRE2_UCHAR buf[256];
  if (pcre2_get_error_message(code, buf, sizeof(buf)) < 0) return "error " + std::to_string(code);
  return reinterpret_cast<const char*>(buf);
}

class Regex {
 public:
  Regex(const std::string& pattern, bool literal, const std::string& where) : where_(where) {
    int err = 0;
    PCRE2_SIZE err_offset = 0;
    const uint32_t options = literal ? (PCRE2_UTF | PCRE2_LITERAL) : (PCRE2_UTF | PCRE2_UCP);
    pcre2_code* code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.data()), pattern.size(),
                                     options, &err, &err_offset, nullptr);
    if (code == nullptr) {
      throw Error(where + ": regex /" + pattern + "/ does not compile at offset " +
                  std::to_string(err_offset) + ": " + pcre2_message(err));
    }
    code_.reset(code);
    pcre2_jit_compile(code, PCRE2_JIT_COMPLETE);  // the interpreter is the fallback
  }

  // First match at or after `from` in subject (valid UTF-8); false when none.
  bool find(std::string_view subject, size_t from, pcre2_match_data* md, size_t& begin,
            size_t& end) const {
    const int rc = pcre2_match(code_.get(), reinterpret_cast<PCRE2_SPTR>(subject.data()),
                               subject.size(), from, PCRE2_NO_UTF_CHECK, md, nullptr);
    if (rc == PCRE2_ERROR_NOMATCH) return false;
    // rc == 0 only says the one-pair match data had no room for capture groups.
    if (rc < 0) throw Error(where_ + ": regex match failed: " + pcre2_message(rc));
    const PCRE2_SIZE* ov = pcre2_get_ovector_pointer(md);
    begin = ov[0];
    end = ov[1];
    return true;
  }

  // Anchored match of the whole code point at s[pos].
  bool matches_at(std::string_view s, size_t pos, pcre2_match_data* md) const {
    const int rc = pcre2_match(code_.get(), reinterpret_cast<PCRE2_SPTR>(s.data()), s.size(), pos,
                               PCRE2_NO_UTF_CHECK | PCRE2_ANCHORED, md, nullptr);
    return rc >= 0;
  }

 private:
  std::string where_;
  std::unique_ptr<pcre2_code, CodeDeleter> code_;
};

// ---- pre-tokenizer -------------------------------------------------------------------------

enum class Behavior { kRemoved, kIsolated, kMergedWithPrevious, kMergedWithNext, kContiguous };

struct Piece {
  size_t begin, end;  // byte range into the pre-tokenizer buffer
};

struct PreStep {
  enum class Kind { kSplit, kPrefixSpace } kind = Kind::kSplit;
  std::unique_ptr<Regex> regex;
  Behavior behavior = Behavior::kIsolated;
  bool invert = false;
};

// One split step over every piece, as HF's Split pre-tokenizer with the given behavior.
void split_pieces(const PreStep& step, const std::string& buf, std::vector<Piece>& pieces,
                  std::vector<Piece>& scratch, pcre2_match_data* md) {
  scratch.clear();
  struct Part { size_t begin, end; bool delim; };
  std::vector<Part> parts;
  for (const Piece& p : pieces) {
    const std::string_view sub(buf.data() + p.begin, p.end - p.begin);
    parts.clear();
    size_t prev = 0, from = 0, mb = 0, me = 0;
    while (from <= sub.size() && step.regex->find(sub, from, md, mb, me)) {
      if (me == mb) {  // an empty match splits nothing; step over one code point
        if (mb >= sub.size()) break;
        size_t next = mb;
        next_code_point(sub, next);
        from = next;
        continue;
      }
      if (mb > prev) parts.push_back({prev, mb, step.invert});
      parts.push_back({mb, me, !step.invert});
      prev = from = me;
    }
    if (prev < sub.size()) parts.push_back({prev, sub.size(), step.invert});

    const size_t base = p.begin;
    auto emit = [&](size_t b, size_t e) {
      if (e > b) scratch.push_back({base + b, base + e});
    };
    switch (step.behavior) {
      case Behavior::kRemoved:
        for (const Part& pt : parts)
          if (!pt.delim) emit(pt.begin, pt.end);
        break;
      case Behavior::kIsolated:
        for (const Part& pt : parts) emit(pt.begin, pt.end);
        break;
      case Behavior::kMergedWithPrevious: {
        size_t start = 0;
        bool open = false;
        for (const Part& pt : parts) {
          if (!open) { start = pt.begin; open = true; }
          if (pt.delim) { emit(start, pt.end); open = false; }
        }
        if (open) emit(start, sub.size());
        break;
      }
      case Behavior::kMergedWithNext: {
        size_t start = 0;
        bool open = false;
        for (const Part& pt : parts) {
          if (pt.delim) {
            if (open) emit(start, pt.begin);
            start = pt.begin;
            open = true;
          } else if (!open) {
            emit(pt.begin, pt.end);
          } else {
            emit(start, pt.end);
            open = false;
          }
        }
        if (open) emit(start, sub.size());
        break;
      }
      case Behavior::kContiguous: {
        size_t i = 0;
        while (i < parts.size()) {
          size_t j = i + 1;
          if (parts[i].delim)
            while (j < parts.size() && parts[j].delim) ++j;
          emit(parts[i].begin, parts[j - 1].end);
          i = j;
        }
        break;
      }
    }
  }
  pieces.swap(scratch);
}

// ---- added tokens --------------------------------------------------------------------------

struct AddedToken {
  int64_t id = 0;
  std::string content;
  bool single_word = false, lstrip = false, rstrip = false, normalized = false, special = false;
};

struct Segment {
  size_t begin, end;
  int64_t id;  // -1: ordinary text
};

// Leftmost-longest matching of a set of literal strings, then HF's AddedVocabulary rules.
class AddedTokenMatcher {
 public:
  void add(const AddedToken* token, std::string pattern) {
    if (pattern.empty()) return;
    const auto first = static_cast<unsigned char>(pattern[0]);
    by_first_byte_[first].push_back({token, std::move(pattern)});
    any_ = true;
  }
  void finish() {
    for (auto& list : by_first_byte_) {
      std::stable_sort(list.begin(), list.end(), [](const Entry& a, const Entry& b) {
        return a.pattern.size() > b.pattern.size();
      });
    }
  }
  bool empty() const { return !any_; }

  void split(std::string_view s, std::vector<Segment>& out, const Regex* word_char,
             pcre2_match_data* word_md) const {
    out.clear();
    size_t start_offset = 0;
    size_t i = 0;
    while (i < s.size()) {
      const auto& list = by_first_byte_[static_cast<unsigned char>(s[i])];
      const Entry* hit = nullptr;
      for (const Entry& e : list) {
        if (s.size() - i >= e.pattern.size() && std::memcmp(s.data() + i, e.pattern.data(), e.pattern.size()) == 0) {
          hit = &e;
          break;
        }
      }
      if (hit == nullptr) { ++i; continue; }
      size_t start = i, stop = i + hit->pattern.size();
      i = stop;  // matches never overlap, even when one is discarded below
      if (start < start_offset) continue;
      const AddedToken& tok = *hit->token;
      if (tok.single_word) {
        const bool word_before = start > 0 && word_char &&
                                 word_char->matches_at(s, previous_code_point_start(s, start), word_md);
        const bool word_after = stop < s.size() && word_char && word_char->matches_at(s, stop, word_md);
        if (word_before || word_after) continue;
      }
      if (tok.lstrip) {
        size_t b = start;
        while (b > start_offset) {
          const size_t prev = previous_code_point_start(s, b);
          size_t k = prev;
          if (!is_white_space(next_code_point(s, k))) break;
          b = prev;
        }
        start = b;
      }
      if (tok.rstrip) {
        while (stop < s.size()) {
          size_t k = stop;
          if (!is_white_space(next_code_point(s, k))) break;
          stop = k;
        }
        i = std::max(i, stop);
      }
      if (start_offset < start) out.push_back({start_offset, start, -1});
      out.push_back({start, stop, tok.id});
      start_offset = stop;
    }
    if (start_offset < s.size()) out.push_back({start_offset, s.size(), -1});
  }

 private:
  struct Entry {
    const AddedToken* token;
    std::string pattern;
  };
  std::array<std::vector<Entry>, 256> by_first_byte_;
  bool any_ = false;
};

// ---- BPE -----------------------------------------------------------------------------------

struct MergeInfo {
  int32_t rank;
  int32_t new_id;
};

inline uint64_t pair_key(int32_t a, int32_t b) {
  return (static_cast<uint64_t>(static_cast<uint32_t>(a)) << 32) | static_cast<uint32_t>(b);
}

constexpr size_t kCacheMaxWordBytes = 256;      // longer words are rare and not worth caching
constexpr size_t kCacheMaxEntries = 1u << 17;   // cleared wholesale when full

struct State {
  std::string where;
  // model
  std::unordered_map<std::string, int32_t> vocab;   // byte-level token string -> id
  std::unordered_map<uint64_t, MergeInfo> merges;   // (left id, right id) -> rank, merged id
  std::array<int32_t, 256> byte_id{};               // id of each single-byte symbol, -1 when absent
  int32_t unk_id = -1;
  bool fuse_unk = false;
  bool ignore_merges = false;
  // pipeline
  bool nfc = false;
  std::vector<PreStep> pre_steps;
  std::vector<AddedToken> added;
  AddedTokenMatcher raw_matcher, normalized_matcher;
  std::unique_ptr<Regex> word_char;  // only when a token is single_word
  // reverse maps
  std::vector<std::string> id_bytes;   // decoded bytes per id
  std::vector<std::string> id_token;   // raw token string per id
  std::vector<uint8_t> id_present;
  std::unordered_map<std::string, int64_t> added_by_content;
  // cache: word bytes -> ids
  mutable std::shared_mutex cache_mutex;  // readers share; an insert is exclusive
  mutable std::unordered_map<std::string, std::vector<int32_t>> cache;

  void bpe_word(std::string_view word, std::vector<int64_t>& out) const;
  void encode_text(std::string_view text, std::vector<int64_t>& out, pcre2_match_data* md) const;
};

struct Symbol {
  int32_t id;
  int32_t prev, next;
  int32_t len;  // 0 once merged into its left neighbour
};

struct QueuedMerge {
  int32_t rank, pos, new_id;
  bool operator>(const QueuedMerge& o) const { return rank != o.rank ? rank > o.rank : pos > o.pos; }
};

void State::bpe_word(std::string_view word, std::vector<int64_t>& out) const {
  if (word.empty()) return;
  if (ignore_merges) {
    std::string symbols;
    for (unsigned char b : word) append_utf8(symbols, byte_alphabet().byte_to_cp[b]);
    const auto it = vocab.find(symbols);
    if (it != vocab.end()) {
      out.push_back(it->second);
      return;
    }
  }
  const bool cacheable = word.size() <= kCacheMaxWordBytes;
  std::string key;
  if (cacheable) {
    key.assign(word.data(), word.size());
    std::shared_lock<std::shared_mutex> lock(cache_mutex);
    const auto it = cache.find(key);
    if (it != cache.end()) {
      out.insert(out.end(), it->second.begin(), it->second.end());
      return;
    }
  }

  std::vector<Symbol> sym;
  sym.reserve(word.size());
  for (unsigned char b : word) {
    int32_t id = byte_id[b];
    if (id < 0) {
      // As HF: a symbol missing from the vocabulary becomes unk_token, or is dropped without one.
      if (unk_id < 0) continue;
      if (fuse_unk && !sym.empty() && sym.back().id == unk_id) {
        sym.back().len += 1;
        continue;
      }
      id = unk_id;
    }
    const auto n = static_cast<int32_t>(sym.size());
    sym.push_back({id, n - 1, -1, 1});
    if (n > 0) sym[n - 1].next = n;
  }

  std::priority_queue<QueuedMerge, std::vector<QueuedMerge>, std::greater<QueuedMerge>> queue;
  auto push_pair = [&](int32_t left) {
    const int32_t right = sym[left].next;
    if (right < 0) return;
    const auto it = merges.find(pair_key(sym[left].id, sym[right].id));
    if (it != merges.end()) queue.push({it->second.rank, left, it->second.new_id});
  };
  for (int32_t i = 0; i + 1 < static_cast<int32_t>(sym.size()); ++i) push_pair(i);

  while (!queue.empty()) {
    const QueuedMerge top = queue.top();
    queue.pop();
    Symbol& left = sym[top.pos];
    if (left.len == 0 || left.next < 0) continue;
    const int32_t r = left.next;
    const auto it = merges.find(pair_key(left.id, sym[r].id));
    if (it == merges.end() || it->second.rank != top.rank || it->second.new_id != top.new_id) continue;
    left.id = top.new_id;
    left.len += sym[r].len;
    left.next = sym[r].next;
    sym[r].len = 0;
    if (left.next >= 0) sym[left.next].prev = top.pos;
    if (left.prev >= 0) push_pair(left.prev);
    push_pair(top.pos);
  }

  std::vector<int32_t> ids;
  for (int32_t i = sym.empty() ? -1 : 0; i >= 0; i = sym[i].next) ids.push_back(sym[i].id);
  out.insert(out.end(), ids.begin(), ids.end());
  if (cacheable) {
    std::unique_lock<std::shared_mutex> lock(cache_mutex);
    if (cache.size() >= kCacheMaxEntries) cache.clear();
    cache.emplace(std::move(key), std::move(ids));
  }
}

void State::encode_text(std::string_view text, std::vector<int64_t>& out, pcre2_match_data* md) const {
  if (text.empty()) return;
  std::string buf;
  if (pre_steps.empty()) {
    bpe_word(text, out);
    return;
  }
  buf.assign(text.data(), text.size());
  std::vector<Piece> pieces{{0, buf.size()}}, scratch;
  for (const PreStep& step : pre_steps) {
    if (step.kind == PreStep::Kind::kPrefixSpace) {
      for (Piece& p : pieces) {
        if (p.end > p.begin && buf[p.begin] == ' ') continue;
        const size_t start = buf.size();
        buf.push_back(' ');
        buf.append(buf, p.begin, p.end - p.begin);
        p = {start, buf.size()};
      }
      continue;
    }
    split_pieces(step, buf, pieces, scratch, md);
  }
  for (const Piece& p : pieces) bpe_word(std::string_view(buf.data() + p.begin, p.end - p.begin), out);
}

// ---- loading -------------------------------------------------------------------------------


std::string field_error(const std::string& where, const std::string& field, const std::string& what) {
  return where + ": " + field + ": " + what;
}

bool get_bool(const json& obj, const char* key, bool fallback, const std::string& where,
              const std::string& field) {
  const auto it = obj.find(key);
  if (it == obj.end() || it->is_null()) return fallback;
  if (!it->is_boolean()) throw Error(field_error(where, field + "." + key, "expected true or false"));
  return it->get<bool>();
}

bool is_valid_id(const json& v) {
  return v.is_number_integer() && v.get<int64_t>() >= 0 &&
         v.get<int64_t>() <= std::numeric_limits<int32_t>::max();
}

int32_t get_id(const json& v, const std::string& where, const std::string& field) {
  if (!is_valid_id(v))
    throw Error(field_error(where, field, "expected a non-negative integer id, got " + v.dump()));
  return static_cast<int32_t>(v.get<int64_t>());
}

Behavior parse_behavior(const json& v, const std::string& where, const std::string& field) {
  const std::string b = v.is_string() ? v.get<std::string>() : v.dump();
  if (b == "Removed") return Behavior::kRemoved;
  if (b == "Isolated") return Behavior::kIsolated;
  if (b == "MergedWithPrevious") return Behavior::kMergedWithPrevious;
  if (b == "MergedWithNext") return Behavior::kMergedWithNext;
  if (b == "Contiguous") return Behavior::kContiguous;
  throw Error(field_error(where, field, "unknown split behavior " + v.dump()));
}

constexpr const char* kGpt2Pattern =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

void parse_normalizer(const json& n, const std::string& where, const std::string& field, bool& nfc) {
  if (n.is_null()) return;
  if (!n.is_object() || !n.contains("type") || !n["type"].is_string())
    throw Error(field_error(where, field, "expected an object with a \"type\""));
  const std::string type = n["type"].get<std::string>();
  if (type == "NFC") {
    nfc = true;
  } else if (type == "Sequence") {
    const auto it = n.find("normalizers");
    if (it == n.end() || !it->is_array())
      throw Error(field_error(where, field + ".normalizers", "expected an array"));
    for (size_t i = 0; i < it->size(); ++i)
      parse_normalizer((*it)[i], where, field + ".normalizers[" + std::to_string(i) + "]", nfc);
  } else {
    throw Error(field_error(where, field + ".type",
                            "normalizer \"" + type + "\" is not supported (NFC or a Sequence of NFC)"));
  }
}

// Flattens pre_tokenizer into steps; returns whether a ByteLevel step was seen.
void parse_pre_tokenizer(const json& p, const std::string& where, const std::string& field,
                         std::vector<PreStep>& steps, bool& byte_level) {
  if (p.is_null()) return;
  if (!p.is_object() || !p.contains("type") || !p["type"].is_string())
    throw Error(field_error(where, field, "expected an object with a \"type\""));
  const std::string type = p["type"].get<std::string>();
  if (byte_level)
    throw Error(field_error(where, field, "\"" + type + "\" after ByteLevel is not supported"));
  if (type == "Sequence") {
    const auto it = p.find("pretokenizers");
    if (it == p.end() || !it->is_array())
      throw Error(field_error(where, field + ".pretokenizers", "expected an array"));
    for (size_t i = 0; i < it->size(); ++i)
      parse_pre_tokenizer((*it)[i], where, field + ".pretokenizers[" + std::to_string(i) + "]", steps,
                          byte_level);
  } else if (type == "Split") {
    PreStep step;
    const auto pat = p.find("pattern");
    if (pat == p.end() || !pat->is_object())
      throw Error(field_error(where, field + ".pattern", "expected {\"Regex\": ...} or {\"String\": ...}"));
    if (pat->contains("Regex") && (*pat)["Regex"].is_string()) {
      step.regex = std::make_unique<Regex>((*pat)["Regex"].get<std::string>(), false,
                                           where + ": " + field + ".pattern.Regex");
    } else if (pat->contains("String") && (*pat)["String"].is_string()) {
      step.regex = std::make_unique<Regex>((*pat)["String"].get<std::string>(), true,
                                           where + ": " + field + ".pattern.String");
    } else {
      throw Error(field_error(where, field + ".pattern", "expected {\"Regex\": ...} or {\"String\": ...}"));
    }
    const auto beh = p.find("behavior");
    if (beh == p.end()) throw Error(field_error(where, field + ".behavior", "missing"));
    step.behavior = parse_behavior(*beh, where, field + ".behavior");
    step.invert = get_bool(p, "invert", false, where, field);
    steps.push_back(std::move(step));
  } else if (type == "ByteLevel") {
    byte_level = true;
    if (get_bool(p, "add_prefix_space", true, where, field)) {
      PreStep step;
      step.kind = PreStep::Kind::kPrefixSpace;
      steps.push_back(std::move(step));
    }
    if (get_bool(p, "use_regex", true, where, field)) {
      PreStep step;
      step.regex = std::make_unique<Regex>(kGpt2Pattern, false, where + ": " + field);
      steps.push_back(std::move(step));
    }
  } else {
    throw Error(field_error(where, field + ".type", "pre-tokenizer \"" + type +
                                                        "\" is not supported (Split, ByteLevel, Sequence)"));
  }
}

void check_decoder(const json& d, const std::string& where, const std::string& field) {
  if (d.is_null()) return;
  if (!d.is_object() || !d.contains("type") || !d["type"].is_string())
    throw Error(field_error(where, field, "expected an object with a \"type\""));
  const std::string type = d["type"].get<std::string>();
  if (type == "ByteLevel") return;
  if (type == "Sequence" && d.contains("decoders") && d["decoders"].is_array()) {
    for (size_t i = 0; i < d["decoders"].size(); ++i)
      check_decoder(d["decoders"][i], where, field + ".decoders[" + std::to_string(i) + "]");
    return;
  }
  throw Error(field_error(where, field + ".type", "decoder \"" + type + "\" is not supported (ByteLevel)"));
}

void parse_merges(const json& merges, State& impl) {
  const std::string& where = impl.where;
  if (!merges.is_array()) throw Error(field_error(where, "model.merges", "expected an array"));
  impl.merges.reserve(merges.size() * 2);
  std::string a, b, ab;
  for (size_t rank = 0; rank < merges.size(); ++rank) {
    const json& m = merges[rank];
    const auto field = [rank] { return "model.merges[" + std::to_string(rank) + "]"; };
    if (m.is_string()) {
      const std::string& s = m.get_ref<const std::string&>();
      const size_t space = s.find(' ');
      if (space == std::string::npos || s.find(' ', space + 1) != std::string::npos)
        throw Error(field_error(where, field(), "expected \"left right\", got " + m.dump()));
      a.assign(s, 0, space);
      b.assign(s, space + 1);
    } else if (m.is_array() && m.size() == 2 && m[0].is_string() && m[1].is_string()) {
      a = m[0].get_ref<const std::string&>();
      b = m[1].get_ref<const std::string&>();
    } else {
      throw Error(field_error(where, field(), "expected \"left right\" or [left, right], got " + m.dump()));
    }
    ab.assign(a).append(b);
    const auto ia = impl.vocab.find(a), ib = impl.vocab.find(b), im = impl.vocab.find(ab);
    if (ia == impl.vocab.end())
      throw Error(field_error(where, field(), "token \"" + a + "\" is not in model.vocab"));
    if (ib == impl.vocab.end())
      throw Error(field_error(where, field(), "token \"" + b + "\" is not in model.vocab"));
    if (im == impl.vocab.end())
      throw Error(field_error(where, field(), "merged token \"" + ab + "\" is not in model.vocab"));
    // As HF: a repeated pair keeps its last rank.
    impl.merges[pair_key(ia->second, ib->second)] = {static_cast<int32_t>(rank), im->second};
  }
}

void parse_model(const json& root, State& impl) {
  const std::string& where = impl.where;
  const auto mit = root.find("model");
  if (mit == root.end() || !mit->is_object()) throw Error(field_error(where, "model", "missing or not an object"));
  const json& model = *mit;
  if (model.contains("type") && model["type"] != "BPE")
    throw Error(field_error(where, "model.type", "only BPE is supported, got " + model["type"].dump()));
  const auto vit = model.find("vocab");
  if (vit == model.end() || !vit->is_object())
    throw Error(field_error(where, "model.vocab", "missing or not an object"));
  impl.vocab.reserve(vit->size() * 2);
  for (auto it = vit->begin(); it != vit->end(); ++it) {
    if (!is_valid_id(it.value())) get_id(it.value(), where, "model.vocab[\"" + it.key() + "\"]");
    impl.vocab.emplace(it.key(), static_cast<int32_t>(it.value().get<int64_t>()));
  }

  auto empty_string_field = [&](const char* key) {
    const auto f = model.find(key);
    if (f != model.end() && !f->is_null() && !(f->is_string() && f->get<std::string>().empty()))
      throw Error(field_error(where, std::string("model.") + key, "non-empty values are not supported"));
  };
  empty_string_field("continuing_subword_prefix");
  empty_string_field("end_of_word_suffix");
  if (get_bool(model, "byte_fallback", false, where, "model"))
    throw Error(field_error(where, "model.byte_fallback", "true is not supported"));
  const auto drop = model.find("dropout");
  if (drop != model.end() && !drop->is_null() && !(drop->is_number() && drop->get<double>() == 0.0))
    throw Error(field_error(where, "model.dropout", "dropout is not supported at encode time"));
  impl.fuse_unk = get_bool(model, "fuse_unk", false, where, "model");
  impl.ignore_merges = get_bool(model, "ignore_merges", false, where, "model");
  const auto unk = model.find("unk_token");
  if (unk != model.end() && !unk->is_null()) {
    if (!unk->is_string()) throw Error(field_error(where, "model.unk_token", "expected a string"));
    const auto u = impl.vocab.find(unk->get<std::string>());
    if (u == impl.vocab.end())
      throw Error(field_error(where, "model.unk_token", unk->dump() + " is not in model.vocab"));
    impl.unk_id = u->second;
  }
  const auto merges = model.find("merges");
  if (merges != model.end() && !merges->is_null()) parse_merges(*merges, impl);

  const ByteAlphabet& alphabet = byte_alphabet();
  for (int b = 0; b < 256; ++b) {
    const auto it = impl.vocab.find(alphabet.symbol(static_cast<unsigned char>(b)));
    impl.byte_id[b] = it == impl.vocab.end() ? -1 : it->second;
  }
}

void parse_added_tokens(const json& root, State& impl) {
  const std::string& where = impl.where;
  const auto ait = root.find("added_tokens");
  if (ait == root.end() || ait->is_null()) return;
  if (!ait->is_array()) throw Error(field_error(where, "added_tokens", "expected an array"));
  impl.added.reserve(ait->size());
  for (size_t i = 0; i < ait->size(); ++i) {
    const json& t = (*ait)[i];
    const std::string field = "added_tokens[" + std::to_string(i) + "]";
    if (!t.is_object()) throw Error(field_error(where, field, "expected an object"));
    AddedToken tok;
    if (!t.contains("id")) throw Error(field_error(where, field + ".id", "missing"));
    tok.id = get_id(t["id"], where, field + ".id");
    if (!t.contains("content") || !t["content"].is_string())
      throw Error(field_error(where, field + ".content", "missing or not a string"));
    tok.content = t["content"].get<std::string>();
    std::string scratch;
    valid_utf8(tok.content, scratch);
    if (!scratch.empty())
      throw Error(field_error(where, field + ".content", "not valid UTF-8"));
    tok.special = get_bool(t, "special", false, where, field);
    tok.single_word = get_bool(t, "single_word", false, where, field);
    tok.lstrip = get_bool(t, "lstrip", false, where, field);
    tok.rstrip = get_bool(t, "rstrip", false, where, field);
    tok.normalized = get_bool(t, "normalized", !tok.special, where, field);
    impl.added.push_back(std::move(tok));
  }
  for (const AddedToken& tok : impl.added) {
    impl.added_by_content[tok.content] = tok.id;
    if (tok.normalized) {
      impl.normalized_matcher.add(&tok, impl.nfc ? nfc_valid(tok.content) : tok.content);
    } else {
      impl.raw_matcher.add(&tok, tok.content);
    }
    if (tok.single_word && !impl.word_char) {
      // Rust regex's Unicode \w, which HF uses for single_word boundaries.
      impl.word_char = std::make_unique<Regex>(R"([\p{L}\p{Nl}\p{M}\p{Nd}\p{Pc}\x{200C}\x{200D}])", false,
                                               where + ": single_word");
    }
  }
  impl.raw_matcher.finish();
  impl.normalized_matcher.finish();
}

void build_reverse_maps(State& impl) {
  int64_t max_id = -1;
  for (const auto& [tok, id] : impl.vocab) max_id = std::max<int64_t>(max_id, id);
  for (const AddedToken& t : impl.added) max_id = std::max(max_id, t.id);
  const auto n = static_cast<size_t>(max_id + 1);
  impl.id_bytes.assign(n, {});
  impl.id_token.assign(n, {});
  impl.id_present.assign(n, 0);
  const ByteAlphabet& alphabet = byte_alphabet();
  // Deterministic choice when two strings share an id: the smallest string wins.
  std::vector<std::pair<std::string_view, int32_t>> entries;
  entries.reserve(impl.vocab.size());
  for (const auto& [tok, id] : impl.vocab) entries.emplace_back(tok, id);
  std::sort(entries.begin(), entries.end());
  for (const auto& [tok, id] : entries) {
    if (impl.id_present[id]) continue;
    impl.id_present[id] = 1;
    impl.id_token[id] = std::string(tok);
    // As HF's ByteLevel decoder: a token with characters outside the alphabet decodes as written.
    auto bytes = alphabet.bytes_of(tok);
    impl.id_bytes[id] = bytes ? std::move(*bytes) : std::string(tok);
  }
  for (const AddedToken& t : impl.added) {
    impl.id_present[t.id] = 1;
    impl.id_token[t.id] = t.content;
    impl.id_bytes[t.id] = t.content;
  }
}

std::string read_file(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary | std::ios::ate);
  if (!in) throw Error("cannot read tokenizer file '" + path.string() + "'");
  const std::streamoff size = in.tellg();
  if (size < 0) throw Error("cannot read tokenizer file '" + path.string() + "'");
  std::string text(static_cast<size_t>(size), '\0');
  in.seekg(0);
  if (!in.read(text.data(), size)) throw Error("error while reading tokenizer file '" + path.string() + "'");
  return text;
}

}  // namespace

struct Tokenizer::Impl {
  State state;
};

// ---- public API ----------------------------------------------------------------------------

Tokenizer::Tokenizer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Tokenizer::Tokenizer(Tokenizer&&) noexcept = default;
Tokenizer& Tokenizer::operator=(Tokenizer&&) noexcept = default;
Tokenizer::~Tokenizer() = default;

Tokenizer Tokenizer::load(const std::filesystem::path& tokenizer_json) {
  return from_json_text(read_file(tokenizer_json), tokenizer_json.string());
}

Tokenizer Tokenizer::from_json_text(const std::string& text, const std::string& where) {
  json root;
  try {
    root = json::parse(text);
  } catch (const json::exception& e) {
    throw Error(where + ": not valid JSON: " + e.what());
  }
  if (!root.is_object()) throw Error(where + ": expected a JSON object at the top level");
  auto holder = std::make_unique<Impl>();
  State* impl = &holder->state;
  impl->where = where;
  try {
    parse_model(root, *impl);
    if (root.contains("normalizer")) parse_normalizer(root["normalizer"], where, "normalizer", impl->nfc);
    bool byte_level = false;
    if (root.contains("pre_tokenizer"))
      parse_pre_tokenizer(root["pre_tokenizer"], where, "pre_tokenizer", impl->pre_steps, byte_level);
    if (!byte_level)
      throw Error(field_error(where, "pre_tokenizer",
                              "no ByteLevel step; only byte-level BPE tokenizers are supported"));
    if (root.contains("decoder")) check_decoder(root["decoder"], where, "decoder");
    parse_added_tokens(root, *impl);
    build_reverse_maps(*impl);
  } catch (const json::exception& e) {
    throw Error(where + ": unexpected JSON structure: " + e.what());
  }
  return Tokenizer(std::move(holder));
}

std::vector<int64_t> Tokenizer::encode(std::string_view text) const {
  const State& im = impl_->state;
  std::string repaired;
  const std::string_view s = valid_utf8(text, repaired);
  std::vector<int64_t> out;
  out.reserve(s.size() / 3 + 4);
  const MatchData md(pcre2_match_data_create(1, nullptr));
  const MatchData word_md(pcre2_match_data_create(1, nullptr));
  if (!md || !word_md) throw Error(im.where + ": encode: out of memory for regex match data");
  std::vector<Segment> raw, norm;
  im.raw_matcher.split(s, raw, im.word_char.get(), word_md.get());
  for (const Segment& seg : raw) {
    if (seg.id >= 0) {
      out.push_back(seg.id);
      continue;
    }
    const std::string_view piece = s.substr(seg.begin, seg.end - seg.begin);
    std::string normalized;
    std::string_view text_n = piece;
    if (im.nfc) {
      normalized = nfc_valid(piece);
      text_n = normalized;
    }
    if (im.normalized_matcher.empty()) {
      im.encode_text(text_n, out, md.get());
      continue;
    }
    im.normalized_matcher.split(text_n, norm, im.word_char.get(), word_md.get());
    for (const Segment& sub : norm) {
      if (sub.id >= 0) {
        out.push_back(sub.id);
      } else {
        im.encode_text(text_n.substr(sub.begin, sub.end - sub.begin), out, md.get());
      }
    }
  }
  return out;
}

std::string Tokenizer::decode(const std::vector<int64_t>& ids) const {
  const State& im = impl_->state;
  std::string out;
  for (size_t i = 0; i < ids.size(); ++i) {
    const int64_t id = ids[i];
    if (id < 0 || id >= static_cast<int64_t>(im.id_bytes.size()) || !im.id_present[id]) {
      throw Error(im.where + ": decode: token id " + std::to_string(id) + " (position " + std::to_string(i) +
                  ") is not in the vocabulary (vocab_size " + std::to_string(im.id_bytes.size()) + ")");
    }
    out += im.id_bytes[id];
  }
  return out;
}

int64_t Tokenizer::vocab_size() const { return static_cast<int64_t>(impl_->state.id_bytes.size()); }

std::string Tokenizer::id_to_token(int64_t id) const {
  const State& im = impl_->state;
  if (id < 0 || id >= static_cast<int64_t>(im.id_token.size()) || !im.id_present[id]) {
    throw Error(im.where + ": token id " + std::to_string(id) + " is not in the vocabulary (vocab_size " +
                std::to_string(im.id_token.size()) + ")");
  }
  return im.id_token[id];
}

std::optional<int64_t> Tokenizer::token_to_id(const std::string& token) const {
  const State& im = impl_->state;
  const auto a = im.added_by_content.find(token);
  if (a != im.added_by_content.end()) return a->second;
  const auto v = im.vocab.find(token);
  if (v != im.vocab.end()) return v->second;
  return std::nullopt;
}

std::string normalize_nfc(std::string_view text) {
  std::string repaired;
  return nfc_valid(valid_utf8(text, repaired));
}

}  // namespace hh::model
