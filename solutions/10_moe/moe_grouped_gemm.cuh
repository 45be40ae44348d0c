// solutions/10_moe/moe_grouped_gemm.cuh — module 10's reference, part 3 of 4: the grouped GEMM on
// mma.sync, which every product of the layer goes through: grouped_kernel in its two modes (groups
// split the rows, or the reduction for dW) and both operand layouts, and the host code that picks
// a variant and launches it persistently. Included by moe.cu only, inside its unnamed namespace,
// after the memory-bound kernels (moe_permute.cuh); moe.cu then closes the namespace and defines
// the contract's entry points, before Part B (moe_hopper.cuh).
#pragma once

// ================================================================================================
// The grouped GEMM
// ================================================================================================

// In GEMM terms every variant computes C[m][n] = Σ_r A(m, r) · B(n, r), per group:
//   Mode::rows       groups split the rows of A and C (forward and dX); r runs over k.
//   Mode::reduction  groups split r (dW): C_g is [m][n] = [dY's width][X's width].
// An operand is K-contiguous (r fastest in memory) or MN-contiguous (m or n fastest).
enum class Mode { rows, reduction };

template <class OutT>
struct GemmArgs {
  int groups;
  const int* offsets;
  int m, n, k;  // m: reduction mode only (rows mode takes each group's rows from offsets)
  const bf16* a;
  const bf16* b;
  OutT* c;
  bool accumulate, pairs;
};

template <int BM_, int BN_, int WARPS_M_, int WARPS_N_, int STAGES_, int BLOCKS_PER_SM_>
struct Tile {
  static constexpr int BM = BM_, BN = BN_, BK = 64, WARPS_M = WARPS_M_, WARPS_N = WARPS_N_, STAGES = STAGES_;
  static constexpr int kBlocksPerSm = BLOCKS_PER_SM_;
  static constexpr int kThreads = 32 * WARPS_M * WARPS_N;
  static constexpr int WM = BM / WARPS_M, WN = BN / WARPS_N, MT = WM / 16, NT = WN / 8;
  static constexpr int kTileA = BM * BK * 2, kTileB = BN * BK * 2, kStageBytes = kTileA + kTileB;
  static constexpr int kSmemBytes = STAGES * kStageBytes;
  static_assert(WM % 16 == 0 && WN % 16 == 0 && BM >= 64 && BN >= 64, "whole mma tiles; swizzled rows of 128 bytes or more");
  static_assert(kBlocksPerSm * (kSmemBytes + 4 * (kMaxExperts + 1)) <= 227 * 1024,
                "stages and the tile prefix fit in shared memory");
};

// 128×256 with 8 warps of 64×64, 4 stages, one block per SM. Measured on an H200 at the module's
// up projection (lab/moe_grouped.cu): 328.9 TFLOP/s; module 05's 256×128 313.1;
// 128×128 with 4 warps and 2 blocks per SM 320.4; with 8 warps 294.5; 256×128 with 3 stages 316.8.
using Reference = Tile<128, 256, 2, 4, 4, 1>;

// Byte offset of 16-byte chunk `chunk` of row `row`, rows of `row_bytes` (a multiple of 128):
// chunk c of row r lives at c ^ (r % 8), so 8 consecutive rows read at one chunk hit 8 different
// 16-byte bank groups: ldmatrix (8 rows, one chunk) is conflict-free in both tile shapes.
template <int kRowBytes>
__device__ __forceinline__ std::uint32_t swz(int row, int chunk) {
  return row * kRowBytes + ((chunk ^ (row & 7)) << 4);
}

