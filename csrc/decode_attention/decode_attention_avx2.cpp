// AVX2 + FMA ops of the CPU decode_attention kernel (interface in decode_attention.h), written against the vector layer
// common/vec_avx2.h.
//
// Decode is a matrix-vector product per (sequence, kv head): the few GQA query rows against keys read straight from
// the cache (token-major rows, no packing). Keys go in blocks of 8: per row, 8 lane-partial dot products (one per
// key, the row's q chunk loaded once for all 8) are reduced by a transposing add tree into one vector of 8 scores
// (base 2); a chunk's softmax in two passes (its maximum, then exp2 without denormals); the block's values are
// widened to fp32 once into L1 scratch (bf16) and every row adds p_j * v_j with FMA (P stays fp32). bf16 keys are
// widened in registers as pairs against a de-interleaved fp32 copy of q (per 16 elements: the 8 even, then the 8
// odd).
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "common/vec_avx2.h"
#include "decode_attention/decode_attention.h"

namespace pyscore {
namespace {

namespace V = avx2;
using V::Vec;

constexpr int kKeysPerBlock = V::kLanes;
constexpr int kMaxRows = 16;     // GQA query rows per call; more are done in several calls
constexpr int kMaxHeadDim = 256;
constexpr int kOutVecs = 8;      // output vectors (64 dims) accumulated in registers per pass over a block's keys
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// The keys past the end of a short block.
template <class T>
alignas(32) const T kZeroRow[kMaxHeadDim] = {};

// Lane j of the result = the sum of the 8 lanes of a[j].
inline Vec reduce8(const Vec (&a)[8]) {
  const Vec t0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
  const Vec t1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
  return V::add(_mm256_permute2f128_ps(t0, t1, 0x20), _mm256_permute2f128_ps(t0, t1, 0x31));
}

// Element traits: prepare_q() writes a query row in the form dots() reads; dots() adds q . keys[j] lane-partially
// for the 8 key rows of a block (a block short of keys points the rest at a zero row, so all 8 accumulators stay in
// registers); values() gives the block's value rows in fp32.
struct F32 {
  using T = float;
  static const float* prepare_q(const T* q, int, float*) { return q; }
  static void dots(const float* q, const T* const (&keys)[8], int head_dim, Vec (&acc)[8]) {
    for (int c = 0; c < head_dim; c += V::kLanes) {
      const Vec qv = V::load(q + c);
      for (int j = 0; j < 8; ++j) acc[j] = V::fma(qv, V::load(keys[j] + c), acc[j]);
    }
  }
  static const float* values(const T* v, int64_t token_stride, int n, int head_dim, float (*)[kMaxHeadDim],
                             int64_t* stride) {
    (void)n, (void)head_dim;
    *stride = token_stride;
    return v;
  }
};

struct Bf16 {
  using T = uint16_t;
  static const float* prepare_q(const T* q, int head_dim, float* buf) {
    for (int c = 0; c < head_dim; c += 2 * V::kLanes) {
      const __m256i x = V::load_bits(q + c);
      V::store(buf + c, V::bf16_even(x));
      V::store(buf + c + V::kLanes, V::bf16_odd(x));
    }
    return buf;
  }
  static void dots(const float* q, const T* const (&keys)[8], int head_dim, Vec (&acc)[8]) {
    for (int c = 0; c < head_dim; c += 2 * V::kLanes) {
      const Vec qe = V::load(q + c), qo = V::load(q + c + V::kLanes);
      for (int j = 0; j < 8; ++j) {
        const __m256i x = V::load_bits(keys[j] + c);
        acc[j] = V::fma(qe, V::bf16_even(x), V::fma(qo, V::bf16_odd(x), acc[j]));
      }
    }
  }
  // The block's n value rows widened into scratch (row stride kMaxHeadDim).
  static const float* values(const T* v, int64_t token_stride, int n, int head_dim, float (*scratch)[kMaxHeadDim],
                             int64_t* stride) {
    for (int j = 0; j < n; ++j)
      for (int c = 0; c < head_dim; c += V::kLanes) V::store(scratch[j] + c, V::load(v + j * token_stride + c));
    *stride = kMaxHeadDim;
    return scratch[0];
  }
};

// o[0, VECS lanes) += sum_j p[j] * v_j: VECS accumulators, a compile-time count so that they stay in registers (with
// a run-time count GCC kept them in memory, a store per FMA: 8 sequences' decode attention took 0.65-0.78 ms in fp32
// instead of 0.54-0.62, bench/results/tiers/kernels/decode_attention_avx2_ab.txt).
template <int VECS>
inline void add_values_pass(float* o, const float* p, const float* v, int64_t v_stride, int n) {
  Vec acc[VECS];
  for (int z = 0; z < VECS; ++z) acc[z] = V::load(o + z * V::kLanes);
  for (int j = 0; j < n; ++j) {
    const Vec pj = V::set1(p[j]);
    for (int z = 0; z < VECS; ++z) acc[z] = V::fma(pj, V::load(v + j * v_stride + z * V::kLanes), acc[z]);
  }
  for (int z = 0; z < VECS; ++z) V::store(o + z * V::kLanes, acc[z]);
}

// o[0, D) += sum_j p[j] * v_j, 64 dims per pass (head_dim is a multiple of 16: the last pass has 2, 4, 6 or 8
// vectors). Each output lane's sum runs over j in the same order whatever the pass, so the bits do not depend on it.
inline void add_values(float* o, const float* p, const float* v, int64_t v_stride, int n, int head_dim) {
  for (int c0 = 0; c0 < head_dim; c0 += kOutVecs * V::kLanes) {
    switch (std::min(kOutVecs, (head_dim - c0) / V::kLanes)) {
      case 2: add_values_pass<2>(o + c0, p, v + c0, v_stride, n); break;
      case 4: add_values_pass<4>(o + c0, p, v + c0, v_stride, n); break;
      case 6: add_values_pass<6>(o + c0, p, v + c0, v_stride, n); break;
      default: add_values_pass<kOutVecs>(o + c0, p, v + c0, v_stride, n); break;
    }
  }
}

// A chunk (at most kDecodeChunk keys) in three passes per row rather than an online softmax per block of 8 keys:
// the scores and their maximum, 2^(score - max) and their sum, then P.V (the block's values widened once for every
// row). The online form chained every block's reduce, max, exp and rescale through the row's running state
// (latency-bound); here only each pass's final reduction is serial.
template <class E>
void attend(const void* q_, int64_t q_row_stride, int32_t rows, const void* const* k_tiles,
            const void* const* v_tiles, int64_t token_stride, int32_t num_keys, int32_t head_dim, float scale, float* o,
            float* lse) {
  using T = typename E::T;
  static_assert(kCpuKeyTile % kKeysPerBlock == 0, "a block of keys never straddles two tiles (pages)");
  static_assert(kDecodeChunk % kKeysPerBlock == 0, "whole blocks of scores");
  const T* q = static_cast<const T*>(q_);
  const float scale2 = scale * kLog2e;
  alignas(32) float qbuf[kMaxHeadDim];
  alignas(32) float p[kMaxRows][kDecodeChunk];  // a row's scores, then their exponentials
  float sum[kMaxRows];
  for (int r = 0; r < rows; ++r) {
    const float* qf = E::prepare_q(q + r * q_row_stride, head_dim, qbuf);
    Vec m = V::set1(kNegInf);
    for (int32_t key0 = 0; key0 < num_keys; key0 += kKeysPerBlock) {
      const int n = std::min<int32_t>(kKeysPerBlock, num_keys - key0);
      const T* k = static_cast<const T*>(k_tiles[key0 / kCpuKeyTile]) + (key0 % kCpuKeyTile) * token_stride;
      const T* keys[kKeysPerBlock];
      for (int j = 0; j < kKeysPerBlock; ++j) keys[j] = j < n ? k + j * token_stride : kZeroRow<T>;
      Vec partial[kKeysPerBlock];
      for (int j = 0; j < kKeysPerBlock; ++j) partial[j] = V::zero();
      E::dots(qf, keys, head_dim, partial);
      const Vec s = V::select(V::first_lanes(n), V::mul(reduce8(partial), V::set1(scale2)), V::set1(kNegInf));
      V::store(p[r] + key0, s);
      m = V::max(m, s);
    }
    const float max = V::reduce_max(m);  // finite: the chunk has a key
    Vec total = V::zero();
    for (int32_t key0 = 0; key0 < num_keys; key0 += kKeysPerBlock) {
      const Vec pz = V::exp2_ps(V::sub(V::load(p[r] + key0), V::set1(max)));  // -inf lanes: 0
      V::store(p[r] + key0, pz);
      total = V::add(total, pz);
    }
    sum[r] = V::reduce_add(total);  // >= 1: the maximum key contributes 2^0
    lse[r] = max * kLn2 + std::log(sum[r]);
    std::memset(o + r * head_dim, 0, head_dim * sizeof(float));
  }
  alignas(32) float vf[kKeysPerBlock][kMaxHeadDim];
  for (int32_t key0 = 0; key0 < num_keys; key0 += kKeysPerBlock) {
    const int n = std::min<int32_t>(kKeysPerBlock, num_keys - key0);
    const T* v = static_cast<const T*>(v_tiles[key0 / kCpuKeyTile]) + (key0 % kCpuKeyTile) * token_stride;
    int64_t v_stride;
    const float* vals = E::values(v, token_stride, n, head_dim, vf, &v_stride);
    for (int r = 0; r < rows; ++r) add_values(o + r * head_dim, p[r] + key0, vals, v_stride, n, head_dim);
  }
  for (int r = 0; r < rows; ++r) {
    const Vec inv = V::set1(1.0f / sum[r]);
    for (int c = 0; c < head_dim; c += V::kLanes)
      V::store(o + r * head_dim + c, V::mul(inv, V::load(o + r * head_dim + c)));
  }
}

// More rows than kMaxRows in consecutive calls of up to kMaxRows.
template <class E>
void attend_rows(const void* q, int64_t q_row_stride, int32_t rows, const void* const* k, const void* const* v,
                 int64_t token_stride, int32_t num_keys, int32_t head_dim, float scale, float* o, float* lse) {
  using T = typename E::T;
  for (int32_t r = 0; r < rows; r += kMaxRows)
    attend<E>(static_cast<const T*>(q) + r * q_row_stride, q_row_stride, std::min(kMaxRows, rows - r), k, v,
              token_stride, num_keys, head_dim, scale, o + int64_t(r) * head_dim, lse + r);
}

template <class T>
void store_row(const float* src, int32_t dim, void* dst_) {
  auto* dst = static_cast<T*>(dst_);
  for (int32_t d = 0; d < dim; d += V::kLanes) V::store(dst + d, V::load(src + d));
}

const DecodeCpuOps kBf16Ops{attend_rows<Bf16>, store_row<uint16_t>};
const DecodeCpuOps kF32Ops{attend_rows<F32>, store_row<float>};

}  // namespace

const DecodeCpuOps* PYSCORE_ENTRY(decode_ops, avx2)(const KernelKey& key) {
  // Whole bf16 pair steps (16 elements), and the scratch rows' size.
  if (key.head_dim % 16 != 0 || key.head_dim > kMaxHeadDim) return nullptr;
  if (key.dtype == DType::kBFloat16) return &kBf16Ops;
  if (key.dtype == DType::kFloat32) return &kF32Ops;
  return nullptr;
}

}  // namespace pyscore
