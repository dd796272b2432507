"""add_rms_norm against its reference (the transformers recipe in the input dtype) on the AVX-512 and portable
CPU paths: the residual add is bitwise torch's; the normalized output differs only through the order of the fp32
sum of squares, so fp32 stays within a few ulps and bf16 within 2 ulps (one rounding flip of the normalized value,
scaled by the weight) on a tiny fraction of elements. Odd and ragged widths, strided rows, with and without delta.
An fp32 weight (Qwen3.5's zero-centred norm, weight 1 + w) equals transformers' Qwen3_5RMSNorm."""

from __future__ import annotations

import pytest
import torch

from pyscore.ops import add_rms_norm
from pyscore.ops.reference import add_rms_norm_ref
from tests.helpers import CPU_ISAS, force_cpu_isa, outputs_at_tiers, ulp_distance

# (rows T, hidden H): SmolLM2's width, a ragged 17 (one full zmm + 1), tiny, wide, wider than the bf16 rows' stack
# scratch (4096: it moves to the heap) with a ragged end.
SHAPES = {"smollm-775": (775, 576), "ragged-17": (5, 17), "one-row-h1": (1, 1), "wide": (3, 4096), "odd": (37, 100),
          "heap-4100": (2, 4100)}


@pytest.fixture(params=CPU_ISAS)
def isa(request, monkeypatch):
    return force_cpu_isa(monkeypatch, request.param)


def make_inputs(rows, hidden, dtype, strided: bool, seed: int = 0):
    """x, delta [T, H] (row strides > H when strided) and weight [H], in dtype."""
    gen = torch.Generator().manual_seed(seed)
    pad = 5 if strided else 0
    x = (torch.randn(rows, hidden + pad, generator=gen) * 3)[:, :hidden]
    delta = torch.randn(rows, hidden + 2 * pad, generator=gen)[:, pad : pad + hidden]
    weight = torch.randn(hidden, generator=gen) * 0.5 + 1
    return x.to(dtype), delta.to(dtype), weight.to(dtype)


