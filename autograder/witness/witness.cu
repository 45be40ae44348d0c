// k2c_witness — the grader's own run of one timed kernel, in a process with no student code.
//
//   k2c_witness NAME --out VERDICT.json [--shapes N] [--ceiling CEILING] [--timeout S]
//               [--uid U --gid G [--private-tmp [--private-pids] [--private-net]]] [--cwd DIR] [--env K=V]... -- TEST_PROGRAM [ARGS...]
//
// Two kinds of run. Timed (the default): the kernel at its performance test's shape, in windows
// the checker clocks, a sample of each launch's output checked. Correctness (--shapes N): N shapes
// the checker draws within the contract the module's tests check, one launch each, every output
// element checked; no clock.
//
// The protocol is in common/include/k2c/testing/witness.h; what each witness launches, on which
// buffers, and how its output is checked is in specs.cu. The verdict (JSON) says what the
// checker saw: the best rate over its windows in the rubric's unit, or the problem, and whose
// fault it was: "grader" when the checker could not set the run up (no device, buffers it cannot
// lend: its own server tries them first), "submission" for anything that happened once the test
// program was started, including its silence. The grader (k2c grade) compares the rate with the test program's own report.
// With --ceiling, a timed run also measures the ceiling the rubric names for the test (those this
// program knows, see measure_ceiling), before the test program starts: the grader holds the
// report's ceiling against it, as it holds the report's rate against the witnessed one.
//
// A window holds more than the work: the socket's round trip, the GPU's switch from this process's
// context to the test program's and back, the read of the outputs (about 0.6 ms on an H200, as
// long as a dozen launches of a bandwidth-bound kernel). So the checker first runs the same
// windows against itself (`k2c_witness --serve-calibration`, an empty kernel per set) and takes
// the fastest of those off each window of the test program.
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <optional>
#include <random>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include <cuda_runtime.h>
#include <nlohmann/json.hpp>

#include "k2c/core/check.h"
#include "k2c/core/fd_io.h"
#include "k2c/core/random.h"
#include "k2c/device/device.h"
#include "k2c/device/shared_memory.h"
#include "k2c/device/timing.h"
#include "k2c/reference/ceilings.h"
#include "k2c/testing/witness.h"
#include "process.h"
#include "specs.h"
#include "verdict_file.h"

namespace {

using nlohmann::json;
using Clock = std::chrono::steady_clock;
namespace wp = k2c::witness;

constexpr int kWindows = 5;
// What all sets together may take of the device: enough launches per window that its fixed cost
// (about half a millisecond, see the calibration in run()) is a small part of it, without crowding
// a GPU smaller than the H200.
constexpr std::size_t kSetBudget = std::size_t{16} << 30;

struct Args {
  std::string name, out;
  int shapes = 0;       // > 0: a correctness run over that many drawn shapes
  std::string ceiling;  // the rubric's name of the timed test's ceiling ("": none measured)
  double timeout_s = 300;
  int uid = -1, gid = -1;
  bool private_tmp = false;  // the test program's runs with temporary folders of their own (process.h)
  bool private_pids = false;  // and processes of their own (process.h)
  bool private_net = false;   // and a network of their own (process.h)
  std::string cwd;
  std::vector<std::pair<std::string, std::string>> env;
  std::vector<std::string> program;
};

Args parse(int argc, char** argv) {
  Args a;
  if (argc < 2) throw std::invalid_argument("usage: k2c_witness NAME --out FILE [options] -- PROGRAM [ARGS]");
  a.name = argv[1];
  for (int i = 2; i < argc; ++i) {
    const std::string arg = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) throw std::invalid_argument(arg + " needs a value");
      return argv[++i];
    };
    if (arg == "--") {
      a.program.assign(argv + i + 1, argv + argc);
      break;
    }
    if (arg == "--out") a.out = value();
    else if (arg == "--timeout") a.timeout_s = std::stod(value());
    else if (arg == "--shapes") a.shapes = std::stoi(value());
    else if (arg == "--ceiling") a.ceiling = value();
    else if (arg == "--uid") a.uid = std::stoi(value());
    else if (arg == "--gid") a.gid = std::stoi(value());
    else if (arg == "--private-tmp") a.private_tmp = true;
    else if (arg == "--private-pids") a.private_pids = true;
    else if (arg == "--private-net") a.private_net = true;
    else if (arg == "--cwd") a.cwd = value();
    else if (arg == "--env") {
      const std::string kv = value();
      const auto eq = kv.find('=');
      if (eq == std::string::npos) throw std::invalid_argument("--env " + kv + ": expected K=V");
      a.env.emplace_back(kv.substr(0, eq), kv.substr(eq + 1));
    } else {
      throw std::invalid_argument("unknown option " + arg);
    }
  }
  if (a.out.empty() || a.program.empty()) throw std::invalid_argument("--out and a program after -- are required");
  if (a.shapes < 0 || a.shapes > 64) throw std::invalid_argument("--shapes: expected 0 to 64");
  if (a.private_pids && !a.private_tmp) throw std::invalid_argument("--private-pids needs --private-tmp");
  if (a.private_net && !a.private_tmp) throw std::invalid_argument("--private-net needs --private-tmp");
  return a;
}

