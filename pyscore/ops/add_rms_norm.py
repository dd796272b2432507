"""add_rms_norm: the residual add + RMSNorm between decoder sublayers in one pass (see csrc/add_rms_norm/add_rms_norm.h
for the contract). Where no kernel fits (see the registry in pyscore/ops/_ext.py: today a C++ kernel for CPU
fp32/bf16 tensors only) the torch reference runs, which has the same semantics."""

from __future__ import annotations

import torch

from pyscore.ops import _ext
from pyscore.ops.reference import add_rms_norm_ref


def _check(x: torch.Tensor, weight: torch.Tensor, delta: torch.Tensor | None, out: torch.Tensor | None) -> None:
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"x must be [T, H] contiguous in its last dim, got shape {tuple(x.shape)} "
                         f"strides {x.stride()}")
    hidden = x.shape[1]
    if weight.shape != (hidden,) or weight.stride(0) != 1:
        raise ValueError(f"weight must be a contiguous [H={hidden}], got {tuple(weight.shape)}")
    if weight.device != x.device or weight.dtype not in (x.dtype, torch.float32):
        raise ValueError(f"weight must match x's dtype ({x.dtype}) or be float32, on x's device {x.device}, "
                         f"got {weight.dtype}, {weight.device}")
    for name, t in (("delta", delta), ("out", out)):
        if t is not None and (t.dtype != x.dtype or t.device != x.device):
            raise ValueError(f"{name} must match x's dtype and device ({x.dtype}, {x.device}), "
                             f"got {t.dtype}, {t.device}")
    for name, t in (("delta", delta), ("out", out)):
        if t is not None and (t.shape != x.shape or t.stride(1) != 1):
            raise ValueError(f"{name} must be [T, H]={tuple(x.shape)} contiguous in its last dim, "
                             f"got shape {tuple(t.shape)} strides {t.stride()}")


def add_rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, delta: torch.Tensor | None = None,
    out: torch.Tensor | None = None, backend: str = "auto",
) -> torch.Tensor:
    """x [T, H] (row stride free), weight [H], optional delta [T, H] -> RMSNorm(x) [T, H] in x's dtype, after
    x += delta in place when delta is given. weight in x's dtype: Llama's recipe (the normalized row rounded, then
    scaled); a float32 weight scales the fp32 row before its one rounding (Qwen3.5's zero-centred norm, weight 1 + w).
    out, when given, must overlap neither x nor delta. backend: "auto" | "kernel" | "reference"."""
    _check(x, weight, delta, out)
    module = _ext.kernel_for("add_rms_norm", x.device, x.dtype, backend)
    if module is None:
        normed = add_rms_norm_ref(x, weight, eps, delta)
        return normed if out is None else out.copy_(normed)
    if out is None:
        out = torch.empty(x.shape, dtype=x.dtype)
    module.add_rms_norm(*kernel_args(x, weight, eps, delta, out))
    return out


def kernel_args(x: torch.Tensor, weight: torch.Tensor, eps: float, delta: torch.Tensor | None,
                out: torch.Tensor) -> tuple:
    """The kernel's arguments for checked tensors (add_rms_norm's, and a decode program's bound once)."""
    return (x.data_ptr(), x.stride(0), 0 if delta is None else delta.data_ptr(),
            0 if delta is None else delta.stride(0), weight.data_ptr(), out.data_ptr(), out.stride(0), x.shape[0],
            x.shape[1], float(eps), weight.dtype != x.dtype, _ext.torch_dtype_name(x.dtype))
