// AVX-512 arithmetic of the linear-attention ops (interface in gated_delta_rule.h).
//
// Recurrence: a task's [Dk, 32] state block is two zmm per row. Per token, two walks over the rows: a read-only one
// accumulating S^T k^ (the decay applied to the sum: decay (S^T k^) = (decay S)^T k^), then S = decay S + k^_i delta
// with one store per row, accumulating S^T q^ (two partial sums per zmm so the FMA chains are half as long). That is
// 5 Dk Dv / 16 vector ops and Dk Dv / 16 stores per token and head, on L1-resident data; the q/k L2 norms (2 Dk) and
// the scalar gates are recomputed per column block, a few percent of it.
//
// A decode step's next state in another buffer (StateRows::stream) is stored with non-temporal stores: its lines are
// not read before they are written, a third of the step's state traffic (a Qwen3.5-0.8B step's states, 18 MB a
// sequence, are read from DRAM: the weights stream through L3 between steps).
//
// Convolution: a token's row 16 channels per zmm, K FMAs each; SiLU with the full-accuracy exp_ps, the conv sum
// rounded to the dtype first as torch's conv1d-then-silu does.
#include <cmath>

#include "common/elementwise_avx512.h"
#include "gated_delta_rule/gated_delta_rule.h"

namespace pyscore {
namespace {

using namespace avx512;

inline __mmask16 upper_lanes(int32_t cols) { return cols > 16 ? lanes(16, cols) : __mmask16(0); }

// x * rsqrt(sum x^2 + 1e-6) * extra into out (fp32, n <= kMaxKeyDim).
template <class E>
void l2_normalized(const typename E::T* x, int32_t n, float extra, float* out) {
  __m512 acc = _mm512_setzero_ps();
  for (int32_t i = 0; i < n; i += 16) {
    const __m512 v = E::load(x + i, lanes(i, n));
    acc = _mm512_fmadd_ps(v, v, acc);
  }
  const float r = 1.0f / std::sqrt(_mm512_reduce_add_ps(acc) + 1e-6f);
  const __m512 vr = _mm512_set1_ps(r), ve = _mm512_set1_ps(extra);
  for (int32_t i = 0; i < n; i += 16) {
    const __mmask16 m = lanes(i, n);
    _mm512_mask_storeu_ps(out + i, m, _mm512_mul_ps(_mm512_mul_ps(E::load(x + i, m), vr), ve));
  }
}

inline float softplus(float x) { return x > 20.0f ? x : std::log1p(std::exp(x)); }

// Stores 32 floats of a state row (64-byte aligned when `stream`).
inline void store_row(float* w, __m512 lo, __m512 hi, bool stream) {
  if (stream) {
    _mm512_stream_ps(w, lo), _mm512_stream_ps(w + 16, hi);
  } else {
    _mm512_storeu_ps(w, lo), _mm512_storeu_ps(w + 16, hi);
  }
}

template <class E>
void state_columns(const GatedDeltaRuleParams& p, int32_t head, int32_t col0, int32_t cols, int32_t start,
                   int32_t length, StateRows rows) {
  using T = typename E::T;
  const float* state = rows.in;  // the state this token starts from; after the first token, rows.out
  const int64_t rs = rows.stride;
  const int32_t dk = p.k_dim, k_head = head / (p.num_v_heads / p.num_k_heads);
  const float a_exp = std::exp(p.a_log[head]), dt_bias = p.dt_bias[head];
  const __mmask16 m0 = lanes(0, cols), m1 = upper_lanes(cols);
  alignas(64) float qn[kMaxKeyDim + 1], kn[kMaxKeyDim + 1];
  qn[dk] = kn[dk] = 0.0f;  // the unrolled walks below may read one past an odd Dk
  for (int32_t t = start; t < start + length; ++t) {
    l2_normalized<E>(static_cast<const T*>(p.q) + t * p.q_token_stride + k_head * p.q_head_stride, dk, p.scale, qn);
    l2_normalized<E>(static_cast<const T*>(p.k) + t * p.k_token_stride + k_head * p.k_head_stride, dk, 1.0f, kn);
    const float a = E::load(static_cast<const T*>(p.a) + t * p.a_token_stride + head, 1)[0];
    const float b = E::load(static_cast<const T*>(p.b) + t * p.b_token_stride + head, 1)[0];
    const __m512 decay = _mm512_set1_ps(std::exp(-a_exp * softplus(a + dt_bias)));
    const __m512 beta = _mm512_set1_ps(1.0f / (1.0f + std::exp(-b)));

    // Walk 1 (read only): kv = (decay S)^T k^ = decay (S^T k^), rows i and i + 1 into separate partial sums.
    __m512 kv0 = _mm512_setzero_ps(), kv1 = _mm512_setzero_ps(), kv2 = _mm512_setzero_ps(),
           kv3 = _mm512_setzero_ps();
    int32_t i = 0;
    for (; i + 1 < dk; i += 2) {
      const float* r0 = state + i * rs;
      const __m512 k0 = _mm512_set1_ps(kn[i]), k1 = _mm512_set1_ps(kn[i + 1]);
      kv0 = _mm512_fmadd_ps(k0, _mm512_loadu_ps(r0), kv0), kv1 = _mm512_fmadd_ps(k0, _mm512_loadu_ps(r0 + 16), kv1);
      kv2 = _mm512_fmadd_ps(k1, _mm512_loadu_ps(r0 + rs), kv2);
      kv3 = _mm512_fmadd_ps(k1, _mm512_loadu_ps(r0 + rs + 16), kv3);
    }
    if (i < dk) {
      const float* r0 = state + i * rs;
      const __m512 k0 = _mm512_set1_ps(kn[i]);
      kv0 = _mm512_fmadd_ps(k0, _mm512_loadu_ps(r0), kv0), kv1 = _mm512_fmadd_ps(k0, _mm512_loadu_ps(r0 + 16), kv1);
    }
    const T* v = static_cast<const T*>(p.v) + t * p.v_token_stride + head * p.v_head_stride + col0;
    const __m512 d0 = _mm512_mul_ps(_mm512_fnmadd_ps(decay, _mm512_add_ps(kv0, kv2), E::load(v, m0)), beta);
    const __m512 d1 = _mm512_mul_ps(_mm512_fnmadd_ps(decay, _mm512_add_ps(kv1, kv3), E::load(v + 16, m1)), beta);

    // Walk 2: S = decay S + k^ delta^T (one store per row), o = S^T q^.
    __m512 o0 = _mm512_setzero_ps(), o1 = _mm512_setzero_ps(), o2 = _mm512_setzero_ps(), o3 = _mm512_setzero_ps();
    for (i = 0; i + 1 < dk; i += 2) {
      const float* r0 = state + i * rs;
      const float* r1 = r0 + rs;
      float* w0 = rows.out + i * rs;
      float* w1 = w0 + rs;
      const __m512 k0 = _mm512_set1_ps(kn[i]), k1 = _mm512_set1_ps(kn[i + 1]);
      const __m512 a0 = _mm512_fmadd_ps(_mm512_loadu_ps(r0), decay, _mm512_mul_ps(k0, d0));
      const __m512 a1 = _mm512_fmadd_ps(_mm512_loadu_ps(r0 + 16), decay, _mm512_mul_ps(k0, d1));
      const __m512 b0 = _mm512_fmadd_ps(_mm512_loadu_ps(r1), decay, _mm512_mul_ps(k1, d0));
      const __m512 b1 = _mm512_fmadd_ps(_mm512_loadu_ps(r1 + 16), decay, _mm512_mul_ps(k1, d1));
      store_row(w0, a0, a1, rows.stream), store_row(w1, b0, b1, rows.stream);
      const __m512 q0 = _mm512_set1_ps(qn[i]), q1 = _mm512_set1_ps(qn[i + 1]);
      o0 = _mm512_fmadd_ps(q0, a0, o0), o1 = _mm512_fmadd_ps(q0, a1, o1);
      o2 = _mm512_fmadd_ps(q1, b0, o2), o3 = _mm512_fmadd_ps(q1, b1, o3);
    }
    if (i < dk) {
      const float* r0 = state + i * rs;
      float* w0 = rows.out + i * rs;
      const __m512 k0 = _mm512_set1_ps(kn[i]);
      const __m512 a0 = _mm512_fmadd_ps(_mm512_loadu_ps(r0), decay, _mm512_mul_ps(k0, d0));
      const __m512 a1 = _mm512_fmadd_ps(_mm512_loadu_ps(r0 + 16), decay, _mm512_mul_ps(k0, d1));
      store_row(w0, a0, a1, rows.stream);
      const __m512 q0 = _mm512_set1_ps(qn[i]);
      o0 = _mm512_fmadd_ps(q0, a0, o0), o1 = _mm512_fmadd_ps(q0, a1, o1);
    }
    T* o = static_cast<T*>(p.o) + t * p.o_token_stride + head * p.o_head_stride + col0;
    E::store(o, m0, _mm512_add_ps(o0, o2));
    E::store(o + 16, m1, _mm512_add_ps(o1, o3));
    state = rows.out;
  }
  if (rows.stream) _mm_sfence();  // the streamed rows are visible before the launcher's threads join
}

template <class E>
void conv_tokens(const CausalConv1dParams& p, int32_t start, int32_t j0, int32_t j1, const void* const* history,
                 const float* wt) {
  using T = typename E::T;
  const int32_t taps = p.kernel_size, channels = p.channels;
  const T* x = static_cast<const T*>(p.x);
  const __m512 one = _mm512_set1_ps(1.0f);
  for (int32_t j = j0; j < j1; ++j) {
    const T* rows[kMaxConvKernel];
    for (int32_t i = 0; i < taps; ++i) {
      const int32_t pos = j - (taps - 1) + i;
      rows[i] = pos >= 0 ? x + int64_t(start + pos) * p.x_token_stride : static_cast<const T*>(history[pos + taps - 1]);
    }
    T* y = static_cast<T*>(p.y) + int64_t(start + j) * p.y_token_stride;
    for (int32_t c = 0; c < channels; c += 16) {
      const __mmask16 m = lanes(c, channels);
      __m512 acc = _mm512_setzero_ps();
      for (int32_t i = 0; i < taps; ++i) {
        if (rows[i]) acc = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, wt + int64_t(i) * channels + c), E::load(rows[i] + c, m), acc);
      }
      const __m512 s = E::round(acc);
      E::store(y + c, m, _mm512_div_ps(s, _mm512_add_ps(one, exp_ps(_mm512_sub_ps(_mm512_setzero_ps(), s)))));
    }
  }
}

}  // namespace

StateColumnsRun state_columns_avx512(DType dtype) {
  if (dtype == DType::kBFloat16) return state_columns<Bf16Lanes>;
  if (dtype == DType::kFloat32) return state_columns<F32Lanes>;
  return nullptr;
}

ConvTokensRun conv_tokens_avx512(DType dtype) {
  if (dtype == DType::kBFloat16) return conv_tokens<Bf16Lanes>;
  if (dtype == DType::kFloat32) return conv_tokens<F32Lanes>;
  return nullptr;
}

}  // namespace pyscore
