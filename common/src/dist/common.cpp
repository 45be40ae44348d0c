// common.cpp — what both backends share (see k2c/dist/communicator.h, k2c/dist/grid.h).
#include <sstream>
#include <stdexcept>

#include "k2c/check.h"
#include "k2c/dist/communicator.h"
#include "k2c/dist/grid.h"

namespace k2c::dist {

std::string to_string(Backend b) { return b == Backend::nccl ? "nccl" : "mpi"; }
std::string to_string(DType t) {
  return t == DType::f32 ? "f32" : t == DType::f64 ? "f64" : "i32";
}
std::string to_string(ReduceOp op) { return op == ReduceOp::sum ? "sum" : "max"; }

// ---------------------------------------------------------------------------------- grid -----

int GridShape::extent(Axis a) const {
  switch (a) {
    case Axis::dp: return dp;
    case Axis::pp: return pp;
    case Axis::ep: return ep;
    case Axis::cp: return cp;
    case Axis::tp: return tp;
  }
  return 1;
}

ProcessGrid::ProcessGrid(Communicator& world, GridShape shape) : world_(world), shape_(shape) {
  K2C_CHECK(shape.dp >= 1 && shape.pp >= 1 && shape.ep >= 1 && shape.cp >= 1 && shape.tp >= 1,
            "process grid: every extent must be >= 1");
  K2C_CHECK(shape.total() == world.size(),
            "process grid dp" << shape.dp << " x pp" << shape.pp << " x ep" << shape.ep << " x cp"
                              << shape.cp << " x tp" << shape.tp << " = " << shape.total()
                              << " ranks, but the job has " << world.size());
  // Mixed-radix digits of the world rank, tp fastest.
  int r = world.rank();
  for (int a = 4; a >= 0; --a) {
    const int e = shape.extent(static_cast<Axis>(a));
    coords_[a] = r % e;
    r /= e;
  }
  // The group along axis a: ranks equal in every other coordinate. Color = the rank with this
  // axis' coordinate zeroed (unique per group), key = the coordinate along a.
  for (int a = 0; a < 5; ++a) {
    int stride = 1;
    for (int b = a + 1; b < 5; ++b) stride *= shape.extent(static_cast<Axis>(b));
    const int color = world.rank() - coords_[a] * stride;
    groups_[a] = world.split(color, coords_[a]);
  }
}

std::string ProcessGrid::describe() const {
  static const char* names[] = {"dp", "pp", "ep", "cp", "tp"};
  std::ostringstream os;
  os << "rank " << world_.rank() << ":";
  for (int a = 0; a < 5; ++a)
    os << " " << names[a] << " " << coords_[a] << "/" << shape_.extent(static_cast<Axis>(a));
  return os.str();
}

}  // namespace k2c::dist
