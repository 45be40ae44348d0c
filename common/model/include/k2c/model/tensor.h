// k2c/model/tensor.h — tensors of the model library and the ledger that accounts for their memory.
//
// A Tensor is a pointer, an element type and up to four dimensions. Its memory comes from a
// Memory (host memory for a single process, the communicator's alloc() on distributed runs, so
// that a tensor lives where that backend's collectives expect it) and is recorded in a
// MemoryLedger under one of five categories. The ledger is what the ZeRO module's "optimizer
// bytes per rank = 1/N" is measured with, so every byte a model allocates goes through it.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <string>

namespace k2c::model {

enum class DType { f32, bf16, i32 };
std::size_t dtype_size(DType t);
std::string to_string(DType t);

enum class Category { params, grads, optimizer, activations, comm };
inline constexpr int kCategories = 5;
std::string to_string(Category c);

// Current and peak bytes per category, and the peak of their sum (which is not the sum of the
// peaks: activations peak in backward, when optimizer state may not exist yet).
class MemoryLedger {
 public:
  void add(Category c, std::size_t bytes);
  void remove(Category c, std::size_t bytes);  // throws std::logic_error on underflow
  std::size_t current(Category c) const { return current_[static_cast<int>(c)]; }
  std::size_t peak(Category c) const { return peak_[static_cast<int>(c)]; }
  std::size_t current_total() const;
  std::size_t peak_total() const { return peak_total_; }
  // Peaks restart from the current figures (e.g. to measure one training step).
  void reset_peaks();
  // One line per category: "activations  current 1.50 MiB  peak 3.00 MiB".
  std::string report() const;

 private:
  std::array<std::size_t, kCategories> current_{}, peak_{};
  std::size_t peak_total_ = 0;
};

// Where tensor memory comes from. HostMemory is plain aligned host memory; a distributed run
// passes a Memory that forwards to its communicator (host on MPI, device on NCCL).
class Memory {
 public:
  virtual ~Memory() = default;
  virtual void* alloc(std::size_t bytes) = 0;
  virtual void free(void* p) = 0;
  virtual bool on_device() const = 0;
};

class HostMemory final : public Memory {
 public:
  void* alloc(std::size_t bytes) override;
  void free(void* p) override;
  bool on_device() const override { return false; }
};

struct Shape {
  std::array<std::int64_t, 4> dims{};
  int rank = 0;
  Shape() = default;
  Shape(std::initializer_list<std::int64_t> d);  // 1 to 4 dimensions, each >= 0
  std::int64_t operator[](int i) const { return dims[i]; }
  std::int64_t numel() const;
  bool operator==(const Shape& o) const;
  std::string str() const;  // "[4, 32, 64]"
};

// An owning tensor (memory from a Memory, recorded in a ledger, freed with it) or a view of
// memory owned elsewhere (a parameter's slice of the flat buffer). Move-only.
class Tensor {
 public:
  Tensor() = default;
  Tensor(Memory& memory, MemoryLedger& ledger, Category category, Shape shape, DType dtype = DType::f32);
  static Tensor view(void* data, Shape shape, DType dtype = DType::f32);
  ~Tensor();
  Tensor(Tensor&& o) noexcept;
  Tensor& operator=(Tensor&& o) noexcept;
  Tensor(const Tensor&) = delete;
  Tensor& operator=(const Tensor&) = delete;

  const Shape& shape() const { return shape_; }
  std::int64_t dim(int i) const;  // throws std::out_of_range past rank()
  int rank() const { return shape_.rank; }
  std::int64_t numel() const { return shape_.numel(); }
  DType dtype() const { return dtype_; }
  std::size_t bytes() const { return static_cast<std::size_t>(numel()) * dtype_size(dtype_); }
  bool empty() const { return data_ == nullptr; }
  bool owning() const { return memory_ != nullptr; }
  void* raw() const { return data_; }
  // Typed access, checked against the dtype (bf16 data is reached as std::uint16_t).
  float* f32() const;
  std::int32_t* i32() const;
  // A view of the same memory with another shape of the same element count.
  Tensor reshaped(Shape shape) const;
  // A view of rows [begin, begin + count) of a matrix ([rows, cols], any dtype): an expert's rows, a shard.
  Tensor rows(std::int64_t begin, std::int64_t count) const;
  // Throws std::invalid_argument naming `what` unless the shape (and dtype) match.
  void expect(const Shape& shape, const char* what, DType dtype = DType::f32) const;

 private:
  void release();
  void* data_ = nullptr;
  Shape shape_;
  DType dtype_ = DType::f32;
  Memory* memory_ = nullptr;
  MemoryLedger* ledger_ = nullptr;
  Category category_ = Category::activations;
};

}  // namespace k2c::model
