// The vector ops of the CPU linear kernel (interface and packed layout in linear.h), written once against a vector
// layer `V` (common/vec_avx2.h, 8 lanes and 16 registers; vec_avx512.h, 16 and 32; vec_neon.h, 4 and 16) and compiled
// once per layer named below by cmake/cpu_kernels.cmake. At tier amx, bf16 runs on AMX tiles (linear_amx.cpp), which
// takes this text's avx512 epilogue and, where K % 32 != 0, its widened bf16 ops.
//
// Register tile: TM <= 6 rows x NV vectors of fp32 accumulators over one K block, as many vectors as TM x NV and one
// broadcast leave registers for (weights come as memory operands): AVX-512 6 x 4 (a whole 64-column block), AVX2 and
// NEON 6 x 2, 2-3 x 4 and 1 x 8. Each K step loads the tile's weight vectors (its columns of one packed K row or pair
// row) and broadcasts one x element (or pair) per row. On a layer whose 6-row tile is narrower than a block, a
// rectangle of a decode step's rows (at most kNarrowRows) runs in tiles of 1-3 rows with wider strips instead, and
// the first tile over a block part prefetches the part's K rows ahead (decode reads nothing else).
//
// Element policies. fp32 (F32): fma(x[k], w[k], acc) for k = 0, 1, ... bf16 x works on pairs, multiplied by the
// layer's pair dot where it has one and key.bf16_dot asks for it (Bf16Pairs: vdpbf16ps), else widened to fp32 in
// registers with two FMAs in vdpbf16ps's order, the odd product first (Bf16Widen; its x rows widened once per tile
// and K block): the same bits on normal numbers, on every layer. A rectangle of kWidenPanelRows rows or more widens
// each K block's weight panel to fp32 once (WidenPanel), so its steps are F32's with no widening in the loop. bf16
// weights under fp32 x (Bf16Weight, LinearParams::bf16_weight) widen each weight vector in registers and run F32's
// chain in K order (even element first), so the bits are those of the fp32 weight holding the same values; on a
// narrow-tile layer more than kWeightPanelRows rows widen the panel instead (WeightPanel, the same chain).
//
// Exactness: every output row is the same chain over K whatever M is, the tile height, the strip width and wherever
// the row falls; K blocks (a function of K alone) hand the partial sums on through fp32 buffers, exactly. Rows are
// batch-invariant. The epilogue (bias, SiLU-mul of a gated unit's gate and up halves, residual, one rounding) runs
// from the tile's buffered sums after the last K block.
//
// Every loop over a tile's rows is PYSCORE_UNROLL'd (common/kernel_text.h): without it GCC kept the tile an array in
// memory, written to the stack and read back at each call's entry and exit on x86 and at every K step on aarch64;
// tests/ops/test_register_tiles.py checks that no micro<> stores more than two vectors to the stack per call (none
// does now), on every layer.
// NEON: the neon unit's results are checked under qemu-aarch64 (tests/cpu/kernel_check_layers.cpp), but no ARM CPU
// has timed it: the tier table keeps torch's F.linear at tier neon (pyscore/ops/tiers.py).
// pyscore-vec-layers: avx2 avx512 neon
#pragma once
#include "common/kernel_text.h"
#include <algorithm>
#include <climits>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "common/opaque.h"
#include "linear/linear.h"

