#pragma once
// Named hook points (TransformerLens vocabulary, DESIGN §4). LibTorch modules have no forward hooks,
// so the forward calls Hooks::run at each point explicitly. A hook receives the tensor by reference:
// it can read it, replace it (assign a new tensor of the same shape), or make it require grad.
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "core/util/compat.h"

namespace hh::model {

enum class HookKind {
  ResidPre,   // blocks.{l}.hook_resid_pre        [B, T, d]
  Q,          // blocks.{l}.attn.hook_q           [B, T, Hq, Dh]  after q_norm and RoPE
  K,          // blocks.{l}.attn.hook_k           [B, T, Hkv, Dh] after k_norm and RoPE
  V,          // blocks.{l}.attn.hook_v           [B, T, Hkv, Dh]
  Pattern,    // blocks.{l}.attn.hook_pattern     [B, Hq, R, T]   softmax rows of requested queries
  Z,          // blocks.{l}.attn.hook_z           [B, T, Hq, Dh]  input of o_proj (head patching point)
  AttnOut,    // blocks.{l}.hook_attn_out         [B, T, d]
  ResidMid,   // blocks.{l}.hook_resid_mid        [B, T, d]
  MlpOut,     // blocks.{l}.hook_mlp_out          [B, T, d]
  ResidPost,  // blocks.{l}.hook_resid_post       [B, T, d]
};

std::string hook_name(int64_t layer, HookKind kind);
// Every valid hook name for a model with `num_layers` layers, in forward order.
std::vector<std::string> all_hook_names(int64_t num_layers);
// Parses "blocks.3.attn.hook_z" -> (3, Z). Throws hh::Error naming the string when unknown.
std::pair<int64_t, HookKind> parse_hook_name(const std::string& name);

using HookFn = std::function<void(at::Tensor& t)>;

class Hooks {
 public:
  void add(const std::string& name, HookFn fn);  // several per name run in insertion order
  // Convenience: store a detached copy of the activation under its name.
  void cache(const std::string& name, std::map<std::string, at::Tensor>* store);
  bool active(const std::string& name) const { return fns_.count(name) != 0; }
  bool empty() const { return fns_.empty(); }
  void run(const std::string& name, at::Tensor& t) const;
  void clear() { fns_.clear(); }

 private:
  std::map<std::string, std::vector<HookFn>> fns_;
};

}  // namespace hh::model
