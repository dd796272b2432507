// Internal interface of the CPU decode_attention kernel: the launcher (decode_attention_cpu.cpp, baseline ISA) plans
// (sequence, kv head, key chunk) units and merges their partial states; the arithmetic comes in an AVX-512 build
// (decode_attention_avx512.cpp), an AVX2 one (decode_attention_avx2.cpp) and a portable one.
#pragma once
#include <cstdint>

#include "common/cpu_features.h"
#include "common/dtype.h"
#include "decode_attention/params.h"

namespace pyscore {

struct DecodeCpuOps {
  // `rows` query rows (row r at q + r * q_row_stride) against keys [0, num_keys) in tiles of kCpuKeyTile (key t
  // at k_tiles[t / kCpuKeyTile] + (t % kCpuKeyTile) * token_stride, its value likewise in v_tiles: one tile never
  // straddles two pages): writes the normalized o [rows, D] (fp32) and the natural-log log-sum-exp lse [rows] of
  // the scaled scores. num_keys >= 1.
  void (*attend)(const void* q, int64_t q_row_stride, int32_t rows, const void* const* k_tiles,
                 const void* const* v_tiles, int64_t token_stride, int32_t num_keys, int32_t head_dim, float scale,
                 float* o, float* lse);
  // Writes one fp32 row of `dim` values in the kernel's dtype.
  void (*store_row)(const float* src, int32_t dim, void* dst);
};

// nullptr when the dtype / head_dim is not covered (the caller checks the CPU). bf16_dot: how the AVX-512 ops
// multiply bf16 pairs (kWiden is the one a tier without AVX512-BF16 may run).
const DecodeCpuOps* decode_ops_avx512(DType dtype, int32_t head_dim, Bf16Dot bf16_dot);
const DecodeCpuOps* decode_ops_avx2(DType dtype, int32_t head_dim);

}  // namespace pyscore
