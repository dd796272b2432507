// AVX-512 rows of add_rms_norm (interface in cpu_ops.h): the body of rows_simd.h on the AVX-512 vector layer.
#include "common/vec_avx512.h"

namespace pyscore {
namespace {
namespace V = avx512;
}  // namespace
}  // namespace pyscore

#include "add_rms_norm/rows_simd.h"

namespace pyscore {

AddRmsNormRows add_rms_norm_rows_avx512(DType dtype) { return rows_for(dtype); }

}  // namespace pyscore
