"""prefix_item_attention against the fp32 dense-mask reference on every device, over awkward streams (odd
lengths, 1-token items, SIS, prefix-only groups, several groups mixed), GQA ratios, head dims, dtypes and views
into a fused qkv buffer; plus the log-sum-exp merge alone. Tolerances follow flash-attention: fp32 ~1e-5, low
precision within 2x the error of a plain torch computation in that precision."""

from __future__ import annotations

import pytest
import torch

from pyscore.ops import AttentionPlan, CachedKeys, SegmentTable, _ext, prefix_item_attention
from pyscore.ops.reference import (
    attention_with_lse_ref,
    merge_state_ref,
    prefix_item_attention_ref,
    segment_attention_mask,
)
from tests.helpers import force_cpu_isa, outputs_at_tiers

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]

# A stream is a list of groups: (prefix_length, item_lengths). (0, [n]) is a SIS sequence of n tokens,
# (p, []) a prefix-only group.
STREAMS = {
    "mis": [(37, [5, 1, 30, 17, 2])],
    "sis": [(0, [13]), (0, [1]), (0, [64]), (0, [65])],
    "mixed": [(70, [1, 7, 33]), (0, [19]), (23, []), (5, [64, 3]), (0, [1]), (1, [1, 1])],
    "long": [(130, [90, 1, 45])],
}
# Ranges of over 2,000 keys (some 33 key blocks of the online softmax): a long prefix and a long causal sequence.
LONG_STREAMS = {"long-ranges": [(2100, [40, 3]), (0, [2090])]}
HEADS = {"mha-d64": (4, 4, 64), "gqa3-d64": (9, 3, 64), "gqa4-d128": (8, 2, 128), "gqa2-d96": (4, 2, 96),
         "gqa4-d256": (8, 2, 256)}  # the last: Qwen3.5's heads


def make_segments(groups: list[tuple[int, list[int]]], device) -> tuple[torch.Tensor, int]:
    """Segment table int32 [S, 4] (start, length, prefix_start, prefix_length) and the token count T."""
    rows, t = [], 0
    for prefix, items in groups:
        if prefix == 0:
            rows += [[t, n, 0, 0] for n in items]
            t += sum(items)
            continue
        rows.append([t, prefix, 0, 0])
        prefix_start, t = t, t + prefix
        for n in items:
            rows.append([t, n, prefix_start, prefix])
            t += n
    return torch.tensor(rows, dtype=torch.int32, device=device), t


def make_qkv(num_tokens, hq, hkv, d, dtype, device, fused: bool, seed: int = 0):
    """q [T, Hq, D], k/v [T, Hkv, D]; with fused=True, strided views into one [T, (Hq + 2 Hkv) * D] buffer."""
    gen = torch.Generator().manual_seed(seed)
    if fused:
        qkv = torch.randn(num_tokens, (hq + 2 * hkv) * d, generator=gen).to(device=device, dtype=dtype)
        q = qkv[:, : hq * d].view(num_tokens, hq, d)
        k = qkv[:, hq * d : (hq + hkv) * d].view(num_tokens, hkv, d)
        v = qkv[:, (hq + hkv) * d :].view(num_tokens, hkv, d)
        return q, k, v
    return tuple(torch.randn(num_tokens, h, d, generator=gen).to(device=device, dtype=dtype) for h in (hq, hkv, hkv))


def attention_in_dtype(q, k, v, segments) -> torch.Tensor:
    """The same masked attention computed plainly by torch in q's dtype: the error yardstick for bf16."""
    group = q.shape[1] // k.shape[1]
    qt, kt, vt = (x.transpose(0, 1) for x in (q, k, v))
    kt, vt = kt.repeat_interleave(group, 0), vt.repeat_interleave(group, 0)
    scores = (qt @ kt.transpose(1, 2)) * q.shape[-1] ** -0.5
    mask = segment_attention_mask(segments.cpu(), q.shape[0]).to(q.device)
    return (scores.masked_fill(~mask, float("-inf")).softmax(-1) @ vt).transpose(0, 1)