using k2c::witness_io::write_verdict;

// The ceiling the rubric calls `name`, in the rubric's unit, measured as the test programs measure
// it (k2c/reference/ceilings.h); nothing for a ceiling this program does not know (those measured
// inside a test, interleaved with the kernel's own repeats). Where tests measure one ceiling at
// several sizes, the size that gives the lowest of them: the grader voids only a report whose
// ceiling is well below this one, so it must never be above an honest report's.
std::optional<double> measure_ceiling(const std::string& name) {
  if (name == "cudaMemcpy D2D") return k2c::copy_bandwidth() / 1e9;  // GB/s; every such test copies 1 GiB
  if (name == "fp32 peak") return k2c::fp32_peak_flops(k2c::device_info()) / 1e12;
  if (name == "cuBLAS SGEMM") return k2c::sgemm_rate(4096) / 1e12;
  if (name == "naive SGEMM") return k2c::naive_sgemm_rate(4096) / 1e12;
  if (name == "cuBLAS bf16 GEMM") return k2c::bf16_gemm_rate(4096) / 1e12;  // tests take 4096 or 8192 (faster)
  return std::nullopt;
}

json verdict(const std::string& name, const std::string& fault, const std::string& problem) {
  return {{"witness", name}, {"fault", fault}, {"problem", problem}};
}

// This program's own path, to start it as the calibration's server.
std::string self_path() {
  std::vector<char> buf(4096);
  const ssize_t n = readlink("/proc/self/exe", buf.data(), buf.size() - 1);
  if (n <= 0) throw std::runtime_error("cannot find k2c_witness's own path");
  return std::string(buf.data(), static_cast<std::size_t>(n));
}

__global__ void empty_kernel() {}

// Copies each range of the shared allocation into `staging` (one block per range).
__global__ void gather(const char* base, const k2c::witness_specs::Range* ranges, const std::uint64_t* into,
                       char* staging) {
  const k2c::witness_specs::Range r = ranges[blockIdx.x];
  for (std::uint64_t i = threadIdx.x; i < r.bytes; i += blockDim.x) staging[into[blockIdx.x] + i] = base[r.offset + i];
}

void gather_all(const char* base, std::size_t count, const k2c::witness_specs::Range* ranges, const std::uint64_t* into,
                char* staging) {
  if (count > 0) gather<<<static_cast<unsigned>(count), 256>>>(base, ranges, into, staging);
  K2C_CUDA_CHECK(cudaGetLastError());
}

