// k2c/model/ops.h — the operations the model library's layers are built from, behind one
// interface with one implementation per backend.
//
// Layers never touch tensor memory themselves: they call these operations, so the same layer
// code runs on the CPU backend (host memory, MPI ranks, CI) and on a GPU backend. All tensors
// are row-major; activations are matrices of tokens × channels, tokens ordered batch-major
// (token t of sequence b is row b·T + t).
//
// The CPU backend (cpu_ops()) computes in fp32, single-threaded, each sum in a fixed order. Two
// runs on the same inputs give the same bits, and so do two ranks that compute the same thing:
// that is what lets the distributed modules' tests demand bit-exact agreement where the order of
// operations allows it. Operations named "accumulate" or documented with "+=" add into their
// output, so gradients from several uses (tied weights, micro-batches) sum without a copy.
//
// Activations may be stored in bf16 (DType::bf16), half the bytes of fp32, as mixed-precision
// training stores them, and so may the residual stream (Context::residual); parameters, their
// gradients and optimizer state stay fp32. The operations marked [bf16] take fp32 or bf16 for each of their activation
// arguments (the weights, rstd, lse, ids and targets stay as documented): they compute in fp32
// and round to nearest even where they store a bf16 value, once per value (shared_linear_backward
// sums one product at a time into a bf16 dx: once per product there). The others take fp32 only.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "k2c/model/tensor.h"

namespace k2c::model {

// The attention problem of one call. Queries are rows of q ([batch·q_len, q_heads·head_dim]),
// keys and values rows of k and v ([batch·kv_len, kv_heads·head_dim]); query head h reads
// key-value head h / (q_heads / kv_heads) (GQA). Query i sits at position q_offset + i and key j
// at kv_offset + j; with `causal`, query i sees key j only if its position is not earlier. The
// offsets let a rank that holds one chunk of the sequence attend to another chunk (ring
// attention). Scores are scaled by 1/sqrt(head_dim).
struct AttentionShape {
  int batch = 1, q_len = 0, kv_len = 0, q_heads = 1, kv_heads = 1, head_dim = 0;
  bool causal = true;
  std::int64_t q_offset = 0, kv_offset = 0;
  void check() const;  // throws std::invalid_argument with the offending values

  // Causal self-attention over T tokens of each sequence, keys and queries alike, no offsets: the
  // shape of a layer that attends over its own whole sequence (the library's Attention, and the
  // parallel ones of modules 14 and 16 over their local heads).
  static AttentionShape causal_self(int batch, std::int64_t T, int q_heads, int kv_heads, int head_dim) {
    return {batch, static_cast<int>(T), static_cast<int>(T), q_heads, kv_heads, head_dim, true, 0, 0};
  }
};

// What makes a dropout mask: element e of an activation is dropped when a hash of
// (seed, step, layer, e's index in the UNSHARDED activation) falls below p. A rank that holds a
// shard passes the shard's place in the whole (row and column offsets and the whole row length),
// so its mask is exactly the corresponding slice of the single-process mask.
struct DropoutKey {
  std::uint64_t seed = 0, step = 0, layer = 0;
  std::int64_t row_offset = 0;   // rows of the whole activation before this shard's first row
  std::int64_t col_offset = 0;   // columns before this shard's first column
  std::int64_t full_cols = -1;   // the whole activation's row length (-1: this tensor's)
};

// Indices (token ids, targets, rows, experts) are checked by every backend: one outside its range
// throws std::out_of_range. The CPU backend throws from the call; a GPU backend's kernel skips the
// index and records it, and the backend throws from its next call that waits for the device (a
// download, a loss, column sums, a routing plan, a sum of squares), naming the first operation
// that found one. A
// training step waits at its loss, so it reports its own bad indices; outputs (and, by then, later
// operations' results) may be written.
class Ops {
 public:
  virtual ~Ops() = default;
  virtual std::string name() const = 0;
  // Where this backend's tensors live.
  virtual Memory& memory() = 0;

  // Host <-> tensor copies (a plain memcpy on the CPU backend). The host buffer may be reused as
  // soon as either returns; an upload need not wait for the device.
  virtual void upload(Tensor& dst, const void* host) = 0;
  virtual void download(void* host, const Tensor& src) = 0;

  // ---- element-wise
  virtual void fill(Tensor& t, float value) = 0;                                // [bf16]
  // dst = src, element for element: one dtype, or fp32 and bf16 either way (rounding once). [bf16]
  virtual void copy(Tensor& dst, const Tensor& src) = 0;
  virtual void add(const Tensor& a, const Tensor& b, Tensor& out) = 0;         // out = a + b [bf16]
  virtual void accumulate(Tensor& acc, const Tensor& x, float scale) = 0;       // acc += scale·x
  virtual void scale(Tensor& t, float s) = 0;                                   // t *= s
  virtual double sum_squares(const Tensor& t) = 0;                              // Σ t², in double

