// CUDA label_logprobs (contract in label_logprobs.h). Two kernels per batch of up to 256 rows:
//  1. partials: the vocabulary is split into chunks; each CTA computes its chunk's logits for *all* rows of the
//     batch and reduces them at once to per-row (max, sum e^{x - max}), so the [R, V] logits never exist
//     outside registers. With an LM head the bound is streaming the weight: every CTA reads its 64 weight
//     rows exactly once (bf16/fp16: mma.sync m16n8k16, weight rows as the A operand so a 16-row vocab tile
//     is always full and small R wastes at most the 8-wide n tile; hidden k-slices ride along in shared
//     memory through a 3-stage cp.async pipeline).
//  2. combine: one CTA per row merges the chunk partials into logZ, computes the label logits (a dot product
//     per label with the LM head, a gather with logits), then logprobs and the softmax over valid labels.
// fp32, unaligned rows or hidden sizes that are not a multiple of 8 take a scalar CUDA-core partials kernel.
#include "common/cuda_host.h"
#include "label_logprobs/label_logprobs.h"
#include "label_logprobs/label_logprobs_kernels.cuh"

namespace pyscore {
namespace {

using namespace label_cuda;

// ---- host side ------------------------------------------------------------------------------------------------

bool tensor_core_ok(const LabelLogprobsParams& p) {
  return p.weight != nullptr && p.dtype != DType::kFloat32 && p.hidden_size % 8 == 0 &&
         p.hidden_row_stride % 8 == 0 && p.weight_row_stride % 8 == 0 && aligned_to(p.hidden, 16) &&
         aligned_to(p.weight, 16);
}

template <typename T>
Status launch(const LabelLogprobsParams& p, cudaStream_t stream) {
  const bool has_weight = p.weight != nullptr;
  const bool tc = tensor_core_ok(p);
  const int num_chunks = has_weight ? ceil_div(p.vocab_size, kVocabTile) : ceil_div(p.vocab_size, kLogitsChunk);
  const int max_batch = p.num_rows < kMaxBatchRows ? p.num_rows : kMaxBatchRows;
  const T* weight = static_cast<const T*>(p.weight);

  if constexpr (sizeof(T) == 2) {
    if (tc) {
      constexpr int kMaxSmem = kStages * stage_elems(kMaxBatchRows) * sizeof(T);
      PYSCORE_CUDA_TRY(cudaFuncSetAttribute(lm_head_partials_tc_kernel<T>,
                                            cudaFuncAttributeMaxDynamicSharedMemorySize, kMaxSmem));
    }
  }
  MaxSum* partials = nullptr;
  PYSCORE_CUDA_TRY(cudaMallocAsync(reinterpret_cast<void**>(&partials),
                                   sizeof(MaxSum) * size_t(max_batch) * size_t(num_chunks), stream));
  cudaError_t err = cudaSuccess;
  for (int row0 = 0; row0 < p.num_rows && err == cudaSuccess; row0 += kMaxBatchRows) {
    const int rows = p.num_rows - row0 < kMaxBatchRows ? p.num_rows - row0 : kMaxBatchRows;
    const T* hidden = static_cast<const T*>(p.hidden) + row0 * p.hidden_row_stride;
    if (!has_weight) {
      logits_partials_kernel<T><<<dim3(num_chunks, rows), kCombineThreads, 0, stream>>>(
          hidden, p.hidden_row_stride, p.vocab_size, partials);
    } else if (tc) {
      if constexpr (sizeof(T) == 2) {
        const int threads = ceil_div(rows, kRowsPerWarp) * 32;  // one batch row per thread, padded to warps
        const size_t smem = size_t(kStages) * stage_elems(threads) * sizeof(T);
        lm_head_partials_tc_kernel<T><<<num_chunks, threads, smem, stream>>>(
            hidden, p.hidden_row_stride, weight, p.weight_row_stride, rows, p.hidden_size, p.vocab_size,
            partials);
      }
    } else {
      lm_head_partials_simple_kernel<T><<<num_chunks, kSimpleWarps * 32, 0, stream>>>(
          hidden, p.hidden_row_stride, weight, p.weight_row_stride, rows, p.hidden_size, p.vocab_size, partials);
    }
    err = cudaGetLastError();
    if (err != cudaSuccess) break;
    const int64_t label_offset = int64_t(row0) * p.num_labels;
    combine_kernel<T><<<rows, kCombineThreads, 0, stream>>>(
        partials, num_chunks, hidden, p.hidden_row_stride, weight, p.weight_row_stride, p.hidden_size,
        p.vocab_size, p.labels + label_offset, p.num_labels, p.logprobs + label_offset,
        p.label_softmax + label_offset, p.logz ? p.logz + row0 : nullptr);
    err = cudaGetLastError();
  }
  const cudaError_t free_err = cudaFreeAsync(partials, stream);  // stream-ordered: after the kernels
  PYSCORE_CUDA_TRY(err);
  PYSCORE_CUDA_TRY(free_err);
  return kOk;
}

}  // namespace

Status label_logprobs_cuda(const LabelLogprobsParams& p, void* stream) {
  if (p.dtype != DType::kBFloat16 && p.dtype != DType::kFloat16 && p.dtype != DType::kFloat32) {
    return kUnsupportedDType;
  }
  if (p.num_rows < 0 || p.num_labels < 0 || p.vocab_size <= 0 || (p.weight && p.hidden_size <= 0)) {
    return kInvalidArgument;
  }
  // the whole-row logits output and a bf16 weight under fp32 rows are CPU only (label_logprobs.h)
  if (p.logits || p.bf16_weight) return kInvalidArgument;
  if (p.num_rows == 0) return kOk;
  if (!p.hidden || (p.num_labels > 0 && (!p.labels || !p.logprobs || !p.label_softmax))) return kInvalidArgument;
  if (p.num_labels == 0 && !p.logz) return kOk;  // nothing to write

  CudaDeviceGuard guard;
  PYSCORE_CUDA_TRY(guard.set_from_pointer(p.hidden));
  const auto s = static_cast<cudaStream_t>(stream);
  switch (p.dtype) {
    case DType::kBFloat16: return launch<__nv_bfloat16>(p, s);
    case DType::kFloat16: return launch<__half>(p, s);
    default: return launch<float>(p, s);
  }
}

}  // namespace pyscore
