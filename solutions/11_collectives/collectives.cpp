// solutions/11_collectives/collectives.cpp — reference solution of module 11
// (contract: collectives.h).
//
// The ring. n ranks in a circle; at every step each rank sends one block to its right neighbour
// and receives one from its left with a single exchange, so all n links carry data at once.
//
//   reduce-scatter: n-1 steps. At step s rank r sends block (r-s-1) mod n — its partial sum so
//     far — and receives block (r-s-2) mod n from the left, adding its own contribution. A block
//     picks up one rank's data per hop, so after n-1 hops block r, fully reduced, sits on rank r.
//   all-gather: n-1 steps. At step s rank r forwards block (r-s) mod n, which it received the
//     step before (or owns, at s = 0), and receives block (r-s-1) mod n.
//   all-reduce = reduce-scatter + all-gather.
//
// Traffic: each rank sends (n-1)/n of the buffer in each phase, 2(n-1)/n for all-reduce — the
// minimum for any all-reduce algorithm, independent of n. Time ≈ 2(n-1)·α + 2(n-1)/n · S/B,
// with α the per-message latency and B the link bandwidth: bandwidth-optimal, latency linear in
// n (trees win for small messages; NCCL switches).
//
// The pipeline. Done block by block, the reduction sits on the critical path: a step's reduce
// waits for its whole transfer, and the next transfer waits for the reduce. So every block can be
// cut into `chunks` pieces with the exchanges started ahead (start_send_recv): the exchange of
// chunk c+1 is on the wire while chunk c is reduced, on the other stream, and in the all-reduce
// the all-gather of a chunk starts as soon as its last reduce is issued.
//
// What it buys depends on what one exchange costs, and that was measured, not assumed. On 2 H200s
// over NVLink (1 GiB fp32 all-reduce, ring / NCCL bus bandwidth, measured back to back):
//   at most 1 chunk per block (no pipeline)       0.92
//   at most 2 (chunks of 256 MiB)                 0.89
//   at most 4 (128 MiB)                           0.86
//   at most 8 (64 MiB)                            0.79
// and at 2 GiB: 0.91 with 1 chunk, 1.00 with 2 chunks of 512 MiB. Each exchange pays a start-up
// cost (a 64 MiB exchange ran at ~230 GB/s where a 512 MiB one ran at ~300), so below a few
// hundred MiB a chunk costs more in start-up than its share of the reduction (~0.4 ms for all
// 512 MiB, i.e. under 10% of the all-reduce) saves. Hence chunks of at least RingOptions::min_chunk_bytes =
// 512 MiB: a 1 GiB all-reduce on 2 ranks runs unpipelined, 2 GiB in two chunks, 4 GiB in four.
// On a slower link, or with a costlier reduction, the balance moves towards smaller chunks.
//
// The order of issue, one rank, item j = (step j / chunks, chunk j % chunks), step-major:
//   start(0); for j: start(j+1) if its data is ready; wait(j); reduce(j); [all-gather of the
//   chunk, if j was its last reduce]
// Item j+1 sends what the reduce of item j+1-chunks wrote, issued earlier when chunks ≥ 2; with
// one chunk it must wait for reduce(j), and the ring runs unpipelined as before. Two receive
// slots alternate: item j+2 reuses item j's slot and is started only after reduce(j) is issued,
// which start_send_recv orders it after. Chunks are disjoint, so the all-gather of chunk c
// (writing `out` in chunk c of every block) never meets the reduce-scatter of another chunk.
// Within one chunk's all-gather, a step forwards what the step before received, so it waits on
// that step's ticket first (at n = 2 there is one step, and no such wait).
//
// Details that matter for speed: the first reduce-scatter step sends straight from `data` and
// reduces data + received into `out` (out = a + b), so no full copy of the input is ever made;
// the all-gather receives straight into `out`; temporary space comes from p2p.scratch(), reused
// across calls, because a cudaMalloc of a 512 MiB receive block on every call costs real time.
// Each element is reduced exactly once per hop, by the rank that receives it, in a fixed order
// (own data (op) received), so every rank ends with bit-identical results, however many chunks.
#include "collectives.h"

