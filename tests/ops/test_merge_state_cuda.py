"""The CUDA log-sum-exp merge kernel alone against merge_state_ref (GPU only; the shared merge checks in
test_prefix_item_attention.py run it too): awkward dims, -inf sides, a dominating side, outputs aliasing the
first state."""

from __future__ import annotations

import pytest
import torch

from pyscore.ops import _ext
from pyscore.ops.reference import merge_state_ref

pytestmark = pytest.mark.cuda


def cuda_merge(o_a, lse_a, o_b, lse_b, o_out, lse_out) -> None:
    rows, dim = o_a.shape
    ptrs = [x.data_ptr() for x in (o_a, lse_a, o_b, lse_b, o_out, lse_out)]
    _ext.cuda_module().merge_state(*ptrs, rows, dim, _ext.cuda_stream(o_a.device))
    torch.cuda.synchronize(o_a.device)


def make_states(rows: int, dim: int):
    gen = torch.Generator().manual_seed(rows * 1000 + dim)
    o_a, o_b = (torch.randn(rows, dim, generator=gen) for _ in range(2))
    lse_a, lse_b = (torch.randn(rows, generator=gen) * 8 for _ in range(2))
    if rows >= 8:
        lse_a[1] = float("-inf")  # only b saw keys
        lse_b[2] = float("-inf")  # only a
        lse_a[3] = lse_b[3] = float("-inf")  # neither: identity (0, -inf)
        lse_b[4] = lse_a[4] + 60.0  # b dominates
        lse_b[5] = lse_a[5]  # equal weights
    return [x.cuda() for x in (o_a, lse_a, o_b, lse_b)]


def assert_close_to_ref(out, lse, ref_out, ref_lse) -> None:
    diff = (out - ref_out).abs()
    assert diff.max().item() <= 1e-6, f"o: max diff {diff.max().item():.3g}, mean {diff.mean().item():.3g}"
    assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse)), "lse: -inf pattern differs"
    finite = ~torch.isinf(ref_lse)
    lse_diff = (lse[finite] - ref_lse[finite]).abs().max().item() if finite.any() else 0.0
    assert lse_diff <= 1e-5, f"lse: max diff {lse_diff:.3g}"


@pytest.mark.parametrize(("rows", "dim"), [(1, 64), (37, 128), (9, 7), (1000, 96)])
def test_merge_state_cuda_matches_reference(rows, dim):
    o_a, lse_a, o_b, lse_b = make_states(rows, dim)
    out, lse = torch.empty_like(o_a), torch.empty_like(lse_a)
    cuda_merge(o_a, lse_a, o_b, lse_b, out, lse)
    assert_close_to_ref(out, lse, *merge_state_ref(o_a, lse_a, o_b, lse_b))


def test_merge_state_cuda_in_place():
    o_a, lse_a, o_b, lse_b = make_states(37, 64)
    ref = merge_state_ref(o_a, lse_a, o_b, lse_b)
    cuda_merge(o_a, lse_a, o_b, lse_b, o_a, lse_a)  # outputs alias the first state
    assert_close_to_ref(o_a, lse_a, *ref)
