// cuda_ops.cu — the GPU backend of k2c/model/ops.h: every operation on the device, tensors in
// fp32 (master weights, gradients, optimizer state; the residual stream and the activations too
// unless stored in bf16, below), in one of two kinds of math:
//
//   GpuMath::fp32  GEMMs in plain fp32 (cuBLAS SGEMM) and a straightforward kernel for every
//                  other operation, attention included: the reference the tests hold tightly
//                  against the CPU backend.
//   GpuMath::bf16  the fast path: the operands of every GEMM are rounded to bf16 on their way in
//                  and multiplied on the tensor cores with fp32 accumulation, results in the
//                  output's dtype
//                  (mixed precision as training frameworks do it), and attention is computed by
//                  batched tensor-core GEMMs over blocks of the score matrix: the causal mask's
//                  empty blocks are never computed, the softmax runs in fp32 between the GEMMs,
//                  and backward recomputes the scores from the log-sum-exp instead of storing
//                  them (src/cuda_attention.cuh tells the story); for head_dim 64 and 128 a fused
//                  FlashAttention-2 kernel pair on mma.sync takes over, and the scores never
//                  reach memory (src/cuda_flash.cuh).
//
// Element-wise and row-wise operations (norms, RoPE, SwiGLU, cross-entropy, dropout, AdamW) are
// the same plain kernels in both modes (src/cuda_kernels.cuh): they are memory-bound, so what
// they cost is bytes. Activations stored in bf16 (ops.h's [bf16] operations) halve those bytes:
// the kernels of those operations read and write either type, GEMMs take bf16 operands as they
// are and write a bf16 output directly, and a call that no kernel takes in bf16 (fp32 mode, the
// unfused attention) runs on fp32 copies that are rounded back once (Wide). Reductions that the CPU backend does in a fixed order are done here with
// atomics where that is simplest (embedding gradients, scatters): the GPU backend promises
// agreement within rounding, not bits. Every launch and every cuBLAS call goes to one stream
// (cuda_ops_use_stream), so a communicator that orders its work against that stream sees the
// model's work in order.
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <array>
#include <climits>
#include <cmath>
#include <cstring>
#include <initializer_list>
#include <span>
#include <stdexcept>
#include <string>
#include <optional>
#include <tuple>
#include <type_traits>
#include <unordered_map>
#include <vector>

#include "k2c/core/check.h"
#include "k2c/model/cuda_ops.h"
#include "k2c/model/mask.h"
#include "op_checks.h"

namespace k2c::model {

namespace {

// The stream every operation of both GPU backends is issued to (nullptr: the legacy default
// stream, which orders against every other blocking stream of the device).
cudaStream_t g_stream = nullptr;

constexpr int kThreads = 256;
int blocks_for(std::int64_t n) { return static_cast<int>(std::min<std::int64_t>((n + kThreads - 1) / kThreads, 65535)); }

using checks::as_matrix;
using checks::Matrix;
using checks::same_shape;

// Device memory with a cache of freed blocks, as training frameworks keep one: a step allocates
// and frees the same activation sizes every time, and cudaMalloc / cudaFree are slow and
// cudaFree waits for the whole device. A freed block goes back to a free list by size and the
// next request of that size takes it. That is safe in stream order: every kernel that read the
// old tensor was queued before any kernel that writes the new one, on the same stream. Blocks are
// rounded up (to 512 bytes, or to 2 MiB above 2 MiB) so that near sizes share; when the device
// runs out, the cache is released and the allocation tried once more.
class DeviceMemory final : public Memory {
 public:
  ~DeviceMemory() override {
    release_cache();
    for (auto& [p, bytes] : live_) cudaFree(p);
  }
  void* alloc(std::size_t bytes) override {
    if (bytes == 0) return nullptr;
    const std::size_t size = rounded(bytes);
    void* p = nullptr;
    if (auto it = free_.find(size); it != free_.end()) {
      p = it->second;
      free_.erase(it);
      cached_ -= size;
    } else if (cudaMalloc(&p, size) != cudaSuccess) {
      cudaGetLastError();  // clear the out-of-memory error, release what is cached, try again
      release_cache();
      K2C_CUDA_CHECK(cudaMalloc(&p, size));
    }
    live_[p] = size;
    return p;
  }
  void free(void* p) override {
    if (!p) return;
    const auto it = live_.find(p);
    if (it == live_.end()) return;  // not ours: nothing to do
    free_.emplace(it->second, p);
    cached_ += it->second;
    live_.erase(it);
  }
  bool on_device() const override { return true; }

 private:
  static std::size_t rounded(std::size_t bytes) {
    const std::size_t unit = bytes > (std::size_t{2} << 20) ? (std::size_t{2} << 20) : 512;
    return (bytes + unit - 1) / unit * unit;
  }
  void release_cache() {
    if (free_.empty()) return;
    cudaDeviceSynchronize();
    for (auto& [size, p] : free_) cudaFree(p);
    free_.clear();
    cached_ = 0;
  }
  std::unordered_map<void*, std::size_t> live_;
  std::unordered_multimap<std::size_t, void*> free_;
  std::size_t cached_ = 0;
};

// Small uploads without a wait: the host's bytes are copied into pinned memory at once, so the
// caller may reuse its buffer on return, and the device copy is queued in stream order. Two
// buffers take turns; one is refilled only after the copy that last read it has finished (an
// event, almost always long past).
class Staging {
 public:
  static constexpr std::size_t kMaxBytes = std::size_t{4} << 20;
  Staging() = default;
  Staging(const Staging&) = delete;
  Staging& operator=(const Staging&) = delete;
  ~Staging() {
    for (Slot& s : slots_) {
      if (s.read) cudaEventDestroy(s.read);
      cudaFreeHost(s.host);
    }
  }
  static bool fits(std::size_t bytes) { return bytes <= kMaxBytes; }
  void to_device(void* dst, const void* host, std::size_t bytes) {
    if (bytes == 0) return;
    Slot& s = slots_[next_];
    next_ ^= 1;
    if (s.read) K2C_CUDA_CHECK(cudaEventSynchronize(s.read));
    else K2C_CUDA_CHECK(cudaEventCreateWithFlags(&s.read, cudaEventDisableTiming));
    if (s.bytes < bytes) {
      K2C_CUDA_CHECK(cudaFreeHost(s.host));
      s.host = nullptr, s.bytes = 0;
      K2C_CUDA_CHECK(cudaMallocHost(&s.host, bytes));
      s.bytes = bytes;
    }
    std::memcpy(s.host, host, bytes);
    K2C_CUDA_CHECK(cudaMemcpyAsync(dst, s.host, bytes, cudaMemcpyHostToDevice, g_stream));
    K2C_CUDA_CHECK(cudaEventRecord(s.read, g_stream));
  }

 private:
  struct Slot {
    void* host = nullptr;
    std::size_t bytes = 0;
    cudaEvent_t read = nullptr;  // recorded after the copy that reads `host`
  };
  Slot slots_[2];
  int next_ = 0;
};

// Index checks without a wait of their own. A kernel that meets an index outside its range skips
// it and sets its operation's flag; the flags cross to the host with the next wait the host makes
// anyway (a download, a loss, column sums, a routing plan, a sum of squares, cuda_ops_synchronize), which throws
// std::out_of_range for the first operation flagged and clears them all. A wait after each check
// would drain the stream several times in every MoE layer (its gathers, scatters and router
// gradient). One set of flags for the process: both backends issue to the same stream, and a
// tensor one of them made may reach the other's kernels.
enum IndexCheck { kIds, kTargets, kGatherRows, kScatterRows, kGatherAddRows, kGatherAddTokens, kExperts, kPlanExperts, kPlanRows, kIndexChecks };
struct IndexFlags {
  int* device = nullptr;  // [kIndexChecks]
  int* seen = nullptr;    // their pinned copy on the host
};
IndexFlags& index_flags() {
  static IndexFlags f = [] {
    IndexFlags n;
    K2C_CUDA_CHECK(cudaMalloc(&n.device, kIndexChecks * sizeof(int)));
    K2C_CUDA_CHECK(cudaMemset(n.device, 0, kIndexChecks * sizeof(int)));
    K2C_CUDA_CHECK(cudaMallocHost(&n.seen, kIndexChecks * sizeof(int)));
    return n;
  }();
  return f;
}
int* index_flag(IndexCheck c) { return index_flags().device + c; }
void wait_for_device() {
  IndexFlags& f = index_flags();
  K2C_CUDA_CHECK(cudaMemcpyAsync(f.seen, f.device, kIndexChecks * sizeof(int), cudaMemcpyDeviceToHost, g_stream));
  K2C_CUDA_CHECK(cudaStreamSynchronize(g_stream));
  for (int c = 0; c < kIndexChecks; ++c) {
    if (!f.seen[c]) continue;
    std::fill(f.seen, f.seen + kIndexChecks, 0);
    K2C_CUDA_CHECK(cudaMemsetAsync(f.device, 0, kIndexChecks * sizeof(int), g_stream));  // reported once
    static constexpr const char* what[kIndexChecks] = {
        "embedding: an id outside the table", "cross-entropy: a target outside the vocabulary",
        "gather_rows: a row outside the source", "scatter_add_rows: a row outside the output",
        "gather_add_rows: a row outside the source", "gather_add_rows_backward: a token outside the output gradient",
        "routing_grad: an expert outside [0, E)", "route_rows: an expert outside [0, experts)",
        "route_rows_backward: a row outside [0, N·k)"};
    throw std::out_of_range(what[c]);
  }
}

#include "cuda_kernels.cuh"

#include "cuda_attention.cuh"
#include "cuda_flash.cuh"

// ---------------------------------------------------------------------------------------------
// the backend

class CudaOps final : public Ops {
 public:
  explicit CudaOps(GpuMath math) : math_(math) {
    K2C_CUBLAS_CHECK(cublasCreate(&blas_));
    // fp32 mode: plain fp32 products, as the CPU backend computes them (no TF32).
    K2C_CUBLAS_CHECK(cublasSetMathMode(blas_, CUBLAS_DEFAULT_MATH));
    K2C_CUDA_CHECK(cudaMalloc(&sum_, sizeof(double)));
  }
  ~CudaOps() override {
    cublasDestroy(blas_);
    cudaFree(sum_);
  }
  std::string name() const override { return math_ == GpuMath::bf16 ? "cuda (bf16 tensor cores)" : "cuda (fp32)"; }
  Memory& memory() override { return device_; }

