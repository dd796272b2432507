"""The linear-attention ops (causal_conv1d, gated_delta_rule) against their fp32 references on every device, over
awkward streams (MIS groups with 1-4 token items, a prefix shorter than the conv window, SIS, items of 63/64/65
tokens, several groups mixed), GQA ratios, head dims and both dtypes; the references against transformers' own
Qwen3.5 torch fallbacks; MIS items equal their SIS sequences bitwise; a sequence split over calls through the state
arguments (prefill, then decode steps in place) equals it run whole, so does one resumed from a snapshot taken
mid-segment, and one whose steps run on their states in place; items after a short resumed prefix see its tail;
and the plan refuses tables the linear layers cannot walk. Tolerances: fp32 ~1e-5, bf16 within 2x the error of
rounding the fp32 reference to bf16."""

from __future__ import annotations

import pytest
import torch

from pyscore.ops import SegmentTable
from pyscore.ops.gated_delta_rule import causal_conv1d, gated_delta_rule, plan_linear_attention
from pyscore.ops.reference import causal_conv1d_ref, gated_delta_rule_ref
from tests.helpers import on_device, outputs_at_tiers, ulp_distance
from tests.ops.test_prefix_item_attention import assert_within, make_segments

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]
CPU_PATHS = ["cpu-avx2", "cpu-portable"]  # the lower tiers' kernels, forced on this CPU
STREAMS = {
    "mis-short-items": [(9, [1, 2, 3, 4])],
    "short-prefix": [(2, [1, 3, 6]), (1, [2])],
    "sis": [(0, [13]), (0, [1]), (0, [3])],
    "item-63-64-65": [(20, [63, 64, 65])],
    "mixed": [(37, [5, 1, 30]), (0, [19]), (23, []), (5, [4, 3]), (0, [1])],
}
# (Hk, Hv, Dk, Dv)
HEADS = {"r1-d16": (2, 2, 16, 16), "r2-d32x48": (2, 4, 32, 48), "r4-d13x20": (1, 4, 13, 20)}


def sequences(lengths: list[int]) -> tuple[torch.Tensor, int]:
    """The table of plain sequences back to back (SIS, generation prefill and decode), and T."""
    return make_segments([(0, [n]) for n in lengths], "cpu")


def rule_inputs(num_tokens, hk, hv, dk, dv, dtype, device, seed=0):
    """q, k, v as strided views into one fused projection output (as the decoder produces them), a/b, gates."""
    gen = torch.Generator().manual_seed(seed)
    width = 2 * hk * dk + hv * dv + 2 * hv
    fused = torch.randn(num_tokens, width, generator=gen).to(device=device, dtype=dtype)
    q = fused[:, : hk * dk].view(num_tokens, hk, dk)
    k = fused[:, hk * dk : 2 * hk * dk].view(num_tokens, hk, dk)
    v = fused[:, 2 * hk * dk : 2 * hk * dk + hv * dv].view(num_tokens, hv, dv)
    a, b = fused[:, width - 2 * hv : width - hv], fused[:, width - hv :]
    a_log = (torch.randn(hv, generator=gen) * 0.5).to(device)
    dt_bias = torch.randn(hv, generator=gen).to(device)
    return q, k, v, a, b, a_log, dt_bias


def tolerance(ref32: torch.Tensor, ref_in_dtype: torch.Tensor) -> float:
    """fp32: 1e-5 of the scale; bf16: 2x the error of torch's own computation in the dtype (the reference run on the
    same inputs in the dtype, rounding where transformers rounds) against the fp32 reference."""
    if ref_in_dtype.dtype == torch.float32:
        return 1e-5 * max(1.0, ref32.abs().max().item())
    return 2 * (ref_in_dtype.float() - ref32).abs().max().item() + 1e-6


