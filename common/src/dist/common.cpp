// common.cpp — what does not depend on the backend: names and checks both backends share
// (k2c/dist/communicator.h), the process grid (k2c/dist/grid.h), the counting decorator
// (k2c/dist/counting.h) and time_step (k2c/dist/timing.h).
#include <algorithm>
#include <atomic>
#include <chrono>
#include <iomanip>
#include <sstream>
#include <stdexcept>

#include "k2c/core/check.h"
#include "k2c/dist/communicator.h"
#include "k2c/dist/counting.h"
#include "k2c/dist/grid.h"
#include "k2c/dist/timing.h"
#include "mpi_communicator.h"

namespace k2c::dist {

namespace {
std::atomic<std::uint64_t> g_library_collectives{0};
}
std::uint64_t library_collectives() { return g_library_collectives.load(std::memory_order_relaxed); }
void detail::count_library_collective() { g_library_collectives.fetch_add(1, std::memory_order_relaxed); }

std::string to_string(Backend b) { return b == Backend::nccl ? "nccl" : "mpi"; }
std::string to_string(DType t) {
  switch (t) {
    case DType::f32: return "f32";
    case DType::f64: return "f64";
    case DType::i32: return "i32";
    case DType::bf16: return "bf16";
  }
  return "?";
}
std::string to_string(ReduceOp op) {
  switch (op) {
    case ReduceOp::sum: return "sum";
    case ReduceOp::max: return "max";
    case ReduceOp::avg: return "avg";
  }
  return "?";
}

void check_reduction(DType t, ReduceOp op, const char* what) {
  K2C_CHECK(!(op == ReduceOp::avg && t == DType::i32),
            what << ": ReduceOp::avg needs a floating-point type (f32, f64, bf16), got " << to_string(t)
                 << " (an integer average would have to round; sum, then divide as you need)");
}

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

std::string to_string(Axis a) {
  static const char* names[] = {"dp", "pp", "ep", "cp", "tp"};
  return names[static_cast<int>(a)];
}

GridCoords grid_coords(const GridShape& shape, int world_rank) {
  GridCoords at{};
  for (int a = 4; a >= 0; --a) {  // mixed-radix digits, tp fastest
    const int e = shape.extent(static_cast<Axis>(a));
    at[a] = world_rank % e;
    world_rank /= e;
  }
  return at;
}

std::string axes_label(const GridShape& shape, unsigned axes_mask) {
  std::string label;
  for (int a = 0; a < 5; ++a)
    if ((axes_mask & (1u << a)) && shape.extent(static_cast<Axis>(a)) > 1)
      label += (label.empty() ? "" : "+") + to_string(static_cast<Axis>(a));
  return label.empty() ? "self" : label;
}

std::string group_label(const GridShape& shape, const std::vector<int>& world_ranks) {
  unsigned varies = 0;
  for (int r : world_ranks) {
    const GridCoords at = grid_coords(shape, r), first = grid_coords(shape, world_ranks.front());
    for (int a = 0; a < 5; ++a)
      if (at[a] != first[a]) varies |= 1u << a;
  }
  return axes_label(shape, varies);
}

ProcessGrid::ProcessGrid(Communicator& world, GridShape shape) : world_(world), shape_(shape) {
  K2C_CHECK(shape.dp >= 1 && shape.pp >= 1 && shape.ep >= 1 && shape.cp >= 1 && shape.tp >= 1,
            "process grid: every extent must be >= 1");
  K2C_CHECK(shape.total() == world.size(),
            "process grid dp" << shape.dp << " x pp" << shape.pp << " x ep" << shape.ep << " x cp"
                              << shape.cp << " x tp" << shape.tp << " = " << shape.total()
                              << " ranks, but the job has " << world.size());
  coords_ = grid_coords(shape, world.rank());
  for (int a = 0; a < 5; ++a) groups_[a] = make_group(1u << a);
}

// The group along the axes in `mask`: ranks equal in every other coordinate. Color = the world
// rank with those coordinates zeroed (the same for the whole group, different between groups);
// key = the mixed-radix number of those coordinates, slowest axis first, which orders the
// members as their world ranks are ordered.
std::unique_ptr<Communicator> ProcessGrid::make_group(unsigned mask) {
  GridCoords base = coords_;
  int key = 0;
  std::string label;
  for (int a = 0; a < 5; ++a) {
    if (!(mask & (1u << a))) continue;
    base[a] = 0;
    key = key * shape_.extent(static_cast<Axis>(a)) + coords_[a];
    label += (label.empty() ? "" : "+") + to_string(static_cast<Axis>(a));
  }
  const int color = world_rank(base);
  if (auto* counting = dynamic_cast<CountingCommunicator*>(&world_)) return counting->split(color, key, label);
  return world_.split(color, key);
}

Communicator& ProcessGrid::group(std::initializer_list<Axis> axes) {
  K2C_CHECK(axes.size() > 0, "process grid: group({}) needs at least one axis");
  unsigned mask = 0;
  for (Axis a : axes) mask |= 1u << static_cast<int>(a);
  for (int a = 0; a < 5; ++a)
    if (mask == (1u << a)) return *groups_[a];
  std::unique_ptr<Communicator>& g = combined_[mask];
  if (!g) g = make_group(mask);
  return *g;
}

int ProcessGrid::world_rank(const GridCoords& at) const {
  int r = 0;
  for (int a = 0; a < 5; ++a) {
    const int e = shape_.extent(static_cast<Axis>(a));
    K2C_CHECK(at[a] >= 0 && at[a] < e, "process grid: coordinate " << at[a] << " of "
                                                                   << to_string(static_cast<Axis>(a))
                                                                   << " is outside 0.." << e - 1);
    r = r * e + at[a];
  }
  return r;
}

int ProcessGrid::prev_stage() const {
  if (is_first_stage()) return -1;
  GridCoords at = coords_;
  --at[static_cast<int>(Axis::pp)];
  return world_rank(at);
}

int ProcessGrid::next_stage() const {
  if (is_last_stage()) return -1;
  GridCoords at = coords_;
  ++at[static_cast<int>(Axis::pp)];
  return world_rank(at);
}

std::string ProcessGrid::describe() const {
  std::ostringstream os;
  os << "rank " << world_.rank() << ":";
  for (int a = 0; a < 5; ++a)
    os << " " << to_string(static_cast<Axis>(a)) << " " << coords_[a] << "/" << shape_.extent(static_cast<Axis>(a));
  return os.str();
}

// ------------------------------------------------------------------------------ counting -----

CountingCommunicator::CountingCommunicator(Communicator& inner, std::string label)
    : inner_(inner), label_(std::move(label)), ledger_(std::make_shared<TrafficTable>()),
      namer_(std::make_shared<GroupNamer>()), world_rank_(inner.rank()), waits_(std::make_shared<Waits>()) {}

CountingCommunicator::CountingCommunicator(std::unique_ptr<Communicator> inner, std::string label)
    : owned_(std::move(inner)), inner_(*owned_), label_(std::move(label)), ledger_(std::make_shared<TrafficTable>()),
      namer_(std::make_shared<GroupNamer>()), world_rank_(inner_.rank()), waits_(std::make_shared<Waits>()) {}

CountingCommunicator::CountingCommunicator(std::unique_ptr<Communicator> inner, std::string label,
                                           std::shared_ptr<TrafficTable> ledger, std::shared_ptr<Waits> waits,
                                           std::shared_ptr<GroupNamer> namer, int world_rank)
    : owned_(std::move(inner)), inner_(*owned_), label_(std::move(label)), ledger_(std::move(ledger)),
      namer_(std::move(namer)), world_rank_(world_rank), root_(false), waits_(std::move(waits)) {}

std::unique_ptr<CountingCommunicator> CountingCommunicator::split(int color, int key, std::string label) {
  // The constructor that shares the ledger is private: make_unique cannot reach it.
  return std::unique_ptr<CountingCommunicator>(
      new CountingCommunicator(inner_.split(color, key), std::move(label), ledger_, waits_, namer_, world_rank_));
}

std::unique_ptr<Communicator> CountingCommunicator::split(int color, int key) {
  if (!*namer_) return split(color, key, label_ + "/split");
  std::unique_ptr<Communicator> group = inner_.split(color, key);
  // The members' world ranks, through the group's own memory (device memory on NCCL).
  const int n = group->size();
  std::vector<int> members(static_cast<std::size_t>(n));
  {
    Buffer mine(*group, sizeof(int)), all(*group, members.size() * sizeof(int));
    group->to_backend(mine.get(), &world_rank_, sizeof(int));
    group->all_gather(mine.get(), all.get(), 1, DType::i32);
    group->to_host(members.data(), all.get(), members.size() * sizeof(int));
  }
  std::sort(members.begin(), members.end());
  return std::unique_ptr<CountingCommunicator>(
      new CountingCommunicator(std::move(group), (*namer_)(members), ledger_, waits_, namer_, world_rank_));
}

void CountingCommunicator::name_groups(GroupNamer namer) {
  // The namer is shared with every split: set on a split, it would rename its parent's groups too.
  K2C_CHECK(root_, "CountingCommunicator::name_groups: call it on the world, not on a split ('" << label_ << "')");
  *namer_ = std::move(namer);
}

void CountingCommunicator::record(const char* op, std::uint64_t bytes, bool started) {
  Traffic& t = (*ledger_)[label_][op];
  ++t.calls;
  t.started += started ? 1 : 0;
  t.bytes += bytes;
}

Traffic CountingCommunicator::count(const std::string& label, const std::string& op) const {
  const auto l = ledger_->find(label);
  if (l == ledger_->end()) return {};
  const auto o = l->second.find(op);
  return o == l->second.end() ? Traffic{} : o->second;
}

Traffic CountingCommunicator::total(const std::string& op) const {
  Traffic sum;
  for (const auto& [label, ops] : *ledger_) {
    const auto o = ops.find(op);
    if (o == ops.end()) continue;
    sum.calls += o->second.calls;
    sum.started += o->second.started;
    sum.bytes += o->second.bytes;
  }
  return sum;
}

std::uint64_t CountingCommunicator::calls_except(const std::set<std::pair<std::string, std::string>>& allowed) const {
  std::uint64_t calls = 0;
  for (const auto& [label, ops] : *ledger_)
    for (const auto& [op, t] : ops)
      if (!allowed.count({label, op})) calls += t.calls;
  return calls;
}

std::string CountingCommunicator::report() const {
  std::ostringstream os;
  os << "traffic of rank " << rank() << " (bytes as defined in k2c/dist/counting.h):\n";
  if (ledger_->empty()) os << "  nothing\n";
  for (const auto& [label, ops] : *ledger_)
    for (const auto& [op, t] : ops)
      os << "  " << std::left << std::setw(12) << label << " " << std::setw(15) << op << std::right
         << " calls " << std::setw(6) << t.calls << "  started " << std::setw(6) << t.started << "  bytes "
         << std::setw(14) << t.bytes << "\n";
  return os.str();
}

void CountingCommunicator::reset() {
  ledger_->clear();
  *waits_ = {};
}

Ticket CountingCommunicator::remember(Ticket ticket, std::uint64_t bytes) {
  started_bytes_[ticket.id] = bytes;
  return ticket;
}

void CountingCommunicator::wait(Ticket ticket) {
  ++waits_->calls;
  if (const auto it = started_bytes_.find(ticket.id); it != started_bytes_.end()) {
    waits_->bytes += it->second;
    started_bytes_.erase(it);
  }
  inner_.wait(ticket);
}

void CountingCommunicator::drained() {
  ++waits_->calls;
  for (const auto& [id, bytes] : started_bytes_) waits_->bytes += bytes;
  started_bytes_.clear();
}

void CountingCommunicator::synchronize() {
  drained();
  inner_.synchronize();
}

void CountingCommunicator::free(void* p) {
  if (!started_bytes_.empty()) drained();
  inner_.free(p);
}

void* CountingCommunicator::scratch(std::size_t bytes) {
  if (bytes > scratch_bytes_) {
    scratch_bytes_ = bytes;
    if (!started_bytes_.empty()) drained();
  }
  return inner_.scratch(bytes);
}

// The counts are recorded before forwarding: a call that throws (a refused reduction) was still
// asked for, and the ledger is about what the algorithm asked for.
void CountingCommunicator::send(const void* buf, std::size_t count, DType t, int peer) {
  record("send", count * dtype_size(t), false);
  inner_.send(buf, count, t, peer);
}
void CountingCommunicator::recv(void* buf, std::size_t count, DType t, int peer) {
  record("recv", count * dtype_size(t), false);
  inner_.recv(buf, count, t, peer);
}
Ticket CountingCommunicator::start_send_recv(const void* send_buf, std::size_t send_count, int dst, void* recv_buf,
                                             std::size_t recv_count, int src, DType t) {
  const std::uint64_t bytes = send_count * dtype_size(t);
  record("send_recv", bytes, true);
  return remember(inner_.start_send_recv(send_buf, send_count, dst, recv_buf, recv_count, src, t), bytes);
}

void CountingCommunicator::all_reduce(const void* send, void* recv, std::size_t count, DType t, ReduceOp op) {
  record("all_reduce", count * dtype_size(t), false);
  inner_.all_reduce(send, recv, count, t, op);
}
void CountingCommunicator::reduce_scatter(const void* send, void* recv, std::size_t count, DType t, ReduceOp op) {
  record("reduce_scatter", count * size() * dtype_size(t), false);
  inner_.reduce_scatter(send, recv, count, t, op);
}
void CountingCommunicator::all_gather(const void* send, void* recv, std::size_t count, DType t) {
  record("all_gather", count * size() * dtype_size(t), false);
  inner_.all_gather(send, recv, count, t);
}
void CountingCommunicator::broadcast(void* buf, std::size_t count, DType t, int root) {
  record("broadcast", count * dtype_size(t), false);
  inner_.broadcast(buf, count, t, root);
}
void CountingCommunicator::reduce(const void* send, void* recv, std::size_t count, DType t, ReduceOp op, int root) {
  record("reduce", count * dtype_size(t), false);
  inner_.reduce(send, recv, count, t, op, root);
}
void CountingCommunicator::all_to_all(const void* send, void* recv, std::size_t count, DType t) {
  record("all_to_all", count * size() * dtype_size(t), false);
  inner_.all_to_all(send, recv, count, t);
}

static std::uint64_t sum_of(const std::vector<std::size_t>& counts) {
  std::uint64_t s = 0;
  for (std::size_t c : counts) s += c;
  return s;
}

void CountingCommunicator::all_to_all_v(const void* send, const std::vector<std::size_t>& send_counts,
                                        const std::vector<std::size_t>& send_offsets, void* recv,
                                        const std::vector<std::size_t>& recv_counts,
                                        const std::vector<std::size_t>& recv_offsets, DType t) {
  record("all_to_all_v", sum_of(send_counts) * dtype_size(t), false);
  inner_.all_to_all_v(send, send_counts, send_offsets, recv, recv_counts, recv_offsets, t);
}

Ticket CountingCommunicator::start_all_reduce(const void* send, void* recv, std::size_t count, DType t,
                                              ReduceOp op) {
  const std::uint64_t bytes = count * dtype_size(t);
  record("all_reduce", bytes, true);
  return remember(inner_.start_all_reduce(send, recv, count, t, op), bytes);
}
Ticket CountingCommunicator::start_reduce_scatter(const void* send, void* recv, std::size_t count, DType t,
                                                  ReduceOp op) {
  const std::uint64_t bytes = count * size() * dtype_size(t);
  record("reduce_scatter", bytes, true);
  return remember(inner_.start_reduce_scatter(send, recv, count, t, op), bytes);
}
Ticket CountingCommunicator::start_all_gather(const void* send, void* recv, std::size_t count, DType t) {
  const std::uint64_t bytes = count * size() * dtype_size(t);
  record("all_gather", bytes, true);
  return remember(inner_.start_all_gather(send, recv, count, t), bytes);
}
Ticket CountingCommunicator::start_all_to_all_v(const void* send, const std::vector<std::size_t>& send_counts,
                                                const std::vector<std::size_t>& send_offsets, void* recv,
                                                const std::vector<std::size_t>& recv_counts,
                                                const std::vector<std::size_t>& recv_offsets, DType t) {
  const std::uint64_t bytes = sum_of(send_counts) * dtype_size(t);
  record("all_to_all_v", bytes, true);
  return remember(inner_.start_all_to_all_v(send, send_counts, send_offsets, recv, recv_counts, recv_offsets, t), bytes);
}

void CountingCommunicator::barrier() {
  record("barrier", 0, false);
  inner_.barrier();
}

// ----------------------------------------------------------------------------- time_step -----

TimingResult time_step(Communicator& c, const std::function<void()>& fn, TimeStepOptions options) {
  K2C_CHECK(options.repeats >= 1 && options.warmup >= 0,
            "time_step: needs repeats >= 1 and warmup >= 0, got " << options.repeats << " and " << options.warmup);
  for (int i = 0; i < options.warmup; ++i) {
    fn();
    c.synchronize();
  }
  c.barrier();
  const std::size_t n = static_cast<std::size_t>(options.repeats);
  std::vector<double> mine(n);
  for (std::size_t i = 0; i < n; ++i) {
    c.barrier();  // every rank starts the repeat together, so the max over ranks is the step's time
    const auto t0 = std::chrono::steady_clock::now();
    fn();
    c.synchronize();
    mine[i] = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  }
  // One reduction for all repeats, through the communicator's own memory (device memory on NCCL).
  TimingResult r;
  r.repeat_ms.resize(n);
  {
    Buffer times(c, n * sizeof(double));
    c.to_backend(times.get(), mine.data(), n * sizeof(double));
    c.all_reduce(times.get(), times.get(), n, DType::f64, ReduceOp::max);
    c.to_host(r.repeat_ms.data(), times.get(), n * sizeof(double));
  }
  std::vector<double> sorted = r.repeat_ms;
  std::sort(sorted.begin(), sorted.end());
  r.min_ms = sorted.front();
  r.max_ms = sorted.back();
  r.median_ms = n % 2 ? sorted[n / 2] : 0.5 * (sorted[n / 2 - 1] + sorted[n / 2]);
  return r;
}

}  // namespace k2c::dist
