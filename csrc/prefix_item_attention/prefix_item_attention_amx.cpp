// AMX attend() of the CPU prefix_item_attention kernel, bf16 (tier amx). Packing and the output store are the
// avx512 layer's ops' own (attention_simd.h; prefix_item_attention.h layouts): a packed K block's pair rows are already AMX B-tile rows for S = Q.K^T
// (16 keys x one head_dim pair, 256 bytes apart), and a packed V block's key-pair rows are B-tile rows for P.V
// (16 dims x one key pair, 2 * head_dim * 2 bytes apart), so nothing is re-laid out for the tiles.
//
// One tile is 16 query rows against the range's 64-key blocks, flash-attention style:
//   S (16 x 64, fp32) = four C tiles from head_dim / 32 dot steps, stored to a buffer;
//   scale to base 2, mask per row to its limit, online softmax in AVX-512 (P rounded to bf16 as on the AVX-512
//   path, its exp2 a shorter polynomial: see exp2_p4_ps), P as the A tile of P.V;
//   P.V for the block into zeroed C tiles, 64 output dims at a time, then O = alpha * O + P.V per row in fp32.
// A tile row's arithmetic depends only on that row (its q, its limit, the range's keys in fixed block order): rows
// padded into a short last tile, or keys past a row's limit (probability 0, adding exact zeros), change none of its
// bits. So results stay batch-invariant and a cached range gives a cold range's bits, as on the other paths; they
// are not the AVX-512 path's bits (the tile unit sums a block's products in its own order).
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "common/amx_tiles.h"
#include "common/vec_math_avx512.h"
#include "prefix_item_attention/prefix_item_attention.h"

namespace pyscore {

const AttentionCpuOps* PYSCORE_ENTRY(attention_ops, avx512)(const KernelKey& key);  // attention_simd.h's avx512 unit

namespace {

using namespace avx512;

// Tiles (common/amx_tiles.h): 0-3 C (fp32 16 x 16), 4 A, 5-7 B.
constexpr int kRows = 16;       // query rows per tile: an AMX tile's rows
constexpr int kDimStep = 32;    // head_dim elements per Q.K^T dot step: one A-tile row of bf16
constexpr int kOutDims = 64;    // output dims per P.V pass: four 16-column C tiles
constexpr int kKeyHalf = 32;    // keys per P.V dot step: one A-tile row of bf16 P
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// 2^x for probabilities that are rounded to bf16 (relative error 2^-9) before P.V: a degree-4 fit on [-1/2, 1/2]
// (relative error 2.7e-6) instead of exp2_ps's degree 7 (~1 ulp), which this kernel's softmax spends most of its
// time in. x <= 0 here; lanes below -126 (and -inf) give 0, as exp2_ps.
inline __m512 exp2_p4_ps(__m512 x) {
  const __mmask16 normal = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-126.0f), _CMP_GE_OQ);
  x = _mm512_max_ps(x, _mm512_set1_ps(-127.0f));
  const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(x, n);
  __m512 p = _mm512_set1_ps(9.57010128e-03f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.59178591e-02f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.40247443e-01f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.93121791e-01f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.99999285e-01f));
  return _mm512_maskz_scalef_ps(normal, p, n);
}

inline __mmask16 first_lanes(int count) {
  if (count >= 16) return 0xFFFF;
  return count <= 0 ? 0 : __mmask16((1u << count) - 1);
}

// Scores of 16 rows (q: [16, D] bf16) against the first G 16-key groups of one packed K block, unscaled, into
// s [16][64] (the other groups' columns are left as they were: they lie past every row's limit).
template <int G>
void scores_tiles(const uint16_t* q, int head_dim, const uint16_t* kblock, float* s) {
  _tile_zero(0);
  if (G > 1) _tile_zero(1);
  if (G > 2) _tile_zero(2);
  if (G > 3) _tile_zero(3);
  const int64_t b_bytes = kKeyBlock * 4;  // one pair row of 64 keys
  for (int t = 0; t < head_dim / kDimStep; ++t) {
    _tile_loadd(4, q + t * kDimStep, head_dim * 2);
    const uint16_t* b = kblock + int64_t(t) * (kDimStep / 2) * kKeyBlock * 2;  // pair rows 16t .. 16t + 15
    _tile_loadd(5, b, b_bytes);
    _tile_dpbf16ps(0, 4, 5);
    if (G > 1) {
      _tile_loadd(6, b + 32, b_bytes);
      _tile_dpbf16ps(1, 4, 6);
    }
    if (G > 2) {
      _tile_loadd(7, b + 64, b_bytes);
      _tile_dpbf16ps(2, 4, 7);
    }
    if (G > 3) {
      _tile_loadd(5, b + 96, b_bytes);
      _tile_dpbf16ps(3, 4, 5);
    }
  }
  const int64_t s_bytes = kKeyBlock * 4;
  _tile_stored(0, s, s_bytes);
  if (G > 1) _tile_stored(1, s + 16, s_bytes);
  if (G > 2) _tile_stored(2, s + 32, s_bytes);
  if (G > 3) _tile_stored(3, s + 48, s_bytes);
}

