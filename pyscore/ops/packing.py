"""The packed column order of linear's weights (csrc/linear/linear.h): which weight row each packed column holds, in
blocks of BLOCK_N, for plain and gated (SwiGLU gate_up: units of 16 gate then 16 up rows) weights. linear's
bf16 / fp32 packing (pyscore.ops.linear) and the int8 packing (pyscore.ops.linear_int8) both follow it."""

from __future__ import annotations

import torch

BLOCK_N = 64  # packed columns per block


def packed_order(out_features: int, gated: bool) -> list[int]:
    """For each packed column, the weight row it holds (-1 = zero padding)."""
    if not gated:
        return list(range(out_features))
    units = (out_features + 15) // 16
    order = []
    for u in range(units):
        for half in (0, out_features):  # gate rows, then up rows
            order += [half + r if r < out_features else -1 for r in range(16 * u, 16 * u + 16)]
    return order


def pack_index(rows: int, out_features: int, gated: bool, device) -> torch.Tensor:
    """The weight row of each packed column, N_pad of them (a multiple of BLOCK_N), `rows` (one past the last row)
    where the column is padding: index a tensor with a zero row appended."""
    order = packed_order(out_features, gated)
    columns = (len(order) + BLOCK_N - 1) // BLOCK_N * BLOCK_N
    return torch.tensor([r if r >= 0 else rows for r in order] + [rows] * (columns - len(order)), device=device)


def original_rows(out_features: int, gated: bool, device) -> torch.Tensor:
    """Packed column of each weight row, in weight row order."""
    order = packed_order(out_features, gated)
    rows = len(order) if not gated else 2 * out_features
    where = torch.empty(rows, dtype=torch.long)
    for column, row in enumerate(order):
        if row >= 0:
            where[row] = column
    return where.to(device)


def pack_rows(t: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """t [rows, ...] in packed column order (index: pack_index), padding columns zero."""
    return torch.cat([t, t.new_zeros(1, *t.shape[1:])])[index].contiguous()
