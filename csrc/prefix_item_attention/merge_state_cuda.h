// Launcher for the standalone CUDA merge of two partial attention states (the device function lives in
// common/merge_state.cuh): o [rows, dim] fp32 row-major, lse [rows] natural log. o_out / lse_out may alias the
// `a` inputs. Exposed as _C_cuda.merge_state so the merge can be tested alone against merge_state_ref.
#pragma once
#include <cstdint>

#include "common/dtype.h"

namespace pyscore {

Status merge_state_cuda(const float* o_a, const float* lse_a, const float* o_b, const float* lse_b, int32_t rows,
                        int32_t dim, float* o_out, float* lse_out, void* stream);

}  // namespace pyscore
