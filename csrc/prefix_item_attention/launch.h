// Launchers for prefix_item_attention (contract in params.h). They return a Status, never throw.
#pragma once
#include "prefix_item_attention/params.h"

namespace pyscore {

Status prefix_item_attention_cpu(const PrefixItemAttentionParams& params);
// `stream` is a cudaStream_t passed as void* so this header needs no CUDA include.
Status prefix_item_attention_cuda(const PrefixItemAttentionParams& params, void* stream);

}  // namespace pyscore
