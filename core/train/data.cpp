#include "core/train/data.h"

#include <torch/torch.h>

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <exception>
#include <thread>
#include <cstring>
#include <numeric>
#include <random>

#include "core/eval/perplexity.h"
#include "core/interp/task_registry.h"
#include "core/model/tokenizer.h"
#include "core/util/error.h"

namespace hh::train {

namespace fs = std::filesystem;

std::string DataSource::describe() const { return kind == "task" ? "task " + task : path.string(); }

uint64_t mix_seed(uint64_t seed, uint64_t a, uint64_t b, uint64_t c) {
  auto round = [](uint64_t z) {
    z += 0x9e3779b97f4a7c15ULL;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
  };
  uint64_t h = round(seed);
  h = round(h ^ a);
  h = round(h ^ b);
  return round(h ^ c);
}

// A token stream: a read-only mapping of a .bin file (no copy, any size) or ids held in memory.
struct DataMixture::Stream {
  const uint32_t* mapped = nullptr;
  std::size_t mapped_bytes = 0;
  std::vector<uint32_t> owned;
  int64_t size = 0;
  // Permutation of the windows for one epoch, cached per (epoch, window count).
  int64_t perm_epoch = -1, perm_windows = -1, offset = 0;
  std::vector<int64_t> perm;

