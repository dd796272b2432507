// Launchers for prefix_item_attention (contract in params.h). They return a Status, never throw. Both devices
// split the work FlashInfer's way: a plan made once per batch from the segment table and the head layout, then
// one run per layer. The CPU plan (its launchers are in plan_cpu.h) owns its workspaces; on CUDA the caller
// allocates one workspace of prefix_item_attention_workspace_bytes_cuda bytes per batch, the plan fills it on
// the device, and every run with that shape reads it.
#pragma once
#include <cstddef>

#include "prefix_item_attention/params.h"

namespace pyscore {

// `stream` is a cudaStream_t passed as void* so this header needs no CUDA include. shape.segments and every
// pointer are device pointers; the workspace must be 16-byte aligned.
size_t prefix_item_attention_workspace_bytes_cuda(const AttentionPlanParams& shape);
Status prefix_item_attention_plan_cuda(const AttentionPlanParams& shape, void* workspace, size_t workspace_bytes,
                                       void* stream);
Status prefix_item_attention_run_cuda(const PrefixItemAttentionParams& p, const void* workspace,
                                      size_t workspace_bytes, void* stream);

}  // namespace pyscore
