// decode_kernel.h — module 19, Part G: decode attention as one CUDA kernel over a paged bf16
// cache, read where it lies.
//
// Part B computes decode attention through the model library's operations, which serve every
// backend but cannot read a paged cache in place: on the GPU its pages are first gathered into a
// contiguous copy, and the step runs at a few percent of the memory's speed. Decode is bound by
// the bytes of cache it reads, so the one thing that matters is reading each byte once, at full
// bandwidth. This part is that kernel, the way serving engines write it (FlashDecoding's split of
// the cache, vLLM's pages): every (sequence, KV head, part of the cache) is a block of work, and
// a second, small kernel merges the parts by their log-sum-exps.
//
// Built only where the CUDA toolkit is (decode_kernel.cu); its tests run on a GPU, on one rank.
// Tests: autograder/19_inference/test_inference_kernel.cu. Lecture: lectures/19_inference.md,
// "A decode kernel that reads at the speed of memory".
#pragma once

#include <cstddef>

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

namespace k2c::inference {

using bf16 = __nv_bfloat16;

// The shape of one decode step. head_dim is 64 or 128; q_heads is a multiple of kv_heads with at
// most 8 query heads per KV head (GQA groups up to 8; MHA is a group of 1). page_size is any
// value >= 1. max_length bounds every sequence's length (the grid is sized from it).
struct DecodeShape {
  int batch = 1;        // sequences, one new query each, >= 1
  int q_heads = 1;
  int kv_heads = 1;
  int head_dim = 128;
  int page_size = 16;
  int max_pages = 1;    // columns of the page table: pages of the longest sequence, >= 1
  int max_length = 1;   // >= every lengths[b], >= 1, <= max_pages·page_size
};

// Device pointers of one decode step, each 16-byte aligned (cudaMalloc's are).
//
// The cache's layout on the GPU: page p of the pool holds, for each KV head h, page_size rows of
// head_dim values, one per token, contiguous:
//     k_pool[((p·kv_heads + h)·page_size + i)·head_dim + d]     (token i of page p, head h)
// so a block that reads one head of a page streams page_size·head_dim·2 contiguous bytes. (Part
// A's CPU pool interleaves the heads of each token in one row; on the GPU the heads are kept
// apart because a block of the kernel reads one head.) v_pool likewise.
// Token t of sequence b is in page page_table[b·max_pages + t / page_size], at row t % page_size.
// The pool holds fewer than 2^31 rows (pages·kv_heads·page_size), so a row index fits an int.
struct DecodeArgs {
  const bf16* q = nullptr;        // [batch, q_heads, head_dim], RoPE applied
  const bf16* k_pool = nullptr;
  const bf16* v_pool = nullptr;
  const int* page_table = nullptr;  // [batch, max_pages]; entries past a sequence's pages unused
  const int* lengths = nullptr;     // [batch], each in [1, max_length]
  bf16* o = nullptr;              // [batch, q_heads, head_dim], overwritten
};

// Bytes of device scratch space decode_attention_paged needs for this shape (the parts' outputs
// and log-sum-exps, however you split the cache; 0 if none). Throws std::invalid_argument,
// naming the field, for a shape outside the contract above.
std::size_t decode_workspace_bytes(const DecodeShape& shape);

// o[b, h] = softmax(q[b, h]·Kᵀ/sqrt(head_dim))·V over the positions [0, lengths[b]) of sequence
// b, query head h reading KV head h / (q_heads / kv_heads); no mask (the new query is the latest
// position). Accumulation in fp32, o rounded to bf16 once. workspace: at least
// decode_workspace_bytes(shape) bytes of device memory (nothing in it is assumed). Asynchronous
// on `stream`; launch errors are thrown as std::runtime_error; shape errors as from
// decode_workspace_bytes.
void decode_attention_paged(const DecodeShape& shape, const DecodeArgs& args, void* workspace,
                            cudaStream_t stream = nullptr);

}  // namespace k2c::inference
