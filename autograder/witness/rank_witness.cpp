// k2c_rank_witness — the grader's own check of a distributed module's correctness test, in a
// process that holds no student code. The protocol is in common/include/k2c/dist/rank_witness.h.
//
//   k2c_rank_witness NAME --out VERDICT.json --ranks N [--cases C] [--timeout S] [--cwd DIR]
//                    [--env K=V]... [--uid U --gid G] -- mpirun ... PROGRAM --k2c_rank_witness=NAME
//
// It listens on DIR/rank_witness.sock, starts the command with the socket's path in
// K2C_RANK_WITNESS (the command exports it to the ranks), draws C cases of the witness NAME, sends
// each rank its input, and compares every output byte with its own reference. The verdict, written
// to VERDICT.json in every outcome, is {"fault": "" | "submission" | "grader", "problem": ...,
// "shapes": [what each case was]}: "submission" when the test program's ranks did something wrong
// (a wrong, missing or late output, a rank that never came), "grader" when the check itself could
// not be set up.
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <functional>
#include <random>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include "k2c/core/fd_io.h"
#include "k2c/core/random.h"
#include "k2c/dist/communicator.h"
#include "k2c/dist/rank_witness.h"
#include "process.h"

namespace {

namespace wr = k2c::dist::witness;
using json = nlohmann::json;
using Clock = std::chrono::steady_clock;
using Bytes = std::vector<unsigned char>;
using Deadline = std::chrono::time_point<Clock, std::chrono::duration<double>>;

// Time limits within the test program's own (--timeout): for the ranks to start and reach the
// checker (MPI's start-up included), and for each case. The largest case is a few hundred thousand
// elements, which a ring moves in milliseconds and even element-by-element messages in seconds;
// a rank that hangs costs a submission this much, not a module's whole time limit per check.
constexpr double kStartSeconds = 120, kCaseSeconds = 30;

struct Args {
  std::string name, out, cwd;
  int ranks = 0, cases = 3, uid = -1, gid = -1;
  double timeout_s = 300;
  std::vector<std::pair<std::string, std::string>> env;
  std::vector<std::string> program;
};

Args parse(int argc, char** argv) {
  Args a;
  if (argc < 2) throw std::invalid_argument("usage: k2c_rank_witness NAME --out FILE --ranks N [options] -- COMMAND");
  a.name = argv[1];
  for (int i = 2; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--") {
      a.program.assign(argv + i + 1, argv + argc);
      break;
    }
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) throw std::invalid_argument(arg + " needs a value");
      return argv[++i];
    };
    if (arg == "--out") a.out = value();
    else if (arg == "--ranks") a.ranks = std::stoi(value());
    else if (arg == "--cases") a.cases = std::stoi(value());
    else if (arg == "--timeout") a.timeout_s = std::stod(value());
    else if (arg == "--cwd") a.cwd = value();
    else if (arg == "--uid") a.uid = std::stoi(value());
    else if (arg == "--gid") a.gid = std::stoi(value());
    else if (arg == "--env") {
      const std::string kv = value();
      const auto eq = kv.find('=');
      if (eq == std::string::npos) throw std::invalid_argument("--env " + kv + ": expected K=V");
      a.env.emplace_back(kv.substr(0, eq), kv.substr(eq + 1));
    } else throw std::invalid_argument("unknown option " + arg);
  }
  if (a.out.empty() || a.program.empty()) throw std::invalid_argument("--out and a command after -- are required");
  if (a.ranks < 1 || a.ranks > 64) throw std::invalid_argument("--ranks must be 1 to 64");
  if (a.cases < 1 || a.cases > 16) throw std::invalid_argument("--cases must be 1 to 16");
  if (!(a.timeout_s > 0)) throw std::invalid_argument("--timeout must be positive");
  return a;
}

json verdict(const std::string& fault, const std::string& problem) {
  return {{"fault", fault}, {"problem", problem}};
}

void write_verdict(const std::string& path, const json& v) {
  std::ofstream(path, std::ios::trunc) << v.dump(1) << "\n";
}

// ---- the cases: what the checker sends and what it expects back ------------------------------