// One 16-byte chunk of a tile: the 8 elements src[row · ld + col ..], zeros where the row is
// outside (row_ok false) or an element lies at or past col_end. With kVector, col_end and ld
// are multiples of 8, so a chunk is wholly inside or wholly outside and cp.async moves it.
template <bool kVector>
__device__ __forceinline__ void copy_chunk(std::uint32_t dst, const bf16* src, long long ld, int row, bool row_ok,
                                           int col, int col_end) {
  if constexpr (kVector) {
    const bool inside = row_ok && col < col_end;
    tc::cp_async_16(dst, inside ? src + row * ld + col : src, inside);
  } else {
    alignas(16) bf16 v[8];
#pragma unroll
    for (int j = 0; j < 8; ++j) v[j] = row_ok && col + j < col_end ? src[row * ld + col + j] : __float2bfloat16(0.0f);
    const uint4 p = *reinterpret_cast<const uint4*>(v);
    asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};\n" ::"r"(dst), "r"(p.x), "r"(p.y), "r"(p.z), "r"(p.w));
  }
}

// A K-contiguous tile: ROWS rows × 64 reduction elements (128 bytes a row). Element (row, r) of
// the source is src[row · ld + r]; rows >= row_end and r >= r_end are zero-filled.
template <class T, int ROWS, bool kVector>
__device__ __forceinline__ void load_k_tile(std::uint32_t tile, const bf16* src, long long ld, int row0, int row_end,
                                            int r0, int r_end) {
#pragma unroll
  for (int i = 0; i < ROWS * 8 / T::kThreads; ++i) {
    const int id = i * T::kThreads + threadIdx.x, row = id >> 3, ch = id & 7;
    copy_chunk<kVector>(tile + swz<128>(row, ch), src, ld, row0 + row, row0 + row < row_end, r0 + ch * 8, r_end);
  }
}

// An MN-contiguous tile: 64 reduction rows × COLS elements (2·COLS bytes a row). Element (r, col)
// of the source is src[r · ld + col]; r >= r_end and col >= col_end are zero-filled.
template <class T, int COLS, bool kVector>
__device__ __forceinline__ void load_mn_tile(std::uint32_t tile, const bf16* src, long long ld, int r0, int r_end,
                                             int col0, int col_end) {
  constexpr int kChunks = COLS / 8;
#pragma unroll
  for (int i = 0; i < 64 * kChunks / T::kThreads; ++i) {
    const int id = i * T::kThreads + threadIdx.x, row = id / kChunks, ch = id % kChunks;
    copy_chunk<kVector>(tile + swz<COLS * 2>(row, ch), src, ld, r0 + row, r0 + row < r_end, col0 + ch * 8, col_end);
  }
}

template <class OutT>
__device__ __forceinline__ void store_pair(OutT* p, bool both, bool pairs, bool accumulate, float v0, float v1) {
  if (accumulate) {
    v0 += static_cast<float>(p[0]);
    if (both) v1 += static_cast<float>(p[1]);
  }
  if (both && pairs) {
    if constexpr (sizeof(OutT) == 2) {
      *reinterpret_cast<std::uint32_t*>(p) = tc::pack_bf16x2(v0, v1);
    } else {
      *reinterpret_cast<float2*>(p) = make_float2(v0, v1);
    }
  } else {
    p[0] = static_cast<OutT>(v0);
    if (both) p[1] = static_cast<OutT>(v1);
  }
}

