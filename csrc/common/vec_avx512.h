// The AVX-512 vector layer: the names of common/vec_avx2.h (Vec, kLanes, load / store from fp32 or bf16 with torch's
// rounding, load_n / store_n for ragged ends, round_as, fma, reductions, exp2_ps / exp_ps) on 16-lane zmm vectors, so
// a kernel body written once against `V::` compiles for either ISA (see add_rms_norm/rows_simd.h). add, sub, mul and
// div use the explicit-rounding intrinsics, which GCC never contracts into an FMA: a body that rounds each product as
// torch does keeps doing so whatever -ffp-contract says.
//
// Include only from files compiled with the AVX-512 flags (see vec_math_avx512.h).
#pragma once
#include <cstring>

#include "common/vec_math_avx512.h"

namespace pyscore {
namespace avx512 {

constexpr int kLanes = 16;
constexpr int kRegisters = 32;     // vector registers: what a kernel text sizes its register tiles by
constexpr bool kHasBf16Dot = true;  // dot_pairs is vdpbf16ps (AVX512-BF16; tier avx512 never reaches it)
using Vec = __m512;
using Mask = __mmask16;  // a lane mask
using Bits = __m512i;    // 16 bf16 pairs (a 32-bit lane = elements 2i, 2i+1)
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

static inline Mask first_lanes(int n) { return first_mask(n); }
static inline Vec select(Mask m, Vec yes, Vec no) { return _mm512_mask_blend_ps(m, no, yes); }
static inline void prefetch(const void* p) { _mm_prefetch(static_cast<const char*>(p), _MM_HINT_T1); }  // to L2

static inline Vec load(const float* p) { return _mm512_loadu_ps(p); }
static inline Vec load(const uint16_t* p) { return load_bf16_ps(p); }
static inline Vec load_first(const float* p, int n) { return _mm512_maskz_loadu_ps(first_mask(n), p); }
static inline Vec load_first(const uint16_t* p, int n) { return maskz_load_bf16_ps(first_mask(n), p); }

static inline void store_first(float* p, Vec x, int n) { _mm512_mask_storeu_ps(p, first_mask(n), x); }
static inline void store_first(uint16_t* p, Vec x, int n) { mask_store_bf16_exact_ps(p, first_mask(n), x); }
static inline void store(float* p, Vec x) { _mm512_storeu_ps(p, x); }
static inline void store(uint16_t* p, Vec x) { store_first(p, x, kLanes); }
#include "common/vec_ragged.inc"  // load_n, store_n

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

// ---- bf16 pairs (vec_avx2.h's names) -------------------------------------------------------------------------------
static inline Vec bf16_even(Bits pairs) { return bf16_even_ps(pairs); }
static inline Vec bf16_odd(Bits pairs) { return bf16_odd_ps(pairs); }
static inline Bits load_bits(const void* p) { return _mm512_loadu_si512(p); }
// bf16_odd, for linear's widened steps: the AVX-512 layer has the registers to hold its mask.
static inline Vec bf16_odd_lean(Bits pairs) { return bf16_odd(pairs); }
// Registers linear's widened bf16 steps need beside a tile and its widened weight vectors: the broadcast, the mask,
// a temporary and two GCC takes once the tile is scalars (with 3, the 6 x 4 tile spilled 3 vectors a step).
constexpr int kWidenSpareRegisters = 5;
// acc + a_odd * b_odd + a_even * b_even per lane (vdpbf16ps; dot2_widened_ps gives its bits without it).
static inline Vec dot_pairs(Vec acc, Bits a, Bits b) { return _mm512_dpbf16_ps(acc, (__m512bh)a, (__m512bh)b); }

// The 4-byte unit at p (a bf16 pair) in every lane: the broadcast operand of dot_pairs.
static inline Bits set1_pair(const uint16_t* p) {
  int32_t pair;
  std::memcpy(&pair, p, sizeof(pair));
  return _mm512_set1_epi32(pair);
}

// ---- int8 quads (linear's int8 weights: linear/linear.h) -----------------------------------------------------------
// Sums in int32 lanes of Bits (zero_bits, load_bits, store_bits). dot_quads adds to each 32-bit lane the four
// products of x's 4 code bytes (the broadcast operand) with the lane's 4 weight bytes, exactly (vpdpbusd,
// AVX512-VNNI: every CPU of tier avx512bf16 and up has it). vpdpbusd multiplies unsigned by signed bytes, so x codes
// are stored as q + kInt8XOffset in [1, 255], and a group's sums start from -kInt8XOffset * sum(w) (linear.h's w_base).
constexpr bool kInt8DotIsVnni = true;  // dot_quads is vpdpbusd: only where cpu_int8_vnni()
constexpr int kInt8SpareRegisters = 1;  // what dot_quads needs beside a tile and its weights: the broadcast (weights as registers)
constexpr int32_t kInt8XOffset = 128;
// In asm: GCC 12's vpdpbusd builtin copies the accumulator to a fresh register before each one and back after (a
// 6 x 4 tile then spilled every step, 0.9x the bf16 kernel's speed); the asm ties it to its register.
static inline Bits dot_quads(Bits acc, Bits x, Bits w) {
  asm("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(x), "vm"(w));
  return acc;
}
static inline Bits zero_bits() { return _mm512_setzero_si512(); }
static inline void store_bits(void* p, Bits v) { _mm512_storeu_si512(p, v); }
// The 4-byte unit at p in every lane, as set1_pair's broadcast: dot_quads' x operand.
static inline Bits set1_quad(const uint8_t* p) { return set1_pair(reinterpret_cast<const uint16_t*>(p)); }
// acc's int32 lanes in fp32, rounded to nearest even (a group's sums are exact in fp32: linear.h's kInt8MaxGroup).
static inline Vec bits_to_f32(Bits acc) { return _mm512_cvtepi32_ps(acc); }
// The first n lanes of x as codes at p: round half to even, clamped to [-127, 127], plus kInt8XOffset, a byte each.
static inline void store_codes(uint8_t* p, Vec x, int n) {
  __m512i q = _mm512_cvtps_epi32(x);  // the MXCSR's rounding: nearest even
  q = _mm512_min_epi32(_mm512_max_epi32(q, _mm512_set1_epi32(-127)), _mm512_set1_epi32(127));
  _mm512_mask_cvtepi32_storeu_epi8(p, first_mask(n), _mm512_add_epi32(q, _mm512_set1_epi32(kInt8XOffset)));
}
static inline Vec abs(Vec x) { return _mm512_abs_ps(x); }

// out[2i] = a[i], out[2i + 1] = b[i] for i < kZipDims (two rows of 32 bf16 interleaved into 32 pairs, one
// vpermt2w per half); a null row reads as zeros.
constexpr int kZipDims = 32;
static inline void store_zip(uint16_t* out, const uint16_t* a, const uint16_t* b) {
  const __m512i lo = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8,
                                      39, 7, 38, 6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
  const __m512i hi = _mm512_add_epi16(lo, _mm512_set1_epi16(16));
  const __m512i x = a ? _mm512_loadu_si512(a) : _mm512_setzero_si512();
  const __m512i y = b ? _mm512_loadu_si512(b) : _mm512_setzero_si512();
  _mm512_storeu_si512(out, _mm512_permutex2var_epi16(x, lo, y));
  _mm512_storeu_si512(out + kZipDims, _mm512_permutex2var_epi16(x, hi, y));
}

static inline float reduce_add(Vec x) { return _mm512_reduce_add_ps(x); }
// out[i] = the sum of the lanes of a_i: one fold of 512 -> 128 bits across the four, then within lanes.
static inline void reduce_add4(Vec a0, Vec a1, Vec a2, Vec a3, float* out) {
  const __m512 s01 = _mm512_add_ps(_mm512_shuffle_f32x4(a0, a1, 0x44), _mm512_shuffle_f32x4(a0, a1, 0xEE));
  const __m512 s23 = _mm512_add_ps(_mm512_shuffle_f32x4(a2, a3, 0x44), _mm512_shuffle_f32x4(a2, a3, 0xEE));
  // 128-bit lane i now holds 4 partial sums of a_i.
  __m512 t = _mm512_add_ps(_mm512_shuffle_f32x4(s01, s23, 0x88), _mm512_shuffle_f32x4(s01, s23, 0xDD));
  t = _mm512_add_ps(t, _mm512_permute_ps(t, _MM_SHUFFLE(2, 3, 0, 1)));
  t = _mm512_add_ps(t, _mm512_permute_ps(t, _MM_SHUFFLE(1, 0, 3, 2)));
  const __m512i first_of_lanes = _mm512_setr_epi32(0, 4, 8, 12, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0);
  _mm_storeu_ps(out, _mm512_castps512_ps128(_mm512_permutexvar_ps(first_of_lanes, t)));
}
static inline float reduce_max(Vec x) { return _mm512_reduce_max_ps(x); }

// p[2i] = even[i], p[2i + 1] = odd[i]: 2 * kLanes fp32 (a pair split by bf16_even / bf16_odd, back in element order).
static inline void store_interleaved(float* p, Vec even, Vec odd) {
  const __m512i lo = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
  const __m512i hi = _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
  _mm512_storeu_ps(p, _mm512_permutex2var_ps(even, lo, odd));
  _mm512_storeu_ps(p + kLanes, _mm512_permutex2var_ps(even, hi, odd));
}

// Lane j of the result = the sum of the 16 lanes of a[j] (a transpose and add of 16 vectors: four levels of
// pairwise interleave-and-add, 15 adds and 30 shuffles for 16 sums; not reduce_add's order).
static inline Vec transpose_sum(const Vec (&a)[kLanes]) {
  Vec b[8], c[4], d[2];
  for (int i = 0; i < 8; ++i)  // per 128-bit lane: x02 y02 x13 y13
    b[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]), _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {  // per 128-bit lane: the lane's sums of 4 consecutive vectors
    const __m512d u = _mm512_castps_pd(b[2 * i]), v = _mm512_castps_pd(b[2 * i + 1]);
    c[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(u, v)), _mm512_castpd_ps(_mm512_unpackhi_pd(u, v)));
  }
  for (int i = 0; i < 2; ++i)  // 128-bit lanes: (0+1, 2+3) of c[2i], then of c[2i + 1]
    d[i] = _mm512_add_ps(_mm512_shuffle_f32x4(c[2 * i], c[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(c[2 * i], c[2 * i + 1], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(d[0], d[1], 0x88), _mm512_shuffle_f32x4(d[0], d[1], 0xDD));
}

}  // namespace avx512
}  // namespace pyscore
