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
// Cached keys (a prefix cache's blocks, optional): a segment may be preceded by keys that have no query row in
// this stream, `count` blocks of `block_tokens` keys each, listed at cached_blocks[first .. first + count) as
// block indices into the layer's cache_k / cache_v. Every token of the segment sees all of them. Where they sit
// in the key order follows the segment's `kind`, chosen to reproduce the layout of a run without the cache so
// that a warm run does the same arithmetic as a cold one:
//   kCachedBeforeOwn    (a causal sequence that continues cached tokens: a SIS sequence, a Generate prompt, the
//                        uncached rest of an MIS prefix) — the cached keys precede the segment's own tokens and
//                        form one causal key range with them; prefix_length must be 0.
//   kCachedBeforePrefix (the items of an MIS group whose prefix starts with cached tokens) — the cached keys
//                        precede the prefix range [prefix_start, +prefix_length), which may be empty when the
//                        whole prefix is cached; the group's items share that one range.
// block_tokens is a multiple of 64 (the kernels' key tile) on CUDA, so a cached block is whole key tiles and a
// cached range followed by stream keys tiles exactly as the same keys in one stream range would. The CPU kernel takes
// multiples of 16 (the KV store's CPU pages): blocks that are not whole packed key tiles are gathered with the
// range's stream keys and packed as one run, the same layout.
//
// The work that depends only on the segment table and the head layout is planned once per batch
// (AttentionPlanParams; plan_cpu.h on the CPU, the tile work list on CUDA) and every layer runs with it.
#pragma once
#include <cstdint>

#include "common/dtype.h"

namespace pyscore {

enum CachedKind : int32_t { kCachedBeforeOwn = 0, kCachedBeforePrefix = 1 };
constexpr int32_t kCachedBlockMultiple = 64;     // CUDA
constexpr int32_t kCpuCachedBlockMultiple = 16;  // CPU

// What a plan depends on: the batch's segment table and the model's head layout, no tensors.
struct AttentionPlanParams {
  const int32_t* segments;  // [num_segments, 4]: start, length, prefix_start, prefix_length
  int32_t num_segments;
  int32_t num_tokens;
  int32_t num_q_heads;
  int32_t num_kv_heads;
  int32_t head_dim;
  DType dtype;
  // Cached keys; cached == nullptr: none (then the other three are ignored).
  const int32_t* cached = nullptr;         // [num_segments, 3]: first, count, kind (CachedKind)
  const int32_t* cached_blocks = nullptr;  // [num_cached_blocks]: block index into cache_k / cache_v
  int32_t num_cached_blocks = 0;
  int32_t block_tokens = 0;
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
  // This layer's cached blocks (with a plan that has cached keys): key j of block b, kv head h at
  // cache_k + b * cache_block_stride + j * cache_token_stride + h * cache_head_stride; the same strides for cache_v.
  const void* cache_k = nullptr;
  const void* cache_v = nullptr;
  int64_t cache_block_stride = 0, cache_token_stride = 0, cache_head_stride = 0;
};

}  // namespace pyscore
