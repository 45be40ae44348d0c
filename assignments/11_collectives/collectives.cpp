// assignments/11_collectives/collectives.cpp — module 11: your implementation
// (contract: collectives.h). Read lectures/11_collectives.md first.
//
// Work from the ring's picture: at each step every rank sends one block to its right neighbour
// (rank + 1) and receives one from its left (rank - 1) with a single send_recv, so all links are
// busy at once and nobody waits for a partner that is itself waiting.
#include "collectives.h"
#include "k2c/core/todo.h"

namespace k2c::collectives {

void ring_reduce_scatter(PointToPoint& p2p, const void* data, void* out, std::size_t count, DType t,
                         ReduceOp op, const RingOptions& options) {
  (void)p2p, (void)data, (void)out, (void)count, (void)t, (void)op, (void)options;
  K2C_TODO("ring_reduce_scatter: size()-1 steps of send_recv + reduce_local around the ring");
}

void ring_all_gather(PointToPoint& p2p, const void* in, void* out, std::size_t count, DType t) {
  (void)p2p, (void)in, (void)out, (void)count, (void)t;
  K2C_TODO("ring_all_gather: size()-1 steps of send_recv, each forwarding the block just received");
}

void ring_all_reduce(PointToPoint& p2p, const void* data, void* out, std::size_t count, DType t,
                     ReduceOp op, const RingOptions& options) {
  (void)p2p, (void)data, (void)out, (void)count, (void)t, (void)op, (void)options;
  K2C_TODO("ring_all_reduce: reduce-scatter, then all-gather, in `out`");
}

}  // namespace k2c::collectives
