// AVX-512 ops of the CPU prefix_item_attention kernel (interface and packed layouts in prefix_item_attention.h).
//
// One register-blocked flash-attention tile serves every element type: bf16 works on pairs (Q.K^T with pairs along
// head_dim, P.V with pairs along keys, P rounded to bf16 as flash-attention does on GPUs), fp32 on single elements
// with fp32 P. Either way a zmm of K or V is 64 bytes and the broadcast operand is one 4-byte unit, so the same
// loops serve both. bf16 pairs are multiplied either by vdpbf16ps or by widening them to fp32 and two FMAs in
// vdpbf16ps's own order (Bf16Dot in common/cpu_features.h): the same bits, at the rate each CPU family runs best.
// Softmax is online, in base 2 (scores pre-multiplied by scale * log2(e)), with a vector exp2 accurate to ~1 ulp so
// the fp32 path matches the fp32 reference.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "common/vec_math_avx512.h"
#include "prefix_item_attention/prefix_item_attention.h"

namespace pyscore {
namespace {

using namespace avx512;

// 6 rows x 4 zmm (64 keys, or 64 dims of the output) accumulators + 4 operands + 1 broadcast <= 32 zmm.
constexpr int kTileRows = 6;
constexpr int kZmmPerTile = 4;
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// Element traits. T is the stored type of q, K, V and the output; B the broadcast operand of the tile's products
// (q rows in Q.K^T, P in P.V), one 4-byte unit (kPack elements) per step. step() adds, for TM rows, the product
// of row r's unit (b + r * b_stride) with the ZN zmm at `vec` into acc[r][0..ZN).
struct Bf16 {  // vdpbf16ps on bf16 pairs
  using T = uint16_t;
  using B = uint16_t;
  static constexpr int kPack = 2;
  template <int TM, int ZN>
  static void step(__m512 (&acc)[TM][ZN], const B* b, int64_t b_stride, const T* vec) {
    __m512 v[ZN];
    for (int z = 0; z < ZN; ++z) v[z] = _mm512_loadu_ps(vec + z * 16 * kPack);
    for (int r = 0; r < TM; ++r) {
      int32_t pair;
      std::memcpy(&pair, b + r * b_stride, sizeof(pair));
      const __m512bh bc = (__m512bh)_mm512_set1_epi32(pair);
      for (int z = 0; z < ZN; ++z) acc[r][z] = _mm512_dpbf16_ps(acc[r][z], bc, (__m512bh)v[z]);
    }
  }
  static const B* rows_as_b(const T* q, int32_t, int32_t) { return q; }
  static void store_p(B* dst, __m512 p) { store_bf16_ps(dst, p); }
  static void store(T* dst, __m512 x) { store_bf16_ps(dst, x); }
};

// bf16 pairs widened to fp32 in registers, two FMAs per pair in vdpbf16ps's order: bitwise Bf16's results on normal
// numbers. The broadcast side is fp32 (q converted once per call, P rounded to bf16 and kept as fp32), so each
// product is one FMA with an embedded broadcast; each K/V zmm is widened once for all TM rows.
struct Bf16Widen {
  using T = uint16_t;
  using B = float;
  static constexpr int kPack = 2;
  template <int TM, int ZN>
  static void step(__m512 (&acc)[TM][ZN], const B* b, int64_t b_stride, const T* vec) {
    for (int z = 0; z < ZN; ++z) {
      const __m512i v = _mm512_loadu_si512(vec + z * 16 * kPack);
      const __m512 even = bf16_even_ps(v), odd = bf16_odd_ps(v);
      const B* bz = opaque(b);  // broadcasts stay FMA memory operands instead of 2 TM registers (see opaque)
      for (int r = 0; r < TM; ++r)
        acc[r][z] = dot2_widened_ps(acc[r][z], _mm512_set1_ps(bz[r * b_stride]), _mm512_set1_ps(bz[r * b_stride + 1]),
                                    even, odd);
    }
  }
  // q rows [rows, D] as fp32 in a per-thread buffer (exact).
  static const B* rows_as_b(const T* q, int32_t rows, int32_t head_dim) {
    thread_local std::vector<float> qf;
    const int64_t n = int64_t(rows) * head_dim;
    if (int64_t(qf.size()) < n) qf.resize(n);
    for (int64_t i = 0; i < n; i += 16) _mm512_storeu_ps(qf.data() + i, load_bf16_ps(q + i));  // D % 64 == 0
    return qf.data();
  }
  // P rounded to bf16 and kept as fp32, in integer arithmetic: no BF16 instruction, so tier avx512 runs this path.
  // Bitwise Bf16::store_p's vcvtneps2bf16 on P, which is never denormal (exp2_ps flushes below 2^-126).
  static void store_p(B* dst, __m512 p) { _mm512_storeu_ps(dst, round_bf16_exact_ps(p)); }
  // The output rounded as torch rounds (vcvtneps2bf16 would also flush denormal outputs to zero).
  static void store(T* dst, __m512 x) { store_bf16_exact_ps(dst, x); }
};

struct F32 {
  using T = float;
  using B = float;
  static constexpr int kPack = 1;
  template <int TM, int ZN>
  static void step(__m512 (&acc)[TM][ZN], const B* b, int64_t b_stride, const T* vec) {
    __m512 v[ZN];
    for (int z = 0; z < ZN; ++z) v[z] = _mm512_loadu_ps(vec + z * 16);
    for (int r = 0; r < TM; ++r) {
      const __m512 bc = _mm512_set1_ps(b[r * b_stride]);
      for (int z = 0; z < ZN; ++z) acc[r][z] = _mm512_fmadd_ps(bc, v[z], acc[r][z]);
    }
  }
  static const B* rows_as_b(const T* q, int32_t, int32_t) { return q; }
  static void store_p(B* dst, __m512 p) { _mm512_storeu_ps(dst, p); }
  static void store(T* dst, __m512 x) { _mm512_storeu_ps(dst, x); }
};

// Lanes [0, count) of a 16-lane group, count clamped to [0, 16].
inline __mmask16 first_lanes(int count) {
  if (count >= 16) return 0xFFFF;
  return count <= 0 ? 0 : __mmask16((1u << count) - 1);
}

// ---- packing ---------------------------------------------------------------------------------------------

// K: for each block, step p and 16-key group, gather the p-th 4-byte unit of 16 key rows (the transpose that
// puts 16 keys in one zmm). Byte-granular gather offsets, so any token stride works.
template <class E>
void pack_k(const void* k, int64_t token_stride, int32_t n, int32_t head_dim, void* out) {
  const int64_t row_bytes = token_stride * int64_t(sizeof(typename E::T));
  const int steps = head_dim / E::kPack;
  const __m512i offsets = _mm512_mullo_epi32(
      _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15), _mm512_set1_epi32(int32_t(row_bytes)));
  auto* dst = static_cast<int32_t*>(out);
  const auto* src = static_cast<const char*>(k);
  for (int32_t b = 0; b < key_blocks(n); ++b) {
    for (int z = 0; z < kZmmPerTile; ++z) {
      const int32_t key0 = b * kKeyBlock + z * 16;
      const __mmask16 valid = first_lanes(n - key0);
      const char* rows = valid ? src + key0 * row_bytes : src;
      for (int p = 0; p < steps; ++p) {
        const __m512i x = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), valid, offsets, rows + 4 * p, 1);
        _mm512_storeu_si512(dst + (int64_t(b) * steps + p) * kKeyBlock + z * 16, x);
      }
    }
  }
}

