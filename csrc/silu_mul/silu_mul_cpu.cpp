// CPU silu_mul (contract in silu_mul.h): rows are independent, so OpenMP threads take slices of them. The
// arithmetic is in SiluMulRows: AVX-512 or AVX2 by the CPU tier, else the portable loop below.
#include <algorithm>
#include <cmath>

#include "common/bf16.h"
#include "common/cpu_features.h"
#include "common/threads.h"
#include "silu_mul/silu_mul.h"

namespace pyscore {
namespace {

constexpr int64_t kMinParallelElems = 16384;
constexpr int32_t kRowsPerTask = 4;

template <class T>
void rows_portable(const SiluMulParams& p, int32_t begin, int32_t end) {
  const T* tag = nullptr;
  for (int32_t t = begin; t < end; ++t) {
    const T* gate = static_cast<const T*>(p.gate) + t * p.gate_row_stride;
    const T* up = static_cast<const T*>(p.up) + t * p.up_row_stride;
    T* out = static_cast<T*>(p.out) + t * p.out_row_stride;
    for (int32_t i = 0; i < p.width; ++i) {
      const float g = to_f32(gate[i]);
      store_f32(out + i, round_as(g / (1.0f + std::exp(-g)), tag) * to_f32(up[i]));
    }
  }
}

SiluMulRows choose_rows(DType dtype) {
  if (SiluMulRows fast = select_kernel<silu_mul_rows_kernels>(KernelKey{dtype})) return fast;
  return dtype == DType::kBFloat16 ? rows_portable<uint16_t> : rows_portable<float>;
}

Status check_params(const SiluMulParams& p) {
  if (p.dtype != DType::kFloat32 && p.dtype != DType::kBFloat16) return kUnsupportedDType;
  if (p.num_rows < 0 || p.width < 0) return kInvalidArgument;
  if (p.num_rows > 0 && p.width > 0 && (!p.gate || !p.up || !p.out)) return kInvalidArgument;
  return kOk;
}

}  // namespace

Status silu_mul_cpu(const SiluMulParams& p) {
  const Status status = check_params(p);
  if (status != kOk || p.num_rows == 0 || p.width == 0) return status;
  const SiluMulRows rows = choose_rows(p.dtype);
  const int32_t tasks = (p.num_rows + kRowsPerTask - 1) / kRowsPerTask;
  const bool parallel = int64_t(p.num_rows) * p.width >= kMinParallelElems;
#pragma omp parallel for num_threads(kernel_threads()) schedule(static) if (parallel)
  for (int32_t task = 0; task < tasks; ++task)
    rows(p, task * kRowsPerTask, std::min(p.num_rows, (task + 1) * kRowsPerTask));
  return kOk;
}

}  // namespace pyscore
