// AVX-512 rows of silu_mul (interface in cpu_ops.h): the body of rows_simd.h on the AVX-512 vector layer.
#include "common/vec_avx512.h"

namespace pyscore {
namespace {
namespace V = avx512;
}  // namespace
}  // namespace pyscore

#include "silu_mul/rows_simd.h"

namespace pyscore {

SiluMulRows silu_mul_rows_avx512(DType dtype) { return rows_for(dtype); }

}  // namespace pyscore
