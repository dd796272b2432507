// CPU rotary (contract in rotary.h): tokens are independent, so OpenMP threads take slices of them. The
// arithmetic is in RotaryTokens: AVX-512 or AVX2 by the CPU tier, else the portable loops below.
#include <algorithm>

#include "common/bf16.h"
#include "common/cpu_features.h"
#include "common/rms_portable.h"
#include "common/threads.h"
#include "rotary/rotary.h"

namespace pyscore {
namespace {

constexpr int64_t kMinParallelElems = 16384;
constexpr int32_t kTokensPerTask = 8;

// One head row in place; c/s are the token's tables already rounded to the dtype.
template <class T>
void rotate_head(T* x, const T* norm, float eps, const float* c, const float* s, int32_t head_dim) {
  const T* tag = nullptr;
  float v[kRotaryMaxHeadDim];
  for (int32_t i = 0; i < head_dim; ++i) v[i] = to_f32(x[i]);
  if (norm) {
    const float r = rms_scale(sum_of_squares(x, head_dim), head_dim, eps);
    for (int32_t i = 0; i < head_dim; ++i) v[i] = round_as(to_f32(norm[i]) * round_as(v[i] * r, tag), tag);
  }
  const int32_t h = head_dim / 2;
  for (int32_t i = 0; i < h; ++i) {
    store_f32(x + i, round_as(v[i] * c[i], tag) - round_as(v[i + h] * s[i], tag));
    store_f32(x + i + h, round_as(v[i + h] * c[i + h], tag) + round_as(v[i] * s[i + h], tag));
  }
}

template <class T>
void tokens_portable(const RotaryParams& p, int32_t begin, int32_t end) {
  const T* tag = nullptr;
  float c[kRotaryMaxHeadDim], s[kRotaryMaxHeadDim];
  for (int32_t t = begin; t < end; ++t) {
    const float* cos = p.cos + p.positions[t] * p.head_dim;
    const float* sin = p.sin + p.positions[t] * p.head_dim;
    for (int32_t i = 0; i < p.head_dim; ++i) c[i] = round_as(cos[i], tag), s[i] = round_as(sin[i], tag);
    for (int32_t hd = 0; hd < p.num_q_heads; ++hd)
      rotate_head(static_cast<T*>(p.q) + t * p.q_token_stride + hd * p.q_head_stride,
                  static_cast<const T*>(p.q_norm), p.eps, c, s, p.head_dim);
    for (int32_t hd = 0; hd < p.num_kv_heads; ++hd)
      rotate_head(static_cast<T*>(p.k) + t * p.k_token_stride + hd * p.k_head_stride,
                  static_cast<const T*>(p.k_norm), p.eps, c, s, p.head_dim);
  }
}

RotaryTokens choose_tokens(DType dtype) {
  if (RotaryTokens fast = select_kernel<rotary_tokens_kernels>(KernelKey{dtype})) return fast;
  return dtype == DType::kBFloat16 ? tokens_portable<uint16_t> : tokens_portable<float>;
}

Status check_params(const RotaryParams& p) {
  if (p.dtype != DType::kFloat32 && p.dtype != DType::kBFloat16) return kUnsupportedDType;
  if (p.head_dim <= 0 || p.head_dim % 2 || p.head_dim > kRotaryMaxHeadDim) return kUnsupportedHeadDim;
  if (p.num_tokens < 0 || p.num_q_heads < 0 || p.num_kv_heads < 0 || bool(p.q_norm) != bool(p.k_norm))
    return kInvalidArgument;
  if (p.num_tokens == 0) return kOk;
  if (!p.positions || !p.cos || !p.sin || (p.num_q_heads && !p.q) || (p.num_kv_heads && !p.k))
    return kInvalidArgument;
  for (int32_t t = 0; t < p.num_tokens; ++t)
    if (p.positions[t] < 0 || p.positions[t] >= p.num_positions) return kInvalidArgument;
  return kOk;
}

}  // namespace

Status rotary_cpu(const RotaryParams& p) {
  const Status status = check_params(p);
  if (status != kOk || p.num_tokens == 0) return status;
  const RotaryTokens tokens = choose_tokens(p.dtype);
  const int32_t tasks = (p.num_tokens + kTokensPerTask - 1) / kTokensPerTask;
  const bool parallel = int64_t(p.num_tokens) * (p.num_q_heads + p.num_kv_heads) * p.head_dim >= kMinParallelElems;
#pragma omp parallel for num_threads(kernel_threads()) schedule(static) if (parallel)
  for (int32_t task = 0; task < tasks; ++task)
    tokens(p, task * kTokensPerTask, std::min(p.num_tokens, (task + 1) * kTokensPerTask));
  return kOk;
}

}  // namespace pyscore