  void upload(Tensor& dst, const void* host) override { to_device(dst.raw(), host, dst.bytes()); }
  void download(void* host, const Tensor& src) override {
    K2C_CUDA_CHECK(cudaMemcpyAsync(host, src.raw(), src.bytes(), cudaMemcpyDeviceToHost, g_stream));
    wait_for_device();
  }

  void fill(Tensor& t, float v) override {
    if (t.dtype() == DType::bf16) return fill_as<__nv_bfloat16>(t, v);
    fill_as<float>(t, v);
  }
  template <class T>
  void fill_as(Tensor& t, float v) {
    if (vectorizable(t.numel(), {t.raw()})) launch(fill4_kernel<T>, t.numel() / 4, ptr<T>(t), t.numel() / 4, v);
    else launch(fill_kernel<T>, t.numel(), ptr<T>(t), t.numel(), v);
  }
  void copy(Tensor& dst, const Tensor& src) override {
    checks::copy_args(dst, src);
    if (dst.dtype() == src.dtype()) {
      K2C_CUDA_CHECK(cudaMemcpyAsync(dst.raw(), src.raw(), src.bytes(), cudaMemcpyDeviceToDevice, g_stream));
    } else if (dst.dtype() == DType::bf16) {
      convert_as(src.f32(), ptr<__nv_bfloat16>(dst), src.numel());
    } else {
      convert_as(ptr<__nv_bfloat16>(src), dst.f32(), src.numel());
    }
  }
  template <class S, class O>
  void convert_as(const S* src, O* dst, std::int64_t n) {
    if (vectorizable(n, {src, dst})) launch(convert4_kernel<S, O>, n / 4, src, dst, n / 4);
    else launch(convert_kernel<S, O>, n, src, dst, n);
  }
  void add(const Tensor& a, const Tensor& b, Tensor& out) override {
    same_shape(a, b, "add");
    same_shape(a, out, "add");
    // Each operand read and the sum stored in its own dtype (a bf16 branch output added into the
    // residual stream, fp32 or bf16, model::Block), rounded once where out holds bf16.
    with_dtype(a, [&](auto* pa) {
      with_dtype(b, [&](auto* pb) { with_dtype(out, [&](auto* po) { add_as(pa, pb, po, a.numel()); }); });
    });
  }
  void accumulate(Tensor& acc, const Tensor& x, float s) override {
    same_shape(acc, x, "accumulate");
    if (vectorizable(x.numel(), {acc.raw(), x.raw()})) launch(axpy4_kernel, x.numel() / 4, f4(acc), f4(x), s, x.numel() / 4);
    else launch(axpy_kernel, x.numel(), acc.f32(), x.f32(), s, x.numel());
  }
  void scale(Tensor& t, float s) override {
    if (vectorizable(t.numel(), {t.raw()})) launch(scale4_kernel, t.numel() / 4, f4(t), s, t.numel() / 4);
    else launch(scale_kernel, t.numel(), t.f32(), s, t.numel());
  }
  double sum_squares(const Tensor& t) override {
    K2C_CUDA_CHECK(cudaMemsetAsync(sum_, 0, sizeof(double), g_stream));
    launch(sum_squares_kernel, t.numel(), t.f32(), t.numel(), sum_);
    double s = 0;
    K2C_CUDA_CHECK(cudaMemcpyAsync(&s, sum_, sizeof s, cudaMemcpyDeviceToHost, g_stream));
    wait_for_device();
    return s;
  }

  void matmul(const Tensor& a, bool ta, const Tensor& b, bool tb, Tensor& c, float alpha, float beta) override {
    const auto [M, N, K] = checks::gemm_dims(a, ta, b, tb, c);
    const Matrix ma = as_matrix(a), mb = as_matrix(b);
    if (M == 0 || N == 0) return;
    if ((math_ == GpuMath::fp32 || K == 0) && any_bf16({&a, &b, &c})) {  // SGEMM and scale take fp32
      Wide wa(*this, a), wb(*this, b), wc(*this, c, beta == 0.0f ? Use::out : Use::in_out);
      matmul(wa, ta, wb, tb, wc, alpha, beta);
      return wc.store();
    }
    if (K == 0) {  // cuBLAS leaves C alone when K is 0; the contract is c = beta·c
      if (beta == 0.0f) fill(c, 0.0f);
      else scale(c, beta);
      return;
    }
    K2C_CUBLAS_CHECK(cublasSetStream(blas_, g_stream));
    if (math_ == GpuMath::bf16) {
      gemm16(to_bf16(a, ws_, kGemmA), ta, ma.cols, to_bf16(b, ws_, kGemmB), tb, mb.cols, c, M, N, K, alpha, beta);
      return;
    }
    // Row-major C (M×N) is column-major Cᵀ (N×M) = op(B)ᵀ·op(A)ᵀ: swap the operands, keep the ops.
    K2C_CUBLAS_CHECK(cublasSgemm(blas_, tb ? CUBLAS_OP_T : CUBLAS_OP_N, ta ? CUBLAS_OP_T : CUBLAS_OP_N,
                                 static_cast<int>(N), static_cast<int>(M), static_cast<int>(K), &alpha, b.f32(),
                                 static_cast<int>(mb.cols), a.f32(), static_cast<int>(ma.cols), &beta, c.f32(),
                                 static_cast<int>(N)));
  }

  void linear_backward(const Tensor& x, const Tensor& w, const Tensor& dy, Tensor* dw, Tensor* dx) override {
    if (math_ != GpuMath::bf16) return Ops::linear_backward(x, w, dy, dw, dx);
    // dy rounded once for both products; checked as the two matmul calls would be.
    const Matrix mx = as_matrix(x), mw = as_matrix(w), my = as_matrix(dy);
    if (dw) checks::gemm_dims(dy, true, x, false, *dw);
    if (dx) checks::gemm_dims(dy, false, w, false, *dx);
    if (my.rows == 0 || my.cols == 0 || mx.cols == 0 || mw.cols == 0 || (!dw && !dx))
      return Ops::linear_backward(x, w, dy, dw, dx);  // an empty product: matmul's rules for it
    K2C_CUBLAS_CHECK(cublasSetStream(blas_, g_stream));
    const __nv_bfloat16* dy16 = to_bf16(dy, ws_, kLinearDy);
    if (dw) gemm16(dy16, true, my.cols, to_bf16(x, ws_, kGemmB), false, mx.cols, *dw, my.cols, mx.cols, my.rows, 1.0f, 1.0f);
    if (dx) gemm16(dy16, false, my.cols, to_bf16(w, ws_, kGemmB), false, mw.cols, *dx, my.rows, mw.cols, my.cols, 1.0f, 0.0f);
  }

