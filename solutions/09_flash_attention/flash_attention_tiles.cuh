// solutions/09_flash_attention/flash_attention_tiles.cuh — module 09's reference, part 1 of 4:
// the pieces every kernel builds on. Swizzled shared-memory tiles and their cp.async loads, the
// mma.sync fragment loads, the step that turns accumulators into the next product's A operand,
// the causal mask, the kernels' Params, and the order in which blocks start (launch_place).
// Included by flash_attention.cu only, inside its unnamed namespace, after that file's
// using-declarations and fast_exp2; the forward pass (flash_attention_forward.cuh) follows.
#pragma once

// ---- shared-memory tiles ---------------------------------------------------------------------
//
// A tile is `rows` rows of W bf16 (W = 64 or 128: 128 or 256 bytes), stored as 16-byte chunks
// with chunk c of row r at position c ^ (r % 8). ldmatrix reads one chunk column of 8 rows at a
// time; the XOR spreads those 8 chunks over all 32 banks, so every ldmatrix and every cp.async
// store is conflict-free (lecture 05, the swizzle section).
template <int W>
__device__ __forceinline__ std::uint32_t swizzled(std::uint32_t tile, int row, int chunk) {
  static_assert(W % 64 == 0, "a row must hold at least 8 chunks for the XOR to stay inside it");
  return tile + row * (W * 2) + ((chunk ^ (row & 7)) << 4);
}

// Copies rows [0, ROWS) of a W-wide bf16 tile starting at `src`, `ld` elements from one row to the
// next (W, or more in the tokens_first layout), into shared memory, chunk c of
// row r to the address at(r, c) (the layout: load_tile's below, or the Hopper kernels' 128-byte
// blocks, load_tile_sw128); rows >= valid_rows are zero filled. All THREADS threads of the block
// take part; src must point at a real row. Thread t copies chunk t % (W/8) of rows t / (W/8) +
// i·kRowStep: a trip count known at compile time, so the loop unrolls into straight cp.async with
// immediate offsets (a loop counted from t, as in `for (i = t; i < n; i += THREADS)`, compiles to
// a rolled loop with remainder branches, hundreds of instructions per tile that every warp issues
// on its way to the tensor cores), and with kRowStep a multiple of 8 the swizzle's XOR is the same
// for each of a thread's rows.
template <int ROWS, int W, int THREADS, class At>
__device__ __forceinline__ void copy_rows(const bf16* src, std::size_t ld, int valid_rows, int tid, At&& at) {
  constexpr int kChunks = W / 8, kRowStep = THREADS / kChunks;
  static_assert(THREADS % kChunks == 0 && ROWS % kRowStep == 0, "every thread copies the same chunks");
  const int r0 = tid / kChunks, c = tid % kChunks;
#pragma unroll
  for (int i = 0; i < ROWS / kRowStep; ++i) {
    const int r = r0 + i * kRowStep;
    const bool ok = r < valid_rows;
    cp_async_16(at(r, c), ok ? src + r * ld + c * 8 : src, ok);
  }
}

// copy_rows into the swizzled tile above.
template <int ROWS, int W, int THREADS>
__device__ __forceinline__ void load_tile(std::uint32_t tile, const bf16* src, std::size_t ld, int valid_rows, int tid) {
  copy_rows<ROWS, W, THREADS>(src, ld, valid_rows, tid, [tile](int r, int c) { return swizzled<W>(tile, r, c); });
}

// The A fragment (16 rows × 16 columns) at (row0, col0) of a row-major tile, by one ldmatrix.x4.
template <int W>
__device__ __forceinline__ void load_a(std::uint32_t (&a)[4], std::uint32_t tile, int row0, int col0, int lane) {
  ldmatrix_x4(a, swizzled<W>(tile, row0 + (lane & 15), col0 / 8 + (lane >> 4)));
}

// Two B fragments (k16 × n8 each, n-tiles n0 and n0 + 8) when the tile stores B transposed, rows
// = n and columns = k (K in Q·Kᵀ: keys × head_dim). b[0..1] is n-tile n0, b[2..3] n-tile n0 + 8.
template <int W>
__device__ __forceinline__ void load_b_nk(std::uint32_t (&b)[4], std::uint32_t tile, int n0, int k0, int lane) {
  ldmatrix_x4(b, swizzled<W>(tile, n0 + (lane & 7) + ((lane >> 4) << 3), k0 / 8 + ((lane >> 3) & 1)));
}

// The same when the tile stores B as it is, rows = k and columns = n (V in P·V: keys × head_dim):
// the .trans load turns each 8×8 piece around on the way.
template <int W>
__device__ __forceinline__ void load_b_kn(std::uint32_t (&b)[4], std::uint32_t tile, int k0, int n0, int lane) {
  ldmatrix_x4_trans(b, swizzled<W>(tile, k0 + (lane & 7) + (((lane >> 3) & 1) << 3), n0 / 8 + (lane >> 4)));
}

// Accumulator → operand. The fp32 accumulators of two neighbouring n8 tiles (columns 16k..16k+15
// of a 16-row strip) hold, per thread, exactly the elements that the A fragment of k step k
// needs: rounding them to bf16 pairs is all it takes to feed P (or dS) straight back into the
// tensor cores, without a trip through shared memory (lecture, section 4).
__device__ __forceinline__ void accumulators_to_a(std::uint32_t (&a)[4], const float (&lo)[4], const float (&hi)[4]) {
  a[0] = pack_bf16x2(lo[0], lo[1]);
  a[1] = pack_bf16x2(lo[2], lo[3]);
  a[2] = pack_bf16x2(hi[0], hi[1]);
  a[3] = pack_bf16x2(hi[2], hi[3]);
}

