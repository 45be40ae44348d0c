// k2c/reference/reference.h — CPU reference implementations, the correctness oracle of every
// module.
//
// Plain loops in double precision, written for clarity rather than speed: what the GPU version
// must compute, with rounding error far below any kernel's tolerance.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

namespace k2c::ref {

// C = alpha * A * B + beta * C, row-major, A M×K, B K×N, C M×N. With beta == 0, C is not read.
std::vector<double> gemm(int M, int N, int K, double alpha, std::span<const float> A,
                         std::span<const float> B, double beta, std::span<const float> C);

// One element (r, c) of the same GEMM: for spot checks of sizes too large for the full loop.
double gemm_at(int N, int K, double alpha, std::span<const float> A, std::span<const float> B,
               double beta, std::span<const float> C, int r, int c);

// C = A · Bᵀ with A M×K and B N×K, both row-major (module 05's tensor-core layout). When
// `magnitude` is given it receives Σ_k |A[r][k]·B[c][k]| per element: the scale of the rounding
// error any floating-point summation of that element can make.
std::vector<double> gemm_abt(int M, int N, int K, std::span<const float> A,
                             std::span<const float> B, std::vector<double>* magnitude = nullptr);

// One element (r, c) of the same, with its magnitude.
double gemm_abt_at(int K, std::span<const float> A, std::span<const float> B, int r, int c,
                   double* magnitude = nullptr);

// Module 00's FMA-chain function (see assignments/00_roofline/roofline.h). It is defined in
// fp32 arithmetic with fused multiply-adds, so the reference computes it in fp32 with std::fma:
// the GPU result should agree to the last bits of the final sum.
std::vector<double> fma_chains(std::span<const float> in, int iters, int chains, float step,
                               float mul, float add);

// ---- memory-bound operators of modules 06–08 (inputs as float, bf16 values widened exactly) ----

// Row softmax of a rows × cols row-major matrix, computed stably (the row maximum subtracted).
std::vector<double> softmax_rows(std::span<const float> x, int rows, int cols);

// RMSNorm, y = x / rms(x) · gamma with rms(x) = sqrt(mean(x²) + eps), per row of length cols.
struct RmsNormForward {
  std::vector<double> y;     // rows × cols
  std::vector<double> rstd;  // rows: 1 / rms(x), what the backward pass reuses
};
RmsNormForward rmsnorm_forward(std::span<const float> x, std::span<const float> gamma, int rows,
                               int cols, double eps);

// Gradients of RMSNorm for upstream dy: with r = rstd of the row and n = cols,
//   dx_i = r·gamma_i·dy_i − x_i · r³/n · Σ_j dy_j·gamma_j·x_j,   dgamma_i = Σ_rows dy_i·x_i·r.
struct RmsNormBackward {
  std::vector<double> dx;      // rows × cols
  std::vector<double> dgamma;  // cols
};
RmsNormBackward rmsnorm_backward(std::span<const float> x, std::span<const float> gamma,
                                 std::span<const float> dy, int rows, int cols, double eps);

// Rotary position embedding of x laid out [tokens][heads][head_dim] (head_dim even): the pair
// (a, b) of dimension-pair k at position p = position_offset + token is rotated by the angle
// p · base^(−2k/head_dim). Pairs are (2k, 2k+1) when interleaved (the complex form), or
// (k, k + head_dim/2) when half-split. inverse = true rotates by the opposite angle, which is
// also the backward pass (a rotation's transpose is its inverse).
enum class RopeLayout { interleaved, half_split };
std::vector<double> rope(std::span<const float> x, int tokens, int heads, int head_dim,
                         long position_offset, double base, RopeLayout layout, bool inverse);


// ---- attention (module 09) ----------------------------------------------------------------------

// Scaled dot-product attention, q [batch][heads][q_len][head_dim], k and v
// [batch][kv_heads][kv_len][head_dim], row-major. Query head h reads kv head h / (heads /
// kv_heads) (grouped-query attention; kv_heads divides heads). With `causal`, key j is visible
// to query i when j <= i + kv_len - q_len: the mask is aligned to the bottom right, so the last
// query sees every key (the FlashAttention 2 convention; the two alignments agree when the
// lengths are equal). A query that sees no key (q_len > kv_len, causal) has output 0 and
// logsumexp +inf.
struct AttentionShape {
  int batch = 1, heads = 1, kv_heads = 1, q_len = 1, kv_len = 1, head_dim = 1;
  bool causal = false;
  double scale = 1.0;  // usually 1 / sqrt(head_dim)
};
// The *_magnitude tensors (shaped like the output they go with) are the sums of absolute terms
// that a bf16 rounding of each intermediate scales into an error bound, as gemm_abt's magnitude
// does for a GEMM. Forward: Σ_j P_ij·|V_jc| (a relative error ε in every P_ij moves O_ic by at
// most ε times that).
struct AttentionForward {
  std::vector<double> o;    // [batch][heads][q_len][head_dim]
  std::vector<double> lse;  // [batch][heads][q_len]: log of the softmax denominator, natural log,
                            // of the scaled scores (what the backward pass recomputes P from)
  std::vector<double> o_magnitude;
};
AttentionForward attention_forward(std::span<const float> q, std::span<const float> k,
                                   std::span<const float> v, const AttentionShape& shape);

// Gradients of the same for upstream gradient dout (shaped like o). dk and dv are summed over the
// query heads that share a kv head.
// Magnitudes, with e_i = Σ_c |dO_ic|·|O_ic| (what an ε relative error in O moves D_i by):
//   dv: Σ_i P_ij·|dO_ic|     dk: scale·Σ_i |Q_ic|·(|dS_ij| + P_ij·e_i)     dq: scale·Σ_j |K_jc|·(|dS_ij| + P_ij·e_i)
struct AttentionBackward {
  std::vector<double> dq, dk, dv;
  std::vector<double> dq_magnitude, dk_magnitude, dv_magnitude;
};
AttentionBackward attention_backward(std::span<const float> q, std::span<const float> k,
                                     std::span<const float> v, std::span<const float> dout,
                                     const AttentionShape& shape);

// Spot checks at sizes where the whole backward pass is too slow on a CPU: the gradients of one
// key row (dk and dv of key `key` of kv head `kv_head`, summed over its query heads) or of one
// query row (dq of query `query` of head `head`), given the o and lse the pass receives. Each
// returns head_dim values and their magnitudes as defined above.
struct AttentionRowGradient {
  std::vector<double> dk, dv, dq;
  std::vector<double> dk_magnitude, dv_magnitude, dq_magnitude;
};
AttentionRowGradient attention_key_gradient_at(std::span<const float> q, std::span<const float> k,
                                               std::span<const float> v, std::span<const float> o,
                                               std::span<const float> dout, std::span<const float> lse,
                                               const AttentionShape& shape, int batch, int kv_head, int key);
AttentionRowGradient attention_query_gradient_at(std::span<const float> q, std::span<const float> k,
                                                 std::span<const float> v, std::span<const float> o,
                                                 std::span<const float> dout, std::span<const float> lse,
                                                 const AttentionShape& shape, int batch, int head, int query);
// The same two, given per query row (as lse's rows) D_i = Σ dO_i ∘ O_i and e_i = Σ |dO_i ∘ O_i| in
// place of o: for a caller that keeps two numbers a row rather than the whole of o.
struct AttentionRowTerms {
  std::span<const double> D, e;
};
AttentionRowGradient attention_key_gradient_at(std::span<const float> q, std::span<const float> k,
                                               std::span<const float> v, const AttentionRowTerms& rows,
                                               std::span<const float> dout, std::span<const float> lse,
                                               const AttentionShape& shape, int batch, int kv_head, int key);
AttentionRowGradient attention_query_gradient_at(std::span<const float> q, std::span<const float> k,
                                                 std::span<const float> v, const AttentionRowTerms& rows,
                                                 std::span<const float> dout, std::span<const float> lse,
                                                 const AttentionShape& shape, int batch, int head, int query);

// Multi-head latent attention (module 19, Part D) over one sequence x [T][d_model] at positions
// 0 .. T−1, causal, in the training form: per-head queries [x·W_qnᵀ ; RoPE(x·W_qrᵀ)], keys
// [c·W_ukᵀ ; RoPE(x·W_krᵀ)] (the rotated part shared by every head) and values c·W_uvᵀ from the
// latent c = x·W_dkvᵀ; y = [o_1; ...; o_H]·W_oᵀ. RoPE half-split with base rope_theta; scores
// scaled by 1/sqrt(nope_dim + rope_dim). Weights as linear layers' ([out][in]), head h owning
// rows [h·dn, (h+1)·dn) of W_qn and W_uk (dr of W_qr, dv of W_uv). Products and attention in
// double, each intermediate rounded to fp32 as a layer's output would be. y [T][d_model].
struct MlaShape {
  int d_model = 1, heads = 1, nope_dim = 1, rope_dim = 2, latent_dim = 1, value_dim = 1;
  double rope_theta = 10000.0;
};
struct MlaWeights {
  std::span<const float> wq_nope, wq_rope, w_dkv, w_kr, w_uk, w_uv, wo;
};
std::vector<double> mla_forward(std::span<const float> x, int tokens, const MlaShape& shape, const MlaWeights& w);

// ---- mixture of experts (module 10) ----------------------------------------------------------------

// The router: scores s = softmax(logits) or sigmoid(logits) per token ([tokens][experts]), top-k
// chosen on s + bias (bias: per-expert, may be empty; it steers selection, never the weights).
// Group-limited routing splits the experts into `groups` equal groups, scores a group by the sum
// of its two best biased scores (its best one when a group has one expert), and lets only the
// `top_groups` best groups compete. Weights are the chosen experts' unbiased scores, divided by
// their sum when `normalize` (always with sigmoid scores), times route_scale. Ties go to the lower
// index, for experts and for groups, so the choice is deterministic.
enum class RouterScore { softmax, sigmoid };
struct RouterConfig {
  int experts = 1, top_k = 1;
  RouterScore score = RouterScore::softmax;
  int groups = 1, top_groups = 1;
  bool normalize = false;
  double route_scale = 1.0;
};
struct Routing {
  std::vector<int> expert;     // [tokens][top_k], best first
  std::vector<double> weight;  // [tokens][top_k]
  std::vector<double> scores;  // [tokens][experts], unbiased
};
Routing route(std::span<const float> logits, std::span<const float> bias, int tokens,
              const RouterConfig& config);

// The Switch load-balancing loss in its top-k form, L = alpha · E / (k · T²) · Σ_i count_i ·
// Σ_t p_ti, with p = softmax(logits) and count_i the tokens routed to expert i (constants: the
// gradient flows through p only). Its minimum under uniform routing is alpha.
struct BalanceLoss {
  double loss = 0;
  std::vector<double> dlogits;  // [tokens][experts]
};
BalanceLoss balance_loss(std::span<const float> logits, const Routing& routing, int tokens,
                         int experts, int top_k, double alpha);

// Token rows in expert order. Within an expert, assignments keep token order (then choice order);
// with capacity >= 0 an expert keeps its first `capacity` assignments and the rest are dropped.
struct Dispatch {
  std::vector<int> counts;   // [experts]: assignments kept
  std::vector<int> offsets;  // [experts + 1]: prefix sums of counts
  std::vector<int> slot;     // [tokens][top_k]: row in expert order, or -1 when dropped
  std::vector<int> source;   // [kept]: the token of each row in expert order
  int dropped = 0;
};
Dispatch dispatch(const Routing& routing, int tokens, int experts, int top_k, int capacity);

// x [tokens][hidden] → rows in expert order, [kept][hidden]; and back: out[t] = Σ_j weight_tj ·
// rows[slot_tj] over the kept choices of token t.
std::vector<double> permute(std::span<const float> x, int hidden, const Dispatch& d);
std::vector<double> combine(std::span<const double> rows, int tokens, int hidden, int top_k,
                            const Dispatch& d, const Routing& routing);

// A SwiGLU feed-forward network on rows × hidden: y = (silu(x W1ᵀ) ∘ (x W3ᵀ)) W2ᵀ, with W1 and W3
// [ffn][hidden] and W2 [hidden][ffn] (the layout of a linear layer's weight).
std::vector<double> swiglu(std::span<const double> x, int rows, int hidden, int ffn,
                           std::span<const float> w1, std::span<const float> w3,
                           std::span<const float> w2);

// The whole layer's forward pass: routed experts (weights stacked per expert, expert e's W1 at
// e · ffn · hidden) plus `shared` shared experts that every token passes through (their weights
// stacked the same way), added to the routed output.
struct MoeLayer {
  int hidden = 1, ffn = 1, shared_ffn = 1, shared = 0;
  RouterConfig router;
  int capacity = -1;
  std::span<const float> w_router;  // [experts][hidden]
  std::span<const float> bias;      // [experts] or empty
  std::span<const float> w1, w3, w2, shared_w1, shared_w3, shared_w2;
};
struct MoeForward {
  std::vector<double> y;  // [tokens][hidden]
  Routing routing;
  Dispatch dispatch;
};
MoeForward moe_forward(std::span<const float> x, int tokens, const MoeLayer& layer);

// Gradients of moe_forward for upstream dy ([tokens][hidden]), with the routing held fixed (the
// top-k choice is a step function: gradients flow through the chosen experts' weights and from
// there through the scores into the router, never through the choice itself). The balancing
// loss is separate (balance_loss); where it is used, add its dlogits · x to dw_router and
// dlogits · w_router to dx. Weights' gradients are laid out like the weights; each *_mag beside
// one holds, per element, the sum of the magnitudes of the terms that element sums (one per token
// that reached the expert), where dW1's and dW3's terms count dh = d_out W2 (d_out: the routing
// weight times dy) at the sum of its own terms' magnitudes: the scale of the rounding error such a
// sum carries when its terms are computed in low precision, which a tolerance needs where terms
// cancel.
struct MoeBackward {
  std::vector<double> dx, dw_router, dw1, dw3, dw2, dshared_w1, dshared_w3, dshared_w2;
  std::vector<double> dw1_mag, dw3_mag, dw2_mag, dshared_w1_mag, dshared_w3_mag, dshared_w2_mag;
};
MoeBackward moe_backward(std::span<const float> x, int tokens, const MoeLayer& layer,
                         std::span<const float> dy);

}  // namespace k2c::ref
