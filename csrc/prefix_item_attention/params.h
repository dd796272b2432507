// prefix_item_attention: attention over a packed, unpadded token stream made of segments.
//
// Every segment s covers tokens [start, start + length) and may see a shared prefix
// [prefix_start, prefix_start + prefix_length): a token t of segment s attends to every prefix token and,
// causally, to the tokens of its own segment up to and including t. prefix_length == 0 gives plain causal
// attention (a SIS sequence, or the prefix of an MIS group itself). The items of one MIS group are
// consecutive rows of the table with the same (prefix_start, prefix_length) and sit contiguously in the
// stream, so kernels can read the prefix once for all of them (items x prefix as one dense block, each item
// x its own keys causally, merged by log-sum-exp).
//
// Strides are in elements. GQA: query head h reads kv head h / (num_q_heads / num_kv_heads).
//
// The work that depends only on the segment table and the head layout is planned once per batch
// (AttentionPlanParams; plan_cpu.h on the CPU, the tile work list on CUDA) and every layer runs with it.
#pragma once
#include <cstdint>

#include "common/dtype.h"

namespace pyscore {

// What a plan depends on: the batch's segment table and the model's head layout, no tensors.
struct AttentionPlanParams {
  const int32_t* segments;  // [num_segments, 4]: start, length, prefix_start, prefix_length
  int32_t num_segments;
  int32_t num_tokens;
  int32_t num_q_heads;
  int32_t num_kv_heads;
  int32_t head_dim;
  DType dtype;
};

// One layer's run: the plan's shape plus that layer's tensors.
struct PrefixItemAttentionParams : AttentionPlanParams {
  const void* q;  // [T, Hq, D]
  const void* k;  // [T, Hkv, D]
  const void* v;  // [T, Hkv, D]
  void* o;        // [T, Hq, D], same dtype as q
  int64_t q_token_stride, q_head_stride;
  int64_t k_token_stride, k_head_stride;
  int64_t v_token_stride, v_head_stride;
  int64_t o_token_stride, o_head_stride;
  float scale;  // softmax scale, usually 1/sqrt(head_dim)
};

}  // namespace pyscore
