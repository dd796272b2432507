"""linear in int8 (pyscore.ops.linear_int8): the quantization's rounding, the exact int32 sums on every path (the C++
kernel at each tier this CPU runs, torch._int_mm, the fp32 chunks: bitwise the float64 definition), batch invariance,
the fallback when torch._int_mm is not exact, the packed layout and linear()'s dispatch."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pyscore.ops import _ext
from pyscore.ops import linear_int8 as q8
from pyscore.ops.linear import linear, prepare_linear
from pyscore.ops.linear_int8 import (
    PackedQuantLinear,
    QuantLinear,
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


def test_weight_quantization_is_per_row_symmetric_and_round_half_even():
    w, _ = weight(8, 40)
    w[3] = 0.0  # a zero row: scale 0, all zeros
    w[5] = 0.25
    w[5, :4] = torch.tensor([127.0, -127.0, 0.5, 1.5])  # max 127: scale 1, the halves round to even
    qw = quantize_linear(w)
    assert qw.weight.dtype == torch.int8 and qw.scale.dtype == torch.float32
    assert qw.weight.abs().max() <= 127 and torch.equal(qw.weight.abs().amax(1)[[0, 1, 2, 4]],
                                                        torch.full((4,), 127, dtype=torch.int8))
    assert qw.scale[3] == 0 and not qw.weight[3].any()
    assert qw.scale[5] == 1 and qw.weight[5, :4].tolist() == [127, -127, 0, 2]
    deq, _ = qw.unpacked()
    assert ((deq - w).abs() <= qw.scale[:, None] / 2 + 1e-7).all()


def test_activation_rows_are_quantized_each_on_its_own():
    x = torch.randn(5, 33)
    x[2] = 0.0
    q, s = quantize_rows(x)
    assert torch.equal(s, x.abs().amax(1) / 127) and not q[2].any()
    for m in range(5):
        q1, s1 = quantize_rows(x[m : m + 1] * 1)  # alone: the same row, the same bits
        assert torch.equal(q1[0], q[m]) and torch.equal(s1[0], s[m])


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
    assert torch.equal(linear_int8(x, qw, res), want)  # this CPU's path (torch._int_mm where exact)
    assert torch.equal(linear_int8(x, qw, res, reference=True), want)  # the fp32-chunk sums


def test_a_row_never_depends_on_its_batch_mates():
    qw = quantize_linear(*weight(64, 576), gated=True)
    x = torch.randn(40, 576).bfloat16()
    whole = linear_int8(x, qw)
    for rows in (slice(3, 4), slice(0, 17), slice(20, 40)):
        assert torch.equal(linear_int8(x[rows], qw), whole[rows])
    shuffled = torch.randperm(40)
    assert torch.equal(linear_int8(x[shuffled], qw), whole[shuffled])


def test_fp32_chunk_sums_are_exact_at_worst_case_magnitudes():
    """Every product 127 * 127 with one sign over K = 3000 (> 2^24 in total, < 2^24 per chunk)."""
    a = torch.full((3, 3000), 127, dtype=torch.int8)
    b = torch.full((5, 3000), -127, dtype=torch.int8)
    b[1, ::3] = 127
    want = (a.double() @ b.double().t()).to(torch.int32)
    assert torch.equal(q8._sums_fp32(a, b), want)
    assert want.abs().max() > 2**24  # the case where one fp32 GEMM over all of K would round


def test_an_inexact_int_mm_is_not_used(monkeypatch):
    """oneDNN without VNNI saturates 16-bit pair sums: a torch._int_mm that rounds must lose the check."""
    real = torch._int_mm

    def saturating(a, b):
        return real(a, b).clamp(-(2**20), 2**20)

    q8._int_mm_is_exact.cache_clear()
    monkeypatch.setenv("PYSCORE_CPU_TIER", "generic")  # the torch paths' tier
    monkeypatch.setattr(torch, "_int_mm", saturating)
    try:
        assert q8.int_path(torch.device("cpu")) == "fp32 chunks"
        assert "not exact here" in q8.describe(torch.device("cpu"))
        qw = quantize_linear(*weight(32, 64))
        x = torch.randn(4, 64)
        assert torch.equal(linear_int8(x, qw), linear_int8_ref(x, qw))
    finally:
        q8._int_mm_is_exact.cache_clear()


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
    (130, 577, 200, True, False, False), (40, 1536, 96, False, False, True)])
def test_the_kernel_is_the_float64_definition_bitwise(monkeypatch, tier, dtype, m, k, n, gated, bias, residual):
    """Odd K (the quads' zero padding), gated units past the last output, bias, the residual added in place."""
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
    """Every product +-127 * 127 over K = 12288 (Qwen3-8B's down; sums past 2^24, codes at both ends of the
    unsigned offset), and a row of -max: the int32 sums and their one rounding to fp32 are the definition's."""
    kernel_tier(monkeypatch, tier)
    k = 12288
    w = torch.ones(64, k)
    w[1::2, ::2] = -1.0
    qw = quantize_linear(w)
    x = torch.ones(3, k)
    x[1] = -1.0
    x[2, 1::2] = -1.0
    assert torch.equal(linear(x, prepare_linear(qw)), linear_int8_ref(x, qw))
    assert (quantize_rows(x)[0][0].int() * qw.weight[0].int()).sum() > 2**24


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
