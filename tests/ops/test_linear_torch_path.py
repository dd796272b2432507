"""linear's torch path (the production GEMM on tiers where torch's beats ours, forced here with
PYSCORE_CPU_TIER=generic):
F.linear in the weight's dtype over fixed-size row chunks, equal to the fp32 reference within torch's own error, and
batch-invariant: a row's bits depend only on that row, whatever the number of rows in the call and where the row
sits — for both call heights (prefill and decode). prepare_linear holds each weight once, in its path's form."""

from __future__ import annotations

import pytest
import torch

from pyscore.ops import PackedLinear, PlainLinear, _ext, linear, pack_linear, prepare_linear
from pyscore.ops.linear import DECODE_ROWS, PREFILL_ROWS
from pyscore.ops.reference import linear_ref
from tests.ops.test_linear import assert_within, make_inputs, torch_in_dtype

DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture
def torch_tier(monkeypatch):
    if _ext.cpu_module() is None:
        pytest.skip("needs pyscore._C (the tier comes from it)")
    monkeypatch.setenv("PYSCORE_CPU_TIER", "generic")
    assert _ext.path_for("linear", torch.device("cpu"), torch.float32)[1] == "torch"


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("gated", [False, True], ids=["plain", "gated"])
def test_torch_path_matches_the_reference(torch_tier, dtype, gated):
    for m in (1, 5, PREFILL_ROWS + 3):
        x, w, b, r = make_inputs(m, 96, 2 * 40, gated, dtype, bias=True, residual=True)
        weight = prepare_linear(PlainLinear(w, b, gated))
        assert isinstance(weight, PlainLinear)
        got = linear(x, weight, residual=r)
        ref = linear_ref(x, w, b, gated=gated, residual=r)
        if dtype == torch.float32:
            assert_within(got, ref, 2e-5 * max(1.0, ref.abs().max().item()), f"M={m}")
        else:  # within 2x torch's own bf16 error: it is torch's bf16 computation
            own = (torch_in_dtype(x, w, b, gated, r).float() - ref).abs().max().item()
            assert_within(got, ref, 2 * own + 1e-6, f"M={m} bf16")


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("rows", [PREFILL_ROWS, DECODE_ROWS], ids=["prefill", "decode"])
def test_torch_path_is_batch_invariant(torch_tier, dtype, rows):
    """The decoder's shapes (SmolLM2 gate_up and down): row 3 alone equals row 3 inside batches of many sizes, at
    several positions, and the in-place residual form equals the out-of-place one."""
    for k, n, gated in ((576, 3072, True), (1536, 576, False)):
        x, w, b, _ = make_inputs(2 * rows + 7, k, n, gated, dtype, bias=False, residual=False, seed=3)
        weight = PlainLinear(w, b, gated)
        alone = linear(x[3:4], weight, rows_per_call=rows)
        for m in (2, rows - 1, rows, rows + 1, 2 * rows + 7):
            for pos in {0, m // 2, m - 1}:
                batch = x[:m].clone()
                batch[pos] = x[3]
                got = linear(batch, weight, rows_per_call=rows)[pos]
                assert torch.equal(got, alone[0]), f"K={k} N={n} M={m} row at {pos} ({rows} rows per call)"


def test_in_place_residual(torch_tier):
    x, w, b, r = make_inputs(9, 64, 40, False, torch.bfloat16, bias=True, residual=True)
    weight = PlainLinear(w, b)
    expected = linear(x, weight, residual=r)
    out = r.clone()
    assert linear(x, weight, residual=out, out=out) is out
    assert torch.equal(out, expected)


def test_prepare_linear_holds_one_form_per_path(torch_tier, monkeypatch):
    _, w, b, _ = make_inputs(1, 64, 2 * 24, True, torch.bfloat16, bias=True, residual=False)
    plain = PlainLinear(w, b, gated=True)
    assert prepare_linear(plain) is plain  # torch path: kept as it is, no copy
    packed = prepare_linear(plain, backend="kernel")
    assert isinstance(packed, PackedLinear)
    back = prepare_linear(packed)  # torch path again: unpacked once, the packed form dropped by the caller
    assert isinstance(back, PlainLinear) and torch.equal(back.weight, w) and back.gated
    assert prepare_linear(plain, backend="reference") is plain
    monkeypatch.delenv("PYSCORE_CPU_TIER")
    if _ext.path_for("linear", torch.device("cpu"), torch.bfloat16)[1] == "kernel":
        assert isinstance(prepare_linear(plain), PackedLinear)


def test_a_packed_weight_runs_on_the_torch_path(torch_tier):
    """A weight packed before the tier changed (a forced tier in a test) unpacks on demand: same result."""
    x, w, b, r = make_inputs(5, 64, 40, False, torch.bfloat16, bias=True, residual=True)
    assert torch.equal(linear(x, pack_linear(w, b), residual=r),
                       linear(x, PlainLinear(w, b.to(torch.bfloat16)), residual=r))
