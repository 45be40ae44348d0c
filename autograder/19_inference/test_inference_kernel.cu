// autograder/19_inference/test_inference_kernel.cu — tests of module 19, Part G (contract:
// decode_kernel.h): decode attention as a CUDA kernel over a paged bf16 cache.
//
// The kernel runs on one GPU, so these tests run in the one-rank run and skip in the others (and
// skip without a GPU). Their reference is the course's double-precision attention
// (k2c/reference/reference.h) of each query over its sequence's keys and values, gathered on the
// host from the pages the kernel read; inputs are rounded to bf16 first, so the reference sees
// exactly the kernel's inputs. What must agree: every output within 1e-2·M + 1e-2·|w| (M = the
// largest |w| of the sequence's outputs): o is rounded to bf16 once (relative 2^-8), and the
// scores' sums run in fp32 in the kernel's own order. Outputs and workspace are poisoned (NaN)
// before each call; page table entries past a sequence's pages hold an out-of-range page, so a
// read past the end faults.
//
// Speed: 32 sequences of 8192 cached tokens, 32 query and 8 KV heads of 128, pages of 16 tokens
// scattered over the pool: the cache bytes read per second against cudaMemcpy's rate (bytes read
// plus written) measured in the same run; and one sequence of 32768 tokens, reported.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <numeric>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "decode_kernel.h"
#include "k2c/core/check.h"
#include "k2c/core/random.h"
#include "k2c/device/buffer.h"
#include "k2c/device/timing.h"
#include "k2c/dist/testing.h"
#include "k2c/reference/reference.h"
#include "k2c/testing/bf16.h"
#include "k2c/testing/testing.h"
#include "k2c/testing/witness.h"

namespace {

namespace inf = k2c::inference;
using k2c::bf16;
using k2c::testing::seed_for;

#define K2C_REQUIRE_ONE_RANK()                                                                         \
  do {                                                                                                 \
    if (::k2c::dist::testing::world().size() != 1)                                                    \
      K2C_SKIP("the kernel's tests run in the one-rank run (this run has " +                           \
               std::to_string(::k2c::dist::testing::world().size()) + " ranks)");                      \
  } while (0)

// A decode problem on the host and the device: pools whose every element is drawn on its own on
// the device (k2c/core/random.h), so that nothing repeats and the host recomputes any element
// from its index.
struct Problem {
  inf::DecodeShape shape;
  std::vector<int> lengths, table;  // table [batch, max_pages]
  int pool_pages = 0;
  std::vector<float> q;  // widened bf16
  std::uint64_t k_seed = 0, v_seed = 0;
  k2c::DeviceBuffer<bf16> q_d, k_d, v_d, o_d;
  k2c::DeviceBuffer<int> table_d, lengths_d;
  k2c::DeviceBuffer<unsigned char> workspace;

