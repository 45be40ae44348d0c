// tensor.cpp — see k2c/model/tensor.h.
#include "k2c/model/tensor.h"

#include <cstdio>
#include <cstdlib>
#include <new>
#include <sstream>
#include <stdexcept>
#include <utility>

namespace k2c::model {

std::size_t dtype_size(DType t) { return t == DType::bf16 ? 2 : 4; }

std::string to_string(DType t) {
  switch (t) {
    case DType::f32: return "f32";
    case DType::bf16: return "bf16";
    case DType::i32: return "i32";
  }
  return "?";
}

std::string to_string(Category c) {
  static const char* names[kCategories] = {"parameters", "gradients", "optimizer", "activations",
                                           "communication"};
  return names[static_cast<int>(c)];
}

// ---------------------------------------------------------------------------------------------
// MemoryLedger

void MemoryLedger::add(Category c, std::size_t bytes) {
  const int i = static_cast<int>(c);
  current_[i] += bytes;
  if (current_[i] > peak_[i]) peak_[i] = current_[i];
  const std::size_t total = current_total();
  if (total > peak_total_) peak_total_ = total;
}

void MemoryLedger::remove(Category c, std::size_t bytes) {
  const int i = static_cast<int>(c);
  if (bytes > current_[i])
    throw std::logic_error("memory ledger: freeing " + std::to_string(bytes) + " bytes of " +
                           to_string(c) + " but only " + std::to_string(current_[i]) + " recorded");
  current_[i] -= bytes;
}

std::size_t MemoryLedger::current_total() const {
  std::size_t total = 0;
  for (std::size_t b : current_) total += b;
  return total;
}

void MemoryLedger::reset_peaks() {
  peak_ = current_;
  peak_total_ = current_total();
}

std::string MemoryLedger::report() const {
  std::ostringstream out;
  char line[128];
  for (int i = 0; i < kCategories; ++i) {
    std::snprintf(line, sizeof line, "%-14s current %10.2f MiB  peak %10.2f MiB\n",
                  to_string(static_cast<Category>(i)).c_str(), current_[i] / 1048576.0,
                  peak_[i] / 1048576.0);
    out << line;
  }
  std::snprintf(line, sizeof line, "%-14s current %10.2f MiB  peak %10.2f MiB\n", "total",
                current_total() / 1048576.0, peak_total_ / 1048576.0);
  out << line;
  return out.str();
}

// ---------------------------------------------------------------------------------------------
// HostMemory: 64-byte aligned, so that vectorised loops and the MPI library see whole lines.

void* HostMemory::alloc(std::size_t bytes) {
  if (bytes == 0) return nullptr;
  void* p = std::aligned_alloc(64, (bytes + 63) / 64 * 64);
  if (!p) throw std::bad_alloc();
  return p;
}

void HostMemory::free(void* p) { std::free(p); }

// ---------------------------------------------------------------------------------------------
// Shape

Shape::Shape(std::initializer_list<std::int64_t> d) {
  if (d.size() < 1 || d.size() > 4)
    throw std::invalid_argument("tensor shape: 1 to 4 dimensions, got " + std::to_string(d.size()));
  for (std::int64_t x : d) {
    if (x < 0) throw std::invalid_argument("tensor shape: negative dimension " + std::to_string(x));
    dims[rank++] = x;
  }
}

std::int64_t Shape::numel() const {
  if (rank == 0) return 0;
  std::int64_t n = 1;
  for (int i = 0; i < rank; ++i) n *= dims[i];
  return n;
}

bool Shape::operator==(const Shape& o) const {
  if (rank != o.rank) return false;
  for (int i = 0; i < rank; ++i)
    if (dims[i] != o.dims[i]) return false;
  return true;
}

std::string Shape::str() const {
  std::string s = "[";
  for (int i = 0; i < rank; ++i) s += (i ? ", " : "") + std::to_string(dims[i]);
  return s + "]";
}

// ---------------------------------------------------------------------------------------------
// Tensor

Tensor::Tensor(Memory& memory, MemoryLedger& ledger, Category category, Shape shape, DType dtype)
    : shape_(shape), dtype_(dtype), memory_(&memory), ledger_(&ledger), category_(category) {
  data_ = memory.alloc(bytes());
  ledger.add(category, bytes());
}

Tensor Tensor::view(void* data, Shape shape, DType dtype) {
  Tensor t;
  t.data_ = data;
  t.shape_ = shape;
  t.dtype_ = dtype;
  return t;
}

Tensor::~Tensor() { release(); }

void Tensor::release() {
  if (memory_) {
    ledger_->remove(category_, bytes());
    if (data_) memory_->free(data_);
  }
  data_ = nullptr;
  memory_ = nullptr;
}

Tensor::Tensor(Tensor&& o) noexcept { *this = std::move(o); }

Tensor& Tensor::operator=(Tensor&& o) noexcept {
  if (this != &o) {
    release();
    data_ = std::exchange(o.data_, nullptr);
    shape_ = o.shape_;
    dtype_ = o.dtype_;
    memory_ = std::exchange(o.memory_, nullptr);
    ledger_ = o.ledger_;
    category_ = o.category_;
  }
  return *this;
}

std::int64_t Tensor::dim(int i) const {
  if (i < 0 || i >= shape_.rank)
    throw std::out_of_range("tensor " + shape_.str() + " has no dimension " + std::to_string(i));
  return shape_[i];
}

float* Tensor::f32() const {
  if (dtype_ != DType::f32) throw std::logic_error("tensor is " + to_string(dtype_) + ", not f32");
  return static_cast<float*>(data_);
}

std::int32_t* Tensor::i32() const {
  if (dtype_ != DType::i32) throw std::logic_error("tensor is " + to_string(dtype_) + ", not i32");
  return static_cast<std::int32_t*>(data_);
}

Tensor Tensor::reshaped(Shape shape) const {
  if (shape.numel() != numel())
    throw std::invalid_argument("reshape " + shape_.str() + " to " + shape.str() +
                                ": element counts differ");
  return view(data_, shape, dtype_);
}

Tensor Tensor::rows(std::int64_t begin, std::int64_t count) const {
  if (rank() != 2 || begin < 0 || count < 0 || begin + count > dim(0))
    throw std::out_of_range("rows [" + std::to_string(begin) + ", " + std::to_string(begin + count) + ") of " +
                            shape_.str());
  const std::size_t offset = static_cast<std::size_t>(begin * dim(1)) * dtype_size(dtype_);
  return view(static_cast<unsigned char*>(raw()) + offset, {count, dim(1)}, dtype_);
}

void Tensor::expect(const Shape& shape, const char* what, DType dtype) const {
  if (!(shape_ == shape) || dtype_ != dtype)
    throw std::invalid_argument(std::string(what) + ": expected " + to_string(dtype) + " " +
                                shape.str() + ", got " + to_string(dtype_) + " " + shape_.str());
}

}  // namespace k2c::model
