// Checks of the NEON vector layer (csrc/common/vec_neon.h), cross-compiled for aarch64 and run under qemu-aarch64
// by tests/ops/test_aarch64.py:
//   aarch64-linux-gnu-g++ -std=c++17 -O2 -ffp-contract=off -Icsrc tests/cpu/simd_check_neon.cpp
// The exp formulas must give, bit for bit, what the x86 layers' instruction sequence gives, written out here in
// scalar C++ (std::fma for each fused step, x86's max / min rule, round to nearest even); bf16 rounding must equal
// common/bf16.h's; loads and stores of a ragged end must not touch memory past it. Prints one line per check and
// exits non-zero on any failure.
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "common/bf16.h"
#include "common/vec_neon.h"

namespace {

namespace V = pyscore::neon;
}  // namespace

#include "layer_select_check.h"

namespace {

int g_failures = 0;

uint32_t bits(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  return u;
}

float from_bits(uint32_t u) {
  float x;
  std::memcpy(&x, &u, 4);
  return x;
}

void report(bool ok, const char* what, long total, long bad) {
  std::printf("%-4s %s: %ld inputs, %ld mismatches\n", ok ? "ok" : "FAIL", what, total, bad);
  g_failures += !ok;
}

float max_x86(float a, float b) { return a > b ? a : b; }
float min_x86(float a, float b) { return a < b ? a : b; }
float pow2i(float n) { return from_bits(uint32_t(int32_t(n) + 127) << 23); }

// vec_avx2.h / vec_math_avx512.h exp2_ps, one lane.
float exp2_x86(float x) {
  const bool normal = x >= -126.0f;
  x = max_x86(x, -127.0f);
  const float n = std::nearbyint(x), f = x - n;
  float p = 1.5252734e-05f;
  for (float c : {1.5403530e-04f, 1.3333558e-03f, 9.6181291e-03f, 5.5504109e-02f, 2.4022651e-01f, 6.9314718e-01f,
                  1.0f})
    p = std::fma(p, f, c);
  return p * (normal ? pow2i(n) : 0.0f);
}

// vec_avx2.h exp_ps, one lane.
float exp_x86(float x) {
  x = min_x86(100.0f, max_x86(-110.0f, x));
  const float n = std::nearbyint(x * 1.44269504088896341f);
  float r = std::fma(-n, 0.693145751953125f, x);
  r = std::fma(-n, 1.42860682030941723212e-6f, r);
  float p = 1.0f / 5040;
  for (float c : {1.0f / 720, 1.0f / 120, 1.0f / 24, 1.0f / 6, 0.5f, 1.0f, 1.0f}) p = std::fma(p, r, c);
  const float half = std::floor(n * 0.5f);
  return p * pow2i(half) * pow2i(n - half);
}

std::vector<float> inputs(float lo, float hi, std::vector<float> xs) {
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> wide(lo, hi), edge(-127.5f, -124.5f);
  for (int i = 0; i < 200000; ++i) xs.push_back(i % 2 ? wide(rng) : edge(rng));
  while (xs.size() % V::kLanes) xs.push_back(-1.0f);
  return xs;
}

template <class Vector, class Scalar>
void check_exp(const char* what, const std::vector<float>& xs, Vector vector_fn, Scalar scalar_fn, bool no_denormal) {
  long bad = 0;
  for (size_t i = 0; i < xs.size(); i += V::kLanes) {
    float got[V::kLanes];
    V::store(got, vector_fn(V::load(xs.data() + i)));
    for (int l = 0; l < V::kLanes; ++l) {
      const float want = scalar_fn(xs[i + l]);
      const bool same = bits(got[l]) == bits(want) || (std::isnan(got[l]) && std::isnan(want));
      const bool ok = same && !(no_denormal && std::fpclassify(got[l]) == FP_SUBNORMAL);
      if (!ok && bad++ < 5) std::printf("  %s(%.9g): got %.9g, want %.9g\n", what, xs[i + l], got[l], want);
    }
  }
  report(bad == 0, what, long(xs.size()), bad);
}

// Accuracy against libm, so the scalar transcription above cannot hide a wrong formula.
void check_exp2_accuracy(const std::vector<float>& xs) {
  long bad = 0;
  for (float x : xs) {
    if (!(x <= 0.0f)) continue;
    const float got = exp2_x86(x), want = x < -126.0f ? 0.0f : std::exp2(x);
    if (std::abs(int64_t(bits(got)) - int64_t(bits(want))) > 2 && bad++ < 5)
      std::printf("  exp2(%.9g): got %.9g, want %.9g\n", x, got, want);
  }
  report(bad == 0, "the exp2 formula within 2 ulp of std::exp2 (x <= 0), 0 below -126", long(xs.size()), bad);
}

void check_exp_accuracy(const std::vector<float>& xs) {
  long bad = 0;
  for (float x : xs) {
    const float got = exp_x86(x), want = std::exp(x);
    if (std::fpclassify(want) != FP_NORMAL) continue;
    if (std::abs(int64_t(bits(got)) - int64_t(bits(want))) > 2 && bad++ < 5)
      std::printf("  exp(%.9g): got %.9g, want %.9g\n", x, got, want);
  }
  report(bad == 0, "the exp formula within 2 ulp of std::exp (normal results)", long(xs.size()), bad);
}

// store(uint16_t*) rounds as common/bf16.h does; round_as equals a store and a reload; widening is exact. NaN: the
// ones arithmetic produces and bf16 inputs carry stay NaN (the x86 layers' contract; an arbitrary payload may not).
void check_bf16() {
  std::vector<float> xs = {0.0f, -0.0f, 1.0f, 1.00390625f, 1.01171875f, 3.4028235e38f, -3.4028235e38f, 1e-40f,
                           -1e-40f, std::numeric_limits<float>::infinity(), -std::numeric_limits<float>::infinity(),
                           from_bits(0x7FC00000u), from_bits(0xFFC00000u), from_bits(0x7F810000u)};
  std::mt19937 rng(11);
  for (int i = 0; i < 200000; ++i) {
    const float x = from_bits(uint32_t(rng()));
    if (!std::isnan(x)) xs.push_back(x);
  }
  while (xs.size() % V::kLanes) xs.push_back(1.0f);
  long bad = 0;
  for (size_t i = 0; i < xs.size(); i += V::kLanes) {
    uint16_t h[V::kLanes];
    float again[V::kLanes], rounded[V::kLanes];
    const V::Vec x = V::load(xs.data() + i);
    V::store(h, x);
    V::store(again, V::load(h));
    V::store(rounded, V::round_as(x, static_cast<const uint16_t*>(nullptr)));
    for (int l = 0; l < V::kLanes; ++l) {
      if (std::isnan(xs[i + l])) {
        bad += !std::isnan(again[l]);
        continue;
      }
      const uint16_t want = pyscore::bf16_from_f32(xs[i + l]);
      bad += h[l] != want || bits(again[l]) != uint32_t(want) << 16 || bits(rounded[l]) != uint32_t(want) << 16;
    }
  }
  report(bad == 0, "bf16 store / reload / round_as == bf16_from_f32 (NaN stays NaN)", long(xs.size()), bad);
}

// Ragged ends: lanes past n read as 0 and are never written; bf16 pairs widen to their even and odd elements.
void check_ragged_and_pairs() {
  long bad = 0;
  for (int n = 0; n <= V::kLanes; ++n) {
    float src[8] = {1, 2, 3, 4, 9, 9, 9, 9}, dst[8] = {-1, -1, -1, -1, -1, -1, -1, -1};
    V::store_n(dst, V::load_n(src, n), n);
    for (int l = 0; l < 8; ++l) bad += dst[l] != (l < n ? src[l] : -1.0f);
    uint16_t hsrc[8] = {0x3F80, 0x4000, 0x4040, 0x4080, 0x7FC0, 0x7FC0, 0x7FC0, 0x7FC0}, hdst[8] = {};
    V::store_n(hdst, V::load_n(hsrc, n), n);
    for (int l = 0; l < 8; ++l) bad += hdst[l] != (l < n ? hsrc[l] : 0);
    float lanes[V::kLanes];
    V::store(lanes, V::load_first(src, n));
    for (int l = 0; l < V::kLanes; ++l) bad += lanes[l] != (l < n ? src[l] : 0.0f);
  }
  const uint16_t pairs[8] = {0x3F80, 0x4000, 0x4040, 0x4080, 0x40A0, 0x40C0, 0x40E0, 0x4100};  // 1 .. 8
  float even[V::kLanes], odd[V::kLanes];
  V::store(even, V::bf16_even(V::load_bits(pairs)));
  V::store(odd, V::bf16_odd(V::load_bits(pairs)));
  for (int l = 0; l < V::kLanes; ++l) bad += even[l] != float(2 * l + 1) || odd[l] != float(2 * l + 2);
  report(bad == 0, "load_n / store_n stop at n; bf16_even / bf16_odd split pairs", 5, bad);
}

void check_select_and_zip() {
  const long bad = select_and_zip_mismatches();
  report(bad == 0, "select keeps first_lanes(n) of one vector; store_zip interleaves, a null row as zeros", 8, bad);
}

void check_reductions() {
  const float x[4] = {1e8f, 1.0f, -1e8f, 1.0f};
  const float sum = V::reduce_add(V::load(x));  // (1e8 + -1e8) + (1 + 1): lanes i and i + 2 first
  const float y[4] = {-3.0f, std::nanf(""), 7.0f, 2.0f};
  const float mx = V::reduce_max(V::load(y));
  const bool ok = sum == 2.0f && mx == 7.0f && V::reduce_max(V::set1(-1.0f)) == -1.0f;
  report(ok, "reduce_add folds halves first; reduce_max passes over NaN", 3, !ok);
}

}  // namespace

int main() {
  const auto softmax_args = inputs(-160.0f, 0.0f, {-std::numeric_limits<float>::infinity(), -150.0f, -127.0f,
                                                   -126.5f, -126.0f, std::nextafter(-126.0f, 0.0f), -0.5f, -0.0f,
                                                   0.0f, std::numeric_limits<float>::quiet_NaN()});
  const auto anywhere = inputs(-120.0f, 100.0f, {-std::numeric_limits<float>::infinity(), -110.0f, -104.0f, -88.0f,
                                                 88.7f, 89.0f, 100.0f, std::numeric_limits<float>::infinity(),
                                                 std::numeric_limits<float>::quiet_NaN()});
  check_exp("neon exp2_ps == the x86 exp2 sequence, no denormal", softmax_args, V::exp2_ps, exp2_x86, true);
  check_exp("neon exp_ps == the x86 exp sequence", anywhere, V::exp_ps, exp_x86, false);
  check_exp2_accuracy(softmax_args);
  check_exp_accuracy(anywhere);
  check_bf16();
  check_ragged_and_pairs();
  check_select_and_zip();
  check_reductions();
  std::printf("%s: %d failed\n", g_failures ? "FAILED" : "passed", g_failures);
  return g_failures ? 1 : 0;
}
