"""The prefix cache: every layer's keys and values of recently computed causal prefixes (Score queries, Generate
prompts) in blocks of `block_tokens` tokens, reused by later requests whose tokens start the same way.

- Matching: a block is found by a chained hash of its tokens and its parent block's hash, from a root that covers
  the model, dtype and device (and a request's salt: requests with different salts never share a block, as with
  vLLM's cache_salt), so a block matches only after its whole prefix matched. On a hit the block's token ids,
  parent and root are compared too: a hash collision is a miss, never a wrong key.
- Storage: a block is a page of the paged KV store (pyscore.model.kv_store.KVStore) that running generations share:
  its slot is the page index. Attention reads cached blocks straight from the pool (`layer(i)` gives that layer's
  [pages, B, Hkv, D] views of K and V). A generation holds the cached blocks of its prompt (`hold` / `release`) while
  it runs and reads them in place. The cache holds at most `capacity` blocks (the whole store unless capped).
- A forward pass uses the cache through one `CacheLease`: blocks it reads are pinned; blocks it writes are
  pending: later groups of the same pass may read them (their keys are written before that layer's attention),
  other passes see them only after `commit()`, which the caller runs once the pass succeeded; `abort()` frees them.
- Eviction: least recently used unpinned blocks go first, each with its descendants (unreachable without it), when
  the cache is at its capacity or the store has no free page (the store asks: `KVStore.reclaim`). A block held by
  a running sequence or a pass is pinned, never evicted. When nothing can be evicted, a new block is simply not
  stored: the cache never fails a request.

Not thread-safe: one engine worker owns it (a metrics scrape only reads `stats`)."""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from pyscore.model.kv_store import KVStore
from pyscore.model.packing import CacheUse

__all__ = ["Block", "CacheLease", "PrefixCache", "PrefixCacheStats", "pass_lease",
           "unsupported_reason"]


@dataclass
class PrefixCacheStats:
    """Counters since start (tokens looked up and found / not found, blocks evicted) and what is held now."""

    block_tokens: int
    capacity_bytes: int
    bytes: int = 0  # held now: published and pending blocks
    blocks: int = 0
    hit_tokens: int = 0  # cacheable tokens read from the cache instead of computed
    miss_tokens: int = 0  # cacheable tokens (whole blocks) looked up and not found, so computed
    evicted_blocks: int = 0


@dataclass(eq=False)
class Block:
    slot: int
    key: bytes
    root: bytes  # its chain's root (the cache's, salted)
    tokens: tuple[int, ...]
    parent: Block | None
    children: list[Block] = field(default_factory=list)
    refs: int = 0  # pins by running passes and running sequences
    writer: CacheLease | None = None  # the lease that is writing it; None once published


def unsupported_reason(cfg: object) -> str | None:
    """Why the cache cannot serve this model, or None. Linear-attention layers (hybrid models such as Qwen3.5)
    carry a recurrent and a conv state along the sequence that a block of keys and values does not hold; caching
    only the attention layers would give wrong scores, so such models run without the cache."""
    kinds = set(getattr(cfg, "layer_types", ()) or ())
    if kinds - {"full_attention"}:
        return (f"layers of kind {sorted(kinds - {'full_attention'})} keep a recurrent state the prefix cache "
                "does not store")
    return None