@pytest.mark.parametrize("device", [*DEVICES, *CPU_PATHS])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("stream", list(STREAMS))
@pytest.mark.parametrize("taps,channels", [(4, 100), (2, 16), (4, 260)])
def test_causal_conv1d_matches_reference(monkeypatch, device, dtype, stream, taps, channels):
    device = on_device(monkeypatch, device)
    segments, num_tokens = make_segments(STREAMS[stream], "cpu")
    gen = torch.Generator().manual_seed(1)
    wide = torch.randn(num_tokens, channels + 24, generator=gen).to(device=device, dtype=dtype)
    x = wide[:, 5 : 5 + channels]  # a strided view, as the decoder slices the fused projection
    weight = (torch.randn(channels, taps, generator=gen) * 0.5).to(device=device, dtype=dtype)
    out = causal_conv1d(x, weight, segments, backend="kernel")
    ref32, _ = causal_conv1d_ref(x.float(), weight.float(), segments)
    ref, _ = causal_conv1d_ref(x, weight, segments)  # torch's own computation in the dtype
    assert_within(out, ref32, tolerance(ref32, ref), f"conv {stream} {dtype}")
    if dtype == torch.bfloat16:  # same roundings as torch: at most one ulp from it
        assert ulp_distance(out.cpu(), ref.cpu()).max().item() <= 1


@pytest.mark.parametrize("device", [*DEVICES, *CPU_PATHS])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("stream", list(STREAMS))
@pytest.mark.parametrize("heads", list(HEADS))
def test_gated_delta_rule_matches_reference(monkeypatch, device, dtype, stream, heads):
    device = on_device(monkeypatch, device)
    hk, hv, dk, dv = HEADS[heads]
    segments, num_tokens = make_segments(STREAMS[stream], "cpu")
    q, k, v, a, b, a_log, dt_bias = rule_inputs(num_tokens, hk, hv, dk, dv, dtype, device)
    out = gated_delta_rule(q, k, v, a, b, a_log, dt_bias, segments, backend="kernel")
    ref32, _, _ = gated_delta_rule_ref(*(t.float() for t in (q, k, v, a, b)), a_log, dt_bias, segments)
    ref, _, _ = gated_delta_rule_ref(q, k, v, a, b, a_log, dt_bias, segments)
    assert out.dtype == dtype and out.shape == v.shape
    assert_within(out, ref32, tolerance(ref32, ref), f"rule {stream} {heads} {dtype}")


