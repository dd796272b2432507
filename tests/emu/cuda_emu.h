// A small host-side SIMT emulator, just enough to run the real kernel sources of csrc/ (the *_kernels.cuh
// headers) on a machine without a GPU: every CUDA thread of a block is a std::thread,
// __syncthreads and warp collectives are barriers, `__shared__` variables are statics (blocks run one at a
// time), and common/mma_ptx.cuh is replaced by include/common/mma_ptx.cuh, which implements cp.async, ldmatrix
// and mma.sync from the fragment layouts of the PTX ISA. It checks the kernels' index arithmetic, masks,
// pipelines and reductions; it cannot check timing-dependent hazards the way hardware would, nor the inline
// PTX strings themselves (ptxas compiles those).
//
// Force-included (g++ -include cuda_emu.h) ahead of the kernels; include/ shadows the CUDA headers.
#pragma once
#include <math.h>

#include <algorithm>
#include <array>
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __align__(n) alignas(n)
#define __shared__ static
#define PYSCORE_DYNAMIC_SMEM(name) unsigned char* name = ::emu::dynamic_smem()

struct dim3 {
  unsigned x, y, z;
  dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
};
struct int4 {
  int x, y, z, w;
};
inline int4 make_int4(int x, int y, int z, int w) { return {x, y, z, w}; }
struct int2 {
  int x, y;
};
inline int2 make_int2(int x, int y) { return {x, y}; }
inline int min(int a, int b) { return a < b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }
inline float __expf(float x) { return expf(x); }
inline float __logf(float x) { return logf(x); }

// ---- 16-bit float types (bit-exact storage, round-to-nearest-even conversions) ------------------------------
struct __nv_bfloat16 {
  uint16_t bits;
};
struct __nv_bfloat162 {
  __nv_bfloat16 x, y;
};
struct __half {
  uint16_t bits;
};
struct __half2 {
  __half x, y;
};
inline float __bfloat162float(__nv_bfloat16 v) {
  const uint32_t u = uint32_t(v.bits) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline __nv_bfloat16 __float2bfloat16_rn(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if (std::isnan(f)) return {uint16_t(0x7fc0)};
  u += 0x7fffu + ((u >> 16) & 1u);
  return {uint16_t(u >> 16)};
}
inline __nv_bfloat162 __floats2bfloat162_rn(float lo, float hi) {
  return {__float2bfloat16_rn(lo), __float2bfloat16_rn(hi)};
}
inline float __half2float(__half v) {
  _Float16 h;
  std::memcpy(&h, &v.bits, 2);
  return float(h);
}
inline __half __float2half_rn(float f) {
  const _Float16 h = static_cast<_Float16>(f);
  __half r;
  std::memcpy(&r.bits, &h, 2);
  return r;
}
inline __half2 __floats2half2_rn(float lo, float hi) { return {__float2half_rn(lo), __float2half_rn(hi)}; }

namespace emu {

struct BlockContext {
  std::unique_ptr<std::barrier<>> block_barrier;
  std::vector<std::unique_ptr<std::barrier<>>> warp_barriers;
  std::vector<unsigned char> dynamic_smem;
  std::vector<std::array<std::array<uint64_t, 16>, 32>> exchange;  // [warp][lane][slot]
};

inline BlockContext* g_block = nullptr;
inline dim3 g_block_dim, g_grid_dim;
inline thread_local dim3 t_thread_idx, t_block_idx;

inline unsigned char* dynamic_smem() { return g_block->dynamic_smem.data(); }
inline int lane() { return int(t_thread_idx.x % 32); }
inline int warp() { return int(t_thread_idx.x / 32); }
inline void sync_block() { g_block->block_barrier->arrive_and_wait(); }
inline void sync_warp() { g_block->warp_barriers[warp()]->arrive_and_wait(); }
inline std::array<uint64_t, 16>& my_slot() { return g_block->exchange[warp()][lane()]; }
inline std::array<uint64_t, 16>& slot_of(int l) { return g_block->exchange[warp()][l]; }

// Runs `body` (a call of the kernel with its arguments) for every thread of every block, one block at a time.
// Dynamic shared memory starts filled with 0xff bytes (NaN for 16-bit floats and fp32) so reads of slots the
// kernel never wrote show up in the results.
template <class F>
void launch(dim3 grid, dim3 block, size_t smem_bytes, F&& body) {
  g_grid_dim = grid;
  g_block_dim = block;
  const unsigned threads = block.x;  // the kernels use 1-D blocks of whole warps
  const unsigned warps = threads / 32;
  for (unsigned bz = 0; bz < grid.z; ++bz)
    for (unsigned by = 0; by < grid.y; ++by)
      for (unsigned bx = 0; bx < grid.x; ++bx) {
        BlockContext ctx;
        ctx.block_barrier = std::make_unique<std::barrier<>>(threads);
        for (unsigned w = 0; w < warps; ++w) ctx.warp_barriers.push_back(std::make_unique<std::barrier<>>(32));
        ctx.dynamic_smem.assign(smem_bytes + 16, 0xff);
        ctx.exchange.resize(warps);
        g_block = &ctx;
        std::vector<std::thread> pool;
        pool.reserve(threads);
        for (unsigned t = 0; t < threads; ++t) {
          pool.emplace_back([&, t] {
            t_thread_idx = dim3(t);
            t_block_idx = dim3(bx, by, bz);
            body();
            // A thread that returned no longer takes part in barriers (like an exited CUDA thread).
            g_block->warp_barriers[warp()]->arrive_and_drop();
            g_block->block_barrier->arrive_and_drop();
          });
        }
        for (auto& th : pool) th.join();
        g_block = nullptr;
      }
}

}  // namespace emu

#define threadIdx (::emu::t_thread_idx)
#define blockIdx (::emu::t_block_idx)
#define blockDim (::emu::g_block_dim)
#define gridDim (::emu::g_grid_dim)

inline void __syncthreads() { ::emu::sync_block(); }
inline void __syncwarp(unsigned = 0xffffffffu) { ::emu::sync_warp(); }

template <typename T>
T __shfl_xor_sync(unsigned, T value, int lane_mask) {
  static_assert(sizeof(T) <= 8, "scalar shuffles only");
  std::memcpy(&::emu::my_slot()[0], &value, sizeof(T));
  ::emu::sync_warp();
  T other;
  std::memcpy(&other, &::emu::slot_of(::emu::lane() ^ lane_mask)[0], sizeof(T));
  ::emu::sync_warp();
  return other;
}
