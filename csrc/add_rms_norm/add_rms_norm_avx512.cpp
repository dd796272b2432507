// AVX-512 rows of add_rms_norm (interface in cpu_ops.h). A row is walked twice, 16 lanes at a time: the add
// (stored back, rounded, and re-read rounded so the statistics see exactly the stored residual) with the sum
// of squares, then the scaling; the second walk finds the row in L1. Ragged ends use masked loads and stores.
#include "add_rms_norm/cpu_ops.h"
#include "common/rms_portable.h"
#include "common/elementwise_avx512.h"

namespace pyscore {
namespace {

using namespace avx512;

template <class E>
void rows(const AddRmsNormParams& p, int32_t begin, int32_t end) {
  using T = typename E::T;
  const T* w = static_cast<const T*>(p.weight);
  const int32_t n = p.hidden_size;
  for (int32_t t = begin; t < end; ++t) {
    T* x = static_cast<T*>(p.x) + t * p.x_row_stride;
    T* out = static_cast<T*>(p.out) + t * p.out_row_stride;
    const T* d = p.delta ? static_cast<const T*>(p.delta) + t * p.delta_row_stride : nullptr;
    __m512 acc = _mm512_setzero_ps();
    for (int32_t i = 0; i < n; i += 16) {
      const __mmask16 m = lanes(i, n);
      __m512 v = E::load(x + i, m);
      if (d) {
        v = E::round(_mm512_add_ps(v, E::load(d + i, m)));
        E::store(x + i, m, v);
      }
      acc = _mm512_fmadd_ps(v, v, acc);  // masked-off lanes are 0
    }
    const __m512 r = _mm512_set1_ps(rms_scale(_mm512_reduce_add_ps(acc), n, p.eps));
    if (p.weight_fp32) {  // one rounding of the fp32 product
      const float* w32 = static_cast<const float*>(p.weight);
      for (int32_t i = 0; i < n; i += 16) {
        const __mmask16 m = lanes(i, n);
        E::store(out + i, m, _mm512_mul_ps(_mm512_mul_ps(E::load(x + i, m), r), _mm512_maskz_loadu_ps(m, w32 + i)));
      }
      continue;
    }
    for (int32_t i = 0; i < n; i += 16) {
      const __mmask16 m = lanes(i, n);
      const __m512 y = E::round(_mm512_mul_ps(E::load(x + i, m), r));
      E::store(out + i, m, _mm512_mul_ps(E::load(w + i, m), y));
    }
  }
}

}  // namespace

AddRmsNormRows add_rms_norm_rows_avx512(DType dtype) {
  if (dtype == DType::kBFloat16) return rows<Bf16Lanes>;
  if (dtype == DType::kFloat32) return rows<F32Lanes>;
  return nullptr;
}

}  // namespace pyscore
