// The AVX2 + FMA vector layer: an 8-lane fp32 vector and what the kernels do with it (lane masks and select, loads
// and stores from fp32 or bf16, bf16 pairs, multiply-add, max, exp, horizontal reductions, prefetch), so a kernel is
// written against these names, not against raw intrinsics, and the same kernel text compiles against another ISA's
// layer with the same names (vLLM's csrc/cpu/cpu_types_*.hpp pattern; issue 21 item 5): the *_simd.h kernel bodies
// are compiled per layer, this one and common/vec_neon.h (attention, label read-out) or common/vec_avx512.h
// (elementwise). No bf16 arithmetic here: bf16 is widened to fp32 (exact, a shift), multiplied with FMA in fp32 and
// rounded back to nearest even in integer arithmetic, exactly as torch's conversion rounds.
//
// Include only from files compiled with -mavx2 -mfma -mf16c (CMakeLists.txt gives them to *_avx2.cpp on x86-64):
// everything here is `static inline`, so no out-of-line copy can leak into baseline-ISA code.
#pragma once
#include <immintrin.h>

#include <cstdint>
#include <cstring>
#include "common/opaque.h"

namespace pyscore {
namespace avx2 {

constexpr int kLanes = 8;
constexpr int kRegisters = 16;       // vector registers: what a kernel text sizes its register tiles by
constexpr bool kHasBf16Dot = false;  // dot_pairs is two FMAs (no bf16 arithmetic)
using Vec = __m256;
using Mask = __m256i;  // a lane mask: all ones or all zeros per 32-bit lane
using Bits = __m256i;  // 8 bf16 pairs (a 32-bit lane = elements 2i, 2i+1)

static inline Vec zero() { return _mm256_setzero_ps(); }
static inline Vec set1(float x) { return _mm256_set1_ps(x); }
static inline Vec add(Vec a, Vec b) { return _mm256_add_ps(a, b); }
static inline Vec sub(Vec a, Vec b) { return _mm256_sub_ps(a, b); }
static inline Vec mul(Vec a, Vec b) { return _mm256_mul_ps(a, b); }
static inline Vec div(Vec a, Vec b) { return _mm256_div_ps(a, b); }
static inline Vec max(Vec a, Vec b) { return _mm256_max_ps(a, b); }
static inline Vec fma(Vec a, Vec b, Vec acc) { return _mm256_fmadd_ps(a, b, acc); }  // a * b + acc, one rounding
static inline Vec fnma(Vec a, Vec b, Vec c) { return _mm256_fnmadd_ps(a, b, c); }     // c - a * b, one rounding
// A store that bypasses the caches (p aligned to the vector), for lines written and not read back soon; a kernel
// that streams calls stream_fence() before its caller's threads join.
static inline void stream(float* p, Vec x) { _mm256_stream_ps(p, x); }
static inline void stream_fence() { _mm_sfence(); }

// ---- loads and stores --------------------------------------------------------------------------------------------

// The lane mask of the first n lanes (0 <= n <= 8), for maskload / maskstore and select.
static inline Mask first_lanes(int n) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

// yes where the mask's lane is set, else no.
static inline Vec select(Mask m, Vec yes, Vec no) { return _mm256_blendv_ps(no, yes, _mm256_castsi256_ps(m)); }

// Pulls the cache line at p into L2 (not L1, which the read-out's rows ahead would fill: see
// label_logprobs/logits_simd.h's kPrefetchRows); a hint, never a fault.
static inline void prefetch(const void* p) { _mm_prefetch(static_cast<const char*>(p), _MM_HINT_T1); }

// 8 bf16 (in an xmm) -> 8 fp32, exact.
static inline Vec widen_bf16(__m128i h) { return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16)); }

static inline Vec load(const float* p) { return _mm256_loadu_ps(p); }
static inline Vec load(const uint16_t* p) { return widen_bf16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }

// The first n elements (0 <= n <= 8), the other lanes 0; never reads past p + n.
static inline Vec load_first(const float* p, int n) { return _mm256_maskload_ps(p, first_lanes(n)); }
static inline Vec load_first(const uint16_t* p, int n) {
  alignas(16) uint16_t buf[8] = {};
  std::memcpy(buf, p, size_t(n) * sizeof(uint16_t));
  return widen_bf16(_mm_load_si128(reinterpret_cast<const __m128i*>(buf)));
}

