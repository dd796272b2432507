// AVX2 ops of the CPU prefix_item_attention kernel (interface in cpu_ops.h): the kernel text of
// attention_simd.h on the AVX2 vector layer (common/vec_avx2.h).
#include "common/vec_avx2.h"

namespace pyscore {
namespace {
namespace V = avx2;
}  // namespace
}  // namespace pyscore

#include "prefix_item_attention/attention_simd.h"

namespace pyscore {

const AttentionCpuOps* attention_ops_avx2(DType dtype, int32_t head_dim) { return ops_for(dtype, head_dim); }

}  // namespace pyscore