// V, bf16: interleave keys 2j and 2j+1 element by element, 32 dims at a time.
void pack_v_bf16(const void* v, int64_t token_stride, int32_t n, int32_t head_dim, void* out) {
  auto* dst = static_cast<uint16_t*>(out);
  const auto* src = static_cast<const uint16_t*>(v);
  const __m512i lo = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8,
                                      39, 7, 38, 6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
  const __m512i hi = _mm512_add_epi16(lo, _mm512_set1_epi16(16));
  const int32_t pairs = key_blocks(n) * kKeyBlock / 2;
  for (int32_t j = 0; j < pairs; ++j) {
    const int32_t k0 = 2 * j, k1 = 2 * j + 1;
    uint16_t* step = dst + int64_t(j) * head_dim * 2;
    for (int d = 0; d < head_dim; d += 32) {
      const __m512i a = k0 < n ? _mm512_loadu_si512(src + k0 * token_stride + d) : _mm512_setzero_si512();
      const __m512i b = k1 < n ? _mm512_loadu_si512(src + k1 * token_stride + d) : _mm512_setzero_si512();
      _mm512_storeu_si512(step + 2 * d, _mm512_permutex2var_epi16(a, lo, b));
      _mm512_storeu_si512(step + 2 * d + 32, _mm512_permutex2var_epi16(a, hi, b));
    }
  }
}

// ---- the attention tile --------------------------------------------------------------------------------

// Per-row online-softmax state of one tile, padded to a zmm so the rescale factors are one vector exp.
struct alignas(64) SoftmaxState {
  float max[16];   // running max of the base-2 scores
  float sum[16];   // running sum of 2^(score - max)
  float alpha[16]; // rescale factor of this key block
};

