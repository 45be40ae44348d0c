// lab/precision.cpp — how much accuracy a dot product loses to low-precision inputs
// and to a low-precision accumulator. Plain C++20, no GPU: lecture 05 (section 9) quotes what it
// prints. Build and run anywhere:
//   g++ -O2 -std=c++20 lab/precision.cpp -o /tmp/precision && /tmp/precision
//
// For each length K, `kSamples` dot products of fp32 vectors drawn uniformly from [-1, 1) are
// computed four ways:
//   bf16 in, fp32 acc   inputs rounded to bf16, products (exact in fp32) summed in fp32
//   fp16 in, fp32 acc   inputs rounded to fp16, likewise
//   bf16 in, bf16 acc   inputs rounded to bf16, the running sum rounded to bf16 after every add
//   fp32 in, fp32 acc   the fp32 inputs as they are, one fmaf per term
// The sums are sequential (k = 0, 1, 2, ...), the worst common order: a tensor core adds short
// runs of products before they reach the accumulator, which can only help. Each result is
// compared with two double-precision references:
//   vs exact    the dot product of the original (unrounded) fp32 inputs: the total error
//   vs rounded  the dot product of the inputs after rounding: the accumulation error alone
// It prints three markdown tables: the median and the largest |error| / |reference|, and the
// largest |error| / Σ|a·b|. A random dot product can cancel to almost nothing, which makes the
// largest relative error a property of the unluckiest sample; Σ|a·b| is the scale error bounds
// are written in, and the one module 05's test tolerance uses.
//
// bf16 and fp16 rounding are written out below (round to nearest, ties to even) rather than
// taken from a library, so the program runs on any compiler.
#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <iterator>
#include <random>
#include <vector>