namespace pyscore {
namespace {

using V::Vec;
constexpr int kLanes = V::kLanes;
constexpr int kTileRows = 6;

constexpr int pow2_floor(int n) { return n >= 8 ? 8 : n >= 4 ? 4 : n >= 2 ? 2 : 1; }

// Accumulator vectors per row of a tm-row tile over a block part `width` columns wide.
constexpr int max_vecs(int tm) { return std::min(kLinearBlockN / kLanes, pow2_floor((V::kRegisters - 1) / tm)); }

// Layers whose 6-row tile reads part of a block's K row (AVX2, NEON): a K row is then several strided streams.
constexpr bool kNarrowLayer = max_vecs(kTileRows) * kLanes < kLinearBlockN;

// Decode-step rectangles (at most this many rows) on a narrow layer run in tiles of 1-3 rows and strips of 32-64
// columns: the first tile over a block part reads its weight panel from memory, and 16-column strips walk the
// panel's K rows as four strided streams, which left 4-16 rows bound by memory latency (on an AMD Zen 1 at 6 rows
// 2x slower than the larger of its memory and FMA times): bench/results/tiers/kernels/linear_avx2_decode_tiles_ab.txt.
constexpr int32_t kNarrowRows = 16;

// K steps the first tile prefetches ahead on a narrow layer (its first strip: the part's whole K row, its own line
// into L1, the others into L2), so the strided streams become one that runs ahead
// (bench/results/tiers/kernels/linear_avx2_wide_strips_ab.txt). AVX-512's tile reads each K row whole.
constexpr int32_t kAhead = kNarrowLayer ? 32 : 0;

// A K block's weight panel, as the steps read it, stays in L2 while every row tile of the rectangle passes over it:
// unblocked, Qwen3-8B's down (K = 12288) came from L3 for every row tile, 0.45-0.58x torch's F.linear at prefill on
// a Zen 4, 0.99-1.03x in blocks (bench/results/tiers/kernels/linear_fp32_kblock_ab.txt, linear_fp32_kblock_sizes.txt).
// Half the L2 of the layer's CPUs: 1-2 MiB with AVX-512, 512 KiB on a Zen 1-3 with AVX2 only.
constexpr int64_t kPanelBytes = kLanes >= 16 ? int64_t(512) << 10 : int64_t(256) << 10;

// bf16 x, widened: on AVX-512, from this many rows the panel is widened once per K block (WidenPanel) instead of each
// weight vector once per row tile; both give the same bits (bench/results/tiers/kernels/linear_widen_panel.txt). On a
// narrow layer the panel ran a SmolLM2 / Qwen3-0.6B prefill (776 rows) at 1.08-1.12x the time of widening in
// registers on a Zen 4 (bench/results/tiers/kernels/linear_text_ab_avx2.txt, first run): never there.
constexpr int32_t kWidenPanelRows = kNarrowLayer ? INT32_MAX : 64;

// bf16 weights under fp32 x on a narrow layer: above this many rows the panel is widened once per K block and runs
// F32's 6-row tiles from L2, where the narrow tiles widen each weight vector once per 2-3 rows (SmolLM2's bf16
// checkpoint's decode step on a Zen 1: 12 generations 1.09x, 16 1.07x; 8: 1.01x:
// bench/results/tiers/kernels/linear_avx2_bf16_panel_rows_ab.txt). On AVX-512 the weight is widened in registers at
// every row count: a panel read 0.25-0.93x up to 128 rows, 0.95-1.04x at 256-776
// (bench/results/tiers/kernels/linear_avx512_bf16_weights.txt).
constexpr int32_t kWeightPanelRows = 10;

// ---- element policies -------------------------------------------------------------------------------------------
// T: x's, the residual's and out's type; P: the packed weight's; W: what step() reads (the packed weight or a
// widened fp32 panel); kPack: K elements per step; kColElems / kStepElems: W elements per column and per step row;
// kRows: how a tile's x rows reach step() (XRows::kInPlace: x itself; kWidened: bf16 x widened to fp32).

enum class XRows { kInPlace, kWidened, kCodes };  // kCodes: int8 x codes (Int8Quads)

struct F32 {
  using T = float;
  using P = float;
  using W = float;
  static constexpr int kPack = 1, kColElems = 1, kStepElems = kLinearBlockN;
  static constexpr XRows kRows = XRows::kInPlace;
  static constexpr bool kPanel = false;
  template <int TM, int NV>
  static void step(Vec (&acc)[TM][NV], const float* x, int64_t xs, const float* w) {
    PYSCORE_UNROLL for (int r = 0; r < TM; ++r) {
      const Vec b = V::set1(x[r * xs]);
      for (int j = 0; j < NV; ++j) acc[r][j] = V::fma(b, V::load(w + kLanes * j), acc[r][j]);
    }
  }
};

// Steps over the packed bf16 pairs (kLanes columns x one pair a vector).
struct PackedPairs {
  using P = uint16_t;
  using W = uint16_t;
  static constexpr int kPack = 2, kColElems = 2, kStepElems = 2 * kLinearBlockN;
  static constexpr bool kPanel = false;
};

struct Bf16Pairs : PackedPairs {  // vdpbf16ps
  using T = uint16_t;
  static constexpr XRows kRows = XRows::kInPlace;
  template <int TM, int NV>
  static void step(Vec (&acc)[TM][NV], const uint16_t* x, int64_t xs, const uint16_t* w) {
    V::Bits v[NV];
    for (int j = 0; j < NV; ++j) v[j] = V::load_bits(w + 2 * kLanes * j);
    PYSCORE_UNROLL for (int r = 0; r < TM; ++r) {
      const V::Bits b = V::set1_pair(x + r * xs);
      for (int j = 0; j < NV; ++j) acc[r][j] = V::dot_pairs(acc[r][j], b, v[j]);
    }
  }
};

// fp32 x rows times widened pairs, the pair's element kFirst (1: odd, vdpbf16ps's order) then the other. G weight
// vectors are widened at once, as many as fit beside the accumulators and the layer's kWidenSpareRegisters (the
// broadcast and what GCC takes besides: on AVX-512 and NEON the odd mask, a temporary and two more, or the 6 x 4
// tile spilled 3 vectors a step; on AVX2 one, the odd mask being a memory operand, so that the 6 x 2 tile's two
// vectors share each broadcast: one vector a broadcast ran a 776-row bf16 prefill 1.16-1.24x slower,
// bench/results/tiers/kernels/linear_widen_mask_ab_1thread_avx2.txt). Each half reads x and its pairs through
// opaque() (common/opaque.h; the reloads are L1 hits), or GCC keeps every row's broadcasts and the pairs in
// registers across the groups and halves and spills accumulators instead.
template <int kFirst>
struct WidenedPairs : PackedPairs {
  template <int TM, int NV>
  static constexpr int kGroup = TM * NV + NV + V::kWidenSpareRegisters <= V::kRegisters       ? NV
                                : TM * NV + NV / 2 + V::kWidenSpareRegisters <= V::kRegisters ? NV / 2
                                : TM * NV + NV / 4 + V::kWidenSpareRegisters <= V::kRegisters ? NV / 4
                                                                                               : 1;

