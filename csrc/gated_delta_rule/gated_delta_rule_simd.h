// The linear-attention ops' arithmetic (interface in gated_delta_rule.h), written once against a vector layer `V` and
// compiled once per layer named below by cmake/cpu_kernels.cmake.
//
// Recurrence: a task's [Dk, 32] state block is kColVecs vectors per row. Per token, two walks over the rows: a
// read-only one accumulating S^T k^ (two rows per step into separate partial sums, so the FMA chains are half as long;
// the decay applied to the sum: decay (S^T k^) = (decay S)^T k^), then S = decay S + k^ delta with one store per row,
// accumulating S^T q^ (into two partial sums, even and odd rows, where a row is fewer than four vectors: the same
// chain length). That is 5 Dk Dv / kLanes vector ops and Dk Dv / kLanes stores per token and head, on L1-resident
// data; the q/k L2 norms and the scalar gates are recomputed per column block, a few percent of it. A column's
// arithmetic depends only on its own inputs, never on how many columns share its block.
//
// A decode step's next state in another buffer (StateRows::stream) is stored with V::stream: its lines are not read
// before they are written, a third of the step's state traffic (a Qwen3.5-0.8B step's states, 18 MB a sequence, are
// read from DRAM: the weights stream through L3 between steps).
//
// Convolution: a token's row kLanes channels per vector, K FMAs each; SiLU with the full-accuracy exp, the conv sum
// rounded to the dtype first as torch's conv1d-then-silu does.
// pyscore-vec-layers: avx2 avx512 neon
#pragma once
#include "common/kernel_text.h"
#include <algorithm>
#include <cmath>

#include "gated_delta_rule/gated_delta_rule.h"