def assert_within(out: torch.Tensor, ref: torch.Tensor, atol: float, what: str) -> None:
    diff = (out.float() - ref.float()).abs()
    assert diff.max().item() <= atol, (
        f"{what}: max diff {diff.max().item():.3g} (allowed {atol:.3g}), mean diff {diff.mean().item():.3g}")


def check_prefix_item_attention(device, stream: str, heads: str, dtype: torch.dtype, fused: bool) -> None:
    hq, hkv, d = HEADS[heads]
    segments, num_tokens = make_segments({**STREAMS, **LONG_STREAMS}[stream], device)
    q, k, v = make_qkv(num_tokens, hq, hkv, d, dtype, device, fused)
    try:
        out = prefix_item_attention(q, k, v, segments, backend="kernel")
    except ValueError as e:
        if "unsupported head_dim" in str(e):
            pytest.skip(f"kernel on {device} has no head_dim {d}")
        raise
    ref = prefix_item_attention_ref(q, k, v, segments)
    assert out.dtype == dtype and out.shape == q.shape
    if dtype == torch.float32:
        assert_within(out, ref, 2e-5, f"{stream}/{heads} fp32 vs reference")
        return
    torch_err = (attention_in_dtype(q, k, v, segments).float() - ref).abs().max().item()
    assert_within(out, ref, 2 * torch_err + 1e-4, f"{stream}/{heads} {dtype} vs reference")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("heads", list(HEADS))
@pytest.mark.parametrize("stream", list(STREAMS))
def test_prefix_item_attention(device, stream, heads, dtype):
    check_prefix_item_attention(device, stream, heads, dtype, fused=False)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("heads", list(HEADS))
@pytest.mark.parametrize("stream", list(STREAMS))
def test_prefix_item_attention_avx2_cpu_path(monkeypatch, stream, heads, dtype):
    """The AVX2 + FMA kernels (tiers avx2 and avx512), forced on a bigger CPU."""
    force_cpu_isa(monkeypatch, "avx2")
    check_prefix_item_attention("cpu", stream, heads, dtype, fused=False)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("heads", ["gqa3-d64", "gqa4-d128"])
def test_prefix_item_attention_fused_qkv_views(device, heads, dtype):
    check_prefix_item_attention(device, "mixed", heads, dtype, fused=True)


@pytest.mark.parametrize("device", [*DEVICES, "cpu-avx2"])
def test_group_result_does_not_depend_on_batch_mates(monkeypatch, device):
    """A group's rows come out the same alone and packed behind other sequences."""
    if device == "cpu-avx2":
        force_cpu_isa(monkeypatch, "avx2")
        device = "cpu"
    hq, hkv, d = HEADS["gqa3-d64"]
    alone, t_alone = make_segments([(40, [9, 1, 20])], device)
    packed, t_packed = make_segments([(0, [33]), (17, [4]), (40, [9, 1, 20])], device)
    q, k, v = make_qkv(t_packed, hq, hkv, d, torch.float32, device, fused=True)
    offset = t_packed - t_alone
    out_alone = prefix_item_attention(q[offset:], k[offset:], v[offset:], alone, backend="kernel")
    out_packed = prefix_item_attention(q, k, v, packed, backend="kernel")
    assert_within(out_packed[offset:], out_alone, 1e-6, "packed vs alone")


def merge_state(o_a, lse_a, o_b, lse_b) -> tuple[torch.Tensor, torch.Tensor]:
    """The CPU kernel's merge_state (the CUDA kernel fuses its merge into one online softmax) on contiguous fp32
    [rows, dim] / [rows] tensors."""
    rows, dim = o_a.shape
    o_out, lse_out = torch.empty_like(o_a), torch.empty_like(lse_a)
    _ext.cpu_module().merge_state(*[x.data_ptr() for x in (o_a, lse_a, o_b, lse_b, o_out, lse_out)], rows, dim)
    return o_out, lse_out


