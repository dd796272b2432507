// AVX-512 helpers shared by the *_avx512.cpp kernels. Include only from files compiled with the AVX-512 flags:
// everything here is `static inline` so no out-of-line copy can leak into baseline-ISA code.
#pragma once
#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <limits>

#include "common/opaque.h"

namespace pyscore {
namespace avx512 {

// 2^x for x <= 0 (softmax arguments), ~1 ulp: x = n + f with n = round(x), f in [-0.5, 0.5], 2^f by its
// degree-7 Taylor polynomial (truncation < 1e-8 relative), then scalef multiplies by 2^n exactly.
// Lanes below -126 (and -inf, NaN) give 0 through a zero-masked scalef: their true results are denormals, and an
// Intel core takes a ~90 ns microcode assist for every vector that produces one (masked scores are -inf, so
// attention made one per masked tile). Lanes at or above -126 give exactly what the unmasked formula gives (2^f >= 1
// for n = -126, so those results are normal); the rest are the unmasked result flushed to zero. Bitwise, this is
// the unmasked formula under flush-to-zero (tests/cpu/simd_check.cpp).
static inline __m512 exp2_ps(__m512 x) {
  const __mmask16 normal = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-126.0f), _CMP_GE_OQ);
  x = _mm512_max_ps(x, _mm512_set1_ps(-127.0f));  // keeps -inf out of the arithmetic (no NaN in dead lanes)
  const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(x, n);  // exact
  __m512 p = _mm512_set1_ps(1.5252734e-05f);  // ln2^7 / 7!
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.5403530e-04f));  // ln2^6 / 6!
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3333558e-03f));  // ln2^5 / 5!
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291e-03f));  // ln2^4 / 4!
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504109e-02f));  // ln2^3 / 3!
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022651e-01f));  // ln2^2 / 2!
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718e-01f));  // ln2
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  return _mm512_maskz_scalef_ps(normal, p, n);
}

// The last step of a flash-attention tile, for `rows` rows of `dim` (a multiple of 16) fp32 outputs: o[r] /= sum[r]
// (o stays 0 for a row that saw no key) and lse[r], the natural-log log-sum-exp of the row's scores, from the
// running max of its base-2 scores and the running sum of 2^(score - max) (-inf for a row that saw no key).
static inline void finish_softmax_rows(float* o, int rows, int dim, const float* max2, const float* sum, float* lse) {
  for (int r = 0; r < rows; ++r) {
    const float l = sum[r];
    const __m512 inv = _mm512_set1_ps(l > 0.0f ? 1.0f / l : 0.0f);
    for (int d = 0; d < dim; d += 16)
      _mm512_storeu_ps(o + r * dim + d, _mm512_mul_ps(inv, _mm512_loadu_ps(o + r * dim + d)));
    lse[r] = l > 0.0f ? max2[r] * 0.6931471805599453f + std::log(l) : -std::numeric_limits<float>::infinity();
  }
}

// ---- bf16 pairs widened to fp32 (the Bf16Dot::kWiden path, see common/cpu_features.h) ----------------------------

// A zmm of 16 bf16 pairs (dword i = elements 2i, 2i+1) as two fp32 vectors: the even elements (low halves) and the
// odd ones (high halves). Exact.
static inline __m512 bf16_even_ps(__m512i pairs) { return _mm512_castsi512_ps(_mm512_slli_epi32(pairs, 16)); }
static inline __m512 bf16_odd_ps(__m512i pairs) {
  return _mm512_castsi512_ps(_mm512_and_si512(pairs, _mm512_set1_epi32(int(0xFFFF0000u))));
}

// acc + a_odd * b_odd + a_even * b_even per lane, rounded as vdpbf16ps rounds: the odd product is added first, each
// product is exact in fp32, so two FMAs in that order give vdpbf16ps's result bitwise on normal numbers (vdpbf16ps
// also flushes denormal inputs and outputs to zero; FMA keeps them).
static inline __m512 dot2_widened_ps(__m512 acc, __m512 a_even, __m512 a_odd, __m512 b_even, __m512 b_odd) {
  return _mm512_fmadd_ps(a_even, b_even, _mm512_fmadd_ps(a_odd, b_odd, acc));
}

// e^x with full fp32 accuracy (for results rounded to bf16 that must land where torch's Sleef exp lands): a
// Cody-Waite reduction x = n ln2 + r, |r| <= ln2 / 2, instead of scaling the argument by log2 e (whose rounding
// error grows with |x|), e^r by its degree-7 Taylor polynomial (truncation < 6e-9 relative), times 2^n exactly. ~1 ulp;
// overflows to +inf past 88.7 and underflows to 0 (through the denormals) below -103.
static inline __m512 exp_ps(__m512 x) {
  // Clamp with x as the second operand so a NaN passes through.
  x = _mm512_min_ps(_mm512_set1_ps(100.0f), _mm512_max_ps(_mm512_set1_ps(-110.0f), x));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);  // ln2 high part: n * it is exact
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.42860682030941723212e-6f), r);  // ln2 low part
  __m512 p = _mm512_set1_ps(1.0f / 5040);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 720));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

// 16 bf16 -> 16 fp32 (exact: bf16 is the top half of an fp32).
static inline __m512 load_bf16_ps(const uint16_t* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

static inline __m512 maskz_load_bf16_ps(__mmask16 m, const uint16_t* p) {
  const __m256i h = _mm256_maskz_loadu_epi16(m, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// 16 fp32 -> 16 bf16, round to nearest even (the hardware conversion).
static inline void store_bf16_ps(uint16_t* p, __m512 x) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), (__m256i)_mm512_cvtneps_pbh(x));
}

static inline void mask_store_bf16_ps(uint16_t* p, __mmask16 m, __m512 x) {
  _mm256_mask_storeu_epi16(p, m, (__m256i)_mm512_cvtneps_pbh(x));
}

// Round to nearest even to bf16 exactly as torch's own conversion does, in integer arithmetic on the fp32 bits:
// add 0x7FFF plus the lowest kept bit, clear the 16 dropped bits. Unlike vcvtneps2bf16 (store_bf16_ps), which
// treats denormal inputs as zero, denormals round to bf16 denormals; and it costs a few integer ops and no
// shuffle. NaNs that arithmetic or bf16 inputs produce stay NaN (their low 16 bits are 0, or the quiet bit is
// set below a zero bit, so the carry never reaches the exponent).
static inline __m512i round_bf16_bits(__m512 x) {
  const __m512i bits = _mm512_castps_si512(x);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  return _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF)));  // bf16 in the high halves
}

// x rounded to bf16 (as torch) and still held as fp32: what storing and re-loading would give.
static inline __m512 round_bf16_exact_ps(__m512 x) {
  return _mm512_castsi512_ps(_mm512_and_si512(round_bf16_bits(x), _mm512_set1_epi32(int(0xFFFF0000u))));
}

static inline void mask_store_bf16_exact_ps(uint16_t* p, __mmask16 m, __m512 x) {
  _mm256_mask_storeu_epi16(p, m, _mm512_cvtepi32_epi16(_mm512_srli_epi32(round_bf16_bits(x), 16)));
}

// 16 fp32 -> 16 bf16 as torch rounds, without vcvtneps2bf16 (store_bf16_ps's instruction, which tier avx512 lacks).
static inline void store_bf16_exact_ps(uint16_t* p, __m512 x) { mask_store_bf16_exact_ps(p, 0xFFFF, x); }

}  // namespace avx512
}  // namespace pyscore
