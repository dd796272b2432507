// The linear-attention layer of Qwen3.5 (Gated DeltaNet) on a packed, unpadded token stream, as two ops that walk
// the segment table of prefix_item_attention ([S, 4]: start, length, prefix_start, prefix_length):
//
//  * causal_conv1d: the depthwise causal convolution (kernel K, no bias) + SiLU over the fused q|k|v projection.
//  * gated_delta_rule: the gated delta rule with an fp32 state per value head.
//
// Two ops, not one: the convolution is channel-parallel and its q/k channels are shared by several value heads
// (GQA-style, Hv = r Hk), the recurrence is head-parallel and sequential in time; fused, the shared channels would
// be convolved r times and their conv tails written by r tasks. The [T, C] intermediate costs one pass over the
// activations, well under 1% of the layer's projection traffic, and is rounded to the dtype as transformers does.
//
// Sequences. A segment with prefix_length == 0 is a sequence of its own (a SIS sequence, or an MIS group's
// prefix): it starts from a zero state and zero conv inputs, unless the caller supplies a state (generation). A
// segment with prefix_length > 0 (an MIS item) continues the sequence of its prefix, which must be another row of
// the table (start == prefix_start, length == prefix_length, prefix_length == 0): it starts from the prefix's end
// state S_p, its conv window reaches back into the prefix's last K-1 inputs (zeros before the prefix's first token,
// exactly as the item's SIS sequence would see, or the prefix's tail_in, given as the item's), and it never changes
// anything the prefix or another item sees.
//
// causal_conv1d, for channel c and a token at position p of its segment's sequence (prefix tokens first):
//   y[t, c] = silu(round(sum_{j < K} w[c, j] * x_seq[p - (K - 1) + j, c]))
// with x_seq before the sequence's first token = the caller's tail (tail_in) or 0, the conv sum rounded to the
// dtype before the SiLU (transformers runs conv1d and silu as two ops in the dtype), SiLU in fp32, rounded again.
//
// gated_delta_rule, for value head h (key head h / (Hv / Hk)) and each token of the sequence in order:
//   q^ = q * rsqrt(sum q^2 + 1e-6) * scale,  k^ = k * rsqrt(sum k^2 + 1e-6)            (fp32, L2 norms)
//   decay = exp(-exp(a_log[h]) * softplus(a[t, h] + dt_bias[h])),  beta = sigmoid(b[t, h])
//   S = decay * S;  S = S + k^ ((v - S^T k^) * beta)^T;  o[t, h] = S^T q^                 (S: [Dk, Dv], fp32)
// softplus(x) = x for x > 20 (torch's threshold). o is rounded to the dtype once.
//
// Strides are in elements; every tensor's last dimension is contiguous.
#pragma once
#include <cstdint>

#include "common/dtype.h"
#include "common/dispatch.h"
#include "common/op_args.h"

