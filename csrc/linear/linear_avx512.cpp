// AVX-512 ops of the CPU linear kernel (interface in linear.h, packed layout in linear.h).
//
// At tier amx, bf16 runs on AMX tiles instead (rect_amx below).
//
// Micro-kernel: TM <= 6 rows x ZN <= 4 zmm (64 packed columns) of fp32 accumulators held in registers over a K
// block (24 + 4 weight operands + 1 broadcast <= 32 zmm); each step loads ZN weight zmm (16 columns x one pair) and
// broadcasts one x pair per row. Over a rectangle, the weight panel of a block (K block x 64) is reused from L2 by
// every row tile. bf16 pairs are multiplied by vdpbf16ps or widened to fp32 with two FMAs in its order (Bf16Dot): the
// same bits; widened, a rectangle of 64 rows or more first widens each weight panel to fp32 once (Bf16Panel), so its
// steps are the fp32 kernel's. bf16 weights under fp32 x (Bf16Weight) widen each weight zmm in registers and run the
// fp32 kernel's FMAs. The epilogue (bias, SiLU-mul, residual, rounding) runs on the accumulators before the one store.
#include <algorithm>
#include <cstring>
#include <vector>

#include "common/amx_tiles.h"
#include "common/vec_math_avx512.h"
#include "linear/linear.h"

namespace pyscore {
namespace {

using namespace avx512;

constexpr int kTileRows = 6;
constexpr int kMaxZmm = kLinearBlockN / 16;

// Element traits as in the attention kernel: T is the stored type of x, the weight and the output; B the broadcast
// operand (x rows), one 4-byte unit (kPack elements) per step. step() adds, for TM rows, row r's unit
// (b + r * b_stride) times the ZN weight zmm at w into acc[r][0..ZN).
// The weight as the rect hands it to the steps: P is the packed element (linear.h), W what step() reads; weights()
// turns a K block of the packed weight (steps K steps, zn zmm from the rect's first column) into W. Here it is the
// packed weight itself. K steps per block: a block's weight panel (kLinearBlockN columns x this many steps: 512 KiB in
// fp32 and in bf16 pairs) stays in L2 while every row tile of the rectangle passes over it. Unblocked, Qwen3-8B's down
// (K = 12288, a 3 MiB fp32 panel) came from L3 for every row tile: 0.45-0.58x torch's F.linear at prefill,
// 0.99-1.03x with these blocks (bench/results/tiers/kernels/linear_fp32_kblock_ab.txt; 4096-step blocks 0.94x, 1024 as
// 2048: linear_fp32_kblock_sizes.txt). Half of Zen 4's 1 MiB L2. The blocks change no bit (partial sums wait in
// fp32, exactly).
template <class Elem>
struct PackedAsIs {
  using P = Elem;
  using W = Elem;
  static constexpr int64_t kBlockSteps = 2048;
  static const W* weights(const P* w, int64_t, int) { return w; }
};

struct Bf16 : PackedAsIs<uint16_t> {  // vdpbf16ps
  using T = uint16_t;
  using B = uint16_t;
  static constexpr int kPack = 2;
  template <int TM, int ZN>
  static void step(__m512 (&acc)[TM][ZN], const B* b, int64_t b_stride, const T* w) {
    __m512 v[ZN];
    for (int z = 0; z < ZN; ++z) v[z] = _mm512_loadu_ps(w + z * 16 * kPack);
    for (int r = 0; r < TM; ++r) {
      int32_t pair;
      std::memcpy(&pair, b + r * b_stride, sizeof(pair));
      const __m512bh bc = (__m512bh)_mm512_set1_epi32(pair);
      for (int z = 0; z < ZN; ++z) acc[r][z] = _mm512_dpbf16_ps(acc[r][z], bc, (__m512bh)v[z]);
    }
  }
  struct Rows {
    const B* data;
    int64_t stride;
  };
  static Rows rows(const T* x, int64_t x_stride, int, int) { return {x, x_stride}; }
  static __m512 load(const T* p, __mmask16 m) { return maskz_load_bf16_ps(m, p); }
  static void store(T* p, __mmask16 m, __m512 v) { mask_store_bf16_exact_ps(p, m, v); }
};

// A tile's tm bf16 x rows over k (even) elements widened into a per-thread fp32 buffer, rows k apart; with
// kSwapPairs each pair is stored odd element first (Bf16Panel's order).
template <bool kSwapPairs>
const float* widen_rows(const uint16_t* x, int64_t x_stride, int tm, int k) {
  thread_local std::vector<float> buf;
  if (int64_t(buf.size()) < int64_t(tm) * k) buf.resize(int64_t(tm) * k);
  for (int r = 0; r < tm; ++r)
    for (int i = 0; i < k; i += 16) {  // k even: a ragged end is whole pairs
      const __mmask16 m = k - i >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (k - i)) - 1);
      __m512 v = maskz_load_bf16_ps(m, x + r * x_stride + i);
      if (kSwapPairs) v = _mm512_permute_ps(v, 0xB1);
      _mm512_mask_storeu_ps(buf.data() + int64_t(r) * k + i, m, v);
    }
  return buf.data();
}