  void shared_linear_forward(const Tensor& x, std::span<const Tensor* const> ws, std::span<Tensor* const> ys) override {
    if (math_ != GpuMath::bf16 || ws.size() != ys.size()) return Ops::shared_linear_forward(x, ws, ys);
    const Matrix mx = as_matrix(x);
    for (std::size_t i = 0; i < ws.size(); ++i) checks::gemm_dims(x, false, *ws[i], true, *ys[i]);
    if (mx.rows == 0 || mx.cols == 0) return Ops::shared_linear_forward(x, ws, ys);  // matmul's rules
    K2C_CUBLAS_CHECK(cublasSetStream(blas_, g_stream));
    const __nv_bfloat16* x16 = to_bf16(x, ws_, kGemmA);  // once for every projection
    for (std::size_t i = 0; i < ws.size(); ++i) {
      const std::int64_t N = as_matrix(*ws[i]).rows;
      if (N > 0) gemm16(x16, false, mx.cols, to_bf16(*ws[i], ws_, kGemmB), true, mx.cols, *ys[i], mx.rows, N, mx.cols, 1.0f, 0.0f);
    }
  }
  void shared_linear_backward(const Tensor& x, std::span<const Tensor* const> ws, std::span<const Tensor* const> dys,
                              std::span<Tensor* const> dws, Tensor* dx) override {
    if (math_ != GpuMath::bf16 || ws.size() != dys.size() || ws.size() != dws.size())
      return Ops::shared_linear_backward(x, ws, dys, dws, dx);
    const Matrix mx = as_matrix(x);
    bool empty = mx.rows == 0 || mx.cols == 0;
    for (std::size_t i = 0; i < ws.size(); ++i) {
      if (dws[i]) checks::gemm_dims(*dys[i], true, x, false, *dws[i]);
      if (dx) checks::gemm_dims(*dys[i], false, *ws[i], false, *dx);
      empty = empty || as_matrix(*dys[i]).cols == 0;
    }
    if (empty || ws.empty()) return Ops::shared_linear_backward(x, ws, dys, dws, dx);  // matmul's rules
    K2C_CUBLAS_CHECK(cublasSetStream(blas_, g_stream));
    const __nv_bfloat16* x16 = nullptr;
    for (std::size_t i = 0; i < ws.size(); ++i) {
      const Matrix my = as_matrix(*dys[i]);
      const __nv_bfloat16* dy16 = to_bf16(*dys[i], ws_, kLinearDy);  // once for both of its products
      if (dws[i]) {
        if (!x16) x16 = to_bf16(x, ws_, kGemmA);  // once for every weight gradient
        gemm16(dy16, true, my.cols, x16, false, mx.cols, *dws[i], my.cols, mx.cols, my.rows, 1.0f, 1.0f);
      }
      if (dx)
        gemm16(dy16, false, my.cols, to_bf16(*ws[i], ws_, kGemmB), false, mx.cols, *dx, my.rows, mx.cols, my.cols, 1.0f,
               i == 0 ? 0.0f : 1.0f);
    }
  }

  // The experts' GEMMs: each operand rounded to bf16 once for every group (not once per expert),
  // then one cuBLAS GEMM per group with rows on bf16 pointers into those copies.
  //
  // cuBLAS picks a kernel on the host for every new shape, and the routing gives each expert a
  // row count of its own at almost every call: measured on the H200 (MoE-135M, 108 grouped calls a
  // step), the host spent 970 ms of the first step in these loops and still 40-90 ms later on,
  // and the step's rate followed it. So the row counts are rounded up to whole buckets of
  // kGroupRows, which repeat: a group's product also covers the next groups' first rows (they
  // are written again when their own group runs, in order on the same stream), up to the end of
  // the tensor; a weight gradient, whose rows are its sum, is split into whole buckets and a
  // remainder of fewer than kGroupRows rows instead.
  static constexpr std::int64_t kGroupRows = 128;
  void grouped_matmul(const Tensor& a, std::span<const std::int64_t> offsets, int first, const Tensor& w,
                      bool transpose_w, Tensor& c) override {
    if (math_ != GpuMath::bf16 || !grouped_fits(a, offsets, first, w, c)) return Ops::grouped_matmul(a, offsets, first, w, transpose_w, c);
    const std::int64_t n = w.dim(1), k = w.dim(2), in = transpose_w ? k : n, out = transpose_w ? n : k;
    if (a.dim(1) != in || c.dim(1) != out) return Ops::grouped_matmul(a, offsets, first, w, transpose_w, c);  // its error
    K2C_CUBLAS_CHECK(cublasSetStream(blas_, g_stream));
    const __nv_bfloat16 *a16 = to_bf16(a, ws_, kGemmA), *w16 = to_bf16(w, ws_, kGemmB);
    for (std::size_t g = 0; g + 1 < offsets.size(); ++g) {
      const std::int64_t r0 = offsets[g], rows = offsets[g + 1] - r0;
      if (rows == 0) continue;
      const std::int64_t covered = std::min((rows + kGroupRows - 1) / kGroupRows * kGroupRows, a.dim(0) - r0);
      Tensor c_g = c.rows(r0, covered);
      gemm16(a16 + r0 * in, false, in, w16 + (first + static_cast<std::int64_t>(g)) * n * k, transpose_w, k, c_g,
             covered, out, in, 1.0f, 0.0f);
    }
  }
  void grouped_weight_grad(const Tensor& dy, const Tensor& x, std::span<const std::int64_t> offsets, int first,
                           Tensor& dw) override {
    if (math_ != GpuMath::bf16 || !grouped_fits(dy, offsets, first, dw, x) || dy.dim(1) != dw.dim(1) ||
        x.dim(1) != dw.dim(2))
      return Ops::grouped_weight_grad(dy, x, offsets, first, dw);
    const std::int64_t n = dw.dim(1), k = dw.dim(2);
    K2C_CUBLAS_CHECK(cublasSetStream(blas_, g_stream));
    const __nv_bfloat16 *dy16 = to_bf16(dy, ws_, kLinearDy), *x16 = to_bf16(x, ws_, kGemmB);
    for (std::size_t g = 0; g + 1 < offsets.size(); ++g) {
      const std::int64_t r0 = offsets[g], rows = offsets[g + 1] - r0, whole = rows / kGroupRows * kGroupRows;
      Tensor dw_g = Tensor::view(dw.f32() + (first + static_cast<std::int64_t>(g)) * n * k, {n, k});
      if (whole > 0) gemm16(dy16 + r0 * n, true, n, x16 + r0 * k, false, k, dw_g, n, k, whole, 1.0f, 1.0f);
      if (rows > whole)
        gemm16(dy16 + (r0 + whole) * n, true, n, x16 + (r0 + whole) * k, false, k, dw_g, n, k, rows - whole, 1.0f, 1.0f);
    }
  }
  // Whether a grouped call is well formed (else the base class's checks name what is not) and has rows.
  static bool grouped_fits(const Tensor& a, std::span<const std::int64_t> offsets, int first, const Tensor& w,
                           const Tensor& other) {
    if (a.rank() != 2 || w.rank() != 3 || other.rank() != 2 || other.dim(0) != a.dim(0) || a.dim(0) == 0) return false;
    if (offsets.empty() || offsets.front() != 0 || offsets.back() != a.dim(0) || first < 0 ||
        first + static_cast<std::int64_t>(offsets.size()) - 1 > w.dim(0))
      return false;
    for (std::size_t g = 0; g + 1 < offsets.size(); ++g)
      if (offsets[g + 1] < offsets[g]) return false;
    return true;
  }

  void embedding_forward(const Tensor& ids, const Tensor& table, Tensor& out) override {
    const Matrix t = as_matrix(table);
    out.expect({ids.numel(), t.cols}, "embedding output");
    launch(embedding_forward_kernel, ids.numel() * t.cols, ids.i32(), table.f32(), out.f32(), ids.numel(), t.cols, t.rows,
           index_flag(kIds));
  }
  void embedding_backward(const Tensor& ids, const Tensor& dout, Tensor& dtable) override {
    const Matrix t = as_matrix(dtable);
    dout.expect({ids.numel(), t.cols}, "embedding output gradient");
    launch(embedding_backward_kernel, ids.numel() * t.cols, ids.i32(), dout.f32(), dtable.f32(), ids.numel(), t.cols, t.rows,
           index_flag(kIds));
  }

