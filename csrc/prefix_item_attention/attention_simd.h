// The vector ops of the CPU prefix_item_attention kernel (interface and packed layouts in prefix_item_attention.h),
// written once against a vector layer `V` (common/vec_avx2.h, 8 lanes; common/vec_avx512.h, 16; common/vec_neon.h,
// 4) and compiled once per layer named below by cmake/cpu_kernels.cmake, which binds `V` and names the entry point.
// At tier amx, prefix_item_attention_amx.cpp runs Q.K^T and P.V on AMX tiles and takes this text's avx512 packing.
//
// Flash-attention over 64-key blocks: per tile of TM query rows, S = Q.K^T kChunkKeys keys at a time (TM x
// kTileVecs accumulators), online softmax in base 2 (scores pre-multiplied by scale * log2(e)) with the vector exp2
// (~1 ulp, denormal-free), then O = alpha O + P.V kChunkKeys output dims at a time. A register tile column is 4
// vectors on a 32-register layer (AVX-512: 64 keys), else 2 (AVX2: 16, NEON: 8).
//
// Element types. fp32 multiplies single elements with FMA. bf16 works on pairs (the packed layouts' 4-byte units:
// Q.K^T pairs along head_dim, P.V pairs along keys), either by the layer's pair dot (Bf16Pairs: vdpbf16ps, where
// V::kHasBf16Dot and key.bf16_dot is kDpbf16) or by widening them to fp32 in registers and two FMAs in vdpbf16ps's
// order (Bf16: the odd product first), which gives the pair dot's bits on normal numbers. Where the layer has a
// pair dot, P is its bf16 operand, so both ways round P to bf16 (as flash-attention does on GPUs) and a row's bits
// do not depend on which one the CPU runs; on the other layers P stays fp32.
//
// Exactness: a row's arithmetic depends only on its own q, its key range and its limit, never on which rows share
// its tile or how many there are (key groups a row does not see are masked to p = 0, and adding 0 * v is exact), so
// a row gives the same bits in MIS and SIS and warm and cold, as the portable and AMX ops do.
// pyscore-vec-layers: avx2 avx512 neon
#pragma once
#include "common/kernel_text.h"
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <utility>
#include <vector>

#include "common/opaque.h"
#include "prefix_item_attention/prefix_item_attention.h"

