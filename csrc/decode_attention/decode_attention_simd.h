// The CPU decode_attention ops (interface in decode_attention.h: DecodeCpuOps), written once against a vector layer
// `V` and compiled once per layer named below by cmake/cpu_kernels.cmake.
//
// Decode is a matrix-vector product per (sequence, kv head): the few GQA query rows against keys read straight from
// the cache (token-major rows, no packing: every key is read once per step). A chunk (at most kDecodeChunk keys) goes
// in three passes per row rather than an online softmax per block of keys: the scores (keys in blocks of kLanes, per
// key lane-partial dot products that V::transpose_sum turns into one vector of kLanes scores; base 2) and their
// maximum; 2^(score - max) (exp2 without denormals) and their sum; then P.V. The online form chained every block's
// reduce, max, exp and rescale through the row's running state (latency-bound); here only each pass's final
// reduction is serial. The launcher merges chunks by lse.
//
// Compile-time policies, so that one text keeps what each register file wants:
// - Elements (F32, Bf16Widen, Bf16Dpbf16): how a step of a q row meets a key row. bf16 rows are read as pairs (a
//   32-bit lane = elements 2i, 2i+1) and widened by a shift and a mask, no shuffle. Bf16Widen multiplies them by two
//   FMAs in vdpbf16ps's order (odd element first) against q held widened: Bf16Dpbf16's sums bitwise on normal numbers
//   with no BF16 instruction (tier avx512 runs it: key.bf16_dot == kWiden). Bf16Dpbf16 is vdpbf16ps on q's raw pairs,
//   taken only where the layer has the instruction (V::kHasBf16Dot: the avx512 layer) and the tier asks for it.
// - q held or streamed (kHoldQ). The 16-lane layer holds a q row in registers at compile-time head dims 64 and 128
//   (4 or 8 of its 32 zmm, beside the block's 16 partial sums) and takes a whole dot per key; its other head dims go
//   to the AVX2 layer (the dispatch table's next row). The AVX2 layer (16 ymm) and NEON (a 128-dim fp32 row would be
//   all 32 of its registers) stream q at any head dim a multiple of 16 up to kMaxHeadDim: a step of q is loaded once
//   for the block's kLanes keys, whose kLanes partial sums stay in registers (a short block's missing keys read a zero
//   row, so no per-key check).
// - Values: G query rows x VECS output vectors per pass, at most kValueAccs (half the register file) fp32
//   accumulators, compile-time counts so that they stay in registers over a block of keys; each value row's VECS
//   vectors are loaded (bf16: widened) once for the G rows. bf16 values are kept as (even, odd) vectors and put back in
//   element order at the final store (V::store_interleaved). Held q: one pass over the whole row and the whole chunk
//   as one block (G = 4 at 64 dims, 2 at 128); streamed: G <= 2, passes of kValueAccs / G vectors over blocks of
//   kCpuKeyTile keys (a block's values stay in L1 for every row and pass), the sums kept in o between blocks (exact).
// Every output lane's sums run over the keys (and a key's dot over its row) in the same order whatever the grouping,
// passes and blocks, so those change no bit; the bits depend on the layer (its lanes set the dots' partial sums).
// pyscore-vec-layers: avx2 avx512 neon
#pragma once
#include "common/kernel_text.h"
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

#include "decode_attention/decode_attention.h"

