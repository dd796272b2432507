// pyscore._C_cuda: binds the CUDA launchers. Compiled by the host compiler; links cudart statically, so the
// module imports on machines with no driver: `available()` then answers False and the CPU path runs.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cuda_runtime_api.h>

#include "common/bind_args.h"
#include "label_logprobs/launch.h"
#include "prefix_item_attention/launch.h"

namespace py = pybind11;
using namespace pyscore;

PYBIND11_MODULE(_C_cuda, m) {
  m.doc() = "pyscore CUDA kernels (sm_90a): prefix_item_attention and label_logprobs";
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
           int32_t head_dim, const std::string& dtype, uintptr_t workspace, size_t workspace_bytes, uintptr_t stream) {
          const AttentionPlanParams shape = make_attention_plan_params(segments, num_segments, num_tokens,
                                                                       num_q_heads, num_kv_heads, head_dim, dtype);
          throw_on_error(prefix_item_attention_plan_cuda(shape, reinterpret_cast<void*>(workspace), workspace_bytes,
                                                         reinterpret_cast<void*>(stream)),
                         "prefix_item_attention_plan");
        },
        "Plans the tile work list of a segment table on the device, into the workspace (stream-ordered)");
  m.def("prefix_item_attention",
        [](uintptr_t q, uintptr_t k, uintptr_t v, uintptr_t o, Strides qs, Strides ks, Strides vs, Strides os,
           uintptr_t segments, int32_t num_segments, int32_t num_tokens, int32_t num_q_heads, int32_t num_kv_heads,
           int32_t head_dim, float scale, const std::string& dtype, uintptr_t workspace, size_t workspace_bytes,
           uintptr_t stream) {
          auto p = make_attention_params(q, k, v, o, qs, ks, vs, os, segments, num_segments, num_tokens,
                                         num_q_heads, num_kv_heads, head_dim, scale, dtype_or_throw(dtype));
          throw_on_error(prefix_item_attention_run_cuda(p, reinterpret_cast<const void*>(workspace), workspace_bytes,
                                                        reinterpret_cast<void*>(stream)),
                         "prefix_item_attention");
        },
        "One layer's attention with a workspace planned by prefix_item_attention_plan for the same shape");
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
