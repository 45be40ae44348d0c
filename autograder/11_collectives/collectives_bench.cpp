// autograder/11_collectives/collectives_bench.cpp — k2c_collectives, in the manner of nccl-tests.
//
//   mpirun -np N k2c_collectives [-b 1M] [-e 1G] [-f 2] [-n 20] [-w 5] [-c 1] [-o out.json]
//                                [--min-chunk 512M] [--max-chunks 8]
//   (or: k2c collectives -np N ...)
//
// For each size S (bytes of the whole buffer, K/M/G suffixes, from -b to -e growing by -f) and
// each collective, times the library's version (NCCL or MPI, whichever backend this run uses)
// and the module's hand-written ring (all-reduce, reduce-scatter, all-gather; all-to-all has
// only the library's) and prints time, algbw = S / time and busbw = algbw × the nccl-tests
// factor (all-reduce 2(n-1)/n; reduce-scatter, all-gather, all-to-all (n-1)/n), with -c 1 the
// number of wrong elements. Inputs are small integers, so every sum is exact and checkable.
// Times are the slowest rank's mean over -n back-to-back iterations after -w warm-ups.
// --min-chunk and --max-chunks are handed to the ring as its RingOptions (the pipeline's chunking).
#include <mpi.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <string>
#include <vector>

#include "collectives.h"
#include "k2c/dist/bench.h"
#include "k2c/dist/runtime.h"

namespace kd = k2c::dist;
namespace col = k2c::collectives;
using kd::DType;
using kd::ReduceOp;

namespace {

struct Row {
  std::string op, variant;
  std::size_t bytes;
  double us, algbw, busbw;
  long wrong;
};

}  // namespace