  // x is the residual stream, fp32 or bf16; y a GEMM's operand, fp32 or bf16.
  void rmsnorm_forward(const Tensor& x, const Tensor& gamma, float eps, Tensor& y, Tensor& rstd) override {
    const Matrix m = checks::rmsnorm_args(x, gamma, y, rstd);
    if (m.rows == 0) return;
    if (x.dtype() == DType::bf16) return rmsnorm_forward_x<__nv_bfloat16>(m, x, gamma, eps, y, rstd);
    rmsnorm_forward_x<float>(m, x, gamma, eps, y, rstd);
  }
  template <class X>
  void rmsnorm_forward_x(Matrix m, const Tensor& x, const Tensor& gamma, float eps, Tensor& y, Tensor& rstd) {
    if (y.dtype() == DType::bf16) return rmsnorm_forward_as<X, __nv_bfloat16>(m, x, gamma, eps, y, rstd);
    rmsnorm_forward_as<X, float>(m, x, gamma, eps, y, rstd);
  }
  template <class X, class Y>
  void rmsnorm_forward_as(Matrix m, const Tensor& x, const Tensor& gamma, float eps, Tensor& y, Tensor& rstd) {
    if (vectorizable(m.cols, {x.raw(), gamma.raw(), y.raw()}))
      rmsnorm_forward_kernel<true><<<rows_grid(m.rows), kThreads, 0, g_stream>>>(ptr<X>(x), gamma.f32(), eps, ptr<Y>(y),
                                                                                rstd.f32(), m.cols);
    else
      rmsnorm_forward_kernel<false><<<rows_grid(m.rows), kThreads, 0, g_stream>>>(ptr<X>(x), gamma.f32(), eps,
                                                                                 ptr<Y>(y), rstd.f32(), m.cols);
    K2C_CUDA_CHECK_LAUNCH();
  }
  void rmsnorm_backward(const Tensor& x, const Tensor& gamma, const Tensor& rstd, const Tensor& dy, Tensor& dx,
                        Tensor& dgamma) override {
    rmsnorm_backward_into(x, gamma, rstd, dy, nullptr, dx, dgamma);
  }
  void rmsnorm_backward_add(const Tensor& x, const Tensor& gamma, const Tensor& rstd, const Tensor& dy,
                            const Tensor& residual_dy, Tensor& dx, Tensor& dgamma) override {
    same_shape(x, residual_dy, "rmsnorm backward (residual gradient)");
    rmsnorm_backward_into(x, gamma, rstd, dy, &residual_dy, dx, dgamma);
  }
  void rmsnorm_backward_into(const Tensor& x, const Tensor& gamma, const Tensor& rstd, const Tensor& dy,
                             const Tensor* residual_dy, Tensor& dx, Tensor& dgamma) {
    const Matrix m = checks::rmsnorm_backward_args(x, gamma, rstd, dy, dx, dgamma);
    if (m.rows == 0) return;
    // The kernels take x, the residual's gradient and dx in one dtype, the stream's (dy either):
    // a call that mixes them (a pipeline stage's fp32 gradient into a bf16 stream) runs on fp32
    // copies.
    const DType stream = float_dtype(x, "rmsnorm backward input");
    float_dtype(dx, "rmsnorm backward output");
    if (residual_dy) float_dtype(*residual_dy, "rmsnorm backward residual gradient");
    if (dx.dtype() != stream || (residual_dy && residual_dy->dtype() != stream)) {
      Wide wx(*this, x), wdx(*this, dx, Use::out);
      std::optional<Wide> wr;
      if (residual_dy) wr.emplace(*this, *residual_dy);
      rmsnorm_backward_into(wx, gamma, rstd, dy, residual_dy ? &static_cast<Tensor&>(*wr) : nullptr, wdx, dgamma);
      return wdx.store();
    }
    if (stream == DType::bf16) rmsnorm_backward_s<__nv_bfloat16>(m, x, gamma, rstd, dy, residual_dy, dx, dgamma);
    else rmsnorm_backward_s<float>(m, x, gamma, rstd, dy, residual_dy, dx, dgamma);
  }
  template <class S>
  void rmsnorm_backward_s(Matrix m, const Tensor& x, const Tensor& gamma, const Tensor& rstd, const Tensor& dy,
                          const Tensor* residual_dy, Tensor& dx, Tensor& dgamma) {
    if (dy.dtype() == DType::bf16) rmsnorm_backward_as<S, __nv_bfloat16>(m, x, gamma, rstd, dy, residual_dy, dx, dgamma);
    else rmsnorm_backward_as<S, float>(m, x, gamma, rstd, dy, residual_dy, dx, dgamma);
  }
  template <class S, class DY>
  void rmsnorm_backward_as(Matrix m, const Tensor& x, const Tensor& gamma, const Tensor& rstd, const Tensor& dy,
                           const Tensor* residual_dy, Tensor& dx, Tensor& dgamma) {
    const S* residual = residual_dy ? ptr<S>(*residual_dy) : nullptr;
    if (vectorizable(m.cols, {x.raw(), gamma.raw(), dy.raw(), dx.raw(), residual}))
      rmsnorm_backward_kernel<true><<<rows_grid(m.rows), kThreads, 0, g_stream>>>(ptr<S>(x), gamma.f32(), rstd.f32(),
                                                                                 ptr<DY>(dy), residual, ptr<S>(dx), m.cols);
    else
      rmsnorm_backward_kernel<false><<<rows_grid(m.rows), kThreads, 0, g_stream>>>(
          ptr<S>(x), gamma.f32(), rstd.f32(), ptr<DY>(dy), residual, ptr<S>(dx), m.cols);
    K2C_CUDA_CHECK_LAUNCH();
    const dim3 grid(static_cast<unsigned>((m.cols + kThreads - 1) / kThreads),
                    static_cast<unsigned>((m.rows + kRowRun - 1) / kRowRun));
    rmsnorm_dgamma_kernel<<<grid, kThreads, 0, g_stream>>>(ptr<S>(x), rstd.f32(), ptr<DY>(dy), dgamma.f32(), m.rows,
                                                           m.cols);
    K2C_CUDA_CHECK_LAUNCH();
  }

  void rope(Tensor& x, const Tensor& positions, int heads, int head_dim, float theta, bool inverse) override {
    const Matrix m = as_matrix(x);
    const std::int64_t T = positions.numel();
    if (head_dim % 2 || m.cols != static_cast<std::int64_t>(heads) * head_dim || T == 0 || m.rows % T)
      throw std::invalid_argument("rope: x " + x.shape().str() + " is not [batch*" + std::to_string(T) + ", " +
                                  std::to_string(heads) + "*" + std::to_string(head_dim) + "] with an even head_dim");
    if (x.dtype() == DType::bf16) return rope_as<__nv_bfloat16>(x, m, positions, heads, head_dim, theta, inverse);
    rope_as<float>(x, m, positions, heads, head_dim, theta, inverse);
  }
  template <class T>
  void rope_as(Tensor& x, Matrix m, const Tensor& positions, int heads, int head_dim, float theta, bool inverse) {
    const std::int64_t T_ = positions.numel();
    if (head_dim % 8 == 0 && vectorizable(m.rows * m.cols, {x.raw()})) {
      auto* cs = static_cast<float2*>(ws_.get(kRope, static_cast<std::size_t>(T_) * (head_dim / 2) * sizeof(float2)));
      launch(rope_table_kernel, T_ * (head_dim / 2), cs, positions.i32(), static_cast<int>(T_), head_dim, theta, inverse);
      launch(rope4_kernel<T>, m.rows * heads * (head_dim / 8), ptr<T>(x), static_cast<const float2*>(cs), m.rows,
             static_cast<int>(T_), heads, head_dim);
      return;
    }
    launch(rope_kernel<T>, m.rows * (head_dim / 2), ptr<T>(x), positions.i32(), m.rows, static_cast<int>(T_), heads,
           head_dim, theta, inverse);
  }

