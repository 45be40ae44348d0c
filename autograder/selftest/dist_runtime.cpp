// dist_runtime.cpp — the runtime's additions for Part II (run by CTest under mpirun -np 1 to 4 on
// the MPI backend; it runs unchanged on NCCL, K2C_BACKEND=nccl, one GPU per rank):
//   overlap     four started collectives and a started exchange in flight at once, with local
//               work between start and wait; waited in the order started, in reverse, and not
//               at all (synchronize()); a ticket of a collective is refused a second wait; the
//               counts of all_to_all_v may go before the wait;
//   avg         all_reduce / reduce_scatter / reduce with avg on f32, f64 (and bf16) against the
//               mean; refused on i32, and by reduce_local, with std::invalid_argument;
//   bf16        the host conversions on the cases that matter (ties to even, overflow, NaN);
//               reduce_local; all_reduce sum exact on small integers, exactly one rounding at
//               2 ranks, within the rounding bound beyond; max; all_gather, all_to_all_v and
//               broadcast move bit patterns unchanged;
//   streams     compute_stream() is shared by a world and its splits (nullptr on MPI); a split
//               of a split works after its parent is gone; a result passed from one group's
//               collective to another's needs no synchronize() in between;
//   groups      group({axes}) of every dp × cp × tp (and pp) shape of the job's size: the world
//               ranks that differ only in those axes, in world-rank order; cached; order of the
//               list irrelevant; pipeline neighbours agree with the gathered coordinates and
//               carry a message down the pipeline;
//   counting    each operation's calls and bytes equal the formulas of k2c/dist/counting.h, per
//               label, through a grid's groups and a default split; report(); reset(); the
//               waits and the bytes they complete (wait, synchronize, free with an exchange open);
//   time_step   every rank gets the same result, and it is the slowest rank's time;
//   library     library_collectives() counts each collective, started or blocking, barriers and
//               collectives of a split included, and no point-to-point operation; the
//               Communicator behind a PointToPointView, one pointer away, is counted the same.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <map>
#include <memory>
#include <numeric>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "k2c/dist/counting.h"
#include "k2c/dist/grid.h"
#include "k2c/dist/runtime.h"
#include "k2c/dist/timing.h"

namespace kd = k2c::dist;
using kd::DType;
using kd::ReduceOp;

