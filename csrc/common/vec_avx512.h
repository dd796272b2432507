// The AVX-512 vector layer: the names of common/vec_avx2.h (Vec, kLanes, load / store from fp32 or bf16 with torch's
// rounding, load_n / store_n for ragged ends, round_as, fma, reductions, exp2_ps / exp_ps) on 16-lane zmm vectors, so
// a kernel body written once against `V::` compiles for either ISA (see add_rms_norm/rows_simd.h). add, sub, mul and
// div use the explicit-rounding intrinsics, which GCC never contracts into an FMA: a body that rounds each product as
// torch does keeps doing so whatever -ffp-contract says.
//
// Include only from files compiled with the AVX-512 flags (see vec_math_avx512.h).
#pragma once
#include "common/vec_math_avx512.h"

namespace pyscore {
namespace avx512 {

constexpr int kLanes = 16;
using Vec = __m512;
constexpr int kRoundNearest = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;

static inline Vec zero() { return _mm512_setzero_ps(); }
static inline Vec set1(float x) { return _mm512_set1_ps(x); }
static inline Vec add(Vec a, Vec b) { return _mm512_add_round_ps(a, b, kRoundNearest); }
static inline Vec sub(Vec a, Vec b) { return _mm512_sub_round_ps(a, b, kRoundNearest); }
static inline Vec mul(Vec a, Vec b) { return _mm512_mul_round_ps(a, b, kRoundNearest); }
static inline Vec div(Vec a, Vec b) { return _mm512_div_round_ps(a, b, kRoundNearest); }
static inline Vec max(Vec a, Vec b) { return _mm512_max_ps(a, b); }
static inline Vec fma(Vec a, Vec b, Vec acc) { return _mm512_fmadd_ps(a, b, acc); }
static inline Vec fnma(Vec a, Vec b, Vec c) { return _mm512_fnmadd_ps(a, b, c); }  // c - a * b, one rounding
static inline void stream(float* p, Vec x) { _mm512_stream_ps(p, x); }  // p 64-byte aligned (see vec_avx2.h)
static inline void stream_fence() { _mm_sfence(); }

// The first n lanes (n clamped to [0, 16]).
static inline __mmask16 first_mask(int n) {
  return n >= kLanes ? __mmask16(0xFFFF) : n <= 0 ? __mmask16(0) : __mmask16((1u << n) - 1);
}

static inline Vec load(const float* p) { return _mm512_loadu_ps(p); }
static inline Vec load(const uint16_t* p) { return load_bf16_ps(p); }
static inline Vec load_first(const float* p, int n) { return _mm512_maskz_loadu_ps(first_mask(n), p); }
static inline Vec load_first(const uint16_t* p, int n) { return maskz_load_bf16_ps(first_mask(n), p); }
template <class T>
static inline Vec load_n(const T* p, int n) { return n >= kLanes ? load(p) : load_first(p, n); }

static inline void store_first(float* p, Vec x, int n) { _mm512_mask_storeu_ps(p, first_mask(n), x); }
static inline void store_first(uint16_t* p, Vec x, int n) { mask_store_bf16_exact_ps(p, first_mask(n), x); }
static inline void store(float* p, Vec x) { _mm512_storeu_ps(p, x); }
static inline void store(uint16_t* p, Vec x) { store_first(p, x, kLanes); }
template <class T>
static inline void store_n(T* p, Vec x, int n) {
  if (n >= kLanes) store(p, x);
  else store_first(p, x, n);
}

// Two vectors a, b stored as 2 * kLanes consecutive elements (b after a), rounded as store: for bf16 one shuffle
// (vpermt2w picks the rounded bits' high halves of both) and one store, where two stores cost two vpmovdw of two
// shuffle-port uops each (that port bounds the elementwise bf16 loops).
static inline void store2(float* p, Vec a, Vec b) {
  _mm512_storeu_ps(p, a);
  _mm512_storeu_ps(p + kLanes, b);
}
static inline void store2(uint16_t* p, Vec a, Vec b) {
  const __m512i odd_words = _mm512_set_epi16(63, 61, 59, 57, 55, 53, 51, 49, 47, 45, 43, 41, 39, 37, 35, 33, 31, 29,
                                             27, 25, 23, 21, 19, 17, 15, 13, 11, 9, 7, 5, 3, 1);
  _mm512_storeu_si512(p, _mm512_permutex2var_epi16(round_bf16_bits(a), odd_words, round_bf16_bits(b)));
}

static inline Vec round_as(Vec x, const float*) { return x; }
static inline Vec round_as(Vec x, const uint16_t*) { return round_bf16_exact_ps(x); }

static inline float reduce_add(Vec x) { return _mm512_reduce_add_ps(x); }
static inline float reduce_max(Vec x) { return _mm512_reduce_max_ps(x); }

}  // namespace avx512
}  // namespace pyscore
