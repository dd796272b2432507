// NEON ops of the CPU label_logprobs kernel (interface in cpu_ops.h): the kernel text of logits_simd.h on the
// NEON vector layer (common/vec_neon.h).
#include "common/vec_neon.h"

namespace pyscore {
namespace {
namespace V = neon;
}  // namespace
}  // namespace pyscore

#include "label_logprobs/logits_simd.h"

namespace pyscore {

const LabelCpuOps* label_ops_neon(DType dtype) { return ops_for(dtype); }

}  // namespace pyscore