__device__ __forceinline__ void mma(float (&d)[4], const std::uint32_t (&a)[4], std::uint32_t b0, std::uint32_t b1) {
  const std::uint32_t b[2] = {b0, b1};
  mma_bf16_16816(d, a, b);
}

// Where thread `lane` sits in an accumulator: rows lane/4 and lane/4 + 8, columns 2·(lane%4) + {0, 1}.
__device__ __forceinline__ int acc_row(int lane, int half) { return (lane >> 2) + 8 * half; }
__device__ __forceinline__ int acc_col(int lane) { return 2 * (lane & 3); }

// The value itself, through a volatile asm statement that the compiler's optimiser may neither
// move nor look through: what a loop computes from it is not hoisted out of the loop and held in
// registers across it. (ptxas sees a plain move; that the effect survives is checked in
// ptxas -v's register and spill counts, lecture section 10.6.)
__device__ __forceinline__ std::uint64_t opaque(std::uint64_t v) {
  asm volatile("mov.b64 %0, %0;" : "+l"(v));
  return v;
}

// Key j is visible to query i (causal, bottom-right aligned) when j <= i + offset, where
// offset = kv_len - q_len.
struct Mask {
  int kv_len;
  int offset;
  bool causal;
  __device__ __forceinline__ bool hidden(int query, int key) const {
    return key >= kv_len || (causal && key > query + offset);
  }
};

struct Params {
  const bf16 *q, *k, *v, *o, *dout;
  bf16 *out, *dq, *dk, *dv;
  const float* lse_in;
  float *lse_out, *dot, *dq_accum;
  int heads, kv_heads, group, q_len, kv_len;
  int wave_heads;  // heads started together (launch_place); 0 or less: SMs × the tile's blocks per SM / blocks per head
  float scale, scale_log2;
  bool causal;
  bool tokens_first;  // the bf16 tensors' layout, for the host to pick the kernels' kTokens
  // Rows are counted heads first, as lse is laid out: head (b, h) of q-shaped tensors owns rows
  // q_rows(b, h) + [0, q_len), kv head (b, g) of kv-shaped ones kv_rows(b, g) + [0, kv_len).
  __device__ std::size_t q_rows(int b, int h) const { return (static_cast<std::size_t>(b) * heads + h) * q_len; }
  __device__ std::size_t kv_rows(int b, int g) const { return (static_cast<std::size_t>(b) * kv_heads + g) * kv_len; }
  // Where such a row starts in the bf16 tensors (rows of D elements), and how far apart one head's
  // consecutive rows lie, in elements. Heads first (kTokens false): row r at r · D, rows D apart.
  // Tokens first: row i of head h of batch b at ((b · len + i) · heads + h) · D, rows heads · D
  // apart. A tile of one head's rows is then a start and a stride. The layout is a template
  // argument, not a run-time one: heads first, both are then constants, as in a kernel written for
  // that layout alone (a run-time stride cost the D = 128 kernels registers and spills).
  template <int D, bool kTokens>
  __device__ std::size_t q_at(std::size_t row) const { return at<D, kTokens>(row, q_len, heads); }
  template <int D, bool kTokens>
  __device__ std::size_t kv_at(std::size_t row) const { return at<D, kTokens>(row, kv_len, kv_heads); }
  template <int D, bool kTokens>
  __device__ std::size_t q_ld() const { return kTokens ? std::size_t(heads) * D : D; }
  template <int D, bool kTokens>
  __device__ std::size_t kv_ld() const { return kTokens ? std::size_t(kv_heads) * D : D; }

 private:
  template <int D, bool kTokens>
  __device__ std::size_t at(std::size_t row, int len, int n_heads) const {
    if (!kTokens || len == 0) return row * D;  // (no rows: nothing is read there)
    const std::size_t head = row / len, i = row % len;  // head = b · n_heads + h
    return ((head / n_heads * len + i) * n_heads + head % n_heads) * D;
  }
};

// Where a block sits, in launch order. The GPU starts blocks in order of their linear index and
// holds about wave_heads heads' worth at once, so the heads (with their batch) go in sets of
// wave_heads, and inside a set the heaviest blocks start first: under the causal mask a query
// block near the end and a key block near the start do the most work. The last blocks to start,
// which decide how long the grid's tail is, are then the light ones of the last set, while the
// K and V of the heads in flight still fit in L2. `rank` 0 is the heaviest block of its head;
// with heads as the outer loop only the last head's heavy blocks would start late and run on
// alone (lecture section 6.3).
// tile_place is the same order for tile `at` of `blocks` blocks per head and `pairs` (head,
// batch) pairs, for a persistent kernel that walks the tiles in launch order itself.
__device__ __forceinline__ void tile_place(long long at, long long blocks, int heads, long long pairs, int wave_heads,
                                           int& rank, int& h, int& b) {
  const long long set = at / (wave_heads * blocks), in_set = at % (wave_heads * blocks);
  const long long size = min(static_cast<long long>(wave_heads), pairs - set * wave_heads);
  const long long pair = set * wave_heads + in_set % size;
  rank = static_cast<int>(in_set / size);
  h = static_cast<int>(pair % heads);
  b = static_cast<int>(pair / heads);
}
// The block's linear index in launch order (x fastest, then y, then z).
__device__ __forceinline__ long long launch_index() {
  return blockIdx.x + static_cast<long long>(gridDim.x) * (blockIdx.y + static_cast<long long>(gridDim.y) * blockIdx.z);
}
__device__ __forceinline__ void launch_place(int wave_heads, int& rank, int& h, int& b) {
  const long long pairs = static_cast<long long>(gridDim.y) * gridDim.z;
  tile_place(launch_index(), gridDim.x, static_cast<int>(gridDim.y), pairs, wave_heads, rank, h, b);
}