// Widened pairs, two FMAs in vdpbf16ps's order (odd first): Bf16's bits on normal numbers. The tile's x rows are
// widened once per tile into a per-thread fp32 buffer; each weight zmm is widened once for all TM rows, and the
// broadcasts are FMA memory operands (see opaque()).
struct Bf16Widen : PackedAsIs<uint16_t> {
  using T = uint16_t;
  using B = float;
  static constexpr int kPack = 2;
  template <int TM, int ZN>
  static void step(__m512 (&acc)[TM][ZN], const B* b, int64_t b_stride, const T* w) {
    for (int z = 0; z < ZN; ++z) {
      const __m512i v = _mm512_loadu_si512(w + z * 16 * kPack);
      const __m512 even = bf16_even_ps(v), odd = bf16_odd_ps(v);
      const B* bz = opaque(b);
      for (int r = 0; r < TM; ++r)
        acc[r][z] = dot2_widened_ps(acc[r][z], _mm512_set1_ps(bz[r * b_stride]), _mm512_set1_ps(bz[r * b_stride + 1]),
                                    even, odd);
    }
  }
  struct Rows {
    const B* data;
    int64_t stride;
  };
  static Rows rows(const T* x, int64_t x_stride, int tm, int k) { return {widen_rows<false>(x, x_stride, tm, k), k}; }
  static __m512 load(const T* p, __mmask16 m) { return maskz_load_bf16_ps(m, p); }
  static void store(T* p, __mmask16 m, __m512 v) { mask_store_bf16_exact_ps(p, m, v); }
};

