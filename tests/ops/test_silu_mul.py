"""silu_mul against its reference (torch's `F.silu(gate) * up` in the input dtype) on the AVX-512 and portable
CPU paths: bf16 bitwise but for a rare rounding flip where our exp and torch's Sleef exp straddle a bf16 rounding
boundary, fp32 within a few ulps; special values (+-inf, NaN, overflowing exp) as torch. Strided gate_up rows,
odd and ragged widths."""

from __future__ import annotations

import pytest
import torch

from pyscore.ops import silu_mul
from pyscore.ops.reference import silu_mul_ref
from tests.helpers import CPU_ISAS, force_cpu_isa, ulp_distance

# (rows T, width I): SmolLM2's MLP, a ragged 33 (two zmm + 1), tiny, Qwen-sized.
SHAPES = {"smollm-775": (775, 1536), "ragged-33": (13, 33), "one-row-i1": (1, 1), "qwen": (4, 4864)}


@pytest.fixture(params=CPU_ISAS)
def isa(request, monkeypatch):
    return force_cpu_isa(monkeypatch, request.param)


def make_gate_up(rows, width, dtype, strided: bool, scale: float = 4.0, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    pad = 3 if strided else 0
    return (torch.randn(rows, 2 * width + pad, generator=gen) * scale)[:, : 2 * width].to(dtype)


def assert_near_reference(out: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    ulps = ulp_distance(out, ref)
    max_ulps, max_frac = (8, 0.1) if out.dtype == torch.float32 else (1, 1e-4)
    frac = (ulps > 0).float().mean().item()
    assert ulps.max().item() <= max_ulps and frac <= max_frac, (
        f"{what}: max {ulps.max().item()} ulps (allowed {max_ulps}), {frac:.3%} of elements differ, "
        f"max abs diff {(out.float() - ref.float()).abs().max().item():.3g}")


@pytest.mark.parametrize("scale", [4.0, 40.0], ids=["x4", "x40"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_silu_mul_matches_reference(isa, shape, dtype, scale):
    rows, width = SHAPES[shape]
    gate_up = make_gate_up(rows, width, dtype, strided=shape in ("ragged-33", "smollm-775"), scale=scale)
    out = silu_mul(gate_up, backend="kernel")
    assert out.shape == (rows, width) and out.dtype == dtype
    assert_near_reference(out, silu_mul_ref(gate_up), f"{shape} {dtype} x{scale} {isa}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_special_values(isa, dtype):
    gate = torch.tensor([0.0, -0.0, 1e-30, -1e-30, 88.0, -88.0, 89.0, -89.0, 100.0, -100.0, 1e4, -1e4,
                         float("inf"), float("-inf"), float("nan"), -3.0, 3.0])
    up = torch.full_like(gate, 1.5)
    gate_up = torch.cat([gate, up])[None].to(dtype)
    out, ref = silu_mul(gate_up, backend="kernel"), silu_mul_ref(gate_up)
    assert torch.equal(out.isnan(), ref.isnan()), f"NaNs differ: {out} vs {ref}"
    finite = ~ref.isnan()
    assert bool((ulp_distance(out[finite], ref[finite]) <= 4).all()), f"{out} vs {ref}"


def test_out_argument_with_row_stride():
    gate_up = make_gate_up(5, 40, torch.bfloat16, strided=True)
    buffer = torch.zeros(5, 48, dtype=torch.bfloat16)
    out = silu_mul(gate_up, out=buffer[:, 4:44], backend="kernel")
    assert out.data_ptr() == buffer[:, 4:44].data_ptr()
    assert_near_reference(out, silu_mul_ref(gate_up), "out view")
    assert bool((buffer[:, :4] == 0).all() and (buffer[:, 44:] == 0).all()), "wrote outside out"


@pytest.mark.parametrize("bad, message", [
    (lambda g, o: (g[:, :-1], None), "gate_up must be"),
    (lambda g, o: (g[None], None), "gate_up must be"),
    (lambda g, o: (g.T, None), "gate_up must be"),
    (lambda g, o: (g, o[:, :-1]), "out must be"),
    (lambda g, o: (g, o.bfloat16()), "out must be"),
])
def test_rejects_bad_arguments(bad, message):
    gate_up = make_gate_up(4, 8, torch.float32, strided=False)
    gate_up, out = bad(gate_up, torch.empty(4, 8))
    with pytest.raises(ValueError, match=message):
        silu_mul(gate_up, out=out)


@pytest.mark.cuda
def test_cuda_falls_back_to_reference():
    gate_up = make_gate_up(33, 1536, torch.bfloat16, strided=True).cuda()
    assert torch.equal(silu_mul(gate_up), silu_mul_ref(gate_up))
