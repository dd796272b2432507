// The ops of the CPU label_logprobs kernel (interface in label_logprobs.h), written once against a vector layer `V`
// (common/vec_avx2.h, 8 lanes; vec_avx512.h, 16; vec_neon.h, 4) and compiled once per layer named below by
// cmake/cpu_kernels.cmake, which binds `V` and names the entry point.
//
// The LM head product for R read-out rows is a skinny GEMM bound by streaming the [V, H] weight: each register tile
// takes VT weight rows and RT hidden rows, so every weight vector loaded serves all the tile's rows and the weight
// tile stays in L1 while the following row tiles reuse it. Dot products run along H in lane-partial accumulators
// reduced at the end (four at a time where VT is 4). The tiles are sized by the layer's register count: 16 (AVX2;
// NEON, see vec_neon.h), at most 13 in use, or AVX-512's 32. bf16 pairs are multiplied two ways, the same bits on normal numbers:
// widened (the hidden rows once per chunk into a de-interleaved fp32 copy: per kStep = 2 kLanes elements, the kLanes
// even then the kLanes odd; each weight vector of kLanes pairs widened in registers, a shift and a mask; two FMAs per
// pair, the odd product first), or by the layer's pair dot where it has one (vdpbf16ps, key.bf16_dot kDpbf16: fast on
// AMD, half the FMA rate on Intel). A bf16 head under fp32 rows (label_logprobs.h's bf16_weight) runs the fp32 steps,
// each weight vector widened as it is loaded. A logit's bits depend only on its row, its weight row and its place in
// the vocabulary chunk (a 4-wide column or the ragged rest), never on the number of rows. NEON's speed on ARM has not
// been measured, only its results, under qemu-aarch64 (tests/cpu/kernel_check.cpp).
// pyscore-vec-layers: avx2 avx512 neon
#pragma once
#include "common/kernel_text.h"
#include <climits>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "label_logprobs/label_logprobs.h"

