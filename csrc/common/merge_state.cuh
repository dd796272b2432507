// Log-sum-exp merge of two partial attentions of the same query row over disjoint key sets (the CUDA twin of
// pyscore.ops.reference.merge_state_ref):
//   m = max(lse_a, lse_b) (0 when that is infinite),  w_x = e^{lse_x - m},
//   o = (w_a o_a + w_b o_b) / (w_a + w_b),  lse = m + log(w_a + w_b).
// A side with lse = -inf (it saw no key) has weight 0; when both have, o = 0 and lse = -inf, which keeps
// (0, -inf) the identity of the merge.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

namespace pyscore {

struct MergeWeights {
  float a;    // factor for o_a, already divided by the denominator
  float b;    // factor for o_b
  float lse;  // merged log-sum-exp
};

// The weights are computed in double: it costs nothing next to the row's memory traffic and keeps the merge
// exact to fp32 rounding under --use_fast_math (whose __expf error grows with |lse_a - lse_b|).
__device__ __forceinline__ MergeWeights merge_weights(float lse_a, float lse_b) {
  double m = fmax(double(lse_a), double(lse_b));
  if (isinf(m)) m = 0.0;  // both -inf: e^{-inf - 0} = 0 below instead of NaN from -inf - (-inf)
  const double w_a = exp(double(lse_a) - m);
  const double w_b = exp(double(lse_b) - m);
  const double denom = w_a + w_b;
  const double inv = denom > 0.0 ? 1.0 / denom : 0.0;
  return {float(w_a * inv), float(w_b * inv), float(m + log(denom))};  // log(0) = -inf
}

// Standalone merge of two states: one warp per row, lanes stride over the row's `dim` values.
constexpr int kMergeWarps = 4;

__global__ void __launch_bounds__(kMergeWarps * 32)
    merge_state_kernel(const float* o_a, const float* lse_a, const float* o_b, const float* lse_b, int32_t rows,
                       int32_t dim, float* o_out, float* lse_out) {
  // No __restrict__: o_out / lse_out may alias the `a` inputs. Each o element is read before the same thread
  // writes it; every lane reads the row's lse before the __syncwarp, and lane 0 writes lse_out after it.
  const int64_t row = int64_t(blockIdx.x) * kMergeWarps + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (row >= rows) return;
  const MergeWeights w = merge_weights(lse_a[row], lse_b[row]);
  __syncwarp();
  const int64_t base = row * dim;
  for (int d = lane; d < dim; d += 32) o_out[base + d] = fmaf(w.a, o_a[base + d], w.b * o_b[base + d]);
  if (lane == 0) lse_out[row] = w.lse;
}

}  // namespace pyscore
