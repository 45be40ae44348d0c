// assignments/19_inference/inference.cpp — module 19, parts A–D: your implementation (contract:
// inference.h; parts E–F go in serving.cpp). Read lectures/19_inference.md first.
//
// Work in the order of the parts: the cache (its bookkeeping is all host integers; only write()
// touches tensors), decode attention (index lists on the host, a few gathers, attention calls and
// a merge on the device), the engine (model::Block's forward with attention swapped), then MLA.
// common/model/src/layers.cpp and block.cpp are the forward pass you reproduce step for step;
// ops.h lists every operation you may call. Run one test at a time first:
//   build/assignments/bin/k2c run -np 1 --backend mpi build/assignments/bin/k2c_test_19_inference \
//     --gtest_filter='Inference.Cache*'
#include "inference.h"
#include "k2c/core/todo.h"

namespace k2c::inference {

// =============================================================================================
// Part A: the paged KV cache
//
// Keep the free pages so that the lowest number comes out first (a min-heap, or a sorted list);
// `reserved_` counts pages promised to live sequences and not yet taken. A pool of one layer is
// one ctx.tensor; a page is a range of its rows (Tensor::rows), so write() is one ctx.ops.copy per
// run of slots that stay inside one page.

PagedKvCache::PagedKvCache(Context& ctx, const CacheConfig& config) : config_(config) {
  (void)ctx;
  K2C_TODO("PagedKvCache: check the config, allocate the pools, fill the free list");
}

std::int64_t PagedKvCache::bytes_per_token() const { K2C_TODO("PagedKvCache::bytes_per_token: the formula"); }

std::int64_t PagedKvCache::bytes() const { K2C_TODO("PagedKvCache::bytes: pages · page_size · bytes per token"); }

int PagedKvCache::create(std::int64_t max_tokens) {
  (void)max_tokens;
  K2C_TODO("PagedKvCache::create: reserve pages_for(max_tokens) pages, or std::length_error");
}

void PagedKvCache::extend(int seq, std::int64_t count) {
  (void)seq, (void)count;
  K2C_TODO("PagedKvCache::extend: grow the length, take pages as it crosses into them");
}

void PagedKvCache::release(int seq) {
  (void)seq;
  K2C_TODO("PagedKvCache::release: pages back to the free list, reservation dropped");
}

bool PagedKvCache::contains(int seq) const {
  (void)seq;
  K2C_TODO("PagedKvCache::contains");
}

std::int64_t PagedKvCache::length(int seq) const {
  (void)seq;
  K2C_TODO("PagedKvCache::length");
}

std::int64_t PagedKvCache::capacity(int seq) const {
  (void)seq;
  K2C_TODO("PagedKvCache::capacity");
}

const std::vector<int>& PagedKvCache::page_table(int seq) const {
  (void)seq;
  K2C_TODO("PagedKvCache::page_table");
}

std::int64_t PagedKvCache::slot(int seq, std::int64_t position) const {
  (void)seq, (void)position;
  K2C_TODO("PagedKvCache::slot: page_table[t / page_size] · page_size + t % page_size");
}

int PagedKvCache::free_pages() const { K2C_TODO("PagedKvCache::free_pages: neither held nor reserved"); }

int PagedKvCache::used_pages() const { K2C_TODO("PagedKvCache::used_pages"); }

int PagedKvCache::sequences() const { K2C_TODO("PagedKvCache::sequences"); }

void PagedKvCache::write(Context& ctx, int layer, int seq, std::int64_t first, const Tensor& k, const Tensor& v) {
  (void)ctx, (void)layer, (void)seq, (void)first, (void)k, (void)v;
  K2C_TODO("PagedKvCache::write: one copy per run of slots inside a page, keys and values");
}

const Tensor& PagedKvCache::keys(int layer) const {
  (void)layer;
  K2C_TODO("PagedKvCache::keys");
}

const Tensor& PagedKvCache::values(int layer) const {
  (void)layer;
  K2C_TODO("PagedKvCache::values: the keys themselves with shared_values");
}

// =============================================================================================
// Part B: decode attention
//
// A plan that works: list the parts (sequence, first position, length) on the host; gather each
// part's keys and values out of the pool into one tensor (gather_rows with the rows' slots: a pool
// [rows, kv_heads·hd] seen as [rows·kv_heads, hd] has one head of one slot per row); gather each
// part's query; run attention_forward on the parts (those of the same length can share one call:
// `batch` counts them); then merge. The merge needs exp(lse_j − lse) per part and head, which is
// exactly softmax_rows over a row of the part lse's of one (sequence, head), padded with −inf
// where a sequence has fewer parts; scatter_add_rows with those weights as `scale` sums the
// parts' outputs into o (filled with 0 first). Lecture, section 3.

void decode_attention(Context& ctx, const PagedKvCache& cache, int layer, const std::vector<int>& seqs,
                      const Tensor& q, Tensor& o, int split_tokens) {
  (void)ctx, (void)cache, (void)layer, (void)seqs, (void)q, (void)o, (void)split_tokens;
  K2C_TODO("decode_attention: parts, gathers, attention of every part, merge by log-sum-exp");
}

// =============================================================================================
// Part C: the engine
//
// Look the parameters up once (find_param, names in the contract). A step: embedding, then per
// layer RMSNorm, q k v projections (matmul with the weight transposed), RoPE with one position
// per row, the cache writes, attention, the output projection, the residual, RMSNorm, SwiGLU, the
// residual; at the end the final norm and the head on the rows whose next token is wanted, and
// top_k(1) for the tokens. Use the same operations in the same order as model::Block, or the
// bit-for-bit test against the recomputation fails.

Engine::Engine(Context& ctx, const ModelConfig& model, int pages, int page_size, int split_tokens)
    : ctx_(&ctx), model_(model), split_tokens_(split_tokens) {
  (void)pages, (void)page_size;
  K2C_TODO("Engine: check the model, find its parameters, make the cache");
}

Step Engine::prefill(const std::vector<int>& seqs, const std::vector<std::vector<std::int32_t>>& prompts) {
  (void)seqs, (void)prompts;
  K2C_TODO("Engine::prefill: every prompt's rows through the blocks, each prompt attending to itself");
}

Step Engine::decode(const std::vector<int>& seqs, const std::vector<std::int32_t>& tokens) {
  (void)seqs, (void)tokens;
  K2C_TODO("Engine::decode: one row per sequence, attention over its cache");
}

// =============================================================================================
// Part D: multi-head latent attention
//
// The library's attention wants every head's query, key and value as one block of a row; MLA
// computes them in pieces (latent part, rotated part; a rotated key shared by all heads). A
// gather of rows can put pieces side by side: seen as rows of u numbers (u dividing every
// piece's width), the pieces stacked in one tensor, gathered in the order of the output's units.
// The absorbed weights are products of weight slices (matmul with transposes); the library has no
// transpose of its own, but a product with the identity matrix is one.

Mla::Mla(ParamList& params, const std::string& name, const MlaConfig& config) : config_(config) {
  (void)params, (void)name;
  K2C_TODO("Mla: check the config, register the seven weights in the contract's order");
}

CacheConfig Mla::cache_config(int pages, int page_size) const {
  (void)pages, (void)page_size;
  K2C_TODO("Mla::cache_config: one layer, one head of latent_dim + rope_dim, shared values");
}

void Mla::forward(Context& ctx, const Tensor& x, Tensor& y) const {
  (void)ctx, (void)x, (void)y;
  K2C_TODO("Mla::forward: per-head keys and values from the latent, causal attention, output");
}

void Mla::prefill(Context& ctx, PagedKvCache& cache, int seq, const Tensor& x, Tensor& y) const {
  (void)ctx, (void)cache, (void)seq, (void)x, (void)y;
  K2C_TODO("Mla::prefill: forward, and the latent entries [c ; kr] of every position into the cache");
}

void Mla::absorb(Context& ctx) {
  (void)ctx;
  K2C_TODO("Mla::absorb: fold W_uk into the query, W_uv into the output, mind the scale");
}

void Mla::decode(Context& ctx, PagedKvCache& cache, const std::vector<int>& seqs, const Tensor& x, Tensor& y,
                 int split_tokens) const {
  (void)ctx, (void)cache, (void)seqs, (void)x, (void)y, (void)split_tokens;
  K2C_TODO("Mla::decode: the new latent entries, the absorbed query, decode_attention, the folded output");
}

}  // namespace k2c::inference
