// AVX-512 ops of the CPU linear kernel (interface in cpu_ops.h, packed layout in params.h).
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

const LinearCpuOps kBf16Ops{rect<Bf16>};
const LinearCpuOps kBf16WidenOps{rect<Bf16Widen>};
const LinearCpuOps kF32Ops{rect<F32>};

}  // namespace

const LinearCpuOps* linear_ops_avx512(DType dtype, Bf16Dot bf16_dot) {
  if (dtype == DType::kBFloat16) return bf16_dot == Bf16Dot::kWiden ? &kBf16WidenOps : &kBf16Ops;
  if (dtype == DType::kFloat32) return &kF32Ops;
  return nullptr;
}

}  // namespace pyscore