// The first ZN zmm (16 keys each) of S = Q.K^T; the rest are left 0 (keys past the rows' limits, masked below).
template <class E, int TM, int ZN>
inline void scores_part(const typename E::B* q, int head_dim, const typename E::T* kblock,
                        __m512 (&s)[TM][kZmmPerTile]) {
  constexpr int P = E::kPack;
  __m512 part[TM][ZN];
  for (int r = 0; r < TM; ++r)
    for (int z = 0; z < ZN; ++z) part[r][z] = _mm512_setzero_ps();
  for (int p = 0; p < head_dim / P; ++p)
    E::template step<TM, ZN>(part, q + p * P, head_dim, kblock + p * kKeyBlock * P);
  for (int r = 0; r < TM; ++r)
    for (int z = 0; z < kZmmPerTile; ++z) s[r][z] = z < ZN ? part[r][z] : _mm512_setzero_ps();
}

// S = Q.K^T for TM rows x 64 keys of one key block, scaled to base 2, masked per row to keys < limit. Only the
// 16-key groups below the tile's key_end are multiplied (an item's own keys rarely fill a block).
template <class E, int TM>
inline void scores_block(const typename E::B* q, int head_dim, const typename E::T* kblock, const int* limit,
                         int key0, int key_end, float scale2, __m512 (&s)[TM][kZmmPerTile]) {
  switch (std::min(kZmmPerTile, (key_end - key0 + 15) / 16)) {
    case 1: scores_part<E, TM, 1>(q, head_dim, kblock, s); break;
    case 2: scores_part<E, TM, 2>(q, head_dim, kblock, s); break;
    case 3: scores_part<E, TM, 3>(q, head_dim, kblock, s); break;
    default: scores_part<E, TM, kZmmPerTile>(q, head_dim, kblock, s); break;
  }
  const __m512 neg_inf = _mm512_set1_ps(kNegInf), scale = _mm512_set1_ps(scale2);
  for (int r = 0; r < TM; ++r)
    for (int z = 0; z < kZmmPerTile; ++z)
      s[r][z] = _mm512_mask_mul_ps(neg_inf, first_lanes(limit[r] - key0 - 16 * z), s[r][z], scale);
}

// Online-softmax step: new row maxima, rescale factors, P = 2^(S - max) into pbuf (as the PV broadcast operand) and
// the running sums (from the unrounded P).
template <class E, int TM>
inline void softmax_block(__m512 (&s)[TM][kZmmPerTile], SoftmaxState& st, typename E::B (*pbuf)[kKeyBlock]) {
  alignas(64) float prev[16] = {}, ref[16] = {};
  for (int r = 0; r < TM; ++r) {
    __m512 mx = _mm512_max_ps(_mm512_max_ps(s[r][0], s[r][1]), _mm512_max_ps(s[r][2], s[r][3]));
    prev[r] = st.max[r];
    const float block_max = _mm512_reduce_max_ps(mx);
    if (block_max > st.max[r]) st.max[r] = block_max;
    // A row that has seen no key yet keeps max -inf; subtract 0 instead so 2^(-inf) stays 0, not NaN.
    ref[r] = st.max[r] == kNegInf ? 0.0f : st.max[r];
  }
  _mm512_store_ps(st.alpha, exp2_ps(_mm512_sub_ps(_mm512_load_ps(prev), _mm512_load_ps(ref))));
  for (int r = 0; r < TM; ++r) {
    const __m512 m = _mm512_set1_ps(ref[r]);
    __m512 sum = _mm512_setzero_ps();
    for (int z = 0; z < kZmmPerTile; ++z) {
      const __m512 p = exp2_ps(_mm512_sub_ps(s[r][z], m));
      sum = _mm512_add_ps(sum, p);
      E::store_p(pbuf[r] + 16 * z, p);
    }
    st.sum[r] = st.sum[r] * st.alpha[r] + _mm512_reduce_add_ps(sum);
  }
}

// O = alpha * O + P.V for TM rows, 64 output dims at a time; `pairs` = key steps of this block that matter.
template <class E, int TM>
inline void pv_block(const typename E::B (*pbuf)[kKeyBlock], const typename E::T* vblock, int pairs, int head_dim,
                     const SoftmaxState& st, float* o) {
  constexpr int P = E::kPack;
  for (int c = 0; c < head_dim; c += 16 * kZmmPerTile) {
    __m512 acc[TM][kZmmPerTile];
    for (int r = 0; r < TM; ++r) {
      const __m512 a = _mm512_set1_ps(st.alpha[r]);
      for (int z = 0; z < kZmmPerTile; ++z)
        acc[r][z] = _mm512_mul_ps(a, _mm512_loadu_ps(o + r * head_dim + c + 16 * z));
    }
    for (int j = 0; j < pairs; ++j)
      E::template step<TM, kZmmPerTile>(acc, pbuf[0] + j * P, kKeyBlock, vblock + (j * head_dim + c) * P);
    for (int r = 0; r < TM; ++r)
      for (int z = 0; z < kZmmPerTile; ++z) _mm512_storeu_ps(o + r * head_dim + c + 16 * z, acc[r][z]);
  }
}