namespace {

// ------------------------------------------------------------------ rounding ----------------

// fp32 → bf16 → fp32: keep the top 16 bits, rounding the 16 dropped ones to nearest, ties to
// even. Adding 0x7fff plus the lowest kept bit carries into the kept part exactly when the dropped
// part is above half, or exactly half with an odd kept part; a carry out of the mantissa bumps the
// exponent, which is the correct result (up to infinity for the largest finite values).
float round_bf16(float x) {
  std::uint32_t u = std::bit_cast<std::uint32_t>(x);
  if ((u & 0x7fffffffu) > 0x7f800000u) return x;  // NaN stays NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return std::bit_cast<float>(u & 0xffff0000u);
}

// fp32 → fp16 bits, round to nearest even, with fp16 subnormals (below 2^-14) and overflow to
// infinity (from 65520 up, the midpoint between fp16's largest value 65504 and 2^16).
std::uint16_t to_half_bits(float x) {
  const std::uint32_t u = std::bit_cast<std::uint32_t>(x);
  const std::uint16_t sign = static_cast<std::uint16_t>((u >> 16) & 0x8000u);
  const std::uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return sign | 0x7e00u;  // NaN
  if (a >= 0x477ff000u) return sign | 0x7c00u; // |x| >= 65520: infinity
  const int e = static_cast<int>(a >> 23) - 127;  // unbiased exponent (fp32 subnormals: -127)
  if (e < -25) return sign;                        // below half the smallest subnormal: zero
  // The 24-bit significand, implicit bit included (fp32 subnormals are far below fp16's range
  // and were returned above).
  const std::uint32_t m = (a & 0x7fffffu) | 0x800000u;
  // Normal fp16 keeps 11 significant bits (drop 13); a subnormal keeps fewer, because its last
  // bit is worth 2^-24 whatever the exponent: drop 13 + (-14 - e) bits.
  const int drop = e >= -14 ? 13 : 13 + (-14 - e);
  const std::uint32_t kept = m >> drop, rest = m & ((1u << drop) - 1u), half = 1u << (drop - 1);
  // Normal: biased exponent and 10 stored bits; the implicit bit is absorbed by using e + 14
  // (kept has bit 10 set). Subnormal: the kept bits are the whole encoding.
  std::uint32_t h = e >= -14 ? (static_cast<std::uint32_t>(e + 14) << 10) + kept : kept;
  if (rest > half || (rest == half && (kept & 1u))) ++h;  // a carry may raise the exponent: correct
  return static_cast<std::uint16_t>(sign | h);
}

float half_bits_to_float(std::uint16_t h) {
  const float sign = (h & 0x8000u) ? -1.0f : 1.0f;
  const int e = (h >> 10) & 0x1f, f = h & 0x3ff;
  if (e == 31) return f ? NAN : sign * INFINITY;
  if (e == 0) return sign * std::ldexp(static_cast<float>(f), -24);
  return sign * std::ldexp(static_cast<float>(f | 0x400), e - 25);
}

float round_fp16(float x) { return half_bits_to_float(to_half_bits(x)); }

// Spot checks of the two conversions against exactly known cases; the program refuses to
// report anything if one fails.
bool self_test() {
  struct Case {
    float in, bf16, fp16;
  };
  const Case cases[] = {
      // input                       bf16                fp16
      {1.0f,                         1.0f,               1.0f},
      {1.0f + 0x1p-8f,               1.0f,               1.0f + 0x1p-8f},      // bf16 tie: even
      {1.0f + 0x1p-8f + 0x1p-20f,    1.0f + 0x1p-7f,     1.0f + 0x1p-8f},      // past the tie
      {1.0f + 3 * 0x1p-8f,           1.0f + 0x1p-6f,     1.0f + 3 * 0x1p-8f},  // tie, odd below
      {1.0f + 0x1p-11f,              1.0f,               1.0f},                // fp16 tie: even
      {1.0f + 3 * 0x1p-11f,          1.0f,               1.0f + 0x1p-9f},      // tie, odd below
      {65504.0f,                     65536.0f,           65504.0f},            // fp16 maximum
      {65519.0f,                     65536.0f,           65504.0f},            // below the midpoint
      {65520.0f,                     65536.0f,           INFINITY},            // midpoint: inf
      {0x1p-24f,                     0x1p-24f,           0x1p-24f},            // least subnormal
      {0x1p-25f,                     0x1p-25f,           0.0f},                // half of it: 0
      {0x1.8p-25f,                   0x1.8p-25f,         0x1p-24f},            // above half: up
      {3 * 0x1p-25f,                 3 * 0x1p-25f,       2 * 0x1p-24f},        // 1.5 units: 2
      {0x1.ffcp-15f,                 0x1p-14f,           0x1p-14f},            // subnormal tie: up
      {-0.333333343f,                -0.333984375f,      -0.333251953f},
  };
  bool ok = true;
  for (const Case& c : cases) {
    const float b = round_bf16(c.in), h = round_fp16(c.in);
    if (b != c.bf16 || h != c.fp16) {
      std::printf("self-test failed for %a: bf16 %a (want %a), fp16 %a (want %a)\n", c.in, b,
                  c.bf16, h, c.fp16);
      ok = false;
    }
  }
  // Every fp16 value converts back to itself (finite ones).
  for (std::uint32_t bits = 0; bits < 0x7c00u; ++bits) {
    const float f = half_bits_to_float(static_cast<std::uint16_t>(bits));
    if (to_half_bits(f) != bits || to_half_bits(-f) != (bits | 0x8000u)) {
      std::printf("self-test failed: fp16 0x%04x does not round-trip\n", bits);
      return false;
    }
  }
  return ok;
}

// ------------------------------------------------------------------ the experiment ----------

enum Method { kBf16InFp32Acc, kFp16InFp32Acc, kBf16InBf16Acc, kFp32InFp32Acc, kMethods };
const char* const kNames[kMethods] = {"bf16 in, fp32 acc", "fp16 in, fp32 acc", "bf16 in, bf16 acc",
                                      "fp32 in, fp32 acc"};

struct Errors {
  std::vector<double> rel_exact, rel_rounded, scaled_exact, scaled_rounded;
};

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const std::size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}
double maximum(const std::vector<double>& v) { return *std::max_element(v.begin(), v.end()); }

}  // namespace

