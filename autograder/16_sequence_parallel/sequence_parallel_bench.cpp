// autograder/16_sequence_parallel/sequence_parallel_bench.cpp — k2c_sequence_parallel: when ring
// attention hides its ring, against the length of the chunks.
//
//   mpirun -np N k2c_sequence_parallel [-c 2048,4096,8192,16384] [-b 1] [-H 32] [-K 8] [-d 128]
//                                      [-n 5] [-w 2] [-o out.json]
//   (or: k2c run -np N build/solutions/bin/k2c_sequence_parallel ...)
//
// For each chunk length C, sequences of T = 2·N·C tokens (each rank holds 2·C of them), causal,
// -H query and -K key-value heads of -d: forward and backward timed three ways in one run:
//   T1   the model library's attention on each rank's own device alone, over N sequences of 2·C
//        tokens: the same work as one rank's share of the ring, with nothing to exchange
//   TR   the module's RingAttention over the N ranks (sequence_parallel.h)
//   Th   one hop of the ring alone: this rank's k and v to the next rank, the previous rank's in
// and prints T1, TR, the ratio of useful FLOP rates (ring per GPU over one GPU; 1 is perfect) and
// the compute-to-communication ratio of a ring step, (T1 / N) / (3·Th): a step computes 1/N of the
// rank's work and moves about three hops' bytes (keys and values forward, again backward, and
// their gradients). Lecture 16, section 5, predicts it to grow linearly with C: work per step is
// quadratic in the chunk, the bytes of a hop linear. Times are medians of -n repeats after -w
// warm-ups, each the slowest rank's (k2c/dist/timing.h).
//
// On the NCCL backend the attention runs on the model library's GPU backend (bf16 flash
// attention); on MPI on its CPU backend, where the defaults shrink to sizes a CPU finishes.
#include <algorithm>
#include <cstdio>
#include <string>
#include <vector>

#include "k2c/core/random.h"
#include "k2c/dist/bench.h"
#include "k2c/dist/runtime.h"
#include "k2c/dist/timing.h"
#include "k2c/model/backend.h"
#include "k2c/model/ops.h"
#include "sequence_parallel.h"

namespace kd = k2c::dist;
namespace km = k2c::model;
namespace sp = k2c::sequence_parallel;

