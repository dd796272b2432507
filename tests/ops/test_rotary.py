"""rotary_ against its reference (the decoder's torch code: tables cast to the activation dtype, x * cos +
rotate_half(x) * sin with every product and sum rounded to that dtype) on the AVX-512 and portable CPU paths.
Without qk-norm the kernel is bitwise torch's in fp32 and bf16; with Qwen3's per-head norm only the order of its
fp32 sum of squares differs, so ours stays within 2x torch's own bf16 error and flips a rare bf16 rounding.
Fused-qkv views (strided tokens and heads), head dims with ragged halves, repeated and unordered positions."""

from __future__ import annotations

import pytest
import torch

from pyscore.model.rope import Rotary
from pyscore.ops import rotary_
from pyscore.ops.reference import rotary_ref
from tests.helpers import CPU_ISAS, force_cpu_isa

# (tokens T, Hq, Hkv, D): SmolLM2, Qwen3-like, a ragged half (D=40: 16 + 4 lanes), the smallest D, a wide D.
SHAPES = {
    "smollm-775": (775, 9, 3, 64),
    "qwen3": (33, 16, 8, 128),
    "ragged-d40": (7, 3, 1, 40),
    "d2": (5, 2, 2, 2),
    "d256-one-token": (1, 2, 1, 256),
}


@pytest.fixture(params=CPU_ISAS)
def isa(request, monkeypatch):
    return force_cpu_isa(monkeypatch, request.param)