@pytest.mark.parametrize("dim", [64, 128, 7])
def test_merge_state_matches_reference(dim):
    gen = torch.Generator().manual_seed(1)
    rows = 37
    o_a, o_b = (torch.randn(rows, dim, generator=gen) for _ in range(2))
    lse_a, lse_b = (torch.randn(rows, generator=gen) * 5 for _ in range(2))
    lse_a[3] = float("-inf")  # one side saw no key
    lse_b[4] = float("-inf")
    lse_a[5] = lse_b[5] = float("-inf")  # neither did
    lse_b[6] = lse_a[6] + 40.0  # one side dominates
    inputs = [o_a, lse_a, o_b, lse_b]
    out, lse = merge_state(*inputs)
    out_ref, lse_ref = merge_state_ref(*inputs)
    assert_within(out, out_ref, 1e-6, "merged output")
    assert torch.equal(torch.isinf(lse), torch.isinf(lse_ref)), "merged lse: -inf pattern differs"
    finite = ~torch.isinf(lse_ref)
    assert_within(lse[finite], lse_ref[finite], 1e-5, "merged lse")


def test_merge_of_two_key_sets_is_full_attention():
    """Attention over keys split into two disjoint sets, merged, equals attention over all of them."""
    gen = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(n, 64, generator=gen) for n in (11, 50, 50))
    mask = torch.rand(11, 50, generator=gen) < 0.7
    mask[:, 0] = True
    first = torch.zeros(50, dtype=torch.bool)
    first[:20] = True
    o_a, lse_a = attention_with_lse_ref(q, k, v, mask & first, 0.125)
    o_b, lse_b = attention_with_lse_ref(q, k, v, mask & ~first, 0.125)
    o_full, lse_full = attention_with_lse_ref(q, k, v, mask, 0.125)
    out, lse = merge_state(o_a, lse_a, o_b, lse_b)
    assert_within(out, o_full, 1e-5, "merged vs full attention")
    assert_within(lse, lse_full, 1e-5, "merged lse vs full")


