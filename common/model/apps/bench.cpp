// k2c_model_bench — how fast the model library trains on one GPU, as a fraction of what the
// GPU's GEMMs can do, measured in the same run.
//
//   k2c_model_bench [--config dense_135m|tiny] [--batch 16] [--steps 10] [--warmup 3]
//                   [--math bf16|fp32] [--checkpoint] [--json FILE]
//
// Each timed step is a whole optimizer step: forward, the fused cross-entropy, backward, the
// global gradient norm and clipping, AdamW. The model FLOP rate is train_flops_per_token() ×
// tokens ÷ the median step time (the causal half of attention counted, as the usual MFU
// convention does), and the ratio that matters is that rate ÷ cuBLAS's bf16 GEMM rate at
// 8192³ measured in this process. Then one more step runs with every operation timed on its
// own (TimedOps), to show where a step's time goes. Tokens are uniform random ids: the speed of
// a step does not depend on what the tokens say.
#include <CLI/CLI.hpp>
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <random>
#include <vector>

#include "k2c/core/check.h"
#include "k2c/model/cuda_ops.h"
#include "k2c/model/data.h"
#include "k2c/model/optim.h"
#include "k2c/model/timed_ops.h"
#include "k2c/model/transformer.h"
#include "k2c/reference/ceilings.h"

using namespace k2c::model;

