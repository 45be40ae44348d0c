// unwrapping_collectives.cpp — module 11 by borrowing, for gradescope_test.sh: each "ring" reaches
// through the PointToPointView it is given to the Communicator behind it (the view's one member,
// right after its vtable pointer) and has the library do the collective. Right answers, no ring,
// nothing the link or the library inspection can see; the tests and the grader's own checks must
// fail it because the library counted a collective during the call (library_collectives()).
#include <vector>

#include "collectives.h"

namespace k2c::collectives {
namespace {

dist::Communicator& behind(PointToPoint& p2p) {
  return **reinterpret_cast<dist::Communicator**>(reinterpret_cast<char*>(&p2p) + sizeof(void*));
}

}  // namespace

void ring_all_reduce(PointToPoint& p2p, const void* data, void* out, std::size_t count, DType t, ReduceOp op,
                     const RingOptions&) {
  behind(p2p).all_reduce(data, out, count, t, op);
}

void ring_reduce_scatter(PointToPoint& p2p, const void* data, void* out, std::size_t count, DType t, ReduceOp op,
                         const RingOptions&) {
  const std::size_t es = dist::dtype_size(t);
  const dist::Block mine = dist::block_of(count, p2p.size(), p2p.rank());
  void* all = p2p.scratch(count * es + 1);
  behind(p2p).all_reduce(data, all, count, t, op);
  p2p.copy(out, static_cast<const char*>(all) + mine.offset * es, mine.size * es);
}

void ring_all_gather(PointToPoint& p2p, const void* in, void* out, std::size_t count, DType t) {
  const int ranks = p2p.size();
  const std::size_t own = dist::block_of(count, ranks, p2p.rank()).size;
  std::vector<std::size_t> send_counts(ranks, own), send_offsets(ranks, 0), recv_counts(ranks), recv_offsets(ranks);
  for (int p = 0; p < ranks; ++p) {
    const dist::Block b = dist::block_of(count, ranks, p);
    recv_counts[p] = b.size;
    recv_offsets[p] = b.offset;
  }
  behind(p2p).all_to_all_v(in, send_counts, send_offsets, out, recv_counts, recv_offsets, t);
}

}  // namespace k2c::collectives
