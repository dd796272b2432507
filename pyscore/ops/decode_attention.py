"""decode_attention: one new query token per running sequence against that sequence's own KV cache, every
sequence of a decode step in one call (see csrc/decode_attention/params.h). `plan_decode` gathers the caches'
addresses once per step; `decode_attention(q, plan, layer)` then serves every layer with the kernel the registry
(pyscore/ops/_ext.py) names for the device and dtype, else the fp32 reference. With k_new / v_new the step's keys and
values are first written into the caches at position length - 1."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pyscore.ops import _ext
from pyscore.ops.reference import decode_attention_ref


@dataclass(frozen=True)
class DecodePlan:
    """The running sequences' caches for one decode step. k / v: per sequence [L, capacity, Hkv, D] (token and head
    strides shared by all); lengths: keys per sequence including this step's token."""

    k: list[torch.Tensor]
    v: list[torch.Tensor]
    lengths: list[int]
    k_base: torch.Tensor  # int64 [B] addresses, on the caches' device
    v_base: torch.Tensor
    layer_stride: torch.Tensor  # int64 [B] elements
    lengths_t: torch.Tensor  # int32 [B]
    token_stride: int
    head_stride: int

    @property
    def num_kv_heads(self) -> int:
        return self.k[0].shape[2]

    @property
    def head_dim(self) -> int:
        return self.k[0].shape[3]


def plan_decode(k_caches: list[torch.Tensor], v_caches: list[torch.Tensor], lengths: list[int]) -> DecodePlan:
    """Validates the caches once per step and gathers what every layer's call needs."""
    if not k_caches or len(k_caches) != len(v_caches) or len(lengths) != len(k_caches):
        raise ValueError(f"k_caches, v_caches and lengths must have one entry per sequence, got {len(k_caches)}, "
                         f"{len(v_caches)} and {len(lengths)}")
    first = k_caches[0]
    if first.dim() != 4:
        raise ValueError(f"caches must be [L, capacity, Hkv, D], got {tuple(first.shape)}")
    strides = (first.stride(1), first.stride(2), 1)
    for name, caches in (("k_caches", k_caches), ("v_caches", v_caches)):
        for b, c in enumerate(caches):
            if c.dim() != 4 or c.shape[0] != first.shape[0] or c.shape[2:] != first.shape[2:]:
                raise ValueError(f"{name}[{b}] must be [L={first.shape[0]}, capacity, Hkv={first.shape[2]}, "
                                 f"D={first.shape[3]}], got {tuple(c.shape)}")
            if c.dtype != first.dtype or c.device != first.device or c.stride()[1:] != strides:
                raise ValueError(f"{name}[{b}] must match k_caches[0]'s dtype, device and token/head strides")
    for b, n in enumerate(lengths):
        if not 1 <= n <= min(k_caches[b].shape[1], v_caches[b].shape[1]):
            raise ValueError(f"lengths[{b}] must be in [1, capacity], got {n}")
    if any(k.stride(0) != v.stride(0) for k, v in zip(k_caches, v_caches, strict=True)):
        raise ValueError("each sequence's k and v caches must have the same layer stride")
    device = first.device

    def column(values: list[int], dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype).to(device)

    return DecodePlan(
        list(k_caches), list(v_caches), list(lengths), column([c.data_ptr() for c in k_caches], torch.int64),
        column([c.data_ptr() for c in v_caches], torch.int64), column([c.stride(0) for c in k_caches], torch.int64),
        column(lengths, torch.int32), strides[0], strides[1])


def _check(q: torch.Tensor, plan: DecodePlan, layer: int, k_new: torch.Tensor | None,
           v_new: torch.Tensor | None) -> None:
    batch, hkv, d = len(plan.lengths), plan.num_kv_heads, plan.head_dim
    if q.dim() != 3 or q.shape[0] != batch or q.shape[2] != d or q.shape[1] % hkv or q.stride(2) != 1:
        raise ValueError(f"q must be [B={batch}, Hq (a multiple of Hkv={hkv}), D={d}] contiguous in its last dim, "
                         f"got shape {tuple(q.shape)} strides {q.stride()}")
    if q.dtype != plan.k[0].dtype or q.device != plan.k[0].device:
        raise ValueError(f"q must match the caches' dtype and device ({plan.k[0].dtype}, {plan.k[0].device})")
    if not 0 <= layer < plan.k[0].shape[0]:
        raise ValueError(f"layer must be in [0, {plan.k[0].shape[0]}), got {layer}")
    if (k_new is None) != (v_new is None):
        raise ValueError("k_new and v_new must be given together")
    for name, t in (("k_new", k_new), ("v_new", v_new)):
        if t is not None and (t.shape != (batch, hkv, d) or t.stride(2) != 1 or t.dtype != q.dtype
                              or t.device != q.device):
            raise ValueError(f"{name} must be [B={batch}, Hkv={hkv}, D={d}] in q's dtype and device, contiguous in "
                             f"its last dim; got {t.dtype} {tuple(t.shape)} strides {t.stride()}")


def decode_attention(
    q: torch.Tensor, plan: DecodePlan, layer: int, k_new: torch.Tensor | None = None,
    v_new: torch.Tensor | None = None, scale: float | None = None, backend: str = "auto",
) -> torch.Tensor:
    """q [B, Hq, D] (one token per sequence; strides free, last dim contiguous) -> out [B, Hq, D] in q's dtype:
    attention of each sequence's token over keys [0, lengths[b]) of layer `layer` of its caches, after writing
    k_new / v_new [B, Hkv, D] (when given) at position lengths[b] - 1. backend: "auto" | "kernel" | "reference"."""
    _check(q, plan, layer, k_new, v_new)
    scale = plan.head_dim**-0.5 if scale is None else float(scale)
    module = _ext.kernel_for("decode_attention", q.device, q.dtype, backend)
    if module is None:
        if k_new is not None:
            for b, n in enumerate(plan.lengths):
                plan.k[b][layer, n - 1], plan.v[b][layer, n - 1] = k_new[b], v_new[b]
        keys = [k[layer, :n] for k, n in zip(plan.k, plan.lengths, strict=True)]
        values = [v[layer, :n] for v, n in zip(plan.v, plan.lengths, strict=True)]
        return decode_attention_ref(q, keys, values, scale).to(q.dtype)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if k_new is not None and k_new.stride() != v_new.stride():  # the kernel takes one pair of strides for both
        k_new, v_new = k_new.contiguous(), v_new.contiguous()
    new = (0, 0, (0, 0)) if k_new is None else (k_new.data_ptr(), v_new.data_ptr(), (k_new.stride(0), k_new.stride(1)))
    args = [
        q.data_ptr(), (q.stride(0), q.stride(1)), out.data_ptr(), (out.stride(0), out.stride(1)), *new,
        plan.k_base.data_ptr(), plan.v_base.data_ptr(), plan.layer_stride.data_ptr(), layer, plan.token_stride,
        plan.head_stride, plan.lengths_t.data_ptr(), max(plan.lengths), q.shape[0], q.shape[1], plan.num_kv_heads,
        plan.head_dim, scale, _ext.torch_dtype_name(q.dtype),
    ]
    if q.is_cuda:
        args.append(_ext.cuda_stream(q.device))
    module.decode_attention(*args)
    return out
