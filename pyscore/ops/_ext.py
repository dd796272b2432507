"""Loads the compiled extension modules. `_C` (CPU) is expected to be there after `make build`; `_C_cuda`
is optional: when it is missing or no GPU/driver is present, CUDA is reported unavailable, never fatal."""

from __future__ import annotations

import functools
import importlib
import os
from types import ModuleType


@functools.cache
def cpu_module() -> ModuleType | None:
    try:
        return importlib.import_module("pyscore._C")
    except ImportError:
        return None


@functools.cache
def cuda_module() -> ModuleType | None:
    try:
        return importlib.import_module("pyscore._C_cuda")
    except ImportError:
        return None


@functools.cache
def cuda_import_error() -> str | None:
    """Why `_C_cuda` cannot be used (None when it can): reported by model info, never raised."""
    try:
        importlib.import_module("pyscore._C_cuda")
    except ImportError as e:
        return f"pyscore._C_cuda not importable: {e}"
    return None


def torch_dtype_name(dtype) -> str:
    """The kernel-side dtype name ('float32' | 'bfloat16' | 'float16') of a torch dtype."""
    import torch

    names = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
    if dtype not in names:
        raise TypeError(f"unsupported dtype {dtype}; expected float32, bfloat16 or float16")
    return names[dtype]


def cuda_stream(device) -> int:
    """The raw cudaStream_t (as int) of torch's current stream on `device`."""
    import torch

    return int(torch.cuda.current_stream(device).cuda_stream)


def elementwise_cpu_module(x, backend: str, op: str) -> ModuleType | None:
    """The CPU module when the decoder's elementwise op `op` (add_rms_norm, rotary, silu_mul) should run its C++
    kernel on tensor x, None when its torch reference should run: on CUDA (these ops have no CUDA kernel), for
    dtypes other than fp32/bf16, without a built `_C`, or with backend "reference". backend "kernel" raises
    instead of falling back."""
    import torch

    if backend == "auto":
        backend = default_backend()
    if backend == "reference":
        return None
    module = cpu_module() if x.device.type == "cpu" and x.dtype in (torch.float32, torch.bfloat16) else None
    if module is None and backend == "kernel":
        raise RuntimeError(f"no {op} kernel for {x.dtype} on {x.device}")
    return module


def default_backend() -> str:
    """What backend="auto" means: the kernels where built, else the reference; PYSCORE_OP_BACKEND=reference
    forces the fp32 reference everywhere (a slow debugging switch)."""
    return os.environ.get("PYSCORE_OP_BACKEND", "auto")