// The socket to the test program, read with deadlines; the child's exit ends any wait early.
class Channel {
 public:
  Channel(int fd, const std::atomic<bool>& child_done) : fd_(fd), child_done_(child_done) {}
  bool send(const void* data, std::size_t n) { return k2c::send_fully(fd_, data, n); }
  // "" once a whole Reply arrived, else why not.
  std::string receive(wp::Reply& r, double seconds) {
    char* p = reinterpret_cast<char*>(&r);
    std::size_t need = sizeof r;
    const auto deadline = Clock::now() + std::chrono::duration<double>(seconds);
    while (need > 0) {
      if (Clock::now() >= deadline) return "no answer within " + std::to_string(static_cast<int>(seconds)) + " s";
      pollfd pf{fd_, POLLIN, 0};
      const int ready = poll(&pf, 1, 20);
      if (ready > 0) {
        const ssize_t got = recv(fd_, p, need, 0);
        if (got <= 0) return "the test program closed the channel";
        p += got;
        need -= static_cast<std::size_t>(got);
      } else if (child_done_.load()) {
        return "the test program ended";
      }
    }
    if (r.magic != wp::kMagic) return "the test program sent something that is not a reply";
    r.message[sizeof r.message - 1] = '\0';
    return "";
  }

 private:
  int fd_;
  const std::atomic<bool>& child_done_;
};

// The allocation shared with a test program: every set's buffers, and the greeting naming them.
struct Layout {
  const k2c::witness_specs::Spec* spec = nullptr;
  int sets = 0;
  std::optional<k2c::SharedDeviceMemory> memory;  // lent to the test program (shared_memory.h)
  char* base = nullptr;                           // memory's first byte
  wp::Hello hello;
  std::vector<char*> buffers(int set) const {
    std::vector<char*> p;
    for (std::size_t b = 0; b < spec->buffers.size(); ++b) p.push_back(base + hello.offset[set][b]);
    return p;
  }
};

// Lays out as many sets as the budget holds (at most kMaxSets and `max_sets`); throws what stands
// in the way.
Layout lay_out(const k2c::witness_specs::Spec& spec, int max_sets) {
  if (spec.buffers.size() > static_cast<std::size_t>(wp::kMaxBuffers))
    throw std::runtime_error("a launch of more than kMaxBuffers buffers");
  if (spec.shape.size() > static_cast<std::size_t>(wp::kMaxShape))
    throw std::runtime_error("a shape of more than kMaxShape dimensions");
  Layout l;
  l.spec = &spec;
  std::size_t set_bytes = 0;
  std::vector<std::size_t> buffer_offset;  // within a set
  for (const auto& b : spec.buffers) {
    buffer_offset.push_back(set_bytes);
    set_bytes += (b.bytes + 255) / 256 * 256;
  }
  if (!k2c::device_info().present) throw std::runtime_error("no CUDA device: " + k2c::device_info().reason);
  std::size_t free_bytes = 0, total = 0;
  K2C_CUDA_CHECK(cudaMemGetInfo(&free_bytes, &total));
  const std::size_t budget = std::min(kSetBudget, free_bytes / 2);
  l.sets = static_cast<int>(std::min<std::size_t>(std::min({wp::kMaxSets, spec.max_sets, max_sets}),
                                                  budget / std::max<std::size_t>(set_bytes, 1)));
  if (l.sets < 1) throw std::runtime_error("not enough device memory for one launch's buffers");
  l.memory = k2c::SharedDeviceMemory::create(set_bytes * l.sets);
  l.base = l.memory->data();
  l.hello.buffers = static_cast<std::uint32_t>(spec.buffers.size());
  l.hello.sets = static_cast<std::uint32_t>(l.sets);
  l.hello.bytes = l.memory->bytes();
  std::snprintf(l.hello.name, sizeof l.hello.name, "%s", spec.name.c_str());
  for (std::size_t i = 0; i < spec.shape.size(); ++i) l.hello.shape[i] = spec.shape[i];
  for (int s = 0; s < l.sets; ++s)
    for (std::size_t b = 0; b < spec.buffers.size(); ++b) l.hello.offset[s][b] = s * set_bytes + buffer_offset[b];
  return l;
}

