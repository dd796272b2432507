"""The paged KV store alone: pages taken and given back, the prefix cache reclaiming its least recently used pages
that nothing holds when the store runs out, a sequence's table holding cached pages without copying them, and the
store never holding more than its budget (KVStoreFull instead)."""

from __future__ import annotations

import pytest
import torch

from pyscore.model.kv_store import KVStore, KVStoreFull, PageTable
from pyscore.model.prefix_cache import PrefixCache

B = 64  # pages of 64 tokens (the CUDA store's; any multiple of the device's key tile works)
DIMS = dict(num_layers=2, num_kv_heads=1, head_dim=4, dtype=torch.float32, device="cpu", block_tokens=B)
PAGE_BYTES = 2 * 2 * B * 1 * 4 * 4


def store_of(pages: int) -> KVStore:
    store = KVStore(pages * PAGE_BYTES, **DIMS)
    assert store.capacity == pages and store.block_bytes == PAGE_BYTES
    return store


def test_pages_are_taken_and_given_back_within_the_budget():
    store = store_of(3)
    pages = [store.take() for _ in range(3)]
    assert sorted(pages) == [0, 1, 2] and store.stats.held_pages == 3
    assert store.take() is None  # no reclaimer, nothing free
    store.give_back(pages[1])
    assert store.take() == pages[1] and store.stats.held_bytes == 3 * PAGE_BYTES


def test_a_run_of_consecutive_pages_comes_from_the_top_of_the_free_pages():
    store = store_of(8)
    assert store.take_run(3) == [0, 1, 2] and store.stats.held_pages == 3  # a fresh pool's pages come in order
    assert store.take() == 3 and store.take_run(9) is None
    for page in (0, 1, 2, 3):
        store.give_back(page)  # the free pages' top: 3, 2, 1, then 0
    assert store.take_run(3) == [1, 2, 3] and store.stats.held_pages == 3
    assert store.take() == 0 and store.take() == 4
    store.give_back(0)  # the top: 0, then 5
    assert store.take_run(2) is None and store.stats.held_pages == 4  # not consecutive: the caller copies instead


def test_a_table_grows_by_whole_pages_and_fails_rather_than_exceed_the_store():
    store = store_of(3)
    table = PageTable(store)
    table.reserve(1)
    assert len(table.pages) == 1
    table.reserve(B)
    assert len(table.pages) == 1  # 64 tokens fit one page
    table.reserve(B + 1)
    assert len(table.pages) == 2
    other = PageTable(store)
    other.reserve(B)
    with pytest.raises(KVStoreFull, match="--kv-cache-mb"):
        other.reserve(2 * B + 1)
    assert store.stats.held_pages == 3 <= store.capacity
    table.release()
    other.release()
    table.release()  # idempotent
    assert store.stats.held_pages == 0


def test_cached_pages_are_referenced_and_evicted_only_when_nobody_holds_them():
    store = store_of(4)
    cache = PrefixCache(None, identity="m", store=store)
    tokens = list(range(3 * B))
    lease = cache.lease()
    written = lease.store([], tokens, 3 * B)
    lease.commit()
    blocks = [block for _, block in written]
    assert len(blocks) == 3 and store.stats.held_pages == 3 and cache.stats.blocks == 3

    # A sequence references the first two cached pages: its table starts with them, nothing is copied.
    seq = PageTable(store, cache, blocks[:2])
    seq.reserve(2 * B + 10)
    assert seq.pages[:2] == [blocks[0].slot, blocks[1].slot] and len(seq.owned) == 1
    assert store.stats.held_pages == 4  # 3 cached + 1 owned, the shared two counted once

    # The store is full: a new page comes from evicting the cache's unheld block, never a held one.
    other = PageTable(store)
    other.reserve(1)
    assert cache.stats.evicted_blocks == 1 and cache.stats.blocks == 2
    with pytest.raises(KVStoreFull):
        other.reserve(B + 1)  # the two cached pages left are held by `seq`
    seq.release()
    other.reserve(B + 1)  # the page `seq` owned
    assert cache.stats.blocks == 2 and store.stats.held_pages == 4
    other.reserve(2 * B + 1)  # released, the cached pages are evictable again: the chain's leaf goes first
    assert cache.stats.blocks == 1 and cache.stats.evicted_blocks == 2 and store.stats.held_pages == 4


def test_a_capped_cache_evicts_within_its_cap_and_leaves_the_rest_to_sequences():
    store = store_of(6)
    cache = PrefixCache(2 * PAGE_BYTES, identity="m", store=store)
    assert cache.capacity == 2
    lease = cache.lease()
    assert len(lease.store([], list(range(4 * B)), 4 * B)) == 2  # stops at its cap (nothing to evict: all pending)
    lease.commit()
    table = PageTable(store)
    table.reserve(4 * B)
    assert store.stats.held_pages == 6 and cache.stats.blocks == 2
