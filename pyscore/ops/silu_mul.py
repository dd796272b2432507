"""silu_mul: the SwiGLU activation silu(gate) * up on the fused gate_up projection output (see
csrc/silu_mul/silu_mul.h for the contract). Where no kernel fits (see the registry in pyscore/ops/_ext.py: today a
C++ kernel for CPU fp32/bf16 tensors only) the torch reference runs, which has the same semantics."""

from __future__ import annotations

import torch

from pyscore.ops import _ext
from pyscore.ops.reference import silu_mul_ref


def silu_mul(gate_up: torch.Tensor, out: torch.Tensor | None = None, backend: str = "auto") -> torch.Tensor:
    """gate_up [T, 2I] (gate then up; row stride free) -> silu(gate) * up [T, I] in gate_up's dtype.
    backend: "auto" | "kernel" | "reference"."""
    if gate_up.dim() != 2 or gate_up.shape[1] % 2 or gate_up.stride(1) != 1:
        raise ValueError(f"gate_up must be [T, 2I] contiguous in its last dim, got shape {tuple(gate_up.shape)} "
                         f"strides {gate_up.stride()}")
    num_rows, width = gate_up.shape[0], gate_up.shape[1] // 2
    if out is not None and (out.shape != (num_rows, width) or out.stride(1) != 1 or out.dtype != gate_up.dtype
                            or out.device != gate_up.device):
        raise ValueError(f"out must be [T, I]=({num_rows}, {width}) {gate_up.dtype} on {gate_up.device}, contiguous "
                         f"in its last dim, got {out.dtype} {tuple(out.shape)} strides {out.stride()}")
    module = _ext.kernel_for("silu_mul", gate_up.device, gate_up.dtype, backend)
    if module is None:
        result = silu_mul_ref(gate_up)
        return result if out is None else out.copy_(result)
    if out is None:
        out = torch.empty(num_rows, width, dtype=gate_up.dtype)
    ptr, row_stride = gate_up.data_ptr(), gate_up.stride(0)
    module.silu_mul(ptr, row_stride, ptr + width * gate_up.element_size(), row_stride, out.data_ptr(), out.stride(0),
                    num_rows, width, _ext.torch_dtype_name(gate_up.dtype))
    return out
