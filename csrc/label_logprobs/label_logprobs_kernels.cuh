// Kernels of the CUDA label_logprobs (design notes in label_logprobs_cuda.cu, which launches them). Kept in a
// header, free of inline PTX and host code, so tests/emu can run them on the host.
#pragma once
#include <cstdint>

#include "common/cuda_utils.cuh"
#include "common/mma_ptx.cuh"

namespace pyscore {
namespace label_cuda {

constexpr int kVocabTile = 64;      // vocab rows per partials CTA (LM head paths): four m16 tiles
constexpr int kRowsPerWarp = 32;    // batch rows per warp in the tensor-core kernel: four n8 tiles
constexpr int kMaxBatchRows = 256;  // rows per launch; larger R is processed in batches
constexpr int kKChunk = 64;         // hidden dims per pipeline stage
constexpr int kStages = 3;
constexpr int kLogitsChunk = 4096;  // vocab entries per CTA when logits are given
constexpr int kCombineThreads = 256;
constexpr int kSimpleWarps = 8;
static_assert(kVocabTile == 64 && kRowsPerWarp == 32 && kKChunk == 64, "fragment loops below assume these");
static_assert(kVocabTile % kSimpleWarps == 0, "simple kernel splits the vocab tile evenly over warps");

// Running (max, sum of e^{x - max}) of a set of logits; {-inf, 0} is the empty set.
struct MaxSum {
  float m;
  float s;
};

__device__ __forceinline__ MaxSum merge(MaxSum a, MaxSum b) {
  const float m = fmaxf(a.m, b.m);
  if (m == -INFINITY) return {-INFINITY, 0.f};  // both empty: avoid -inf - (-inf)
  return {m, a.s * __expf(a.m - m) + b.s * __expf(b.m - m)};
}

__device__ __forceinline__ MaxSum warp_merge(MaxSum x) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) {
    const MaxSum y{__shfl_xor_sync(0xffffffffu, x.m, offset), __shfl_xor_sync(0xffffffffu, x.s, offset)};
    x = merge(x, y);
  }
  return x;
}

// Block-wide reductions for blockDim.x a multiple of 32 (<= 1024); every thread gets the result. `scratch`
// must hold 32 entries; the leading __syncthreads lets callers reuse it back to back.
__device__ MaxSum block_merge(MaxSum x, MaxSum* scratch) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, warps = blockDim.x / 32;
  x = warp_merge(x);
  __syncthreads();
  if (lane == 0) scratch[warp] = x;
  __syncthreads();
  x = lane < warps ? scratch[lane] : MaxSum{-INFINITY, 0.f};
  return warp_merge(x);
}

__device__ float block_max(float x, float* scratch) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, warps = blockDim.x / 32;
  x = warp_max(x);
  __syncthreads();
  if (lane == 0) scratch[warp] = x;
  __syncthreads();
  return warp_max(lane < warps ? scratch[lane] : -INFINITY);
}

__device__ float block_sum(float x, float* scratch) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, warps = blockDim.x / 32;
  x = warp_sum(x);
  __syncthreads();
  if (lane == 0) scratch[warp] = x;
  __syncthreads();
  return warp_sum(lane < warps ? scratch[lane] : 0.f);
}

// ---- partials: tensor cores ---------------------------------------------------------------------------------

constexpr int stage_elems(int batch_pad) { return (kVocabTile + batch_pad) * kKChunk; }