struct F32 : PackedAsIs<float> {
  using T = float;
  using B = float;
  static constexpr int kPack = 1;
  template <int TM, int ZN>
  static void step(__m512 (&acc)[TM][ZN], const B* b, int64_t b_stride, const T* w) {
    __m512 v[ZN];
    for (int z = 0; z < ZN; ++z) v[z] = _mm512_loadu_ps(w + z * 16);
    for (int r = 0; r < TM; ++r) {
      const __m512 bc = _mm512_set1_ps(b[r * b_stride]);
      for (int z = 0; z < ZN; ++z) acc[r][z] = _mm512_fmadd_ps(bc, v[z], acc[r][z]);
    }
  }
  struct Rows {
    const B* data;
    int64_t stride;
  };
  static Rows rows(const T* x, int64_t x_stride, int, int) { return {x, x_stride}; }
  static __m512 load(const T* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
  static void store(T* p, __mmask16 m, __m512 v) { _mm512_mask_storeu_ps(p, m, v); }
};

// Bf16Widen's arithmetic near the fp32 kernel's rate, for rectangles of many rows: the rect widens each K block's
// weight panel once into a per-thread fp32 buffer (weights() below: at most 512 KiB, hence K blocks of half the
// steps), each pair stored odd row first, and a tile's x rows into fp32 with each pair swapped the same way; a pair
// step is then two fp32 steps, odd then even: the same two FMAs per pair in the same order as Bf16Widen, so the same bits, while a pair step loads 8
// weight zmm and 12 broadcasts and widens nothing (Bf16Widen: 4 zmm widened on the FMA ports and 48 broadcasts,
// 0.54-0.78x the fp32 kernel's rate: bench/results/tiers/kernels/linear_avx512_dtypes.txt).
struct Bf16Panel : Bf16Widen {  // T, P, B, kPack, Rows, load and store as Bf16Widen
  using W = float;
  static constexpr int64_t kBlockSteps = 1024;
  template <int TM, int ZN>
  static void step(__m512 (&acc)[TM][ZN], const B* b, int64_t b_stride, const W* w) {
    F32::step<TM, ZN>(acc, b, b_stride, w);                      // x_odd * w_odd
    F32::step<TM, ZN>(acc, b + 1, b_stride, w + kLinearBlockN);  // then x_even * w_even
  }
  static Rows rows(const T* x, int64_t x_stride, int tm, int k) { return {widen_rows<true>(x, x_stride, tm, k), k}; }
  // The packed bf16 panel w (steps pair rows of a block, from its zmm column z0) as fp32 pair rows, zn zmm wide:
  // row 2s the odd elements, row 2s + 1 the even ones, kLinearBlockN floats apart (the fp32 packed layout).
  static const W* weights(const P* w, int64_t steps, int zn) {
    thread_local std::vector<float> buf;
    buf.resize(size_t(steps) * 2 * kLinearBlockN);
    for (int64_t s = 0; s < steps; ++s)
      for (int z = 0; z < zn; ++z) {
        const __m512i v = _mm512_loadu_si512(w + (s * kLinearBlockN + z * 16) * 2);
        _mm512_storeu_ps(buf.data() + s * 2 * kLinearBlockN + z * 16, bf16_odd_ps(v));
        _mm512_storeu_ps(buf.data() + (s * 2 + 1) * kLinearBlockN + z * 16, bf16_even_ps(v));
      }
    return buf.data();
  }
};

// bf16 weight pairs under fp32 x (LinearParams::bf16_weight): each weight zmm (16 columns x one pair) widened once
// for all TM rows, then F32's FMAs for the pair's even element (K step 2s) and its odd one (2s + 1), x's fp32 rows
// read in place. A lane's chain over K is F32's, so the bits are those of the fp32 weight holding the same values.
// At every row count: on a Zen 4 (weights from DRAM) this ran 2.0-2.8x the fp32 weight at one row (half the bytes),
// 1.05-1.34x at 8-16 rows, 0.95-1.07x from 24 rows to a 776-row prefill (a 16-candidate MIS 0.99-1.00x); an fp32
// panel widened once per K block (as Bf16Panel) read 0.25-0.93x the pairs up to 128 rows and 0.95-1.04x at 256-776
// (bench/results/tiers/kernels/linear_avx512_bf16_weights.txt).
struct Bf16Weight : F32 {  // B, Rows, rows(), load and store as F32: x and out are fp32
  using P = uint16_t;
  using W = uint16_t;
  static constexpr int kPack = 2;
  static constexpr int64_t kBlockSteps = 1024;  // pair steps: F32's 2048 K steps
  template <int TM, int ZN>
  static void step(__m512 (&acc)[TM][ZN], const B* b, int64_t b_stride, const W* w) {
    __m512i v[ZN];
    for (int z = 0; z < ZN; ++z) v[z] = _mm512_loadu_si512(w + z * 16 * kPack);
    __m512 half[ZN];
    for (int z = 0; z < ZN; ++z) half[z] = bf16_even_ps(v[z]);
    for (int r = 0; r < TM; ++r) {
      const __m512 bc = _mm512_set1_ps(b[r * b_stride]);
      for (int z = 0; z < ZN; ++z) acc[r][z] = _mm512_fmadd_ps(bc, half[z], acc[r][z]);
    }
    for (int z = 0; z < ZN; ++z) half[z] = bf16_odd_ps(v[z]);
    for (int r = 0; r < TM; ++r) {
      const __m512 bc = _mm512_set1_ps(b[r * b_stride + 1]);
      for (int z = 0; z < ZN; ++z) acc[r][z] = _mm512_fmadd_ps(bc, half[z], acc[r][z]);
    }
  }
  static const W* weights(const P* w, int64_t, int) { return w; }
};

inline __mmask16 lanes_below(int32_t count) {
  if (count >= 16) return 0xFFFF;
  return count <= 0 ? 0 : __mmask16((1u << count) - 1);
}

inline __m512 silu_ps(__m512 g) {
  return _mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f), exp_ps(_mm512_sub_ps(_mm512_setzero_ps(), g))));
}

// Writes one output vector of 16 columns starting at output column oc of row m, after the residual add.
template <class E>
inline void store_out(const LinearParams& p, int32_t m, int32_t oc, __m512 v) {
  using T = typename E::T;
  const __mmask16 mask = lanes_below(p.n_out - oc);
  if (!mask) return;
  if (p.residual)
    v = _mm512_add_ps(v, E::load(static_cast<const T*>(p.residual) + m * p.residual_row_stride + oc, mask));
  E::store(static_cast<T*>(p.out) + m * p.out_row_stride + oc, mask, v);
}

// One K block of a tile: K steps [s0, s1) (steps of E::kPack elements). The fp32 sums wait in `part` between
// blocks (the tile's rows kLinearBlockN floats apart): read unless `first`, written unless `last`; the last block
// runs the epilogue. An fp32 sum stored and reloaded is exact, so a K split in blocks gives the unsplit bits.
struct KSpan {
  int64_t s0, s1;
  float* part;
  bool first, last;
};

