// AVX2 + FMA ops of the CPU linear kernel (interface in linear.h, packed layout in linear.h: the one the AVX-512
// kernel reads; fp32 pack 1, bf16 pairs widened to fp32 here, no bf16 arithmetic).
//
// Micro-kernel: TM <= 6 rows x one strip of 16 packed columns (2 ymm): 12 fp32 accumulators + 2 weight operands + 1
// broadcast of the 16 ymm registers; each K step loads the strip's 16 weights (one cache line of the block's K row) and
// broadcasts one x per row. A decode step's few rows (at most kNarrowRows; kPanelRows for bf16 weights under fp32 x)
// take tiles of 1-3 rows and a wider strip instead, as many columns as the accumulators allow: 1 row x 64 columns (the
// whole K row of a block), 2-3 rows x 32. Narrow strips walk the block's K rows as four strided streams, which at 1-4
// rows bound a call by memory latency (0.4-0.5x torch's bf16 F.linear at M = 1, 2.5x slower than the AVX-512 kernel,
// which reads each K row whole: bench/results/tiers/kernels/linear_avx2_wide_strips_ab.txt; at 4-16 rows see kNarrowRows).
// Every lane of a row runs acc = fma(x[k], w[k], acc) for k = 0, 1, ..., K-1 in order, whatever M is, the strip width,
// the tile height and wherever the row falls: tail tiles run the same per-row chain, there is no split-K.
//
// Cache blocking: K in blocks of kKBlock, so that a block part's weight panel over a K block (up to 64 columns x
// kKBlock, 256 KiB in fp32) stays in L2 while every row tile of the rectangle passes over it; a tile's x rows over
// the K block stay in L1 while the strips of the block part pass over them. Between K blocks a tile's accumulators
// wait in a per-thread fp32 buffer (a store and a reload are exact), so the chain over K, hence every bit, is the
// unblocked one. The epilogue (bias, SiLU-mul of a gated unit's gate and up strips, residual, one rounding) runs
// from that buffer after the last K block.
//
// bf16 weights under fp32 x (LinearParams::bf16_weight) run Bf16's steps on x's rows as they are; a rectangle of
// more than kPanelRows rows first widens each block part's K-block panel into an fp32 panel (exact) and runs F32's
// 6-row tiles on it, so neither prefill nor a large decode step widens per row tile. Either way a lane's chain over
// K is F32's.
#include <algorithm>
#include <type_traits>
#include <vector>

#include "common/vec_avx2.h"
#include "linear/linear.h"

namespace pyscore {
namespace {

using namespace avx2;

constexpr int kTileRows = 6;
constexpr int kStripN = 16;          // packed columns per micro-kernel call at 4-6 rows: 2 ymm
constexpr int32_t kKBlock = 1024;    // K per cache block (even: whole bf16 pairs)

// A rectangle of at most this many rows (a decode step's) runs in tiles of 2-3 rows and 32-column strips, not 6
// rows and 16 columns: the first tile over a block part reads its weight panel from memory, and 16-column strips
// walk the panel's K rows as four strided streams, which left 4-16 rows bound by memory latency (on an AMD Zen 1
// at 6 rows 2x slower than the larger of its memory and FMA times). Two streams, 12 accumulators per 3 rows, the
// same FMAs per K step: bench/results/tiers/kernels/linear_avx2_decode_tiles_ab.txt. Rows are split evenly (8: 3 + 3 + 2).
constexpr int32_t kNarrowRows = 16;

// bf16 weights under fp32 x: a rectangle of more than this many rows widens the panel once (widen_panel) and runs
// 6-row tiles over it from L2, where the narrow tiles widen every weight vector once per 2-3 rows. A decode step of
// SmolLM2's bf16 checkpoint on an AMD Zen 1: 12 generations 1.09x, 16 1.07x (8, the unchanged path: 1.01x)
// (bench/results/tiers/kernels/linear_avx2_bf16_panel_rows_ab.txt).
constexpr int32_t kPanelRows = 10;

// Rows of the tile at row m of a rectangle ending at m1: 6-row tiles when `wide`, else tiles of at most 3 rows.
int tile_rows(bool wide, int32_t m, int32_t m1) {
  const int32_t left = m1 - m;
  if (wide) return std::min<int32_t>(kTileRows, left);
  const int32_t tiles = (left + 2) / 3;  // tiles of at most 3 rows over what is left, as even as they come
  return (left + tiles - 1) / tiles;
}

// Packed columns per micro-kernel call for a tile of tm rows over a block part `width` columns wide (32 or 64): as
// wide as tm x width / 8 accumulators allow in 16 ymm registers (weights come as memory operands).
int strip_columns(int tm, int32_t width) { return tm == 1 ? width : tm <= 3 ? 32 : kStripN; }

// Element traits: T is the stored type of the weight, X that of x and the output. x rows reach the micro-kernel as
// fp32 (bf16 ones widened once per tile and K block into a per-thread buffer); step() adds one K row of the strip
// (fp32) or one K pair (bf16, even element first: the natural K order) for TM rows and NV ymm (8 columns each).
struct F32 {
  using T = float;
  using X = float;
  static constexpr int kPack = 1;
  template <int TM, int NV>
  static void step(Vec (&acc)[TM][NV], const float* x, int64_t x_stride, const T* w) {
    for (int r = 0; r < TM; ++r) {
      const Vec b = set1(x[r * x_stride]);
      for (int j = 0; j < NV; ++j) acc[r][j] = fma(b, load(w + 8 * j), acc[r][j]);
    }
  }
};

struct Bf16 {
  using T = uint16_t;
  using X = uint16_t;
  static constexpr int kPack = 2;
  // The ymm widened at once: as many as fit beside the TM x NV accumulators and one broadcast, so that each
  // broadcast serves G FMAs (the 6-row tile: both of its ymm, as before wide strips).
  template <int TM, int NV>
  static constexpr int kGroup = TM * NV + NV + 1 <= 16 ? NV : NV / 2;

