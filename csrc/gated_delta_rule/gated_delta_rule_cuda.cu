// CUDA linear-attention ops (contracts in gated_delta_rule.h).
//
// causal_conv1d: one thread per (segment, channel) walks the segment with its K - 1 previous inputs in registers;
// consecutive threads take consecutive channels, so every token row is read coalesced. A 300-token segment is ~300
// dependent-free loads and FMAs per thread: a few microseconds, negligible beside the layer's projections.
//
// gated_delta_rule: the token-recurrent form, chosen over the chunked (WY / UT-transform) form because
//  * it is the same arithmetic however the stream is segmented, so an item continuing from S_p is exactly the SIS
//    sequence's suffix and the CPU kernel, the CUDA kernel and the reference agree to fp32 rounding;
//  * its cost is a latency chain of ~0.3 us per token on one SM (4 Dk / 8 FMAs per thread plus two 3-step shuffle
//    reductions), i.e. ~80 us per layer for a 270-token MIS prefix, with every (head, 16-column block, segment) in
//    parallel; the chunked form only wins once a single sequence runs past ~1-2k tokens, longer than the
//    decision prompts this service scores (a follow-up if prompts grow).
// Three launches: (1) per token, the L2-normalised q^ / k^ and the gates of every head into fp32 scratch (fully
// parallel); (2) phase 0, every segment without a prefix, from zero or the caller's state, each prefix that has
// items leaving S_p in its slot of a scratch [slots, Hv, Dk, Dv]; (3) phase 1, every item from its prefix's S_p,
// in parallel (skipped when there are none). Stream order is the only synchronisation; S_p is read-only in phase 1.
#include "common/cuda_host.h"
#include "gated_delta_rule/gated_delta_rule.h"
#include "gated_delta_rule/gated_delta_rule_kernels.cuh"

namespace pyscore {
namespace {

using namespace linear_cuda;

template <typename T>
Status launch_conv(const CausalConv1dParams& p, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>(ceil_div(p.channels, kConvThreads)), static_cast<unsigned>(p.num_segments));
  causal_conv1d_kernel<T><<<grid, kConvThreads, 0, stream>>>(p);
  PYSCORE_CUDA_TRY(cudaGetLastError());
  return kOk;
}

template <typename T, int kRows>
Status launch_rule_rows(const GatedDeltaRuleParams& p, cudaStream_t stream) {
  const size_t q_elems = size_t(p.num_tokens) * p.num_k_heads * p.k_dim;
  const size_t gate_elems = size_t(p.num_tokens) * p.num_v_heads;
  const size_t state_elems = size_t(p.num_slots) * p.num_v_heads * p.k_dim * p.v_dim;
  float* buffer = nullptr;
  PYSCORE_CUDA_TRY(cudaMallocAsync(reinterpret_cast<void**>(&buffer),
                                   sizeof(float) * (2 * q_elems + 2 * gate_elems + state_elems), stream));
  const RuleScratch scratch{buffer, buffer + q_elems, buffer + 2 * q_elems, buffer + 2 * q_elems + gate_elems};
  float* prefix_states = buffer + 2 * q_elems + 2 * gate_elems;
  cudaError_t err = cudaSuccess;
  if (p.num_tokens > 0) {
    rule_prepare_kernel<T><<<p.num_tokens, kPrepThreads, 0, stream>>>(p, scratch);
    err = cudaGetLastError();
  }
  const dim3 grid(static_cast<unsigned>(ceil_div(p.v_dim, kRuleCols)), static_cast<unsigned>(p.num_v_heads),
                  static_cast<unsigned>(p.num_segments));
  for (int phase = 0; phase < (p.num_slots > 0 ? 2 : 1) && err == cudaSuccess; ++phase) {
    gated_delta_rule_kernel<T, kRows><<<grid, kRuleThreads, 0, stream>>>(p, scratch, prefix_states, phase);
    err = cudaGetLastError();
  }
  const cudaError_t free_err = cudaFreeAsync(buffer, stream);  // stream-ordered: after the kernels
  PYSCORE_CUDA_TRY(err);
  PYSCORE_CUDA_TRY(free_err);
  return kOk;
}

// Rows per thread = ceil(Dk / 8), rounded up to a power of two (Dk <= 256).
template <typename T>
Status launch_rule(const GatedDeltaRuleParams& p, cudaStream_t stream) {
  const int rows = ceil_div(p.k_dim, kRowSlices);
  if (rows <= 2) return launch_rule_rows<T, 2>(p, stream);
  if (rows <= 4) return launch_rule_rows<T, 4>(p, stream);
  if (rows <= 8) return launch_rule_rows<T, 8>(p, stream);
  if (rows <= 16) return launch_rule_rows<T, 16>(p, stream);
  return launch_rule_rows<T, 32>(p, stream);
}

}  // namespace

Status causal_conv1d_cuda(const CausalConv1dParams& p, void* stream) {
  if (p.dtype != DType::kBFloat16 && p.dtype != DType::kFloat32 && p.dtype != DType::kFloat16) return kUnsupportedDType;
  if (p.num_segments < 0 || p.channels <= 0 || p.kernel_size < 1 || p.kernel_size > kMaxConvKernel) {
    return kInvalidArgument;
  }
  if (p.num_segments == 0 || p.num_segments > 65535) return p.num_segments == 0 ? kOk : kInvalidArgument;
  if (!p.x || !p.y || !p.weight || !p.segments) return kInvalidArgument;
  CudaDeviceGuard guard;
  PYSCORE_CUDA_TRY(guard.set_from_pointer(p.x));
  const auto s = static_cast<cudaStream_t>(stream);
  switch (p.dtype) {
    case DType::kBFloat16: return launch_conv<__nv_bfloat16>(p, s);
    case DType::kFloat16: return launch_conv<__half>(p, s);
    default: return launch_conv<float>(p, s);
  }
}

Status gated_delta_rule_cuda(const GatedDeltaRuleParams& p, void* stream) {
  if (p.dtype != DType::kBFloat16 && p.dtype != DType::kFloat32 && p.dtype != DType::kFloat16) return kUnsupportedDType;
  if (p.num_k_heads <= 0 || p.num_v_heads <= 0 || p.num_v_heads % p.num_k_heads || p.v_dim <= 0 ||
      p.num_segments < 0 || p.num_tokens < 0 || p.num_slots < 0 || p.num_segments > 65535 || p.num_v_heads > 65535) {
    return kInvalidArgument;
  }
  if (p.k_dim <= 0 || p.k_dim > kMaxKeyDim) return kUnsupportedHeadDim;
  if (p.num_segments == 0) return kOk;
  if (!p.q || !p.k || !p.v || !p.a || !p.b || !p.o || !p.a_log || !p.dt_bias || !p.segments || !p.state_slot) {
    return kInvalidArgument;
  }
  CudaDeviceGuard guard;
  PYSCORE_CUDA_TRY(guard.set_from_pointer(p.q));
  const auto s = static_cast<cudaStream_t>(stream);
  switch (p.dtype) {
    case DType::kBFloat16: return launch_rule<__nv_bfloat16>(p, s);
    case DType::kFloat16: return launch_rule<__half>(p, s);
    default: return launch_rule<float>(p, s);
  }
}

}  // namespace pyscore
