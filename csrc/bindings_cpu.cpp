// pyscore._C: binds the CPU launchers. Only argument plumbing here; the kernels live in their op folders.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <omp.h>

#include <cstdlib>

#include "common/bind_args.h"
#include "common/cpu_features.h"
#include "common/dispatch.h"
#include "common/merge_state_cpu.h"
#include "common/threads.h"
#include "decode_attention/decode_attention.h"
#include "prefix_item_attention/plan_cpu.h"
#include "prefix_item_attention/prefix_item_attention.h"

namespace py = pybind11;
using namespace pyscore;

namespace pyscore {
void bind_cpu_ops(py::module_& m);  // generated
}  // namespace pyscore

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
        [](Ptr segments, int32_t num_segments, int32_t num_tokens, int32_t num_q_heads, int32_t num_kv_heads,
           int32_t head_dim, const std::string& dtype, Ptr cached, Ptr cached_blocks, int32_t num_cached_blocks,
           int32_t block_tokens) {
          const auto shape = params_from<AttentionPlanParams>(segments, num_segments, num_tokens, num_q_heads,
                                                              num_kv_heads, head_dim, dtype, cached, cached_blocks,
                                                              num_cached_blocks, block_tokens);
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
        [](AttentionCpuPlan& plan, Ptr q, Ptr k, Ptr v, Ptr o, Strides qs, Strides ks, Strides vs, Strides os,
           float scale, Ptr cache_k, Ptr cache_v, CacheStrides cache_strides) {
          const AttentionPlanParams& s = plan.shape;  // the run reads its tables from the plan
          const AttentionPlanParams shape{nullptr, s.num_segments, s.num_tokens, s.num_q_heads, s.num_kv_heads,
                                          s.head_dim, s.dtype};
          const auto p = params_from<PrefixItemAttentionParams>(shape, q, k, v, o, qs, ks, vs, os, scale, cache_k,
                                                                cache_v, cache_strides);
          run_without_gil("prefix_item_attention", [&] { return prefix_item_attention_run_cpu(plan, p); });
        },
        py::arg("plan"), py::arg("q"), py::arg("k"), py::arg("v"), py::arg("o"), py::arg("q_strides"),
        py::arg("k_strides"), py::arg("v_strides"), py::arg("o_strides"), py::arg("scale"), py::arg("cache_k") = 0,
        py::arg("cache_v") = 0, py::arg("cache_strides") = CacheStrides{0, 0, 0},
        "One layer's attention with a plan from prefix_item_attention_plan (the tables are read from the plan); "
        "cache_k / cache_v: this layer's cached blocks when the plan has cached keys");
  bind_cpu_ops(m);  // every op header's PYSCORE_BIND line (generated: cmake/kernel_table.cmake)
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
