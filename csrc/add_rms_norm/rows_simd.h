// add_rms_norm rows written once against a vector layer `V` (common/vec_avx2.h or common/vec_avx512.h), compiled
// once per layer named below by cmake/cpu_kernels.cmake, which binds `V` and names the entry point. A row is walked
// twice, V::kLanes at a time with ragged ends: the add (stored back rounded, re-read rounded so the statistics see
// exactly the stored residual) with the sum of squares, then the scaling. For bf16 the first walk also keeps the
// rounded row in fp32, and the weight is widened once per slice, so the second walk reads both from L1 without
// widening bf16 again; full pairs of vectors are stored with one shuffle (V::store2). Widening and narrowing bf16
// are shuffle-port ops, the port these loops were bound on (776 x 576 bf16 rows, one thread, AMX Xeon: 238 us a
// call before). Neither changes an operation on a value or its order: the same bits.
// pyscore-vec-layers: avx2 avx512
#pragma once
#include "common/kernel_text.h"
#include "add_rms_norm/add_rms_norm.h"
#include "common/rms_portable.h"

#include <vector>

namespace pyscore {
namespace {

void rows_f32(const AddRmsNormParams& p, int32_t begin, int32_t end) {
  using T = float;
  const T* w = static_cast<const T*>(p.weight);
  const T* tag = nullptr;
  const int32_t n = p.hidden_size;
  for (int32_t t = begin; t < end; ++t) {
    T* x = static_cast<T*>(p.x) + t * p.x_row_stride;
    T* out = static_cast<T*>(p.out) + t * p.out_row_stride;
    const T* d = p.delta ? static_cast<const T*>(p.delta) + t * p.delta_row_stride : nullptr;
    V::Vec acc = V::zero();
    for (int32_t i = 0; i < n; i += V::kLanes) {
      V::Vec v = V::load_n(x + i, n - i);
      if (d) {
        v = V::round_as(V::add(v, V::load_n(d + i, n - i)), tag);
        V::store_n(x + i, v, n - i);
      }
      acc = V::fma(v, v, acc);  // lanes past n are 0
    }
    const V::Vec r = V::set1(rms_scale(V::reduce_add(acc), n, p.eps));
    if (p.weight_fp32) {  // one rounding of the fp32 product
      const float* w32 = static_cast<const float*>(p.weight);
      for (int32_t i = 0; i < n; i += V::kLanes)
        V::store_n(out + i, V::mul(V::mul(V::load_n(x + i, n - i), r), V::load_n(w32 + i, n - i)), n - i);
      continue;
    }
    for (int32_t i = 0; i < n; i += V::kLanes) {
      const V::Vec y = V::round_as(V::mul(V::load_n(x + i, n - i), r), tag);
      V::store_n(out + i, V::mul(V::load_n(w + i, n - i), y), n - i);
    }
  }
}

// The bf16 rows (see the top): `wf` is the weight in fp32 (nullptr with weight_fp32, whose weight is fp32 already),
// `xf` a row of fp32 scratch. The loops take pairs of vectors, then single (ragged) ones.
void rows_bf16(const AddRmsNormParams& p, int32_t begin, int32_t end, const float* wf, float* xf) {
  constexpr int L = V::kLanes;
  const uint16_t* tag = nullptr;
  const int32_t n = p.hidden_size, pairs = n / (2 * L) * (2 * L);
  const float* w = p.weight_fp32 ? static_cast<const float*>(p.weight) : wf;
  for (int32_t t = begin; t < end; ++t) {
    uint16_t* x = static_cast<uint16_t*>(p.x) + t * p.x_row_stride;
    uint16_t* out = static_cast<uint16_t*>(p.out) + t * p.out_row_stride;
    const uint16_t* d = p.delta ? static_cast<const uint16_t*>(p.delta) + t * p.delta_row_stride : nullptr;
    V::Vec acc = V::zero();
    int32_t i = 0;
    for (; i < pairs; i += 2 * L) {
      V::Vec a = V::load(x + i), b = V::load(x + i + L);
      if (d) {
        a = V::round_as(V::add(a, V::load(d + i)), tag);
        b = V::round_as(V::add(b, V::load(d + i + L)), tag);
        V::store2(x + i, a, b);
      }
      V::store2(xf + i, a, b);
      acc = V::fma(b, b, V::fma(a, a, acc));
    }
    for (; i < n; i += L) {
      V::Vec v = V::load_n(x + i, n - i);
      if (d) {
        v = V::round_as(V::add(v, V::load_n(d + i, n - i)), tag);
        V::store_n(x + i, v, n - i);
      }
      V::store_n(xf + i, v, n - i);
      acc = V::fma(v, v, acc);  // lanes past n are 0
    }
    const V::Vec r = V::set1(rms_scale(V::reduce_add(acc), n, p.eps));
    // Llama's recipe: the normalized row rounded, then scaled; with an fp32 weight, one rounding of the product.
    auto scaled = [&](V::Vec v, V::Vec wv) {
      return p.weight_fp32 ? V::mul(V::mul(v, r), wv) : V::mul(wv, V::round_as(V::mul(v, r), tag));
    };
    for (i = 0; i < pairs; i += 2 * L)
      V::store2(out + i, scaled(V::load(xf + i), V::load(w + i)), scaled(V::load(xf + i + L), V::load(w + i + L)));
    for (; i < n; i += L) V::store_n(out + i, scaled(V::load_n(xf + i, n - i), V::load_n(w + i, n - i)), n - i);
  }
}

// Up to this hidden size the bf16 rows' fp32 weight and row live on the stack (32 KiB), beyond it on the heap.
constexpr int32_t kStackHidden = 4096;

void rows_bf16_slice(const AddRmsNormParams& p, int32_t begin, int32_t end) {
  const int32_t n = p.hidden_size;
  alignas(64) float stack[2 * kStackHidden];
  std::vector<float> heap;
  float* buf = stack;
  if (n > kStackHidden) {
    heap.resize(2 * size_t(n));
    buf = heap.data();
  }
  const uint16_t* w = static_cast<const uint16_t*>(p.weight);
  if (!p.weight_fp32)
    for (int32_t i = 0; i < n; i += V::kLanes) V::store_n(buf + i, V::load_n(w + i, n - i), n - i);
  rows_bf16(p, begin, end, buf, buf + n);
}

AddRmsNormRows rows_for(DType dtype) {
  if (dtype == DType::kBFloat16) return rows_bf16_slice;
  if (dtype == DType::kFloat32) return rows_f32;
  return nullptr;
}

}  // namespace

// The entry point add_rms_norm.h declares, named for the layer this text is compiled on (e.g. add_rms_norm_rows_avx2).
AddRmsNormRows PYSCORE_VEC_ENTRY(add_rms_norm_rows)(const KernelKey& key) { return rows_for(key.dtype); }

}  // namespace pyscore
