// assignments/04_register_tiled_matmul/dispatch.h — the given end of register_tiled_matmul.cu:
// turns its list of tile configurations (Configs) and its launch<T> into the contract's
// functions: config_count(), config(), TileConfig::name(), matmul_config() and matmul(), which
// picks tuned_config.h's configuration for large and for small outputs. Included once, at the
// end of register_tiled_matmul.cu (the stub's and the reference's alike), after Configs and
// launch<T> are defined; not a file to edit or submit.
#pragma once

#include <array>
#include <string>
#include <tuple>
#include <utility>

#include "k2c/core/check.h"
#include "k2c/core/gemm_args.h"
#include "register_tiled_matmul.h"
// kTunedConfig, kTunedConfigSmall and kSmallOutputs come from the tuned_config.h that the .cu
// included, its own folder's (the student's or the reference's): not included again from here.

namespace k2c::register_tiled_matmul {

using Launcher = void (*)(int, int, int, float, const float*, const float*, float, float*,
                          cudaStream_t);

template <std::size_t... I>
constexpr auto make_launchers(std::index_sequence<I...>) {
  return std::array<Launcher, sizeof...(I)>{&launch<std::tuple_element_t<I, Configs>>...};
}
template <std::size_t... I>
auto make_configs(std::index_sequence<I...>) {
  return std::array<TileConfig, sizeof...(I)>{std::tuple_element_t<I, Configs>::config()...};
}
constexpr auto kIndices = std::make_index_sequence<std::tuple_size_v<Configs>>{};
constexpr auto kLaunchers = make_launchers(kIndices);
static_assert(kTunedConfig >= 0 && kTunedConfig < static_cast<int>(kLaunchers.size()) &&
                  kTunedConfigSmall >= 0 && kTunedConfigSmall < static_cast<int>(kLaunchers.size()),
              "tuned_config.h names a configuration that does not exist");

std::string TileConfig::name() const {
  return std::to_string(bm) + "x" + std::to_string(bn) + "x" + std::to_string(bk) + " w" +
         std::to_string(wm) + "x" + std::to_string(wn) + "x" + std::to_string(wniter) + " t" +
         std::to_string(tm) + "x" + std::to_string(tn) + " " + std::to_string(threads) + "thr";
}

int config_count() { return static_cast<int>(kLaunchers.size()); }

TileConfig config(int index) {
  K2C_CHECK(index >= 0 && index < config_count(),
            "config: index " << index << " outside [0, " << config_count() << ")");
  return make_configs(kIndices)[index];
}

void matmul_config(int index, int M, int N, int K, float alpha, const float* A, const float* B,
                   float beta, float* C, cudaStream_t stream) {
  K2C_CHECK(index >= 0 && index < config_count(),
            "matmul_config: index " << index << " outside [0, " << config_count() << ")");
  check_gemm_args(M, N, K, A, B, beta, C);
  if (M == 0 || N == 0) return;
  kLaunchers[index](M, N, K, alpha, A, B, beta, C, stream);
}

// Big tiles win when there are enough of them to fill the GPU; a small C (a 1024² C is only 32
// tiles of 128×256 for 132 SMs) needs smaller tiles. The tuner picks one configuration for each
// regime and the output-size boundary between them.
void matmul(int M, int N, int K, float alpha, const float* A, const float* B, float beta, float* C,
            cudaStream_t stream) {
  const bool small = static_cast<long>(M) * N < kSmallOutputs;
  matmul_config(small ? kTunedConfigSmall : kTunedConfig, M, N, K, alpha, A, B, beta, C, stream);
}

}  // namespace k2c::register_tiled_matmul
