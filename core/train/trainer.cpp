#include "core/train/trainer.h"

#include <torch/torch.h>

#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstring>
#include <fstream>
#include <functional>
#include <map>
#include <optional>

#include "core/attention/hybrid_model.h"
#include "core/dist/grad_sync.h"
#include "core/dist/process_group.h"
#include "core/interp/calibration.h"
#include "core/io/checkpoint.h"
#include "core/io/fingerprint.h"
#include "core/io/safetensors.h"
#include "core/model/summary.h"
#include "core/model/tokenizer.h"
#include "core/select/manifest.h"
#include "core/train/data.h"
#include "core/train/job_lock.h"
#include "core/train/optim.h"
#include "core/train/run_log.h"
#include "core/util/error.h"
#include "core/util/files.h"
#include "core/util/log.h"

namespace hh::train {

namespace fs = std::filesystem;
using nlohmann::json;
using jobs::StageKind;

namespace {

constexpr int64_t kEvalIndexBase = int64_t{1} << 40;  // sample indices no training step reaches
const char* const kModelExtras[] = {"tokenizer_config.json", "generation_config.json"};

double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}


// Where the job stands; state.json of a checkpoint.
struct JobState {
  int64_t stage = 0, stage_step = 0;      // next step to run
  int64_t train_rows = 0, eval_rows = 0;  // rows of run.h5 this state accounts for
  int64_t optimizer_steps = 0;
  double elapsed_s = 0;
  std::string job_sha256;