@pytest.mark.parametrize("device", [*DEVICES, *CPU_PATHS])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mis_items_equal_their_sis_sequences_bitwise(monkeypatch, device, dtype):
    """An item continuing from S_p and the conv tail computes exactly what its SIS sequence computes for it."""
    device = on_device(monkeypatch, device)
    prefix, items = 11, [1, 2, 3, 4, 17]
    mis, num_tokens = make_segments([(prefix, items)], "cpu")
    hk, hv, dk, dv = 2, 4, 32, 48
    channels = 2 * hk * dk + hv * dv
    q, k, v, a, b, a_log, dt_bias = rule_inputs(num_tokens, hk, hv, dk, dv, dtype, device, seed=3)
    x = torch.randn(num_tokens, channels, generator=torch.Generator().manual_seed(4)).to(device=device, dtype=dtype)
    weight = torch.randn(channels, 4, generator=torch.Generator().manual_seed(5)).to(device=device, dtype=dtype)
    # The SIS stream: prefix + item, one sequence per item.
    order = []
    for i, n in enumerate(items):
        start = prefix + sum(items[:i])
        order += list(range(prefix)) + list(range(start, start + n))
    sis, _ = sequences([prefix + n for n in items])
    index = torch.tensor(order, device=device)
    conv_mis = causal_conv1d(x, weight, mis, backend="kernel")
    conv_sis = causal_conv1d(x[index].contiguous(), weight, sis, backend="kernel")
    rule_mis = gated_delta_rule(q, k, v, a, b, a_log, dt_bias, mis, backend="kernel")
    rule_sis = gated_delta_rule(*(t[index] for t in (q, k, v, a, b)), a_log, dt_bias, sis, backend="kernel")
    at = 0
    for i, n in enumerate(items):
        start = prefix + sum(items[:i])
        own = slice(at + prefix, at + prefix + n)
        assert torch.equal(conv_mis[start : start + n], conv_sis[own]), f"conv item {i}"
        assert torch.equal(rule_mis[start : start + n], rule_sis[own]), f"rule item {i}"
        at += prefix + n


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("backend", ["kernel", "reference"])
def test_states_continue_a_sequence_across_calls(device, dtype, backend):
    """Prefill [0, m) leaving states, then decode steps of one token continuing in place, equal one call over
    [0, n) (bitwise for the kernels); two sequences side by side, one shorter than the conv window."""
    lengths, m = [9, 2], [5, 1]
    hk, hv, dk, dv, taps = 1, 2, 16, 24, 4
    channels = 2 * hk * dk + hv * dv
    whole, num_tokens = sequences(lengths)
    q, k, v, a, b, a_log, dt_bias = rule_inputs(num_tokens, hk, hv, dk, dv, dtype, device, seed=6)
    x = torch.randn(num_tokens, channels, generator=torch.Generator().manual_seed(7)).to(device=device, dtype=dtype)
    weight = torch.randn(channels, taps, generator=torch.Generator().manual_seed(8)).to(device=device, dtype=dtype)
    conv_whole = causal_conv1d(x, weight, whole, backend=backend)
    rule_whole = gated_delta_rule(q, k, v, a, b, a_log, dt_bias, whole, backend=backend)

    starts = [0, lengths[0]]
    tails = [torch.full((taps - 1, channels), 7.0, dtype=dtype, device=device) for _ in lengths]
    states = [torch.full((hv, dk, dv), 7.0, device=device) for _ in lengths]
    prefill = torch.tensor([starts[0], starts[1]], device=device)
    rows = torch.cat([torch.arange(s, s + n, device=device) for s, n in zip(prefill.tolist(), m, strict=True)])
    table, _ = sequences(m)
    conv_parts = [causal_conv1d(x[rows].contiguous(), weight, table, tail_out=tails, backend=backend)]
    rule_parts = [gated_delta_rule(*(t[rows] for t in (q, k, v, a, b)), a_log, dt_bias, table, state_out=states,
                                   backend=backend)]
    positions = [rows]
    for step in range(max(n - p for n, p in zip(lengths, m, strict=True))):
        live = [i for i, (n, p) in enumerate(zip(lengths, m, strict=True)) if p + step < n]
        rows = torch.tensor([starts[i] + m[i] + step for i in live], device=device)
        table, _ = sequences([1] * len(live))
        tail, state = [tails[i] for i in live], [states[i] for i in live]
        conv_parts.append(causal_conv1d(x[rows].contiguous(), weight, table, tail_in=tail, tail_out=tail,
                                        backend=backend))
        rule_parts.append(gated_delta_rule(*(t[rows] for t in (q, k, v, a, b)), a_log, dt_bias, table,
                                           state_in=state, state_out=state, backend=backend))
        positions.append(rows)
    rows = torch.cat(positions)
    conv_steps, rule_steps = torch.cat(conv_parts), torch.cat(rule_parts)
    if backend == "kernel":  # the same arithmetic however the sequence is split
        assert torch.equal(conv_steps, conv_whole[rows]) and torch.equal(rule_steps, rule_whole[rows])
    else:  # torch's conv1d rounds differently for different lengths
        assert ulp_distance(conv_steps.cpu(), conv_whole[rows].cpu()).max().item() <= (64 if dtype == torch.float32
                                                                                       else 1)
        assert_within(rule_steps, rule_whole[rows], 1e-5 if dtype == torch.float32 else 8e-3, "reference rule")
    _, ref_tails = causal_conv1d_ref(x, weight, whole)
    _, ref_states, _ = gated_delta_rule_ref(q, k, v, a, b, a_log, dt_bias, whole)
    for i in range(len(lengths)):
        assert torch.equal(tails[i], ref_tails[i]), f"tail {i}"  # zero-padded on the left for the short one
        assert_within(states[i], ref_states[i], 2e-5 if dtype == torch.float32 else 1e-4, f"state {i}")