// Round to nearest even to bf16 as torch does, on the fp32 bits: add 0x7FFF plus the lowest kept bit (the bf16 sits
// in the high halves afterwards). Denormals round to bf16 denormals; NaNs that arithmetic or bf16 inputs produce
// stay NaN (see vec_math_avx512.h's round_bf16_bits, the same arithmetic).
static inline __m256i round_bf16_bits(Vec x) {
  const __m256i bits = _mm256_castps_si256(x);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  return _mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF)));
}

// 8 fp32 -> 8 bf16 in an xmm, rounded as above.
static inline __m128i narrow_bf16(Vec x) {
  const __m256i hi = _mm256_srli_epi32(round_bf16_bits(x), 16);  // 0..0xFFFF per dword: packus keeps it exactly
  return _mm_packus_epi32(_mm256_castsi256_si128(hi), _mm256_extracti128_si256(hi, 1));
}

static inline void store(float* p, Vec x) { _mm256_storeu_ps(p, x); }
static inline void store(uint16_t* p, Vec x) { _mm_storeu_si128(reinterpret_cast<__m128i*>(p), narrow_bf16(x)); }

// Two vectors a, b stored as 16 consecutive elements (b after a), rounded as store: for bf16 one pack and one
// permute for both (vec_avx512.h's store2 names the same operation).
static inline void store2(float* p, Vec a, Vec b) {
  _mm256_storeu_ps(p, a);
  _mm256_storeu_ps(p + kLanes, b);
}
static inline void store2(uint16_t* p, Vec a, Vec b) {
  const __m256i lanes = _mm256_packus_epi32(_mm256_srli_epi32(round_bf16_bits(a), 16),
                                            _mm256_srli_epi32(round_bf16_bits(b), 16));  // a0-3 b0-3 | a4-7 b4-7
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm256_permute4x64_epi64(lanes, 0xD8));
}

// Stores the first n lanes (0 <= n <= 8); never writes past p + n.
static inline void store_first(float* p, Vec x, int n) { _mm256_maskstore_ps(p, first_lanes(n), x); }
static inline void store_first(uint16_t* p, Vec x, int n) {
  alignas(16) uint16_t buf[8];
  _mm_store_si128(reinterpret_cast<__m128i*>(buf), narrow_bf16(x));
  std::memcpy(p, buf, size_t(n) * sizeof(uint16_t));
}

#include "common/vec_ragged.inc"  // load_n, store_n

// x rounded to the element type and held as fp32: what a store and a reload would give (the pointer only selects).
static inline Vec round_as(Vec x, const float*) { return x; }
static inline Vec round_as(Vec x, const uint16_t*) {
  return _mm256_castsi256_ps(_mm256_and_si256(round_bf16_bits(x), _mm256_set1_epi32(int(0xFFFF0000u))));
}

// ---- bf16 pairs (a dword = elements 2i, 2i+1) widened to fp32 ---------------------------------------------------

static inline Vec bf16_even(Bits pairs) { return _mm256_castsi256_ps(_mm256_slli_epi32(pairs, 16)); }
static inline Vec bf16_odd(Bits pairs) {
  return _mm256_castsi256_ps(_mm256_and_si256(pairs, _mm256_set1_epi32(int(0xFFFF0000u))));
}
static inline Bits load_bits(const void* p) { return _mm256_loadu_si256(static_cast<const __m256i*>(p)); }
// bf16_odd with its mask read from memory at each use (a vpand memory operand), not held in a register: in a tile
// that fills the 16 registers (linear's 6 x 2 with two widened vectors and a broadcast) the mask's register is the
// one that would spill an accumulator.
alignas(32) inline const uint32_t kBf16OddMask[8] = {0xFFFF0000u, 0xFFFF0000u, 0xFFFF0000u, 0xFFFF0000u,
                                                     0xFFFF0000u, 0xFFFF0000u, 0xFFFF0000u, 0xFFFF0000u};