// TM query rows (q: the broadcast form of their values) against a packed key range: flash-attention over key
// blocks up to the rows' largest limit.
template <class E, int TM>
void attend_tile(const typename E::B* q, const int32_t* limits, const typename E::T* k_packed,
                 const typename E::T* v_packed, int32_t num_keys, int32_t head_dim, float scale2, float* o,
                 float* lse) {
  int limit[TM];
  int key_end = 0;
  SoftmaxState st;
  for (int r = 0; r < TM; ++r) {
    limit[r] = limits ? std::min(limits[r], num_keys) : num_keys;
    key_end = std::max(key_end, limit[r]);
    st.max[r] = kNegInf;
    st.sum[r] = 0.0f;
    std::memset(o + r * head_dim, 0, head_dim * sizeof(float));
  }
  alignas(64) typename E::B pbuf[TM][kKeyBlock];
  for (int key0 = 0; key0 < key_end; key0 += kKeyBlock) {
    const int64_t block = int64_t(key0) * head_dim;  // both packed layouts hold kKeyBlock * D per block
    __m512 s[TM][kZmmPerTile];
    scores_block<E, TM>(q, head_dim, k_packed + block, limit, key0, key_end, scale2, s);
    softmax_block<E, TM>(s, st, pbuf);
    const int pairs = (std::min(kKeyBlock, key_end - key0) + E::kPack - 1) / E::kPack;
    pv_block<E, TM>(pbuf, v_packed + block, pairs, head_dim, st, o);
  }
  finish_softmax_rows(o, TM, head_dim, st.max, st.sum, lse);
}

template <class E>
void attend(const void* q_, int32_t rows, const int32_t* limits, const void* k_packed, const void* v_packed,
            int32_t num_keys, int32_t head_dim, float scale, float* o, float* lse) {
  using T = typename E::T;
  const typename E::B* q = E::rows_as_b(static_cast<const T*>(q_), rows, head_dim);
  const T* kp = static_cast<const T*>(k_packed);
  const T* vp = static_cast<const T*>(v_packed);
  const float scale2 = scale * kLog2e;
  int32_t r = 0;
  for (; r + kTileRows <= rows; r += kTileRows)
    attend_tile<E, kTileRows>(q + int64_t(r) * head_dim, limits ? limits + r : nullptr, kp, vp, num_keys,
                              head_dim, scale2, o + int64_t(r) * head_dim, lse + r);
  const typename E::B* qr = q + int64_t(r) * head_dim;
  const int32_t* lr = limits ? limits + r : nullptr;
  float* orow = o + int64_t(r) * head_dim;
  switch (rows - r) {
    case 1: attend_tile<E, 1>(qr, lr, kp, vp, num_keys, head_dim, scale2, orow, lse + r); break;
    case 2: attend_tile<E, 2>(qr, lr, kp, vp, num_keys, head_dim, scale2, orow, lse + r); break;
    case 3: attend_tile<E, 3>(qr, lr, kp, vp, num_keys, head_dim, scale2, orow, lse + r); break;
    case 4: attend_tile<E, 4>(qr, lr, kp, vp, num_keys, head_dim, scale2, orow, lse + r); break;
    case 5: attend_tile<E, 5>(qr, lr, kp, vp, num_keys, head_dim, scale2, orow, lse + r); break;
    default: break;
  }
}

template <class E>
void store_row(const float* src, int32_t dim, void* dst_) {
  auto* dst = static_cast<typename E::T*>(dst_);
  for (int32_t d = 0; d < dim; d += 16) E::store(dst + d, _mm512_loadu_ps(src + d));
}

const AttentionCpuOps kBf16Ops{pack_k<Bf16>, pack_v_bf16, attend<Bf16>, store_row<Bf16>};
const AttentionCpuOps kBf16WidenOps{pack_k<Bf16>, pack_v_bf16, attend<Bf16Widen>, store_row<Bf16Widen>};
const AttentionCpuOps kF32Ops{pack_k<F32>, pack_v_f32, attend<F32>, store_row<F32>};

}  // namespace

const AttentionCpuOps* PYSCORE_ENTRY(attention_ops, avx512)(const KernelKey& key) {
  // The tiles cover 64 output dims per pass; other head dims fall to the layer below.
  if (key.head_dim % (16 * kZmmPerTile) != 0) return nullptr;
  if (key.dtype == DType::kBFloat16) return key.bf16_dot == Bf16Dot::kWiden ? &kBf16WidenOps : &kBf16Ops;
  if (key.dtype == DType::kFloat32) return &kF32Ops;
  return nullptr;
}

}  // namespace pyscore
