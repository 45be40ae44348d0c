// solutions/11_collectives/collectives.cpp — reference solution of module 11
// (contract: collectives.h).
//
// The ring. n ranks in a circle; at every step each rank sends one block to its right neighbour
// and receives one from its left with a single send_recv, so all n links carry data at once.
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
// Details that matter for speed: the first reduce-scatter step sends straight from `data` and
// reduces data + received into `out` (out = a + b), so no full copy of the input is ever made;
// the all-gather receives straight into `out`; temporary space comes from p2p.scratch(), reused
// across calls, because a cudaMalloc of a 512 MiB receive block on every call costs real time. Each element is reduced exactly once, by the rank
// that receives it, in a fixed order, so every rank ends with bit-identical results.
#include "collectives.h"

#include <algorithm>

namespace k2c::collectives {
namespace {

int mod(int a, int n) { return ((a % n) + n) % n; }

const char* at(const void* base, std::size_t elements, DType t) {
  return static_cast<const char*>(base) + elements * dist::dtype_size(t);
}
char* at(void* base, std::size_t elements, DType t) {
  return static_cast<char*>(base) + elements * dist::dtype_size(t);
}

std::size_t largest_block(std::size_t count, int n) {
  std::size_t largest = 0;
  for (int b = 0; b < n; ++b) largest = std::max(largest, dist::block_of(count, n, b).size);
  return largest;
}

// Reduce-scatter into the blocks of `work` (count elements), receiving into `incoming` (one
// block): on return block rank() of `work` is fully reduced. Block b of `work` is only read
// after it was written, except at step 0, where the outgoing block comes from `data` itself.
void reduce_scatter_in(PointToPoint& p2p, const void* data, void* work, void* incoming,
                       std::size_t count, DType t, ReduceOp op) {
  const int n = p2p.size(), r = p2p.rank();
  const int right = mod(r + 1, n), left = mod(r - 1, n);

  for (int s = 0; s < n - 1; ++s) {
    const dist::Block out_b = dist::block_of(count, n, mod(r - s - 1, n));
    const dist::Block in_b = dist::block_of(count, n, mod(r - s - 2, n));
    const void* src = s == 0 ? at(data, out_b.offset, t) : at(work, out_b.offset, t);
    p2p.send_recv(src, out_b.size, right, incoming, in_b.size, left, t);
    // work[in_b] = data[in_b] (op) incoming: this rank's contribution joins the partial result.
    p2p.reduce_local(at(work, in_b.offset, t), at(data, in_b.offset, t), incoming, in_b.size, t, op);
  }
}

// All-gather within `buf` (count elements) whose block rank() is in place.
void all_gather_in(PointToPoint& p2p, void* buf, std::size_t count, DType t) {
  const int n = p2p.size(), r = p2p.rank();
  const int right = mod(r + 1, n), left = mod(r - 1, n);
  for (int s = 0; s < n - 1; ++s) {
    const dist::Block out_b = dist::block_of(count, n, mod(r - s, n));
    const dist::Block in_b = dist::block_of(count, n, mod(r - s - 1, n));
    p2p.send_recv(at(buf, out_b.offset, t), out_b.size, right, at(buf, in_b.offset, t), in_b.size, left, t);
  }
}

}  // namespace

void ring_reduce_scatter(PointToPoint& p2p, const void* data, void* out, std::size_t count, DType t,
                         ReduceOp op) {
  const dist::Block mine = dist::block_of(count, p2p.size(), p2p.rank());
  if (p2p.size() == 1) {
    p2p.copy(out, data, count * dist::dtype_size(t));
    return;
  }
  // One scratch request for the partial sums (count elements) and the receive block after them.
  void* work = p2p.scratch((count + largest_block(count, p2p.size())) * dist::dtype_size(t));
  reduce_scatter_in(p2p, data, work, at(work, count, t), count, t, op);
  p2p.copy(out, at(work, mine.offset, t), mine.size * dist::dtype_size(t));
}

void ring_all_gather(PointToPoint& p2p, const void* in, void* out, std::size_t count, DType t) {
  const dist::Block mine = dist::block_of(count, p2p.size(), p2p.rank());
  p2p.copy(at(out, mine.offset, t), in, mine.size * dist::dtype_size(t));
  all_gather_in(p2p, out, count, t);
}

void ring_all_reduce(PointToPoint& p2p, const void* data, void* out, std::size_t count, DType t,
                     ReduceOp op) {
  if (p2p.size() == 1) {
    if (out != data) p2p.copy(out, data, count * dist::dtype_size(t));
    return;
  }
  void* incoming = p2p.scratch(largest_block(count, p2p.size()) * dist::dtype_size(t));
  reduce_scatter_in(p2p, data, out, incoming, count, t, op);
  all_gather_in(p2p, out, count, t);
}

}  // namespace k2c::collectives
