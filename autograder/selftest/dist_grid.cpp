// dist_grid.cpp — the process grid on 4 or 8 ranks (run by CTest under mpirun -np 4 and -np 8,
// MPI backend): every listed shape that multiplies to the job's size gives groups of the right
// sizes whose members agree on the coordinates they share, and a shape of the wrong size is
// refused with a clear message.
#include <stdexcept>
#include <string>
#include <vector>

#include "k2c/dist/grid.h"
#include "k2c/dist/runtime.h"

namespace kd = k2c::dist;

static void require(bool ok, const std::string& what) {
  if (!ok) throw std::runtime_error("grid check failed: " + what);
}

int main(int argc, char** argv) {
  return kd::run(argc, argv, [](kd::Communicator& w) {
    require(w.size() == 4 || w.size() == 8, "run me on 4 or 8 ranks");
    const std::vector<kd::GridShape> shapes =
        w.size() == 4 ? std::vector<kd::GridShape>{{.dp = 2, .tp = 2}, {.dp = 4}, {.pp = 2, .ep = 2},
                                                   {.cp = 2, .tp = 2}, {.tp = 4}}
                      : std::vector<kd::GridShape>{{.dp = 2, .pp = 2, .tp = 2}, {.dp = 8},
                                                   {.pp = 2, .ep = 2, .tp = 2}, {.dp = 4, .cp = 2},
                                                   {.ep = 8}, {.dp = 2, .ep = 4}};
    const kd::Axis axes[] = {kd::Axis::dp, kd::Axis::pp, kd::Axis::ep, kd::Axis::cp, kd::Axis::tp};
    for (const kd::GridShape& shape : shapes) {
      kd::ProcessGrid grid(w, shape);
      for (kd::Axis a : axes) {
        kd::Communicator& g = grid.group(a);
        require(g.size() == shape.extent(a), grid.describe() + ": group size");
        require(g.rank() == grid.coord(a), grid.describe() + ": rank in group = coordinate");
        // Members of a group share every other coordinate: the sum of a coordinate over the
        // group is size × coordinate for every other axis.
        for (kd::Axis b : axes) {
          if (b == a) continue;
          int mine = grid.coord(b), sum = 0;
          g.all_reduce(&mine, &sum, 1, kd::DType::i32, kd::ReduceOp::sum);
          require(sum == g.size() * grid.coord(b), grid.describe() + ": group spans other coordinates");
        }
      }
    }
    bool refused = false;
    try {
      kd::ProcessGrid bad(w, {.dp = 3});
    } catch (const std::invalid_argument& e) {
      refused = std::string(e.what()).find("the job has " + std::to_string(w.size())) != std::string::npos;
    }
    require(refused, "a 3-rank grid must be refused with the counts");
    if (w.rank() == 0) std::printf("process grid: %zu shapes on %d ranks OK\n", shapes.size(), w.size());
  });
}
