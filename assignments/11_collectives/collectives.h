// assignments/11_collectives/collectives.h — the contract of module 11 (do not edit).
//
// Collectives by hand: reduce-scatter, all-gather and all-reduce on a ring, written with nothing
// but a PointToPoint (k2c/dist/communicator.h): send, recv, send_recv (or its two halves,
// start_send_recv and wait), and local copy and reduce. The same code runs on CPU ranks (MPI backend, host buffers) and on GPUs (NCCL backend,
// device buffers); buffers come from p2p.alloc(). The library collectives are not reachable
// from here, by design.
//
// Blocks: `count` elements are cut into size() blocks as evenly as possible, the first
// count % size() one element longer (k2c::dist::block_of). Rank r owns block r.
// Calls may return before the work is done (NCCL queues it); p2p.synchronize() waits.
// Every rank calls with the same count, type and op. The ops are sum and max, combined two
// elements at a time by p2p.reduce_local (bf16 widened to fp32 and rounded at each hop, as it
// does). avg is not one of them: it is a property of the whole collective, which reduce_local
// refuses with std::invalid_argument; a caller that wants a mean divides the sum.
//
// Exchanges started with start_send_recv run alongside the local work issued after them (on
// NCCL, on a second stream), which lets a reduction overlap the next transfer. Wait on every
// ticket you take before returning: then whatever the caller issues next sees your result.
//
// Tests: autograder/11_collectives/test_collectives.cpp. Lecture: lectures/11_collectives.md.
#pragma once

#include <cstddef>

#include "k2c/dist/communicator.h"

namespace k2c::collectives {

using dist::DType;
using dist::PointToPoint;
using dist::ReduceOp;

// How a pipelined ring cuts each block into chunks (lecture section 7): chunks of at least
// min_chunk_bytes, at most max_chunks of them per block. A ring without a pipeline may ignore
// it. The defaults suit NVLink between H200s; a test passes tiny chunks to reach every path of a
// pipeline at small sizes, and the benchmark takes both as flags (--min-chunk, --max-chunks).
struct RingOptions {
  std::size_t min_chunk_bytes = std::size_t{512} << 20;
  int max_chunks = 8;
};

// out (block_of(count, size, rank).size elements) = block rank() of the element-wise reduction
// of every rank's `data` (count elements). data is not modified.
void ring_reduce_scatter(PointToPoint& p2p, const void* data, void* out, std::size_t count, DType t,
                         ReduceOp op, const RingOptions& options = {});

// out (count elements) = every rank's block, in rank order; `in` holds this rank's block
// (block_of(count, size, rank).size elements).
void ring_all_gather(PointToPoint& p2p, const void* in, void* out, std::size_t count, DType t);

// out (count elements) = the element-wise reduction of every rank's `data`: a ring
// reduce-scatter followed by a ring all-gather. out may equal data (in place).
void ring_all_reduce(PointToPoint& p2p, const void* data, void* out, std::size_t count, DType t,
                     ReduceOp op, const RingOptions& options = {});

}  // namespace k2c::collectives
