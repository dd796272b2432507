// AVX2 rows of silu_mul (interface in cpu_ops.h): the body of rows_simd.h on the AVX2 vector layer.
#include "common/vec_avx2.h"

namespace pyscore {
namespace {
namespace V = avx2;
}  // namespace
}  // namespace pyscore

#include "silu_mul/rows_simd.h"

namespace pyscore {

SiluMulRows silu_mul_rows_avx2(DType dtype) { return rows_for(dtype); }

}  // namespace pyscore
