// optim.cpp — see k2c/model/optim.h.
#include "k2c/model/optim.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>
#include <vector>

namespace k2c::model {

namespace {

float decay_for(const ParamInfo& p, float wd) { return p.shape.rank >= 2 ? wd : 0.0f; }

// The part of one trainable parameter that lies in an optimizer's range, as 1-D views of its
// values, its gradient and the range's state. The views start at different places because the
// three buffers are indexed differently: the value buffer also holds frozen parameters (offset),
// the gradient buffer does not (grad_offset), and the state starts at the range's begin.
struct Piece {
  const ParamInfo* info;
  Tensor value, grad;
  std::int64_t state_at = 0, count = 0;  // first state element, and how many
};

void check_range(const char* who, const ParamList& params, std::int64_t begin, std::int64_t end) {
  if (!params.materialized()) throw std::logic_error(std::string(who) + ": materialize the parameters first");
  const std::int64_t n = params.trainable_numel();
  if (begin < 0 || begin > end || end > n)
    throw std::invalid_argument(std::string(who) + ": range [" + std::to_string(begin) + ", " +
                                std::to_string(end) + ") is not inside the gradient buffer [0, " +
                                std::to_string(n) + ")");
}

// State of `count` elements in the optimizer category, zeroed; none at all for an empty range
// (some memories refuse zero-byte allocations).
Tensor zero_state(Ops& ops, MemoryLedger& ledger, std::int64_t count) {
  if (count == 0) return {};
  Tensor t(ops.memory(), ledger, Category::optimizer, {count});
  ops.fill(t, 0.0f);
  return t;
}

// The pieces of the trainable parameters inside gradient range [begin, end), in registration
// order. Parameters are visited one at a time as before, so a full range steps each one whole.
// Values and gradients come from the flat buffers, or, where the caller holds its own copies of
// the range (`own_values`, `own_grads`: element k is gradient element begin + k), from those.
std::vector<Piece> pieces(ParamList& params, std::int64_t begin, std::int64_t end, float* own_values = nullptr,
                          float* own_grads = nullptr) {
  std::vector<Piece> out;
  if (begin == end) return out;
  float* values = own_values ? nullptr : params.flat_values().f32();
  float* grads = own_grads ? nullptr : params.flat_grads().f32();
  for (ParamId id : params.trainable()) {
    const ParamInfo& p = params.info(id);
    const std::int64_t lo = std::max(begin, p.grad_offset);
    const std::int64_t hi = std::min(end, p.grad_offset + p.shape.numel());
    if (lo >= hi) continue;
    const std::int64_t count = hi - lo;
    float* value = own_values ? own_values + (lo - begin) : values + p.offset + (lo - p.grad_offset);
    float* grad = own_grads ? own_grads + (lo - begin) : grads + lo;  // (own_grads - begin would point before it)
    out.push_back({&p, Tensor::view(value, {count}), Tensor::view(grad, {count}), lo - begin, count});
  }
  return out;
}

// State elements [at, at + count) as a 1-D view.
Tensor state_view(Tensor& state, std::int64_t at, std::int64_t count) {
  return Tensor::view(state.f32() + at, {count});
}

}  // namespace

AdamW::AdamW(ParamList& params, Ops& ops, MemoryLedger& ledger, AdamWConfig config)
    : AdamW(params, ops, ledger, config, 0, params.trainable_numel()) {}

AdamW::AdamW(ParamList& params, Ops& ops, MemoryLedger& ledger, AdamWConfig config, std::int64_t begin,
             std::int64_t end)
    : params_(params), ops_(ops), config_(config), begin_(begin), end_(end) {
  check_range("AdamW", params, begin, end);
  m_ = zero_state(ops, ledger, end - begin);
  v_ = zero_state(ops, ledger, end - begin);
}

namespace {
// One AdamW update of each piece at step t. Pieces that follow each other in the values, the
// gradients and the state alike, with the same weight decay, are stepped as one: a model is
// many small tensors (a norm's weight is 768 floats), and a call each costs more in launches
// than the update itself. The update is element by element, so the result is the same.
void adamw_pieces(Ops& ops, const AdamWConfig& c, Tensor& m_state, Tensor& v_state, int t, float lr,
                  std::vector<Piece> parts) {
  for (std::size_t i = 0; i < parts.size();) {
    // Weight decay is a property of the whole parameter (its rank), not of the piece's 1-D view.
    const Piece& first = parts[i];
    const float decay = decay_for(*first.info, c.weight_decay);
    std::size_t j = i + 1;
    std::int64_t count = first.count;
    for (; j < parts.size(); ++j) {
      const Piece& next = parts[j];
      const bool follows = next.value.f32() == first.value.f32() + count &&
                           next.grad.f32() == first.grad.f32() + count && next.state_at == first.state_at + count;
      if (!follows || decay_for(*next.info, c.weight_decay) != decay) break;
      count += next.count;
    }
    Tensor value = Tensor::view(first.value.f32(), {count}), grad = Tensor::view(first.grad.f32(), {count});
    Tensor m = state_view(m_state, first.state_at, count), v = state_view(v_state, first.state_at, count);
    ops.adamw_step(value, grad, m, v, lr, c.beta1, c.beta2, c.eps, decay, t);
    i = j;
  }
}
}  // namespace

void AdamW::step(float lr) {
  ++t_;  // counts for an empty range too: every rank's bias correction must agree
  adamw_pieces(ops_, config_, m_, v_, t_, lr, pieces(params_, begin_, end_));
}

void AdamW::step(float lr, Tensor& values, const Tensor& grads) {
  const std::int64_t n = end_ - begin_;
  if (values.numel() != n || grads.numel() != n)
    throw std::invalid_argument("AdamW::step: the range [" + std::to_string(begin_) + ", " + std::to_string(end_) +
                                ") has " + std::to_string(n) + " elements, but values hold " +
                                std::to_string(values.numel()) + " and gradients " + std::to_string(grads.numel()));
  ++t_;
  adamw_pieces(ops_, config_, m_, v_, t_, lr, pieces(params_, begin_, end_, values.f32(), grads.f32()));
}

Sgd::Sgd(ParamList& params, Ops& ops, MemoryLedger& ledger, float momentum, float weight_decay)
    : Sgd(params, ops, ledger, momentum, weight_decay, 0, params.trainable_numel()) {}

Sgd::Sgd(ParamList& params, Ops& ops, MemoryLedger& ledger, float momentum, float weight_decay,
         std::int64_t begin, std::int64_t end)
    : params_(params), ops_(ops), beta_(momentum), weight_decay_(weight_decay), begin_(begin), end_(end) {
  check_range("Sgd", params, begin, end);
  if (momentum > 0) momentum_ = zero_state(ops, ledger, end - begin);
}

void Sgd::step(float lr) {
  for (Piece& piece : pieces(params_, begin_, end_)) {
    Tensor m = momentum_.empty() ? Tensor() : state_view(momentum_, piece.state_at, piece.count);
    ops_.sgd_step(piece.value, piece.grad, momentum_.empty() ? nullptr : &m, lr, beta_,
                  decay_for(*piece.info, weight_decay_));
  }
}

double global_grad_norm(ParamList& params, Ops& ops) {
  return params.trainable_numel() ? std::sqrt(ops.sum_squares(params.flat_grads())) : 0.0;
}

double clip_grad_norm(ParamList& params, Ops& ops, double max_norm) {
  const double norm = global_grad_norm(params, ops);
  if (max_norm > 0 && norm > max_norm) ops.scale(params.flat_grads(), static_cast<float>(max_norm / norm));
  return norm;
}

float cosine_lr(int step, int warmup, int total, float max_lr, float min_lr) {
  if (warmup > 0 && step < warmup) return max_lr * static_cast<float>(step + 1) / static_cast<float>(warmup);
  if (step >= total) return min_lr;
  const double progress = static_cast<double>(step - warmup) / std::max(1, total - warmup);
  return static_cast<float>(min_lr + 0.5 * (max_lr - min_lr) * (1.0 + std::cos(3.141592653589793 * progress)));
}

}  // namespace k2c::model