  std::size_t page_elems() const { return std::size_t(shape.kv_heads) * shape.page_size * shape.head_dim; }
  float k_at(std::size_t e) const { return static_cast<float>(bf16(k2c::uniform_at(k_seed, e, -1.0f, 1.0f))); }
  float v_at(std::size_t e) const { return static_cast<float>(bf16(k2c::uniform_at(v_seed, e, -1.0f, 1.0f))); }
  inf::DecodeArgs args() {
    return {q_d.data(), k_d.data(), v_d.data(), table_d.data(), lengths_d.data(), o_d.data()};
  }
  double cache_bytes() const {
    const double tokens = std::accumulate(lengths.begin(), lengths.end(), 0.0);
    return 2.0 * tokens * shape.kv_heads * shape.head_dim * sizeof(bf16);
  }
};

std::vector<float> random_bf16(std::size_t n, const std::string& purpose, float scale = 1.0f) {
  std::vector<float> x = k2c::random_values<bf16>(n, seed_for(purpose), -scale, scale);
  return x;
}

// Pages of all sequences drawn from one pool in a random order (a cache after some traffic), the
// table's unused entries an out-of-range page.
Problem make_problem(int batch, int q_heads, int kv_heads, int head_dim, int page_size, std::vector<int> lengths,
                     const std::string& tag) {
  Problem p;
  p.lengths = std::move(lengths);
  const int longest = *std::max_element(p.lengths.begin(), p.lengths.end());
  p.shape = {batch, q_heads, kv_heads, head_dim, page_size, (longest + page_size - 1) / page_size, longest};
  std::vector<int> pages_of(batch);
  for (int b = 0; b < batch; ++b) pages_of[b] = (p.lengths[b] + page_size - 1) / page_size;
  p.pool_pages = std::accumulate(pages_of.begin(), pages_of.end(), 0) + 3;  // a few pages nobody holds
  std::vector<int> order(p.pool_pages);
  std::iota(order.begin(), order.end(), 0);
  std::shuffle(order.begin(), order.end(), std::mt19937_64(seed_for(tag + "/pages")));
  p.table.assign(std::size_t(batch) * p.shape.max_pages, std::numeric_limits<int>::max() / 2);
  int next = 0;
  for (int b = 0; b < batch; ++b)
    for (int j = 0; j < pages_of[b]; ++j) p.table[std::size_t(b) * p.shape.max_pages + j] = order[next++];

  const std::size_t pool_elems = std::size_t(p.pool_pages) * p.page_elems();
  p.q = random_bf16(std::size_t(batch) * q_heads * head_dim, tag + "/q", 3.0f);  // peaked softmaxes too
  p.k_seed = seed_for(tag + "/k");
  p.v_seed = seed_for(tag + "/v");
  p.q_d = k2c::to_device<bf16>(p.q);
  p.k_d = k2c::DeviceBuffer<bf16>(pool_elems);
  p.v_d = k2c::DeviceBuffer<bf16>(pool_elems);
  k2c::fill_uniform_device(p.k_d.data(), pool_elems, p.k_seed);
  k2c::fill_uniform_device(p.v_d.data(), pool_elems, p.v_seed);
  K2C_CUDA_CHECK(cudaDeviceSynchronize());
  p.table_d = k2c::DeviceBuffer<int>(std::span<const int>(p.table));
  p.lengths_d = k2c::DeviceBuffer<int>(std::span<const int>(p.lengths));
  p.o_d = k2c::DeviceBuffer<bf16>(std::size_t(batch) * q_heads * head_dim);
  p.workspace = k2c::DeviceBuffer<unsigned char>(inf::decode_workspace_bytes(p.shape));
  return p;
}

// Sequence b's output by the double-precision reference, for the query vectors q
// ([batch][q_heads][head_dim], widened bf16), over its keys and values gathered from the pages
// into [kv_heads][length][head_dim].
std::vector<double> reference_row(const Problem& p, const std::vector<float>& q, int b) {
  const inf::DecodeShape& s = p.shape;
  const int L = p.lengths[b], hd = s.head_dim;
  std::vector<float> k(std::size_t(s.kv_heads) * L * hd), v(k.size());
  for (int h = 0; h < s.kv_heads; ++h)
    for (int t = 0; t < L; ++t) {
      const std::size_t page = std::size_t(p.table[std::size_t(b) * s.max_pages + t / s.page_size]);
      const std::size_t from = ((page * s.kv_heads + h) * s.page_size + t % s.page_size) * hd;
      const std::size_t to = (std::size_t(h) * L + t) * hd;
      for (int d = 0; d < hd; ++d) {
        k[to + d] = p.k_at(from + d);
        v[to + d] = p.v_at(from + d);
      }
    }
  const std::vector<float> qb(q.begin() + std::ptrdiff_t(b) * s.q_heads * hd, q.begin() + std::ptrdiff_t(b + 1) * s.q_heads * hd);
  const k2c::ref::AttentionShape shape{1, s.q_heads, s.kv_heads, 1, L, hd, false, 1.0 / std::sqrt(double(hd))};
  return k2c::ref::attention_forward(qb, k, v, shape).o;
}

// Sequence b of `got` (an output, [batch][q_heads][head_dim]) against the reference for the
// queries q; returns the first disagreement, or "".
std::string check_sequence(const Problem& p, const std::vector<float>& q, const std::vector<float>& got, int b) {
  const std::vector<double> want = reference_row(p, q, b);
  const std::size_t width = std::size_t(p.shape.q_heads) * p.shape.head_dim;
  double top = 0;
  for (double w : want) top = std::max(top, std::abs(w));
  for (std::size_t i = 0; i < width; ++i) {
    const double g = got[b * width + i];
    if (!(std::abs(g - want[i]) <= 1e-2 * top + 1e-2 * std::abs(want[i])))
      return "sequence " + std::to_string(b) + " (length " + std::to_string(p.lengths[b]) + "), query head " +
             std::to_string(i / p.shape.head_dim) + ", value " + std::to_string(i % p.shape.head_dim) + ": got " +
             std::to_string(g) + ", want " + std::to_string(want[i]);
  }
  return "";
}

// Outputs of the sequences `rows` against the reference; returns the first disagreement, or "".
std::string check_rows(const Problem& p, const std::vector<int>& rows) {
  const std::vector<float> got = k2c::to_host(p.o_d);
  for (int b : rows)
    if (std::string wrong = check_sequence(p, p.q, got, b); !wrong.empty()) return wrong;
  return "";
}

void run(Problem& p) {
  p.o_d.poison();
  p.workspace.poison();
  inf::decode_attention_paged(p.shape, p.args(), p.workspace.data());
  K2C_CUDA_CHECK(cudaDeviceSynchronize());
}

struct Case {
  int batch, q_heads, kv_heads, head_dim, page_size;
  std::vector<int> lengths;
};

std::string describe(const Case& c) {
  std::string lengths;
  for (int l : c.lengths) lengths += (lengths.empty() ? "" : ",") + std::to_string(l);
  return "batch " + std::to_string(c.batch) + ", heads " + std::to_string(c.q_heads) + "/" + std::to_string(c.kv_heads) +
         " of " + std::to_string(c.head_dim) + ", pages of " + std::to_string(c.page_size) + ", lengths " + lengths;
}

}  // namespace

