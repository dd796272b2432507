// AVX-512 ops of the CPU decode_attention kernel (interface in decode_attention.h).
//
// Decode is a matrix-vector product per (sequence, kv head): the few GQA query rows against keys read straight from
// the cache (token-major rows, no packing: every key is read once per step). A chunk's keys (at most kDecodeChunk)
// go in three passes per row: the scores (keys in blocks of 16: per key one zmm of 16 lane-partial dot products,
// vdpbf16ps on bf16 pairs or FMA on fp32, reduced by a transposing add tree into one zmm of 16 scores; base 2) and
// their maximum; 2^(score - max) (exp2 without denormals) and their sum; then P.V, each value row widened to fp32
// in registers once for all the rows, whose accumulators stay in registers. The launcher merges chunks by lse.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "common/vec_math_avx512.h"
#include "decode_attention/decode_attention.h"

namespace pyscore {
namespace {

using namespace avx512;

constexpr int kKeysPerBlock = 16;
constexpr int kMaxRows = 16;  // GQA query rows per call; more are done in several calls
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// lane j of the result = the sum of the 16 lanes of a[j]: four levels of pairwise interleave-and-add.
inline __m512 reduce16(__m512 (&a)[16]) {
  __m512 b[8], c[4], d[2];
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

// Element traits: a query row spans QZ = D / kPerZmm zmm of its elements and is held for the dot products in
// QZ * kQRegs zmm (load_q); dot() adds q . (one key row) lane-partially. kWholeBlocks: scores() takes a block of 16
// keys without a per-key check (see there).
template <class T, int QZ>
inline void load_q_as_is(const T* q, __m512 (&qz)[QZ]) {
  for (int c = 0; c < QZ; ++c) qz[c] = _mm512_loadu_ps(q + 64 / sizeof(T) * c);
}

struct Bf16 {
  using T = uint16_t;
  static constexpr int kPerZmm = 32;  // vdpbf16ps on pairs
  static constexpr int kQRegs = 1;
  static constexpr bool kWholeBlocks = true;
  template <int QZ>
  static void load_q(const T* q, __m512 (&qz)[QZ]) { load_q_as_is<T, QZ>(q, qz); }
  template <int QZ>
  static __m512 dot(const __m512 (&qz)[QZ], const T* k) {
    __m512 acc = _mm512_setzero_ps();
    for (int c = 0; c < QZ; ++c)
      acc = _mm512_dpbf16_ps(acc, (__m512bh)qz[c], (__m512bh)_mm512_loadu_si512(k + kPerZmm * c));
    return acc;
  }
  // A value row [16 * DZ] in fp32, each 32 elements as two zmm: the even elements, then the odd ones (a bf16 pair
  // widened by a shift and a mask: no shuffle, which vpmovzxwd would spend per 16 elements on the shuffle port the
  // FMAs share). The accumulators keep this order; store_scaled() interleaves them back.
  template <int DZ>
  static void values(const T* v, __m512 (&vz)[DZ]) {
    for (int c = 0; c < DZ / 2; ++c) {
      const __m512i x = _mm512_loadu_si512(v + 32 * c);
      vz[2 * c] = _mm512_castsi512_ps(_mm512_slli_epi32(x, 16));
      vz[2 * c + 1] = _mm512_castsi512_ps(_mm512_and_si512(x, _mm512_set1_epi32(int32_t(0xFFFF0000u))));
    }
  }
  // o[0, 16 * DZ) = inv * acc, acc in values()' order.
  template <int DZ>
  static void store_scaled(float* o, const __m512 (&acc)[DZ], __m512 inv) {
    const __m512i lo = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
    const __m512i hi = _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
    for (int c = 0; c < DZ / 2; ++c) {
      const __m512 even = _mm512_mul_ps(inv, acc[2 * c]), odd = _mm512_mul_ps(inv, acc[2 * c + 1]);
      _mm512_storeu_ps(o + 32 * c, _mm512_permutex2var_ps(even, lo, odd));
      _mm512_storeu_ps(o + 32 * c + 16, _mm512_permutex2var_ps(even, hi, odd));
    }
  }
  static void store(T* dst, __m512 x) { store_bf16_ps(dst, x); }
};

// bf16 pairs widened to fp32 in registers, two FMAs per pair in vdpbf16ps's order (odd element first): Bf16::dot's
// sums bitwise on normal numbers, with no BF16 instruction (tier avx512 runs it; Bf16Dot::kWiden). The query row is
// held widened (each zmm of pairs as its even and its odd elements), so a key zmm costs a load, a shift, a mask and
// two FMAs. Values and stores as Bf16's, the output rounded as torch rounds (no vcvtneps2bf16).
struct Bf16Widen : Bf16 {
  static constexpr int kQRegs = 2;
  template <int QZ2>
  static void load_q(const T* q, __m512 (&qz)[QZ2]) {
    for (int c = 0; c < QZ2 / 2; ++c) {
      const __m512i x = _mm512_loadu_si512(q + kPerZmm * c);
      qz[2 * c] = bf16_even_ps(x);
      qz[2 * c + 1] = bf16_odd_ps(x);
    }
  }
  template <int QZ2>
  static __m512 dot(const __m512 (&qz)[QZ2], const T* k) {
    __m512 acc = _mm512_setzero_ps();
    for (int c = 0; c < QZ2 / 2; ++c) {
      const __m512i x = _mm512_loadu_si512(k + kPerZmm * c);
      acc = dot2_widened_ps(acc, qz[2 * c], qz[2 * c + 1], bf16_even_ps(x), bf16_odd_ps(x));
    }
    return acc;
  }
  static void store(T* dst, __m512 x) { store_bf16_exact_ps(dst, x); }
};

struct F32 {
  using T = float;
  static constexpr int kPerZmm = 16;
  static constexpr int kQRegs = 1;
  static constexpr bool kWholeBlocks = false;  // at head_dim 128 the unchecked form spills
  template <int QZ>
  static void load_q(const T* q, __m512 (&qz)[QZ]) { load_q_as_is<T, QZ>(q, qz); }
  template <int QZ>
  static __m512 dot(const __m512 (&qz)[QZ], const T* k) {
    __m512 acc = _mm512_setzero_ps();
    for (int c = 0; c < QZ; ++c) acc = _mm512_fmadd_ps(qz[c], _mm512_loadu_ps(k + kPerZmm * c), acc);
    return acc;
  }
  template <int DZ>
  static void values(const T* v, __m512 (&vz)[DZ]) {
    for (int c = 0; c < DZ; ++c) vz[c] = _mm512_loadu_ps(v + 16 * c);
  }
  template <int DZ>
  static void store_scaled(float* o, const __m512 (&acc)[DZ], __m512 inv) {
    for (int c = 0; c < DZ; ++c) _mm512_storeu_ps(o + 16 * c, _mm512_mul_ps(inv, acc[c]));
  }
  static void store(T* dst, __m512 x) { _mm512_storeu_ps(dst, x); }
};

// Row r's base-2 scores over the chunk's keys into s (invalid lanes of the last block -inf); returns their maximum.
template <class E, int DZ>
float scores(const typename E::T* q, const void* const* k_tiles, int64_t token_stride, int32_t num_keys,
             float scale2, float* s) {
  using T = typename E::T;
  constexpr int QZ = 16 * DZ / E::kPerZmm * E::kQRegs;
  __m512 qz[QZ];
  E::load_q(q, qz);
  __m512 m = _mm512_set1_ps(kNegInf);
  for (int32_t key0 = 0; key0 < num_keys; key0 += kKeysPerBlock) {
    const int n = std::min<int32_t>(kKeysPerBlock, num_keys - key0);
    const __mmask16 valid = n >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << n) - 1);
    const T* k = static_cast<const T*>(k_tiles[key0 / kCpuKeyTile]) + (key0 % kCpuKeyTile) * token_stride;
    __m512 partial[kKeysPerBlock];
    if (E::kWholeBlocks && n == kKeysPerBlock) {
      // bf16, a whole block: no per-key check. With it GCC sent some key rows through a stack slot on their way to
      // vdpbf16ps (a store and a reload per key; 8 sequences 0.31-0.38 vs 0.35-0.46 ms without:
      // bench/results/tiers/kernels/decode_attention_avx512_ab.txt); fp32 at head_dim 128 spills in this form, so keeps the
      // other.
      const T* kj = k;
      for (int j = 0; j < kKeysPerBlock; ++j, kj += token_stride) partial[j] = E::dot(qz, kj);
    } else {
      for (int j = 0; j < kKeysPerBlock; ++j)
        partial[j] = j < n ? E::dot(qz, k + j * token_stride) : _mm512_setzero_ps();
    }
    const __m512 sz = _mm512_mask_mul_ps(_mm512_set1_ps(kNegInf), valid, reduce16(partial), _mm512_set1_ps(scale2));
    _mm512_store_ps(s + key0, sz);
    m = _mm512_max_ps(m, sz);
  }
  return _mm512_reduce_max_ps(m);  // finite: the chunk has a key
}

// s (base-2 scores) -> 2^(s - max) in place; returns their sum.
inline float exponentials(float* s, int32_t num_keys, float max) {
  const __m512 mz = _mm512_set1_ps(max);
  __m512 sum = _mm512_setzero_ps();
  for (int32_t key0 = 0; key0 < num_keys; key0 += kKeysPerBlock) {
    const __m512 pz = exp2_ps(_mm512_sub_ps(_mm512_load_ps(s + key0), mz));  // -inf lanes: 0
    _mm512_store_ps(s + key0, pz);
    sum = _mm512_add_ps(sum, pz);
  }
  return _mm512_reduce_add_ps(sum);  // >= 1: the maximum key contributes 2^0
}

// o[g] = sum_j p[g][j] v_j / sum[g] for G rows: each value row is widened once into registers and met by every row,
// whose G x DZ accumulators stay in registers over the chunk (G x DZ independent FMA chains).
template <class E, int DZ, int G>
void weighted_values(const float* p, const void* const* v_tiles, int64_t token_stride, int32_t num_keys,
                     const float* sum, float* o) {
  using T = typename E::T;
  constexpr int D = 16 * DZ;
  __m512 acc[G][DZ];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < DZ; ++c) acc[g][c] = _mm512_setzero_ps();
  for (int32_t key0 = 0; key0 < num_keys; key0 += kKeysPerBlock) {
    const int n = std::min<int32_t>(kKeysPerBlock, num_keys - key0);
    const T* v = static_cast<const T*>(v_tiles[key0 / kCpuKeyTile]) + (key0 % kCpuKeyTile) * token_stride;
    for (int j = 0; j < n; ++j) {
      __m512 vz[DZ];
      E::values(v + j * token_stride, vz);
      for (int g = 0; g < G; ++g) {
        const __m512 pj = _mm512_set1_ps(p[g * kDecodeChunk + key0 + j]);
        for (int c = 0; c < DZ; ++c) acc[g][c] = _mm512_fmadd_ps(pj, vz[c], acc[g][c]);
      }
    }
  }
  for (int g = 0; g < G; ++g) E::store_scaled(o + g * D, acc[g], _mm512_set1_ps(1.0f / sum[g]));
}

