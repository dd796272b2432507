// Checks of the AVX2 vector layer (csrc/common/vec_avx2.h) whose contract is exact. Built and run by
// tests/ops/test_simd_math.py on CPUs with AVX2 + FMA + F16C:
//   g++ -O2 -mavx2 -mfma -mf16c -Icsrc tests/cpu/simd_check_avx2.cpp
// and, where the CPU has AVX512-BF16, with those flags too, which adds the bitwise comparisons with the AVX-512
// layer (vec_math_avx512.h): the AVX2 exp2 and exp are the same formulas and must give the same bits.
// Prints one line per check and exits non-zero on any mismatch.
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "common/vec_avx2.h"
#if defined(__AVX512BF16__)
#include "common/vec_math_avx512.h"
#endif

namespace {
namespace V = pyscore::avx2;
}  // namespace

#include "layer_select_check.h"

namespace {

int g_failures = 0;

uint32_t bits(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  return u;
}

void report(bool ok, const char* what, long total, long mismatches) {
  std::printf("%-4s %s: %ld inputs, %ld mismatches\n", ok ? "ok" : "FAIL", what, total, mismatches);
  g_failures += !ok;
}

std::vector<float> inputs(float lo, float hi, std::vector<float> edges) {
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> wide(lo, hi), edge(-127.5f, -124.5f);
  for (int i = 0; i < 400000; ++i) edges.push_back(i % 2 ? wide(rng) : edge(rng));
  while (edges.size() % 16) edges.push_back(-1.0f);
  return edges;
}

// exp2_ps: never a denormal, 0 below -126, and within 2 ulp of std::exp2 elsewhere (softmax arguments, x <= 0).
void check_exp2_accuracy() {
  const auto xs = inputs(-160.0f, 0.0f, {-std::numeric_limits<float>::infinity(), -150.0f, -126.5f, -126.0f,
                                         std::nextafter(-126.0f, 0.0f), -125.5f, -0.5f, -0.0f, 0.0f});
  long bad = 0;
  for (size_t i = 0; i < xs.size(); i += 8) {
    alignas(32) float got[8];
    _mm256_store_ps(got, pyscore::avx2::exp2_ps(_mm256_loadu_ps(xs.data() + i)));
    for (int l = 0; l < 8; ++l) {
      const float x = xs[i + l], want = x < -126.0f ? 0.0f : std::exp2(x);
      const bool ok = std::fpclassify(got[l]) != FP_SUBNORMAL &&
                      std::abs(int64_t(bits(got[l])) - int64_t(bits(want))) <= 2;
      if (!ok && bad++ < 5) std::printf("  exp2(%.9g): got %.9g, want %.9g\n", x, got[l], want);
    }
  }
  report(bad == 0, "avx2 exp2_ps within 2 ulp of exp2, 0 (never denormal) below -126", long(xs.size()), bad);
}

// exp_ps: within 2 ulp of std::exp over the clamped range, +inf above it; NaN stays NaN.
void check_exp_accuracy() {
  const auto xs = inputs(-103.0f, 88.0f, {-110.0f, -103.0f, -87.0f, 0.0f, 88.7f, 89.0f, 100.0f});
  long bad = 0;
  for (size_t i = 0; i < xs.size(); i += 8) {
    alignas(32) float got[8];
    _mm256_store_ps(got, pyscore::avx2::exp_ps(_mm256_loadu_ps(xs.data() + i)));
    for (int l = 0; l < 8; ++l) {
      const float x = xs[i + l], want = std::exp(x);
      const bool denormal = std::fpclassify(want) == FP_SUBNORMAL;  // rounded once there, as scalef rounds
      const bool ok = denormal ? std::abs(got[l] - want) <= std::ldexp(1.0f, -148)
                               : std::abs(int64_t(bits(got[l])) - int64_t(bits(want))) <= 2;
      if (!ok && bad++ < 5) std::printf("  exp(%.9g): got %.9g, want %.9g\n", x, got[l], want);
    }
  }
  alignas(32) float nan_out[8];
  _mm256_store_ps(nan_out, pyscore::avx2::exp_ps(_mm256_set1_ps(std::numeric_limits<float>::quiet_NaN())));
  bad += !std::isnan(nan_out[0]);
  report(bad == 0, "avx2 exp_ps within 2 ulp of exp, NaN stays NaN", long(xs.size()), bad);
}

uint16_t to_bf16(float f) {  // torch's round to nearest even
  const uint32_t u = bits(f);
  return uint16_t((u + 0x7FFF + ((u >> 16) & 1)) >> 16);
}

// store(bf16) rounds as torch; store_first / load_first touch exactly n elements.
void check_bf16_and_partial() {
  std::mt19937 rng(3);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_int_distribution<int> scale(-140, 100);
  long total = 0, bad = 0;
  for (int it = 0; it < 100000; ++it) {
    alignas(32) float x[8];
    for (float& v : x) v = normal(rng) * std::ldexp(1.0f, scale(rng));
    uint16_t out[10];
    std::memset(out, 0xAB, sizeof(out));
    const int n = it % 9;
    pyscore::avx2::store_first(out + 1, _mm256_load_ps(x), n);
    for (int l = 0; l < 8; ++l) {
      ++total;
      bad += l < n ? out[1 + l] != to_bf16(x[l]) : out[1 + l] != 0xABAB;
    }
    bad += out[0] != 0xABAB || out[9] != 0xABAB;
    alignas(32) float back[8];
    _mm256_store_ps(back, pyscore::avx2::load_first(out + 1, n));
    for (int l = 0; l < 8; ++l) {
      uint32_t want = l < n ? uint32_t(to_bf16(x[l])) << 16 : 0u;
      bad += bits(back[l]) != want;
    }
  }
  report(bad == 0, "avx2 bf16 store rounds as torch, partial loads and stores touch n elements", total, bad);
}

void check_select_and_zip() {
  const long bad = select_and_zip_mismatches();
  report(bad == 0, "avx2 select keeps first_lanes(n) of one vector; store_zip interleaves, a null row as zeros", 12,
         bad);
}

#if defined(__AVX512BF16__)
// The two layers' exp2 and exp are the same formulas: the same bits lane by lane.
void check_same_bits_as_avx512() {
  const auto xs = inputs(-160.0f, 100.0f, {-std::numeric_limits<float>::infinity(), -126.0f, 88.7f, 100.0f,
                                           std::numeric_limits<float>::quiet_NaN()});
  long bad2 = 0, bad = 0;
  for (size_t i = 0; i < xs.size(); i += 16) {
    alignas(64) float a[16], b[16], c[16], d[16];
    const __m512 x = _mm512_loadu_ps(xs.data() + i);
    _mm512_store_ps(a, pyscore::avx512::exp2_ps(_mm512_min_ps(x, _mm512_setzero_ps())));
    _mm512_store_ps(c, pyscore::avx512::exp_ps(x));
    for (int h = 0; h < 2; ++h) {
      const __m256 y = _mm256_loadu_ps(xs.data() + i + 8 * h);
      _mm256_store_ps(b + 8 * h, pyscore::avx2::exp2_ps(_mm256_min_ps(y, _mm256_setzero_ps())));
      _mm256_store_ps(d + 8 * h, pyscore::avx2::exp_ps(y));
    }
    for (int l = 0; l < 16; ++l) {
      if (bits(a[l]) != bits(b[l]) && bad2++ < 5)
        std::printf("  exp2(%.9g): avx512 %.9g, avx2 %.9g\n", xs[i + l], a[l], b[l]);
      if (bits(c[l]) != bits(d[l]) && !(std::isnan(c[l]) && std::isnan(d[l])) && bad++ < 5)
        std::printf("  exp(%.9g): avx512 %.9g, avx2 %.9g\n", xs[i + l], c[l], d[l]);
    }
  }
  report(bad2 == 0, "avx2 exp2_ps == avx512 exp2_ps bitwise", long(xs.size()), bad2);
  report(bad == 0, "avx2 exp_ps == avx512 exp_ps bitwise", long(xs.size()), bad);
}
#endif

}  // namespace

int main() {
  check_exp2_accuracy();
  check_exp_accuracy();
  check_bf16_and_partial();
  check_select_and_zip();
#if defined(__AVX512BF16__)
  check_same_bits_as_avx512();
#endif
  std::printf("%s\n", g_failures ? "FAILED" : "ALL OK");
  return g_failures ? 1 : 0;
}
