// Internal interface of the CPU linear kernel: the launcher (linear_cpu.cpp, baseline ISA) splits the output into
// rectangles over threads and calls these ops on them; they come in an AVX-512 build (linear_avx512.cpp), an AVX2
// build (linear_avx2.cpp) and a portable one. x arrives with an even K (the launcher pads an odd K), so a bf16 row is whole pairs.
#pragma once
#include <cstdint>

#include "common/cpu_features.h"
#include "linear/params.h"

namespace pyscore {

// Packed columns per unit of work: one gated unit (16 gate + 16 up columns), two zmm.
constexpr int32_t kLinearUnitN = 32;

struct LinearCpuOps {
  // Rows [m0, m1) x packed columns [c0, c1) (multiples of kLinearUnitN) of the output, epilogue included.
  void (*rect)(const LinearParams& p, int32_t m0, int32_t m1, int32_t c0, int32_t c1);
  int32_t row_tile;  // rows the micro-kernel takes at once: row chunks are multiples of it (no short tile left)
};

// nullptr when the dtype is not covered (the caller checks the CPU); bf16_dot picks how bf16 pairs are multiplied.
const LinearCpuOps* linear_ops_avx512(DType dtype, Bf16Dot bf16_dot);
// AVX2 + FMA (fp32, and bf16 widened to fp32); nullptr for other dtypes.
const LinearCpuOps* linear_ops_avx2(DType dtype);
// The AMX tile GEMM (bf16 only; nullptr for other dtypes or when the OS does not grant the tile state).
const LinearCpuOps* linear_ops_amx(DType dtype);

}  // namespace pyscore
