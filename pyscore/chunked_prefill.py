"""Chunked prefill: a causal prefix longer than one forward pass's token budget (a Score query, a Generate prompt) is
computed chunk by chunk into the prefix cache's blocks, one forward pass per chunk, so that other requests' passes
run between its chunks; its last pass (the query's tail and the items, or the prompt's last tokens) then reads all
of them from the cache, exactly as a warm request reads a cached prefix.

The rules, all through the cache's public API (`CacheLease`):
- Reservation first: `plan` pins the prefix's cached blocks and allocates every missing one at once, under one
  lease that lives as long as the request. Pinned and pending blocks are never evicted, so a chunked request never
  loses an earlier chunk. When the cache cannot hold the whole prefix (too small, or held by other chunked
  requests), or is off (budget 0), `plan` returns None and the request runs as one pass, as before chunking
  existed.
- A hybrid model (Qwen3.5) also needs its linear layers' states where each chunk ends: `plan` reserves a set of
  state pages at every chunk's last block too (a chunk leaves its states there, the next chunk and the last pass
  resume from them). They are published with the blocks, so each chunk end is a hit point for later requests. Its
  published blocks without states (shared with an earlier request past that one's states) are recomputed, not
  written again, and a chunk ends where they end: a branch point (pyscore.branch_points) where later requests that
  share them resume.
- Chunk boundaries lie on block boundaries, and each chunk is the causal continuation of the blocks before it (the
  attention kernels' kCachedBeforeOwn), so chunked equals unchunked bitwise on the kernel path, as warm = cold.
- One driver: `ChunkedPrefill.advance` is the whole loop's body, one step at a time (the next chunk, or once they
  all ran the request's last pass); Score (Engine.advance_chunked, which the server's scheduler steps once per
  iteration and Engine.run_prepared runs to the end) and Generate (GenerationRunner, once per step) both step it.
- Commit after success: the blocks stay pending (visible to this request's later passes only) until the whole
  request has succeeded (`close(ok=True)` commits); a failure, a cancellation or a deadline between or inside
  chunks aborts the lease, which drops every block the request wrote. A request that bypasses the cache is chunked
  under a salt of its own and always aborted at the end: it neither reads nor leaves anything in the cache.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

from pyscore.model.decoder import Decoder
from pyscore.model.packing import CacheUse, Group, pack
from pyscore.model.prefix_cache import Block, CacheLease, PrefixCache

_private = itertools.count()
T = TypeVar("T")


@dataclass(eq=False)
class ChunkedPrefill:
    """tokens[:end] (whole blocks) computed in chunks that end at `stops` under `lease`; `done` tokens so far."""

    tokens: list[int]
    end: int
    lease: CacheLease
    blocks: list[Block]  # the prefix's blocks in order: the cached ones, then the reserved (pending) ones
    cached: int  # tokens that were in the cache before this request (read, not computed)
    publish: bool  # commit at the end (False for a request that bypasses the cache)
    stops: list[int]  # where each chunk ends, ascending, the last one `end` (chunks of at most chunk_tokens)
    first_new: int = 0  # the first block this plan allocated (a hybrid model's blocks before it are published)
    states: dict[int, tuple[int, ...]] = field(default_factory=dict)  # hybrid: token position -> its states' pages
    done: int = 0
    open: bool = True

    @property
    def finished(self) -> bool:
        return self.done >= self.end

    @property
    def computed(self) -> int:
        """Tokens of the prefix this request computed in its chunks (so far)."""
        return self.done - self.cached

    def next_chunk(self) -> Group:
        """The next chunk as one causal sequence that reads the blocks before it and writes its own (its last
        token is read out only because a pass reads out at least one row; nothing uses it)."""
        b = self.lease.cache.block_tokens
        stop = next(s for s in self.stops if s > self.done)
        slots = [block.slot for block in self.blocks]
        keep = self.states.get(stop)
        use = CacheUse(b, read=tuple(slots[: self.done // b]),
                       write=tuple((j, slots[j]) for j in range(max(self.done // b, self.first_new), stop // b)),
                       state=self.states.get(self.done, ()), snapshot=None if keep is None else (stop // b - 1, keep))
        return Group(prefix=[], items=[self.tokens[:stop]], readouts=[[stop - 1]], cache=use)

    def run_next(self, decoder: Decoder) -> int:
        """One forward pass over the next chunk; `done` advances only once it ran to its end (an interrupted or
        failed pass leaves the plan as it was). Returns the tokens it computed."""
        group = self.next_chunk()
        batch = pack([group])
        cache = self.lease.cache
        decoder.hidden_at(batch, kv_sink=cache.writer(batch.block_writes), blocks=cache)
        computed, self.done = len(group.items[0]) - self.done, len(group.items[0])
        return computed

    def advance(self, decoder: Decoder, last_pass: Callable[[], T]) -> T | None:
        """One step of the prefill: the next chunk's pass (returns None: more to come), or, once every chunk ran,
        `last_pass()` (the request's last pass, which reads them all: `read_all`) and its result. A pass that
        raises leaves the plan as it was; the caller closes it when it gives the request up."""
        if not self.finished:
            self.run_next(decoder)
            return None
        return last_pass()

    def read_all(self) -> CacheUse:
        """The whole prefix read from the cache: the request's last pass (its query's tail and items, or its
        prompt's last tokens) once every chunk ran."""
        assert self.finished, "the prefix's chunks have not all run"
        return CacheUse(self.lease.cache.block_tokens, read=tuple(block.slot for block in self.blocks),
                        state=self.states.get(self.end, ()))

    def close(self, ok: bool) -> None:
        """The request is over: on success its blocks become visible to every later pass (unless it bypassed the
        cache); otherwise everything it wrote is dropped. Idempotent."""
        if not self.open:
            return
        self.open = False
        if ok and self.publish:
            self.lease.commit()
        else:
            self.lease.abort()


def whole_blocks(tokens: int, block_tokens: int) -> int:
    """A chunk's size: `tokens` rounded down to whole blocks, at least one block."""
    return max(block_tokens, tokens // block_tokens * block_tokens)


def plan(cache: PrefixCache | None, tokens: list[int], limit: int, chunk_tokens: int, salt: str = "",
         bypass: bool = False) -> ChunkedPrefill | None:
    """Reserves the cache's blocks for tokens[:limit]'s whole blocks and returns the chunking plan, or None when
    the request runs as one pass (no cache, fewer than one whole block, or no room for the prefix and, for a
    hybrid model, the states at each chunk's end)."""
    if cache is None:
        return None
    b = cache.block_tokens
    end = limit // b * b
    if end == 0:
        return None
    if bypass:
        salt = f"\x00chunked-private-{next(_private)}"  # a chain no other request can match
    lease = cache.lease()
    chain = [] if bypass else lease.match(tokens, end, salt)
    after, first_new = lease.reserve(chain, tokens, end, salt)
    blocks = chain + after
    if len(blocks) != end // b:
        lease.abort()  # the cache cannot hold the whole prefix beside what is pinned: one pass, as before
        return None
    cached, chunk = len(chain) * b, whole_blocks(chunk_tokens, b)
    stops = sorted({*range(cached + chunk, end, chunk), end})
    if cached < first_new * b < end:  # a hybrid model's published blocks without states end there: a branch point
        stops = sorted({*stops, first_new * b})  # (pyscore.branch_points) where a later request can resume
    states = _reserve_states(lease, blocks, cached, stops) if cache.state_pages else {}
    if states is None:
        lease.abort()
        return None
    return ChunkedPrefill(tokens=tokens, end=end, lease=lease, blocks=blocks, cached=cached, publish=not bypass,
                          stops=stops, first_new=first_new, done=cached, states=states)


def _reserve_states(lease: CacheLease, blocks: list[Block], cached: int, stops: list[int]
                    ) -> dict[int, tuple[int, ...]] | None:
    """A hybrid plan's states: where its cached chain ends (published, read) and at each chunk's end (pending,
    reserved now so that no chunk can lack room later); None when the cache cannot hold them all."""
    b = lease.cache.block_tokens
    states = {cached: lease.cache.states_after(blocks[: cached // b])} if cached else {}
    for stop in stops:
        pages = lease.attach_state(blocks[stop // b - 1])
        if pages is None:
            return None
        states[stop] = pages
    return states