  void attention_forward(const AttentionShape& s, const Tensor& q, const Tensor& k, const Tensor& v, Tensor& o,
                         Tensor& lse) override {
    checks::attention_args(s, q, k, v);
    checks::activation(o, q.shape(), "attention output");
    lse.expect({s.batch, s.q_heads, s.q_len}, "attention lse");
    if (s.q_len == 0) return;
    // The fused kernels read and write bf16 as they are; the other kernels take fp32 only.
    const bool flash = math_ == GpuMath::bf16 && flash_fits(s, o);
    if (!flash && any_bf16({&q, &k, &v, &o})) {
      Wide wq(*this, q), wk(*this, k), wv(*this, v), wo(*this, o, Use::out);
      attention_forward(s, wq, wk, wv, wo, lse);
      return wo.store();
    }
    if (flash) {
      flash_.forward(s, q, k, v, o, lse);
      return;
    }
    if (math_ == GpuMath::bf16 && blocked_attention_fits(s)) {
      K2C_CUBLAS_CHECK(cublasSetStream(blas_, g_stream));
      attention_.forward(s, q, k, v, o, lse);
      return;
    }
    const dim3 grid(s.q_len, s.q_heads, s.batch);
    attention_forward_kernel<<<grid, kThreads, score_bytes(s), g_stream>>>(args(s), q.f32(), k.f32(), v.f32(), o.f32(), lse.f32());
    K2C_CUDA_CHECK_LAUNCH();
  }
  void attention_backward(const AttentionShape& s, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& o,
                          const Tensor& lse, const Tensor& dout, Tensor& dq, Tensor& dk, Tensor& dv) override {
    checks::attention_backward_args(s, q, k, v, o, lse, dout, dq, dk, dv);
    if (s.q_len == 0) return;
    const bool flash = flash_backward_takes(s, o, dout, dq, dk, dv);
    if (!flash && any_bf16({&q, &k, &v, &o, &dout, &dq, &dk, &dv})) {
      Wide wq(*this, q), wk(*this, k), wv(*this, v), wo(*this, o), wdo(*this, dout);
      Wide wdq(*this, dq, Use::out), wdk(*this, dk, Use::in_out), wdv(*this, dv, Use::in_out);
      attention_backward(s, wq, wk, wv, wo, lse, wdo, wdq, wdk, wdv);
      wdq.store();
      wdk.store();
      return wdv.store();
    }
    if (flash) {
      flash_.backward(s, q, k, v, o, lse, dout, dq, dk, dv, true);
      return;
    }
    if (math_ == GpuMath::bf16 && blocked_attention_fits(s)) {
      K2C_CUBLAS_CHECK(cublasSetStream(blas_, g_stream));
      attention_.backward(s, q, k, v, o, lse, dout, dq, dk, dv);
      return;
    }
    const dim3 grid(s.q_len, s.q_heads, s.batch);
    attention_backward_kernel<<<grid, kThreads, score_bytes(s), g_stream>>>(args(s), q.f32(), k.f32(), v.f32(), o.f32(), lse.f32(),
                                                                  dout.f32(), dq.f32(), dk.f32(), dv.f32());
    K2C_CUDA_CHECK_LAUNCH();
  }
  // The fused kernels write dk and dv where they would add into them; every other path zeroes them
  // and adds (Ops's default).
  void attention_backward_overwrite(const AttentionShape& s, const Tensor& q, const Tensor& k, const Tensor& v,
                                    const Tensor& o, const Tensor& lse, const Tensor& dout, Tensor& dq, Tensor& dk,
                                    Tensor& dv) override {
    checks::attention_backward_args(s, q, k, v, o, lse, dout, dq, dk, dv);
    if (!flash_backward_takes(s, o, dout, dq, dk, dv))
      return Ops::attention_backward_overwrite(s, q, k, v, o, lse, dout, dq, dk, dv);
    flash_.backward(s, q, k, v, o, lse, dout, dq, dk, dv, false);
  }
  // Whether the fused kernels take this backward: they read bf16 as it is and write the gradients
  // in their tensors' dtype (one for the three; O and dO of one too); the other kernels take fp32
  // only.
  bool flash_backward_takes(const AttentionShape& s, const Tensor& o, const Tensor& dout, const Tensor& dq,
                            const Tensor& dk, const Tensor& dv) const {
    return math_ == GpuMath::bf16 && flash_fits(s, dq) && same_dtype({&dq, &dk, &dv}) && same_dtype({&o, &dout});
  }

  void swiglu_forward(const Tensor& g, const Tensor& u, Tensor& h) override {
    same_shape(g, u, "swiglu");
    same_shape(g, h, "swiglu");
    if (!same_dtype({&g, &u, &h})) {
      Wide wg(*this, g), wu(*this, u), wh(*this, h, Use::out);
      swiglu_forward(wg, wu, wh);
      return wh.store();
    }
    if (g.dtype() == DType::bf16) return swiglu_forward_as<__nv_bfloat16>(g, u, h);
    swiglu_forward_as<float>(g, u, h);
  }
  template <class T>
  void swiglu_forward_as(const Tensor& g, const Tensor& u, Tensor& h) {
    if (vectorizable(g.numel(), {g.raw(), u.raw(), h.raw()}))
      launch(swiglu_forward4_kernel<T>, g.numel() / 4, ptr<T>(g), ptr<T>(u), ptr<T>(h), g.numel() / 4);
    else
      launch(swiglu_forward_kernel<T>, g.numel(), ptr<T>(g), ptr<T>(u), ptr<T>(h), g.numel());
  }
  void swiglu_backward(const Tensor& g, const Tensor& u, const Tensor& dh, Tensor& dg, Tensor& du) override {
    same_shape(g, u, "swiglu backward");
    same_shape(g, dh, "swiglu backward");
    same_shape(g, dg, "swiglu backward");
    same_shape(g, du, "swiglu backward");
    if (!same_dtype({&g, &u, &dh, &dg, &du})) {
      Wide wg(*this, g), wu(*this, u), wdh(*this, dh), wdg(*this, dg, Use::out), wdu(*this, du, Use::out);
      swiglu_backward(wg, wu, wdh, wdg, wdu);
      wdg.store();
      return wdu.store();
    }
    if (g.dtype() == DType::bf16) return swiglu_backward_as<__nv_bfloat16>(g, u, dh, dg, du);
    swiglu_backward_as<float>(g, u, dh, dg, du);
  }
  template <class T>
  void swiglu_backward_as(const Tensor& g, const Tensor& u, const Tensor& dh, Tensor& dg, Tensor& du) {
    if (vectorizable(g.numel(), {g.raw(), u.raw(), dh.raw(), dg.raw(), du.raw()}))
      launch(swiglu_backward4_kernel<T>, g.numel() / 4, ptr<T>(g), ptr<T>(u), ptr<T>(dh), ptr<T>(dg), ptr<T>(du),
             g.numel() / 4);
    else
      launch(swiglu_backward_kernel<T>, g.numel(), ptr<T>(g), ptr<T>(u), ptr<T>(dh), ptr<T>(dg), ptr<T>(du), g.numel());
  }

  double cross_entropy(const Tensor& logits, const Tensor& targets, float grad_scale, Tensor& dlogits) override {
    const Matrix m = as_matrix(logits);
    targets.expect({m.rows}, "cross-entropy targets", DType::i32);
    same_shape(logits, dlogits, "cross-entropy gradient");
    if (m.rows == 0) return 0;
    if (!same_dtype({&logits, &dlogits})) {
      Wide wz(*this, logits), wdz(*this, dlogits, Use::out);
      const double loss = cross_entropy(wz, targets, grad_scale, wdz);
      wdz.store();
      return loss;
    }
    auto* losses = static_cast<double*>(ws_.get(kLosses, m.rows * sizeof(double)));
    if (logits.dtype() == DType::bf16) cross_entropy_as<__nv_bfloat16>(m, logits, targets, grad_scale, dlogits, losses);
    else cross_entropy_as<float>(m, logits, targets, grad_scale, dlogits, losses);
    std::vector<double> host(static_cast<std::size_t>(m.rows));
    K2C_CUDA_CHECK(cudaMemcpyAsync(host.data(), losses, host.size() * sizeof(double), cudaMemcpyDeviceToHost, g_stream));
    wait_for_device();
    double total = 0;  // summed on the host in row order, like the CPU backend
    for (double l : host) total += l;
    return total;
  }

  template <class T>
  void cross_entropy_as(Matrix m, const Tensor& logits, const Tensor& targets, float grad_scale, Tensor& dlogits,
                        double* losses) {
    // bf16 rows that fit in registers: one read of the logits (cross_entropy_rows_kernel).
    if constexpr (std::is_same_v<T, __nv_bfloat16>) {
      const std::int64_t vecs = (m.cols + 8 * kRowThreads - 1) / (8 * kRowThreads);
      if (m.cols % 8 == 0 && vecs <= 8 && vectorizable(m.cols, {logits.raw(), dlogits.raw()})) {
        auto rows = [&](auto kernel) {
          kernel<<<rows_grid(m.rows), kRowThreads, 0, g_stream>>>(ptr<T>(logits), targets.i32(), grad_scale, ptr<T>(dlogits),
                                                                  losses, static_cast<int>(m.cols), index_flag(kTargets));
          K2C_CUDA_CHECK_LAUNCH();
        };
        if (vecs <= 1) rows(cross_entropy_rows_kernel<1>);
        else if (vecs <= 2) rows(cross_entropy_rows_kernel<2>);
        else if (vecs <= 4) rows(cross_entropy_rows_kernel<4>);
        else rows(cross_entropy_rows_kernel<8>);
        return;
      }
    }
    // Four at a time where a row is whole 16-byte (fp32) or 8-byte (bf16) steps from aligned starts.
    if (vectorizable(m.cols, {logits.raw(), dlogits.raw()}))
      cross_entropy_kernel<true, T><<<rows_grid(m.rows), kThreads, 0, g_stream>>>(ptr<T>(logits), targets.i32(), grad_scale,
                                                                                 ptr<T>(dlogits), losses, m.cols, index_flag(kTargets));
    else
      cross_entropy_kernel<false, T><<<rows_grid(m.rows), kThreads, 0, g_stream>>>(ptr<T>(logits), targets.i32(), grad_scale,
                                                                                  ptr<T>(dlogits), losses, m.cols, index_flag(kTargets));
    K2C_CUDA_CHECK_LAUNCH();
  }