@pytest.mark.parametrize("isa", ["avx2", "portable"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("heads", ["gqa3-d64", "gqa4-d128"])
def test_prefix_item_attention_lower_cpu_paths(monkeypatch, isa, heads, dtype):
    """The AVX2 kernels and the scalar code (the generic tier), forced on this CPU, on views into a fused qkv."""
    force_cpu_isa(monkeypatch, isa)
    check_prefix_item_attention("cpu", "mixed", heads, dtype, fused=True)


def bf16_dot_paths(module) -> list[str]:
    """The bf16 product paths this CPU can run (both on any AVX512-BF16 CPU), or skip."""
    if module is None or not module.cpu_features()["avx512bf16"]:
        pytest.skip("needs pyscore._C on a CPU with AVX512-BF16")
    return ["dpbf16", "widen"]


@pytest.mark.parametrize("stream", ["mixed", "long"])
@pytest.mark.parametrize("heads", ["gqa3-d64", "gqa4-d128"])
def test_bf16_widened_path_is_bitwise_the_dpbf16_path(monkeypatch, stream, heads):
    """PYSCORE_BF16_DOT=widen (FMA on widened pairs, Intel's default) gives vdpbf16ps's bits (AMD's default), and
    both pass the reference check."""
    hq, hkv, d = HEADS[heads]
    segments, num_tokens = make_segments(STREAMS[stream], "cpu")
    q, k, v = make_qkv(num_tokens, hq, hkv, d, torch.bfloat16, "cpu", fused=True, seed=3)
    outs = {}
    paths = bf16_dot_paths(_ext.cpu_module())
    monkeypatch.setenv("PYSCORE_CPU_TIER", "avx512bf16")  # the AVX-512 attend(), not the AMX tiles of tier amx
    for path in paths:
        monkeypatch.setenv("PYSCORE_BF16_DOT", path)
        assert _ext.cpu_module().cpu_features()["bf16_dot"] == path
        outs[path] = prefix_item_attention(q, k, v, segments, backend="kernel")
        check_prefix_item_attention("cpu", stream, heads, torch.bfloat16, fused=True)
    diff = (outs["widen"].float() - outs["dpbf16"].float()).abs()
    assert torch.equal(outs["widen"], outs["dpbf16"]), (
        f"max diff {diff.max().item():.3g}, mean {diff.mean().item():.3g}")


def amx_or_skip() -> None:
    module = _ext.cpu_module()
    if module is None or module.cpu_features()["hardware_tier"] != "amx":
        pytest.skip("needs pyscore._C on a CPU with AMX-BF16 (tier amx)")


@pytest.mark.parametrize("stream", list(STREAMS))
@pytest.mark.parametrize("heads", ["gqa3-d64", "gqa4-d128", "gqa4-d256"])
def test_amx_tiles_run_at_tier_amx(monkeypatch, stream, heads):
    """At tier amx, bf16 attention runs on AMX tiles: it passes the reference check, and its bits are not the
    AVX-512 attend()'s (a tile sums a block's products in its own order), which shows the tile path is the one
    that ran; forcing avx512bf16 on the same CPU gives the AVX-512 bits again."""
    amx_or_skip()
    hq, hkv, d = HEADS[heads]
    segments, num_tokens = make_segments(STREAMS[stream], "cpu")
    q, k, v = make_qkv(num_tokens, hq, hkv, d, torch.bfloat16, "cpu", fused=True, seed=5)
    monkeypatch.setenv("PYSCORE_CPU_TIER", "amx")
    tiles = prefix_item_attention(q, k, v, segments, backend="kernel")
    check_prefix_item_attention("cpu", stream, heads, torch.bfloat16, fused=True)
    monkeypatch.setenv("PYSCORE_CPU_TIER", "avx512bf16")
    fma = prefix_item_attention(q, k, v, segments, backend="kernel")
    assert not torch.equal(tiles, fma), "tier amx ran the AVX-512 attend(), not the AMX tiles"
    monkeypatch.setenv("PYSCORE_CPU_TIER", "amx")
    assert torch.equal(prefix_item_attention(q, k, v, segments, backend="kernel"), tiles)


@pytest.mark.parametrize("heads", ["gqa3-d64", "gqa4-d128"])
def test_amx_tiles_over_long_ranges(monkeypatch, heads):
    """Ranges of over 2,000 keys (many rescales of the online softmax) pass the reference check at tier amx, and an
    item's rows come out the same behind a long causal sequence as alone."""
    amx_or_skip()
    monkeypatch.setenv("PYSCORE_CPU_TIER", "amx")
    check_prefix_item_attention("cpu", "long-ranges", heads, torch.bfloat16, fused=True)
    assert_last_group_alone_as_packed(heads, [(2100, [40, 3])], [(0, [2090])])


def assert_last_group_alone_as_packed(heads: str, group: list[tuple[int, list[int]]],
                                      before: list[tuple[int, list[int]]]) -> None:
    """`group`'s bf16 rows come out bitwise the same alone and packed behind the `before` sequences."""
    hq, hkv, d = HEADS[heads]
    alone, t_alone = make_segments(group, "cpu")
    packed, t_packed = make_segments(before + group, "cpu")
    q, k, v = make_qkv(t_packed, hq, hkv, d, torch.bfloat16, "cpu", fused=True)
    offset = t_packed - t_alone
    out_alone = prefix_item_attention(q[offset:], k[offset:], v[offset:], alone, backend="kernel")
    assert torch.equal(prefix_item_attention(q, k, v, packed, backend="kernel")[offset:], out_alone)


def test_amx_tiles_result_does_not_depend_on_batch_mates(monkeypatch):
    """A 16-row tile mixes rows of different items, heads and causal limits, and a short last tile is padded: a
    group's bf16 rows still come out bitwise the same alone and packed behind other sequences."""
    amx_or_skip()
    monkeypatch.setenv("PYSCORE_CPU_TIER", "amx")
    assert_last_group_alone_as_packed("gqa3-d64", [(40, [9, 1, 20])], [(0, [33]), (17, [4])])


@pytest.mark.parametrize("device", DEVICES)
def test_segment_table_is_checked_again_after_in_place_change(device):
    segments, num_tokens = make_segments([(5, [3])], device)
    q, k, v = make_qkv(num_tokens, 2, 1, 64, torch.float32, device, fused=False)
    prefix_item_attention(q, k, v, segments)
    segments[1, 3] = 6  # the item's prefix range now covers its own first token
    with pytest.raises(ValueError, match="overlap"):
        prefix_item_attention(q, k, v, segments)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("backend", ["kernel", "reference"])
def test_one_plan_runs_every_layer(device, backend):
    """A plan made once and run with several layers' q/k/v gives each layer exactly the one-shot result."""
    hq, hkv, d = HEADS["gqa3-d64"]
    segments, num_tokens = make_segments(STREAMS["mixed"], device)
    plan = AttentionPlan(SegmentTable.of(segments, num_tokens, device), hq, hkv, d, torch.bfloat16, device, backend)
    for layer in range(3):
        q, k, v = make_qkv(num_tokens, hq, hkv, d, torch.bfloat16, device, fused=True, seed=layer)
        assert torch.equal(plan.run(q, k, v), prefix_item_attention(q, k, v, segments, backend=backend))


def test_plan_run_checks_the_tensors_against_the_plan():
    hq, hkv, d = HEADS["gqa3-d64"]
    segments, num_tokens = make_segments(STREAMS["mis"], "cpu")
    plan = AttentionPlan(SegmentTable.of(segments, num_tokens), hq, hkv, d, torch.float32, "cpu")
    q, k, v = make_qkv(num_tokens, hq, hkv, d, torch.float32, "cpu", fused=False)
    with pytest.raises(ValueError, match=r"q must have shape \[T=\d+, Hq=9, D=64\] \(the plan's\)"):
        plan.run(q[1:], k[1:], v[1:])
    with pytest.raises(ValueError, match=r"k must be torch\.float32 on cpu"):
        plan.run(q, k.bfloat16(), v)
    with pytest.raises(ValueError, match="must be a positive multiple of num_kv_heads"):
        AttentionPlan(plan.table, 9, 2, d, torch.float32, "cpu")


def test_cpu_plan_owns_its_workspaces_and_rejects_a_bad_table():
    """The C++ plan is made once per batch with its workspaces (packed K/V, per-thread scratch) and validates
    the table itself too; its runs read the table it copied, not the caller's buffer."""
    module = _ext.cpu_module()
    segments, num_tokens = make_segments(STREAMS["mixed"], "cpu")
    plan = module.prefix_item_attention_plan(segments.data_ptr(), segments.shape[0], num_tokens, 9, 3, 64, "bfloat16")
    assert plan.workspace_bytes >= 2 * num_tokens * 3 * 64 * 2 and plan.num_units > 0
    bad = segments.clone()
    bad[-1, 1] += 1  # one token past the stream
    with pytest.raises(ValueError, match="prefix_item_attention_plan: invalid argument"):
        module.prefix_item_attention_plan(bad.data_ptr(), bad.shape[0], num_tokens, 9, 3, 64, "bfloat16")


# ---- cached keys (a prefix cache's blocks before a segment's own tokens or before its prefix) -------------------

BLOCK = 64
# Groups (prefix_length, item_lengths, cached_blocks): an MIS group's cached blocks are its prefix's first
# tokens (all of them when cached_blocks * BLOCK == prefix_length); a SIS sequence's are its own first tokens.
CACHED_STREAMS = {
    "mis-partial": [(150, [5, 1, 30], 2)],
    "mis-whole": [(128, [7, 64, 1], 2)],
    "sis": [(0, [70], 1), (0, [13], 0), (0, [200], 3)],
    "mixed": [(0, [9], 0), (64, [3, 40], 1), (0, [65], 1), (300, [2], 4), (17, [5], 0), (128, [1, 1], 2)],
}
# The same kinds in the CPU store's 16-token blocks, cached runs that end inside a 64-key tile (the kernel gathers
# them with the stream keys that follow into whole tiles).
CACHED_STREAMS_16 = {
    "mis-partial": [(150, [5, 1, 30], 5)],
    "mis-whole": [(48, [7, 64, 1], 3)],
    "sis": [(0, [70], 1), (0, [13], 0), (0, [200], 7)],
    "mixed": [(0, [9], 0), (64, [3, 40], 1), (0, [65], 4), (300, [2], 9), (17, [5], 0), (32, [1, 1], 2)],
}
CACHED_CASES = [(64, name) for name in CACHED_STREAMS] + [(16, name) for name in CACHED_STREAMS_16]


def cached_stream(block: int, name: str):
    return (CACHED_STREAMS if block == 64 else CACHED_STREAMS_16)[name]


def cold_and_warm(groups, hq, hkv, d, dtype, device, seed=0, block=BLOCK):
    """The same attention twice: cold, every token in the stream; warm, the cached tokens' keys moved into a
    block pool (blocks at scattered slots) and their rows dropped. Returns (cold segments, q, k, v), (warm
    segments, cached rows, blocks, pool_k, pool_v) and the cold rows the warm stream keeps, in warm order."""
    cold_rows, warm_rows, cached_rows, blocks, kept = [], [], [], [], []
    t = w = 0
    cached_tokens = []  # (cold token start, blocks) per cached run of keys
    for prefix, items, cached in groups:
        c = cached * block
        if prefix:
            cold_rows.append([t, prefix, 0, 0])
            first = len(blocks)
            blocks += list(range(first, first + cached))
            cached_tokens.append((t, cached))
            if prefix > c:
                warm_rows.append([w, prefix - c, 0, 0])
                cached_rows.append([first, cached, 0])
            kept += range(t + c, t + prefix)
            p0, wp0 = t, w
            t, w = t + prefix, w + prefix - c
            for n in items:
                cold_rows.append([t, n, p0, prefix])
                warm_rows.append([w, n, wp0 if prefix > c else 0, prefix - c])
                cached_rows.append([first, cached, 1])
                kept += range(t, t + n)
                t, w = t + n, w + n
            continue
        for n in items:
            first = len(blocks)
            blocks += list(range(first, first + cached))
            cached_tokens.append((t, cached))
            cold_rows.append([t, n, t, 0])
            warm_rows.append([w, n - c, w, 0])
            cached_rows.append([first, cached, 0])
            kept += range(t + c, t + n)
            t, w = t + n, w + n - c
    q, k, v = make_qkv(t, hq, hkv, d, dtype, device, fused=True, seed=seed)
    pool = len(blocks) + 3
    pool += pool % 7 == 0  # not a multiple of 7, so the slots below are one-to-one
    slot = [(7 * b + 3) % pool for b in range(len(blocks))]  # scattered, some pool blocks unused
    assert len(set(slot)) == len(slot)
    gen = torch.Generator().manual_seed(seed + 1)
    pool_k, pool_v = (torch.randn(pool, block, hkv, d, generator=gen).to(device=device, dtype=dtype) for _ in "kv")
    b = 0
    for start, count in cached_tokens:
        for j in range(count):
            pool_k[slot[b]] = k[start + j * block : start + (j + 1) * block]
            pool_v[slot[b]] = v[start + j * block : start + (j + 1) * block]
            b += 1
    i32 = dict(dtype=torch.int32, device=device)
    cold = (torch.tensor(cold_rows, **i32), q, k, v)
    warm = (torch.tensor(warm_rows, **i32), torch.tensor(cached_rows, **i32), torch.tensor(slot, **i32), pool_k,
            pool_v)
    return cold, warm, torch.tensor(kept, device=device)


@pytest.mark.parametrize("device", [*DEVICES, "cpu-avx2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("heads", ["gqa3-d64", "gqa4-d128"])
@pytest.mark.parametrize("block, stream", CACHED_CASES, ids=[f"{name}-{b}" for b, name in CACHED_CASES])
def test_cached_keys_match_reference_and_the_cold_run(monkeypatch, device, block, stream, heads, dtype):
    """Keys read from a block pool give the reference's attention, and on the CPU exactly (bitwise) what the cold
    run gives the same rows: the cached blocks fill the same key tiles the stream keys filled (16-token blocks,
    the CPU store's, are gathered with the stream keys after them into whole tiles)."""
    if device == "cpu-avx2":
        force_cpu_isa(monkeypatch, "avx2")
        device = "cpu"
    if device == "cuda" and block % 64:
        pytest.skip("the CUDA kernel's cached blocks are whole 64-key tiles")
    hq, hkv, d = HEADS[heads]
    (cold_seg, q, k, v), (seg, rows, blocks, pool_k, pool_v), kept = cold_and_warm(
        cached_stream(block, stream), hq, hkv, d, dtype, device, block=block)
    cached = dict(cached=rows, cached_blocks=blocks, cache_k=pool_k, cache_v=pool_v)
    wq, wk, wv = q[kept], k[kept], v[kept]
    warm = prefix_item_attention(wq, wk, wv, seg, backend="kernel", **cached)
    ref = prefix_item_attention_ref(wq, wk, wv, seg, None, rows, blocks, pool_k, pool_v)
    cold = prefix_item_attention(q, k, v, cold_seg, backend="kernel")[kept]
    assert_within(ref, prefix_item_attention_ref(q, k, v, cold_seg)[kept], 1e-5, "reference warm vs cold")
    if dtype == torch.float32:
        assert_within(warm, ref, 2e-5, f"{stream}/{heads} fp32 vs reference")
    else:
        torch_err = (attention_in_dtype(q, k, v, cold_seg)[kept].float() - ref).abs().max().item()
        assert_within(warm, ref, 2 * torch_err + 1e-4, f"{stream}/{heads} {dtype} vs reference")
    if device == "cpu":
        assert torch.equal(warm, cold), f"{stream}: warm differs from cold, max {(warm - cold).abs().max()}"
    else:
        assert_within(warm, cold, 2e-5 if dtype == torch.float32 else 2e-2, "warm vs cold")


@pytest.mark.parametrize("isa", ["avx2", "portable"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("block", [16, 64])
def test_cached_keys_on_the_lower_cpu_paths(monkeypatch, isa, dtype, block):
    force_cpu_isa(monkeypatch, isa)
    hq, hkv, d = HEADS["gqa3-d64"]
    (cold_seg, q, k, v), (seg, rows, blocks, pool_k, pool_v), kept = cold_and_warm(
        cached_stream(block, "mixed"), hq, hkv, d, dtype, "cpu", block=block)
    warm = prefix_item_attention(q[kept], k[kept], v[kept], seg, backend="kernel", cached=rows, cached_blocks=blocks,
                                 cache_k=pool_k, cache_v=pool_v)
    assert torch.equal(warm, prefix_item_attention(q, k, v, cold_seg, backend="kernel")[kept])


@pytest.mark.parametrize("backend", ["kernel", "reference"])
def test_one_cached_plan_runs_every_layer_with_its_own_pool(backend):
    """The plan holds the cached table; each layer passes its own pool views (here: slices of one pool tensor
    laid out [N, 2, L, B, Hkv, D], as the prefix cache keeps them)."""
    hq, hkv, d = HEADS["gqa3-d64"]
    (_, q, k, v), (seg, rows, blocks, pool_k, pool_v), kept = cold_and_warm(
        CACHED_STREAMS["mixed"], hq, hkv, d, torch.bfloat16, "cpu")
    layers = 3
    pool = torch.stack([torch.stack([pool_k.roll(i, dims=-1), pool_v.roll(i, dims=-1)]) for i in range(layers)])
    pool = pool.permute(2, 1, 0, 3, 4, 5).contiguous()  # [N, 2, L, B, Hkv, D]
    table = SegmentTable.of(seg, len(kept))
    keys = CachedKeys.of(table, rows, blocks, BLOCK, pool.shape[0])
    plan = AttentionPlan(table, hq, hkv, d, torch.bfloat16, "cpu", backend, keys)
    for i in range(layers):
        got = plan.run(q[kept], k[kept], v[kept], cache_k=pool[:, 0, i], cache_v=pool[:, 1, i])
        want = prefix_item_attention(q[kept], k[kept], v[kept], seg, backend=backend, cached=rows,
                                     cached_blocks=blocks, cache_k=pool_k.roll(i, dims=-1),
                                     cache_v=pool_v.roll(i, dims=-1))
        assert torch.equal(got, want), f"layer {i}"


def test_cached_keys_are_checked_at_the_door():
    hq, hkv, d = HEADS["gqa3-d64"]
    (_, q, k, v), (seg, rows, blocks, pool_k, pool_v), kept = cold_and_warm(
        CACHED_STREAMS["mis-partial"], hq, hkv, d, torch.float32, "cpu")
    table = SegmentTable.of(seg, len(kept))
    bad_kind = rows.clone()
    bad_kind[0, 2] = 2
    with pytest.raises(ValueError, match="cached kind"):
        CachedKeys.of(table, bad_kind, blocks, BLOCK, pool_k.shape[0])
    own_with_prefix = rows.clone()
    own_with_prefix[1, 2] = 0  # an item (it has a stream prefix) with cached keys before its own tokens
    with pytest.raises(ValueError, match="cannot have cached keys before its own tokens"):
        CachedKeys.of(table, own_with_prefix, blocks, BLOCK, pool_k.shape[0])
    with pytest.raises(ValueError, match=r"block indices in \[0, 2\)"):
        CachedKeys.of(table, rows, blocks, BLOCK, 2)
    with pytest.raises(ValueError, match="inside the 1 given"):
        CachedKeys.of(table, rows, blocks[:1], BLOCK, pool_k.shape[0])
    with pytest.raises(ValueError, match="multiple of 16 \\(the kernels' key tile on cpu\\)"):
        CachedKeys.of(table, rows, blocks, 8, pool_k.shape[0])
    plan = AttentionPlan(table, hq, hkv, d, torch.float32, "cpu", "kernel",
                         CachedKeys.of(table, rows, blocks, BLOCK, pool_k.shape[0]))
    with pytest.raises(ValueError, match="cache_k is required"):
        plan.run(q[kept], k[kept], v[kept])
    with pytest.raises(ValueError, match=r"cache_v must have shape \[N=\d+, B=64"):
        plan.run(q[kept], k[kept], v[kept], cache_k=pool_k, cache_v=pool_v[:, :32])
    with pytest.raises(ValueError, match="plan without cached keys"):
        AttentionPlan(table, hq, hkv, d, torch.float32, "cpu").run(q[kept], k[kept], v[kept], cache_k=pool_k,
                                                                    cache_v=pool_v)
    module = _ext.cpu_module()  # the C++ plan checks the rules too
    with pytest.raises(ValueError, match="invalid argument"):
        module.prefix_item_attention_plan(seg.data_ptr(), seg.shape[0], len(kept), hq, hkv, d, "float32",
                                          cached=own_with_prefix.data_ptr(), cached_blocks=blocks.data_ptr(),
                                          num_cached_blocks=blocks.shape[0], block_tokens=BLOCK)


@pytest.mark.parametrize("heads", ["gqa3-d64", "gqa4-d128"])
def test_tier_avx512_runs_the_avx512_kernel(monkeypatch, heads):
    """Tier avx512 (AVX-512F without BF16) runs the AVX-512 ops in both dtypes: fp32, and bf16 on pairs widened to
    fp32 (no BF16 instruction in either: tests/ops/test_avx512_tier_isa.py), bitwise tier avx512bf16's with its bf16
    products widened, not the AVX2 ops' bits; within the reference's tolerance there."""
    hq, hkv, d = HEADS[heads]
    segments, num_tokens = make_segments(STREAMS["mixed"], "cpu")
    monkeypatch.setenv("PYSCORE_BF16_DOT", "widen")
    for dtype in (torch.float32, torch.bfloat16):
        q, k, v = make_qkv(num_tokens, hq, hkv, d, dtype, "cpu", fused=True, seed=5)
        out = outputs_at_tiers(monkeypatch, lambda q=q, k=k, v=v: prefix_item_attention(q, k, v, segments,
                                                                                    backend="kernel"))
        assert not torch.equal(out["avx512bf16"], out["avx2"]), "the kernels agree bitwise: the test cannot tell"
        assert torch.equal(out["avx512"], out["avx512bf16"]), f"{dtype} at tier avx512 is not the AVX-512 kernel"
        monkeypatch.setenv("PYSCORE_CPU_TIER", "avx512")
        check_prefix_item_attention("cpu", "mixed", heads, dtype, fused=True)
