"""decode_attention: one new query token per running sequence against that sequence's keys and values in the paged
KV store, every sequence of a decode step in one call (see csrc/decode_attention/decode_attention.h). A sequence's
keys are
listed by its block table (page indices into the pool, as prefix_item_attention's cached_blocks); pages a cached
prefix shares are read in place. `plan_decode` gathers the block tables once per step; `decode_attention(q, plan,
layer)` then serves every layer with the kernel the registry (pyscore/ops/_ext.py) names for the device and dtype,
else the fp32 reference. With k_new / v_new the step's keys and values are first written into the pages at position
length - 1."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pyscore.ops import _ext
from pyscore.ops.reference import decode_attention_ref
from pyscore.ops.segments import key_tile


@dataclass(frozen=True)
class DecodePlan:
    """The running sequences' pages for one decode step. k_pool / v_pool: [pages, L, block_tokens, Hkv, D] views
    of the store's pool (same strides); tables: per sequence, its pages in token order; lengths: keys per sequence
    including this step's token."""

    k_pool: torch.Tensor
    v_pool: torch.Tensor
    tables: list[list[int]]
    lengths: list[int]
    block_table: torch.Tensor  # int32 [B, max pages], on the pool's device
    lengths_t: torch.Tensor  # int32 [B]

    def __post_init__(self):
        # The kernel's arguments that are the same for every layer of the step, gathered once (~15 us a call less),
        # as PackedLinear's _kernel_args: before the layer index (the pools and their page / layer strides), and
        # after it (token / head strides, the block table, the lengths).
        k = self.k_pool
        object.__setattr__(self, "pool_args", (k.data_ptr(), self.v_pool.data_ptr(), (k.stride(0), k.stride(1)),
                                               (k.stride(2), k.stride(3))))
        object.__setattr__(self, "table_args", (
            self.block_table.data_ptr(), self.block_table.shape[1], k.shape[2], self.lengths_t.data_ptr(),
            max(self.lengths)))

    @property
    def num_layers(self) -> int:
        return self.k_pool.shape[1]

    @property
    def block_tokens(self) -> int:
        return self.k_pool.shape[2]

    @property
    def num_kv_heads(self) -> int:
        return self.k_pool.shape[3]

    @property
    def head_dim(self) -> int:
        return self.k_pool.shape[4]

    def keys(self, b: int, layer: int, pool: torch.Tensor) -> torch.Tensor:
        """Sequence b's [lengths[b], Hkv, D] keys (pool = k_pool) or values (v_pool) of `layer`, gathered."""
        pages = pool[torch.tensor(self.tables[b], dtype=torch.long, device=pool.device), layer]
        return pages.reshape(-1, *pages.shape[2:])[: self.lengths[b]]


def plan_decode(k_pool: torch.Tensor, v_pool: torch.Tensor, tables: list[list[int]], lengths: list[int]) -> DecodePlan:
    """Validates the pool and the block tables once per step and gathers what every layer's call needs."""
    if not tables or len(lengths) != len(tables):
        raise ValueError(f"tables and lengths must have one entry per sequence, got {len(tables)} and {len(lengths)}")
    if k_pool.dim() != 5 or v_pool.shape != k_pool.shape:
        raise ValueError(f"k_pool and v_pool must be [pages, L, block_tokens, Hkv, D] of one shape, got "
                         f"{tuple(k_pool.shape)} and {tuple(v_pool.shape)}")
    if k_pool.stride() != v_pool.stride() or k_pool.stride()[2:] != (k_pool.shape[3] * k_pool.shape[4],
                                                                       k_pool.shape[4], 1):
        raise ValueError("k_pool and v_pool must share strides, each page's [block_tokens, Hkv, D] contiguous")
    if v_pool.dtype != k_pool.dtype or v_pool.device != k_pool.device:
        raise ValueError("k_pool and v_pool must share a dtype and a device")
    pages, block = k_pool.shape[0], k_pool.shape[2]
    tile = key_tile(k_pool.device)
    if block % tile:
        raise ValueError(f"block_tokens must be a multiple of {tile} (the kernels' key tile on "
                         f"{k_pool.device.type}), got {block}")
    for b, (table, n) in enumerate(zip(tables, lengths, strict=True)):
        if not 1 <= n <= len(table) * block:
            raise ValueError(f"lengths[{b}] must be in [1, {len(table) * block}] (its {len(table)} pages), got {n}")
        if any(not 0 <= page < pages for page in table):
            raise ValueError(f"tables[{b}] must hold page indices in [0, {pages}), got {table}")
    width = max(len(t) for t in tables)
    rows = [list(t) + [0] * (width - len(t)) for t in tables]
    device = k_pool.device
    return DecodePlan(k_pool, v_pool, [list(t) for t in tables], list(lengths),
                      torch.tensor(rows, dtype=torch.int32).to(device),
                      torch.tensor(lengths, dtype=torch.int32).to(device))


