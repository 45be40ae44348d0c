// train.cpp — see k2c/model/train.h.
#include "k2c/model/mask.h"
#include "k2c/model/train.h"

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <stdexcept>

namespace k2c::model {

namespace {

Context make_context(Ops& ops, MemoryLedger& ledger, ParamList& params, const TrainConfig& c) {
  Context ctx{ops, ledger, params};
  ctx.dropout = c.dropout;
  ctx.seed = c.seed;
  if (c.activations != DType::f32 && c.activations != DType::bf16)
    throw std::invalid_argument("train: activations are f32 or bf16, not " + to_string(c.activations));
  ctx.activations = c.activations;
  check_residual(c.residual, c.dropout, "train");
  ctx.residual = c.residual;
  return ctx;
}

void check_loader(const TokenLoader& loader, const TrainConfig& c, const char* which) {
  if (loader.config().seq_len != c.model.seq_len || loader.config().global_batch != c.batch)
    throw std::invalid_argument(std::string(which) + " loader: seq_len " +
                                std::to_string(loader.config().seq_len) + " and batch " +
                                std::to_string(loader.config().global_batch) + ", but the model has T " +
                                std::to_string(c.model.seq_len) + " and the run batch " + std::to_string(c.batch));
  if (loader.vocab() > static_cast<std::uint32_t>(c.model.vocab))
    throw std::invalid_argument(std::string(which) + " data has a vocab of " + std::to_string(loader.vocab()) +
                                " tokens, more than the model's " + std::to_string(c.model.vocab));
}

// The checkpoint's header: what must match for its numbers to mean anything to this model.
constexpr char kMagic[8] = {'K', '2', 'C', 'C', 'K', 'P', 'T', '1'};
struct Header {
  char magic[8];
  std::int32_t vocab, d_model, n_layers, q_heads, kv_heads, seq_len, tied_head, step, adam_steps;
  std::int32_t experts, top_k, shared_experts;
  std::int64_t d_ff, d_expert, values, trainable;
  float rope_theta, norm_eps;
};

Header header_for(const ModelConfig& m, int step, int adam_steps, std::int64_t values, std::int64_t trainable) {
  Header h;
  std::memset(&h, 0, sizeof h);  // padding included: headers are compared as bytes
  std::memcpy(h.magic, kMagic, 8);
  h.vocab = m.vocab, h.d_model = m.d_model, h.n_layers = m.n_layers, h.q_heads = m.q_heads;
  h.kv_heads = m.kv_heads, h.seq_len = m.seq_len, h.tied_head = m.tied_head, h.d_ff = m.d_ff;
  h.experts = m.experts, h.top_k = m.top_k, h.shared_experts = m.shared_experts, h.d_expert = m.d_expert;
  h.rope_theta = m.rope_theta, h.norm_eps = m.norm_eps;
  h.step = step, h.adam_steps = adam_steps, h.values = values, h.trainable = trainable;
  return h;
}

}  // namespace

Trainer::Trainer(const TrainConfig& config, Ops& ops, TokenLoader train, TokenLoader val)
    : config_(config), ops_(ops), train_(std::move(train)), val_(std::move(val)),
      ctx_(make_context(ops, ledger_, params_, config)) {
  config.model.check();
  if (config.steps < 0 || config.batch < 1) throw std::invalid_argument("train: steps >= 0 and batch >= 1");
  check_loader(train_, config, "training");
  check_loader(val_, config, "validation");
  model_ = std::make_unique<Transformer>(params_, config.model);
  params_.materialize(ops, ledger_, config.seed);
  optimizer_ = std::make_unique<AdamW>(params_, ops, ledger_, config.adamw);
}

StepRecord Trainer::step() {
  const auto start = std::chrono::steady_clock::now();
  train_.seek(step_);
  const TokenBatch b = train_.next();
  Tensor ids = ctx_.tensor({static_cast<std::int64_t>(b.inputs.size())}, Category::activations, DType::i32);
  Tensor targets = ctx_.tensor({static_cast<std::int64_t>(b.targets.size())}, Category::activations, DType::i32);
  ops_.upload(ids, b.inputs.data());
  ops_.upload(targets, b.targets.data());
  params_.zero_grads(ops_);
  ctx_.step = static_cast<std::uint64_t>(step_);
  const double tokens = static_cast<double>(b.targets.size());
  StepRecord r;
  r.step = step_;
  r.loss = model_->train_step(ctx_, ids, targets, b.rows, static_cast<float>(1.0 / tokens),
                              config_.checkpoint_activations) / tokens;
  r.grad_norm = clip_grad_norm(params_, ops_, config_.clip);
  r.lr = cosine_lr(step_, config_.warmup, config_.steps, config_.lr, config_.min_lr);
  optimizer_->step(static_cast<float>(r.lr));
  ++step_;
  r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  r.tokens_per_s = tokens / r.seconds;
  if (config_.peak_flops > 0) r.mfu = r.tokens_per_s * config_.model.train_flops_per_token() / config_.peak_flops;
  return r;
}

double Trainer::evaluate(int batches) {
  double total = 0, tokens = 0;
  for (int i = 0; i < batches; ++i) {
    const TokenBatch b = val_.batch_at(i);
    Tensor ids = ctx_.tensor({static_cast<std::int64_t>(b.inputs.size())}, Category::activations, DType::i32);
    Tensor targets = ctx_.tensor({static_cast<std::int64_t>(b.targets.size())}, Category::activations, DType::i32);
    ops_.upload(ids, b.inputs.data());
    ops_.upload(targets, b.targets.data());
    total += model_->evaluate(ctx_, ids, targets, b.rows);
    tokens += static_cast<double>(b.targets.size());
  }
  return total / tokens;
}

std::vector<StepRecord> Trainer::run(std::ostream& out, int print_every) {
  std::ofstream log;
  if (!config_.log_path.empty()) {
    const bool fresh = step_ == 0 || !std::filesystem::exists(config_.log_path);
    log.open(config_.log_path, fresh ? std::ios::trunc : std::ios::app);
    if (!log) throw std::runtime_error("cannot write the log " + config_.log_path.string());
    if (fresh) log << "step,loss,val_loss,lr,grad_norm,tokens_per_s,mfu,seconds\n";
  }
  out << "model: " << config_.model.describe() << "\n"
      << "run: " << config_.steps << " steps of " << config_.batch << " x " << config_.model.seq_len
      << " tokens on " << ops_.name() << (step_ ? ", resumed at step " + std::to_string(step_) : "") << "\n";
  std::vector<StepRecord> records;
  while (step_ < config_.steps) {
    StepRecord r = step();
    const bool last = step_ == config_.steps;
    if ((config_.eval_every > 0 && step_ % config_.eval_every == 0) || last) r.val_loss = evaluate(config_.eval_batches);
    if (!config_.checkpoint_path.empty() &&
        ((config_.checkpoint_every > 0 && step_ % config_.checkpoint_every == 0) || last))
      save(config_.checkpoint_path);
    if (print_every > 0 && (r.step % print_every == 0 || last || r.val_loss >= 0)) {
      char line[256];
      std::snprintf(line, sizeof line, "step %5d/%d  loss %.4f%s  lr %.2e  |g| %.3f  %.0f tok/s%s  mem %.1f MiB\n",
                    r.step + 1, config_.steps, r.loss,
                    r.val_loss >= 0 ? ("  val " + std::to_string(r.val_loss).substr(0, 6)).c_str() : "",
                    r.lr, r.grad_norm, r.tokens_per_s,
                    config_.peak_flops > 0 ? ("  MFU " + std::to_string(100 * r.mfu).substr(0, 4) + "%").c_str() : "",
                    ledger_.peak_total() / 1048576.0);
      out << line << std::flush;
    }
    if (log) {
      log << r.step << ',' << r.loss << ',';
      if (r.val_loss >= 0) log << r.val_loss;
      log << ',' << r.lr << ',' << r.grad_norm << ',' << r.tokens_per_s << ',' << r.mfu << ',' << r.seconds << '\n';
    }
    records.push_back(r);
  }
  return records;
}

void Trainer::save(const std::filesystem::path& path) const {
  // Written beside the target and renamed over it, so an interrupted save never leaves a
  // half-written checkpoint where the last good one was.
  const std::filesystem::path tmp = path.string() + ".tmp";
  {
    std::ofstream f(tmp, std::ios::binary | std::ios::trunc);
    if (!f) throw std::runtime_error("cannot write the checkpoint " + tmp.string());
    const Header h = header_for(config_.model, step_, optimizer_->steps(), params_.numel(), params_.trainable_numel());
    f.write(reinterpret_cast<const char*>(&h), sizeof h);
    auto& self = const_cast<Trainer&>(*this);
    for (Tensor* t : {&self.params_.flat_values(), &self.optimizer_->first_moment(), &self.optimizer_->second_moment()}) {
      std::vector<char> host(t->bytes());
      ops_.download(host.data(), *t);
      f.write(host.data(), static_cast<std::streamsize>(host.size()));
    }
    if (!f) throw std::runtime_error("error writing the checkpoint " + tmp.string());
  }
  std::filesystem::rename(tmp, path);
}

void Trainer::load(const std::filesystem::path& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) throw std::runtime_error("checkpoint " + path.string() + ": cannot open");
  Header h{};
  f.read(reinterpret_cast<char*>(&h), sizeof h);
  if (!f || std::memcmp(h.magic, kMagic, 8) != 0)
    throw std::runtime_error("checkpoint " + path.string() + ": not a k2c checkpoint");
  const Header want = header_for(config_.model, h.step, h.adam_steps, params_.numel(), params_.trainable_numel());
  if (std::memcmp(&h, &want, sizeof h) != 0)
    throw std::runtime_error("checkpoint " + path.string() + " was written for another model (" +
                             "vocab " + std::to_string(h.vocab) + ", d " + std::to_string(h.d_model) + ", " +
                             std::to_string(h.n_layers) + " layers, T " + std::to_string(h.seq_len) +
                             "); this run has " + config_.model.describe());
  for (Tensor* t : {&params_.flat_values(), &optimizer_->first_moment(), &optimizer_->second_moment()}) {
    std::vector<char> host(t->bytes());
    f.read(host.data(), static_cast<std::streamsize>(host.size()));
    if (!f) throw std::runtime_error("checkpoint " + path.string() + ": truncated");
    ops_.upload(*t, host.data());
  }
  if (f.peek() != std::char_traits<char>::eof())
    throw std::runtime_error("checkpoint " + path.string() + ": unexpected bytes after the end");
  step_ = h.step;
  optimizer_->set_steps(h.adam_steps);
}

