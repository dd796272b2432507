// CUDA prefix_item_attention (contract in prefix_item_attention.h).
//
// Tensor-core path (bf16 / fp16, 16-byte aligned rows), FlashAttention-2 style with mma.sync m16n8k16:
//  * A CTA owns up to 64 query rows = (tokens of one *run*) x (stacked GQA query heads of one kv head). A run is
//    a maximal chain of consecutive segment rows that sit back to back in the stream and share the same
//    prefix (all items of one MIS group, or neighbouring plain-causal sequences). Stacking the heads and
//    the items means the prefix is streamed once per 64 rows, whatever the item lengths or GQA ratio.
//  * Each CTA walks two key ranges with a single online softmax (which *is* the log-sum-exp merge of the two
//    partial attentions of DESIGN.md): the shared prefix [prefix_start, +prefix_length) with no mask, then
//    the run's own keys [first row's segment start, last row's token] with the per-row mask
//    segment_start(row) <= key <= token(row), i.e. causal inside the row's own segment only. Cached keys (a
//    prefix cache's blocks, prefix_item_attention.h) come first, whole 64-key tiles read from the block pool with no mask; a
//    segment whose cached keys precede its own tokens is a run by itself.
//  * K/V tiles of 64 keys are double-buffered with cp.async into XOR-swizzled shared memory and read with
//    ldmatrix (V transposed); S and O accumulate in fp32 registers; P is rounded to the input dtype for the
//    PV product (as in FlashAttention-2), the row sums use the fp32 P.
//  * The work list (one entry per 64-row tile) is planned on the device from the segment table, once per batch
//    (prefix_item_attention_plan_cuda) into a workspace the caller allocates once; every layer's run reads it.
//    Nothing is copied back to the host: the attention grid is sized by an upper bound and surplus CTAs exit.
//
// Simple path (fp32, inputs whose rows are not 16-byte aligned, and 256-dim heads): one warp per (token, query head),
// scalar fp32 online softmax. Slow, but exact enough to test fp32 against the reference.
#include <climits>

#include "common/cuda_host.h"
#include "prefix_item_attention/prefix_item_attention.h"
#include "prefix_item_attention/prefix_item_attention_kernels.cuh"

