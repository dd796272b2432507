// decode_attention: one new query token per running sequence against that sequence's KV cache, all sequences in one
// call (ragged lengths, GQA: query head h reads kv head h / (num_q_heads / num_kv_heads)).
//
// Each sequence keeps its own cache; the kernel sees, per sequence b, a base address and a layer stride, so the
// keys of layer `layer` start at k_base[b] + layer * layer_stride[b] (elements) and key t of kv head h sits at
// + t * token_stride + h * head_stride (values likewise from v_base). For pyscore's KVCache ([L, capacity, Hkv, D]
// per sequence) that is layer_stride = capacity * Hkv * D, token_stride = Hkv * D, head_stride = D. A paged cache
// would add a block table [B, max_blocks] and a block size: key t at pool + block_table[b][t / block] * block
// stride + (t % block) * token_stride; only the address arithmetic of a key changes.
//
// Sequence b attends to keys [0, lengths[b]), which include its new token. When k_new / v_new are given ([B, Hkv, D])
// the kernel first writes them into the caches at position lengths[b] - 1 (the caller advances its own length
// only after the step succeeded). Long caches are split into fixed chunks of kDecodeChunk keys, attended in parallel
// and merged by log-sum-exp in chunk order; the split depends only on the sequence's own length, so its result does
// not depend on its batch-mates. Strides in elements.
#pragma once
#include <cstdint>

#include "common/dtype.h"

namespace pyscore {

constexpr int32_t kDecodeChunk = 256;

struct DecodeAttentionParams {
  const void* q;  // [B, Hq, D]
  int64_t q_seq_stride, q_head_stride;
  void* o;  // [B, Hq, D], q's dtype
  int64_t o_seq_stride, o_head_stride;
  const void* k_new;  // [B, Hkv, D] or nullptr
  const void* v_new;
  int64_t new_seq_stride, new_head_stride;  // shared by k_new and v_new
  const int64_t* k_base;  // [B] addresses (the caches are written through them when k_new is given)
  const int64_t* v_base;
  const int64_t* layer_stride;  // [B] elements
  int32_t layer;
  int64_t token_stride, head_stride;  // shared by k and v
  const int32_t* lengths;  // [B], each >= 1
  int32_t max_length;      // >= every length (sizes the CUDA grid; the CPU kernel reads the lengths)
  int32_t num_seqs;
  int32_t num_q_heads;
  int32_t num_kv_heads;
  int32_t head_dim;
  float scale;
  DType dtype;
};

}  // namespace pyscore