// weighted_values for g <= G rows, G a compile-time count (the accumulators stay in registers).
template <class E, int DZ, int G>
void weighted_values_upto(int32_t g, const float* p, const void* const* v_tiles, int64_t token_stride,
                          int32_t num_keys, const float* sum, float* o) {
  if constexpr (G > 1) {
    if (g < G) return weighted_values_upto<E, DZ, G - 1>(g, p, v_tiles, token_stride, num_keys, sum, o);
  }
  weighted_values<E, DZ, G>(p, v_tiles, token_stride, num_keys, sum, o);
}

// Rows in groups of at most kGroup (DZ accumulators each, beside DZ widened values, in 32 zmm).
template <class E, int DZ>
void weighted_values_rows(const float* p, int32_t rows, const void* const* v_tiles, int64_t token_stride,
                          int32_t num_keys, const float* sum, float* o) {
  constexpr int kGroup = DZ <= 4 ? 4 : 2, D = 16 * DZ;
  for (int32_t r = 0; r < rows; r += kGroup)
    weighted_values_upto<E, DZ, kGroup>(std::min<int32_t>(kGroup, rows - r), p + int64_t(r) * kDecodeChunk,
                                        v_tiles, token_stride, num_keys, sum + r, o + r * D);
}

// A chunk (at most kDecodeChunk keys) in three passes per row instead of an online softmax per key block: the
// scores and their maximum, the exponentials and their sum, then P.V. The online form chained every block's
// reduce, max, exp and rescale through one row's running state (latency-bound: ~31 ns a key and kv head with its
// L2-resident keys on the Xeon); here only the reductions at a pass's end are serial.
template <class E, int DZ>
void attend(const void* q_, int64_t q_row_stride, int32_t rows, const void* const* k_tiles,
            const void* const* v_tiles, int64_t token_stride, int32_t num_keys, int32_t head_dim, float scale, float* o,
            float* lse) {
  using T = typename E::T;
  static_assert(kCpuKeyTile % kKeysPerBlock == 0, "a block of keys never straddles two tiles (pages)");
  static_assert(kDecodeChunk % kKeysPerBlock == 0, "whole blocks of scores");
  const T* q = static_cast<const T*>(q_);
  alignas(64) float p[kMaxRows * kDecodeChunk];  // the rows' scores, then their exponentials
  float sum[kMaxRows];
  for (int r = 0; r < rows; ++r) {
    float* pr = p + r * kDecodeChunk;
    const float max = scores<E, DZ>(q + r * q_row_stride, k_tiles, token_stride, num_keys, scale * kLog2e, pr);
    sum[r] = exponentials(pr, num_keys, max);
    lse[r] = max * kLn2 + std::log(sum[r]);
  }
  weighted_values_rows<E, DZ>(p, rows, v_tiles, token_stride, num_keys, sum, o);
  (void)head_dim;
}