std::vector<std::int32_t> Trainer::sample(std::vector<std::int32_t> tokens, int count, float temperature,
                                          std::uint64_t seed) {
  const int T = config_.model.seq_len, V = config_.model.vocab;
  if (tokens.empty()) throw std::invalid_argument("sample: the prompt needs at least one token");
  const float dropout = ctx_.dropout;
  ctx_.dropout = 0.0f;
  for (int n = 0; n < count; ++n) {
    // The model sees a window of T tokens; the prompt's tail fills it from the left, and the
    // causal mask keeps the padding after it from mattering.
    const int len = std::min<int>(T, static_cast<int>(tokens.size()));
    std::vector<std::int32_t> window(T, 0);
    std::copy(tokens.end() - len, tokens.end(), window.begin());
    Tensor ids = ctx_.tensor({T}, Category::activations, DType::i32);
    ops_.upload(ids, window.data());
    Transformer::Saved s;
    model_->forward(ctx_, ids, 1, true, s);
    std::vector<float> logits(static_cast<std::size_t>(T) * V);
    ops_.download(logits.data(), s.logits);
    const float* z = logits.data() + static_cast<std::size_t>(len - 1) * V;
    int pick = 0;
    if (temperature <= 0) {
      for (int j = 1; j < V; ++j)
        if (z[j] > z[pick]) pick = j;
    } else {
      double mx = z[0], total = 0;
      for (int j = 1; j < V; ++j) mx = std::max<double>(mx, z[j]);
      std::vector<double> p(V);
      for (int j = 0; j < V; ++j) total += p[j] = std::exp((z[j] - mx) / temperature);
      double u = static_cast<double>(mask::mix(seed + n) >> 11) * 0x1.0p-53 * total;
      for (pick = 0; pick < V - 1 && u >= p[pick]; ++pick) u -= p[pick];
    }
    tokens.push_back(pick);
  }
  ctx_.dropout = dropout;
  return tokens;
}

}  // namespace k2c::model
