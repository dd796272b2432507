// AVX-512 ops of the CPU label_logprobs kernel (interface in label_logprobs.h).
//
// The LM head product for R read-out rows is a skinny GEMM bound by streaming the [V, H] weight, so each tile
// takes 4 weight rows and up to 6 hidden rows: every weight zmm loaded is used by all the tile's rows, and the
// weight tile (4 x H) stays in L1 while the following row tiles reuse it. Dot products run along H (vdpbf16ps
// on bf16 pairs, FMA on fp32) in lane-partial accumulators that are reduced 4 at a time at the end. On CPUs where
// vdpbf16ps is slow (Bf16Dot::kWiden) bf16 pairs are widened to fp32 instead: the hidden rows once per chunk into a
// de-interleaved fp32 copy, each weight zmm in registers, and two FMAs per pair in vdpbf16ps's order give the
// same bits.
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "common/vec_math_avx512.h"
#include "label_logprobs/label_logprobs.h"

namespace pyscore {
namespace {

using namespace avx512;

constexpr int kWeightRows = 4;  // per tile
constexpr int kMaxTileRows = 6; // hidden rows per tile: 6 x 4 accumulators + 4 + 6 operands <= 32 zmm
// Weight rows ahead to prefetch while a tile computes: covers DRAM latency even at R = 1, where a tile is short.
// They go to L2, not L1: 16 rows ahead are 32 KB at H = 1024, a whole L1 of Zen 4, and pulled into L1 they
// evicted the hidden rows and the weight tile being read. To L2 the LM head read 1.2-2x faster on a Zen 4
// (bench/results/tiers/label_prefetch_l2_ab.txt).
constexpr int kPrefetchRows = 16;
constexpr _mm_hint kPrefetchHint = _MM_HINT_T1;
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// T: the hidden rows' element, W: the weight's (load_w reads kLanes of it as step operands).
struct Bf16 {
  using T = uint16_t;
  using W = T;
  static constexpr int kLanes = 32;  // elements per zmm
  static __m512 load(const T* p) { return _mm512_loadu_ps(p); }
  static __m512 load_first(const T* p, int count) {
    return _mm512_castsi512_ps(_mm512_maskz_loadu_epi16(__mmask32((uint64_t(1) << count) - 1), p));
  }
  static __m512 dot(__m512 acc, __m512 a, __m512 b) { return _mm512_dpbf16_ps(acc, (__m512bh)a, (__m512bh)b); }
  static __m512 to_f32(const T* p) { return load_bf16_ps(p); }
  static __m512 to_f32_first(const T* p, int count) { return maskz_load_bf16_ps(__mmask16((1u << count) - 1), p); }
  static __m512 load_w(const W* p) { return load(p); }
  static __m512 load_w_first(const W* p, int count) { return load_first(p, count); }
};

struct F32 {
  using T = float;
  using W = T;
  static constexpr int kLanes = 16;
  static __m512 load(const T* p) { return _mm512_loadu_ps(p); }
  static __m512 load_first(const T* p, int count) { return _mm512_maskz_loadu_ps(__mmask16((1u << count) - 1), p); }
  static __m512 dot(__m512 acc, __m512 a, __m512 b) { return _mm512_fmadd_ps(a, b, acc); }
  static __m512 to_f32(const T* p) { return _mm512_loadu_ps(p); }
  static __m512 to_f32_first(const T* p, int count) { return load_first(p, count); }
  static __m512 load_w(const W* p) { return load(p); }
  static __m512 load_w_first(const W* p, int count) { return load_first(p, count); }
};

// A bf16 LM head under fp32 hidden rows (label_logprobs.h's bf16_weight): F32's steps, each weight vector widened
// exactly as it is loaded, so every logit is bitwise the fp32 head's.
struct F32Bf16Weight : F32 {
  using W = uint16_t;
  static __m512 load_w(const W* p) { return load_bf16_ps(p); }
  static __m512 load_w_first(const W* p, int count) { return maskz_load_bf16_ps(__mmask16((1u << count) - 1), p); }
};

// The 4 horizontal sums of a0..a3, in one xmm: fold 512 -> 128 bits across the four, then within lanes.
inline __m128 reduce4(__m512 a0, __m512 a1, __m512 a2, __m512 a3) {
  const __m512 s01 = _mm512_add_ps(_mm512_shuffle_f32x4(a0, a1, 0x44), _mm512_shuffle_f32x4(a0, a1, 0xEE));
  const __m512 s23 = _mm512_add_ps(_mm512_shuffle_f32x4(a2, a3, 0x44), _mm512_shuffle_f32x4(a2, a3, 0xEE));
  // 128-bit lane i now holds 4 partial sums of a_i.
  __m512 t = _mm512_add_ps(_mm512_shuffle_f32x4(s01, s23, 0x88), _mm512_shuffle_f32x4(s01, s23, 0xDD));
  t = _mm512_add_ps(t, _mm512_permute_ps(t, _MM_SHUFFLE(2, 3, 0, 1)));
  t = _mm512_add_ps(t, _mm512_permute_ps(t, _MM_SHUFFLE(1, 0, 3, 2)));
  const __m512i first_of_lanes = _mm512_setr_epi32(0, 4, 8, 12, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0);
  return _mm512_castps512_ps128(_mm512_permutexvar_ps(first_of_lanes, t));
}

// out[r * out_stride + v] = h[r] . w[v] for RT hidden rows x VT (4 or 1) weight rows. With `prefetch`, also
// pulls the same span of the weight rows kPrefetchRows ahead into cache (one line per row and step).
template <class E, int VT, int RT>
void dot_tile(const typename E::W* w, int64_t w_stride, const typename E::T* h, int64_t h_stride, int hidden,
              float* out, int64_t out_stride, bool prefetch) {
  __m512 acc[RT][VT];
  for (int r = 0; r < RT; ++r)
    for (int v = 0; v < VT; ++v) acc[r][v] = _mm512_setzero_ps();
  int i = 0;
  for (; i + E::kLanes <= hidden; i += E::kLanes) {
    __m512 wv[VT];
    for (int v = 0; v < VT; ++v) wv[v] = E::load_w(w + v * w_stride + i);
    if (prefetch)
      for (int v = 0; v < VT; ++v)
        _mm_prefetch(reinterpret_cast<const char*>(w + (kPrefetchRows + v) * w_stride + i), kPrefetchHint);
    for (int r = 0; r < RT; ++r) {
      const __m512 hv = E::load(h + r * h_stride + i);
      for (int v = 0; v < VT; ++v) acc[r][v] = E::dot(acc[r][v], hv, wv[v]);
    }
  }
  if (i < hidden) {  // zero-filled tail: contributes nothing beyond `hidden`
    const int rest = hidden - i;
    __m512 wv[VT];
    for (int v = 0; v < VT; ++v) wv[v] = E::load_w_first(w + v * w_stride + i, rest);
    for (int r = 0; r < RT; ++r) {
      const __m512 hv = E::load_first(h + r * h_stride + i, rest);
      for (int v = 0; v < VT; ++v) acc[r][v] = E::dot(acc[r][v], hv, wv[v]);
    }
  }
  for (int r = 0; r < RT; ++r) {
    if constexpr (VT == 4) _mm_storeu_ps(out + r * out_stride, reduce4(acc[r][0], acc[r][1], acc[r][2], acc[r][3]));
    else out[r * out_stride] = _mm512_reduce_add_ps(acc[r][0]);
  }
}

// Hidden rows widened for the kWiden path: per 32-element block of a row, its 16 even elements then its 16 odd
// ones as fp32 (exact), the ragged last block zero-filled; rows `stride` floats apart.
struct WidenedRows {
  const float* data;
  int64_t stride;
};

WidenedRows widen_rows(const uint16_t* h, int64_t h_stride, int rows, int hidden) {
  thread_local std::vector<float> buf;
  const int blocks = (hidden + 31) / 32;
  const int64_t stride = int64_t(blocks) * 32;
  if (int64_t(buf.size()) < rows * stride) buf.resize(rows * stride);
  for (int r = 0; r < rows; ++r)
    for (int b = 0; b < blocks; ++b) {
      const int rest = hidden - 32 * b;
      const __mmask32 m = rest >= 32 ? ~__mmask32(0) : __mmask32((uint64_t(1) << rest) - 1);
      const __m512i x = _mm512_maskz_loadu_epi16(m, h + r * h_stride + 32 * b);
      _mm512_storeu_ps(buf.data() + r * stride + 32 * b, bf16_even_ps(x));
      _mm512_storeu_ps(buf.data() + r * stride + 32 * b + 16, bf16_odd_ps(x));
    }
  return {buf.data(), stride};
}

// dot_tile<Bf16, VT, RT> computed with widened pairs: the same accumulation order lane by lane (odd product, then
// even, block after block, then the same reduction), so the same bits on normal numbers. At most 4 rows: 16
// accumulators + 8 widened weight vectors + 2 hidden vectors fit the 32 registers. The whole 32-element steps and the
// ragged last one are separate loops, as in dot_tile: with the mask computed in one loop GCC kept the accumulators in
// memory, a store per FMA. The step is written out in both rather than shared through an inline helper taking acc
// by reference, which GCC 12 compiled the same bad way here (tests/ops/test_register_tiles.py guards it).
template <int VT, int RT>
void dot_tile_widened(const uint16_t* w, int64_t w_stride, WidenedRows h, int hidden, float* out, int64_t out_stride,
                      bool prefetch) {
  __m512 acc[RT][VT];
  for (int r = 0; r < RT; ++r)
    for (int v = 0; v < VT; ++v) acc[r][v] = _mm512_setzero_ps();
  int i = 0;
  for (; i + 32 <= hidden; i += 32) {
    __m512 we[VT], wo[VT];
    for (int v = 0; v < VT; ++v) {
      const __m512i x = _mm512_loadu_si512(w + v * w_stride + i);
      we[v] = bf16_even_ps(x);
      wo[v] = bf16_odd_ps(x);
    }
    if (prefetch)
      for (int v = 0; v < VT; ++v)
        _mm_prefetch(reinterpret_cast<const char*>(w + (kPrefetchRows + v) * w_stride + i), kPrefetchHint);
    for (int r = 0; r < RT; ++r) {
      const float* hr = h.data + r * h.stride + i;
      const __m512 he = _mm512_loadu_ps(hr), ho = _mm512_loadu_ps(hr + 16);
      for (int v = 0; v < VT; ++v) acc[r][v] = dot2_widened_ps(acc[r][v], he, ho, we[v], wo[v]);
    }
  }
  if (i < hidden) {  // zero-filled tail: contributes nothing beyond `hidden`
    const __mmask32 m = __mmask32((uint64_t(1) << (hidden - i)) - 1);
    __m512 we[VT], wo[VT];
    for (int v = 0; v < VT; ++v) {
      const __m512i x = _mm512_maskz_loadu_epi16(m, w + v * w_stride + i);
      we[v] = bf16_even_ps(x);
      wo[v] = bf16_odd_ps(x);
    }
    for (int r = 0; r < RT; ++r) {
      const float* hr = h.data + r * h.stride + i;
      const __m512 he = _mm512_loadu_ps(hr), ho = _mm512_loadu_ps(hr + 16);
      for (int v = 0; v < VT; ++v) acc[r][v] = dot2_widened_ps(acc[r][v], he, ho, we[v], wo[v]);
    }
  }
  for (int r = 0; r < RT; ++r) {
    if constexpr (VT == 4) _mm_storeu_ps(out + r * out_stride, reduce4(acc[r][0], acc[r][1], acc[r][2], acc[r][3]));
    else out[r * out_stride] = _mm512_reduce_add_ps(acc[r][0]);
  }
}

template <int VT>
void dot_column_widened(const uint16_t* w, int64_t w_stride, WidenedRows h, int rows, int hidden, float* out,
                        int64_t out_stride, bool prefetch) {
  constexpr int kRows = 4;
  for (int r = 0; r < rows; r += kRows) {
    const WidenedRows hr{h.data + r * h.stride, h.stride};
    float* o = out + r * out_stride;
    const bool pf = r == 0 && prefetch;
    switch (rows - r) {
      case 1: dot_tile_widened<VT, 1>(w, w_stride, hr, hidden, o, out_stride, pf); break;
      case 2: dot_tile_widened<VT, 2>(w, w_stride, hr, hidden, o, out_stride, pf); break;
      case 3: dot_tile_widened<VT, 3>(w, w_stride, hr, hidden, o, out_stride, pf); break;
      default: dot_tile_widened<VT, kRows>(w, w_stride, hr, hidden, o, out_stride, pf); break;
    }
  }
}

template <class E, int VT>
void dot_column(const typename E::W* w, int64_t w_stride, const typename E::T* h, int64_t h_stride, int rows,
                int hidden, float* out, int64_t out_stride, bool prefetch) {
  for (int r = 0; r < rows; r += kMaxTileRows) {
    const typename E::T* hr = h + r * h_stride;
    float* o = out + r * out_stride;
    const bool pf = r == 0 && prefetch;  // later row tiles find the weight tile in L1
    switch (rows - r) {
      case 1: dot_tile<E, VT, 1>(w, w_stride, hr, h_stride, hidden, o, out_stride, pf); break;
      case 2: dot_tile<E, VT, 2>(w, w_stride, hr, h_stride, hidden, o, out_stride, pf); break;
      case 3: dot_tile<E, VT, 3>(w, w_stride, hr, h_stride, hidden, o, out_stride, pf); break;
      case 4: dot_tile<E, VT, 4>(w, w_stride, hr, h_stride, hidden, o, out_stride, pf); break;
      case 5: dot_tile<E, VT, 5>(w, w_stride, hr, h_stride, hidden, o, out_stride, pf); break;
      default: dot_tile<E, VT, kMaxTileRows>(w, w_stride, hr, h_stride, hidden, o, out_stride, pf); break;
    }
  }
}

// Given logits: just widen them to fp32.
template <class E>
void copy_logits(const LabelLogprobsParams& p, int32_t v0, int32_t n, float* out) {
  const auto* x = static_cast<const typename E::T*>(p.hidden);
  for (int32_t r = 0; r < p.num_rows; ++r) {
    const typename E::T* src = x + r * p.hidden_row_stride + v0;
    float* dst = out + int64_t(r) * n;
    int32_t j = 0;
    for (; j + 16 <= n; j += 16) _mm512_storeu_ps(dst + j, E::to_f32(src + j));
    if (j < n) _mm512_mask_storeu_ps(dst + j, __mmask16((1u << (n - j)) - 1), E::to_f32_first(src + j, n - j));
  }
}

template <class E>
void logits_chunk(const LabelLogprobsParams& p, int32_t v0, int32_t n, float* out) {
  if (!p.weight) return copy_logits<E>(p, v0, n, out);
  const auto* w = static_cast<const typename E::W*>(p.weight) + v0 * p.weight_row_stride;
  const auto* h = static_cast<const typename E::T*>(p.hidden);
  // Prefetch only where the rows ahead are still this chunk's or the next one's: never past the vocabulary.
  const int32_t safe_end = p.vocab_size - v0 - kPrefetchRows - kWeightRows;
  int32_t j = 0;
  for (; j + kWeightRows <= n; j += kWeightRows)
    dot_column<E, kWeightRows>(w + j * p.weight_row_stride, p.weight_row_stride, h, p.hidden_row_stride,
                               p.num_rows, p.hidden_size, out + j, n, j <= safe_end);
  for (; j < n; ++j)
    dot_column<E, 1>(w + j * p.weight_row_stride, p.weight_row_stride, h, p.hidden_row_stride, p.num_rows,
                     p.hidden_size, out + j, n, false);
}

void logits_chunk_widened(const LabelLogprobsParams& p, int32_t v0, int32_t n, float* out) {
  if (!p.weight) return copy_logits<Bf16>(p, v0, n, out);
  const auto* w = static_cast<const uint16_t*>(p.weight) + v0 * p.weight_row_stride;
  const WidenedRows h = widen_rows(static_cast<const uint16_t*>(p.hidden), p.hidden_row_stride, p.num_rows,
                                   p.hidden_size);
  const int32_t safe_end = p.vocab_size - v0 - kPrefetchRows - kWeightRows;
  int32_t j = 0;
  for (; j + kWeightRows <= n; j += kWeightRows)
    dot_column_widened<kWeightRows>(w + j * p.weight_row_stride, p.weight_row_stride, h, p.num_rows, p.hidden_size,
                                    out + j, n, j <= safe_end);
  for (; j < n; ++j)
    dot_column_widened<1>(w + j * p.weight_row_stride, p.weight_row_stride, h, p.num_rows, p.hidden_size, out + j, n,
                          false);
}

void lse_update(const float* x, int32_t n, float* max, float* sum) {
  __m512 mx = _mm512_set1_ps(kNegInf);
  int32_t j = 0;
  for (; j + 16 <= n; j += 16) mx = _mm512_max_ps(mx, _mm512_loadu_ps(x + j));
  const __mmask16 tail = __mmask16((1u << (n - j)) - 1);
  mx = _mm512_mask_max_ps(mx, tail, mx, _mm512_maskz_loadu_ps(tail, x + j));
  const float chunk_max = _mm512_reduce_max_ps(mx);
  const float new_max = chunk_max > *max ? chunk_max : *max;
  if (new_max == kNegInf) return;  // nothing but -inf so far
  // exp(x - m) = 2^((x - m) log2 e); the subtraction first keeps the argument exact near the maximum.
  const __m512 m = _mm512_set1_ps(new_max), log2e = _mm512_set1_ps(kLog2e);
  __m512 acc = _mm512_setzero_ps();
  for (j = 0; j + 16 <= n; j += 16)
    acc = _mm512_add_ps(acc, exp2_ps(_mm512_mul_ps(_mm512_sub_ps(_mm512_loadu_ps(x + j), m), log2e)));
  const __m512 rest = exp2_ps(_mm512_mul_ps(_mm512_sub_ps(_mm512_maskz_loadu_ps(tail, x + j), m), log2e));
  acc = _mm512_mask_add_ps(acc, tail, acc, rest);
  const float rescale = *max == kNegInf ? 0.0f : std::exp(*max - new_max);
  *sum = *sum * rescale + _mm512_reduce_add_ps(acc);
  *max = new_max;
}

const LabelCpuOps kBf16Ops{logits_chunk<Bf16>, lse_update};
const LabelCpuOps kBf16WidenOps{logits_chunk_widened, lse_update};
const LabelCpuOps kF32Ops{logits_chunk<F32>, lse_update};
const LabelCpuOps kF32Bf16WeightOps{logits_chunk<F32Bf16Weight>, lse_update};

}  // namespace

const LabelCpuOps* PYSCORE_ENTRY(label_ops, avx512)(const KernelKey& key) {
  if (key.bf16_weight) return key.dtype == DType::kFloat32 ? &kF32Bf16WeightOps : nullptr;
  if (key.dtype == DType::kBFloat16) return key.bf16_dot == Bf16Dot::kWiden ? &kBf16WidenOps : &kBf16Ops;
  if (key.dtype == DType::kFloat32) return &kF32Ops;
  return nullptr;
}

}  // namespace pyscore
