// add_rms_norm rows written once against a vector layer `V` (common/vec_avx2.h or common/vec_avx512.h), compiled
// once per layer named below by cmake/cpu_kernels.cmake, which binds `V` and names the entry point. A row is walked
// twice, V::kLanes at a time with ragged ends: the add (stored back rounded, re-read rounded so the statistics see
// exactly the stored residual) with the sum of squares, then the scaling; the second walk finds the row in L1.
// pyscore-vec-layers: avx2 avx512
#pragma once
#ifndef PYSCORE_VEC_ENTRY
#error "a kernel text is compiled once per vector layer on its pyscore-vec-layers line (cmake/cpu_kernels.cmake)"
#endif
#include "add_rms_norm/cpu_ops.h"
#include "common/rms_portable.h"

namespace pyscore {
namespace {

template <class T>
void rows(const AddRmsNormParams& p, int32_t begin, int32_t end) {
  const T* w = static_cast<const T*>(p.weight);
  const T* tag = nullptr;
  const int32_t n = p.hidden_size;
  for (int32_t t = begin; t < end; ++t) {
    T* x = static_cast<T*>(p.x) + t * p.x_row_stride;
    T* out = static_cast<T*>(p.out) + t * p.out_row_stride;
    const T* d = p.delta ? static_cast<const T*>(p.delta) + t * p.delta_row_stride : nullptr;
    V::Vec acc = V::zero();
    for (int32_t i = 0; i < n; i += V::kLanes) {
      V::Vec v = V::load_n(x + i, n - i);
      if (d) {
        v = V::round_as(V::add(v, V::load_n(d + i, n - i)), tag);
        V::store_n(x + i, v, n - i);
      }
      acc = V::fma(v, v, acc);  // lanes past n are 0
    }
    const V::Vec r = V::set1(rms_scale(V::reduce_add(acc), n, p.eps));
    if (p.weight_fp32) {  // one rounding of the fp32 product
      const float* w32 = static_cast<const float*>(p.weight);
      for (int32_t i = 0; i < n; i += V::kLanes)
        V::store_n(out + i, V::mul(V::mul(V::load_n(x + i, n - i), r), V::load_n(w32 + i, n - i)), n - i);
      continue;
    }
    for (int32_t i = 0; i < n; i += V::kLanes) {
      const V::Vec y = V::round_as(V::mul(V::load_n(x + i, n - i), r), tag);
      V::store_n(out + i, V::mul(V::load_n(w + i, n - i), y), n - i);
    }
  }
}

AddRmsNormRows rows_for(DType dtype) {
  if (dtype == DType::kBFloat16) return rows<uint16_t>;
  if (dtype == DType::kFloat32) return rows<float>;
  return nullptr;
}

}  // namespace

// The entry point cpu_ops.h declares, named for the layer this text is compiled on (e.g. add_rms_norm_rows_avx2).
AddRmsNormRows PYSCORE_VEC_ENTRY(add_rms_norm_rows)(DType dtype) { return rows_for(dtype); }

}  // namespace pyscore