template <class T, Mode kMode, bool kAK, bool kBK, bool kVector, class OutT>
__global__ void __launch_bounds__(T::kThreads, T::kBlocksPerSm) grouped_kernel(GemmArgs<OutT> p) {
  extern __shared__ __align__(128) unsigned char smem[];
  __shared__ int prefix[kMaxExperts + 1];  // prefix[g]: the first tile of group g
  const std::uint32_t smem0 = smem_addr(smem);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int warp_m = warp / T::WARPS_N, warp_n = warp % T::WARPS_N;
  const int tiles_n = ceil_div(p.n, T::BN);

  // Each group's first tile.
  auto tiles_of = [&](int g) {
    return (kMode == Mode::rows ? ceil_div(p.offsets[g + 1] - p.offsets[g], T::BM) : ceil_div(p.m, T::BM)) * tiles_n;
  };
  if (warp == 0) warp_prefix(p.groups, tiles_of, prefix);
  __syncthreads();
  const int total = prefix[p.groups];

  auto stage_a = [&](int s) { return smem0 + s * T::kStageBytes; };
  auto stage_b = [&](int s) { return smem0 + s * T::kStageBytes + T::kTileA; };

  // ldmatrix lane roles (module 05 for K-contiguous tiles; the transposed reads below).
  //   A, K-contiguous:  lanes 0-15 rows 0-15 at chunk 0, lanes 16-31 the same rows at chunk 1.
  //   A, MN-contiguous: matrix q = lane / 8 is (r 0-7 | 8-15) × (m 0-7 | 8-15) in a0..a3 order:
  //                     r row (lane % 8) + 8·(lane / 16), m chunk + (lane / 8) % 2.
  //   B, K-contiguous:  lanes 0-7 rows 0-7 chunk 0, 8-15 rows 0-7 chunk 1, 16-23 rows 8-15
  //                     chunk 0, 24-31 rows 8-15 chunk 1.
  //   B, MN-contiguous: r row (lane % 8) + 8·((lane / 8) % 2), n chunk + lane / 16.
  const int ak_row = warp_m * T::WM + (lane & 15), ak_chunk = lane >> 4;
  const int amn_row = (lane & 7) + ((lane >> 4) << 3), amn_chunk = (warp_m * T::WM) / 8 + ((lane >> 3) & 1);
  const int bk_row = warp_n * T::WN + (lane & 7) + ((lane >> 4) << 3), bk_chunk = (lane >> 3) & 1;
  const int bmn_row = (lane & 7) + (((lane >> 3) & 1) << 3), bmn_chunk = (warp_n * T::WN) / 8 + (lane >> 4);

  for (int t = blockIdx.x; t < total; t += gridDim.x) {
    const int g = group_of(prefix, p.groups, t), local = t - prefix[g];
    const int row0 = p.offsets[g], rows_g = p.offsets[g + 1] - row0;
    const int M = kMode == Mode::rows ? rows_g : p.m;
    const int R = kMode == Mode::rows ? p.k : rows_g;
    const int tiles_m = ceil_div(M, T::BM);
    // Consecutive tiles go down one column of tiles: blocks running together share B's tile.
    const int m0 = (local % tiles_m) * T::BM, n0 = (local / tiles_m) * T::BN;

    // Operand bases and leading dimensions for this group.
    const bf16 *a, *b;
    long long lda, ldb;
    if constexpr (kMode == Mode::rows) {
      a = p.a + static_cast<long long>(row0) * p.k;
      lda = p.k;
      b = p.b + static_cast<long long>(g) * p.n * p.k;
      ldb = kBK ? p.k : p.n;
    } else {
      a = p.a + static_cast<long long>(row0) * p.m;
      lda = p.m;
      b = p.b + static_cast<long long>(row0) * p.n;
      ldb = p.n;
    }
    auto load_stage = [&](int s, int kt) {
      const int r0 = kt * T::BK;
      if constexpr (kAK) load_k_tile<T, T::BM, kVector>(stage_a(s), a, lda, m0, M, r0, R);
      else load_mn_tile<T, T::BM, kVector>(stage_a(s), a, lda, r0, R, m0, M);
      if constexpr (kBK) load_k_tile<T, T::BN, kVector>(stage_b(s), b, ldb, n0, p.n, r0, R);
      else load_mn_tile<T, T::BN, kVector>(stage_b(s), b, ldb, r0, R, n0, p.n);
    };

    __syncthreads();  // every warp is done with the previous tile's stages
    float acc[T::MT][T::NT][4] = {};
    const int k_tiles = ceil_div(R, T::BK);
    tc::pipeline_prologue<T::STAGES>(k_tiles, load_stage);
    for (int kt = 0; kt < k_tiles; ++kt) {
      tc::pipeline_advance<T::STAGES>(kt, k_tiles, load_stage);
      const std::uint32_t sa = stage_a(kt % T::STAGES), sb = stage_b(kt % T::STAGES);
      std::uint32_t af[T::MT][4], bfr[T::NT][2];
      tc::mma_stage<T::BK / 16>(
          acc, af, bfr,
          [&](std::uint32_t(&frag)[4], int mt, int ks) {
            if constexpr (kAK) tc::ldmatrix_x4(frag, sa + swz<128>(ak_row + mt * 16, ks * 2 + ak_chunk));
            else tc::ldmatrix_x4_trans(frag, sa + swz<T::BM * 2>(ks * 16 + amn_row, amn_chunk + mt * 2));
          },
          [&](std::uint32_t(&r)[4], int nt, int ks) {
            if constexpr (kBK) tc::ldmatrix_x4(r, sb + swz<128>(bk_row + nt * 8, ks * 2 + bk_chunk));
            else tc::ldmatrix_x4_trans(r, sb + swz<T::BN * 2>(ks * 16 + bmn_row, bmn_chunk + nt));
          });
    }
    tc::cp_async_wait<0>();

    // Epilogue: rows g8 and g8 + 8, column pairs 2q, of every mma tile.
    OutT* c = kMode == Mode::rows ? p.c + static_cast<long long>(row0) * p.n
                                  : p.c + static_cast<long long>(g) * p.m * p.n;
    const int g8 = lane / 4, q = lane % 4;
#pragma unroll
    for (int mt = 0; mt < T::MT; ++mt)
#pragma unroll
      for (int nt = 0; nt < T::NT; ++nt) {
        const int col = n0 + warp_n * T::WN + nt * 8 + 2 * q;
        if (col >= p.n) continue;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int row = m0 + warp_m * T::WM + mt * 16 + g8 + 8 * h;
          if (row < M)
            store_pair(c + static_cast<long long>(row) * p.n + col, col + 1 < p.n, p.pairs, p.accumulate,
                       acc[mt][nt][2 * h], acc[mt][nt][2 * h + 1]);
        }
      }
  }
}

