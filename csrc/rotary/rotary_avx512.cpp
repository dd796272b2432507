// AVX-512 tokens of rotary (interface in cpu_ops.h): the body of tokens_simd.h on the AVX-512 vector layer.
#include "common/vec_avx512.h"

namespace pyscore {
namespace {
namespace V = avx512;
}  // namespace
}  // namespace pyscore

#include "rotary/tokens_simd.h"

namespace pyscore {

RotaryTokens rotary_tokens_avx512(DType dtype) { return tokens_for(dtype); }

}  // namespace pyscore
