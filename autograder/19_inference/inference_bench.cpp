// autograder/19_inference/inference_bench.cpp — k2c_inference: serving a trace co-located and
// disaggregated, and the bandwidth the disaggregated cache transfer needs. The command lines are
// kUsage's, below the includes (`k2c_inference --help` prints them).
//
// --sweep: decode throughput against batch size. For each batch size B it prefills B prompts of
// --context tokens, then times decode steps of all B sequences (median of 10 after 2 warm-up)
// and prints the step time and tokens per second; `tools/plot_decode.py` draws the JSON. A decode
// step reads every weight once whatever B is, and each sequence's cache once: while the weights
// dominate, the step time hardly grows with B and the throughput grows with it; where it bends,
// the step has become bound by the cache reads or by arithmetic (lecture 19, section 2).
//
// One rank serves the trace (-n requests, Poisson arrivals at -r per second, prompt and output
// lengths uniform in the -p and -o ranges) with continuous batching of at most -b sequences and
// prints time to first token and time per output token (median and p99), throughput, the steps
// and the peak of pages in use. Two ranks also serve it disaggregated (rank 0 prefills, rank 1
// decodes) and print the same figures side by side, the cache bytes sent per request, the
// bandwidth that transfer needs at the trace's request rate (bytes per request × rate) and the
// bandwidth a send of one request's cache gets between the two ranks, measured here.
//
// Step times are measured (wall time of each step) unless --cost replaces them with the tests'
// cost model, which makes the output reproducible and independent of the machine. --pages 0 sizes
// the cache for -b requests of the longest context. On NCCL the model runs on the GPU backend
// (bf16 GEMMs), the "small" model by default; on MPI on the CPU backend, the "tiny" one.
#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <sstream>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <tuple>
#include <vector>

#include "inference.h"
#include "k2c/dist/runtime.h"
#include "k2c/dist/timing.h"
#include "k2c/model/backend.h"
#include "step_cost.h"

namespace kd = k2c::dist;
namespace km = k2c::model;
namespace inf = k2c::inference;

namespace {

struct Options {
  int requests = 32, max_batch = 8, pages = 0, page = 16, split = 256;
  double rate = 20;
  int min_prompt = 16, max_prompt = 256, min_output = 8, max_output = 64;
  std::string model;
  bool cost = false;
  std::uint64_t seed = 1;
  std::string json;
  std::vector<int> sweep;  // batch sizes for --sweep
  int context = 1024;      // prompt tokens per sequence in --sweep
};

// The value of `flag` as a number: std::stoi and its kin refuse a value without saying whose.
template <class T>
T number(const std::string& flag, const std::string& v) {
  try {
    if constexpr (std::is_same_v<T, int>) return std::stoi(v);
    else if constexpr (std::is_same_v<T, double>) return std::stod(v);
    else return static_cast<T>(std::stoull(v));
  } catch (const std::logic_error&) {
    throw std::invalid_argument(flag + " '" + v + "' is not a number");
  }
}

std::vector<int> parse_list(const std::string& s) {
  std::vector<int> out;
  std::stringstream in(s);
  for (std::string item; std::getline(in, item, ',');) {
    const int v = number<int>("--sweep", item);
    if (v < 1) throw std::invalid_argument("--sweep takes batch sizes >= 1, got " + item);
    out.push_back(v);
  }
  if (out.empty()) throw std::invalid_argument("--sweep needs at least one batch size");
  return out;
}

std::pair<int, int> parse_range(const std::string& flag, const std::string& s) {
  const std::size_t comma = s.find(',');
  if (comma == std::string::npos) throw std::invalid_argument(flag + " expects MIN,MAX, got '" + s + "'");
  return {number<int>(flag, s.substr(0, comma)), number<int>(flag, s.substr(comma + 1))};
}

constexpr const char* kUsage = R"(usage:
  mpirun -np 1|2 k2c_inference [-n 32] [-r 20] [-p 16,256] [-o 8,64] [-b 8] [--pages 0]
                               [--page 16] [--split 256] [--model tiny|small] [--cost]
                               [--seed 1] [-j out.json]
  mpirun -np 1 k2c_inference --sweep 1,2,4,...,256 [--context 1024] [--model ...] [-j out.json]
  (or: k2c run -np 2 build/<tree>/bin/k2c_inference ...)
The flags that need more than their name are explained at the top of
autograder/19_inference/inference_bench.cpp.
)";