  void dropout(const Tensor& x, float p, const DropoutKey& key, Tensor& out) override {
    same_shape(x, out, "dropout");
    if (!(p >= 0.0f && p < 1.0f)) throw std::invalid_argument("dropout: p must be in [0, 1)");
    const Matrix m = as_matrix(x);
    launch(dropout_kernel, x.numel(), x.f32(), out.f32(), m.rows, m.cols, p, key.seed, key.step, key.layer,
           key.row_offset, key.col_offset, key.full_cols < 0 ? m.cols : key.full_cols);
  }

  void softmax_rows(const Tensor& x, Tensor& y) override {
    same_shape(x, y, "softmax");
    const Matrix m = as_matrix(x);
    if (m.cols == 0 && m.rows > 0) throw std::invalid_argument("softmax: rows of length 0");
    if (m.rows) softmax_kernel<<<rows_grid(m.rows), kThreads, 0, g_stream>>>(x.f32(), y.f32(), m.cols);
    K2C_CUDA_CHECK_LAUNCH();
  }
  void softmax_rows_backward(const Tensor& y, const Tensor& dy, Tensor& dx) override {
    same_shape(y, dy, "softmax backward");
    same_shape(y, dx, "softmax backward");
    const Matrix m = as_matrix(y);
    if (m.rows) softmax_backward_kernel<<<rows_grid(m.rows), kThreads, 0, g_stream>>>(y.f32(), dy.f32(), dx.f32(), m.cols);
    K2C_CUDA_CHECK_LAUNCH();
  }
  void top_k(const Tensor& scores, int k, Tensor& indices, Tensor& values) override {
    const Matrix m = checks::top_k_args(scores, k, indices, values);
    launch(top_k_kernel, m.rows, scores.f32(), indices.i32(), values.f32(), m.rows, static_cast<int>(m.cols), k);
  }
  // The row operations: a block per row, four columns at a time where every row allows it
  // (row_launch).
  void gather_rows(const Tensor& src, const Tensor& rows, Tensor& out) override {
    const Matrix m = as_matrix(src);
    float_dtype(src, "gather_rows source");
    out.expect({rows.numel(), m.cols}, "gather_rows output", float_dtype(out, "gather_rows output"));
    const RowLaunch l = row_launch(rows.numel(), m, {src.raw(), out.raw()});
    if (!l.blocks) return;
    int* bad = index_flag(kGatherRows);
    auto run = [&](auto* from, auto* to) {
      if (l.vec) gather_rows_kernel<true><<<l.blocks, l.threads, 0, g_stream>>>(from, rows.i32(), to, l.cols, l.bound, bad);
      else gather_rows_kernel<false><<<l.blocks, l.threads, 0, g_stream>>>(from, rows.i32(), to, l.cols, l.bound, bad);
    };
    const bool s16 = src.dtype() == DType::bf16, o16 = out.dtype() == DType::bf16;  // [bf16]: either, each
    if (s16 && o16) run(ptr<__nv_bfloat16>(src), ptr<__nv_bfloat16>(out));
    else if (s16) run(ptr<__nv_bfloat16>(src), out.f32());
    else if (o16) run(src.f32(), ptr<__nv_bfloat16>(out));
    else run(src.f32(), out.f32());
    K2C_CUDA_CHECK_LAUNCH();
  }
  void scatter_add_rows(const Tensor& src, const Tensor& rows, const Tensor* scale, Tensor& out) override {
    const Matrix m = as_matrix(out);
    src.expect({rows.numel(), m.cols}, "scatter_add_rows source", float_dtype(src, "scatter_add_rows source"));
    if (scale) scale->expect({rows.numel()}, "scatter_add_rows scale");
    if (float_dtype(out, "scatter_add_rows output") == DType::bf16) {  // the adds are fp32 atomics: on an fp32 copy
      Wide wo(*this, out, Use::in_out);
      scatter_add_rows(src, rows, scale, wo);
      return wo.store();
    }
    const RowLaunch l = row_launch(rows.numel(), m, {src.raw(), out.raw()});
    if (!l.blocks) return;
    int* bad = index_flag(kScatterRows);
    const float* sc = scale ? scale->f32() : nullptr;
    auto run = [&](auto* from) {
      if (l.vec) scatter_add_rows_kernel<true><<<l.blocks, l.threads, 0, g_stream>>>(from, rows.i32(), sc, out.f32(), l.cols, l.bound, bad);
      else scatter_add_rows_kernel<false><<<l.blocks, l.threads, 0, g_stream>>>(from, rows.i32(), sc, out.f32(), l.cols, l.bound, bad);
    };
    if (src.dtype() == DType::bf16) run(ptr<__nv_bfloat16>(src));
    else run(src.f32());
    K2C_CUDA_CHECK_LAUNCH();
  }
  // A block per output row: no two blocks add into one row, so no atomics, and the CPU's order.
  static constexpr int kMaxGatherAdd = 4096;  // rows a token: the block sorts them in shared memory
  void gather_add_rows(const Tensor& src, const Tensor& rows, int k, const Tensor* scale, Tensor& out) override {
    const Matrix m = checks::gather_add_rows_args(src, rows, k, scale, out);
    if (k > kMaxGatherAdd)
      throw std::invalid_argument("gather_add_rows: " + std::to_string(k) + " rows a token, more than the GPU backend's " +
                                  std::to_string(kMaxGatherAdd));
    float_dtype(src, "gather_add_rows source");
    if (float_dtype(out, "gather_add_rows output") == DType::bf16) {  // summed in fp32, rounded once
      Wide wo(*this, out, Use::in_out);
      gather_add_rows(src, rows, k, scale, wo);
      return wo.store();
    }
    const RowLaunch l = row_launch(m.rows, as_matrix(src), {src.raw(), out.raw()});  // bound: src's rows
    if (!l.blocks) return;
    int* bad = index_flag(kGatherAddRows);
    const float* sc = scale ? scale->f32() : nullptr;
    // The sorted rows in whole 16-byte words: the compiler reads the list a vector at a time
    // (compute-sanitizer saw a 12-byte read past a token's single row).
    const std::size_t sorted = (static_cast<std::size_t>(k) + 3) / 4 * 16;
    auto run = [&](auto* from) {
      if (l.vec) gather_add_rows_kernel<true><<<l.blocks, l.threads, sorted, g_stream>>>(from, rows.i32(), k, sc, out.f32(), l.cols, l.bound, bad);
      else gather_add_rows_kernel<false><<<l.blocks, l.threads, sorted, g_stream>>>(from, rows.i32(), k, sc, out.f32(), l.cols, l.bound, bad);
    };
    if (src.dtype() == DType::bf16) run(ptr<__nv_bfloat16>(src));
    else run(src.f32());
    K2C_CUDA_CHECK_LAUNCH();
  }
  // A block per row r: dout's row read once for both outputs.
  void gather_add_rows_backward(const Tensor& dout, const Tensor& token_of_row, const Tensor& scale, const Tensor& src,
                                Tensor& dsrc, Tensor& dscale) override {
    const Matrix m = checks::gather_add_rows_backward_args(dout, token_of_row, scale, src, dsrc, dscale);
    const Matrix md = as_matrix(dout);
    const bool d16 = float_dtype(dout, "gather_add_rows_backward dout") == DType::bf16,
               s16 = float_dtype(src, "gather_add_rows_backward src") == DType::bf16,
               o16 = float_dtype(dsrc, "gather_add_rows_backward dsrc") == DType::bf16;
    if (d16 || s16) {  // the gradients arrive in fp32 (the residual stream's); other mixes through fp32 copies
      Wide wd(*this, dout), ws(*this, src);
      return gather_add_rows_backward(wd, token_of_row, scale, ws, dsrc, dscale);
    }
    const RowLaunch l = row_launch(m.rows, md, {dout.raw(), src.raw(), dsrc.raw()});  // bound: dout's rows
    if (!l.blocks) return;
    int* bad = index_flag(kGatherAddTokens);
    auto run = [&](auto* to) {  // kThreads a block: block_sum halves a power of two
      if (l.vec) gather_add_rows_backward_kernel<true><<<l.blocks, kThreads, 0, g_stream>>>(dout.f32(), token_of_row.i32(), scale.f32(), src.f32(), to, dscale.f32(), l.cols, l.bound, bad);
      else gather_add_rows_backward_kernel<false><<<l.blocks, kThreads, 0, g_stream>>>(dout.f32(), token_of_row.i32(), scale.f32(), src.f32(), to, dscale.f32(), l.cols, l.bound, bad);
    };
    if (o16) run(ptr<__nv_bfloat16>(dsrc));
    else run(dsrc.f32());
    K2C_CUDA_CHECK_LAUNCH();
  }
  void row_dot(const Tensor& a, const Tensor& b, Tensor& out) override {
    same_shape(a, b, "row_dot");
    const Matrix m = as_matrix(a);
    out.expect({m.rows}, "row_dot output");
    const RowLaunch l = row_launch(m.rows, m, {a.raw(), b.raw()});
    if (!l.blocks) return;
    // kThreads a block: block_sum halves a power of two.
    if (l.vec) row_dot_kernel<true><<<l.blocks, kThreads, 0, g_stream>>>(a.f32(), b.f32(), out.f32(), l.cols);
    else row_dot_kernel<false><<<l.blocks, kThreads, 0, g_stream>>>(a.f32(), b.f32(), out.f32(), l.cols);
    K2C_CUDA_CHECK_LAUNCH();
  }
  void scale_rows(Tensor& x, const Tensor& s) override {
    const Matrix m = as_matrix(x);
    s.expect({m.rows}, "scale_rows scale");
    const RowLaunch l = row_launch(m.rows, m, {x.raw()});
    if (!l.blocks) return;
    if (l.vec) scale_rows_kernel<true><<<l.blocks, l.threads, 0, g_stream>>>(x.f32(), s.f32(), l.cols);
    else scale_rows_kernel<false><<<l.blocks, l.threads, 0, g_stream>>>(x.f32(), s.f32(), l.cols);
    K2C_CUDA_CHECK_LAUNCH();
  }
  // The router's bookkeeping stays on the device: E numbers cross to the host, not N·E.
  std::vector<double> column_sums(const Tensor& x) override {
    const Matrix m = as_matrix(x);
    std::vector<double> sums(static_cast<std::size_t>(m.cols), 0.0);
    if (m.cols == 0) return sums;
    K2C_CHECK(m.cols <= INT_MAX, "column_sums: " << m.cols << " columns");
    auto* d = static_cast<double*>(ws_.get(kRouting, sums.size() * sizeof(double)));
    column_sums_kernel<<<static_cast<unsigned>(m.cols), kThreads, 0, g_stream>>>(x.f32(), d, m.rows, m.cols);
    K2C_CUDA_CHECK_LAUNCH();
    K2C_CUDA_CHECK(cudaMemcpyAsync(sums.data(), d, sums.size() * sizeof(double), cudaMemcpyDeviceToHost, g_stream));
    wait_for_device();
    return sums;
  }
  void routing_grad(const Tensor& indices, const Tensor& values, std::span<const float> column_add,
                    Tensor& out) override {
    const Matrix m = checks::routing_grad_args(indices, values, column_add, out);
    if (out.numel() == 0) return;
    auto* add = static_cast<float*>(ws_.get(kRouting, column_add.size() * sizeof(float)));
    to_device(add, column_add.data(), column_add.size() * sizeof(float));
    launch(routing_grad_kernel, out.numel(), indices.i32(), values.f32(), add, out.f32(), m.rows, m.cols,
           static_cast<int>(indices.dim(1)), index_flag(kExperts));
  }

