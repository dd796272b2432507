// The flat Python arguments of the bindings (bindings_cpu.cpp, bindings_cuda.cpp): pointers arrive as ints
// (tensor.data_ptr()), taken as Ptr, strides as (token, head) tuples, dtypes by name. The make_*_params functions
// build the params of the ops both modules bind; a CPU-only op's binding fills its params from Ptr arguments itself.
#pragma once
#include <pybind11/pybind11.h>

#include <cstdint>
#include <stdexcept>
#include <string>
#include <tuple>
#include <utility>

#include "decode_attention/decode_attention.h"
#include "gated_delta_rule/gated_delta_rule.h"
#include "label_logprobs/label_logprobs.h"
#include "linear/linear.h"
#include "prefix_item_attention/prefix_item_attention.h"

namespace pyscore {

using Strides = std::pair<int64_t, int64_t>;

// A tensor's address as the Python wrappers pass it (tensor.data_ptr(), an int; 0 for none), typed: it converts to
// whichever pointer a params field holds, so a binding fills its params struct directly (aggregate initialization,
// in the order the op header (csrc/<op>/<op>.h) declares the fields) instead of unpacking uintptr_t by hand in a make_*_params function.
// pybind11 reads it as it reads a uintptr_t (the caster below).
struct Ptr {
  uintptr_t address = 0;
  template <class T>
  operator T*() const { return reinterpret_cast<T*>(address); }
};

inline DType dtype_or_throw(const std::string& name) {
  DType dt;
  if (!parse_dtype(name, &dt)) throw std::invalid_argument("unknown dtype '" + name + "'");
  return dt;
}

inline void throw_on_error(Status status, const char* op) {
  switch (status) {
    case kOk: return;
    case kUnsupportedDType: throw std::invalid_argument(std::string(op) + ": unsupported dtype for this device");
    case kUnsupportedHeadDim: throw std::invalid_argument(std::string(op) + ": unsupported head_dim");
    case kInvalidArgument: throw std::invalid_argument(std::string(op) + ": invalid argument");
    case kOutOfMemory: throw std::runtime_error(std::string(op) + ": out of memory");
    default: throw std::runtime_error(std::string(op) + ": kernel failed with status " + std::to_string(status));
  }
}

// The cached-key tables (prefix_item_attention.h) are optional: cached == 0 means none.
inline AttentionPlanParams make_attention_plan_params(uintptr_t segments, int32_t num_segments, int32_t num_tokens,
                                                      int32_t num_q_heads, int32_t num_kv_heads, int32_t head_dim,
                                                      const std::string& dtype, uintptr_t cached = 0,
                                                      uintptr_t cached_blocks = 0, int32_t num_cached_blocks = 0,
                                                      int32_t block_tokens = 0) {
  AttentionPlanParams s{reinterpret_cast<const int32_t*>(segments), num_segments, num_tokens, num_q_heads,
                        num_kv_heads, head_dim, dtype_or_throw(dtype)};
  s.cached = reinterpret_cast<const int32_t*>(cached);
  s.cached_blocks = reinterpret_cast<const int32_t*>(cached_blocks);
  s.num_cached_blocks = num_cached_blocks;
  s.block_tokens = block_tokens;
  return s;
}

// One layer's cached blocks for a run: (cache_k, cache_v) pointers and (block, token, head) strides in elements.
using CacheStrides = std::tuple<int64_t, int64_t, int64_t>;

inline void set_attention_cache(PrefixItemAttentionParams& p, uintptr_t cache_k, uintptr_t cache_v,
                                CacheStrides strides) {
  p.cache_k = reinterpret_cast<const void*>(cache_k);
  p.cache_v = reinterpret_cast<const void*>(cache_v);
  p.cache_block_stride = std::get<0>(strides);
  p.cache_token_stride = std::get<1>(strides);
  p.cache_head_stride = std::get<2>(strides);
}

inline PrefixItemAttentionParams make_attention_params(
    uintptr_t q, uintptr_t k, uintptr_t v, uintptr_t o, Strides qs, Strides ks, Strides vs, Strides os,
    uintptr_t segments, int32_t num_segments, int32_t num_tokens, int32_t num_q_heads, int32_t num_kv_heads,
    int32_t head_dim, float scale, DType dtype) {
  PrefixItemAttentionParams p{};
  p.q = reinterpret_cast<const void*>(q);
  p.k = reinterpret_cast<const void*>(k);
  p.v = reinterpret_cast<const void*>(v);
  p.o = reinterpret_cast<void*>(o);
  p.q_token_stride = qs.first; p.q_head_stride = qs.second;
  p.k_token_stride = ks.first; p.k_head_stride = ks.second;
  p.v_token_stride = vs.first; p.v_head_stride = vs.second;
  p.o_token_stride = os.first; p.o_head_stride = os.second;
  p.segments = reinterpret_cast<const int32_t*>(segments);
  p.num_segments = num_segments;
  p.num_tokens = num_tokens;
  p.num_q_heads = num_q_heads;
  p.num_kv_heads = num_kv_heads;
  p.head_dim = head_dim;
  p.scale = scale;
  p.dtype = dtype;
  return p;
}

inline DecodeAttentionParams make_decode_params(
    uintptr_t q, Strides qs, uintptr_t o, Strides os, uintptr_t k_new, uintptr_t v_new, Strides new_strides,
    uintptr_t k_pool, uintptr_t v_pool, Strides page_strides, int32_t layer, Strides row_strides,
    uintptr_t block_table, int64_t block_table_stride, int32_t block_tokens, uintptr_t lengths, int32_t max_length,
    int32_t num_seqs, int32_t num_q_heads, int32_t num_kv_heads, int32_t head_dim, float scale,
    const std::string& dtype) {
  DecodeAttentionParams p{};
  p.q = reinterpret_cast<const void*>(q);
  p.q_seq_stride = qs.first; p.q_head_stride = qs.second;
  p.o = reinterpret_cast<void*>(o);
  p.o_seq_stride = os.first; p.o_head_stride = os.second;
  p.k_new = reinterpret_cast<const void*>(k_new);
  p.v_new = reinterpret_cast<const void*>(v_new);
  p.new_seq_stride = new_strides.first; p.new_head_stride = new_strides.second;
  p.k_pool = reinterpret_cast<const void*>(k_pool);
  p.v_pool = reinterpret_cast<const void*>(v_pool);
  p.block_stride = page_strides.first; p.layer_stride = page_strides.second;  // (page, layer)
  p.token_stride = row_strides.first; p.head_stride = row_strides.second;     // (token, kv head)
  p.layer = layer;
  p.block_table = reinterpret_cast<const int32_t*>(block_table);
  p.block_table_stride = block_table_stride;
  p.block_tokens = block_tokens;
  p.lengths = reinterpret_cast<const int32_t*>(lengths);
  p.max_length = max_length;
  p.num_seqs = num_seqs;
  p.num_q_heads = num_q_heads;
  p.num_kv_heads = num_kv_heads;
  p.head_dim = head_dim;
  p.scale = scale;
  p.dtype = dtype_or_throw(dtype);
  return p;
}

inline LabelLogprobsParams make_label_params(
    uintptr_t hidden, int64_t hidden_row_stride, uintptr_t weight, int64_t weight_row_stride, uintptr_t labels,
    uintptr_t logprobs, uintptr_t label_softmax, uintptr_t logz, int32_t num_rows, int32_t hidden_size,
    int32_t vocab_size, int32_t num_labels, const std::string& dtype, uintptr_t logits = 0,
    int64_t logits_row_stride = 0, bool bf16_weight = false) {
  LabelLogprobsParams p{};
  p.hidden = reinterpret_cast<const void*>(hidden);
  p.hidden_row_stride = hidden_row_stride;
  p.weight = reinterpret_cast<const void*>(weight);
  p.weight_row_stride = weight_row_stride;
  p.labels = reinterpret_cast<const int32_t*>(labels);
  p.logprobs = reinterpret_cast<float*>(logprobs);
  p.label_softmax = reinterpret_cast<float*>(label_softmax);
  p.logz = reinterpret_cast<float*>(logz);
  p.num_rows = num_rows;
  p.hidden_size = hidden_size;
  p.vocab_size = vocab_size;
  p.num_labels = num_labels;
  p.dtype = dtype_or_throw(dtype);
  p.logits = reinterpret_cast<float*>(logits);
  p.logits_row_stride = logits_row_stride;
  p.bf16_weight = bf16_weight;
  return p;
}

inline CausalConv1dParams make_conv_params(uintptr_t x, int64_t x_token_stride, uintptr_t weight, uintptr_t y,
                                           int64_t y_token_stride, uintptr_t segments, int32_t num_segments,
                                           int32_t num_tokens, int32_t channels, int32_t kernel_size,
                                           uintptr_t tail_in, uintptr_t tail_out, const std::string& dtype) {
  CausalConv1dParams p{};
  p.x = reinterpret_cast<const void*>(x);
  p.x_token_stride = x_token_stride;
  p.weight = reinterpret_cast<const void*>(weight);
  p.y = reinterpret_cast<void*>(y);
  p.y_token_stride = y_token_stride;
  p.segments = reinterpret_cast<const int32_t*>(segments);
  p.num_segments = num_segments;
  p.num_tokens = num_tokens;
  p.channels = channels;
  p.kernel_size = kernel_size;
  p.tail_in = reinterpret_cast<const uint64_t*>(tail_in);
  p.tail_out = reinterpret_cast<const uint64_t*>(tail_out);
  p.dtype = dtype_or_throw(dtype);
  return p;
}

inline GatedDeltaRuleParams make_rule_params(
    uintptr_t q, Strides qs, uintptr_t k, Strides ks, uintptr_t v, Strides vs, uintptr_t a, int64_t a_token_stride,
    uintptr_t b, int64_t b_token_stride, uintptr_t a_log, uintptr_t dt_bias, uintptr_t o, Strides os,
    uintptr_t segments, int32_t num_segments, int32_t num_tokens, uintptr_t state_slot, int32_t num_slots,
    int32_t num_k_heads, int32_t num_v_heads, int32_t k_dim, int32_t v_dim, float scale, uintptr_t state_in,
    uintptr_t state_out, uintptr_t state_snap, uintptr_t snap_at, const std::string& dtype) {
  GatedDeltaRuleParams p{};
  p.q = reinterpret_cast<const void*>(q);
  p.q_token_stride = qs.first; p.q_head_stride = qs.second;
  p.k = reinterpret_cast<const void*>(k);
  p.k_token_stride = ks.first; p.k_head_stride = ks.second;
  p.v = reinterpret_cast<const void*>(v);
  p.v_token_stride = vs.first; p.v_head_stride = vs.second;
  p.a = reinterpret_cast<const void*>(a);
  p.a_token_stride = a_token_stride;
  p.b = reinterpret_cast<const void*>(b);
  p.b_token_stride = b_token_stride;
  p.a_log = reinterpret_cast<const float*>(a_log);
  p.dt_bias = reinterpret_cast<const float*>(dt_bias);
  p.o = reinterpret_cast<void*>(o);
  p.o_token_stride = os.first; p.o_head_stride = os.second;
  p.segments = reinterpret_cast<const int32_t*>(segments);
  p.num_segments = num_segments;
  p.num_tokens = num_tokens;
  p.state_slot = reinterpret_cast<const int32_t*>(state_slot);
  p.num_slots = num_slots;
  p.num_k_heads = num_k_heads;
  p.num_v_heads = num_v_heads;
  p.k_dim = k_dim;
  p.v_dim = v_dim;
  p.scale = scale;
  p.state_in = reinterpret_cast<const uint64_t*>(state_in);
  p.state_out = reinterpret_cast<const uint64_t*>(state_out);
  p.state_snap = reinterpret_cast<const uint64_t*>(state_snap);
  p.snap_at = reinterpret_cast<const int32_t*>(snap_at);
  p.dtype = dtype_or_throw(dtype);
  return p;
}

inline LinearParams make_linear_params(uintptr_t x, int64_t x_row_stride, uintptr_t w_packed, uintptr_t bias,
                                       uintptr_t residual, int64_t residual_row_stride, uintptr_t out,
                                       int64_t out_row_stride, int32_t m, int32_t k, int32_t n_packed, int32_t n_out,
                                       bool gated, const std::string& dtype, bool bf16_weight = false) {
  LinearParams p{};
  p.x = reinterpret_cast<const void*>(x);
  p.x_row_stride = x_row_stride;
  p.w_packed = reinterpret_cast<const void*>(w_packed);
  p.bias = reinterpret_cast<const float*>(bias);
  p.residual = reinterpret_cast<const void*>(residual);
  p.residual_row_stride = residual_row_stride;
  p.out = reinterpret_cast<void*>(out);
  p.out_row_stride = out_row_stride;
  p.m = m;
  p.k = k;
  p.n_packed = n_packed;
  p.n_out = n_out;
  p.gated = gated;
  p.dtype = dtype_or_throw(dtype);
  p.bf16_weight = bf16_weight;
  return p;
}

}  // namespace pyscore

namespace pybind11::detail {

template <>
struct type_caster<pyscore::Ptr> {
  PYBIND11_TYPE_CASTER(pyscore::Ptr, const_name("int"));
  bool load(handle src, bool convert) {
    make_caster<uintptr_t> address;
    if (!address.load(src, convert)) return false;
    value.address = cast_op<uintptr_t>(address);
    return true;
  }
  static handle cast(pyscore::Ptr p, return_value_policy policy, handle parent) {
    return make_caster<uintptr_t>::cast(p.address, policy, parent);
  }
};

}  // namespace pybind11::detail