Options parse(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) throw std::invalid_argument(a + " needs a value");
      return argv[++i];
    };
    if (a == "-n") o.requests = number<int>(a, value());
    else if (a == "-r") o.rate = number<double>(a, value());
    else if (a == "-p") std::tie(o.min_prompt, o.max_prompt) = parse_range(a, value());
    else if (a == "-o") std::tie(o.min_output, o.max_output) = parse_range(a, value());
    else if (a == "-b") o.max_batch = number<int>(a, value());
    else if (a == "--pages") o.pages = number<int>(a, value());
    else if (a == "--page") o.page = number<int>(a, value());
    else if (a == "--split") o.split = number<int>(a, value());
    else if (a == "--model") o.model = value();
    else if (a == "--cost") o.cost = true;
    else if (a == "--seed") o.seed = number<std::uint64_t>(a, value());
    else if (a == "-j") o.json = value();
    else if (a == "--sweep") o.sweep = parse_list(value());
    else if (a == "--context") o.context = number<int>(a, value());
    else throw std::invalid_argument("unknown option '" + a + "' (k2c_inference --help lists them)");
  }
  if (!o.model.empty() && o.model != "tiny" && o.model != "small")
    throw std::invalid_argument("--model tiny or small, got '" + o.model + "'");
  return o;
}

km::ModelConfig model_named(const std::string& name, int context) {
  km::ModelConfig m;  // "tiny": the library's test model
  if (name == "small") {
    m.vocab = 8192;
    m.d_model = 512;
    m.n_layers = 8;
    m.q_heads = 8;
    m.kv_heads = 2;
    m.d_ff = 1376;
  } else if (name != "tiny") {
    throw std::invalid_argument("--model tiny or small, got '" + name + "'");
  }
  m.seq_len = context;
  return m;
}

std::string figures(const char* label, const inf::ServeReport& r) {
  char line[256];
  std::snprintf(line, sizeof line,
                "%-14s TTFT p50 %8.2f ms  p99 %8.2f ms   TPOT p50 %7.2f ms  p99 %7.2f ms   %8.1f tok/s   "
                "steps %d + %d   peak pages %d",
                label, 1e3 * r.ttft_p50, 1e3 * r.ttft_p99, 1e3 * r.tpot_p50, 1e3 * r.tpot_p99, r.throughput,
                r.prefill_steps, r.decode_steps, r.peak_pages);
  return line;
}

// GB/s of one send of `bytes` from rank 0 to rank 1, median of a few.
double link_bandwidth(kd::Communicator& w, std::size_t bytes) {
  kd::Buffer buf(w, bytes);
  const double ms = kd::time_step(w, [&] {
                      if (w.rank() == 0) w.send(buf.get(), bytes / 4, kd::DType::f32, 1);
                      else w.recv(buf.get(), bytes / 4, kd::DType::f32, 0);
                    }, {.warmup = 2, .repeats = 7}).median_ms;
  return static_cast<double>(bytes) / (ms * 1e6);
}

