// CUDA decode_attention (contract in decode_attention.h, kernels and design notes in decode_attention_kernels.cuh): one launch
// of the partial kernel over (chunk, kv head x row slice, sequence), then, when some sequence spans several chunks,
// the chunk merge. The grid is sized from the host-known max_length, so nothing is read back from the device.
#include "common/cuda_host.h"
#include "decode_attention/decode_attention.h"
#include "decode_attention/decode_attention_kernels.cuh"

namespace pyscore {
namespace {

using namespace decode_cuda;

template <typename T, int D>
Status launch(const DecodeAttentionParams& p, cudaStream_t stream) {
  const int max_chunks = ceil_div(p.max_length, kDecodeChunk);
  const int group = p.num_q_heads / p.num_kv_heads;
  const int64_t grid_y = int64_t(p.num_kv_heads) * row_slices(group);
  if (grid_y > 65535 || p.num_seqs > 65535) return kInvalidArgument;
  float* o_parts = nullptr;
  float* lse_parts = nullptr;
  void* scratch = nullptr;
  if (max_chunks > 1) {
    const size_t parts = size_t(p.num_seqs) * p.num_q_heads * max_chunks;
    PYSCORE_CUDA_TRY(cudaMallocAsync(&scratch, parts * (D + 1) * sizeof(float), stream));
    o_parts = static_cast<float*>(scratch);
    lse_parts = o_parts + parts * D;
  }
  decode_partial_kernel<T, D><<<dim3(max_chunks, unsigned(grid_y), p.num_seqs), kThreads, 0, stream>>>(
      p, max_chunks, o_parts, lse_parts);
  cudaError_t err = cudaGetLastError();
  if (err == cudaSuccess && max_chunks > 1) {
    const int64_t pairs = int64_t(p.num_seqs) * p.num_q_heads;
    merge_chunks_kernel<T, D><<<unsigned(ceil_div<int64_t>(pairs, kMergeChunkWarps)), kMergeChunkWarps * 32, 0,
                                stream>>>(p, max_chunks, o_parts, lse_parts);
    err = cudaGetLastError();
  }
  // Stream-ordered free: released only after the kernels above have run.
  const cudaError_t free_err = scratch ? cudaFreeAsync(scratch, stream) : cudaSuccess;
  PYSCORE_CUDA_TRY(err);
  PYSCORE_CUDA_TRY(free_err);
  return kOk;
}

template <typename T>
Status dispatch_head_dim(const DecodeAttentionParams& p, cudaStream_t stream) {
  return p.head_dim == 64 ? launch<T, 64>(p, stream) : launch<T, 128>(p, stream);
}

}  // namespace

Status decode_attention_cuda(const DecodeAttentionParams& p, void* stream) {
  if (p.head_dim != 64 && p.head_dim != 128) return kUnsupportedHeadDim;
  if (p.dtype != DType::kBFloat16 && p.dtype != DType::kFloat16 && p.dtype != DType::kFloat32) return kUnsupportedDType;
  if (p.num_seqs < 0 || p.num_q_heads <= 0 || p.num_kv_heads <= 0 || p.num_q_heads % p.num_kv_heads ||
      p.max_length < 1 || p.layer < 0 || (p.k_new == nullptr) != (p.v_new == nullptr))
    return kInvalidArgument;
  if (p.num_seqs == 0) return kOk;
  if (!p.q || !p.o || !p.k_pool || !p.v_pool || !p.block_table || !p.lengths) return kInvalidArgument;
  if (p.block_tokens <= 0 || p.block_tokens % kKeyTile) return kInvalidArgument;

  CudaDeviceGuard guard;
  PYSCORE_CUDA_TRY(guard.set_from_pointer(p.o));
  const auto s = static_cast<cudaStream_t>(stream);
  switch (p.dtype) {
    case DType::kBFloat16: return dispatch_head_dim<__nv_bfloat16>(p, s);
    case DType::kFloat16: return dispatch_head_dim<__half>(p, s);
    default: return dispatch_head_dim<float>(p, s);
  }
}

}  // namespace pyscore
