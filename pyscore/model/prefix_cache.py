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
- Recurrent states (hybrid models, `state_bytes` > 0): a linear-attention layer carries a conv tail and a recurrent
  state along the sequence that no block of keys and values holds, so for such a model a cached prefix is usable
  only where the cache also holds those states at its end. A pass attaches them (`attach_state`) to one block it
  caches of a sequence (`snapshot`: the last a repeat of the request can read, else its last), in pages of the same
  store (the bytes of the states, split over `state_pages` pages: one budget), visible with the block's commit and
  freed with the block; `match` then ends a chain at its last block with states. Only the blocks with states are hit
  points: a state is ~100x a block's keys and values for Qwen3.5's shapes, so one per cached sequence end, as
  SGLang's hybrid radix cache keeps them, and one where sequences branch (`branch`, pyscore.branch_points).

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
    bytes: int = 0  # held now: published and pending blocks (and their recurrent states)
    blocks: int = 0  # pages held now: blocks and, for a hybrid model, their states' pages
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
    state: tuple[int, ...] = ()  # pages of the recurrent states after its last token (hybrid models), if any
    state_writer: CacheLease | None = None  # the lease writing `state`; None once published


def unsupported_reason(cfg: object) -> str | None:
    """Why the cache cannot serve this model, or None. Linear-attention layers (hybrid models such as Qwen3.5) are
    served with their recurrent states stored beside the blocks (`state_bytes`); a layer of another kind keeps a
    state the cache does not know how to store."""
    kinds = set(getattr(cfg, "layer_types", ()) or ())
    if kinds - {"full_attention", "linear_attention"}:
        return (f"layers of kind {sorted(kinds - {'full_attention', 'linear_attention'})} keep a state the prefix "
                "cache does not store")
    return None


