// Bitwise checks of the AVX-512 helpers in csrc/common/vec_math_avx512.h that must equal a reference formula
// exactly, not within a tolerance. Built and run by tests/ops/test_simd_math.py on CPUs with AVX512-BF16:
//   g++ -O2 -mavx512f -mavx512bw -mavx512dq -mavx512vl -mavx512bf16 -mfma -Icsrc tests/cpu/simd_check.cpp
// Prints one line per check and exits non-zero on the first mismatch.
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "common/vec_math_avx512.h"

using namespace pyscore::avx512;

namespace {

int g_failures = 0;

uint32_t bits(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  return u;
}

// The exp2 of the kernels before the denormal fix, verbatim: clamp at -150, unmasked scalef (which produces
// denormals for -150 <= x < -126).
__m512 exp2_unmasked(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-150.0f));
  const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(x, n);
  __m512 p = _mm512_set1_ps(1.5252734e-05f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.5403530e-04f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3333558e-03f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291e-03f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504109e-02f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022651e-01f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718e-01f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

// exp2_ps must be exp2_unmasked with denormal results flushed to zero, bit for bit, and must never return a
// denormal itself.
void check_exp2() {
  std::vector<float> xs = {-std::numeric_limits<float>::infinity(), -1e30f, -150.0f, -149.0f, -127.0f, -126.75f,
                           -126.5f, -126.25f, -126.0f, std::nextafter(-126.0f, 0.0f),
                           std::nextafter(-126.0f, -200.0f), -125.75f, -125.5f, -125.25f, -125.0f, -100.0f, -0.5f,
                           -1e-30f, -0.0f, 0.0f, std::numeric_limits<float>::quiet_NaN()};
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> wide(-160.0f, 0.0f), edge(-127.5f, -124.5f);
  for (int i = 0; i < 400000; ++i) xs.push_back(i % 2 ? wide(rng) : edge(rng));
  while (xs.size() % 16) xs.push_back(-1.0f);
  long mismatches = 0, zeroed = 0, denormals = 0;
  for (size_t i = 0; i < xs.size(); i += 16) {
    alignas(64) float got[16], old[16];
    const __m512 x = _mm512_loadu_ps(xs.data() + i);
    _mm512_store_ps(got, exp2_ps(x));
    _mm512_store_ps(old, exp2_unmasked(x));
    for (int l = 0; l < 16; ++l) {
      const bool old_denormal = std::fpclassify(old[l]) == FP_SUBNORMAL;
      const float want = old_denormal ? 0.0f : old[l];
      zeroed += old_denormal;
      denormals += std::fpclassify(got[l]) == FP_SUBNORMAL;
      if (bits(got[l]) != bits(want)) {
        if (mismatches++ < 5)
          std::printf("  exp2(%.9g): got %.9g (0x%08x), want %.9g (0x%08x)\n", xs[i + l], got[l], bits(got[l]), want,
                      bits(want));
      }
    }
  }
  const bool ok = mismatches == 0 && denormals == 0 && zeroed > 0;
  std::printf("%-4s exp2_ps == unmasked formula flushed to zero: %zu inputs, %ld were denormal, %ld mismatches, "
              "%ld denormal outputs\n", ok ? "ok" : "FAIL", xs.size(), zeroed, mismatches, denormals);
  g_failures += !ok;
}

uint16_t to_bf16(float f) {  // round to nearest even
  const uint32_t u = bits(f);
  return uint16_t((u + 0x7FFF + ((u >> 16) & 1)) >> 16);
}

// dot2_widened_ps on widened pairs must equal vdpbf16ps bit for bit on normal numbers, over magnitudes spread
// widely enough that the order of the two roundings matters (an even-first order fails this check).
void check_widened_dot() {
  std::mt19937 rng(11);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_int_distribution<int> scale(-20, 20);
  long total = 0, mismatches = 0;
  for (int it = 0; it < 50000; ++it) {
    alignas(64) uint16_t a[32], b[32];
    alignas(64) float acc[16], want[16], got[16];
    for (int i = 0; i < 32; ++i) {
      a[i] = to_bf16(normal(rng) * std::ldexp(1.0f, scale(rng)));
      b[i] = to_bf16(normal(rng) * std::ldexp(1.0f, scale(rng)));
    }
    for (int i = 0; i < 16; ++i) acc[i] = normal(rng) * std::ldexp(1.0f, scale(rng));
    const __m512i va = _mm512_load_si512(a), vb = _mm512_load_si512(b);
    const __m512 c = _mm512_load_ps(acc);
    _mm512_store_ps(want, _mm512_dpbf16_ps(c, (__m512bh)va, (__m512bh)vb));
    _mm512_store_ps(got, dot2_widened_ps(c, bf16_even_ps(va), bf16_odd_ps(va), bf16_even_ps(vb), bf16_odd_ps(vb)));
    for (int l = 0; l < 16; ++l) {
      ++total;
      if (bits(got[l]) != bits(want[l]) && mismatches++ < 5)
        std::printf("  lane %d: widened %.9g, vdpbf16ps %.9g\n", l, got[l], want[l]);
    }
  }
  const bool ok = mismatches == 0;
  std::printf("%-4s dot2_widened_ps == vdpbf16ps: %ld lanes, %ld mismatches\n", ok ? "ok" : "FAIL", total, mismatches);
  g_failures += !ok;
}

}  // namespace

int main() {
  check_exp2();
  check_widened_dot();
  std::printf("%s\n", g_failures ? "FAILED" : "ALL OK");
  return g_failures ? 1 : 0;
}
