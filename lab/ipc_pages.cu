// lab/ipc_pages.cu — whether memory another process lends reads more slowly than a process's own.
// The witness (autograder/witness) allocates a launch's buffers in its own process and lends them
// to the test program; lent as CUDA IPC handles, module 19's reference decode kernel read its 1 GiB
// paged cache there at about a third of the rate it reached on an allocation of its own (lent
// through the driver's virtual memory API, at its own rate). This program reads 2 GiB in 32 KiB
// pages (in pool order and shuffled, a block per run of pages, as a decode step reads its cache)
// from four kinds of memory, all timed in one process:
//   own cudaMalloc         the test program's usual allocation
//   own cuMemCreate        the driver's virtual memory API at 2 MiB granularity
//                          (k2c::SharedDeviceMemory, k2c/device/shared_memory.h)
//   imported cudaIpc       another process's cudaMalloc, opened with cudaIpcOpenMemHandle
//   imported cuMemCreate   another process's SharedDeviceMemory, its file descriptor sent over a
//                          Unix socket (SCM_RIGHTS) and mapped with cuMemMap, as the witness lends
//                          its buffers
// The parent allocates and fills the two exported pools, starts this program again as the child
// (a CUDA process cannot fork and keep using the GPU), sends the handles and waits; the child
// allocates its own two pools and prints GB/s (bytes read over the median time of 30 runs after an
// L2 flush; the median of three rounds over all kinds) for each kind and order, then as JSON.
//   nvcc -O3 -std=c++20 -arch=sm_90 -Icommon/include lab/ipc_pages.cu common/src/shared_memory.cpp \
//     -o /tmp/ipc_pages && /tmp/ipc_pages
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "k2c/core/fd_io.h"
#include "k2c/device/shared_memory.h"
#include "median_time.cuh"

constexpr std::size_t kPool = std::size_t{2} << 30, kPage = 32 << 10;
constexpr int kPages = static_cast<int>(kPool / kPage), kRuns = 512;  // blocks, each a run of pages

#define CHECK_RT(x) check((x) == cudaSuccess, #x, __LINE__)
void check(bool ok, const char* what, int line) {
  if (!ok) {
    std::fprintf(stderr, "ipc_pages: %s failed (line %d)\n", what, line);
    std::exit(1);
  }
}

// Block r reads pages table[r·per .. (r+1)·per) in 16-byte loads, four in flight a thread.
__global__ void read_pages(const uint4* pool, const int* table, int per, unsigned* sink) {
  constexpr int kVecs = kPage / 16;
  unsigned acc = 0;
  for (int i = 0; i < per; ++i) {
    const uint4* page = pool + std::size_t(table[blockIdx.x * per + i]) * kVecs;
    for (int v = threadIdx.x; v < kVecs; v += 4 * blockDim.x) {
      uint4 x[4];
#pragma unroll
      for (int u = 0; u < 4; ++u) x[u] = __ldg(page + min(v + u * int(blockDim.x), kVecs - 1));
#pragma unroll
      for (int u = 0; u < 4; ++u) acc ^= x[u].x ^ x[u].y ^ x[u].z ^ x[u].w;
    }
  }
  if (acc == 0x12345678u) sink[0] = acc;
}

__global__ void fill(std::uint32_t* p, std::size_t n) {
  for (std::size_t i = blockIdx.x * std::size_t(blockDim.x) + threadIdx.x; i < n; i += std::size_t(gridDim.x) * blockDim.x)
    p[i] = static_cast<std::uint32_t>(i * 2654435761u);
}

// What the parent sends: the legacy handle and the lent allocation's size, its descriptor beside them.
struct Greeting {
  cudaIpcMemHandle_t legacy;
  std::size_t lent_bytes;
};

