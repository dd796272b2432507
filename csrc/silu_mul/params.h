// silu_mul: the SwiGLU activation, out[t, i] = silu(gate[t, i]) * up[t, i] for t < T, i < I, where gate and up
// are usually the two halves of the fused gate_up projection output [T, 2I] (row strides 2I). As torch's
// `F.silu(gate) * up` in the dtype: silu(x) = x / (1 + exp(-x)) in fp32 (exp within ~1 ulp, as torch's), rounded
// to the dtype, then the product rounded. Strides in elements; the last dimension is contiguous.
#pragma once
#include <cstdint>

#include "common/dtype.h"

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

}  // namespace pyscore
