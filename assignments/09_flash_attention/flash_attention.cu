// assignments/09_flash_attention/flash_attention.cu — module 09: your implementation (contract:
// flash_attention.h).
//
// Read lectures/09_flash_attention.md first. Suggested order: naive_forward (task 1), forward
// (task 2), backward (task 3), and for bonus points forward_hopper and backward_hopper (Part B).
// k2c/device/tensor_core.cuh holds module 05's wrappers for cp.async, ldmatrix and mma.sync:
// include it and build on them.
#include <cstdint>
#include <string>

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "flash_attention.h"
#include "k2c/core/check.h"
#include "k2c/core/todo.h"
#include "k2c/device/hopper.cuh"

namespace k2c::flash_attention {

void naive_forward(const Shape& s, const bf16* q, const bf16* k, const bf16* v, bf16* o, float* lse,
                   void* workspace, cudaStream_t stream) {
  check_shape(s, "flash_attention naive_forward");
  K2C_CHECK(s.layout == Layout::heads_first, "flash_attention naive_forward: takes the heads_first layout only");
  if (s.batch == 0 || s.heads == 0 || s.q_len == 0) return;
  check_pointers("flash_attention naive_forward", {q, o, lse});
  if (s.kv_len > 0) check_pointers("flash_attention naive_forward", {k, v, workspace});
  (void)stream;
  K2C_TODO("naive_forward: S = scale·Q Kᵀ into the workspace (−inf where masked), softmax each row "
           "in place and write lse, then O = P V");
}

void forward(const Shape& s, const bf16* q, const bf16* k, const bf16* v, bf16* o, float* lse,
             cudaStream_t stream) {
  check_shape(s, "flash_attention forward");
  if (s.batch == 0 || s.heads == 0 || s.q_len == 0) return;
  check_pointers("flash_attention forward", {q, o, lse});
  if (s.kv_len > 0) check_pointers("flash_attention forward", {k, v});
  (void)stream;
  K2C_TODO("forward: a block per query tile, K and V tiles streamed through shared memory, the "
           "online softmax in registers, O and lse written once");
}

// Part B (bonus). This file is compiled for sm_90a where the build targets sm_90: wgmma is then
// available inside `#if defined(__CUDA_ARCH_FEAT_SM90_ALL)` (k2c/device/hopper.cuh wraps the wgmma
// shapes attention needs, their shared-memory descriptors and the proxy fence). Given:
// hopper_supported() and the checks of forward_hopper().
bool hopper_supported(std::string* why_not) { return k2c::hopper::sm90a_supported(why_not); }

void forward_hopper(const Shape& s, const bf16* q, const bf16* k, const bf16* v, bf16* o, float* lse,
                    cudaStream_t stream) {
  check_shape(s, "flash_attention forward_hopper");
  if (s.batch == 0 || s.heads == 0 || s.q_len == 0) return;
  check_pointers("flash_attention forward_hopper", {q, o, lse});
  if (s.kv_len > 0) check_pointers("flash_attention forward_hopper", {k, v});
  k2c::hopper::require_sm90a("flash_attention forward_hopper");
  (void)stream;
  K2C_TODO("forward_hopper: a warpgroup per 64 query rows, S = Q Kᵀ and O += P V on wgmma with Q, K "
           "and V in 128-byte-swizzled shared memory");
}

std::size_t backward_workspace_bytes(const Shape& s) {
  check_shape(s, "flash_attention backward_workspace_bytes");
  K2C_TODO("backward_workspace_bytes: room for D = rowsum(dout ∘ o) and an fp32 dq");
}

void backward(const Shape& s, const bf16* q, const bf16* k, const bf16* v, const bf16* o,
              const bf16* dout, const float* lse, bf16* dq, bf16* dk, bf16* dv, void* workspace,
              cudaStream_t stream) {
  check_shape(s, "flash_attention backward");
  if (s.batch == 0 || s.heads == 0 || s.q_len == 0) {
    K2C_TODO("backward with no queries: dk and dv (when kv_len > 0) must still be written, as zeros");
  }
  check_pointers("flash_attention backward", {q, o, dout, lse, dq, workspace});
  if (s.kv_len > 0) check_pointers("flash_attention backward", {k, v, dk, dv});
  (void)stream;
  K2C_TODO("backward: D = rowsum(dout ∘ o), then a block per key tile recomputing P from lse, "
           "dK and dV in registers, dQ added into fp32; then dq = bf16(scale · that)");
}

// Part B (bonus), like forward_hopper(): given the checks.
void backward_hopper(const Shape& s, const bf16* q, const bf16* k, const bf16* v, const bf16* o,
                     const bf16* dout, const float* lse, bf16* dq, bf16* dk, bf16* dv, void* workspace,
                     cudaStream_t stream) {
  check_shape(s, "flash_attention backward_hopper");
  if (s.batch == 0 || s.heads == 0 || s.q_len == 0) {
    K2C_TODO("backward_hopper with no queries: dk and dv (when kv_len > 0) must still be written, as zeros");
  }
  check_pointers("flash_attention backward_hopper", {q, o, dout, lse, dq, workspace});
  if (s.kv_len > 0) check_pointers("flash_attention backward_hopper", {k, v, dk, dv});
  k2c::hopper::require_sm90a("flash_attention backward_hopper");
  (void)stream;
  K2C_TODO("backward_hopper: two warpgroups of 64 keys each; Sᵀ and dPᵀ on wgmma from shared memory, Pᵀ "
           "and dSᵀ as register A operands of dV and dK, dSᵀ through shared memory for dQ");
}

}  // namespace k2c::flash_attention
