// k2c/dist/grid.h — the process grid of the parallel modules: dp × tp × pp × ep × cp.
//
// World rank r is laid out with tp fastest, then cp, ep, pp, and dp slowest, so the groups that
// talk most (tensor parallel) are neighbours, on one node when the grid spans several. Each
// group() is a sub-communicator over the ranks that differ only in that coordinate.
#pragma once

#include <array>
#include <memory>
#include <string>

#include "k2c/dist/communicator.h"

namespace k2c::dist {

enum class Axis { dp = 0, pp = 1, ep = 2, cp = 3, tp = 4 };  // slowest to fastest

struct GridShape {
  int dp = 1, pp = 1, ep = 1, cp = 1, tp = 1;
  int total() const { return dp * pp * ep * cp * tp; }
  int extent(Axis a) const;
};

class ProcessGrid {
 public:
  // Throws std::invalid_argument unless shape.total() == world.size().
  ProcessGrid(Communicator& world, GridShape shape);
  const GridShape& shape() const { return shape_; }
  int coord(Axis a) const { return coords_[static_cast<int>(a)]; }
  Communicator& group(Axis a) { return *groups_[static_cast<int>(a)]; }
  std::string describe() const;  // "rank 5: dp 1/2 pp 0/1 ep 0/1 cp 0/1 tp 1/2"

 private:
  Communicator& world_;
  GridShape shape_;
  std::array<int, 5> coords_{};
  std::array<std::unique_ptr<Communicator>, 5> groups_;
};

}  // namespace k2c::dist
