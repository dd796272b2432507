"""linear in int8 (pyscore.ops.linear_int8): the quantization's rounding per group of input channels, the exact
group sums and their fold on every path (the C++ kernel at each tier this CPU runs, torch's batched GEMMs: bitwise
the float64 definition), fma32's single rounding, batch invariance, the packed layout and linear()'s dispatch."""

from __future__ import annotations

import random
from fractions import Fraction

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from pyscore.ops import _ext
from pyscore.ops.linear import linear, prepare_linear
from pyscore.ops.linear_int8 import (
    GROUP,
    PackedQuantLinear,
    QuantLinear,
    fma32,
    group_sums,
    linear_int8,
    linear_int8_path,
    linear_int8_ref,
    quantize_linear,
    quantize_rows,
)

CPU = torch.device("cpu")
# The tiers whose int8 kernel this CPU can run (forced through PYSCORE_CPU_TIER, as the tier tests do).
KERNEL_TIERS = [t for t in _ext.runnable_cpu_tiers() if _ext.cpu_module() is not None and t in ("avx2", "avx512",
                                                                                                  "avx512bf16", "amx")]


def weight(n: int, k: int, seed: int = 0, bias: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen) * k**-0.5
    return w, torch.randn(n, generator=gen) if bias else None


def test_weight_quantization_is_per_group_symmetric_and_round_half_even():
    k = GROUP + 40  # a whole group and a shorter last one
    w, _ = weight(8, k)
    w[3] = 0.0  # a zero row: scales 0, all zeros
    w[5] = 0.25
    w[5, :4] = torch.tensor([127.0, -127.0, 0.5, 1.5])  # max 127: scale 1, the halves round to even
    w[6, GROUP:] = 0.0  # a zero group beside a live one
    qw = quantize_linear(w)
    assert qw.weight.dtype == torch.int8 and qw.scale.dtype == torch.float32 and qw.scale.shape == (8, 2)
    for g, cols in enumerate((slice(0, GROUP), slice(GROUP, k))):
        assert torch.equal(qw.scale[:, g], w[:, cols].abs().amax(1) / 127)
    assert qw.weight.abs().max() <= 127
    assert torch.equal(qw.weight[[0, 1, 2, 4], :GROUP].abs().amax(1), torch.full((4,), 127, dtype=torch.int8))
    assert not qw.scale[3].any() and not qw.weight[3].any()
    assert qw.scale[6, 1] == 0 and not qw.weight[6, GROUP:].any() and qw.weight[6, :GROUP].abs().max() == 127
    assert qw.scale[5, 0] == 1 and qw.weight[5, :4].tolist() == [127, -127, 0, 2]
    assert qw.weight[5, GROUP:].eq(127).all()  # the second group on its own scale: 0.25 is its max
    deq, _ = qw.unpacked()
    assert ((deq - w).abs() <= qw.scale.repeat_interleave(GROUP, 1)[:, :k] / 2 + 1e-7).all()


def test_activation_rows_are_quantized_each_group_on_its_own():
    k = 2 * GROUP + 5
    x = torch.randn(5, k)
    x[2] = 0.0
    x[3, 3] = 1000.0  # an outlier in group 0 leaves the other groups their levels
    q, s = quantize_rows(x)
    assert s.shape == (5, 3) and not q[2].any() and not s[2].any()
    for g in range(3):
        assert torch.equal(s[:, g], x[:, g * GROUP : (g + 1) * GROUP].abs().amax(1) / 127)
    assert q[3, GROUP:].abs().max() == 127 and q[3, : GROUP].abs().topk(2).values.tolist()[1] <= 1
    for m in range(5):
        q1, s1 = quantize_rows(x[m : m + 1] * 1)  # alone: the same row, the same bits
        assert torch.equal(q1[0], q[m]) and torch.equal(s1[0], s[m])


def _exact_fp32(value: Fraction) -> np.float32:
    """value rounded to the nearest fp32, ties to even: the neighbours of its float64, whichever is nearest."""
    guess = np.float32(float(value))
    candidates = [np.nextafter(guess, np.float32(-np.inf)), guess, np.nextafter(guess, np.float32(np.inf))]
    return min(candidates, key=lambda c: (abs(Fraction(float(c)) - value), int(c.view(np.int32)) & 1))