// One case: every rank's input and the outputs a right answer has, judged by `check`.
struct Case {
  std::string what;
  std::int64_t args[wr::kArgs] = {};
  std::vector<Bytes> in;          // per rank
  std::vector<std::size_t> out_bytes;  // per rank
  std::function<std::string(const std::vector<Bytes>&)> check;  // "" when right
};

// Module 11's collectives. args: which (0 all-reduce, 1 reduce-scatter, 2 all-gather), dtype
// (k2c::dist::DType), op (k2c::dist::ReduceOp), count, in place (0 or 1).
namespace collectives {

using k2c::dist::DType;
using k2c::dist::ReduceOp;

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

Case draw(const std::string& kind, int n, int index, std::mt19937_64& rng) {
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

}  // namespace collectives

// Module 14's linear layers, forward. args: in, out, tokens (in and out divisible by the ranks).
// column_parallel_forward: rank r gets x [tokens, in] and rows r·out/n.. of W [out, in], and
// answers its columns of y = x·Wᵀ; row_parallel_forward: rank r gets columns r·in/n.. of x and of
// W, and answers the whole y, the same on every rank.
namespace linear {

Bytes floats(const std::vector<float>& v) {
  Bytes b(v.size() * sizeof(float));
  std::memcpy(b.data(), v.data(), b.size());
  return b;
}

Case draw(const std::string& kind, int n, int index, std::mt19937_64& rng) {
  const bool column = kind == "column_parallel_forward";
  // In turn: one token, a few, many; widths of a few elements per rank up to 32.
  const std::int64_t tokens = index % 3 == 0 ? 1 : index % 3 == 1 ? 2 + rng() % 15 : 64 + rng() % 129;
  const std::int64_t in = n * (1 + rng() % 32), out = n * (1 + rng() % 32);
  Case c;
  c.args[0] = in;
  c.args[1] = out;
  c.args[2] = tokens;
  c.what = kind + ", " + std::to_string(tokens) + " tokens, " + std::to_string(in) + " → " + std::to_string(out) +
           " on " + std::to_string(n) + " ranks";
  const std::uint64_t seed = rng();
  std::vector<float> x(tokens * in), w(out * in);
  for (std::size_t i = 0; i < x.size(); ++i) x[i] = k2c::uniform_at(seed, i, -1.0f, 1.0f);
  for (std::size_t i = 0; i < w.size(); ++i) w[i] = k2c::uniform_at(seed + 1, i, -0.5f, 0.5f);
  std::vector<double> y(tokens * out, 0.0);
  double top = 0;
  for (std::int64_t t = 0; t < tokens; ++t)
    for (std::int64_t o = 0; o < out; ++o) {
      for (std::int64_t k = 0; k < in; ++k) y[t * out + o] += double(x[t * in + k]) * w[o * in + k];
      top = std::max(top, std::abs(y[t * out + o]));
    }
  const std::int64_t lo = out / n, li = in / n;
  for (int r = 0; r < n; ++r) {
    std::vector<float> mine;
    if (column) {
      mine = x;
      mine.insert(mine.end(), w.begin() + r * lo * in, w.begin() + (r + 1) * lo * in);
      c.out_bytes.push_back(tokens * lo * sizeof(float));
    } else {
      for (std::int64_t t = 0; t < tokens; ++t) mine.insert(mine.end(), x.begin() + t * in + r * li, x.begin() + t * in + (r + 1) * li);
      for (std::int64_t o = 0; o < out; ++o) mine.insert(mine.end(), w.begin() + o * in + r * li, w.begin() + o * in + (r + 1) * li);
      c.out_bytes.push_back(tokens * out * sizeof(float));
    }
    c.in.push_back(floats(mine));
  }
  // fp32 dot products of at most 96 terms, summed in another order (and, by rows, across ranks).
  const double tol = 1e-4 * std::max(top, 1.0);
  c.check = [=](const std::vector<Bytes>& got) -> std::string {
    for (int r = 0; r < n; ++r) {
      const std::int64_t cols = column ? lo : out, first = column ? r * lo : 0;
      for (std::int64_t t = 0; t < tokens; ++t)
        for (std::int64_t j = 0; j < cols; ++j) {
          float g;
          std::memcpy(&g, got[r].data() + (t * cols + j) * sizeof(float), sizeof g);
          const double want = y[t * out + first + j];
          if (!(std::abs(g - want) <= tol))
            return "rank " + std::to_string(r) + ", y[" + std::to_string(t) + "][" + std::to_string(first + j) +
                   "]: got " + std::to_string(g) + ", want " + std::to_string(want);
        }
      if (!column && got[r] != got[0]) return "rank " + std::to_string(r) + "'s y differs from rank 0's";
    }
    return "";
  };
  return c;
}

}  // namespace linear

// Module 16's ring attention, forward. args: batch B, seq_len T (2·n·C), q_heads H, kv_heads Hkv,
// head_dim hd. Rank r gets its rows of q, k and v in the contract's local order (its chunks r and
// 2n − 1 − r, chunk-major, then sequence, then token) and answers o for the same rows.
namespace ring {

Case draw(const std::string& kind, int n, int index, std::mt19937_64& rng) {
  const bool causal = kind == "ring_attention_causal";
  const int B = 1 + static_cast<int>(rng() % 2), kv_heads = 1 + static_cast<int>(rng() % 2);
  const int heads = kv_heads * (1 + static_cast<int>(rng() % 3)), hd = 4 * (1 + static_cast<int>(rng() % 4));
  // In turn: chunks of one token, a few, more.
  const std::int64_t C = index % 3 == 0 ? 1 : index % 3 == 1 ? 2 + rng() % 3 : 5 + rng() % 4, T = 2 * n * C;
  Case c;
  c.args[0] = B;
  c.args[1] = T;
  c.args[2] = heads;
  c.args[3] = kv_heads;
  c.args[4] = hd;
  c.what = kind + ", " + std::to_string(B) + " × " + std::to_string(T) + " tokens, " + std::to_string(heads) + "/" +
           std::to_string(kv_heads) + " heads of " + std::to_string(hd) + " on " + std::to_string(n) + " ranks";
  const std::uint64_t seed = rng();
  const std::int64_t qw = heads * hd, kw = kv_heads * hd;
  std::vector<float> q(B * T * qw), k(B * T * kw), v(B * T * kw);
  for (std::size_t i = 0; i < q.size(); ++i) q[i] = k2c::uniform_at(seed, i, -2.0f, 2.0f);
  for (std::size_t i = 0; i < k.size(); ++i) k[i] = k2c::uniform_at(seed + 1, i, -2.0f, 2.0f);
  for (std::size_t i = 0; i < v.size(); ++i) v[i] = k2c::uniform_at(seed + 2, i, -1.0f, 1.0f);
  // The reference, in double: softmax(q·kᵀ/sqrt(hd)) over the visible keys, query head h reading
  // key-value head h / (H / Hkv).
  std::vector<double> o(B * T * qw, 0.0);
  for (int b = 0; b < B; ++b)
    for (int h = 0; h < heads; ++h)
      for (std::int64_t i = 0; i < T; ++i) {
        const int g = h / (heads / kv_heads);
        const std::int64_t last = causal ? i : T - 1;
        std::vector<double> p(last + 1);
        double top = -1e300, sum = 0;
        for (std::int64_t j = 0; j <= last; ++j) {
          double dot = 0;
          for (int d = 0; d < hd; ++d) dot += double(q[(b * T + i) * qw + h * hd + d]) * k[(b * T + j) * kw + g * hd + d];
          p[j] = dot / std::sqrt(double(hd));
          top = std::max(top, p[j]);
        }
        for (double& x : p) sum += (x = std::exp(x - top));
        for (std::int64_t j = 0; j <= last; ++j)
          for (int d = 0; d < hd; ++d) o[(b * T + i) * qw + h * hd + d] += p[j] / sum * v[(b * T + j) * kw + g * hd + d];
      }
  std::vector<std::vector<std::int64_t>> rows(n);  // each rank's rows of the whole, in local order
  for (int r = 0; r < n; ++r) {
    for (const std::int64_t chunk : {std::int64_t{r}, std::int64_t{2 * n - 1 - r}})
      for (int b = 0; b < B; ++b)
        for (std::int64_t t = 0; t < C; ++t) rows[r].push_back(b * T + chunk * C + t);
    std::vector<float> mine;
    for (const auto& [data, width] : {std::pair{&q, qw}, std::pair{&k, kw}, std::pair{&v, kw}})
      for (const std::int64_t row : rows[r]) mine.insert(mine.end(), data->begin() + row * width, data->begin() + (row + 1) * width);
    c.in.push_back(linear::floats(mine));
    c.out_bytes.push_back(rows[r].size() * qw * sizeof(float));
  }
  c.check = [=](const std::vector<Bytes>& got) -> std::string {
    for (int r = 0; r < n; ++r)
      for (std::size_t i = 0; i < rows[r].size(); ++i)
        for (std::int64_t e = 0; e < qw; ++e) {
          float g;
          std::memcpy(&g, got[r].data() + (i * qw + e) * sizeof(float), sizeof g);
          const double want = o[rows[r][i] * qw + e];
          if (!(std::abs(g - want) <= 1e-4))  // outputs are averages of values in [-1, 1]
            return "rank " + std::to_string(r) + ", o of token " + std::to_string(rows[r][i] % T) + " of sequence " +
                   std::to_string(rows[r][i] / T) + ", element " + std::to_string(e) + ": got " + std::to_string(g) +
                   ", want " + std::to_string(want);
        }
    return "";
  };
  return c;
}

}  // namespace ring

// Module 12's broadcast of the parameters from rank 0, and its naive all-reduce of the gradients.
// args: the number of parameters P (2 to 7), then each one's element count; the last one is
// frozen. broadcast_parameters: every rank gets values of its own for all P and answers what it
// holds afterwards, rank 0's to the bit. all_reduce_gradients: every rank gets gradients of its
// own for the P − 1 trainable ones and answers them afterwards, their average over the ranks.
namespace parameters {

float at(const Bytes& b, std::size_t i) {
  float v;
  std::memcpy(&v, b.data() + i * sizeof(float), sizeof v);
  return v;
}

Case draw(const std::string& kind, int n, int index, std::mt19937_64& rng) {
  const bool gradients = kind == "all_reduce_gradients";
  const int params = 2 + static_cast<int>(rng() % 6);
  Case c;
  c.args[0] = params;
  std::int64_t total = 0, trainable = 0;
  for (int p = 0; p < params; ++p) {
    // In turn: a few values each, hundreds, tens of thousands.
    const std::int64_t size = index % 3 == 0 ? 1 + rng() % 3 : index % 3 == 1 ? 1 + rng() % 999 : 10000 + rng() % 40000;
    c.args[1 + p] = size;
    total += size;
    if (p < params - 1) trainable += size;
  }
  const std::int64_t count = gradients ? trainable : total;
  c.what = kind + ", " + std::to_string(params) + " parameters, " + std::to_string(count) + " values on " +
           std::to_string(n) + " ranks";
  const std::uint64_t seed = rng();
  for (int r = 0; r < n; ++r) {
    std::vector<float> v(count);
    for (std::int64_t i = 0; i < count; ++i) v[i] = k2c::uniform_at(seed + r, i, -1.0f, 1.0f);
    c.in.push_back(linear::floats(v));
    c.out_bytes.push_back(count * sizeof(float));
  }
  std::vector<double> mean(count, 0.0);
  for (int r = 0; r < n; ++r)
    for (std::int64_t i = 0; i < count; ++i) mean[i] += at(c.in[r], i) / n;
  const Bytes first = c.in[0];
  c.check = [=](const std::vector<Bytes>& got) -> std::string {
    for (int r = 0; r < n; ++r)
      for (std::int64_t i = 0; i < count; ++i) {
        const double g = at(got[r], i), want = gradients ? mean[i] : at(first, i);
        // The average is rounded to fp32 (a few ulps); the broadcast moves bits.
        if (gradients ? !(std::abs(g - want) <= 1e-6) : std::memcmp(got[r].data() + i * 4, first.data() + i * 4, 4) != 0)
          return "rank " + std::to_string(r) + ", value " + std::to_string(i) + ": got " + std::to_string(g) +
                 (gradients ? ", want " : ", rank 0 had ") + std::to_string(want);
      }
    if (gradients)
      for (int r = 1; r < n; ++r)
        if (got[r] != got[0]) return "rank " + std::to_string(r) + "'s gradients differ from rank 0's";
    return "";
  };
  return c;
}

}  // namespace parameters

// Module 16's row collectives. args: M rows per rank, d columns. Rank r gets its shard [M, d]
// and its partial [n·M, d]; it answers all_gather_rows' whole [n·M, d] (rank q's shard at rows
// q·M, to the bit) followed by reduce_scatter_rows' shard [M, d] (rows r·M of the sum).
namespace rows {

Case draw(const std::string& kind, int n, int index, std::mt19937_64& rng) {
  // In turn: one row of one column, a few, many.
  const std::int64_t M = index % 3 == 0 ? 1 : index % 3 == 1 ? 2 + rng() % 9 : 100 + rng() % 200;
  const std::int64_t d = index % 3 == 0 ? 1 : 1 + rng() % 64;
  Case c;
  c.args[0] = M;
  c.args[1] = d;
  c.what = kind + ", " + std::to_string(M) + " rows of " + std::to_string(d) + " per rank on " + std::to_string(n) +
           " ranks";
  const std::uint64_t seed = rng();
  std::vector<std::vector<float>> shard(n), partial(n);
  std::vector<double> sum(n * M * d, 0.0);
  for (int r = 0; r < n; ++r) {
    for (std::int64_t i = 0; i < M * d; ++i) shard[r].push_back(k2c::uniform_at(seed + 2 * r, i, -1.0f, 1.0f));
    for (std::int64_t i = 0; i < n * M * d; ++i) {
      partial[r].push_back(k2c::uniform_at(seed + 2 * r + 1, i, -1.0f, 1.0f));
      sum[i] += partial[r][i];
    }
    std::vector<float> in = shard[r];
    in.insert(in.end(), partial[r].begin(), partial[r].end());
    c.in.push_back(linear::floats(in));
    c.out_bytes.push_back((n + 1) * M * d * sizeof(float));
  }
  c.check = [=](const std::vector<Bytes>& got) -> std::string {
    for (int r = 0; r < n; ++r) {
      for (int q = 0; q < n; ++q)
        if (std::memcmp(got[r].data() + q * M * d * sizeof(float), shard[q].data(), M * d * sizeof(float)) != 0)
          return "rank " + std::to_string(r) + ": all_gather_rows: rows " + std::to_string(q * M) + ".. are not rank " +
                 std::to_string(q) + "'s shard";
      for (std::int64_t i = 0; i < M * d; ++i) {
        const double g = parameters::at(got[r], n * M * d + i), want = sum[r * M * d + i];
        if (!(std::abs(g - want) <= 1e-5))  // fp32 sums of a few values in [-1, 1]
          return "rank " + std::to_string(r) + ": reduce_scatter_rows: row " + std::to_string(i / d) + ", column " +
                 std::to_string(i % d) + ": got " + std::to_string(g) + ", want " + std::to_string(want);
      }
    }
    return "";
  };
  return c;
}

}  // namespace rows


using Drawer = Case (*)(const std::string& kind, int ranks, int index, std::mt19937_64& rng);
Drawer find(const std::string& name) {
  for (const char* k : {"all_reduce_sum", "all_reduce_max", "reduce_scatter", "all_gather", "all_reduce_in_place"})
    if (name == k) return collectives::draw;
  for (const char* k : {"column_parallel_forward", "row_parallel_forward"})
    if (name == k) return linear::draw;
  for (const char* k : {"ring_attention_causal", "ring_attention_full"})
    if (name == k) return ring::draw;
  if (name == "row_collectives") return rows::draw;
  for (const char* k : {"broadcast_parameters", "all_reduce_gradients"})
    if (name == k) return parameters::draw;
  return nullptr;
}

// ---- the channel -----------------------------------------------------------------------------

// Reads exactly n bytes from fd before the deadline; "" or why not.
std::string receive(int fd, void* data, std::size_t n, Deadline deadline, const std::atomic<bool>& child_done) {
  auto* p = static_cast<char*>(data);
  while (n > 0) {
    if (Clock::now() >= deadline) return "no answer in time";
    pollfd pf{fd, POLLIN, 0};
    const int ready = poll(&pf, 1, 20);
    if (ready > 0) {
      const ssize_t got = recv(fd, p, n, 0);
      if (got <= 0) return "the rank closed its connection";
      p += got;
      n -= static_cast<std::size_t>(got);
    } else if (child_done.load()) {
      return "the test program ended";
    }
  }
  return "";
}

// The listening socket at `path`, reachable by the test program's user (the folder around it is
// that user's alone); -1 and `why` when it cannot be made.
int listen_at(const std::string& path, int ranks, std::string& why) {
  sockaddr_un addr{};
  if (path.size() >= sizeof addr.sun_path) {
    why = "the socket path " + path + " is too long";
    return -1;
  }
  addr.sun_family = AF_UNIX;
  std::memcpy(addr.sun_path, path.c_str(), path.size());
  unlink(path.c_str());
  const int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0 || bind(fd, reinterpret_cast<const sockaddr*>(&addr), sizeof addr) != 0 || listen(fd, ranks) != 0 ||
      chmod(path.c_str(), 0666) != 0) {
    why = "cannot listen at " + path + ": " + std::strerror(errno);
    if (fd >= 0) close(fd);
    return -1;
  }
  return fd;
}