// TM rows (from row m) x ZN zmm of packed columns (from column c, block-aligned to 16) over one K block; w is the
// block's weight at step ks.s0.
template <class E, int TM, int ZN>
void tile(const LinearParams& p, int32_t m, int32_t c, const typename E::W* w, const KSpan& ks) {
  using T = typename E::T;
  const auto x = E::rows(static_cast<const T*>(p.x) + m * p.x_row_stride + ks.s0 * E::kPack, p.x_row_stride, TM,
                         int(ks.s1 - ks.s0) * E::kPack);
  __m512 acc[TM][ZN];
  for (int r = 0; r < TM; ++r)
    for (int z = 0; z < ZN; ++z)
      acc[r][z] = ks.first ? _mm512_setzero_ps() : _mm512_loadu_ps(ks.part + r * kLinearBlockN + 16 * z);
  for (int64_t s = ks.s0; s < ks.s1; ++s)
    E::template step<TM, ZN>(acc, x.data + (s - ks.s0) * E::kPack, x.stride,
                             w + (s - ks.s0) * kLinearBlockN * E::kPack);
  if (!ks.last) {
    for (int r = 0; r < TM; ++r)
      for (int z = 0; z < ZN; ++z) _mm512_storeu_ps(ks.part + r * kLinearBlockN + 16 * z, acc[r][z]);
    return;
  }
  for (int z = 0; z < ZN; ++z) {
    const __m512 bias = p.bias ? _mm512_loadu_ps(p.bias + c + 16 * z) : _mm512_setzero_ps();
    for (int r = 0; r < TM; ++r) acc[r][z] = _mm512_add_ps(acc[r][z], bias);
  }
  for (int r = 0; r < TM; ++r) {
    if (p.gated) {
      // zmm pairs (gate, up) of one 32-column unit; c is a multiple of 32, ZN even.
      for (int z = 0; z + 1 < ZN; z += 2)
        store_out<E>(p, m + r, (c + 16 * z) / 2, _mm512_mul_ps(silu_ps(acc[r][z]), acc[r][z + 1]));
    } else {
      for (int z = 0; z < ZN; ++z) store_out<E>(p, m + r, c + 16 * z, acc[r][z]);
    }
  }
}

// Rows [m0, m1) in tiles; ks.part (when blocked) holds row m0's partial sums first.
template <class E, int ZN>
void row_tiles(const LinearParams& p, int32_t m0, int32_t m1, int32_t c, const typename E::W* w, KSpan ks) {
  float* const part = ks.part;
  auto at = [&](int32_t m) {
    if (part) ks.part = part + int64_t(m - m0) * kLinearBlockN;
    return ks;
  };
  int32_t m = m0;
  for (; m + kTileRows <= m1; m += kTileRows) tile<E, kTileRows, ZN>(p, m, c, w, at(m));
  switch (m1 - m) {
    case 1: tile<E, 1, ZN>(p, m, c, w, at(m)); break;
    case 2: tile<E, 2, ZN>(p, m, c, w, at(m)); break;
    case 3: tile<E, 3, ZN>(p, m, c, w, at(m)); break;
    case 4: tile<E, 4, ZN>(p, m, c, w, at(m)); break;
    case 5: tile<E, 5, ZN>(p, m, c, w, at(m)); break;
    default: break;
  }
}


// Block by block, and in a block K block by K block (the weight panel stays in L2 while every row tile of the
// rectangle passes over it).
template <class E>
void rect(const LinearParams& p, int32_t m0, int32_t m1, int32_t c0, int32_t c1) {
  using P = typename E::P;
  const int64_t k_steps = p.k / E::kPack;
  const int64_t k_blocks = std::max<int64_t>(1, (k_steps + E::kBlockSteps - 1) / E::kBlockSteps);  // K = 0: one
  const int64_t block_steps = (k_steps + k_blocks - 1) / k_blocks;
  thread_local std::vector<float> part;  // per thread: the rectangle's rows x one column block, between K blocks
  if (k_blocks > 1) part.resize(size_t(m1 - m0) * kLinearBlockN);
  const P* packed = static_cast<const P*>(p.w_packed);
  for (int32_t c = c0; c < c1;) {
    const int32_t block = c / kLinearBlockN, z0 = (c % kLinearBlockN) / 16;
    const int32_t zn = std::min<int32_t>(kMaxZmm - z0, (c1 - c) / 16);
    const P* w = packed + (int64_t(block) * k_steps * kLinearBlockN + z0 * 16) * E::kPack;
    for (int64_t s0 = 0;; s0 += block_steps) {  // at least one pass: K = 0 still runs the epilogue
      const int64_t s1 = std::min(k_steps, s0 + block_steps);
      const KSpan ks{s0, s1, k_blocks > 1 ? part.data() : nullptr, s0 == 0, s1 == k_steps};
      const typename E::W* we = E::weights(w + s0 * kLinearBlockN * E::kPack, s1 - s0, zn);
      if (zn == 4) row_tiles<E, 4>(p, m0, m1, c, we, ks);
      else row_tiles<E, 2>(p, m0, m1, c, we, ks);  // units of 32 columns: 2 or 4 zmm
      if (s1 == k_steps) break;
    }
    c += 16 * zn;
  }
}