int main(int argc, char** argv) {
  std::size_t begin = 1 << 20, end = std::size_t{1} << 30;
  double factor = 2;
  int iters = 20, warmup = 5;
  bool check = true;
  std::string out_json;
  col::RingOptions ring;
  const kd::FlagSetters flags{
      {"-b", [&](const std::string& v) { begin = kd::parse_size(v); }},
      {"-e", [&](const std::string& v) { end = kd::parse_size(v); }},
      {"-f", [&](const std::string& v) { factor = std::stod(v); }},
      {"-n", [&](const std::string& v) { iters = std::stoi(v); }},
      {"-w", [&](const std::string& v) { warmup = std::stoi(v); }},
      {"-c", [&](const std::string& v) { check = std::stoi(v) != 0; }},
      {"-o", [&](const std::string& v) { out_json = v; }},
      {"--min-chunk", [&](const std::string& v) { ring.min_chunk_bytes = kd::parse_size(v); }},
      {"--max-chunks", [&](const std::string& v) { ring.max_chunks = std::stoi(v); }}};
  if (!kd::parse_flags(argc, argv, flags,
                       "[-b 1M] [-e 1G] [-f 2] [-n 20] [-w 5] [-c 1] [-o out.json] [--min-chunk 512M] [--max-chunks 8]"))
    return 2;
  return kd::run(argc, argv, [&](kd::Communicator& w) {
    kd::PointToPointView p2p(w);
    const int n = w.size(), r = w.rank();
    std::vector<Row> rows;
    if (r == 0)
      std::printf("# k2c_collectives: %d ranks, backend %s, fp32, %d iterations after %d warm-ups\n"
                  "# %-14s %-8s %12s %10s %10s %10s %8s\n", n, kd::to_string(w.backend()).c_str(), iters,
                  warmup, "op", "variant", "size(B)", "time(us)", "algbw", "busbw", "#wrong");
    for (std::size_t bytes = begin; bytes <= end; bytes = static_cast<std::size_t>(bytes * factor)) {
      const std::size_t count = bytes / sizeof(float) / n * n;  // divisible by n for the library
      if (count == 0) continue;
      const std::size_t sz = count * sizeof(float), per = count / n;
      std::vector<float> host(count);
      for (std::size_t i = 0; i < count; ++i) host[i] = static_cast<float>((r + 1) + i % 7);
      kd::Buffer in(w, sz), out(w, sz);
      w.to_backend(in.get(), host.data(), sz);

      auto time_us = [&](const std::function<void()>& op) {
        for (int i = 0; i < warmup; ++i) op();
        w.synchronize();
        w.barrier();
        const auto t0 = std::chrono::steady_clock::now();
        for (int i = 0; i < iters; ++i) op();
        w.synchronize();
        double us = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count() / iters, worst = 0;
        MPI_Allreduce(&us, &worst, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
        return worst;
      };
      // Wrong elements against the exact expectation, summed over ranks.
      auto wrong = [&](std::size_t elems, std::size_t first, const std::function<double(std::size_t)>& want) {
        long bad = 0, total = 0;
        if (check) {
          std::vector<float> got(elems);
          w.to_host(got.data(), out.get(), elems * sizeof(float));
          for (std::size_t i = 0; i < elems; ++i) bad += got[i] != want(first + i);
        }
        MPI_Allreduce(&bad, &total, 1, MPI_LONG, MPI_SUM, MPI_COMM_WORLD);
        return total;
      };
      const double ranks_sum = n * (n + 1) / 2.0;
      auto sum_at = [&](std::size_t i) { return ranks_sum + n * static_cast<double>(i % 7); };
      auto own_at = [&](std::size_t i) { return static_cast<double>((i / per) + 1 + i % 7); };  // all-gather: block b from rank b
      auto record = [&](const char* op, const char* variant, double us, double bus_factor, long bad) {
        const double algbw = sz / (us * 1e-6) / 1e9;
        rows.push_back({op, variant, sz, us, algbw, algbw * bus_factor, bad});
        if (r == 0)
          std::printf("  %-14s %-8s %12zu %10.1f %10.2f %10.2f %8ld\n", op, variant, sz, us, algbw,
                      algbw * bus_factor, bad);
      };
      const double ar = 2.0 * (n - 1) / n, ag = static_cast<double>(n - 1) / n;
      const char* lib = w.backend() == kd::Backend::nccl ? "nccl" : "mpi";

      double us = time_us([&] { w.all_reduce(in.get(), out.get(), count, DType::f32, ReduceOp::sum); });
      record("all_reduce", lib, us, ar, wrong(count, 0, sum_at));
      us = time_us([&] { col::ring_all_reduce(p2p, in.get(), out.get(), count, DType::f32, ReduceOp::sum, ring); });
      record("all_reduce", "ring", us, ar, wrong(count, 0, sum_at));

      us = time_us([&] { w.reduce_scatter(in.get(), out.get(), per, DType::f32, ReduceOp::sum); });
      record("reduce_scatter", lib, us, ag, wrong(per, r * per, sum_at));
      us = time_us([&] { col::ring_reduce_scatter(p2p, in.get(), out.get(), count, DType::f32, ReduceOp::sum, ring); });
      record("reduce_scatter", "ring", us, ag, wrong(per, r * per, sum_at));

      // All-gather: rank r contributes block r of its input, whose values are (r + 1) + i % 7.
      kd::Buffer block(w, per * sizeof(float));
      w.copy(block.get(), static_cast<const char*>(in.get()) + r * per * sizeof(float), per * sizeof(float));
      us = time_us([&] { w.all_gather(block.get(), out.get(), per, DType::f32); });
      record("all_gather", lib, us, ag, wrong(count, 0, own_at));
      us = time_us([&] { col::ring_all_gather(p2p, block.get(), out.get(), count, DType::f32); });
      record("all_gather", "ring", us, ag, wrong(count, 0, own_at));

      us = time_us([&] { w.all_to_all(in.get(), out.get(), per, DType::f32); });
      record("all_to_all", lib, us, ag, 0);
    }
    if (r == 0 && !out_json.empty()) {
      std::ofstream f(out_json);
      f << "{\"ranks\": " << n << ", \"backend\": \"" << kd::to_string(w.backend()) << "\", \"results\": [";
      for (std::size_t i = 0; i < rows.size(); ++i)
        f << (i ? ",\n  " : "\n  ") << "{\"op\": \"" << rows[i].op << "\", \"variant\": \"" << rows[i].variant
          << "\", \"bytes\": " << rows[i].bytes << ", \"time_us\": " << rows[i].us << ", \"algbw_gbs\": "
          << rows[i].algbw << ", \"busbw_gbs\": " << rows[i].busbw << ", \"wrong\": " << rows[i].wrong << "}";
      f << "\n]}\n";
      std::printf("# wrote %s\n", out_json.c_str());
    }
  });
}