namespace {

void require(bool ok, const std::string& what) {
  if (!ok) throw std::runtime_error("runtime check failed: " + what);
}

// Host vectors in and out of the backend's memory, so every check runs on NCCL too.
template <class T>
std::unique_ptr<kd::Buffer> upload(kd::Communicator& c, const std::vector<T>& v, std::size_t extra = 0) {
  auto b = std::make_unique<kd::Buffer>(c, (v.size() + extra) * sizeof(T));
  if (!v.empty()) c.to_backend(b->get(), v.data(), v.size() * sizeof(T));
  return b;
}
template <class T>
std::vector<T> download(kd::Communicator& c, const kd::Buffer& b, std::size_t count) {
  std::vector<T> v(count);
  if (count) c.to_host(v.data(), b.get(), count * sizeof(T));
  return v;
}

// Every rank's values, gathered in rank order.
template <class T>
std::vector<T> gather(kd::Communicator& c, const std::vector<T>& mine, DType t) {
  auto in = upload(c, mine);
  kd::Buffer out(c, mine.size() * c.size() * sizeof(T));
  c.all_gather(in->get(), out.get(), mine.size(), t);
  return download<T>(c, out, mine.size() * c.size());
}

template <class F>
void expect_invalid(F&& f, const std::string& says, const std::string& what) {
  try {
    f();
  } catch (const std::invalid_argument& e) {
    require(std::string(e.what()).find(says) != std::string::npos,
            what + ": the message does not say '" + says + "': " + e.what());
    return;
  }
  require(false, what + ": accepted");
}

// A deterministic value in [-1, 1) per (rank, index, salt).
float noise(int r, std::size_t i, int salt) {
  std::uint64_t h = (static_cast<std::uint64_t>(r) << 40) ^ (static_cast<std::uint64_t>(salt) << 32) ^ i;
  h = (h ^ (h >> 33)) * 0xff51afd7ed558ccdull;
  h = (h ^ (h >> 33)) * 0xc4ceb9fe1a85ec53ull;
  h ^= h >> 33;
  return static_cast<float>(h >> 40) / static_cast<float>(1u << 23) - 1.0f;
}
// Small integers: their sums over up to 4 ranks are exact in every type, bf16 included.
int small_int(int r, std::size_t i, int salt) { return static_cast<int>((r * 7 + i * 3 + salt) % 17) - 8; }

// ------------------------------------------------------------------------------ overlap -----

void overlap(kd::Communicator& w) {
  const int n = w.size(), r = w.rank(), right = (r + 1) % n, left = (r + n - 1) % n;
  constexpr std::size_t C = std::size_t{1} << 14;  // 64 KiB of f32: past the eager limit
  const std::size_t blk = 1000;                     // reduce_scatter's block per rank
  // all_to_all_v: rank r sends (r + p) % 3 + 1 elements to p, so p receives as much from r.
  auto a2a_count = [](int from, int to) { return static_cast<std::size_t>((from + to) % 3 + 1); };
  std::vector<std::size_t> sc(n), so(n), rc(n), ro(n);
  std::size_t sent = 0, received = 0;
  for (int p = 0; p < n; ++p) {
    sc[p] = a2a_count(r, p), so[p] = sent, sent += sc[p];
    rc[p] = a2a_count(p, r), ro[p] = received, received += rc[p];
  }
  auto a2a_value = [](int from, int to, std::size_t k) { return from * 1000 + to * 10 + static_cast<int>(k); };

  for (int round = 0; round < 3; ++round) {  // 0: waits in start order, 1: reverse, 2: synchronize()
    const std::string how = round == 0 ? "waited in start order" : round == 1 ? "waited in reverse" : "synchronize()";
    std::vector<float> ar(C);
    std::vector<int> ag(C);
    std::vector<double> rs(blk * n);
    std::vector<int> a2a(sent), ring(C);
    for (std::size_t i = 0; i < C; ++i) ar[i] = static_cast<float>(small_int(r, i, round));
    for (std::size_t i = 0; i < C; ++i) ag[i] = r * 100000 + static_cast<int>(i);
    for (std::size_t i = 0; i < rs.size(); ++i) rs[i] = noise(r, i, round);
    for (int p = 0; p < n; ++p)
      for (std::size_t k = 0; k < sc[p]; ++k) a2a[so[p] + k] = a2a_value(r, p, k);
    for (std::size_t i = 0; i < C; ++i) ring[i] = r * 7 + static_cast<int>(i);
    auto ar_buf = upload(w, ar), ag_in = upload(w, ag), rs_in = upload(w, rs), a2a_in = upload(w, a2a);
    auto ring_in = upload(w, ring);
    kd::Buffer ag_out(w, C * n * sizeof(int)), rs_out(w, blk * sizeof(double)), a2a_out(w, received * sizeof(int)),
        ring_out(w, C * sizeof(int));
    // Local work on other buffers, issued while everything is in flight.
    std::vector<float> l1(C, 1.5f), l2(C, 2.25f);
    auto la = upload(w, l1), lb = upload(w, l2);
    kd::Buffer lc(w, C * sizeof(float));

    std::vector<kd::Ticket> t;
    t.push_back(w.start_all_reduce(ar_buf->get(), ar_buf->get(), C, DType::f32, ReduceOp::sum));  // in place
    t.push_back(w.start_all_gather(ag_in->get(), ag_out.get(), C, DType::i32));
    t.push_back(w.start_send_recv(ring_in->get(), C, right, ring_out.get(), C, left, DType::i32));
    t.push_back(w.start_reduce_scatter(rs_in->get(), rs_out.get(), blk, DType::f64, ReduceOp::max));
    {
      // Copies of the counts, gone before the wait: the runtime must not need them any more.
      const std::vector<std::size_t> sc2 = sc, so2 = so, rc2 = rc, ro2 = ro;
      t.push_back(w.start_all_to_all_v(a2a_in->get(), sc2, so2, a2a_out.get(), rc2, ro2, DType::i32));
    }
    for (std::size_t i = 1; i < t.size(); ++i)
      for (std::size_t j = 0; j < i; ++j) require(t[i].id != t[j].id, "two open tickets share an id");
    w.reduce_local(lc.get(), la->get(), lb->get(), C, DType::f32, ReduceOp::sum);
    w.copy(la->get(), lc.get(), C * sizeof(float));
    if (round == 0)
      for (kd::Ticket k : t) w.wait(k);
    else if (round == 1)
      for (auto k = t.rbegin(); k != t.rend(); ++k) w.wait(*k);
    else
      w.synchronize();

    const std::vector<float> got_ar = download<float>(w, *ar_buf, C);
    for (std::size_t i = 0; i < C; ++i) {
      int want = 0;
      for (int q = 0; q < n; ++q) want += small_int(q, i, round);
      if (got_ar[i] != static_cast<float>(want)) require(false, how + ": all_reduce element " + std::to_string(i));
    }
    const std::vector<int> got_ag = download<int>(w, ag_out, C * n);
    for (int q = 0; q < n; ++q)
      for (std::size_t i = 0; i < C; ++i)
        if (got_ag[q * C + i] != q * 100000 + static_cast<int>(i))
          require(false, how + ": all_gather from " + std::to_string(q));
    const std::vector<double> got_rs = download<double>(w, rs_out, blk);
    for (std::size_t i = 0; i < blk; ++i) {
      double want = noise(0, r * blk + i, round);
      for (int q = 1; q < n; ++q) want = std::max(want, static_cast<double>(noise(q, r * blk + i, round)));
      if (got_rs[i] != want) require(false, how + ": reduce_scatter max element " + std::to_string(i));
    }
    const std::vector<int> got_a2a = download<int>(w, a2a_out, received);
    for (int p = 0; p < n; ++p)
      for (std::size_t k = 0; k < rc[p]; ++k)
        require(got_a2a[ro[p] + k] == a2a_value(p, r, k), how + ": all_to_all_v block from " + std::to_string(p));
    const std::vector<int> got_ring = download<int>(w, ring_out, C);
    for (std::size_t i = 0; i < C; ++i)
      if (got_ring[i] != left * 7 + static_cast<int>(i))
        require(false, how + ": send_recv element " + std::to_string(i));
    const std::vector<float> got_local = download<float>(w, *la, C);
    require(std::all_of(got_local.begin(), got_local.end(), [](float v) { return v == 3.75f; }),
            how + ": local work done while the collectives were in flight");

    // Every ticket is closed now: by its wait, or by synchronize().
    for (kd::Ticket k : t) {
      bool refused = false;
      try {
        w.wait(k);
      } catch (const std::logic_error&) {
        refused = true;
      }
      require(refused, how + ": a closed ticket of a collective was accepted");
    }
  }
  w.synchronize();
}

// ---------------------------------------------------------------------------------- avg -----

template <class T>
void avg_of(kd::Communicator& w, DType t, double eps) {
  const int n = w.size(), r = w.rank();
  const std::size_t count = 999, blk = 37;
  std::vector<T> x(count), y(blk * n);
  for (std::size_t i = 0; i < count; ++i) x[i] = static_cast<T>(noise(r, i, 1));
  for (std::size_t i = 0; i < y.size(); ++i) y[i] = static_cast<T>(noise(r, i, 2));
  auto mean = [&](std::size_t i, int salt) {
    double s = 0;
    for (int q = 0; q < n; ++q) s += static_cast<T>(noise(q, i, salt));
    return s / n;
  };
  // Sum, then divide (MPI), or each value scaled, then summed (NCCL): a few roundings apart.
  const double tol = 4.0 * (n + 1) * eps;
  const std::string what = "avg of " + kd::to_string(t);

  auto xb = upload(w, x);
  kd::Buffer out(w, count * sizeof(T));
  w.all_reduce(xb->get(), out.get(), count, t, ReduceOp::avg);
  std::vector<T> got = download<T>(w, out, count);
  for (std::size_t i = 0; i < count; ++i)
    require(std::abs(got[i] - mean(i, 1)) <= tol, what + ": all_reduce element " + std::to_string(i));

  // Started, in place: the division happens when the ticket completes.
  const kd::Ticket tk = w.start_all_reduce(xb->get(), xb->get(), count, t, ReduceOp::avg);
  w.wait(tk);
  got = download<T>(w, *xb, count);
  for (std::size_t i = 0; i < count; ++i)
    require(std::abs(got[i] - mean(i, 1)) <= tol, what + ": started in-place all_reduce element " + std::to_string(i));

  auto yb = upload(w, y);
  kd::Buffer ys(w, blk * sizeof(T));
  w.reduce_scatter(yb->get(), ys.get(), blk, t, ReduceOp::avg);
  got = download<T>(w, ys, blk);
  for (std::size_t i = 0; i < blk; ++i)
    require(std::abs(got[i] - mean(r * blk + i, 2)) <= tol, what + ": reduce_scatter element " + std::to_string(i));

  const int root = n - 1;
  auto xb2 = upload(w, x);
  kd::Buffer at_root(w, count * sizeof(T));
  w.reduce(xb2->get(), at_root.get(), count, t, ReduceOp::avg, root);
  if (r == root) {
    got = download<T>(w, at_root, count);
    for (std::size_t i = 0; i < count; ++i)
      require(std::abs(got[i] - mean(i, 1)) <= tol, what + ": reduce element " + std::to_string(i));
  }
}

void avg(kd::Communicator& w) {
  avg_of<float>(w, DType::f32, 1.2e-7);
  avg_of<double>(w, DType::f64, 2.3e-16);
  kd::Buffer a(w, 64), b(w, 64);
  const std::string says = "avg needs a floating-point type";
  expect_invalid([&] { w.all_reduce(a.get(), b.get(), 4, DType::i32, ReduceOp::avg); }, says, "all_reduce avg i32");
  expect_invalid([&] { w.start_all_reduce(a.get(), b.get(), 4, DType::i32, ReduceOp::avg); }, says,
                 "start_all_reduce avg i32");
  expect_invalid([&] { w.reduce_scatter(a.get(), b.get(), 1, DType::i32, ReduceOp::avg); }, says,
                 "reduce_scatter avg i32");
  expect_invalid([&] { w.reduce(a.get(), b.get(), 4, DType::i32, ReduceOp::avg, 0); }, says, "reduce avg i32");
  expect_invalid([&] { w.reduce_local(a.get(), a.get(), b.get(), 4, DType::f32, ReduceOp::avg); },
                 "not an operation on two elements", "reduce_local avg");
  require(kd::to_string(ReduceOp::avg) == "avg" && kd::to_string(DType::bf16) == "bf16", "names");
  // The refusals happened before anything was issued: the communicator still works.
  w.barrier();
}

// --------------------------------------------------------------------------------- bf16 -----

void bf16_conversions() {
  using kd::bf16_to_float;
  using kd::float_to_bf16;
  auto bits = [](std::uint32_t u) {
    float f;
    std::memcpy(&f, &u, sizeof f);
    return f;
  };
  require(kd::dtype_size(DType::bf16) == 2, "bf16 is 2 bytes");
  require(float_to_bf16(1.0f) == 0x3F80 && bf16_to_float(0x3F80) == 1.0f, "1.0");
  require(bf16_to_float(0x4049) == 3.140625f, "widening is exact");
  require(float_to_bf16(bits(0x3F808000)) == 0x3F80, "a tie rounds to the even neighbour (down)");
  require(float_to_bf16(bits(0x3F818000)) == 0x3F82, "a tie rounds to the even neighbour (up)");
  require(float_to_bf16(bits(0x3F808001)) == 0x3F81, "past the tie rounds up");
  require(float_to_bf16(bits(0x3F807FFF)) == 0x3F80, "below the tie rounds down");
  require(float_to_bf16(bits(0xBF818000)) == 0xBF82, "negative ties alike");
  require(float_to_bf16(bits(0x7F7FFFFF)) == 0x7F80, "past the largest bf16: infinity");
  require(float_to_bf16(bits(0x7F800000)) == 0x7F80 && float_to_bf16(bits(0xFF800000)) == 0xFF80, "infinities");
  require(float_to_bf16(-0.0f) == 0x8000, "-0");
  const std::uint16_t nan = float_to_bf16(bits(0x7F800001));  // a NaN whose payload is in the low half
  require((nan & 0x7F80) == 0x7F80 && (nan & 0x007F) != 0, "a NaN stays a NaN");
}

void bf16(kd::Communicator& w) {
  const int n = w.size(), r = w.rank();
  using kd::bf16_to_float;
  using kd::float_to_bf16;

  // reduce_local on the backend: ties, and max with negative values.
  {
    const std::vector<std::uint16_t> a = {0x3F80, 0x3F81, 0xC000, 0x3F80, 0x0000},
                                     b = {0x3B80, 0x3B80, 0xBF80, 0x4000, 0x8000};
    auto ab = upload(w, a), bb = upload(w, b);
    kd::Buffer out(w, a.size() * 2);
    w.reduce_local(out.get(), ab->get(), bb->get(), a.size(), DType::bf16, ReduceOp::sum);
    const std::vector<std::uint16_t> sum = download<std::uint16_t>(w, out, a.size());
    require(sum[0] == 0x3F80 && sum[1] == 0x3F82, "reduce_local bf16: 1 + 2^-8 ties to even");
    require(bf16_to_float(sum[2]) == -3.0f && bf16_to_float(sum[3]) == 3.0f && bf16_to_float(sum[4]) == 0.0f,
            "reduce_local bf16 sums");
    w.reduce_local(out.get(), ab->get(), bb->get(), a.size(), DType::bf16, ReduceOp::max);
    const std::vector<std::uint16_t> mx = download<std::uint16_t>(w, out, a.size());
    require(mx[0] == 0x3F80 && mx[1] == 0x3F81 && mx[2] == 0xBF80 && mx[3] == 0x4000, "reduce_local bf16 max");
  }

  // all_reduce sum of small integers: exact.
  const std::size_t count = 4099;
  {
    std::vector<std::uint16_t> x(count);
    for (std::size_t i = 0; i < count; ++i) x[i] = float_to_bf16(static_cast<float>(small_int(r, i, 3)));
    auto xb = upload(w, x);
    kd::Buffer out(w, count * 2);
    w.all_reduce(xb->get(), out.get(), count, DType::bf16, ReduceOp::sum);
    const std::vector<std::uint16_t> got = download<std::uint16_t>(w, out, count);
    for (std::size_t i = 0; i < count; ++i) {
      int want = 0;
      for (int q = 0; q < n; ++q) want += small_int(q, i, 3);
      require(bf16_to_float(got[i]) == static_cast<float>(want), "bf16 all_reduce of small integers, element " +
                                                                     std::to_string(i));
    }
  }

  // all_reduce sum of values that round: one rounding at 2 ranks (exactly the host's), within
  // the bound of n - 1 roundings beyond. The first elements are ties at 2 ranks.
  {
    auto value = [](int q, std::size_t i) -> std::uint16_t {
      if (i == 0) return q == 0 ? 0x3F80 : 0x3B80;  // 1 + 2^-8: ties down to 1
      if (i == 1) return q == 0 ? 0x3F81 : 0x3B80;  // (1 + 2^-7) + 2^-8: ties up to 1 + 2^-6
      return float_to_bf16(noise(q, i, 4) * 8.0f);
    };
    std::vector<std::uint16_t> x(count);
    for (std::size_t i = 0; i < count; ++i) x[i] = value(r, i);
    auto xb = upload(w, x);
    kd::Buffer out(w, count * 2);
    w.all_reduce(xb->get(), out.get(), count, DType::bf16, ReduceOp::sum);
    const std::vector<std::uint16_t> got = download<std::uint16_t>(w, out, count);
    for (std::size_t i = 0; i < count; ++i) {
      double exact = 0, magnitude = 0;
      for (int q = 0; q < n; ++q) {
        exact += bf16_to_float(value(q, i));
        magnitude += std::abs(bf16_to_float(value(q, i)));
      }
      if (n <= 2) {
        const std::uint16_t want = float_to_bf16(static_cast<float>(exact));  // exact in fp32, one rounding
        require(got[i] == want, "bf16 all_reduce at " + std::to_string(n) + " ranks, element " + std::to_string(i) +
                                    ": not the sum rounded to nearest even");
      } else {
        // n - 1 additions, each rounded with a relative error of at most u = 2^-8: the classic
        // bound gamma_(n-1) = (n-1)u / (1 - (n-1)u) times the sum of magnitudes.
        const double u = std::ldexp(1.0, -8), bound = (n - 1) * u / (1 - (n - 1) * u) * magnitude;
        require(std::abs(bf16_to_float(got[i]) - exact) <= bound,
                "bf16 all_reduce element " + std::to_string(i) + " beyond the rounding bound");
      }
    }
    // max picks one of the values: exact at any n.
    w.all_reduce(xb->get(), out.get(), count, DType::bf16, ReduceOp::max);
    const std::vector<std::uint16_t> mx = download<std::uint16_t>(w, out, count);
    for (std::size_t i = 0; i < count; ++i) {
      float want = bf16_to_float(value(0, i));
      for (int q = 1; q < n; ++q) want = std::max(want, bf16_to_float(value(q, i)));
      require(bf16_to_float(mx[i]) == want, "bf16 all_reduce max element " + std::to_string(i));
    }
    // avg of equal small values: sum then divide, or scale then sum, both land on the value
    // within a rounding.
    std::vector<std::uint16_t> same(count, float_to_bf16(3.0f));
    auto sb = upload(w, same);
    w.all_reduce(sb->get(), sb->get(), count, DType::bf16, ReduceOp::avg);
    const std::vector<std::uint16_t> av = download<std::uint16_t>(w, *sb, count);
    for (std::size_t i = 0; i < count; ++i)
      require(std::abs(bf16_to_float(av[i]) - 3.0f) <= 3.0f * n * std::ldexp(1.0f, -8), "bf16 avg");
  }

  // Moves keep the bits, whatever they are (NaN payloads included).
  {
    auto pattern = [](int q, std::size_t i) {
      return static_cast<std::uint16_t>((q * 40503u + i * 2654435761u) >> 7);
    };
    const std::size_t m = 513;
    std::vector<std::uint16_t> mine(m);
    for (std::size_t i = 0; i < m; ++i) mine[i] = pattern(r, i);
    const std::vector<std::uint16_t> all = gather(w, mine, DType::bf16);
    for (int q = 0; q < n; ++q)
      for (std::size_t i = 0; i < m; ++i) require(all[q * m + i] == pattern(q, i), "bf16 all_gather bits");

    // all_to_all_v: q + 1 elements from every rank q to every other, started and waited.
    std::vector<std::size_t> sc(n), so(n), rc(n), ro(n);
    std::size_t sent = 0, received = 0;
    for (int p = 0; p < n; ++p) {
      sc[p] = static_cast<std::size_t>(r + 1), so[p] = sent, sent += sc[p];
      rc[p] = static_cast<std::size_t>(p + 1), ro[p] = received, received += rc[p];
    }
    std::vector<std::uint16_t> s(sent);
    for (int p = 0; p < n; ++p)
      for (std::size_t k = 0; k < sc[p]; ++k) s[so[p] + k] = pattern(r * 8 + p, k);
    auto sb = upload(w, s);
    kd::Buffer rb(w, received * 2);
    w.wait(w.start_all_to_all_v(sb->get(), sc, so, rb.get(), rc, ro, DType::bf16));
    const std::vector<std::uint16_t> got = download<std::uint16_t>(w, rb, received);
    for (int p = 0; p < n; ++p)
      for (std::size_t k = 0; k < rc[p]; ++k)
        require(got[ro[p] + k] == pattern(p * 8 + r, k), "bf16 all_to_all_v bits");

    std::vector<std::uint16_t> bc(m);
    for (std::size_t i = 0; i < m; ++i) bc[i] = r == 0 ? pattern(99, i) : 0;
    auto bb = upload(w, bc);
    w.broadcast(bb->get(), m, DType::bf16, 0);
    const std::vector<std::uint16_t> got_bc = download<std::uint16_t>(w, *bb, m);
    for (std::size_t i = 0; i < m; ++i) require(got_bc[i] == pattern(99, i), "bf16 broadcast bits");
  }
}

// ------------------------------------------------------------------------------ streams -----

void streams(kd::Communicator& w) {
  const int n = w.size(), r = w.rank();
  const bool nccl = w.backend() == kd::Backend::nccl;
  require(nccl == (w.compute_stream() != nullptr), "compute_stream(): a stream on NCCL, nullptr on MPI");
  auto half = w.split(r % 2, r);  // two groups (one at 1 rank)
  require(half->compute_stream() == w.compute_stream(), "a split shares the world's compute stream");
  std::unique_ptr<kd::Communicator> quarter = half->split(0, r);  // all of `half`, in rank order
  half.reset();  // the parent goes first: the stream it shared must live on
  require(quarter->compute_stream() == w.compute_stream(), "a split of a split shares it too");

  // A result handed from one group's collective to another's with no synchronize() between:
  // ordered on the shared stream. Sum over `quarter` (ranks of one parity), then over the world.
  const std::size_t count = 1 << 12;
  std::vector<int> x(count);
  for (std::size_t i = 0; i < count; ++i) x[i] = r + static_cast<int>(i);
  auto xb = upload(w, x);
  kd::Buffer mid(w, count * sizeof(int)), out(w, count * sizeof(int));
  quarter->all_reduce(xb->get(), mid.get(), count, DType::i32, ReduceOp::sum);
  w.all_reduce(mid.get(), out.get(), count, DType::i32, ReduceOp::sum);
  const std::vector<int> got = download<int>(w, out, count);
  // Every rank's group sum, summed over the world: each rank's x counted (its group's size) times.
  for (std::size_t i = 0; i < count; ++i) {
    long want = 0;
    for (int q = 0; q < n; ++q) {
      const int group_size = (n + 1 - q % 2) / 2;  // ranks of q's parity
      want += static_cast<long>(group_size) * (q + static_cast<long>(i));
    }
    require(got[i] == want, "a collective of one group, then one of another, without synchronize()");
  }
  quarter.reset();
}

// ------------------------------------------------------------------------------- groups -----

// Every (dp, pp, cp, tp) whose product is n, with ep 1.
std::vector<kd::GridShape> shapes_of(int n) {
  std::vector<kd::GridShape> out;
  for (int dp = 1; dp <= n; ++dp)
    for (int pp = 1; pp <= n; ++pp)
      for (int cp = 1; cp <= n; ++cp)
        for (int tp = 1; tp <= n; ++tp)
          if (dp * pp * cp * tp == n) out.push_back({.dp = dp, .pp = pp, .cp = cp, .tp = tp});
  return out;
}

void groups(kd::Communicator& w) {
  const int n = w.size(), r = w.rank();
  using kd::Axis;
  std::vector<kd::GridShape> shapes = shapes_of(n);
  if (w.backend() == kd::Backend::nccl && shapes.size() > 4) {
    // Every split is a new NCCL communicator (a fraction of a second each, a dozen per shape):
    // on GPUs the four shapes with the most axes in play stand for the rest.
    auto in_play = [](const kd::GridShape& s) { return (s.dp > 1) + (s.pp > 1) + (s.cp > 1) + (s.tp > 1); };
    std::stable_sort(shapes.begin(), shapes.end(),
                     [&](const kd::GridShape& a, const kd::GridShape& b) { return in_play(a) > in_play(b); });
    shapes.resize(4);
  }
  for (const kd::GridShape& shape : shapes) {
    kd::ProcessGrid grid(w, shape);
    const std::string where = grid.describe();
    // Everyone's coordinates, gathered: the independent truth the grid's answers are held to.
    const std::vector<int> mine(grid.coords().begin(), grid.coords().end());
    const std::vector<int> all = gather(w, mine, DType::i32);
    auto coord_of = [&](int q, Axis a) { return all[q * 5 + static_cast<int>(a)]; };
    require(grid.world_rank(grid.coords()) == r, where + ": world_rank of my coordinates");

    const std::vector<std::vector<Axis>> sets = {
        {Axis::dp, Axis::cp}, {Axis::dp, Axis::tp}, {Axis::cp, Axis::tp}, {Axis::dp, Axis::cp, Axis::tp},
        {Axis::pp, Axis::tp}, {Axis::dp, Axis::pp, Axis::ep, Axis::cp, Axis::tp}};
    for (const std::vector<Axis>& set : sets) {
      kd::Communicator* g = nullptr;
      if (set.size() == 2) g = &grid.group({set[0], set[1]});
      else if (set.size() == 3) g = &grid.group({set[0], set[1], set[2]});
      else g = &grid.group({set[0], set[1], set[2], set[3], set[4]});
      std::string name;
      for (Axis a : set) name += (name.empty() ? "" : "+") + kd::to_string(a);
      // Members: the ranks equal to me outside the set, in world-rank order.
      std::vector<int> want;
      for (int q = 0; q < n; ++q) {
        bool same = true;
        for (int a = 0; a < 5; ++a)
          if (std::find(set.begin(), set.end(), static_cast<Axis>(a)) == set.end() &&
              coord_of(q, static_cast<Axis>(a)) != mine[a])
            same = false;
        if (same) want.push_back(q);
      }
      require(g->size() == static_cast<int>(want.size()), where + ": size of group " + name);
      require(gather(*g, std::vector<int>{r}, DType::i32) == want, where + ": members of group " + name);
      require(want[g->rank()] == r, where + ": my rank in group " + name);
    }
    // Cached, whatever the order of the list; one axis is the single-axis group.
    require(&grid.group({Axis::cp, Axis::dp}) == &grid.group({Axis::dp, Axis::cp}), where + ": group cached");
    require(&grid.group({Axis::tp, Axis::tp}) == &grid.group(Axis::tp), where + ": one axis = group(axis)");
    expect_invalid([&] { grid.group(std::initializer_list<Axis>{}); }, "at least one axis", "an empty group");

    // Pipeline neighbours, against the gathered coordinates.
    int want_prev = -1, want_next = -1;
    for (int q = 0; q < n; ++q) {
      bool same = true;
      for (int a = 0; a < 5; ++a)
        if (a != static_cast<int>(Axis::pp) && coord_of(q, static_cast<Axis>(a)) != mine[a]) same = false;
      if (!same) continue;
      if (coord_of(q, Axis::pp) == grid.coord(Axis::pp) - 1) want_prev = q;
      if (coord_of(q, Axis::pp) == grid.coord(Axis::pp) + 1) want_next = q;
    }
    require(grid.prev_stage() == want_prev && grid.next_stage() == want_next, where + ": pipeline neighbours");
    require(grid.is_first_stage() == (want_prev < 0) && grid.is_last_stage() == (want_next < 0),
            where + ": first and last stage");
    // A message down the pipeline: each stage receives its predecessor's world rank, then passes
    // its own on (a forward pass; the ends have no neighbour).
    std::vector<int> got{-1};
    auto buf = upload(w, got);
    if (!grid.is_first_stage()) w.recv(buf->get(), 1, DType::i32, grid.prev_stage());
    got = download<int>(w, *buf, 1);
    require(got[0] == want_prev, where + ": the message from the previous stage");
    auto me = upload(w, std::vector<int>{r});
    if (!grid.is_last_stage()) w.send(me->get(), 1, DType::i32, grid.next_stage());
    w.synchronize();
  }
}

// ----------------------------------------------------------------------------- counting -----

void counting(kd::Communicator& w) {
  const int n = w.size(), r = w.rank();
  kd::CountingCommunicator c(w, "world");
  const kd::GridShape shape = n % 2 == 0 ? kd::GridShape{.dp = n / 2, .tp = 2} : kd::GridShape{.dp = n};
  kd::ProcessGrid grid(c, shape);
  require(c.counts().empty(), "making a grid moves no data");

  // Zeroed, so that the reductions below combine numbers, not whatever the memory held.
  const std::vector<char> zeros(4096 * n, 0);
  kd::Buffer a(c, 4096), b(c, 4096 * n);
  c.to_backend(a.get(), zeros.data(), 4096);
  c.to_backend(b.get(), zeros.data(), 4096 * n);
  c.all_reduce(a.get(), b.get(), 100, DType::f32, ReduceOp::sum);                    // 400
  c.wait(c.start_all_reduce(a.get(), a.get(), 50, DType::f64, ReduceOp::max));       // 400, started
  c.reduce_scatter(b.get(), a.get(), 10, DType::f32, ReduceOp::sum);                 // 10·n·4
  c.wait(c.start_reduce_scatter(b.get(), a.get(), 3, DType::bf16, ReduceOp::sum));   // 3·n·2, started
  c.all_gather(a.get(), b.get(), 10, DType::bf16);                                   // 10·n·2
  c.wait(c.start_all_gather(a.get(), b.get(), 4, DType::i32));                       // 4·n·4, started
  c.broadcast(a.get(), 20, DType::i32, 0);                                           // 80
  c.reduce(a.get(), b.get(), 20, DType::f32, ReduceOp::sum, 0);                      // 80
  c.all_to_all(a.get(), b.get(), 5, DType::f32);                                     // 5·n·4
  std::vector<std::size_t> sc(n), so(n), rc(n), ro(n);
  std::size_t sent = 0, received = 0;
  for (int p = 0; p < n; ++p) {
    sc[p] = static_cast<std::size_t>((r + p) % 3 + 1), so[p] = sent, sent += sc[p];
    rc[p] = static_cast<std::size_t>((p + r) % 3 + 1), ro[p] = received, received += rc[p];
  }
  c.all_to_all_v(a.get(), sc, so, b.get(), rc, ro, DType::f64);                      // Σ sc · 8
  c.wait(c.start_all_to_all_v(a.get(), sc, so, b.get(), rc, ro, DType::i32));        // Σ sc · 4, started
  kd::PointToPointView p2p(c);  // what module 11's ring sees: counted all the same
  p2p.send_recv(a.get(), 7, (r + 1) % n, b.get(), 7, (r + n - 1) % n, DType::i32);   // 28
  if (n >= 2 && r == 0) c.send(a.get(), 3, DType::f32, 1);                           // 12
  if (n >= 2 && r == 1) c.recv(b.get(), 3, DType::f32, 0);                           // 12
  c.barrier();
  kd::Communicator& tp = grid.group(kd::Axis::tp);
  tp.all_reduce(a.get(), a.get(), 16, DType::f32, ReduceOp::sum);                    // 64 under "tp"
  kd::Communicator& dp_tp = grid.group({kd::Axis::dp, kd::Axis::tp});
  dp_tp.all_gather(a.get(), b.get(), 2, DType::f32);                                 // 2·n·4 under "dp+tp"
  std::unique_ptr<kd::Communicator> other = c.split(0, r);
  other->all_reduce(a.get(), a.get(), 1, DType::i32, ReduceOp::sum);                 // 4 under "world/split"
  c.synchronize();

  const std::uint64_t N = static_cast<std::uint64_t>(n);
  auto expect = [&](const std::string& label, const std::string& op, std::uint64_t calls, std::uint64_t started,
                    std::uint64_t bytes) {
    const kd::Traffic t = c.count(label, op);
    require(t.calls == calls && t.started == started && t.bytes == bytes,
            label + " " + op + ": calls " + std::to_string(t.calls) + " started " + std::to_string(t.started) +
                " bytes " + std::to_string(t.bytes) + ", want " + std::to_string(calls) + " / " +
                std::to_string(started) + " / " + std::to_string(bytes) + "\n" + c.report());
  };
  expect("world", "all_reduce", 2, 1, 400 + 400);
  expect("world", "reduce_scatter", 2, 1, 10 * N * 4 + 3 * N * 2);
  expect("world", "all_gather", 2, 1, 10 * N * 2 + 4 * N * 4);
  expect("world", "broadcast", 1, 0, 80);
  expect("world", "reduce", 1, 0, 80);
  expect("world", "all_to_all", 1, 0, 5 * N * 4);
  expect("world", "all_to_all_v", 2, 1, sent * 8 + sent * 4);
  expect("world", "send_recv", 1, 1, 28);
  expect("world", "send", n >= 2 && r == 0 ? 1 : 0, 0, n >= 2 && r == 0 ? 12 : 0);
  expect("world", "recv", n >= 2 && r == 1 ? 1 : 0, 0, n >= 2 && r == 1 ? 12 : 0);
  expect("world", "barrier", 1, 0, 0);
  expect("tp", "all_reduce", 1, 0, 64);
  expect("dp+tp", "all_gather", 1, 0, 2 * N * 4);
  expect("world/split", "all_reduce", 1, 0, 4);
  const kd::Traffic all_reduces = c.total("all_reduce");
  require(all_reduces.calls == 4 && all_reduces.bytes == 800 + 64 + 4, "total over labels");
  require(c.counts().at("tp").at("all_reduce").calls == 1, "the map accessor");
  const std::string report = c.report();
  require(report.find("dp+tp") != std::string::npos && report.find("all_to_all_v") != std::string::npos,
          "report names labels and operations:\n" + report);
  c.reset();
  require(c.counts().empty() && c.count("tp", "all_reduce").calls == 0, "reset() empties the shared ledger");
  tp.barrier();
  require(c.count("tp", "barrier").calls == 1, "a group counts into the ledger after a reset");

  // Groups made with plain split() (a student's grid), named by their members' axes once
  // name_groups is set; the gathering of the members is not counted.
  c.name_groups([shape](const std::vector<int>& ranks) { return kd::group_label(shape, ranks); });
  c.reset();
  const kd::GridCoords at = kd::grid_coords(shape, r);
  require(at == grid.coords(), "grid_coords is ProcessGrid's layout");
  std::unique_ptr<kd::Communicator> pairs = c.split(r / 2, r);  // tp where tp = 2, else dp (one odd out)
  std::unique_ptr<kd::Communicator> alone = c.split(r, 0);      // one rank each
  // A split of a split, over the ranks of one parity: named by their world ranks, which differ
  // along dp at 4 ranks ({1, 3}), where their ranks inside the parent ({0, 1}) would say tp.
  std::unique_ptr<kd::Communicator> parity = c.split(r % 2, r);
  std::unique_ptr<kd::Communicator> nested = parity->split(0, r);
  pairs->all_reduce(a.get(), a.get(), 2, DType::f32, ReduceOp::sum);
  alone->all_reduce(a.get(), a.get(), 3, DType::f32, ReduceOp::sum);
  nested->all_reduce(a.get(), a.get(), 4, DType::f32, ReduceOp::sum);
  c.synchronize();
  std::vector<int> pair_ranks, parity_ranks;
  for (int q = 0; q < n; ++q) {
    if (q / 2 == r / 2) pair_ranks.push_back(q);
    if (q % 2 == r % 2) parity_ranks.push_back(q);
  }
  std::map<std::string, std::uint64_t> want;
  want[kd::group_label(shape, pair_ranks)] += 8;
  want["self"] += 12;
  want[kd::group_label(shape, parity_ranks)] += 16;
  std::map<std::string, std::uint64_t> got;
  for (const auto& [label, ops] : c.counts())
    for (const auto& [op, t] : ops) got[label] += op == "all_reduce" ? t.bytes : 1000000;  // nothing else counted
  require(got == want, "groups named by their members' world ranks:\n" + c.report());
  if (n == 4) require(kd::group_label(shape, parity_ranks) == "dp", "the nested group at 4 ranks is a dp group");
  bool refused = false;
  try {
    dynamic_cast<kd::CountingCommunicator&>(*pairs).name_groups({});
  } catch (const std::invalid_argument&) {
    refused = true;
  }
  require(refused, "name_groups on a split is refused");
  require(kd::group_label({.dp = 2, .ep = 2, .tp = 2}, {0, 2, 4, 6}) == "dp+ep" &&
              kd::group_label({.dp = 2, .ep = 2, .tp = 2}, {3}) == "self",
          "group_label names the axes along which the members differ");

  // Waits: a wait completes its ticket's bytes; synchronize(), and free() while an exchange is
  // open, complete every open one; a split's count into its parent's; reset() clears them.
  kd::CountingCommunicator d(w, "waits");
  require(d.waits() == 0 && d.waited_bytes() == 0, "no waits yet");
  kd::Ticket t = d.start_all_reduce(a.get(), a.get(), 10, DType::f32, ReduceOp::sum);  // 40 bytes
  require(d.waits() == 0 && d.waited_bytes() == 0, "starting is not waiting");
  d.wait(t);
  require(d.waits() == 1 && d.waited_bytes() == 40, "a wait completes its ticket's 40 bytes");
  t = d.start_all_reduce(a.get(), a.get(), 20, DType::f32, ReduceOp::sum);              // 80 bytes
  d.free(d.alloc(4));
  require(d.waits() == 2 && d.waited_bytes() == 120, "free() with an exchange open counts as its wait");
  d.wait(t);  // the ticket itself is still to be waited for once; its bytes are counted already
  require(d.waits() == 3 && d.waited_bytes() == 120, "a ticket's bytes are counted once");
  d.free(d.alloc(4));
  require(d.waits() == 3, "free() with nothing open is no wait");
  auto half = d.split(r % 2, r);
  half->start_all_reduce(a.get(), a.get(), 1, DType::f32, ReduceOp::sum);  // closed by synchronize()
  half->synchronize();
  require(d.waits() == 4 && d.waited_bytes() == 124, "a split's waits count into its parent's");
  d.reset();
  require(d.waits() == 0 && d.waited_bytes() == 0, "reset() clears the waits");
}

// ---------------------------------------------------------------------------- time_step -----

void timing(kd::Communicator& w) {
  const int n = w.size(), r = w.rank();
  int runs = 0;
  kd::Buffer x(w, 256);
  // Rank r takes about (r + 1) · 2 ms: the step's time is the slowest rank's, about 2n ms.
  const kd::TimingResult t = kd::time_step(
      w,
      [&] {
        ++runs;
        w.all_reduce(x.get(), x.get(), 16, DType::f32, ReduceOp::sum);
        std::this_thread::sleep_for(std::chrono::milliseconds(2 * (r + 1)));
      },
      {.warmup = 2, .repeats = 4});
  require(runs == 6, "time_step runs warm-up + repeats");
  require(t.repeat_ms.size() == 4 && t.min_ms <= t.median_ms && t.median_ms <= t.max_ms, "time_step's fields");
  require(t.median_ms >= 2.0 * n, "time_step reports the slowest rank: " + std::to_string(t.median_ms) + " ms");
  const std::vector<double> medians = gather(w, std::vector<double>{t.median_ms}, DType::f64);
  for (double m : medians) require(m == t.median_ms, "time_step gives every rank the same median");
  const std::vector<double> repeats = gather(w, t.repeat_ms, DType::f64);
  for (int q = 0; q < n; ++q)
    for (std::size_t i = 0; i < 4; ++i) require(repeats[q * 4 + i] == t.repeat_ms[i], "the same repeats everywhere");
  expect_invalid([&] { kd::time_step(w, [] {}, {.warmup = 0, .repeats = 0}); }, "repeats >= 1", "zero repeats");
}

}  // namespace