void scores(const uint16_t* q, int head_dim, const uint16_t* kblock, int groups, float* s) {
  switch (groups) {
    case 1: return scores_tiles<1>(q, head_dim, kblock, s);
    case 2: return scores_tiles<2>(q, head_dim, kblock, s);
    case 3: return scores_tiles<3>(q, head_dim, kblock, s);
    default: return scores_tiles<4>(q, head_dim, kblock, s);
  }
}

// pv [16][64] = P (p: [16][64] bf16) . V over the first H 32-key halves of one packed V block, output dims
// [c, c + 64).
template <int H>
void pv_tiles(const uint16_t* p, const uint16_t* vblock, int head_dim, int c, float* pv) {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  const int64_t b_bytes = int64_t(head_dim) * 4;  // one key-pair row
  for (int h = 0; h < H; ++h) {
    _tile_loadd(4, p + h * kKeyHalf, kKeyBlock * 2);
    const uint16_t* b = vblock + (int64_t(h) * (kKeyHalf / 2) * head_dim + c) * 2;
    _tile_loadd(5, b, b_bytes);
    _tile_dpbf16ps(0, 4, 5);
    _tile_loadd(6, b + 32, b_bytes);
    _tile_dpbf16ps(1, 4, 6);
    _tile_loadd(7, b + 64, b_bytes);
    _tile_dpbf16ps(2, 4, 7);
    _tile_loadd(5, b + 96, b_bytes);
    _tile_dpbf16ps(3, 4, 5);
  }
  const int64_t c_bytes = kOutDims * 4;
  _tile_stored(0, pv, c_bytes);
  _tile_stored(1, pv + 16, c_bytes);
  _tile_stored(2, pv + 32, c_bytes);
  _tile_stored(3, pv + 48, c_bytes);
}

struct alignas(64) TileState {
  float max[kRows];    // running max of the base-2 scores
  float sum[kRows];    // running sum of 2^(score - max), from the unrounded P
  float alpha[kRows];  // this block's rescale factor of O and sum
  int limit[kRows];    // keys [0, limit) visible to the row
};

// Lane r = v[r] reduced over its 16 lanes by `op`, for the 16 rows at once: the association of
// _mm512_reduce_add_ps / _mm512_reduce_max_ps (GCC's: halves at distance 8, then 4, then 2, then 1, each `op(upper,
// lower)` as theirs), so every row gets the one-row reduction's bits, in about 45 vector ops instead of 16 dependent
// chains of extracts and shuffles (which the block's softmax spent a sixth of its time in).
template <class Op>
inline __m512 reduce_rows(const __m512 (&v)[kRows], Op op) {
  __m512 z[8], w[4];
  for (int k = 0; k < 8; ++k)  // distance 8: rows 2k, 2k + 1 -> 8 lanes each
    z[k] = op(_mm512_shuffle_f32x4(v[2 * k], v[2 * k + 1], 0xEE), _mm512_shuffle_f32x4(v[2 * k], v[2 * k + 1], 0x44));
  for (int j = 0; j < 4; ++j)  // distance 4: rows 4j .. 4j + 3 -> one 128-bit lane each
    w[j] = op(_mm512_shuffle_f32x4(z[2 * j], z[2 * j + 1], 0xDD), _mm512_shuffle_f32x4(z[2 * j], z[2 * j + 1], 0x88));
  // distance 2, then 1: 128-bit lane k ends up holding rows k, 4 + k, 8 + k, 12 + k
  const __m512 u0 = op(_mm512_shuffle_ps(w[0], w[1], 0x44), _mm512_shuffle_ps(w[0], w[1], 0xEE));
  const __m512 u1 = op(_mm512_shuffle_ps(w[2], w[3], 0x44), _mm512_shuffle_ps(w[2], w[3], 0xEE));
  const __m512 t = op(_mm512_shuffle_ps(u0, u1, 0x88), _mm512_shuffle_ps(u0, u1, 0xDD));
  // Row r sits in lane 4 (r % 4) + r / 4.
  const __m512i rows = _mm512_set_epi32(15, 11, 7, 3, 14, 10, 6, 2, 13, 9, 5, 1, 12, 8, 4, 0);
  return _mm512_permutexvar_ps(rows, t);
}

