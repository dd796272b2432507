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


def kernel_module(x, backend: str, op: str, *, cuda_kernel: bool = True,
                  dtypes: tuple | None = None) -> ModuleType | None:
    """The extension module whose kernel `op` should run on tensor x, or None when its torch reference should:
    backend "reference" (or PYSCORE_OP_BACKEND=reference), no module built for x's device, an op without a CUDA
    kernel on a CUDA tensor (cuda_kernel=False), or a dtype outside `dtypes`. backend "kernel" raises instead of
    falling back."""
    if backend == "auto":
        backend = default_backend()
    if backend == "reference":
        return None
    on_cpu = x.device.type == "cpu"
    module = cpu_module() if on_cpu else cuda_module() if (x.is_cuda and cuda_kernel) else None
    if dtypes is not None and x.dtype not in dtypes:
        module = None
    if module is None and backend == "kernel":
        raise RuntimeError(f"no {op} kernel for {x.dtype} on {x.device}")
    return module


def elementwise_cpu_module(x, backend: str, op: str) -> ModuleType | None:
    """kernel_module for the decoder's elementwise ops (add_rms_norm, rotary, silu_mul): C++ CPU kernels for
    fp32 and bf16 only; CUDA tensors and other dtypes run the torch reference."""
    import torch

    return kernel_module(x, backend, op, cuda_kernel=False, dtypes=(torch.float32, torch.bfloat16))


def default_backend() -> str:
    """What backend="auto" means: the kernels where built, else the reference; PYSCORE_OP_BACKEND=reference
    forces the fp32 reference everywhere (a slow debugging switch)."""
    return os.environ.get("PYSCORE_OP_BACKEND", "auto")