// Decode step time against batch size (see the top of this file). Rank 0's figures; every rank
// runs the same steps on its own engine.
void sweep_batches(kd::Communicator& w, km::Ops& ops, const Options& opt) {
  if (opt.context < 1) throw std::invalid_argument("--context must be >= 1, got " + std::to_string(opt.context));
  const int steps = 10, warmup = 2;
  const km::ModelConfig model = model_named(opt.model, opt.context + warmup + steps);
  km::MemoryLedger ledger;
  km::ParamList params;
  km::Context ctx{ops, ledger, params};
  const km::Transformer transformer(params, model);
  params.materialize(ops, ledger, 1);
  std::ostringstream out;
  out << "model " << model.describe() << "; decode steps after prompts of " << opt.context
      << " tokens, median of " << steps << "\n   batch   step ms    tokens/s   cache MB read\n";
  std::string json = "{\"model\": \"" + opt.model + "\", \"context\": " + std::to_string(opt.context) + ", \"rows\": [";
  for (std::size_t k = 0; k < opt.sweep.size(); ++k) {
    const int batch = opt.sweep[k];
    const std::int64_t length = opt.context + warmup + steps;
    const int pages = static_cast<int>(batch * inf::pages_for(length, opt.page));
    inf::Engine engine(ctx, model, pages, opt.page, opt.split);
    std::vector<int> seqs;
    std::vector<std::vector<std::int32_t>> prompts;
    for (int b = 0; b < batch; ++b) {
      seqs.push_back(engine.cache().create(length));
      prompts.push_back(inf::make_trace({1, 1.0, opt.context, opt.context, 1, 1, model.vocab, opt.seed + b})[0].prompt);
    }
    // Prefill a few sequences at a time (the activations of a prefill grow with its tokens); the
    // first decode step takes the greedy next tokens of all.
    std::vector<std::int32_t> next;
    for (int b0 = 0; b0 < batch; b0 += 8) {
      const int b1 = std::min(batch, b0 + 8);
      const inf::Step first = engine.prefill({seqs.begin() + b0, seqs.begin() + b1}, {prompts.begin() + b0, prompts.begin() + b1});
      next.insert(next.end(), first.tokens.begin(), first.tokens.end());
    }
    inf::Step last{km::Tensor{}, next};
    std::vector<double> ms;
    for (int s = 0; s < warmup + steps; ++s) {
      w.barrier();
      const auto start = std::chrono::steady_clock::now();
      last = engine.decode(seqs, last.tokens);  // the tokens come back to the host: the step is done
      const double t = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
      if (s >= warmup) ms.push_back(t);
    }
    std::nth_element(ms.begin(), ms.begin() + ms.size() / 2, ms.end());
    const double step_ms = ms[ms.size() / 2];
    const double cache_mb = double(batch) * double(opt.context + warmup + steps / 2) * double(engine.cache().bytes_per_token()) / 1e6;
    char line[128];
    std::snprintf(line, sizeof line, "%8d %9.3f %11.1f %15.2f\n", batch, step_ms, 1e3 * batch / step_ms, cache_mb);
    out << line;
    json += std::string(k ? ", " : "") + "{\"batch\": " + std::to_string(batch) + ", \"step_ms\": " +
            std::to_string(step_ms) + ", \"tokens_per_s\": " + std::to_string(1e3 * batch / step_ms) +
            ", \"cache_mb\": " + std::to_string(cache_mb) + "}";
  }
  json += "]}\n";
  if (w.rank() == 0) {
    std::fputs(out.str().c_str(), stdout);
    if (!opt.json.empty()) std::ofstream(opt.json) << json;
  }
}

}  // namespace