// More rows than kMaxRows in consecutive calls of up to kMaxRows.
template <class E, int DZ>
void attend_rows(const void* q, int64_t q_row_stride, int32_t rows, const void* const* k, const void* const* v,
                 int64_t token_stride, int32_t num_keys, int32_t head_dim, float scale, float* o, float* lse) {
  using T = typename E::T;
  for (int32_t r = 0; r < rows; r += kMaxRows)
    attend<E, DZ>(static_cast<const T*>(q) + r * q_row_stride, q_row_stride, std::min(kMaxRows, rows - r), k, v,
                  token_stride, num_keys, head_dim, scale, o + int64_t(r) * 16 * DZ, lse + r);
}

template <class E>
void store_row(const float* src, int32_t dim, void* dst_) {
  auto* dst = static_cast<typename E::T*>(dst_);
  for (int32_t d = 0; d < dim; d += 16) E::store(dst + d, _mm512_loadu_ps(src + d));
}

const DecodeCpuOps kBf16D64{attend_rows<Bf16, 4>, store_row<Bf16>};
const DecodeCpuOps kBf16D128{attend_rows<Bf16, 8>, store_row<Bf16>};
const DecodeCpuOps kBf16WidenD64{attend_rows<Bf16Widen, 4>, store_row<Bf16Widen>};
const DecodeCpuOps kBf16WidenD128{attend_rows<Bf16Widen, 8>, store_row<Bf16Widen>};
const DecodeCpuOps kF32D64{attend_rows<F32, 4>, store_row<F32>};
const DecodeCpuOps kF32D128{attend_rows<F32, 8>, store_row<F32>};

}  // namespace

const DecodeCpuOps* PYSCORE_ENTRY(decode_ops, avx512)(const KernelKey& key) {
  const int32_t head_dim = key.head_dim;
  if (head_dim != 64 && head_dim != 128) return nullptr;
  if (key.dtype == DType::kBFloat16 && key.bf16_dot == Bf16Dot::kWiden)
    return head_dim == 64 ? &kBf16WidenD64 : &kBf16WidenD128;
  if (key.dtype == DType::kBFloat16) return head_dim == 64 ? &kBf16D64 : &kBf16D128;
  if (key.dtype == DType::kFloat32) return head_dim == 64 ? &kF32D64 : &kF32D128;
  return nullptr;
}

}  // namespace pyscore
