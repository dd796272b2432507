// pyscore._C_cuda: binds the CUDA launchers. Compiled by the host compiler; links cudart statically, so the
// module imports on machines with no driver: `available()` then answers False and the CPU path runs.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cuda_runtime_api.h>

#include "common/bind_args.h"
#include "decode_attention/decode_attention.h"
#include "gated_delta_rule/gated_delta_rule.h"
#include "label_logprobs/label_logprobs.h"
#include "prefix_item_attention/prefix_item_attention.h"

namespace py = pybind11;
using namespace pyscore;

PYBIND11_MODULE(_C_cuda, m) {
  m.doc() = "pyscore CUDA kernels (sm_90a): prefix_item_attention, decode_attention, label_logprobs, causal_conv1d and "
            "gated_delta_rule";
  m.def("prefix_item_attention_workspace_bytes",
        [](int32_t num_segments, int32_t num_tokens, int32_t num_q_heads, int32_t num_kv_heads) {
          AttentionPlanParams shape{};
          shape.num_segments = num_segments;
          shape.num_tokens = num_tokens;
          shape.num_q_heads = num_q_heads;
          shape.num_kv_heads = num_kv_heads;
          return prefix_item_attention_workspace_bytes_cuda(shape);
        },
        "Bytes of the workspace a plan for this shape needs (allocate once per batch)");
  m.def("prefix_item_attention_plan",
        [](uintptr_t segments, int32_t num_segments, int32_t num_tokens, int32_t num_q_heads, int32_t num_kv_heads,
           int32_t head_dim, const std::string& dtype, uintptr_t workspace, size_t workspace_bytes, uintptr_t stream,
           uintptr_t cached, uintptr_t cached_blocks, int32_t num_cached_blocks, int32_t block_tokens) {
          const AttentionPlanParams shape =
              make_attention_plan_params(segments, num_segments, num_tokens, num_q_heads, num_kv_heads, head_dim,
                                         dtype, cached, cached_blocks, num_cached_blocks, block_tokens);
          throw_on_error(prefix_item_attention_plan_cuda(shape, reinterpret_cast<void*>(workspace), workspace_bytes,
                                                         reinterpret_cast<void*>(stream)),
                         "prefix_item_attention_plan");
        },
        py::arg("segments"), py::arg("num_segments"), py::arg("num_tokens"), py::arg("num_q_heads"),
        py::arg("num_kv_heads"), py::arg("head_dim"), py::arg("dtype"), py::arg("workspace"),
        py::arg("workspace_bytes"), py::arg("stream"), py::arg("cached") = 0, py::arg("cached_blocks") = 0,
        py::arg("num_cached_blocks") = 0, py::arg("block_tokens") = 0,
        "Plans the tile work list of a segment table (and its cached-key tables, device pointers) on the device, "
        "into the workspace (stream-ordered)");
  m.def("prefix_item_attention",
        [](uintptr_t q, uintptr_t k, uintptr_t v, uintptr_t o, Strides qs, Strides ks, Strides vs, Strides os,
           uintptr_t segments, int32_t num_segments, int32_t num_tokens, int32_t num_q_heads, int32_t num_kv_heads,
           int32_t head_dim, float scale, const std::string& dtype, uintptr_t workspace, size_t workspace_bytes,
           uintptr_t stream, uintptr_t cached, uintptr_t cached_blocks, int32_t num_cached_blocks,
           int32_t block_tokens, uintptr_t cache_k, uintptr_t cache_v, CacheStrides cache_strides) {
          auto p = make_attention_params(q, k, v, o, qs, ks, vs, os, segments, num_segments, num_tokens,
                                         num_q_heads, num_kv_heads, head_dim, scale, dtype_or_throw(dtype));
          p.cached = reinterpret_cast<const int32_t*>(cached);
          p.cached_blocks = reinterpret_cast<const int32_t*>(cached_blocks);
          p.num_cached_blocks = num_cached_blocks;
          p.block_tokens = block_tokens;
          set_attention_cache(p, cache_k, cache_v, cache_strides);
          throw_on_error(prefix_item_attention_run_cuda(p, reinterpret_cast<const void*>(workspace), workspace_bytes,
                                                        reinterpret_cast<void*>(stream)),
                         "prefix_item_attention");
        },
        py::arg("q"), py::arg("k"), py::arg("v"), py::arg("o"), py::arg("q_strides"), py::arg("k_strides"),
        py::arg("v_strides"), py::arg("o_strides"), py::arg("segments"), py::arg("num_segments"),
        py::arg("num_tokens"), py::arg("num_q_heads"), py::arg("num_kv_heads"), py::arg("head_dim"), py::arg("scale"),
        py::arg("dtype"), py::arg("workspace"), py::arg("workspace_bytes"), py::arg("stream"), py::arg("cached") = 0,
        py::arg("cached_blocks") = 0, py::arg("num_cached_blocks") = 0, py::arg("block_tokens") = 0,
        py::arg("cache_k") = 0, py::arg("cache_v") = 0, py::arg("cache_strides") = CacheStrides{0, 0, 0},
        "One layer's attention with a workspace planned by prefix_item_attention_plan for the same shape (and the "
        "same cached-key tables); cache_k / cache_v: this layer's cached blocks");
  m.def("causal_conv1d",
        [](uintptr_t x, int64_t x_token_stride, uintptr_t weight, uintptr_t y, int64_t y_token_stride,
           uintptr_t segments, int32_t num_segments, int32_t num_tokens, int32_t channels, int32_t kernel_size,
           uintptr_t tail_in, uintptr_t tail_out, const std::string& dtype, uintptr_t stream) {
          auto p = make_conv_params(x, x_token_stride, weight, y, y_token_stride, segments, num_segments, num_tokens,
                                    channels, kernel_size, tail_in, tail_out, dtype);
          throw_on_error(causal_conv1d_cuda(p, reinterpret_cast<void*>(stream)), "causal_conv1d");
        });
  m.def("gated_delta_rule",
        [](uintptr_t q, Strides qs, uintptr_t k, Strides ks, uintptr_t v, Strides vs, uintptr_t a, int64_t a_stride,
           uintptr_t b, int64_t b_stride, uintptr_t a_log, uintptr_t dt_bias, uintptr_t o, Strides os,
           uintptr_t segments, int32_t num_segments, int32_t num_tokens, uintptr_t state_slot, int32_t num_slots,
           int32_t num_k_heads, int32_t num_v_heads, int32_t k_dim, int32_t v_dim, float scale, uintptr_t state_in,
           uintptr_t state_out, uintptr_t state_snap, uintptr_t snap_at, const std::string& dtype, uintptr_t stream) {
          auto p = make_rule_params(q, qs, k, ks, v, vs, a, a_stride, b, b_stride, a_log, dt_bias, o, os, segments,
                                    num_segments, num_tokens, state_slot, num_slots, num_k_heads, num_v_heads, k_dim,
                                    v_dim, scale, state_in, state_out, state_snap, snap_at, dtype);
          throw_on_error(gated_delta_rule_cuda(p, reinterpret_cast<void*>(stream)), "gated_delta_rule");
        });
  m.def("decode_attention",
        [](uintptr_t q, Strides qs, uintptr_t o, Strides os, uintptr_t k_new, uintptr_t v_new, Strides new_strides,
           uintptr_t k_pool, uintptr_t v_pool, Strides page_strides, int32_t layer, Strides row_strides,
           uintptr_t block_table, int64_t block_table_stride, int32_t block_tokens, uintptr_t lengths,
           int32_t max_length, int32_t num_seqs, int32_t num_q_heads, int32_t num_kv_heads, int32_t head_dim,
           float scale, const std::string& dtype, uintptr_t stream) {
          auto p = make_decode_params(q, qs, o, os, k_new, v_new, new_strides, k_pool, v_pool, page_strides, layer,
                                      row_strides, block_table, block_table_stride, block_tokens, lengths,
                                      max_length, num_seqs, num_q_heads, num_kv_heads, head_dim, scale, dtype);
          throw_on_error(decode_attention_cuda(p, reinterpret_cast<void*>(stream)), "decode_attention");
        });
  m.def("label_logprobs",
        [](uintptr_t hidden, int64_t hidden_row_stride, uintptr_t weight, int64_t weight_row_stride,
           uintptr_t labels, uintptr_t logprobs, uintptr_t label_softmax, uintptr_t logz, int32_t num_rows,
           int32_t hidden_size, int32_t vocab_size, int32_t num_labels, const std::string& dtype, uintptr_t stream) {
          auto p = make_label_params(hidden, hidden_row_stride, weight, weight_row_stride, labels, logprobs,
                                     label_softmax, logz, num_rows, hidden_size, vocab_size, num_labels, dtype);
          throw_on_error(label_logprobs_cuda(p, reinterpret_cast<void*>(stream)), "label_logprobs");
        });
  m.def("available", []() {
    int n = 0;
    return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
  }, "True when a CUDA driver and at least one GPU are present");
  m.def("device_count", []() {
    int n = 0;
    return cudaGetDeviceCount(&n) == cudaSuccess ? n : 0;
  });
}