  // ---- GEMM: c = alpha·op(a)·op(b) + beta·c, op(a) M×K, op(b) K×N, c M×N. A Linear layer uses
  // three layouts: y = x·Wᵀ (forward), dx = dy·W, dW += dyᵀ·x (backward). beta = 0 ignores c's
  // old contents (NaN included). [bf16], and so are the Linear operations after it.
  virtual void matmul(const Tensor& a, bool trans_a, const Tensor& b, bool trans_b, Tensor& c,
                      float alpha, float beta) = 0;
  // The backward of a Linear layer y = x·Wᵀ: dW += dyᵀ·x where dw is given, then dx = dy·W where
  // dx is given. By default those two matmul calls; a backend may share work between them (the
  // GPU's fast path rounds dy to bf16 once for both products instead of once for each).
  virtual void linear_backward(const Tensor& x, const Tensor& w, const Tensor& dy, Tensor* dw, Tensor* dx) {
    if (dw) matmul(dy, true, x, false, *dw, 1.0f, 1.0f);
    if (dx) matmul(dy, false, w, false, *dx, 1.0f, 0.0f);
  }
  // Several Linear layers that read one input (attention's q, k and v projections; the MLP's
  // gate and up): ys[i] = x·W_iᵀ. By default one matmul each; the GPU's fast path rounds x to
  // bf16 once for all of them.
  virtual void shared_linear_forward(const Tensor& x, std::span<const Tensor* const> ws, std::span<Tensor* const> ys);
  // Their backward: dW_i += dy_iᵀ·x for each dws[i] given (null: a frozen weight), then, where dx
  // is given, dx = dy_0·W_0 + dy_1·W_1 + … summed in order of i into dx (one GEMM each, the later
  // ones with beta = 1, so no separate accumulate pass). By default matmul calls; the GPU's fast
  // path rounds x and each dy to bf16 once.
  virtual void shared_linear_backward(const Tensor& x, std::span<const Tensor* const> ws,
                                      std::span<const Tensor* const> dys, std::span<Tensor* const> dws, Tensor* dx);

  // ---- grouped GEMMs (a MoE layer's experts). Rows [offsets[g], offsets[g+1]) of a (and of c, x)
  // belong to group g, whose matrix is w[first + g] of a stacked weight w [E, n, k]; offsets start
  // at 0 and end at a's row count. Groups with no rows do nothing. By default one matmul per group,
  // so the CPU backend's sums are matmul's; a GPU backend may run all groups in one launch.
  //   transpose_w:  c_g = a_g · w_gᵀ   (a [rows, k], c [rows, n]: the experts' forward)
  //   otherwise:    c_g = a_g · w_g    (a [rows, n], c [rows, k]: their input gradient)
  virtual void grouped_matmul(const Tensor& a, std::span<const std::int64_t> offsets, int first, const Tensor& w,
                              bool transpose_w, Tensor& c);
  // dw[first + g] += dy_gᵀ · x_g: the experts' weight gradients (dy [rows, n], x [rows, k]).
  virtual void grouped_weight_grad(const Tensor& dy, const Tensor& x, std::span<const std::int64_t> offsets, int first,
                                   Tensor& dw);

  // ---- layers' kernels
  // out[i, :] = table[ids[i], :]; ids i32 [N], table [V, D], out [N, D]; ids in [0, V).
  virtual void embedding_forward(const Tensor& ids, const Tensor& table, Tensor& out) = 0;
  // dtable[ids[i], :] += dout[i, :], in order of i.
  virtual void embedding_backward(const Tensor& ids, const Tensor& dout, Tensor& dtable) = 0;

  // y = x · rstd · gamma per row, rstd = 1/sqrt(mean(x²) + eps); x, y [N, D]; rstd [N]. [bf16],
  // and so are the two backward operations.
  virtual void rmsnorm_forward(const Tensor& x, const Tensor& gamma, float eps, Tensor& y,
                               Tensor& rstd) = 0;
  // dx = (the input gradient), dgamma += Σ_rows dy · x · rstd.
  virtual void rmsnorm_backward(const Tensor& x, const Tensor& gamma, const Tensor& rstd,
                                const Tensor& dy, Tensor& dx, Tensor& dgamma) = 0;
  // The same, then dx += residual_dy: a pre-norm block's x + f(norm(x)) sends its gradient both
  // through the norm and around it. By default the two operations; the GPU adds in the same pass.
  virtual void rmsnorm_backward_add(const Tensor& x, const Tensor& gamma, const Tensor& rstd, const Tensor& dy,
                                    const Tensor& residual_dy, Tensor& dx, Tensor& dgamma);

