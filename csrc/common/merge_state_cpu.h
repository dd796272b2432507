// The one place the CPU kernels combine partial attentions (the CPU twin of common/merge_weights.cuh and of
// pyscore.ops.reference.merge_state_ref): prefix_item_attention merges a prefix and an item part, decode_attention
// the key chunks of a long cache.
#pragma once
#include <cstdint>

namespace pyscore {

// Merges two partial attentions of the same rows over disjoint key sets (o: [rows, dim] fp32, lse: [rows]
// natural log) into o_out / lse_out, which may alias o_a / lse_a. A side with lse -inf contributes nothing.
void merge_state(const float* o_a, const float* lse_a, const float* o_b, const float* lse_b, int32_t rows,
                 int32_t dim, float* o_out, float* lse_out);

}  // namespace pyscore
