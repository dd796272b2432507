// AVX-512 ops of the CPU linear kernel (interface in cpu_ops.h, packed layout in params.h).
//
// At tier amx, bf16 runs on AMX tiles instead (rect_amx below).
//
// Micro-kernel: TM <= 6 rows x ZN <= 4 zmm (64 packed columns) of fp32 accumulators held in registers over the whole
// K (24 + 4 weight operands + 1 broadcast <= 32 zmm); each step loads ZN weight zmm (16 columns x one pair) and
// broadcasts one x pair per row. Over a rectangle, the weight panel of a block (K x 64) is reused from L2 by every
// row tile. bf16 pairs are multiplied by vdpbf16ps or widened to fp32 with two FMAs in its order (Bf16Dot): the
// same bits. The epilogue (bias, SiLU-mul, residual, rounding) runs on the accumulators before the one store.
#include <algorithm>
#include <cstring>
#include <vector>

#include "common/vec_math_avx512.h"
#include "linear/cpu_ops.h"

namespace pyscore {
namespace {

using namespace avx512;

constexpr int kTileRows = 6;
constexpr int kMaxZmm = kLinearBlockN / 16;

// Element traits as in the attention kernel: T is the stored type of x, the weight and the output; B the broadcast
// operand (x rows), one 4-byte unit (kPack elements) per step. step() adds, for TM rows, row r's unit
// (b + r * b_stride) times the ZN weight zmm at w into acc[r][0..ZN).
struct Bf16 {  // vdpbf16ps
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

// Widened pairs, two FMAs in vdpbf16ps's order (odd first): Bf16's bits on normal numbers. The tile's x rows are
// widened once per tile into a per-thread fp32 buffer; each weight zmm is widened once for all TM rows, and the
// broadcasts are FMA memory operands (see opaque()).
struct Bf16Widen {
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
  static Rows rows(const T* x, int64_t x_stride, int tm, int k) {
    thread_local std::vector<float> buf;
    if (int64_t(buf.size()) < int64_t(tm) * k) buf.resize(int64_t(tm) * k);
    for (int r = 0; r < tm; ++r)
      for (int i = 0; i < k; i += 16) {
        const __mmask16 m = k - i >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (k - i)) - 1);
        _mm512_mask_storeu_ps(buf.data() + int64_t(r) * k + i, m, maskz_load_bf16_ps(m, x + r * x_stride + i));
      }
    return {buf.data(), k};
  }
  static __m512 load(const T* p, __mmask16 m) { return maskz_load_bf16_ps(m, p); }
  static void store(T* p, __mmask16 m, __m512 v) { mask_store_bf16_exact_ps(p, m, v); }
};

struct F32 {
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

// TM rows (from row m) x ZN zmm of packed columns (from column c, block-aligned to 16) over the whole K.
template <class E, int TM, int ZN>
void tile(const LinearParams& p, int32_t m, int32_t c, const typename E::T* w) {
  using T = typename E::T;
  const int32_t k = p.k;  // even for bf16 (the launcher pads)
  const auto x = E::rows(static_cast<const T*>(p.x) + m * p.x_row_stride, p.x_row_stride, TM, k);
  __m512 acc[TM][ZN];
  for (int r = 0; r < TM; ++r)
    for (int z = 0; z < ZN; ++z) acc[r][z] = _mm512_setzero_ps();
  for (int32_t s = 0; s < k / E::kPack; ++s)
    E::template step<TM, ZN>(acc, x.data + s * E::kPack, x.stride, w + int64_t(s) * kLinearBlockN * E::kPack);
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

template <class E, int ZN>
void row_tiles(const LinearParams& p, int32_t m0, int32_t m1, int32_t c, const typename E::T* w) {
  int32_t m = m0;
  for (; m + kTileRows <= m1; m += kTileRows) tile<E, kTileRows, ZN>(p, m, c, w);
  switch (m1 - m) {
    case 1: tile<E, 1, ZN>(p, m, c, w); break;
    case 2: tile<E, 2, ZN>(p, m, c, w); break;
    case 3: tile<E, 3, ZN>(p, m, c, w); break;
    case 4: tile<E, 4, ZN>(p, m, c, w); break;
    case 5: tile<E, 5, ZN>(p, m, c, w); break;
    default: break;
  }
}

// Block by block (the weight panel stays in L2 while every row tile of the rectangle passes over it).
template <class E>
void rect(const LinearParams& p, int32_t m0, int32_t m1, int32_t c0, int32_t c1) {
  using T = typename E::T;
  const int64_t k_steps = p.k / E::kPack;
  const T* packed = static_cast<const T*>(p.w_packed);
  for (int32_t c = c0; c < c1;) {
    const int32_t block = c / kLinearBlockN, z0 = (c % kLinearBlockN) / 16;
    const int32_t zn = std::min<int32_t>(kMaxZmm - z0, (c1 - c) / 16);
    const T* w = packed + (int64_t(block) * k_steps * kLinearBlockN + z0 * 16) * E::kPack;
    if (zn == 4) row_tiles<E, 4>(p, m0, m1, c, w);
    else row_tiles<E, 2>(p, m0, m1, c, w);  // units of 32 columns: 2 or 4 zmm
    c += 16 * zn;
  }
}

const LinearCpuOps kBf16Ops{rect<Bf16>, kTileRows};
const LinearCpuOps kBf16WidenOps{rect<Bf16Widen>, kTileRows};
const LinearCpuOps kF32Ops{rect<F32>, kTileRows};

// ---- AMX (bf16) ------------------------------------------------------------------------------------------------
// Tiles 0-3: fp32 accumulators C[2][2] (16 rows x 16 columns each); 4-5: A (16 rows of x x 32 K); 6-7: B (16 K pairs
// x 16 packed columns x 2), read straight from the packed layout: a block's K-pair rows are 64 columns x 2 bf16 =
// 256 bytes apart, and 16 columns x one pair is one 64-byte row of a B tile. One micro-step covers 32 rows x one
// 32-column unit over the whole K; each output element is the same TDPBF16PS sequence over K whatever M is and
// wherever its row falls (tail rows run in a zero-padded copy), so rows are batch-invariant as on the other paths.
// Needs K % 32 == 0 (every K of the supported families); other K run the widened-FMA path for the whole weight.
constexpr int kAmxRows = 32, kAmxK = 32;

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

void load_tile_config() {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.colsb[t] = 64;
    cfg.rows[t] = 16;
  }
  _tile_loadconfig(&cfg);
}

// acc [32][32] fp32 = rows a (kAmxRows rows, a_stride elements apart) x unit w (a block's K-pair rows from w) over k.
// acc [32][32] fp32 (+)= rows a x unit w over K [k0, k1): from zero when `first`, else continuing the partial sums
// in acc (an fp32 tile stored and reloaded is exact, so a K split in blocks gives the unsplit bits).
void amx_unit(const uint16_t* a, int64_t a_stride, const uint16_t* w, int32_t k0, int32_t k1, bool first, float* acc) {
  constexpr int64_t c_bytes = kAmxRows * 4;
  if (first) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
  } else {
    _tile_loadd(0, acc, c_bytes);
    _tile_loadd(1, acc + 16, c_bytes);
    _tile_loadd(2, acc + 16 * kAmxRows, c_bytes);
    _tile_loadd(3, acc + 16 * kAmxRows + 16, c_bytes);
  }
  const int64_t a_bytes = a_stride * 2, b_bytes = kLinearBlockN * 2 * 2;
  for (int32_t s = k0; s < k1; s += kAmxK) {
    const uint16_t* b = w + int64_t(s / 2) * kLinearBlockN * 2;
    _tile_loadd(4, a + s, a_bytes);
    _tile_loadd(5, a + 16 * a_stride + s, a_bytes);
    _tile_loadd(6, b, b_bytes);
    _tile_loadd(7, b + 32, b_bytes);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
  }
  _tile_stored(0, acc, c_bytes);
  _tile_stored(1, acc + 16, c_bytes);
  _tile_stored(2, acc + 16 * kAmxRows, c_bytes);
  _tile_stored(3, acc + 16 * kAmxRows + 16, c_bytes);
}

// The epilogue of rows [m, m + rows) of one unit at packed column c, from acc [32][32].
void amx_epilogue(const LinearParams& p, int32_t m, int32_t rows, int32_t c, const float* acc) {
  const __m512 b0 = p.bias ? _mm512_loadu_ps(p.bias + c) : _mm512_setzero_ps();
  const __m512 b1 = p.bias ? _mm512_loadu_ps(p.bias + c + 16) : _mm512_setzero_ps();
  for (int32_t r = 0; r < rows; ++r) {
    const __m512 v0 = _mm512_add_ps(_mm512_loadu_ps(acc + r * kAmxRows), b0);
    const __m512 v1 = _mm512_add_ps(_mm512_loadu_ps(acc + r * kAmxRows + 16), b1);
    if (p.gated) {
      store_out<Bf16>(p, m + r, c / 2, _mm512_mul_ps(silu_ps(v0), v1));
    } else {
      store_out<Bf16>(p, m + r, c, v0);
      store_out<Bf16>(p, m + r, c + 16, v1);
    }
  }
}

// Cache blocking: rows in blocks of 32-row groups, K in blocks of kAmxKBlock, so that a row block's x slab over a K
// block stays in L2 while every unit of the rectangle passes over it, and each unit's weight panel over that K block
// is read once per row block. Partial sums wait in fp32 between K blocks (exact); the epilogue runs after the last.
constexpr int32_t kAmxKBlock = 2048, kAmxSlabBytes = 1 << 20;

void rect_amx(const LinearParams& p, int32_t m0, int32_t m1, int32_t c0, int32_t c1) {
  if (p.k % kAmxK) return rect<Bf16Widen>(p, m0, m1, c0, c1);
  const uint16_t* x = static_cast<const uint16_t*>(p.x);
  const uint16_t* packed = static_cast<const uint16_t*>(p.w_packed);
  const int64_t k_pairs = p.k / 2;
  // The rows of a short last group, zero-padded to 32 (fresh per call: the tile config and buffers are per thread).
  thread_local std::vector<uint16_t> tail;
  thread_local std::vector<float> partial;
  load_tile_config();
  const int32_t whole = m0 + (m1 - m0) / kAmxRows * kAmxRows;
  if (whole < m1) {
    tail.assign(size_t(kAmxRows) * p.k, 0);
    for (int32_t m = whole; m < m1; ++m)
      std::memcpy(tail.data() + int64_t(m - whole) * p.k, x + m * p.x_row_stride, size_t(p.k) * 2);
  }
  auto unit_weights = [&](int32_t c) {
    return packed + (int64_t(c / kLinearBlockN) * k_pairs * kLinearBlockN + c % kLinearBlockN) * 2;
  };
  const int32_t kb = std::min(p.k, kAmxKBlock);
  const int32_t block_rows = std::max<int32_t>(kAmxRows, kAmxSlabBytes / (kb * 2) / kAmxRows * kAmxRows);
  const int32_t units = (c1 - c0) / kLinearUnitN;
  const bool k_blocked = kb < p.k;  // else one accumulator tile set is reused: nothing waits between K blocks
  for (int32_t r0 = m0; r0 < m1; r0 += block_rows) {
    const int32_t r1 = std::min(m1, r0 + block_rows);
    const int32_t groups = (r1 - r0 + kAmxRows - 1) / kAmxRows;
    partial.resize(size_t(k_blocked ? groups * units : 1) * kAmxRows * kAmxRows);
    for (int32_t k0 = 0; k0 < p.k; k0 += kb) {
      const int32_t k1 = std::min(p.k, k0 + kb);
      for (int32_t u = 0; u < units; ++u) {
        const int32_t c = c0 + u * kLinearUnitN;
        for (int32_t g = 0; g < groups; ++g) {
          const int32_t m = r0 + g * kAmxRows;
          const bool in_tail = m >= whole;
          float* acc = partial.data() + (k_blocked ? size_t(g * units + u) * kAmxRows * kAmxRows : 0);
          amx_unit(in_tail ? tail.data() : x + m * p.x_row_stride, in_tail ? p.k : p.x_row_stride, unit_weights(c),
                   k0, k1, k0 == 0, acc);
          if (k1 == p.k) amx_epilogue(p, m, std::min(kAmxRows, m1 - m), c, acc);
        }
      }
    }
  }
  _tile_release();
}

const LinearCpuOps kBf16AmxOps{rect_amx, kAmxRows};

}  // namespace

const LinearCpuOps* linear_ops_amx(DType dtype) {
  return dtype == DType::kBFloat16 && cpu_amx_permitted() ? &kBf16AmxOps : nullptr;
}

const LinearCpuOps* linear_ops_avx512(DType dtype, Bf16Dot bf16_dot) {
  if (dtype == DType::kBFloat16) return bf16_dot == Bf16Dot::kWiden ? &kBf16WidenOps : &kBf16Ops;
  if (dtype == DType::kFloat32) return &kF32Ops;
  return nullptr;
}

}  // namespace pyscore