@pytest.mark.parametrize("device", ["cpu", *CPU_PATHS])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("offset", [0, 4])
def test_steps_on_their_states_in_place_equal_the_whole_sequence_bitwise(monkeypatch, device, dtype, offset):
    """A segment that resumes from its own state_in into its own state_out runs on those states' columns where they
    lie (whole 32-column blocks; Dv = 80 leaves a 16-column block on the copied path): a 1-token step into another
    buffer (the decoder's double buffering: state_in is left as it was; the x86 kernels store it past the caches when
    it is 64-byte aligned, and must not when it is `offset` floats off) and a 3-token run in place equal one call
    over the whole sequence, outputs and end state bitwise."""
    device = on_device(monkeypatch, device)
    hk, hv, dk, dv, n = 1, 2, 16, 80, 7
    whole, _ = sequences([n])
    q, k, v, a, b, a_log, dt_bias = rule_inputs(n, hk, hv, dk, dv, dtype, device, seed=9)
    end = torch.zeros(hv, dk, dv)
    rule_whole = gated_delta_rule(q, k, v, a, b, a_log, dt_bias, whole, state_out=[end], backend="kernel")
    first = torch.full((hv, dk, dv), 7.0)
    second = torch.full((offset + hv * dk * dv,), 7.0)[offset:].view(hv, dk, dv)
    assert (second.data_ptr() % 64 == 0) == (offset == 0)

    def run(rows: slice, **states) -> torch.Tensor:
        table, _ = sequences([rows.stop - rows.start])
        return gated_delta_rule(*(t[rows] for t in (q, k, v, a, b)), a_log, dt_bias, table, backend="kernel",
                                **states)

    parts = [run(slice(0, 3), state_out=[first])]
    kept = first.clone()
    parts.append(run(slice(3, 4), state_in=[first], state_out=[second]))
    assert torch.equal(first, kept)  # a step retried after a failure starts from the same state
    parts.append(run(slice(4, 7), state_in=[second], state_out=[second]))
    assert torch.equal(torch.cat(parts), rule_whole)
    assert torch.equal(second, end)


@pytest.mark.parametrize("device", [*DEVICES, *CPU_PATHS])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("backend", ["kernel", "reference"])
def test_items_after_a_short_resumed_prefix_see_its_tail_in(monkeypatch, device, dtype, backend):
    """A prefix that resumes a sequence (tail_in, state_in) and is shorter than the conv window: its items' windows
    reach back past it into the tail, given as the items' tail_in, and their states start where the prefix did:
    each item equals the whole sequence (tail, prefix, item) run as one segment from the same tail and state."""
    device = on_device(monkeypatch, device)
    hk, hv, dk, dv, taps = 1, 2, 16, 24, 4
    channels = 2 * hk * dk + hv * dv
    segments, num_tokens = make_segments([(1, [3, 1, 5])], "cpu")  # a 1-token prefix, K - 1 = 3
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(num_tokens, channels, generator=gen).to(device=device, dtype=dtype)
    weight = torch.randn(channels, taps, generator=gen).to(device=device, dtype=dtype)
    tail = torch.randn(taps - 1, channels, generator=gen).to(device=device, dtype=dtype)
    state = torch.randn(hv, dk, dv, generator=gen).to(device)
    conv = causal_conv1d(x, weight, segments, tail_in=[tail] * 4, backend=backend)
    q, k, v, a, b, a_log, dt_bias = rule_inputs(num_tokens, hk, hv, dk, dv, dtype, device, seed=5)
    rule = gated_delta_rule(q, k, v, a, b, a_log, dt_bias, segments, state_in=[state, None, None, None],
                            backend=backend)
    for start, length in ((1, 3), (4, 1), (5, 5)):
        rows = torch.cat([torch.tensor([0]), torch.arange(start, start + length)]).to(device)
        one = torch.tensor([[0, 1 + length, 0, 0]], dtype=torch.int32)
        alone = causal_conv1d(x[rows].contiguous(), weight, one, tail_in=[tail], backend=backend)
        alone_rule = gated_delta_rule(*(t[rows] for t in (q, k, v, a, b)), a_log, dt_bias, one, state_in=[state],
                                      backend=backend)
        if backend == "kernel":
            assert torch.equal(conv[start : start + length], alone[1:]), (start, length)
            assert torch.equal(rule[start : start + length], alone_rule[1:]), (start, length)
        else:
            assert_within(conv[start : start + length], alone[1:], 1e-5 if dtype == torch.float32 else 1e-2, "conv")
            assert_within(rule[start : start + length], alone_rule[1:], 1e-5 if dtype == torch.float32 else 1e-2,
                          "rule")


