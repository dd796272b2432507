// rotary: rotary position embeddings applied in place to q [T, Hq, D] and k [T, Hkv, D] (usually views into the
// fused qkv projection output), the Llama/Qwen "rotate half" convention. For token t at position pos[t] and each
// head row x [D] with h = D / 2:
//   [qk_norm]  x = norm_weight * to_dtype(x * rsqrt(mean(x^2) + eps))      (Qwen3 q_norm / k_norm, per head)
//   out[i]     = x[i] * c[i] - x[i + h] * s[i]          i < h
//   out[i + h] = x[i + h] * c[i + h] + x[i] * s[i + h]
// with c = to_dtype(cos[pos[t]]), s = to_dtype(sin[pos[t]]) and each product and the sum rounded to the dtype:
// exactly what the torch code (`x * cos + rotate_half(x) * sin` on tables cast to the activation dtype) gives,
// bit for bit, apart from the fp32 sum of squares of the optional norm. cos/sin are fp32 [P, D] row-major.
// Strides in elements; the last dimension is contiguous. q and k must not overlap.
#pragma once
#include <cstdint>

#include "common/dtype.h"
#include "common/dispatch.h"
#include "common/op_args.h"

namespace pyscore {

struct RotaryParams {
  void* q;  // [T, Hq, D]
  int64_t q_token_stride, q_head_stride;
  void* k;  // [T, Hkv, D]
  int64_t k_token_stride, k_head_stride;
  const int64_t* positions;  // [T], each in [0, num_positions)
  const float* cos;          // [P, D]
  const float* sin;          // [P, D]
  int64_t num_positions;
  const void* q_norm;  // [D] in the dtype, or nullptr (then k_norm is nullptr too: no qk-norm)
  const void* k_norm;  // [D]
  float eps;
  int32_t num_tokens;
  int32_t num_q_heads;
  int32_t num_kv_heads;
  int32_t head_dim;  // even, <= kRotaryMaxHeadDim
  DType dtype;       // of q, k and the norm weights
};

constexpr int32_t kRotaryMaxHeadDim = 512;

// ---- The CPU launcher's parts ------------------------------------------------------------------------------------
// The CPU rotary kernel: its launcher, which bindings_cpu.cpp calls, and the parts the
// launcher (rotary_cpu.cpp, baseline ISA) dispatches to. It splits tokens over threads and calls `tokens` on each
// slice; `tokens` comes in AVX-512 and AVX2 builds (one body, tokens_simd.h, compiled per vector layer by
// cmake/cpu_kernels.cmake) and a portable one.

// Returns a Status, never throws. CPU only: on CUDA the Python wrapper runs the torch reference.
Status rotary_cpu(const RotaryParams& params);
PYSCORE_BIND(rotary, rotary_cpu, Ptr, Strides, Ptr, Strides, Ptr, Ptr, Ptr, int64_t, Ptr, Ptr, float, int32_t, int32_t,
             int32_t, int32_t, DTypeName);

using RotaryTokens = void (*)(const RotaryParams& p, int32_t begin, int32_t end);

// The vector layers' tokens (tokens_simd.h); nullptr where the dtype is not covered.
PYSCORE_KERNELS(rotary, rotary_tokens, RotaryTokens);

}  // namespace pyscore