// Small and odd shapes: one token, lengths that end mid-page and mid-step, pages of 1, 3 and 7
// tokens, every group size the contract allows from 1 to 8, both head sizes, and sequences long
// enough to be cut into many parts.
TEST(InferenceKernel, MatchesAttention) {
  K2C_REQUIRE_GPU();
  K2C_REQUIRE_ONE_RANK();
  const std::vector<Case> cases = {
      {1, 1, 1, 64, 1, {1}},
      {3, 8, 2, 128, 16, {1, 17, 300}},
      {2, 12, 4, 64, 7, {33, 129}},
      {4, 8, 1, 128, 64, {1000, 64, 65, 1}},
      {2, 6, 6, 128, 3, {5, 2049}},
      {2, 10, 2, 64, 16, {31, 4097}},
      {3, 14, 2, 128, 32, {6000, 7, 4096}},
      {1, 32, 8, 128, 16, {20000}},
      {2, 4, 2, 128, 8, {300, 9}},
      {2, 12, 2, 64, 5, {77, 1}},
  };
  for (std::size_t i = 0; i < cases.size(); ++i) {
    const Case& c = cases[i];
    Problem p = make_problem(c.batch, c.q_heads, c.kv_heads, c.head_dim, c.page_size, c.lengths, "case" + std::to_string(i));
    run(p);
    std::vector<int> all(c.batch);
    std::iota(all.begin(), all.end(), 0);
    const std::string wrong = check_rows(p, all);
    EXPECT_EQ(wrong, "") << describe(c);
  }
}

// Shapes outside the contract are refused with std::invalid_argument, before anything runs (so
// also without a GPU; sizing a good shape may ask the GPU, as the reference does for its split).
TEST(InferenceKernel, RejectsBadShapes) {
  const inf::DecodeShape good{2, 8, 2, 128, 16, 4, 64};
  if (k2c::testing::gpu_available()) EXPECT_NO_THROW(inf::decode_workspace_bytes(good));
  auto refused = [&](auto change, const std::string& what) {
    inf::DecodeShape s = good;
    change(s);
    EXPECT_THROW(inf::decode_workspace_bytes(s), std::invalid_argument) << what;
  };
  refused([](inf::DecodeShape& s) { s.head_dim = 96; }, "head_dim 96");
  refused([](inf::DecodeShape& s) { s.q_heads = 12, s.kv_heads = 8; }, "12 query heads over 8 KV heads");
  refused([](inf::DecodeShape& s) { s.q_heads = 32, s.kv_heads = 2; }, "groups of 16");
  refused([](inf::DecodeShape& s) { s.batch = 0; }, "batch 0");
  refused([](inf::DecodeShape& s) { s.page_size = 0; }, "page_size 0");
  refused([](inf::DecodeShape& s) { s.max_length = 65; }, "max_length past the table's pages");
  refused([](inf::DecodeShape& s) { s.max_length = 0; }, "max_length 0");
}

