// k2c/device/buffer.h — RAII device memory.
//
// DeviceBuffer<T> owns a cudaMalloc'd array: freed on scope exit, movable, not copyable, with
// upload / download helpers and poison() (all bytes 0xFF: NaN for floats, so any element a
// kernel forgot to write is caught by the comparison).
#pragma once

#include <cstddef>
#include <span>
#include <utility>
#include <vector>

#include <cuda_runtime_api.h>

#include "k2c/core/check.h"

namespace k2c {

template <class T>
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  explicit DeviceBuffer(std::size_t n) : n_(n) {
    if (n_ > 0) K2C_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&ptr_), bytes()));
  }
  explicit DeviceBuffer(std::span<const T> host) : DeviceBuffer(host.size()) { upload(host); }
  ~DeviceBuffer() {
    if (ptr_ != nullptr) cudaFree(ptr_);  // no throw from a destructor; errors surface elsewhere
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  DeviceBuffer(DeviceBuffer&& o) noexcept
      : ptr_(std::exchange(o.ptr_, nullptr)), n_(std::exchange(o.n_, 0)) {}
  DeviceBuffer& operator=(DeviceBuffer&& o) noexcept {
    std::swap(ptr_, o.ptr_);
    std::swap(n_, o.n_);
    return *this;
  }

  T* data() { return ptr_; }
  const T* data() const { return ptr_; }
  std::size_t size() const { return n_; }
  std::size_t bytes() const { return n_ * sizeof(T); }

  void upload(std::span<const T> host) {
    K2C_CHECK(host.size() == n_, "upload of " << host.size() << " elements into " << n_);
    if (n_ > 0) K2C_CUDA_CHECK(cudaMemcpy(ptr_, host.data(), bytes(), cudaMemcpyHostToDevice));
  }
  std::vector<T> download() const {
    std::vector<T> host(n_);
    if (n_ > 0) K2C_CUDA_CHECK(cudaMemcpy(host.data(), ptr_, bytes(), cudaMemcpyDeviceToHost));
    return host;
  }
  void poison() {
    if (n_ > 0) K2C_CUDA_CHECK(cudaMemset(ptr_, 0xFF, bytes()));
  }

 private:
  T* ptr_ = nullptr;
  std::size_t n_ = 0;
};

}  // namespace k2c
