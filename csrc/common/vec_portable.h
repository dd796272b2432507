// The portable kernels' inner loops, written so that GCC -O3 vectorizes them for the baseline ISA of any target:
// NEON on aarch64 (Advanced SIMD is part of ARMv8-A, so no flag is needed; the `neon` tier runs these where an op
// has no *_neon.cpp), SSE2 on x86-64's `generic` tier. Without -ffast-math a compiler may not reorder a float
// reduction, so a plain `sum += a[i] * b[i]` runs one add at a time; here every reduction keeps kPortableLanes
// partial sums (four 128-bit registers), lane l taking elements l, l + kPortableLanes, ..., folded by a fixed tree
// at the end. The order is fixed in the source, not chosen by the target, so a row's result depends only on that
// row, whatever the batch. exp_portable replaces the libm call (glibc has no vector expf for aarch64 before 2.38)
// with arithmetic the vectorizer can take: selects instead of branches, the exponent built in integer bits.
//
// Every function is `static`: an inline function's one out-of-line copy could otherwise come from a file compiled
// with wider ISA flags (*_avx512.cpp) and reach baseline callers (see rms_portable.h).
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#include "common/bf16.h"

namespace pyscore {

constexpr int32_t kPortableLanes = 16;

static inline uint32_t float_bits(float x) {
  uint32_t u;
  std::memcpy(&u, &x, sizeof(u));
  return u;
}

static inline float bits_float(uint32_t u) {
  float x;
  std::memcpy(&x, &u, sizeof(x));
  return x;
}

// e^x within ~2 ulp (Cephes expf): x = n ln2 + r, |r| <= ln2 / 2, ln2 in two parts (Cody-Waite) so r is exact,
// e^r by a degree-7 polynomial, 2^n put into the exponent bits. Results below e^-87 are 0, never denormal (the
// Intel denormal assists that cost the AVX-512 kernels dearly, bench notes); -inf gives 0, NaN stays NaN.
static inline float exp_portable(float x) {
  constexpr float kRound = 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer, held in the low mantissa bits
  const float lo = x < -87.0f ? -87.0f : x;
  const float xc = lo > 88.0f ? 88.0f : lo;
  const float shifted = xc * 1.44269504088896341f + kRound;
  const float n = shifted - kRound;
  const float r = (xc - n * 0.693359375f) - n * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const float y = p * r * r + r + 1.0f;
  const float scale = bits_float((float_bits(shifted) - float_bits(kRound) + 127u) << 23);  // 2^n, n in [-126, 127]
  const float e = y * scale;  // computed before the select: a conditional float op would keep the loop scalar
  return x < -87.0f ? 0.0f : e;
}

// The kPortableLanes partial sums folded pairwise (a fixed tree).
static inline float fold_lanes(float* part) {
  for (int32_t width = kPortableLanes / 2; width >= 1; width /= 2)
    for (int32_t l = 0; l < width; ++l) part[l] += part[l + width];
  return part[0];
}

// sum of a[i] * b[i] in fp32 (A, B: float, or uint16_t holding bf16, widened exactly).
template <class A, class B>
static inline float dot_portable(const A* a, const B* b, int32_t n) {
  float part[kPortableLanes] = {};
  int32_t i = 0;
  for (; i + kPortableLanes <= n; i += kPortableLanes)
    for (int32_t l = 0; l < kPortableLanes; ++l) part[l] += to_f32(a[i + l]) * to_f32(b[i + l]);
  for (int32_t l = 0; i + l < n; ++l) part[l] += to_f32(a[i + l]) * to_f32(b[i + l]);
  return fold_lanes(part);
}

// max(a, b) in one vector instruction where there is one: fmaxnm on aarch64; elsewhere a compare and select
// (x86's fmaxf is a libm call). Both pass over a NaN in b.
static inline float max2(float a, float b) {
#if defined(__aarch64__)
  return std::fmax(a, b);
#else
  return a < b ? b : a;
#endif
}

// max(init, x[0], ..., x[n - 1]); exact, so in any order.
static inline float max_portable(const float* x, int32_t n, float init) {
  float m = init;
  for (int32_t i = 0; i < n; ++i) m = max2(m, x[i]);
  return m;
}

// x[i] = e^(x[i] - shift) in place; returns their sum.
static inline float exp_sum_inplace(float* x, int32_t n, float shift) {
  for (int32_t i = 0; i < n; ++i) x[i] = exp_portable(x[i] - shift);
  float part[kPortableLanes] = {};
  int32_t i = 0;
  for (; i + kPortableLanes <= n; i += kPortableLanes)
    for (int32_t l = 0; l < kPortableLanes; ++l) part[l] += x[i + l];
  for (int32_t l = 0; i + l < n; ++l) part[l] += x[i + l];
  return fold_lanes(part);
}

// sum of e^(x[i] - shift), x left as it is (whole blocks go through a small buffer so the exp loop vectorizes).
static inline float exp_sum(const float* x, int32_t n, float shift) {
  constexpr int32_t kBlock = 4 * kPortableLanes;
  float part[kPortableLanes] = {}, e[kBlock];
  int32_t i = 0;
  for (; i + kBlock <= n; i += kBlock) {
    for (int32_t j = 0; j < kBlock; ++j) e[j] = exp_portable(x[i + j] - shift);
    for (int32_t j = 0; j < kBlock; j += kPortableLanes)
      for (int32_t l = 0; l < kPortableLanes; ++l) part[l] += e[j + l];
  }
  for (int32_t j = 0; i + j < n; ++j) part[j % kPortableLanes] += exp_portable(x[i + j] - shift);
  return fold_lanes(part);
}

}  // namespace pyscore
