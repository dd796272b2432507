"""Branch points of a hybrid model's prefix cache (SGLang's "mamba branching point").

A pass keeps a hybrid model's linear-attention states at one block of each sequence it caches
(`CacheLease.snapshot`: where a repeat of it can resume). So a later query or prompt that shares only a part of it
(the same system prompt, then another question) finds the shared blocks' keys and values but no states to resume
from, and computes the whole shared part again; so do batch-mates that share a prefix the cache does not hold yet.
Before such a batch's own passes, one branch pass computes each shared part once, up to where the sharing ends (the
branch point: the last whole block the cache stores of it, or that a batch-mate shares), and keeps the states
there. The batch's passes then resume from them and compute only their own tokens, as does every later request that
branches at the same place.

A branch pass changes no result: it is a chunk of the prefix (as in pyscore.chunked_prefill), the same causal
computation cut at a block boundary, bitwise the uncut one on the kernel path. Its blocks and states are published
when it succeeds; when it fails its lease drops them, and the batch's passes run as they would without it."""

from __future__ import annotations

import itertools
import logging
from collections.abc import Sequence
from dataclasses import dataclass

from pyscore.errors import PassInterrupted
from pyscore.model.decoder import Decoder
from pyscore.model.packing import CacheUse, Group, pack
from pyscore.model.prefix_cache import PrefixCache, pass_lease

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Head:
    """A causal prefix a pass caches: `tokens`, of which the blocks ending at or before `limit` may be read (a Score
    query: all of it; a Generate prompt: up to its first read-out position), under `salt`."""

    tokens: Sequence[int]
    limit: int
    salt: str


def branch_ends(cache: PrefixCache, heads: Sequence[Head]) -> list[int]:
    """Per head, the end (whole blocks) of the branch pass to run for it first, 0 for none: the furthest of the
    blocks the cache stores of it and the blocks it shares with another head (same salt), when the states there
    are not cached yet. Blocks stored up to the head's own last readable block need no branch pass: the head's own
    pass keeps its states there. One head per shared prefix: the others resume from it."""
    b = cache.block_tokens
    ends, seen = [], set()
    for head, (common, twin) in zip(heads, _shared_blocks(heads, b), strict=True):
        own = head.limit // b * b
        stored = cache.published_tokens(head.tokens, own, head.salt, resumable=False)
        # (shared up to its own end: the head's pass keeps the states there, useful to another head only if it
        # reads the same blocks, e.g. n > 1 samples of one prompt; else that head branches there itself)
        end = max(common if common < own or twin else 0, stored if stored < own else 0)
        key = (head.salt, tuple(head.tokens[:end]))
        if end <= cache.published_tokens(head.tokens, end, head.salt) or key in seen:
            ends.append(0)
            continue
        seen.add(key)
        ends.append(end)
    return ends


def _shared_blocks(heads: Sequence[Head], b: int) -> list[tuple[int, bool]]:
    """Per head, how many of its readable whole-block tokens it shares with another head of the same salt (the
    longest common prefix with its neighbours in sorted order, which is the longest with any head), and whether
    another head reads exactly the same blocks."""
    readable = [(head.salt, tuple(head.tokens[: head.limit // b * b])) for head in heads]
    order = sorted(range(len(heads)), key=lambda k: readable[k])
    shared, twin = [0] * len(heads), [False] * len(heads)
    for x, y in itertools.pairwise(order):
        (salt_x, a), (salt_y, c) = readable[x], readable[y]
        if salt_x != salt_y:
            continue
        n = 0
        while n < min(len(a), len(c)) and a[n] == c[n]:
            n += 1
        common = n // b * b
        shared[x], shared[y] = max(shared[x], common), max(shared[y], common)
        if a == c:
            twin[x] = twin[y] = True
    return list(zip(shared, twin, strict=True))


def run(decoder: Decoder, cache: PrefixCache | None, heads: Sequence[Head | None]) -> list[int]:
    """Runs the branch pass of `heads` (None: a request that caches nothing; one forward pass, none for a model
    without linear states or where no head branches) and returns per head the tokens it computed for it. A pass
    that fails is logged and leaves the cache as it was (an interrupted one raises PassInterrupted)."""
    computed = [0] * len(heads)
    caching = [(k, head) for k, head in enumerate(heads) if head is not None]
    if cache is None or not cache.state_pages or not caching:
        return computed
    ends = branch_ends(cache, [head for _, head in caching])
    if not any(ends):
        return computed
    try:
        with pass_lease(cache) as lease:
            groups, owners = [], []
            for (k, head), end in zip(caching, ends, strict=True):
                use = lease.branch(head.tokens, end, head.salt) if end else None
                if use is None:
                    continue
                stop = _stop(use)
                groups.append(Group(prefix=[], items=[list(head.tokens[:stop])], readouts=[[stop - 1]], cache=use))
                owners.append((k, stop - use.cached_tokens))
            if groups:  # the one read-out row a pass needs is not used
                batch = pack(groups)
                decoder.hidden_at(batch, kv_sink=cache.writer(batch.block_writes), blocks=cache)
    except PassInterrupted:
        raise
    except Exception:
        log.exception("a branch pass failed: the requests' own passes compute their prefixes")
        return computed
    for k, n in owners:
        computed[k] = n
    return computed


def _stop(use: CacheUse) -> int:
    """Where a branch pass's group ends: after the block it keeps the states at, else its last stored block."""
    last = use.snapshot[0] if use.snapshot is not None else use.write[-1][0]
    return (last + 1) * use.block_tokens
