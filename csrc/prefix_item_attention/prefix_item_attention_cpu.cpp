// CPU prefix_item_attention (contract in prefix_item_attention.h): the Hydragen / FlashInfer cascade on a packed stream.
//
// Plan (once per batch, plan_cpu.h): consecutive segments sharing one prefix form a group; the key ranges (each
// segment's own tokens, each group's prefix) and the work units (group, kv head, block of the group's tokens)
// are listed and the workspaces allocated. Run (once per layer): every key range is packed per kv head, then
// each unit's rows (its tokens x the Hq/Hkv query heads of that kv head, stacked) go through:
//   1. rows x own segment keys, causal             -> (o_b, lse_b)
//   2. rows x the group's prefix keys, dense        -> (o_a, lse_a)   (items only; the prefix is read once
//                                                                      per row block, not once per item)
//   3. merge_state(a, b) by log-sum-exp, store in the output dtype.
// Prefix segments and SIS sequences are groups without a prefix: step 1 alone. Units run on OpenMP threads,
// costliest first. The arithmetic lives in AttentionCpuOps: AVX-512 (+BF16) or AVX2 + FMA by the CPU tier, else a
// portable scalar version of the same packed layouts.
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <map>
#include <tuple>
#include <mutex>
#include <utility>
#include <vector>

#include "common/bf16.h"
#include "common/cpu_features.h"
#include "common/merge_state_cpu.h"
#include "common/threads.h"
#include "common/vec_portable.h"
#include "prefix_item_attention/plan_cpu.h"
#include "prefix_item_attention/prefix_item_attention.h"

