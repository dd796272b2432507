// Internal interface of the CPU rotary kernel: the launcher (rotary_cpu.cpp, baseline ISA) splits tokens over
// threads and calls `tokens` on each slice; it comes in AVX-512 and AVX2
// builds (one body, tokens_simd.h, compiled per ISA by rotary_avx512.cpp and rotary_avx2.cpp) and a
// portable one.
#pragma once
#include <cstdint>

#include "rotary/params.h"

namespace pyscore {

using RotaryTokens = void (*)(const RotaryParams& p, int32_t begin, int32_t end);

// nullptr when the dtype is not covered (the caller checks the CPU).
RotaryTokens rotary_tokens_avx512(DType dtype);
RotaryTokens rotary_tokens_avx2(DType dtype);

}  // namespace pyscore
