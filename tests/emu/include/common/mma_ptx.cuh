// Emulator version of csrc/common/mma_ptx.cuh: same functions, implemented from the PTX ISA's definitions
// (see the layout table at the top of the real header) as warp collectives over cuda_emu.h's exchange slots.
#pragma once
#include <cstdint>
#include <cstring>
#include <type_traits>

namespace pyscore {

// cp.async completes immediately here, so commit / wait are no-ops; missing __syncthreads around buffer
// reuse still shows up as corrupted tiles because the copy lands while other threads may be reading.
inline void cp_async_16(void* smem_dst, const void* gmem_src, bool valid) {
  if (valid) {
    std::memcpy(smem_dst, gmem_src, 16);
  } else {
    std::memset(smem_dst, 0, 16);
  }
}
inline void cp_async_commit() {}
template <int N>
inline void cp_async_wait() {}

namespace emu_detail {

inline uint16_t load_u16(uint64_t row_address, int element) {
  uint16_t v;
  std::memcpy(&v, reinterpret_cast<const unsigned char*>(row_address) + 2 * element, 2);
  return v;
}

// lanes 8i..8i+7 give the rows of matrix i; lane receives (row g, cols 2c, 2c+1) of matrix i, or transposed
// (rows 2c, 2c+1, col g).
inline void ldmatrix(uint32_t (&r)[4], const void* row, bool trans) {
  ::emu::my_slot()[0] = reinterpret_cast<uint64_t>(row);
  ::emu::sync_warp();
  const int g = ::emu::lane() / 4, c = ::emu::lane() % 4;
  for (int i = 0; i < 4; ++i) {
    uint16_t lo, hi;
    if (!trans) {
      const uint64_t addr = ::emu::slot_of(8 * i + g)[0];
      lo = load_u16(addr, 2 * c);
      hi = load_u16(addr, 2 * c + 1);
    } else {
      lo = load_u16(::emu::slot_of(8 * i + 2 * c)[0], g);
      hi = load_u16(::emu::slot_of(8 * i + 2 * c + 1)[0], g);
    }
    r[i] = uint32_t(lo) | (uint32_t(hi) << 16);
  }
  ::emu::sync_warp();
}

template <typename T>
float half_to_float(uint16_t bits) {
  T v;
  std::memcpy(&v, &bits, 2);
  if constexpr (sizeof(T) == 2 && std::is_same_v<T, __nv_bfloat16>) {
    return __bfloat162float(v);
  } else {
    return __half2float(v);
  }
}

}  // namespace emu_detail

inline void ldmatrix_x4(uint32_t (&r)[4], const void* smem_row) { emu_detail::ldmatrix(r, smem_row, false); }
inline void ldmatrix_x4_trans(uint32_t (&r)[4], const void* smem_row) { emu_detail::ldmatrix(r, smem_row, true); }

// d += A (16x16) * B (16x8): A element (row, k) lives in lane (row % 8) * 4 + (k % 8) / 2, register
// (row >= 8) + 2 (k >= 8), half k % 2; B element (k, n) in lane n * 4 + (k % 8) / 2, register (k >= 8), half k % 2.
template <typename T>
inline void mma_16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  auto& mine = ::emu::my_slot();
  for (int i = 0; i < 4; ++i) mine[i] = a[i];
  mine[4] = b0;
  mine[5] = b1;
  ::emu::sync_warp();
  const int g = ::emu::lane() / 4, c = ::emu::lane() % 4;
  auto half_of = [](uint64_t reg, int k) { return uint16_t((reg >> (16 * (k % 2))) & 0xffffu); };
  float out[4];
  for (int e = 0; e < 4; ++e) {
    const int row = g + 8 * (e >> 1), col = 2 * c + (e & 1);
    float acc = d[e];
    for (int k = 0; k < 16; ++k) {
      const uint64_t a_reg = ::emu::slot_of((row % 8) * 4 + (k % 8) / 2)[(row >= 8 ? 1 : 0) + (k >= 8 ? 2 : 0)];
      const uint64_t b_reg = ::emu::slot_of(col * 4 + (k % 8) / 2)[4 + (k >= 8 ? 1 : 0)];
      acc += emu_detail::half_to_float<T>(half_of(a_reg, k)) * emu_detail::half_to_float<T>(half_of(b_reg, k));
    }
    out[e] = acc;
  }
  ::emu::sync_warp();
  for (int e = 0; e < 4; ++e) d[e] = out[e];
}

}  // namespace pyscore