  // The plan on the device: E counts cross to the host (the grouped GEMMs' offsets), not the N·k
  // assignments, and the host has no N·k loop to run while the GPU waits. Three launches over
  // chunks of kPlanChunk assignments (route_counts_kernel), the E ints of shared memory each needs
  // bounding E (a plan for more experts runs on the host, as ops.h's default).
  std::vector<std::int64_t> route_rows(const Tensor& indices, const Tensor& values, int experts, bool normalize,
                                       Tensor& token_of_row, Tensor& row_of, Tensor& weight_of_row) override {
    const std::int64_t A = checks::route_rows_args(indices, values, experts, token_of_row, row_of, weight_of_row);
    // The kernels index in int: every index they form must fit.
    const std::int64_t chunks64 = (A + kPlanChunk - 1) / kPlanChunk;
    if (experts > 8192 || A > INT_MAX - kPlanChunk || chunks64 * experts > INT_MAX)
      return Ops::route_rows(indices, values, experts, normalize, token_of_row, row_of, weight_of_row);
    std::vector<std::int64_t> counts(static_cast<std::size_t>(experts), 0);
    if (A == 0) return counts;
    const int a = static_cast<int>(A), k = static_cast<int>(indices.dim(1)), chunks = static_cast<int>(chunks64);
    const std::size_t E = counts.size(), grid = static_cast<std::size_t>(chunks) * E, shared = E * sizeof(int);
    int* c = static_cast<int*>(ws_.get(kRouting, (E + 2 * grid) * sizeof(int)));  // counts, chunk counts, bases
    int *chunk_counts = c + E, *bases = c + E + grid;
    route_counts_kernel<<<chunks, kThreads, shared, g_stream>>>(indices.i32(), a, experts, chunk_counts,
                                                                index_flag(kPlanExperts));
    K2C_CUDA_CHECK_LAUNCH();
    route_bases_kernel<<<1, kThreads, shared, g_stream>>>(chunk_counts, chunks, experts, c, bases);
    K2C_CUDA_CHECK_LAUNCH();
    route_rows_kernel<<<chunks, 32, shared, g_stream>>>(indices.i32(), values.f32(), a, k, experts, normalize, bases,
                                                        token_of_row.i32(), row_of.i32(), weight_of_row.f32());
    K2C_CUDA_CHECK_LAUNCH();
    std::vector<int> host(E);
    K2C_CUDA_CHECK(cudaMemcpyAsync(host.data(), c, E * sizeof(int), cudaMemcpyDeviceToHost, g_stream));
    wait_for_device();
    std::copy(host.begin(), host.end(), counts.begin());
    return counts;
  }
  void route_rows_backward(const Tensor& values, const Tensor& row_of, const Tensor& dweight, bool normalize,
                           Tensor& dvalues) override {
    checks::route_rows_backward_args(values, row_of, dweight, dvalues);
    launch(route_rows_backward_kernel, values.dim(0), values.f32(), row_of.i32(), dweight.f32(), values.dim(0),
           static_cast<int>(values.dim(1)), normalize, dvalues.f32(), index_flag(kPlanRows));
  }

  void sgd_step(Tensor& param, const Tensor& grad, Tensor* momentum, float lr, float beta, float wd) override {
    same_shape(param, grad, "sgd");
    if (momentum) same_shape(param, *momentum, "sgd momentum");
    launch(sgd_kernel, param.numel(), param.f32(), grad.f32(), momentum ? momentum->f32() : nullptr, lr, beta, wd,
           param.numel());
  }
  void adamw_step(Tensor& param, const Tensor& grad, Tensor& m, Tensor& v, float lr, float b1, float b2, float eps,
                  float wd, int t) override {
    same_shape(param, grad, "adamw");
    same_shape(param, m, "adamw");
    same_shape(param, v, "adamw");
    if (t < 1) throw std::invalid_argument("adamw: step numbers start at 1");
    const float c1 = 1.0f - static_cast<float>(std::pow(b1, t)), c2 = 1.0f - static_cast<float>(std::pow(b2, t));
    const AdamWUpdate step{lr, b1, b2, eps, wd, c1, c2};
    const std::int64_t n = param.numel();
    if (vectorizable(n, {param.raw(), grad.raw(), m.raw(), v.raw()}))
      launch(adamw4_kernel, n / 4, f4(param), f4(grad), f4(m), f4(v), step, n / 4);
    else
      launch(adamw_kernel, n, param.f32(), grad.f32(), m.f32(), v.f32(), step, n);
  }

