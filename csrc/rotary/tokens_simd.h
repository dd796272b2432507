// rotary tokens written once against a vector layer `V` (common/vec_avx2.h or common/vec_avx512.h), compiled once per
// layer named below by cmake/cpu_kernels.cmake, which binds `V` and names the entry point. Per token the cos/sin
// rows are rounded to the dtype once into L1 buffers; each head row is rotated V::kLanes lanes of each half at a time
// (lane i of the first half pairs with lane i of the second), after an optional pass for the qk-norm statistics.
// Products and sums are rounded one by one like torch's separate kernels: the layers' add / sub / mul are never fused
// into an FMA (explicit-rounding intrinsics on AVX-512, -ffp-contract=off for the AVX2 files).
// pyscore-vec-layers: avx2 avx512
#pragma once
#include "common/kernel_text.h"
#include "common/rms_portable.h"
#include "rotary/rotary.h"

namespace pyscore {
namespace {

// x * r rounded to the dtype, times the norm weight, rounded again (the transformers RMSNorm on one head).
template <class T>
inline V::Vec normed(V::Vec x, V::Vec r, const T* w, int n) {
  return V::round_as(V::mul(V::load_n(w, n), V::round_as(V::mul(x, r), w)), w);
}

template <class T>
void rotate_head(T* x, const T* norm, float eps, const float* c, const float* s, int32_t head_dim) {
  const int32_t h = head_dim / 2;
  V::Vec r = V::set1(1.0f);
  if (norm) {
    V::Vec acc = V::zero();
    for (int32_t i = 0; i < head_dim; i += V::kLanes) {
      const V::Vec v = V::load_n(x + i, head_dim - i);
      acc = V::fma(v, v, acc);
    }
    r = V::set1(rms_scale(V::reduce_add(acc), head_dim, eps));
  }
  for (int32_t i = 0; i < h; i += V::kLanes) {
    const int n = h - i;
    V::Vec a = V::load_n(x + i, n), b = V::load_n(x + h + i, n);
    if (norm) a = normed(a, r, norm + i, n), b = normed(b, r, norm + h + i, n);
    const V::Vec ac = V::round_as(V::mul(a, V::load(c + i)), x);
    const V::Vec bs = V::round_as(V::mul(b, V::load(s + i)), x);
    const V::Vec bc = V::round_as(V::mul(b, V::load(c + h + i)), x);
    const V::Vec as = V::round_as(V::mul(a, V::load(s + h + i)), x);
    V::store_n(x + i, V::sub(ac, bs), n);
    V::store_n(x + h + i, V::add(bc, as), n);
  }
}

template <class T>
void tokens(const RotaryParams& p, int32_t begin, int32_t end) {
  const T* tag = nullptr;
  // + one vector: the buffers are read whole vectors at a time past head_dim / 2 (those lanes are never stored).
  alignas(64) float c[kRotaryMaxHeadDim + V::kLanes], s[kRotaryMaxHeadDim + V::kLanes];
  for (int32_t t = begin; t < end; ++t) {
    const float* cos = p.cos + p.positions[t] * p.head_dim;
    const float* sin = p.sin + p.positions[t] * p.head_dim;
    for (int32_t i = 0; i < p.head_dim; i += V::kLanes) {
      V::store(c + i, V::round_as(V::load_n(cos + i, p.head_dim - i), tag));
      V::store(s + i, V::round_as(V::load_n(sin + i, p.head_dim - i), tag));
    }
    for (int32_t hd = 0; hd < p.num_q_heads; ++hd)
      rotate_head<T>(static_cast<T*>(p.q) + t * p.q_token_stride + hd * p.q_head_stride,
                     static_cast<const T*>(p.q_norm), p.eps, c, s, p.head_dim);
    for (int32_t hd = 0; hd < p.num_kv_heads; ++hd)
      rotate_head<T>(static_cast<T*>(p.k) + t * p.k_token_stride + hd * p.k_head_stride,
                     static_cast<const T*>(p.k_norm), p.eps, c, s, p.head_dim);
  }
}

RotaryTokens tokens_for(DType dtype) {
  if (dtype == DType::kBFloat16) return tokens<uint16_t>;
  if (dtype == DType::kFloat32) return tokens<float>;
  return nullptr;
}

}  // namespace

// The entry point rotary.h declares, named for the layer this text is compiled on (e.g. rotary_tokens_avx2).
RotaryTokens PYSCORE_VEC_ENTRY(rotary_tokens)(const KernelKey& key) { return tokens_for(key.dtype); }

}  // namespace pyscore