namespace {

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const std::size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"k2c_model_bench: training speed of the model library on one GPU"};
  std::string config_name = "dense_135m", math_name = "bf16", json_path;
  int batch = 16, steps = 10, warmup = 3;
  bool checkpoint = false;
  app.add_option("--config", config_name, "dense_135m or tiny")->check(CLI::IsMember({"dense_135m", "tiny"}));
  app.add_option("--batch", batch, "sequences per step")->check(CLI::PositiveNumber);
  app.add_option("--steps", steps, "timed steps (the median is reported)")->check(CLI::PositiveNumber);
  app.add_option("--warmup", warmup, "untimed steps first")->check(CLI::NonNegativeNumber);
  app.add_option("--math", math_name, "bf16 (tensor cores) or fp32")->check(CLI::IsMember({"bf16", "fp32"}));
  app.add_flag("--checkpoint", checkpoint, "activation checkpointing in every block");
  app.add_option("--json", json_path, "write the figures to this file");
  CLI11_PARSE(app, argc, argv);

  if (!cuda_device_present()) {
    std::cerr << "k2c_model_bench: no CUDA device visible; this benchmark needs a GPU\n";
    return 2;
  }
  try {
    const ModelConfig model = config_name == "tiny" ? ModelConfig::tiny() : ModelConfig::dense_135m();
    Ops& ops = cuda_ops(math_name == "fp32" ? GpuMath::fp32 : GpuMath::bf16);
    cudaDeviceProp prop{};
    K2C_CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
    std::printf("%s on %s, %s, batch %d × %d tokens%s\n", model.describe().c_str(), prop.name, ops.name().c_str(),
                batch, model.seq_len, checkpoint ? ", activation checkpointing" : "");

    MemoryLedger ledger;
    ParamList params;
    Transformer net(params, model);
    params.materialize(ops, ledger, 1);
    AdamW adamw(params, ops, ledger);
    Context ctx{ops, ledger, params};

    // Random tokens, enough for every step to draw its own batch.
    std::mt19937 rng(5);
    std::vector<std::uint16_t> tokens(static_cast<std::size_t>(4) * batch * (model.seq_len + 1) + 1);
    for (auto& t : tokens) t = static_cast<std::uint16_t>(rng() % model.vocab);
    TokenLoader loader(tokens, static_cast<std::uint32_t>(model.vocab), {model.seq_len, batch, 0, 1, 7});

    double optimizer_s = 0;  // the optimizer's own time, measured in the profiled step
    auto one_step = [&](Context& c, std::int64_t step, bool profile = false) {
      const TokenBatch b = loader.batch_at(step);
      Tensor ids = c.tensor({static_cast<std::int64_t>(b.inputs.size())}, Category::activations, DType::i32);
      Tensor targets = c.tensor({static_cast<std::int64_t>(b.targets.size())}, Category::activations, DType::i32);
      c.ops.upload(ids, b.inputs.data());
      c.ops.upload(targets, b.targets.data());
      params.zero_grads(c.ops);
      c.step = static_cast<std::uint64_t>(step);
      const double n = static_cast<double>(b.targets.size());
      const double loss = net.train_step(c, ids, targets, b.rows, static_cast<float>(1.0 / n), checkpoint) / n;
      clip_grad_norm(params, c.ops, 1.0);
      if (profile) K2C_CUDA_CHECK(cudaDeviceSynchronize());
      const auto t0 = std::chrono::steady_clock::now();
      adamw.step(1e-4f);  // on the untimed backend it was made with
      K2C_CUDA_CHECK(cudaDeviceSynchronize());
      if (profile) optimizer_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      return loss;
    };

    std::vector<double> seconds;
    double first_loss = 0, last_loss = 0;
    for (int s = 0; s < warmup + steps; ++s) {
      K2C_CUDA_CHECK(cudaDeviceSynchronize());
      const auto t0 = std::chrono::steady_clock::now();
      const double loss = one_step(ctx, s);
      const double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      if (s == 0) first_loss = loss;
      last_loss = loss;
      if (s >= warmup) seconds.push_back(dt);
      std::printf("  step %2d  loss %.4f  %.1f ms%s\n", s, loss, dt * 1e3, s < warmup ? "  (warm-up)" : "");
      std::fflush(stdout);
    }
    const double step_s = median(seconds);
    const double step_tokens = static_cast<double>(batch) * model.seq_len;
    const double flops = model.train_flops_per_token() * step_tokens / step_s;
    std::printf("measuring the ceiling: cuBLAS bf16 GEMM at 8192^3 ...\n");
    std::fflush(stdout);
    const double cublas = k2c::bf16_gemm_rate(8192);
    std::size_t free_b = 0, total_b = 0;
    K2C_CUDA_CHECK(cudaMemGetInfo(&free_b, &total_b));

    // One step with every operation timed on its own.
    TimedOps timed(ops, [] { K2C_CUDA_CHECK(cudaDeviceSynchronize()); });
    Context tctx{timed, ledger, params};
    one_step(tctx, warmup + steps, true);

    std::printf("\nmedian step %.2f ms: %.0f tokens/s, model FLOP rate %.1f TFLOP/s\n", step_s * 1e3,
                step_tokens / step_s, flops / 1e12);
    std::printf("cuBLAS bf16 GEMM (same run): %.1f TFLOP/s; ratio %.3f\n", cublas / 1e12, flops / cublas);
    std::printf("peak memory: ledger %.2f GiB (parameters, gradients, optimizer, activations); device in use %.2f GiB\n",
                ledger.peak_total() / 1073741824.0, (total_b - free_b) / 1073741824.0);
    std::printf("loss %.4f at the first step, %.4f at the last (random tokens: ln %d = %.4f)\n", first_loss, last_loss,
                model.vocab, std::log(static_cast<double>(model.vocab)));
    std::printf("\nwhere one step's time goes (each operation timed alone):\n%sAdamW step %.3f ms\n",
                timed.report().c_str(), optimizer_s * 1e3);

    if (!json_path.empty()) {
      std::ofstream f(json_path);
      f << "{\n  \"config\": \"" << config_name << "\", \"math\": \"" << math_name << "\", \"gpu\": \"" << prop.name
        << "\",\n  \"batch\": " << batch << ", \"seq_len\": " << model.seq_len << ", \"checkpoint\": "
        << (checkpoint ? "true" : "false") << ",\n  \"step_ms\": " << step_s * 1e3
        << ", \"tokens_per_s\": " << step_tokens / step_s << ",\n  \"model_tflops\": " << flops / 1e12
        << ", \"cublas_bf16_tflops\": " << cublas / 1e12 << ", \"ratio\": " << flops / cublas
        << ",\n  \"ledger_peak_gib\": " << ledger.peak_total() / 1073741824.0
        << ", \"device_used_gib\": " << (total_b - free_b) / 1073741824.0 << ",\n  \"ops_ms\": {";
      bool first = true;
      for (const auto& [name, e] : timed.entries()) {
        f << (first ? "" : ", ") << "\"" << name << "\": " << e.seconds * 1e3;
        first = false;
      }
      f << "},\n  \"ops_host_ms\": {";  // the CPU's time to issue each (TimedOps)
      first = true;
      for (const auto& [name, e] : timed.entries()) {
        f << (first ? "" : ", ") << "\"" << name << "\": " << e.host_seconds * 1e3;
        first = false;
      }
      f << "}\n}\n";
    }
    return 0;
  } catch (const std::exception& e) {
    std::cerr << "k2c_model_bench: " << e.what() << "\n";
    return 1;
  }
}
