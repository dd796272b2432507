// The NEON back-end of the CPU vector layer: the names and contracts of the AVX2 layer (common/vec_avx2.h: an fp32
// vector, lane masks and select, loads and stores from fp32 or bf16, bf16 pairs, multiply-add, max, exp, reductions,
// prefetch) on aarch64's Advanced SIMD, 4 lanes, so one kernel text compiles for both (vLLM's
// csrc/cpu/cpu_types_arm.hpp is the same idea): prefix_item_attention/attention_simd.h and
// label_logprobs/logits_simd.h are, compiled once per layer by their *_avx2.cpp and *_neon.cpp. The `neon` tier's
// other kernels are the portable ones, which -O3 vectorizes for NEON (common/vec_portable.h).
//
// Same bits as the x86 layers where their contract is exact: exp2_ps and exp_ps are the same formulas with the same
// coefficients, one fused multiply-add per step (vfmaq_f32 = _mm256_fmadd_ps), rounding to nearest even (vrndnq_f32);
// bf16 rounding is the same integer arithmetic; max and min keep x86's rule (the second operand when either is NaN),
// not fmaxnm's, so a NaN clamps exactly as on x86. Files built on this layer need -ffp-contract=off as the AVX2 ones
// do: GCC fuses a NEON multiply and add intrinsic otherwise.
//
// Everything is `static inline` (see rms_portable.h). aarch64 only.
#pragma once
#if !defined(__aarch64__)
#error "common/vec_neon.h is the aarch64 vector layer"
#endif
#include <arm_neon.h>

#include <cstdint>
#include <cstring>

