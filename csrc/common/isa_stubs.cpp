// Stand-ins for the ISA entry points of the ops whose header declares them plainly (linear, decode_attention):
// the other ops declare theirs with PYSCORE_X86_ENTRY / PYSCORE_ARM_ENTRY (common/isa_entry.h), which gives the
// stand-in where it is declared. On the architecture that does not compile an ISA file (cmake/cpu_kernels.cmake:
// *_avx512.cpp, *_amx.cpp and *_avx2.cpp on x86-64 only) these return nullptr, "not covered", so every launcher
// keeps one dispatch code for all architectures. They are never reached: cpu_tier() never names another architecture's tier.
// tests/ops/test_aarch64.py checks that every entry point has a stand-in one way or the other.
#include "decode_attention/decode_attention.h"
#include "linear/linear.h"

namespace pyscore {

#if !defined(__x86_64__)
const DecodeCpuOps* decode_ops_avx512(DType, int32_t, Bf16Dot) { return nullptr; }
const LinearCpuOps* linear_ops_avx512(DType, Bf16Dot, bool) { return nullptr; }
const LinearCpuOps* linear_ops_amx(DType) { return nullptr; }
const DecodeCpuOps* decode_ops_avx2(DType, int32_t) { return nullptr; }
const LinearCpuOps* linear_ops_avx2(DType, bool) { return nullptr; }
#endif

}  // namespace pyscore