static inline Vec bf16_odd_lean(Bits pairs) {
  return _mm256_castsi256_ps(_mm256_and_si256(pairs, load_bits(opaque(kBf16OddMask))));
}
// Registers linear's widened bf16 steps need beside a tile and its widened weight vectors (the broadcast and one
// GCC takes; bf16_odd_lean's mask is a memory operand).
constexpr int kWidenSpareRegisters = 2;
// acc + a_odd * b_odd + a_even * b_even per lane: vdpbf16ps's order and bits on normal numbers.
static inline Vec dot_pairs(Vec acc, Bits a, Bits b) {
  return fma(bf16_even(a), bf16_even(b), fma(bf16_odd(a), bf16_odd(b), acc));
}

// The 4-byte unit at p (a bf16 pair) in every lane: the broadcast operand of dot_pairs.
static inline Bits set1_pair(const uint16_t* p) {
  int32_t pair;
  std::memcpy(&pair, p, sizeof(pair));
  return _mm256_set1_epi32(pair);
}

// ---- int8 quads (linear's int8 weights: linear/linear.h) -----------------------------------------------------------
// Sums in int32 lanes of Bits (zero_bits, load_bits, store_bits). dot_quads adds to each 32-bit lane the four
// products of x's 4 code bytes (the broadcast operand) with the lane's 4 weight bytes, exactly: vpmaddubsw of |x| and
// w with x's sign, whose pair sums (at most 2 * 127 * 127 = 32258) never saturate 16 bits, then vpmaddwd by ones. x
// codes are signed here (kInt8XOffset 0; the AVX-512 layer's are offset).
constexpr bool kInt8DotIsVnni = false;  // dot_quads needs no VNNI (true: vpdpbusd, only where cpu_int8_vnni())
// What dot_quads needs beside a tile and its weights: the broadcast, |x|, the ones, the products (at 4, a 4-row x
// 2-vector tile spilled three registers a step: tests/ops/test_register_tiles.py).
constexpr int kInt8SpareRegisters = 7;
constexpr int32_t kInt8XOffset = 0;
static inline Bits dot_quads(Bits acc, Bits x, Bits w) {
  const __m256i pairs = _mm256_maddubs_epi16(_mm256_abs_epi8(x), _mm256_sign_epi8(w, x));
  return _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
}
static inline Bits zero_bits() { return _mm256_setzero_si256(); }
static inline void store_bits(void* p, Bits v) { _mm256_storeu_si256(static_cast<__m256i*>(p), v); }
// The 4-byte unit at p in every lane, as set1_pair's broadcast: dot_quads' x operand.
static inline Bits set1_quad(const uint8_t* p) { return set1_pair(reinterpret_cast<const uint16_t*>(p)); }
// acc's int32 lanes in fp32, rounded to nearest even (a group's sums are exact in fp32: linear.h's kInt8MaxGroup).
static inline Vec bits_to_f32(Bits acc) { return _mm256_cvtepi32_ps(acc); }
// The first n lanes of x as codes at p: round half to even, clamped to [-127, 127] (plus kInt8XOffset), a byte each.
static inline void store_codes(uint8_t* p, Vec x, int n) {
  __m256i q = _mm256_cvtps_epi32(x);  // the MXCSR's rounding: nearest even
  q = _mm256_min_epi32(_mm256_max_epi32(q, _mm256_set1_epi32(-127)), _mm256_set1_epi32(127));
  const __m256i w16 = _mm256_packs_epi32(q, q);        // 128-bit lanes: q0-3 q0-3 | q4-7 q4-7
  const __m256i b8 = _mm256_packs_epi16(w16, w16);     // bytes: q0-3 (x4) | q4-7 (x4)
  const uint64_t bytes = uint32_t(_mm256_extract_epi32(b8, 0)) | uint64_t(uint32_t(_mm256_extract_epi32(b8, 4))) << 32;
  std::memcpy(p, &bytes, size_t(n));
}
static inline Vec abs(Vec x) { return _mm256_and_ps(x, _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF))); }

// out[2i] = a[i], out[2i + 1] = b[i] for i < kZipDims (two rows of 8 bf16 interleaved into 8 pairs); a null row
// reads as zeros.
constexpr int kZipDims = 8;
static inline void store_zip(uint16_t* out, const uint16_t* a, const uint16_t* b) {
  const __m128i x = a ? _mm_loadu_si128(reinterpret_cast<const __m128i*>(a)) : _mm_setzero_si128();
  const __m128i y = b ? _mm_loadu_si128(reinterpret_cast<const __m128i*>(b)) : _mm_setzero_si128();
  _mm_storeu_si128(reinterpret_cast<__m128i*>(out), _mm_unpacklo_epi16(x, y));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(out + 8), _mm_unpackhi_epi16(x, y));
}

