// Launchers for the linear-attention ops (contracts in params.h). They return a Status, never throw.
#pragma once
#include "gated_delta_rule/params.h"

namespace pyscore {

Status causal_conv1d_cpu(const CausalConv1dParams& params);
Status gated_delta_rule_cpu(const GatedDeltaRuleParams& params);
// `stream` is a cudaStream_t passed as void* so this header needs no CUDA include.
Status causal_conv1d_cuda(const CausalConv1dParams& params, void* stream);
Status gated_delta_rule_cuda(const GatedDeltaRuleParams& params, void* stream);

}  // namespace pyscore
