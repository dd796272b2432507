// The CPU rotary kernel (contract in params.h): its launcher, which bindings_cpu.cpp calls, and the parts the
// launcher (rotary_cpu.cpp, baseline ISA) dispatches to. It splits tokens over threads and calls `tokens` on each
// slice; `tokens` comes in AVX-512 and AVX2 builds (one body, tokens_simd.h, compiled per vector layer by
// cmake/cpu_kernels.cmake) and a portable one.
#pragma once
#include <cstdint>

#include "common/isa_entry.h"
#include "rotary/params.h"

namespace pyscore {

// Returns a Status, never throws. CPU only: on CUDA the Python wrapper runs the torch reference.
Status rotary_cpu(const RotaryParams& params);

using RotaryTokens = void (*)(const RotaryParams& p, int32_t begin, int32_t end);

// nullptr when the dtype is not covered (the caller checks the CPU).
PYSCORE_X86_ENTRY(RotaryTokens rotary_tokens_avx512(DType dtype));
PYSCORE_X86_ENTRY(RotaryTokens rotary_tokens_avx2(DType dtype));

}  // namespace pyscore