// p[2i] = even[i], p[2i + 1] = odd[i]: 2 * kLanes fp32 (a pair split by bf16_even / bf16_odd, back in element order).
static inline void store_interleaved(float* p, Vec even, Vec odd) {
  const Vec lo = _mm256_unpacklo_ps(even, odd), hi = _mm256_unpackhi_ps(even, odd);  // e0 o0 e1 o1 | e4 o4 e5 o5; ...
  _mm256_storeu_ps(p, _mm256_permute2f128_ps(lo, hi, 0x20));
  _mm256_storeu_ps(p + kLanes, _mm256_permute2f128_ps(lo, hi, 0x31));
}

// ---- reductions --------------------------------------------------------------------------------------------------

// Lane j of the result = the sum of the 8 lanes of a[j] (a transpose and add of 8 vectors by hadd; not
// reduce_add's order).
static inline Vec transpose_sum(const Vec (&a)[kLanes]) {
  const Vec t0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
  const Vec t1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(t0, t1, 0x20), _mm256_permute2f128_ps(t0, t1, 0x31));
}

static inline float reduce_add(Vec x) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// out[i] = the sum of the lanes of a_i.
static inline void reduce_add4(Vec a0, Vec a1, Vec a2, Vec a3, float* out) {
  const Vec t = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
  _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1)));
}

static inline float reduce_max(Vec x) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  s = _mm_max_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// ---- exponentials ------------------------------------------------------------------------------------------------

// 2^n for integer-valued n in [-127, 127] (n = -127 gives 0: exponent field 0 with a zero mantissa).
static inline Vec pow2i(Vec n) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23));
}

// 2^x for x <= 0 (softmax arguments), ~1 ulp: x = n + f, n = round(x), 2^f by its degree-7 Taylor polynomial, times
// 2^n built in the exponent field. Lanes below -126 (and -inf) give 0 without ever forming a denormal (an Intel core
// takes a microcode assist per vector that does): their 2^n factor is zeroed before the multiply. The same formula
// and coefficients as avx512::exp2_ps, so the same bits lane by lane.
static inline Vec exp2_ps(Vec x) {
  const Vec normal = _mm256_cmp_ps(x, _mm256_set1_ps(-126.0f), _CMP_GE_OQ);
  x = _mm256_max_ps(x, _mm256_set1_ps(-127.0f));  // keeps -inf out of the arithmetic
  const Vec n = _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const Vec f = _mm256_sub_ps(x, n);  // exact
  Vec p = _mm256_set1_ps(1.5252734e-05f);
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.5403530e-04f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.3333558e-03f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(9.6181291e-03f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(5.5504109e-02f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(2.4022651e-01f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(6.9314718e-01f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f));
  return _mm256_mul_ps(p, _mm256_and_ps(pow2i(n), normal));
}

// e^x with full fp32 accuracy over the whole range (silu's exp, whose bf16-rounded result must land where torch's
// lands): avx512::exp_ps's Cody-Waite reduction and polynomial; 2^n (|n| up to 160) as two factors 2^(n/2) and
// 2^(n - n/2), each a normal number, so the product rounds once, as scalef does: overflow to +inf, underflow through
// the denormals to 0.
static inline Vec exp_ps(Vec x) {
  x = _mm256_min_ps(_mm256_set1_ps(100.0f), _mm256_max_ps(_mm256_set1_ps(-110.0f), x));  // NaN passes through
  const Vec n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  Vec r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145751953125f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.42860682030941723212e-6f), r);
  Vec p = _mm256_set1_ps(1.0f / 5040);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 720));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  const Vec half = _mm256_round_ps(_mm256_mul_ps(n, _mm256_set1_ps(0.5f)), _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  return _mm256_mul_ps(_mm256_mul_ps(p, pow2i(half)), pow2i(_mm256_sub_ps(n, half)));
}

}  // namespace avx2
}  // namespace pyscore