// Fills set `set`'s inputs from `seed` and poisons its outputs (0xFF: NaN in fp32 and bf16).
void fill_set(const Layout& l, int set, std::uint64_t seed) {
  const std::vector<char*> p = l.buffers(set);
  l.spec->fill(p, seed);
  for (std::size_t b = 0; b < l.spec->buffers.size(); ++b)
    if (l.spec->buffers[b].output) K2C_CUDA_CHECK(cudaMemset(p[b], 0xFF, l.spec->buffers[b].bytes));
}

// The test program's command line for a witness run of `a`.
std::vector<std::string> witness_program(const Args& a) {
  std::vector<std::string> program = a.program;
  program.push_back("--k2c_witness=" + a.name);
  return program;
}

struct Session {
  std::string problem;            // "" when every window was timed (and, if checked, right)
  std::vector<double> window_ms;  // per window: Go to the checker's read of the outputs
  std::string output;             // the tail of what the test program printed
};

// How a session reads and judges the outputs: `check` compares them with the CPU reference,
// `whole` reads every piece of every launch rather than a sample.
struct Reading {
  int windows = kWindows;
  bool check = true, whole = false;
};

// Starts `program` with the channel on its fd 3 and runs the windows of `how` (see witness.h).
Session run_session(const Layout& l, const std::vector<std::string>& program, const Args& a, int uid, int gid,
                    Reading how, std::mt19937_64& rng) {
  namespace ws = k2c::witness_specs;
  const ws::Spec& spec = *l.spec;
  Session result;
  int fds[2];
  if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, fds) != 0) {
    result.problem = std::string("socketpair: ") + std::strerror(errno);
    return result;
  }
  std::atomic<bool> child_done{false};
  std::atomic<int> child_pid{0};
  k2c::grader::ProcessResult child;
  auto env = a.env;
  env.emplace_back("K2C_WITNESS_FD", std::to_string(wp::kChannelFd));
  std::thread runner([&] {
    child = k2c::grader::run_process(program, {.env = env,
                                               .cwd = a.cwd,
                                               .timeout_s = a.timeout_s,
                                               .uid = uid,
                                               .gid = gid,
                                               .on_start = [&](int pid) { child_pid = pid; },
                                               .channel_fd = fds[1],
                                               .private_tmp = a.private_tmp,
                                               .private_pids = a.private_pids,
                                               .private_net = a.private_net});
    child_done = true;
  });
  Channel channel(fds[0], child_done);
  auto finish = [&](const std::string& problem) {
    result.problem = problem;
    // A polite end first (an honest test program exits on End), then the group, whatever it does.
    for (int i = 0; i < 100 && !child_done.load(); ++i) std::this_thread::sleep_for(std::chrono::milliseconds(50));
    if (const int pid = child_pid.load(); pid > 0 && !child_done.load()) kill(-pid, SIGKILL);
    runner.join();
    close(fds[0]);
    close(fds[1]);
    result.output = k2c::grader::utf8_tail(child.output, 4000);
    return result;
  };

  const int memory_fd = l.memory->export_fd();
  const bool greeted = k2c::send_with_fd(fds[0], &l.hello, sizeof l.hello, memory_fd);
  close(memory_fd);
  if (!greeted) return finish("the test program did not take the checker's greeting");
  wp::Reply reply;
  // Start-up: CUDA's initialisation, mapping the buffers, two warm-up rounds of every set.
  if (std::string why = channel.receive(reply, std::min(a.timeout_s, 180.0)); !why.empty())
    return finish("before its first window: " + why);
  if (reply.status != wp::Status::ready) return finish(std::string("the test program could not start: ") + reply.message);

  char* staging = nullptr;
  ws::Range* d_ranges = nullptr;
  std::uint64_t* d_into = nullptr;
  auto release = [&] {
    cudaFree(staging);
    cudaFree(d_ranges);
    cudaFree(d_into);
    staging = nullptr;
    d_ranges = nullptr;
    d_into = nullptr;
  };
  try {
    for (int w = 0; w < how.windows; ++w) {
      const std::string window = "window " + std::to_string(w + 1);
      // Fresh inputs for every set, outputs poisoned (0xFF: NaN in fp32 and bf16), L2 emptied.
      const std::uint64_t seed = rng();
      for (int s = 0; s < l.sets; ++s) fill_set(l, s, k2c::mix64(seed + s));
      // Where the checker will read, drawn now and kept in this process: the test program cannot
      // know them in advance.
      std::vector<ws::Range> ranges;
      std::vector<std::uint64_t> into;
      std::vector<std::size_t> first_of_set;
      std::uint64_t staged = 0;
      for (int s = 0; s < l.sets; ++s) {
        first_of_set.push_back(ranges.size());
        const std::int64_t count = how.whole ? spec.pieces : std::min<std::int64_t>(spec.sampled, spec.pieces);
        for (std::int64_t i = 0; i < count; ++i)
          for (ws::Range r : spec.piece(how.whole ? i : static_cast<std::int64_t>(rng() % spec.pieces))) {
            r.offset += l.hello.offset[s][r.buffer];
            ranges.push_back(r);
            into.push_back(staged);
            staged += (r.bytes + 15) / 16 * 16;
          }
      }
      first_of_set.push_back(ranges.size());
      release();
      K2C_CUDA_CHECK(cudaMalloc(&staging, std::max<std::uint64_t>(staged, 16)));
      K2C_CUDA_CHECK(cudaMalloc(&d_ranges, std::max<std::size_t>(ranges.size(), 1) * sizeof(ws::Range)));
      K2C_CUDA_CHECK(cudaMalloc(&d_into, std::max<std::size_t>(into.size(), 1) * sizeof(std::uint64_t)));
      K2C_CUDA_CHECK(cudaMemcpy(d_ranges, ranges.data(), ranges.size() * sizeof(ws::Range), cudaMemcpyHostToDevice));
      K2C_CUDA_CHECK(cudaMemcpy(d_into, into.data(), into.size() * sizeof(std::uint64_t), cudaMemcpyHostToDevice));
      std::vector<char> got(staged);
      // The outputs must still hold the poison when Go is sent: a test program that computed them
      // from the inputs while this process was still filling them would otherwise be done before
      // its clock starts.
      gather_all(l.base, ranges.size(), d_ranges, d_into, staging);
      K2C_CUDA_CHECK(cudaMemcpy(got.data(), staging, staged, cudaMemcpyDeviceToHost));
      for (std::size_t i = 0; i < ranges.size(); ++i)
        if (spec.buffers[ranges[i].buffer].output &&
            std::any_of(got.data() + into[i], got.data() + into[i] + ranges[i].bytes, [](char c) { return c != '\xFF'; }))
          return release(), finish(window + ": outputs were written before the launches were asked for");
      k2c::flush_l2();
      K2C_CUDA_CHECK(cudaDeviceSynchronize());

      // The window: Go, the test program's launches, Done, and the checker's own read of the
      // outputs. Work still running when Done came is either read unfinished (and caught) or
      // finished before the read completes, on the clock either way.
      const auto t0 = Clock::now();
      wp::Order go;
      go.command = wp::Command::go;
      go.window = static_cast<std::uint32_t>(w);
      if (!channel.send(&go, sizeof go)) return finish("the test program left before " + window);
      if (std::string why = channel.receive(reply, std::max(60.0, a.timeout_s / 2)); !why.empty())
        return finish(window + ": " + why);
      if (reply.status != wp::Status::done || reply.window != go.window)
        return finish(window + ": " + (reply.status == wp::Status::failed ? std::string(reply.message) : "an answer out of turn"));
      gather_all(l.base, ranges.size(), d_ranges, d_into, staging);
      K2C_CUDA_CHECK(cudaMemcpy(got.data(), staging, staged, cudaMemcpyDeviceToHost));
      result.window_ms.push_back(std::chrono::duration<double, std::milli>(Clock::now() - t0).count());

      // Off the clock: every set's sample against the CPU reference.
      for (int s = 0; how.check && s < l.sets; ++s) {
        std::vector<ws::Range> mine;
        std::vector<const char*> bytes;
        for (std::size_t i = first_of_set[s]; i < first_of_set[s + 1]; ++i) {
          ws::Range r = ranges[i];
          r.offset -= l.hello.offset[s][r.buffer];
          mine.push_back(r);
          bytes.push_back(got.data() + into[i]);
        }
        const std::string problem = spec.check(k2c::mix64(seed + s), mine, bytes);
        if (!problem.empty())
          return release(), finish(window + ", launch " + std::to_string(s + 1) + " of " + std::to_string(l.sets) + ": " + problem);
      }
    }
  } catch (const std::exception& e) {
    // The checker's own CUDA calls: the test program may have broken the shared device state.
    release();
    return finish(std::string("the checker's CUDA work failed: ") + e.what());
  }
  release();
  wp::Order end;
  end.command = wp::Command::end;
  channel.send(&end, sizeof end);
  return finish("");
}

