"""The prefix cache's block table on its own (no model): chained hashes (a block matches only after its whole
prefix), collisions handled by comparing tokens, salts and roots, pinning, pending blocks visible to their own
pass only, abort, LRU eviction under a tiny budget, and a long stream of requests with evictions in the middle
where every hit must hold exactly the keys written for those tokens."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch

from pyscore.model.prefix_cache import CacheLease, PrefixCache, unsupported_reason

B = 64  # blocks of 64 tokens (the CUDA store's; any multiple of the device's key tile works)
DIMS = dict(num_layers=2, num_kv_heads=1, head_dim=4, dtype=torch.float32, device="cpu", block_tokens=B)
BLOCK_BYTES = 2 * 2 * B * 1 * 4 * 4  # K and V, 2 layers, 64 tokens, 1 head, 4 dims, fp32


def make_cache(blocks: int, identity: str = "model-a") -> PrefixCache:
    cache = PrefixCache(blocks * BLOCK_BYTES, identity=identity, **DIMS)
    assert cache.capacity == blocks and cache.block_bytes == BLOCK_BYTES
    return cache


def tokens(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1000) for _ in range(n)]


def fingerprint(block_tokens: tuple[int, ...]) -> torch.Tensor:
    """What a pass "computes" for a block: values that depend on its tokens (and only on them)."""
    return torch.tensor(block_tokens, dtype=torch.float32).sum() + torch.arange(4, dtype=torch.float32)


def run_pass(cache: PrefixCache, seq: list[int], limit: int | None = None, salt: str = "",
             commit: bool = True) -> tuple[int, CacheLease]:
    """One request's pass: match, store and write the rest (each block's tokens' fingerprint into its slot, as the
    kv sink would), then commit. Returns the cached tokens and the lease."""
    lease = cache.lease()
    limit = len(seq) if limit is None else limit
    chain = lease.match(seq, limit, salt)
    for j, block in enumerate(chain):  # every hit holds what was written for exactly these tokens
        assert block.tokens == tuple(seq[j * B : (j + 1) * B])
        assert torch.equal(cache.pool[block.slot, 0, 1, 0, 0], fingerprint(block.tokens)), "a stale slot was read"
    for _, block in lease.store(chain, seq, len(seq), salt):
        cache.pool[block.slot, 0, 1, 0, 0] = fingerprint(block.tokens)
    if commit:
        lease.commit()
    return len(chain) * B, lease


def test_chained_hash_matches_only_whole_prefixes():
    cache = make_cache(16)
    a = tokens(200)
    assert run_pass(cache, a)[0] == 0
    assert cache.stats.blocks == 3  # 200 tokens: three whole blocks
    assert run_pass(cache, a)[0] == 192
    assert run_pass(cache, a + tokens(50, 1))[0] == 192
    assert run_pass(cache, a, limit=191)[0] == 128  # a block ends at or before the limit
    # One token changed in the middle of block 1: only block 0 is shared; block 2 (same tokens as a's block 2,
    # after a different block 1) is not a match either: the chain carries the whole prefix.
    b = list(a)
    b[100] += 1
    assert run_pass(cache, b)[0] == 64
    assert run_pass(cache, tokens(200, 2))[0] == 0  # a different first block: nothing shared
    assert cache.stats.hit_tokens == 192 + 192 + 128 + 64
    assert run_pass(cache, b)[0] == 192  # b's own blocks 1 and 2 were stored by its first pass


def test_a_hash_collision_is_a_miss_not_a_wrong_block(monkeypatch):
    cache = make_cache(8)
    a, b = tokens(64, 1), tokens(64, 2)
    monkeypatch.setattr(cache, "_key", lambda root, parent, toks: b"same key for every block")
    assert run_pass(cache, a)[0] == 0
    assert run_pass(cache, b)[0] == 0  # same key, other tokens: a miss, and b is not stored over a
    assert cache.stats.blocks == 1
    assert run_pass(cache, a)[0] == 64


def test_roots_and_salts_keep_caches_apart():
    seq = tokens(128)
    a, b = make_cache(8, "model-a"), make_cache(8, "model-b")
    run_pass(a, seq)
    assert a._key(a._root, None, seq[:B]) != b._key(b._root, None, seq[:B])  # the root covers the model...
    assert make_cache(8, "model-a")._root == a._root
    bf16 = PrefixCache(8 * BLOCK_BYTES, identity="model-a", **{**DIMS, "dtype": torch.bfloat16})
    assert bf16._root != a._root  # ...and the dtype
    assert run_pass(a, seq, salt="tenant-1")[0] == 0  # another salt: nothing shared with the unsalted chain
    assert run_pass(a, seq, salt="tenant-1")[0] == 128
    assert run_pass(a, seq, salt="tenant-2")[0] == 0
    assert run_pass(a, seq)[0] == 128


def test_pending_blocks_are_seen_by_their_own_pass_only_and_abort_frees_them():
    cache = make_cache(8)
    seq = tokens(130)
    _, writer = run_pass(cache, seq, commit=False)
    assert writer.match(seq, 130) and len(writer.match(seq, 130)) == 2  # a later group of the same pass
    other = cache.lease()
    assert other.match(seq, 130) == []  # another pass does not see them
    assert other.store([], seq, 130) == []  # nor writes them again
    other.commit()
    writer.abort()
    assert cache.stats.blocks == 0 and len(cache._free) == 8
    assert run_pass(cache, seq)[0] == 0
    with pytest.raises(RuntimeError, match="once"):
        writer.commit()


def test_pinned_blocks_are_never_evicted_and_a_full_cache_just_does_not_store():
    cache = make_cache(2)
    a, b = tokens(128, 1), tokens(128, 2)
    run_pass(cache, a)
    reader = cache.lease()
    assert len(reader.match(a, 128)) == 2  # both blocks pinned by a running pass
    writer = cache.lease()
    assert writer.store([], b, 128) == []  # nothing to evict: b is simply not stored
    writer.commit()
    reader.commit()
    assert cache.stats.evicted_blocks == 0
    assert run_pass(cache, b)[0] == 0 and cache.stats.evicted_blocks == 2  # now a's blocks go
    assert run_pass(cache, b)[0] == 128


def test_lru_evicts_least_recently_used_leaves_first():
    cache = make_cache(3)
    a, b, c = tokens(128, 1), tokens(64, 2), tokens(64, 3)
    run_pass(cache, a)  # blocks a0 -> a1
    run_pass(cache, b)
    run_pass(cache, a)  # a used again: b is now the least recent
    run_pass(cache, c)  # needs one slot: b goes
    assert cache.stats.evicted_blocks == 1
    assert run_pass(cache, a)[0] == 128 and run_pass(cache, c)[0] == 64
    assert run_pass(cache, b)[0] == 0  # evicted (and stored again, evicting the LRU: a's leaf a1, not a0)
    assert run_pass(cache, a)[0] == 64


def test_an_evicted_block_takes_its_descendants():
    cache = make_cache(3)
    a = tokens(192, 1)
    run_pass(cache, a)
    root = cache._blocks[cache._key(cache._root, None, a[:B])]
    cache._lru.move_to_end(root, last=False)  # make the root the least recent (as if its leaves were used later)
    assert cache._evict_one()
    assert cache.stats.blocks == 0 and cache.stats.evicted_blocks == 3 and len(cache._free) == 3


def test_a_stream_of_requests_with_evictions_in_the_middle():
    """300 requests over 12 prefixes sharing 5 system prompts, a 7-block budget: every hit's slot holds the
    fingerprint written for exactly its tokens, slots are never shared, counters add up."""
    cache = make_cache(7)
    rng = random.Random(5)
    systems = [tokens(64 * rng.randrange(1, 4), 100 + i) for i in range(5)]
    prefixes = [rng.choice(systems) + tokens(rng.randrange(0, 150), 200 + i) for i in range(12)]
    hits = looked_up = 0
    for _ in range(300):
        seq = rng.choice(prefixes)
        cached, _ = run_pass(cache, seq)
        hits += cached
        looked_up += len(seq) // B * B
        held = list(cache._blocks.values())
        assert len(held) == cache.stats.blocks <= cache.capacity
        assert len({b.slot for b in held}) == len(held) and not set(cache._free) & {b.slot for b in held}
        assert all(b.refs == 0 and b.writer is None for b in held)
        assert all(b.parent is None or b.parent in held for b in held)
    s = cache.stats
    assert s.evicted_blocks > 0 and hits > 0
    assert s.hit_tokens == hits and s.hit_tokens + s.miss_tokens == looked_up
    assert s.bytes == s.blocks * BLOCK_BYTES


def test_a_budget_below_one_block_is_refused():
    with pytest.raises(ValueError, match="holds no block"):
        PrefixCache(BLOCK_BYTES - 1, identity="m", **DIMS)


def test_writer_copies_whole_blocks_into_their_slots_at_every_layer():
    cache = make_cache(4)
    k = torch.randn(200, 1, 4)
    v = torch.randn(200, 1, 4)
    sink = cache.writer([(10, 3), (74, 0)])
    for layer in range(2):
        sink(layer, k * (layer + 1), v - layer)
    for layer in range(2):
        ck, cv = cache.layer(layer)
        assert torch.equal(ck[3], k[10:74] * (layer + 1)) and torch.equal(ck[0], k[74:138] * (layer + 1))
        assert torch.equal(cv[3], v[10:74] - layer)
    assert cache.writer([]) is None


def test_hybrid_models_are_served_and_unknown_state_kinds_refused():
    assert unsupported_reason(SimpleNamespace()) is None
    assert unsupported_reason(SimpleNamespace(layer_types=("full_attention",) * 4)) is None
    assert unsupported_reason(SimpleNamespace(layer_types=("linear_attention", "full_attention"))) is None
    reason = unsupported_reason(SimpleNamespace(layer_types=("mamba", "full_attention")))
    assert reason and "mamba" in reason


def state_blob(cache: PrefixCache, seed: int) -> torch.Tensor:
    return (torch.arange(cache.state_bytes) * (seed + 1) % 251).to(torch.uint8)


def test_recurrent_states_are_the_only_hit_points_and_live_with_their_block():
    """A hybrid model's cache: a chain is read only up to its last block with states, states are attached to the
    last block a use stores (an existing block too), invisible until the commit, stored bit for bit in pages of the
    same budget, and freed by an abort or with their block."""
    cache = PrefixCache(12 * BLOCK_BYTES, identity="hybrid", state_bytes=3 * BLOCK_BYTES - 5, **DIMS)
    assert cache.state_pages == 3
    seq = tokens(200)
    lease = cache.lease()
    use = lease.use(seq, 200, 200)
    assert use.read == () and use.state == () and [j for j, _ in use.write] == [0, 1, 2]
    assert use.snapshot is not None and use.snapshot[0] == 2 and len(use.snapshot[1]) == 3
    cache.write_state(use.snapshot[1], state_blob(cache, 1))
    assert lease.match(seq, 200) == []  # its own pending states: not a hit point for a later group of the pass
    other = cache.lease()
    assert other.match(seq, 200) == []
    other.commit()
    lease.commit()
    assert cache.stats.blocks == 6 and cache.stats.bytes == 6 * BLOCK_BYTES
    warm = cache.lease()
    again = warm.use(seq, 200, 200)
    assert len(again.read) == 3 and again.state == use.snapshot[1] and again.snapshot is None
    assert torch.equal(cache.read_state(again.state), state_blob(cache, 1))
    warm.commit()
    longer = cache.lease()  # resumes at block 2's states and keeps its own at its last block
    grown = longer.use(seq + tokens(64, 5), 264, 264)
    assert len(grown.read) == 3 and grown.snapshot is not None and grown.snapshot[0] == 3
    longer.abort()  # its block and states go; block 2's stay
    probe = cache.lease()
    assert cache.stats.blocks == 6 and len(probe.match(seq, 200)) == 3
    probe.commit()
    shorter = cache.lease()  # ends inside the chain: blocks 0-1 have no states, so nothing is read...
    short = shorter.use(seq[:150], 150, 150)
    assert short.read == () and short.write == () and short.snapshot is not None and short.snapshot[0] == 1
    cache.write_state(short.snapshot[1], state_blob(cache, 2))  # ...and states go to the existing block 1
    shorter.commit()
    assert cache.stats.blocks == 9
    hit = cache.lease()
    assert len(hit.match(seq[:150], 150)) == 2
    hit.commit()
    # A full cache evicts the least recently used chain with its states; none is needed to serve correctly.
    evict = cache.lease()
    fresh = evict.use(tokens(130, 9), 130, 130)
    assert fresh.snapshot is not None and cache.stats.evicted_blocks >= 1 and cache.stats.blocks <= 12
    evict.commit()


def test_a_pass_keeps_its_states_where_a_repeat_of_it_can_resume():
    """States go at the end of the last block the same request could read again (a prompt read out from token
    100 reads at most up to it), else at the last block computed (a longer prompt continuing it reads that)."""
    b = B
    for limit, expected in ((100, 100 // b - 1), (b - 1, 2)):
        cache = PrefixCache(12 * BLOCK_BYTES, identity="hybrid", state_bytes=BLOCK_BYTES, **DIMS)
        lease = cache.lease()
        use = lease.use(tokens(3 * b), limit, 3 * b)
        assert [j for j, _ in use.write] == [0, 1, 2] and use.snapshot is not None and use.snapshot[0] == expected
        cache.write_state(use.snapshot[1], state_blob(cache, 3))
        lease.commit()
        again = cache.lease()
        assert len(again.match(tokens(3 * b), limit)) == (expected + 1 if limit >= b else 0)
        again.commit()


def test_a_cache_that_cannot_hold_one_block_with_its_states_is_refused():
    with pytest.raises(ValueError, match="recurrent states"):
        PrefixCache(3 * BLOCK_BYTES, identity="hybrid", state_bytes=3 * BLOCK_BYTES, **DIMS)


def test_branch_points_are_where_cached_or_batch_mates_prefixes_end_without_states():
    """pyscore.branch_points on the cache alone: a head that stores-without-states part of it gets a branch at the
    end of those blocks (none when they reach its own last readable block, which its own pass keeps); heads of one
    salt that share blocks get one branch at the end of what they share, heads of other salts none; a branch whose
    states are kept already is none. `CacheLease.branch` reads the chain with states, stores the rest up to the
    branch and keeps the states at its end; nothing when they are there or another group keeps them."""
    from pyscore.branch_points import Head, branch_ends

    cache = PrefixCache(40 * BLOCK_BYTES, identity="hybrid", state_bytes=BLOCK_BYTES, **DIMS)
    system, a, c = tokens(3 * B + 10, 1), tokens(2 * B, 2), tokens(2 * B, 3)
    lease = cache.lease()
    first = lease.use(system + a, len(system + a), len(system + a))  # cached; states at its own last block (4)
    assert first.snapshot is not None and first.snapshot[0] == 4
    lease.commit()
    heads = [Head(system + c, len(system + c), ""), Head(system[: 2 * B + 5], 2 * B + 5, ""),
             Head(system + a, len(system + a), "")]
    # the first branches where it leaves the cached chain (3 blocks); the second's cached blocks end at its own
    # last readable one; the third is a repeat: its states are there
    assert branch_ends(cache, heads) == [3 * B, 0, 0]
    mates = [Head(tokens(5 * B, 7) + a, 7 * B, "x"), Head(tokens(5 * B, 7) + c, 7 * B, "x"),
             Head(tokens(5 * B, 7) + c, 7 * B, "y")]
    assert branch_ends(cache, mates) == [5 * B, 0, 0]  # one branch for the shared blocks; other salt: none
    lease = cache.lease()
    use = lease.branch(system + c, 3 * B)
    assert use is not None and use.read == () and use.write == () and use.snapshot is not None
    assert use.snapshot[0] == 2 and lease.branch(system + c, 3 * B) is None  # kept by this group already
    new = lease.branch(tokens(5 * B, 7), 5 * B, "x")
    assert new is not None and [j for j, _ in new.write] == [0, 1, 2, 3, 4] and new.snapshot[0] == 4
    lease.commit()
    assert branch_ends(cache, heads[:1]) == [0] and len(cache.lease().match(system + c, len(system + c))) == 3