namespace pyscore {
namespace neon {

constexpr int kLanes = 4;
// What a kernel text sizes its register tiles by: 16, although AArch64 has 32 vector registers, because with tiles
// for 32 GCC keeps the label read-out's accumulators on the stack (tests/ops/test_register_tiles.py finds it).
constexpr int kRegisters = 16;
constexpr bool kHasBf16Dot = false;  // dot_pairs is two FMAs (BFDOT is not the baseline)
using Vec = float32x4_t;
using Mask = uint32x4_t;  // a lane mask: all ones or all zeros per lane
using Bits = uint32x4_t;  // 4 bf16 pairs (a 32-bit lane = elements 2i, 2i+1)

static inline Vec zero() { return vdupq_n_f32(0.0f); }
static inline Vec set1(float x) { return vdupq_n_f32(x); }
static inline Vec add(Vec a, Vec b) { return vaddq_f32(a, b); }
static inline Vec sub(Vec a, Vec b) { return vsubq_f32(a, b); }
static inline Vec mul(Vec a, Vec b) { return vmulq_f32(a, b); }
static inline Vec div(Vec a, Vec b) { return vdivq_f32(a, b); }
static inline Vec max(Vec a, Vec b) { return vbslq_f32(vcgtq_f32(a, b), a, b); }  // a > b ? a : b, as maxps
static inline Vec min(Vec a, Vec b) { return vbslq_f32(vcltq_f32(a, b), a, b); }  // a < b ? a : b, as minps
static inline Vec fma(Vec a, Vec b, Vec acc) { return vfmaq_f32(acc, a, b); }    // a * b + acc, one rounding
static inline Vec fnma(Vec a, Vec b, Vec c) { return vfmsq_f32(c, a, b); }       // c - a * b, one rounding
// No cache-bypassing store of one vector here: a plain store (vec_avx2.h's stream contract holds trivially).
static inline void stream(float* p, Vec x) { vst1q_f32(p, x); }
static inline void stream_fence() {}

// ---- loads and stores --------------------------------------------------------------------------------------------

// The lane mask of the first n lanes (0 <= n <= 4).
static inline Mask first_lanes(int n) {
  static const uint32_t kIndex[4] = {0, 1, 2, 3};
  return vcltq_u32(vld1q_u32(kIndex), vdupq_n_u32(uint32_t(n)));
}

// yes where the mask's lane is set, else no.
static inline Vec select(Mask m, Vec yes, Vec no) { return vbslq_f32(m, yes, no); }

// Pulls the cache line at p into cache; a hint, never a fault.
static inline void prefetch(const void* p) { __builtin_prefetch(p); }

// 4 bf16 -> 4 fp32, exact.
static inline Vec widen_bf16(uint16x4_t h) { return vreinterpretq_f32_u32(vshll_n_u16(h, 16)); }

static inline Vec load(const float* p) { return vld1q_f32(p); }
static inline Vec load(const uint16_t* p) { return widen_bf16(vld1_u16(p)); }

// The first n elements (0 <= n <= 4), the other lanes 0; never reads past p + n. Lane by lane into a register: a
// stack buffer here (memcpy, or element copies) made GCC keep a calling kernel's whole register tile in memory, a
// store per multiply-add in its main loop (the label read-out's fp32 tile: tests/ops/test_register_tiles.py).
static inline Vec load_first(const float* p, int n) {
  Vec v = vdupq_n_f32(0.0f);
  if (n > 0) v = vsetq_lane_f32(p[0], v, 0);
  if (n > 1) v = vsetq_lane_f32(p[1], v, 1);
  if (n > 2) v = vsetq_lane_f32(p[2], v, 2);
  if (n > 3) v = vsetq_lane_f32(p[3], v, 3);
  return v;
}
static inline Vec load_first(const uint16_t* p, int n) {
  uint16x4_t h = vdup_n_u16(0);
  if (n > 0) h = vset_lane_u16(p[0], h, 0);
  if (n > 1) h = vset_lane_u16(p[1], h, 1);
  if (n > 2) h = vset_lane_u16(p[2], h, 2);
  if (n > 3) h = vset_lane_u16(p[3], h, 3);
  return widen_bf16(h);
}

// Round to nearest even to bf16 as torch does, on the fp32 bits: add 0x7FFF plus the lowest kept bit; the bf16 sits
// in the high halves afterwards (vec_avx2.h's round_bf16_bits, the same arithmetic).
static inline uint32x4_t round_bf16_bits(Vec x) {
  const uint32x4_t bits = vreinterpretq_u32_f32(x);
  const uint32x4_t lsb = vandq_u32(vshrq_n_u32(bits, 16), vdupq_n_u32(1));
  return vaddq_u32(bits, vaddq_u32(lsb, vdupq_n_u32(0x7FFF)));
}

// 4 fp32 -> 4 bf16, rounded as above.
static inline uint16x4_t narrow_bf16(Vec x) { return vshrn_n_u32(round_bf16_bits(x), 16); }

static inline void store(float* p, Vec x) { vst1q_f32(p, x); }
static inline void store(uint16_t* p, Vec x) { vst1_u16(p, narrow_bf16(x)); }

// Stores the first n lanes (0 <= n <= 4); never writes past p + n. Lane by lane from the register, as load_first.
static inline void store_first(float* p, Vec x, int n) {
  if (n > 0) vst1q_lane_f32(p, x, 0);
  if (n > 1) vst1q_lane_f32(p + 1, x, 1);
  if (n > 2) vst1q_lane_f32(p + 2, x, 2);
  if (n > 3) vst1q_lane_f32(p + 3, x, 3);
}
static inline void store_first(uint16_t* p, Vec x, int n) {
  const uint16x4_t h = narrow_bf16(x);
  if (n > 0) vst1_lane_u16(p, h, 0);
  if (n > 1) vst1_lane_u16(p + 1, h, 1);
  if (n > 2) vst1_lane_u16(p + 2, h, 2);
  if (n > 3) vst1_lane_u16(p + 3, h, 3);
}

#include "common/vec_ragged.inc"  // load_n, store_n

// x rounded to the element type and held as fp32: what a store and a reload would give (the pointer only selects).
static inline Vec round_as(Vec x, const float*) { return x; }
static inline Vec round_as(Vec x, const uint16_t*) {
  return vreinterpretq_f32_u32(vandq_u32(round_bf16_bits(x), vdupq_n_u32(0xFFFF0000u)));
}

// ---- bf16 pairs widened to fp32 ----------------------------------------------------------------------------------

static inline Vec bf16_even(Bits pairs) { return vreinterpretq_f32_u32(vshlq_n_u32(pairs, 16)); }
static inline Vec bf16_odd(Bits pairs) { return vreinterpretq_f32_u32(vandq_u32(pairs, vdupq_n_u32(0xFFFF0000u))); }
static inline Bits load_bits(const void* p) { return vld1q_u32(static_cast<const uint32_t*>(p)); }
// bf16_odd, for linear's widened steps: with 32 registers the mask stays in one.
static inline Vec bf16_odd_lean(Bits pairs) { return bf16_odd(pairs); }
// Registers linear's widened bf16 steps need beside a tile and its widened weight vectors: the broadcast, the mask,
// a temporary and two GCC takes once the tile is scalars.
constexpr int kWidenSpareRegisters = 5;
// acc + a_odd * b_odd + a_even * b_even per lane: vdpbf16ps's order and bits on normal numbers.
static inline Vec dot_pairs(Vec acc, Bits a, Bits b) {
  return fma(bf16_even(a), bf16_even(b), fma(bf16_odd(a), bf16_odd(b), acc));
}

// The 4-byte unit at p (a bf16 pair) in every lane: the broadcast operand of dot_pairs.
static inline Bits set1_pair(const uint16_t* p) {
  int32_t pair;
  std::memcpy(&pair, p, sizeof(pair));
  return vdupq_n_u32(uint32_t(pair));
}

// ---- int8 quads (linear's int8 weights: linear/linear.h; vec_avx2.h's names) --------------------------------------
// Sums in int32 lanes of Bits (zero_bits, load_bits, store_bits). dot_quads adds to each 32-bit lane the four products of x's 4 code
// bytes (broadcast) with the lane's 4 weight bytes, exactly: widening multiplies, pairwise adds in 16 bits (at most
// 2 * 127 * 127), then a pairwise add-accumulate into 32 bits (SDOT is not the ARMv8.0 baseline). Codes signed.
constexpr bool kInt8DotIsVnni = false;  // dot_quads needs no VNNI (true: vpdpbusd, only where cpu_int8_vnni())
constexpr int kInt8SpareRegisters = 4;  // what dot_quads needs beside a tile and its weights: the broadcast and the widened products
constexpr int32_t kInt8XOffset = 0;
static inline Bits dot_quads(Bits acc, Bits x, Bits w) {
  const int8x16_t a = vreinterpretq_s8_u32(x), b = vreinterpretq_s8_u32(w);
  const int16x8_t pairs = vpaddq_s16(vmull_s8(vget_low_s8(a), vget_low_s8(b)), vmull_high_s8(a, b));
  return vreinterpretq_u32_s32(vpadalq_s16(vreinterpretq_s32_u32(acc), pairs));
}
static inline Bits zero_bits() { return vdupq_n_u32(0); }
static inline void store_bits(void* p, Bits v) { vst1q_u32(static_cast<uint32_t*>(p), v); }
// The 4-byte unit at p in every lane, as set1_pair's broadcast: dot_quads' x operand.
static inline Bits set1_quad(const uint8_t* p) { return set1_pair(reinterpret_cast<const uint16_t*>(p)); }
// acc's int32 lanes in fp32, rounded to nearest even (a group's sums are exact in fp32: linear.h's kInt8MaxGroup).
static inline Vec bits_to_f32(Bits acc) { return vcvtq_f32_s32(vreinterpretq_s32_u32(acc)); }
// The first n lanes of x as codes at p: round half to even, clamped to [-127, 127], a byte each.
static inline void store_codes(uint8_t* p, Vec x, int n) {
  const int32x4_t q = vminq_s32(vmaxq_s32(vcvtnq_s32_f32(x), vdupq_n_s32(-127)), vdupq_n_s32(127));
  const int16x4_t q16 = vmovn_s32(q);
  const int8x8_t q8 = vmovn_s16(vcombine_s16(q16, q16));
  uint8_t bytes[8];
  vst1_u8(bytes, vreinterpret_u8_s8(q8));
  std::memcpy(p, bytes, size_t(n));
}
static inline Vec abs(Vec x) { return vabsq_f32(x); }

// out[2i] = a[i], out[2i + 1] = b[i] for i < kZipDims (two rows of 8 bf16 interleaved into 8 pairs); a null row
// reads as zeros.
constexpr int kZipDims = 8;
static inline void store_zip(uint16_t* out, const uint16_t* a, const uint16_t* b) {
  const uint16x8_t x = a ? vld1q_u16(a) : vdupq_n_u16(0);
  const uint16x8_t y = b ? vld1q_u16(b) : vdupq_n_u16(0);
  vst1q_u16(out, vzip1q_u16(x, y));
  vst1q_u16(out + 8, vzip2q_u16(x, y));
}

// p[2i] = even[i], p[2i + 1] = odd[i]: 2 * kLanes fp32 (a pair split by bf16_even / bf16_odd, back in element
// order): one interleaving store.
static inline void store_interleaved(float* p, Vec even, Vec odd) { vst2q_f32(p, float32x4x2_t{{even, odd}}); }

// ---- reductions (pairwise: lanes i and i + 2 first, as the x86 layers fold halves) --------------------------------

// Lane j of the result = the sum of the 4 lanes of a[j] (a transpose and add of 4 vectors by pairwise adds).
static inline Vec transpose_sum(const Vec (&a)[kLanes]) {
  return vpaddq_f32(vpaddq_f32(a[0], a[1]), vpaddq_f32(a[2], a[3]));
}

static inline float reduce_add(Vec x) {
  const float32x2_t s = vadd_f32(vget_low_f32(x), vget_high_f32(x));
  return vget_lane_f32(s, 0) + vget_lane_f32(s, 1);
}

// out[i] = the sum of the lanes of a_i.
static inline void reduce_add4(Vec a0, Vec a1, Vec a2, Vec a3, float* out) {
  vst1q_f32(out, vpaddq_f32(vpaddq_f32(a0, a1), vpaddq_f32(a2, a3)));
}

static inline float reduce_max(Vec x) {
  const Vec s = max(x, vcombine_f32(vget_high_f32(x), vget_high_f32(x)));
  const float a = vgetq_lane_f32(s, 0), b = vgetq_lane_f32(s, 1);
  return a > b ? a : b;
}

// ---- exponentials (vec_avx2.h's formulas, step for step) ---------------------------------------------------------

// 2^n for integer-valued n in [-127, 127] (n = -127 gives 0).
static inline Vec pow2i(Vec n) {
  return vreinterpretq_f32_s32(vshlq_n_s32(vaddq_s32(vcvtnq_s32_f32(n), vdupq_n_s32(127)), 23));
}

// 2^x for x <= 0, ~1 ulp; lanes below -126 (and -inf) give 0 without ever forming a denormal.
static inline Vec exp2_ps(Vec x) {
  const uint32x4_t normal = vcgeq_f32(x, vdupq_n_f32(-126.0f));
  x = max(x, vdupq_n_f32(-127.0f));  // keeps -inf (and NaN, as on x86) out of the arithmetic
  const Vec n = vrndnq_f32(x);
  const Vec f = vsubq_f32(x, n);  // exact
  Vec p = vdupq_n_f32(1.5252734e-05f);
  p = vfmaq_f32(vdupq_n_f32(1.5403530e-04f), p, f);
  p = vfmaq_f32(vdupq_n_f32(1.3333558e-03f), p, f);
  p = vfmaq_f32(vdupq_n_f32(9.6181291e-03f), p, f);
  p = vfmaq_f32(vdupq_n_f32(5.5504109e-02f), p, f);
  p = vfmaq_f32(vdupq_n_f32(2.4022651e-01f), p, f);
  p = vfmaq_f32(vdupq_n_f32(6.9314718e-01f), p, f);
  p = vfmaq_f32(vdupq_n_f32(1.0f), p, f);
  return vmulq_f32(p, vreinterpretq_f32_u32(vandq_u32(vreinterpretq_u32_f32(pow2i(n)), normal)));
}

// e^x with full fp32 accuracy over the whole range: Cody-Waite reduction, degree-7 polynomial, 2^n as two normal
// factors so the product rounds once (overflow to +inf, underflow through the denormals to 0). NaN passes through.
static inline Vec exp_ps(Vec x) {
  x = min(vdupq_n_f32(100.0f), max(vdupq_n_f32(-110.0f), x));
  const Vec n = vrndnq_f32(vmulq_f32(x, vdupq_n_f32(1.44269504088896341f)));
  Vec r = vfmsq_f32(x, n, vdupq_n_f32(0.693145751953125f));
  r = vfmsq_f32(r, n, vdupq_n_f32(1.42860682030941723212e-6f));
  Vec p = vdupq_n_f32(1.0f / 5040);
  p = vfmaq_f32(vdupq_n_f32(1.0f / 720), p, r);
  p = vfmaq_f32(vdupq_n_f32(1.0f / 120), p, r);
  p = vfmaq_f32(vdupq_n_f32(1.0f / 24), p, r);
  p = vfmaq_f32(vdupq_n_f32(1.0f / 6), p, r);
  p = vfmaq_f32(vdupq_n_f32(0.5f), p, r);
  p = vfmaq_f32(vdupq_n_f32(1.0f), p, r);
  p = vfmaq_f32(vdupq_n_f32(1.0f), p, r);
  const Vec half = vrndmq_f32(vmulq_f32(n, vdupq_n_f32(0.5f)));
  return vmulq_f32(vmulq_f32(p, pow2i(half)), pow2i(vsubq_f32(n, half)));
}

}  // namespace neon
}  // namespace pyscore
