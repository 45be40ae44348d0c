// autograder/witness/rank_cases_collectives.cpp — k2c_rank_witness's cases of module 11's
// collectives and module 12's broadcast of the parameters and all-reduce of the gradients.
#include <algorithm>
#include <cmath>
#include <cstring>

#include "k2c/core/random.h"
#include "k2c/dist/communicator.h"
#include "rank_cases.h"

namespace k2c::rank_witness {

// Module 11's collectives. args: which (0 all-reduce, 1 reduce-scatter, 2 all-gather), dtype
// (k2c::dist::DType), op (k2c::dist::ReduceOp), count, in place (0 or 1).

using k2c::dist::DType;
using k2c::dist::ReduceOp;

namespace {

std::size_t size_of(DType t) { return t == DType::f64 ? 8 : 4; }

// Element i of a buffer of type t, widened.
double element(const Bytes& b, DType t, std::size_t i) {
  if (t == DType::f64) {
    double v;
    std::memcpy(&v, b.data() + 8 * i, 8);
    return v;
  }
  if (t == DType::i32) {
    std::int32_t v;
    std::memcpy(&v, b.data() + 4 * i, 4);
    return v;
  }
  float v;
  std::memcpy(&v, b.data() + 4 * i, 4);
  return v;
}

Bytes values(DType t, std::size_t count, std::uint64_t seed) {
  Bytes b(count * size_of(t));
  for (std::size_t i = 0; i < count; ++i) {
    if (t == DType::i32) {
      const auto v = static_cast<std::int32_t>(std::floor(k2c::uniform_at(seed, i, -1000.0f, 1000.0f)));
      std::memcpy(b.data() + 4 * i, &v, 4);
    } else if (t == DType::f64) {
      const double v = k2c::uniform_at(seed, i, -1.0f, 1.0f);
      std::memcpy(b.data() + 8 * i, &v, 8);
    } else {
      const float v = k2c::uniform_at(seed, i, -1.0f, 1.0f);
      std::memcpy(b.data() + 4 * i, &v, 4);
    }
  }
  return b;
}

// Compares `got` (count elements from `from` of the reference) with `want`; "" or the first miss.
std::string compare(const Bytes& got, const std::vector<double>& want, std::size_t from, DType t, ReduceOp op, int n) {
  const bool exact = t == DType::i32 || op == ReduceOp::max;
  // Floating-point sums of n values of magnitude <= 1, added in another order: a few ulps of n.
  const double tol = exact ? 0.0 : 4.0 * n * (t == DType::f32 ? 1.2e-7 : 2.3e-16);
  const std::size_t count = got.size() / size_of(t);
  for (std::size_t i = 0; i < count; ++i) {
    const double g = element(got, t, i), w = want[from + i];
    if (!(std::abs(g - w) <= tol))
      return "element " + std::to_string(from + i) + ": got " + std::to_string(g) + ", want " + std::to_string(w);
  }
  return "";
}

}  // namespace

Case draw_collectives(const std::string& kind, int n, int index, std::mt19937_64& rng) {
  const int which = kind == "reduce_scatter" ? 1 : kind == "all_gather" ? 2 : 0;
  const bool in_place = kind == "all_reduce_in_place";
  const DType types[] = {DType::f32, DType::f64, DType::i32};
  const DType t = types[rng() % 3];
  const ReduceOp op = kind == "all_reduce_sum" ? ReduceOp::sum
                      : kind == "all_reduce_max" ? ReduceOp::max
                                                 : (rng() % 2 ? ReduceOp::sum : ReduceOp::max);
  // In turn: tiny (fewer elements than ranks, or none), a tail the ranks do not divide, a large one.
  const int shape = index % 3;
  const std::size_t count = shape == 0   ? rng() % (n + 2)
                            : shape == 1 ? 1 + rng() % 5000
                                         : (std::size_t{1} << 18) + rng() % 4099;
  Case c;
  c.args[0] = which;
  c.args[1] = static_cast<std::int64_t>(t);
  c.args[2] = static_cast<std::int64_t>(op);
  c.args[3] = static_cast<std::int64_t>(count);
  c.args[4] = in_place;
  const char* type_name = t == DType::f32 ? "f32" : t == DType::f64 ? "f64" : "i32";
  c.what = kind + ", " + type_name + (which == 2 ? "" : op == ReduceOp::sum ? ", sum" : ", max") + ", " +
           std::to_string(count) + " elements on " + std::to_string(n) + " ranks";
  const std::uint64_t seed = rng();
  std::vector<Bytes> full;
  for (int r = 0; r < n; ++r) full.push_back(values(t, count, k2c::mix64(seed + r)));
  const std::size_t e = size_of(t);
  std::vector<double> want(count);
  if (which == 2) {  // rank b's block of its own input lands at block b
    for (int b = 0; b < n; ++b) {
      const k2c::dist::Block blk = k2c::dist::block_of(count, n, b);
      for (std::size_t i = blk.offset; i < blk.offset + blk.size; ++i) want[i] = element(full[b], t, i);
      c.in.emplace_back(full[b].begin() + blk.offset * e, full[b].begin() + (blk.offset + blk.size) * e);
      c.out_bytes.push_back(count * e);
    }
  } else {
    for (std::size_t i = 0; i < count; ++i) {
      double acc = element(full[0], t, i);
      for (int r = 1; r < n; ++r)
        acc = op == ReduceOp::sum ? acc + element(full[r], t, i) : std::max(acc, element(full[r], t, i));
      want[i] = acc;  // exact: integers stay far from overflow, floating-point sums get compare's tolerance
    }
    for (int r = 0; r < n; ++r) {
      c.in.push_back(full[r]);
      c.out_bytes.push_back((which == 1 ? k2c::dist::block_of(count, n, r).size : count) * e);
    }
  }
  c.check = [=](const std::vector<Bytes>& got) -> std::string {
    for (int r = 0; r < n; ++r) {
      const std::size_t from = which == 1 ? k2c::dist::block_of(count, n, r).offset : 0;
      if (std::string miss = compare(got[r], want, from, t, op, n); !miss.empty()) return "rank " + std::to_string(r) + ", " + miss;
      // Every rank holds the same result, to the bit (the ring's order is the same everywhere).
      if (which != 1 && got[r] != got[0]) return "rank " + std::to_string(r) + "'s result differs from rank 0's";
    }
    return "";
  };
  return c;
}

// Module 12's broadcast of the parameters from rank 0, its naive all-reduce of the gradients, and
// DataParallel's bucketed one. args: the number of parameters P (2 to 7), then each one's element
// count; args[11] the frozen one (any of them: first, in the middle or last, so that a parameter's
// place in the flat values and in the flat gradients differ); args[9] the bucket size in bytes,
// args[10] the micro-batches M.
//   broadcast_parameters  every rank gets values of its own for all P and answers what it holds
//                         afterwards, rank 0's to the bit
//   all_reduce_gradients  every rank gets gradients of its own for the P − 1 trainable ones and
//                         answers them afterwards, their average over the ranks
//   all_reduce_buckets / accumulate_buckets
//                         every rank gets M sets of gradients (M = 1, or 2 to 3 for
//                         accumulation); for each it runs a backward pass of its own making
//                         (before_backward(sync on the last), each trainable parameter's set added
//                         into its gradient and reported done, last parameter first), then
//                         finish_gradients(), and answers the gradients: for each element the
//                         average over the ranks of the sum of its M sets
Case draw_parameters(const std::string& kind, int n, int index, std::mt19937_64& rng) {
  const bool broadcast = kind == "broadcast_parameters";
  const int params = 2 + static_cast<int>(rng() % 6);
  const int micros = kind == "accumulate_buckets" ? 2 + static_cast<int>(rng() % 2) : 1;
  const int frozen = static_cast<int>(rng() % params);
  Case c;
  c.args[0] = params;
  c.args[11] = frozen;
  std::int64_t total = 0, trainable = 0;
  for (int p = 0; p < params; ++p) {
    // In turn: a few values each, hundreds, tens of thousands.
    const std::int64_t size = index % 3 == 0 ? 1 + rng() % 3 : index % 3 == 1 ? 1 + rng() % 999 : 10000 + rng() % 40000;
    c.args[1 + p] = size;
    total += size;
    if (p != frozen) trainable += size;
  }
  // Buckets from one float (a bucket per parameter) to more than all of them (one bucket).
  const std::int64_t bucket_bytes = 4 * (1 + static_cast<std::int64_t>(rng() % (trainable + trainable / 2 + 1)));
  c.args[9] = bucket_bytes, c.args[10] = micros;
  const std::int64_t count = broadcast ? total : trainable;
  c.what = kind + ", " + std::to_string(params) + " parameters, " + std::to_string(count) + " values" +
           (kind == "all_reduce_buckets" || micros > 1
                ? ", buckets of " + std::to_string(bucket_bytes) + " bytes, " + std::to_string(micros) + " micro-batch" +
                      (micros > 1 ? "es" : "")
                : std::string()) +
           " on " + std::to_string(n) + " ranks";
  const std::uint64_t seed = rng();
  for (int r = 0; r < n; ++r) {
    std::vector<float> v(count * micros);
    for (std::int64_t i = 0; i < count * micros; ++i) v[i] = k2c::uniform_at(seed + r, i, -1.0f, 1.0f);
    c.in.push_back(floats(v));
    c.out_bytes.push_back(count * sizeof(float));
  }
  std::vector<double> mean(count, 0.0);
  for (int r = 0; r < n; ++r)
    for (int m = 0; m < micros; ++m)
      for (std::int64_t i = 0; i < count; ++i) mean[i] += float_at(c.in[r], m * count + i) / n;
  const Bytes first = c.in[0];
  c.check = [=](const std::vector<Bytes>& got) -> std::string {
    for (int r = 0; r < n; ++r)
      for (std::int64_t i = 0; i < count; ++i) {
        const double g = float_at(got[r], i), want = broadcast ? float_at(first, i) : mean[i];
        // The broadcast moves bits; sums of M values in [-1, 1], averaged, round to fp32 by a few
        // ulps of M.
        if (broadcast ? std::memcmp(got[r].data() + i * 4, first.data() + i * 4, 4) != 0 : !(std::abs(g - want) <= 1e-6 * micros))
          return "rank " + std::to_string(r) + ", value " + std::to_string(i) + ": got " + std::to_string(g) +
                 (broadcast ? ", rank 0 had " : ", want ") + std::to_string(want);
      }
    if (!broadcast)
      for (int r = 1; r < n; ++r)
        if (got[r] != got[0]) return "rank " + std::to_string(r) + "'s gradients differ from rank 0's";
    return "";
  };
  return c;
}

}  // namespace k2c::rank_witness
