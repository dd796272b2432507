// Internal interface of the CPU linear-attention kernels: the launchers (gated_delta_rule_cpu.cpp, baseline ISA)
// plan the work and call these, which come in an AVX-512 build (gated_delta_rule_avx512.cpp), an AVX2 one
// (gated_delta_rule_avx2.cpp) and a portable one.
#pragma once
#include <cstdint>

#include "common/isa_entry.h"
#include "gated_delta_rule/params.h"

namespace pyscore {

// State columns per recurrence task: a [Dk, 32] fp32 block (16 KB at Dk = 128) stays in L1 while a sequence runs.
// The columns of S evolve independently given q, k, decay and beta, so (head, column block) tasks never meet.
constexpr int32_t kStateCols = 32;
// Tokens per convolution task: whole rows of C channels, read in stream order (prefetch-friendly), each row
// reused by the K tokens that need it while it is still in L1 / L2.
constexpr int32_t kConvTokens = 16;
constexpr int32_t kMaxKeyDim = 256;

// Runs tokens [start, start + length) of value head `head` through the recurrence for state columns
// [col0, col0 + cols), cols <= kStateCols: `state` is that [Dk, kStateCols] block (row stride kStateCols), holding
// the state the tokens start from and left holding their end state; writes o for those columns.
using StateColumnsRun = void (*)(const GatedDeltaRuleParams& p, int32_t head, int32_t col0, int32_t cols,
                                 int32_t start, int32_t length, float* state);

// Tokens [j0, j1) of the segment starting at stream token `start`, all channels. `history[i]` is the address of the
// input row at sequence position i - (K - 1) relative to the segment's first token (a prefix row, a tail row, or
// nullptr for a zero input), i < K - 1; the segment's own rows come from p.x. `wt` is the weight transposed to
// [K][C] fp32.
using ConvTokensRun = void (*)(const CausalConv1dParams& p, int32_t start, int32_t j0, int32_t j1,
                               const void* const* history, const float* wt);

// nullptr when the dtype is not covered (the caller checks the CPU).
PYSCORE_X86_ENTRY(StateColumnsRun state_columns_avx512(DType dtype));
PYSCORE_X86_ENTRY(ConvTokensRun conv_tokens_avx512(DType dtype));
PYSCORE_X86_ENTRY(StateColumnsRun state_columns_avx2(DType dtype));
PYSCORE_X86_ENTRY(ConvTokensRun conv_tokens_avx2(DType dtype));

}  // namespace pyscore
