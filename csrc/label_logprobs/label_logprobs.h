// label_logprobs: for each read-out row r, logits = hidden[r] . weight^T over the whole vocabulary (or given
// logits when weight is null), logZ = logsumexp(logits) computed in one pass with a running max, and for each
// requested label k: logprobs[r, k] = logits[label] - logZ and label_softmax[r, k] = softmax over the row's
// valid labels only. The vocabulary-wide softmax is never written out.
//
// labels is [R, K] int32; an entry < 0 is padding (rows of one batch may ask for different label sets):
// its outputs are written as -inf (logprobs) and 0 (label_softmax). Outputs are fp32. Strides in elements.
//
// With `logits` (CPU only: the CUDA launcher rejects it) every logit is also written out, [R, V] fp32: Generate
// samples from the whole row, and with logz its log-softmax is logits - logZ, so no second pass over the row is
// needed. A row's logits are the ones the label outputs are computed from; they do not depend on the other rows.
// With K = 0 no label output is read or written (labels, logprobs and label_softmax may be null).
//
// With `bf16_weight` (CPU only, dtype fp32): the LM head is bf16 under fp32 hidden rows, what fp32 serving holds a
// bf16 checkpoint's head in. Its values are widened exactly as they are read and every logit is bitwise the one of
// the same weight held in fp32, on the x86 tiers' AVX2 ops (run at every x86 tier from avx2) and the portable loops.
#pragma once
#include <cstdint>

#include "common/dispatch.h"
#include "common/op_args.h"
#include "common/dtype.h"

namespace pyscore {

struct LabelLogprobsParams {
  const void* hidden;  // [R, H] hidden states, or [R, V] logits when weight == nullptr
  int64_t hidden_row_stride;
  const void* weight;  // [V, H] LM head (hidden's dtype, or bf16 with bf16_weight), or nullptr
  int64_t weight_row_stride;
  const int32_t* labels;  // [R, K], row-major, contiguous
  float* logprobs;        // [R, K] out
  float* label_softmax;   // [R, K] out
  float* logz;            // [R] out, may be nullptr
  int32_t num_rows;
  int32_t hidden_size;  // ignored when weight == nullptr
  int32_t vocab_size;
  int32_t num_labels;
  DType dtype;
  float* logits = nullptr;  // [R, V] out (rows logits_row_stride apart), may be nullptr; CPU only
  int64_t logits_row_stride = 0;
  bool bf16_weight = false;  // fp32 hidden rows, a bf16 weight (CPU only)
};

// ---- Launchers ---------------------------------------------------------------------------------------------------
// Launchers for label_logprobs. They return a Status, never throw.

Status label_logprobs_cpu(const LabelLogprobsParams& params);
PYSCORE_BIND(label_logprobs, label_logprobs_cpu, Ptr, int64_t, Ptr, int64_t, Ptr, Ptr, Ptr, Ptr, int32_t, int32_t,
             int32_t, int32_t, DTypeName, Ptr, int64_t, bool);
Status label_logprobs_cuda(const LabelLogprobsParams& params, void* stream);

// ---- The CPU launcher's parts ------------------------------------------------------------------------------------
// Internal interface of the CPU label_logprobs kernel: the launcher (label_logprobs_cpu.cpp, baseline ISA)
// splits the vocabulary over threads and calls these ops on chunks of it; they come from one text (logits_simd.h,
// compiled per vector layer by cmake/cpu_kernels.cmake: AVX2, AVX-512, NEON), the AMX tiles at tier amx
// (label_logprobs_amx.cpp, which reuses the AVX-512 layer's lse_update) and the portable loops.

struct LabelCpuOps {
  // out[r * n + j] = logit of vocabulary entry v0 + j for row r (hidden[r] . weight[v0 + j] with fp32
  // accumulation, or the given logits when weight is null), for all rows r < num_rows and j < n.
  void (*logits_chunk)(const LabelLogprobsParams& p, int32_t v0, int32_t n, float* out);
  // Folds x[0, n) into a running log-sum-exp state: *max and *sum = sum of exp(x - *max) so far.
  void (*lse_update)(const float* x, int32_t n, float* max, float* sum);
  // Optional (null: nothing to do): run by each thread once per call, before its logits_chunk calls, with the
  // call's params (the AMX ops lay the read-out rows out as tiles here, once instead of per chunk).
  void (*prepare)(const LabelLogprobsParams& p) = nullptr;
};

// The layers' ops: AMX tiles for the bf16 LM head product, AVX-512 (key.bf16_dot: how bf16 pairs are multiplied),
// the AVX2 and NEON text (logits_simd.h). key.bf16_weight: a bf16 weight under fp32 rows (dtype float32), which the
// AVX-512, AVX2 and NEON ops read and AMX's do not. nullptr where the key is not covered.
PYSCORE_KERNELS(label_logprobs, label_ops, const LabelCpuOps*);

}  // namespace pyscore