// grid: ceil(V / 64) CTAs; block: 32 * ceil(R / 32) threads, warp w owns batch rows [32w, 32w + 32).
// partials[r * num_chunks + blockIdx.x] = (max, sumexp) of row r's logits over this CTA's vocab rows.
template <typename T>
__global__ void __launch_bounds__(kMaxBatchRows)
    lm_head_partials_tc_kernel(const T* __restrict__ hidden, int64_t hidden_stride, const T* __restrict__ weight,
                               int64_t weight_stride, int rows, int hidden_size, int vocab,
                               MaxSum* __restrict__ partials) {
  static_assert(sizeof(T) == 2, "tensor-core path is for 16-bit inputs");
  PYSCORE_DYNAMIC_SMEM(smem);
  T* stages = reinterpret_cast<T*>(smem);  // kStages x ([64 weight rows][64] then [batch_pad rows][64]), swizzled
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int batch_pad = blockDim.x;  // one batch row per thread: 32 per warp
  const int v0 = blockIdx.x * kVocabTile;
  const int num_k = ceil_div(hidden_size, kKChunk);
  constexpr int kChunks = kKChunk / 8;

  // hidden_size % 8 == 0 (host check), so a 16-byte chunk is either entirely inside H or entirely past it;
  // rows past V / R and chunks past H are zero-filled and contribute 0 to the dot products.
  auto load_stage = [&](int kc, int stage) {
    T* s_w = stages + stage * stage_elems(batch_pad);
    T* s_h = s_w + kVocabTile * kKChunk;
    const int k0 = kc * kKChunk;
    for (int idx = tid; idx < kVocabTile * kChunks; idx += blockDim.x) {
      const int r = idx / kChunks, c = (idx % kChunks) * 8;
      const bool valid = v0 + r < vocab && k0 + c < hidden_size;
      const T* src = valid ? weight + (v0 + r) * weight_stride + k0 + c : weight;
      cp_async_16(s_w + swizzle<kKChunk>(r, c), src, valid);
    }
    for (int idx = tid; idx < batch_pad * kChunks; idx += blockDim.x) {
      const int r = idx / kChunks, c = (idx % kChunks) * 8;
      const bool valid = r < rows && k0 + c < hidden_size;
      const T* src = valid ? hidden + r * hidden_stride + k0 + c : hidden;
      cp_async_16(s_h + swizzle<kKChunk>(r, c), src, valid);
    }
  };

  // acc[mt][nt]: vocab rows v0 + 16 mt + (lane / 4, + 8), batch rows 32 warp + 8 nt + 2 (lane % 4) (+ 1).
  float acc[4][4][4];
#pragma unroll
  for (int mt = 0; mt < 4; ++mt)
#pragma unroll
    for (int nt = 0; nt < 4; ++nt) acc[mt][nt][0] = acc[mt][nt][1] = acc[mt][nt][2] = acc[mt][nt][3] = 0.f;

  // Pipeline: stage kc % kStages holds k-chunk kc. One commit group per chunk (empty past the end), so
  // before iteration kc there are kStages - 1 + kc groups and waiting until kStages - 2 are pending means
  // chunk kc has landed.
#pragma unroll
  for (int st = 0; st < kStages - 1; ++st) {
    if (st < num_k) load_stage(st, st);
    cp_async_commit();
  }
  for (int kc = 0; kc < num_k; ++kc) {
    cp_async_wait<kStages - 2>();
    __syncthreads();  // chunk kc visible to all; everyone is done with chunk kc - 1, whose stage we refill now
    if (kc + kStages - 1 < num_k) load_stage(kc + kStages - 1, (kc + kStages - 1) % kStages);
    cp_async_commit();

    const T* s_w = stages + (kc % kStages) * stage_elems(batch_pad);
    const T* s_h = s_w + kVocabTile * kKChunk;
#pragma unroll
    for (int kk = 0; kk < kKChunk / 16; ++kk) {
      uint32_t a[4][4];
#pragma unroll
      for (int mt = 0; mt < 4; ++mt) {
        ldmatrix_x4(a[mt], s_w + swizzle<kKChunk>(mt * 16 + (lane & 15), kk * 16 + (lane >> 4) * 8));
      }
#pragma unroll
      for (int nb = 0; nb < 2; ++nb) {
        // B[k][n] = hidden[row n][dim k]: hidden rows as stored (like K in attention), no transpose.
        const int mat = lane >> 3;
        const int row = warp * kRowsPerWarp + nb * 16 + (mat >> 1) * 8 + (lane & 7);
        const int col = kk * 16 + (mat & 1) * 8;
        uint32_t b[4];
        ldmatrix_x4(b, s_h + swizzle<kKChunk>(row, col));
#pragma unroll
        for (int mt = 0; mt < 4; ++mt) {
          mma_16816<T>(acc[mt][2 * nb], a[mt], b[0], b[1]);
          mma_16816<T>(acc[mt][2 * nb + 1], a[mt], b[2], b[3]);
        }
      }
    }
  }
  cp_async_wait<0>();  // drain the (empty) trailing groups before the CTA exits

  // Per batch row: the 64 vocab rows sit in 8 values per thread (4 m tiles x rows g, g + 8) across the 8
  // lanes that share lane % 4. Reduce over them with xor 4, 8, 16.
  const int num_chunks = gridDim.x;
#pragma unroll
  for (int nt = 0; nt < 4; ++nt) {
#pragma unroll
    for (int odd = 0; odd < 2; ++odd) {
      float mx = -INFINITY;
      float x[8];
#pragma unroll
      for (int mt = 0; mt < 4; ++mt) {
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const int v = v0 + mt * 16 + lane / 4 + 8 * half;
          const float val = v < vocab ? acc[mt][nt][2 * half + odd] : -INFINITY;
          x[mt * 2 + half] = val;
          mx = fmaxf(mx, val);
        }
      }
#pragma unroll
      for (int offset = 4; offset < 32; offset <<= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, offset));
      const float base = mx == -INFINITY ? 0.f : mx;
      float sum = 0.f;
#pragma unroll
      for (int e = 0; e < 8; ++e) sum += __expf(x[e] - base);
#pragma unroll
      for (int offset = 4; offset < 32; offset <<= 1) sum += __shfl_xor_sync(0xffffffffu, sum, offset);
      const int r = warp * kRowsPerWarp + nt * 8 + 2 * (lane & 3) + odd;
      if (lane < 4 && r < rows) partials[int64_t(r) * num_chunks + blockIdx.x] = MaxSum{mx, sum};
    }
  }
}