@pytest.mark.parametrize("device", [*DEVICES, *CPU_PATHS])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("backend", ["kernel", "reference"])
def test_a_snapshot_is_the_state_a_segment_passes_through(monkeypatch, device, dtype, backend):
    """state_snap keeps a lead segment's state after its first n tokens (a cached block's end) without changing
    anything else: it equals the state a call over those n tokens alone leaves (bitwise for the kernels), and a
    call resumed from it over the rest equals the whole segment's outputs; an item or an n outside the segment is
    refused."""
    device = on_device(monkeypatch, device)
    hk, hv, dk, dv = 2, 4, 16, 24
    segments, num_tokens = make_segments([(37, [5, 1, 30]), (0, [19]), (23, [])], "cpu")
    q, k, v, a, b, a_log, dt_bias = rule_inputs(num_tokens, hk, hv, dk, dv, dtype, device, seed=11)
    rule = (q, k, v, a, b, a_log, dt_bias)
    plain = gated_delta_rule(*rule, segments, backend=backend)
    start_in = torch.randn(hv, dk, dv, generator=torch.Generator().manual_seed(2)).to(device)
    lead, sis, last = 0, 4, 5  # the MIS group's prefix, the SIS sequence, the item-less prefix
    snaps = [torch.full((hv, dk, dv), 7.0, device=device) for _ in range(3)]
    asked = [None] * 6
    asked[lead], asked[sis], asked[last] = (16, snaps[0]), (19, snaps[1]), (1, snaps[2])
    state_in = [None] * 6
    state_in[sis] = start_in
    ours = gated_delta_rule(*rule, segments, state_snap=asked, state_in=state_in, backend=backend)
    resumed = gated_delta_rule(*rule, segments, state_in=state_in, backend=backend)
    assert torch.equal(ours, resumed)  # asking for snapshots changes no output
    assert torch.equal(ours[: 37 + 36], plain[: 37 + 36])
    rows = segments.tolist()
    for (s, n), snap in zip(((lead, 16), (sis, 19), (last, 1)), snaps, strict=True):
        start = rows[s][0]
        alone_out = torch.empty(hv, dk, dv, device=device)
        table = torch.tensor([[0, n, 0, 0]], dtype=torch.int32)
        gated_delta_rule(*(t[start : start + n] for t in rule[:5]), a_log, dt_bias, table,
                         state_in=[state_in[s]], state_out=[alone_out], backend=backend)
        if backend == "kernel":
            assert torch.equal(snap, alone_out), f"segment {s}"
        else:
            assert_within(snap, alone_out, 1e-5 if dtype == torch.float32 else 1e-4, f"segment {s}")
    # Resumed from the lead's snapshot, the rest of the lead and its items are what the whole call computed.
    rest = torch.tensor([[0, 21, 0, 0], [21, 5, 0, 21], [26, 1, 0, 21], [27, 30, 0, 21]], dtype=torch.int32)
    after = gated_delta_rule(*(t[16:73] for t in rule[:5]), a_log, dt_bias, rest, state_in=[snaps[0], None, None, None],
                             backend=backend)
    if backend == "kernel":
        assert torch.equal(after, ours[16:73])
    else:
        assert_within(after, ours[16:73], 1e-5 if dtype == torch.float32 else 8e-3, "resumed")
    with pytest.raises(ValueError, match="continues its prefix"):
        gated_delta_rule(*rule, segments, state_snap=[None, (1, snaps[0]), None, None, None, None], backend=backend)
    for n in (0, 20):
        with pytest.raises(ValueError, match="not within segment 4"):
            gated_delta_rule(*rule, segments, state_snap=[None] * 4 + [(n, snaps[1]), None], backend=backend)


def test_reference_matches_transformers_torch_fallbacks():
    """The references equal transformers' Qwen3.5 conv (causal_conv1d_fn + silu) and the chunked gated delta rule
    on one sequence, and the recurrent rule when continuing from a state."""
    from transformers.models.qwen3_5 import modeling_qwen3_5 as hf

    torch.manual_seed(0)
    num_tokens, hk, hv, dk, dv = 70, 2, 4, 16, 24
    segments = torch.tensor([[0, num_tokens, 0, 0]], dtype=torch.int32)
    x, weight = torch.randn(num_tokens, 40), torch.randn(40, 4)
    ours, _ = causal_conv1d_ref(x, weight, segments)
    theirs = hf.causal_conv1d_fn(x.T[None], weight, None, activation="silu")[0].T
    assert_within(ours, theirs, 1e-6, "conv vs transformers")
    q, k, v, a, b, a_log, dt_bias = rule_inputs(num_tokens, hk, hv, dk, dv, torch.float32, "cpu")
    ours, ends, _ = gated_delta_rule_ref(q, k, v, a, b, a_log, dt_bias, segments)
    g = -a_log.exp() * torch.nn.functional.softplus(a + dt_bias)
    theirs, end = hf.torch_chunk_gated_delta_rule(q[None], k[None], v[None], g[None], b.sigmoid()[None],
                                                  output_final_state=True, use_qk_l2norm_in_kernel=True)
    assert_within(ours, theirs[0], 2e-5, "rule vs transformers chunked")
    assert_within(ends[0], end[0], 2e-5, "end state vs transformers chunked")
    state = torch.randn(1, hv, dk, dv)
    ours, _, _ = gated_delta_rule_ref(q[:3], k[:3], v[:3], a[:3], b[:3], a_log, dt_bias,
                                   torch.tensor([[0, 3, 0, 0]], dtype=torch.int32), state_in=[state[0]])
    theirs, _ = hf.torch_recurrent_gated_delta_rule(q[None, :3], k[None, :3], v[None, :3], g[None, :3],
                                                    b[:3].sigmoid()[None], initial_state=state,
                                                    use_qk_l2norm_in_kernel=True)
    assert_within(ours, theirs[0], 2e-6, "rule vs transformers recurrent")


