#include "core/dist/process_group.h"

#include <torch/torch.h>

#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include "hydrahead/dist_config.h"
#if HH_HAVE_GLOO
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#endif
// LibTorch's CMake package passes USE_C10D_GLOO to its consumers when its c10d has Gloo; 2.x compiles
// ProcessGroupGloo.hpp only with it.
#if HH_HAVE_GLOO && HH_TORCH_AT_LEAST(2, 0) && !defined(USE_C10D_GLOO)
#error "this LibTorch does not define USE_C10D_GLOO: its c10d has no Gloo backend, which core/dist needs"
#endif
#if HH_HAVE_NCCL
#ifndef USE_C10D_NCCL
#define USE_C10D_NCCL  // the header compiles its content only with this; dist.cmake found the backend
#endif
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#endif

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <deque>
#include <exception>
#include <functional>
#include <future>
#include <mutex>
#include <string>
#include <thread>

#include "core/util/error.h"
#include "core/util/log.h"

namespace hh::dist {

// LibTorch 2.x runs collectives on Backend objects that a ProcessGroup wraps; in 1.13 the backends
// are ProcessGroups themselves. Both have the same collective methods, which are all this file uses.
#if HH_TORCH_AT_LEAST(2, 0)
using BackendBase = c10d::Backend;
#else
using BackendBase = c10d::ProcessGroup;
#endif

namespace {

constexpr const char* kFailureKey = "hydrahead/failed";
// hydrahead/seq/<rank>: the last collective a rank started, so that a failure can name the ranks
// that fell behind (hung, or died without a word).
std::string seq_key(int rank) { return "hydrahead/seq/" + std::to_string(rank); }

std::string first_line(const std::string& s) {
  const auto nl = s.find('\n');
  return nl == std::string::npos ? s : s.substr(0, nl);
}

c10d::ReduceOp to_c10d(ReduceOp op) { return op == ReduceOp::Max ? c10d::ReduceOp::MAX : c10d::ReduceOp::SUM; }

constexpr auto kHeartbeat = std::chrono::milliseconds(200);   // how often a rank publishes its collective count
constexpr auto kStoreAnswer = std::chrono::seconds(3);        // how long a failing rank asks the store

// Runs `fn` on a thread of its own and gives up after `limit`: the store of a job in trouble may not
// answer (1.13's TCPStore server reads a request to its end, so a peer stopped mid-request stalls it),
// and a failing rank must still exit. A stuck thread is left behind; the process is about to end.
template <class T, class F>
bool bounded(F fn, std::chrono::milliseconds limit, T* out) {
  auto task = std::make_shared<std::packaged_task<T()>>(std::move(fn));
  std::future<T> f = task->get_future();
  std::thread([task] { (*task)(); }).detach();
  if (f.wait_for(limit) != std::future_status::ready) return false;
  try {
    *out = f.get();
    return true;
  } catch (const std::exception&) {
    return false;
  }
}

// Publishes this rank's collective count (hydrahead/seq/<rank>) every kHeartbeat, on its own store
// connection and thread, so that the training thread never waits on the store and a stalled store
// never stalls training.
struct Heartbeat {
  std::atomic<int64_t> sequence{0};
  std::atomic<bool> stop{false};
  c10::intrusive_ptr<c10d::Store> store;
  std::string key;
  void run() {
    int64_t published = -1;
    while (!stop.load()) {
      const int64_t now = sequence.load();
      if (now != published) {
        try {
          const std::string v = std::to_string(now);
          store->set(key, std::vector<uint8_t>(v.begin(), v.end()));
          published = now;
        } catch (const std::exception&) {
          return;  // the store is gone: rank 0 ended
        }
      }
      std::this_thread::sleep_for(kHeartbeat);
    }
  }
};

// Who to blame for a failed collective #seq, from what the ranks published in the store.
std::string blame_from_store(const c10::intrusive_ptr<c10d::Store>& store, const DistEnv& env, int64_t seq, double timeout_s) {
  std::string msg;
  try {
    if (store && store->check({kFailureKey})) {
      const std::vector<uint8_t> v = store->get(kFailureKey);
      msg += "; reported by " + std::string(v.begin(), v.end());
    } else {
      std::string behind, same;
      for (int r = 0; r < env.world_size; ++r) {
        if (r == env.rank) continue;
        int64_t at = 0;
        if (store->check({seq_key(r)})) {
          const std::vector<uint8_t> v = store->get(seq_key(r));
          at = std::stoll(std::string(v.begin(), v.end()));
        }
        std::string& list = at < seq ? behind : same;
        if (at <= seq) list += (list.empty() ? "" : ", ") + std::string("rank ") + std::to_string(r) + " (at collective #" + std::to_string(at) + ")";
      }
      const std::string limit = " (--dist-timeout " + std::to_string(static_cast<int64_t>(timeout_s)) + " s)";
      if (!behind.empty()) msg += "; behind this rank: " + behind + ", which hung or died" + limit;
      else if (!same.empty()) msg += "; in this collective with " + same + ": one of them hung or died" + limit;
      else msg += "; another rank died or left the job";
    }
  } catch (const std::exception&) {
    msg += "; rank 0's store is unreachable (rank 0 died or left the job)";
  }
  return msg;
}

// "rank R of N: OP (collective #SEQ) failed: WHAT; <who is to blame>". The store is asked on a
// thread of its own, for at most kStoreAnswer.
std::string failure_message(const c10::intrusive_ptr<c10d::Store>& store, const DistEnv& env, double timeout_s, const char* op,
                            int64_t seq, const std::string& what) {
  std::string msg = "rank " + std::to_string(env.rank) + " of " + std::to_string(env.world_size) + ": " + op + " (collective #" +
                    std::to_string(seq) + ") failed: " + first_line(what);
  std::string blame;
  if (!bounded<std::string>([store, env, seq, timeout_s] { return blame_from_store(store, env, seq, timeout_s); }, kStoreAnswer, &blame))
    blame = "; the job's store (on rank 0) did not answer: rank 0 died or hung, or another rank stalled the store";
  return msg + blame;
}

// Tells the other ranks through the store that rank `rank` is failing; the first report stands.
void publish_failure(const c10::intrusive_ptr<c10d::Store>& store, int rank, const std::string& message) noexcept {
  try {
    const std::string v = "rank " + std::to_string(rank) + ": " + first_line(message);
    bool done = false;
    bounded<bool>(
        [store, v] {
          if (store->add(std::string(kFailureKey) + "/count", 1) != 1) return true;
          store->set(kFailureKey, std::vector<uint8_t>(v.begin(), v.end()));
          return true;
        },
        kStoreAnswer, &done);
  } catch (...) {
  }
}

// NCCL collectives run on the GPU, and waiting for one only orders the CUDA stream after it, so a
// peer that hangs leaves this rank blocked in some later synchronisation until PyTorch's watchdog
// aborts the communicator (with a message about this rank, not the one that hung). The watch names
// the culprit first: it follows every collective in flight, and when one has not completed within
// --dist-timeout it describes the failure from the store (which rank fell behind), reports it to the
// peers and ends the process. PyTorch's own timeout is set later than ours, as a backstop.
struct CollectiveWatch {
  struct Entry {
    c10::intrusive_ptr<c10d::Work> work;
    const char* op;
    int64_t seq;
    std::chrono::steady_clock::time_point started;
  };
  std::mutex mutex;
  std::condition_variable wake;
  std::deque<Entry> in_flight;
  bool stop = false;
  std::chrono::milliseconds limit{0};
  // Called once with (op, seq) of the first collective past the limit; must not return.
  std::function<void(const char*, int64_t)> on_timeout;

