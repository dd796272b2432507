"""Packing: groups of (shared prefix, items) -> one unpadded token stream with explicit positions, a segment
table for prefix_item_attention and the read-out rows.

A group is a prefix (possibly empty) followed by its items. SIS puts each query+item in its own group with an
empty prefix; MIS puts one request's query in the prefix and its items after it. Item token j of a group with
prefix length P sits at position P + j, exactly where it would be in SIS, whatever its place in the stream,
so a request's scores do not depend on its batch-mates.

With a prefix cache a group may begin with cached tokens (`CacheUse`): the first blocks of its prefix (MIS) or of
its single item (SIS, a Generate prompt) are read from the cache's block pool and get no row in the stream; the
batch lists them per segment (`cached`, `cached_blocks`: pyscore.ops.CachedKeys) and the tokens after them keep
their positions. Full blocks the pass computes and the cache should keep are listed in `block_writes`.

A hybrid model's linear-attention layers also need their recurrent states where the cached tokens end: a segment
that starts right after them starts from those states (`state_reads`; an MIS item after a computed rest of the
query lists them too: its conv window may reach back past that rest), and a segment that computes the block the
cache keeps them at (`CacheLease.snapshot` chooses it) leaves the states at that block's end (`state_writes`)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pyscore.ops.segments import CACHED_BEFORE_OWN, CACHED_BEFORE_PREFIX


@dataclass(frozen=True)
class CacheUse:
    """A group's use of the prefix cache: its first len(read) blocks of `block_tokens` tokens (of the prefix, or
    of its single item when it has no prefix) are the pool blocks `read`; `write` lists (j, pool block) for full
    blocks j >= len(read), computed in this pass, that go to the pool."""

    block_tokens: int
    read: tuple[int, ...] = ()
    write: tuple[tuple[int, int], ...] = ()
    state: tuple[int, ...] = ()  # hybrid models: pages of the recurrent states at the end of the read blocks
    snapshot: tuple[int, tuple[int, ...]] | None = None  # (block j, pages): states at block j's end go there

    @property
    def cached_tokens(self) -> int:
        return len(self.read) * self.block_tokens


@dataclass
class Group:
    prefix: list[int]
    items: list[list[int]]
    readouts: list[list[int]]  # per item: offsets inside the item whose next-token distribution is read
    cache: CacheUse | None = None

    @property
    def cached_tokens(self) -> int:
        return self.cache.cached_tokens if self.cache else 0


@dataclass
class PackedBatch:
    tokens: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    segments: torch.Tensor  # [S, 4] int32: start, length, prefix_start, prefix_length
    readout: torch.Tensor  # [R] int64 stream indices
    # rows[g][i] = the read-out row indices (into readout) of item i of group g
    rows: list[list[list[int]]] = field(default_factory=list)
    cached: torch.Tensor | None = None  # [S, 3] int32 (first, count, kind) when a group reads cached blocks
    cached_blocks: torch.Tensor | None = None  # [NB] int32 pool blocks listed by `cached`
    block_writes: list[tuple[int, int]] = field(default_factory=list)  # (stream index of a block's start, pool block)
    # hybrid models: (segment, state pages) a segment starts from; (segment, tokens into it, pages) states to keep
    state_reads: list[tuple[int, tuple[int, ...]]] = field(default_factory=list)
    state_writes: list[tuple[int, int, tuple[int, ...]]] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return int(self.tokens.shape[0])


def pack(groups: list[Group]) -> PackedBatch:
    out = _Packer()
    for group in groups:
        out.add(group)
    return out.batch()


class _Packer:
    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.positions: list[int] = []
        self.segments: list[tuple[int, int, int, int]] = []
        self.cached: list[tuple[int, int, int]] = []
        self.cached_blocks: list[int] = []
        self.block_writes: list[tuple[int, int]] = []
        self.state_reads: list[tuple[int, tuple[int, ...]]] = []
        self.state_writes: list[tuple[int, int, tuple[int, ...]]] = []
        self.readout: list[int] = []
        self.rows: list[list[list[int]]] = []

    def add(self, group: Group) -> None:
        use = group.cache or CacheUse(block_tokens=1)
        skip = use.cached_tokens
        first = len(self.cached_blocks)
        self.cached_blocks += use.read
        if group.prefix:
            if skip > len(group.prefix):
                raise ValueError(f"{skip} cached tokens exceed the {len(group.prefix)}-token prefix")
            self._add_mis(group, use, skip, first)
        else:
            if (use.read or use.write) and (len(group.items) != 1 or skip >= len(group.items[0])):
                raise ValueError("cached blocks of a group without prefix must lead its single item and leave at "
                                 "least one token to compute")
            self._add_sequence(group, use, skip, first)

    def _segment(self, start: int, length: int, prefix_start: int, prefix_length: int, cached: tuple[int, int, int]):
        self.segments.append((start, length, prefix_start, prefix_length))
        self.cached.append(cached)

    def _writes(self, use: CacheUse, first_token_at: int) -> None:
        """The blocks to write, as stream indices: block j starts at token j * B, which sits at first_token_at +
        j * B - (cached tokens); and the states to keep, from the segment that starts at first_token_at (the
        last one added)."""
        b, skip = use.block_tokens, use.cached_tokens
        for j, slot in use.write:
            assert j >= len(use.read), "a cached block is read, not written"
            self.block_writes.append((first_token_at + j * b - skip, slot))
        if use.snapshot is not None:
            j, pages = use.snapshot
            assert j >= len(use.read), "states are kept after the blocks a group computes"
            self.state_writes.append((len(self.segments) - 1, (j + 1) * b - skip, pages))

    def _reads_state(self, use: CacheUse) -> None:
        """The segment added last starts from the states at the end of the cached blocks."""
        if use.state:
            self.state_reads.append((len(self.segments) - 1, use.state))

    def _add_mis(self, group: Group, use: CacheUse, skip: int, first: int) -> None:
        prefix_start, computed = len(self.tokens), len(group.prefix) - skip
        n = len(use.read)
        if computed:
            self._segment(prefix_start, computed, prefix_start, 0, (first, n, CACHED_BEFORE_OWN))
            self._reads_state(use)
            self.tokens += group.prefix[skip:]
            self.positions += range(skip, len(group.prefix))
            self._writes(use, prefix_start)
        else:
            assert not use.write and use.snapshot is None, "a wholly cached prefix writes nothing"
        group_rows = []
        for item, offsets in zip(group.items, group.readouts, strict=True):
            start = len(self.tokens)
            self._segment(start, len(item), prefix_start if computed else start, computed,
                          (first, n, CACHED_BEFORE_PREFIX))
            self._reads_state(use)  # after a wholly cached prefix, or (conv tail) before the computed one
            self.tokens += item
            self.positions += range(len(group.prefix), len(group.prefix) + len(item))
            group_rows.append(self._readouts(start, offsets))
        self.rows.append(group_rows)

    def _add_sequence(self, group: Group, use: CacheUse, skip: int, first: int) -> None:
        """A prefix-less group: each item its own causal sequence (the first may continue cached tokens)."""
        group_rows = []
        for item, offsets in zip(group.items, group.readouts, strict=True):
            start = len(self.tokens)
            self._segment(start, len(item) - skip, start, 0, (first, len(use.read), CACHED_BEFORE_OWN))
            self._reads_state(use)
            self._writes(use, start)
            self.tokens += item[skip:]
            self.positions += range(skip, len(item))
            if min(offsets, default=skip) < skip:
                raise ValueError("a read-out token cannot be a cached one")
            group_rows.append(self._readouts(start - skip, offsets))
        self.rows.append(group_rows)

    def _readouts(self, item_at: int, offsets: list[int]) -> list[int]:
        """Read-out rows of an item whose token 0 sits (or would sit) at stream index item_at."""
        rows = list(range(len(self.readout), len(self.readout) + len(offsets)))
        self.readout += [item_at + o for o in offsets]
        return rows

    def batch(self) -> PackedBatch:
        any_cached = bool(self.cached_blocks)
        return PackedBatch(
            tokens=torch.tensor(self.tokens, dtype=torch.long),
            positions=torch.tensor(self.positions, dtype=torch.long),
            segments=torch.tensor(self.segments, dtype=torch.int32).reshape(-1, 4),
            readout=torch.tensor(self.readout, dtype=torch.long),
            rows=self.rows,
            cached=torch.tensor(self.cached, dtype=torch.int32).reshape(-1, 3) if any_cached else None,
            cached_blocks=torch.tensor(self.cached_blocks, dtype=torch.int32) if any_cached else None,
            block_writes=self.block_writes,
            state_reads=self.state_reads,
            state_writes=self.state_writes,
        )
