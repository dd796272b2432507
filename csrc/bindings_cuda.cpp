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
        [](Ptr segments, int32_t num_segments, int32_t num_tokens, int32_t num_q_heads, int32_t num_kv_heads,
           int32_t head_dim, const std::string& dtype, uintptr_t workspace, size_t workspace_bytes, uintptr_t stream,
           Ptr cached, Ptr cached_blocks, int32_t num_cached_blocks, int32_t block_tokens) {
          const auto shape = params_from<AttentionPlanParams>(segments, num_segments, num_tokens, num_q_heads,
                                                              num_kv_heads, head_dim, dtype, cached, cached_blocks,
                                                              num_cached_blocks, block_tokens);
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
        [](Ptr q, Ptr k, Ptr v, Ptr o, Strides qs, Strides ks, Strides vs, Strides os, Ptr segments,
           int32_t num_segments, int32_t num_tokens, int32_t num_q_heads, int32_t num_kv_heads, int32_t head_dim,
           float scale, const std::string& dtype, uintptr_t workspace, size_t workspace_bytes, uintptr_t stream,
           Ptr cached, Ptr cached_blocks, int32_t num_cached_blocks, int32_t block_tokens, Ptr cache_k, Ptr cache_v,
           CacheStrides cache_strides) {
          const auto shape = params_from<AttentionPlanParams>(segments, num_segments, num_tokens, num_q_heads,
                                                              num_kv_heads, head_dim, dtype, cached, cached_blocks,
                                                              num_cached_blocks, block_tokens);
          const auto p = params_from<PrefixItemAttentionParams>(shape, q, k, v, o, qs, ks, vs, os, scale, cache_k,
                                                                cache_v, cache_strides);
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
  bind_op(m, "causal_conv1d", causal_conv1d_cuda, causal_conv1d_bind_args{});
  bind_op(m, "gated_delta_rule", gated_delta_rule_cuda, gated_delta_rule_bind_args{});
  bind_op(m, "decode_attention", decode_attention_cuda, decode_attention_bind_args{});
  bind_op(m, "label_logprobs", label_logprobs_cuda, label_logprobs_bind_args{});
  m.def("available", []() {
    int n = 0;
    return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
  }, "True when a CUDA driver and at least one GPU are present");
  m.def("device_count", []() {
    int n = 0;
    return cudaGetDeviceCount(&n) == cudaSuccess ? n : 0;
  });
}