  void add(const c10::intrusive_ptr<c10d::Work>& w, const char* op, int64_t seq) {
    std::lock_guard<std::mutex> lock(mutex);
    in_flight.push_back({w, op, seq, std::chrono::steady_clock::now()});
    wake.notify_one();
  }

  void run() {
    std::unique_lock<std::mutex> lock(mutex);
    while (!stop) {
      // Collectives complete in the order they were issued (one NCCL stream): the oldest decides.
      while (!in_flight.empty()) {
        bool done = false;
        try {
          done = in_flight.front().work->isCompleted();
        } catch (const std::exception&) {
          done = true;  // failed: wait() reports it
        }
        if (!done) break;
        in_flight.pop_front();
      }
      if (!in_flight.empty() && std::chrono::steady_clock::now() - in_flight.front().started >= limit) {
        const Entry e = in_flight.front();
        lock.unlock();
        on_timeout(e.op, e.seq);
        return;
      }
      wake.wait_for(lock, std::chrono::milliseconds(100), [this] { return stop; });
    }
  }
};

}  // namespace

struct ProcessGroup::Impl {
  DistEnv env;
  c10::intrusive_ptr<c10d::Store> store;
  c10::intrusive_ptr<BackendBase> backend;
  at::Device device = at::kCPU;
  bool nccl = false;
  double timeout_s = 300;
  int64_t sequence = 0;  // collectives issued, for messages
  std::shared_ptr<Heartbeat> heartbeat;
  std::shared_ptr<CollectiveWatch> watch;  // NCCL only
  std::atomic<bool> failed{false};         // a collective failed: no orderly NCCL shutdown