namespace pyscore {
namespace {

using V::Vec;

constexpr int kLanes = V::kLanes;  // keys per block of scores
constexpr int kMaxRows = 16;        // GQA query rows per call; more are done in several calls
constexpr int kMaxHeadDim = 256;    // streamed q: the prepared row's room
constexpr bool kHoldQ = V::kLanes == 16;
constexpr int kValueAccs = V::kRegisters / 2;
// Streamed: query rows per value pass. Two on AVX2 (a widened value vector serves two FMAs); one on NEON, where GCC's
// aarch64 code kept a two-row group's accumulators in memory too, a store of each per key (test_register_tiles.py).
constexpr int kStreamGroup = V::kLanes == 4 ? 1 : 2;
// Streamed: at most 8 value vectors per pass. NEON has no memory operands, so a pass's values take registers beside
// its accumulators: 16 of each spilled.
constexpr int kMaxPassVecs = 8;
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

static_assert(kCpuKeyTile % kLanes == 0, "a block of keys never straddles two tiles (pages)");
static_assert(kDecodeChunk % kCpuKeyTile == 0, "whole blocks of scores");

// The keys past the end of a short block (streamed q).
template <class T>
alignas(64) const T kZeroRow[kMaxHeadDim] = {};

// Row t of a chunk's tiles (keys or values: one tile never straddles two pages).
template <class T>
inline const T* row_of(const void* const* tiles, int32_t t, int64_t token_stride) {
  return static_cast<const T*>(tiles[t / kCpuKeyTile]) + (t % kCpuKeyTile) * token_stride;
}

// ---- element policies ------------------------------------------------------------------------------------------
// A q row goes in steps of kStep elements, kQRegs registers of type Q each (q_step); dot_step adds a step of q . k
// into one lane-partial sum. values() gives VECS fp32 vectors of a value row, store_pair() writes two of them (z, z + 1
// for an even z) back in element order. kWholeBlocks: the held form takes a whole block of keys without a per-key check (block_dots_held).

struct F32 {
  using T = float;
  using Q = Vec;
  static constexpr int kStep = kLanes, kQRegs = 1;
  static constexpr bool kWholeBlocks = false;  // at head_dim 128 the unchecked form spills
  static void q_step(const T* q, Q* out) { out[0] = V::load(q); }
  static Vec dot_step(const Q* q, const T* k, Vec acc) { return V::fma(q[0], V::load(k), acc); }
  template <int VECS>
  static void values(const T* v, Vec (&out)[VECS]) {
    PYSCORE_UNROLL for (int z = 0; z < VECS; ++z) out[z] = V::load(v + z * kLanes);
  }
  static void store_pair(float* o, Vec a, Vec b) {
    V::store(o, a);
    V::store(o + kLanes, b);
  }
};

struct Bf16Widen {
  using T = uint16_t;
  using Q = Vec;
  static constexpr int kStep = 2 * kLanes, kQRegs = 2;  // a register of pairs: its even, then its odd elements
  static constexpr bool kWholeBlocks = true;
  static void q_step(const T* q, Q* out) {
    const V::Bits x = V::load_bits(q);
    out[0] = V::bf16_even(x);
    out[1] = V::bf16_odd(x);
  }
  static Vec dot_step(const Q* q, const T* k, Vec acc) {
    const V::Bits x = V::load_bits(k);
    return V::fma(q[0], V::bf16_even(x), V::fma(q[1], V::bf16_odd(x), acc));
  }
  // Vector z (even) the even elements of pair register z / 2, z + 1 its odd ones.
  template <int VECS>
  static void values(const T* v, Vec (&out)[VECS]) {
    static_assert(VECS % 2 == 0, "whole pair registers");
    PYSCORE_UNROLL for (int z = 0; z < VECS; z += 2) {
      const V::Bits x = V::load_bits(v + z * kLanes);
      out[z] = V::bf16_even(x);
      out[z + 1] = V::bf16_odd(x);
    }
  }
  static void store_pair(float* o, Vec even, Vec odd) { V::store_interleaved(o, even, odd); }
};

struct Bf16Dpbf16 : Bf16Widen {
  using Q = V::Bits;
  static constexpr int kQRegs = 1;
  static void q_step(const T* q, Q* out) { out[0] = V::load_bits(q); }
  static Vec dot_step(const Q* q, const T* k, Vec acc) { return V::dot_pairs(acc, q[0], V::load_bits(k)); }
};

// ---- scores ----------------------------------------------------------------------------------------------------

// q . k for a held q row (QR registers).
template <class E, int QR>
inline Vec dot_held(const typename E::Q (&q)[QR], const typename E::T* k) {
  Vec acc = V::zero();
  for (int c = 0; c < QR / E::kQRegs; ++c) acc = E::dot_step(q + c * E::kQRegs, k + c * E::kStep, acc);
  return acc;
}

// The dots of a held q row with the n <= kLanes keys at k, as a vector (lanes past n: 0). A whole bf16 block takes
// no per-key check: with it GCC sent some key rows through a stack slot on their way to vdpbf16ps, a store and a
// reload per key (bench/results/tiers/kernels/decode_attention_avx512_ab.txt); fp32 at head_dim 128 spills in that form.
template <class E, int QR>
inline Vec block_dots_held(const typename E::Q (&q)[QR], const typename E::T* k, int64_t token_stride, int n) {
  Vec partial[kLanes];
  if (E::kWholeBlocks && n == kLanes) {
    const typename E::T* kj = k;
    for (int j = 0; j < kLanes; ++j, kj += token_stride) partial[j] = dot_held<E>(q, kj);
  } else {
    for (int j = 0; j < kLanes; ++j) partial[j] = j < n ? dot_held<E>(q, k + j * token_stride) : V::zero();
  }
  return V::transpose_sum(partial);
}

// The same for a streamed q row (`steps` steps of q_step's registers, in order at qf) and the kLanes key rows `keys`.
template <class E>
inline Vec block_dots_streamed(const typename E::Q* qf, const typename E::T* const (&keys)[kLanes], int steps) {
  Vec partial[kLanes];
  for (int j = 0; j < kLanes; ++j) partial[j] = V::zero();
  for (int c = 0; c < steps; ++c) {
    typename E::Q qc[E::kQRegs];
    for (int i = 0; i < E::kQRegs; ++i) qc[i] = qf[c * E::kQRegs + i];
    for (int j = 0; j < kLanes; ++j) partial[j] = E::dot_step(qc, keys[j] + c * E::kStep, partial[j]);
  }
  return V::transpose_sum(partial);
}

// A block's base-2 scores into s (lanes past the chunk's n keys -inf), folded into the running maximum m.
inline void keep_scores(Vec dots, int n, float scale2, float* s, Vec& m) {
  const Vec sz = V::select(V::first_lanes(n), V::mul(dots, V::set1(scale2)), V::set1(kNegInf));
  V::store(s, sz);
  m = V::max(m, sz);
}

// Row q's base-2 scores over the chunk's keys into s; returns their maximum (finite: the chunk has a key). DZ > 0:
// q held, head_dim = DZ * kLanes; DZ = 0: q streamed.
template <class E, int DZ>
float scores(const typename E::T* q, const void* const* k_tiles, int64_t token_stride, int32_t num_keys,
             int32_t head_dim, float scale2, float* s) {
  using T = typename E::T;
  Vec m = V::set1(kNegInf);
  if constexpr (DZ > 0) {
    constexpr int kSteps = DZ * kLanes / E::kStep;
    typename E::Q qh[kSteps * E::kQRegs];
    for (int c = 0; c < kSteps; ++c) E::q_step(q + c * E::kStep, qh + c * E::kQRegs);
    for (int32_t key0 = 0; key0 < num_keys; key0 += kLanes) {
      const int n = std::min<int32_t>(kLanes, num_keys - key0);
      keep_scores(block_dots_held<E>(qh, row_of<T>(k_tiles, key0, token_stride), token_stride, n), n, scale2,
                  s + key0, m);
    }
  } else {
    const int steps = head_dim / E::kStep;
    alignas(64) typename E::Q qf[kMaxHeadDim / kLanes];
    for (int c = 0; c < steps; ++c) E::q_step(q + c * E::kStep, qf + c * E::kQRegs);
    for (int32_t key0 = 0; key0 < num_keys; key0 += kLanes) {
      const int n = std::min<int32_t>(kLanes, num_keys - key0);
      const T* k = row_of<T>(k_tiles, key0, token_stride);
      const T* keys[kLanes];
      for (int j = 0; j < kLanes; ++j) keys[j] = j < n ? k + j * token_stride : kZeroRow<T>;
      keep_scores(block_dots_streamed<E>(qf, keys, steps), n, scale2, s + key0, m);
    }
  }
  return V::reduce_max(m);
}

// s (base-2 scores) -> 2^(s - max) in place; returns their sum (>= 1: the maximum key contributes 2^0).
inline float exponentials(float* s, int32_t num_keys, float max) {
  const Vec mz = V::set1(max);
  Vec sum = V::zero();
  for (int32_t key0 = 0; key0 < num_keys; key0 += kLanes) {
    const Vec pz = V::exp2_ps(V::sub(V::load(s + key0), mz));  // -inf lanes: 0
    V::store(s + key0, pz);
    sum = V::add(sum, pz);
  }
  return V::reduce_add(sum);
}

// ---- P.V -------------------------------------------------------------------------------------------------------

// A group of query rows' P.V operands: row g's exponentials at p + g * kDecodeChunk, its 1 / sum at inv[g], its
// output at o + g * o_stride.
struct ValueRows {
  const float* p;
  const float* inv;
  float* o;
  int64_t o_stride;
};

// o[g][d0, d0 + VECS lanes) (+)= sum over keys [key0, key1) of p[g][t] v_t for G rows: G x VECS accumulators,
// compile-time counts so that they stay in registers (with a run-time count GCC kept them in memory, a store per
// FMA: bench/results/tiers/kernels/decode_attention_avx2_ab.txt). `first`: the sums start at 0, else from o; `last`: o gets
// inv * the sums in element order, else the sums as they are (bf16: values()' order). Out of line: inlined into the
// AVX2 attend, GCC sent the value rows of a 2-vector pass through a stack slot, a store and a reload per key
// (tests/ops/test_register_tiles.py); a call per block of keys, group and pass is noise beside its 16 keys' FMAs.
template <class E, int G, int VECS>
[[gnu::noinline]] void value_pass(const ValueRows& rows, const void* const* v_tiles, int64_t token_stride, int32_t d0,
                                  int32_t key0, int32_t key1, bool first, bool last) {
  using T = typename E::T;
  static_assert(VECS % 2 == 0, "whole pairs");
  Vec acc[G][VECS];
  PYSCORE_UNROLL for (int g = 0; g < G; ++g)
    PYSCORE_UNROLL for (int z = 0; z < VECS; ++z)
      acc[g][z] = first ? V::zero() : V::load(rows.o + g * rows.o_stride + d0 + z * kLanes);
  for (int32_t t0 = key0; t0 < key1; t0 += kCpuKeyTile) {
    const T* v = row_of<T>(v_tiles, t0, token_stride) + d0;
    const int n = std::min<int32_t>(kCpuKeyTile, key1 - t0);
    for (int j = 0; j < n; ++j) {
      Vec vz[VECS];
      E::values(v + j * token_stride, vz);
      PYSCORE_UNROLL for (int g = 0; g < G; ++g) {
        const Vec pj = V::set1(rows.p[g * kDecodeChunk + t0 + j]);
        PYSCORE_UNROLL for (int z = 0; z < VECS; ++z) acc[g][z] = V::fma(pj, vz[z], acc[g][z]);
      }
    }
  }
  PYSCORE_UNROLL for (int g = 0; g < G; ++g) {
    float* o = rows.o + g * rows.o_stride + d0;
    const Vec inv = V::set1(rows.inv[g]);
    PYSCORE_UNROLL for (int z = 0; z < VECS; z += 2) {
      if (last) E::store_pair(o + z * kLanes, V::mul(inv, acc[g][z]), V::mul(inv, acc[g][z + 1]));
      else F32::store_pair(o + z * kLanes, acc[g][z], acc[g][z + 1]);
    }
  }
}

// value_pass over vecs <= VECS vectors (vecs even: head_dim is a multiple of 16), VECS a compile-time count.
template <class E, int G, int VECS>
void value_pass_upto(int vecs, const ValueRows& rows, const void* const* v_tiles, int64_t token_stride, int32_t d0,
                     int32_t key0, int32_t key1, bool first, bool last) {
  if constexpr (VECS > 2) {
    if (vecs < VECS)
      return value_pass_upto<E, G, VECS - 2>(vecs, rows, v_tiles, token_stride, d0, key0, key1, first, last);
  }
  value_pass<E, G, VECS>(rows, v_tiles, token_stride, d0, key0, key1, first, last);
}

// G rows over keys [key0, key1): held q, one pass over the row's DZ vectors; streamed, passes of kValueAccs / G.
template <class E, int DZ, int G>
void value_group(const ValueRows& rows, const void* const* v_tiles, int64_t token_stride, int32_t head_dim,
                 int32_t key0, int32_t key1, bool first, bool last) {
  if constexpr (DZ > 0) {
    value_pass<E, G, DZ>(rows, v_tiles, token_stride, 0, key0, key1, first, last);
  } else {
    constexpr int kVecs = std::min(kValueAccs / G, kMaxPassVecs);
    for (int32_t d0 = 0; d0 < head_dim; d0 += kVecs * kLanes)
      value_pass_upto<E, G, kVecs>((head_dim - d0) / kLanes, rows, v_tiles, token_stride, d0, key0, key1, first,
                                   last);
  }
}

// value_group for g <= G rows, G a compile-time count.
template <class E, int DZ, int G>
void value_group_upto(int32_t g, const ValueRows& rows, const void* const* v_tiles, int64_t token_stride,
                      int32_t head_dim, int32_t key0, int32_t key1, bool first, bool last) {
  if constexpr (G > 1) {
    if (g < G)
      return value_group_upto<E, DZ, G - 1>(g, rows, v_tiles, token_stride, head_dim, key0, key1, first, last);
  }
  value_group<E, DZ, G>(rows, v_tiles, token_stride, head_dim, key0, key1, first, last);
}

// o[r] = sum_t p[r][t] v_t / sum[r] for every row: blocks of keys (held q: the whole chunk), in each the rows in
// groups of kGroup.
template <class E, int DZ>
void weighted_values(const float* p, int32_t rows, const void* const* v_tiles, int64_t token_stride,
                     int32_t num_keys, int32_t head_dim, const float* sum, float* o) {
  constexpr int kGroup = DZ > 0 ? kValueAccs / DZ : kStreamGroup;
  constexpr int32_t kBlock = DZ > 0 ? kDecodeChunk : kCpuKeyTile;
  float inv[kMaxRows];
  for (int32_t r = 0; r < rows; ++r) inv[r] = 1.0f / sum[r];
  for (int32_t key0 = 0; key0 < num_keys; key0 += kBlock) {
    const int32_t key1 = std::min(num_keys, key0 + kBlock);
    for (int32_t r = 0; r < rows; r += kGroup) {
      const ValueRows group{p + r * kDecodeChunk, inv + r, o + int64_t(r) * head_dim, head_dim};
      value_group_upto<E, DZ, kGroup>(std::min<int32_t>(kGroup, rows - r), group, v_tiles, token_stride, head_dim,
                                      key0, key1, key0 == 0, key1 == num_keys);
    }
  }
}

// ---- the ops ---------------------------------------------------------------------------------------------------

// At most kMaxRows rows against the chunk's keys: the three passes.
template <class E, int DZ>
void attend(const void* q_, int64_t q_row_stride, int32_t rows, const void* const* k_tiles,
            const void* const* v_tiles, int64_t token_stride, int32_t num_keys, int32_t head_dim, float scale, float* o,
            float* lse) {
  const auto* q = static_cast<const typename E::T*>(q_);
  alignas(64) float p[kMaxRows * kDecodeChunk];  // the rows' scores, then their exponentials
  float sum[kMaxRows];
  for (int32_t r = 0; r < rows; ++r) {
    float* pr = p + r * kDecodeChunk;
    const float max = scores<E, DZ>(q + r * q_row_stride, k_tiles, token_stride, num_keys, head_dim, scale * kLog2e,
                                    pr);
    sum[r] = exponentials(pr, num_keys, max);
    lse[r] = max * kLn2 + std::log(sum[r]);
  }
  weighted_values<E, DZ>(p, rows, v_tiles, token_stride, num_keys, head_dim, sum, o);
}

// More rows than kMaxRows in consecutive calls of up to kMaxRows.
template <class E, int DZ>
void attend_rows(const void* q, int64_t q_row_stride, int32_t rows, const void* const* k, const void* const* v,
                 int64_t token_stride, int32_t num_keys, int32_t head_dim, float scale, float* o, float* lse) {
  const int32_t d = DZ > 0 ? DZ * kLanes : head_dim;
  for (int32_t r = 0; r < rows; r += kMaxRows)
    attend<E, DZ>(static_cast<const typename E::T*>(q) + r * q_row_stride, q_row_stride,
                  std::min(kMaxRows, rows - r), k, v, token_stride, num_keys, d, scale, o + int64_t(r) * d, lse + r);
}

template <class T>
void store_row(const float* src, int32_t dim, void* dst_) {
  auto* dst = static_cast<T*>(dst_);
  for (int32_t d = 0; d < dim; d += kLanes) V::store(dst + d, V::load(src + d));
}

template <class E, int DZ>
const DecodeCpuOps kOps{attend_rows<E, DZ>, store_row<typename E::T>};

// One element policy's ops at a head dim this layer covers, or nullptr.
template <class E>
const DecodeCpuOps* ops_for(int32_t head_dim) {
  if constexpr (kHoldQ) {
    if (head_dim == 64) return &kOps<E, 64 / kLanes>;
    if (head_dim == 128) return &kOps<E, 128 / kLanes>;
    return nullptr;
  } else {
    // Whole bf16 pair steps of 16 elements on every layer, and the prepared row's room.
    return head_dim > 0 && head_dim % 16 == 0 && head_dim <= kMaxHeadDim ? &kOps<E, 0> : nullptr;
  }
}

// bf16: vdpbf16ps where the layer has it and the tier asks for it, else the widened pairs.
template <bool kDpbf16 = V::kHasBf16Dot>
const DecodeCpuOps* bf16_ops(const KernelKey& key) {
  if constexpr (kDpbf16) {
    if (key.bf16_dot == Bf16Dot::kDpbf16) return ops_for<Bf16Dpbf16>(key.head_dim);
  }
  return ops_for<Bf16Widen>(key.head_dim);
}

}  // namespace

const DecodeCpuOps* PYSCORE_VEC_ENTRY(decode_ops)(const KernelKey& key) {
  if (key.dtype == DType::kBFloat16) return bf16_ops(key);
  if (key.dtype == DType::kFloat32) return ops_for<F32>(key.head_dim);
  return nullptr;
}

}  // namespace pyscore