  template <int TM, int NV>
  static void step(Vec (&acc)[TM][NV], const float* x, int64_t x_stride, const T* w) {
    constexpr int G = kGroup<TM, NV>;
    for (int j0 = 0; j0 < NV; j0 += G) {
      __m256i pairs[G];  // 8 columns x one K pair each
      Vec v[G];
      for (int g = 0; g < G; ++g) pairs[g] = load_bits(w + 16 * (j0 + g));
      for (int g = 0; g < G; ++g) v[g] = bf16_even(pairs[g]);
      for (int r = 0; r < TM; ++r) {
        const Vec b = set1(x[r * x_stride]);
        for (int g = 0; g < G; ++g) acc[r][j0 + g] = fma(b, v[g], acc[r][j0 + g]);
      }
      for (int g = 0; g < G; ++g) v[g] = bf16_odd(pairs[g]);
      for (int r = 0; r < TM; ++r) {
        const Vec b = set1(x[r * x_stride + 1]);
        for (int g = 0; g < G; ++g) acc[r][j0 + g] = fma(b, v[g], acc[r][j0 + g]);
      }
    }
  }
};

// bf16 weight pairs under fp32 x: Bf16's steps, x's fp32 rows read in place.
struct Bf16Weight : Bf16 {
  using X = float;
};

// The first row tile over a block part's K block reads the weight panel from memory (decode reads nothing else):
// its first strip prefetches the panel's whole K row (the part's columns, 64 bytes a strip) kAhead steps ahead, its
// own line into L1 and the other strips' into L2, so the four strided streams become one stream that runs ahead.
constexpr int32_t kAhead = 32;

template <class T>
void prefetch_row(const T* row, int lines, int own) {  // own: the lines this call reads (into L1), the rest into L2
  const char* q = reinterpret_cast<const char*>(row);
  for (int l = 0; l < lines; ++l) _mm_prefetch(q + 64 * l, l < own ? _MM_HINT_T0 : _MM_HINT_T1);
}

// TM rows of x (fp32, x_stride apart, from the K block's start) x one strip (w: its first K row of the block) over
// `steps` K steps, into acc (TM rows of kLinearBlockN floats): from zero when `first`, else continuing acc. With
// pf_lines > 0, prefetches that many lines of the K row kAhead steps ahead, for the first pf_steps steps (those whose
// row ahead is still inside the packed weight).
template <class E, int TM, int NV>
void micro(const float* x, int64_t x_stride, const typename E::T* w, int32_t steps, bool first, float* acc_rows,
           int pf_lines, int32_t pf_steps) {
  constexpr int64_t kRow = kLinearBlockN * E::kPack;  // elements per K step (row or pair row) of a block
  Vec acc[TM][NV];
  for (int r = 0; r < TM; ++r)
    for (int h = 0; h < NV; ++h) acc[r][h] = first ? zero() : load(acc_rows + r * kLinearBlockN + 8 * h);
  int32_t s = 0;
  if (pf_lines > 0) {
    for (const int32_t end = std::min(steps, pf_steps); s < end; ++s) {
      prefetch_row(w + (s + kAhead) * kRow, pf_lines, NV / 2);
      E::template step<TM, NV>(acc, x + s * E::kPack, x_stride, w + s * kRow);
    }
  }
  for (; s < steps; ++s) E::template step<TM, NV>(acc, x + s * E::kPack, x_stride, w + s * kRow);
  for (int r = 0; r < TM; ++r)
    for (int h = 0; h < NV; ++h) store(acc_rows + r * kLinearBlockN + 8 * h, acc[r][h]);
}

// One call of `columns` packed columns (strip_columns) for tm rows.
template <class E>
void micro_rows(int tm, int columns, const float* x, int64_t x_stride, const typename E::T* w, int32_t steps,
                bool first, float* acc, int pf_lines, int32_t pf_steps) {
  if (columns == 64) return micro<E, 1, 8>(x, x_stride, w, steps, first, acc, pf_lines, pf_steps);
  if (columns == 32) {
    switch (tm) {
      case 1: return micro<E, 1, 4>(x, x_stride, w, steps, first, acc, pf_lines, pf_steps);
      case 2: return micro<E, 2, 4>(x, x_stride, w, steps, first, acc, pf_lines, pf_steps);
      default: return micro<E, 3, 4>(x, x_stride, w, steps, first, acc, pf_lines, pf_steps);
    }
  }
  switch (tm) {
    case 1: return micro<E, 1, 2>(x, x_stride, w, steps, first, acc, pf_lines, pf_steps);
    case 2: return micro<E, 2, 2>(x, x_stride, w, steps, first, acc, pf_lines, pf_steps);
    case 3: return micro<E, 3, 2>(x, x_stride, w, steps, first, acc, pf_lines, pf_steps);
    case 4: return micro<E, 4, 2>(x, x_stride, w, steps, first, acc, pf_lines, pf_steps);
    case 5: return micro<E, 5, 2>(x, x_stride, w, steps, first, acc, pf_lines, pf_steps);
    default: return micro<E, 6, 2>(x, x_stride, w, steps, first, acc, pf_lines, pf_steps);
  }
}

// The tile's x rows over K [k0, k1) as fp32 rows: fp32 x in place, bf16 widened into a per-thread buffer.
struct XRows {
  const float* data;
  int64_t stride;
};

XRows x_rows(const LinearParams& p, int32_t m, int tm, int32_t k0, int32_t k1, const float*) {
  return {static_cast<const float*>(p.x) + m * p.x_row_stride + k0, p.x_row_stride};
}

XRows x_rows(const LinearParams& p, int32_t m, int tm, int32_t k0, int32_t k1, const uint16_t*) {
  thread_local std::vector<float> buf;
  const int32_t kb = k1 - k0;
  if (int64_t(buf.size()) < int64_t(tm) * kb) buf.resize(int64_t(tm) * kb);
  for (int r = 0; r < tm; ++r) {
    const uint16_t* row = static_cast<const uint16_t*>(p.x) + (m + r) * p.x_row_stride + k0;
    for (int32_t i = 0; i < kb; i += kLanes) store_n(buf.data() + int64_t(r) * kb + i, load_n(row + i, kb - i), kb - i);
  }
  return {buf.data(), kb};
}

Vec silu(Vec g) { return div(g, add(set1(1.0f), exp_ps(sub(zero(), g)))); }

// Writes 8 output columns from output column oc of row m (fewer at the row's end), after the residual add.
template <class T>
void store_out(const LinearParams& p, int32_t m, int32_t oc, Vec v) {
  const int n = p.n_out - oc;
  if (n <= 0) return;
  if (p.residual) v = add(v, load_n(static_cast<const T*>(p.residual) + m * p.residual_row_stride + oc, n));
  store_n(static_cast<T*>(p.out) + m * p.out_row_stride + oc, v, n);
}

// The epilogue of rows [m, m + tm) over packed columns [c, c + width) (whole 32-column units), from acc (rows of
// kLinearBlockN floats; column c at acc[0]).
template <class T>
void epilogue(const LinearParams& p, int32_t m, int tm, int32_t c, int32_t width, const float* acc) {
  for (int r = 0; r < tm; ++r) {
    const float* a = acc + r * kLinearBlockN;
    for (int32_t j = 0; j < width; j += kLinearUnitN) {
      Vec v[4];
      for (int h = 0; h < 4; ++h) {
        v[h] = load(a + j + 8 * h);
        if (p.bias) v[h] = add(v[h], load(p.bias + c + j + 8 * h));
      }
      if (p.gated) {  // gate columns [0, 16) of the unit, up columns [16, 32): output columns (c + j) / 2 + [0, 16)
        for (int h = 0; h < 2; ++h) store_out<T>(p, m + r, (c + j) / 2 + 8 * h, mul(silu(v[h]), v[h + 2]));
      } else {
        for (int h = 0; h < 4; ++h) store_out<T>(p, m + r, c + j + 8 * h, v[h]);
      }
    }
  }
}

// A block part's weight over a K block (`steps` bf16 pair rows from wk, `width` columns) widened into a per-thread
// fp32 panel in F32's layout (K rows of kLinearBlockN floats, the part's first column at 0): the values as they are.
const float* widen_panel(const uint16_t* wk, int32_t steps, int32_t width) {
  thread_local std::vector<float> panel;
  if (int64_t(panel.size()) < int64_t(2) * steps * kLinearBlockN) panel.resize(size_t(2) * steps * kLinearBlockN);
  for (int32_t s = 0; s < steps; ++s) {
    const uint16_t* row = wk + int64_t(s) * 2 * kLinearBlockN;
    float* even = panel.data() + int64_t(2) * s * kLinearBlockN;
    for (int32_t j = 0; j < width; j += kLanes) {
      const Bits pairs = load_bits(row + 2 * j);
      store(even + j, bf16_even(pairs));
      store(even + kLinearBlockN + j, bf16_odd(pairs));
    }
  }
  return panel.data();
}

template <class E>
void rect(const LinearParams& p, int32_t m0, int32_t m1, int32_t c0, int32_t c1) {
  using T = typename E::T;
  using X = typename E::X;
  const int32_t k_steps = p.k / E::kPack;  // K is even for bf16 (the launcher pads)
  const T* packed = static_cast<const T*>(p.w_packed);
  thread_local std::vector<float> partial;  // [m1 - m0][64]: the rectangle's accumulators for one block part
  partial.assign(size_t(m1 - m0) * kLinearBlockN, 0.0f);
  // 6-row tiles over more rows than a decode step's; bf16 weights under fp32 x run them on a widened panel.
  constexpr bool kPanel = std::is_same_v<E, Bf16Weight>;
  const bool wide = m1 - m0 > (kPanel ? kPanelRows : kNarrowRows);
  for (int32_t c = c0; c < c1;) {
    const int32_t block = c / kLinearBlockN, part0 = c % kLinearBlockN;
    const int32_t width = std::min(kLinearBlockN - part0, c1 - c);  // 32 or 64 columns of this block
    const T* w = packed + (int64_t(block) * k_steps * kLinearBlockN + part0) * E::kPack;
    for (int32_t k0 = 0; k0 < p.k; k0 += kKBlock) {
      const int32_t k1 = std::min(p.k, k0 + kKBlock), s0 = k0 / E::kPack, steps = (k1 - k0) / E::kPack;
      const T* wk = w + int64_t(s0) * kLinearBlockN * E::kPack;
      const float* panel = nullptr;
      if constexpr (kPanel) {  // F32's steps read it
        if (wide) panel = widen_panel(wk, steps, width);
      }
      for (int32_t m = m0, tm; m < m1; m += tm) {
        tm = tile_rows(wide, m, m1);
        const XRows x = x_rows(p, m, tm, k0, k1, static_cast<const X*>(nullptr));
        float* acc = partial.data() + int64_t(m - m0) * kLinearBlockN;
        const int columns = strip_columns(tm, width);
        for (int32_t s = 0; s < width; s += columns) {
          if (panel) {  // F32's steps over the widened panel, which is in L2 already: nothing to prefetch
            micro_rows<F32>(tm, columns, x.data, x.stride, panel + s, k1 - k0, k0 == 0, acc + s, 0, 0);
            continue;
          }
          const int pf_lines = m == m0 && s == 0 ? width / 16 : 0;  // 16 packed columns: one line a K step
          micro_rows<E>(tm, columns, x.data, x.stride, wk + s * E::kPack, steps, k0 == 0, acc + s, pf_lines,
                        k_steps - s0 - kAhead);
        }
        if (k1 == p.k) epilogue<X>(p, m, tm, c, width, acc);
      }
    }
    if (p.k == 0) {  // no K block ran: the product is zero (partial still holds the zeros it was filled with)
      for (int32_t m = m0; m < m1; m += kTileRows)
        epilogue<X>(p, m, std::min<int32_t>(kTileRows, m1 - m), c, width,
                    partial.data() + int64_t(m - m0) * kLinearBlockN);
    }
    c += width;
  }
}

const LinearCpuOps kF32Ops{rect<F32>, kTileRows};
const LinearCpuOps kBf16Ops{rect<Bf16>, kTileRows};
const LinearCpuOps kBf16WeightOps{rect<Bf16Weight>, kTileRows};

}  // namespace

const LinearCpuOps* PYSCORE_ENTRY(linear_ops, avx2)(const KernelKey& key) {
  if (key.bf16_weight) return key.dtype == DType::kFloat32 ? &kBf16WeightOps : nullptr;
  if (key.dtype == DType::kFloat32) return &kF32Ops;
  if (key.dtype == DType::kBFloat16) return &kBf16Ops;
  return nullptr;
}

}  // namespace pyscore
