"""Packing with prefix-cache blocks: cached tokens get no rows, the others keep their positions, the segment table
and its cached rows say where the cached keys go, the blocks to write point at their tokens' rows, and read-outs
still land on the right tokens."""

from __future__ import annotations

import pytest
import torch

from pyscore.model.packing import CacheUse, Group, pack
from pyscore.ops import CACHED_BEFORE_OWN, CACHED_BEFORE_PREFIX, CachedKeys, SegmentTable

B = 64


def test_pack_reads_and_writes_cached_blocks():
    prefix = list(range(1000, 1000 + 150))  # two whole blocks and 22 tokens
    mis = Group(prefix=prefix, items=[[1, 2], [3]], readouts=[[1], [0]],
                cache=CacheUse(B, read=(7,), write=((1, 4),)))  # block 0 cached, block 1 computed and stored
    whole = Group(prefix=prefix[:128], items=[[5]], readouts=[[0]], cache=CacheUse(B, read=(7, 4)))
    sis_seq = [*prefix[:130], 9, 9]
    sis = Group(prefix=[], items=[sis_seq], readouts=[[131]], cache=CacheUse(B, read=(7, 4)))
    plain = Group(prefix=[], items=[[8, 8, 8]], readouts=[[2]])
    batch = pack([mis, whole, sis, plain])
    # rows: mis prefix 150 - 64 = 86, items 2 + 1; whole: item 1; sis: 132 - 128 = 4; plain: 3
    assert batch.num_tokens == 86 + 3 + 1 + 4 + 3
    assert batch.tokens[:86].tolist() == prefix[64:] and batch.positions[:86].tolist() == list(range(64, 150))
    assert batch.positions[86:89].tolist() == [150, 151, 150]
    assert batch.positions[89] == 128 and batch.positions[90:94].tolist() == list(range(128, 132))
    assert batch.segments.tolist() == [[0, 86, 0, 0], [86, 2, 0, 86], [88, 1, 0, 86], [89, 1, 89, 0],
                                       [90, 4, 90, 0], [94, 3, 94, 0]]
    assert batch.cached.tolist() == [[0, 1, CACHED_BEFORE_OWN], [0, 1, CACHED_BEFORE_PREFIX],
                                     [0, 1, CACHED_BEFORE_PREFIX], [1, 2, CACHED_BEFORE_PREFIX],
                                     [3, 2, CACHED_BEFORE_OWN], [5, 0, CACHED_BEFORE_OWN]]
    assert batch.cached_blocks.tolist() == [7, 7, 4, 7, 4]
    assert batch.block_writes == [(0, 4)]  # block 1 (tokens 64..127) starts at the stream's row 0
    assert batch.readout.tolist() == [87, 88, 89, 93, 96]
    table = SegmentTable.of(batch.segments, batch.num_tokens)
    CachedKeys.of(table, batch.cached, batch.cached_blocks, B, 8)  # a table the kernels accept
    assert pack([plain]).cached is None and pack([plain]).block_writes == []


def test_pack_refuses_cached_tokens_it_cannot_place():
    with pytest.raises(ValueError, match="exceed"):
        pack([Group(prefix=[1] * 10, items=[[2]], readouts=[[0]], cache=CacheUse(B, read=(0,)))])
    with pytest.raises(ValueError, match="leave at least one token"):
        pack([Group(prefix=[], items=[[1] * 64], readouts=[[63]], cache=CacheUse(B, read=(0,)))])
    with pytest.raises(ValueError, match="read-out token cannot be a cached one"):
        pack([Group(prefix=[], items=[[1] * 70], readouts=[[3]], cache=CacheUse(B, read=(0,)))])
    assert torch.equal(pack([]).tokens, torch.empty(0, dtype=torch.long))