// Widened bf16 pairs: through the fp32 panel where the rectangle has the rows to repay widening it, else pair by
// pair. Both give the same bits, so the rows a call has change no row's result. A prefill's rows take the panel, a
// decode step's few rows stay pair by pair (bench/results/tiers/kernels/linear_widen_panel.txt).
constexpr int32_t kPanelMinRows = 64;

void rect_widen(const LinearParams& p, int32_t m0, int32_t m1, int32_t c0, int32_t c1) {
  if (m1 - m0 >= kPanelMinRows) rect<Bf16Panel>(p, m0, m1, c0, c1);
  else rect<Bf16Widen>(p, m0, m1, c0, c1);
}

const LinearCpuOps kBf16Ops{rect<Bf16>, kTileRows};
const LinearCpuOps kBf16WidenOps{rect_widen, kTileRows};
const LinearCpuOps kF32Ops{rect<F32>, kTileRows};
const LinearCpuOps kBf16WeightOps{rect<Bf16Weight>, kTileRows};

// ---- AMX (bf16) ------------------------------------------------------------------------------------------------
// Tiles: fp32 accumulators C (up to 4 of 16 rows x 16 columns), A (4-5: 16 rows of x x 32 K) and B (6-7: 16 K pairs x
// 16 packed columns x 2). B is read straight from the packed layout: a block's K-pair rows are 64 columns x 2 bf16 =
// 256 bytes apart, and 16 columns x one pair is one 64-byte row of a B tile. Micro-kernels: 2 row tiles x one 32-column
// unit (2x2 C tiles, 4 tile loads per 4 TDPBF16PS) for a row block of more than 192 rows at K <= 2048; 1 row tile x a
// whole 64-column block (1x4: each K-pair row of the weight read whole, front to back) for 192 rows or fewer (decode
// steps, mid-sized batches) and for K > 2048. Both give the same bits: an element's TDPBF16PS sequence does not depend
// on the tiles around it. Each output element is the same TDPBF16PS sequence over K whatever M is and wherever its row
// falls (tail rows run in a zero-padded copy, K blocks are a function of K alone), so rows are batch-invariant as on
// the other paths.
// Needs K % 32 == 0 (every K of the supported families); other K run the widened-FMA path for the whole weight.
// Tried and measured slower here (Xeon family 6 model 167, bench/results/tiers/kernels/linear_amx.txt): x repacked into
// contiguous 1 KB tile images, software prefetch of the next B rows, K blocks under 2048 (partials in L2), N chunks,
// row-tile-major order; and, timing one thread's rectangle alone, the weight held in L1: a 64-column
// block over K slabs of 4-16 steps met by every row tile, x in slab-major tile images, fp32 partials in L2 (padded
// rows) reloaded per slab: 0.75-0.9x this kernel at Qwen3-8B's qkv and SmolLM2's gate_up for every slab, row block
// and column chunk tried. Tile rows must start 64-byte aligned: misaligned x or weights halved this kernel's speed.
// Where the rest goes (Xeon family 6 model 207, bench/results/tiers/probes/linear_amx_epilogue_probes.txt): 42-53% of the
// TDPBF16PS rate at SmolLM2's prefill shapes on one thread; the epilogue is 14-23% of a call, almost all of it the
// output stores (two new lines per 4 TDPBF16PS at K = 576). Paired vpermt2w stores, prefetchw of the output lines,
// streaming stores, a later start of the epilogue and 512-wide K slices in the 2 x 2 kernel gained nothing.
constexpr int kAmxTileRows = 16, kAmxK = 32;

// The epilogue of rows [m, m + rows) x packed columns [c, c + width) (whole units), from acc (rows ldc apart).
void amx_epilogue(const LinearParams& p, int32_t m, int32_t rows, int32_t c, int32_t width, const float* acc,
                  int64_t ldc) {
  for (int32_t u = 0; u < width; u += kLinearUnitN) {
    const __m512 b0 = p.bias ? _mm512_loadu_ps(p.bias + c + u) : _mm512_setzero_ps();
    const __m512 b1 = p.bias ? _mm512_loadu_ps(p.bias + c + u + 16) : _mm512_setzero_ps();
    for (int32_t r = 0; r < rows; ++r) {
      const __m512 v0 = _mm512_add_ps(_mm512_loadu_ps(acc + r * ldc + u), b0);
      const __m512 v1 = _mm512_add_ps(_mm512_loadu_ps(acc + r * ldc + u + 16), b1);
      if (p.gated) {
        store_out<Bf16>(p, m + r, (c + u) / 2, _mm512_mul_ps(silu_ps(v0), v1));
      } else {
        store_out<Bf16>(p, m + r, c + u, v0);
        store_out<Bf16>(p, m + r, c + u + 16, v1);
      }
    }
  }
}

