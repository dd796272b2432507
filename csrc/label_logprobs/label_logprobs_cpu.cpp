// CPU label_logprobs (contract in label_logprobs.h). Each OpenMP thread takes a contiguous slice of the vocabulary and
// walks it in chunks: logits of the chunk for all R rows (a small [R, chunk] fp32 buffer, never [R, V]), fold
// them into the thread's per-row running (max, sum of exp), and pick up the label logits that fall in the chunk.
// The per-thread states are then merged by log-sum-exp. The arithmetic lives in LabelCpuOps: AVX-512 (+BF16) or
// AVX2 + FMA by the CPU tier, else the portable loops below.
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "common/bf16.h"
#include "common/cpu_features.h"
#include "common/threads.h"
#include "common/vec_portable.h"
#include "label_logprobs/label_logprobs.h"

namespace pyscore {
namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();
// Vocabulary entries per chunk: the [R, chunk] logits stay in L1/L2 while they are folded and gathered.
constexpr int32_t kChunk = 256;

// ---- portable ops ----------------------------------------------------------------------------------------
// Loops the compiler vectorizes (common/vec_portable.h): the `generic` tier's code and the `neon` tier's.

// Weight row outer, rows inner: each weight row is read from memory once per chunk and from L1 by every row.
// W is the weight's element (bf16 under fp32 rows with bf16_weight: widened as read, the fp32 weight's bits).
template <class T, class W = T>
void logits_chunk_portable(const LabelLogprobsParams& p, int32_t v0, int32_t n, float* out) {
  const T* h = static_cast<const T*>(p.hidden);
  const W* w = static_cast<const W*>(p.weight);
  for (int32_t j = 0; j < n; ++j) {
    const W* wr = w ? w + int64_t(v0 + j) * p.weight_row_stride : nullptr;
    for (int32_t r = 0; r < p.num_rows; ++r) {
      const T* hr = h + r * p.hidden_row_stride;
      out[int64_t(r) * n + j] = wr ? dot_portable(hr, wr, p.hidden_size) : to_f32(hr[v0 + j]);
    }
  }
}

void lse_update_portable(const float* x, int32_t n, float* max, float* sum) {
  const float m = max_portable(x, n, *max);
  if (m == kNegInf) return;
  const float s = exp_sum(x, n, m);
  *sum = (*max == kNegInf ? 0.0f : *sum * std::exp(*max - m)) + s;
  *max = m;
}

const LabelCpuOps kPortableBf16{logits_chunk_portable<uint16_t>, lse_update_portable};
const LabelCpuOps kPortableF32{logits_chunk_portable<float>, lse_update_portable};
const LabelCpuOps kPortableBf16Weight{logits_chunk_portable<float, uint16_t>, lse_update_portable};

// The running tier's layer (common/dispatch.h); the AVX-512 read-out from tier avx512 up beats the AVX2 text and
// MKL's AVX-512 GEMM there (bench/results/tiers/kernels/kernels_labels_avx512.txt, kernels_avx512_bf16_ab.txt).
const LabelCpuOps& choose_ops(DType dtype, bool bf16_weight) {
  KernelKey key;
  key.dtype = dtype, key.bf16_weight = bf16_weight;
  if (const LabelCpuOps* fast = select_kernel<label_ops_kernels>(key)) return *fast;
  if (bf16_weight) return kPortableBf16Weight;
  return dtype == DType::kBFloat16 ? kPortableBf16 : kPortableF32;
}

// ---- the vocabulary walk ---------------------------------------------------------------------------------

// Per-row log-sum-exp states of every thread: [threads][rows].
struct LseStates {
  std::vector<float> max, sum;
  LseStates(int threads, int rows) : max(size_t(threads) * rows, kNegInf), sum(size_t(threads) * rows, 0.0f) {}
};

void gather_labels(const LabelLogprobsParams& p, int32_t v0, int32_t n, const float* chunk, float* label_logits) {
  for (int32_t r = 0; r < p.num_rows; ++r)
    for (int32_t k = 0; k < p.num_labels; ++k) {
      const int32_t label = p.labels[int64_t(r) * p.num_labels + k];
      if (label >= v0 && label < v0 + n) label_logits[int64_t(r) * p.num_labels + k] = chunk[int64_t(r) * n + label - v0];
    }
}

// This thread's slice of the vocabulary; slice edges on multiples of 16 so tiles rarely see a ragged end.
void walk_slice(const LabelLogprobsParams& p, const LabelCpuOps& ops, int thread, int threads, LseStates& states,
                float* label_logits) {
  const int64_t units = (int64_t(p.vocab_size) + 15) / 16;
  const int32_t begin = int32_t(std::min<int64_t>(units * thread / threads * 16, p.vocab_size));
  const int32_t end = int32_t(std::min<int64_t>(units * (thread + 1) / threads * 16, p.vocab_size));
  thread_local std::vector<float> chunk;
  chunk.resize(size_t(p.num_rows) * kChunk);
  float* max = states.max.data() + int64_t(thread) * p.num_rows;
  float* sum = states.sum.data() + int64_t(thread) * p.num_rows;
  if (ops.prepare && begin < end) ops.prepare(p);
  for (int32_t v0 = begin; v0 < end; v0 += kChunk) {
    const int32_t n = std::min(kChunk, end - v0);
    ops.logits_chunk(p, v0, n, chunk.data());
    for (int32_t r = 0; r < p.num_rows; ++r) ops.lse_update(chunk.data() + int64_t(r) * n, n, max + r, sum + r);
    if (p.logits)
      for (int32_t r = 0; r < p.num_rows; ++r)
        std::memcpy(p.logits + r * p.logits_row_stride + v0, chunk.data() + int64_t(r) * n, size_t(n) * sizeof(float));
    gather_labels(p, v0, n, chunk.data(), label_logits);
  }
}

float merged_logz(const LseStates& states, int threads, int rows, int r) {
  float m = kNegInf;
  for (int t = 0; t < threads; ++t) m = std::max(m, states.max[int64_t(t) * rows + r]);
  if (m == kNegInf) return kNegInf;
  float s = 0.0f;
  for (int t = 0; t < threads; ++t) {
    const float mt = states.max[int64_t(t) * rows + r];
    if (mt != kNegInf) s += states.sum[int64_t(t) * rows + r] * std::exp(mt - m);
  }
  return m + std::log(s);
}

// logprobs = label logit - logZ; label_softmax over the row's valid labels only (padding: -inf and 0).
void write_row(const LabelLogprobsParams& p, int32_t r, float logz, const float* label_logits) {
  if (p.logz) p.logz[r] = logz;
  if (p.num_labels == 0) return;
  const int32_t* labels = p.labels + int64_t(r) * p.num_labels;
  float* logprobs = p.logprobs + int64_t(r) * p.num_labels;
  float* soft = p.label_softmax + int64_t(r) * p.num_labels;
  float m = kNegInf;
  for (int32_t k = 0; k < p.num_labels; ++k)
    if (labels[k] >= 0) m = std::max(m, label_logits[k]);
  float total = 0.0f;
  for (int32_t k = 0; k < p.num_labels; ++k) {
    const bool valid = labels[k] >= 0;
    logprobs[k] = valid ? label_logits[k] - logz : kNegInf;
    soft[k] = valid ? std::exp(label_logits[k] - m) : 0.0f;
    total += soft[k];
  }
  for (int32_t k = 0; k < p.num_labels; ++k) soft[k] = total > 0.0f ? soft[k] / total : 0.0f;
}

Status check_params(const LabelLogprobsParams& p) {
  if (p.dtype != DType::kFloat32 && p.dtype != DType::kBFloat16) return kUnsupportedDType;
  if (p.bf16_weight && (p.dtype != DType::kFloat32 || !p.weight)) return kInvalidArgument;
  if (p.num_rows < 0 || p.num_labels < 0 || p.vocab_size <= 0 || (p.weight && p.hidden_size <= 0))
    return kInvalidArgument;
  if (p.num_rows > 0 && (!p.hidden || (p.num_labels > 0 && (!p.labels || !p.logprobs || !p.label_softmax))))
    return kInvalidArgument;
  if (p.logits && p.logits_row_stride < p.vocab_size) return kInvalidArgument;
  for (int64_t i = 0; i < int64_t(p.num_rows) * p.num_labels; ++i)
    if (p.labels[i] >= p.vocab_size) return kInvalidArgument;
  return kOk;
}

}  // namespace

Status label_logprobs_cpu(const LabelLogprobsParams& p) {
  Status status = check_params(p);
  if (status != kOk || p.num_rows == 0) return status;
  const LabelCpuOps& ops = choose_ops(p.dtype, p.bf16_weight);
  const int max_threads = kernel_threads();
  LseStates states(max_threads, p.num_rows);
  std::vector<float> label_logits(size_t(p.num_rows) * p.num_labels, kNegInf);
  int threads = 1;
#pragma omp parallel num_threads(max_threads)
  {
#pragma omp single
    threads = omp_get_num_threads();
    // (implicit barrier after single: every thread sees the final count before splitting the vocabulary)
    walk_slice(p, ops, omp_get_thread_num(), threads, states, label_logits.data());
  }
  for (int32_t r = 0; r < p.num_rows; ++r)
    write_row(p, r, merged_logz(states, threads, p.num_rows, r), label_logits.data() + int64_t(r) * p.num_labels);
  return kOk;
}

}  // namespace pyscore
