"""prefix_item_attention: attention over a packed token stream of segments (see csrc/prefix_item_attention/
params.h for the contract), split FlashInfer's way into a plan made once per batch and a run per layer.

`AttentionPlan` holds what depends only on the batch's segment table and the model's head layout: on the CPU a
C++ plan (groups, work units, key ranges) with its packed-K/V and scratch workspaces; on CUDA the tile work list,
planned on the device into one workspace; for the reference, the table alone. `plan.run(q, k, v)` then checks
only the tensors. `prefix_item_attention(q, k, v, segments)` is the one-shot form (plan, then run).

Where the plan goes next: a prefix cache gives a group's prefix keys that are not in the stream (cached blocks,
alongside the computed ones), which the plan takes at creation and lists as more key ranges of that group;
linear attention plans from the same validated `SegmentTable`."""

from __future__ import annotations

import torch

from pyscore.ops import _ext
from pyscore.ops.reference import prefix_item_attention_ref
from pyscore.ops.segments import SegmentTable

OP = "prefix_item_attention"


class AttentionPlan:
    """prefix_item_attention for one packed batch: made once (the table validated, the work planned, the
    workspaces allocated), run once per layer with that layer's q, k, v. Runs one call at a time."""

    def __init__(self, table: SegmentTable, num_q_heads: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str, backend: str = "auto") -> None:
        if num_q_heads <= 0 or num_kv_heads <= 0 or num_q_heads % num_kv_heads:
            raise ValueError(f"num_q_heads={num_q_heads} must be a positive multiple of num_kv_heads={num_kv_heads}")
        self.table = table
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
                table.host.data_ptr(), *dims, head_dim, _ext.torch_dtype_name(dtype))
            return
        size = self.module.prefix_item_attention_workspace_bytes(*dims)
        self._workspace = torch.empty(max(size, 16), dtype=torch.uint8, device=self.device)
        self.module.prefix_item_attention_plan(table.device.data_ptr(), *dims, head_dim, _ext.torch_dtype_name(dtype),
                                               self._workspace.data_ptr(), size, _ext.cuda_stream(self.device))

    def run(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None) -> torch.Tensor:
        """q: [T, Hq, D], k/v: [T, Hkv, D] (token and head strides free, last dim contiguous), in the plan's dtype
        and on its device -> out [T, Hq, D] in q's dtype."""
        self._check_qkv(q, k, v)
        head_dim = self.shape[3]
        scale = head_dim**-0.5 if scale is None else float(scale)
        if self.module is None:
            return prefix_item_attention_ref(q, k, v, self.table.host, scale).to(q.dtype)
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        tensors = [q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(),
                   (q.stride(0), q.stride(1)), (k.stride(0), k.stride(1)), (v.stride(0), v.stride(1)),
                   (out.stride(0), out.stride(1))]
        if self._cpu_plan is not None:
            self.module.prefix_item_attention(self._cpu_plan, *tensors, scale)
            return out
        assert self._workspace is not None
        self.module.prefix_item_attention(
            *tensors, self.table.device.data_ptr(), self.table.num_segments, *self.shape, scale,
            _ext.torch_dtype_name(q.dtype), self._workspace.data_ptr(), self._workspace.numel(),
            _ext.cuda_stream(q.device))
        return out

    def _check_qkv(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        num_tokens, num_q_heads, num_kv_heads, head_dim = self.shape
        if q.shape != (num_tokens, num_q_heads, head_dim):
            raise ValueError(f"q must have shape [T={num_tokens}, Hq={num_q_heads}, D={head_dim}] (the plan's), "
                             f"got {tuple(q.shape)}")
        for name, x in (("q", q), ("k", k), ("v", v)):
            if name != "q" and x.shape != (num_tokens, num_kv_heads, head_dim):
                raise ValueError(f"{name} must have shape [T={num_tokens}, Hkv={num_kv_heads}, D={head_dim}], "
                                 f"got {tuple(x.shape)}")
            if x.dtype != self.dtype or not _on(x, self.device):
                raise ValueError(f"{name} must be {self.dtype} on {self.device} (the plan's), got {x.dtype} on "
                                 f"{x.device}")
            if x.stride(2) != 1:
                raise ValueError(f"{name} must be contiguous in its last dimension")


def _on(x: torch.Tensor, device: torch.device) -> bool:
    return x.device.type == device.type and (device.index is None or x.device.index == device.index)


def prefix_item_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, segments: torch.Tensor,
                          scale: float | None = None, backend: str = "auto") -> torch.Tensor:
    """One-shot: q [T, Hq, D], k/v [T, Hkv, D], segments int32 [S, 4] (any device) -> out [T, Hq, D] in q's
    dtype. A forward pass plans once with `AttentionPlan` instead. backend: "auto" | "kernel" | "reference"."""
    if q.dim() != 3 or k.dim() != 3:
        raise ValueError(f"q must be [T, Hq, D] and k [T, Hkv, D], got {tuple(q.shape)} and {tuple(k.shape)}")
    table = SegmentTable.of(segments, q.shape[0], q.device)
    plan = AttentionPlan(table, q.shape[1], k.shape[1], q.shape[2], q.dtype, q.device, backend)
    return plan.run(q, k, v, scale)