  ~Impl() {
    if (heartbeat) heartbeat->stop.store(true);   // its thread ends within kHeartbeat (detached)
    if (watch) {
      std::lock_guard<std::mutex> lock(watch->mutex);
      watch->stop = true;
      watch->wake.notify_one();
    }
#if HH_HAVE_NCCL
    // What torch.distributed.destroy_process_group() does at a normal exit: drain and close the
    // communicator (without it PyTorch warns at exit). Not while unwinding from an error: a peer
    // may be gone, and the process is about to end anyway.
    if (nccl && backend && !failed.load() && std::uncaught_exceptions() == 0) {
      try {
        static_cast<c10d::ProcessGroupNCCL*>(backend.get())->shutdown();
      } catch (const std::exception& e) {
        log::warn("rank " + std::to_string(env.rank) + ": closing the NCCL communicator: " + first_line(e.what()));
      }
    }
#endif
  }

  // The number of the collective about to start; the heartbeat publishes it.
  int64_t next() {
    ++sequence;
    if (heartbeat) heartbeat->sequence.store(sequence);
    return sequence;
  }

  // The message of a failed collective, naming whoever reported a failure through the store.
  std::string describe_failure(const char* op, int64_t seq, const std::string& what) {
    failed.store(true);
    return failure_message(store, env, timeout_s, op, seq, what);
  }
};

struct Pending::Impl {
  c10::intrusive_ptr<c10d::Work> work;
  ProcessGroup::Impl* group = nullptr;
  const char* op = "";
  int64_t seq = 0;
  bool done = false;
};

Pending::Pending() = default;
Pending::~Pending() = default;
Pending::Pending(Pending&&) noexcept = default;
Pending& Pending::operator=(Pending&&) noexcept = default;
bool Pending::valid() const { return impl_ && !impl_->done; }

void Pending::wait() {
  if (!impl_ || impl_->done) return;
  impl_->done = true;
  try {
    impl_->work->wait();
  } catch (const std::exception& e) {
    throw Error(impl_->group->describe_failure(impl_->op, impl_->seq, e.what()));
  }
}

ProcessGroup::ProcessGroup() : impl_(std::make_unique<Impl>()) {}
ProcessGroup::~ProcessGroup() = default;

std::shared_ptr<ProcessGroup> ProcessGroup::create(const DistEnv& env, const std::string& device, double timeout_s) {
  if (env.world_size < 1 || env.rank >= env.world_size) throw Error("internal: rank " + std::to_string(env.rank) + " of " + std::to_string(env.world_size));
  if (timeout_s <= 0) throw Error("--dist-timeout must be positive (seconds)");
  std::shared_ptr<ProcessGroup> pg(new ProcessGroup());
  Impl& g = *pg->impl_;
  g.env = env;
  g.timeout_s = timeout_s;
  const auto timeout = std::chrono::milliseconds(static_cast<int64_t>(timeout_s * 1000.0));
  // A peer that died closes its sockets; writing to them must fail with an error we can report, not
  // end this process by SIGPIPE.
  std::signal(SIGPIPE, SIG_IGN);
  const bool cuda = device.rfind("cuda", 0) == 0;
  if (cuda) {
    if (!have_nccl())
      throw Error("--device " + device + " with several processes needs a LibTorch with CUDA and NCCL; this build has none "
                  "(use --device cpu for Gloo)");
    g.device = at::Device(rank_device(device, env, "--device"));
    // Allocations on plain "cuda" and NCCL's streams go to this rank's GPU.
    c10::impl::getDeviceGuardImpl(at::kCUDA)->setDevice(g.device);
    g.nccl = true;
  } else if (!HH_HAVE_GLOO) {
    throw Error("--device " + device + " with several processes needs c10d's Gloo backend; this build has none (its "
                "LibTorch ships no Gloo headers): use --device cuda, or build with Debian's libgloo-dev");
  }

  c10d::TCPStoreOptions so;
  so.port = static_cast<uint16_t>(env.master_port);
  so.isServer = env.rank == 0;
  so.numWorkers = static_cast<std::size_t>(env.world_size);
  so.waitWorkers = true;
  so.timeout = timeout;
  try {
    g.store = c10::make_intrusive<c10d::TCPStore>(env.master_addr, so);
  } catch (const std::exception& e) {
    throw Error("rank " + std::to_string(env.rank) + ": rendezvous at " + env.master_addr + ":" + std::to_string(env.master_port) +
                " failed (" + env.source + "): " + first_line(e.what()));
  }
  try {
    c10d::TCPStoreOptions ho;
    ho.port = static_cast<uint16_t>(env.master_port);
    ho.isServer = false;
    ho.waitWorkers = false;
    ho.timeout = timeout;
    auto hb = std::make_shared<Heartbeat>();
    hb->store = c10::make_intrusive<c10d::TCPStore>(env.master_addr, ho);
    hb->key = seq_key(env.rank);
    std::thread([hb] { hb->run(); }).detach();
    g.heartbeat = hb;
  } catch (const std::exception& e) {
    log::warn("rank " + std::to_string(env.rank) + ": no heartbeat connection to the store (" + first_line(e.what()) +
              "); a failure will not name the ranks that fell behind");
  }

  try {
    if (g.nccl) {
#if HH_HAVE_NCCL
      // PyTorch's watchdog is the backstop: ours (CollectiveWatch) fires first and names the rank
      // that fell behind. Without a dump on timeout the backstop does not wait a further minute.
      ::setenv("TORCH_NCCL_DUMP_ON_TIMEOUT", "0", 0);
      auto o = c10d::ProcessGroupNCCL::Options::create();
      o->timeout = timeout + std::max(std::chrono::milliseconds(30000), timeout / 2);
      g.backend = c10::make_intrusive<c10d::ProcessGroupNCCL>(g.store, env.rank, env.world_size, o);
      auto w = std::make_shared<CollectiveWatch>();
      w->limit = timeout;
      const auto store = g.store;
      const DistEnv e = env;
      w->on_timeout = [store, e, timeout_s](const char* op, int64_t seq) {
        const std::string msg = failure_message(store, e, timeout_s, op, seq, "timed out");
        std::fprintf(stderr, "error: %s\n", msg.c_str());
        std::fflush(stderr);
        publish_failure(store, e.rank, msg);
        // The training thread is blocked on the GPU behind the hung collective: end the process
        // from here. Files are written through a temporary and a rename, so none is left half-written.
        std::_Exit(1);
      };
      std::thread([w] { w->run(); }).detach();
      g.watch = w;
#endif
    } else {
#if HH_HAVE_GLOO
      auto o = c10d::ProcessGroupGloo::Options::create(timeout);
      // GLOO_SOCKET_IFNAME picks the network interface (as torch.distributed does); a job on one host
      // talks over the loopback; otherwise the address this host's name resolves to.
      const char* ifname = std::getenv("GLOO_SOCKET_IFNAME");
      if (ifname != nullptr && *ifname != '\0')
        o->devices.push_back(c10d::ProcessGroupGloo::createDeviceForInterface(ifname));
      else if (env.master_addr == "127.0.0.1" || env.master_addr == "localhost")
        o->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1"));
      else
        o->devices.push_back(c10d::ProcessGroupGloo::createDefaultDevice());
      o->threads = 2;
      g.backend = c10::make_intrusive<c10d::ProcessGroupGloo>(g.store, env.rank, env.world_size, o);
#endif
    }
  } catch (const Error&) {
    throw;
  } catch (const std::exception& e) {
    throw Error("rank " + std::to_string(env.rank) + ": creating the " + (g.nccl ? "NCCL" : "Gloo") +
                " process group failed: " + first_line(e.what()));
  }
  log::info("rank " + std::to_string(env.rank) + " of " + std::to_string(env.world_size) + " joined (" + pg->backend_name() +
            ", " + g.device.str() + ", " + env.source + ")");
  return pg;
}

int ProcessGroup::rank() const { return impl_->env.rank; }
int ProcessGroup::size() const { return impl_->env.world_size; }
const DistEnv& ProcessGroup::env() const { return impl_->env; }
const char* ProcessGroup::backend_name() const { return impl_->nccl ? "nccl" : "gloo"; }
at::Device ProcessGroup::device() const { return impl_->device; }

namespace {
void check_tensor(const at::Tensor& t, const at::Device& d, const char* op) {
  if (!t.defined() || !t.is_contiguous() || t.device() != d)
    throw Error(std::string("internal: ") + op + " needs a contiguous tensor on " + d.str());
}
}  // namespace

template <class Issue>
Pending ProcessGroup::start_collective(const char* op, Issue&& issue) {
  Pending p;
  p.impl_ = std::make_unique<Pending::Impl>();
  p.impl_->group = impl_.get();
  p.impl_->op = op;
  p.impl_->seq = impl_->next();
  try {
    p.impl_->work = issue();
  } catch (const std::exception& e) {
    throw Error(impl_->describe_failure(op, p.impl_->seq, e.what()));
  }
  if (impl_->watch) impl_->watch->add(p.impl_->work, op, p.impl_->seq);
  return p;
}

Pending ProcessGroup::all_reduce_async(const at::Tensor& t, ReduceOp op) {
  check_tensor(t, impl_->device, "all_reduce");
  return start_collective("all_reduce", [&] {
    std::vector<at::Tensor> v{t};
    c10d::AllreduceOptions o;
    o.reduceOp = to_c10d(op);
    return impl_->backend->allreduce(v, o);
  });
}

void ProcessGroup::all_reduce(const at::Tensor& t, ReduceOp op) { all_reduce_async(t, op).wait(); }

Pending ProcessGroup::broadcast_async(const at::Tensor& t, int root) {
  check_tensor(t, impl_->device, "broadcast");
  return start_collective("broadcast", [&] {
    std::vector<at::Tensor> v{t};
    c10d::BroadcastOptions o;
    o.rootRank = root;
    o.rootTensor = 0;
    return impl_->backend->broadcast(v, o);
  });
}

void ProcessGroup::broadcast(const at::Tensor& t, int root) { broadcast_async(t, root).wait(); }

std::vector<at::Tensor> ProcessGroup::all_gather(const at::Tensor& t) {
  const at::Tensor in = t.contiguous();
  check_tensor(in, impl_->device, "all_gather");
  std::vector<at::Tensor> inputs{in};
  std::vector<std::vector<at::Tensor>> outputs(1);
  for (int r = 0; r < size(); ++r) outputs[0].push_back(at::empty_like(in));
  start_collective("all_gather", [&] { return impl_->backend->allgather(outputs, inputs); }).wait();
  return outputs[0];
}

void ProcessGroup::barrier() {
  // An all-reduce of one element: NCCL's barrier guesses a device, this one uses ours.
  all_reduce(at::zeros({1}, at::TensorOptions().dtype(at::kFloat).device(impl_->device)));
}

void ProcessGroup::report_failure(const std::string& message) noexcept {
  // The first rank to fail is the one to name: the others fail because of it.
  publish_failure(impl_->store, impl_->env.rank, message);
}

std::string rank_device(const std::string& device, const DistEnv& env, const std::string& what) {
  if (!env.distributed() || device.rfind("cuda", 0) != 0) return device;
  if (device == "cuda") return "cuda:" + std::to_string(env.local_rank);
  if (env.local_world_size > 1)
    throw Error(what + " " + device + ": with " + std::to_string(env.local_world_size) +
                " processes on this node give plain 'cuda'; each rank then uses cuda:LOCAL_RANK");
  return device;
}

bool have_nccl() {
#if HH_HAVE_NCCL
  return true;
#else
  return false;
#endif
}

}  // namespace hh::dist