def assert_near_reference(out: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    ulps = ulp_distance(out, ref)
    max_ulps, max_frac = (8, 1.0) if out.dtype == torch.float32 else (2, 1e-3)
    frac = (ulps > 0).float().mean().item()
    assert ulps.max().item() <= max_ulps and frac <= max_frac, (
        f"{what}: max {ulps.max().item()} ulps (allowed {max_ulps}), {frac:.2%} of elements differ, "
        f"max abs diff {(out.float() - ref.float()).abs().max().item():.3g}")


@pytest.mark.parametrize("with_delta", [True, False], ids=["add+norm", "norm"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_add_rms_norm_matches_reference(isa, shape, dtype, with_delta):
    rows, hidden = SHAPES[shape]
    x, delta, weight = make_inputs(rows, hidden, dtype, strided=shape in ("odd", "smollm-775"))
    delta = delta if with_delta else None
    x_ref = x.clone()
    out = add_rms_norm(x, weight, 1e-5, delta=delta, backend="kernel")
    ref = add_rms_norm_ref(x_ref, weight, 1e-5, delta=delta)
    assert torch.equal(x, x_ref), "the residual add must round exactly as torch's x + delta"
    assert out.shape == (rows, hidden) and out.dtype == dtype
    assert_near_reference(out, ref, f"{shape} {dtype} {isa}")


def test_bf16_error_within_twice_torch_bf16(isa):
    """Against the fp32 truth, ours errs at most 2x what torch's own bf16 computation errs."""
    x, delta, weight = make_inputs(775, 576, torch.bfloat16, strided=False)
    truth = add_rms_norm_ref(x.float(), weight.float(), 1e-6, delta=delta.float())
    torch_err = (add_rms_norm_ref(x.clone(), weight, 1e-6, delta=delta).float() - truth).abs().max().item()
    ours_err = (add_rms_norm(x, weight, 1e-6, delta=delta, backend="kernel").float() - truth).abs().max().item()
    assert ours_err <= 2 * torch_err, f"ours {ours_err:.3g} vs torch bf16 {torch_err:.3g}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", ["smollm-775", "ragged-17", "odd"])
def test_fp32_weight_is_qwen3_5_zero_centred_norm(isa, shape, dtype):
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5RMSNorm

    rows, hidden = SHAPES[shape]
    x, delta, _ = make_inputs(rows, hidden, dtype, strided=shape == "odd")
    norm = Qwen3_5RMSNorm(hidden, eps=1e-6)
    with torch.no_grad():
        norm.weight.normal_(0, 0.3, generator=torch.Generator().manual_seed(1))  # w around 0: scales 1 + w
        expected = norm((x + delta).contiguous())
    x_ref = x.clone()
    out = add_rms_norm(x, 1.0 + norm.weight.detach().float(), 1e-6, delta=delta, backend="kernel")
    ref = add_rms_norm_ref(x_ref, 1.0 + norm.weight.detach().float(), 1e-6, delta=delta)
    assert torch.equal(x, x_ref) and out.dtype == dtype
    assert_near_reference(out, expected, f"{shape} {dtype} {isa} vs transformers")
    assert torch.equal(ref, expected), "the reference is transformers' recipe bit for bit"


def test_out_argument_with_row_stride():
    x, delta, weight = make_inputs(9, 64, torch.bfloat16, strided=False)
    buffer = torch.zeros(9, 80, dtype=torch.bfloat16)
    out = add_rms_norm(x.clone(), weight, 1e-6, delta=delta, out=buffer[:, 8:72], backend="kernel")
    assert out.data_ptr() == buffer[:, 8:72].data_ptr()
    assert_near_reference(out, add_rms_norm_ref(x.clone(), weight, 1e-6, delta=delta), "out view")
    assert bool((buffer[:, :8] == 0).all() and (buffer[:, 72:] == 0).all()), "wrote outside out"


def test_zero_rows():
    x = torch.empty(0, 64)
    assert add_rms_norm(x, torch.ones(64), 1e-6, backend="kernel").shape == (0, 64)


@pytest.mark.parametrize("bad, message", [
    (lambda x, w, d: (x[:, None], w, d), "x must be"),
    (lambda x, w, d: (x.T, w, None), "x must be"),
    (lambda x, w, d: (x, w[:-1], d), "weight must be"),
    (lambda x, w, d: (x, w.double(), d), "weight must match"),
    (lambda x, w, d: (x.bfloat16(), w.half(), None), "weight must match"),
    (lambda x, w, d: (x, w, d[:-1]), "delta must be"),
    (lambda x, w, d: (x, w, d.bfloat16()), "delta must match"),
])
def test_rejects_bad_arguments(bad, message):
    x, delta, weight = make_inputs(4, 32, torch.float32, strided=False)
    x, weight, delta = bad(x, weight, delta)
    with pytest.raises(ValueError, match=message):
        add_rms_norm(x, weight, 1e-6, delta=delta)


@pytest.mark.cuda
def test_cuda_falls_back_to_reference():
    x, delta, weight = (t.cuda() for t in make_inputs(33, 576, torch.bfloat16, strided=True))
    x_ref = x.clone()
    out = add_rms_norm(x, weight, 1e-6, delta=delta)
    assert torch.equal(out, add_rms_norm_ref(x_ref, weight, 1e-6, delta=delta)) and torch.equal(x, x_ref)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_tier_avx512_runs_the_avx512_unit(monkeypatch, dtype):
    """Tier avx512 (AVX-512 without BF16) runs the kernel text's AVX-512 unit in both dtypes (no BF16 instruction in
    it: tests/ops/test_avx512_tier_isa.py), so it gives tier avx512bf16's bits. In fp32 those differ from the AVX2
    unit's (its sum of squares runs 8 lanes wide), so the check can fail; silu_mul and rotary give the same bits on
    every layer, and their dispatch is checked by the ISA test and the bench alone."""
    x, delta, weight = make_inputs(*SHAPES["smollm-775"], dtype, strided=True)
    out = outputs_at_tiers(monkeypatch, lambda: add_rms_norm(x.clone(), weight, 1e-5, delta=delta, backend="kernel"))
    assert torch.equal(out["avx512"], out["avx512bf16"]), f"{dtype} at tier avx512 is not the AVX-512 unit's"
    if dtype == torch.float32:
        assert not torch.equal(out["avx512bf16"], out["avx2"]), "the units agree bitwise: the test cannot tell"