class PrefixCache:
    def __init__(self, budget_bytes: int | None, *, identity: str, store: KVStore | None = None,
                 **dims: object) -> None:
        """The cache's blocks live in `store` (else in a store of its own of `budget_bytes`, built from `dims`:
        num_layers, num_kv_heads, head_dim, dtype, device, block_tokens); it holds at most budget_bytes of them
        (None: the whole store). identity: what makes keys and values differ besides the tokens (the model's path
        and config); the hash root covers it with the dtype, device and block shape."""
        if store is None:
            if budget_bytes is None:
                raise ValueError("a prefix cache without a store needs a budget")
            store = KVStore(budget_bytes, **dims)  # type: ignore[arg-type]
        self.store = store
        self.block_bytes, self.block_tokens = store.block_bytes, store.block_tokens
        self.capacity = store.capacity if budget_bytes is None else min(store.capacity,
                                                                        budget_bytes // self.block_bytes)
        if self.capacity < 1:
            raise ValueError(f"a prefix cache of {budget_bytes} bytes holds no block of {self.block_bytes} bytes")
        pool = store.pool
        root = f"{identity}|{pool.dtype}|{pool.device}|{store.shape}"
        self._root = hashlib.blake2b(root.encode(), digest_size=16).digest()
        self._blocks: dict[bytes, Block] = {}
        self._lru: OrderedDict[Block, None] = OrderedDict()  # unpinned published blocks, least recent first
        self.stats = PrefixCacheStats(block_tokens=self.block_tokens,
                                      capacity_bytes=self.capacity * self.block_bytes)
        store.reclaim = self._evict_one

    @property
    def pool(self) -> torch.Tensor:
        return self.store.pool

    @property
    def num_blocks(self) -> int:
        return self.store.num_blocks

    @property
    def _free(self) -> list[int]:
        """The store's free pages (what its tests check a block's slot against)."""
        return self.store._free

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer i's key and value blocks: two [pages, block_tokens, Hkv, D] views of the store's pool."""
        return self.store.layer(i)

    def lease(self) -> CacheLease:
        return CacheLease(self)

    def hold(self, blocks: Sequence[Block]) -> None:
        """Pins blocks for a running sequence that reads them in place (until `release`)."""
        for block in blocks:
            self._pin(block)

    def release(self, blocks: Sequence[Block]) -> None:
        """The sequence is done with them: unpinned in reverse, so a chain's root stays most recent."""
        for block in reversed(blocks):
            self._unpin(block)

    def writer(self, writes: Sequence[tuple[int, int]]) -> Callable[[int, torch.Tensor, torch.Tensor], None] | None:
        """A kv sink that copies, at every layer, the full blocks computed in a pass into their pool slots:
        writes = (stream index of the block's first token, slot). None when there is nothing to write."""
        if not writes:
            return None
        b = self.block_tokens
        # Runs of blocks consecutive both in the stream and in the pool (a query's blocks usually are, the pool's
        # free pages mostly): each run one slice copy a layer, where a gather then an index_copy_ per layer cost
        # ~5 ms a 16-candidate SmolLM2 MIS (bench/results/tiers/prefix_cache_sink_ab.txt).
        runs: list[list[int]] = []  # [first stream row, first slot, blocks]
        for start, slot in writes:
            if runs and start == runs[-1][0] + runs[-1][2] * b and slot == runs[-1][1] + runs[-1][2]:
                runs[-1][2] += 1
            else:
                runs.append([start, slot, 1])

        def sink(layer: int, k: torch.Tensor, v: torch.Tensor) -> None:  # k, v: [T, Hkv, D]
            for pool, x in zip(self.layer(layer), (k, v), strict=True):
                for start, slot, n in runs:
                    pool[slot : slot + n].copy_(x[start : start + n * b].view(n, b, *x.shape[1:]))

        return sink

    # --- the block table (CacheLease calls these) ----------------------------------------------------------------
    def _salted_root(self, salt: str) -> bytes:
        if not salt:
            return self._root
        return hashlib.blake2b(self._root + salt.encode(), digest_size=16).digest()

    def _key(self, root: bytes, parent: Block | None, tokens: Sequence[int]) -> bytes:
        h = hashlib.blake2b(parent.key if parent else root, digest_size=16)
        h.update(array("q", tokens).tobytes())
        return h.digest()

    def _find(self, root: bytes, parent: Block | None, tokens: tuple[int, ...], lease: CacheLease) -> Block | None:
        block = self._blocks.get(self._key(root, parent, tokens))
        if block is None or block.tokens != tokens or block.parent is not parent or block.root != root:
            return None  # absent, or a hash collision
        if block.writer is not None and block.writer is not lease:
            return None  # being written by another pass
        return block

    def _pin(self, block: Block) -> None:
        block.refs += 1
        self._lru.pop(block, None)

    def _unpin(self, block: Block) -> None:
        block.refs -= 1
        if block.refs == 0 and block.writer is None:
            self._lru[block] = None  # most recently used

    def _new_block(self, root: bytes, parent: Block | None, tokens: tuple[int, ...],
                   lease: CacheLease) -> Block | None:
        """A pending block after `parent`, or None when its key is taken or no slot can be freed."""
        key = self._key(root, parent, tokens)
        if key in self._blocks:
            return None  # a collision with another chain, or another pass writes it
        if self.stats.blocks >= self.capacity and not self._evict_one():
            return None
        slot = self.store.take()  # may evict through store.reclaim
        if slot is None:
            return None
        block = Block(slot=slot, key=key, root=root, tokens=tokens, parent=parent, writer=lease)
        self._blocks[key] = block
        if parent is not None:
            parent.children.append(block)
        self._count_held(+1)
        return block

    def _evict_one(self) -> bool:
        """Frees the least recently used unpinned block and its descendants (all unpinned: a pinned or pending
        block's ancestors are pinned). False when every block is pinned."""
        if not self._lru:
            return False
        victim, _ = self._lru.popitem(last=False)
        if victim.parent is not None:
            victim.parent.children.remove(victim)
        stack = [victim]
        while stack:
            block = stack.pop()
            assert block.refs == 0 and block.writer is None, "an unpinned block's descendant is in use"
            stack += block.children
            self._lru.pop(block, None)
            self._drop(block)
            self.stats.evicted_blocks += 1
        return True

    def _drop(self, block: Block) -> None:
        del self._blocks[block.key]
        self.store.give_back(block.slot)
        self._count_held(-1)

    def _count_held(self, blocks: int) -> None:
        self.stats.blocks += blocks
        self.stats.bytes = self.stats.blocks * self.block_bytes


@contextmanager
def pass_lease(cache: PrefixCache | None) -> Iterator[CacheLease | None]:
    """The lease of one forward pass (None without a cache): committed when the block completes, aborted when it
    raises, so what the pass wrote becomes visible only after it succeeded."""
    lease = cache.lease() if cache is not None else None
    try:
        yield lease
    except BaseException:
        if lease is not None:
            lease.abort()
        raise
    if lease is not None:
        lease.commit()


class CacheLease:
    """One forward pass's use of the cache: `match` and `store` pin blocks; `commit` (after the pass succeeded)
    publishes what it wrote and unpins everything; `abort` frees what it wrote and unpins the rest."""

    def __init__(self, cache: PrefixCache) -> None:
        self.cache = cache
        self._pinned: list[Block] = []  # in pin order; released in reverse, so a chain's root stays most recent
        self._written: list[Block] = []
        self._hits = self._misses = 0
        self._open = True

    def match(self, tokens: Sequence[int], limit: int, salt: str = "") -> list[Block]:
        """The longest chain of cached blocks (under `salt`) that starts `tokens` and ends at or before token
        `limit`: published blocks, or blocks this lease is writing. Pins them."""
        cache, b = self.cache, self.cache.block_tokens
        root = cache._salted_root(salt)
        chain: list[Block] = []
        parent = None
        for start in range(0, limit // b * b, b):
            block = cache._find(root, parent, tuple(tokens[start : start + b]), self)
            if block is None:
                break
            chain.append(block)
            parent = block
        for block in chain:
            self._pin(block)
        self._hits += len(chain) * b
        self._misses += limit // b * b - len(chain) * b
        return chain

    def store(self, chain: list[Block], tokens: Sequence[int], end: int, salt: str = "") -> list[tuple[int, Block]]:
        """Blocks for the full blocks of tokens[len(chain) * B : end] after `chain` (matched under the same salt),
        which this pass computes. Returns the ones it allocated, pending, as (block index in `tokens`, block): the
        caller writes their keys and values. Blocks already there are pinned and kept; it stops at the first block
        that cannot be stored."""
        cache, b = self.cache, self.cache.block_tokens
        root = cache._salted_root(salt)
        allocated: list[tuple[int, Block]] = []
        parent = chain[-1] if chain else None
        for start in range(len(chain) * b, end // b * b, b):
            piece = tuple(tokens[start : start + b])
            block = cache._find(root, parent, piece, self)
            if block is None:
                block = cache._new_block(root, parent, piece, self)
                if block is None:
                    break
                self._written.append(block)
                allocated.append((start // b, block))
            self._pin(block)
            parent = block
        return allocated

    def use(self, tokens: Sequence[int], limit: int, end: int, salt: str = "") -> CacheUse:
        """A group's use of the cache for `tokens`: the cached blocks ending at or before `limit` are read, the
        full blocks after them up to `end` are written (`match`, then `store`)."""
        chain = self.match(tokens, limit, salt)
        written = self.store(chain, tokens, end, salt)
        return CacheUse(self.cache.block_tokens, read=tuple(b.slot for b in chain),
                        write=tuple((j, b.slot) for j, b in written))

    def commit(self) -> None:
        """The pass succeeded: its blocks become visible to every later pass."""
        self._close()
        for block in self._written:
            block.writer = None
        self._release()
        stats = self.cache.stats
        stats.hit_tokens += self._hits
        stats.miss_tokens += self._misses

    def abort(self) -> None:
        """The pass failed: what it wrote is dropped (children before parents), what it read is unpinned."""
        self._close()
        self._release()
        for block in reversed(self._written):
            if block.parent is not None:
                block.parent.children.remove(block)
            self.cache._drop(block)

    def _pin(self, block: Block) -> None:
        self.cache._pin(block)
        self._pinned.append(block)

    def _release(self) -> None:
        for block in reversed(self._pinned):
            self.cache._unpin(block)
        self._pinned.clear()

    def _close(self) -> None:
        if not self._open:
            raise RuntimeError("a cache lease is committed or aborted once")
        self._open = False