  json to_json() const {
    return {{"format", "hydrahead-train-state"}, {"format_version", 1},  {"stage", stage},
            {"stage_step", stage_step},          {"train_rows", train_rows}, {"eval_rows", eval_rows},
            {"optimizer_steps", optimizer_steps}, {"elapsed_s", elapsed_s}, {"job_sha256", job_sha256}};
  }
  static JobState from_json(const json& j, const std::string& where) {
    try {
      if (j.at("format") != "hydrahead-train-state") throw Error(where + ": not a training state file");
      JobState s;
      s.stage = j.at("stage").get<int64_t>();
      s.stage_step = j.at("stage_step").get<int64_t>();
      s.train_rows = j.at("train_rows").get<int64_t>();
      s.eval_rows = j.at("eval_rows").get<int64_t>();
      s.optimizer_steps = j.at("optimizer_steps").get<int64_t>();
      s.elapsed_s = j.at("elapsed_s").get<double>();
      s.job_sha256 = j.at("job_sha256").get<std::string>();
      return s;
    } catch (const json::exception& e) {
      throw Error(where + ": malformed training state: " + e.what());
    }
  }
};

// The models a job trains, and the files that travel with every saved model (tokenizer.json, ...),
// read once at the start: the checkpoint they may come from is deleted when a newer one is written.
struct Models : StageModels {
  std::map<std::string, std::string> extra_files;
};

// `fill` creates a directory at a temporary sibling path of `final_dir`, which is then renamed over
// `final_dir` (replacing an older one), so that `final_dir` is never seen half-written.
void publish_dir(const fs::path& final_dir, const std::function<void(const fs::path&)>& fill) {
  const fs::path tmp = final_dir.string() + ".tmp." + std::to_string(::getpid());
  util::remove_tree(tmp);
  try {
    fill(tmp);
  } catch (...) {
    util::remove_tree(tmp);
    throw;
  }
  util::remove_tree(final_dir);
  fs::rename(tmp, final_dir);
}

std::string read_bytes(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  if (!in) throw Error(p.string() + ": cannot read");
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

}  // namespace

// Every weight of a dense model or hybrid under its checkpoint name (tensor handles, shared storage).
std::vector<std::pair<std::string, at::Tensor>> named_weights(const StageModels& m) {
  std::vector<std::pair<std::string, at::Tensor>> out;
  const model::Transformer& base = m.dense ? *m.dense : m.student->teacher();
  model::Weights w = base.weights();
  for (const auto& e : model::weight_table(base.config(), w)) out.emplace_back(e.name, *e.slot);
  if (!m.dense && m.student) {
    std::vector<attention::HybridLayerWeights> layers = m.student->layers();
    for (int64_t l = 0; l < base.config().num_hidden_layers; ++l)
      for (const auto& e : attention::hybrid_weight_table(base.config(), m.student->options(),
                                                          m.student->splits()[static_cast<size_t>(l)], l,
                                                          layers[static_cast<size_t>(l)]))
        out.emplace_back(e.name, *e.slot);
  }
  return out;
}

std::vector<Param> stage_params(const StageModels& m, StageKind kind) {
  std::vector<Param> out;
  for (auto& [name, t] : named_weights(m)) {
    const bool attention = name.find(".self_attn.") != std::string::npos;
    const bool train = kind != StageKind::Align || attention;
    t.requires_grad_(train);
    if (train) out.push_back({name, t, t.dim() >= 2 && name.find("embed_tokens") == std::string::npos});
  }
  return out;
}

namespace {

model::Transformer deep_copy(const model::Transformer& t) {
  model::Weights w = t.weights();
  for (const auto& e : model::weight_table(t.config(), w)) *e.slot = e.slot->detach().clone();
  if (t.config().tie_word_embeddings) w.lm_head = at::Tensor();
  return model::Transformer(t.config(), std::move(w));
}

void save_model_dir(const Models& m, const fs::path& dir) {
  if (m.student) {
    m.student->save(dir);
  } else {
    model::Weights w = m.dense->weights();
    for (const auto& e : model::weight_table(m.dense->config(), w)) *e.slot = e.slot->detach();
    model::save_model(dir, m.dense->config(), w);
  }
  for (const auto& [name, bytes] : m.extra_files) io::write_file_atomic(dir / name, bytes);
}

// ---- losses ---------------------------------------------------------------------------------------

// The next-token loss is sum(w * nll) with these per-token weights [B, T]: 1 / (B T) (the mean over all
// tokens), or with a mask mask / (the row's count * rows that count any): the mean over rows of each
// row's mean over its counted targets.
at::Tensor loss_weights(const at::Tensor& targets, const at::Tensor& mask) {
  if (!mask.defined())
    return at::full(targets.sizes(), 1.0 / static_cast<double>(targets.numel()), targets.options().dtype(at::kFloat));
  const at::Tensor m = mask.to(targets.device(), at::kFloat);
  const at::Tensor count = m.sum(1, true);
  const at::Tensor rows = (count > 0).to(at::kFloat).sum().clamp_min(1.0);
  return m / count.clamp_min(1.0) / rows;
}

// Negative log-likelihood [B, T] of targets [B, T] under logits [B, T, V], in float32.
at::Tensor token_nll(const at::Tensor& logits, const at::Tensor& targets) {
  return -at::log_softmax(logits.to(at::kFloat), -1).gather(-1, targets.unsqueeze(-1)).squeeze(-1);
}

at::Tensor cross_entropy(const at::Tensor& logits, const at::Tensor& targets, const at::Tensor& mask) {
  return (token_nll(logits, targets) * loss_weights(targets, mask)).sum();
}

// Sum over tokens of KL(teacher || student) = sum_v p_t (log p_t - log p_s), temperature 1, in float32.
at::Tensor kl_sum(const at::Tensor& teacher_logits, const at::Tensor& student_logits) {
  const int64_t V = student_logits.size(-1);
  const at::Tensor lt = at::log_softmax(teacher_logits.reshape({-1, V}).to(at::kFloat), -1);
  const at::Tensor ls = at::log_softmax(student_logits.reshape({-1, V}).to(at::kFloat), -1);
  return (lt.exp() * (lt - ls)).sum();
}

// The float32 sum over chunks of `chunk` positions of part(t0, n), positions t0 .. t0 + n of hidden [B, T, d].
at::Tensor sum_by_chunks(const at::Tensor& hidden, int64_t chunk, const std::function<at::Tensor(int64_t, int64_t)>& part) {
  at::Tensor total = at::zeros({}, hidden.options().dtype(at::kFloat));
  for (int64_t t0 = 0; t0 < hidden.size(1); t0 += chunk) total += part(t0, std::min(chunk, hidden.size(1) - t0));
  return total;
}

// The gradient with respect to hidden [B, T, d] of the sum over chunks of `chunk` positions of
// part(rows, t0, n), rows = hidden's positions t0 .. t0 + n: each chunk's part is formed again with
// autograd and back-propagated before the next (which accumulates the weights' gradients), so no chunk's
// graph outlives it.
at::Tensor backward_by_chunks(const at::Tensor& hidden, int64_t chunk,
                              const std::function<at::Tensor(const at::Tensor&, int64_t, int64_t)>& part) {
  at::Tensor grad_hidden = at::zeros_like(hidden);
  for (int64_t t0 = 0; t0 < hidden.size(1); t0 += chunk) {
    const int64_t n = std::min(chunk, hidden.size(1) - t0);
    const at::Tensor h = hidden.narrow(1, t0, n).detach().requires_grad_(true);
    at::Tensor p;
    {
      at::AutoGradMode enable(true);
      p = part(h, t0, n);
    }
    torch::autograd::backward({p});
    grad_hidden.narrow(1, t0, n).copy_(h.grad());
  }
  return grad_hidden;
}

// sum(w * nll) with the vocabulary projected `chunk` positions at a time; the backward pass projects
// each chunk again and back-propagates it before the next, so no chunk's graph outlives it.
struct ChunkedLoss : public torch::autograd::Function<ChunkedLoss> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& hidden, const at::Tensor& targets,
                            const at::Tensor& weights, int64_t base, int64_t chunk) {
    ctx->saved_data["base"] = base;
    ctx->saved_data["chunk"] = chunk;
    ctx->save_for_backward({hidden, targets, weights});
    const auto* model = reinterpret_cast<const model::Transformer*>(base);
    return sum_by_chunks(hidden, chunk, [&](int64_t t0, int64_t n) {
      return (token_nll(model->unembed(hidden.narrow(1, t0, n)), targets.narrow(1, t0, n)) * weights.narrow(1, t0, n)).sum();
    });
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx, torch::autograd::variable_list grad) {
    const auto* model = reinterpret_cast<const model::Transformer*>(ctx->saved_data["base"].toInt());
    const int64_t chunk = ctx->saved_data["chunk"].toInt();
    const auto saved = ctx->get_saved_variables();
    // (the final norm's and lm_head's gradients accumulate)
    const at::Tensor grad_hidden = backward_by_chunks(saved[0], chunk, [&](const at::Tensor& h, int64_t t0, int64_t n) {
      return (token_nll(model->unembed(h), saved[1].narrow(1, t0, n)) * saved[2].narrow(1, t0, n)).sum() * grad[0];
    });
    return {grad_hidden, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

// The sum over a chunk's rows of KL(teacher || student) from the two models' hidden states [B, n, d].
at::Tensor kl_rows_sum(const model::Transformer& teacher, const at::Tensor& teacher_hidden, const model::Transformer& student,
                       const at::Tensor& student_hidden) {
  at::Tensor t;
  {
    at::NoGradGuard ng;
    t = teacher.unembed(teacher_hidden);
  }
  return kl_sum(t, student.unembed(student_hidden));
}

// KL(teacher || student) a chunk of positions at a time, as ChunkedLoss does the cross-entropy: the
// forward pass projects each chunk of both models and sums, the backward pass projects each chunk again
// and back-propagates it through the student's final norm and lm_head before the next.
struct ChunkedKl : public torch::autograd::Function<ChunkedKl> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& student_hidden,
                            const at::Tensor& teacher_hidden, int64_t teacher, int64_t student, int64_t chunk) {
    ctx->saved_data["teacher"] = teacher;
    ctx->saved_data["student"] = student;
    ctx->saved_data["chunk"] = chunk;
    ctx->save_for_backward({student_hidden, teacher_hidden});
    const auto& t = *reinterpret_cast<const model::Transformer*>(teacher);
    const auto& s = *reinterpret_cast<const model::Transformer*>(student);
    const at::Tensor total = sum_by_chunks(student_hidden, chunk, [&](int64_t t0, int64_t n) {
      return kl_rows_sum(t, teacher_hidden.narrow(1, t0, n), s, student_hidden.narrow(1, t0, n));
    });
    return total / static_cast<double>(student_hidden.size(0) * student_hidden.size(1));
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx, torch::autograd::variable_list grad) {
    const auto& t = *reinterpret_cast<const model::Transformer*>(ctx->saved_data["teacher"].toInt());
    const auto& s = *reinterpret_cast<const model::Transformer*>(ctx->saved_data["student"].toInt());
    const int64_t chunk = ctx->saved_data["chunk"].toInt();
    const auto saved = ctx->get_saved_variables();
    const double rows = static_cast<double>(saved[0].size(0) * saved[0].size(1));
    // (the student's final norm's and lm_head's gradients accumulate)
    const at::Tensor grad_hidden = backward_by_chunks(saved[0], chunk, [&](const at::Tensor& h, int64_t t0, int64_t n) {
      return kl_rows_sum(t, saved[1].narrow(1, t0, n), s, h) * (grad[0] / rows);
    });
    return {grad_hidden, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

}  // namespace

at::Tensor chunked_kl_divergence(const model::Transformer& teacher, const at::Tensor& teacher_hidden,
                                 const model::Transformer& student, const at::Tensor& student_hidden, int64_t chunk) {
  if (chunk < 1) throw Error("chunked KL: chunk must be >= 1");
  if (teacher_hidden.dim() != 3 || student_hidden.dim() != 3 || teacher_hidden.size(0) != student_hidden.size(0) ||
      teacher_hidden.size(1) != student_hidden.size(1))
    throw Error("chunked KL: the hidden states must be [B, T, d] of one B and T, got " + model::format_shape(teacher_hidden.sizes().vec()) +
                " and " + model::format_shape(student_hidden.sizes().vec()));
  // The node must exist even when nothing upstream requires grad but the lm_head does.
  const at::Tensor h = at::GradMode::is_enabled() && !student_hidden.requires_grad()
                           ? student_hidden.detach().requires_grad_(true) : student_hidden;
  return ChunkedKl::apply(h, teacher_hidden.detach(), reinterpret_cast<int64_t>(&teacher), reinterpret_cast<int64_t>(&student), chunk);
}

at::Tensor chunked_next_token_loss(const model::Transformer& base, const at::Tensor& hidden, const at::Tensor& targets,
                                   const at::Tensor& target_mask, int64_t chunk) {
  if (chunk < 1) throw Error("chunked loss: chunk must be >= 1");
  const at::Tensor w = loss_weights(targets, target_mask);
  // The node must exist even when nothing upstream requires grad but the lm_head does.
  const at::Tensor h = at::GradMode::is_enabled() && !hidden.requires_grad() ? hidden.detach().requires_grad_(true) : hidden;
  return ChunkedLoss::apply(h, targets, w, reinterpret_cast<int64_t>(&base), chunk);
}

namespace {
// Tokens in a batch above which the cross-entropy and distillation's KL project the vocabulary in chunks
// of positions. Unchunked, each float32 logits tensor, log-softmax and gradient takes 2.3 GiB at 4,096
// tokens of Qwen3's vocabulary, and the KL holds both models' (about 9 GiB of distil's peak there:
// docs/BENCHMARKS.md, training throughput). The chunks' second projections cost a few milliseconds a step.
constexpr int64_t kChunkedLossTokens = 2048;
constexpr int64_t kLossChunk = 1024;
}  // namespace

double stage_loss(const StageModels& m, StageKind kind, const at::Tensor& ids, double scale, bool backward,
                  bool checkpoint_layers, const at::Tensor& target_mask) {
  if (kind == StageKind::Pretrain ? !m.dense : !m.student) throw Error(std::string("stage ") + jobs::stage_kind_name(kind) + ": no model to train");
  if ((kind == StageKind::Align || kind == StageKind::Distil) && !m.teacher)
    throw Error(std::string("stage ") + jobs::stage_kind_name(kind) + " needs the teacher");
  if (ids.dim() != 2 || ids.size(1) < 2) throw Error("stage loss: token ids must be [B, T + 1] with T >= 1");
  std::optional<at::NoGradGuard> no_grad;
  if (!backward) no_grad.emplace();
  const at::Tensor input = ids.narrow(1, 0, ids.size(1) - 1);
  const at::Tensor target = ids.narrow(1, 1, ids.size(1) - 1);
  switch (kind) {
    case StageKind::Pretrain: {
      const at::Tensor h = m.dense->hidden(input, checkpoint_layers);
      const at::Tensor loss = input.numel() > kChunkedLossTokens
                                  ? chunked_next_token_loss(*m.dense, h, target, target_mask, kLossChunk)
                                  : cross_entropy(m.dense->unembed(h), target, target_mask);
      if (backward) (loss * scale).backward();
      return loss.item<double>();
    }
    case StageKind::Finetune: {
      at::Tensor loss = input.numel() > kChunkedLossTokens
          ? chunked_next_token_loss(m.student->teacher(), m.student->hidden(input, true, checkpoint_layers), target,
                                    target_mask, kLossChunk)
          : cross_entropy(m.student->forward(input, true, checkpoint_layers), target, target_mask);
      if (backward) (loss * scale).backward();
      return loss.item<double>();
    }
    case StageKind::Distil: {
      at::Tensor t;  // the teacher's last hidden states
      {
        at::NoGradGuard ng;
        t = m.teacher->hidden(input);
      }
      const at::Tensor h = m.student->hidden(input, true, checkpoint_layers);
      const model::Transformer& base = m.student->teacher();
      const at::Tensor loss = input.numel() > kChunkedLossTokens
                 ? chunked_kl_divergence(*m.teacher, t, base, h, kLossChunk)
                 : kl_rows_sum(*m.teacher, t, base, h) / static_cast<double>(input.numel());
      if (backward) (loss * scale).backward();
      return loss.item<double>();
    }
    case StageKind::Align: {
      // The teacher's layer inputs and attention outputs; each hybrid attention gets the teacher's input
      // and matches its output. Layers are independent given the teacher, so each one's graph is freed
      // by its own backward.
      const auto& cfg = m.student->config();
      const int64_t L = cfg.num_hidden_layers;
      std::map<std::string, at::Tensor> cache;
      {
        at::NoGradGuard ng;
        model::Hooks hooks;
        for (int64_t l = 0; l < L; ++l) {
          hooks.cache(model::hook_name(l, model::HookKind::ResidPre), &cache);
          hooks.cache(model::hook_name(l, model::HookKind::AttnOut), &cache);
        }
        model::ForwardOptions fo;
        fo.hooks = &hooks;
        fo.logits = false;  // the cached layers' tensors only
        m.teacher->forward(input, fo);
      }
      const model::Transformer& s = m.student->teacher();
      // The layers' losses summed on the device (float64, in layer order) and read once: a read per
      // layer would wait for each layer's backward before the next layer's launches.
      at::Tensor total;
      for (int64_t l = 0; l < L; ++l) {
        const auto& lw = s.weights().layers[static_cast<size_t>(l)];
        const at::Tensor xn = model::rms_norm(cache.at(model::hook_name(l, model::HookKind::ResidPre)), lw.input_layernorm,
                                              cfg.rms_norm_eps);
        const at::Tensor y = attention::hybrid_attention(cfg, m.student->options(), m.student->splits()[static_cast<size_t>(l)],
                                                         lw, m.student->layers()[static_cast<size_t>(l)], xn, s.inv_freq());
        const at::Tensor target_l = cache.at(model::hook_name(l, model::HookKind::AttnOut)).to(at::kFloat);
        at::Tensor loss = at::mse_loss(s.attn_out(l, y).to(at::kFloat), target_l);
        if (backward) (loss * (scale / static_cast<double>(L))).backward();
        const at::Tensor l64 = loss.detach().to(at::kDouble);
        total = total.defined() ? total + l64 : l64;
      }
      return total.defined() ? total.item<double>() / static_cast<double>(L) : 0.0;
    }
  }
  return 0;
}

namespace {

// What the data streams need, read from the configuration and tokenizer without loading any weights,
// so that a mistake in the data is reported before minutes of loading and conversion.
struct DataSetup {
  std::optional<model::Tokenizer> tok;
  fs::path tokenizer_file, extras_from;   // where the files that travel with the model come from
  int64_t vocab = 0, eos = -1;
  std::vector<std::unique_ptr<DataMixture>> train, held_out;   // per stage; null for stages not run

  DataSetup(const jobs::JobSpec& job, const fs::path& resume_model, const interp::TaskRegistry* tasks, int64_t first,
            int64_t last) {
    model::ModelConfig cfg;
    if (job.pretrain()) {
      extras_from = resume_model;
      tokenizer_file = resume_model.empty() ? job.tokenizer : resume_model / "tokenizer.json";
      cfg = model::ModelConfig::load(resume_model.empty() ? job.model_config : resume_model / "config.json");
    } else {
      extras_from = !resume_model.empty() ? resume_model : !job.hybrid.empty() ? job.hybrid : job.teacher;
      tokenizer_file = extras_from / "tokenizer.json";
      cfg = model::ModelConfig::load_teacher_view(extras_from / "config.json");
    }
    if (!tokenizer_file.empty() && fs::exists(tokenizer_file)) tok = model::Tokenizer::load(tokenizer_file);
    vocab = cfg.vocab_size;
    eos = cfg.eos_token_id.value_or(-1);
    train.resize(job.stages.size());
    held_out.resize(job.stages.size());
    for (int64_t si = first; si <= last; ++si) {
      const jobs::StageSpec& st = job.stages[static_cast<size_t>(si)];
      const std::vector<DataSource>& sources = st.data.empty() ? job.data : st.data;
      const model::Tokenizer* t = tok ? &*tok : nullptr;
      train[static_cast<size_t>(si)] = std::make_unique<DataMixture>(sources, t, tasks, vocab, eos, mix_seed(job.seed, st.seed, 0xda7a));
      train[static_cast<size_t>(si)]->probe_tasks(st.seq_len);
      if (!job.eval_data.empty()) {
        held_out[static_cast<size_t>(si)] =
            std::make_unique<DataMixture>(job.eval_data, t, tasks, vocab, eos, mix_seed(job.seed, st.seed, 0xe7a1));
        held_out[static_cast<size_t>(si)]->probe_tasks(st.seq_len);
      }
    }
  }
};

}  // namespace

namespace {

// The optimiser of a stage: AdamW over every parameter, or with a sharded optimiser over this rank's
// share (dist::partition_params), each updated parameter then broadcast from its owner. state() and
// load_state() use the unsharded layout either way, so a checkpoint resumes with any number of ranks.
class StageOptimizer {
 public:
  StageOptimizer(std::vector<Param> params, const AdamWOptions& ao, dist::ProcessGroup* group, bool shard)
      : all_(std::move(params)), group_(group) {
    std::vector<Param> mine = all_;
    if (group_ != nullptr && shard) {
      std::vector<int64_t> numels;
      for (const auto& p : all_) numels.push_back(p.tensor.numel());
      owner_ = dist::partition_params(numels, group_->size());
      mine.clear();
      for (size_t i = 0; i < all_.size(); ++i)
        if (owner_[i] == group_->rank()) mine.push_back(all_[i]);
    }
    opt_.emplace(std::move(mine), ao);
  }
  void step(double lr) {
    opt_->step(lr);
    if (owner_.empty()) return;
    at::NoGradGuard ng;
    std::vector<dist::Pending> pending;
    for (size_t i = 0; i < all_.size(); ++i) pending.push_back(group_->broadcast_async(all_[i].tensor, owner_[i]));
    for (auto& p : pending) p.wait();
  }
  void zero_grad() {
    for (auto& p : all_)
      if (p.tensor.grad().defined()) p.tensor.mutable_grad() = at::Tensor();
  }
  int64_t steps() const { return opt_->steps(); }
  // The whole state in AdamW::state()'s names and order. Sharded: every owner broadcasts its part (a
  // collective: every rank calls this); only rank 0 needs the result.
  std::vector<std::pair<std::string, at::Tensor>> state() const {
    if (owner_.empty()) return opt_->state();
    std::map<std::string, at::Tensor> mine;
    for (auto& [name, t] : opt_->state()) mine[name] = t;
    std::vector<std::pair<std::string, at::Tensor>> out;
    for (size_t i = 0; i < all_.size(); ++i) {
      const at::Tensor& p = all_[i].tensor;
      const bool low = p.scalar_type() == at::kBFloat16 || p.scalar_type() == at::kHalf;
      const auto opts = p.options().dtype(p.scalar_type() == at::kDouble ? at::kDouble : at::kFloat);
      std::vector<std::string> names = {all_[i].name + ".exp_avg", all_[i].name + ".exp_avg_sq"};
      if (low) names.push_back(all_[i].name + ".master");
      for (const auto& n : names) {
        at::Tensor t = owner_[i] == group_->rank() ? mine.at(n).contiguous() : at::empty(p.sizes(), opts);
        group_->broadcast(t, owner_[i]);
        out.emplace_back(n, t);
      }
    }
    return out;
  }
  void load_state(const std::map<std::string, at::Tensor>& state, int64_t steps) { opt_->load_state(state, steps); }

 private:
  std::vector<Param> all_;
  std::vector<int> owner_;   // per parameter; empty: not sharded
  dist::ProcessGroup* group_;
  std::optional<AdamW> opt_;
};

}  // namespace

void check_job_data(const jobs::JobSpec& job, const interp::TaskRegistry* tasks) {
  DataSetup(job, {}, tasks, 0, static_cast<int64_t>(job.stages.size()) - 1);
}

JobStatus run_job(const jobs::JobSpec& job, const TrainOptions& o) {
  const fs::path out = job.output;
  dist::ProcessGroup* group = o.dist.get();
  const int world = group ? group->size() : 1;
  const bool lead = group == nullptr || group->rank() == 0;   // writes files and emits events
  const auto emit = [&](json e) {
    if (o.on_event && lead) o.on_event(e);
  };
  for (size_t i = 0; i < job.stages.size(); ++i)
    if (job.stages[i].batch % world != 0)
      throw Error("stages[" + std::to_string(i) + "].batch (" + std::to_string(job.stages[i].batch) +
                  ") must be a multiple of the number of ranks (" + std::to_string(world) +
                  "): the batch is split evenly over them");
  fs::create_directories(out);
  std::optional<JobLock> lock;
  if (lead) lock.emplace(out);
  const fs::path ckpt_root = out / "checkpoints";
  const fs::path run_path = out / "run.h5";
  const int64_t S = static_cast<int64_t>(job.stages.size());

  // ---- where the job stands ----
  JobState state;
  state.job_sha256 = job.sha256;
  fs::path resume_from;
  if (fs::exists(ckpt_root / "LATEST")) {
    std::ifstream in(ckpt_root / "LATEST");
    std::string name;
    std::getline(in, name);
    resume_from = ckpt_root / name;
    const fs::path sp = resume_from / "state.json";
    std::ifstream sin(sp);
    if (!sin) throw Error(sp.string() + ": cannot read (the checkpoint named by " + (ckpt_root / "LATEST").string() + ")");
    json j;
    try {
      j = json::parse(sin);
    } catch (const json::parse_error& e) {
      throw Error(sp.string() + ": not valid JSON: " + e.what());
    }
    state = JobState::from_json(j, sp.string());
    if (state.job_sha256 != job.sha256)
      throw Error(out.string() + ": holds a run of a different job spec; resume with the same spec, or choose a new output directory");
    if (lead && !fs::exists(run_path)) throw Error(run_path.string() + ": missing, though " + resume_from.string() + " exists");
  }
  int64_t first_stage = state.stage;
  int64_t last_stage = S - 1;
  if (!o.only_stage.empty()) {
    const jobs::StageSpec* st = job.find_stage(o.only_stage);
    if (st == nullptr) {
      std::string names;
      for (const auto& s : job.stages) names += (names.empty() ? "" : ", ") + s.name;
      throw Error("--stage " + o.only_stage + ": the job has no such stage (" + names + ")");
    }
    const int64_t idx = st - job.stages.data();
    if (idx < state.stage)
      throw Error("--stage " + o.only_stage + ": already finished in " + out.string() + "; choose a new output directory to rerun it");
    if (idx > state.stage) {
      state.stage = idx;
      state.stage_step = 0;
    }
    first_stage = last_stage = idx;
  }
  if (state.stage >= S) {
    emit({{"event", "done"}, {"model", (out / "model").string()}, {"already_complete", true}});
    return JobStatus::Completed;
  }

  // ---- models ----
  // A stop asked for while the models load or the student is made (a single process: ranks must stop at
  // the same step) ends the job before its first step, writing nothing; the last checkpoint, if any,
  // stays the one to resume from.
  const std::atomic<bool>* load_stop = group == nullptr ? o.stop : nullptr;
  const auto stopped_before_start = [&] {
    emit({{"event", "interrupted"},
          {"checkpoint", resume_from.empty() ? json(nullptr) : json(resume_from.string())}});
    return JobStatus::Interrupted;
  };
  Models m;
  bool need_teacher = false;
  for (int64_t s = first_stage; s <= last_stage; ++s)
    need_teacher |= job.stages[static_cast<size_t>(s)].kind == StageKind::Align ||
                    job.stages[static_cast<size_t>(s)].kind == StageKind::Distil;
  const fs::path resume_model = resume_from.empty() ? fs::path() : resume_from / "model";
  DataSetup data_setup(job, resume_model, o.tasks, state.stage, last_stage);
  const fs::path& extras_from = data_setup.extras_from;
  const fs::path& tokenizer_file = data_setup.tokenizer_file;
  try {  // the loads read load_stop before each tensor
    if (job.pretrain()) {
      if (!resume_from.empty()) {
        m.dense.emplace(model::Transformer::load(resume_model, job.device, "", load_stop));
      } else {
        const auto cfg = model::ModelConfig::load(job.model_config);
        const at::ScalarType dt = job.dtype.empty() ? at::kFloat : model::parse_dtype(job.dtype);
        model::Weights w = model::random_weights(cfg, job.seed, dt);
        for (const auto& e : model::weight_table(cfg, w)) *e.slot = e.slot->to(model::parse_device(job.device));
        if (cfg.tie_word_embeddings) w.lm_head = at::Tensor();
        m.dense.emplace(cfg, std::move(w));
      }
    } else {
      // A job without a dtype takes the checkpoint's, but float32 on the CPU (model::resolve_dtype); a resumed
      // job's teacher takes the dtype its student was saved in, which is the one it trained in.
      const std::string dtype =
          !resume_from.empty() ? model::hf_dtype_name(model::stored_dtype(resume_model))
          : job.dtype.empty() ? std::string("auto")
                              : job.dtype;
      if (need_teacher || (resume_from.empty() && job.hybrid.empty()))
        m.teacher.emplace(model::Transformer::load(job.teacher, job.device, dtype, load_stop));
      if (!resume_from.empty()) {
        m.student.emplace(attention::HybridModel::load(resume_model, job.device, "", load_stop));
      } else if (!job.hybrid.empty()) {
        m.student.emplace(attention::HybridModel::load(job.hybrid, job.device, dtype, load_stop));
      } else {
        const auto manifest = select::read_manifest(job.manifest);
        select::check_fits(manifest, select::shape_of(m.teacher->config(), io::model_fingerprint(job.teacher)),
                           job.manifest.string());
        std::optional<model::Tokenizer> tok;
        if (fs::exists(job.teacher / "tokenizer.json")) tok = model::Tokenizer::load(job.teacher / "tokenizer.json");
        std::vector<interp::CalibExample> calib;
        if (!job.calib.empty())
          calib = interp::read_calibration(job.calib, tok ? &*tok : nullptr, m.teacher->config().vocab_size);
        attention::ConvertOptions co;
        co.calib = calib.empty() ? nullptr : &calib;
        co.seed = job.seed;
        m.student.emplace(attention::convert(deep_copy(*m.teacher), manifest, co));
      }
      if (!need_teacher) m.teacher.reset();
    }
  } catch (const hh::Cancelled&) {
    return stopped_before_start();
  }
  if (load_stop && load_stop->load()) return stopped_before_start();  // asked while the student was made
  const model::Transformer& base = m.dense ? *m.dense : m.student->teacher();
  const at::Device device = base.device();
  if (group != nullptr) {
    // Every rank starts from rank 0's weights (a conversion or initialisation on another device
    // could differ in the last bits).
    at::NoGradGuard ng;
    for (auto& [name, t] : named_weights(m)) {
      at::Tensor c = t.contiguous();
      group->broadcast(c, 0);
      if (!c.is_same(t)) t.copy_(c);
    }
  }
  if (data_setup.tok) m.extra_files["tokenizer.json"] = read_bytes(tokenizer_file);
  for (const char* extra : kModelExtras)
    if (!extras_from.empty() && fs::exists(extras_from / extra)) m.extra_files[extra] = read_bytes(extras_from / extra);

  // ---- run.h5 ----
  std::optional<RunLog> log;
  if (lead)
    log.emplace(resume_from.empty() ? RunLog::create(run_path, job)
                                    : RunLog::resume(run_path, state.train_rows, state.eval_rows, static_cast<int32_t>(state.stage)));
  // Rows of run.h5, counted on every rank (rank 0 alone has the file).
  int64_t train_rows = resume_from.empty() ? 0 : state.train_rows, eval_rows = resume_from.empty() ? 0 : state.eval_rows;
  emit({{"event", "start"},
        {"stages", [&] { json a = json::array(); for (const auto& s : job.stages) a.push_back(s.name); return a; }()},
        {"resumed", !resume_from.empty()},
        {"stage", job.stages[static_cast<size_t>(state.stage)].name},
        {"stage_step", state.stage_step},
        {"device", device.str()},
        {"ranks", world}});

  const double t_begin = now_s() - state.elapsed_s;
  int64_t steps_this_call = 0;
  auto local_stop = [&] { return (o.stop && o.stop->load()) || (o.max_steps >= 0 && steps_this_call >= o.max_steps); };
  // With several ranks a stop counts when any rank was asked, so that they all stop at the same step.
  auto should_stop = [&] {
    bool stop = local_stop();
    if (group != nullptr) {
      const at::Tensor f = at::full({1}, stop ? 1.0 : 0.0, at::TensorOptions().dtype(at::kDouble).device(group->device()));
      group->all_reduce(f, dist::ReduceOp::Max);
      stop = f.item<double>() > 0;
    }
    return stop;
  };

  // Checkpoint of the current state (model, optimiser when mid-stage, state.json), then LATEST.
  // Every rank calls it (a sharded optimiser's state is gathered); rank 0 writes.
  auto write_checkpoint = [&](const StageOptimizer* opt) -> fs::path {
    const std::string name = "stage" + std::to_string(state.stage) + "-step" + std::to_string(state.stage_step);
    const fs::path final_dir = ckpt_root / name;
    state.optimizer_steps = opt ? opt->steps() : 0;
    state.elapsed_s = now_s() - t_begin;
    state.train_rows = train_rows;
    state.eval_rows = eval_rows;
    std::vector<std::pair<std::string, at::Tensor>> opt_state;
    if (opt != nullptr) opt_state = opt->state();
    if (!lead) return final_dir;
    publish_dir(final_dir, [&](const fs::path& tmp) {
      fs::create_directories(tmp);
      save_model_dir(m, tmp / "model");
      if (opt != nullptr) io::save_tensors(tmp / "optimizer.safetensors", opt_state);
      io::write_file_atomic(tmp / "state.json", state.to_json().dump(2) + "\n");
    });
    io::write_file_atomic(ckpt_root / "LATEST", name + "\n");
    std::error_code ec;
    for (const auto& e : fs::directory_iterator(ckpt_root, ec))
      if (e.is_directory() && e.path().filename() != name) util::remove_tree(e.path());
    // The stage and step the checkpoint resumes at (stage == the stage count: the job is complete).
    emit({{"event", "checkpoint"}, {"path", final_dir.string()}, {"resume_stage", state.stage}, {"resume_step", state.stage_step}});
    return final_dir;
  };

  fs::path last_checkpoint;
  for (int64_t si = state.stage; si <= last_stage; ++si) {
    const jobs::StageSpec& st = job.stages[static_cast<size_t>(si)];
    DataMixture& data = *data_setup.train[static_cast<size_t>(si)];
    DataMixture* held_out = data_setup.held_out[static_cast<size_t>(si)].get();
    std::vector<Param> params = stage_params(m, st.kind);
    AdamWOptions ao;
    ao.beta1 = st.beta1;
    ao.beta2 = st.beta2;
    ao.weight_decay = st.weight_decay;
    StageOptimizer opt(params, ao, group, o.shard_optimizer);
    std::optional<dist::GradSync> grad_sync;
    if (group != nullptr) {
      std::vector<at::Tensor> tensors;
      for (const auto& p : params) tensors.push_back(p.tensor);
      if (!(o.bucket_mb > 0)) throw Error("--bucket-mb must be positive");
      grad_sync.emplace(*group, tensors, static_cast<std::size_t>(o.bucket_mb * 1048576.0));
      if (lead)
        log::info("stage " + st.name + ": gradients averaged over " + std::to_string(world) + " ranks in " +
                  std::to_string(grad_sync->num_buckets()) + " buckets" + (o.shard_optimizer ? ", optimizer state sharded" : ""));
    }
    if (state.stage_step > 0) {
      opt.load_state(io::load_tensors(resume_from / "optimizer.safetensors"), state.optimizer_steps);
    } else if (log) {
      log->stage_started(static_cast<int32_t>(si));
    }
    // This rank's share of each micro-batch: sequences [rank * local, (rank + 1) * local).
    const int64_t local_batch = st.batch / world;
    const int64_t rank_offset = group ? group->rank() * local_batch : 0;
    // The mean over ranks of each rank's value.
    auto rank_mean = [&](double v) {
      if (group == nullptr) return v;
      const at::Tensor t = at::full({1}, v, at::TensorOptions().dtype(at::kDouble).device(group->device()));
      group->all_reduce(t);
      return t.item<double>() / static_cast<double>(world);
    };
    int64_t trainable = 0;
    for (const auto& p : params) trainable += p.tensor.numel();
    emit({{"event", "stage"}, {"stage", st.name}, {"index", si}, {"kind", jobs::stage_kind_name(st.kind)}, {"steps", st.steps},
          {"params", trainable}, {"tokens_per_step", st.tokens_per_step()}});

    auto evaluate = [&]() {
      if (st.eval_batches <= 0) return;
      double sum = 0;
      for (int64_t b = 0; b < st.eval_batches; ++b) {
        const int64_t first = (held_out ? b * st.batch : kEvalIndexBase + b * st.batch) + rank_offset;
        at::Tensor mask;
        const at::Tensor ids = (held_out ? *held_out : data).batch(first, local_batch, st.seq_len, &mask).to(device);
        sum += stage_loss(m, st.kind, ids, 1.0, false, false, (mask.defined() ? mask.to(device) : mask));
      }
      const double loss = rank_mean(sum / static_cast<double>(st.eval_batches));
      const int64_t global = train_rows;
      if (log) log->eval(global, static_cast<int32_t>(si), loss);
      ++eval_rows;
      emit({{"event", "eval"}, {"stage", st.name}, {"step", state.stage_step}, {"global_step", global}, {"loss", loss}});
    };

    double stage_time = 0;
    int64_t stage_steps_timed = 0;
    while (state.stage_step < st.steps) {
      const int64_t k = state.stage_step;
      const double t0 = now_s();
      const double lr = schedule_lr(st.schedule, st.lr, st.min_lr, st.warmup, k, st.steps);
      double loss = 0;
      for (int64_t a = 0; a < st.grad_accum; ++a) {
        at::Tensor mask;
        const at::Tensor ids =
            data.batch((k * st.grad_accum + a) * st.batch + rank_offset, local_batch, st.seq_len, &mask).to(device);
        if (grad_sync) grad_sync->set_sync(a == st.grad_accum - 1);   // communicate on the last micro-step only
        loss += stage_loss(m, st.kind, ids, 1.0 / static_cast<double>(st.grad_accum), true, st.activation_checkpointing,
                           (mask.defined() ? mask.to(device) : mask));
      }
      if (grad_sync) grad_sync->finish();
      loss = rank_mean(loss / static_cast<double>(st.grad_accum));
      if (!std::isfinite(loss))
        throw Error("stage " + st.name + ", step " + std::to_string(k + 1) + ": the loss is " + std::to_string(loss) +
                    "; lower the learning rate or check the data (the last checkpoint is intact)");
      const double gn = clip_grad_norm(params, st.clip);
      opt.step(lr);
      opt.zero_grad();
      const double dt = now_s() - t0;
      ++state.stage_step;
      ++steps_this_call;
      stage_time += dt;
      ++stage_steps_timed;
      StepRecord r;
      r.step = train_rows + 1;
      r.stage = static_cast<int32_t>(si);
      r.stage_step = state.stage_step;
      r.loss = loss;
      r.lr = lr;
      r.grad_norm = gn;
      r.tokens_per_s = static_cast<double>(st.tokens_per_step()) / dt;
      r.elapsed_s = now_s() - t_begin;
      if (log) log->step(r);
      ++train_rows;
      // ETA: this stage's mean step time for its remaining steps; later stages by their token share.
      const double per_token = stage_time / static_cast<double>(stage_steps_timed * st.tokens_per_step());
      double eta = per_token * static_cast<double>((st.steps - state.stage_step) * st.tokens_per_step());
      for (int64_t later = si + 1; later <= last_stage; ++later)
        eta += per_token * static_cast<double>(job.stages[static_cast<size_t>(later)].steps *
                                               job.stages[static_cast<size_t>(later)].tokens_per_step());
      emit({{"event", "step"}, {"stage", st.name}, {"index", si}, {"step", state.stage_step}, {"steps", st.steps},
            {"global_step", r.step}, {"loss", loss}, {"lr", lr}, {"grad_norm", gn}, {"tokens_per_s", r.tokens_per_s},
            {"elapsed_s", r.elapsed_s}, {"eta_s", eta}});
      const bool last = state.stage_step == st.steps;
      if (st.eval_every > 0 && state.stage_step % st.eval_every == 0 && !last) evaluate();
      const bool stop = should_stop();
      if (!last && (stop || (st.checkpoint_every > 0 && state.stage_step % st.checkpoint_every == 0))) {
        const fs::path p = write_checkpoint(&opt);
        if (stop) {
          if (log) log->close();
          emit({{"event", "interrupted"}, {"checkpoint", p.string()}});
          return JobStatus::Interrupted;
        }
      }
    }
    evaluate();
    if (log) log->stage_ended(static_cast<int32_t>(si));
    for (auto& p : params) p.tensor.requires_grad_(false);
    state.stage = si + 1;
    state.stage_step = 0;
    last_checkpoint = write_checkpoint(nullptr);
    if (should_stop() && si < last_stage) {
      if (log) log->close();
      emit({{"event", "interrupted"}, {"checkpoint", last_checkpoint.string()}});
      return JobStatus::Interrupted;
    }
  }
  if (log) log->close();
  if (state.stage >= S) {
    if (lead) publish_dir(out / "model", [&](const fs::path& tmp) { save_model_dir(m, tmp); });
    emit({{"event", "done"}, {"model", (out / "model").string()}});
  } else {
    emit({{"event", "done"}, {"stage", job.stages[static_cast<size_t>(last_stage)].name}, {"checkpoint", last_checkpoint.string()}});
  }
  return JobStatus::Completed;
}

}  // namespace hh::train
