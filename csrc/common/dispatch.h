// The one dispatch of the CPU kernels. An op's header declares its kernel families (PYSCORE_KERNELS: op name,
// family, what an entry point returns, nullptr = "not covered"); the ISA code defines one entry point per family and
// vector layer it is built for (PYSCORE_VEC_ENTRY in a kernel text, PYSCORE_ENTRY in an ISA file); and
// cmake/cpu_kernels.cmake reads both and generates the table: for each family its built layers, highest tier first,
// behind select_kernel<family>(key). A launcher asks select_kernel and falls back to its portable loops on nullptr.
//
// A layer serves every tier from its own up (amx: tier amx; avx512: avx512, avx512bf16 and amx; avx2: avx2 and up;
// neon: neon), so a shape the running tier's layer does not cover falls to the next layer below, never past it to
// the other architecture. The key's bf16_dot is the running tier's (cpu_bf16_dot), filled in here.
#pragma once
#include <cstddef>
#include <cstdint>

#include "common/cpu_features.h"
#include "common/dtype.h"

namespace pyscore {

// What an entry point is asked to cover.
struct KernelKey {
  DType dtype = DType::kFloat32;
  int32_t head_dim = 0;        // the attention ops
  bool bf16_weight = false;    // linear, label_logprobs: bf16 weights under fp32 activations
  Bf16Dot bf16_dot = Bf16Dot::kWiden;  // set by select_kernel
};

// The name of a family's entry point on a layer in an ISA file: PYSCORE_ENTRY(linear_ops, avx512) -> linear_ops_avx512.
#define PYSCORE_ENTRY(family, layer) family##_##layer

template <class Family>
typename Family::type select_kernel(KernelKey key);

// Declares a kernel family in its op's header (namespace pyscore): its tag and select_kernel's specialization, which
// the generated table defines.
#define PYSCORE_KERNELS(op, family, result)             \
  struct family##_kernels {                               \
    using type = result;                                  \
    static constexpr const char* op_name = #op;           \
  };                                                      \
  template <>                                             \
  result select_kernel<family##_kernels>(KernelKey key)

// A layer's tier runs at `running`: at or below it on x86; neon only at neon.
inline bool layer_runs(CpuTier layer, CpuTier running) {
  if (layer == CpuTier::kNeon || running == CpuTier::kNeon) return layer == running;
  return static_cast<int>(layer) <= static_cast<int>(running);
}

template <class R>
struct KernelRow {
  CpuTier tier;  // the lowest tier the layer runs at
  R (*entry)(const KernelKey&);
};

// The first row, highest tier first, that runs now and covers the key; R{} (nullptr) when none.
template <class R, size_t N>
R first_covering(const KernelRow<R> (&rows)[N], KernelKey key) {
  const CpuTier running = cpu_tier();
  key.bf16_dot = cpu_bf16_dot();
  for (const KernelRow<R>& row : rows) {
    if (!layer_runs(row.tier, running)) continue;
    if (R found = row.entry(key)) return found;
  }
  return R{};
}

// Whether an entry point covers a dtype at some head size the models use (the table's report, not the dispatch).
template <class R>
bool covers_dtype(R (*entry)(const KernelKey&), DType dtype) {
  for (int32_t head_dim : {64, 128}) {
    KernelKey key;
    key.dtype = dtype, key.head_dim = head_dim;
    if (entry(key)) return true;
  }
  return false;
}

// One built (family, layer) of the generated table, for _C.kernel_table().
struct KernelTableRow {
  const char* op;
  const char* family;
  const char* layer;
  CpuTier tier;
  bool (*covers)(DType);
};

// The generated table's rows (count in *n).
const KernelTableRow* kernel_table(size_t* n);

}  // namespace pyscore
