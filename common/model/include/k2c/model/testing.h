// k2c/model/testing.h — Side: one side of a test's comparison on the model library, a backend
// with a memory ledger, parameters and a Context of its own, and the host data helpers around it.
//
// Why it exists: the tests of the Part II modules (14, 16, 17, 19) build the same computation
// twice, the library's single-process layer (the reference) and the one under test, and compare
// them. Each side needs its own ParamList, so that parameters are matched by name across the
// two, and its own ledger, so that memory can be asserted per side. Those tests once carried
// four copies of this struct; this is the one they share. Header-only and free of GoogleTest: a
// program includes it with the model library alone. The distributed checks and fixtures that go
// with it are in k2c/dist/testing.h.
//
// The backend is the caller's: cpu_ops() unless told, or the GPU backend (k2c/model/cuda_ops.h)
// on a NCCL run. Tensors made here are activations of the side's ledger, fp32 unless told.
// Uploads and downloads of zero elements leave the backend alone (a rank may hold no rows).
// Parameters are materialized from a seed the test names, so each module keeps its weights.
#pragma once

#include <cstdint>
#include <limits>
#include <stdexcept>
#include <string>
#include <vector>

#include "k2c/model/layers.h"
#include "k2c/model/ops.h"
#include "k2c/model/params.h"
#include "k2c/model/tensor.h"

namespace k2c::model::testing {

struct Side {
  MemoryLedger ledger;
  ParamList params;
  Context ctx;  // refers to the two members above: a Side is neither copied nor moved

  explicit Side(Ops& ops = cpu_ops()) : ctx{ops, ledger, params} {}
  Side(const Side&) = delete;
  Side& operator=(const Side&) = delete;

  Ops& ops() { return ctx.ops; }

  Tensor tensor(Shape s, DType t = DType::f32) { return ctx.tensor(s, Category::activations, t); }

  // A tensor of NaN: an operation that skips an element of its output cannot pass by luck.
  Tensor poisoned(Shape s) {
    Tensor t = tensor(s);
    ops().fill(t, std::numeric_limits<float>::quiet_NaN());
    return t;
  }

  Tensor upload(const std::vector<float>& h, Shape s) {
    Tensor t = tensor(s);
    if (t.numel() != static_cast<std::int64_t>(h.size()))
      throw std::invalid_argument("Side::upload: " + std::to_string(h.size()) + " host values for a tensor of " +
                                  s.str() + " (" + std::to_string(t.numel()) + " elements)");
    if (t.numel() > 0) ops().upload(t, h.data());
    return t;
  }
  // Token ids or positions: a vector of i32.
  Tensor upload_ids(const std::vector<std::int32_t>& h) {
    Tensor t = tensor({static_cast<std::int64_t>(h.size())}, DType::i32);
    if (!h.empty()) ops().upload(t, h.data());
    return t;
  }

  std::vector<float> download(const Tensor& t) {
    std::vector<float> h(static_cast<std::size_t>(t.numel()));
    if (!h.empty()) ops().download(h.data(), t);
    return h;
  }
  std::vector<std::int32_t> download_ids(const Tensor& t) {
    std::vector<std::int32_t> h(static_cast<std::size_t>(t.numel()));
    if (!h.empty()) ops().download(h.data(), t);
    return h;
  }

  void materialize(std::uint64_t seed) { params.materialize(ops(), ledger, seed); }

  // The parameter registered as `name`, or -1.
  ParamId find(const std::string& name) const {
    for (ParamId i = 0; i < params.size(); ++i)
      if (params.info(i).name == name) return i;
    return -1;
  }
  // The values of parameter `name`, on the host.
  std::vector<float> value(const std::string& name) {
    const ParamId id = find(name);
    if (id < 0) throw std::invalid_argument("Side::value: no parameter named '" + name + "'");
    return download(params.value(id));
  }
  // Its gradient, on the host.
  std::vector<float> grad(const std::string& name) {
    const ParamId id = find(name);
    if (id < 0) throw std::invalid_argument("Side::grad: no parameter named '" + name + "'");
    return download(params.grad(id));
  }
};

}  // namespace k2c::model::testing