// ---- partials: scalar fallbacks -------------------------------------------------------------------------------

// LM head on CUDA cores: grid ceil(V / 64), 8 warps, warp w owns vocab rows v0 + 8w .. + 8; lanes split H.
template <typename T>
__global__ void __launch_bounds__(kSimpleWarps * 32)
    lm_head_partials_simple_kernel(const T* __restrict__ hidden, int64_t hidden_stride,
                                   const T* __restrict__ weight, int64_t weight_stride, int rows, int hidden_size,
                                   int vocab, MaxSum* __restrict__ partials) {
  constexpr int kRowsPerWarpV = kVocabTile / kSimpleWarps;
  __shared__ MaxSum s_part[kSimpleWarps][kMaxBatchRows];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int v_first = blockIdx.x * kVocabTile + warp * kRowsPerWarpV;
  for (int r = 0; r < rows; ++r) {
    const T* h = hidden + r * hidden_stride;
    MaxSum acc{-INFINITY, 0.f};
    for (int i = 0; i < kRowsPerWarpV; ++i) {
      const int v = v_first + i;
      if (v >= vocab) break;
      const T* w = weight + v * weight_stride;
      float dot = 0.f;
      for (int d = lane; d < hidden_size; d += 32) dot += to_float(h[d]) * to_float(w[d]);
      acc = merge(acc, MaxSum{warp_sum(dot), 1.f});
    }
    if (lane == 0) s_part[warp][r] = acc;
  }
  __syncthreads();
  for (int r = threadIdx.x; r < rows; r += blockDim.x) {
    MaxSum acc{-INFINITY, 0.f};
#pragma unroll
    for (int w = 0; w < kSimpleWarps; ++w) acc = merge(acc, s_part[w][r]);
    partials[int64_t(r) * gridDim.x + blockIdx.x] = acc;
  }
}

