// AVX-512 rows of silu_mul (interface in cpu_ops.h), 16 lanes at a time with a masked ragged end. exp needs
// full fp32 accuracy here (the result is rounded to bf16 and must land where torch's Sleef exp lands): exp_ps of
// common/vec_math_avx512.h.
#include "common/elementwise_avx512.h"
#include "silu_mul/cpu_ops.h"

namespace pyscore {
namespace {

using namespace avx512;

template <class E>
inline void silu_mul_16(const typename E::T* gate, const typename E::T* up, typename E::T* out, __mmask16 m) {
  const __m512 g = E::load(gate, m);
  const __m512 e = exp_ps(_mm512_sub_ps(_mm512_setzero_ps(), g));
  const __m512 silu = E::round(_mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f), e)));
  E::store(out, m, _mm512_mul_ps(silu, E::load(up, m)));
}

template <class E>
void rows(const SiluMulParams& p, int32_t begin, int32_t end) {
  using T = typename E::T;
  const int32_t width = p.width;
  for (int32_t t = begin; t < end; ++t) {
    const T* gate = static_cast<const T*>(p.gate) + t * p.gate_row_stride;
    const T* up = static_cast<const T*>(p.up) + t * p.up_row_stride;
    T* out = static_cast<T*>(p.out) + t * p.out_row_stride;
    int32_t i = 0;
    for (; i + 32 <= width; i += 32) {  // two independent vectors per step for the long exp/div chains
      silu_mul_16<E>(gate + i, up + i, out + i, 0xFFFF);
      silu_mul_16<E>(gate + i + 16, up + i + 16, out + i + 16, 0xFFFF);
    }
    for (; i < width; i += 16) silu_mul_16<E>(gate + i, up + i, out + i, lanes(i, width));
  }
}

}  // namespace

SiluMulRows silu_mul_rows_avx512(DType dtype) {
  if (dtype == DType::kBFloat16) return rows<Bf16Lanes>;
  if (dtype == DType::kFloat32) return rows<F32Lanes>;
  return nullptr;
}

}  // namespace pyscore
