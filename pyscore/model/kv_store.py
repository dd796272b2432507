"""The paged KV store: one pool of pages, each `block_tokens` tokens of every attention layer's keys and values,
sized by one byte budget and shared by the prefix cache and running generations.

- A cached block (pyscore.model.prefix_cache) is a page with a hash and a reference count.
- A running sequence is a block table (`PageTable`): first the cached pages of its prompt, referenced (pinned,
  never written, never copied), then pages it owns for the rest of its prompt and what it generates. Its prompt's
  full blocks are offered to the cache as it prefills: those pages are the cache's blocks from then on, held by
  the sequence until it ends.
- `take()` hands out a free page; when none is free it asks its reclaimer (the prefix cache's eviction of least
  recently used pages that no sequence or pass holds) for one; None when every page is held.
- Admission (`reservations`): a generation is admitted only while what every admitted one may yet hold, prompt +
  max_tokens each in whole pages, fits the store; then a page is always free or reclaimable when a sequence needs
  one (a prompt's cached pages count in each sequence that shares them, although held once).

The pool [pages, 2 (K, V), layers, block_tokens, kv heads, head_dim] is allocated once; pages never written take no
memory. Not thread-safe: one engine worker owns it (a metrics scrape only reads `stats`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from pyscore.errors import ResourceExhausted
from pyscore.ops.segments import key_tile

if TYPE_CHECKING:
    from pyscore.model.prefix_cache import Block, PrefixCache

def page_tokens(device: torch.device | str) -> int:
    """The KV store's page size on `device` in tokens: the attention kernels' key tile there, 16 on the CPU and 64
    on CUDA, so that a cached page is whole key tiles (warm = cold bitwise). Why 16 and not 64 on the CPU:
    bench/results/memory/kv_sharing.md and docs/prefix-cache.md."""
    return key_tile(device)


@dataclass(eq=False)
class Reservation:
    """`tokens` of a store reserved for one generation until `release()` (idempotent)."""

    ledger: Reservations
    tokens: int
    held: bool = True

    def release(self) -> None:
        if self.held:
            self.held = False
            self.ledger.reserved -= self.tokens


class Reservations:
    """The admission ledger of a store of `capacity_tokens` in pages of `page_tokens`: what admitted generations
    may yet hold. `reserved` is safe to read from another thread (a metrics scrape)."""

    def __init__(self, capacity_tokens: int, page_tokens: int) -> None:
        self.capacity_tokens, self.page_tokens = capacity_tokens, page_tokens
        self.reserved = 0

    def whole_pages(self, tokens: int) -> int:
        return -(-tokens // self.page_tokens) * self.page_tokens

    def check(self, tokens: int) -> None:
        """Refuses (ResourceExhausted, naming --kv-cache-mb) a generation of `tokens` that could never fit."""
        if self.whole_pages(tokens) > self.capacity_tokens:
            raise ResourceExhausted("max_tokens", f"prompt + max_tokens is {tokens} tokens ({self.whole_pages(tokens)} "
                                    f"in whole KV pages), more than this server's KV store of {self.capacity_tokens} "
                                    "tokens (--kv-cache-mb)")

    def take(self, tokens: int) -> Reservation | None:
        """A reservation of `tokens` in whole pages if they fit beside the others now, else None."""
        whole = self.whole_pages(tokens)
        if self.reserved + whole > self.capacity_tokens:
            return None
        self.reserved += whole
        return Reservation(self, whole)


class KVStoreFull(RuntimeError):
    """No page is free and none can be reclaimed: every page is held by a sequence or the running pass."""


@dataclass
class KVStoreStats:
    """What the store holds now, in pages (each `block_bytes`)."""

    block_tokens: int
    block_bytes: int
    capacity_pages: int
    held_pages: int = 0  # taken: by sequences, by the cache, or both

    @property
    def held_bytes(self) -> int:
        return self.held_pages * self.block_bytes


class KVStore:
    def __init__(self, budget_bytes: int, *, num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device | str, block_tokens: int | None = None) -> None:
        """block_tokens: the page size (default: `page_tokens(device)`), a multiple of the device's key tile."""
        tile = key_tile(device)
        block_tokens = page_tokens(device) if block_tokens is None else block_tokens
        if block_tokens <= 0 or block_tokens % tile:
            raise ValueError(f"block_tokens must be a positive multiple of {tile} (the attention kernels' key tile "
                             f"on {torch.device(device).type}), got {block_tokens}")
        self.shape = (2, num_layers, block_tokens, num_kv_heads, head_dim)  # one page
        self.block_bytes = torch.Size(self.shape).numel() * torch.empty((), dtype=dtype).element_size()
        self.capacity = budget_bytes // self.block_bytes
        if self.capacity < 1:
            raise ValueError(f"a KV store of {budget_bytes} bytes holds no block (page) of {self.block_bytes} bytes")
        self.block_tokens = block_tokens
        self.pool = torch.empty((self.capacity, *self.shape), dtype=dtype, device=device)
        self._free = list(range(self.capacity - 1, -1, -1))
        self.reclaim: Callable[[], bool] | None = None  # frees at least one page, or says False (the cache sets it)
        self.stats = KVStoreStats(block_tokens, self.block_bytes, self.capacity)
        self.reservations = Reservations(self.capacity_tokens, block_tokens)

    @property
    def num_blocks(self) -> int:
        return self.capacity

    @property
    def capacity_tokens(self) -> int:
        return self.capacity * self.block_tokens

    def pages_for(self, tokens: int) -> int:
        return -(-tokens // self.block_tokens)

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer i's key and value pages: two [capacity, block_tokens, Hkv, D] views of the pool."""
        return self.pool[:, 0, i], self.pool[:, 1, i]

    def take(self) -> int | None:
        """A free page (reclaiming one from the cache if need be), or None when every page is held."""
        if not self._free and (self.reclaim is None or not self.reclaim()):
            return None
        self.stats.held_pages += 1
        return self._free.pop()

    def take_run(self, n: int) -> list[int] | None:
        """n free pages that are consecutive in the pool (one contiguous stretch of memory), or None; reclaims
        nothing. It looks only at the next n free pages, O(n): those of a fresh pool are consecutive, and so are
        the pages of a run given back last (searching the whole free list cost ms a call; a caller without a run
        copies instead)."""
        top = self._free[-n:] if 0 < n <= len(self._free) else []
        if not top or max(top) - min(top) != n - 1:
            return None
        del self._free[-n:]
        self.stats.held_pages += n
        return sorted(top)

    def give_back(self, page: int) -> None:
        self._free.append(page)
        self.stats.held_pages -= 1

    def writer(self, tables: Sequence[Sequence[int]], starts: Sequence[int], firsts: Sequence[int],
               counts: Sequence[int]) -> Callable[[int, torch.Tensor, torch.Tensor], None]:
        """A kv sink that writes, at every layer, sequence i's `counts[i]` rows from stream row `starts[i]` into its
        pages (`tables[i]`) at token positions firsts[i], ...: a prefill's keys and values, bitwise."""
        b, rows, pages, offsets = self.block_tokens, [], [], []
        for table, start, first, count in zip(tables, starts, firsts, counts, strict=True):
            positions = torch.arange(first, first + count)
            rows.append(torch.arange(start, start + count))
            pages.append(torch.tensor(table, dtype=torch.long)[positions // b])
            offsets.append(positions % b)
        device = self.pool.device
        rows_t, pages_t, offsets_t = (torch.cat(x).to(device) for x in (rows, pages, offsets))

        def sink(layer: int, k: torch.Tensor, v: torch.Tensor) -> None:  # k, v: [T, Hkv, D]
            for pool, x in zip(self.layer(layer), (k, v), strict=True):
                pool.index_put_((pages_t, offsets_t), x[rows_t])

        return sink


class PageTable:
    """One sequence's pages: `shared` leading ones held in the prefix cache (pinned there until `release`), then
    pages it owns. Page i holds the sequence's tokens [i * block_tokens, (i + 1) * block_tokens)."""

    def __init__(self, store: KVStore, cache: PrefixCache | None = None, shared: Sequence[Block] = ()) -> None:
        self.store, self.cache = store, cache
        self.shared = list(shared)
        if self.shared:
            assert cache is not None
            cache.hold(self.shared)
        self.pages = [block.slot for block in self.shared]
        self.owned: list[int] = []

    def reserve(self, tokens: int) -> None:
        """Owned pages until `tokens` tokens fit. Raises KVStoreFull (keeping what it took) when none is left."""
        while len(self.pages) * self.store.block_tokens < tokens:
            page = self.store.take()
            if page is None:
                raise KVStoreFull(f"the KV store's {self.store.capacity} pages of {self.store.block_tokens} tokens "
                                  "are all held by running sequences (--kv-cache-mb)")
            self.owned.append(page)
            self.pages.append(page)

    def release(self) -> None:
        """Gives owned pages back to the store and unpins the shared ones (they stay cached, least recently used
        last). Idempotent."""
        for page in self.owned:
            self.store.give_back(page)
        if self.shared:
            assert self.cache is not None
            self.cache.release(self.shared)
        self.pages, self.owned, self.shared = [], [], []
