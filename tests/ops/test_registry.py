"""The op registry (pyscore/ops/_ext.py) decides in one place which path every op takes: on the CPU the tier table
(pyscore/ops/tiers.py) picks our kernel or torch's op per (op, tier, dtype); a kernel needs to be registered for the
device and dtype and its module to import, else the reference runs, with a reason that says which of those failed;
backend "kernel" reaches our kernel whatever the table says, or an error carrying the same reason."""

from __future__ import annotations

import platform
import re
from pathlib import Path

import pytest
import torch

from pyscore.ops import _ext, add_rms_norm, silu_mul, tiers

CPU = torch.device("cpu")
ROOT = Path(__file__).resolve().parents[2]


def test_every_op_has_a_cpu_kernel_for_fp32_and_bf16():
    for op in _ext.REGISTRY:
        for dtype in (torch.float32, torch.bfloat16):
            module, why = _ext.resolve(op, CPU, dtype, "kernel")
            assert module is _ext.cpu_module() and module is not None, f"{op} {dtype}: {why}"
            assert why == "kernel: pyscore._C"


def test_registered_kernels_are_the_modules_functions():
    """REGISTRY is derived (every op of the tier table on the CPU, CUDA_OPS on CUDA): each entry names a function its
    module binds under the op's name, so a misspelt op in either list fails here, not at a model's first call."""
    assert set(_ext.CUDA_OPS) <= set(_ext.REGISTRY)
    for op, devices in _ext.REGISTRY.items():
        for device, kernel in devices.items():
            module = _ext.cpu_module() if device == "cpu" else _ext.cuda_module()
            if module is None:
                continue  # _C_cuda is optional; test_every_op_has_a_cpu_kernel_for_fp32_and_bf16 needs _C
            assert callable(getattr(module, op, None)), f"{kernel.module} binds no {op}"