// An epilogue waiting to run: rows [m + done, m + rows) x packed columns [c, c + width) from acc. It runs a few rows
// at a time between the K steps of the next tile block, so the vector units work while the tiles multiply (run in
// one piece after its block, it left the tiles idle: SmolLM2's gate_up prefill took 1.3 ms instead of 1.2).
struct PendingEpilogue {
  const LinearParams& p;
  int32_t m = 0, rows = 0, done = 0, c = 0, width = 0;
  const float* acc = nullptr;
  int64_t ldc = 0;
  void run(int32_t n) {
    const int32_t end = std::min(rows, done + n);
    if (done < end) amx_epilogue(p, m + done, end - done, c, width, acc + done * ldc, ldc);
    done = end;
  }
  void finish() { run(rows); }
  void set(int32_t m_, int32_t rows_, int32_t c_, int32_t width_, const float* acc_, int64_t ldc_) {
    m = m_, rows = rows_, done = 0, c = c_, width = width_, acc = acc_, ldc = ldc_;
  }
};

// Rows of x for the A tiles: row tile i starts at row[i] (at the K block's first column), its rows stride[i]
// elements apart (x itself, or the zero-padded copy of a short last tile).
struct AmxRows {
  const uint16_t* row[2];
  int64_t stride[2];
};

// acc [RT * 16][BT * 16] fp32 (+)= RT row tiles of x x BT B tiles of the weight from w, over `steps` K steps of 32:
// from zero when `first`, else continuing the partial sums in acc (an fp32 tile stored and reloaded is exact, so a K
// split in blocks gives the unsplit bits); acc rows are ldc apart. `pending` is run between the steps and finished
// before acc is written.
template <int RT, int BT>
void amx_block(const AmxRows& a, const uint16_t* w, int32_t steps, bool first, float* acc, int64_t ldc,
               PendingEpilogue& pending) {
  static_assert((RT == 2 && BT == 2) || (RT == 1 && (BT == 2 || BT == 4)), "four accumulator tiles at most");
  constexpr int kC = RT * BT;
  const int64_t c_bytes = ldc * 4, b_bytes = kLinearBlockN * 2 * 2, b_step = (kAmxK / 2) * kLinearBlockN * 2;
  auto c_at = [&](int t) { return RT == 2 ? acc + (t / 2) * 16 * ldc + (t % 2) * 16 : acc + t * 16; };
  if (first) {
    _tile_zero(0);
    _tile_zero(1);
    if (kC == 4) {
      _tile_zero(2);
      _tile_zero(3);
    }
  } else {
    _tile_loadd(0, c_at(0), c_bytes);
    _tile_loadd(1, c_at(1), c_bytes);
    if (kC == 4) {
      _tile_loadd(2, c_at(2), c_bytes);
      _tile_loadd(3, c_at(3), c_bytes);
    }
  }
  const int64_t a0_bytes = a.stride[0] * 2, a1_bytes = a.stride[RT - 1] * 2;
  const int32_t epilogue_rows = (pending.rows - pending.done + steps - 1) / steps;
  for (int32_t s = 0; s < steps; ++s) {
    const uint16_t* b = w + int64_t(s) * b_step;
    _tile_loadd(4, a.row[0] + s * kAmxK, a0_bytes);
    if (RT == 2) {
      // The weight unit streams past the pair of row tiles, which the chunk's next units reuse: loaded with the
      // non-temporal hint (TILELOADDT1), the weight leaves the pair's x in L1 instead of evicting it (SmolLM2's
      // gate_up prefill 0.87-0.90x -> 0.96-1.00x torch: bench/results/tiers/kernels/linear_amx_stream_ab.txt). The 1 x 4
      // kernel keeps plain loads: over K blocks the weight panels are the operand reused (from L2), and at decode
      // each weight tile meets one row tile; the hint measured slower or no faster in both.
      _tile_stream_loadd(6, b, b_bytes);
      _tile_stream_loadd(7, b + 32, b_bytes);
    } else {
      _tile_loadd(6, b, b_bytes);
      _tile_loadd(7, b + 32, b_bytes);
    }
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    if (RT == 2) {
      _tile_loadd(5, a.row[RT - 1] + s * kAmxK, a1_bytes);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    } else if (BT == 4) {
      _tile_loadd(6, b + 64, b_bytes);
      _tile_loadd(7, b + 96, b_bytes);
      _tile_dpbf16ps(2, 4, 6);
      _tile_dpbf16ps(3, 4, 7);
    }
    pending.run(epilogue_rows);
  }
  pending.finish();
  _tile_stored(0, c_at(0), c_bytes);
  _tile_stored(1, c_at(1), c_bytes);
  if (kC == 4) {
    _tile_stored(2, c_at(2), c_bytes);
    _tile_stored(3, c_at(3), c_bytes);
  }
}

