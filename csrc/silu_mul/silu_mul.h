// silu_mul: the SwiGLU activation, out[t, i] = silu(gate[t, i]) * up[t, i] for t < T, i < I, where gate and up
// are usually the two halves of the fused gate_up projection output [T, 2I] (row strides 2I). As torch's
// `F.silu(gate) * up` in the dtype: silu(x) = x / (1 + exp(-x)) in fp32 (exp within ~1 ulp, as torch's), rounded
// to the dtype, then the product rounded. Strides in elements; the last dimension is contiguous.
#pragma once
#include <cstdint>

#include "common/dtype.h"
#include "common/dispatch.h"
#include "common/op_args.h"

namespace pyscore {

struct SiluMulParams {
  const void* gate;  // [T, I]
  int64_t gate_row_stride;
  const void* up;  // [T, I]
  int64_t up_row_stride;
  void* out;  // [T, I], may alias neither input
  int64_t out_row_stride;
  int32_t num_rows;
  int32_t width;  // I
  DType dtype;
};

// ---- The CPU launcher's parts ------------------------------------------------------------------------------------
// The CPU silu_mul kernel: its launcher, which bindings_cpu.cpp calls, and the parts the
// launcher (silu_mul_cpu.cpp, baseline ISA) dispatches to. It splits rows over threads and calls `rows` on each
// slice; `rows` comes in AVX-512 and AVX2 builds (one body, rows_simd.h, compiled per vector layer by
// cmake/cpu_kernels.cmake) and a portable one.

// Returns a Status, never throws. CPU only: on CUDA the Python wrapper runs the torch reference.
Status silu_mul_cpu(const SiluMulParams& params);
PYSCORE_BIND(silu_mul, silu_mul_cpu, Ptr, int64_t, Ptr, int64_t, Ptr, int64_t, int32_t, int32_t, DTypeName);

using SiluMulRows = void (*)(const SiluMulParams& p, int32_t begin, int32_t end);

// The vector layers' rows (rows_simd.h); nullptr where the dtype is not covered.
PYSCORE_KERNELS(silu_mul, silu_mul_rows, SiluMulRows);

}  // namespace pyscore