namespace pyscore {

// The largest key head dim either device's kernels take (Qwen3.5: 128).
constexpr int32_t kMaxKeyDim = 256;

struct CausalConv1dParams {
  const void* x;  // [T, C] pre-convolution inputs (the q|k|v part of the linear layer's input projection)
  int64_t x_token_stride;
  const void* weight;  // [C, K] contiguous, in the dtype
  void* y;             // [T, C], must not overlap x
  int64_t y_token_stride;
  const int32_t* segments;  // [num_segments, 4]
  int32_t num_segments;
  int32_t num_tokens;
  int32_t channels;     // C
  int32_t kernel_size;  // K, 1..kMaxConvKernel
  // Generation and cached prefixes (optional, nullptr = none), per segment the address of a contiguous [K - 1, C]
  // tail of pre-conv inputs in the dtype, oldest first, or 0. tail_in: the segment's sequence (for an item, its
  // prefix's: the prefix's own tail_in) continues after these inputs instead of zeros. tail_out: receives the last
  // K - 1 inputs of the segment's sequence (zero-padded on the left when the sequence is shorter); it may alias the
  // same segment's tail_in.
  const uint64_t* tail_in;
  const uint64_t* tail_out;
  DType dtype;
};

constexpr int32_t kMaxConvKernel = 8;

struct GatedDeltaRuleParams {
  const void* q;  // [T, Hk, Dk]
  int64_t q_token_stride, q_head_stride;
  const void* k;  // [T, Hk, Dk]
  int64_t k_token_stride, k_head_stride;
  const void* v;  // [T, Hv, Dv]
  int64_t v_token_stride, v_head_stride;
  const void* a;  // [T, Hv] decay input (in_proj_a output)
  int64_t a_token_stride;
  const void* b;  // [T, Hv] update-rate input (in_proj_b output)
  int64_t b_token_stride;
  const float* a_log;    // [Hv]
  const float* dt_bias;  // [Hv]
  void* o;               // [T, Hv, Dv], in the dtype; must not overlap the inputs
  int64_t o_token_stride, o_head_stride;
  const int32_t* segments;  // [num_segments, 4]
  int32_t num_segments;
  int32_t num_tokens;
  // The plan (pyscore.ops.gated_delta_rule.plan_linear_attention), per segment: for a prefix_length == 0 segment,
  // the slot in which its end state is kept for its items (-1: no segment continues it); for a segment with a
  // prefix, the slot of its prefix. Slots are 0..num_slots-1, one per prefix that has items.
  const int32_t* state_slot;
  int32_t num_slots;
  int32_t num_k_heads;
  int32_t num_v_heads;  // a multiple of num_k_heads
  int32_t k_dim;        // Dk
  int32_t v_dim;        // Dv
  float scale;          // applied to q^, usually Dk^-1/2
  // Generation (optional, nullptr = none), per segment the address of a contiguous fp32 [Hv, Dk, Dv] state, or 0.
  // state_in: the (prefix_length == 0) segment starts from it instead of zeros. state_out: receives the segment's
  // end state; it may alias the same segment's state_in.
  const uint64_t* state_in;
  const uint64_t* state_out;
  // Snapshots (optional, nullptr = none): per segment the address of a contiguous fp32 [Hv, Dk, Dv] state, or 0, and
  // snap_at[s], a token count in [1, length]: that (prefix_length == 0) segment's state after its first snap_at[s]
  // tokens goes there (the prefix cache keeps it at a cached block's end: a later pass resumes from it bitwise, the
  // recurrence being token-sequential).
  const uint64_t* state_snap;
  const int32_t* snap_at;
  DType dtype;  // of q, k, v, a, b and o
};

// ---- Launchers ---------------------------------------------------------------------------------------------------
// Launchers for the linear-attention ops. They return a Status, never throw.

Status causal_conv1d_cpu(const CausalConv1dParams& params);
PYSCORE_BIND(causal_conv1d, causal_conv1d_cpu, Ptr, int64_t, Ptr, Ptr, int64_t, Ptr, int32_t, int32_t, int32_t, int32_t,
             Ptr, Ptr, DTypeName);
Status gated_delta_rule_cpu(const GatedDeltaRuleParams& params);
PYSCORE_BIND(gated_delta_rule, gated_delta_rule_cpu, Ptr, Strides, Ptr, Strides, Ptr, Strides, Ptr, int64_t, Ptr,
             int64_t, Ptr, Ptr, Ptr, Strides, Ptr, int32_t, int32_t, Ptr, int32_t, int32_t, int32_t, int32_t, int32_t,
             float, Ptr, Ptr, Ptr, Ptr, DTypeName);
// `stream` is a cudaStream_t passed as void* so this header needs no CUDA include.
Status causal_conv1d_cuda(const CausalConv1dParams& params, void* stream);
Status gated_delta_rule_cuda(const GatedDeltaRuleParams& params, void* stream);

// ---- The CPU launcher's parts ------------------------------------------------------------------------------------
// Internal interface of the CPU linear-attention kernels: the launchers (gated_delta_rule_cpu.cpp, baseline ISA)
// plan the work and call these, which come from one kernel text on each vector layer (gated_delta_rule_simd.h) and
// the portable loops.

// State columns per recurrence task: a [Dk, 32] fp32 block (16 KB at Dk = 128) stays in L1 while a sequence runs.
// The columns of S evolve independently given q, k, decay and beta, so (head, column block) tasks never meet.
constexpr int32_t kStateCols = 32;
// Tokens per convolution task: whole rows of C channels, read in stream order (prefetch-friendly), each row
// reused by the K tokens that need it while it is still in L1 / L2.
constexpr int32_t kConvTokens = 16;

// The rows of a task's state columns: row i (kStateCols floats, which a kernel may all read and write whatever
// `cols` is) lies at in + i * stride before the first token and at out + i * stride after each (in may equal out;
// later tokens read out). They are the launcher's L1 block ([Dk, kStateCols], stride kStateCols), or, for a
// decode step's sequence (one segment, its own state_in and state_out, a whole block of columns), those states'
// columns where they lie (stride Dv): a 1-token run then skips copying the block in and out.
//
// `stream`: out is another buffer than in, the run is one token, and out's rows are 64-byte aligned: a decode step's
// next state, read again only at the next step, by when the step's weights have streamed through the caches. A kernel
// may then store its rows past the caches (non-temporal stores, then a fence), which saves reading each line of out
// before writing it; the values are the same. A kernel may ignore it.
struct StateRows {
  const float* in;
  float* out;
  int64_t stride;
  bool stream = false;
};

// Runs tokens [start, start + length) of value head `head` through the recurrence for state columns
// [col0, col0 + cols), cols <= kStateCols, from the state in `rows` to the end state there; writes o for those
// columns.
using StateColumnsRun = void (*)(const GatedDeltaRuleParams& p, int32_t head, int32_t col0, int32_t cols,
                                 int32_t start, int32_t length, StateRows rows);

// Tokens [j0, j1) of the segment starting at stream token `start`, all channels. `history[i]` is the address of the
// input row at sequence position i - (K - 1) relative to the segment's first token (a prefix row, a tail row, or
// nullptr for a zero input), i < K - 1; the segment's own rows come from p.x. `wt` is the weight transposed to
// [K][C] fp32.
using ConvTokensRun = void (*)(const CausalConv1dParams& p, int32_t start, int32_t j0, int32_t j1,
                               const void* const* history, const float* wt);

// The vector layers' arithmetic; nullptr where the dtype is not covered.
PYSCORE_KERNELS(gated_delta_rule, state_columns, StateColumnsRun);
PYSCORE_KERNELS(causal_conv1d, conv_tokens, ConvTokensRun);

}  // namespace pyscore
