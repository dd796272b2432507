// add_rms_norm: the residual add and RMSNorm between decoder sublayers, fused. For each row t of x [T, H]:
//   if delta:  x[t] = x[t] + delta[t]                                   (in x's dtype: fp32 add, then rounded)
//   out[t] = weight * to_dtype(x_f32[t] * rsqrt(mean(x_f32[t]^2) + eps))
// which is the transformers recipe bit for bit except for the order of the fp32 sum of squares: statistics in
// fp32, the normalized row rounded to the dtype, then the weight product rounded again (for bf16 that product
// is exact in fp32, so the only rounding is the final one). Without delta it is a plain RMSNorm and x is
// read only. With weight_fp32 the weight is fp32 and scales the fp32 normalized row before its one rounding:
//   out[t] = to_dtype(weight_f32 * x_f32[t] * rsqrt(mean(x_f32[t]^2) + eps))
// which is Qwen3.5's zero-centred RMSNorm `x_hat * (1 + w)` with weight = 1 + w (the two recipes agree in fp32).
// Strides in elements; the last dimension of every tensor is contiguous.
#pragma once
#include <cstdint>

#include "common/dtype.h"
#include "common/dispatch.h"
#include "common/op_args.h"

namespace pyscore {

struct AddRmsNormParams {
  void* x;  // [T, H] residual stream, updated in place when delta is given
  int64_t x_row_stride;
  const void* delta;  // [T, H] or nullptr
  int64_t delta_row_stride;
  const void* weight;  // [H], in the dtype, or fp32 with weight_fp32
  void* out;           // [T, H], must not overlap x or delta
  int64_t out_row_stride;
  int32_t num_rows;
  int32_t hidden_size;
  float eps;
  bool weight_fp32;
  DType dtype;  // of x, delta, out and (unless weight_fp32) weight
};

// ---- The CPU launcher's parts ------------------------------------------------------------------------------------
// The CPU add_rms_norm kernel: its launcher, which bindings_cpu.cpp calls, and the parts the
// launcher (add_rms_norm_cpu.cpp, baseline ISA) dispatches to. It splits the rows over threads and calls `rows` on
// each slice; `rows` comes in AVX-512 and AVX2 builds (one body, rows_simd.h, compiled per vector layer
// by cmake/cpu_kernels.cmake) and a portable one.

// Returns a Status, never throws. CPU only: on CUDA the Python wrapper runs the torch reference.
Status add_rms_norm_cpu(const AddRmsNormParams& params);
PYSCORE_BIND(add_rms_norm, add_rms_norm_cpu, Ptr, int64_t, Ptr, int64_t, Ptr, Ptr, int64_t, int32_t, int32_t, float,
             bool, DTypeName);

using AddRmsNormRows = void (*)(const AddRmsNormParams& p, int32_t begin, int32_t end);

// The vector layers' rows (rows_simd.h); nullptr where the dtype is not covered.
PYSCORE_KERNELS(add_rms_norm, add_rms_norm_rows, AddRmsNormRows);

}  // namespace pyscore
