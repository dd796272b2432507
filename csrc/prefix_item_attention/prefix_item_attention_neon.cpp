// NEON ops of the CPU prefix_item_attention kernel (interface in cpu_ops.h): the kernel text of
// attention_simd.h on the NEON vector layer (common/vec_neon.h).
#include "common/vec_neon.h"

namespace pyscore {
namespace {
namespace V = neon;
}  // namespace
}  // namespace pyscore

#include "prefix_item_attention/attention_simd.h"

namespace pyscore {

const AttentionCpuOps* attention_ops_neon(DType dtype, int32_t head_dim) { return ops_for(dtype, head_dim); }

}  // namespace pyscore