def test_the_tier_table_covers_every_op_and_tier():
    for op in _ext.REGISTRY:
        assert set(tiers.CPU_TIERS[op]) <= set(tiers.TIERS), op
        for tier in tiers.TIERS:
            for dtype in (torch.float32, torch.bfloat16):
                choice = tiers.cpu_choice(op, tier, dtype)
                assert choice.path in ("kernel", "torch") and choice.why, (op, tier, dtype)
    # a tier without an entry inherits the one below it, and says so
    inherited = tiers.cpu_choice("decode_attention", "amx", torch.bfloat16)
    assert inherited == tiers.Choice("kernel", f"inherited from avx512bf16: {tiers.AVX512BF16.why}")
    assert tiers.cpu_choice("linear", "amx", torch.bfloat16) == tiers.LINEAR_AMX
    assert tiers.cpu_choice("rotary", "amx", torch.float32).why.startswith("inherited from avx512bf16: ")
    with pytest.raises(ValueError, match="unknown CPU tier"):
        tiers.cpu_choice("rotary", "sse2", torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_op_paths_follow_the_tier_table_on_every_tier_this_cpu_runs(monkeypatch, dtype):
    for tier in _ext.runnable_cpu_tiers():
        monkeypatch.setenv("PYSCORE_CPU_TIER", tier)
        assert _ext.cpu_tier() == tier
        for op, path in _ext.op_paths(CPU, dtype).items():
            choice = tiers.cpu_choice(op, tier, dtype)
            if choice.path == "torch":
                assert path == f"torch: tier {tier}, {choice.why}", (tier, op)
                assert _ext.kernel_for(op, CPU, dtype) is None
            else:
                assert path.startswith(f"kernel: pyscore._C (tier {tier}"), (tier, op, path)
                assert _ext.kernel_for(op, CPU, dtype) is _ext.cpu_module()


def test_a_tier_above_the_hardware_falls_to_the_hardware_tier(monkeypatch):
    features = _ext.cpu_module().cpu_features()
    if features["hardware_tier"] == "amx":
        pytest.skip("no tier above amx to ask for")
    monkeypatch.setenv("PYSCORE_CPU_TIER", "amx")
    assert _ext.cpu_tier() == features["hardware_tier"]


def test_default_cpu_dtype_follows_the_tier(monkeypatch):
    monkeypatch.setenv("PYSCORE_CPU_TIER", "avx2")
    if _ext.cpu_tier() == "avx2":
        assert _ext.default_cpu_dtype() == (torch.float32, "float32: tier avx2 has no bf16 arithmetic")
    monkeypatch.delenv("PYSCORE_CPU_TIER")
    if _ext.cpu_tier() in ("avx512bf16", "amx"):
        assert _ext.default_cpu_dtype()[0] == torch.bfloat16


def test_unregistered_dtype_falls_back_with_the_reason():
    module, why = _ext.resolve("silu_mul", CPU, torch.float16)
    assert module is None
    assert why == "reference: the CPU kernel takes bfloat16/float32, not float16"


def test_memoized_paths_see_a_switch_changed_between_calls(monkeypatch):
    """resolve_path answers from a memo: a switch set, a lower tier forced or a registry entry replaced between two
    calls is seen by the second."""
    monkeypatch.delenv("PYSCORE_OP_BACKEND", raising=False)
    monkeypatch.delenv("PYSCORE_CPU_TIER", raising=False)
    first = _ext.resolve_path("label_logprobs", CPU, torch.float32)
    assert _ext.resolve_path("label_logprobs", CPU, torch.float32) == first and first[1] == "kernel"
    monkeypatch.setenv("PYSCORE_OP_BACKEND", "reference")
    assert _ext.resolve_path("label_logprobs", CPU, torch.float32)[1] == "reference"
    monkeypatch.delenv("PYSCORE_OP_BACKEND")
    monkeypatch.setenv("PYSCORE_CPU_TIER", "generic")
    assert _ext.resolve_path("add_rms_norm", CPU, torch.float32)[2].startswith("torch: tier generic")
    monkeypatch.delenv("PYSCORE_CPU_TIER")
    assert _ext.resolve_path("label_logprobs", CPU, torch.float32) == first
    monkeypatch.setitem(_ext.REGISTRY, "label_logprobs", {})
    assert _ext.resolve_path("label_logprobs", CPU, torch.float32)[0] is None


def test_op_without_a_device_kernel_falls_back():
    module, why = _ext.resolve("rotary", torch.device("cuda"), torch.bfloat16)
    assert module is None and why == "reference: no CUDA kernel for rotary"


def test_forced_reference(monkeypatch):
    assert _ext.resolve("label_logprobs", CPU, torch.float32, "reference") == (None, "reference: op_backend=reference")
    monkeypatch.setenv("PYSCORE_OP_BACKEND", "reference")
    assert _ext.resolve("label_logprobs", CPU, torch.float32) == (None, "reference: PYSCORE_OP_BACKEND=reference")
    module, _ = _ext.resolve("label_logprobs", CPU, torch.float32, "kernel")  # an explicit "kernel" still wins
    assert module is _ext.cpu_module()


def test_missing_module_is_named_with_its_import_error(monkeypatch):
    monkeypatch.setattr(_ext, "_load", lambda name: (None, f"No module named '{name}'"))
    module, why = _ext.resolve("prefix_item_attention", torch.device("cuda"), torch.bfloat16)
    assert module is None
    assert why == "reference: CUDA off: `_C_cuda` failed to import: No module named 'pyscore._C_cuda'"
    assert _ext.cuda_status() == (False, "CUDA off: `_C_cuda` failed to import: No module named 'pyscore._C_cuda'")


def test_kernel_backend_raises_with_the_reason():
    x = torch.zeros(2, 8, dtype=torch.float16)
    with pytest.raises(RuntimeError, match=r"no silu_mul kernel for torch\.float16 on cpu: reference: the CPU kernel"):
        silu_mul(x, backend="kernel")
    with pytest.raises(ValueError, match="backend must be auto, kernel or reference"):
        add_rms_norm(torch.zeros(2, 8), torch.ones(8), 1e-6, backend="fast")


def test_a_fallback_computes_the_reference():
    x = torch.randn(3, 8, dtype=torch.float16)
    assert torch.equal(silu_mul(x), silu_mul(x, backend="reference"))


def test_op_paths_name_the_tier_and_the_bf16_product(monkeypatch):
    monkeypatch.delenv("PYSCORE_CPU_TIER", raising=False)  # the hardware's own tier, whatever the run forces
    features = _ext.cpu_module().cpu_features()
    if features["hardware_tier"] not in ("avx512bf16", "amx"):
        pytest.skip("needs an AVX512-BF16 CPU")
    monkeypatch.setenv("PYSCORE_BF16_DOT", "widen")
    tier = features["hardware_tier"]
    assert _ext.op_paths(CPU, torch.bfloat16)["rotary"] == f"kernel: pyscore._C (tier {tier}, bf16 products by widen)"
    monkeypatch.setenv("PYSCORE_BF16_DOT", "dpbf16")  # not at tier avx512: no vdpbf16ps there, whatever is asked
    monkeypatch.setenv("PYSCORE_CPU_TIER", "avx512")
    assert _ext.op_paths(CPU, torch.bfloat16)["linear"] == (
        f"kernel: pyscore._C (tier avx512, bf16 products by widen; forced below the CPU's {tier})")
    monkeypatch.delenv("PYSCORE_CPU_TIER")
    monkeypatch.setenv("PYSCORE_DISABLE_AVX512", "1")  # the legacy switch: the generic tier
    forced = _ext.op_paths(CPU, torch.float32, "kernel")["rotary"]
    assert forced == f"kernel: pyscore._C (tier generic; forced below the CPU's {tier})"
    assert set(_ext.op_paths(CPU, torch.float32, "reference").values()) == {"reference: op_backend=reference"}


def test_linear_without_a_kernel_runs_torchs_gemm_not_the_fp32_oracle():
    """A GPU (no linear kernel of ours) or fp16 on a CPU: the projections run torch's GEMM in the model's dtype, as
    the decoder did before the tier table, never the fp32 reference."""
    assert _ext.resolve_path("linear", torch.device("cuda"), torch.bfloat16) == (
        None, "torch", "torch: no CUDA kernel for linear")
    assert _ext.resolve_path("linear", CPU, torch.float16)[1] == "torch"
    assert _ext.resolve_path("linear", CPU, torch.float16, "reference")[1] == "reference"


def _defined_entry_points() -> set[tuple[str, str]]:
    """(family, layer) of every entry point this architecture's sources define, read from the sources: the kernel
    texts' PYSCORE_VEC_ENTRY on each of their layers built here, the ISA files' PYSCORE_ENTRY(family, layer)."""
    x86 = platform.machine() == "x86_64"
    layers = {"avx2", "avx512"} if x86 else {"neon"}
    suffixes = ("_avx512.cpp", "_amx.cpp", "_avx2.cpp") if x86 else ("_neon.cpp",)
    found = set()
    for text in ROOT.glob("csrc/*/*_simd.h"):
        source = text.read_text()
        line = re.search(r"^// pyscore-vec-layers:(.*)$", source, re.M)
        assert line, text
        for family in re.findall(r"PYSCORE_VEC_ENTRY\((\w+)\)", source):
            found |= {(family, layer) for layer in line.group(1).split() if layer in layers}
    for source in (p for p in ROOT.glob("csrc/*/*.cpp") if p.name.endswith(suffixes)):
        found |= set(re.findall(r"PYSCORE_ENTRY\((\w+), (\w+)\)", source.read_text()))
    return found


def test_the_kernel_table_is_every_entry_point_the_sources_define():
    """cmake/kernel_table.cmake generates the dispatch table from the sources: each (family, layer) they define is a
    row, once, with its layer's tier, and nothing else is."""
    table = _ext.cpu_module().kernel_table()
    pairs = [(r["family"], r["layer"]) for r in table]
    assert len(pairs) == len(set(pairs))
    assert set(pairs) == _defined_entry_points()
    tier_of = {"amx": "amx", "avx512": "avx512", "avx2": "avx2", "neon": "neon"}
    assert all(r["tier"] == tier_of[r["layer"]] for r in table)
    assert {r["op"] for r in table} <= set(tiers.CPU_TIERS)


def test_the_tier_table_is_checked_against_the_built_kernels():
    """pyscore.ops._ext refuses a CPU module whose kernel table lacks a kernel the tier table names (here: one built
    without the AMX GEMM, or without any AVX-512 silu_mul) and accepts the real one."""
    if platform.machine() != "x86_64":
        pytest.skip("the rows removed below are x86's")
    table = _ext.cpu_module().kernel_table()
    _ext.check_kernel_table(table)
    without_amx = [r for r in table if (r["op"], r["layer"]) != ("linear", "amx")]
    with pytest.raises(RuntimeError, match="linear at amx: no amx kernel built"):
        _ext.check_kernel_table(without_amx, "x86_64")
    without_avx512 = [r for r in table if (r["op"], r["layer"]) != ("silu_mul", "avx512")]
    with pytest.raises(RuntimeError, match="silu_mul at avx512: no avx512 kernel built"):
        _ext.check_kernel_table(without_avx512, "x86_64")
    bf16_only = [dict(r, dtypes=["bfloat16"]) if r["op"] == "rotary" else r for r in table]
    with pytest.raises(RuntimeError, match="rotary at avx2 for float32"):
        _ext.check_kernel_table(bf16_only, "x86_64")
