// The AVX2 and NEON ops of the CPU prefix_item_attention kernel (interface and packed layouts in prefix_item_attention.h), written
// once against a vector layer `V` (common/vec_avx2.h, 8 lanes; common/vec_neon.h, 4 lanes) and compiled once per
// layer named below by cmake/cpu_kernels.cmake, which binds `V` and names the entry point.
//
// Flash-attention over 64-key blocks, as the AVX-512 ops: per tile of TM query rows, S = Q.K^T kChunkKeys keys at a
// time (TM x 2 accumulators), online softmax in base 2 with the denormal-free exp2, then O = alpha O + P.V
// kChunkKeys output dims at a time (kChunkKeys = 2 vectors: 16 on AVX2, 8 on NEON). bf16 has no arithmetic here: K
// and V pairs (the packed layouts' 4-byte units) are widened to fp32 in registers (a shift and a mask) and multiplied
// with FMA; q is widened once per call and P stays fp32. AVX2's 16 ymm registers hold TM x 2 accumulators plus the
// operands: TM = 6 for fp32 (2 K/V vectors + 1 broadcast), 4 for bf16 (4 widened vectors + 2 broadcasts); NEON keeps
// these heights (12 of its 32 registers for fp32, 8 for bf16; its speed on ARM has not been measured, only its
// results, under qemu-aarch64 by tests/cpu/kernel_check.cpp).
//
// Exactness: a row's arithmetic depends only on its own q, its key range and its limit, never on which rows share
// its tile or how many there are (key groups a row does not see are masked to p = 0, and adding 0 * v is exact), so
// a row gives the same bits in MIS and SIS and warm and cold, as the AVX-512 and portable ops do.
// pyscore-vec-layers: avx2 neon
#pragma once
#include "common/kernel_text.h"
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "prefix_item_attention/prefix_item_attention.h"

