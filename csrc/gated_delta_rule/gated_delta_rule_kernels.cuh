// Kernels of the CUDA linear-attention ops (design notes in gated_delta_rule_cuda.cu, which launches them). Kept in a
// header, free of inline PTX and host code, so tests/emu can run them on the host.
#pragma once
#include <cstdint>

#include "common/cuda_utils.cuh"
#include "gated_delta_rule/gated_delta_rule.h"

namespace pyscore {
namespace linear_cuda {

constexpr int kConvThreads = 128;  // one thread per (segment, channel)
constexpr int kPrepThreads = 128;  // one block per token: the L2 norms and gates of all its heads
constexpr int kRuleThreads = 128;  // 4 warps x 4 state columns x 8 lanes (row slices) per column
constexpr int kColsPerWarp = 4;
constexpr int kRowSlices = 8;
constexpr int kRuleCols = (kRuleThreads / 32) * kColsPerWarp;  // 16 state columns per CTA
constexpr int kTokenChunk = 16;  // tokens whose q^ / k^ are staged in shared memory at once
static_assert(kColsPerWarp * kRowSlices == 32, "a warp is 4 columns x 8 row slices");

__device__ __forceinline__ int4 load_segment(const int32_t* table, int s) {
  const int32_t* r = table + 4 * static_cast<int64_t>(s);
  return make_int4(r[0], r[1], r[2], r[3]);
}

// ---- causal_conv1d ----------------------------------------------------------------------------------------------

// grid (ceil(C / kConvThreads), S). A thread walks its segment's tokens for one channel keeping the last K - 1
// inputs in registers (hist, oldest first); it reads its tail_in before and writes its tail_out after, so the two may
// alias. All window indices are compile-time after unrolling, with the runtime K as a predicate.
template <typename T>
__global__ void __launch_bounds__(kConvThreads) causal_conv1d_kernel(CausalConv1dParams p) {
  constexpr int kHist = kMaxConvKernel - 1;
  const int c = blockIdx.x * kConvThreads + threadIdx.x;
  const int s = blockIdx.y;
  if (c >= p.channels) return;
  const int4 seg = load_segment(p.segments, s);  // start, length, prefix_start, prefix_length
  const int history = p.kernel_size - 1;
  const T* x = static_cast<const T*>(p.x);
  const T* weight = static_cast<const T*>(p.weight) + static_cast<int64_t>(c) * p.kernel_size;
  const T* tail_in = p.tail_in ? reinterpret_cast<const T*>(p.tail_in[s]) : nullptr;
  float w[kHist], hist[kHist];
#pragma unroll
  for (int i = 0; i < kHist; ++i) {
    w[i] = i < history ? to_float(weight[i]) : 0.f;
    hist[i] = 0.f;
    if (i >= history) continue;
    const int back = history - i;  // inputs before the segment's first token
    if (back <= seg.w) {  // a prefix row (an item's), else what came before the prefix (or the segment)
      hist[i] = to_float(x[(static_cast<int64_t>(seg.z) + seg.w - back) * p.x_token_stride + c]);
    } else if (tail_in) {
      hist[i] = to_float(tail_in[static_cast<int64_t>(i + seg.w) * p.channels + c]);
    }
  }
  const float w_cur = to_float(weight[history]);
  T* y = static_cast<T*>(p.y);
  for (int j = 0; j < seg.y; ++j) {
    const int64_t t = seg.x + j;
    const float cur = to_float(x[t * p.x_token_stride + c]);
    float acc = 0.f;
#pragma unroll
    for (int i = 0; i < kHist; ++i) acc += w[i] * hist[i];  // w is 0 past the history
    acc += w_cur * cur;
#pragma unroll
    for (int i = 0; i < kHist; ++i) {
      if (i + 1 < history) hist[i] = hist[i + 1];
      else if (i + 1 == history) hist[i] = cur;
    }
    const float conv = to_float(from_float<T>(acc));  // rounded as torch's conv1d output, then SiLU
    y[t * p.y_token_stride + c] = from_float<T>(conv / (1.f + __expf(-conv)));
  }
  if (p.tail_out && p.tail_out[s]) {
    T* tail_out = reinterpret_cast<T*>(p.tail_out[s]);
#pragma unroll
    for (int i = 0; i < kHist; ++i) {
      if (i < history) tail_out[static_cast<int64_t>(i) * p.channels + c] = from_float<T>(hist[i]);
    }
  }
}

// ---- gated_delta_rule -------------------------------------------------------------------------------------------

// Per-token inputs of the recurrence, computed once for all heads (fp32): q^ and k^ [T, Hk, Dk], decay and beta
// [T, Hv].
struct RuleScratch {
  float* q;
  float* k;
  float* decay;
  float* beta;
};

__device__ __forceinline__ float softplus(float x) { return x > 20.f ? x : log1pf(__expf(x)); }

// grid (T): warps take key heads (the L2 norms), then threads take value heads (the gates).
template <typename T>
__global__ void __launch_bounds__(kPrepThreads) rule_prepare_kernel(GatedDeltaRuleParams p, RuleScratch scratch) {
  const int t = blockIdx.x;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int dk = p.k_dim;
  for (int h = warp; h < p.num_k_heads; h += kPrepThreads / 32) {
    const T* qr = static_cast<const T*>(p.q) + t * p.q_token_stride + h * p.q_head_stride;
    const T* kr = static_cast<const T*>(p.k) + t * p.k_token_stride + h * p.k_head_stride;
    float qs = 0.f, ks = 0.f;
    for (int d = lane; d < dk; d += 32) {
      const float qv = to_float(qr[d]), kv = to_float(kr[d]);
      qs += qv * qv;
      ks += kv * kv;
    }
    const float q_scale = p.scale / sqrtf(warp_sum(qs) + 1e-6f), k_scale = 1.f / sqrtf(warp_sum(ks) + 1e-6f);
    float* qo = scratch.q + (static_cast<int64_t>(t) * p.num_k_heads + h) * dk;
    float* ko = scratch.k + (static_cast<int64_t>(t) * p.num_k_heads + h) * dk;
    for (int d = lane; d < dk; d += 32) {
      qo[d] = to_float(qr[d]) * q_scale;
      ko[d] = to_float(kr[d]) * k_scale;
    }
  }
  for (int h = threadIdx.x; h < p.num_v_heads; h += kPrepThreads) {
    const float a = to_float(static_cast<const T*>(p.a)[t * p.a_token_stride + h]);
    const float b = to_float(static_cast<const T*>(p.b)[t * p.b_token_stride + h]);
    scratch.decay[static_cast<int64_t>(t) * p.num_v_heads + h] = __expf(-__expf(p.a_log[h]) * softplus(a + p.dt_bias[h]));
    scratch.beta[static_cast<int64_t>(t) * p.num_v_heads + h] = 1.f / (1.f + __expf(-b));
  }
}

// Sum over the 8 row slices of a column (lanes 8c .. 8c + 7 of the warp); every lane gets it.
__device__ __forceinline__ float slice_sum(float x) {
#pragma unroll
  for (int offset = 1; offset < kRowSlices; offset <<= 1) x += __shfl_xor_sync(0xffffffffu, x, offset);
  return x;
}

// grid (ceil(Dv / kRuleCols), Hv, S), launched twice: phase 0 runs the segments without a prefix (and keeps the
// end state of each prefix that has items in its slot of `prefix_states` [slots, Hv, Dk, Dv]), phase 1 runs every
// item from its prefix's slot. A thread owns rows slice + 8 r (r < kRows) of one state column in registers; q^ and k^
// of kTokenChunk tokens at a time are staged in shared memory (interleaved rows: the 8 slices of a column read 8
// consecutive words, the 4 columns of a warp the same ones).
template <typename T, int kRows>
__global__ void __launch_bounds__(kRuleThreads) gated_delta_rule_kernel(GatedDeltaRuleParams p, RuleScratch scratch,
                                                                        float* prefix_states, int phase) {
  __shared__ float sm_q[kTokenChunk][kRows * kRowSlices];
  __shared__ float sm_k[kTokenChunk][kRows * kRowSlices];
  __shared__ float sm_decay[kTokenChunk], sm_beta[kTokenChunk];
  const int s = blockIdx.z, head = blockIdx.y;
  const int4 seg = load_segment(p.segments, s);
  if ((seg.w > 0) != (phase == 1)) return;  // uniform over the block
  const int lane = threadIdx.x % 32, slice = lane % kRowSlices;
  const int col = blockIdx.x * kRuleCols + (threadIdx.x / 32) * kColsPerWarp + lane / kRowSlices;
  const bool has_col = col < p.v_dim;
  const int dk = p.k_dim, k_head = head / (p.num_v_heads / p.num_k_heads);
  const int64_t state_elems = static_cast<int64_t>(dk) * p.v_dim;
  const int slot = p.state_slot[s];

  // The state column this thread owns, rows slice + 8 r.
  float st[kRows];
  const float* init = nullptr;
  if (phase == 1) {
    init = prefix_states + (static_cast<int64_t>(slot) * p.num_v_heads + head) * state_elems;
  } else if (p.state_in && p.state_in[s]) {
    init = reinterpret_cast<const float*>(p.state_in[s]) + head * state_elems;
  }
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    const int row = slice + kRowSlices * r;
    st[r] = (init && has_col && row < dk) ? init[static_cast<int64_t>(row) * p.v_dim + col] : 0.f;
  }

