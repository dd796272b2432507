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
#include <cstddef>
#include <cstdint>
#include <cstring>

#include "common/dispatch.h"
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

// ---- Launchers ---------------------------------------------------------------------------------------------------
// Launchers for prefix_item_attention. They return a Status, never throw. Both devices
// split the work FlashInfer's way: a plan made once per batch from the segment table and the head layout, then
// one run per layer. The CPU plan (its launchers are in plan_cpu.h) owns its workspaces; on CUDA the caller
// allocates one workspace of prefix_item_attention_workspace_bytes_cuda bytes per batch, the plan fills it on
// the device, and every run with that shape reads it.

// `stream` is a cudaStream_t passed as void* so this header needs no CUDA include. shape.segments and every
// pointer are device pointers; the workspace must be 16-byte aligned.
size_t prefix_item_attention_workspace_bytes_cuda(const AttentionPlanParams& shape);
Status prefix_item_attention_plan_cuda(const AttentionPlanParams& shape, void* workspace, size_t workspace_bytes,
                                       void* stream);
Status prefix_item_attention_run_cuda(const PrefixItemAttentionParams& p, const void* workspace,
                                      size_t workspace_bytes, void* stream);

// ---- The CPU launcher's parts ------------------------------------------------------------------------------------
// Internal interface of the CPU prefix_item_attention kernel: the launcher (prefix_item_attention_cpu.cpp,
// baseline ISA) plans the work and calls these ops, which come in AVX2, AVX-512 and NEON builds (one text,
// attention_simd.h, compiled per vector layer by cmake/cpu_kernels.cmake; at tier amx its attend() on AMX tiles,
// prefix_item_attention_amx.cpp) and a portable one, chosen by the CPU tier.
//
// Key ranges are packed once per kv head into blocks of kKeyBlock keys so the micro-kernels read them with
// aligned full-width loads and no masking on the dot-product axis. "Pack" = elements per 4-byte unit (2 for
// bf16, whose dpbf16ps works on pairs; 1 for fp32):
//   K block: [D / pack][kKeyBlock keys][pack]        (pairs along head_dim: one zmm = 16 keys x one pair)
//   V block: [kKeyBlock / pack][D][pack]             (pairs along keys:     one zmm = 16 dims x one pair)
// Padding keys are zero, so masked probabilities (0) never meet garbage values.

constexpr int32_t kKeyBlock = 64;

inline int32_t key_blocks(int32_t num_keys) { return (num_keys + kKeyBlock - 1) / kKeyBlock; }
inline int32_t elem_pack(DType dtype) { return dtype == DType::kBFloat16 ? 2 : 1; }
inline int64_t packed_kv_elems(int32_t num_keys, int32_t head_dim) {
  return int64_t(key_blocks(num_keys)) * kKeyBlock * head_dim;
}

// The fp32 V block is the rows as they are (pack 1), zero rows as padding: the same code for every vector build.
inline void pack_v_f32(const void* v, int64_t token_stride, int32_t n, int32_t head_dim, void* out) {
  auto* dst = static_cast<float*>(out);
  const auto* src = static_cast<const float*>(v);
  const int32_t padded = key_blocks(n) * kKeyBlock;
  for (int32_t j = 0; j < padded; ++j) {
    float* row = dst + int64_t(j) * head_dim;
    if (j < n) std::memcpy(row, src + j * token_stride, head_dim * sizeof(float));
    else std::memset(row, 0, head_dim * sizeof(float));
  }
}

struct AttentionCpuOps {
  // Packs keys [0, n) of one kv head (rows `token_stride` elements apart) into the layouts above.
  void (*pack_k)(const void* k, int64_t token_stride, int32_t n, int32_t head_dim, void* out);
  void (*pack_v)(const void* v, int64_t token_stride, int32_t n, int32_t head_dim, void* out);
  // One partial attention: `rows` query rows (q: [rows, D], contiguous) against a packed key range of
  // `num_keys` keys; row r sees keys [0, limits[r]) (limits == nullptr: all keys; a causal diagonal is
  // limits[r] = its position + 1). Writes the normalized output o [rows, D] (fp32) and the natural-log
  // log-sum-exp of the scaled scores lse [rows] (-inf with o = 0 for a row that sees no key).
  void (*attend)(const void* q, int32_t rows, const int32_t* limits, const void* k_packed, const void* v_packed,
                 int32_t num_keys, int32_t head_dim, float scale, float* o, float* lse);
  // Writes one fp32 row of `dim` values to the output in the kernel's dtype.
  void (*store_row)(const float* src, int32_t dim, void* dst);
};

// The layers' ops: AMX tiles for bf16 (with the AVX-512 ops' packing), AVX-512 (key.bf16_dot: how bf16 pairs are
// multiplied), the AVX2 and NEON text (attention_simd.h). nullptr where the dtype / head_dim is not covered.
PYSCORE_KERNELS(prefix_item_attention, attention_ops, const AttentionCpuOps*);
const AttentionCpuOps* attention_ops_portable(DType dtype);

}  // namespace pyscore