  template <int TM, int NV>
  static void step(Vec (&acc)[TM][NV], const float* x, int64_t xs, const uint16_t* w) {
    constexpr int G = kGroup<TM, NV>;
    PYSCORE_UNROLL for (int j0 = 0; j0 < NV; j0 += G) {
      half<kFirst, G>(acc, opaque(x), xs, w, j0);
      half<1 - kFirst, G>(acc, opaque(x), xs, opaque(w), j0);
    }
  }

  // acc[r][j0 + g] += x[r][e] * (element e of the pairs at w), e = 0 even, 1 odd.
  template <int e, int G, int TM, int NV>
  static void half(Vec (&acc)[TM][NV], const float* x, int64_t xs, const uint16_t* w, int j0) {
    Vec v[G];
    for (int g = 0; g < G; ++g) {
      const V::Bits pairs = V::load_bits(w + 2 * kLanes * (j0 + g));
      v[g] = e ? V::bf16_odd_lean(pairs) : V::bf16_even(pairs);
    }
    PYSCORE_UNROLL for (int r = 0; r < TM; ++r) {
      const Vec b = V::set1(x[r * xs + e]);
      for (int g = 0; g < G; ++g) acc[r][j0 + g] = V::fma(b, v[g], acc[r][j0 + g]);
    }
  }
};

struct Bf16Widen : WidenedPairs<1> {
  using T = uint16_t;
  static constexpr XRows kRows = XRows::kWidened;
};

struct Bf16Weight : WidenedPairs<0> {
  using T = float;
  static constexpr XRows kRows = XRows::kInPlace;
};

// A K block's packed pairs widened once into an fp32 panel (pair step s: row 2s the even elements, row 2s + 1 the
// odd ones), read by F32's steps, the pair's element kFirst first: the arithmetic of WidenedPairs<kFirst>.
template <int kFirst>
struct PanelPairs {
  using P = uint16_t;
  using W = float;
  static constexpr int kPack = 2, kColElems = 1, kStepElems = 2 * kLinearBlockN;
  static constexpr bool kPanel = true;
  template <int TM, int NV>
  static void step(Vec (&acc)[TM][NV], const float* x, int64_t xs, const float* w) {
    F32::step<TM, NV>(acc, x + kFirst, xs, w + kFirst * kLinearBlockN);
    F32::step<TM, NV>(acc, x + (1 - kFirst), xs, w + (1 - kFirst) * kLinearBlockN);
  }
};

struct WidenPanel : PanelPairs<1> {
  using T = uint16_t;
  static constexpr XRows kRows = XRows::kWidened;
};

struct WeightPanel : PanelPairs<0> {
  using T = float;
  static constexpr XRows kRows = XRows::kInPlace;
};

// int8 weights (linear.h's int8 section): x codes (this layer's kInt8XOffset added) in quads against the packed
// weight's quads into int32 accumulators (V::Bits), a group's sums exact (so their order within it does not
// matter); micro<> folds each group into the tile's fp32 sums in memory (L1) and starts the next from the weight's
// sum bases. Out: the residual's and out's type.
template <class Out>
struct Int8Quads {
  using T = Out;
  using P = int8_t;
  using W = int8_t;
  static constexpr int kPack = 4, kColElems = 4, kStepElems = 4 * kLinearBlockN;
  static constexpr XRows kRows = XRows::kCodes;
  static constexpr bool kPanel = false;
  template <int TM, int NV>
  static void step(V::Bits (&acc)[TM][NV], const uint8_t* x, int64_t xs, const int8_t* w) {
    V::Bits v[NV];
    for (int j = 0; j < NV; ++j) v[j] = V::load_bits(w + 4 * kLanes * j);
    PYSCORE_UNROLL for (int r = 0; r < TM; ++r) {
      const V::Bits b = V::set1_quad(x + r * xs);
      for (int j = 0; j < NV; ++j) acc[r][j] = V::dot_quads(acc[r][j], b, v[j]);
    }
  }
};

// Accumulator vectors per row for policy E: the int8 quads hold their NV weight vectors in registers beside the
// tile and need V::kInt8SpareRegisters more (the broadcast; without VNNI, the widening's temporaries too).
template <class E>
constexpr int vecs_for(int tm) {
  if constexpr (E::kRows == XRows::kCodes)
    return std::min(kLinearBlockN / kLanes, pow2_floor((V::kRegisters - V::kInt8SpareRegisters) / (tm + 1)));
  else
    return max_vecs(tm);
}
template <class E>
int tile_vecs(int tm, int32_t width) { return std::min<int>(width / kLanes, vecs_for<E>(tm)); }

// ---- the tile -----------------------------------------------------------------------------------------------------

struct Tile {
  const void* x;  // the tile's first x row at the K block's start (fp32, or bf16 pairs for Bf16Pairs)
  int64_t x_stride;
  const void* w;  // the strip's first weight column at the K block's first step
  int64_t steps;
  bool first;     // the first K block: the sums start from zero, else from acc
  float* acc;     // the tile's sums, rows kLinearBlockN floats apart, from the strip's first column
  bool prefetch;    // the first tile's first strip: prefetch K rows ahead where the layer does (micro_fit)
  int64_t pf_last;  // the last K step of the block column, from the K block's start
  // int8 (Int8Quads; the K block starts a group): the tile's first row's x scales from the block's first group
  // (rows x_scale_stride apart), the strip's first column's weight scales and sum bases from that group (groups
  // kLinearBlockN apart), and the quads per group.
  const float* x_scale = nullptr;
  int64_t x_scale_stride = 0;
  const float* w_scale = nullptr;
  const int32_t* w_base = nullptr;
  int64_t group_steps = 0;
};

// Prefetches 4 lines of 64 bytes from a block part's K row (a whole block's row; after a 32-column part, the start of
// its next K row, harmless), the first kOwn lines (the strip's own) into L1, the rest into L2. No run-time count:
// a loop or branch inside the hot loop kept GCC from holding the tile in registers on aarch64.
template <int kOwn>
void prefetch_row(const char* row) {
  for (int l = 0; l < kLinearBlockN * 4 / 64; ++l) {
    if (l < kOwn) __builtin_prefetch(row + 64 * l, 0, 3);
    else __builtin_prefetch(row + 64 * l, 0, 2);
  }
}

// acc += policy E's steps [s0, s1) from x and w; with kPrefetch, each step prefetches the K row kAhead steps ahead
// (at most pf_last: one loop, no branch).
template <class E, int TM, int NV, bool kPrefetch, class A, class X>
inline void run_steps(A (&acc)[TM][NV], const X* x, int64_t xs, const typename E::W* w, int64_t s0, int64_t s1,
                      int64_t pf_last) {
  for (int64_t s = s0; s < s1; ++s) {
    if constexpr (kPrefetch) {
      constexpr int kOwn = NV * kLanes / 16;  // 16 columns of 4 bytes a step: one 64-byte line
      prefetch_row<kOwn>(reinterpret_cast<const char*>(w + std::min(s + kAhead, pf_last) * E::kStepElems));
    }
    E::template step<TM, NV>(acc, x + s * E::kPack, xs, w + s * E::kStepElems);
  }
}

// int8: the K block's groups one by one. A group's int32 sums start from the weight's bases (the x codes' offset
// taken back) or zero, run its quads, and fold into the tile's fp32 sums at out as v = fma(float(sum) * w_scale,
// x_scale, v) (v from 0 at K's first group): the order over K is the groups', whatever the blocking. The fp32 sums
// stay in L1 rather than registers, so the tile keeps the int32 tile's shape (6 x 4 on AVX-512).
template <class E, int TM, int NV, bool kPrefetch>
inline void run_groups(const Tile& tile, const uint8_t* x, int64_t xs, const int8_t* w, float* out) {
  const int64_t steps = tile.steps, pf_last = tile.pf_last, group_steps = tile.group_steps;
  const float* const x_scale = tile.x_scale;
  const int64_t x_scale_stride = tile.x_scale_stride;
  const float* const w_scale = tile.w_scale;
  const int32_t* const w_base = tile.w_base;
  for (int64_t s0 = 0, g = 0; s0 < steps; s0 += group_steps, ++g) {
    V::Bits acc[TM][NV];
    PYSCORE_UNROLL for (int r = 0; r < TM; ++r)
      for (int j = 0; j < NV; ++j)
        acc[r][j] = V::kInt8XOffset ? V::load_bits(w_base + g * kLinearBlockN + kLanes * j) : V::zero_bits();
    run_steps<E, TM, NV, kPrefetch>(acc, x, xs, w, s0, std::min(steps, s0 + group_steps), pf_last);
    const bool fresh = tile.first && g == 0;
    PYSCORE_UNROLL for (int r = 0; r < TM; ++r) {
      const Vec sx = V::set1(x_scale[r * x_scale_stride + g]);
      for (int j = 0; j < NV; ++j) {
        float* const o = out + r * kLinearBlockN + kLanes * j;
        const Vec t = V::mul(V::bits_to_f32(acc[r][j]), V::load(w_scale + g * kLinearBlockN + kLanes * j));
        V::store(o, V::fma(t, sx, fresh ? V::zero() : V::load(o)));
      }
    }
  }
}

// TM rows x NV vectors over one K block (kPrefetch: run_steps'; pf_last, the block column's last K step). Not
// inlined: one register tile per function, whose hot loop tests/ops/test_register_tiles.py checks (a call per strip
// and K block is nothing beside its steps).
template <class E, int TM, int NV, bool kPrefetch>
[[gnu::noinline]] void micro(const Tile& tile) {
  using X = std::conditional_t<
      E::kRows == XRows::kCodes, uint8_t,
      std::conditional_t<E::kRows == XRows::kWidened || std::is_same_v<typename E::T, float>, float, uint16_t>>;
  // Scalars, not the struct: stores through out cannot alias them.
  const X* x = static_cast<const X*>(tile.x);
  const int64_t xs = tile.x_stride;
  const typename E::W* w = static_cast<const typename E::W*>(tile.w);
  float* const out = tile.acc;
  if constexpr (E::kRows == XRows::kCodes) {
    run_groups<E, TM, NV, kPrefetch>(tile, x, xs, w, out);
  } else {
    Vec acc[TM][NV];
    PYSCORE_UNROLL for (int r = 0; r < TM; ++r)
      for (int j = 0; j < NV; ++j) acc[r][j] = tile.first ? V::zero() : V::load(out + r * kLinearBlockN + kLanes * j);
    run_steps<E, TM, NV, kPrefetch>(acc, x, xs, w, 0, tile.steps, tile.pf_last);
    PYSCORE_UNROLL for (int r = 0; r < TM; ++r)
      for (int j = 0; j < NV; ++j) V::store(out + r * kLinearBlockN + kLanes * j, acc[r][j]);
  }
}

template <class E, int TM, int NV>
void micro_fit(const Tile& t) {
  if constexpr (NV <= vecs_for<E>(TM)) {
    if constexpr (kAhead > 0 && !E::kPanel) {  // a panel is in L2 already: nothing to prefetch
      if (t.prefetch) return micro<E, TM, NV, true>(t);
    }
    micro<E, TM, NV, false>(t);
  }
}

template <class E, int TM>
void micro_vecs(int nv, const Tile& t) {
  if (nv >= 8) return micro_fit<E, TM, 8>(t);
  if (nv >= 4) return micro_fit<E, TM, 4>(t);
  if (nv >= 2) return micro_fit<E, TM, 2>(t);
  micro_fit<E, TM, 1>(t);  // the int8 quads' 6-row tiles on a 16-register layer
}

// One strip of nv vectors (tile_vecs) for tm rows.
template <class E>
void micro_rows(int tm, int nv, const Tile& t) {
  switch (tm) {
    case 1: return micro_vecs<E, 1>(nv, t);
    case 2: return micro_vecs<E, 2>(nv, t);
    case 3: return micro_vecs<E, 3>(nv, t);
    case 4: return micro_vecs<E, 4>(nv, t);
    case 5: return micro_vecs<E, 5>(nv, t);
    default: return micro_vecs<E, 6>(nv, t);
  }
}

// Rows of the tile at row m of a rectangle ending at m1: 6-row tiles, or on a narrow rectangle tiles of at most 3
// rows, as even as they come (8: 3 + 3 + 2).
int tile_rows(bool narrow, int32_t m, int32_t m1) {
  const int32_t left = m1 - m;
  if (!narrow) return std::min<int32_t>(kTileRows, left);
  const int32_t tiles = (left + 2) / 3;
  return (left + tiles - 1) / tiles;
}

// ---- x rows, panels, epilogue -------------------------------------------------------------------------------------

struct Rows {
  const void* data;
  int64_t stride;
};

// The tile's tm x rows over K [k0, k0 + kb): in place, or bf16 widened to fp32 into a per-thread buffer, rows kb apart.
template <class E>
Rows x_rows(const LinearParams& p, int32_t m, int tm, int64_t k0, int64_t kb) {
  using T = std::conditional_t<E::kRows == XRows::kCodes, uint8_t, typename E::T>;
  const T* x = static_cast<const T*>(p.x) + m * p.x_row_stride + k0;
  if constexpr (E::kRows != XRows::kWidened) {
    return {x, p.x_row_stride};
  } else {
    thread_local std::vector<float> buf;
    if (int64_t(buf.size()) < tm * kb) buf.resize(size_t(tm * kb));
    for (int r = 0; r < tm; ++r)
      for (int64_t i = 0; i < kb; i += kLanes) {
        const int n = int(std::min<int64_t>(kLanes, kb - i));
        V::store_n(buf.data() + r * kb + i, V::load_n(x + r * p.x_row_stride + i, n), n);
      }
    return {buf.data(), kb};
  }
}

// The weight of a block part (width columns) over a K block (`steps` steps from w) as step() reads it: the packed
// weight itself, or its pairs widened into a per-thread fp32 panel (PanelPairs' rows, the part's first column at 0).
template <class E>
const typename E::W* block_weights(const typename E::P* w, int64_t steps, int32_t width) {
  if constexpr (!E::kPanel) {
    return w;
  } else {
    thread_local std::vector<float> panel;
    if (int64_t(panel.size()) < steps * 2 * kLinearBlockN) panel.resize(size_t(steps * 2 * kLinearBlockN));
    for (int64_t s = 0; s < steps; ++s) {
      const uint16_t* row = w + s * 2 * kLinearBlockN;
      float* even = panel.data() + s * 2 * kLinearBlockN;
      for (int32_t j = 0; j < width; j += kLanes) {
        const V::Bits pairs = V::load_bits(row + 2 * j);
        V::store(even + j, V::bf16_even(pairs));
        V::store(even + kLinearBlockN + j, V::bf16_odd(pairs));
      }
    }
    return panel.data();
  }
}

Vec silu(Vec g) { return V::div(g, V::add(V::set1(1.0f), V::exp_ps(V::sub(V::zero(), g)))); }

// Writes kLanes output columns from output column oc of row m (fewer at the row's end), after the residual add.
template <class T>
void store_out(const LinearParams& p, int32_t m, int32_t oc, Vec v) {
  const int n = p.n_out - oc;
  if (n <= 0) return;
  if (p.residual) v = V::add(v, V::load_n(static_cast<const T*>(p.residual) + m * p.residual_row_stride + oc, n));
  V::store_n(static_cast<T*>(p.out) + m * p.out_row_stride + oc, v, n);
}

// The epilogue of rows [m, m + rows) over packed columns [c, c + width) (whole units of kLinearUnitN), from acc
// (column c first, rows ldc floats apart).
template <class T>
void epilogue(const LinearParams& p, int32_t m, int32_t rows, int32_t c, int32_t width, const float* acc,
              int64_t ldc) {
  constexpr int kUnitVecs = kLinearUnitN / kLanes, kHalf = kUnitVecs / 2;
  for (int32_t r = 0; r < rows; ++r) {
    const float* a = acc + r * ldc;
    for (int32_t j = 0; j < width; j += kLinearUnitN) {
      Vec v[kUnitVecs];
      for (int h = 0; h < kUnitVecs; ++h) {
        v[h] = V::load(a + j + kLanes * h);
        if (p.bias) v[h] = V::add(v[h], V::load(p.bias + c + j + kLanes * h));
      }
      if (p.gated) {  // gate columns [0, 16) of the unit, up columns [16, 32): output columns (c + j) / 2 + [0, 16)
        for (int h = 0; h < kHalf; ++h)
          store_out<T>(p, m + r, (c + j) / 2 + kLanes * h, V::mul(silu(v[h]), v[h + kHalf]));
      } else {
        for (int h = 0; h < kUnitVecs; ++h) store_out<T>(p, m + r, c + j + kLanes * h, v[h]);
      }
    }
  }
}

// ---- the rectangle ------------------------------------------------------------------------------------------------

// Rows [m0, m1) x packed columns [c0, c1) (multiples of kLinearUnitN): block part by block part, in a part K block
// by K block, every row tile of the rectangle over the block's panel.
// q: the int8 scales (Int8Quads), else nullptr; its K blocks are whole groups.
template <class E>
void rect_scaled(const LinearParams& p, const Int8Scales* q, int32_t m0, int32_t m1, int32_t c0, int32_t c1) {
  using T = typename E::T;
  constexpr int64_t kBlockSteps = kPanelBytes / (E::kStepElems * int64_t(sizeof(typename E::W)));
  const int64_t k_steps = p.k / E::kPack;  // K is even for bf16 pairs (the launcher pads)
  const int64_t k_blocks = std::max<int64_t>(1, (k_steps + kBlockSteps - 1) / kBlockSteps);
  const int64_t group_steps = q ? q->group_steps : 1;
  const int64_t block_steps =
      std::max<int64_t>(1, ((k_steps + k_blocks - 1) / k_blocks + group_steps - 1) / group_steps * group_steps);
  const bool narrow = kNarrowLayer && !E::kPanel && m1 - m0 <= kNarrowRows;
  // The sums of a tile between its K blocks: over several, the rectangle's rows x one block part wait in
  // `partial`; with one, a tile's sums go through one L1 buffer that the next tile reuses (the rectangle's
  // [m1 - m0][64] written and read back once per block part cost a 776-row bf16 prefill 2-11% on a Zen 4:
  // bench/results/tiers/kernels/linear_text_ab_rerun_avx512bf16.txt).
  thread_local std::vector<float> partial;
  alignas(64) float local[kTileRows * kLinearBlockN];
  const bool one_block = block_steps >= k_steps;
  if (!one_block && partial.size() < size_t(m1 - m0) * kLinearBlockN)
    partial.resize(size_t(m1 - m0) * kLinearBlockN);
  const typename E::P* packed = static_cast<const typename E::P*>(p.w_packed);
  for (int32_t c = c0; c < c1;) {
    const int32_t block = c / kLinearBlockN, part0 = c % kLinearBlockN;
    const int32_t width = std::min(kLinearBlockN - part0, c1 - c);  // 32 or 64 columns of this block
    const typename E::P* w = packed + (int64_t(block) * k_steps * kLinearBlockN + part0) * E::kPack;
    for (int64_t s0 = 0;; s0 += block_steps) {  // at least one pass: K = 0 still runs the epilogue on zeros
      const int64_t steps = std::min(block_steps, k_steps - s0);
      const bool last = s0 + steps >= k_steps;
      const typename E::W* wk = block_weights<E>(w + s0 * kLinearBlockN * E::kPack, steps, width);
      for (int32_t m = m0, tm; m < m1; m += tm) {
        tm = tile_rows(narrow, m, m1);
        const Rows x = x_rows<E>(p, m, tm, s0 * E::kPack, steps * E::kPack);
        float* acc = one_block ? local : partial.data() + int64_t(m - m0) * kLinearBlockN;
        const int nv = tile_vecs<E>(tm, width);
        for (int32_t s = 0; s < width; s += nv * kLanes) {
          const bool prefetch = m == m0 && s == 0;  // the first tile's first strip (micro_fit: where it applies)
          Tile t{x.data, x.stride, wk + s * E::kColElems, steps, s0 == 0, acc + s, prefetch, k_steps - s0 - 1};
          if constexpr (E::kRows == XRows::kCodes) {
            const int64_t g0 = s0 / group_steps, at = (int64_t(block) * q->groups + g0) * kLinearBlockN + part0 + s;
            t.x_scale = q->x_scale + int64_t(m) * q->groups + g0, t.x_scale_stride = q->groups;
            t.w_scale = q->w_scale + at, t.w_base = q->w_base + at, t.group_steps = group_steps;
          }
          micro_rows<E>(tm, nv, t);
        }
        if (last) epilogue<T>(p, m, tm, c, width, acc, kLinearBlockN);
      }
      if (last) break;
    }
    c += width;
  }
}

template <class E>
void rect(const LinearParams& p, int32_t m0, int32_t m1, int32_t c0, int32_t c1) {
  rect_scaled<E>(p, nullptr, m0, m1, c0, c1);
}

void rect_widen(const LinearParams& p, int32_t m0, int32_t m1, int32_t c0, int32_t c1) {
  if (m1 - m0 >= kWidenPanelRows) rect<WidenPanel>(p, m0, m1, c0, c1);
  else rect<Bf16Widen>(p, m0, m1, c0, c1);
}

void rect_bf16_weight(const LinearParams& p, int32_t m0, int32_t m1, int32_t c0, int32_t c1) {
  if (kNarrowLayer && m1 - m0 > kWeightPanelRows) rect<WeightPanel>(p, m0, m1, c0, c1);
  else rect<Bf16Weight>(p, m0, m1, c0, c1);
}

// ---- int8: the quantizing prologue and the rectangles ---------------------------------------------------------

// Rows [m0, m1) of x (of T) as codes at q + m * q_stride (K4 bytes, the padding the zero code) and their group
// scales at scale + m * groups.
template <class T>
void quantize(const LinearInt8Params& p, int32_t m0, int32_t m1, uint8_t* q, int64_t q_stride, float* scale) {
  const int32_t k = p.k, k4 = (k + 3) / 4 * 4, groups = (k + p.group - 1) / p.group;
  for (int32_t m = m0; m < m1; ++m) {
    const T* row = static_cast<const T*>(p.x) + m * p.x_row_stride;
    uint8_t* codes = q + m * q_stride;
    for (int32_t g = 0; g < groups; ++g) {
      const int32_t i0 = g * p.group, i1 = std::min(k, i0 + p.group);
      Vec peak = V::zero();
      for (int32_t i = i0; i < i1; i += kLanes) peak = V::max(peak, V::abs(V::load_n(row + i, std::min(kLanes, i1 - i))));
      const float amax = V::reduce_max(peak);
      const float factor = amax > 0.0f ? 127.0f / amax : 0.0f;  // one rounding, as pyscore/ops/linear_int8.py
      scale[int64_t(m) * groups + g] = amax / 127.0f;
      for (int32_t i = i0; i < i1; i += kLanes) {
        const int n = std::min(kLanes, i1 - i);
        V::store_codes(codes + i, V::mul(V::load_n(row + i, n), V::set1(factor)), n);
      }
    }
    for (int32_t i = k; i < k4; ++i) codes[i] = uint8_t(V::kInt8XOffset);
  }
}

template <class T>
void rect_int8(const LinearParams& p, const Int8Scales& s, int32_t m0, int32_t m1, int32_t c0, int32_t c1) {
  rect_scaled<Int8Quads<T>>(p, &s, m0, m1, c0, c1);
}

const LinearInt8CpuOps kInt8F32Ops{quantize<float>, rect_int8<float>, kTileRows};
const LinearInt8CpuOps kInt8Bf16Ops{quantize<uint16_t>, rect_int8<uint16_t>, kTileRows};

const LinearCpuOps kF32Ops{rect<F32>, kTileRows, epilogue<float>};
const LinearCpuOps kBf16WidenOps{rect_widen, kTileRows, epilogue<uint16_t>};
const LinearCpuOps kBf16PairsOps{rect<Bf16Pairs>, kTileRows, epilogue<uint16_t>};
const LinearCpuOps kBf16WeightOps{rect_bf16_weight, kTileRows, epilogue<float>};

}  // namespace

// int8 (key.dtype: x's). A layer whose quads are vpdpbusd needs AVX512-VNNI (cpu_int8_vnni); without it the AVX2
// layer's serve.
const LinearInt8CpuOps* PYSCORE_VEC_ENTRY(linear_int8_ops)(const KernelKey& key) {
  if constexpr (V::kInt8DotIsVnni) {
    if (!cpu_int8_vnni()) return nullptr;
  }
  if (key.dtype == DType::kFloat32) return &kInt8F32Ops;
  if (key.dtype == DType::kBFloat16) return &kInt8Bf16Ops;
  return nullptr;
}

const LinearCpuOps* PYSCORE_VEC_ENTRY(linear_ops)(const KernelKey& key) {
  if (key.bf16_weight) return key.dtype == DType::kFloat32 ? &kBf16WeightOps : nullptr;
  if (key.dtype == DType::kFloat32) return &kF32Ops;
  if (key.dtype != DType::kBFloat16) return nullptr;
  if constexpr (V::kHasBf16Dot) {
    if (key.bf16_dot == Bf16Dot::kDpbf16) return &kBf16PairsOps;
  }
  return &kBf16WidenOps;
}

}  // namespace pyscore
