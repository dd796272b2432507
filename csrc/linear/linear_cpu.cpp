// CPU linear (contract in linear.h). The output is cut into rectangles (rows x units of 32 packed columns) over
// OpenMP threads: with enough column units every thread takes a contiguous run of them for all rows, so each
// weight byte is read by one thread once (decode is weight-bandwidth bound); with few columns and many rows the
// rows are split into chunks too. A row's arithmetic never depends on the rectangle it falls in, so the split only
// changes who computes a row, not its bits. The arithmetic lives in LinearCpuOps: the running tier's (AMX tiles, or
// the kernel text linear_simd.h on its vector layer), else the portable loops below over the same packed layout.
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "common/bf16.h"
#include "common/cpu_features.h"
#include "common/threads.h"
#include "linear/linear.h"

namespace pyscore {
namespace {

// Row tile of the vector micro-kernels (and the portable loops, which share their split).
constexpr int32_t kRowTile = 6;

// ---- portable ops ----------------------------------------------------------------------------------------

template <class T>
constexpr int pack_of() { return sizeof(T) == 2 ? 2 : 1; }

template <class W>
float packed_weight(const LinearParams& p, int32_t col, int32_t k) {
  constexpr int P = pack_of<W>();
  const int64_t k_pad = (int64_t(p.k) + P - 1) / P * P;
  const int64_t offset = int64_t(col / kLinearBlockN) * k_pad * kLinearBlockN +
                         (int64_t(k / P) * kLinearBlockN + col % kLinearBlockN) * P + k % P;
  return to_f32(static_cast<const W*>(p.w_packed)[offset]);
}

// T: x's, the residual's and out's type; W: the packed weight's.
template <class T, class W = T>
void rect_portable(const LinearParams& p, int32_t m0, int32_t m1, int32_t c0, int32_t c1) {
  const T* x = static_cast<const T*>(p.x);
  std::vector<float> v(c1 - c0);
  for (int32_t m = m0; m < m1; ++m) {
    const T* row = x + m * p.x_row_stride;
    for (int32_t c = c0; c < c1; ++c) {
      float acc = 0.0f;
      for (int32_t k = 0; k < p.k; ++k) acc += to_f32(row[k]) * packed_weight<W>(p, c, k);
      v[c - c0] = acc + (p.bias ? p.bias[c] : 0.0f);
    }
    for (int32_t c = c0; c < c1; ++c) {
      float y;
      int32_t oc;
      if (p.gated) {
        if (c % kLinearUnitN >= 16) continue;  // up columns are read with their gate column
        const float g = v[c - c0];
        y = g / (1.0f + std::exp(-g)) * v[c + 16 - c0];
        oc = c / kLinearUnitN * 16 + c % 16;
      } else {
        y = v[c - c0];
        oc = c;
      }
      if (oc >= p.n_out) continue;
      if (p.residual) y += to_f32(static_cast<const T*>(p.residual)[m * p.residual_row_stride + oc]);
      store_f32(static_cast<T*>(p.out) + m * p.out_row_stride + oc, y);
    }
  }
}

const LinearCpuOps kPortableBf16{rect_portable<uint16_t>, kRowTile};
const LinearCpuOps kPortableF32{rect_portable<float>, kRowTile};
const LinearCpuOps kPortableBf16Weight{rect_portable<float, uint16_t>, kRowTile};

// The running tier's layer (common/dispatch.h). At tier avx512 the K-blocked AVX-512 FMA kernel beats our AVX2
// kernel and torch's batch-invariant row calls at every bench shape (bench/results/tiers/kernels/linear_avx512_fp32.txt,
// linear_avx512_bf16_ab.txt).
const LinearCpuOps& choose_ops(DType dtype, bool bf16_weight) {
  KernelKey key;
  key.dtype = dtype, key.bf16_weight = bf16_weight;
  if (const LinearCpuOps* fast = select_kernel<linear_ops_kernels>(key)) return *fast;
  if (bf16_weight) return kPortableBf16Weight;
  return dtype == DType::kBFloat16 ? kPortableBf16 : kPortableF32;
}

// ---- work split --------------------------------------------------------------------------------------------

// Packed columns that produce output: all N for plain weights; for gated ones, the units up to the last output.
int32_t needed_columns(const LinearParams& p) {
  return p.gated ? (p.n_out + 15) / 16 * kLinearUnitN : p.n_out;
}

struct Split {
  int32_t row_chunks, row_chunk;  // rows per chunk, a multiple of the row tile
  int32_t units;                  // column units of kLinearUnitN
};

Split make_split(const LinearParams& p, int threads, int32_t row_tile) {
  Split s;
  s.units = (needed_columns(p) + kLinearUnitN - 1) / kLinearUnitN;
  const int32_t tiles = (p.m + row_tile - 1) / row_tile;
  // Two cells per thread at least, so uneven cells balance; rows are split only when columns alone cannot.
  const int32_t chunks = s.units >= 2 * threads ? 1 : std::min(tiles, (2 * threads + s.units - 1) / s.units);
  s.row_chunk = (tiles + chunks - 1) / chunks * row_tile;
  s.row_chunks = (p.m + s.row_chunk - 1) / s.row_chunk;
  return s;
}

// Thread t's share of the cells (unit-major, so a thread's cells share weight panels), as rectangles
// rect(m0, m1, c0, c1).
template <class Rect>
void run_share(const LinearParams& p, Rect rect, const Split& s, int t, int threads) {
  const int64_t cells = int64_t(s.units) * s.row_chunks;
  const int64_t begin = cells * t / threads, end = cells * (t + 1) / threads;
  if (s.row_chunks == 1) {  // one rectangle: all rows, a run of column units
    if (begin < end) rect(0, p.m, int32_t(begin) * kLinearUnitN, int32_t(end) * kLinearUnitN);
    return;
  }
  for (int64_t cell = begin; cell < end; ++cell) {
    const int32_t unit = int32_t(cell / s.row_chunks), chunk = int32_t(cell % s.row_chunks);
    const int32_t m0 = chunk * s.row_chunk, m1 = std::min(p.m, m0 + s.row_chunk);
    rect(m0, m1, unit * kLinearUnitN, (unit + 1) * kLinearUnitN);
  }
}

Status check_params(const LinearParams& p) {
  if (p.dtype != DType::kFloat32 && p.dtype != DType::kBFloat16) return kUnsupportedDType;
  if (p.bf16_weight && p.dtype != DType::kFloat32) return kUnsupportedDType;
  if (p.m < 0 || p.k < 0 || p.n_out < 0 || p.n_packed < 0 || p.n_packed % kLinearBlockN) return kInvalidArgument;
  if (needed_columns(p) > p.n_packed) return kInvalidArgument;
  if (p.m > 0 && p.n_out > 0 && (!p.out || (p.k > 0 && (!p.x || !p.w_packed)))) return kInvalidArgument;
  return kOk;
}

// Points p at a copy of x (of T) with a zero column appended, K odd -> even.
template <class T>
void pad_k(LinearParams& p, std::vector<T>& padded) {
  const int64_t k2 = p.k + 1;
  padded.assign(size_t(p.m) * k2, T(0));
  for (int32_t m = 0; m < p.m; ++m)
    std::memcpy(padded.data() + m * k2, static_cast<const T*>(p.x) + m * p.x_row_stride, p.k * sizeof(T));
  p.x = padded.data();
  p.x_row_stride = k2;
  p.k = int32_t(k2);
}

}  // namespace

Status linear_cpu(const LinearParams& params) {
  Status status = check_params(params);
  if (status != kOk || params.m == 0 || params.n_out == 0) return status;
  LinearParams p = params;
  // bf16 weights work on whole pairs: an odd K runs on a copy of x with a zero column (the packed weight has a zero
  // row there), so every path sees the same even K.
  std::vector<uint16_t> padded_bf16;
  std::vector<float> padded_f32;
  if (p.dtype == DType::kBFloat16 && p.k % 2) pad_k(p, padded_bf16);
  if (p.bf16_weight && p.k % 2) pad_k(p, padded_f32);
  const LinearCpuOps& ops = choose_ops(p.dtype, p.bf16_weight);
  const int threads = kernel_threads();
  const Split split = make_split(p, threads, ops.row_tile);
  const auto rect = [&](int32_t m0, int32_t m1, int32_t c0, int32_t c1) { ops.rect(p, m0, m1, c0, c1); };
#pragma omp parallel num_threads(threads)
  run_share(p, rect, split, omp_get_thread_num(), omp_get_num_threads());
  return kOk;
}

// int8: the rows quantized into one buffer (rows split over the threads), then linear's split over the codes. The
// buffers grow with the call's rows (M x K4 bytes, a quarter of an fp32 x, and M x groups scales) and live as long
// as the thread.
Status linear_int8_cpu(const LinearInt8Params& q) {
  LinearParams p{q.x, q.x_row_stride, q.w_packed, q.bias, q.residual, q.residual_row_stride, q.out,
                 q.out_row_stride, q.m, q.k, q.n_packed, q.n_out, q.gated, q.dtype, false};
  Status status = check_params(p);
  if (status != kOk || q.m == 0 || q.n_out == 0) return status;
  if (q.group < 4 || q.group % 4 || q.group > kInt8MaxGroup) return kInvalidArgument;
  if (q.k > 0 && (!q.w_scale || !q.w_base)) return kInvalidArgument;
  KernelKey key;
  key.dtype = q.dtype;
  const LinearInt8CpuOps* ops = select_kernel<linear_int8_ops_kernels>(key);
  if (!ops) return kUnsupportedDType;  // no int8 layer at this tier: pyscore/ops/linear_int8.py's torch paths
  const int64_t k4 = (int64_t(q.k) + 3) / 4 * 4;
  const int32_t groups = (q.k + q.group - 1) / q.group;
  thread_local std::vector<uint8_t> codes;
  thread_local std::vector<float> scales;
  codes.resize(size_t(q.m) * size_t(k4));
  scales.resize(size_t(q.m) * size_t(groups));
  // Plain pointers into the parallel regions: a thread_local named there is each worker's own (empty) vector.
  uint8_t* const code_rows = codes.data();
  float* const row_scales = scales.data();
  const int threads = kernel_threads();
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int32_t m = 0; m < q.m; ++m) ops->quantize(q, m, m + 1, code_rows, k4, row_scales);
  p.x = code_rows, p.x_row_stride = k4, p.k = int32_t(k4);
  const Int8Scales s{row_scales, q.w_scale, q.w_base, groups, q.group / 4};
  const Split split = make_split(p, threads, ops->row_tile);
  const auto rect = [&](int32_t m0, int32_t m1, int32_t c0, int32_t c1) { ops->rect(p, s, m0, m1, c0, c1); };
#pragma omp parallel num_threads(threads)
  run_share(p, rect, split, omp_get_thread_num(), omp_get_num_threads());
  return kOk;
}

}  // namespace pyscore