// A correctness run: a.shapes shapes drawn within the module's contract, each in a session of its
// own (one launch, every piece of the output checked). Every shape is drawn and laid out, and its
// buffers filled once (the test program's warm-up launches run on them before the first window),
// before any test program starts: what it does cannot then make the checker's own set-up fail.
int run_shapes(const Args& a, const k2c::witness_specs::Witness& witness, std::mt19937_64& rng) {
  namespace ws = k2c::witness_specs;
  std::vector<ws::Spec> specs;
  std::vector<Layout> layouts;
  specs.reserve(a.shapes);  // a Layout points at its Spec
  try {
    for (int i = 0; i < a.shapes; ++i) {
      specs.push_back(witness.make(witness.draw(rng)));
      layouts.push_back(lay_out(specs.back(), 1));
      fill_set(layouts.back(), 0, rng());
    }
    K2C_CUDA_CHECK(cudaDeviceSynchronize());
  } catch (const std::exception& e) {
    write_verdict(a.out, verdict(a.name, "grader", std::string("cannot set up the correctness run: ") + e.what()));
    return 0;
  }
  // Lending the buffers to another process, tried first with a server of the checker's own (an
  // empty kernel, nothing judged): where this machine cannot lend them, that is the grader's
  // fault, not the submission's.
  std::string lending;
  try {
    lending = run_session(layouts[0], {self_path(), "--serve-calibration"}, a, -1, -1, {.windows = 1, .check = false}, rng)
                  .problem;
  } catch (const std::exception& e) {
    lending = e.what();
  }
  if (!lending.empty()) {
    write_verdict(a.out, verdict(a.name, "grader", "cannot lend the buffers to another process: " + lending));
    return 0;
  }
  // From here on the test program runs: what goes wrong is the submission's.
  write_verdict(a.out, verdict(a.name, "submission", "the witness run ended before the checker could judge it"));
  const std::vector<std::string> program = witness_program(a);
  json shapes = json::array();
  for (std::size_t i = 0; i < specs.size(); ++i) {
    const Session s = run_session(layouts[i], program, a, a.uid, a.gid, {.windows = 1, .check = true, .whole = true}, rng);
    if (!s.problem.empty()) {
      json v = verdict(a.name, "submission", "at shape " + json(specs[i].shape).dump() + ": " + s.problem);
      v["output"] = s.output;
      write_verdict(a.out, v);
      return 0;
    }
    shapes.push_back(specs[i].shape);
  }
  json v = verdict(a.name, "", "");
  v["shapes"] = shapes;
  write_verdict(a.out, v);
  return 0;
}