  // Rotary embedding in place on x [batch·T, heads·head_dim], pairs (i, i + head_dim/2) of each
  // head rotated by positions[t]·theta^(−2i/head_dim); positions i32 [T], shared by the batch.
  // inverse rotates back, which is also the backward (a rotation's transpose is its inverse). [bf16]
  virtual void rope(Tensor& x, const Tensor& positions, int heads, int head_dim, float theta,
                    bool inverse) = 0;

  // o = softmax(q·kᵀ/sqrt(d) masked)·v, and lse [batch, q_heads, q_len] the log-sum-exp of each
  // query's scaled scores (−inf and o = 0 for a query that sees no key). [bf16], backward too.
  virtual void attention_forward(const AttentionShape& s, const Tensor& q, const Tensor& k,
                                 const Tensor& v, Tensor& o, Tensor& lse) = 0;
  // dq = (overwritten), dk, dv += (added: a ring adds the gradients of several query chunks).
  virtual void attention_backward(const AttentionShape& s, const Tensor& q, const Tensor& k,
                                  const Tensor& v, const Tensor& o, const Tensor& lse,
                                  const Tensor& dout, Tensor& dq, Tensor& dk, Tensor& dv) = 0;
  // The same with dk and dv overwritten too, for a caller whose dk and dv would start at zero (the
  // library's Attention): a backend can then skip zeroing them and reading them back. By default
  // it zeroes them and adds.
  virtual void attention_backward_overwrite(const AttentionShape& s, const Tensor& q, const Tensor& k,
                                            const Tensor& v, const Tensor& o, const Tensor& lse,
                                            const Tensor& dout, Tensor& dq, Tensor& dk, Tensor& dv) {
    fill(dk, 0.0f);
    fill(dv, 0.0f);
    attention_backward(s, q, k, v, o, lse, dout, dq, dk, dv);
  }

  // h = silu(gate) · up, all [N, F]; backward writes dgate and dup. [bf16]
  virtual void swiglu_forward(const Tensor& gate, const Tensor& up, Tensor& h) = 0;
  virtual void swiglu_backward(const Tensor& gate, const Tensor& up, const Tensor& dh,
                               Tensor& dgate, Tensor& dup) = 0;

  // Softmax cross-entropy over logits [N, V] with targets i32 [N] (−1: ignored). Returns the sum
  // of the losses of the counted rows, and writes dlogits = grad_scale·(softmax − onehot) (zero
  // rows for ignored targets). The caller picks grad_scale, usually 1 / (tokens in the global
  // batch), so the gradient is that of the mean over every rank's tokens. [bf16]
  virtual double cross_entropy(const Tensor& logits, const Tensor& targets, float grad_scale,
                               Tensor& dlogits) = 0;

  // out = x · mask / (1 − p), mask from `key` (see DropoutKey); the backward is the same call
  // on dy with the same key. p = 0 copies.
  virtual void dropout(const Tensor& x, float p, const DropoutKey& key, Tensor& out) = 0;

