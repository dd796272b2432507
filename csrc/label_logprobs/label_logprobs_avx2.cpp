// AVX2 ops of the CPU label_logprobs kernel (interface in cpu_ops.h): the kernel text of logits_simd.h on the
// AVX2 vector layer (common/vec_avx2.h).
#include "common/vec_avx2.h"

namespace pyscore {
namespace {
namespace V = avx2;
}  // namespace
}  // namespace pyscore

#include "label_logprobs/logits_simd.h"

namespace pyscore {

const LabelCpuOps* label_ops_avx2(DType dtype) { return ops_for(dtype); }

}  // namespace pyscore
