// The CPU prefix_item_attention plan (FlashInfer's plan() / run() split): everything that depends only on the
// batch's segment table and the model's head layout, made once per forward pass and run by every layer.
//
// Planning reads and validates the table, groups consecutive segments that share one prefix (an MIS group's
// items), lists the key ranges to pack (each segment's own tokens, each group's prefix, de-duplicated) and the
// work units (group, kv head, block of the group's tokens; costliest first), and allocates the workspaces the
// runs reuse: the packed K/V of every range and one scratch per kernel thread, sized for the largest unit.
//
// A key range says where a block of keys sits in the packed workspace; a run packs every range from the
// layer's k/v before any unit reads it. A range may start with cached blocks (a prefix cache's keys, prefix_item_attention.h):
// they are packed from the layer's cache_k / cache_v into the range's first key tiles, the stream part after
// them, so the packed range is exactly what one stream range of the same keys would be and the units and the
// merge do not know the difference.
//
// Plain structs, no torch. A plan is run by one caller at a time (its workspaces are reused), which `running`
// enforces; the bindings hold it as an opaque object.
#pragma once
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <vector>

#include "prefix_item_attention/prefix_item_attention.h"

namespace pyscore {

// Cached blocks in front of a key range: plan.cached_blocks[first .. first + count).
struct CachedSpan {
  int32_t first = 0, count = 0;
  bool operator<(const CachedSpan& o) const { return first != o.first ? first < o.first : count < o.count; }
};

struct AttentionSegment {
  int32_t start, length, prefix_start, prefix_length;
  CachedSpan cached;
  int32_t cached_kind;  // CachedKind (prefix_item_attention.h); meaningless when cached.count == 0
  int32_t end() const { return start + length; }
  CachedSpan cached_before_own() const { return cached_kind == kCachedBeforeOwn ? cached : CachedSpan{}; }
  CachedSpan cached_before_prefix() const { return cached_kind == kCachedBeforePrefix ? cached : CachedSpan{}; }
  // Items see a prefix range: stream tokens, cached blocks, or both.
  bool has_prefix() const { return prefix_length > 0 || cached_before_prefix().count > 0; }
};

struct KeyRange {
  int32_t start, length;  // tokens of the stream, after the cached blocks
  CachedSpan cached;      // cached blocks first
  int64_t offset;         // elements from the start of one kv head's packed area
};

// Consecutive segments sharing one prefix (an MIS group's items), or one segment without prefix.
struct AttentionGroup {
  int32_t first_segment, num_segments;
  int32_t prefix_range;  // index into ranges, -1 without prefix
  int32_t token_begin, token_end;
};

struct AttentionUnit {
  int32_t group, kv_head, token_begin, token_end;
  double cost;
};

// 64-byte aligned bytes, uninitialized (every user writes before it reads).
struct AlignedBuffer {
  std::unique_ptr<char[]> storage;
  char* data = nullptr;
  size_t bytes = 0;
  void allocate(size_t n);
};

// One kernel thread's buffers for a unit: stacked q rows, the two partial states, the causal limits. Carved
// from one arena of whole cache lines per thread, so two threads never write to the same line.
struct AttentionScratch {
  AlignedBuffer arena;
  char* q = nullptr;
  float *o_a = nullptr, *o_b = nullptr, *lse_a = nullptr, *lse_b = nullptr;
  int32_t* limits = nullptr;
};

struct AttentionCpuPlan {
  AttentionPlanParams shape;  // what the plan was made for (its segments pointer is not kept)
  std::vector<AttentionSegment> segments;  // non-empty segments, in table order
  std::vector<int32_t> own_range;          // per segment: its own tokens' key range
  std::vector<KeyRange> ranges;
  std::vector<AttentionGroup> groups;
  std::vector<AttentionUnit> units;        // costliest first
  std::vector<int32_t> cached_blocks;      // copied from the params: block indices into cache_k / cache_v
  int32_t block_tokens = 0;
  int64_t packed_elems_per_head = 0;
  int32_t max_unit_tokens = 0;
  // Workspaces: packed K and V of every range, [Hkv][packed_elems_per_head] each; one scratch per thread.
  AlignedBuffer k_packed, v_packed;
  std::vector<AttentionScratch> scratch;
  std::mutex running;

  size_t workspace_bytes() const;
  int32_t cached_tokens(const CachedSpan& c) const { return c.count * block_tokens; }
  int32_t keys(const KeyRange& r) const { return cached_tokens(r.cached) + r.length; }
};

// Reads and validates the segment table (and the cached-key table, when given) and fills `plan` (a fresh
// object). Returns kInvalidArgument for a table that does not cover the stream exactly once, whose prefix
// overlaps its own segment, or whose cached rows do not fit prefix_item_attention.h's rules.
Status prefix_item_attention_plan_cpu(const AttentionPlanParams& shape, AttentionCpuPlan* plan);

// One layer's attention with a plan: p's sizes and dtype must be the plan's (its segments pointer is unused).
Status prefix_item_attention_run_cpu(AttentionCpuPlan& plan, const PrefixItemAttentionParams& p);

}  // namespace pyscore
