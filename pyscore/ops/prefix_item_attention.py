"""prefix_item_attention: attention over a packed token stream of segments (see csrc/prefix_item_attention/
params.h for the contract). Dispatches to the CUDA kernel for CUDA tensors, the C++ kernel for CPU tensors,
and the fp32 reference where no kernel is built. Inputs are validated here; kernels trust them."""

from __future__ import annotations

import weakref

import torch

from pyscore.ops import _ext
from pyscore.ops.reference import prefix_item_attention_ref


def _check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    if q.dim() != 3:
        raise ValueError(f"q must have shape [T, Hq, D], got {tuple(q.shape)}")
    num_tokens, num_q_heads, head_dim = q.shape
    for name, x in (("k", k), ("v", v)):
        if x.dim() != 3 or x.shape[0] != num_tokens or x.shape[2] != head_dim:
            raise ValueError(f"{name} must have shape [T={num_tokens}, Hkv, D={head_dim}], got {tuple(x.shape)}")
        if x.dtype != q.dtype or x.device != q.device:
            raise ValueError(f"{name} must match q's dtype and device ({q.dtype}, {q.device}), "
                             f"got {x.dtype}, {x.device}")
        if x.stride(2) != 1:
            raise ValueError(f"{name} must be contiguous in its last dimension")
    if k.shape[1] != v.shape[1] or num_q_heads % k.shape[1]:
        raise ValueError(f"Hq={num_q_heads} must be a multiple of Hkv (k: {k.shape[1]}, v: {v.shape[1]})")
    if q.stride(2) != 1:
        raise ValueError("q must be contiguous in its last dimension")


# The decoder passes one segment table to every layer: validate it once, not 30 times (the checks cost more than
# a small batch's attention). Keyed by a weak reference and the tensor's version counter, so a table modified in
# place, or a new one, is checked again.
_last_valid: tuple[weakref.ref, int, int] | None = None


def _check_segments(segments: torch.Tensor, num_tokens: int) -> None:
    global _last_valid
    if _last_valid is not None and _last_valid[0]() is segments and _last_valid[1:] == (segments._version, num_tokens):
        return
    _check_segments_uncached(segments, num_tokens)
    _last_valid = (weakref.ref(segments), segments._version, num_tokens)


def _check_segments_uncached(segments: torch.Tensor, num_tokens: int) -> None:
    if segments.dtype != torch.int32 or segments.dim() != 2 or segments.shape[1] != 4:
        raise ValueError(f"segments must be int32 [S, 4], got {segments.dtype} {tuple(segments.shape)}")
    if not segments.is_contiguous():
        raise ValueError("segments must be contiguous")
    seg = segments.cpu()
    starts, lengths, pstarts, plens = seg.unbind(1)
    if bool((lengths < 0).any() | (plens < 0).any() | (starts < 0).any() | (pstarts < 0).any()):
        raise ValueError("segments must have non-negative start, length, prefix_start and prefix_length")
    if bool(((starts + lengths) > num_tokens).any() | ((pstarts + plens) > num_tokens).any()):
        raise ValueError(f"segments must lie inside the {num_tokens}-token stream")
    if int(lengths.sum()) != num_tokens:
        raise ValueError(f"segments must cover the stream exactly once: lengths sum to {int(lengths.sum())}, "
                         f"T={num_tokens}")
    overlap = (plens > 0) & (pstarts < starts + lengths) & (starts < pstarts + plens)
    if bool(overlap.any()):
        raise ValueError(f"segment {int(overlap.nonzero()[0, 0])}: its prefix range must not overlap its own tokens")


def prefix_item_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    segments: torch.Tensor,
    scale: float | None = None,
    out: torch.Tensor | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """q: [T, Hq, D], k/v: [T, Hkv, D] (token and head strides free, last dim contiguous), segments int32 [S, 4]
    (on the CPU for the CPU kernel, on q's device for CUDA) -> out [T, Hq, D] in q's dtype.
    backend: "auto" | "kernel" | "reference"."""
    _check_qkv(q, k, v)
    num_tokens, num_q_heads, head_dim = q.shape
    _check_segments(segments, num_tokens)
    scale = head_dim**-0.5 if scale is None else float(scale)
    module = _ext.kernel_for("prefix_item_attention", q, backend)
    if module is None:
        return prefix_item_attention_ref(q, k, v, segments, scale).to(q.dtype)
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    segments = segments.to(q.device)
    args = [
        q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(),
        (q.stride(0), q.stride(1)), (k.stride(0), k.stride(1)), (v.stride(0), v.stride(1)),
        (out.stride(0), out.stride(1)),
        segments.data_ptr(), segments.shape[0], num_tokens, num_q_heads, k.shape[1], head_dim, scale,
        _ext.torch_dtype_name(q.dtype),
    ]
    if q.is_cuda:
        args.append(_ext.cuda_stream(q.device))
    module.prefix_item_attention(*args)
    return out