int main() {
  if (!self_test()) return 1;
  constexpr int kSamples = 2000;
  const int lengths[] = {256, 1024, 4096, 16384};
  std::mt19937_64 rng(20240505);
  // Uniform on [-1, 1) with 24 random bits: every value is an exact fp32 number.
  auto draw = [&] {
    return static_cast<float>(static_cast<std::int64_t>(rng() >> 40) - (1 << 23)) * 0x1p-23f;
  };

  std::printf("%d dot products per K, inputs uniform on [-1, 1), sequential sums.\n", kSamples);
  std::printf("\"exact\": reference from the unrounded inputs (total error);\n"
              "\"rounded\": from the rounded inputs (accumulation error alone).\n");

  Errors err[std::size(lengths)][kMethods];
  for (std::size_t l = 0; l < std::size(lengths); ++l) {
    const int K = lengths[l];
    std::vector<float> a(K), b(K);
    for (int s = 0; s < kSamples; ++s) {
      for (int k = 0; k < K; ++k) {
        a[k] = draw();
        b[k] = draw();
      }
      // The exact reference and its scale, from the original inputs. Products of two fp32
      // numbers are exact in double; the double sum's own error (~K · 2^-53) is negligible.
      double exact = 0, exact_scale = 0;
      for (int k = 0; k < K; ++k) {
        const double p = static_cast<double>(a[k]) * b[k];
        exact += p;
        exact_scale += std::abs(p);
      }
      for (int m = 0; m < kMethods; ++m) {
        double ref_rounded = 0, rounded_scale = 0;  // double sum of the rounded inputs' products
        float acc = 0.0f;
        for (int k = 0; k < K; ++k) {
          float x = a[k], y = b[k];
          if (m == kBf16InFp32Acc || m == kBf16InBf16Acc) {
            x = round_bf16(x);
            y = round_bf16(y);
          } else if (m == kFp16InFp32Acc) {
            x = round_fp16(x);
            y = round_fp16(y);
          }
          const double p = static_cast<double>(x) * y;
          ref_rounded += p;
          rounded_scale += std::abs(p);
          if (m == kFp32InFp32Acc) {
            acc = std::fmaf(x, y, acc);  // what an FFMA does
          } else if (m == kBf16InBf16Acc) {
            // The product is exact in fp32 (8 + 8 bits); the fp32 add rounds once before the
            // bf16 rounding, a double rounding far below bf16's own step.
            acc = round_bf16(acc + x * y);
          } else {
            acc += x * y;  // exact product (at most 11 + 11 significant bits), fp32 add
          }
        }
        const double e_exact = std::abs(acc - exact), e_rounded = std::abs(acc - ref_rounded);
        err[l][m].rel_exact.push_back(e_exact / std::abs(exact));
        err[l][m].rel_rounded.push_back(e_rounded / std::abs(ref_rounded));
        err[l][m].scaled_exact.push_back(e_exact / exact_scale);
        err[l][m].scaled_rounded.push_back(e_rounded / rounded_scale);
      }
    }
  }

  // Three markdown tables: rows are method × reference, columns the lengths.
  auto table = [&](const char* title, auto stat, std::vector<double> Errors::*exact_field,
                   std::vector<double> Errors::*rounded_field) {
    std::printf("\n%s\n\n| method | reference |", title);
    for (const int K : lengths) std::printf(" K = %d |", K);
    std::printf("\n|---|---|");
    for (std::size_t l = 0; l < std::size(lengths); ++l) std::printf("---:|");
    std::printf("\n");
    for (int m = 0; m < kMethods; ++m)
      for (int r = 0; r < 2; ++r) {
        std::printf("| %s | %s |", kNames[m], r == 0 ? "exact" : "rounded");
        for (std::size_t l = 0; l < std::size(lengths); ++l)
          std::printf(" %.2e |", stat(err[l][m].*(r == 0 ? exact_field : rounded_field)));
        std::printf("\n");
      }
  };
  table("median |error| / |reference|", median, &Errors::rel_exact, &Errors::rel_rounded);
  table("largest |error| / |reference|", maximum, &Errors::rel_exact, &Errors::rel_rounded);
  table("largest |error| / sum|a*b|", maximum, &Errors::scaled_exact, &Errors::scaled_rounded);
  std::printf("\nunit roundoff: bf16 2^-8 = %.2e, fp16 2^-11 = %.2e, fp32 2^-24 = %.2e\n", 0x1p-8,
              0x1p-11, 0x1p-24);
  return 0;
}
