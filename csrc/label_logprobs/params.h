// label_logprobs: for each read-out row r, logits = hidden[r] . weight^T over the whole vocabulary (or given
// logits when weight is null), logZ = logsumexp(logits) computed in one pass with a running max, and for each
// requested label k: logprobs[r, k] = logits[label] - logZ and label_softmax[r, k] = softmax over the row's
// valid labels only. The vocabulary-wide softmax is never written out.
//
// labels is [R, K] int32; an entry < 0 is padding (rows of one batch may ask for different label sets):
// its outputs are written as -inf (logprobs) and 0 (label_softmax). Outputs are fp32. Strides in elements.
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
};

}  // namespace pyscore
