"""The op registry (pyscore/ops/_ext.py) decides in one place which path every op takes: a kernel where one is
registered for the device and dtype and its module imports, else the reference, with a reason that says which
of those failed; backend "kernel" turns the fallback into an error carrying the same reason."""

from __future__ import annotations

import pytest
import torch

from pyscore.ops import _ext, add_rms_norm, silu_mul

CPU = torch.device("cpu")


def test_every_op_has_a_cpu_kernel_for_fp32_and_bf16():
    for op in _ext.REGISTRY:
        for dtype in (torch.float32, torch.bfloat16):
            module, why = _ext.resolve(op, CPU, dtype)
            assert module is _ext.cpu_module() and module is not None, f"{op} {dtype}: {why}"
            assert why == "kernel: pyscore._C"


def test_unregistered_dtype_falls_back_with_the_reason():
    module, why = _ext.resolve("silu_mul", CPU, torch.float16)
    assert module is None
    assert why == "reference: the CPU kernel takes bfloat16/float32, not float16"


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


def test_op_paths_name_every_op_and_the_cpu_isa(monkeypatch):
    paths = _ext.op_paths(CPU, torch.bfloat16)
    assert set(paths) == set(_ext.REGISTRY)
    features = _ext.cpu_module().cpu_features()
    isa = (f"AVX-512 BF16, bf16 products by {features['bf16_dot']}" if features["avx512bf16"]
           else "portable: this CPU lacks AVX512-BF16")
    assert all(p == f"kernel: pyscore._C ({isa})" for p in paths.values()), paths
    if features["avx512bf16"]:
        monkeypatch.setenv("PYSCORE_DISABLE_AVX512", "1")
        forced = _ext.op_paths(CPU, torch.float32)["rotary"]
        assert forced == "kernel: pyscore._C (portable: PYSCORE_DISABLE_AVX512 is set)"
        monkeypatch.delenv("PYSCORE_DISABLE_AVX512")
        monkeypatch.setenv("PYSCORE_BF16_DOT", "widen")
        widened = _ext.op_paths(CPU, torch.bfloat16)["linear"]
        assert widened == "kernel: pyscore._C (AVX-512 BF16, bf16 products by widen)"
    assert set(_ext.op_paths(CPU, torch.float32, "reference").values()) == {"reference: op_backend=reference"}