namespace {

// Decode reads each cached key and value once: 2·B·L·Hkv·hd·2 bytes for 4·B·L·Hq·hd FLOPs, two
// FLOPs per byte at GQA 4, far below the H200's ~200 FLOPs per byte of balance: the time is the
// cache's bytes at memory bandwidth, and the device copy (1 GiB, bytes read + written, as module
// 00 counts it) is the ceiling. The two are timed in alternation, a repeat of each in turn, as
// module 10 times its ceiling: timed one after the other, the copy first, the ratio moved by
// several percent from one process to the next while the kernel's own duration under Nsight
// Compute did not; alternated, it is the same in every process.
void time_decode(int batch, int length) {
  Problem p = make_problem(batch, 32, 8, 128, 16, std::vector<int>(batch, length), "perf" + std::to_string(batch));
  const std::size_t copy_bytes = std::size_t{1} << 30;
  k2c::DeviceBuffer<char> src(copy_bytes), dst(copy_bytes);
  K2C_CUDA_CHECK(cudaMemset(src.data(), 0x5A, copy_bytes));
  // Every call, warm-up and timed, gets queries of its own, drawn (from a seed nobody knows in
  // advance) and uploaded just before it, off the clock, and an output of its own, poisoned then;
  // every output is checked afterwards. A kernel that computed once and skipped the repeats (the
  // cache and the page table stay the same from call to call) leaves poison behind, and one that
  // answered later calls early finds no queries for them. The repeats are timed until the whole
  // device is idle, so work left running on a stream of the kernel's own is on the clock too.
  // Every element of the cache is drawn on its own: no smaller pool reproduces it.
  k2c::TimingOptions options;
  options.whole_device = true;
  const int calls = options.warmup + options.repeats;
  const std::size_t nq = p.q.size();
  std::vector<std::vector<float>> queries(calls);
  std::vector<std::uint64_t> seeds(calls);  // each call's, to replay a failing one
  k2c::DeviceBuffer<bf16> q_all(nq * calls), o_all(nq * calls);
  q_all.poison();
  o_all.poison();
  int call = 0;
  options.before = [&](std::size_t work, int c) {
    if (work != 0) return;  // the copy
    K2C_CHECK(c < calls, "the timing made more calls than its options say");
    seeds[c] = k2c::testing::unpredictable_seed();
    queries[c] = k2c::random_values<bf16>(nq, seeds[c], -3.0f, 3.0f);
    const k2c::DeviceBuffer<bf16> qc = k2c::to_device<bf16>(queries[c]);
    K2C_CUDA_CHECK(cudaMemcpy(q_all.data() + nq * c, qc.data(), nq * sizeof(bf16), cudaMemcpyDeviceToDevice));
    K2C_CUDA_CHECK(cudaMemset(o_all.data() + nq * c, 0xFF, nq * sizeof(bf16)));
  };
  const std::vector<k2c::Timing> t = k2c::time_gpu_interleaved(
      {[&] {
         inf::DecodeArgs args = p.args();
         args.q = q_all.data() + nq * (call % calls);
         args.o = o_all.data() + nq * (call % calls);
         ++call;
         inf::decode_attention_paged(p.shape, args, p.workspace.data());
       },
       [&] { K2C_CUDA_CHECK(cudaMemcpyAsync(dst.data(), src.data(), copy_bytes, cudaMemcpyDeviceToDevice)); }},
      options);
  const double ceiling = 2.0 * static_cast<double>(copy_bytes) / (t[1].median_ms * 1e-3);
  K2C_CUDA_CHECK(cudaDeviceSynchronize());
  ASSERT_EQ(call, calls) << "the timing made another number of calls than its options say";
  // Each call's output, at a sequence drawn after timing.
  std::mt19937_64 pick(std::random_device{}());
  const std::vector<float> got = k2c::to_host(o_all);
  for (int c = 0; c < calls; ++c) {
    const std::vector<float> out(got.begin() + std::ptrdiff_t(nq) * c, got.begin() + std::ptrdiff_t(nq) * (c + 1));
    ASSERT_EQ(check_sequence(p, queries[c], out, static_cast<int>(pick() % batch)), "")
        << "call " << c << " of the timed decode attention is wrong (its queries: random_values<bf16>(" << nq
        << ", " << seeds[c] << ", -3, 3))";
  }
  const std::string detail = std::to_string(batch) + " × " + std::to_string(length) +
                             " tokens, 32/8 heads of 128, bf16, pages of 16; median of " + std::to_string(t[0].repeats) +
                             " runs, each beside a run of the copy, each with queries of its own";
  K2C_EXPECT_PERF(p.cache_bytes() / (t[0].median_ms * 1e-3) / 1e9, ceiling / 1e9, detail);
}

}  // namespace

// The suite's fixture, as in test_inference_serving.cpp (one suite, one fixture).
using InferencePerf = k2c::dist::testing::DistTest;

// The grader's own run of the timed decode step (k2c/testing/witness.h), on its buffers.
K2C_WITNESS(decode_attention) {
  const inf::DecodeShape s{w.dim(0), w.dim(1), w.dim(2), w.dim(3), w.dim(4), w.dim(5), w.dim(6)};
  static k2c::DeviceBuffer<unsigned char> workspace(inf::decode_workspace_bytes(s));
  inf::decode_attention_paged(
      s, {w.at<bf16>(0), w.at<bf16>(1), w.at<bf16>(2), w.at<int>(3), w.at<int>(4), w.at<bf16>(5)}, workspace.data());
}

TEST_F(InferencePerf, DecodeKernelVsCopy) {
  K2C_REQUIRE_TIMING();
  K2C_REQUIRE_ONE_RANK();
  time_decode(32, 8192);
}

// One long sequence: only splitting its cache gives the GPU enough blocks.
TEST_F(InferencePerf, DecodeKernelOneLongSequence) {
  K2C_REQUIRE_TIMING();
  K2C_REQUIRE_ONE_RANK();
  time_decode(1, 32768);
}
