#include "core/model/hooks.h"

#include <array>
#include <cctype>
#include <utility>

#include "core/util/error.h"

namespace hh::model {
namespace {

struct HookSpelling {
  HookKind kind;
  const char* suffix;  // what follows "blocks.{l}."
};

// Forward order within one layer; all_hook_names() and parse_hook_name() both read this table.
constexpr std::array<HookSpelling, 10> kHookSpellings{{
    {HookKind::ResidPre, "hook_resid_pre"},
    {HookKind::Q, "attn.hook_q"},
    {HookKind::K, "attn.hook_k"},
    {HookKind::V, "attn.hook_v"},
    {HookKind::Pattern, "attn.hook_pattern"},
    {HookKind::Z, "attn.hook_z"},
    {HookKind::AttnOut, "hook_attn_out"},
    {HookKind::ResidMid, "hook_resid_mid"},
    {HookKind::MlpOut, "hook_mlp_out"},
    {HookKind::ResidPost, "hook_resid_post"},
}};

const char* suffix_of(HookKind kind) {
  for (const auto& s : kHookSpellings)
    if (s.kind == kind) return s.suffix;
  throw Error("hook_name: unknown HookKind value " + std::to_string(static_cast<int>(kind)));
}

}  // namespace

std::string hook_name(int64_t layer, HookKind kind) {
  std::string name = "blocks.";
  name += std::to_string(layer);
  name += '.';
  name += suffix_of(kind);
  return name;
}

std::vector<std::string> all_hook_names(int64_t num_layers) {
  std::vector<std::string> names;
  names.reserve(static_cast<size_t>(num_layers > 0 ? num_layers : 0) * kHookSpellings.size());
  for (int64_t l = 0; l < num_layers; ++l)
    for (const auto& s : kHookSpellings) names.push_back(hook_name(l, s.kind));
  return names;
}

std::pair<int64_t, HookKind> parse_hook_name(const std::string& name) {
  const std::string prefix = "blocks.";
  auto bad = [&name](const std::string& why) {
    return Error("unknown hook name '" + name + "': " + why +
                 " (expected e.g. blocks.3.attn.hook_z or blocks.0.hook_resid_pre)");
  };
  if (name.compare(0, prefix.size(), prefix) != 0) throw bad("does not start with 'blocks.'");

  // Layer index: decimal digits, no sign, no leading zeros (so each hook has one spelling).
  size_t pos = prefix.size();
  const size_t digits_begin = pos;
  while (pos < name.size() && std::isdigit(static_cast<unsigned char>(name[pos]))) ++pos;
  const size_t n_digits = pos - digits_begin;
  if (n_digits == 0) throw bad("missing layer index");
  if (n_digits > 1 && name[digits_begin] == '0') throw bad("layer index has a leading zero");
  if (n_digits > 9) throw bad("layer index out of range");
  if (pos >= name.size() || name[pos] != '.') throw bad("expected '.' after the layer index");
  const int64_t layer = std::stoll(name.substr(digits_begin, n_digits));

  const std::string suffix = name.substr(pos + 1);
  for (const auto& s : kHookSpellings)
    if (suffix == s.suffix) return {layer, s.kind};
  throw bad("unknown hook point '" + suffix + "'");
}

void Hooks::add(const std::string& name, HookFn fn) {
  if (!fn) throw Error("Hooks::add: empty function for hook '" + name + "'");
  parse_hook_name(name);  // reject typos now rather than silently never firing
  fns_[name].push_back(std::move(fn));
}

void Hooks::cache(const std::string& name, std::map<std::string, at::Tensor>* store) {
  if (store == nullptr) throw Error("Hooks::cache: null store for hook '" + name + "'");
  add(name, [name, store](at::Tensor& t) { (*store)[name] = t.detach().clone(); });
}

void Hooks::run(const std::string& name, at::Tensor& t) const {
  auto it = fns_.find(name);
  if (it == fns_.end()) return;
  for (const auto& fn : it->second) fn(t);
}

}  // namespace hh::model
