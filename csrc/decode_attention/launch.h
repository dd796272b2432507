// Launchers for decode_attention (contract in params.h). They return a Status, never throw.
#pragma once
#include "decode_attention/params.h"

namespace pyscore {

Status decode_attention_cpu(const DecodeAttentionParams& params);
// `stream` is a cudaStream_t passed as void* so this header needs no CUDA include.
Status decode_attention_cuda(const DecodeAttentionParams& params, void* stream);

}  // namespace pyscore
