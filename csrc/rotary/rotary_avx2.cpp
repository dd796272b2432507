// AVX2 tokens of rotary (interface in cpu_ops.h): the body of tokens_simd.h on the AVX2 vector layer.
#include "common/vec_avx2.h"

namespace pyscore {
namespace {
namespace V = avx2;
}  // namespace
}  // namespace pyscore

#include "rotary/tokens_simd.h"

namespace pyscore {

RotaryTokens rotary_tokens_avx2(DType dtype) { return tokens_for(dtype); }

}  // namespace pyscore