def test_fma32_rounds_once():
    """Against exact rational arithmetic: random operands of every magnitude mix, and the double rounding's trap
    (2^24 + 2 + (1 + 2^-15)(1 - 2^-15): float64 rounds it to the tie 2^24 + 3, which goes to even 2^24 + 4; the
    true value is below the tie)."""
    rng = random.Random(0)
    a = [1 + 2**-15, *(rng.uniform(-1, 1) * 2.0 ** rng.randint(-30, 30) for _ in range(3000))]
    b = [1 - 2**-15, *(rng.uniform(-1, 1) * 2.0 ** rng.randint(-30, 30) for _ in range(3000))]
    c = [2**24 + 2, *(rng.uniform(-1, 1) * 2.0 ** rng.randint(-40, 40) for _ in range(3000))]
    ta, tb, tc = (torch.tensor(v, dtype=torch.float32) for v in (a, b, c))
    got = fma32(ta, tb, tc)
    want = [_exact_fp32(Fraction(float(x)) * Fraction(float(y)) + Fraction(float(z)))
            for x, y, z in zip(ta.tolist(), tb.tolist(), tc.tolist(), strict=True)]
    assert got[0].item() == 2**24 + 2 and ((ta[0].double() * tb[0].double() + tc[0].double()).float() == 2**24 + 4)
    assert torch.equal(got, torch.tensor(np.array(want, dtype=np.float32)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("gated,bias,residual", [(False, False, False), (True, True, False), (False, True, True)])
@pytest.mark.parametrize("m", [1, 7, 130])
def test_both_paths_are_the_float64_definition_bitwise(dtype, gated, bias, residual, m):
    w, b = weight(96, 80, bias=bias)
    qw = quantize_linear(w, b, gated=gated)
    x = torch.randn(m, 80).to(dtype)
    res = torch.randn(m, qw.out_features).to(dtype) if residual else None
    want = linear_int8_ref(x, qw, res)
    assert want.dtype == dtype and want.shape == (m, qw.out_features)
    assert torch.equal(linear_int8(x, qw, res), want)  # this CPU's path
    assert torch.equal(linear_int8(x, qw, res, reference=True), want)


def test_a_row_never_depends_on_its_batch_mates():
    qw = quantize_linear(*weight(64, 576), gated=True)
    x = torch.randn(40, 576).bfloat16()
    whole = linear_int8(x, qw)
    for rows in (slice(3, 4), slice(0, 17), slice(20, 40)):
        assert torch.equal(linear_int8(x[rows], qw), whole[rows])
    shuffled = torch.randperm(40)
    assert torch.equal(linear_int8(x[shuffled], qw), whole[shuffled])


def test_group_sums_are_exact_at_worst_case_magnitudes():
    """Every product 127 * 127 with one sign over K = 3000: the fp32 batched sums are the float64 ones."""
    a = torch.full((3, 3000), 127, dtype=torch.int8)
    b = torch.full((5, 3000), -127, dtype=torch.int8)
    b[1, ::3] = 127
    want = group_sums(a, b, torch.float64)
    assert torch.equal(group_sums(a, b).double(), want) and want.abs().max() == 127 * 127 * GROUP


def test_linear_runs_an_int8_weight_with_its_epilogue_in_place():
    w, b = weight(48, 64, bias=True)
    qw = prepare_linear(quantize_linear(w, b))  # packed where the kernel runs it
    assert isinstance(qw, PackedQuantLinear if linear_int8_path(CPU) == "kernel" else QuantLinear)
    x, res = torch.randn(6, 64), torch.randn(6, 48)
    want = linear_int8_ref(x, qw, res)
    out = res.clone()
    assert linear(x, qw, residual=out, out=out) is out and torch.equal(out, want)
    close = F.linear(x, w, b) + res
    assert (out - close).abs().max() < 0.05 * close.abs().max()  # what the int8 weight stands for


def test_bad_shapes_name_the_argument():
    qw = quantize_linear(*weight(16, 32))
    with pytest.raises(ValueError, match="x must be"):
        linear_int8(torch.randn(2, 31), qw)
    with pytest.raises(ValueError, match="residual must be"):
        linear_int8(torch.randn(2, 32), qw, torch.randn(2, 15))
    with pytest.raises(ValueError, match="gated weight"):
        quantize_linear(torch.randn(3, 8), gated=True)


def kernel_tier(monkeypatch, tier: str) -> None:
    monkeypatch.setenv("PYSCORE_CPU_TIER", tier)
    assert linear_int8_path(CPU) == "kernel", tier


@pytest.mark.skipif(not KERNEL_TIERS, reason="no int8 kernel tier on this CPU / build")
@pytest.mark.parametrize("tier", KERNEL_TIERS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m,k,n,gated,bias,residual", [
    (1, 576, 192, False, False, False), (7, 575, 100, True, True, True), (16, 130, 64, False, True, True),
    (130, 577, 200, True, False, False), (40, 1536, 96, False, False, True), (3, 8200, 64, False, False, False)])
def test_the_kernel_is_the_float64_definition_bitwise(monkeypatch, tier, dtype, m, k, n, gated, bias, residual):
    """Odd K (the quads' zero padding), a short last group, gated units past the last output, bias, the residual
    added in place; K = 8200: K blocks (AVX-512: 2050 quads in two, AVX2: three) rounded up to whole groups."""
    kernel_tier(monkeypatch, tier)
    w, b = weight(2 * n if gated else n, k, seed=m, bias=bias)
    qw = quantize_linear(w, b, gated=gated)
    packed = prepare_linear(qw)
    assert isinstance(packed, PackedQuantLinear)
    gen = torch.Generator().manual_seed(k)
    x = (torch.randn(m, k, generator=gen) * torch.rand(m, 1, generator=gen) * 4).to(dtype)
    x[0, k // 2] = 30.0  # an outlier: most of the row's codes small
    if m > 2:
        x[2] = 0.0  # a zero row: scale and codes 0
    res = torch.randn(m, qw.out_features, generator=gen).to(dtype) if residual else None
    want = linear_int8_ref(x, qw, res)
    if res is None:
        assert torch.equal(linear(x, packed), want)
    else:
        out = res.clone()
        assert linear(x, packed, residual=out, out=out) is out and torch.equal(out, want)


@pytest.mark.skipif(not KERNEL_TIERS, reason="no int8 kernel tier on this CPU / build")
@pytest.mark.parametrize("tier", KERNEL_TIERS)
def test_the_kernel_sums_worst_case_codes_exactly(monkeypatch, tier):
    """Every product +-127 * 127 over K = 12288 (Qwen3-8B's down, several K blocks; codes at both ends of the
    unsigned offset), and a row of -max: each group's int32 sums and the fold are the definition's."""
    kernel_tier(monkeypatch, tier)
    k = 12288
    w = torch.ones(64, k)
    w[1::2, ::2] = -1.0
    qw = quantize_linear(w)
    x = torch.ones(3, k)
    x[1] = -1.0
    x[2, 1::2] = -1.0
    assert torch.equal(linear(x, prepare_linear(qw)), linear_int8_ref(x, qw))
    assert (quantize_rows(x)[0][0].int() * qw.weight[0].int()).sum() > 2**24  # one int32 sum over K would not fit fp32


@pytest.mark.skipif(not KERNEL_TIERS, reason="no int8 kernel tier on this CPU / build")
@pytest.mark.parametrize("tier", KERNEL_TIERS)
def test_a_kernel_row_never_depends_on_its_batch_mates(monkeypatch, tier):
    kernel_tier(monkeypatch, tier)
    qw = prepare_linear(quantize_linear(*weight(192, 576), gated=True))
    x = torch.randn(40, 576).bfloat16()
    whole = linear(x, qw)
    for rows in (slice(3, 4), slice(0, 17), slice(20, 40)):
        assert torch.equal(linear(x[rows], qw), whole[rows])
    shuffled = torch.randperm(40)
    assert torch.equal(linear(x[shuffled], qw), whole[shuffled])


def test_the_packed_weight_is_the_same_weight(monkeypatch):
    """rows() gives back the QuantLinear (the torch paths and the reference read it), and a packed weight under a
    tier without the kernel runs torch's path with the same bits."""
    w, b = weight(100, 70, bias=True)
    qw = quantize_linear(w, b, gated=True)
    if linear_int8_path(CPU) != "kernel":
        pytest.skip("no int8 kernel here: nothing is packed")
    packed = prepare_linear(qw)
    back = packed.rows()
    assert torch.equal(back.weight, qw.weight) and torch.equal(back.scale, qw.scale)
    assert torch.equal(back.bias, qw.bias) and back.gated
    x = torch.randn(5, 70)
    want = linear_int8_ref(x, qw)
    assert torch.equal(linear(x, packed), want)
    monkeypatch.setenv("PYSCORE_CPU_TIER", "generic")  # (the SiLU is the tier's silu_mul: the definition's there)
    assert torch.equal(linear(x, packed), linear_int8_ref(x, qw))
    assert isinstance(prepare_linear(packed), QuantLinear)  # and prepared again, it goes back to rows
