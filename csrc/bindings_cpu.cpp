// pyscore._C: binds the CPU launchers. Only argument plumbing here; the kernels live in their op folders.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <omp.h>

#include <cstdlib>

#include "add_rms_norm/add_rms_norm.h"
#include "common/bind_args.h"
#include "common/cpu_features.h"
#include "common/dispatch.h"
#include "common/merge_state_cpu.h"
#include "common/threads.h"
#include "decode_attention/decode_attention.h"
#include "gated_delta_rule/gated_delta_rule.h"
#include "label_logprobs/label_logprobs.h"
#include "linear/linear.h"
#include "prefix_item_attention/plan_cpu.h"
#include "prefix_item_attention/prefix_item_attention.h"
#include "rotary/rotary.h"
#include "silu_mul/silu_mul.h"

namespace py = pybind11;
using namespace pyscore;

namespace {

// Every kernel runs with the GIL released, the decoder's elementwise ops (tens of microseconds each) too, so the
// server's event loop is never held up by model work; the launcher's status becomes a Python exception.
template <class Launch>
void run_without_gil(const char* op, Launch launch) {
  Status status;
  {
    py::gil_scoped_release release;
    status = launch();
  }
  throw_on_error(status, op);
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "pyscore CPU kernels: prefix_item_attention, decode_attention, label_logprobs, linear, add_rms_norm, "
            "rotary, silu_mul, causal_conv1d, gated_delta_rule";
  // The key tile a KV page must hold whole tiles of (pyscore.ops.segments.CPU_KEY_TILE states it for a process
  // without this module; tests/ops/test_decode_attention.py checks that the two agree). Both attention ops read the
  // same pages, so their page multiples are one constant each for CPU and CUDA.
  static_assert(kCpuCachedBlockMultiple == kCpuKeyTile && kCachedBlockMultiple == kKeyTile,
                "prefix attention and decode attention must accept the same KV pages");
  m.attr("CPU_KEY_TILE") = kCpuKeyTile;
  py::class_<AttentionCpuPlan, std::shared_ptr<AttentionCpuPlan>>(
      m, "AttentionPlan", "prefix_item_attention's plan for one batch (opaque): the segment table read and "
                          "validated, the work listed, the workspaces allocated")
      .def_property_readonly("workspace_bytes", &AttentionCpuPlan::workspace_bytes)
      .def_property_readonly("num_units", [](const AttentionCpuPlan& p) { return p.units.size(); });
  m.def("prefix_item_attention_plan",
        [](uintptr_t segments, int32_t num_segments, int32_t num_tokens, int32_t num_q_heads, int32_t num_kv_heads,
           int32_t head_dim, const std::string& dtype, uintptr_t cached, uintptr_t cached_blocks,
           int32_t num_cached_blocks, int32_t block_tokens) {
          const AttentionPlanParams shape =
              make_attention_plan_params(segments, num_segments, num_tokens, num_q_heads, num_kv_heads, head_dim,
                                         dtype, cached, cached_blocks, num_cached_blocks, block_tokens);
          auto plan = std::make_shared<AttentionCpuPlan>();
          run_without_gil("prefix_item_attention_plan",
                          [&] { return prefix_item_attention_plan_cpu(shape, plan.get()); });
          return plan;
        },
        py::arg("segments"), py::arg("num_segments"), py::arg("num_tokens"), py::arg("num_q_heads"),
        py::arg("num_kv_heads"), py::arg("head_dim"), py::arg("dtype"), py::arg("cached") = 0,
        py::arg("cached_blocks") = 0, py::arg("num_cached_blocks") = 0, py::arg("block_tokens") = 0,
        "Plans a batch: its segment table and, optionally, its cached-key tables (read and copied now)");
  m.def("prefix_item_attention",
        [](AttentionCpuPlan& plan, uintptr_t q, uintptr_t k, uintptr_t v, uintptr_t o, Strides qs, Strides ks,
           Strides vs, Strides os, float scale, uintptr_t cache_k, uintptr_t cache_v, CacheStrides cache_strides) {
          const AttentionPlanParams& s = plan.shape;
          auto p = make_attention_params(q, k, v, o, qs, ks, vs, os, 0, s.num_segments, s.num_tokens, s.num_q_heads,
                                         s.num_kv_heads, s.head_dim, scale, s.dtype);
          set_attention_cache(p, cache_k, cache_v, cache_strides);
          run_without_gil("prefix_item_attention", [&] { return prefix_item_attention_run_cpu(plan, p); });
        },
        py::arg("plan"), py::arg("q"), py::arg("k"), py::arg("v"), py::arg("o"), py::arg("q_strides"),
        py::arg("k_strides"), py::arg("v_strides"), py::arg("o_strides"), py::arg("scale"), py::arg("cache_k") = 0,
        py::arg("cache_v") = 0, py::arg("cache_strides") = CacheStrides{0, 0, 0},
        "One layer's attention with a plan from prefix_item_attention_plan (the tables are read from the plan); "
        "cache_k / cache_v: this layer's cached blocks when the plan has cached keys");
  m.def("causal_conv1d",
        [](uintptr_t x, int64_t x_token_stride, uintptr_t weight, uintptr_t y, int64_t y_token_stride,
           uintptr_t segments, int32_t num_segments, int32_t num_tokens, int32_t channels, int32_t kernel_size,
           uintptr_t tail_in, uintptr_t tail_out, const std::string& dtype) {
          auto p = make_conv_params(x, x_token_stride, weight, y, y_token_stride, segments, num_segments, num_tokens,
                                    channels, kernel_size, tail_in, tail_out, dtype);
          run_without_gil("causal_conv1d", [&] { return causal_conv1d_cpu(p); });
        });
  m.def("gated_delta_rule",
        [](uintptr_t q, Strides qs, uintptr_t k, Strides ks, uintptr_t v, Strides vs, uintptr_t a, int64_t a_stride,
           uintptr_t b, int64_t b_stride, uintptr_t a_log, uintptr_t dt_bias, uintptr_t o, Strides os,
           uintptr_t segments, int32_t num_segments, int32_t num_tokens, uintptr_t state_slot, int32_t num_slots,
           int32_t num_k_heads, int32_t num_v_heads, int32_t k_dim, int32_t v_dim, float scale, uintptr_t state_in,
           uintptr_t state_out, uintptr_t state_snap, uintptr_t snap_at, const std::string& dtype) {
          auto p = make_rule_params(q, qs, k, ks, v, vs, a, a_stride, b, b_stride, a_log, dt_bias, o, os, segments,
                                    num_segments, num_tokens, state_slot, num_slots, num_k_heads, num_v_heads, k_dim,
                                    v_dim, scale, state_in, state_out, state_snap, snap_at, dtype);
          run_without_gil("gated_delta_rule", [&] { return gated_delta_rule_cpu(p); });
        });
  m.def("decode_attention",
        [](uintptr_t q, Strides qs, uintptr_t o, Strides os, uintptr_t k_new, uintptr_t v_new, Strides new_strides,
           uintptr_t k_pool, uintptr_t v_pool, Strides page_strides, int32_t layer, Strides row_strides,
           uintptr_t block_table, int64_t block_table_stride, int32_t block_tokens, uintptr_t lengths,
           int32_t max_length, int32_t num_seqs, int32_t num_q_heads, int32_t num_kv_heads, int32_t head_dim,
           float scale, const std::string& dtype) {
          auto p = make_decode_params(q, qs, o, os, k_new, v_new, new_strides, k_pool, v_pool, page_strides, layer,
                                      row_strides, block_table, block_table_stride, block_tokens, lengths,
                                      max_length, num_seqs, num_q_heads, num_kv_heads, head_dim, scale, dtype);
          run_without_gil("decode_attention", [&] { return decode_attention_cpu(p); });
        });
  m.def("label_logprobs",
        [](uintptr_t hidden, int64_t hidden_row_stride, uintptr_t weight, int64_t weight_row_stride,
           uintptr_t labels, uintptr_t logprobs, uintptr_t label_softmax, uintptr_t logz, int32_t num_rows,
           int32_t hidden_size, int32_t vocab_size, int32_t num_labels, const std::string& dtype, uintptr_t logits,
           int64_t logits_row_stride, bool bf16_weight) {
          auto p = make_label_params(hidden, hidden_row_stride, weight, weight_row_stride, labels, logprobs,
                                     label_softmax, logz, num_rows, hidden_size, vocab_size, num_labels, dtype, logits,
                                     logits_row_stride, bf16_weight);
          run_without_gil("label_logprobs", [&] { return label_logprobs_cpu(p); });
        },
        py::arg("hidden"), py::arg("hidden_row_stride"), py::arg("weight"), py::arg("weight_row_stride"),
        py::arg("labels"), py::arg("logprobs"), py::arg("label_softmax"), py::arg("logz"), py::arg("num_rows"),
        py::arg("hidden_size"), py::arg("vocab_size"), py::arg("num_labels"), py::arg("dtype"), py::arg("logits") = 0,
        py::arg("logits_row_stride") = 0, py::arg("bf16_weight") = false);
  m.def("linear",
        [](uintptr_t x, int64_t x_row_stride, uintptr_t w_packed, uintptr_t bias, uintptr_t residual,
           int64_t residual_row_stride, uintptr_t out, int64_t out_row_stride, int32_t m, int32_t k, int32_t n_packed,
           int32_t n_out, bool gated, const std::string& dtype, bool bf16_weight) {
          auto p = make_linear_params(x, x_row_stride, w_packed, bias, residual, residual_row_stride, out,
                                      out_row_stride, m, k, n_packed, n_out, gated, dtype, bf16_weight);
          run_without_gil("linear", [&] { return linear_cpu(p); });
        });
  m.def("add_rms_norm",
        [](Ptr x, int64_t x_row_stride, Ptr delta, int64_t delta_row_stride, Ptr weight, bool weight_fp32, Ptr out,
           int64_t out_row_stride, int32_t num_rows, int32_t hidden_size, float eps, const std::string& dtype) {
          const AddRmsNormParams p{x, x_row_stride, delta, delta_row_stride, weight, out, out_row_stride, num_rows,
                                   hidden_size, eps, weight_fp32, dtype_or_throw(dtype)};
          run_without_gil("add_rms_norm", [&] { return add_rms_norm_cpu(p); });
        });
  m.def("rotary",
        [](Ptr q, Strides qs, Ptr k, Strides ks, Ptr positions, Ptr cos, Ptr sin, int64_t num_positions, Ptr q_norm,
           Ptr k_norm, float eps, int32_t num_tokens, int32_t num_q_heads, int32_t num_kv_heads, int32_t head_dim,
           const std::string& dtype) {
          const RotaryParams p{q, qs.first, qs.second, k, ks.first, ks.second, positions, cos, sin, num_positions,
                               q_norm, k_norm, eps, num_tokens, num_q_heads, num_kv_heads, head_dim,
                               dtype_or_throw(dtype)};
          run_without_gil("rotary", [&] { return rotary_cpu(p); });
        });
  m.def("silu_mul",
        [](Ptr gate, int64_t gate_row_stride, Ptr up, int64_t up_row_stride, Ptr out, int64_t out_row_stride,
           int32_t num_rows, int32_t width, const std::string& dtype) {
          const SiluMulParams p{gate, gate_row_stride, up, up_row_stride, out, out_row_stride, num_rows, width,
                                dtype_or_throw(dtype)};
          run_without_gil("silu_mul", [&] { return silu_mul_cpu(p); });
        });
  // Exposed so the log-sum-exp merge of the cascade is tested alone (fp32, contiguous [rows, dim] / [rows]).
  m.def("merge_state",
        [](uintptr_t o_a, uintptr_t lse_a, uintptr_t o_b, uintptr_t lse_b, uintptr_t o_out, uintptr_t lse_out,
           int32_t rows, int32_t dim) {
          auto f = [](uintptr_t x) { return reinterpret_cast<float*>(x); };
          py::gil_scoped_release release;
          merge_state(f(o_a), f(lse_a), f(o_b), f(lse_b), rows, dim, f(o_out), f(lse_out));
        });
  m.def("set_num_threads", [](int n) { set_kernel_threads(n); },
        "Threads used by the CPU kernels, process-wide (0 = OpenMP's default)");
  m.def("get_num_threads", []() { return kernel_threads(); });
  // An environment variable as the C library sees it (os.environ's changes reach it through putenv / unsetenv):
  // the registry reads its switches on every op call, and os.environ's encode and lookup cost ~10x this.
  m.def("getenv", [](const char* name) -> py::object {
    const char* value = std::getenv(name);
    return value ? py::object(py::str(value)) : py::object(py::none());
  });
  // The generated kernel table (common/dispatch.h): each built (family, layer), the tier it serves from and the
  // dtypes it covers. pyscore.ops._ext checks the tier table (pyscore/ops/tiers.py) against it.
  m.def("kernel_table", []() {
    py::list rows;
    size_t n = 0;
    const KernelTableRow* table = kernel_table(&n);
    for (size_t i = 0; i < n; ++i) {
      const KernelTableRow& r = table[i];
      py::list dtypes;
      for (DType d : {DType::kFloat32, DType::kBFloat16})
        if (r.covers(d)) dtypes.append(d == DType::kFloat32 ? "float32" : "bfloat16");
      py::dict row;
      row["op"] = r.op, row["family"] = r.family, row["layer"] = r.layer, row["tier"] = tier_name(r.tier);
      row["dtypes"] = dtypes;
      rows.append(row);
    }
    return rows;
  });
  m.def("cpu_features", []() {
    py::dict d;
    d["avx512f"] = cpu_has_avx512();
    d["avx512bf16"] = cpu_has_avx512bf16();
    d["avx2"] = cpu_has_avx2();
    d["amx_bf16"] = cpu_has_amx_bf16();
    d["arm_bf16"] = cpu_has_arm_bf16();
    d["arm_i8mm"] = cpu_has_arm_i8mm();
    d["intel"] = cpu_is_intel();
    d["hardware_tier"] = tier_name(cpu_hardware_tier());
    // What the kernels run now (PYSCORE_CPU_TIER / PYSCORE_BF16_DOT read at each call, as the launchers do).
    d["tier"] = tier_name(cpu_tier());
    const CpuTier tier = cpu_tier();
    d["path"] = tier == CpuTier::kNeon ? "neon"
                : cpu_tier_at_least(CpuTier::kAvx512) ? "avx512"
                : cpu_tier_at_least(CpuTier::kAvx2) ? "avx2" : "portable";
    d["bf16_dot"] = bf16_dot_name(cpu_bf16_dot());
    return d;
  });
}