def _check(q: torch.Tensor, plan: DecodePlan, layer: int, k_new: torch.Tensor | None,
           v_new: torch.Tensor | None) -> None:
    batch, hkv, d = len(plan.lengths), plan.num_kv_heads, plan.head_dim
    if q.dim() != 3 or q.shape[0] != batch or q.shape[2] != d or q.shape[1] % hkv or q.stride(2) != 1:
        raise ValueError(f"q must be [B={batch}, Hq (a multiple of Hkv={hkv}), D={d}] contiguous in its last dim, "
                         f"got shape {tuple(q.shape)} strides {q.stride()}")
    if q.dtype != plan.k_pool.dtype or q.device != plan.k_pool.device:
        raise ValueError(f"q must match the pool's dtype and device ({plan.k_pool.dtype}, {plan.k_pool.device})")
    if not 0 <= layer < plan.num_layers:
        raise ValueError(f"layer must be in [0, {plan.num_layers}), got {layer}")
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
    attention of each sequence's token over keys [0, lengths[b]) of layer `layer` of its pages, after writing
    k_new / v_new [B, Hkv, D] (when given) at position lengths[b] - 1. backend: "auto" | "kernel" | "reference"."""
    _check(q, plan, layer, k_new, v_new)
    scale = plan.head_dim**-0.5 if scale is None else float(scale)
    module = _ext.kernel_for("decode_attention", q.device, q.dtype, backend)
    if module is None:
        if k_new is not None:
            block = plan.block_tokens
            for b, n in enumerate(plan.lengths):
                page, offset = plan.tables[b][(n - 1) // block], (n - 1) % block
                plan.k_pool[page, layer, offset], plan.v_pool[page, layer, offset] = k_new[b], v_new[b]
        keys = [plan.keys(b, layer, plan.k_pool) for b in range(len(plan.lengths))]
        values = [plan.keys(b, layer, plan.v_pool) for b in range(len(plan.lengths))]
        return decode_attention_ref(q, keys, values, scale).to(q.dtype)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if k_new is not None and k_new.stride() != v_new.stride():  # the kernel takes one pair of strides for both
        k_new, v_new = k_new.contiguous(), v_new.contiguous()
    args = kernel_args(step_args(q, out, k_new, v_new, plan.num_kv_heads, plan.head_dim, scale), plan, layer)
    module.decode_attention(*args, *((_ext.cuda_stream(q.device),) if q.is_cuda else ()))
    return out


def step_args(q: torch.Tensor, out: torch.Tensor, k_new: torch.Tensor | None, v_new: torch.Tensor | None,
              num_kv_heads: int, head_dim: int, scale: float) -> tuple[tuple, tuple]:
    """The kernel's arguments that are not the plan's, for checked tensors (k_new and v_new of one stride), as the
    two runs around the plan's (`kernel_args`): a decode program binds them once and the step's plan per step."""
    new = (0, 0, (0, 0)) if k_new is None else (k_new.data_ptr(), v_new.data_ptr(), (k_new.stride(0), k_new.stride(1)))
    return ((q.data_ptr(), (q.stride(0), q.stride(1)), out.data_ptr(), (out.stride(0), out.stride(1)), *new),
            (q.shape[0], q.shape[1], num_kv_heads, head_dim, scale, _ext.torch_dtype_name(q.dtype)))


def kernel_args(bound: tuple[tuple, tuple], plan: DecodePlan, layer: int) -> tuple:
    """The kernel's arguments: `step_args`' two runs around the plan's pool, the layer and the plan's tables."""
    return (*bound[0], *plan.pool_args, layer, *plan.table_args, *bound[1])