namespace pyscore {

namespace {

// ---- portable ops (any x86-64 or other CPU; same packed layouts as the AVX-512 ops) ----------------------

inline int64_t k_offset(int32_t key, int32_t d, int32_t head_dim, int pack) {
  return int64_t(key / kKeyBlock) * kKeyBlock * head_dim +
         (int64_t(d / pack) * kKeyBlock + key % kKeyBlock) * pack + d % pack;
}
inline int64_t v_offset(int32_t key, int32_t d, int32_t head_dim, int pack) {
  return int64_t(key / kKeyBlock) * kKeyBlock * head_dim +
         (int64_t((key % kKeyBlock) / pack) * head_dim + d) * pack + key % pack;
}

template <class T>
constexpr int pack_of() { return sizeof(T) == 2 ? 2 : 1; }

// Scatters keys [0, n) of one kv head into a packed layout given by its element offset function.
template <class T, int64_t (*offset)(int32_t, int32_t, int32_t, int)>
void pack_portable(const void* src_, int64_t token_stride, int32_t n, int32_t head_dim, void* out_) {
  const T* src = static_cast<const T*>(src_);
  T* out = static_cast<T*>(out_);
  std::fill(out, out + packed_kv_elems(n, head_dim), T(0));
  for (int32_t j = 0; j < n; ++j)
    for (int32_t d = 0; d < head_dim; ++d) out[offset(j, d, head_dim, pack_of<T>())] = src[j * token_stride + d];
}

// Scores of one query row against the first `tiles` key tiles, written to s [tiles * kKeyBlock] (padding keys
// score 0). The packed K puts a tile's keys side by side for each head element (pair), so the inner loop runs over
// 64 contiguous keys and vectorizes (NEON, SSE2): an outer product, one element of q at a time.
template <class T>
void tile_scores(const T* q, const T* kp, int32_t tiles, int32_t head_dim, float* s) {
  constexpr int P = pack_of<T>();
  for (int32_t b = 0; b < tiles; ++b, s += kKeyBlock) {
    const T* kb = kp + int64_t(b) * kKeyBlock * head_dim;
    std::fill(s, s + kKeyBlock, 0.0f);
    for (int32_t d = 0; d < head_dim; d += P) {
      const T* kd = kb + int64_t(d) * kKeyBlock;  // [kKeyBlock keys][P]
      const float q0 = to_f32(q[d]), q1 = P == 2 ? to_f32(q[d + 1]) : 0.0f;
      for (int32_t j = 0; j < kKeyBlock; ++j)
        s[j] += P == 2 ? q0 * to_f32(kd[2 * j]) + q1 * to_f32(kd[2 * j + 1]) : q0 * to_f32(kd[j]);
    }
  }
}

// o [head_dim] = sum over keys j < limit of p[j] * v_j, v from the packed V ([kKeyBlock / P keys][D][P] per tile:
// a key's (pair's) values are contiguous along head_dim, so the inner loop vectorizes). For bf16 the keys go in
// pairs: p[limit] must be 0 when limit is odd.
template <class T>
void weighted_values(const float* p, int32_t limit, const T* vp, int32_t head_dim, float* o) {
  constexpr int P = pack_of<T>();
  std::fill(o, o + head_dim, 0.0f);
  for (int32_t j = 0; j < limit; j += P) {
    const T* v = vp + int64_t(j / kKeyBlock) * kKeyBlock * head_dim + int64_t((j % kKeyBlock) / P) * head_dim * P;
    const float p0 = p[j], p1 = P == 2 ? p[j + 1] : 0.0f;
    for (int32_t d = 0; d < head_dim; ++d)
      o[d] += P == 2 ? p0 * to_f32(v[2 * d]) + p1 * to_f32(v[2 * d + 1]) : p0 * to_f32(v[d]);
  }
}

// Exact two-pass softmax per row (fp32 probabilities in both dtypes), each pass a vectorizable loop
// (common/vec_portable.h): the `generic` tier's code and the `neon` tier's.
template <class T>
void attend_portable(const void* q_, int32_t rows, const int32_t* limits, const void* k_packed,
                     const void* v_packed, int32_t num_keys, int32_t head_dim, float scale, float* o, float* lse) {
  const T* q = static_cast<const T*>(q_);
  const T* kp = static_cast<const T*>(k_packed);
  const T* vp = static_cast<const T*>(v_packed);
  thread_local std::vector<float> scores;
  scores.resize(std::max<int64_t>(int64_t(key_blocks(num_keys)) * kKeyBlock, 1));
  for (int32_t r = 0; r < rows; ++r) {
    float* orow = o + int64_t(r) * head_dim;
    const int32_t limit = limits ? std::min(limits[r], num_keys) : num_keys;
    if (limit <= 0) {
      std::fill(orow, orow + head_dim, 0.0f);
      lse[r] = -std::numeric_limits<float>::infinity();
      continue;
    }
    float* s = scores.data();
    tile_scores(q + int64_t(r) * head_dim, kp, key_blocks(limit), head_dim, s);
    for (int32_t j = 0; j < limit; ++j) s[j] *= scale;
    const float mx = max_portable(s, limit, -std::numeric_limits<float>::infinity());
    const float sum = exp_sum_inplace(s, limit, mx);
    if (limit % 2) s[limit] = 0.0f;  // bf16 reads keys in pairs (limit < the padded tile end when odd)
    weighted_values(s, limit, vp, head_dim, orow);
    for (int32_t d = 0; d < head_dim; ++d) orow[d] /= sum;
    lse[r] = mx + std::log(sum);
  }
}

void store_row_f32(const float* src, int32_t dim, void* dst) { std::memcpy(dst, src, dim * sizeof(float)); }
void store_row_bf16(const float* src, int32_t dim, void* dst_) {
  auto* dst = static_cast<uint16_t*>(dst_);
  for (int32_t d = 0; d < dim; ++d) dst[d] = bf16_from_f32(src[d]);
}

const AttentionCpuOps kPortableBf16{pack_portable<uint16_t, k_offset>, pack_portable<uint16_t, v_offset>,
                                    attend_portable<uint16_t>, store_row_bf16};
const AttentionCpuOps kPortableF32{pack_portable<float, k_offset>, pack_portable<float, v_offset>,
                                   attend_portable<float>, store_row_f32};

// ---- plan ------------------------------------------------------------------------------------------------

// Tokens per work unit: small enough that 2+ threads get several units each, large enough that a unit's
// stacked rows fill many 6-row tiles against the same packed keys.
constexpr int32_t kItemUnitTokens = 32;
constexpr int32_t kCausalUnitTokens = 64;

Status check_shape(const AttentionPlanParams& s) {
  if (s.dtype != DType::kFloat32 && s.dtype != DType::kBFloat16) return kUnsupportedDType;
  if (s.head_dim <= 0 || (s.dtype == DType::kBFloat16 && s.head_dim % 2)) return kUnsupportedHeadDim;
  if (s.num_tokens < 0 || s.num_segments < 0 || s.num_q_heads <= 0 || s.num_kv_heads <= 0 ||
      s.num_q_heads % s.num_kv_heads)
    return kInvalidArgument;
  if (s.num_segments > 0 && !s.segments) return kInvalidArgument;
  return kOk;
}

// The cached-key columns of segment row i (prefix_item_attention.h): checked against the block list and the kind's rules.
Status read_cached(const AttentionPlanParams& s, int32_t i, AttentionSegment* seg) {
  seg->cached = {};
  seg->cached_kind = kCachedBeforeOwn;
  if (!s.cached) return kOk;
  const int32_t* row = s.cached + 3 * int64_t(i);
  const int32_t first = row[0], count = row[1], kind = row[2];
  if (first < 0 || count < 0 || int64_t(first) + count > s.num_cached_blocks) return kInvalidArgument;
  if (kind != kCachedBeforeOwn && kind != kCachedBeforePrefix) return kInvalidArgument;
  // Cached keys continue a causal sequence or lead a prefix; a segment with a stream prefix cannot have them
  // before its own tokens (they would sit between the prefix and the segment).
  if (count > 0 && kind == kCachedBeforeOwn && seg->prefix_length > 0) return kInvalidArgument;
  seg->cached = {first, count};
  seg->cached_kind = kind;
  return kOk;
}

Status read_segments(const AttentionPlanParams& s, std::vector<AttentionSegment>* out) {
  int64_t covered = 0;
  for (int32_t i = 0; i < s.num_segments; ++i) {
    const int32_t* row = s.segments + 4 * int64_t(i);
    AttentionSegment seg{row[0], row[1], row[2], row[3], {}, kCachedBeforeOwn};
    if (seg.start < 0 || seg.length < 0 || seg.prefix_start < 0 || seg.prefix_length < 0 ||
        int64_t(seg.start) + seg.length > s.num_tokens ||
        int64_t(seg.prefix_start) + seg.prefix_length > s.num_tokens)
      return kInvalidArgument;
    // A prefix overlapping its own segment would count those keys twice.
    if (seg.prefix_length > 0 && seg.prefix_start < seg.end() && seg.start < seg.prefix_start + seg.prefix_length)
      return kInvalidArgument;
    if (seg.prefix_length == 0) seg.prefix_start = 0;  // an empty stream prefix is the same wherever it "starts"
    const Status status = read_cached(s, i, &seg);
    if (status != kOk) return status;
    if (seg.length > 0) out->push_back(seg);
    covered += seg.length;
  }
  // Every output row must be written by exactly one segment.
  return covered == s.num_tokens ? kOk : kInvalidArgument;
}

using RangeKey = std::tuple<int32_t, int32_t, int32_t, int32_t>;

int32_t add_range(AttentionCpuPlan& plan, std::map<RangeKey, int32_t>& index, int32_t start, int32_t length,
                  CachedSpan cached) {
  auto [it, inserted] =
      index.emplace(RangeKey{start, length, cached.first, cached.count}, int32_t(plan.ranges.size()));
  if (inserted) {
    plan.ranges.push_back({start, length, cached, plan.packed_elems_per_head});
    plan.packed_elems_per_head += packed_kv_elems(plan.cached_tokens(cached) + length, plan.shape.head_dim);
  }
  return it->second;
}

bool same_group(const AttentionSegment& prev, const AttentionSegment& next) {
  const CachedSpan a = prev.cached_before_prefix(), b = next.cached_before_prefix();
  return prev.has_prefix() && next.prefix_start == prev.prefix_start && next.prefix_length == prev.prefix_length &&
         a.first == b.first && a.count == b.count && next.start == prev.end();
}

void add_units(AttentionCpuPlan& plan, int32_t group_index) {
  const AttentionGroup& g = plan.groups[group_index];
  const int32_t tokens = g.token_end - g.token_begin;
  const bool items = g.prefix_range >= 0;
  const int32_t target = items ? kItemUnitTokens : kCausalUnitTokens;
  const int32_t count = (tokens + target - 1) / target;
  const int32_t prefix = items ? plan.keys(plan.ranges[g.prefix_range]) : 0;
  // A causal group is one segment: its cached keys are visited by every row.
  const int32_t cached = items ? 0 : plan.cached_tokens(plan.segments[g.first_segment].cached_before_own());
  for (int32_t c = 0; c < count; ++c) {
    // Even split, so no unit is a small leftover.
    const int32_t t0 = g.token_begin + int64_t(tokens) * c / count;
    const int32_t t1 = g.token_begin + int64_t(tokens) * (c + 1) / count;
    // Keys visited per row: the prefix plus, causally, about the row's offset in its segment.
    const double causal = items ? 0.5 * kItemUnitTokens : cached + 0.5 * (t0 + t1) - g.token_begin;
    const double cost = double(t1 - t0) * (prefix + causal + kKeyBlock);
    for (int32_t h = 0; h < plan.shape.num_kv_heads; ++h) plan.units.push_back({group_index, h, t0, t1, cost});
    plan.max_unit_tokens = std::max(plan.max_unit_tokens, t1 - t0);
  }
}

void list_work(AttentionCpuPlan& plan) {
  std::map<RangeKey, int32_t> index;
  const auto& segs = plan.segments;
  for (const AttentionSegment& s : segs)
    plan.own_range.push_back(add_range(plan, index, s.start, s.length, s.cached_before_own()));
  for (int32_t i = 0; i < int32_t(segs.size());) {
    int32_t j = i + 1;
    while (j < int32_t(segs.size()) && same_group(segs[j - 1], segs[j])) ++j;
    const int32_t prefix = segs[i].has_prefix() ? add_range(plan, index, segs[i].prefix_start, segs[i].prefix_length,
                                                            segs[i].cached_before_prefix())
                                                : -1;
    plan.groups.push_back({i, j - i, prefix, segs[i].start, segs[j - 1].end()});
    add_units(plan, int32_t(plan.groups.size()) - 1);
    i = j;
  }
  std::stable_sort(plan.units.begin(), plan.units.end(),
                   [](const AttentionUnit& a, const AttentionUnit& b) { return a.cost > b.cost; });
}

// ---- workspaces ------------------------------------------------------------------------------------------

size_t elem_size(DType dtype) { return dtype == DType::kBFloat16 ? 2 : 4; }

constexpr size_t kLine = 64;
size_t whole_lines(size_t bytes) { return (bytes + kLine - 1) / kLine * kLine; }

void allocate_workspaces(AttentionCpuPlan& plan) {
  const AttentionPlanParams& s = plan.shape;
  const size_t elem = elem_size(s.dtype);
  const size_t packed_bytes = size_t(plan.packed_elems_per_head) * s.num_kv_heads * elem;
  plan.k_packed.allocate(packed_bytes);
  plan.v_packed.allocate(packed_bytes);
  const size_t rows = size_t(plan.max_unit_tokens) * (s.num_q_heads / s.num_kv_heads);
  const size_t q_bytes = whole_lines(rows * s.head_dim * elem), o_bytes = whole_lines(rows * s.head_dim * 4);
  const size_t row_bytes = whole_lines(rows * 4);
  plan.scratch.resize(std::max(1, kernel_threads()));
  for (AttentionScratch& t : plan.scratch) {
    t.arena.allocate(q_bytes + 2 * o_bytes + 3 * row_bytes);
    char* p = t.arena.data;
    t.q = p;
    t.o_a = reinterpret_cast<float*>(p += q_bytes);
    t.o_b = reinterpret_cast<float*>(p += o_bytes);
    t.lse_a = reinterpret_cast<float*>(p += o_bytes);
    t.lse_b = reinterpret_cast<float*>(p += row_bytes);
    t.limits = reinterpret_cast<int32_t*>(p += row_bytes);
  }
}

// ---- execution -------------------------------------------------------------------------------------------

char* packed_k(const AttentionCpuPlan& plan, const KeyRange& r, int32_t h) {
  return plan.k_packed.data + (h * plan.packed_elems_per_head + r.offset) * elem_size(plan.shape.dtype);
}
char* packed_v(const AttentionCpuPlan& plan, const KeyRange& r, int32_t h) {
  return plan.v_packed.data + (h * plan.packed_elems_per_head + r.offset) * elem_size(plan.shape.dtype);
}

// Packs one kv head of a key range: its cached blocks (whole key tiles each) first, then its stream tokens.
// Blocks smaller than a packed key block (the KV store's 16-token CPU pages) do not fill whole packed blocks: the
// range's keys (cached blocks, then its stream tokens) are gathered into one contiguous [keys, D] run per kv head and
// packed in one call, which lays them out exactly as one stream range of the same keys (so warm = cold bitwise).
void pack_range_gathered(const PrefixItemAttentionParams& p, const AttentionCpuOps& ops, const AttentionCpuPlan& plan,
                         const KeyRange& r, int32_t h) {
  const size_t elem = elem_size(p.dtype), row_bytes = size_t(p.head_dim) * elem;
  const int32_t cached = plan.cached_tokens(r.cached), keys = cached + r.length;
  thread_local std::vector<char> run;
  run.resize(size_t(keys) * row_bytes);
  const struct {
    const void* cache;
    const void* stream;
    int64_t stream_token_stride, stream_head_stride;
    char* dst;
    decltype(ops.pack_k) pack;
  } sides[2] = {{p.cache_k, p.k, p.k_token_stride, p.k_head_stride, packed_k(plan, r, h), ops.pack_k},
                {p.cache_v, p.v, p.v_token_stride, p.v_head_stride, packed_v(plan, r, h), ops.pack_v}};
  for (const auto& side : sides) {
    char* out = run.data();
    for (int32_t b = 0; b < r.cached.count; ++b) {
      const int64_t at = plan.cached_blocks[r.cached.first + b] * p.cache_block_stride + h * p.cache_head_stride;
      for (int32_t j = 0; j < plan.block_tokens; ++j, out += row_bytes)
        std::memcpy(out, static_cast<const char*>(side.cache) + (at + j * p.cache_token_stride) * elem, row_bytes);
    }
    for (int32_t j = 0; j < r.length; ++j, out += row_bytes)
      std::memcpy(out, static_cast<const char*>(side.stream) +
                           ((r.start + j) * side.stream_token_stride + h * side.stream_head_stride) * elem,
                  row_bytes);
    side.pack(run.data(), p.head_dim, keys, p.head_dim, side.dst);
  }
}

void pack_range(const PrefixItemAttentionParams& p, const AttentionCpuOps& ops, const AttentionCpuPlan& plan,
                const KeyRange& r, int32_t h) {
  if (r.cached.count > 0 && plan.block_tokens % kKeyBlock) return pack_range_gathered(p, ops, plan, r, h);
  const size_t elem = elem_size(p.dtype);
  char* dst_k = packed_k(plan, r, h);
  char* dst_v = packed_v(plan, r, h);
  const size_t block_bytes = packed_kv_elems(plan.block_tokens, p.head_dim) * elem;
  for (int32_t b = 0; b < r.cached.count; ++b) {
    const int64_t at = plan.cached_blocks[r.cached.first + b] * p.cache_block_stride + h * p.cache_head_stride;
    ops.pack_k(static_cast<const char*>(p.cache_k) + at * elem, p.cache_token_stride, plan.block_tokens, p.head_dim,
               dst_k);
    ops.pack_v(static_cast<const char*>(p.cache_v) + at * elem, p.cache_token_stride, plan.block_tokens, p.head_dim,
               dst_v);
    dst_k += block_bytes;
    dst_v += block_bytes;
  }
  if (r.length == 0) return;
  const char* k = static_cast<const char*>(p.k) + (r.start * p.k_token_stride + h * p.k_head_stride) * elem;
  const char* v = static_cast<const char*>(p.v) + (r.start * p.v_token_stride + h * p.v_head_stride) * elem;
  ops.pack_k(k, p.k_token_stride, r.length, p.head_dim, dst_k);
  ops.pack_v(v, p.v_token_stride, r.length, p.head_dim, dst_v);
}

// Row (t - token_begin) * ratio + j of the unit holds query head kv_head * ratio + j of token t.
void gather_q(const PrefixItemAttentionParams& p, const AttentionUnit& u, int32_t ratio, char* dst) {
  const size_t elem = elem_size(p.dtype);
  const size_t row_bytes = size_t(p.head_dim) * elem;
  for (int32_t t = u.token_begin; t < u.token_end; ++t)
    for (int32_t j = 0; j < ratio; ++j) {
      const int64_t head = int64_t(u.kv_head) * ratio + j;
      std::memcpy(dst, static_cast<const char*>(p.q) + (t * p.q_token_stride + head * p.q_head_stride) * elem,
                  row_bytes);
      dst += row_bytes;
    }
}

void store_rows(const PrefixItemAttentionParams& p, const AttentionCpuOps& ops, const AttentionUnit& u,
                int32_t ratio, const float* src) {
  const size_t elem = elem_size(p.dtype);
  for (int32_t t = u.token_begin; t < u.token_end; ++t)
    for (int32_t j = 0; j < ratio; ++j) {
      const int64_t head = int64_t(u.kv_head) * ratio + j;
      ops.store_row(src, p.head_dim, static_cast<char*>(p.o) + (t * p.o_token_stride + head * p.o_head_stride) * elem);
      src += p.head_dim;
    }
}

// Step 1 of the cascade: each segment piece of the unit against its own keys, causally.
void attend_own_keys(const PrefixItemAttentionParams& p, const AttentionCpuOps& ops, const AttentionCpuPlan& plan,
                     const AttentionUnit& u, int32_t ratio, AttentionScratch& s) {
  const AttentionGroup& g = plan.groups[u.group];
  const size_t elem = elem_size(p.dtype);
  for (int32_t i = g.first_segment; i < g.first_segment + g.num_segments; ++i) {
    const AttentionSegment& seg = plan.segments[i];
    const int32_t t0 = std::max(u.token_begin, seg.start), t1 = std::min(u.token_end, seg.end());
    if (t0 >= t1) continue;
    const int32_t row0 = (t0 - u.token_begin) * ratio, rows = (t1 - t0) * ratio;
    const KeyRange& range = plan.ranges[plan.own_range[i]];
    // Own keys: the segment's cached blocks (all visible), then its tokens up to the row's own.
    const int32_t first_limit = plan.cached_tokens(range.cached) + t0 - seg.start + 1;
    for (int32_t r = 0; r < rows; ++r) s.limits[row0 + r] = first_limit + r / ratio;
    ops.attend(s.q + size_t(row0) * p.head_dim * elem, rows, s.limits + row0, packed_k(plan, range, u.kv_head),
               packed_v(plan, range, u.kv_head), plan.keys(range), p.head_dim, p.scale,
               s.o_b + size_t(row0) * p.head_dim, s.lse_b + row0);
  }
}

void run_unit(const PrefixItemAttentionParams& p, const AttentionCpuOps& ops, const AttentionCpuPlan& plan,
              const AttentionUnit& u, AttentionScratch& s) {
  const int32_t ratio = p.num_q_heads / p.num_kv_heads;
  const int32_t rows = (u.token_end - u.token_begin) * ratio;
  const AttentionGroup& g = plan.groups[u.group];
  gather_q(p, u, ratio, s.q);
  attend_own_keys(p, ops, plan, u, ratio, s);
  if (g.prefix_range < 0) {
    store_rows(p, ops, u, ratio, s.o_b);
    return;
  }
  // Steps 2 and 3: all rows of the unit (every item in it, every query head of this kv head) as one dense
  // block against the shared prefix, then the log-sum-exp merge with the causal part.
  const KeyRange& prefix = plan.ranges[g.prefix_range];
  ops.attend(s.q, rows, nullptr, packed_k(plan, prefix, u.kv_head), packed_v(plan, prefix, u.kv_head),
             plan.keys(prefix), p.head_dim, p.scale, s.o_a, s.lse_a);
  merge_state(s.o_a, s.lse_a, s.o_b, s.lse_b, rows, p.head_dim, s.o_a, nullptr);
  store_rows(p, ops, u, ratio, s.o_a);
}

// The run's tensors must match the shape the plan was made for.
Status check_run(const AttentionCpuPlan& plan, const PrefixItemAttentionParams& p) {
  const AttentionPlanParams& s = plan.shape;
  if (p.dtype != s.dtype || p.num_tokens != s.num_tokens || p.num_q_heads != s.num_q_heads ||
      p.num_kv_heads != s.num_kv_heads || p.head_dim != s.head_dim)
    return kInvalidArgument;
  if (p.num_tokens > 0 && (!p.q || !p.k || !p.v || !p.o)) return kInvalidArgument;
  if (!plan.cached_blocks.empty() && (!p.cache_k || !p.cache_v)) return kInvalidArgument;
  return kOk;
}

// The running tier's layer (common/dispatch.h); the AVX-512 ops are 1.6-2.1x the AVX2 ops at tier avx512
// (bench/results/tiers/kernels/attention_avx512_fp32_ab.txt, kernels_avx512_bf16_ab.txt).
const AttentionCpuOps& choose_ops(DType dtype, int32_t head_dim) {
  KernelKey key;
  key.dtype = dtype, key.head_dim = head_dim;
  if (const AttentionCpuOps* fast = select_kernel<attention_ops_kernels>(key)) return *fast;
  return dtype == DType::kBFloat16 ? kPortableBf16 : kPortableF32;
}

}  // namespace

void AlignedBuffer::allocate(size_t n) {
  storage.reset(new char[n + kLine]);
  data = reinterpret_cast<char*>((reinterpret_cast<uintptr_t>(storage.get()) + kLine - 1) & ~uintptr_t(kLine - 1));
  bytes = n;
}

size_t AttentionCpuPlan::workspace_bytes() const {
  size_t bytes = k_packed.bytes + v_packed.bytes;
  for (const AttentionScratch& t : scratch) bytes += t.arena.bytes;
  return bytes;
}

Status prefix_item_attention_plan_cpu(const AttentionPlanParams& shape, AttentionCpuPlan* plan) {
  Status status = check_shape(shape);
  if (status != kOk) return status;
  plan->shape = shape;
  plan->shape.segments = nullptr;  // the tables are read now; the caller's buffers may go away
  plan->shape.cached = plan->shape.cached_blocks = nullptr;
  if (shape.cached) {
    if (shape.num_cached_blocks < 0 || (shape.num_cached_blocks > 0 && !shape.cached_blocks) ||
        shape.block_tokens <= 0 || shape.block_tokens % kCpuCachedBlockMultiple)
      return kInvalidArgument;
    plan->cached_blocks.assign(shape.cached_blocks, shape.cached_blocks + shape.num_cached_blocks);
    for (int32_t b : plan->cached_blocks)
      if (b < 0) return kInvalidArgument;
    plan->block_tokens = shape.block_tokens;
  }
  status = read_segments(shape, &plan->segments);
  if (status != kOk) return status;
  list_work(*plan);
  allocate_workspaces(*plan);
  return kOk;
}

Status prefix_item_attention_run_cpu(AttentionCpuPlan& plan, const PrefixItemAttentionParams& p) {
  Status status = check_run(plan, p);
  if (status != kOk || p.num_tokens == 0) return status;
  std::lock_guard<std::mutex> one_run_at_a_time(plan.running);
  const AttentionCpuOps& ops = choose_ops(p.dtype, p.head_dim);
  const int32_t num_ranges = int32_t(plan.ranges.size());
  const int32_t num_units = int32_t(plan.units.size());

#pragma omp parallel num_threads(int(plan.scratch.size()))
  {
    AttentionScratch& scratch = plan.scratch[omp_get_thread_num()];
#pragma omp for schedule(dynamic, 1)
    for (int32_t i = 0; i < num_ranges * p.num_kv_heads; ++i)
      pack_range(p, ops, plan, plan.ranges[i / p.num_kv_heads], i % p.num_kv_heads);
    // (implicit barrier: every range is packed before any unit reads it)
#pragma omp for schedule(dynamic, 1)
    for (int32_t i = 0; i < num_units; ++i) run_unit(p, ops, plan, plan.units[i], scratch);
  }
  return kOk;
}

}  // namespace pyscore