// Scale and mask s to base-2 scores, update the running max / sum, write P rounded to bf16 (the AVX-512 path's
// rules, with exp2_p4_ps: a row that has seen no key keeps max -inf and subtracts 0, so 2^(-inf) stays 0). Two
// passes over the 16 rows: the rows' maxima, reduced together, then P and the rows' sums, reduced together. The
// second pass scales and masks s again (the same arithmetic, so the same scores) rather than holding 16 x 4 zmm of
// them across the reduction. The 16-key groups past every row's limit (groups >= `groups`) are P = 0 without an exp.
void softmax_block(const float* s, int key0, int groups, float scale2, TileState& st, uint16_t* p) {
  const __m512 neg_inf = _mm512_set1_ps(kNegInf), scale = _mm512_set1_ps(scale2);
  auto scaled = [&](int r, int z) {
    return _mm512_mask_mul_ps(neg_inf, first_lanes(st.limit[r] - key0 - 16 * z),
                              _mm512_loadu_ps(s + r * kKeyBlock + 16 * z), scale);
  };
  __m512 per_row[kRows];
  for (int r = 0; r < kRows; ++r) {
    __m512 mx = neg_inf;
    for (int z = 0; z < groups; ++z) mx = _mm512_max_ps(mx, scaled(r, z));
    per_row[r] = mx;
  }
  const __m512 prev = _mm512_load_ps(st.max);
  // max_ps(block, prev) is std::max(prev, block) lane by lane, ties and NaNs included.
  const __m512 now = _mm512_max_ps(reduce_rows(per_row, [](__m512 a, __m512 b) { return _mm512_max_ps(a, b); }), prev);
  _mm512_store_ps(st.max, now);
  alignas(64) float ref[kRows];
  _mm512_store_ps(ref, _mm512_mask_mov_ps(now, _mm512_cmp_ps_mask(now, neg_inf, _CMP_EQ_OQ), _mm512_setzero_ps()));
  for (int r = 0; r < kRows; ++r) {
    uint16_t* prow = p + r * kKeyBlock;
    const __m512 m = _mm512_set1_ps(ref[r]);
    __m512 sum = _mm512_setzero_ps();
    for (int z = 0; z < groups; ++z) {
      const __m512 e = exp2_p4_ps(_mm512_sub_ps(scaled(r, z), m));
      sum = _mm512_add_ps(sum, e);
      store_bf16_ps(prow + 16 * z, e);
    }
    for (int z = groups; z < kKeyBlock / 16; ++z) _mm256_storeu_si256(reinterpret_cast<__m256i*>(prow + 16 * z),
                                                                      _mm256_setzero_si256());
    per_row[r] = sum;
  }
  const __m512 block_sum = reduce_rows(per_row, [](__m512 a, __m512 b) { return _mm512_add_ps(a, b); });
  const __m512 alpha = exp2_ps(_mm512_sub_ps(prev, _mm512_load_ps(ref)));
  _mm512_store_ps(st.alpha, alpha);
  _mm512_store_ps(st.sum, _mm512_fmadd_ps(_mm512_load_ps(st.sum), alpha, block_sum));
}

