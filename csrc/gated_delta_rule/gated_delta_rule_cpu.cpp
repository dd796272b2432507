// CPU launchers of the linear-attention ops (contracts in gated_delta_rule.h) and their portable arithmetic.
//
// causal_conv1d: tasks are (segment, 16 tokens) over whole rows, the weight transposed to [K][C] fp32 once per call;
// a task resolves the K - 1 input rows before its segment (prefix rows, the caller's tail, or zeros). New tails are
// written in a pass after every output is done, so an aliased tail_in is only overwritten once nothing reads it.
//
// gated_delta_rule: a group is a prefix_length == 0 segment and the items that continue it (the plan's state_slot
// links them). Tasks are (value head, group, 32-column block of the state), in that order: a task runs the
// group's lead segment from zero (or the caller's state), keeps that [Dk, 32] block of S_p, then runs every item
// of the group from a copy of it. The block is 16 KB at Dk = 128, so S_p and the running state stay in L1 while the
// items of that head run; S_p is read-only once the lead segment is done. A group's column blocks run back to back,
// so the q and k rows they all read come from L2 rather than L3 or DRAM (16 sequences of 300 tokens in fp32: the
// rule 1.2-1.5x faster than with the groups innermost, bench/results/tiers/kernels/rule_task_order_ab.txt).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "common/bf16.h"
#include "common/cpu_features.h"
#include "common/threads.h"
#include "gated_delta_rule/gated_delta_rule.h"

