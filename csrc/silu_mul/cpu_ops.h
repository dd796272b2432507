// Internal interface of the CPU silu_mul kernel: the launcher (silu_mul_cpu.cpp, baseline ISA) splits rows over
// threads and calls `rows` on each slice; it comes in AVX-512 and AVX2
// builds (one body, rows_simd.h, compiled per ISA by silu_mul_avx512.cpp and silu_mul_avx2.cpp) and a
// portable one.
#pragma once
#include <cstdint>

#include "silu_mul/params.h"

namespace pyscore {

using SiluMulRows = void (*)(const SiluMulParams& p, int32_t begin, int32_t end);

// nullptr when the dtype is not covered (the caller checks the CPU).
SiluMulRows silu_mul_rows_avx512(DType dtype);
SiluMulRows silu_mul_rows_avx2(DType dtype);

}  // namespace pyscore
