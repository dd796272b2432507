"""The segment table of a packed batch, validated once per batch: one int32 row (start, length, prefix_start,
prefix_length) per item or prefix (see pyscore/model/packing.py and
csrc/prefix_item_attention/prefix_item_attention.h). Every
op that mixes tokens along the stream (prefix_item_attention today, linear attention next) plans from the same
validated table, so no layer checks it again and no device ever copies it back to the host.

`CachedKeys` is the table's companion when a prefix cache supplies keys that have no row in the stream: per
segment the blocks of a block pool that precede it, and whether they lead its own tokens or its prefix."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, eq=False)
class SegmentTable:
    host: torch.Tensor  # [S, 4] int32, contiguous, on the CPU: what planners and the reference read
    device: torch.Tensor  # the same rows on the compute device (the host tensor itself on the CPU)
    num_tokens: int

    @classmethod
    def of(cls, segments: torch.Tensor, num_tokens: int, device: torch.device | str = "cpu") -> SegmentTable:
        """Validates `segments` (on any device; read on the host once) for a stream of num_tokens tokens and
        places a copy on `device`. Raises ValueError naming what is wrong."""
        if segments.dtype != torch.int32 or segments.dim() != 2 or segments.shape[1] != 4:
            raise ValueError(f"segments must be int32 [S, 4], got {segments.dtype} {tuple(segments.shape)}")
        if not segments.is_contiguous():
            raise ValueError("segments must be contiguous")
        host = segments.cpu()
        _check_rows(host, num_tokens)
        device = torch.device(device)
        on_device = host if device.type == "cpu" else host.to(device)
        return cls(host=host, device=on_device, num_tokens=num_tokens)

    @property
    def num_segments(self) -> int:
        return int(self.host.shape[0])


def _check_rows(seg: torch.Tensor, num_tokens: int) -> None:
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


CACHED_BEFORE_OWN = 0  # cached keys continue a causal sequence (SIS, a Generate prompt, an MIS prefix's rest)
CACHED_BEFORE_PREFIX = 1  # cached keys lead the prefix an MIS group's items share (it may be wholly cached)
KEY_TILE = 64  # the CUDA kernels' key tile: a cached block (a page) must be whole tiles
CPU_KEY_TILE = 16  # the CPU kernels' (kCpuKeyTile, pyscore._C.CPU_KEY_TILE: their vector blocks of 16 or 8 keys)


def key_tile(device: torch.device | str) -> int:
    """The attention kernels' key tile on `device`: a page of the KV store (a cached block) must be whole tiles."""
    return KEY_TILE if torch.device(device).type == "cuda" else CPU_KEY_TILE


@dataclass(frozen=True, eq=False)
class CachedKeys:
    """Cached keys of a batch's segments (csrc/prefix_item_attention/prefix_item_attention.h): segment s is preceded by
    rows[s, 1] blocks of `block_tokens` keys, listed at blocks[rows[s, 0] : rows[s, 0] + rows[s, 1]] as block
    indices into a pool of `pool_blocks` blocks, placed before its own tokens or before its prefix (rows[s, 2]:
    CACHED_BEFORE_OWN / CACHED_BEFORE_PREFIX) where a run without the cache has those keys."""

    rows: torch.Tensor  # [S, 3] int32 on the CPU: first, count, kind
    blocks: torch.Tensor  # [NB] int32 on the CPU
    rows_device: torch.Tensor  # the same on the compute device (the host tensors themselves on the CPU)
    blocks_device: torch.Tensor
    block_tokens: int
    pool_blocks: int

    @classmethod
    def of(cls, table: SegmentTable, rows: torch.Tensor, blocks: torch.Tensor, block_tokens: int, pool_blocks: int,
           device: torch.device | str = "cpu") -> CachedKeys:
        """Validates the cached rows against the segment table and the pool; raises ValueError naming what is
        wrong."""
        if rows.dtype != torch.int32 or rows.shape != (table.num_segments, 3):
            raise ValueError(f"cached rows must be int32 [S={table.num_segments}, 3], got {rows.dtype} "
                             f"{tuple(rows.shape)}")
        if blocks.dtype != torch.int32 or blocks.dim() != 1:
            raise ValueError(f"cached blocks must be int32 [NB], got {blocks.dtype} {tuple(blocks.shape)}")
        device = torch.device(device)
        tile = key_tile(device)
        if block_tokens <= 0 or block_tokens % tile:
            raise ValueError(f"block_tokens must be a positive multiple of {tile} (the kernels' key tile on "
                             f"{device.type}), got {block_tokens}")
        rows, blocks = rows.cpu().contiguous(), blocks.cpu().contiguous()
        _check_cached(table.host, rows, blocks, pool_blocks)
        on_device = (lambda t: t) if device.type == "cpu" else (lambda t: t.to(device))
        return cls(rows=rows, blocks=blocks, rows_device=on_device(rows), blocks_device=on_device(blocks),
                   block_tokens=block_tokens, pool_blocks=pool_blocks)

    @property
    def num_blocks(self) -> int:
        return int(self.blocks.shape[0])


def _check_cached(seg: torch.Tensor, rows: torch.Tensor, blocks: torch.Tensor, pool_blocks: int) -> None:
    first, count, kind = rows.unbind(1)
    if bool((first < 0).any() | (count < 0).any() | ((first + count) > blocks.shape[0]).any()):
        raise ValueError(f"cached rows must list blocks inside the {blocks.shape[0]} given")
    if bool(((kind != CACHED_BEFORE_OWN) & (kind != CACHED_BEFORE_PREFIX)).any()):
        raise ValueError("cached kind must be CACHED_BEFORE_OWN (0) or CACHED_BEFORE_PREFIX (1)")
    if bool(((count > 0) & (kind == CACHED_BEFORE_OWN) & (seg[:, 3] > 0)).any()):
        raise ValueError("a segment with a prefix cannot have cached keys before its own tokens")
    if bool(((blocks < 0) | (blocks >= pool_blocks)).any()):
        raise ValueError(f"cached blocks must be block indices in [0, {pool_blocks})")