// Blocks that fit on the device at once, asked once per device and kernel.
template <class T, class Kernel>
int resident_blocks(Kernel kernel) {
  static std::mutex mutex;
  static std::map<std::pair<int, const void*>, int> known;
  int device = 0;
  K2C_CUDA_CHECK(cudaGetDevice(&device));
  std::lock_guard<std::mutex> lock(mutex);
  int& n = known[{device, reinterpret_cast<const void*>(kernel)}];
  if (n == 0) {
    int sms = 0, per_sm = 0;
    K2C_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
    K2C_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, T::kThreads, T::kSmemBytes));
    K2C_CHECK(per_sm > 0, "moe grouped GEMM: the kernel does not fit on this GPU");
    n = sms * per_sm;
  }
  return n;
}

template <Mode kMode, bool kAK, bool kBK, bool kVector, class T = Reference, class OutT>
void launch_gemm(const GemmArgs<OutT>& args, cudaStream_t stream) {
  auto* kernel = grouped_kernel<T, kMode, kAK, kBK, kVector, OutT>;
  K2C_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, T::kSmemBytes));
  kernel<<<resident_blocks<T>(kernel), T::kThreads, T::kSmemBytes, stream>>>(args);
  K2C_CUDA_CHECK_LAUNCH();
}

bool aligned16(const void* p) { return reinterpret_cast<std::uintptr_t>(p) % 16 == 0; }

template <class OutT>
void run_grouped(const char* who, int groups, const int* offsets, int n, int k, const bf16* a, const bf16* b, OutT* c,
                 bool b_transposed, bool accumulate, cudaStream_t stream) {
  check_grouped(groups, n, k, {offsets, a, b, c}, who);
  // Vector copies need every row to start on 16 bytes: n and k multiples of 8, aligned bases.
  const bool vec = n % 8 == 0 && k % 8 == 0 && aligned16(a) && aligned16(b);
  const bool pairs = n % 2 == 0 && reinterpret_cast<std::uintptr_t>(c) % (2 * sizeof(OutT)) == 0;
  const GemmArgs<OutT> args{groups, offsets, 0, n, k, a, b, c, accumulate, pairs};
  if (b_transposed) {
    if (vec) launch_gemm<Mode::rows, true, true, true>(args, stream);
    else launch_gemm<Mode::rows, true, true, false>(args, stream);
  } else {
    if (vec) launch_gemm<Mode::rows, true, false, true>(args, stream);
    else launch_gemm<Mode::rows, true, false, false>(args, stream);
  }
}
