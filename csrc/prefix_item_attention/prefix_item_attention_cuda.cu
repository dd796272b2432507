// CUDA prefix_item_attention (contract in params.h).
//
// Tensor-core path (bf16 / fp16, 16-byte aligned rows), FlashAttention-2 style with mma.sync m16n8k16:
//  * A CTA owns up to 64 query rows = (tokens of one *run*) x (stacked GQA query heads of one kv head). A run is
//    a maximal chain of consecutive segment rows that sit back to back in the stream and share the same
//    prefix (all items of one MIS group, or neighbouring plain-causal sequences). Stacking the heads and
//    the items means the prefix is streamed once per 64 rows, whatever the item lengths or GQA ratio.
//  * Each CTA walks two key ranges with a single online softmax (which *is* the log-sum-exp merge of the two
//    partial attentions of DESIGN.md): the shared prefix [prefix_start, +prefix_length) with no mask, then
//    the run's own keys [first row's segment start, last row's token] with the per-row mask
//    segment_start(row) <= key <= token(row), i.e. causal inside the row's own segment only.
//  * K/V tiles of 64 keys are double-buffered with cp.async into XOR-swizzled shared memory and read with
//    ldmatrix (V transposed); S and O accumulate in fp32 registers; P is rounded to the input dtype for the
//    PV product (as in FlashAttention-2), the row sums use the fp32 P.
//  * The work list (one entry per 64-row tile) is planned on the device from the segment table, so nothing
//    is copied back to the host: the attention grid is sized by an upper bound and surplus CTAs exit.
//
// Simple path (fp32, or inputs whose rows are not 16-byte aligned): one warp per (token, query head), scalar
// fp32 online softmax. Slow, but exact enough to test fp32 against the reference.
#include <climits>

#include "common/cuda_host.h"
#include "prefix_item_attention/launch.h"
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

// Scratch for the planner, carved from one stream-ordered allocation.
struct PlanBuffers {
  int4* work;
  int* num_work;
  int* seg_head;
  int* run_end;
  int* tok_seg_start;
};

template <typename T, int D>
Status launch_tensor_core(const PrefixItemAttentionParams& p, cudaStream_t stream) {
  const TileConfig cfg = tile_config(p.num_q_heads, p.num_kv_heads, p.num_tokens, p.num_segments);
  if (cfg.max_tiles > INT_MAX) return kInvalidArgument;
  const int max_tiles = static_cast<int>(cfg.max_tiles);
  const int head_chunks = cfg.head_chunks, heads_per_cta = cfg.heads_per_cta, tile_tokens = cfg.tile_tokens;
  const unsigned grid_y = static_cast<unsigned>(p.num_kv_heads) * static_cast<unsigned>(head_chunks);
  if (grid_y > 65535u) return kInvalidArgument;

  const size_t bytes = sizeof(int4) * size_t(max_tiles) + sizeof(int) * (1 + 2 * size_t(p.num_segments) +
                                                                         size_t(p.num_tokens));
  void* scratch = nullptr;
  PYSCORE_CUDA_TRY(cudaMallocAsync(&scratch, bytes, stream));
  PlanBuffers b;
  b.work = static_cast<int4*>(scratch);
  b.num_work = reinterpret_cast<int*>(b.work + max_tiles);
  b.seg_head = b.num_work + 1;
  b.run_end = b.seg_head + p.num_segments;
  b.tok_seg_start = b.run_end + p.num_segments;

  auto run = [&]() -> cudaError_t {
    plan_tiles_kernel<<<1, kPlanThreads, 0, stream>>>(p.segments, p.num_segments, tile_tokens, max_tiles,
                                                      b.seg_head, b.run_end, b.work, b.num_work);
    cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) return err;
    const unsigned seg_blocks = static_cast<unsigned>(p.num_segments < 4096 ? p.num_segments : 4096);
    token_segment_start_kernel<<<seg_blocks, 128, 0, stream>>>(p.segments, p.num_segments, p.num_tokens,
                                                               b.tok_seg_start);
    err = cudaGetLastError();
    if (err != cudaSuccess) return err;
    auto kernel = prefix_item_attention_tc_kernel<T, D>;
    constexpr int smem = attention_smem_bytes<D>();
    err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    if (err != cudaSuccess) return err;
    const dim3 grid(static_cast<unsigned>(max_tiles), grid_y);
    kernel<<<grid, kThreads, smem, stream>>>(p, b.work, b.num_work, b.tok_seg_start, heads_per_cta,
                                             head_chunks);
    return cudaGetLastError();
  };
  const cudaError_t err = run();
  // Stream-ordered free: the memory is released only after the kernels above have run.
  const cudaError_t free_err = cudaFreeAsync(scratch, stream);
  PYSCORE_CUDA_TRY(err);
  PYSCORE_CUDA_TRY(free_err);
  return kOk;
}

template <typename T>
Status dispatch_head_dim(const PrefixItemAttentionParams& p, cudaStream_t stream, bool tensor_cores) {
  if constexpr (sizeof(T) == 2) {
    if (tensor_cores) {
      return p.head_dim == 64 ? launch_tensor_core<T, 64>(p, stream) : launch_tensor_core<T, 128>(p, stream);
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
  return aligned_to(p.q, 16) && aligned_to(p.k, 16) && aligned_to(p.v, 16) && aligned_to(p.o, 16);
}

}  // namespace

Status prefix_item_attention_cuda(const PrefixItemAttentionParams& p, void* stream) {
  if (p.head_dim != 64 && p.head_dim != 128) return kUnsupportedHeadDim;
  if (p.dtype != DType::kBFloat16 && p.dtype != DType::kFloat16 && p.dtype != DType::kFloat32) {
    return kUnsupportedDType;
  }
  if (p.num_tokens < 0 || p.num_segments < 0 || p.num_q_heads <= 0 || p.num_kv_heads <= 0 ||
      p.num_q_heads % p.num_kv_heads != 0 || p.num_q_heads > 65535) {
    return kInvalidArgument;
  }
  if (p.num_tokens == 0 || p.num_segments == 0) return kOk;
  if (!p.q || !p.k || !p.v || !p.o || !p.segments) return kInvalidArgument;

  CudaDeviceGuard guard;
  PYSCORE_CUDA_TRY(guard.set_from_pointer(p.o));
  const auto s = static_cast<cudaStream_t>(stream);
  const bool tensor_cores = rows_are_16b_aligned(p);
  switch (p.dtype) {
    case DType::kBFloat16: return dispatch_head_dim<__nv_bfloat16>(p, s, tensor_cores);
    case DType::kFloat16: return dispatch_head_dim<__half>(p, s, tensor_cores);
    default: return dispatch_head_dim<float>(p, s, false);
  }
}

}  // namespace pyscore