// o [16, D] fp32 = softmax(q . K^T) . V over one packed range; lse [16].
void attend_tile(const uint16_t* q, const uint16_t* kp, const uint16_t* vp, int32_t num_keys, int32_t head_dim,
                 float scale2, TileState& st, float* o, float* lse) {
  int key_end = 0;
  for (int r = 0; r < kRows; ++r) {
    st.max[r] = kNegInf;
    st.sum[r] = 0.0f;
    key_end = std::max(key_end, std::min(st.limit[r], num_keys));
  }
  std::memset(o, 0, sizeof(float) * kRows * head_dim);
  alignas(64) float s[kRows * kKeyBlock];
  alignas(64) float pv[kRows * kOutDims];
  alignas(64) uint16_t p[kRows * kKeyBlock];
  for (int key0 = 0; key0 < key_end; key0 += kKeyBlock) {
    const int64_t block = int64_t(key0) * head_dim;  // both packed layouts hold kKeyBlock * D per block
    const int live = std::min(kKeyBlock, key_end - key0);
    const int groups = (live + 15) / 16;
    scores(q, head_dim, kp + block, groups, s);
    softmax_block(s, key0, groups, scale2, st, p);
    for (int c = 0; c < head_dim; c += kOutDims) {
      if (live <= kKeyHalf) pv_tiles<1>(p, vp + block, head_dim, c, pv);
      else pv_tiles<2>(p, vp + block, head_dim, c, pv);
      for (int r = 0; r < kRows; ++r) {
        const __m512 a = _mm512_set1_ps(st.alpha[r]);
        float* out = o + r * head_dim + c;
        for (int z = 0; z < kOutDims / 16; ++z)
          _mm512_storeu_ps(out + 16 * z, _mm512_fmadd_ps(a, _mm512_loadu_ps(out + 16 * z),
                                                         _mm512_loadu_ps(pv + r * kOutDims + 16 * z)));
      }
    }
  }
  finish_softmax_rows(o, kRows, head_dim, st.max, st.sum, lse);
}

void attend(const void* q_, int32_t rows, const int32_t* limits, const void* k_packed, const void* v_packed,
            int32_t num_keys, int32_t head_dim, float scale, float* o, float* lse) {
  const auto* q = static_cast<const uint16_t*>(q_);
  const auto* kp = static_cast<const uint16_t*>(k_packed);
  const auto* vp = static_cast<const uint16_t*>(v_packed);
  const float scale2 = scale * kLog2e;
  // A short last tile runs on zero-padded copies; its padding rows see no key (limit 0) and are dropped.
  thread_local std::vector<uint16_t> q_tail;
  thread_local std::vector<float> o_tail;
  alignas(64) float lse_tail[kRows];
  TileState st;
  load_amx_tiles_16x64();
  for (int32_t r0 = 0; r0 < rows; r0 += kRows) {
    const int32_t n = std::min(kRows, rows - r0);
    for (int r = 0; r < kRows; ++r) st.limit[r] = r >= n ? 0 : limits ? std::min(limits[r0 + r], num_keys) : num_keys;
    if (n == kRows) {
      attend_tile(q + int64_t(r0) * head_dim, kp, vp, num_keys, head_dim, scale2, st, o + int64_t(r0) * head_dim,
                  lse + r0);
      continue;
    }
    q_tail.assign(size_t(kRows) * head_dim, 0);
    o_tail.resize(size_t(kRows) * head_dim);
    std::memcpy(q_tail.data(), q + int64_t(r0) * head_dim, size_t(n) * head_dim * 2);
    attend_tile(q_tail.data(), kp, vp, num_keys, head_dim, scale2, st, o_tail.data(), lse_tail);
    std::memcpy(o + int64_t(r0) * head_dim, o_tail.data(), size_t(n) * head_dim * sizeof(float));
    std::memcpy(lse + r0, lse_tail, size_t(n) * sizeof(float));
  }
  _tile_release();
}

}  // namespace

const AttentionCpuOps* PYSCORE_ENTRY(attention_ops, amx)(const KernelKey& key) {
  if (key.dtype != DType::kBFloat16 || key.head_dim % kOutDims != 0) return nullptr;
  KernelKey packing = key;  // the AVX-512 ops' packing and row store (vdpbf16ps pairs, as the tiles multiply)
  packing.bf16_dot = Bf16Dot::kDpbf16;
  const AttentionCpuOps* avx512 = attention_ops_avx512(packing);
  if (!avx512) return nullptr;
  static const AttentionCpuOps ops{avx512->pack_k, avx512->pack_v, attend, avx512->store_row};
  return &ops;
}

}  // namespace pyscore