// Given logits: grid (ceil(V / 4096), rows), 256 threads, each CTA reduces one row's chunk.
template <typename T>
__global__ void __launch_bounds__(kCombineThreads)
    logits_partials_kernel(const T* __restrict__ logits, int64_t row_stride, int vocab,
                           MaxSum* __restrict__ partials) {
  __shared__ MaxSum scratch[32];
  const int r = blockIdx.y;
  const T* x = logits + r * row_stride;
  const int begin = blockIdx.x * kLogitsChunk;
  const int end = min(begin + kLogitsChunk, vocab);
  MaxSum acc{-INFINITY, 0.f};
  for (int v = begin + threadIdx.x; v < end; v += blockDim.x) acc = merge(acc, MaxSum{to_float(x[v]), 1.f});
  acc = block_merge(acc, scratch);
  if (threadIdx.x == 0) partials[int64_t(r) * gridDim.x + blockIdx.x] = acc;
}

// ---- combine ----------------------------------------------------------------------------------------------------

// One CTA per row. logprobs doubles as scratch for the raw label logits between the two phases.
template <typename T>
__global__ void __launch_bounds__(kCombineThreads)
    combine_kernel(const MaxSum* __restrict__ partials, int num_chunks, const T* __restrict__ hidden,
                   int64_t hidden_stride, const T* __restrict__ weight, int64_t weight_stride, int hidden_size,
                   int vocab, const int32_t* __restrict__ labels, int num_labels, float* __restrict__ logprobs,
                   float* __restrict__ label_softmax, float* __restrict__ logz) {
  __shared__ MaxSum merge_scratch[32];
  __shared__ float scratch[32];
  const int r = blockIdx.x;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, warps = blockDim.x / 32;

  MaxSum acc{-INFINITY, 0.f};
  for (int c = threadIdx.x; c < num_chunks; c += blockDim.x) acc = merge(acc, partials[int64_t(r) * num_chunks + c]);
  acc = block_merge(acc, merge_scratch);
  const float log_z = acc.m == -INFINITY ? -INFINITY : acc.m + __logf(acc.s);

  const int32_t* row_labels = labels + int64_t(r) * num_labels;
  float* row_logprobs = logprobs + int64_t(r) * num_labels;
  float* row_softmax = label_softmax + int64_t(r) * num_labels;
  const T* h = hidden + r * hidden_stride;
  for (int k = warp; k < num_labels; k += warps) {
    const int label = row_labels[k];
    float logit = -INFINITY;  // padding (label < 0); out-of-range ids are treated the same way
    if (label >= 0 && label < vocab) {
      if (weight != nullptr) {
        const T* w = weight + label * weight_stride;
        float dot = 0.f;
        for (int d = lane; d < hidden_size; d += 32) dot += to_float(h[d]) * to_float(w[d]);
        logit = warp_sum(dot);
      } else {
        logit = to_float(h[label]);
      }
    }
    if (lane == 0) row_logprobs[k] = logit;
  }
  __syncthreads();  // raw logits (global) visible to the whole block

  float mx = -INFINITY;
  for (int k = threadIdx.x; k < num_labels; k += blockDim.x) mx = fmaxf(mx, row_logprobs[k]);
  mx = block_max(mx, scratch);
  const float base = mx == -INFINITY ? 0.f : mx;  // no valid label: all softmax entries become 0
  float sum = 0.f;
  for (int k = threadIdx.x; k < num_labels; k += blockDim.x) sum += __expf(row_logprobs[k] - base);
  sum = block_sum(sum, scratch);
  const float inv = sum > 0.f ? 1.f / sum : 0.f;
  for (int k = threadIdx.x; k < num_labels; k += blockDim.x) {
    const float logit = row_logprobs[k];
    row_softmax[k] = __expf(logit - base) * inv;
    row_logprobs[k] = logit - log_z;  // -inf stays -inf
  }
  if (logz != nullptr && threadIdx.x == 0) logz[r] = log_z;
}

}  // namespace label_cuda
}  // namespace pyscore