namespace pyscore {
namespace {

using V::Vec;

constexpr bool kWideRegisters = V::kRegisters >= 32;
constexpr int kTileVecs = kWideRegisters ? 4 : 2;       // vectors per register tile column
constexpr int kChunkKeys = kTileVecs * V::kLanes;       // keys (or output dims) per tile column
constexpr int kVecPerBlock = kKeyBlock / V::kLanes;
constexpr int kStateLanes = std::max(8, V::kLanes);      // a tile's rows (<= 8) padded to whole vectors
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// Element traits. T is the stored type of q, K, V and the output; B the broadcast operand of the tile's products
// (q rows in Q.K^T, P in P.V), one 4-byte unit (kPack elements) per step. step<TM, ZN>() adds, for TM rows, the
// product of row r's unit (b + r * b_stride) with the ZN vectors at `vec` into acc[r][0..ZN).
struct F32 {
  using T = float;
  using B = float;
  static constexpr int kPack = 1;
  static constexpr int kTileRows = 6;  // 6 x kTileVecs accumulators + kTileVecs operands + 1 broadcast
  template <int TM, int ZN>
  static void step(Vec (&acc)[TM][ZN], const B* b, int64_t b_stride, const T* vec) {
    Vec v[ZN];
    for (int z = 0; z < ZN; ++z) v[z] = V::load(vec + z * V::kLanes);
    for (int r = 0; r < TM; ++r) {
      const Vec bc = V::set1(b[r * b_stride]);
      for (int z = 0; z < ZN; ++z) acc[r][z] = V::fma(bc, v[z], acc[r][z]);
    }
  }
  static const B* rows_as_b(const T* q, int32_t, int32_t) { return q; }
  static void store_p(B* dst, Vec p) { V::store(dst, p); }
};

// bf16 pairs widened to fp32, two FMAs per pair, the odd product first; q widened once per call, P kept as fp32.
struct Bf16 {
  using T = uint16_t;
  using B = float;
  static constexpr int kPack = 2;
  static constexpr int kTileRows = kWideRegisters ? 6 : 4;
  template <int TM, int ZN>
  static void step(Vec (&acc)[TM][ZN], const B* b, int64_t b_stride, const T* vec) {
    if constexpr (kWideRegisters) {
      // Each vector widened once for all TM rows, the rows' broadcasts FMA memory operands (see opaque): 6 x 4
      // accumulators and 2 widened vectors fill AVX-512's 32 registers.
      for (int z = 0; z < ZN; ++z) {
        const V::Bits u = V::load_bits(vec + z * V::kLanes * kPack);
        const Vec even = V::bf16_even(u), odd = V::bf16_odd(u);
        const B* bz = opaque(b);
        for (int r = 0; r < TM; ++r)
          acc[r][z] = V::fma(V::set1(bz[r * b_stride]), even, V::fma(V::set1(bz[r * b_stride + 1]), odd, acc[r][z]));
      }
    } else {
      // Without embedded broadcasts, each row's two broadcasts are loaded once for all ZN vectors (4 x 2
      // accumulators, 4 widened vectors and 2 broadcasts in 16 registers).
      Vec even[ZN], odd[ZN];
      for (int z = 0; z < ZN; ++z) {
        const V::Bits u = V::load_bits(vec + z * V::kLanes * kPack);
        even[z] = V::bf16_even(u), odd[z] = V::bf16_odd(u);
      }
      for (int r = 0; r < TM; ++r) {
        const Vec be = V::set1(b[r * b_stride]), bo = V::set1(b[r * b_stride + 1]);
        for (int z = 0; z < ZN; ++z) acc[r][z] = V::fma(be, even[z], V::fma(bo, odd[z], acc[r][z]));
      }
    }
  }
  // q rows [rows, D] widened to fp32 in a per-thread buffer (exact).
  static const B* rows_as_b(const T* q, int32_t rows, int32_t head_dim) {
    thread_local std::vector<float> qf;
    const int64_t n = int64_t(rows) * head_dim;
    if (int64_t(qf.size()) < n) qf.resize(n);
    for (int64_t i = 0; i < n; i += V::kLanes) V::store(qf.data() + i, V::load(q + i));  // D % kChunkKeys == 0
    return qf.data();
  }
  // Where the layer has a pair dot, P rounded to bf16 as Bf16Pairs rounds it (in integer arithmetic: tier avx512,
  // which has no BF16 instruction, runs this path). P is never denormal (exp2_ps flushes below 2^-126).
  static void store_p(B* dst, Vec p) {
    if constexpr (V::kHasBf16Dot) V::store(dst, V::round_as(p, static_cast<const uint16_t*>(nullptr)));
    else V::store(dst, p);
  }
};

// bf16 pairs by the layer's pair dot; q and P stay bf16 pairs (only selected where V::kHasBf16Dot).
struct Bf16Pairs {
  using T = uint16_t;
  using B = uint16_t;
  static constexpr int kPack = 2;
  static constexpr int kTileRows = 6;
  template <int TM, int ZN>
  static void step(Vec (&acc)[TM][ZN], const B* b, int64_t b_stride, const T* vec) {
    V::Bits v[ZN];
    for (int z = 0; z < ZN; ++z) v[z] = V::load_bits(vec + z * V::kLanes * kPack);
    for (int r = 0; r < TM; ++r) {
      const V::Bits bc = V::set1_pair(b + r * b_stride);
      for (int z = 0; z < ZN; ++z) acc[r][z] = V::dot_pairs(acc[r][z], bc, v[z]);
    }
  }
  static const B* rows_as_b(const T* q, int32_t, int32_t) { return q; }
  static void store_p(B* dst, Vec p) { V::store(dst, p); }
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

// V, bf16: keys 2j and 2j+1 interleaved element by element, kZipDims dims at a time (head_dim % kChunkKeys == 0).
void pack_v_bf16(const void* v, int64_t token_stride, int32_t n, int32_t head_dim, void* out) {
  static_assert(kChunkKeys % V::kZipDims == 0);
  auto* dst = static_cast<uint16_t*>(out);
  const auto* src = static_cast<const uint16_t*>(v);
  const int32_t pairs = key_blocks(n) * kKeyBlock / 2;
  for (int32_t j = 0; j < pairs; ++j) {
    const int32_t k0 = 2 * j, k1 = 2 * j + 1;
    uint16_t* step = dst + int64_t(j) * head_dim * 2;
    for (int d = 0; d < head_dim; d += V::kZipDims)
      V::store_zip(step + 2 * d, k0 < n ? src + k0 * token_stride + d : nullptr,
                   k1 < n ? src + k1 * token_stride + d : nullptr);
  }
}

// ---- the attention tile ----------------------------------------------------------------------------------------

// Per-row online-softmax state of one tile, padded to whole vectors so the rescale factors are vector exps.
struct alignas(64) SoftmaxState {
  float max[kStateLanes];    // running max of the base-2 scores
  float sum[kStateLanes];    // running sum of 2^(score - max)
  float alpha[kStateLanes];  // rescale factor of this key block
};

// The first ZN vectors of tile column C of S = Q.K^T (the others 0: keys past every row's limit, masked below). C is
// a template argument so that every index into s and part is a constant and the tile stays in registers.
template <class E, int TM, int C, int ZN>
inline void scores_part(const typename E::B* q, int head_dim, const typename E::T* kblock,
                        Vec (&s)[TM][kVecPerBlock]) {
  constexpr int P = E::kPack;
  Vec part[TM][ZN];
  for (int r = 0; r < TM; ++r)
    for (int z = 0; z < ZN; ++z) part[r][z] = V::zero();
  for (int p = 0; p < head_dim / P; ++p)
    E::template step<TM, ZN>(part, q + p * P, head_dim, kblock + (p * kKeyBlock + C * kChunkKeys) * P);
  for (int r = 0; r < TM; ++r)
    for (int z = 0; z < kTileVecs; ++z) s[r][C * kTileVecs + z] = z < ZN ? part[r][z] : V::zero();
}

// Tile column C with its first `active` vectors multiplied (active in [0, ZN]).
template <class E, int TM, int C, int ZN = kTileVecs>
inline void scores_column(int active, const typename E::B* q, int head_dim, const typename E::T* kblock,
                          Vec (&s)[TM][kVecPerBlock]) {
  if constexpr (ZN > 0) {
    if (active >= ZN) return scores_part<E, TM, C, ZN>(q, head_dim, kblock, s);
    return scores_column<E, TM, C, ZN - 1>(active, q, head_dim, kblock, s);
  } else {
    for (int r = 0; r < TM; ++r)
      for (int z = 0; z < kTileVecs; ++z) s[r][C * kTileVecs + z] = V::zero();
  }
}

// Every tile column of a key block; `keys` = keys of the block below the tile's key_end.
template <class E, int TM, int... C>
inline void scores_columns(std::integer_sequence<int, C...>, int keys, const typename E::B* q, int head_dim,
                           const typename E::T* kblock, Vec (&s)[TM][kVecPerBlock]) {
  (scores_column<E, TM, C>(std::clamp((keys - C * kChunkKeys + V::kLanes - 1) / V::kLanes, 0, kTileVecs), q,
                           head_dim, kblock, s),
   ...);
}

// S = Q.K^T for TM rows x 64 keys of one key block, scaled to base 2 and masked per row to keys < limit. Only the
// vectors of keys below the tile's key_end are multiplied (an item's own keys rarely fill a block).
template <class E, int TM>
inline void scores_block(const typename E::B* q, int head_dim, const typename E::T* kblock, const int* limit,
                         int key0, int key_end, float scale2, Vec (&s)[TM][kVecPerBlock]) {
  scores_columns<E, TM>(std::make_integer_sequence<int, kKeyBlock / kChunkKeys>{}, key_end - key0, q, head_dim,
                        kblock, s);
  const Vec neg_inf = V::set1(kNegInf), scale = V::set1(scale2);
  for (int r = 0; r < TM; ++r)
    for (int z = 0; z < kVecPerBlock; ++z) {
      const V::Mask visible = V::first_lanes(std::clamp(limit[r] - key0 - z * V::kLanes, 0, V::kLanes));
      s[r][z] = V::select(visible, V::mul(s[r][z], scale), neg_inf);
    }
}

// Online-softmax step: new row maxima, rescale factors, P = 2^(S - max) into pbuf (as the P.V broadcast operand)
// and the running sums (from the unrounded P).
template <class E, int TM>
inline void softmax_block(Vec (&s)[TM][kVecPerBlock], SoftmaxState& st, typename E::B (*pbuf)[kKeyBlock]) {
  alignas(64) float prev[kStateLanes] = {}, ref[kStateLanes] = {};
  for (int r = 0; r < TM; ++r) {
    Vec mx = s[r][0];
    for (int z = 1; z < kVecPerBlock; ++z) mx = V::max(mx, s[r][z]);
    prev[r] = st.max[r];
    const float block_max = V::reduce_max(mx);
    if (block_max > st.max[r]) st.max[r] = block_max;
    // A row that has seen no key yet keeps max -inf; subtract 0 instead so 2^(-inf) stays 0, not NaN.
    ref[r] = st.max[r] == kNegInf ? 0.0f : st.max[r];
  }
  for (int r = 0; r < TM; r += V::kLanes)  // one vector on AVX-512 and AVX2 (TM <= 8 lanes), two on NEON
    V::store(st.alpha + r, V::exp2_ps(V::sub(V::load(prev + r), V::load(ref + r))));
  for (int r = 0; r < TM; ++r) {
    const Vec m = V::set1(ref[r]);
    Vec sum = V::zero();
    for (int z = 0; z < kVecPerBlock; ++z) {
      const Vec p = V::exp2_ps(V::sub(s[r][z], m));
      sum = V::add(sum, p);
      E::store_p(pbuf[r] + V::kLanes * z, p);
    }
    st.sum[r] = st.sum[r] * st.alpha[r] + V::reduce_add(sum);
  }
}

// O = alpha * O + P.V for TM rows, kChunkKeys output dims at a time; `steps` = key units of this block that matter.
template <class E, int TM>
inline void pv_block(const typename E::B (*pbuf)[kKeyBlock], const typename E::T* vblock, int steps, int head_dim,
                     const SoftmaxState& st, float* o) {
  constexpr int P = E::kPack;
  for (int c = 0; c < head_dim; c += kChunkKeys) {
    Vec acc[TM][kTileVecs];
    for (int r = 0; r < TM; ++r) {
      const Vec a = V::set1(st.alpha[r]);
      for (int z = 0; z < kTileVecs; ++z) acc[r][z] = V::mul(a, V::load(o + r * head_dim + c + z * V::kLanes));
    }
    for (int j = 0; j < steps; ++j)
      E::template step<TM, kTileVecs>(acc, pbuf[0] + j * P, kKeyBlock, vblock + (int64_t(j) * head_dim + c) * P);
    for (int r = 0; r < TM; ++r)
      for (int z = 0; z < kTileVecs; ++z) V::store(o + r * head_dim + c + z * V::kLanes, acc[r][z]);
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
    Vec s[TM][kVecPerBlock];
    scores_block<E, TM>(q, head_dim, k_packed + block, limit, key0, key_end, scale2, s);
    softmax_block<E, TM>(s, st, pbuf);
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
void attend_tail(int rows, const typename E::B* q, const int32_t* limits, const typename E::T* kp,
                 const typename E::T* vp, int32_t num_keys, int32_t head_dim, float scale2, float* o, float* lse) {
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
  const typename E::B* q = E::rows_as_b(static_cast<const T*>(q_), rows, head_dim);
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

// A row's output rounded as torch rounds (bf16: to nearest even, denormals kept).
template <class T>
void store_row(const float* src, int32_t dim, void* dst_) {
  auto* dst = static_cast<T*>(dst_);
  for (int32_t d = 0; d < dim; d += V::kLanes) V::store(dst + d, V::load(src + d));
}

const AttentionCpuOps kBf16Ops{pack_k<Bf16>, pack_v_bf16, attend<Bf16>, store_row<uint16_t>};
const AttentionCpuOps kF32Ops{pack_k<F32>, pack_v_f32, attend<F32>, store_row<float>};

// nullptr where these ops do not cover the dtype / head_dim (the portable ops do); the caller has checked the CPU.
const AttentionCpuOps* ops_for(const KernelKey& key) {
  if (key.head_dim % kChunkKeys != 0) return nullptr;  // the tiles cover kChunkKeys output dims per pass
  if (key.dtype == DType::kFloat32) return &kF32Ops;
  if (key.dtype != DType::kBFloat16) return nullptr;
  if constexpr (V::kHasBf16Dot) {
    static const AttentionCpuOps pairs{pack_k<Bf16Pairs>, pack_v_bf16, attend<Bf16Pairs>, store_row<uint16_t>};
    if (key.bf16_dot == Bf16Dot::kDpbf16) return &pairs;
  }
  return &kBf16Ops;
}

}  // namespace

// The entry point prefix_item_attention.h declares, named for the layer this text is compiled on (e.g.
// attention_ops_avx2).
const AttentionCpuOps* PYSCORE_VEC_ENTRY(attention_ops)(const KernelKey& key) { return ops_for(key); }

}  // namespace pyscore
