// AMX ops of the CPU linear kernel (bf16; interface and packed layout in linear.h): the tile GEMM of tier amx. Its
// epilogue and, where K % 32 != 0, the whole product are the avx512 unit's of linear_simd.h (widened bf16 pairs).
#include <algorithm>
#include <cstring>
#include <vector>

#include "common/amx_tiles.h"
#include "linear/linear.h"

namespace pyscore {

const LinearCpuOps* PYSCORE_ENTRY(linear_ops, avx512)(const KernelKey& key);  // linear_simd.h's avx512 unit

namespace {

// The avx512 unit's widened bf16 ops: the same on every CPU of tier amx (no vdpbf16ps-or-not choice to make).
const LinearCpuOps& vector_ops() {
  static const LinearCpuOps& ops = [] {
    KernelKey key;
    key.dtype = DType::kBFloat16, key.bf16_dot = Bf16Dot::kWiden;
    return *PYSCORE_ENTRY(linear_ops, avx512)(key);
  }();
  return ops;
}

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
    if (done < end) vector_ops().epilogue(p, m + done, end - done, c, width, acc + done * ldc, ldc);
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
  if (p.k % kAmxK) return vector_ops().rect(p, m0, m1, c0, c1);
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

}  // namespace pyscore