int run(const Args& a) {
  namespace ws = k2c::witness_specs;
  const ws::Witness* witness = ws::find(a.name);
  if (witness == nullptr) {
    write_verdict(a.out, verdict(a.name, "grader", "k2c_witness has no witness named '" + a.name + "'"));
    return 0;
  }
  std::random_device entropy;
  std::mt19937_64 rng((static_cast<std::uint64_t>(entropy()) << 32) ^ entropy());
  if (!k2c::device_info().present) {
    write_verdict(a.out, verdict(a.name, "grader", "no CUDA device: " + k2c::device_info().reason));
    return 0;
  }
  if (a.shapes > 0) return run_shapes(a, *witness, rng);

  // ---- the grader's side: a failure here is not the submission's -------------------------------
  // The calibration: the same windows served by this program itself, launching an empty kernel
  // per set. What such a window takes (the socket's round trip, the GPU's switches between this
  // process and the server, the read of the outputs) is what every window takes beside the work;
  // it is taken off the test program's windows. Measured with code of the course's own, before
  // the test program runs, so nothing it does can stretch it.
  const ws::Spec spec = witness->make(witness->timed);
  Layout layout;
  Session calibration;
  try {
    layout = lay_out(spec, wp::kMaxSets);
    calibration = run_session(layout, {self_path(), "--serve-calibration"}, a, -1, -1, {.check = false}, rng);
  } catch (const std::exception& e) {
    calibration.problem = e.what();
  }
  if (!calibration.problem.empty()) {
    write_verdict(a.out, verdict(a.name, "grader", "the checker's calibration failed: " + calibration.problem));
    return 0;
  }
  const double overhead_ms = *std::min_element(calibration.window_ms.begin(), calibration.window_ms.end());
  // The test's ceiling, on a device no code under test has touched yet. Should it fail, the rate
  // is still judged; the verdict says why the ceiling is not.
  std::optional<double> ceiling;
  std::string ceiling_problem;
  try {
    if (!a.ceiling.empty()) ceiling = measure_ceiling(a.ceiling);
  } catch (const std::exception& e) {
    ceiling_problem = e.what();
  }

  // ---- from here on the test program runs: what goes wrong is the submission's ---------------
  write_verdict(a.out, verdict(a.name, "submission", "the witness run ended before the checker could judge it"));
  const Session s = run_session(layout, witness_program(a), a, a.uid, a.gid, {}, rng);
  if (!s.problem.empty()) {
    json v = verdict(a.name, "submission", s.problem);
    v["output"] = s.output;
    write_verdict(a.out, v);
    return 0;
  }
  // The work's share of a window, never taken below half of it: a calibration that happened to be
  // slow (a busy GPU) must not make a kernel look much faster than its window allows. Measured on
  // an H200, the overhead is 0.4 to 1.1 ms and the work at least three quarters of every window.
  std::vector<double> rates;
  for (const double ms : s.window_ms) {
    const double work_ms = std::max(ms - overhead_ms, 0.5 * ms);
    rates.push_back(spec.work * layout.sets / (work_ms * 1e-3) / spec.unit_scale);
  }
  json v = verdict(a.name, "", "");
  v["unit"] = spec.unit;
  v["rate"] = *std::max_element(rates.begin(), rates.end());
  v["rates"] = rates;
  v["sets"] = layout.sets;
  v["window_ms"] = s.window_ms;
  v["overhead_ms"] = calibration.window_ms;
  if (ceiling) v["ceiling"] = *ceiling, v["ceiling_name"] = a.ceiling;
  if (!ceiling_problem.empty()) v["ceiling_problem"] = ceiling_problem;
  write_verdict(a.out, v);
  return 0;
}

}  // namespace

// The calibration's server: one empty kernel per set.
K2C_WITNESS(calibration) { empty_kernel<<<1, 1>>>(); }

int main(int argc, char** argv) {
  if (argc == 2 && std::string(argv[1]) == "--serve-calibration") return k2c::testing::serve_witness("calibration");
  try {
    return run(parse(argc, argv));
  } catch (const std::exception& e) {
    std::fprintf(stderr, "k2c_witness: %s\n", e.what());
    return 2;
  }
}
