// The CPU silu_mul kernel (contract in params.h): its launcher, which bindings_cpu.cpp calls, and the parts the
// launcher (silu_mul_cpu.cpp, baseline ISA) dispatches to. It splits rows over threads and calls `rows` on each
// slice; `rows` comes in AVX-512 and AVX2 builds (one body, rows_simd.h, compiled per vector layer by
// cmake/cpu_kernels.cmake) and a portable one.
#pragma once
#include <cstdint>

#include "common/isa_entry.h"
#include "silu_mul/params.h"

namespace pyscore {

// Returns a Status, never throws. CPU only: on CUDA the Python wrapper runs the torch reference.
Status silu_mul_cpu(const SiluMulParams& params);

using SiluMulRows = void (*)(const SiluMulParams& p, int32_t begin, int32_t end);

// nullptr when the dtype is not covered (the caller checks the CPU).
PYSCORE_X86_ENTRY(SiluMulRows silu_mul_rows_avx512(DType dtype));
PYSCORE_X86_ENTRY(SiluMulRows silu_mul_rows_avx2(DType dtype));

}  // namespace pyscore
