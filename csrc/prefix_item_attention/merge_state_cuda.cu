// Launcher of the standalone merge kernel (common/merge_state.cuh).
#include "common/cuda_host.h"
#include "common/cuda_utils.cuh"
#include "common/merge_state.cuh"
#include "prefix_item_attention/merge_state_cuda.h"

namespace pyscore {

Status merge_state_cuda(const float* o_a, const float* lse_a, const float* o_b, const float* lse_b, int32_t rows,
                        int32_t dim, float* o_out, float* lse_out, void* stream) {
  if (rows < 0 || dim < 0) return kInvalidArgument;
  if (rows == 0) return kOk;
  if (!o_a || !lse_a || !o_b || !lse_b || !o_out || !lse_out) return kInvalidArgument;
  CudaDeviceGuard guard;
  PYSCORE_CUDA_TRY(guard.set_from_pointer(o_out));
  const unsigned blocks = static_cast<unsigned>(ceil_div<int64_t>(rows, kMergeWarps));
  merge_state_kernel<<<blocks, kMergeWarps * 32, 0, static_cast<cudaStream_t>(stream)>>>(
      o_a, lse_a, o_b, lse_b, rows, dim, o_out, lse_out);
  PYSCORE_CUDA_TRY(cudaGetLastError());
  return kOk;
}

}  // namespace pyscore