// What module 11's tests hold a hand-written collective to (k2c/dist/communicator.h).
void library(kd::Communicator& w) {
  const int n = w.size(), r = w.rank();
  kd::Buffer a(w, 64), b(w, 64 * static_cast<std::size_t>(n));
  std::vector<unsigned char> zeros(64 * static_cast<std::size_t>(n), 0);
  w.to_backend(a.get(), zeros.data(), 64);
  std::uint64_t before = kd::library_collectives();
  auto counted = [&](std::uint64_t at_least, const std::string& what) {
    const std::uint64_t now = kd::library_collectives();
    require(now >= before + at_least, what + ": library_collectives() moved by " + std::to_string(now - before) +
                                          ", want at least " + std::to_string(at_least));
    before = now;
  };
  w.all_reduce(a.get(), a.get(), 4, DType::f32, ReduceOp::sum);
  counted(1, "all_reduce");
  w.wait(w.start_all_gather(a.get(), b.get(), 4, DType::f32));
  counted(1, "start_all_gather");
  w.broadcast(a.get(), 4, DType::f32, 0);
  w.barrier();
  counted(2, "broadcast and barrier");
  std::unique_ptr<kd::Communicator> split = w.split(0, r);
  before = kd::library_collectives();  // split() itself may use one
  split->all_reduce(a.get(), a.get(), 1, DType::i32, ReduceOp::sum);
  counted(1, "a split's all_reduce");
  kd::PointToPointView p2p(w);
  p2p.send_recv(a.get(), 4, (r + 1) % n, b.get(), 4, (r + n - 1) % n, DType::f32);
  w.synchronize();
  require(kd::library_collectives() == before, "point-to-point exchanges are not library collectives");
  // The view's one member, after its vtable pointer: what a ring that goes looking finds.
  kd::Communicator& behind = **reinterpret_cast<kd::Communicator**>(reinterpret_cast<char*>(&p2p) + sizeof(void*));
  require(&behind == &w, "the Communicator is where module 11's tests assume a ring could find it");
  behind.all_reduce(a.get(), a.get(), 4, DType::f32, ReduceOp::sum);
  counted(1, "all_reduce through the view's Communicator");
}

int main(int argc, char** argv) {
  return kd::run(argc, argv, [](kd::Communicator& w) {
    const auto t0 = std::chrono::steady_clock::now();
    const std::pair<const char*, void (*)(kd::Communicator&)> parts[] = {
        {"overlap", overlap}, {"avg", avg},         {"bf16", bf16},          {"streams", streams},
        {"groups", groups},   {"counting", counting}, {"time_step", timing}, {"library", library}};
    bf16_conversions();
    for (const auto& [name, part] : parts) {
      part(w);
      w.barrier();
      if (w.rank() == 0)
        std::printf("runtime: %-9s OK (%.2f s)\n", name,
                    std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    }
    if (w.rank() == 0) std::printf("runtime additions on %d rank(s), backend %s OK\n", w.size(),
                                   kd::to_string(w.backend()).c_str());
  });
}