namespace pyscore {
namespace {

using V::Vec;

// Weight rows ahead to prefetch while a tile computes: covers DRAM latency even at R = 1, where a tile is short.
// They go to L2 (V::prefetch), not L1: 16 rows ahead are 32 KB at H = 1024, a whole L1 of Zen 4, and pulled into L1
// they evicted the hidden rows and the weight tile being read (bench/results/tiers/kernels/label_prefetch_l2_ab.txt).
constexpr int kPrefetchRows = 16;
constexpr bool kWideRegisters = V::kRegisters >= 32;
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// Hidden rows as the steps read them: fp32, rows `stride` apart.
struct FloatRows {
  const float* data;
  int64_t stride;
  const float* row(int r) const { return data + r * stride; }
};

// Element traits. kStep elements of H per step; a weight step is kParts vectors (fp32: kLanes values; bf16: the
// even and odd elements of kLanes pairs); Hidden is the hidden rows in the form the steps read (fp32 as given; bf16
// widened).
// W is the weight's element: fp32, or bf16 (uint16_t) under fp32 hidden rows (fp32 serving of a bf16 checkpoint's
// LM head: label_logprobs.h's bf16_weight). V::load of bf16 widens kLanes consecutive elements in their order (a
// shift, exact), so every lane's chain over H is the fp32 weight's: the same bits at half the bytes read.
template <class W>
struct F32Of {
  using T = float;
  using Weight = W;
  using Operand = Vec;
  static constexpr int kStep = V::kLanes, kParts = 1;
  // 16 registers: 9 accumulators + 3 weight vectors + 1 hidden; 3 x 3 rather than 4 x 2: fewer loads per FMA and a
  // bf16 weight widened once per 3 rows: the fp32 read-out 1.07-1.17x at 3-16 rows, 0.96-1.03x at 1-2, on a Zen 1
  // (bench/results/tiers/kernels/labels_avx2_bf16_head_ab.txt). 32: 24 accumulators + 4 + 1.
  static constexpr int kWeightRows = kWideRegisters ? 4 : 3, kTileRows = kWideRegisters ? 6 : 3;
  using Hidden = FloatRows;
  static Hidden hidden_rows(const T* h, int64_t stride, int, int) { return {h, stride}; }
  static void weights_full(const W* w, int i, Vec (&out)[kParts]) { out[0] = V::load(w + i); }
  static void weights(const W* w, int i, int hidden, Vec (&out)[kParts]) {
    out[0] = V::load_first(w + i, hidden - i);
  }
  static void hiddens_full(const float* h, int i, Vec (&out)[kParts]) { out[0] = V::load(h + i); }
  static void hiddens(const float* h, int i, int hidden, Vec (&out)[kParts]) {
    out[0] = V::load_first(h + i, hidden - i);
  }
  static Vec dot(Vec acc, const Vec (&h)[kParts], const Vec (&w)[kParts]) { return V::fma(h[0], w[0], acc); }
};
using F32 = F32Of<float>;
using F32Bf16Weight = F32Of<uint16_t>;

struct Bf16 {
  using T = uint16_t;
  using Weight = T;
  using Operand = Vec;
  static constexpr int kStep = 2 * V::kLanes, kParts = 2;
  // 16 registers: 6 accumulators + 4 widened weight vectors + 2 hidden; 32: 16 + 8 + 2.
  static constexpr int kWeightRows = kWideRegisters ? 4 : 2, kTileRows = kWideRegisters ? 4 : 3;
  using Hidden = FloatRows;
  // Per kStep-element block of a row: its kLanes even elements then its kLanes odd ones as fp32, the ragged end
  // zero-filled.
  static Hidden hidden_rows(const T* h, int64_t h_stride, int rows, int hidden) {
    thread_local std::vector<float> buf;
    const int blocks = (hidden + kStep - 1) / kStep;
    const int64_t stride = int64_t(blocks) * kStep;
    if (int64_t(buf.size()) < rows * stride) buf.resize(rows * stride);
    for (int r = 0; r < rows; ++r)
      for (int b = 0; b < blocks; ++b) {
        const V::Bits x = pairs(h + r * h_stride, kStep * b, hidden);
        V::store(buf.data() + r * stride + kStep * b, V::bf16_even(x));
        V::store(buf.data() + r * stride + kStep * b + V::kLanes, V::bf16_odd(x));
      }
    return {buf.data(), stride};
  }
  static void weights_full(const T* w, int i, Vec (&out)[kParts]) { widen(V::load_bits(w + i), out); }
  static void weights(const T* w, int i, int hidden, Vec (&out)[kParts]) { widen(pairs(w, i, hidden), out); }
  static void widen(V::Bits x, Vec (&out)[kParts]) {
    out[0] = V::bf16_even(x);
    out[1] = V::bf16_odd(x);
  }
  // The widened rows are zero-filled to whole steps: no ragged load.
  static void hiddens_full(const float* h, int i, Vec (&out)[kParts]) {
    out[0] = V::load(h + i);
    out[1] = V::load(h + i + V::kLanes);
  }
  static void hiddens(const float* h, int i, int, Vec (&out)[kParts]) { hiddens_full(h, i, out); }
  // The odd product first, as vdpbf16ps adds them (the AVX-512 widened path does the same).
  static Vec dot(Vec acc, const Vec (&h)[kParts], const Vec (&w)[kParts]) {
    return V::fma(h[0], w[0], V::fma(h[1], w[1], acc));
  }
  // kStep bf16 from p + i as kLanes pairs, zero past `hidden`.
  static V::Bits pairs(const T* p, int i, int hidden) {
    if (hidden - i >= kStep) return V::load_bits(p + i);
    alignas(32) uint16_t buf[kStep] = {};
    std::memcpy(buf, p + i, size_t(hidden - i) * sizeof(T));
    return V::load_bits(buf);
  }
};

// bf16 pairs by the layer's pair dot (V::dot_pairs: vdpbf16ps where V::kHasBf16Dot), the hidden rows read as they
// are: one instruction per step and weight row instead of two FMAs and the widening, the same bits.
struct Bf16Pairs {
  using T = uint16_t;
  using Weight = T;
  using Operand = V::Bits;
  static constexpr int kStep = 2 * V::kLanes, kParts = 1;
  static constexpr int kWeightRows = 4, kTileRows = 6;  // 24 accumulators + 4 weight vectors + 1 hidden
  struct Hidden {
    const T* data;
    int64_t stride;
    const T* row(int r) const { return data + r * stride; }
  };
  static Hidden hidden_rows(const T* h, int64_t stride, int, int) { return {h, stride}; }
  static void weights_full(const T* w, int i, Operand (&out)[kParts]) { out[0] = V::load_bits(w + i); }
  static void weights(const T* w, int i, int hidden, Operand (&out)[kParts]) { out[0] = Bf16::pairs(w, i, hidden); }
  static void hiddens_full(const T* h, int i, Operand (&out)[kParts]) { out[0] = V::load_bits(h + i); }
  static void hiddens(const T* h, int i, int hidden, Operand (&out)[kParts]) { out[0] = Bf16::pairs(h, i, hidden); }
  static Vec dot(Vec acc, const Operand (&h)[kParts], const Operand (&w)[kParts]) {
    return V::dot_pairs(acc, h[0], w[0]);
  }
};

// One step of dot_tile: elements [i, i + kStep) of the tile's rows into acc. kFull: the whole step lies inside
// `hidden` (plain loads); else the ragged last step (zero-filled past `hidden`). The two kinds are separate loops in
// dot_tile so that the main loop has no branch: with the bounds check inside it, GCC kept the accumulators in
// memory, a store per FMA (the same bits in registers: R=16 on one thread 40-42 -> 27-36 ms at tier avx2,
// bench/results/tiers/kernels/labels_avx2_ab.txt).
template <class E, int VT, int RT, bool kFull>
inline __attribute__((always_inline)) void dot_step(Vec (&acc)[RT][VT], const typename E::Weight* w,
                                                    int64_t w_stride, typename E::Hidden h, int i, int hidden) {
  typename E::Operand wv[VT][E::kParts];
  PYSCORE_UNROLL for (int v = 0; v < VT; ++v) {
    if constexpr (kFull) E::weights_full(w + v * w_stride, i, wv[v]);
    else E::weights(w + v * w_stride, i, hidden, wv[v]);
  }
  PYSCORE_UNROLL for (int r = 0; r < RT; ++r) {
    typename E::Operand hv[E::kParts];
    if constexpr (kFull) E::hiddens_full(h.row(r), i, hv);
    else E::hiddens(h.row(r), i, hidden, hv);
    PYSCORE_UNROLL for (int v = 0; v < VT; ++v) acc[r][v] = E::dot(acc[r][v], hv, wv[v]);
  }
}

// out[r * out_stride + v] = h[r] . w[v] for RT hidden rows x VT weight rows. With `prefetch`, also pulls the same
// span of the weight rows kPrefetchRows ahead into cache.
template <class E, int VT, int RT>
void dot_tile(const typename E::Weight* w, int64_t w_stride, typename E::Hidden h, int hidden, float* out,
              int64_t out_stride, bool prefetch) {
  Vec acc[RT][VT];
  PYSCORE_UNROLL for (int r = 0; r < RT; ++r)
    PYSCORE_UNROLL for (int v = 0; v < VT; ++v) acc[r][v] = V::zero();
  int i = 0;
  for (; i + E::kStep <= hidden; i += E::kStep) {
    if (prefetch && (i * sizeof(typename E::Weight)) % 64 == 0)  // one prefetch per cache line of each row
      PYSCORE_UNROLL for (int v = 0; v < VT; ++v) V::prefetch(w + (kPrefetchRows + v) * w_stride + i);
    dot_step<E, VT, RT, true>(acc, w, w_stride, h, i, hidden);
  }
  if (i < hidden) dot_step<E, VT, RT, false>(acc, w, w_stride, h, i, hidden);
  PYSCORE_UNROLL for (int r = 0; r < RT; ++r) {
    if constexpr (VT == 4) V::reduce_add4(acc[r][0], acc[r][1], acc[r][2], acc[r][3], out + r * out_stride);
    else
      PYSCORE_UNROLL for (int v = 0; v < VT; ++v) out[r * out_stride + v] = V::reduce_add(acc[r][v]);
  }
}

// The last `rows` (< kTileRows) hidden rows: one tile of exactly that many.
template <class E, int VT, int N>
void dot_tail(int rows, const typename E::Weight* w, int64_t w_stride, typename E::Hidden h, int hidden, float* out,
              int64_t out_stride, bool prefetch) {
  if constexpr (N > 0) {
    if (rows == N) return dot_tile<E, VT, N>(w, w_stride, h, hidden, out, out_stride, prefetch);
    dot_tail<E, VT, N - 1>(rows, w, w_stride, h, hidden, out, out_stride, prefetch);
  }
}

// VT weight rows against all hidden rows, kTileRows at a time (later row tiles find the weight tile in L1).
template <class E, int VT>
void dot_column(const typename E::Weight* w, int64_t w_stride, typename E::Hidden h, int rows, int hidden, float* out,
                int64_t out_stride, bool prefetch) {
  constexpr int RT = E::kTileRows;
  int r = 0;
  for (; r + RT <= rows; r += RT)
    dot_tile<E, VT, RT>(w, w_stride, {h.row(r), h.stride}, hidden, out + r * out_stride, out_stride,
                        prefetch && r == 0);
  dot_tail<E, VT, RT - 1>(rows - r, w, w_stride, {h.row(r), h.stride}, hidden, out + r * out_stride, out_stride,
                          prefetch && r == 0);
}

// Given logits: just widen them to fp32.
template <class E>
void copy_logits(const LabelLogprobsParams& p, int32_t v0, int32_t n, float* out) {
  const auto* x = static_cast<const typename E::T*>(p.hidden);
  for (int32_t r = 0; r < p.num_rows; ++r) {
    const typename E::T* src = x + r * p.hidden_row_stride + v0;
    float* dst = out + int64_t(r) * n;
    for (int32_t j = 0; j < n; j += V::kLanes) V::store_n(dst + j, V::load_n(src + j, n - j), n - j);
  }
}

// A bf16 head under up to kInRegisterRows fp32 rows is widened in registers by each row tile that reads it (decode:
// the head streams from memory and the widening hides under it). More rows widen each column of VT weight rows
// once into a per-thread fp32 copy (VT x H: L1 or L2) that the fp32 tiles read: there the read-out is bound by
// arithmetic and every row tile would widen the same vectors again. Against the fp32 head on a Zen 1 (16
// registers): in registers 1.5-1.9x at 1-2 rows, 1.3-1.5x at 3, 0.92-1.02x at 8; the copy 0.86-0.96x at 12-16 rows
// (bench/results/tiers/kernels/labels_avx2_bf16_head_ab.txt). With 32
// registers (6-row tiles) the widening is shared by more rows: in registers always.
constexpr int kInRegisterRows = kWideRegisters ? INT_MAX : 9;

template <int VT>
void dot_column_widened(const uint16_t* w, int64_t w_stride, FloatRows h, int rows, int hidden, float* out,
                        int64_t out_stride, bool prefetch) {
  thread_local std::vector<float> wide;
  if (int64_t(wide.size()) < int64_t(VT) * hidden) wide.resize(size_t(VT) * hidden);
  PYSCORE_UNROLL for (int v = 0; v < VT; ++v) {
    const uint16_t* src = w + v * w_stride;
    float* dst = wide.data() + int64_t(v) * hidden;
    for (int i = 0; i < hidden; i += V::kLanes) {
      if (prefetch && i % 32 == 0) V::prefetch(src + kPrefetchRows * w_stride + i);  // a cache line of bf16
      V::store_n(dst + i, V::load_n(src + i, hidden - i), hidden - i);
    }
  }
  dot_column<F32, VT>(wide.data(), hidden, h, rows, hidden, out, out_stride, false);
}

template <class E>
void logits_chunk(const LabelLogprobsParams& p, int32_t v0, int32_t n, float* out) {
  if (!p.weight) return copy_logits<E>(p, v0, n, out);
  constexpr int VT = E::kWeightRows;
  const auto* w = static_cast<const typename E::Weight*>(p.weight) + v0 * p.weight_row_stride;
  const typename E::Hidden h =
      E::hidden_rows(static_cast<const typename E::T*>(p.hidden), p.hidden_row_stride, p.num_rows, p.hidden_size);
  // Prefetch only where the rows ahead are still this chunk's or the next one's: never past the vocabulary.
  const int32_t safe_end = p.vocab_size - v0 - kPrefetchRows - VT;
  int32_t j = 0;
  if constexpr (std::is_same_v<E, F32Bf16Weight>) {
    if (p.num_rows > kInRegisterRows) {
      for (; j + VT <= n; j += VT)
        dot_column_widened<VT>(w + j * p.weight_row_stride, p.weight_row_stride, h, p.num_rows, p.hidden_size,
                               out + j, n, j <= safe_end);
      for (; j < n; ++j)
        dot_column_widened<1>(w + j * p.weight_row_stride, p.weight_row_stride, h, p.num_rows, p.hidden_size,
                              out + j, n, false);
      return;
    }
  }
  for (; j + VT <= n; j += VT)
    dot_column<E, VT>(w + j * p.weight_row_stride, p.weight_row_stride, h, p.num_rows, p.hidden_size, out + j, n,
                      j <= safe_end);
  for (; j < n; ++j)
    dot_column<E, 1>(w + j * p.weight_row_stride, p.weight_row_stride, h, p.num_rows, p.hidden_size, out + j, n,
                     false);
}

void lse_update(const float* x, int32_t n, float* max, float* sum) {
  Vec mx = V::set1(kNegInf);
  for (int32_t j = 0; j < n; j += V::kLanes) {
    mx = V::max(mx, V::select(V::first_lanes(n - j), V::load_n(x + j, n - j), V::set1(kNegInf)));
  }
  const float chunk_max = V::reduce_max(mx);
  const float new_max = chunk_max > *max ? chunk_max : *max;
  if (new_max == kNegInf) return;  // nothing but -inf so far
  // exp(x - m) = 2^((x - m) log2 e); the subtraction first keeps the argument exact near the maximum. Lanes past n
  // are -inf, so their 2^(-inf) is 0.
  const Vec m = V::set1(new_max), log2e = V::set1(kLog2e);
  Vec acc = V::zero();
  for (int32_t j = 0; j < n; j += V::kLanes) {
    const Vec xj = V::select(V::first_lanes(n - j), V::load_n(x + j, n - j), V::set1(kNegInf));
    acc = V::add(acc, V::exp2_ps(V::mul(V::sub(xj, m), log2e)));
  }
  const float rescale = *max == kNegInf ? 0.0f : std::exp(*max - new_max);
  *sum = *sum * rescale + V::reduce_add(acc);
  *max = new_max;
}

const LabelCpuOps kBf16Ops{logits_chunk<Bf16>, lse_update};
const LabelCpuOps kF32Ops{logits_chunk<F32>, lse_update};
const LabelCpuOps kF32Bf16WeightOps{logits_chunk<F32Bf16Weight>, lse_update};

// nullptr where the key is not covered. bf16 takes the pair dot where the layer has one and the tier asks for it.
const LabelCpuOps* ops_for(const KernelKey& key) {
  if (key.dtype == DType::kFloat32) return key.bf16_weight ? &kF32Bf16WeightOps : &kF32Ops;
  if (key.dtype != DType::kBFloat16 || key.bf16_weight) return nullptr;
  if constexpr (V::kHasBf16Dot) {
    static const LabelCpuOps pairs{logits_chunk<Bf16Pairs>, lse_update};
    if (key.bf16_dot == Bf16Dot::kDpbf16) return &pairs;
  }
  return &kBf16Ops;
}

}  // namespace

// The entry point label_logprobs.h declares, named for the layer this text is compiled on (e.g. label_ops_avx2).
const LabelCpuOps* PYSCORE_VEC_ENTRY(label_ops)(const KernelKey& key) { return ops_for(key); }

}  // namespace pyscore
