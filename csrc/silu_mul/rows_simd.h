// silu_mul rows written once against a vector layer `V` (common/vec_avx2.h or common/vec_avx512.h), compiled once per
// layer named below by cmake/cpu_kernels.cmake, which binds `V` and names the entry point. V::kLanes at a
// time, two independent vectors per step for the long exp/div chains, ragged ends. exp is the full-accuracy one (the
// result is rounded to bf16 and must land where torch's Sleef exp lands).
// pyscore-vec-layers: avx2 avx512
#pragma once
#include "common/kernel_text.h"
#include "silu_mul/silu_mul.h"

namespace pyscore {
namespace {

template <class T>
inline void silu_mul_step(const T* gate, const T* up, T* out, int n) {
  const V::Vec g = V::load_n(gate, n);
  const V::Vec e = V::exp_ps(V::sub(V::zero(), g));
  const V::Vec silu = V::round_as(V::div(g, V::add(V::set1(1.0f), e)), out);
  V::store_n(out, V::mul(silu, V::load_n(up, n)), n);
}

template <class T>
void rows(const SiluMulParams& p, int32_t begin, int32_t end) {
  const int32_t width = p.width;
  for (int32_t t = begin; t < end; ++t) {
    const T* gate = static_cast<const T*>(p.gate) + t * p.gate_row_stride;
    const T* up = static_cast<const T*>(p.up) + t * p.up_row_stride;
    T* out = static_cast<T*>(p.out) + t * p.out_row_stride;
    int32_t i = 0;
    for (; i + 2 * V::kLanes <= width; i += 2 * V::kLanes) {
      silu_mul_step(gate + i, up + i, out + i, V::kLanes);
      silu_mul_step(gate + i + V::kLanes, up + i + V::kLanes, out + i + V::kLanes, V::kLanes);
    }
    for (; i < width; i += V::kLanes) silu_mul_step(gate + i, up + i, out + i, width - i);
  }
}

SiluMulRows rows_for(DType dtype) {
  if (dtype == DType::kBFloat16) return rows<uint16_t>;
  if (dtype == DType::kFloat32) return rows<float>;
  return nullptr;
}

}  // namespace

// The entry point silu_mul.h declares, named for the layer this text is compiled on (e.g. silu_mul_rows_avx2).
SiluMulRows PYSCORE_VEC_ENTRY(silu_mul_rows)(const KernelKey& key) { return rows_for(key.dtype); }

}  // namespace pyscore
