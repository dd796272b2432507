// Portable bf16 <-> fp32 conversions for the scalar code paths (the AVX-512 paths use the hardware ones).
#pragma once
#include <cmath>
#include <cstdint>
#include <cstring>

namespace pyscore {

// Exact: bf16 is the top half of an fp32.
inline float bf16_to_f32(uint16_t x) {
  const uint32_t bits = uint32_t(x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

// Round to nearest even, as the hardware conversion does (NaN stays NaN).
inline uint16_t bf16_from_f32(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof(bits));
  if (std::isnan(f)) return uint16_t((bits >> 16) | 0x40);
  return uint16_t((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16);
}

// Element -> fp32 for templates over the two storage types (uint16_t holds bf16).
inline float to_f32(float x) { return x; }
inline float to_f32(uint16_t x) { return bf16_to_f32(x); }

// fp32 -> element type (the pointer only selects it): store, or the value a store and a reload would give.
inline void store_f32(float* p, float x) { *p = x; }
inline void store_f32(uint16_t* p, float x) { *p = bf16_from_f32(x); }
inline float round_as(float x, const float*) { return x; }
inline float round_as(float x, const uint16_t*) { return bf16_to_f32(bf16_from_f32(x)); }

}  // namespace pyscore
