// autograder/19_inference/bench_inference.cu — module 19's decode roofline: the two halves of
// one decode step of one layer of an 8B-class model (d 4096, 32 query and 8 KV heads of 128,
// feed-forward 14336: 218 M parameters, 436 MB of bf16 weights a layer), against the batch size
// B, with 1,024 cached tokens per sequence:
//
//   BM_inference_decode/weights/B    the layer's linear maps as one cuBLAS bf16 GEMM,
//                                    [B, 4096]·[4096, 53248] (the down projection
//                                    [B, 14336]·[14336, 4096] moves the same bytes and FLOPs as
//                                    its transpose, so one GEMM stands for all seven)
//   BM_inference_decode/attention/B  Part G's kernel over the B sequences' paged caches
//
// The weights are read once per step whatever B is, so their time stays flat while B is small
// and rises once the GEMM's FLOPs, 2·B per parameter, outweigh its bytes: at about B = 165 on an
// H200 (~790 TFLOP/s over ~4.8 TB/s). The cache grows with B from the start. Lecture 19,
// section 2 draws both from this sweep (tools/plot_decode.py --roofline).
#include <algorithm>
#include <numeric>
#include <random>
#include <span>
#include <vector>

#include <cuda_runtime.h>

#include "decode_kernel.h"
#include "k2c/core/check.h"
#include "k2c/reference/ceilings.h"
#include "k2c/testing/bench.h"

namespace inf = k2c::inference;
using inf::bf16;

namespace {

constexpr int kModel = 4096, kQHeads = 32, kKvHeads = 8, kHeadDim = 128, kFf = 14336;
constexpr int kColumns = kModel + 2 * kKvHeads * kHeadDim + kModel + 3 * kFf;  // q, k, v, o; gate, up, down
constexpr int kContext = 1024, kPage = 16;
const std::vector<int> kBatches = {1, 2, 4, 8, 16, 32, 64, 128, 256, 512};

void weights(benchmark::State& state, int batch) {
  const std::size_t w = std::size_t(kColumns) * kModel;
  k2c::DeviceBuffer<bf16> a(std::size_t(batch) * kModel), weight(w), c(std::size_t(batch) * kColumns);
  k2c::fill_uniform_device(a.data(), a.size(), 1, -1.0f, 1.0f);
  k2c::fill_uniform_device(weight.data(), w, 2, -0.02f, 0.02f);
  k2c::bench::run(state, [&] { k2c::cublas_bf16_gemm(batch, kColumns, kModel, a.data(), weight.data(), c.data()); },
                  2.0 * batch * static_cast<double>(w), static_cast<double>(w) * sizeof(bf16));
}

// B sequences of kContext tokens, their pages scattered over one pool (a cache after traffic).
void attention(benchmark::State& state, int batch) {
  const int pages_per_seq = kContext / kPage, pages = batch * pages_per_seq;
  const std::size_t pool = std::size_t(pages) * kKvHeads * kPage * kHeadDim;
  std::vector<int> table(pages), lengths(batch, kContext);
  std::iota(table.begin(), table.end(), 0);
  std::shuffle(table.begin(), table.end(), std::mt19937(19));
  const inf::DecodeShape shape{batch, kQHeads, kKvHeads, kHeadDim, kPage, pages_per_seq, kContext};
  k2c::DeviceBuffer<bf16> q(std::size_t(batch) * kQHeads * kHeadDim), k(pool), v(pool), o(q.size());
  k2c::DeviceBuffer<int> table_d{std::span<const int>(table)}, lengths_d{std::span<const int>(lengths)};
  k2c::DeviceBuffer<unsigned char> workspace(inf::decode_workspace_bytes(shape));
  k2c::fill_uniform_device(q.data(), q.size(), 3, -1.0f, 1.0f);
  k2c::fill_uniform_device(k.data(), pool, 4, -1.0f, 1.0f);
  k2c::fill_uniform_device(v.data(), pool, 5, -1.0f, 1.0f);
  const inf::DecodeArgs args{q.data(), k.data(), v.data(), table_d.data(), lengths_d.data(), o.data()};
  const double tokens = double(batch) * kContext;
  k2c::bench::run(state, [&] { inf::decode_attention_paged(shape, args, workspace.data()); },
                  4.0 * tokens * kQHeads * kHeadDim, 2.0 * tokens * kKvHeads * kHeadDim * sizeof(bf16));
}

void register_all() {
  for (int batch : kBatches) {
    const std::string size = "/" + std::to_string(batch);
    k2c::bench::add("BM_inference_decode/weights" + size, [=](benchmark::State& s) { weights(s, batch); })
        ->Iterations(10)->Repetitions(5)->ReportAggregatesOnly(true);
    k2c::bench::add("BM_inference_decode/attention" + size, [=](benchmark::State& s) { attention(s, batch); })
        ->Iterations(10)->Repetitions(5)->ReportAggregatesOnly(true);
  }
}

}  // namespace

int main(int argc, char** argv) { return k2c::bench::main(argc, argv, register_all); }