namespace pyscore {
namespace {

using namespace attention_cuda;

// ---- host side ----------------------------------------------------------------------------------------------

template <typename T, int D>
Status launch_simple(const PrefixItemAttentionParams& p, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>(p.num_segments), static_cast<unsigned>(p.num_q_heads));
  prefix_item_attention_simple_kernel<T, D><<<grid, kSimpleWarps * 32, 0, stream>>>(p);
  PYSCORE_CUDA_TRY(cudaGetLastError());
  return kOk;
}

// The plan's workspace, carved from one caller-allocated buffer (16-byte aligned): the tile work list, each
// tile's cached blocks, the list's length, the planner's per-segment scratch, and each token's segment start.
struct PlanLayout {
  int4* work;
  int2* work_cached;
  int* num_work;
  int* seg_head;
  int* run_end;
  int* tok_seg_start;
};

TileConfig tile_config_of(const AttentionPlanParams& s) {
  return tile_config(s.num_q_heads, s.num_kv_heads, s.num_tokens, s.num_segments);
}

size_t plan_bytes(const AttentionPlanParams& s) {
  return (sizeof(int4) + sizeof(int2)) * size_t(tile_config_of(s).max_tiles) +
         sizeof(int) * (1 + 2 * size_t(s.num_segments) + size_t(s.num_tokens));
}

PlanLayout plan_layout(const void* workspace, const AttentionPlanParams& s) {
  PlanLayout b;
  b.work = static_cast<int4*>(const_cast<void*>(workspace));
  b.work_cached = reinterpret_cast<int2*>(b.work + tile_config_of(s).max_tiles);
  b.num_work = reinterpret_cast<int*>(b.work_cached + tile_config_of(s).max_tiles);
  b.seg_head = b.num_work + 1;
  b.run_end = b.seg_head + s.num_segments;
  b.tok_seg_start = b.run_end + s.num_segments;
  return b;
}

Status check_shape(const AttentionPlanParams& s) {
  if (s.head_dim != 64 && s.head_dim != 128 && s.head_dim != 256) return kUnsupportedHeadDim;
  if (s.dtype != DType::kBFloat16 && s.dtype != DType::kFloat16 && s.dtype != DType::kFloat32) {
    return kUnsupportedDType;
  }
  if (s.num_tokens < 0 || s.num_segments < 0 || s.num_q_heads <= 0 || s.num_kv_heads <= 0 ||
      s.num_q_heads % s.num_kv_heads != 0 || s.num_q_heads > 65535) {
    return kInvalidArgument;
  }
  // Cached keys: whole key tiles per block, and the tables they need (device pointers, not read here).
  if (s.cached && (s.block_tokens <= 0 || s.block_tokens % kBlockN || s.num_cached_blocks < 0 ||
                   (s.num_cached_blocks > 0 && !s.cached_blocks))) {
    return kInvalidArgument;
  }
  const TileConfig cfg = tile_config_of(s);
  if (cfg.max_tiles > INT_MAX) return kInvalidArgument;
  if (static_cast<int64_t>(s.num_kv_heads) * cfg.head_chunks > 65535) return kInvalidArgument;  // grid.y
  return kOk;
}

template <typename T, int D>
Status launch_tensor_core(const PrefixItemAttentionParams& p, const void* workspace, cudaStream_t stream) {
  const TileConfig cfg = tile_config_of(p);
  const PlanLayout b = plan_layout(workspace, p);
  auto kernel = prefix_item_attention_tc_kernel<T, D>;
  constexpr int smem = attention_smem_bytes<D>();
  PYSCORE_CUDA_TRY(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  const dim3 grid(static_cast<unsigned>(cfg.max_tiles), static_cast<unsigned>(p.num_kv_heads * cfg.head_chunks));
  kernel<<<grid, kThreads, smem, stream>>>(p, b.work, b.work_cached, b.num_work, b.tok_seg_start,
                                           cfg.heads_per_cta, cfg.head_chunks);
  PYSCORE_CUDA_TRY(cudaGetLastError());
  return kOk;
}

template <typename T>
Status dispatch_head_dim(const PrefixItemAttentionParams& p, const void* workspace, cudaStream_t stream,
                         bool tensor_cores) {
  // Qwen3.5's 256-dim heads: the tensor-core tiles and their shared memory are sized for <= 128, so these take the
  // CUDA-core path for now (one attention layer in four of that family; the plan's tile list goes unused).
  if (p.head_dim == 256) return launch_simple<T, 256>(p, stream);
  if constexpr (sizeof(T) == 2) {
    if (tensor_cores) {
      return p.head_dim == 64 ? launch_tensor_core<T, 64>(p, workspace, stream)
                              : launch_tensor_core<T, 128>(p, workspace, stream);
    }
  }
  return p.head_dim == 64 ? launch_simple<T, 64>(p, stream) : launch_simple<T, 128>(p, stream);
}

// The tensor-core path loads rows as 16-byte chunks and stores pairs: every row start must be 16-byte aligned.
bool rows_are_16b_aligned(const PrefixItemAttentionParams& p) {
  const int64_t strides[] = {p.q_token_stride, p.q_head_stride, p.k_token_stride, p.k_head_stride,
                             p.v_token_stride, p.v_head_stride, p.o_token_stride, p.o_head_stride};
  for (int64_t s : strides) {
    if (s % 8 != 0) return false;  // 8 x 16-bit elements = 16 bytes
  }
  if (p.cached && (p.cache_block_stride % 8 || p.cache_token_stride % 8 || p.cache_head_stride % 8 ||
                   !aligned_to(p.cache_k, 16) || !aligned_to(p.cache_v, 16))) {
    return false;
  }
  return aligned_to(p.q, 16) && aligned_to(p.k, 16) && aligned_to(p.v, 16) && aligned_to(p.o, 16);
}

}  // namespace

size_t prefix_item_attention_workspace_bytes_cuda(const AttentionPlanParams& shape) { return plan_bytes(shape); }

Status prefix_item_attention_plan_cuda(const AttentionPlanParams& shape, void* workspace, size_t workspace_bytes,
                                       void* stream) {
  Status status = check_shape(shape);
  if (status != kOk) return status;
  if (shape.num_tokens == 0 || shape.num_segments == 0) return kOk;
  if (!shape.segments || !workspace || !aligned_to(workspace, 16) || workspace_bytes < plan_bytes(shape)) {
    return kInvalidArgument;
  }
  const TileConfig cfg = tile_config_of(shape);
  const PlanLayout b = plan_layout(workspace, shape);

  CudaDeviceGuard guard;
  PYSCORE_CUDA_TRY(guard.set_from_pointer(workspace));
  const auto s = static_cast<cudaStream_t>(stream);
  plan_tiles_kernel<<<1, kPlanThreads, 0, s>>>(shape.segments, shape.cached, shape.num_segments, cfg.tile_tokens,
                                               static_cast<int>(cfg.max_tiles), b.seg_head, b.run_end, b.work,
                                               b.work_cached, b.num_work);
  PYSCORE_CUDA_TRY(cudaGetLastError());
  const unsigned seg_blocks = static_cast<unsigned>(shape.num_segments < 4096 ? shape.num_segments : 4096);
  token_segment_start_kernel<<<seg_blocks, 128, 0, s>>>(shape.segments, shape.num_segments, shape.num_tokens,
                                                        b.tok_seg_start);
  PYSCORE_CUDA_TRY(cudaGetLastError());
  return kOk;
}

Status prefix_item_attention_run_cuda(const PrefixItemAttentionParams& p, const void* workspace,
                                      size_t workspace_bytes, void* stream) {
  Status status = check_shape(p);
  if (status != kOk) return status;
  if (p.num_tokens == 0 || p.num_segments == 0) return kOk;
  if (!p.q || !p.k || !p.v || !p.o || !p.segments || !workspace || workspace_bytes < plan_bytes(p)) {
    return kInvalidArgument;
  }
  if (p.cached && p.num_cached_blocks > 0 && (!p.cache_k || !p.cache_v)) return kInvalidArgument;

  CudaDeviceGuard guard;
  PYSCORE_CUDA_TRY(guard.set_from_pointer(p.o));
  const auto s = static_cast<cudaStream_t>(stream);
  const bool tensor_cores = rows_are_16b_aligned(p);
  switch (p.dtype) {
    case DType::kBFloat16: return dispatch_head_dim<__nv_bfloat16>(p, workspace, s, tensor_cores);
    case DType::kFloat16: return dispatch_head_dim<__half>(p, workspace, s, tensor_cores);
    default: return dispatch_head_dim<float>(p, workspace, s, false);
  }
}

}  // namespace pyscore