// Cache blocking (the K blocks are a function of K alone, which keeps the bits): K in near-equal blocks of at most
// kAmxKBlock. With one K block, all of the rectangle's rows are one row block: each 256-column chunk's weight panels
// come from memory once per call while the rows pass over them (x from L2 / L3). Blocks of 256 rows read the whole
// weight once per block, and a short last block (a 776-row MIS: 3 x 256 + 8) once more for a few rows
// (bench/results/tiers/kernels/linear_amx_row_blocks.txt). Over
// several K blocks (K > 2048: Qwen3-8B's projections, weights far larger than L3) a row block is as tall as
// kAmxPartialBytes of fp32 partials allow, from kAmxRowBlock up to kAmxRowBlockMax rows. Partial sums wait in fp32
// between K blocks (exact); the epilogue runs after the last, one tile block behind the tiles (PendingEpilogue).
constexpr int32_t kAmxKBlock = 2048, kAmxRowBlock = 256, kAmxRowBlockMax = 1024, kAmxColChunk = 256;
// Row tiles per row block up to which the 1 x 4 kernel runs at one K block. Before, only a single row tile (16 rows)
// ran 1 x 4: a decode step of 17 generations took ~1.8x one of 16 in the projections
// (bench/results/tiers/kernels/linear_amx_mid_rows.txt).
constexpr int32_t kAmx1x4MaxTiles = 12;
constexpr int64_t kAmxPartialBytes = int64_t(16) << 20;  // per thread

int32_t amx_row_block(int32_t rows, int32_t k_blocks, int32_t width) {
  if (k_blocks == 1) return rows;
  const int64_t fit = kAmxPartialBytes / (int64_t(width) * 4) / 32 * 32;
  return int32_t(std::min<int64_t>(rows, std::clamp<int64_t>(fit, kAmxRowBlock, kAmxRowBlockMax)));
}