namespace {

struct Options {
  std::vector<std::int64_t> chunks;
  int batch = 1, heads = 0, kv_heads = 0, head_dim = 0;
  int repeats = 5, warmup = 2;
  std::string json;
};

struct Row {
  std::int64_t chunk, seq_len;
  double t1_ms, ring_ms, hop_ms;
  int ranks;
  // Useful pairs per GPU: the ring's share of B·T(T+1)/2, the one-GPU problem's N·B·L(L+1)/2.
  double ratio() const {
    const double T = static_cast<double>(seq_len), L = T / ranks;
    return (T * (T + 1) / 2 / ranks / ring_ms) / (ranks * L * (L + 1) / 2 / t1_ms);
  }
  double compute_to_comm() const { return (t1_ms / ranks) / (3 * hop_ms); }
};

km::Tensor random_tensor(km::Ops& ops, km::MemoryLedger& ledger, km::Shape shape, std::uint64_t seed) {
  km::Tensor t(ops.memory(), ledger, km::Category::activations, shape);
  std::vector<float> host(static_cast<std::size_t>(t.numel()));
  k2c::fill_uniform(host, seed);
  ops.upload(t, host.data());
  return t;
}

Row measure(kd::Communicator& w, km::Ops& ops, std::int64_t C, const Options& o) {
  const int n = w.size(), B = o.batch, H = o.heads, Hkv = o.kv_heads, hd = o.head_dim;
  const std::int64_t L = 2 * C, T = n * L, rows = B * L;
  km::MemoryLedger ledger;
  km::ParamList params;
  km::Context ctx{ops, ledger, params};
  // The ring's inputs are this rank's rows; the one-GPU problem reads the same memory as n
  // sequences of L tokens each (n times the rows): values do not change the time.
  km::Tensor q = random_tensor(ops, ledger, {n * rows, H * hd}, 1), k = random_tensor(ops, ledger, {n * rows, Hkv * hd}, 2),
             v = random_tensor(ops, ledger, {n * rows, Hkv * hd}, 3), dout = random_tensor(ops, ledger, {n * rows, H * hd}, 4);
  km::Tensor o1 = ctx.tensor(q.shape()), l1 = ctx.tensor({n * B, H, L}), dq1 = ctx.tensor(q.shape()),
             dk1 = ctx.tensor(k.shape()), dv1 = ctx.tensor(k.shape());
  const km::Tensor ql = q.rows(0, rows), kl = k.rows(0, rows), vl = v.rows(0, rows), dol = dout.rows(0, rows);
  km::Tensor ol = ctx.tensor(ql.shape()), ll = ctx.tensor({2 * B, H, C}), dql = ctx.tensor(ql.shape()),
             dkl = ctx.tensor(kl.shape()), dvl = ctx.tensor(kl.shape()), kin = ctx.tensor(kl.shape()),
             vin = ctx.tensor(kl.shape());
  const sp::RingAttention ring(ctx, w, {B, T, H, Hkv, hd, true});
  const km::AttentionShape one{n * B, static_cast<int>(L), static_cast<int>(L), H, Hkv, hd, true, 0, 0};

  const kd::TimeStepOptions opt{.warmup = o.warmup, .repeats = o.repeats};
  Row row{C, T, 0, 0, 0, n};
  row.t1_ms = kd::time_step(w, [&] {
    ops.attention_forward(one, q, k, v, o1, l1);
    ops.fill(dk1, 0.0f);
    ops.fill(dv1, 0.0f);
    ops.attention_backward(one, q, k, v, o1, l1, dout, dq1, dk1, dv1);
  }, opt).median_ms;
  row.ring_ms = kd::time_step(w, [&] {
    ring.forward(ctx, ql, kl, vl, ol, ll);
    ring.backward(ctx, ql, kl, vl, ol, ll, dol, dql, dkl, dvl);
  }, opt).median_ms;
  const int next = (w.rank() + 1) % n, prev = (w.rank() + n - 1) % n;
  const std::size_t count = static_cast<std::size_t>(kl.numel());
  row.hop_ms = kd::time_step(w, [&] {
    const kd::Ticket a = w.start_send_recv(kl.raw(), count, next, kin.raw(), count, prev, kd::DType::f32);
    const kd::Ticket b = w.start_send_recv(vl.raw(), count, next, vin.raw(), count, prev, kd::DType::f32);
    w.wait(a);
    w.wait(b);
  }, opt).median_ms;
  return row;
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  std::string chunks;
  const kd::FlagSetters flags{
      {"-c", [&](const std::string& v) { chunks = v; }},
      {"-b", [&](const std::string& v) { o.batch = std::stoi(v); }},
      {"-H", [&](const std::string& v) { o.heads = std::stoi(v); }},
      {"-K", [&](const std::string& v) { o.kv_heads = std::stoi(v); }},
      {"-d", [&](const std::string& v) { o.head_dim = std::stoi(v); }},
      {"-n", [&](const std::string& v) { o.repeats = std::stoi(v); }},
      {"-w", [&](const std::string& v) { o.warmup = std::stoi(v); }},
      {"-o", [&](const std::string& v) { o.json = v; }}};
  if (!kd::parse_flags(argc, argv, flags,
                       "[-c C1,C2,...] [-b batch] [-H q_heads] [-K kv_heads] [-d head_dim] [-n repeats] [-w warmups] "
                       "[-o out.json]"))
    return 2;
  return kd::run(argc, argv, [&](kd::Communicator& w) {
    const bool gpu = w.backend() == kd::Backend::nccl;
    km::Ops* ops = &km::backend_for(gpu, w.compute_stream(), km::GpuMath::bf16);
    if (chunks.empty()) chunks = gpu ? "2048,4096,8192,16384" : "8,16,32,64";
    if (o.heads == 0) o.heads = gpu ? 32 : 4;
    if (o.kv_heads == 0) o.kv_heads = gpu ? 8 : 2;
    if (o.head_dim == 0) o.head_dim = gpu ? 128 : 16;
    o.chunks = kd::parse_counts(chunks);
    const int n = w.size();
    if (w.rank() == 0)
      std::printf("# k2c_sequence_parallel: causal ring attention forward + backward, batch %d, %d/%d heads of %d, "
                  "%d rank(s), %s backend, %s\n"
                  "# %7s %8s %10s %10s %7s %9s %13s\n",
                  o.batch, o.heads, o.kv_heads, o.head_dim, n, kd::to_string(w.backend()).c_str(),
                  ops->name().c_str(), "C", "T", "T1 ms", "TR ms", "ratio", "hop ms", "compute/comm");
    std::vector<Row> rows;
    for (std::int64_t C : o.chunks) {
      rows.push_back(measure(w, *ops, C, o));
      const Row& r = rows.back();
      if (w.rank() == 0)
        std::printf("  %7lld %8lld %10.3f %10.3f %7.3f %9.3f %13.2f\n", static_cast<long long>(r.chunk),
                    static_cast<long long>(r.seq_len), r.t1_ms, r.ring_ms, r.ratio(), r.hop_ms, r.compute_to_comm());
    }
    if (w.rank() == 0 && !o.json.empty()) {
      std::vector<kd::JsonFields> out(rows.size());
      for (std::size_t i = 0; i < rows.size(); ++i) {
        const Row& r = rows[i];
        out[i].add("chunk", r.chunk).add("seq_len", r.seq_len).add("t1_ms", r.t1_ms).add("ring_ms", r.ring_ms)
            .add("ratio", r.ratio()).add("hop_ms", r.hop_ms).add("compute_to_comm", r.compute_to_comm());
      }
      kd::write_sweep_json(o.json,
                           kd::run_fields(w, ops->name()).add("batch", o.batch).add("q_heads", o.heads)
                               .add("kv_heads", o.kv_heads).add("head_dim", o.head_dim),
                           out);
    }
  });
}
