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
#pragma once
#include <cstdint>

#include "common/dtype.h"

namespace pyscore {

struct LabelLogprobsParams {
  const void* hidden;  // [R, H] hidden states, or [R, V] logits when weight == nullptr
  int64_t hidden_row_stride;
  const void* weight;  // [V, H] LM head (same dtype as hidden), or nullptr
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
};

}  // namespace pyscore
