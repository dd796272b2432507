// Kernels of the CUDA decode_attention (launched by decode_attention_cuda.cu). Kept in a header, free of inline PTX
// and host code, so tests/emu can run them on the host.
//
// Grid (chunk, kv head x row slice, sequence), 4 warps per CTA. A CTA takes up to kSliceRows query heads of one kv
// head (GQA rows share every key load) and one chunk of kDecodeChunk keys of one sequence; CTAs past the sequence's
// own chunk count exit, so the split depends on that sequence's length alone. Warps take keys round-robin; each
// lane holds D / 32 consecutive dims of q, K, V and the output, a key's score is a warp sum, and the online softmax
// runs per key in base 2 with fp32 state in registers. The 4 warp states are merged by log-sum-exp in shared memory.
// A sequence with one chunk is written straight to the output; otherwise the chunk states go to a scratch and
// merge_chunks_kernel folds them in chunk order (the double-precision weights of merge_weights.cuh).
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "common/cuda_utils.cuh"
#include "common/merge_weights.cuh"
#include "decode_attention/decode_attention.h"

namespace pyscore {
namespace decode_cuda {

constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;
constexpr int kSliceRows = 8;  // query heads per CTA; larger GQA groups take several CTAs
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

__host__ __device__ inline int row_slices(int group) { return ceil_div(group, kSliceRows); }

template <typename T>
__device__ __forceinline__ const T* cache_row(const DecodeAttentionParams& p, const void* pool, int b, int h,
                                             int token) {
  // Through the sequence's block table into the shared page pool (decode_attention.h).
  const int64_t page = p.block_table[b * p.block_table_stride + token / p.block_tokens];
  return static_cast<const T*>(pool) + page * p.block_stride + p.layer * p.layer_stride + h * p.head_stride +
         int64_t(token % p.block_tokens) * p.token_stride;
}

// Partial attention of one (sequence, kv head, row slice, chunk). o_parts / lse_parts: [B, Hq, max_chunks, D] and
// [B, Hq, max_chunks] fp32, used when the sequence has more than one chunk.
template <typename T, int D>
__global__ void __launch_bounds__(kThreads)
    decode_partial_kernel(DecodeAttentionParams p, int max_chunks, float* __restrict__ o_parts,
                          float* __restrict__ lse_parts) {
  constexpr int E = D / 32;  // dims per lane
  __shared__ float q_s[kSliceRows][D];
  __shared__ float o_s[kWarps][kSliceRows][D];
  __shared__ float m_s[kWarps][kSliceRows], l_s[kWarps][kSliceRows];

  const int b = blockIdx.z, chunk = blockIdx.x;
  const int group = p.num_q_heads / p.num_kv_heads, slices = row_slices(group);
  const int h = blockIdx.y / slices, row0 = (blockIdx.y % slices) * kSliceRows;
  const int rows = min(kSliceRows, group - row0);
  const int length = p.lengths[b], chunks = ceil_div(length, kDecodeChunk);
  if (chunk >= chunks) return;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int key0 = chunk * kDecodeChunk, key1 = min(length, key0 + kDecodeChunk);

  // The new token: every CTA of the last chunk reads it from k_new / v_new (CTAs of other row slices run
  // concurrently), and the first row slice's CTA also writes it into the cache.
  const bool has_new = p.k_new != nullptr;
  const int64_t new_row = b * p.new_seq_stride + h * p.new_head_stride;
  if (has_new && chunk == chunks - 1 && row0 == 0) {
    T* k_dst = const_cast<T*>(cache_row<T>(p, p.k_pool, b, h, length - 1));
    T* v_dst = const_cast<T*>(cache_row<T>(p, p.v_pool, b, h, length - 1));
    for (int d = threadIdx.x; d < D; d += kThreads) {
      k_dst[d] = static_cast<const T*>(p.k_new)[new_row + d];
      v_dst[d] = static_cast<const T*>(p.v_new)[new_row + d];
    }
  }
  // q pre-scaled to base-2 scores.
  const int q_head0 = h * group + row0;
  const T* q_in = static_cast<const T*>(p.q) + b * p.q_seq_stride + q_head0 * p.q_head_stride;
  for (int i = threadIdx.x; i < kSliceRows * D; i += kThreads) {
    const int r = i / D, d = i % D;
    q_s[r][d] = r < rows ? to_float(q_in[r * p.q_head_stride + d]) * (p.scale * kLog2e) : 0.f;
  }
  __syncthreads();

  float q[kSliceRows][E], o[kSliceRows][E], m[kSliceRows], l[kSliceRows];
#pragma unroll
  for (int r = 0; r < kSliceRows; ++r) {
    m[r] = -INFINITY;
    l[r] = 0.f;
#pragma unroll
    for (int e = 0; e < E; ++e) {
      q[r][e] = q_s[r][lane * E + e];
      o[r][e] = 0.f;
    }
  }
  for (int t = key0 + warp; t < key1; t += kWarps) {
    const bool fresh = has_new && t == length - 1;
    const T* k = (fresh ? static_cast<const T*>(p.k_new) + new_row : cache_row<T>(p, p.k_pool, b, h, t)) + lane * E;
    const T* v = (fresh ? static_cast<const T*>(p.v_new) + new_row : cache_row<T>(p, p.v_pool, b, h, t)) + lane * E;
    float kf[E], vf[E];
#pragma unroll
    for (int e = 0; e < E; ++e) {
      kf[e] = to_float(k[e]);
      vf[e] = to_float(v[e]);
    }
#pragma unroll
    for (int r = 0; r < kSliceRows; ++r) {
      if (r >= rows) break;
      float dot = 0.f;
#pragma unroll
      for (int e = 0; e < E; ++e) dot = fmaf(q[r][e], kf[e], dot);
      const float s = warp_sum(dot);  // base-2 score
      const float m_new = fmaxf(m[r], s);
      const float alpha = exp2f(m[r] - m_new), pr = exp2f(s - m_new);  // alpha = 0 on a warp's first key
      l[r] = l[r] * alpha + pr;
#pragma unroll
      for (int e = 0; e < E; ++e) o[r][e] = fmaf(pr, vf[e], o[r][e] * alpha);
      m[r] = m_new;
    }
  }
#pragma unroll
  for (int r = 0; r < kSliceRows; ++r) {
#pragma unroll
    for (int e = 0; e < E; ++e) o_s[warp][r][lane * E + e] = o[r][e];
    if (lane == 0) {
      m_s[warp][r] = m[r];
      l_s[warp][r] = l[r];
    }
  }
  __syncthreads();

  // Merge the warps (a warp that saw no key has m = -inf and weight 0; the chunk has at least one key).
  for (int i = threadIdx.x; i < rows * D; i += kThreads) {
    const int r = i / D, d = i % D;
    float mx = -INFINITY;
    for (int w = 0; w < kWarps; ++w) mx = fmaxf(mx, m_s[w][r]);
    float sum = 0.f, acc = 0.f;
    for (int w = 0; w < kWarps; ++w) {
      const float weight = m_s[w][r] == -INFINITY ? 0.f : exp2f(m_s[w][r] - mx);
      sum += l_s[w][r] * weight;
      acc += o_s[w][r][d] * weight;
    }
    const int hq = q_head0 + r;
    if (chunks == 1) {
      static_cast<T*>(p.o)[b * p.o_seq_stride + hq * p.o_head_stride + d] = from_float<T>(acc / sum);
    } else {
      const int64_t part = (int64_t(b) * p.num_q_heads + hq) * max_chunks + chunk;
      o_parts[part * D + d] = acc / sum;
      if (d == 0) lse_parts[part] = (mx + log2f(sum)) * kLn2;
    }
  }
}

// One warp per (sequence, query head) of a sequence with several chunks: folds chunk states 1.. into chunk 0's in
// order, then writes the output.
constexpr int kMergeChunkWarps = 4;

template <typename T, int D>
__global__ void __launch_bounds__(kMergeChunkWarps * 32)
    merge_chunks_kernel(DecodeAttentionParams p, int max_chunks, const float* __restrict__ o_parts,
                        const float* __restrict__ lse_parts) {
  const int64_t pair = int64_t(blockIdx.x) * kMergeChunkWarps + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (pair >= int64_t(p.num_seqs) * p.num_q_heads) return;
  const int b = int(pair / p.num_q_heads), hq = int(pair % p.num_q_heads);
  const int chunks = ceil_div(p.lengths[b], kDecodeChunk);
  if (chunks == 1) return;  // written by the partial kernel
  const int64_t part0 = pair * max_chunks;
  float acc[D / 32];
#pragma unroll
  for (int e = 0; e < D / 32; ++e) acc[e] = o_parts[part0 * D + lane + 32 * e];
  float lse = lse_parts[part0];
  for (int c = 1; c < chunks; ++c) {
    const MergeWeights w = merge_weights(lse, lse_parts[part0 + c]);
#pragma unroll
    for (int e = 0; e < D / 32; ++e) acc[e] = fmaf(w.a, acc[e], w.b * o_parts[(part0 + c) * D + lane + 32 * e]);
    lse = w.lse;
  }
#pragma unroll
  for (int e = 0; e < D / 32; ++e)
    static_cast<T*>(p.o)[b * p.o_seq_stride + hq * p.o_head_stride + lane + 32 * e] = from_float<T>(acc[e]);
}

}  // namespace decode_cuda
}  // namespace pyscore
