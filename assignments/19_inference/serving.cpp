// assignments/19_inference/serving.cpp — module 19, parts E–F: your implementation (contract:
// inference.h; parts A–D go in inference.cpp). Lecture: lectures/19_inference.md, sections 7–8.
//
// Both parts are host code around the engine: lists of requests, a clock, and the steps the
// contract's schedule chooses. Write serve() first and test it under a cost model (the tests'
// timer); serve_disaggregated() is the same loop cut in two, plus the messages that keep the two
// ranks in step. Every result must come out the same on both ranks.
#include "inference.h"
#include "k2c/core/todo.h"

namespace k2c::inference {

// =============================================================================================
// Part E: continuous batching

void summarize(ServeReport& report) {
  (void)report;
  K2C_TODO("summarize: TTFT and TPOT percentiles, throughput, over the requests that finished");
}

ServeReport serve(Engine& engine, const std::vector<Request>& trace, const ServeConfig& config) {
  (void)engine, (void)trace, (void)config;
  K2C_TODO("serve: arrivals, rejections, admission, one prefill or one decode per step, releases");
}

// =============================================================================================
// Part F: prefill/decode disaggregation
//
// Small messages (clocks, headers, results) travel as f64 in a dist::Buffer of the communicator
// (to_backend, to_host around the collective): on NCCL a collective cannot read host memory.
// A cache travels as one tensor of [2·layers·prompt, kv_heads·head_dim] rows, gathered from the
// pools in position order on rank 0 and written back with PagedKvCache::write on rank 1.

ServeReport serve_disaggregated(Communicator& comm, Engine& engine, const std::vector<Request>& trace,
                                const ServeConfig& config) {
  (void)comm, (void)engine, (void)trace, (void)config;
  K2C_TODO("serve_disaggregated: rounds of (clocks, decision, one step), caches sent rank 0 -> rank 1");
}

}  // namespace k2c::inference