  const T* v = static_cast<const T*>(p.v) + head * p.v_head_stride + col;
  T* o = static_cast<T*>(p.o) + head * p.o_head_stride + col;
  // A snapshot: the state after the segment's first snap_at tokens (a lead segment's; checked by the host).
  float* snap = (phase == 0 && p.state_snap && p.state_snap[s])
                    ? reinterpret_cast<float*>(p.state_snap[s]) + head * state_elems : nullptr;
  const int64_t snap_end = snap ? static_cast<int64_t>(seg.x) + p.snap_at[s] : -1;
  for (int t0 = seg.x; t0 < seg.x + seg.y; t0 += kTokenChunk) {
    const int n = min(kTokenChunk, seg.x + seg.y - t0);
    __syncthreads();  // the previous chunk is consumed
    for (int e = threadIdx.x; e < kTokenChunk * kRows * kRowSlices; e += kRuleThreads) {
      const int tt = e / (kRows * kRowSlices), d = e % (kRows * kRowSlices);
      const int64_t at = (static_cast<int64_t>(t0 + tt) * p.num_k_heads + k_head) * dk + d;
      const bool live = tt < n && d < dk;
      sm_q[tt][d] = live ? scratch.q[at] : 0.f;
      sm_k[tt][d] = live ? scratch.k[at] : 0.f;
    }
    if (threadIdx.x < kTokenChunk) {
      const bool live = static_cast<int>(threadIdx.x) < n;
      const int64_t at = static_cast<int64_t>(t0 + threadIdx.x) * p.num_v_heads + head;
      sm_decay[threadIdx.x] = live ? scratch.decay[at] : 1.f;
      sm_beta[threadIdx.x] = live ? scratch.beta[at] : 0.f;
    }
    __syncthreads();
    for (int tt = 0; tt < n; ++tt) {
      const int64_t t = t0 + tt;
      const float decay = sm_decay[tt];
      float kv = 0.f;
#pragma unroll
      for (int r = 0; r < kRows; ++r) {
        st[r] *= decay;
        kv += sm_k[tt][slice + kRowSlices * r] * st[r];
      }
      kv = slice_sum(kv);
      const float delta = ((has_col ? to_float(v[t * p.v_token_stride]) : 0.f) - kv) * sm_beta[tt];
      float out = 0.f;
#pragma unroll
      for (int r = 0; r < kRows; ++r) {
        st[r] += sm_k[tt][slice + kRowSlices * r] * delta;
        out += sm_q[tt][slice + kRowSlices * r] * st[r];
      }
      out = slice_sum(out);
      if (has_col && slice == 0) o[t * p.o_token_stride] = from_float<T>(out);
      if (t + 1 == snap_end && has_col) {
#pragma unroll
        for (int r = 0; r < kRows; ++r) {
          const int row = slice + kRowSlices * r;
          if (row < dk) snap[static_cast<int64_t>(row) * p.v_dim + col] = st[r];
        }
      }
    }
  }

  float* keep = (phase == 0 && slot >= 0) ? prefix_states + (static_cast<int64_t>(slot) * p.num_v_heads + head) * state_elems
                                         : nullptr;
  float* out_state = (p.state_out && p.state_out[s]) ? reinterpret_cast<float*>(p.state_out[s]) + head * state_elems
                                                     : nullptr;
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    const int row = slice + kRowSlices * r;
    if (!has_col || row >= dk) continue;
    const int64_t at = static_cast<int64_t>(row) * p.v_dim + col;
    if (keep) keep[at] = st[r];
    if (out_state) out_state[at] = st[r];
  }
}

}  // namespace linear_cuda
}  // namespace pyscore
