"""pyscore._C_cuda on any machine: it is built wherever nvcc is, imports without a driver or GPU, reports
availability instead of failing, and the op wrappers never hand it CPU tensors."""

from __future__ import annotations

import shutil

import pytest
import torch

from pyscore.ops import (
    _ext,
    causal_conv1d,
    decode_attention,
    gated_delta_rule,
    label_logprobs,
    plan_decode,
    prefix_item_attention,
)


@pytest.fixture
def cuda_module():
    module = _ext.cuda_module()
    if module is None:
        if shutil.which("nvcc"):
            pytest.fail(f"nvcc is installed but {_ext.import_error(_ext.CUDA_MODULE)}")
        pytest.skip("pyscore._C_cuda not built (no nvcc)")
    return module


def test_module_imports_and_exposes_the_ops(cuda_module):
    for name in ("prefix_item_attention", "decode_attention", "label_logprobs", "causal_conv1d", "gated_delta_rule",
                 "available", "device_count"):
        assert callable(getattr(cuda_module, name)), name


def test_available_agrees_with_device_count(cuda_module):
    available, count = cuda_module.available(), cuda_module.device_count()
    assert isinstance(available, bool) and isinstance(count, int)
    assert available == (count > 0)
    if not torch.cuda.is_available():
        assert not available  # no driver / GPU here: answered, not raised


def test_wrappers_do_not_dispatch_cpu_tensors_to_cuda(monkeypatch):
    """With a CUDA module that fails on any use, ops on CPU tensors still run (CPU kernel or reference)."""

    class Exploding:
        def __getattr__(self, name):
            raise AssertionError(f"_C_cuda.{name} used for CPU tensors")

    monkeypatch.setattr(_ext, "cuda_module", lambda: Exploding())
    q, k, v = torch.randn(5, 2, 64), torch.randn(5, 1, 64), torch.randn(5, 1, 64)
    segments = torch.tensor([[0, 2, 0, 0], [2, 3, 0, 2]], dtype=torch.int32)
    assert prefix_item_attention(q, k, v, segments).shape == q.shape
    hidden, weight = torch.randn(2, 16), torch.randn(50, 16)
    logprobs, _ = label_logprobs(hidden, weight, torch.tensor([[1, -1], [3, 4]], dtype=torch.int32))
    assert logprobs.shape == (2, 2)
    q, v = torch.randn(5, 1, 16), torch.randn(5, 2, 16)
    ab = torch.randn(5, 2)
    assert gated_delta_rule(q, q, v, ab, ab, torch.zeros(2), torch.zeros(2), segments).shape == v.shape
    pool = torch.randn(2, 2, 1, 64, 1, 64)  # [pages, K/V, L, block_tokens, Hkv, D]
    plan = plan_decode(pool[:, 0], pool[:, 1], [[1]], [3])
    assert decode_attention(torch.randn(1, 2, 64), plan, 0).shape == (1, 2, 64)


def test_one_argument_list_per_op_binds_on_both_modules(cuda_module, monkeypatch):
    """csrc/common/bind_args.h binds each op from its params struct and one argument list for both modules (the CUDA
    binding takes the stream last), and the wrappers build one list for either device. So what a wrapper hands the
    CPU module, with a stream appended, must bind on the CUDA module: the launcher may refuse host pointers (no GPU
    here), pybind11 must not refuse the argument types. Each op is also called once with an argument short, which
    must fail to bind, so the check can fail."""
    if cuda_module.available():
        pytest.skip("host pointers must not reach a GPU launcher")
    cpu = _ext.cpu_module()
    calls: list[tuple[str, tuple]] = []

    class Recording:
        def __getattr__(self, name):
            def call(*args):
                calls.append((name, args))
                return getattr(cpu, name)(*args)
            return call

    recording = Recording()
    monkeypatch.setattr(_ext, "kernel_for", lambda *a, **k: recording)
    segments = torch.tensor([[0, 2, 0, 0], [2, 3, 0, 2]], dtype=torch.int32)
    hidden, weight = torch.randn(2, 16), torch.randn(50, 16)
    label_logprobs(hidden, weight, torch.tensor([[1, -1], [3, 4]], dtype=torch.int32))
    q, v = torch.randn(5, 1, 16), torch.randn(5, 2, 16)
    ab = torch.randn(5, 2)
    gated_delta_rule(q, q, v, ab, ab, torch.zeros(2), torch.zeros(2), segments)
    pool = torch.randn(2, 2, 1, 64, 1, 64)
    decode_attention(torch.randn(1, 2, 64), plan_decode(pool[:, 0], pool[:, 1], [[1]], [3]), 0)
    x = torch.randn(5, 32)
    causal_conv1d(x, torch.randn(32, 4), segments)
    assert {name for name, _ in calls} >= {"label_logprobs", "gated_delta_rule", "decode_attention", "causal_conv1d"}
    for name, args in calls:
        if name not in _ext.CUDA_OPS:
            continue
        try:
            getattr(cuda_module, name)(*args, 0)
        except TypeError as e:
            pytest.fail(f"_C_cuda.{name} does not take the CPU module's arguments: {e}")
        except (ValueError, RuntimeError):
            pass  # the launcher refused the host pointers: the arguments bound
        with pytest.raises(TypeError):
            getattr(cuda_module, name)(*args[:-1], 0)
