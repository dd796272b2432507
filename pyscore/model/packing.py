"""Packing: groups of (shared prefix, items) -> one unpadded token stream with explicit positions, a segment
table for prefix_item_attention and the read-out rows.

A group is a prefix (possibly empty) followed by its items. SIS puts each query+item in its own group with an
empty prefix; MIS puts one request's query in the prefix and its items after it. Item token j of a group with
prefix length P sits at position P + j, exactly where it would be in SIS, whatever its place in the stream,
so a request's scores do not depend on its batch-mates."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class Group:
    prefix: list[int]
    items: list[list[int]]
    readouts: list[list[int]]  # per item: offsets inside the item whose next-token distribution is read


@dataclass
class PackedBatch:
    tokens: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    segments: torch.Tensor  # [S, 4] int32: start, length, prefix_start, prefix_length
    readout: torch.Tensor  # [R] int64 stream indices
    # rows[g][i] = the read-out row indices (into readout) of item i of group g
    rows: list[list[list[int]]] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return int(self.tokens.shape[0])


def pack(groups: list[Group]) -> PackedBatch:
    tokens: list[int] = []
    positions: list[int] = []
    segments: list[tuple[int, int, int, int]] = []
    readout: list[int] = []
    rows: list[list[list[int]]] = []
    for group in groups:
        prefix_start, prefix_length = len(tokens), len(group.prefix)
        if prefix_length:
            segments.append((prefix_start, prefix_length, prefix_start, 0))
            tokens += group.prefix
            positions += range(prefix_length)
        group_rows = []
        for item, offsets in zip(group.items, group.readouts, strict=True):
            start = len(tokens)
            segments.append((start, len(item), prefix_start if prefix_length else start, prefix_length))
            tokens += item
            positions += range(prefix_length, prefix_length + len(item))
            group_rows.append(list(range(len(readout), len(readout) + len(offsets))))
            readout += [start + o for o in offsets]
        rows.append(group_rows)
    return PackedBatch(
        tokens=torch.tensor(tokens, dtype=torch.long),
        positions=torch.tensor(positions, dtype=torch.long),
        segments=torch.tensor(segments, dtype=torch.int32).reshape(-1, 4),
        readout=torch.tensor(readout, dtype=torch.long),
        rows=rows,
    )
