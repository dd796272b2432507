// Off x86-64 (aarch64) the x86 ISA kernels (*_avx512.cpp, *_avx2.cpp) are not compiled (cmake/cpu_kernels.cmake);
// these stand-ins for their entry points return nullptr, "not covered", so every launcher keeps one dispatch code
// for all architectures and falls to its portable ops. They are never reached in practice: cpu_tier() is generic or
// neon there, below every x86 tier. A new x86 entry point needs its stand-in here, or the aarch64 build fails to link
// (tests/ops/test_aarch64.py says which symbol).
#if !defined(__x86_64__)

#include "add_rms_norm/cpu_ops.h"
#include "decode_attention/cpu_ops.h"
#include "gated_delta_rule/cpu_ops.h"
#include "label_logprobs/cpu_ops.h"
#include "linear/cpu_ops.h"
#include "prefix_item_attention/cpu_ops.h"
#include "rotary/cpu_ops.h"
#include "silu_mul/cpu_ops.h"

namespace pyscore {

AddRmsNormRows add_rms_norm_rows_avx512(DType) { return nullptr; }
const DecodeCpuOps* decode_ops_avx512(DType, int32_t) { return nullptr; }
StateColumnsRun state_columns_avx512(DType) { return nullptr; }
ConvTokensRun conv_tokens_avx512(DType) { return nullptr; }
const LabelCpuOps* label_ops_avx512(DType, Bf16Dot) { return nullptr; }
const LinearCpuOps* linear_ops_avx512(DType, Bf16Dot) { return nullptr; }
const AttentionCpuOps* attention_ops_avx512(DType, int32_t, Bf16Dot) { return nullptr; }
RotaryTokens rotary_tokens_avx512(DType) { return nullptr; }
SiluMulRows silu_mul_rows_avx512(DType) { return nullptr; }

}  // namespace pyscore

#endif  // !defined(__x86_64__)
