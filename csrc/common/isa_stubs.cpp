// The ISA kernels are compiled for their architecture only (cmake/cpu_kernels.cmake): *_avx512.cpp and *_avx2.cpp
// on x86-64, *_neon.cpp on aarch64. On the other architecture these stand-ins for their entry points return nullptr,
// "not covered", so every launcher keeps one dispatch code for all architectures. They are never reached: cpu_tier()
// never names another architecture's tier. A new entry point needs its stand-in here
// (tests/ops/test_aarch64.py checks the names).
#include "add_rms_norm/cpu_ops.h"
#include "decode_attention/cpu_ops.h"
#include "gated_delta_rule/cpu_ops.h"
#include "label_logprobs/cpu_ops.h"
#include "linear/cpu_ops.h"
#include "prefix_item_attention/cpu_ops.h"
#include "rotary/cpu_ops.h"
#include "silu_mul/cpu_ops.h"

namespace pyscore {

#if !defined(__x86_64__)
AddRmsNormRows add_rms_norm_rows_avx512(DType) { return nullptr; }
const DecodeCpuOps* decode_ops_avx512(DType, int32_t) { return nullptr; }
StateColumnsRun state_columns_avx512(DType) { return nullptr; }
ConvTokensRun conv_tokens_avx512(DType) { return nullptr; }
const LabelCpuOps* label_ops_avx512(DType, Bf16Dot) { return nullptr; }
const LinearCpuOps* linear_ops_avx512(DType, Bf16Dot) { return nullptr; }
const AttentionCpuOps* attention_ops_avx512(DType, int32_t, Bf16Dot) { return nullptr; }
RotaryTokens rotary_tokens_avx512(DType) { return nullptr; }
SiluMulRows silu_mul_rows_avx512(DType) { return nullptr; }
const LinearCpuOps* linear_ops_amx(DType) { return nullptr; }
AddRmsNormRows add_rms_norm_rows_avx2(DType) { return nullptr; }
const DecodeCpuOps* decode_ops_avx2(DType, int32_t) { return nullptr; }
StateColumnsRun state_columns_avx2(DType) { return nullptr; }
ConvTokensRun conv_tokens_avx2(DType) { return nullptr; }
const LabelCpuOps* label_ops_avx2(DType) { return nullptr; }
const LinearCpuOps* linear_ops_avx2(DType) { return nullptr; }
const AttentionCpuOps* attention_ops_avx2(DType, int32_t) { return nullptr; }
RotaryTokens rotary_tokens_avx2(DType) { return nullptr; }
SiluMulRows silu_mul_rows_avx2(DType) { return nullptr; }
#endif

#if !defined(__aarch64__)
const AttentionCpuOps* attention_ops_neon(DType, int32_t) { return nullptr; }
const LabelCpuOps* label_ops_neon(DType) { return nullptr; }
#endif

}  // namespace pyscore