namespace pyscore {
namespace {

using V::Vec;

constexpr int kColVecs = kStateCols / V::kLanes;
constexpr int kOutSums = kColVecs >= 4 ? 1 : 2;  // walk 2's partial sums of S^T q^

// Lanes of column vector z that lie below `cols`.
inline int lanes_of(int32_t cols, int z) { return std::clamp(cols - z * V::kLanes, 0, V::kLanes); }

template <class T>
inline Vec load_cols(const T* p, int n) { return n > 0 ? V::load_n(p, n) : V::zero(); }

// (x * rsqrt(sum x^2 + 1e-6)) * extra into out (fp32, n <= kMaxKeyDim, whole vectors: out has room for the last
// one); the reference's order: the normalized vector, then its scale.
template <class T>
void l2_normalized(const T* x, int32_t n, float extra, float* out) {
  Vec acc = V::zero();
  for (int32_t i = 0; i < n; i += V::kLanes) {
    const Vec v = V::load_n(x + i, n - i);
    acc = V::fma(v, v, acc);
  }
  const Vec r = V::set1(1.0f / std::sqrt(V::reduce_add(acc) + 1e-6f)), e = V::set1(extra);
  for (int32_t i = 0; i < n; i += V::kLanes) V::store(out + i, V::mul(V::mul(V::load_n(x + i, n - i), r), e));
}

inline float softplus(float x) { return x > 20.0f ? x : std::log1p(std::exp(x)); }

// Walk 2 for row i: S_i = decay S_i + k_i delta (stored), o += q_i S_i.
inline void update_row(const float* r, float* w, bool stream, Vec decay, Vec k, Vec q, const Vec* d, Vec* o) {
  for (int z = 0; z < kColVecs; ++z) {
    const Vec s = V::fma(V::load(r + z * V::kLanes), decay, V::mul(k, d[z]));
    if (stream) V::stream(w + z * V::kLanes, s);
    else V::store(w + z * V::kLanes, s);
    o[z] = V::fma(q, s, o[z]);
  }
}

template <class T>
void state_columns(const GatedDeltaRuleParams& p, int32_t head, int32_t col0, int32_t cols, int32_t start,
                   int32_t length, StateRows rows) {
  const float* state = rows.in;  // the state this token starts from; after the first token, rows.out
  const int64_t rs = rows.stride;
  const int32_t dk = p.k_dim, k_head = head / (p.num_v_heads / p.num_k_heads);
  const float a_exp = std::exp(p.a_log[head]), dt_bias = p.dt_bias[head];
  int n[kColVecs];
  for (int z = 0; z < kColVecs; ++z) n[z] = lanes_of(cols, z);
  alignas(64) float qn[kMaxKeyDim + V::kLanes], kn[kMaxKeyDim + V::kLanes];
  for (int32_t t = start; t < start + length; ++t) {
    l2_normalized(static_cast<const T*>(p.q) + t * p.q_token_stride + k_head * p.q_head_stride, dk, p.scale, qn);
    l2_normalized(static_cast<const T*>(p.k) + t * p.k_token_stride + k_head * p.k_head_stride, dk, 1.0f, kn);
    const float a = V::reduce_add(V::load_first(static_cast<const T*>(p.a) + t * p.a_token_stride + head, 1));
    const float b = V::reduce_add(V::load_first(static_cast<const T*>(p.b) + t * p.b_token_stride + head, 1));
    const Vec decay = V::set1(std::exp(-a_exp * softplus(a + dt_bias)));
    const Vec beta = V::set1(1.0f / (1.0f + std::exp(-b)));

    // Walk 1 (read only): kv = decay (S^T k^), rows i and i + 1 into separate partial sums.
    Vec kv[2][kColVecs];
    for (int z = 0; z < kColVecs; ++z) kv[0][z] = kv[1][z] = V::zero();
    int32_t i = 0;
    for (; i + 1 < dk; i += 2) {
      const float* r0 = state + i * rs;
      const Vec k0 = V::set1(kn[i]), k1 = V::set1(kn[i + 1]);
      for (int z = 0; z < kColVecs; ++z) {
        kv[0][z] = V::fma(k0, V::load(r0 + z * V::kLanes), kv[0][z]);
        kv[1][z] = V::fma(k1, V::load(r0 + rs + z * V::kLanes), kv[1][z]);
      }
    }
    if (i < dk) {
      const float* r0 = state + i * rs;
      const Vec k0 = V::set1(kn[i]);
      for (int z = 0; z < kColVecs; ++z) kv[0][z] = V::fma(k0, V::load(r0 + z * V::kLanes), kv[0][z]);
    }
    const T* v = static_cast<const T*>(p.v) + t * p.v_token_stride + head * p.v_head_stride + col0;
    Vec d[kColVecs];
    for (int z = 0; z < kColVecs; ++z)
      d[z] = V::mul(V::fnma(decay, V::add(kv[0][z], kv[1][z]), load_cols(v + z * V::kLanes, n[z])), beta);

    // Walk 2: S = decay S + k^ delta^T (one store per row), o = S^T q^ (even rows into o[0], odd into o[kOutSums-1]).
    Vec o[kOutSums][kColVecs];
    for (int h = 0; h < kOutSums; ++h)
      for (int z = 0; z < kColVecs; ++z) o[h][z] = V::zero();
    for (i = 0; i + 1 < dk; i += 2) {
      update_row(state + i * rs, rows.out + i * rs, rows.stream, decay, V::set1(kn[i]), V::set1(qn[i]), d, o[0]);
      update_row(state + (i + 1) * rs, rows.out + (i + 1) * rs, rows.stream, decay, V::set1(kn[i + 1]),
                 V::set1(qn[i + 1]), d, o[kOutSums - 1]);
    }
    if (i < dk) update_row(state + i * rs, rows.out + i * rs, rows.stream, decay, V::set1(kn[i]), V::set1(qn[i]), d, o[0]);
    T* out = static_cast<T*>(p.o) + t * p.o_token_stride + head * p.o_head_stride + col0;
    for (int z = 0; z < kColVecs; ++z)
      if (n[z] > 0) V::store_n(out + z * V::kLanes, kOutSums == 1 ? o[0][z] : V::add(o[0][z], o[kOutSums - 1][z]), n[z]);
    state = rows.out;
  }
  if (rows.stream) V::stream_fence();  // the streamed rows are visible before the launcher's threads join
}

template <class T>
void conv_tokens(const CausalConv1dParams& p, int32_t start, int32_t j0, int32_t j1, const void* const* history,
                 const float* wt) {
  const int32_t taps = p.kernel_size, channels = p.channels;
  const T* x = static_cast<const T*>(p.x);
  const Vec one = V::set1(1.0f);
  for (int32_t j = j0; j < j1; ++j) {
    const T* rows[kMaxConvKernel];
    for (int32_t i = 0; i < taps; ++i) {
      const int32_t pos = j - (taps - 1) + i;
      rows[i] = pos >= 0 ? x + int64_t(start + pos) * p.x_token_stride : static_cast<const T*>(history[pos + taps - 1]);
    }
    T* y = static_cast<T*>(p.y) + int64_t(start + j) * p.y_token_stride;
    for (int32_t c = 0; c < channels; c += V::kLanes) {
      const int m = channels - c;
      Vec acc = V::zero();
      for (int32_t i = 0; i < taps; ++i)
        if (rows[i]) acc = V::fma(V::load_n(wt + int64_t(i) * channels + c, m), V::load_n(rows[i] + c, m), acc);
      const Vec s = V::round_as(acc, y);
      V::store_n(y + c, V::div(s, V::add(one, V::exp_ps(V::sub(V::zero(), s)))), m);
    }
  }
}

}  // namespace

// The entry points gated_delta_rule.h declares, named for the layer (e.g. state_columns_avx2).
StateColumnsRun PYSCORE_VEC_ENTRY(state_columns)(const KernelKey& key) {
  if (key.dtype == DType::kBFloat16) return state_columns<uint16_t>;
  if (key.dtype == DType::kFloat32) return state_columns<float>;
  return nullptr;
}

ConvTokensRun PYSCORE_VEC_ENTRY(conv_tokens)(const KernelKey& key) {
  if (key.dtype == DType::kBFloat16) return conv_tokens<uint16_t>;
  if (key.dtype == DType::kFloat32) return conv_tokens<float>;
  return nullptr;
}

}  // namespace pyscore