  ~Stream() {
    if (mapped) ::munmap(const_cast<uint32_t*>(mapped), mapped_bytes);
  }
  int64_t at(int64_t i) const { return mapped ? mapped[i] : owned[static_cast<std::size_t>(i)]; }
};

namespace {

std::unique_ptr<DataMixture::Stream> open_bin(const fs::path& path, int64_t vocab);

}  // namespace

DataMixture::DataMixture(std::vector<DataSource> sources, const model::Tokenizer* tok, const interp::TaskRegistry* tasks,
                         int64_t vocab_size, int64_t eos, uint64_t seed)
    : sources_(std::move(sources)), tok_(tok), tasks_(tasks), vocab_(vocab_size), eos_(eos), seed_(seed) {
  if (sources_.empty()) throw Error("training data: no sources");
  double total = 0;
  for (const auto& s : sources_) {
    if (!(s.weight > 0)) throw Error("training data: " + s.describe() + ": weight must be > 0");
    total += s.weight;
  }
  double acc = 0;
  for (const auto& s : sources_) cumulative_.push_back((acc += s.weight) / total);
  cumulative_.back() = 1.0;
  for (const auto& s : sources_) {
    if (s.kind == "bin") {
      streams_.push_back(open_bin(s.path, vocab_));
    } else if (s.kind == "jsonl") {
      if (tok_ == nullptr) throw Error(s.path.string() + ": text data needs the model's tokenizer.json");
      auto st = std::make_unique<Stream>();
      for (const int64_t id : eval::read_token_stream(s.path, tok_, vocab_)) st->owned.push_back(static_cast<uint32_t>(id));
      st->size = static_cast<int64_t>(st->owned.size());
      streams_.push_back(std::move(st));
    } else if (s.kind == "task") {
      if (tasks_ == nullptr || tok_ == nullptr) throw Error("training data: task " + s.task + " needs the task plugins and a tokenizer");
      if (tasks_->find(s.task) == nullptr) {
        std::string known;
        for (const auto& t : tasks_->tasks()) known += (known.empty() ? "" : ", ") + t.id;
        throw Error("training data: unknown task '" + s.task + "' (known: " + known + ")");
      }
      tasks_->resolve_params(s.task, s.params);  // refuses unknown or out-of-range parameters now
      streams_.push_back(nullptr);
    } else {
      throw Error("training data: unknown source kind '" + s.kind + "' (bin, jsonl or task)");
    }
  }
}

DataMixture::~DataMixture() = default;
DataMixture::DataMixture(DataMixture&&) noexcept = default;
DataMixture& DataMixture::operator=(DataMixture&&) noexcept = default;

std::size_t DataMixture::source_of(int64_t index) const {
  if (sources_.size() == 1) return 0;
  const double u = static_cast<double>(mix_seed(seed_, 0x5eed, static_cast<uint64_t>(index)) >> 11) * 0x1.0p-53;
  return static_cast<std::size_t>(std::upper_bound(cumulative_.begin(), cumulative_.end(), u) - cumulative_.begin());
}

DataMixture::Sample DataMixture::make_sample(int64_t index, int64_t seq_len) {
  if (index < 0) throw Error("training data: negative sample index");
  if (seq_len < 1) throw Error("training data: seq_len must be >= 1");
  const std::size_t s = std::min(source_of(index), sources_.size() - 1);
  if (!streams_[s]) return task_sample(s, index, seq_len);
  return {stream_sample(s, index, seq_len), std::vector<uint8_t>(static_cast<std::size_t>(seq_len), 1)};
}

std::vector<int64_t> DataMixture::sample(int64_t index, int64_t seq_len) { return make_sample(index, seq_len).ids; }

void DataMixture::probe_tasks(int64_t seq_len) const {
  for (std::size_t s = 0; s < sources_.size(); ++s) {
    if (streams_[s]) continue;
    try {
      (void)task_sample(s, 0, seq_len);
    } catch (const std::exception& e) {
      throw Error("training data: " + sources_[s].describe() + ": " + e.what());
    }
  }
}

at::Tensor DataMixture::batch(int64_t first, int64_t n, int64_t seq_len, at::Tensor* target_mask) {
  if (first < 0 || n < 0) throw Error("training data: negative sample index or count");
  if (seq_len < 1) throw Error("training data: seq_len must be >= 1");
  at::Tensor out = at::empty({n, seq_len + 1}, at::TensorOptions().dtype(at::kLong));
  auto* dst = out.data_ptr<int64_t>();
  const bool any_masked = std::any_of(sources_.begin(), sources_.end(), [](const DataSource& s) { return s.answer_loss_only; });
  at::Tensor mask;
  if (target_mask && any_masked) mask = at::empty({n, seq_len}, at::TensorOptions().dtype(at::kByte));
  if (target_mask) *target_mask = mask;
  uint8_t* mdst = mask.defined() ? mask.data_ptr<uint8_t>() : nullptr;
  auto put = [&](int64_t i, const Sample& x) {
    std::memcpy(dst + i * (seq_len + 1), x.ids.data(), sizeof(int64_t) * static_cast<std::size_t>(seq_len + 1));
    if (mdst) std::memcpy(mdst + i * seq_len, x.targets.data(), static_cast<std::size_t>(seq_len));
  };
  // Stream samples are copies (serial); task samples run generators, spread over worker threads.
  std::vector<int64_t> task_rows;
  for (int64_t i = 0; i < n; ++i) {
    if (streams_[source_of(first + i)]) put(i, make_sample(first + i, seq_len));
    else task_rows.push_back(i);
  }
  if (task_rows.empty()) return out;
  const std::size_t workers = std::min<std::size_t>(task_rows.size(), std::max(1u, std::thread::hardware_concurrency()));
  std::atomic<std::size_t> next{0};
  std::vector<std::exception_ptr> errors(workers);
  auto work = [&](std::size_t w) {
    try {
      for (std::size_t j = next++; j < task_rows.size(); j = next++) {
        const int64_t i = task_rows[j];
        put(i, task_sample(source_of(first + i), first + i, seq_len));
      }
    } catch (...) {
      errors[w] = std::current_exception();
      next = task_rows.size();
    }
  };
  std::vector<std::thread> threads;
  for (std::size_t w = 1; w < workers; ++w) threads.emplace_back(work, w);
  work(0);
  for (auto& t : threads) t.join();
  for (auto& e : errors)
    if (e) std::rethrow_exception(e);
  return out;
}

std::vector<int64_t> DataMixture::stream_sample(std::size_t s, int64_t index, int64_t seq_len) {
  Stream& st = *streams_[s];
  if (st.size <= seq_len)
    throw Error(sources_[s].describe() + ": " + std::to_string(st.size) + " tokens, too few for one sequence of " +
                std::to_string(seq_len) + " + 1");
  // W windows an epoch, leaving room for every shift in [0, seq_len) when the stream is long enough:
  // epoch 0 cuts at multiples of seq_len, each later epoch at a seeded shift of them, so a small corpus
  // is not seen at the same boundaries every time (a model would learn the cut, not the text).
  const int64_t windows = std::max<int64_t>(1, (st.size - seq_len) / seq_len);
  const int64_t slack = std::min(seq_len - 1, st.size - 1 - windows * seq_len);
  const int64_t epoch = index / windows, pos = index % windows;
  if (st.perm_epoch != epoch || st.perm_windows != windows) {
    st.perm.resize(static_cast<std::size_t>(windows));
    std::iota(st.perm.begin(), st.perm.end(), 0);
    std::mt19937_64 rng(mix_seed(seed_, 0xe90c, s, static_cast<uint64_t>(epoch)));
    st.offset = epoch == 0 ? 0 : static_cast<int64_t>(rng() % static_cast<uint64_t>(slack + 1));
    // Fisher-Yates with our own index draw, so the order is the same with every standard library.
    for (int64_t i = windows - 1; i > 0; --i) {
      const int64_t j = static_cast<int64_t>(rng() % static_cast<uint64_t>(i + 1));
      std::swap(st.perm[static_cast<std::size_t>(i)], st.perm[static_cast<std::size_t>(j)]);
    }
    st.perm_epoch = epoch;
    st.perm_windows = windows;
  }
  const int64_t start = st.offset + st.perm[static_cast<std::size_t>(pos)] * seq_len;
  std::vector<int64_t> out(static_cast<std::size_t>(seq_len + 1));
  for (int64_t i = 0; i <= seq_len; ++i) out[static_cast<std::size_t>(i)] = st.at(start + i);
  return out;
}

DataMixture::Sample DataMixture::task_sample(std::size_t s, int64_t index, int64_t seq_len) const {
  // Example k of the sample comes from its own seed, one plugin call each: nothing is generated that
  // the sample does not use, and samples can be made in any order or in parallel.
  nlohmann::json params = sources_[s].params;
  params["num_examples"] = 1;
  const bool all = !sources_[s].answer_loss_only;
  const auto need = static_cast<std::size_t>(seq_len + 1);
  Sample out;
  out.ids.reserve(need);
  std::vector<uint8_t> counts;   // per token: does predicting it count
  for (uint64_t k = 0; out.ids.size() < need; ++k) {
    if (k > 4096) throw Error("training data: task " + sources_[s].task + " yields empty examples");
    const auto ex = tasks_->generate(sources_[s].task, params, *tok_, mix_seed(seed_, 0x7a5c00 + s, static_cast<uint64_t>(index), k));
    if (ex.empty()) throw Error("training data: task " + sources_[s].task + " generated no example");
    if (!out.ids.empty() && eos_ >= 0) {
      out.ids.push_back(eos_);
      counts.push_back(all);
    }
    out.ids.insert(out.ids.end(), ex[0].clean_ids.begin(), ex[0].clean_ids.end());
    counts.insert(counts.end(), ex[0].clean_ids.size(), all);
    out.ids.insert(out.ids.end(), ex[0].answer_ids.begin(), ex[0].answer_ids.end());
    counts.insert(counts.end(), ex[0].answer_ids.size(), 1);
  }
  out.ids.resize(need);
  out.targets.assign(counts.begin() + 1, counts.begin() + static_cast<std::ptrdiff_t>(need));
  return out;
}

namespace {

std::unique_ptr<DataMixture::Stream> open_bin(const fs::path& path, int64_t vocab) {
  const std::string file = path.string();
  const int fd = ::open(file.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) throw Error(file + ": cannot read: " + std::strerror(errno));
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    ::close(fd);
    throw Error(file + ": cannot stat");
  }
  const auto bytes = static_cast<std::size_t>(st.st_size);
  if (bytes % 4 != 0) {
    ::close(fd);
    throw Error(file + ": " + std::to_string(bytes) + " bytes is not a whole number of uint32 ids");
  }
  auto out = std::make_unique<DataMixture::Stream>();
  out->size = static_cast<int64_t>(bytes / 4);
  if (bytes > 0) {
    void* p = ::mmap(nullptr, bytes, PROT_READ, MAP_PRIVATE, fd, 0);
    if (p == MAP_FAILED) {
      ::close(fd);
      throw Error(file + ": cannot map: " + std::strerror(errno));
    }
    out->mapped = static_cast<const uint32_t*>(p);
    out->mapped_bytes = bytes;
  }
  ::close(fd);
  if (vocab > 0)
    for (int64_t i = 0; i < out->size; ++i)
      if (static_cast<int64_t>(out->mapped[i]) >= vocab)
        throw Error(file + ": token " + std::to_string(i) + " = " + std::to_string(out->mapped[i]) +
                    " is outside the vocabulary [0, " + std::to_string(vocab) + ")");
  return out;
}

}  // namespace

}  // namespace hh::train