namespace pyscore {
namespace {

struct Segment {
  int32_t start, length, prefix_start, prefix_length;
};

inline Segment segment_at(const int32_t* table, int32_t s) {
  const int32_t* r = table + 4 * int64_t(s);
  return {r[0], r[1], r[2], r[3]};
}

// ---- portable arithmetic --------------------------------------------------------------------------------------

inline float silu(float x) { return x / (1.0f + std::exp(-x)); }

template <class T>
void conv_tokens_portable(const CausalConv1dParams& p, int32_t start, int32_t j0, int32_t j1,
                          const void* const* history, const float* wt) {
  const T* tag = nullptr;
  const int32_t taps = p.kernel_size, channels = p.channels;
  const T* x = static_cast<const T*>(p.x);
  std::vector<float> acc(channels);
  for (int32_t j = j0; j < j1; ++j) {
    std::fill(acc.begin(), acc.end(), 0.0f);
    for (int32_t i = 0; i < taps; ++i) {
      const int32_t pos = j - (taps - 1) + i;
      const T* row = pos >= 0 ? x + int64_t(start + pos) * p.x_token_stride
                              : static_cast<const T*>(history[pos + taps - 1]);
      if (!row) continue;
      const float* w = wt + int64_t(i) * channels;
      for (int32_t c = 0; c < channels; ++c) acc[c] += w[c] * to_f32(row[c]);
    }
    T* y = static_cast<T*>(p.y) + int64_t(start + j) * p.y_token_stride;
    for (int32_t c = 0; c < channels; ++c) store_f32(y + c, silu(round_as(acc[c], tag)));
  }
}

inline float softplus(float x) { return x > 20.0f ? x : std::log1p(std::exp(x)); }

// x * rsqrt(sum x^2 + 1e-6) * extra, into out (fp32); the sum in 16 interleaved partials, as the AVX-512 lanes.
template <class T>
void l2_normalized(const T* x, int32_t n, float extra, float* out) {
  float part[16] = {};
  for (int32_t i = 0; i < n; ++i) part[i % 16] += to_f32(x[i]) * to_f32(x[i]);
  float sum = 0.0f;
  for (float s : part) sum += s;
  const float r = 1.0f / std::sqrt(sum + 1e-6f);
  for (int32_t i = 0; i < n; ++i) out[i] = to_f32(x[i]) * r * extra;
}

template <class T>
void state_columns_portable(const GatedDeltaRuleParams& p, int32_t head, int32_t col0, int32_t cols, int32_t start,
                            int32_t length, StateRows rows) {
  const float* state = rows.in;  // the state this token starts from; after the first token, rows.out
  const int32_t dk = p.k_dim, k_head = head / (p.num_v_heads / p.num_k_heads);
  const float a_exp = std::exp(p.a_log[head]), dt_bias = p.dt_bias[head];
  float qn[kMaxKeyDim], kn[kMaxKeyDim], delta[kStateCols], out[kStateCols];
  for (int32_t t = start; t < start + length; ++t) {
    l2_normalized(static_cast<const T*>(p.q) + t * p.q_token_stride + k_head * p.q_head_stride, dk, p.scale, qn);
    l2_normalized(static_cast<const T*>(p.k) + t * p.k_token_stride + k_head * p.k_head_stride, dk, 1.0f, kn);
    const float a = to_f32(static_cast<const T*>(p.a)[t * p.a_token_stride + head]);
    const float b = to_f32(static_cast<const T*>(p.b)[t * p.b_token_stride + head]);
    const float decay = std::exp(-a_exp * softplus(a + dt_bias));
    const float beta = 1.0f / (1.0f + std::exp(-b));
    const T* v = static_cast<const T*>(p.v) + t * p.v_token_stride + head * p.v_head_stride + col0;
    for (int32_t c = 0; c < cols; ++c) delta[c] = 0.0f;  // holds S^T k^ first
    for (int32_t i = 0; i < dk; ++i) {
      const float* row = state + i * rows.stride;
      float* decayed = rows.out + i * rows.stride;
      for (int32_t c = 0; c < cols; ++c) {
        decayed[c] = row[c] * decay;
        delta[c] += kn[i] * decayed[c];
      }
    }
    for (int32_t c = 0; c < cols; ++c) {
      delta[c] = (to_f32(v[c]) - delta[c]) * beta;
      out[c] = 0.0f;
    }
    for (int32_t i = 0; i < dk; ++i) {
      float* row = rows.out + i * rows.stride;
      for (int32_t c = 0; c < cols; ++c) {
        row[c] += kn[i] * delta[c];
        out[c] += qn[i] * row[c];
      }
    }
    T* o = static_cast<T*>(p.o) + t * p.o_token_stride + head * p.o_head_stride + col0;
    for (int32_t c = 0; c < cols; ++c) store_f32(o + c, out[c]);
    state = rows.out;
  }
}

ConvTokensRun choose_conv(DType dtype) {
  if (ConvTokensRun fast = select_kernel<conv_tokens_kernels>(KernelKey{dtype})) return fast;
  return dtype == DType::kBFloat16 ? conv_tokens_portable<uint16_t> : conv_tokens_portable<float>;
}

StateColumnsRun choose_state_run(DType dtype) {
  if (StateColumnsRun fast = select_kernel<state_columns_kernels>(KernelKey{dtype})) return fast;
  return dtype == DType::kBFloat16 ? state_columns_portable<uint16_t> : state_columns_portable<float>;
}

inline size_t elem_size(DType dtype) { return dtype == DType::kFloat32 ? 4 : 2; }

// ---- causal_conv1d --------------------------------------------------------------------------------------------

Status check_conv(const CausalConv1dParams& p) {
  if (p.dtype != DType::kFloat32 && p.dtype != DType::kBFloat16) return kUnsupportedDType;
  if (p.num_segments < 0 || p.num_tokens < 0 || p.channels <= 0 || p.kernel_size < 1 ||
      p.kernel_size > kMaxConvKernel) {
    return kInvalidArgument;
  }
  if (p.num_tokens > 0 && (!p.x || !p.y || !p.weight)) return kInvalidArgument;
  if (p.num_segments > 0 && !p.segments) return kInvalidArgument;
  return kOk;
}

// The K - 1 input rows before segment `seg`'s first token, oldest first: prefix rows (an item's), then before them
// the caller's tail (of the segment, or of an item's prefix), or nullptr (zeros).
void history_rows(const CausalConv1dParams& p, int32_t s, const Segment& seg, const void** rows) {
  const int32_t history = p.kernel_size - 1;
  const size_t elem = elem_size(p.dtype);
  const char* tail_in = p.tail_in ? reinterpret_cast<const char*>(p.tail_in[s]) : nullptr;
  for (int32_t i = 0; i < history; ++i) {
    const int32_t back = history - i;  // rows before the first token
    rows[i] = nullptr;
    if (back <= seg.prefix_length) {
      rows[i] = static_cast<const char*>(p.x) +
                (int64_t(seg.prefix_start) + seg.prefix_length - back) * p.x_token_stride * elem;
    } else if (tail_in) {
      rows[i] = tail_in + int64_t(i + seg.prefix_length) * p.channels * elem;
    }
  }
}

// The new tail of segment s: the last K - 1 rows of (history, then the segment), zero-padded, gathered before any is
// written (tail_out may alias tail_in).
void write_tail(const CausalConv1dParams& p, int32_t s) {
  const Segment seg = segment_at(p.segments, s);
  const int32_t history = p.kernel_size - 1;
  const size_t row_bytes = size_t(p.channels) * elem_size(p.dtype);
  const void* rows[kMaxConvKernel];
  history_rows(p, s, seg, rows);
  std::vector<char> tail(size_t(history) * row_bytes, 0);
  for (int32_t i = 0; i < history; ++i) {
    const int32_t pos = seg.length - history + i;  // relative to the segment's first token
    const char* row = pos >= 0 ? static_cast<const char*>(p.x) + (int64_t(seg.start) + pos) * p.x_token_stride *
                                                                      int64_t(elem_size(p.dtype))
                               : static_cast<const char*>(rows[pos + history]);
    if (row) std::memcpy(tail.data() + i * row_bytes, row, row_bytes);
  }
  std::memcpy(reinterpret_cast<void*>(p.tail_out[s]), tail.data(), tail.size());
}

// ---- gated_delta_rule -----------------------------------------------------------------------------------------

Status check_rule(const GatedDeltaRuleParams& p) {
  if (p.dtype != DType::kFloat32 && p.dtype != DType::kBFloat16) return kUnsupportedDType;
  if (p.num_k_heads <= 0 || p.num_v_heads <= 0 || p.num_v_heads % p.num_k_heads || p.v_dim <= 0 ||
      p.num_segments < 0 || p.num_tokens < 0 || p.num_slots < 0) {
    return kInvalidArgument;
  }
  if (p.k_dim <= 0 || p.k_dim > kMaxKeyDim) return kUnsupportedHeadDim;
  if (p.num_tokens > 0 && (!p.q || !p.k || !p.v || !p.a || !p.b || !p.o)) return kInvalidArgument;
  if (!p.a_log || !p.dt_bias || (p.num_segments > 0 && (!p.segments || !p.state_slot))) return kInvalidArgument;
  return kOk;
}

struct Group {
  int32_t lead;
  std::vector<int32_t> items;
};

bool snapshot_of(const GatedDeltaRuleParams& p, int32_t s) { return p.state_snap && p.state_snap[s]; }

// Groups from the plan; false when a slot is out of range, an item's slot has no lead segment or a snapshot is not
// inside a segment without a prefix.
bool plan_groups(const GatedDeltaRuleParams& p, std::vector<Group>* groups) {
  std::vector<int32_t> group_of_slot(p.num_slots, -1);
  for (int32_t s = 0; s < p.num_segments; ++s) {
    const Segment seg = segment_at(p.segments, s);
    if (snapshot_of(p, s) && (!p.snap_at || seg.prefix_length > 0 || p.snap_at[s] < 1 || p.snap_at[s] > seg.length)) {
      return false;
    }
    if (seg.prefix_length > 0) continue;
    const int32_t slot = p.state_slot[s];
    if (slot >= p.num_slots || (slot >= 0 && group_of_slot[slot] >= 0)) return false;
    if (slot >= 0) group_of_slot[slot] = int32_t(groups->size());
    groups->push_back({s, {}});
  }
  for (int32_t s = 0; s < p.num_segments; ++s) {
    if (segment_at(p.segments, s).prefix_length == 0) continue;
    const int32_t slot = p.state_slot[s];
    if (slot < 0 || slot >= p.num_slots || group_of_slot[slot] < 0) return false;
    (*groups)[group_of_slot[slot]].items.push_back(s);
  }
  return true;
}

// Copies columns [col0, col0 + cols) of a full [Dk, Dv] state to or from a [Dk, kStateCols] block.
void load_block(const float* full, const GatedDeltaRuleParams& p, int32_t head, int32_t col0, int32_t cols,
                float* block) {
  const float* src = full + int64_t(head) * p.k_dim * p.v_dim + col0;
  for (int32_t i = 0; i < p.k_dim; ++i) std::memcpy(block + i * kStateCols, src + int64_t(i) * p.v_dim, cols * 4);
}

void store_block(const float* block, const GatedDeltaRuleParams& p, int32_t head, int32_t col0, int32_t cols,
                 float* full) {
  float* dst = full + int64_t(head) * p.k_dim * p.v_dim + col0;
  for (int32_t i = 0; i < p.k_dim; ++i) std::memcpy(dst + int64_t(i) * p.v_dim, block + i * kStateCols, cols * 4);
}

// Runs segment s for (head, columns) from `state` (updated to its end state) and writes state_snap (in two runs
// split there: the same token-sequential steps) and state_out if asked.
void run_segment(const GatedDeltaRuleParams& p, StateColumnsRun run, int32_t s, int32_t head, int32_t col0,
                 int32_t cols, float* state) {
  const Segment seg = segment_at(p.segments, s);
  const int32_t at = snapshot_of(p, s) ? p.snap_at[s] : 0;
  const StateRows block{state, state, kStateCols};
  if (at > 0) {
    run(p, head, col0, cols, seg.start, at, block);
    store_block(state, p, head, col0, cols, reinterpret_cast<float*>(p.state_snap[s]));
  }
  if (seg.length > at) run(p, head, col0, cols, seg.start + at, seg.length - at, block);
  if (p.state_out && p.state_out[s]) store_block(state, p, head, col0, cols, reinterpret_cast<float*>(p.state_out[s]));
}

// A decode step's sequence runs on its states' columns where they lie (StateRows with stride Dv): one segment
// without items or a snapshot, its own state_in and state_out (which may alias), and a whole block of columns (the
// kernels touch all kStateCols of a row). The arithmetic is the block's, so the bits are too.
bool runs_in_place(const GatedDeltaRuleParams& p, const Group& g, int32_t cols) {
  return g.items.empty() && cols == kStateCols && !snapshot_of(p, g.lead) && p.state_in && p.state_in[g.lead] &&
         p.state_out && p.state_out[g.lead];
}

void rule_task(const GatedDeltaRuleParams& p, StateColumnsRun run, const Group& g, int32_t head, int32_t col0,
               int32_t cols, float* state, float* prefix_state) {
  if (runs_in_place(p, g, cols)) {
    const Segment seg = segment_at(p.segments, g.lead);
    const int64_t at = int64_t(head) * p.k_dim * p.v_dim + col0;
    const float* in = reinterpret_cast<const float*>(p.state_in[g.lead]) + at;
    float* out = reinterpret_cast<float*>(p.state_out[g.lead]) + at;
    const bool aligned = reinterpret_cast<uintptr_t>(out) % 64 == 0 && p.v_dim % 16 == 0;
    run(p, head, col0, cols, seg.start, seg.length, {in, out, p.v_dim, seg.length == 1 && in != out && aligned});
    return;
  }
  const size_t block = size_t(p.k_dim) * kStateCols;
  std::fill(prefix_state, prefix_state + block, 0.0f);  // also the unused columns of a narrow last block
  if (p.state_in && p.state_in[g.lead]) {
    load_block(reinterpret_cast<const float*>(p.state_in[g.lead]), p, head, col0, cols, prefix_state);
  }
  run_segment(p, run, g.lead, head, col0, cols, prefix_state);  // prefix_state now holds S_p
  for (int32_t item : g.items) {
    std::memcpy(state, prefix_state, block * sizeof(float));
    run_segment(p, run, item, head, col0, cols, state);
  }
}

}  // namespace

Status causal_conv1d_cpu(const CausalConv1dParams& p) {
  const Status status = check_conv(p);
  if (status != kOk || p.num_segments == 0) return status;
  const ConvTokensRun run = choose_conv(p.dtype);
  const int32_t taps = p.kernel_size, channels = p.channels;
  std::vector<float> wt(size_t(taps) * channels);  // [K][C] fp32
  for (int32_t c = 0; c < channels; ++c) {
    for (int32_t i = 0; i < taps; ++i) {
      const int64_t at = int64_t(c) * taps + i;
      wt[size_t(i) * channels + c] = p.dtype == DType::kBFloat16
                                         ? bf16_to_f32(static_cast<const uint16_t*>(p.weight)[at])
                                         : static_cast<const float*>(p.weight)[at];
    }
  }
  std::vector<std::pair<int32_t, int32_t>> tasks;  // (segment, first token of the chunk)
  for (int32_t s = 0; s < p.num_segments; ++s) {
    for (int32_t j = 0; j < segment_at(p.segments, s).length; j += kConvTokens) tasks.emplace_back(s, j);
  }
  const bool parallel = int64_t(p.num_tokens) * channels >= 16384;
#pragma omp parallel for num_threads(kernel_threads()) schedule(dynamic) if (parallel)
  for (size_t t = 0; t < tasks.size(); ++t) {
    const auto [s, j0] = tasks[t];
    const Segment seg = segment_at(p.segments, s);
    const void* rows[kMaxConvKernel];
    history_rows(p, s, seg, rows);
    run(p, seg.start, j0, std::min(seg.length, j0 + kConvTokens), rows, wt.data());
  }
  if (p.tail_out && taps > 1) {
    for (int32_t s = 0; s < p.num_segments; ++s) {
      if (p.tail_out[s]) write_tail(p, s);
    }
  }
  return kOk;
}

Status gated_delta_rule_cpu(const GatedDeltaRuleParams& p) {
  Status status = check_rule(p);
  if (status != kOk || p.num_segments == 0) return status;
  std::vector<Group> groups;
  if (!plan_groups(p, &groups)) return kInvalidArgument;
  const StateColumnsRun run = choose_state_run(p.dtype);
  const int32_t col_blocks = (p.v_dim + kStateCols - 1) / kStateCols;
  const int64_t per_head = int64_t(col_blocks) * int64_t(groups.size());
  const int64_t tasks = per_head * p.num_v_heads;
  const size_t block = size_t(p.k_dim) * kStateCols;
#pragma omp parallel num_threads(kernel_threads()) if (p.num_tokens > 1 || tasks > 1)
  {
    std::vector<float> buffers(2 * block);
#pragma omp for schedule(dynamic)
    for (int64_t task = 0; task < tasks; ++task) {  // head, then group, then column block
      const int32_t head = int32_t(task / per_head);
      const Group& g = groups[task % per_head / col_blocks];
      const int32_t col0 = int32_t(task % col_blocks) * kStateCols;
      rule_task(p, run, g, head, col0, std::min(kStateCols, p.v_dim - col0), buffers.data(), buffers.data() + block);
    }
  }
  return kOk;
}

}  // namespace pyscore
