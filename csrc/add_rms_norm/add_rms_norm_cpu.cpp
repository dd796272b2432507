// CPU add_rms_norm (contract in add_rms_norm.h): rows are independent, so OpenMP threads take contiguous slices of them. The
// arithmetic is in AddRmsNormRows: AVX-512 or AVX2 by the CPU tier, else the portable loop below.
#include <omp.h>

#include <algorithm>

#include "add_rms_norm/add_rms_norm.h"
#include "common/bf16.h"
#include "common/cpu_features.h"
#include "common/rms_portable.h"
#include "common/threads.h"

namespace pyscore {
namespace {

// Below this many elements a parallel region costs more than it saves (decode steps, final norms).
constexpr int64_t kMinParallelElems = 16384;
constexpr int32_t kRowsPerTask = 8;

template <class T>
void rows_portable(const AddRmsNormParams& p, int32_t begin, int32_t end) {
  const T* w = static_cast<const T*>(p.weight);
  for (int32_t t = begin; t < end; ++t) {
    T* x = static_cast<T*>(p.x) + t * p.x_row_stride;
    T* out = static_cast<T*>(p.out) + t * p.out_row_stride;
    if (p.delta) {
      const T* d = static_cast<const T*>(p.delta) + t * p.delta_row_stride;
      for (int32_t i = 0; i < p.hidden_size; ++i) store_f32(x + i, to_f32(x[i]) + to_f32(d[i]));
    }
    const float r = rms_scale(sum_of_squares(x, p.hidden_size), p.hidden_size, p.eps);
    if (p.weight_fp32) {  // one rounding of the fp32 product
      const float* w32 = static_cast<const float*>(p.weight);
      for (int32_t i = 0; i < p.hidden_size; ++i) store_f32(out + i, to_f32(x[i]) * r * w32[i]);
      continue;
    }
    for (int32_t i = 0; i < p.hidden_size; ++i)
      store_f32(out + i, to_f32(w[i]) * round_as(to_f32(x[i]) * r, static_cast<T*>(nullptr)));
  }
}

AddRmsNormRows choose_rows(DType dtype) {
  if (AddRmsNormRows fast = select_kernel<add_rms_norm_rows_kernels>(KernelKey{dtype})) return fast;
  return dtype == DType::kBFloat16 ? rows_portable<uint16_t> : rows_portable<float>;
}

Status check_params(const AddRmsNormParams& p) {
  if (p.dtype != DType::kFloat32 && p.dtype != DType::kBFloat16) return kUnsupportedDType;
  if (p.num_rows < 0 || p.hidden_size <= 0) return kInvalidArgument;
  if (p.num_rows > 0 && (!p.x || !p.weight || !p.out)) return kInvalidArgument;
  return kOk;
}

}  // namespace

Status add_rms_norm_cpu(const AddRmsNormParams& p) {
  const Status status = check_params(p);
  if (status != kOk || p.num_rows == 0) return status;
  const AddRmsNormRows rows = choose_rows(p.dtype);
  const int32_t tasks = (p.num_rows + kRowsPerTask - 1) / kRowsPerTask;
  const bool parallel = int64_t(p.num_rows) * p.hidden_size >= kMinParallelElems;
  // One call per thread on a contiguous slice of whole tasks: `rows` sets up per-slice scratch once.
#pragma omp parallel num_threads(kernel_threads()) if (parallel)
  {
    const int32_t threads = omp_get_num_threads(), t = omp_get_thread_num();
    const int32_t begin = int32_t(int64_t(tasks) * t / threads) * kRowsPerTask;
    const int32_t end = std::min(p.num_rows, int32_t(int64_t(tasks) * (t + 1) / threads) * kRowsPerTask);
    if (begin < end) rows(p, begin, end);
  }
  return kOk;
}

}  // namespace pyscore
