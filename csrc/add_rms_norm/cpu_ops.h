// The CPU add_rms_norm kernel (contract in params.h): its launcher, which bindings_cpu.cpp calls, and the parts the
// launcher (add_rms_norm_cpu.cpp, baseline ISA) dispatches to. It splits the rows over threads and calls `rows` on
// each slice; `rows` comes in AVX-512 and AVX2 builds (one body, rows_simd.h, compiled per vector layer
// by cmake/cpu_kernels.cmake) and a portable one.
#pragma once
#include <cstdint>

#include "add_rms_norm/params.h"
#include "common/isa_entry.h"

namespace pyscore {

// Returns a Status, never throws. CPU only: on CUDA the Python wrapper runs the torch reference.
Status add_rms_norm_cpu(const AddRmsNormParams& params);

using AddRmsNormRows = void (*)(const AddRmsNormParams& p, int32_t begin, int32_t end);

// nullptr when the dtype is not covered (the caller checks the CPU).
PYSCORE_X86_ENTRY(AddRmsNormRows add_rms_norm_rows_avx512(DType dtype));
PYSCORE_X86_ENTRY(AddRmsNormRows add_rms_norm_rows_avx2(DType dtype));

}  // namespace pyscore
