"""prefix_item_attention: attention over a packed token stream of segments (see csrc/prefix_item_attention/
prefix_item_attention.h for the contract), split FlashInfer's way into a plan made once per batch and a run per layer.

`AttentionPlan` holds what depends only on the batch's segment table and the model's head layout: on the CPU a
C++ plan (groups, work units, key ranges) with its packed-K/V and scratch workspaces; on CUDA the tile work list,
planned on the device into one workspace; for the reference, the table alone. `plan.run(q, k, v)` then checks
only the tensors. `prefix_item_attention(q, k, v, segments)` is the one-shot form (plan, then run).

Cached keys: a prefix cache gives segments keys that have no row in the stream (`CachedKeys`: blocks of a block
pool before a segment's own tokens or before its prefix). The plan takes their table at creation; each run gets
that layer's pool (`cache_k` / `cache_v` [N, B, Hkv, D]), and the kernels read the listed blocks where a run
without the cache has those keys, so a warm run does the arithmetic of a cold one."""

from __future__ import annotations

import torch

from pyscore.ops import _ext
from pyscore.ops.reference import prefix_item_attention_ref
from pyscore.ops.segments import CachedKeys, SegmentTable

OP = "prefix_item_attention"


class AttentionPlan:
    """prefix_item_attention for one packed batch: made once (the table validated, the work planned, the
    workspaces allocated), run once per layer with that layer's q, k, v. Runs one call at a time."""

    def __init__(self, table: SegmentTable, num_q_heads: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str, backend: str = "auto",
                 cached: CachedKeys | None = None) -> None:
        if num_q_heads <= 0 or num_kv_heads <= 0 or num_q_heads % num_kv_heads:
            raise ValueError(f"num_q_heads={num_q_heads} must be a positive multiple of num_kv_heads={num_kv_heads}")
        self.table = table
        self.cached = cached
        self.shape = (table.num_tokens, num_q_heads, num_kv_heads, head_dim)
        self.dtype, self.device = dtype, torch.device(device)
        self.module = _ext.kernel_for(OP, self.device, dtype, backend)
        self._cpu_plan = None  # the C++ plan (CPU)
        self._workspace: torch.Tensor | None = None  # the planned tile work list (CUDA)
        if self.module is None:
            return
        dims = (table.num_segments, table.num_tokens, num_q_heads, num_kv_heads)
        if self.device.type == "cpu":
            self._cpu_plan = self.module.prefix_item_attention_plan(
                table.host.data_ptr(), *dims, head_dim, _ext.torch_dtype_name(dtype), *self._cached_args(host=True))
            return
        size = self.module.prefix_item_attention_workspace_bytes(*dims)
        self._workspace = torch.empty(max(size, 16), dtype=torch.uint8, device=self.device)
        self.module.prefix_item_attention_plan(table.device.data_ptr(), *dims, head_dim, _ext.torch_dtype_name(dtype),
                                               self._workspace.data_ptr(), size, _ext.cuda_stream(self.device),
                                               *self._cached_args(host=False))

    def _cached_args(self, host: bool) -> tuple[int, int, int, int]:
        """(cached rows, cached blocks, number of blocks, block_tokens) for the kernels; zeros without."""
        c = self.cached
        if c is None:
            return 0, 0, 0, 0
        rows, blocks = (c.rows, c.blocks) if host else (c.rows_device, c.blocks_device)
        return rows.data_ptr(), blocks.data_ptr(), c.num_blocks, c.block_tokens

    def run(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None,
            cache_k: torch.Tensor | None = None, cache_v: torch.Tensor | None = None) -> torch.Tensor:
        """q: [T, Hq, D], k/v: [T, Hkv, D] (token and head strides free, last dim contiguous), in the plan's dtype
        and on its device -> out [T, Hq, D] in q's dtype. A plan with cached keys also needs this layer's block
        pools cache_k / cache_v [N, B, Hkv, D] (N = the plan's pool_blocks; strides free, last dim contiguous)."""
        self._check_qkv(q, k, v)
        self._check_cache(cache_k, cache_v)
        head_dim = self.shape[3]
        scale = head_dim**-0.5 if scale is None else float(scale)
        c = self.cached
        if self.module is None:
            if c is None:
                return prefix_item_attention_ref(q, k, v, self.table.host, scale).to(q.dtype)
            return prefix_item_attention_ref(q, k, v, self.table.host, scale, c.rows, c.blocks, cache_k,
                                             cache_v).to(q.dtype)
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        tensors = [q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(),
                   (q.stride(0), q.stride(1)), (k.stride(0), k.stride(1)), (v.stride(0), v.stride(1)),
                   (out.stride(0), out.stride(1))]
        cache = (0, 0, (0, 0, 0))
        if cache_k is not None and cache_v is not None:
            cache = (cache_k.data_ptr(), cache_v.data_ptr(), tuple(cache_k.stride()[:3]))
        if self._cpu_plan is not None:
            self.module.prefix_item_attention(self._cpu_plan, *tensors, scale, *cache)
            return out
        assert self._workspace is not None
        self.module.prefix_item_attention(
            *tensors, self.table.device.data_ptr(), self.table.num_segments, *self.shape, scale,
            _ext.torch_dtype_name(q.dtype), self._workspace.data_ptr(), self._workspace.numel(),
            _ext.cuda_stream(q.device), *self._cached_args(host=False), *cache)
        return out

    def _check_cache(self, cache_k: torch.Tensor | None, cache_v: torch.Tensor | None) -> None:
        c = self.cached
        if c is None:
            if cache_k is not None or cache_v is not None:
                raise ValueError("cache_k / cache_v given to a plan without cached keys")
            return
        _, _, num_kv_heads, head_dim = self.shape
        for name, x in (("cache_k", cache_k), ("cache_v", cache_v)):
            if x is None:
                raise ValueError(f"{name} is required: the plan has cached keys")
            self._check_tensor(name, x, dict(N=c.pool_blocks, B=c.block_tokens, Hkv=num_kv_heads, D=head_dim))
        assert cache_k is not None and cache_v is not None
        if cache_k.stride() != cache_v.stride():
            raise ValueError(f"cache_k and cache_v must have the same strides, got {cache_k.stride()} and "
                             f"{cache_v.stride()}")

    def _check_qkv(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        num_tokens, num_q_heads, num_kv_heads, head_dim = self.shape
        self._check_tensor("q", q, dict(T=num_tokens, Hq=num_q_heads, D=head_dim))
        for name, x in (("k", k), ("v", v)):
            self._check_tensor(name, x, dict(T=num_tokens, Hkv=num_kv_heads, D=head_dim))

    def _check_tensor(self, name: str, x: torch.Tensor, dims: dict[str, int]) -> None:
        """x must have the named sizes, the plan's dtype and device, and a contiguous last dimension."""
        if tuple(x.shape) != tuple(dims.values()):
            named = ", ".join(f"{k}={n}" for k, n in dims.items())
            raise ValueError(f"{name} must have shape [{named}] (the plan's), got {tuple(x.shape)}")
        if x.dtype != self.dtype or not _on(x, self.device):
            raise ValueError(f"{name} must be {self.dtype} on {self.device} (the plan's), got {x.dtype} on "
                             f"{x.device}")
        if x.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dimension")


def _on(x: torch.Tensor, device: torch.device) -> bool:
    return x.device.type == device.type and (device.index is None or x.device.index == device.index)


def prefix_item_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, segments: torch.Tensor,
                          scale: float | None = None, backend: str = "auto", cached: torch.Tensor | None = None,
                          cached_blocks: torch.Tensor | None = None, cache_k: torch.Tensor | None = None,
                          cache_v: torch.Tensor | None = None) -> torch.Tensor:
    """One-shot: q [T, Hq, D], k/v [T, Hkv, D], segments int32 [S, 4] (any device) -> out [T, Hq, D] in q's
    dtype; optionally cached keys: rows int32 [S, 3], blocks int32 [NB] and the pools cache_k / cache_v
    [N, B, Hkv, D] (see `CachedKeys`). A forward pass plans once with `AttentionPlan` instead.
    backend: "auto" | "kernel" | "reference"."""
    if q.dim() != 3 or k.dim() != 3:
        raise ValueError(f"q must be [T, Hq, D] and k [T, Hkv, D], got {tuple(q.shape)} and {tuple(k.shape)}")
    table = SegmentTable.of(segments, q.shape[0], q.device)
    keys = None
    if cached is not None:
        if cached_blocks is None or cache_k is None or cache_v is None:
            raise ValueError("cached rows need cached_blocks, cache_k and cache_v")
        keys = CachedKeys.of(table, cached, cached_blocks, cache_k.shape[1], cache_k.shape[0], q.device)
    plan = AttentionPlan(table, q.shape[1], k.shape[1], q.shape[2], q.dtype, q.device, backend, keys)
    return plan.run(q, k, v, scale, cache_k, cache_v)