int main(int argc, char** argv) {
  // The command line before MPI starts: help and a bad flag need no ranks (status 2, as every
  // program of the course gives a bad command line).
  Options opt;
  for (int i = 1; i < argc; ++i)
    if (std::string(argv[i]) == "-h" || std::string(argv[i]) == "--help") {
      std::printf("%s", kUsage);
      return 0;
    }
  try {
    opt = parse(argc, argv);
  } catch (const std::exception& e) {  // std::invalid_argument, and std::stoi's out_of_range
    std::fprintf(stderr, "k2c_inference: %s\n", e.what());
    return 2;
  }
  kd::Runtime runtime(&argc, &argv);
  kd::Communicator& w = runtime.world();
  try {
    const bool gpu = w.backend() == kd::Backend::nccl;
    km::Ops* ops = &km::backend_for(gpu, w.compute_stream());
    if (opt.model.empty()) opt.model = gpu ? "small" : "tiny";
    if (!opt.sweep.empty()) {
      sweep_batches(w, *ops, opt);
      return 0;
    }
    const int context = opt.max_prompt + opt.max_output;
    const km::ModelConfig model = model_named(opt.model, context);
    if (opt.pages == 0) opt.pages = static_cast<int>(opt.max_batch * inf::pages_for(context, opt.page));

    km::MemoryLedger ledger;
    km::ParamList params;
    km::Context ctx{*ops, ledger, params};
    const km::Transformer transformer(params, model);
    params.materialize(*ops, ledger, 1);
    inf::Engine engine(ctx, model, opt.pages, opt.page, opt.split);
    const std::vector<inf::Request> trace = inf::make_trace(
        {opt.requests, opt.rate, opt.min_prompt, opt.max_prompt, opt.min_output, opt.max_output, model.vocab, opt.seed});
    const inf::ServeConfig config{opt.max_batch, opt.cost ? inf::StepTimer(k2c::inference_testing::step_cost) : inf::StepTimer()};

    const inf::ServeReport together = inf::serve(engine, trace, config);
    std::ostringstream out;
    out << "model " << model.describe() << "; cache " << opt.pages << " pages of " << opt.page << " tokens, "
        << engine.cache().bytes_per_token() << " bytes per token; " << trace.size() << " requests at " << opt.rate
        << "/s, prompts " << opt.min_prompt << "-" << opt.max_prompt << ", outputs " << opt.min_output << "-"
        << opt.max_output << ", batch " << opt.max_batch << (opt.cost ? ", cost model" : ", measured") << "\n";
    out << figures("co-located", together) << "\n";
    std::string json = "{\"colocated\": {\"ttft_p50\": " + std::to_string(together.ttft_p50) +
                       ", \"ttft_p99\": " + std::to_string(together.ttft_p99) + ", \"tpot_p50\": " +
                       std::to_string(together.tpot_p50) + ", \"tpot_p99\": " + std::to_string(together.tpot_p99) +
                       ", \"throughput\": " + std::to_string(together.throughput) + "}";
    if (w.size() == 2) {
      const inf::ServeReport apart = inf::serve_disaggregated(w, engine, trace, config);
      out << figures("disaggregated", apart) << "\n";
      int decoded = 0;
      double prompt_tokens = 0;
      for (const inf::Request& r : trace)
        if (r.output_len >= 2) {
          ++decoded;
          prompt_tokens += static_cast<double>(r.prompt.size());
        }
      const double per_request = static_cast<double>(apart.kv_bytes_sent) / std::max(decoded, 1);
      const double need = per_request * opt.rate / 1e9;
      const double have = link_bandwidth(w, static_cast<std::size_t>(std::max(per_request, 4096.0)) / 4 * 4);
      char line[256];
      std::snprintf(line, sizeof line,
                    "cache sent     %.3f MB per request (%.0f prompt tokens on average); at %.1f requests/s the "
                    "transfer needs %.3g GB/s, the link gives %.3g GB/s for one request's cache\n",
                    per_request / 1e6, prompt_tokens / std::max(decoded, 1), opt.rate, need, have);
      out << line;
      json += ", \"disaggregated\": {\"ttft_p50\": " + std::to_string(apart.ttft_p50) + ", \"ttft_p99\": " +
              std::to_string(apart.ttft_p99) + ", \"tpot_p50\": " + std::to_string(apart.tpot_p50) +
              ", \"tpot_p99\": " + std::to_string(apart.tpot_p99) + ", \"throughput\": " +
              std::to_string(apart.throughput) + "}, \"kv_bytes_per_request\": " + std::to_string(per_request) +
              ", \"needed_gb_s\": " + std::to_string(need) + ", \"link_gb_s\": " + std::to_string(have);
    } else if (w.size() > 2) {
      out << "(disaggregation runs on exactly 2 ranks; this run has " << w.size() << ")\n";
    }
    json += "}\n";
    if (w.rank() == 0) {
      std::fputs(out.str().c_str(), stdout);
      if (!opt.json.empty()) std::ofstream(opt.json) << json;
    }
  } catch (const std::exception& e) {
    kd::abort_job(std::string("k2c_inference: ") + e.what());
  }
  return 0;
}
