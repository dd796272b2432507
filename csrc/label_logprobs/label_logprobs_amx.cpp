// AMX logits_chunk() of the CPU label_logprobs kernel, bf16 (tier amx); lse_update is the AVX-512 ops' own.
//
// The LM head product is computed transposed, logits^T [16 vocab][16 rows] = W block . H^T, so the weight is read
// as it is stored: an A tile is 16 consecutive vocabulary rows x 32 hidden elements, loaded straight from the
// [V, H] matrix (no repacking of a matrix the size of the vocabulary). The read-out rows are the B tiles: H
// re-laid once per call into AMX's pair layout, 16 rows per tile, [H / 32] tiles per row group. Each vocabulary
// block is multiplied with up to 4 row groups at once (C tiles 0-3) while the next blocks' weight lines are
// prefetched: the walk is bound by streaming the weight from memory, which this keeps the loads ahead of.
//
// A logit is one row of H against one vocabulary row, summed over H in a fixed order whatever else is in the
// tile, so a row's result does not depend on the other rows (batch-invariant), as on the other paths; the bits
// are not the AVX-512 path's (the tile unit sums its pairs in its own order).
#include <immintrin.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "common/amx_tiles.h"
#include "label_logprobs/label_logprobs.h"

namespace pyscore {

const LabelCpuOps* PYSCORE_ENTRY(label_ops, avx512)(const KernelKey& key);  // logits_simd.h on the avx512 layer

namespace {

// Tiles (common/amx_tiles.h): 0-3 C (fp32 16 x 16), 4 A (weight rows), 5-7 B (read-out rows).
constexpr int kTile = 16;        // vocabulary rows per A tile = read-out rows per B tile
constexpr int kStep = 32;        // hidden elements per dot step (64 bytes of bf16)
constexpr int kGroupsPerPass = 4;  // C tiles 0-3

// H [R, K] -> B tiles [groups][K / 32][16 pairs][16 rows][2]: tile (g, t) row p holds, for read-out rows
// 16g .. 16g + 15, hidden elements 32t + 2p and 32t + 2p + 1. Rows past R are zero.
void pack_rows(const uint16_t* h, int64_t stride, int rows, int hidden, std::vector<uint32_t>& out) {
  const int groups = (rows + kTile - 1) / kTile, steps = hidden / kStep;
  out.assign(size_t(groups) * steps * kTile * kTile, 0);
  for (int r = 0; r < rows; ++r) {
    const auto* row = reinterpret_cast<const uint32_t*>(h + r * stride);  // pairs
    uint32_t* dst = out.data() + size_t(r / kTile) * steps * kTile * kTile + r % kTile;
    for (int t = 0; t < steps; ++t)
      for (int p = 0; p < kTile; ++p) {
        uint32_t pair;
        std::memcpy(&pair, row + t * kTile + p, sizeof(pair));
        dst[(size_t(t) * kTile + p) * kTile] = pair;
      }
  }
}

template <int G>
void block_tiles(const uint16_t* w, int64_t w_bytes, const uint32_t* b, int steps, const uint16_t* prefetch,
                 float* c) {
  _tile_zero(0);
  if (G > 1) _tile_zero(1);
  if (G > 2) _tile_zero(2);
  if (G > 3) _tile_zero(3);
  const int64_t group = int64_t(steps) * kTile * kTile;  // uint32 per row group of B
  for (int t = 0; t < steps; ++t) {
    // One 64-byte line of each of the 16 rows kPrefetchBlocks ahead: their whole rows over the block's steps.
    if (prefetch)
      for (int v = 0; v < kTile; ++v) _mm_prefetch(reinterpret_cast<const char*>(prefetch + t * kStep) + v * w_bytes,
                                                   _MM_HINT_T0);
    // The weight is read once per call: loaded with the non-temporal hint (TILELOADDT1) it leaves the hidden rows'
    // tiles in L1 (16 rows 1.92-2.03 -> 1.80-1.96 ms, 1 row 1.26-1.34 -> 1.16-1.23 ms:
    // bench/results/tiers/kernels/kernels_labels_amx_stream_ab.txt).
    _tile_stream_loadd(4, w + t * kStep, w_bytes);
    const uint32_t* bt = b + int64_t(t) * kTile * kTile;
    _tile_loadd(5, bt, 64);
    _tile_dpbf16ps(0, 4, 5);
    if (G > 1) {
      _tile_loadd(6, bt + group, 64);
      _tile_dpbf16ps(1, 4, 6);
    }
    if (G > 2) {
      _tile_loadd(7, bt + 2 * group, 64);
      _tile_dpbf16ps(2, 4, 7);
    }
    if (G > 3) {
      _tile_loadd(5, bt + 3 * group, 64);
      _tile_dpbf16ps(3, 4, 5);
    }
  }
  _tile_stored(0, c, 64);
  if (G > 1) _tile_stored(1, c + kTile * kTile, 64);
  if (G > 2) _tile_stored(2, c + 2 * kTile * kTile, 64);
  if (G > 3) _tile_stored(3, c + 3 * kTile * kTile, 64);
}

constexpr int kPrefetchBlocks = 2;

// This thread's B tiles of the current call's rows: written by prepare(), read by its logits_chunk() calls.
std::vector<uint32_t>& packed_rows() {
  thread_local std::vector<uint32_t> b;
  return b;
}

// The AVX-512 layer's bf16 ops (pairs widened), whose log-sum-exp update and short-shape product the tile ops reuse.
const LabelCpuOps* avx512_bf16_ops() {
  KernelKey key;
  key.dtype = DType::kBFloat16, key.bf16_dot = Bf16Dot::kWiden;
  return label_ops_avx512(key);
}

void prepare(const LabelLogprobsParams& p) {
  if (p.weight && p.hidden_size % kStep == 0)
    pack_rows(static_cast<const uint16_t*>(p.hidden), p.hidden_row_stride, p.num_rows, p.hidden_size, packed_rows());
}

void logits_chunk(const LabelLogprobsParams& p, int32_t v0, int32_t n, float* out) {
  static const LabelCpuOps* avx512 = avx512_bf16_ops();
  if (!p.weight || p.hidden_size % kStep) return avx512->logits_chunk(p, v0, n, out);
  const auto* w = static_cast<const uint16_t*>(p.weight);
  const int64_t w_bytes = p.weight_row_stride * 2;
  const int steps = p.hidden_size / kStep;
  const int groups = (p.num_rows + kTile - 1) / kTile;
  const std::vector<uint32_t>& b = packed_rows();
  thread_local std::vector<uint16_t> tail;
  alignas(64) float c[kGroupsPerPass * kTile * kTile];
  load_amx_tiles_16x64();
  for (int32_t j = 0; j < n; j += kTile) {
    const int32_t live = std::min(kTile, n - j);
    const uint16_t* wj = w + (v0 + j) * p.weight_row_stride;
    int64_t wj_bytes = w_bytes;
    if (live < kTile) {  // the last rows of the chunk, zero-padded: never read past the vocabulary
      tail.assign(size_t(kTile) * p.hidden_size, 0);
      for (int v = 0; v < live; ++v)
        std::memcpy(tail.data() + int64_t(v) * p.hidden_size, wj + v * p.weight_row_stride, size_t(p.hidden_size) * 2);
      wj = tail.data();
      wj_bytes = int64_t(p.hidden_size) * 2;
    }
    const int64_t ahead = v0 + j + int64_t(kPrefetchBlocks) * kTile;
    const uint16_t* prefetch = ahead + kTile <= p.vocab_size ? w + ahead * p.weight_row_stride : nullptr;
    for (int g0 = 0; g0 < groups; g0 += kGroupsPerPass) {
      const uint32_t* bg = b.data() + size_t(g0) * steps * kTile * kTile;
      const int pass = std::min(kGroupsPerPass, groups - g0);
      const uint16_t* pf = g0 == 0 ? prefetch : nullptr;
      switch (pass) {
        case 1: block_tiles<1>(wj, wj_bytes, bg, steps, pf, c); break;
        case 2: block_tiles<2>(wj, wj_bytes, bg, steps, pf, c); break;
        case 3: block_tiles<3>(wj, wj_bytes, bg, steps, pf, c); break;
        default: block_tiles<4>(wj, wj_bytes, bg, steps, pf, c); break;
      }
      // c[g][v][r]: logit of vocabulary row j + v for read-out row 16 (g0 + g) + r.
      for (int g = 0; g < pass; ++g)
        for (int r = 0; r < kTile; ++r) {
          const int32_t row = (g0 + g) * kTile + r;
          if (row >= p.num_rows) break;
          float* dst = out + int64_t(row) * n + j;
          for (int v = 0; v < live; ++v) dst[v] = c[(g * kTile + v) * kTile + r];
        }
    }
  }
  _tile_release();
}

}  // namespace

const LabelCpuOps* PYSCORE_ENTRY(label_ops, amx)(const KernelKey& key) {
  if (key.dtype != DType::kBFloat16) return nullptr;
  const LabelCpuOps* avx512 = avx512_bf16_ops();
  if (!avx512) return nullptr;
  static const LabelCpuOps ops{logits_chunk, avx512->lse_update, prepare};
  return &ops;
}

}  // namespace pyscore
