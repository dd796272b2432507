// Internal interface of the CPU label_logprobs kernel: the launcher (label_logprobs_cpu.cpp, baseline ISA)
// splits the vocabulary over threads and calls these ops on chunks of it; they come in an AVX-512 build
// (label_logprobs_avx512.cpp; the LM head product on AMX tiles at tier amx, label_logprobs_amx.cpp), AVX2 and
// NEON ones (one text, logits_simd.h, compiled per vector layer by cmake/cpu_kernels.cmake) and a
// portable one.
#pragma once
#include <cstdint>

#include "common/cpu_features.h"
#include "common/isa_entry.h"
#include "label_logprobs/params.h"

namespace pyscore {

struct LabelCpuOps {
  // out[r * n + j] = logit of vocabulary entry v0 + j for row r (hidden[r] . weight[v0 + j] with fp32
  // accumulation, or the given logits when weight is null), for all rows r < num_rows and j < n.
  void (*logits_chunk)(const LabelLogprobsParams& p, int32_t v0, int32_t n, float* out);
  // Folds x[0, n) into a running log-sum-exp state: *max and *sum = sum of exp(x - *max) so far.
  void (*lse_update)(const float* x, int32_t n, float* max, float* sum);
  // Optional (null: nothing to do): run by each thread once per call, before its logits_chunk calls, with the
  // call's params (the AMX ops lay the read-out rows out as tiles here, once instead of per chunk).
  void (*prepare)(const LabelLogprobsParams& p) = nullptr;
};

// nullptr when the dtype is not covered (the caller checks the CPU); bf16_dot picks how bf16 pairs are multiplied.
PYSCORE_X86_ENTRY(const LabelCpuOps* label_ops_avx512(DType dtype, Bf16Dot bf16_dot));
// AMX tiles for the bf16 LM head product (tier amx; the caller checks it): nullptr for other dtypes.
PYSCORE_X86_ENTRY(const LabelCpuOps* label_ops_amx(DType dtype));
PYSCORE_X86_ENTRY(const LabelCpuOps* label_ops_avx2(DType dtype));
PYSCORE_ARM_ENTRY(const LabelCpuOps* label_ops_neon(DType dtype));

}  // namespace pyscore
