// Internal interface of the CPU prefix_item_attention kernel: the launcher (prefix_item_attention_cpu.cpp,
// baseline ISA) plans the work and calls these ops, which come in an AVX-512 build
// (prefix_item_attention_avx512.cpp; its attend() on AMX tiles at tier amx, prefix_item_attention_amx.cpp), AVX2
// and NEON ones (one text, attention_simd.h, compiled per vector layer by
// cmake/cpu_kernels.cmake) and a portable one, chosen by the CPU tier.
//
// Key ranges are packed once per kv head into blocks of kKeyBlock keys so the micro-kernels read them with
// aligned full-width loads and no masking on the dot-product axis. "Pack" = elements per 4-byte unit (2 for
// bf16, whose dpbf16ps works on pairs; 1 for fp32):
//   K block: [D / pack][kKeyBlock keys][pack]        (pairs along head_dim: one zmm = 16 keys x one pair)
//   V block: [kKeyBlock / pack][D][pack]             (pairs along keys:     one zmm = 16 dims x one pair)
// Padding keys are zero, so masked probabilities (0) never meet garbage values.
#pragma once
#include <cstdint>
#include <cstring>

#include "common/cpu_features.h"
#include "common/dtype.h"
#include "common/isa_entry.h"

namespace pyscore {

constexpr int32_t kKeyBlock = 64;

inline int32_t key_blocks(int32_t num_keys) { return (num_keys + kKeyBlock - 1) / kKeyBlock; }
inline int32_t elem_pack(DType dtype) { return dtype == DType::kBFloat16 ? 2 : 1; }
inline int64_t packed_kv_elems(int32_t num_keys, int32_t head_dim) {
  return int64_t(key_blocks(num_keys)) * kKeyBlock * head_dim;
}

// The fp32 V block is the rows as they are (pack 1), zero rows as padding: the same code for every vector build.
inline void pack_v_f32(const void* v, int64_t token_stride, int32_t n, int32_t head_dim, void* out) {
  auto* dst = static_cast<float*>(out);
  const auto* src = static_cast<const float*>(v);
  const int32_t padded = key_blocks(n) * kKeyBlock;
  for (int32_t j = 0; j < padded; ++j) {
    float* row = dst + int64_t(j) * head_dim;
    if (j < n) std::memcpy(row, src + j * token_stride, head_dim * sizeof(float));
    else std::memset(row, 0, head_dim * sizeof(float));
  }
}

struct AttentionCpuOps {
  // Packs keys [0, n) of one kv head (rows `token_stride` elements apart) into the layouts above.
  void (*pack_k)(const void* k, int64_t token_stride, int32_t n, int32_t head_dim, void* out);
  void (*pack_v)(const void* v, int64_t token_stride, int32_t n, int32_t head_dim, void* out);
  // One partial attention: `rows` query rows (q: [rows, D], contiguous) against a packed key range of
  // `num_keys` keys; row r sees keys [0, limits[r]) (limits == nullptr: all keys; a causal diagonal is
  // limits[r] = its position + 1). Writes the normalized output o [rows, D] (fp32) and the natural-log
  // log-sum-exp of the scaled scores lse [rows] (-inf with o = 0 for a row that sees no key).
  void (*attend)(const void* q, int32_t rows, const int32_t* limits, const void* k_packed, const void* v_packed,
                 int32_t num_keys, int32_t head_dim, float scale, float* o, float* lse);
  // Writes one fp32 row of `dim` values to the output in the kernel's dtype.
  void (*store_row)(const float* src, int32_t dim, void* dst);
};

// nullptr when the dtype/head_dim is not covered by the AVX-512 ops (the caller checks the CPU); bf16_dot picks
// how bf16 pairs are multiplied.
PYSCORE_X86_ENTRY(const AttentionCpuOps* attention_ops_avx512(DType dtype, int32_t head_dim, Bf16Dot bf16_dot));
// AMX tiles for bf16 (tier amx; the caller checks it), the AVX-512 ops' packing: nullptr for other dtypes / head dims.
PYSCORE_X86_ENTRY(const AttentionCpuOps* attention_ops_amx(DType dtype, int32_t head_dim));
PYSCORE_X86_ENTRY(const AttentionCpuOps* attention_ops_avx2(DType dtype, int32_t head_dim));
PYSCORE_ARM_ENTRY(const AttentionCpuOps* attention_ops_neon(DType dtype, int32_t head_dim));
const AttentionCpuOps* attention_ops_portable(DType dtype);

}  // namespace pyscore