  // ---- routing (the MoE layer)
  // y = softmax of each row of x; the backward writes dx from y and dy.
  virtual void softmax_rows(const Tensor& x, Tensor& y) = 0;
  virtual void softmax_rows_backward(const Tensor& y, const Tensor& dy, Tensor& dx) = 0;
  // The k largest entries of each row of scores [N, E] in decreasing order (ties: the lower
  // index first): indices i32 [N, k] and values [N, k].
  virtual void top_k(const Tensor& scores, int k, Tensor& indices, Tensor& values) = 0;
  // out[r, :] = src[rows[r], :]; rows i32 [R], out [R, D]. [bf16]: src and out either dtype.
  virtual void gather_rows(const Tensor& src, const Tensor& rows, Tensor& out) = 0;
  // out[rows[r], :] += scale[r] · src[r, :] in order of r (scale null: 1); src [R, D]. [bf16]
  virtual void scatter_add_rows(const Tensor& src, const Tensor& rows, const Tensor* scale, Tensor& out) = 0;
  // The same sums seen from the output: out[n, :] += scale[r] · src[r, :] for each of token n's k
  // rows r = rows[n·k + j] (scale null: 1), in increasing order of r (equal rows in order of j).
  // Where rows is the inverse of scatter_add_rows's row list (route_rows's row_of is the inverse of
  // its token_of_row), both add the same products in the same order. Each output row is one
  // token's, so a device backend adds without atomics, in the CPU's order. rows i32 [N·k], src
  // [R, D], scale fp32 [R] (by source row, as scatter_add_rows's), out [N, D]; a row outside src
  // throws std::out_of_range. The GPU backend takes k up to 4096. [bf16]: src, out.
  virtual void gather_add_rows(const Tensor& src, const Tensor& rows, int k, const Tensor* scale, Tensor& out) = 0;
  // Its gradient, row by row: dsrc[r, :] = scale[r] · dout[t, :] and dscale[r] = dout[t, :] · src[r, :]
  // (a dot product, summed in the CPU backend's order as its row_dot sums), t = token_of_row[r], the
  // token whose output row r added into (so token_of_row [R] i32 is the inverse of
  // gather_add_rows's rows); a token outside dout throws std::out_of_range. dout [N, D], src and
  // dsrc [R, D], scale and dscale fp32 [R]. [bf16]: dout, src, dsrc.
  virtual void gather_add_rows_backward(const Tensor& dout, const Tensor& token_of_row, const Tensor& scale,
                                        const Tensor& src, Tensor& dsrc, Tensor& dscale) = 0;
  // out[r] = a[r, :] · b[r, :].
  virtual void row_dot(const Tensor& a, const Tensor& b, Tensor& out) = 0;
  // x[r, :] *= scale[r].
  virtual void scale_rows(Tensor& x, const Tensor& scale) = 0;
  // The sum of each column of x [N, E], in double: the router's mean probability per expert, for
  // the balance loss. By default on the host after a download, in order of the rows; a device
  // backend sums where x is (in its own order) and returns E numbers.
  virtual std::vector<double> column_sums(const Tensor& x);
  // The router probabilities' gradient: out[n, e] = Σ_j [indices[n, j] = e]·values[n, j] (in
  // order of j) + column_add[e]; indices i32 [N, k] in [0, E), values [N, k], out [N, E] written
  // whole. By default on the host, then one upload of out; a device backend uploads E numbers
  // instead.
  virtual void routing_grad(const Tensor& indices, const Tensor& values, std::span<const float> column_add,
                            Tensor& out);
  // The MoE layer's plan of its routed rows, from each token's chosen experts, indices i32 [N, k]
  // in [0, experts), and their probabilities, values [N, k]: the N·k assignments sorted by expert,
  // in order of n·k + j within an expert (Routing::plan's order). Writes token_of_row i32 [N·k]
  // (the token of each row), row_of i32 [N·k] (the row of assignment n·k + j) and weight_of_row
  // [N·k] (the assignment's value, divided by the sum of its token's k values where `normalize`,
  // summed in order of j), and returns each expert's count of rows. By default on the host after a
  // download (Routing::plan); a device backend plans where the indices are and returns E numbers.
  virtual std::vector<std::int64_t> route_rows(const Tensor& indices, const Tensor& values, int experts,
                                               bool normalize, Tensor& token_of_row, Tensor& row_of,
                                               Tensor& weight_of_row);
  // Its gradient: dvalues [N, k] from dweight [N·k], the gradient of weight_of_row (values and
  // row_of as route_rows had and wrote them). With dw_j = dweight[row_of[n·k + j]] for token n:
  // dv_j = dw_j, or with `normalize` (dw_j − Σ_i (v_i / Σv)·dw_i) / Σv, the sums in order of i.
  virtual void route_rows_backward(const Tensor& values, const Tensor& row_of, const Tensor& dweight, bool normalize,
                                   Tensor& dvalues);

  // ---- optimizer updates on flat fp32 buffers (parameters, gradients, state of equal length)
  virtual void sgd_step(Tensor& param, const Tensor& grad, Tensor* momentum, float lr,
                        float beta, float weight_decay) = 0;
  // AdamW with bias correction at step t (1-based), decoupled weight decay.
  virtual void adamw_step(Tensor& param, const Tensor& grad, Tensor& m, Tensor& v, float lr,
                          float beta1, float beta2, float eps, float weight_decay, int t) = 0;
};

// The CPU backend: fp32, single-threaded, fixed summation order, host memory.
Ops& cpu_ops();

// The mask value (0 or 1/(1 − p)) that dropout applies to element (row, col) of an activation
// whose rows are `cols` long, under `key`: the definition every backend follows.
float dropout_scale(const DropoutKey& key, float p, std::int64_t row, std::int64_t col, std::int64_t cols);

}  // namespace k2c::model
