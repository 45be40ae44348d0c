// k2c/dist/grid.h — the process grid of the parallel modules: dp × tp × pp × ep × cp.
//
// World rank r is laid out with tp fastest, then cp, ep, pp, and dp slowest, so the groups that
// talk most (tensor parallel) are neighbours, on one node when the grid spans several. Each
// group(axis) is a sub-communicator over the ranks that differ only in that coordinate;
// group({axes...}) one over the ranks that differ only in those coordinates (dp × cp for the
// gradients of a context-parallel model, dp × ep for the dense gradients under expert
// parallelism). prev_stage() / next_stage() name the pipeline neighbours for start_send_recv.
#pragma once

#include <array>
#include <initializer_list>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "k2c/dist/communicator.h"

namespace k2c::dist {

enum class Axis { dp = 0, pp = 1, ep = 2, cp = 3, tp = 4 };  // slowest to fastest
std::string to_string(Axis a);                                // "dp", "pp", ...

struct GridShape {
  int dp = 1, pp = 1, ep = 1, cp = 1, tp = 1;
  int total() const { return dp * pp * ep * cp * tp; }
  int extent(Axis a) const;
};

// A rank's coordinates, indexed by Axis (dp first).
using GridCoords = std::array<int, 5>;

// World rank r's coordinates on a grid of this shape (the layout above).
GridCoords grid_coords(const GridShape& shape, int world_rank);
// A group's label from the axes it spans (bit 1 << Axis): those with more than one rank, in Axis
// order, joined by "+" ("dp+ep"), or "self" where none has. (ProcessGrid's own labels keep every
// listed axis: its tp group is "tp" even where tp = 1.)
std::string axes_label(const GridShape& shape, unsigned axes_mask);
// The same label from a group's members' world ranks: the axes along which their coordinates
// differ. A namer for CountingCommunicator::name_groups (k2c/dist/counting.h).
std::string group_label(const GridShape& shape, const std::vector<int>& world_ranks);

class ProcessGrid {
 public:
  // Throws std::invalid_argument unless shape.total() == world.size(). Builds the five
  // single-axis groups (a collective call: every rank of the world makes it). When `world` is a
  // CountingCommunicator (k2c/dist/counting.h), the groups count into its ledger under their
  // axes' names ("tp", "dp+cp").
  ProcessGrid(Communicator& world, GridShape shape);
  const GridShape& shape() const { return shape_; }
  Communicator& world() const { return world_; }
  int coord(Axis a) const { return coords_[static_cast<int>(a)]; }
  const GridCoords& coords() const { return coords_; }
  Communicator& group(Axis a) { return *groups_[static_cast<int>(a)]; }

  // The group over the ranks that differ from this one only in the listed axes (their order in
  // the list and repeats do not matter; one axis gives group(axis)). Its ranks are ordered by
  // their coordinates in the grid's layout order (dp slowest): the order of their world ranks.
  // Made on first use and kept: the first call for a set of axes is a collective over the world
  // (a split), so every rank must make it at the same point of the program; later calls are
  // free. An empty list throws std::invalid_argument.
  Communicator& group(std::initializer_list<Axis> axes);

  // World rank of the rank at the given coordinates; throws std::invalid_argument when one is
  // outside the grid.
  int world_rank(const GridCoords& at) const;
  // Pipeline neighbours: the world ranks one stage before and after this one, every other
  // coordinate equal; -1 past either end.
  int prev_stage() const;
  int next_stage() const;
  bool is_first_stage() const { return coord(Axis::pp) == 0; }
  bool is_last_stage() const { return coord(Axis::pp) == shape_.pp - 1; }

  std::string describe() const;  // "rank 5: dp 1/2 pp 0/1 ep 0/1 cp 0/1 tp 1/2"

 private:
  std::unique_ptr<Communicator> make_group(unsigned axes_mask);
  Communicator& world_;
  GridShape shape_;
  GridCoords coords_{};
  std::array<std::unique_ptr<Communicator>, 5> groups_;
  std::map<unsigned, std::unique_ptr<Communicator>> combined_;  // by bit mask of axes (1 << Axis)
};

}  // namespace k2c::dist