void rect_amx(const LinearParams& p, int32_t m0, int32_t m1, int32_t c0, int32_t c1) {
  if (p.k % kAmxK) return rect_widen(p, m0, m1, c0, c1);
  const uint16_t* x = static_cast<const uint16_t*>(p.x);
  const uint16_t* packed = static_cast<const uint16_t*>(p.w_packed);
  const int64_t k_pairs = p.k / 2;
  const int32_t k_steps = p.k / kAmxK, k_blocks = (p.k + kAmxKBlock - 1) / kAmxKBlock;
  const int32_t block_steps = (k_steps + k_blocks - 1) / k_blocks;
  const int32_t width = c1 - c0, row_block = amx_row_block(m1 - m0, k_blocks, width);
  // Per thread, fresh per call: the zero-padded rows of a short last tile; the partials between K blocks.
  thread_local std::vector<uint16_t> tail;
  thread_local std::vector<float> partial;
  // With one K block the accumulators go through two small L1 buffers instead: one written, one in its epilogue.
  alignas(64) float local[2][2 * kAmxTileRows * kLinearBlockN];
  int flip = 0;
  const int64_t ldc = k_blocks == 1 ? kLinearBlockN : width;
  if (k_blocks > 1) partial.resize(size_t((row_block + 31) / 32 * 32) * width);
  const int32_t whole = m0 + (m1 - m0) / kAmxTileRows * kAmxTileRows;
  if (whole < m1) {
    tail.assign(size_t(kAmxTileRows) * p.k, 0);
    for (int32_t m = whole; m < m1; ++m)
      std::memcpy(tail.data() + int64_t(m - whole) * p.k, x + m * p.x_row_stride, size_t(p.k) * 2);
  }
  PendingEpilogue pending{p};
  load_amx_tiles_16x64();
  for (int32_t r0 = m0; r0 < m1; r0 += row_block) {
    const int32_t r1 = std::min(m1, r0 + row_block), tiles = (r1 - r0 + kAmxTileRows - 1) / kAmxTileRows;
    for (int32_t s0 = 0; s0 < k_steps; s0 += block_steps) {
      const int32_t steps = std::min(block_steps, k_steps - s0);
      const bool first = s0 == 0, last = s0 + steps == k_steps;
      auto tile_rows = [&](int32_t m, AmxRows& a, int i) {
        a.row[i] = (m < whole ? x + m * p.x_row_stride : tail.data()) + int64_t(s0) * kAmxK;
        a.stride[i] = m < whole ? p.x_row_stride : p.k;
      };
      auto weights = [&](int32_t c) {
        return packed + (int64_t(c / kLinearBlockN) * k_pairs * kLinearBlockN + c % kLinearBlockN) * 2 +
               int64_t(s0) * (kAmxK / 2) * kLinearBlockN * 2;
      };
      auto acc_at = [&](int32_t t, int32_t c) {
        return k_blocks == 1 ? local[flip ^= 1] : partial.data() + int64_t(t) * kAmxTileRows * width + (c - c0);
      };
      // 1 x 4 tiles, each K-pair row of a 64-column block read whole (the 2 x 2 tiles read half of it, and the
      // other half again for the next unit): for up to kAmx1x4MaxTiles row tiles, and over K blocks (K > 2048),
      // where the weight panels do not stay in L1 either way (0.8x -> 0.87x torch at Qwen3-8B's qkv and down
      // prefill). With several row tiles the columns go in chunks of kAmxColChunk, each tile meeting the chunk's
      // weight panels in L2 (over K blocks: a row tile's x block (16 x 2048) is read from L3 once per chunk, not
      // once per 64 columns; bench/results/tiers/kernels/linear_amx_kblock_chunks_ab.txt).
      if (tiles <= kAmx1x4MaxTiles || k_blocks > 1) {
        const int32_t chunk = tiles == 1 ? c1 - c0 : kAmxColChunk;
        for (int32_t cc = c0; cc < c1; cc += chunk) {
          const int32_t cc1 = std::min(c1, cc + chunk);
          for (int32_t t = 0; t < tiles; ++t) {
            const int32_t m = r0 + t * kAmxTileRows;
            AmxRows a;
            tile_rows(m, a, 0);
            for (int32_t c = cc; c < cc1;) {
              const bool whole_block = c % kLinearBlockN == 0 && c + kLinearBlockN <= cc1;
              const int32_t cw = whole_block ? kLinearBlockN : kLinearUnitN;
              float* acc = acc_at(t, c);
              if (whole_block) amx_block<1, 4>(a, weights(c), steps, first, acc, ldc, pending);
              else amx_block<1, 2>(a, weights(c), steps, first, acc, ldc, pending);
              if (last) pending.set(m, std::min(kAmxTileRows, r1 - m), c, cw, acc, ldc);
              c += cw;
            }
          }
        }
        continue;
      }
      // Columns in chunks of kAmxColChunk; in a chunk, each pair of row tiles meets every unit in turn, so the pair's
      // x (2 x 16 rows x K) stays in L1 while the chunk's weight panels come from L2.
      for (int32_t cc = c0; cc < c1; cc += kAmxColChunk) {
        const int32_t cc1 = std::min(c1, cc + kAmxColChunk);
        for (int32_t t = 0; t < tiles; t += 2) {
          const int32_t m = r0 + t * kAmxTileRows;
          AmxRows a;
          tile_rows(m, a, 0);
          if (t + 1 < tiles) tile_rows(m + kAmxTileRows, a, 1);
          for (int32_t c = cc; c < cc1; c += kLinearUnitN) {
            float* acc = acc_at(t, c);
            if (t + 1 < tiles) amx_block<2, 2>(a, weights(c), steps, first, acc, ldc, pending);
            else amx_block<1, 2>(a, weights(c), steps, first, acc, ldc, pending);
            if (last) pending.set(m, std::min(2 * kAmxTileRows, r1 - m), c, kLinearUnitN, acc, ldc);
          }
        }
      }
    }
  }
  pending.finish();
  _tile_release();
}

const LinearCpuOps kBf16AmxOps{rect_amx, kAmxTileRows};

}  // namespace

const LinearCpuOps* PYSCORE_ENTRY(linear_ops, amx)(const KernelKey& key) {
  // Tier amx implies the OS granted the tile state (cpu_features.h: cpu_has_amx_bf16).
  return key.dtype == DType::kBFloat16 ? &kBf16AmxOps : nullptr;
}

const LinearCpuOps* PYSCORE_ENTRY(linear_ops, avx512)(const KernelKey& key) {
  if (key.bf16_weight) return key.dtype == DType::kFloat32 ? &kBf16WeightOps : nullptr;
  if (key.dtype == DType::kBFloat16) return key.bf16_dot == Bf16Dot::kWiden ? &kBf16WidenOps : &kBf16Ops;
  if (key.dtype == DType::kFloat32) return &kF32Ops;
  return nullptr;
}

}  // namespace pyscore
