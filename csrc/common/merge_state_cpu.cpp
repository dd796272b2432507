// The CPU log-sum-exp merge of two partial attentions (contract in merge_state_cpu.h).
#include "common/merge_state_cpu.h"

#include <algorithm>
#include <cmath>
#include <limits>

namespace pyscore {

void merge_state(const float* o_a, const float* lse_a, const float* o_b, const float* lse_b, int32_t rows,
                 int32_t dim, float* o_out, float* lse_out) {
  for (int32_t r = 0; r < rows; ++r) {
    const float a = lse_a[r], b = lse_b[r];
    const float m = std::max(a, b);
    const float* xa = o_a + int64_t(r) * dim;
    const float* xb = o_b + int64_t(r) * dim;
    float* out = o_out + int64_t(r) * dim;
    if (m == -std::numeric_limits<float>::infinity()) {  // neither side saw a key
      std::fill(out, out + dim, 0.0f);
      if (lse_out) lse_out[r] = m;
      continue;
    }
    // The larger side has weight e^0 = 1, so one exp per row suffices.
    const float w = std::exp(std::min(a, b) - m);
    const float wa = a >= b ? 1.0f : w, wb = a >= b ? w : 1.0f;
    const float inv = 1.0f / (1.0f + w);
    for (int32_t d = 0; d < dim; ++d) out[d] = (wa * xa[d] + wb * xb[d]) * inv;
    if (lse_out) lse_out[r] = m + std::log1p(w);
  }
}

}  // namespace pyscore