int child(int sock) {
  CHECK_RT(cudaSetDevice(0));
  Greeting g;
  const int fd = k2c::receive_with_fd(sock, &g, sizeof g);
  check(fd >= 0, "the greeting and its descriptor", __LINE__);
  struct Kind {
    const char* name;
    void* pool;
  };
  std::vector<Kind> kinds;
  void* own = nullptr;
  CHECK_RT(cudaMalloc(&own, kPool));
  kinds.push_back({"own cudaMalloc", own});
  k2c::SharedDeviceMemory own_lendable = k2c::SharedDeviceMemory::create(kPool);
  kinds.push_back({"own cuMemCreate", own_lendable.data()});
  void* legacy = nullptr;
  CHECK_RT(cudaIpcOpenMemHandle(&legacy, g.legacy, cudaIpcMemLazyEnablePeerAccess));
  kinds.push_back({"imported cudaIpc", legacy});
  k2c::SharedDeviceMemory borrowed = k2c::SharedDeviceMemory::import(fd, g.lent_bytes);
  kinds.push_back({"imported cuMemCreate", borrowed.data()});
  for (int k = 0; k < 2; ++k) {
    fill<<<1024, 256>>>(static_cast<std::uint32_t*>(kinds[k].pool), kPool / 4);
  }
  CHECK_RT(cudaDeviceSynchronize());

  std::vector<int> in_order(kPages), shuffled(kPages);
  std::iota(in_order.begin(), in_order.end(), 0);
  shuffled = in_order;
  std::mt19937 rng(19);
  std::shuffle(shuffled.begin(), shuffled.end(), rng);
  int *d_order = nullptr, *d_shuffled = nullptr;
  unsigned* sink = nullptr;
  CHECK_RT(cudaMalloc(&d_order, kPages * sizeof(int)));
  CHECK_RT(cudaMalloc(&d_shuffled, kPages * sizeof(int)));
  CHECK_RT(cudaMalloc(&sink, sizeof(unsigned)));
  CHECK_RT(cudaMemcpy(d_order, in_order.data(), kPages * sizeof(int), cudaMemcpyHostToDevice));
  CHECK_RT(cudaMemcpy(d_shuffled, shuffled.data(), kPages * sizeof(int), cudaMemcpyHostToDevice));

  // Three rounds over every kind and order, the median of each: the clock moves between rounds.
  constexpr int kRounds = 3;
  std::vector<std::vector<double>> gbs(kinds.size() * 2);
  for (int round = 0; round < kRounds; ++round)
    for (std::size_t k = 0; k < kinds.size(); ++k)
      for (int o = 0; o < 2; ++o) {
        const int* table = o == 0 ? d_order : d_shuffled;
        const double ms = graded_ms([&] {
          read_pages<<<kRuns, 256>>>(static_cast<const uint4*>(kinds[k].pool), table, kPages / kRuns, sink);
        });
        gbs[2 * k + o].push_back(kPool / (ms * 1e-3) / 1e9);
      }
  auto median = [](std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
  };
  std::printf("GB/s reading 2 GiB in 32 KiB pages (%d blocks), median of %d rounds\n", kRuns, kRounds);
  std::printf("%-22s %10s %10s\n", "memory", "in order", "shuffled");
  std::string json;
  for (std::size_t k = 0; k < kinds.size(); ++k) {
    const double in_order_gbs = median(gbs[2 * k]), shuffled_gbs = median(gbs[2 * k + 1]);
    std::printf("%-22s %10.0f %10.0f\n", kinds[k].name, in_order_gbs, shuffled_gbs);
    json += std::string(k ? ", " : "") + "\"" + kinds[k].name + "\": {\"in_order\": " + std::to_string(in_order_gbs) +
            ", \"shuffled\": " + std::to_string(shuffled_gbs) + "}";
  }
  std::printf("{\"ipc_pages\": {%s}}\n", json.c_str());
  CHECK_RT(cudaIpcCloseMemHandle(legacy));
  return 0;
}

int main(int argc, char** argv) {
  if (argc == 3 && std::string(argv[1]) == "child") return child(std::atoi(argv[2]));
  CHECK_RT(cudaSetDevice(0));
  cudaDeviceProp prop;
  CHECK_RT(cudaGetDeviceProperties(&prop, 0));
  std::printf("%s\n", prop.name);
  void* legacy = nullptr;
  CHECK_RT(cudaMalloc(&legacy, kPool));
  fill<<<1024, 256>>>(static_cast<std::uint32_t*>(legacy), kPool / 4);
  k2c::SharedDeviceMemory lent = k2c::SharedDeviceMemory::create(kPool);
  fill<<<1024, 256>>>(reinterpret_cast<std::uint32_t*>(lent.data()), kPool / 4);
  CHECK_RT(cudaDeviceSynchronize());
  Greeting g;
  CHECK_RT(cudaIpcGetMemHandle(&g.legacy, legacy));
  g.lent_bytes = lent.bytes();

  int socks[2];
  check(socketpair(AF_UNIX, SOCK_STREAM, 0, socks) == 0, "socketpair", __LINE__);
  const pid_t pid = fork();
  if (pid == 0) {
    close(socks[0]);
    const std::string s = std::to_string(socks[1]);
    execl("/proc/self/exe", argv[0], "child", s.c_str(), static_cast<char*>(nullptr));
    std::_Exit(127);
  }
  close(socks[1]);
  const int fd = lent.export_fd();
  check(k2c::send_with_fd(socks[0], &g, sizeof g, fd), "sending the greeting", __LINE__);
  close(fd);
  int status = 0;
  waitpid(pid, &status, 0);
  return WIFEXITED(status) ? WEXITSTATUS(status) : 1;
}
