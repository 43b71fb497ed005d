#include "core/dist/grad_sync.h"

#include <torch/torch.h>

#include <algorithm>
#include <mutex>

#include "core/dist/process_group.h"
#include "core/util/error.h"

namespace hh::dist {

struct GradSync::Impl {
  struct Bucket {
    std::vector<size_t> params;       // indices into Impl::params
    std::vector<int64_t> offsets;     // element offset of each in flat
    at::Tensor flat;                  // [numel] in the parameters' dtype, on their device
    size_t arrived = 0;
    bool launched = false;
    Pending pending;
  };
  ProcessGroup* group = nullptr;
  std::vector<at::Tensor> params;
  std::vector<size_t> bucket_of, slot_of;   // per parameter
  std::vector<char> seen;                   // per parameter: its gradient arrived this step
  std::vector<Bucket> buckets;
  size_t next_launch = 0;                   // buckets start in index order
  bool sync = false, fired_twice = false;
  std::mutex mu;                            // hooks may run on autograd's device threads
  std::vector<unsigned> hook_ids;           // per parameter, for remove_hook

  at::Tensor slot(size_t p) {
    const Bucket& b = buckets[bucket_of[p]];
    return b.flat.narrow(0, b.offsets[slot_of[p]], params[p].numel()).view(params[p].sizes());
  }
  void launch(Bucket& b) {
    b.flat.div_(static_cast<double>(group->size()));
    b.pending = group->all_reduce_async(b.flat);
    b.launched = true;
  }
  void launch_ready() {
    while (next_launch < buckets.size() && buckets[next_launch].arrived == buckets[next_launch].params.size())
      launch(buckets[next_launch++]);
  }
  void on_grad(size_t p, const at::Tensor& g) {
    std::lock_guard<std::mutex> lock(mu);
    if (!sync) return;
    if (seen[p]) {
      fired_twice = true;
      return;
    }
    seen[p] = 1;
    if (fired_twice) return;
    at::NoGradGuard ng;
    const at::Tensor& acc = params[p].grad();
    at::Tensor s = slot(p);
    if (acc.defined()) at::add_out(s, acc, g);
    else s.copy_(g);
    ++buckets[bucket_of[p]].arrived;
    launch_ready();
  }
};

GradSync::GradSync(ProcessGroup& group, std::vector<at::Tensor> params, std::size_t bucket_bytes)
    : impl_(std::make_shared<Impl>()) {
  Impl& s = *impl_;
  s.group = &group;
  s.params = std::move(params);
  const size_t n = s.params.size();
  s.bucket_of.assign(n, 0);
  s.slot_of.assign(n, 0);
  s.seen.assign(n, 0);
  // Reverse order; a new bucket when the current one is full or the dtype / device changes.
  std::vector<size_t> cur;
  int64_t cur_bytes = 0;
  auto close = [&] {
    if (cur.empty()) return;
    Impl::Bucket b;
    int64_t off = 0;
    for (size_t p : cur) {
      s.bucket_of[p] = s.buckets.size();
      s.slot_of[p] = b.params.size();
      b.params.push_back(p);
      b.offsets.push_back(off);
      off += s.params[p].numel();
    }
    b.flat = at::zeros({off}, s.params[cur.front()].options().requires_grad(false));
    s.buckets.push_back(std::move(b));
    cur.clear();
    cur_bytes = 0;
  };
  for (size_t i = n; i-- > 0;) {
    const at::Tensor& t = s.params[i];
    if (!t.requires_grad()) throw Error("internal: GradSync parameter " + std::to_string(i) + " does not require grad");
    if (!cur.empty() && (s.params[cur.front()].scalar_type() != t.scalar_type() || s.params[cur.front()].device() != t.device()))
      close();
    cur.push_back(i);
    cur_bytes += t.numel() * static_cast<int64_t>(t.element_size());
    if (cur_bytes >= static_cast<int64_t>(bucket_bytes)) close();
  }
  close();
  std::weak_ptr<Impl> weak = impl_;
  for (size_t p = 0; p < n; ++p)
    s.hook_ids.push_back(s.params[p].register_hook([weak, p](const at::Tensor& g) {
      if (auto impl = weak.lock()) impl->on_grad(p, g);
    }));
}

GradSync::~GradSync() {
  for (size_t p = 0; p < impl_->params.size(); ++p) {
    try {
      impl_->params[p].remove_hook(impl_->hook_ids[p]);
    } catch (const std::exception&) {
      // A hook that cannot be removed holds only a weak reference: it does nothing from now on.
    }
  }
}

void GradSync::set_sync(bool sync) {
  std::lock_guard<std::mutex> lock(impl_->mu);
  impl_->sync = sync;
}

int64_t GradSync::num_buckets() const { return static_cast<int64_t>(impl_->buckets.size()); }

void GradSync::finish() {
  Impl& s = *impl_;
  std::lock_guard<std::mutex> lock(s.mu);
  if (!s.sync) throw Error("internal: GradSync::finish outside a synchronising step");
  at::NoGradGuard ng;
  if (s.fired_twice) {
    // Wait for what is in flight, then rebuild every bucket from the final .grad and reduce it again.
    for (auto& b : s.buckets) b.pending.wait();
    for (size_t p = 0; p < s.params.size(); ++p) {
      at::Tensor sl = s.slot(p);
      if (s.params[p].grad().defined()) sl.copy_(s.params[p].grad());
      else sl.zero_();
    }
    for (auto& b : s.buckets) {
      s.launch(b);
      b.pending.wait();
    }
  } else {
    // Parameters without a gradient this step count as zeros.
    for (size_t p = 0; p < s.params.size(); ++p)
      if (!s.seen[p]) {
        at::Tensor sl = s.slot(p);
        if (s.params[p].grad().defined()) sl.copy_(s.params[p].grad());
        else sl.zero_();
        s.seen[p] = 1;
        ++s.buckets[s.bucket_of[p]].arrived;
      }
    s.launch_ready();
    for (auto& b : s.buckets) b.pending.wait();
  }
  for (size_t p = 0; p < s.params.size(); ++p) s.params[p].mutable_grad() = s.slot(p);
  for (auto& b : s.buckets) {
    b.arrived = 0;
    b.launched = false;
  }
  std::fill(s.seen.begin(), s.seen.end(), 0);
  s.next_launch = 0;
  s.fired_twice = false;
}

std::vector<int> partition_params(const std::vector<int64_t>& numels, int world_size) {
  std::vector<int64_t> load(static_cast<size_t>(std::max(1, world_size)), 0);
  std::vector<int> owner;
  owner.reserve(numels.size());
  for (int64_t n : numels) {
    const auto it = std::min_element(load.begin(), load.end());
    owner.push_back(static_cast<int>(it - load.begin()));
    *it += n;
  }
  return owner;
}

}  // namespace hh::dist
