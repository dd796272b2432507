// AVX-512 tokens of rotary (interface in cpu_ops.h). Per token the cos/sin rows are rounded to the dtype once
// into L1 buffers; each head row is then rotated 16 lanes of each half at a time (lane i of the first half pairs
// with lane i of the second), after an optional pass for the qk-norm statistics. Products and sums are rounded
// one by one like torch's separate kernels: the fp32 adds use the embedded-rounding intrinsics, which GCC does
// not contract into FMAs the way it may contract a plain vector mul + add.
#include "common/rms_portable.h"
#include "common/elementwise_avx512.h"
#include "rotary/cpu_ops.h"

namespace pyscore {
namespace {

using namespace avx512;

constexpr int kRound = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;

// x * r rounded to the dtype, times the norm weight, rounded again (the transformers RMSNorm on one head).
template <class E>
inline __m512 normed(__m512 x, __m512 r, const typename E::T* w, __mmask16 m) {
  return E::round(_mm512_mul_ps(E::load(w, m), E::round(_mm512_mul_ps(x, r))));
}

template <class E>
void rotate_head(typename E::T* x, const typename E::T* norm, float eps, const float* c, const float* s,
                 int32_t head_dim) {
  const int32_t h = head_dim / 2;
  __m512 r = _mm512_set1_ps(1.0f);
  if (norm) {
    __m512 acc = _mm512_setzero_ps();
    for (int32_t i = 0; i < head_dim; i += 16) {
      const __m512 v = E::load(x + i, lanes(i, head_dim));
      acc = _mm512_fmadd_ps(v, v, acc);
    }
    r = _mm512_set1_ps(rms_scale(_mm512_reduce_add_ps(acc), head_dim, eps));
  }
  for (int32_t i = 0; i < h; i += 16) {
    const __mmask16 m = lanes(i, h);
    __m512 a = E::load(x + i, m), b = E::load(x + h + i, m);
    if (norm) a = normed<E>(a, r, norm + i, m), b = normed<E>(b, r, norm + h + i, m);
    const __m512 ac = E::round(_mm512_mul_ps(a, _mm512_maskz_loadu_ps(m, c + i)));
    const __m512 bs = E::round(_mm512_mul_ps(b, _mm512_maskz_loadu_ps(m, s + i)));
    const __m512 bc = E::round(_mm512_mul_ps(b, _mm512_maskz_loadu_ps(m, c + h + i)));
    const __m512 as = E::round(_mm512_mul_ps(a, _mm512_maskz_loadu_ps(m, s + h + i)));
    E::store(x + i, m, _mm512_sub_round_ps(ac, bs, kRound));
    E::store(x + h + i, m, _mm512_add_round_ps(bc, as, kRound));
  }
}

template <class E>
void tokens(const RotaryParams& p, int32_t begin, int32_t end) {
  using T = typename E::T;
  alignas(64) float c[kRotaryMaxHeadDim + 16], s[kRotaryMaxHeadDim + 16];  // + a ragged last chunk
  for (int32_t t = begin; t < end; ++t) {
    const float* cos = p.cos + p.positions[t] * p.head_dim;
    const float* sin = p.sin + p.positions[t] * p.head_dim;
    for (int32_t i = 0; i < p.head_dim; i += 16) {
      const __mmask16 m = lanes(i, p.head_dim);
      _mm512_storeu_ps(c + i, E::round(_mm512_maskz_loadu_ps(m, cos + i)));
      _mm512_storeu_ps(s + i, E::round(_mm512_maskz_loadu_ps(m, sin + i)));
    }
    for (int32_t hd = 0; hd < p.num_q_heads; ++hd)
      rotate_head<E>(static_cast<T*>(p.q) + t * p.q_token_stride + hd * p.q_head_stride,
                     static_cast<const T*>(p.q_norm), p.eps, c, s, p.head_dim);
    for (int32_t hd = 0; hd < p.num_kv_heads; ++hd)
      rotate_head<E>(static_cast<T*>(p.k) + t * p.k_token_stride + hd * p.k_head_stride,
                     static_cast<const T*>(p.k_norm), p.eps, c, s, p.head_dim);
  }
}

}  // namespace

RotaryTokens rotary_tokens_avx512(DType dtype) {
  if (dtype == DType::kBFloat16) return tokens<Bf16Lanes>;
  if (dtype == DType::kFloat32) return tokens<F32Lanes>;
  return nullptr;
}

}  // namespace pyscore