def make_inputs(tokens, hq, hkv, d, dtype, seed: int = 0, scaling: float = 1.0, max_positions: int = 4096):
    """A fused qkv buffer [T, Hq + 2 Hkv, D] (q and k are views into it), positions [T] and rope tables."""
    gen = torch.Generator().manual_seed(seed)
    qkv = (torch.randn(tokens, hq + 2 * hkv, d, generator=gen) * 2).to(dtype)
    positions = torch.randint(0, max_positions, (tokens,), generator=gen)
    positions[: tokens // 2] = torch.arange(tokens // 2)  # a run of consecutive positions, then random ones
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    rope = Rotary(inv_freq, scaling, max_positions, torch.device("cpu"))
    norms = ((torch.randn(d, generator=gen) * 0.3 + 1).to(dtype), (torch.randn(d, generator=gen) * 0.3 + 1).to(dtype))
    return qkv, positions, rope.cos, rope.sin, norms


def views(qkv: torch.Tensor, hq: int, hkv: int) -> tuple[torch.Tensor, torch.Tensor]:
    return qkv[:, :hq], qkv[:, hq : hq + hkv]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_rotary_is_bitwise_torch(isa, shape, dtype):
    tokens, hq, hkv, d = SHAPES[shape]
    qkv, positions, cos, sin, _ = make_inputs(tokens, hq, hkv, d, dtype, scaling=1.2 if shape == "qwen3" else 1.0)
    ours, ref = qkv.clone(), qkv.clone()
    rotary_(*views(ours, hq, hkv), positions, cos, sin, backend="kernel")
    rotary_ref(*views(ref, hq, hkv), positions, cos, sin)
    diff = (ours.float() - ref.float()).abs()
    assert torch.equal(ours, ref), (
        f"{shape} {dtype} {isa}: {int((diff > 0).sum())} elements differ, max {diff.max():.3g}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", ["qwen3", "smollm-775", "ragged-d40", "d2"])
def test_rotary_with_qk_norm(isa, shape, dtype):
    tokens, hq, hkv, d = SHAPES[shape]
    qkv, positions, cos, sin, (q_norm, k_norm) = make_inputs(tokens, hq, hkv, d, dtype)
    ours, ref = qkv.clone(), qkv.clone()
    rotary_(*views(ours, hq, hkv), positions, cos, sin, q_norm, k_norm, eps=1e-6, backend="kernel")
    rotary_ref(*views(ref, hq, hkv), positions, cos, sin, q_norm, k_norm, eps=1e-6)
    assert torch.equal(ours[:, hq + hkv :], qkv[:, hq + hkv :]), "v must be untouched"
    diff = (ours.float() - ref.float()).abs()
    if dtype == torch.float32:
        # a few ulps of the normalized operands, which are O(1): absolute, since the rotation may cancel
        assert diff.max().item() <= 4e-6 * max(1.0, ref.abs().max().item()), f"max diff {diff.max():.3g}"
        return
    truth = qkv.float()
    rotary_ref(*views(truth, hq, hkv), positions, cos, sin, q_norm.float(), k_norm.float(), eps=1e-6)
    torch_err = (ref.float() - truth).abs().max().item()
    ours_err = (ours.float() - truth).abs().max().item()
    frac = (diff > 0).float().mean().item()
    assert ours_err <= 2 * torch_err and frac <= 1e-3, (
        f"ours {ours_err:.3g} vs torch bf16 {torch_err:.3g} from fp32; {frac:.2%} differ from torch bf16")


def test_separate_contiguous_q_and_k():
    qkv, positions, cos, sin, _ = make_inputs(6, 4, 2, 64, torch.bfloat16)
    q, k = qkv[:, :4].contiguous(), qkv[:, 4:6].contiguous()
    q_ref, k_ref = q.clone(), k.clone()
    rotary_(q, k, positions, cos, sin, backend="kernel")
    rotary_ref(q_ref, k_ref, positions, cos, sin)
    assert torch.equal(q, q_ref) and torch.equal(k, k_ref)


def test_position_out_of_table_is_rejected():
    qkv, positions, cos, sin, _ = make_inputs(4, 2, 1, 16, torch.float32, max_positions=8)
    positions[2] = 8
    with pytest.raises(ValueError, match="rotary: invalid argument"):
        rotary_(*views(qkv, 2, 1), positions, cos, sin, backend="kernel")


@pytest.mark.parametrize("bad, message", [
    (lambda q, k, p, c, s, n: (q[..., :-1], k, p, c, s, n), "k must be"),
    (lambda q, k, p, c, s, n: (q, k[:-1], p, c, s, n), "k must be"),
    (lambda q, k, p, c, s, n: (q, k.double(), p, c, s, n), "k must match"),
    (lambda q, k, p, c, s, n: (q, k, p.int(), c, s, n), "positions must be"),
    (lambda q, k, p, c, s, n: (q, k, p[1:], c, s, n), "positions must be"),
    (lambda q, k, p, c, s, n: (q, k, p, c.bfloat16(), s, n), "cos must be"),
    (lambda q, k, p, c, s, n: (q, k, p, c, s[:, :-2], n), "sin must be"),
    (lambda q, k, p, c, s, n: (q, k, p, c, s, (n[0], None)), "given together"),
    (lambda q, k, p, c, s, n: (q, k, p, c, s, (n[0][:-1], n[1][:-1])), "q_norm must be"),
    (lambda q, k, p, c, s, n: (q, k, p, c, s, (n[0], n[1].bfloat16())), "k_norm must match"),
])
def test_rejects_bad_arguments(bad, message):
    qkv, positions, cos, sin, norms = make_inputs(4, 2, 1, 16, torch.float32)
    q, k, positions, cos, sin, (q_norm, k_norm) = bad(*views(qkv, 2, 1), positions, cos, sin, norms)
    with pytest.raises(ValueError, match=message):
        rotary_(q, k, positions, cos, sin, q_norm, k_norm)


@pytest.mark.cuda
def test_cuda_falls_back_to_reference():
    qkv, positions, cos, sin, (q_norm, k_norm) = make_inputs(33, 4, 2, 64, torch.bfloat16)
    qkv, positions, cos, sin, q_norm, k_norm = (t.cuda() for t in (qkv, positions, cos, sin, q_norm, k_norm))
    ours, ref = qkv.clone(), qkv.clone()
    rotary_(*views(ours, 4, 2), positions, cos, sin, q_norm, k_norm)
    rotary_ref(*views(ref, 4, 2), positions, cos, sin, q_norm, k_norm)
    assert torch.equal(ours, ref)
