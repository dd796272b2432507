// Device helpers shared by the CUDA kernels: element conversions, warp reductions and the swizzled
// shared-memory tile layout. Only standard CUDA intrinsics here (the inline PTX lives in mma_ptx.cuh), so the
// host-side emulator in tests/emu can compile the kernels that use it unchanged.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

// The kernel's dynamic shared memory as `unsigned char name[]`, 16-byte aligned (cp.async / ldmatrix need it).
#ifndef PYSCORE_DYNAMIC_SMEM
#define PYSCORE_DYNAMIC_SMEM(name) extern __shared__ __align__(16) unsigned char name[]
#endif

namespace pyscore {

template <typename T>
__host__ __device__ constexpr T ceil_div(T a, T b) {
  return (a + b - 1) / b;
}

// ---- element conversions ----------------------------------------------------------------------------

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }

template <typename T>
__device__ __forceinline__ T from_float(float x);
template <>
__device__ __forceinline__ float from_float<float>(float x) { return x; }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }
template <>
__device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }

// Two floats as one b32 register of 16-bit values, `lo` in the low half (= the lower column of an mma
// fragment pair, matching memory order).
template <typename T>
__device__ __forceinline__ uint32_t pack2(float lo, float hi);
template <>
__device__ __forceinline__ uint32_t pack2<__nv_bfloat16>(float lo, float hi) {
  __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);  // .x = lo (low 16 bits), .y = hi
  return *reinterpret_cast<uint32_t*>(&v);
}
template <>
__device__ __forceinline__ uint32_t pack2<__half>(float lo, float hi) {
  __half2 v = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&v);
}

// ---- warp reductions ----------------------------------------------------------------------------------

__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) x += __shfl_xor_sync(0xffffffffu, x, offset);
  return x;
}

__device__ __forceinline__ float warp_max(float x) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, offset));
  return x;
}

// ---- shared-memory tile layout -------------------------------------------------------------------------

// Element offset of (row, col) in a [rows x kCols] tile of 16-bit values stored with the 16-byte chunks of
// each row XOR-swizzled by (row % 8): the 8 row addresses of one ldmatrix (same col, 8 consecutive rows) then
// hit 8 different bank groups instead of one. kCols must be a multiple of 64 (>= 8 chunks per row) so the
// XOR stays inside the row; col must be a multiple of 8 for 16-byte accesses.
template <int kCols>
__device__ __forceinline__ int swizzle(int row, int col) {
  static_assert(kCols % 64 == 0, "swizzled tiles need at least 8 16-byte chunks per row");
  return row * kCols + ((((col >> 3) ^ (row & 7))) << 3) + (col & 7);
}

}  // namespace pyscore
