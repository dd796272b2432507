"""rotary_: rotary position embeddings applied in place to q and k, usually strided views into the fused qkv
projection output, with the Qwen3 per-head q/k RMSNorm optionally fused in (see csrc/rotary/rotary.h for the
contract). Where no kernel fits (see the registry in pyscore/ops/_ext.py: today a C++ kernel for CPU fp32/bf16
tensors only) the torch reference runs, which has the same semantics."""

from __future__ import annotations

import torch

from pyscore.ops import _ext
from pyscore.ops.reference import rotary_ref


def _check(q, k, positions, cos, sin, q_norm, k_norm) -> None:
    if q.dim() != 3 or q.stride(2) != 1:
        raise ValueError(f"q must be [T, Hq, D] contiguous in its last dim, got shape {tuple(q.shape)} "
                         f"strides {q.stride()}")
    num_tokens, _, head_dim = q.shape
    if k.dim() != 3 or k.shape[0] != num_tokens or k.shape[2] != head_dim or k.stride(2) != 1:
        raise ValueError(f"k must be [T={num_tokens}, Hkv, D={head_dim}] contiguous in its last dim, got shape "
                         f"{tuple(k.shape)} strides {k.stride()}")
    if head_dim % 2:
        raise ValueError(f"head_dim must be even, got {head_dim}")
    if positions.shape != (num_tokens,) or positions.dtype != torch.int64 or positions.stride(0) != 1:
        raise ValueError(f"positions must be a contiguous int64 [T={num_tokens}], got {positions.dtype} "
                         f"{tuple(positions.shape)}")
    for name, t in (("cos", cos), ("sin", sin)):
        if t.dim() != 2 or t.shape[1] != head_dim or t.dtype != torch.float32 or not t.is_contiguous():
            raise ValueError(f"{name} must be a contiguous float32 [P, D={head_dim}], got {t.dtype} {tuple(t.shape)}")
    if sin.shape != cos.shape:
        raise ValueError(f"sin must have cos's shape {tuple(cos.shape)}, got {tuple(sin.shape)}")
    if (q_norm is None) != (k_norm is None):
        raise ValueError("q_norm and k_norm must be given together")
    for name, t in (("k", k), ("q_norm", q_norm), ("k_norm", k_norm)):
        if t is not None and (t.dtype != q.dtype or t.device != q.device):
            raise ValueError(f"{name} must match q's dtype and device ({q.dtype}, {q.device}), "
                             f"got {t.dtype}, {t.device}")
    for name, t in (("q_norm", q_norm), ("k_norm", k_norm)):
        if t is not None and (t.shape != (head_dim,) or t.stride(0) != 1):
            raise ValueError(f"{name} must be a contiguous [D={head_dim}], got {tuple(t.shape)}")
    for name, t in (("positions", positions), ("cos", cos), ("sin", sin)):
        if t.device != q.device:
            raise ValueError(f"{name} must be on q's device {q.device}, got {t.device}")


def rotary_(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
    q_norm: torch.Tensor | None = None, k_norm: torch.Tensor | None = None, eps: float = 1e-6,
    backend: str = "auto",
) -> None:
    """In place: q [T, Hq, D], k [T, Hkv, D] (token and head strides free) rotated at positions [T] (int64, each
    < P) by the fp32 tables cos/sin [P, D] (`pyscore.model.rope.Rotary`), after a per-head RMSNorm with
    q_norm / k_norm [D] when given (Qwen3). backend: "auto" | "kernel" | "reference"."""
    _check(q, k, positions, cos, sin, q_norm, k_norm)
    module = _ext.kernel_for("rotary", q.device, q.dtype, backend)
    if module is None:
        return rotary_ref(q, k, positions, cos, sin, q_norm, k_norm, eps)
    module.rotary(*kernel_args(q, k, positions, cos, sin, q_norm, k_norm, eps))


def kernel_args(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                q_norm: torch.Tensor | None, k_norm: torch.Tensor | None, eps: float) -> tuple:
    """The kernel's arguments for checked tensors (rotary_'s, and a decode program's bound once)."""
    num_tokens, num_q_heads, head_dim = q.shape
    return (q.data_ptr(), (q.stride(0), q.stride(1)), k.data_ptr(), (k.stride(0), k.stride(1)),
            positions.data_ptr(), cos.data_ptr(), sin.data_ptr(), cos.shape[0],
            0 if q_norm is None else q_norm.data_ptr(), 0 if k_norm is None else k_norm.data_ptr(), float(eps),
            num_tokens, num_q_heads, k.shape[1], head_dim, _ext.torch_dtype_name(q.dtype))
