// witness_server.cpp — the test program's side of the grader's witness run (k2c/testing/witness.h).
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <exception>
#include <map>
#include <optional>
#include <string>

#include <cuda_runtime.h>

#include "k2c/core/fd_io.h"
#include "k2c/device/shared_memory.h"
#include "k2c/testing/witness.h"

namespace k2c::testing {
namespace {

std::map<std::string, WitnessFn>& registry() {
  static std::map<std::string, WitnessFn> r;
  return r;
}

bool reply(int fd, witness::Status status, std::uint32_t window, const std::string& message = "") {
  witness::Reply r;
  r.status = status;
  r.window = window;
  std::snprintf(r.message, sizeof r.message, "%s", message.c_str());
  return k2c::write_fully(fd, &r, sizeof r);
}

// Runs the kernel on every set, then waits for the device; "" or what went wrong.
std::string run_sets(WitnessFn fn, const witness::Hello& hello, char* base) {
  WitnessLaunch w;
  w.shape.assign(hello.shape, hello.shape + witness::kMaxShape);
  try {
    for (std::uint32_t s = 0; s < hello.sets; ++s) {
      w.buffers.clear();
      for (std::uint32_t b = 0; b < hello.buffers; ++b) w.buffers.push_back(base + hello.offset[s][b]);
      fn(w);
    }
  } catch (const std::exception& e) {
    return e.what();
  }
  const cudaError_t err = cudaDeviceSynchronize();
  return err == cudaSuccess ? "" : cudaGetErrorString(err);
}

}  // namespace

bool register_witness(const char* name, WitnessFn fn) {
  registry()[name] = fn;
  return true;
}

int serve_witness(const std::string& name) {
  const int fd = witness::kChannelFd;
  const auto it = registry().find(name);
  if (it == registry().end()) {
    reply(fd, witness::Status::failed, 0, "this test program has no witness '" + name + "'");
    std::fprintf(stderr, "no witness '%s' in this test program\n", name.c_str());
    return 2;
  }
  witness::Hello hello;
  const int memory_fd = k2c::receive_with_fd(fd, &hello, sizeof hello);
  if (memory_fd < 0 || hello.magic != witness::kMagic || hello.sets == 0 || hello.sets > witness::kMaxSets ||
      hello.buffers == 0 || hello.buffers > witness::kMaxBuffers || hello.bytes == 0) {
    if (memory_fd >= 0) close(memory_fd);
    std::fprintf(stderr, "witness: no valid greeting on fd %d\n", fd);
    return 2;
  }
  std::optional<SharedDeviceMemory> memory;
  try {
    memory = SharedDeviceMemory::import(memory_fd, hello.bytes);
  } catch (const std::exception& e) {
    reply(fd, witness::Status::failed, 0, std::string("cannot map the grader's buffers: ") + e.what());
    return 2;
  }
  char* base = memory->data();
  // Warm-up, off the clock: module loading and first launches, as time_gpu's warm-up does.
  for (int i = 0; i < 2; ++i)
    if (const std::string problem = run_sets(it->second, hello, base); !problem.empty()) {
      reply(fd, witness::Status::failed, 0, problem);
      return 1;
    }
  if (!reply(fd, witness::Status::ready, 0)) return 1;
  for (;;) {
    witness::Order order;
    if (!k2c::read_fully(fd, &order, sizeof order) || order.magic != witness::kMagic) return 1;
    if (order.command == witness::Command::end) break;
    const std::string problem = run_sets(it->second, hello, base);
    if (!reply(fd, problem.empty() ? witness::Status::done : witness::Status::failed, order.window, problem))
      return 1;
  }
  return 0;
}

}  // namespace k2c::testing
