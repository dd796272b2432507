// Internal interface of the CPU add_rms_norm kernel: the launcher (add_rms_norm_cpu.cpp, baseline ISA) splits
// the rows over threads and calls `rows` on each slice; it comes in AVX-512 and AVX2
// builds (one body, rows_simd.h, compiled per ISA by add_rms_norm_avx512.cpp and add_rms_norm_avx2.cpp) and a
// portable one.
#pragma once
#include <cstdint>

#include "add_rms_norm/params.h"

namespace pyscore {

using AddRmsNormRows = void (*)(const AddRmsNormParams& p, int32_t begin, int32_t end);

// nullptr when the dtype is not covered (the caller checks the CPU).
AddRmsNormRows add_rms_norm_rows_avx512(DType dtype);
AddRmsNormRows add_rms_norm_rows_avx2(DType dtype);

}  // namespace pyscore