int run(const Args& a) {
  const Drawer draw = find(a.name);
  if (draw == nullptr) {
    write_verdict(a.out, verdict("grader", "k2c_rank_witness has no witness named '" + a.name + "'"));
    return 0;
  }
  std::random_device entropy;
  std::mt19937_64 rng((static_cast<std::uint64_t>(entropy()) << 32) ^ entropy());
  // Every case drawn, and its reference computed, before any rank starts.
  std::vector<Case> cases;
  for (int k = 0; k < a.cases; ++k) cases.push_back(draw(a.name, a.ranks, k, rng));
  const std::string path = (a.cwd.empty() ? std::string(".") : a.cwd) + "/rank_witness.sock";
  std::string why;
  const int listener = listen_at(path, a.ranks, why);
  if (listener < 0) {
    write_verdict(a.out, verdict("grader", why));
    return 0;
  }

  // ---- from here on the test program runs: what goes wrong is the submission's ---------------
  write_verdict(a.out, verdict("submission", "the check ended before it could judge the test program"));
  std::atomic<bool> child_done{false};
  std::atomic<int> child_pid{0};
  k2c::grader::ProcessResult child;
  auto env = a.env;
  env.emplace_back("K2C_RANK_WITNESS", path);
  std::thread runner([&] {
    child = k2c::grader::run_process(a.program, {.env = env,
                                                 .cwd = a.cwd,
                                                 .timeout_s = a.timeout_s,
                                                 .uid = a.uid,
                                                 .gid = a.gid,
                                                 .on_start = [&](int pid) { child_pid = pid; }});
    child_done = true;
  });
  std::vector<int> rank_fd(a.ranks, -1);
  auto finish = [&](const std::string& fault, const std::string& problem) {
    for (int fd : rank_fd)
      if (fd >= 0) {
        wr::Job end;
        k2c::send_fully(fd, &end, sizeof end);
      }
    for (int i = 0; i < 100 && !child_done.load(); ++i) std::this_thread::sleep_for(std::chrono::milliseconds(50));
    if (const int pid = child_pid.load(); pid > 0 && !child_done.load()) kill(-pid, SIGKILL);
    runner.join();
    for (int fd : rank_fd)
      if (fd >= 0) close(fd);
    close(listener);
    unlink(path.c_str());
    json v = verdict(fault, problem);
    if (!fault.empty()) v["output"] = child.output.substr(child.output.size() > 4000 ? child.output.size() - 4000 : 0);
    json shapes = json::array();
    for (const Case& c : cases) shapes.push_back(c.what);
    if (fault.empty()) v["shapes"] = shapes;
    write_verdict(a.out, v);
    return 0;
  };

  // Every rank connects and says who it is.
  const Deadline start_deadline = Clock::now() + std::chrono::duration<double>(std::min(a.timeout_s, kStartSeconds));
  for (int connected = 0; connected < a.ranks;) {
    if (Clock::now() >= start_deadline) return finish("submission", "only " + std::to_string(connected) + " of " +
                                                                        std::to_string(a.ranks) + " ranks reached the checker in time");
    pollfd pf{listener, POLLIN, 0};
    if (poll(&pf, 1, 20) <= 0) {
      if (child_done.load())
        return finish("submission", "the test program ended (" + k2c::grader::describe_exit(child, a.timeout_s) +
                                        ") before every rank reached the checker");
      continue;
    }
    const int fd = accept4(listener, nullptr, nullptr, SOCK_CLOEXEC);
    if (fd < 0) continue;
    wr::Hello hello;
    if (const std::string late = receive(fd, &hello, sizeof hello, start_deadline, child_done); !late.empty()) {
      close(fd);
      return finish("submission", "a rank connected but did not say who it is: " + late);
    }
    hello.name[sizeof hello.name - 1] = '\0';
    if (hello.magic != wr::kMagic || hello.size != a.ranks || hello.rank < 0 || hello.rank >= a.ranks ||
        rank_fd[hello.rank] >= 0 || a.name != hello.name) {
      close(fd);
      return finish("submission", "a connection that is not one of the " + std::to_string(a.ranks) +
                                      " ranks of this check (rank " + std::to_string(hello.rank) + " of " +
                                      std::to_string(hello.size) + ", witness '" + hello.name + "')");
    }
    rank_fd[hello.rank] = fd;
    ++connected;
  }

  for (std::size_t k = 0; k < cases.size(); ++k) {
    const Case& c = cases[k];
    const std::string label = "case " + std::to_string(k + 1) + " (" + c.what + ")";
    // Every rank gets its job before any answer is read: the ranks run the collective together.
    for (int r = 0; r < a.ranks; ++r) {
      wr::Job job;
      job.command = wr::Command::run;
      job.index = static_cast<std::uint32_t>(k);
      std::memcpy(job.args, c.args, sizeof job.args);
      job.in_bytes = c.in[r].size();
      job.out_bytes = c.out_bytes[r];
      if (!k2c::send_fully(rank_fd[r], &job, sizeof job) || !k2c::send_fully(rank_fd[r], c.in[r].data(), c.in[r].size()))
        return finish("submission", label + ": rank " + std::to_string(r) + " stopped taking input");
    }
    const Deadline deadline = Clock::now() + std::chrono::duration<double>(std::min(a.timeout_s, kCaseSeconds));
    std::vector<Bytes> got(a.ranks);
    for (int r = 0; r < a.ranks; ++r) {
      const std::string rank = label + ": rank " + std::to_string(r);
      wr::Result res;
      if (const std::string late = receive(rank_fd[r], &res, sizeof res, deadline, child_done); !late.empty())
        return finish("submission", rank + ": " + late);
      res.message[sizeof res.message - 1] = '\0';
      if (res.magic != wr::kMagic || res.index != k) return finish("submission", rank + " sent something that is not its result");
      if (res.status != wr::Status::done) return finish("submission", rank + " failed: " + res.message);
      if (res.out_bytes != c.out_bytes[r])
        return finish("submission", rank + " sent " + std::to_string(res.out_bytes) + " bytes, not " +
                                        std::to_string(c.out_bytes[r]));
      got[r].resize(res.out_bytes);
      if (const std::string late = receive(rank_fd[r], got[r].data(), got[r].size(), deadline, child_done); !late.empty())
        return finish("submission", rank + ": " + late);
    }
    if (const std::string wrong = c.check(got); !wrong.empty()) return finish("submission", label + ": " + wrong);
  }
  return finish("", "");
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return run(parse(argc, argv));
  } catch (const std::exception& e) {
    std::fprintf(stderr, "k2c_rank_witness: %s\n", e.what());
    return 2;
  }
}