def test_plan_links_items_to_their_prefix_and_refuses_orphans():
    segments, num_tokens = make_segments([(4, [1, 2]), (0, [3]), (2, [1])], "cpu")
    plan = plan_linear_attention(SegmentTable.of(segments, num_tokens))
    assert plan.state_slot.tolist() == [0, 0, 0, -1, 1, 1] and plan.num_slots == 2
    orphan = torch.tensor([[0, 4, 0, 0], [4, 2, 1, 3]], dtype=torch.int32)  # prefix [1, 4) is no row
    with pytest.raises(ValueError, match="segment 1: its prefix"):
        plan_linear_attention(SegmentTable.of(orphan, 6))


def test_inputs_are_checked_at_the_door():
    segments, num_tokens = make_segments([(3, [2])], "cpu")
    q, k, v, a, b, a_log, dt_bias = rule_inputs(num_tokens, 2, 2, 16, 16, torch.float32, "cpu")
    with pytest.raises(ValueError, match="v must be"):
        gated_delta_rule(q, k, v[:, :1].expand(num_tokens, 3, 16), a, b, a_log, dt_bias, segments)
    with pytest.raises(ValueError, match="a_log must be"):
        gated_delta_rule(q, k, v, a, b, a_log.bfloat16(), dt_bias, segments)
    with pytest.raises(ValueError, match=r"state_in\[1\]: segment 1 continues its prefix"):
        gated_delta_rule(q, k, v, a, b, a_log, dt_bias, segments, state_in=[None, torch.zeros(2, 16, 16)])
    with pytest.raises(ValueError, match=r"state_out\[0\] must be a contiguous"):
        gated_delta_rule(q, k, v, a, b, a_log, dt_bias, segments, state_out=[torch.zeros(2, 16, 8), None])
    x = torch.randn(num_tokens, 8)
    with pytest.raises(ValueError, match="kernel size must be"):
        causal_conv1d(x, torch.randn(8, 9), segments)
    with pytest.raises(ValueError, match="weight must be a contiguous"):
        causal_conv1d(x, torch.randn(7, 4), segments)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_tier_avx512_runs_the_avx512_kernels(monkeypatch, dtype):
    """Tier avx512 (AVX-512 without BF16) runs gated_delta_rule_simd.h's avx512 unit in both dtypes (no BF16
    instruction: tests/ops/test_avx512_tier_isa.py), so conv and rule give tier avx512bf16's bits there. The rule's
    bits differ from the AVX2 unit's (its sums run 16 lanes wide), so the check can fail."""
    segments, num_tokens = make_segments(STREAMS["mixed"], "cpu")
    q, k, v, a, b, a_log, dt_bias = rule_inputs(num_tokens, *HEADS["r2-d32x48"], dtype, "cpu")
    x = torch.cat([q.reshape(num_tokens, -1), k.reshape(num_tokens, -1)], 1)
    weight = (torch.randn(x.shape[1], 4, generator=torch.Generator().manual_seed(2)) * 0.5).to(dtype)
    out = outputs_at_tiers(monkeypatch, lambda: torch.cat([
        causal_conv1d(x, weight, segments, backend="kernel").flatten(),
        gated_delta_rule(q, k, v, a, b, a_log, dt_bias, segments, backend="kernel").flatten()]))
    assert torch.equal(out["avx512"], out["avx512bf16"]), f"{dtype} at tier avx512 is not the AVX-512 kernels'"
    assert not torch.equal(out["avx512bf16"], out["avx2"]), "the kernels agree bitwise: the test cannot tell"