 private:
  // c (M×N, fp32 or bf16) = alpha·op(a)·op(b) + beta·c on bf16 operands (row-major, rows lda and
  // ldb long), fp32 accumulation; a bf16 c is rounded once, from the fp32 sums (and read in bf16
  // where beta is not 0). Row-major C is column-major Cᵀ = op(B)ᵀ·op(A)ᵀ: the operands swap places.
  void gemm16(const __nv_bfloat16* a, bool ta, std::int64_t lda, const __nv_bfloat16* b, bool tb, std::int64_t ldb,
              Tensor& c, std::int64_t M, std::int64_t N, std::int64_t K, float alpha, float beta) {
    K2C_CUBLAS_CHECK(cublasGemmEx(blas_, tb ? CUBLAS_OP_T : CUBLAS_OP_N, ta ? CUBLAS_OP_T : CUBLAS_OP_N,
                                  static_cast<int>(N), static_cast<int>(M), static_cast<int>(K), &alpha, b, CUDA_R_16BF,
                                  static_cast<int>(ldb), a, CUDA_R_16BF, static_cast<int>(lda), &beta, c.raw(),
                                  c.dtype() == DType::bf16 ? CUDA_R_16BF : CUDA_R_32F,
                                  static_cast<int>(N), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
  }
  // f with t's elements as float* or __nv_bfloat16*, whichever t holds.
  template <class F>
  static void with_dtype(const Tensor& t, F&& f) {
    if (t.dtype() == DType::bf16) f(ptr<__nv_bfloat16>(t));
    else f(ptr<float>(t));
  }
  // o = a + b over n elements: four a thread where the pointers allow.
  template <class A, class B, class O>
  void add_as(const A* a, const B* b, O* o, std::int64_t n) {
    if (vectorizable(n, {a, b, o})) launch(add4_kernel<A, B, O>, n / 4, a, b, o, n / 4);
    else launch(add_kernel<A, B, O>, n, a, b, o, n);
  }
  static float4* f4(const Tensor& t) { return reinterpret_cast<float4*>(const_cast<float*>(t.f32())); }
  static bool any_bf16(std::initializer_list<const Tensor*> ts) {
    for (const Tensor* t : ts)
      if (t && t->dtype() == DType::bf16) return true;
    return false;
  }
  static bool same_dtype(std::initializer_list<const Tensor*> ts) {
    for (const Tensor* t : ts)
      if (t->dtype() != (*ts.begin())->dtype()) return false;
    return true;
  }
  // A bf16 tensor where a kernel takes fp32 only: the call runs on an fp32 copy (widening is
  // exact), and store() rounds the copy of a tensor it wrote back, once, when the call is done.
  // An fp32 tensor is used as it is. The copies come from the device's cache, in stream order.
  enum class Use { in, out, in_out };  // read, written whole, read and written
  class Wide {
   public:
    Wide(CudaOps& ops, const Tensor& t, Use use = Use::in) : ops_(ops), t_(t), written_(use != Use::in) {
      if (t.dtype() != DType::bf16) return;
      copy_ = t.numel() ? Tensor(ops.device_, ops.copies_, Category::activations, t.shape())
                        : Tensor::view(&ops.empty_, t.shape());  // a view needs an address
      if (use != Use::out) ops.launch(widen_kernel, t.numel(), ptr<__nv_bfloat16>(t), copy_.f32(), t.numel());
    }
    Wide(const Wide&) = delete;
    Wide& operator=(const Wide&) = delete;
    operator Tensor&() { return copy_.empty() ? const_cast<Tensor&>(t_) : copy_; }
    void store() {
      if (written_ && !copy_.empty())
        ops_.launch(narrow_kernel, t_.numel(), copy_.f32(), ptr<__nv_bfloat16>(t_), t_.numel());
    }

   private:
    CudaOps& ops_;
    const Tensor& t_;
    bool written_;
    Tensor copy_;
  };
  template <class Kernel, class... Args>
  void launch(Kernel kernel, std::int64_t n, Args... args) {
    if (n <= 0) return;
    kernel<<<blocks_for(n), kThreads, 0, g_stream>>>(args...);
    K2C_CUDA_CHECK_LAUNCH();
  }
  // A row operation's activation is fp32 or bf16 (ops.h's [bf16]): its dtype, checked.
  static DType float_dtype(const Tensor& t, const char* what) {
    if (t.dtype() != DType::f32 && t.dtype() != DType::bf16)
      throw std::invalid_argument(std::string(what) + ": fp32 or bf16, not " + to_string(t.dtype()));
    return t.dtype();
  }
  // A row operation's launch: one block per row of `count`, threads enough for a row's columns
  // (four at a time with vec: the columns a multiple of 4 and every pointer 16-byte aligned, so
  // that every row starts aligned for 16 bytes of fp32 or 8 of bf16), all in 32-bit arithmetic.
  struct RowLaunch {
    unsigned blocks = 0, threads = 0;
    int cols = 0, bound = 0;  // bound: the rows an index may name
    bool vec = false;
  };
  static RowLaunch row_launch(std::int64_t count, const Matrix& m, std::initializer_list<const void*> pointers) {
    // A thread steps by 4·blockDim columns: the column index stays below INT_MAX.
    if (count > 2147483647 || m.cols > 2147483647 - 4 * kThreads || m.rows > 2147483647)
      throw std::invalid_argument("row operation: " + std::to_string(count) + " rows of " + std::to_string(m.cols) +
                                  " over " + std::to_string(m.rows) + " is past a launch's 32-bit indices");
    RowLaunch l;
    if (count == 0 || m.cols == 0) return l;
    l.vec = vectorizable(m.cols, pointers);
    const std::int64_t lanes = l.vec ? m.cols / 4 : m.cols;
    l.blocks = static_cast<unsigned>(count);
    l.threads = static_cast<unsigned>(std::min<std::int64_t>(kThreads, (lanes + 31) / 32 * 32));
    l.cols = static_cast<int>(m.cols), l.bound = static_cast<int>(m.rows);
    return l;
  }
  static unsigned rows_grid(std::int64_t rows) {
    if (rows > 2147483647) throw std::invalid_argument("too many rows for one launch");
    return static_cast<unsigned>(rows);
  }
  static AttnArgs args(const AttentionShape& s) {
    return {s.batch, s.q_len, s.kv_len, s.q_heads, s.kv_heads, s.head_dim, s.causal, s.q_offset, s.kv_offset,
            1.0f / std::sqrt(static_cast<float>(s.head_dim))};
  }
  // The scores of one query row, rounded up to whole 16-byte vectors: the compiler may read the
  // row's tail a vector at a time (compute-sanitizer saw a 12-byte read cross the end of 70 keys).
  static std::size_t score_bytes(const AttentionShape& s) {
    const std::size_t bytes = (static_cast<std::size_t>(s.kv_len) + 3) / 4 * 4 * sizeof(float);
    if (bytes > 48 * 1024)
      throw std::invalid_argument("attention (first GPU version): at most 12288 keys a call, got " + std::to_string(s.kv_len));
    return bytes;
  }

  // The caller may reuse `host` at once: a small copy goes through pinned memory and reaches the
  // device in stream order, without a wait (the MoE layer uploads its routing every layer); a large
  // one waits for its copy.
  void to_device(void* dst, const void* host, std::size_t bytes) {
    if (Staging::fits(bytes)) return staging_.to_device(dst, host, bytes);
    K2C_CUDA_CHECK(cudaMemcpyAsync(dst, host, bytes, cudaMemcpyHostToDevice, g_stream));
    K2C_CUDA_CHECK(cudaStreamSynchronize(g_stream));
  }

  GpuMath math_;
  DeviceMemory device_;
  cublasHandle_t blas_{};
  Workspace ws_;  // bf16 operands, score blocks, pointer arrays, per-row losses
  BlockedAttention attention_{blas_, ws_};  // head_dim a multiple of 8
  FlashAttention flash_{ws_};                // head_dim 64 or 128
  MemoryLedger copies_;    // Wide's fp32 copies (scratch, outside the model's ledger)
  float empty_ = 0;       // the address of an empty copy
  Staging staging_;
  double* sum_ = nullptr;
};

}  // namespace

bool cuda_device_present() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
}

Ops& cuda_ops(GpuMath math) {
  if (math == GpuMath::fp32) {
    static CudaOps ops(GpuMath::fp32);
    return ops;
  }
  static CudaOps ops(GpuMath::bf16);
  return ops;
}

void cuda_ops_use_stream(void* stream) {
  // Work queued on the old stream must be done before the new one can reuse the memory it used
  // (the allocator's cache and the workspace rely on stream order, and two streams have none).
  if (g_stream != static_cast<cudaStream_t>(stream)) K2C_CUDA_CHECK(cudaStreamSynchronize(g_stream));
  g_stream = static_cast<cudaStream_t>(stream);
}

void* cuda_ops_stream() { return g_stream; }

void cuda_ops_synchronize() { wait_for_device(); }

namespace {
class CudaQueueMarks final : public QueueMarks {
 public:
  ~CudaQueueMarks() override {
    for (cudaEvent_t e : events_) cudaEventDestroy(e);  // no throwing from a destructor
  }
  int mark() override {
    if (used_ == events_.size()) {
      cudaEvent_t e = nullptr;
      K2C_CUDA_CHECK(cudaEventCreate(&e));
      events_.push_back(e);
    }
    K2C_CUDA_CHECK(cudaEventRecord(events_[used_], g_stream));
    return static_cast<int>(used_++);
  }
  double seconds(int from, int to) override {
    K2C_CHECK(from >= 0 && to >= 0 && static_cast<std::size_t>(std::max(from, to)) < used_, "no such mark");
    K2C_CUDA_CHECK(cudaEventSynchronize(events_[to]));
    float ms = 0;
    K2C_CUDA_CHECK(cudaEventElapsedTime(&ms, events_[from], events_[to]));
    return ms * 1e-3;
  }
  void reset() override { used_ = 0; }

 private:
  std::vector<cudaEvent_t> events_;
  std::size_t used_ = 0;
};
}  // namespace

std::unique_ptr<QueueMarks> cuda_queue_marks() { return std::make_unique<CudaQueueMarks>(); }

}  // namespace k2c::model