#include <algorithm>
#include <stdexcept>
#include <vector>

namespace k2c::collectives {
namespace {

int mod(int a, int n) { return ((a % n) + n) % n; }

const char* at(const void* base, std::size_t elements, DType t) {
  return static_cast<const char*>(base) + elements * dist::dtype_size(t);
}
char* at(void* base, std::size_t elements, DType t) {
  return static_cast<char*>(base) + elements * dist::dtype_size(t);
}

// Block 0 is a largest block (block_of puts the extra elements first), and its chunk 0 the
// largest chunk of all.
std::size_t largest_block(std::size_t count, int n) { return dist::block_of(count, n, 0).size; }

// Chunks of at least options.min_chunk_bytes (512 MiB by default: the measurements at the top of
// the file), at most options.max_chunks (each one more adds a start-up cost). The same on every
// rank, since it depends only on count, n, the type and the options, which every rank passes alike.
int chunks_for(std::size_t count, int n, DType t, const RingOptions& options) {
  if (options.min_chunk_bytes == 0 || options.max_chunks < 1)
    throw std::invalid_argument("ring: RingOptions needs min_chunk_bytes > 0 and max_chunks >= 1");
  const std::size_t bytes = largest_block(count, n) * dist::dtype_size(t);
  return static_cast<int>(
      std::clamp<std::size_t>(bytes / options.min_chunk_bytes, 1, static_cast<std::size_t>(options.max_chunks)));
}

// Chunk k of block b: block_of once more, one level down. Sender and receiver compute the same
// sizes, as they must for every exchange.
dist::Block chunk_of(std::size_t count, int n, int b, int chunks, int k) {
  const dist::Block blk = dist::block_of(count, n, b);
  const dist::Block c = dist::block_of(blk.size, chunks, k);
  return {blk.offset + c.offset, c.size};
}

// Pipelined reduce-scatter over the blocks of `work` (count elements). The final reduce of each
// chunk (block rank()) goes to `mine_out` instead, at the chunk's offset within the block, and is
// then announced through on_final(k). Receives land in two alternating slots of `slot_elems`
// elements each at `slots`. Block b of `work` is read only after it was written, except at step
// 0, where the outgoing block comes from `data` itself.
template <class OnFinal>
void reduce_scatter_in(PointToPoint& p2p, const void* data, void* work, void* mine_out, void* slots,
                       std::size_t slot_elems, std::size_t count, DType t, ReduceOp op, int chunks,
                       OnFinal on_final) {
  const int n = p2p.size(), r = p2p.rank();
  const int right = mod(r + 1, n), left = mod(r - 1, n);
  const int items = (n - 1) * chunks, first_final = (n - 2) * chunks;
  const std::size_t mine_offset = dist::block_of(count, n, r).offset;

  auto sent = [&](int j) { return chunk_of(count, n, mod(r - j / chunks - 1, n), chunks, j % chunks); };
  auto received = [&](int j) { return chunk_of(count, n, mod(r - j / chunks - 2, n), chunks, j % chunks); };
  auto slot = [&](int j) { return at(slots, (j % 2) * slot_elems, t); };
  auto start = [&](int j) {
    const dist::Block out_b = sent(j);
    const void* src = j < chunks ? at(data, out_b.offset, t) : at(work, out_b.offset, t);
    return p2p.start_send_recv(src, out_b.size, right, slot(j), received(j).size, left, t);
  };

  dist::Ticket current = start(0);
  for (int j = 0; j < items; ++j) {
    const bool has_next = j + 1 < items, ahead = has_next && chunks > 1;
    dist::Ticket next{};
    if (ahead) next = start(j + 1);  // on the wire while item j is reduced
    p2p.wait(current);
    // dst[in_b] = data[in_b] (op) incoming: this rank's contribution joins the partial result.
    const dist::Block in_b = received(j);
    void* dst = j >= first_final ? at(mine_out, in_b.offset - mine_offset, t) : at(work, in_b.offset, t);
    p2p.reduce_local(dst, at(data, in_b.offset, t), slot(j), in_b.size, t, op);
    if (j >= first_final) on_final(j % chunks);
    if (has_next) current = ahead ? next : start(j + 1);
  }
}

// The all-gather of chunk k within `buf` (count elements), whose chunk k of block rank() is in
// place. The last step is left open and returned: nothing reads its chunk until the caller
// waits, so the reduce-scatter of the next chunks goes on meanwhile.
dist::Ticket start_all_gather_chunk(PointToPoint& p2p, void* buf, std::size_t count, DType t, int chunks,
                                    int k) {
  const int n = p2p.size(), r = p2p.rank();
  const int right = mod(r + 1, n), left = mod(r - 1, n);
  dist::Ticket step{};
  for (int s = 0; s < n - 1; ++s) {
    if (s > 0) p2p.wait(step);  // step s forwards what step s-1 received
    const dist::Block out_b = chunk_of(count, n, mod(r - s, n), chunks, k);
    const dist::Block in_b = chunk_of(count, n, mod(r - s - 1, n), chunks, k);
    step = p2p.start_send_recv(at(buf, out_b.offset, t), out_b.size, right, at(buf, in_b.offset, t),
                               in_b.size, left, t);
  }
  return step;
}

}  // namespace

void ring_reduce_scatter(PointToPoint& p2p, const void* data, void* out, std::size_t count, DType t,
                         ReduceOp op, const RingOptions& options) {
  const int n = p2p.size();
  if (n == 1) {
    p2p.copy(out, data, count * dist::dtype_size(t));
    return;
  }
  const int chunks = chunks_for(count, n, t, options);
  const std::size_t slot_elems = dist::block_of(largest_block(count, n), chunks, 0).size;
  // One scratch request for the partial sums (count elements) and the two receive slots.
  void* work = p2p.scratch((count + 2 * slot_elems) * dist::dtype_size(t));
  reduce_scatter_in(p2p, data, work, out, at(work, count, t), slot_elems, count, t, op, chunks, [](int) {});
}

// No local work to hide here, so no chunks: one exchange per step, each forwarding the block
// received the step before.
void ring_all_gather(PointToPoint& p2p, const void* in, void* out, std::size_t count, DType t) {
  const int n = p2p.size(), r = p2p.rank();
  const dist::Block mine = dist::block_of(count, n, r);
  p2p.copy(at(out, mine.offset, t), in, mine.size * dist::dtype_size(t));
  const int right = mod(r + 1, n), left = mod(r - 1, n);
  for (int s = 0; s < n - 1; ++s) {
    const dist::Block out_b = dist::block_of(count, n, mod(r - s, n));
    const dist::Block in_b = dist::block_of(count, n, mod(r - s - 1, n));
    p2p.send_recv(at(out, out_b.offset, t), out_b.size, right, at(out, in_b.offset, t), in_b.size, left, t);
  }
}

void ring_all_reduce(PointToPoint& p2p, const void* data, void* out, std::size_t count, DType t,
                     ReduceOp op, const RingOptions& options) {
  const int n = p2p.size();
  if (n == 1) {
    if (out != data) p2p.copy(out, data, count * dist::dtype_size(t));
    return;
  }
  const int chunks = chunks_for(count, n, t, options);
  const std::size_t slot_elems = dist::block_of(largest_block(count, n), chunks, 0).size;
  void* slots = p2p.scratch(2 * slot_elems * dist::dtype_size(t));
  // Both phases in `out`: the in-place case needs nothing special, since block b of `data` is
  // read (sent at step 0, or reduced) no later than the same block of `out` is written.
  const dist::Block mine = dist::block_of(count, n, p2p.rank());
  std::vector<dist::Ticket> gathers;
  gathers.reserve(static_cast<std::size_t>(chunks));
  reduce_scatter_in(p2p, data, out, at(out, mine.offset, t), slots, slot_elems, count, t, op, chunks,
                    [&](int k) { gathers.push_back(start_all_gather_chunk(p2p, out, count, t, chunks, k)); });
  // Whatever the caller issues next sees the finished result.
  for (dist::Ticket g : gathers) p2p.wait(g);
}

}  // namespace k2c::collectives
