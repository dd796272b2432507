// Element adapters for the AVX-512 elementwise kernels (add_rms_norm, rotary, silu_mul): 16 lanes of bf16 or fp32
// in and out of fp32 zmm registers, with torch's rounding, so one template body serves both dtypes. Include only
// from files compiled with the AVX-512 flags (see vec_math_avx512.h).
#pragma once
#include "common/vec_math_avx512.h"

namespace pyscore {
namespace avx512 {

// bf16 storage; rounding as torch's conversion (denormals kept), not vcvtneps2bf16's: see round_bf16_bits.
struct Bf16Lanes {
  using T = uint16_t;
  static __m512 load(const T* p, __mmask16 m) { return maskz_load_bf16_ps(m, p); }
  static void store(T* p, __mmask16 m, __m512 x) { mask_store_bf16_exact_ps(p, m, x); }
  // The value a store and a reload would give.
  static __m512 round(__m512 x) { return round_bf16_exact_ps(x); }
};

struct F32Lanes {
  using T = float;
  static __m512 load(const T* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
  static void store(T* p, __mmask16 m, __m512 x) { _mm512_mask_storeu_ps(p, m, x); }
  static __m512 round(__m512 x) { return x; }
};

// The mask of the lanes of the 16-wide step at i that lie below n.
static inline __mmask16 lanes(int32_t i, int32_t n) {
  return n - i >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (n - i)) - 1);
}

}  // namespace avx512
}  // namespace pyscore