namespace pyscore {
namespace {

using V::Vec;

constexpr int kChunkKeys = 2 * V::kLanes;  // keys (or output dims) per register tile column: 2 vectors
constexpr int kVecPerBlock = kKeyBlock / V::kLanes;
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// Element traits. step() adds, for TM rows, row r's unit of the broadcast operand (b + r * b_stride: one fp32 for
// fp32, a pair of fp32 for bf16) times the kChunkKeys lanes of the packed unit row at `vec` into acc[r][0..2).
struct F32 {
  using T = float;
  static constexpr int kPack = 1;
  static constexpr int kTileRows = 6;
  template <int TM>
  static void step(Vec (&acc)[TM][2], const float* b, int64_t b_stride, const T* vec) {
    const Vec v0 = V::load(vec), v1 = V::load(vec + V::kLanes);
    for (int r = 0; r < TM; ++r) {
      const Vec bc = V::set1(b[r * b_stride]);
      acc[r][0] = V::fma(bc, v0, acc[r][0]);
      acc[r][1] = V::fma(bc, v1, acc[r][1]);
    }
  }
  static const float* rows_as_f32(const T* q, int32_t, int32_t) { return q; }
};

struct Bf16 {
  using T = uint16_t;
  static constexpr int kPack = 2;
  static constexpr int kTileRows = 4;
  template <int TM>
  static void step(Vec (&acc)[TM][2], const float* b, int64_t b_stride, const T* vec) {
    const V::Bits u0 = V::load_bits(vec), u1 = V::load_bits(vec + 2 * V::kLanes);
    const Vec e0 = V::bf16_even(u0), o0 = V::bf16_odd(u0), e1 = V::bf16_even(u1), o1 = V::bf16_odd(u1);
    for (int r = 0; r < TM; ++r) {
      const Vec be = V::set1(b[r * b_stride]), bo = V::set1(b[r * b_stride + 1]);
      acc[r][0] = V::fma(be, e0, V::fma(bo, o0, acc[r][0]));
      acc[r][1] = V::fma(be, e1, V::fma(bo, o1, acc[r][1]));
    }
  }
  // q rows [rows, D] widened to fp32 in a per-thread buffer (exact).
  static const float* rows_as_f32(const T* q, int32_t rows, int32_t head_dim) {
    thread_local std::vector<float> qf;
    const int64_t n = int64_t(rows) * head_dim;
    if (int64_t(qf.size()) < n) qf.resize(n);
    for (int64_t i = 0; i < n; i += V::kLanes) V::store(qf.data() + i, V::load(q + i));  // D % kChunkKeys == 0
    return qf.data();
  }
};

// ---- packing ---------------------------------------------------------------------------------------------------

// K: block b, unit step p, key j of the block at out[(b * steps + p) * kKeyBlock + j] (4-byte units: one fp32 or one
// bf16 pair); padding keys 0. Reads each key row once, writes with a stride of one key tile.
template <class E>
void pack_k(const void* k, int64_t token_stride, int32_t n, int32_t head_dim, void* out) {
  const int steps = head_dim / E::kPack;
  const int64_t row_bytes = token_stride * int64_t(sizeof(typename E::T));
  auto* dst = static_cast<uint32_t*>(out);
  const auto* src = static_cast<const char*>(k);
  const int32_t padded = key_blocks(n) * kKeyBlock;
  for (int32_t j = 0; j < padded; ++j) {
    uint32_t* col = dst + int64_t(j / kKeyBlock) * steps * kKeyBlock + j % kKeyBlock;
    if (j >= n) {
      for (int p = 0; p < steps; ++p) col[p * kKeyBlock] = 0;
      continue;
    }
    const char* row = src + j * row_bytes;
    for (int p = 0; p < steps; ++p) std::memcpy(col + p * kKeyBlock, row + 4 * p, 4);
  }
}

// V, bf16: keys 2j and 2j+1 interleaved element by element, 8 dims at a time (head_dim % kChunkKeys == 0).
void pack_v_bf16(const void* v, int64_t token_stride, int32_t n, int32_t head_dim, void* out) {
  auto* dst = static_cast<uint16_t*>(out);
  const auto* src = static_cast<const uint16_t*>(v);
  const int32_t pairs = key_blocks(n) * kKeyBlock / 2;
  for (int32_t j = 0; j < pairs; ++j) {
    const int32_t k0 = 2 * j, k1 = 2 * j + 1;
    uint16_t* step = dst + int64_t(j) * head_dim * 2;
    for (int d = 0; d < head_dim; d += 8)
      V::store_zip8(step + 2 * d, k0 < n ? src + k0 * token_stride + d : nullptr,
                    k1 < n ? src + k1 * token_stride + d : nullptr);
  }
}

// ---- the attention tile ----------------------------------------------------------------------------------------

struct alignas(32) SoftmaxState {
  float max[8];    // running max of the base-2 scores
  float sum[8];    // running sum of 2^(score - max)
  float alpha[8];  // rescale factor of this key block
};

// S = Q.K^T for TM rows x 64 keys of one key block, scaled to base 2 and masked per row to keys < limit. Only the
// kChunkKeys-key groups below the tile's key_end are multiplied; the others are masked (-inf) like any key past a
// limit.
template <class E, int TM>
inline void scores_block(const float* q, int head_dim, const typename E::T* kblock, const int* limit, int key0,
                         int key_end, float scale2, Vec (&s)[TM][kVecPerBlock]) {
  constexpr int P = E::kPack;
  for (int c = 0; c < kKeyBlock / kChunkKeys; ++c) {
    Vec acc[TM][2];
    for (int r = 0; r < TM; ++r) acc[r][0] = acc[r][1] = V::zero();
    if (key0 + c * kChunkKeys < key_end)
      for (int p = 0; p < head_dim / P; ++p)
        E::template step<TM>(acc, q + p * P, head_dim, kblock + (p * kKeyBlock + c * kChunkKeys) * P);
    for (int r = 0; r < TM; ++r)
      for (int z = 0; z < 2; ++z) {
        const int lane0 = key0 + c * kChunkKeys + z * V::kLanes;
        const V::Mask visible = V::first_lanes(std::clamp(limit[r] - lane0, 0, V::kLanes));
        s[r][2 * c + z] = V::select(visible, V::mul(acc[r][z], V::set1(scale2)), V::set1(kNegInf));
      }
  }
}

// Online-softmax step: new row maxima, rescale factors, P = 2^(S - max) into pbuf and the running sums.
template <int TM>
inline void softmax_block(Vec (&s)[TM][kVecPerBlock], SoftmaxState& st, float (*pbuf)[kKeyBlock]) {
  alignas(32) float prev[8] = {}, ref[8] = {};
  for (int r = 0; r < TM; ++r) {
    Vec mx = s[r][0];
    for (int z = 1; z < kVecPerBlock; ++z) mx = V::max(mx, s[r][z]);
    prev[r] = st.max[r];
    const float block_max = V::reduce_max(mx);
    if (block_max > st.max[r]) st.max[r] = block_max;
    // A row that has seen no key yet keeps max -inf; subtract 0 instead so 2^(-inf) stays 0, not NaN.
    ref[r] = st.max[r] == kNegInf ? 0.0f : st.max[r];
  }
  for (int r = 0; r < TM; r += V::kLanes)  // one vector on AVX2 (TM <= 8 lanes), two on NEON
    V::store(st.alpha + r, V::exp2_ps(V::sub(V::load(prev + r), V::load(ref + r))));
  for (int r = 0; r < TM; ++r) {
    const Vec m = V::set1(ref[r]);
    Vec sum = V::zero();
    for (int z = 0; z < kVecPerBlock; ++z) {
      const Vec p = V::exp2_ps(V::sub(s[r][z], m));
      sum = V::add(sum, p);
      V::store(pbuf[r] + V::kLanes * z, p);
    }
    st.sum[r] = st.sum[r] * st.alpha[r] + V::reduce_add(sum);
  }
}

// O = alpha * O + P.V for TM rows, kChunkKeys output dims at a time; `steps` = key units of this block that matter.
template <class E, int TM>
inline void pv_block(const float (*pbuf)[kKeyBlock], const typename E::T* vblock, int steps, int head_dim,
                     const SoftmaxState& st, float* o) {
  constexpr int P = E::kPack;
  for (int c = 0; c < head_dim; c += kChunkKeys) {
    Vec acc[TM][2];
    for (int r = 0; r < TM; ++r) {
      const Vec a = V::set1(st.alpha[r]);
      acc[r][0] = V::mul(a, V::load(o + r * head_dim + c));
      acc[r][1] = V::mul(a, V::load(o + r * head_dim + c + V::kLanes));
    }
    for (int j = 0; j < steps; ++j)
      E::template step<TM>(acc, pbuf[0] + j * P, kKeyBlock, vblock + (int64_t(j) * head_dim + c) * P);
    for (int r = 0; r < TM; ++r) {
      V::store(o + r * head_dim + c, acc[r][0]);
      V::store(o + r * head_dim + c + V::kLanes, acc[r][1]);
    }
  }
}

// TM query rows (fp32) against a packed key range: flash-attention over key blocks up to the rows' largest limit.
template <class E, int TM>
void attend_tile(const float* q, const int32_t* limits, const typename E::T* k_packed, const typename E::T* v_packed,
                 int32_t num_keys, int32_t head_dim, float scale2, float* o, float* lse) {
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
  alignas(32) float pbuf[TM][kKeyBlock];
  for (int key0 = 0; key0 < key_end; key0 += kKeyBlock) {
    const int64_t block = int64_t(key0) * head_dim;  // both packed layouts hold kKeyBlock * D per block
    Vec s[TM][kVecPerBlock];
    scores_block<E, TM>(q, head_dim, k_packed + block, limit, key0, key_end, scale2, s);
    softmax_block<TM>(s, st, pbuf);
    const int steps = (std::min(kKeyBlock, key_end - key0) + E::kPack - 1) / E::kPack;
    pv_block<E, TM>(pbuf, v_packed + block, steps, head_dim, st, o);
  }
  for (int r = 0; r < TM; ++r) {
    const float l = st.sum[r];
    const Vec inv = V::set1(l > 0.0f ? 1.0f / l : 0.0f);
    for (int d = 0; d < head_dim; d += V::kLanes)
      V::store(o + r * head_dim + d, V::mul(inv, V::load(o + r * head_dim + d)));
    lse[r] = l > 0.0f ? st.max[r] * kLn2 + std::log(l) : kNegInf;
  }
}

// The last `rows` (< TM) rows: one tile of exactly that many.
template <class E, int N>
void attend_tail(int rows, const float* q, const int32_t* limits, const typename E::T* kp, const typename E::T* vp,
                 int32_t num_keys, int32_t head_dim, float scale2, float* o, float* lse) {
  if constexpr (N > 0) {
    if (rows == N) return attend_tile<E, N>(q, limits, kp, vp, num_keys, head_dim, scale2, o, lse);
    attend_tail<E, N - 1>(rows, q, limits, kp, vp, num_keys, head_dim, scale2, o, lse);
  }
}

template <class E>
void attend(const void* q_, int32_t rows, const int32_t* limits, const void* k_packed, const void* v_packed,
            int32_t num_keys, int32_t head_dim, float scale, float* o, float* lse) {
  using T = typename E::T;
  constexpr int TM = E::kTileRows;
  const float* q = E::rows_as_f32(static_cast<const T*>(q_), rows, head_dim);
  const T* kp = static_cast<const T*>(k_packed);
  const T* vp = static_cast<const T*>(v_packed);
  const float scale2 = scale * kLog2e;
  int32_t r = 0;
  for (; r + TM <= rows; r += TM)
    attend_tile<E, TM>(q + int64_t(r) * head_dim, limits ? limits + r : nullptr, kp, vp, num_keys, head_dim, scale2,
                       o + int64_t(r) * head_dim, lse + r);
  attend_tail<E, TM - 1>(rows - r, q + int64_t(r) * head_dim, limits ? limits + r : nullptr, kp, vp, num_keys,
                         head_dim, scale2, o + int64_t(r) * head_dim, lse + r);
}

template <class T>
void store_row(const float* src, int32_t dim, void* dst_) {
  auto* dst = static_cast<T*>(dst_);
  for (int32_t d = 0; d < dim; d += V::kLanes) V::store(dst + d, V::load(src + d));
}

const AttentionCpuOps kBf16Ops{pack_k<Bf16>, pack_v_bf16, attend<Bf16>, store_row<uint16_t>};
const AttentionCpuOps kF32Ops{pack_k<F32>, pack_v_f32, attend<F32>, store_row<float>};

// nullptr where these ops do not cover the dtype / head_dim (the portable ops do); the caller has checked the CPU.
const AttentionCpuOps* ops_for(DType dtype, int32_t head_dim) {
  if (head_dim % kChunkKeys != 0) return nullptr;  // the tiles cover kChunkKeys output dims per pass
  if (dtype == DType::kBFloat16) return &kBf16Ops;
  if (dtype == DType::kFloat32) return &kF32Ops;
  return nullptr;
}

}  // namespace

// The entry point prefix_item_attention.h declares, named for the layer this text is compiled on (e.g. attention_ops_avx2).
const AttentionCpuOps* PYSCORE_VEC_ENTRY(attention_ops)(const KernelKey& key) {
  return ops_for(key.dtype, key.head_dim);
}

}  // namespace pyscore
