// The log-sum-exp merge of two partial attentions of the same query row over disjoint key sets (the CUDA twin of
// pyscore.ops.reference.merge_state_ref), as weights: decode_attention folds its key chunks with them.
//   m = max(lse_a, lse_b) (0 when that is infinite),  w_x = e^{lse_x - m},
//   o = (w_a o_a + w_b o_b) / (w_a + w_b),  lse = m + log(w_a + w_b).
// A side with lse = -inf (it saw no key) has weight 0; when both have, o = 0 and lse = -inf, which keeps
// (0, -inf) the identity of the merge.
#pragma once
#include <cuda_runtime.h>

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

}  // namespace pyscore
