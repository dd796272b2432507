// decode_attention: one new query token per running sequence against that sequence's KV cache, all sequences in one
// call (ragged lengths, GQA: query head h reads kv head h / (num_q_heads / num_kv_heads)).
//
// The keys and values live in one paged pool (pyscore.model.kv_store.KVStore), shared by every sequence and the
// prefix cache: a page holds block_tokens tokens of every layer. Sequence b's keys are listed by its block table
// (block_table[b * block_table_stride + i] = the page of its keys [i * block_tokens, (i + 1) * block_tokens)), the
// convention of prefix_item_attention's cached_blocks; pages a prefix shares are read in place, never copied. Key t of
// kv head h in layer `layer` sits at
//   k_pool + block_table[b][t / block_tokens] * block_stride + layer * layer_stride + (t % block_tokens) * token_stride
//          + h * head_stride
// (values likewise from v_pool, with the same strides). For the pool [pages, 2 (K, V), L, block_tokens, Hkv, D] that
// is block_stride = 2 L block_tokens Hkv D, layer_stride = block_tokens Hkv D, token_stride = Hkv D, head_stride = D.
// block_tokens is a multiple of the kernel's key tile, so a tile never straddles two pages: kKeyTile (64) for the
// CUDA kernel, kCpuKeyTile (16: the CPU kernels' vector blocks of 16 or 8 keys) on the CPU, where smaller pages
// waste less of a sequence's last page (the KV store's CPU pages are 16 tokens).
//
// Sequence b attends to keys [0, lengths[b]), which include its new token. When k_new / v_new are given ([B, Hkv, D])
// the kernel first writes them into the pages at position lengths[b] - 1 (the caller advances its own length
// only after the step succeeded). Long caches are split into fixed chunks of kDecodeChunk keys, attended in parallel
// and merged by log-sum-exp in chunk order; the split depends only on the sequence's own length, so its result does
// not depend on its batch-mates. Strides in elements.
#pragma once
#include <cstdint>

#include "common/dispatch.h"
#include "common/op_args.h"
#include "common/dtype.h"

namespace pyscore {

constexpr int32_t kDecodeChunk = 256;  // a multiple of kKeyTile
constexpr int32_t kKeyTile = 64;
constexpr int32_t kCpuKeyTile = 16;

struct DecodeAttentionParams {
  const void* q;  // [B, Hq, D]
  int64_t q_seq_stride, q_head_stride;
  void* o;  // [B, Hq, D], q's dtype
  int64_t o_seq_stride, o_head_stride;
  const void* k_new;  // [B, Hkv, D] or nullptr
  const void* v_new;
  int64_t new_seq_stride, new_head_stride;  // shared by k_new and v_new
  const void* k_pool;  // page 0, layer 0 (the caches are written through it when k_new is given)
  const void* v_pool;
  int64_t block_stride, layer_stride, token_stride, head_stride;  // shared by k and v
  int32_t layer;
  const int32_t* block_table;  // [B, block_table_stride] page indices; row b lists ceil(lengths[b] / block_tokens)
  int64_t block_table_stride;
  int32_t block_tokens;  // a multiple of kKeyTile (CUDA) or kCpuKeyTile (CPU)
  const int32_t* lengths;  // [B], each >= 1
  int32_t max_length;      // >= every length (sizes the CUDA grid; the CPU kernel reads the lengths)
  int32_t num_seqs;
  int32_t num_q_heads;
  int32_t num_kv_heads;
  int32_t head_dim;
  float scale;
  DType dtype;
};

// ---- Launchers ---------------------------------------------------------------------------------------------------
// Launchers for decode_attention. They return a Status, never throw.

Status decode_attention_cpu(const DecodeAttentionParams& params);
PYSCORE_BIND(decode_attention, decode_attention_cpu, Ptr, Strides, Ptr, Strides, Ptr, Ptr, Strides, Ptr, Ptr, Strides,
             Strides, int32_t, Ptr, int64_t, int32_t, Ptr, int32_t, int32_t, int32_t, int32_t, int32_t, float,
             DTypeName);
// `stream` is a cudaStream_t passed as void* so this header needs no CUDA include.
Status decode_attention_cuda(const DecodeAttentionParams& params, void* stream);

// ---- The CPU launcher's parts ------------------------------------------------------------------------------------
// Internal interface of the CPU decode_attention kernel: the launcher (decode_attention_cpu.cpp, baseline ISA) plans
// (sequence, kv head, key chunk) units and merges their partial states; the arithmetic comes from one kernel text
// compiled per vector layer (decode_attention_simd.h: avx512, avx2, neon) and a portable build.

struct DecodeCpuOps {
  // `rows` query rows (row r at q + r * q_row_stride) against keys [0, num_keys) in tiles of kCpuKeyTile (key t
  // at k_tiles[t / kCpuKeyTile] + (t % kCpuKeyTile) * token_stride, its value likewise in v_tiles: one tile never
  // straddles two pages): writes the normalized o [rows, D] (fp32) and the natural-log log-sum-exp lse [rows] of
  // the scaled scores. num_keys >= 1.
  void (*attend)(const void* q, int64_t q_row_stride, int32_t rows, const void* const* k_tiles,
                 const void* const* v_tiles, int64_t token_stride, int32_t num_keys, int32_t head_dim, float scale,
                 float* o, float* lse);
  // Writes one fp32 row of `dim` values in the kernel's dtype.
  void (*store_row)(const float* src, int32_t dim, void* dst);
};

// The layers' ops (key.bf16_dot: how the avx512 layer's ops multiply bf16 pairs; kWiden is the one a tier without
// AVX512-BF16 runs); nullptr where the dtype / head_dim is not covered.
PYSCORE_KERNELS(decode_attention, decode_ops, const DecodeCpuOps*);

}  // namespace pyscore
