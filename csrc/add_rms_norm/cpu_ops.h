// Internal interface of the CPU add_rms_norm kernel: the launcher (add_rms_norm_cpu.cpp, baseline ISA) splits
// the rows over threads and calls `rows` on each slice; it comes in an AVX-512 build (add_rms_norm_avx512.cpp),
// an AVX2 one (add_rms_norm_avx2.cpp) and a portable one.
#pragma once
#include <cstdint>

#include "add_rms_norm/params.h"

namespace pyscore {

using AddRmsNormRows = void (*)(const AddRmsNormParams& p, int32_t begin, int32_t end);

// nullptr when the dtype is not covered (the caller checks the CPU).
AddRmsNormRows add_rms_norm_rows_avx512(DType dtype);
AddRmsNormRows add_rms_norm_rows_avx2(DType dtype);

}  // namespace pyscore
