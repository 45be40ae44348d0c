// k2c/device/shared_memory.h — device memory that one process allocates and another maps.
//
// The witness (k2c/testing/witness.h) keeps a launch's buffers in its own process and lends them
// to the test program. It first lent them as CUDA IPC handles (cudaIpcGetMemHandle); on an H100
// module 19's decode kernel then read its 1 GiB paged cache at about a third of the rate it
// reached on an allocation of its own, and lent this way, at its own rate. (lab/ipc_pages.cu
// reads memory lent either way, in a simpler pattern, at the rate of the process's own, so what
// slowed the IPC form is not established.) Here the owner creates the allocation (cuMemCreate)
// and exports it as a file descriptor, the descriptor travels over a Unix socket
// (k2c::send_with_fd in k2c/core/fd_io.h), and both processes map the same allocation at 2 MiB
// granularity (cuMemMap).
//
// The driver's functions are looked up through the runtime (cudaGetDriverEntryPointByVersion), so
// nothing links libcuda and a machine without a driver still loads the programs; every call
// throws std::runtime_error, naming the call, where the driver refuses.
#pragma once

#include <cstddef>

namespace k2c {

class SharedDeviceMemory {
 public:
  // The owner's side: at least `bytes` bytes on the current device, mapped here, exportable.
  static SharedDeviceMemory create(std::size_t bytes);
  // The borrower's side: maps the allocation `fd` names (`bytes`, as the owner's bytes()); takes
  // the descriptor and closes it.
  static SharedDeviceMemory import(int fd, std::size_t bytes);

  SharedDeviceMemory(SharedDeviceMemory&& other) noexcept;
  SharedDeviceMemory& operator=(SharedDeviceMemory&& other) noexcept;
  SharedDeviceMemory(const SharedDeviceMemory&) = delete;
  SharedDeviceMemory& operator=(const SharedDeviceMemory&) = delete;
  ~SharedDeviceMemory();

  char* data() const { return data_; }
  std::size_t bytes() const { return bytes_; }
  // A new descriptor for the allocation, to send to a borrower (the caller closes it).
  int export_fd() const;

 private:
  SharedDeviceMemory() = default;
  void release() noexcept;
  char* data_ = nullptr;
  std::size_t bytes_ = 0;
  unsigned long long handle_ = 0;  // CUmemGenericAllocationHandle
};

}  // namespace k2c
