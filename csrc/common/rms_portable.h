// RMSNorm statistics shared by add_rms_norm and the rotary qk-norm. sum_of_squares is for the scalar paths: it
// runs in 16 interleaved partial sums, as the AVX-512 paths' lanes do, which keeps its rounding error (and the
// difference from torch's vectorized sum) at a few fp32 ulps instead of growing with the row length.
// rms_scale is used from *_avx512.cpp files too, so it is `static`: an inline function's single out-of-line copy
// could otherwise be the one compiled with AVX-512 and reach baseline-ISA callers.
#pragma once
#include <cmath>
#include <cstdint>

#include "common/bf16.h"

namespace pyscore {

template <class T>
float sum_of_squares(const T* x, int32_t n) {
  float part[16] = {};
  for (int32_t i = 0; i < n; ++i) part[i % 16] += to_f32(x[i]) * to_f32(x[i]);
  float sum = 0.0f;
  for (float p : part) sum += p;
  return sum;
}

// 1 / sqrt(mean + eps), both correctly rounded, as torch's rsqrt on CPU.
static inline float rms_scale(float sum_of_squares, int32_t n, float eps) {
  return 1.0f / std::sqrt(sum_of_squares / float(n) + eps);
}

}  // namespace pyscore