class PrefixCache:
    def __init__(self, budget_bytes: int | None, *, identity: str, store: KVStore | None = None,
                 state_bytes: int = 0, **dims: object) -> None:
        """The cache's blocks live in `store` (else in a store of its own of `budget_bytes`, built from `dims`:
        num_layers, num_kv_heads, head_dim, dtype, device, block_tokens); it holds at most budget_bytes of them
        (None: the whole store), states included. identity: what makes keys and values differ besides the tokens
        (the model's path and config); the hash root covers it with the dtype, device and block shape. state_bytes:
        a hybrid model's recurrent states at one token (0: none; then every block is a hit point)."""
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
        self.state_bytes = state_bytes
        self.state_pages = -(-state_bytes // self.block_bytes)
        if self.state_pages and self.state_pages + 1 > self.capacity:
            raise ValueError(f"a prefix cache of {self.capacity} pages holds no block with its recurrent states "
                             f"({self.state_pages} pages of {self.block_bytes} bytes)")
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

    def published_tokens(self, tokens: Sequence[int], limit: int, salt: str = "", resumable: bool = True) -> int:
        """How many of tokens[:limit] a pass starting now would read (whole published blocks; for a hybrid model
        up to the last with states, or with resumable=False the blocks of keys and values whether or not states
        follow them). Reads only: pins nothing, counts no hit."""
        return len(self._chain(tokens, limit, salt, None, resumable)) * self.block_tokens

    def states_after(self, chain: Sequence[Block]) -> tuple[int, ...]:
        """The pages of the published states at the end of a chain `match` returned: where a hybrid model's pass
        resumes (empty for other models, or an empty chain)."""
        return self._state_of(chain[-1]) if chain and self.state_pages else ()

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
        # free pages mostly): each run one slice copy a layer, where a gather then an index_copy_ per layer made a
        # cold 16-candidate SmolLM2 MIS 1.02x slower on an AMX Xeon
        # (bench/results/tiers/engine/prefix_cache_sink_ab.txt).
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

    def state_view(self, pages: Sequence[int]) -> torch.Tensor | None:
        """The uint8 [state_bytes] of a block's states as a view of the pool when its pages are consecutive (read
        and written in place: no copy), else None (`read_state` / `write_state` copy)."""
        if not pages or list(pages) != list(range(pages[0], pages[0] + len(pages))):
            return None
        return self._page_bytes()[pages[0] : pages[-1] + 1].view(-1)[: self.state_bytes]

    def write_state(self, pages: Sequence[int], blob: torch.Tensor) -> None:
        """Stores `blob` (uint8 [state_bytes], on the pool's device) in `pages` (a block's state), bitwise."""
        assert blob.dtype == torch.uint8 and blob.numel() == self.state_bytes and len(pages) == self.state_pages
        padded = blob.new_zeros(self.state_pages * self.block_bytes)
        padded[: self.state_bytes] = blob
        index = torch.tensor(pages, dtype=torch.long, device=self.pool.device)
        self._page_bytes().index_copy_(0, index, padded.view(self.state_pages, self.block_bytes))

    def read_state(self, pages: Sequence[int]) -> torch.Tensor:
        """The uint8 [state_bytes] that `write_state` stored in `pages`."""
        index = torch.tensor(pages, dtype=torch.long, device=self.pool.device)
        return self._page_bytes().index_select(0, index).view(-1)[: self.state_bytes]

    def _page_bytes(self) -> torch.Tensor:
        """The pool as [pages, block_bytes] uint8 (a page is contiguous)."""
        return self.pool.view(self.pool.shape[0], -1).view(torch.uint8)

    # --- the block table (CacheLease calls these) ----------------------------------------------------------------
    def _salted_root(self, salt: str) -> bytes:
        if not salt:
            return self._root
        return hashlib.blake2b(self._root + salt.encode(), digest_size=16).digest()

    def _key(self, root: bytes, parent: Block | None, tokens: Sequence[int]) -> bytes:
        h = hashlib.blake2b(parent.key if parent else root, digest_size=16)
        h.update(array("q", tokens).tobytes())
        return h.digest()

    @staticmethod
    def _state_of(block: Block) -> tuple[int, ...]:
        """The block's state pages once published. Unlike keys and values, which a pass writes layer by layer
        before any group reads them, states are written after the pass's last layer: a later group of the same
        pass cannot start from them."""
        return block.state if block.state_writer is None else ()

    def _chain(self, tokens: Sequence[int], limit: int, salt: str, lease: CacheLease | None,
               resumable: bool = True) -> list[Block]:
        """The longest chain of blocks (under `salt`) that starts `tokens` and ends at or before token `limit`:
        published ones, or ones `lease` is writing; a hybrid model's ends at its last block with published states
        (it resumes only where they were kept) unless resumable is False."""
        root, b = self._salted_root(salt), self.block_tokens
        chain: list[Block] = []
        for start in range(0, limit // b * b, b):
            block = self._find(root, chain[-1] if chain else None, tuple(tokens[start : start + b]), lease)
            if block is None:
                break
            chain.append(block)
        if self.state_pages and resumable:
            while chain and not self._state_of(chain[-1]):
                chain.pop()
        return chain

    def _find(self, root: bytes, parent: Block | None, tokens: tuple[int, ...], lease: CacheLease | None
              ) -> Block | None:
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
        pages = self._take_pages(1)
        if pages is None:
            return None
        block = Block(slot=pages[0], key=key, root=root, tokens=tokens, parent=parent, writer=lease)
        self._blocks[key] = block
        if parent is not None:
            parent.children.append(block)
        return block

    def _attach_state(self, block: Block, lease: CacheLease) -> tuple[int, ...] | None:
        """Pages for the (pinned) block's recurrent states, pending under `lease`; None when it has states already
        or no pages can be freed."""
        if block.state:
            return None
        pages = self._take_pages(self.state_pages)
        if pages is None:
            return None
        block.state, block.state_writer = pages, lease
        return pages

    def _take_pages(self, n: int) -> tuple[int, ...] | None:
        """n pages under the cache's capacity (evicting least recently used blocks as needed), or None (nothing
        taken) when they cannot all be had. Several pages (a block's states) come as one consecutive run where the
        store's free pages hold one: then the states are read and written in place (`state_view`)."""
        while self.stats.blocks + n > self.capacity:
            if not self._evict_one():
                return None
        run = self.store.take_run(n) if n > 1 else None
        if run is not None:
            self._count_held(n)
            return tuple(run)
        pages: list[int] = []
        for _ in range(n):
            page = self.store.take()  # may evict through store.reclaim
            if page is None:
                for taken in pages:
                    self.store.give_back(taken)
                return None
            pages.append(page)
        self._count_held(n)
        return tuple(pages)

    def _give_back(self, pages: Sequence[int]) -> None:
        for page in pages:
            self.store.give_back(page)
        self._count_held(-len(pages))

    def _drop_state(self, block: Block) -> None:
        self._give_back(block.state)
        block.state, block.state_writer = (), None

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
        self._give_back((block.slot,))
        self._drop_state(block)  # last, so the next states taken find this run on top of the free pages

    def _count_held(self, pages: int) -> None:
        self.stats.blocks += pages
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
        self._stated: list[Block] = []  # blocks whose states this lease attached
        self._hits = self._misses = 0
        self._open = True

    def match(self, tokens: Sequence[int], limit: int, salt: str = "") -> list[Block]:
        """The longest chain of cached blocks (under `salt`) that starts `tokens` and ends at or before token
        `limit`: published blocks, or blocks this lease is writing. Pins them."""
        b = self.cache.block_tokens
        chain = self.cache._chain(tokens, limit, salt, self)
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
        return self._store(chain, tokens, end, salt)[0]

    def reserve(self, chain: list[Block], tokens: Sequence[int], end: int, salt: str = "") -> tuple[list[Block], int]:
        """`store` for a pass that computes every block after `chain` (a chunked prefix): all of them up to `end`,
        found (a hybrid model's blocks without states) or allocated, pinned, stopping at the first that cannot be
        stored; and the index of the first one allocated (the ones before it are published: not written again)."""
        allocated, after = self._store(chain, tokens, end, salt)
        return after, allocated[0][0] if allocated else len(chain) + len(after)

    def _store(self, chain: list[Block], tokens: Sequence[int], end: int, salt: str
               ) -> tuple[list[tuple[int, Block]], list[Block]]:
        """`store`'s allocated blocks, and every block after `chain` it pinned (found or allocated), in order."""
        cache, b = self.cache, self.cache.block_tokens
        root = cache._salted_root(salt)
        allocated: list[tuple[int, Block]] = []
        after: list[Block] = []
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
            after.append(block)
            parent = block
        return allocated, after

    def attach_state(self, block: Block) -> tuple[int, ...] | None:
        """Pages for the recurrent states at the end of `block` (pinned by this lease), which the caller fills
        (`PrefixCache.write_state`) before the commit publishes them; None when the block has states already or
        the cache cannot make room."""
        pages = self.cache._attach_state(block, self)
        if pages is not None:
            self._stated.append(block)
        return pages

    def snapshot(self, blocks: list[Block], first: int, limit: int) -> tuple[int, tuple[int, ...]] | None:
        """Where a hybrid pass keeps its states among the blocks it computes, blocks[first:] (blocks: the
        sequence's run of blocks from its start), as (block index, pages): at the end of the last block a repeat of
        the request can read (ending at or before `limit`), else of the last one (a longer prompt that continues
        this one reads it). None when there is no new block, it has states already or no room."""
        b = self.cache.block_tokens
        if first >= len(blocks):
            return None
        readable = [j for j in range(first, len(blocks)) if (j + 1) * b <= limit]
        j = readable[-1] if readable else len(blocks) - 1
        pages = self.attach_state(blocks[j])
        return None if pages is None else (j, pages)

    def branch(self, tokens: Sequence[int], end: int, salt: str = "") -> CacheUse | None:
        """A hybrid model's branch pass over tokens[:end] (whole blocks; pyscore.branch_points): it reads the
        cached chain with states, computes the rest, stores its blocks (those not there yet) and keeps the states
        at the end of the last one it could store. None when there is nothing to compute or keep: the states are
        there already or being kept by another group, or the cache has no room."""
        cache, b = self.cache, self.cache.block_tokens
        chain = cache._chain(tokens, end, salt, self)
        if len(chain) * b >= end:
            return None
        for block in chain:
            self._pin(block)
        written, after = self._store(chain, tokens, end, salt)
        pages = self.attach_state(after[-1]) if after else None
        if pages is None and not written:
            return None  # (blocks it stored must be computed: without states they still hold keys and values)
        self._misses += len(after) * b  # computed here; the pass that resumes them counts them as read
        snapshot = None if pages is None else (len(chain) + len(after) - 1, pages)
        return CacheUse(b, read=tuple(block.slot for block in chain),
                        write=tuple((j, block.slot) for j, block in written), state=cache.states_after(chain),
                        snapshot=snapshot)

    def use(self, tokens: Sequence[int], limit: int, end: int, salt: str = "") -> CacheUse:
        """A group's use of the cache for `tokens`: the cached blocks ending at or before `limit` are read, the
        full blocks after them up to `end` are written (`match`, then `store`). For a hybrid model the read chain
        ends where states were kept (`state`: they are the group's starting states) and the pass keeps its own at
        one block it computes (`snapshot`, which chooses it: the block index whose end they describe, and their
        pages)."""
        cache = self.cache
        chain = self.match(tokens, limit, salt)
        written, after = self._store(chain, tokens, end, salt)
        snapshot = self.snapshot([*chain, *after], len(chain), limit) if cache.state_pages else None
        return CacheUse(cache.block_tokens, read=tuple(b.slot for b in chain),
                        write=tuple((j, b.slot) for j, b in written), state=cache.states_after(chain),
                        snapshot=snapshot)

    def commit(self) -> None:
        """The pass succeeded: its blocks become visible to every later pass."""
        self._close()
        for block in self._written:
            block.writer = None
        for block in self._stated:
            block.state_writer = None
        self._release()
        stats = self.cache.stats
        stats.hit_tokens += self._hits
        stats.miss_tokens += self._misses

    def abort(self) -> None:
        """The pass failed: what it wrote is dropped (children before parents), what it read is unpinned."""
        self._close()
        self._release()
        for block in self._stated:
            if block.state_writer is self:  # (a block this lease wrote goes below with its states)
                self.cache._drop_state(block)
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
