// shared_memory.cpp — device memory lent between processes (k2c/device/shared_memory.h).
#include "k2c/device/shared_memory.h"

#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <utility>

#include <cuda.h>
#include <cuda_runtime.h>

namespace k2c {
namespace {

// The driver calls used here, looked up once through the runtime.
struct Driver {
  CUresult (*mem_create)(CUmemGenericAllocationHandle*, std::size_t, const CUmemAllocationProp*, unsigned long long);
  CUresult (*mem_release)(CUmemGenericAllocationHandle);
  CUresult (*granularity)(std::size_t*, const CUmemAllocationProp*, CUmemAllocationGranularity_flags);
  CUresult (*reserve)(CUdeviceptr*, std::size_t, std::size_t, CUdeviceptr, unsigned long long);
  CUresult (*free_range)(CUdeviceptr, std::size_t);
  CUresult (*map)(CUdeviceptr, std::size_t, std::size_t, CUmemGenericAllocationHandle, unsigned long long);
  CUresult (*unmap)(CUdeviceptr, std::size_t);
  CUresult (*set_access)(CUdeviceptr, std::size_t, const CUmemAccessDesc*, std::size_t);
  CUresult (*export_handle)(void*, CUmemGenericAllocationHandle, CUmemAllocationHandleType, unsigned long long);
  CUresult (*import_handle)(CUmemGenericAllocationHandle*, void*, CUmemAllocationHandleType);
};

template <class F>
void look_up(F& f, const char* name) {
  void* p = nullptr;
  cudaDriverEntryPointQueryResult found{};
  if (cudaGetDriverEntryPointByVersion(name, &p, 12000, cudaEnableDefault, &found) != cudaSuccess ||
      found != cudaDriverEntryPointSuccess || p == nullptr)
    throw std::runtime_error(std::string("the CUDA driver has no ") + name);
  f = reinterpret_cast<F>(p);
}

const Driver& driver() {
  static const Driver d = [] {
    if (cudaFree(nullptr) != cudaSuccess) throw std::runtime_error("no CUDA device to share memory on");
    Driver r{};
    look_up(r.mem_create, "cuMemCreate");
    look_up(r.mem_release, "cuMemRelease");
    look_up(r.granularity, "cuMemGetAllocationGranularity");
    look_up(r.reserve, "cuMemAddressReserve");
    look_up(r.free_range, "cuMemAddressFree");
    look_up(r.map, "cuMemMap");
    look_up(r.unmap, "cuMemUnmap");
    look_up(r.set_access, "cuMemSetAccess");
    look_up(r.export_handle, "cuMemExportToShareableHandle");
    look_up(r.import_handle, "cuMemImportFromShareableHandle");
    return r;
  }();
  return d;
}

void check(CUresult r, const char* call) {
  if (r != CUDA_SUCCESS) throw std::runtime_error(std::string(call) + " failed (CUDA driver error " + std::to_string(r) + ")");
}

int current_device() {
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) throw std::runtime_error("no current CUDA device");
  return device;
}

CUmemAllocationProp properties(int device) {
  CUmemAllocationProp prop{};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = device;
  prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
  return prop;
}

constexpr std::size_t kAlignment = std::size_t{2} << 20;  // 2 MiB: the pages both sides map with

// Maps `handle` (`bytes`) at a new address of this process, read-write for `device`.
char* map_here(CUmemGenericAllocationHandle handle, std::size_t bytes, int device) {
  const Driver& d = driver();
  CUdeviceptr p = 0;
  check(d.reserve(&p, bytes, kAlignment, 0, 0), "cuMemAddressReserve");
  if (const CUresult r = d.map(p, bytes, 0, handle, 0); r != CUDA_SUCCESS) {
    d.free_range(p, bytes);
    check(r, "cuMemMap");
  }
  CUmemAccessDesc access{};
  access.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  access.location.id = device;
  access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  if (const CUresult r = d.set_access(p, bytes, &access, 1); r != CUDA_SUCCESS) {
    d.unmap(p, bytes);
    d.free_range(p, bytes);
    check(r, "cuMemSetAccess");
  }
  return reinterpret_cast<char*>(static_cast<std::uintptr_t>(p));
}

}  // namespace

SharedDeviceMemory SharedDeviceMemory::create(std::size_t bytes) {
  const Driver& d = driver();
  const int device = current_device();
  const CUmemAllocationProp prop = properties(device);
  std::size_t granularity = 0;
  check(d.granularity(&granularity, &prop, CU_MEM_ALLOC_GRANULARITY_RECOMMENDED), "cuMemGetAllocationGranularity");
  granularity = std::max(granularity, kAlignment);
  SharedDeviceMemory m;
  m.bytes_ = (std::max<std::size_t>(bytes, 1) + granularity - 1) / granularity * granularity;
  CUmemGenericAllocationHandle h = 0;
  check(d.mem_create(&h, m.bytes_, &prop, 0), "cuMemCreate");
  m.handle_ = h;
  m.data_ = map_here(h, m.bytes_, device);  // on a throw, m's destructor releases the handle
  return m;
}

SharedDeviceMemory SharedDeviceMemory::import(int fd, std::size_t bytes) {
  CUmemGenericAllocationHandle h = 0;
  CUresult r = CUDA_ERROR_UNKNOWN;
  try {
    r = driver().import_handle(&h, reinterpret_cast<void*>(static_cast<std::uintptr_t>(fd)),
                               CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
  } catch (...) {
    close(fd);
    throw;
  }
  close(fd);  // the handle holds the allocation now
  check(r, "cuMemImportFromShareableHandle");
  SharedDeviceMemory m;
  m.handle_ = h;
  m.bytes_ = bytes;
  m.data_ = map_here(h, bytes, current_device());
  return m;
}

int SharedDeviceMemory::export_fd() const {
  int fd = -1;
  check(driver().export_handle(&fd, handle_, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0),
        "cuMemExportToShareableHandle");
  return fd;
}

void SharedDeviceMemory::release() noexcept {
  if (handle_ == 0) return;
  const Driver& d = driver();
  if (data_ != nullptr) {
    const auto p = static_cast<CUdeviceptr>(reinterpret_cast<std::uintptr_t>(data_));
    d.unmap(p, bytes_);
    d.free_range(p, bytes_);
  }
  d.mem_release(handle_);
  data_ = nullptr;
  handle_ = 0;
}

SharedDeviceMemory::SharedDeviceMemory(SharedDeviceMemory&& o) noexcept
    : data_(std::exchange(o.data_, nullptr)),
      bytes_(o.bytes_),
      handle_(std::exchange(o.handle_, 0)) {}

SharedDeviceMemory& SharedDeviceMemory::operator=(SharedDeviceMemory&& o) noexcept {
  if (this != &o) {
    release();
    data_ = std::exchange(o.data_, nullptr);
    bytes_ = o.bytes_;
    handle_ = std::exchange(o.handle_, 0);
  }
  return *this;
}

SharedDeviceMemory::~SharedDeviceMemory() { release(); }

}  // namespace k2c
