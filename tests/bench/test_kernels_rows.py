"""bench.kernels' contenders do the same work: the decode-step rule row's two sides (ours from and to the fp32
states, transformers' recurrent fallback from the same state) give the same output. The prefill rows time ours and
transformers' in alternation."""

from __future__ import annotations

import os

import pytest
import torch

from bench import kernels as bench_kernels
from pyscore.ops import _ext
from pyscore.ops.linear_int8 import linear_int8_ref, quantize_linear


@pytest.mark.parametrize("batch", [1, 3])
def test_rule_decode_pair_computes_the_same_step(batch):
    if _ext.cpu_module() is None:
        pytest.skip("needs pyscore._C")
    ours, theirs = bench_kernels.rule_decode_pair(batch, torch.float32, layers=1)  # both read layer 0's states
    mine, want = ours(), theirs()
    assert mine.shape == want.shape == (batch, 16, 128)
    torch.testing.assert_close(mine, want, atol=2e-5, rtol=1e-4)


def test_the_prefill_rows_alternate_ours_with_transformers(monkeypatch):
    if _ext.cpu_module() is None:
        pytest.skip("needs pyscore._C")
    alternated = []

    def recording(fns, rounds, timer):
        alternated.append((sorted(fns), rounds))
        return {name: [timer(fn) for _ in range(rounds)] for name, fn in fns.items()}

    monkeypatch.setattr(bench_kernels, "alternate_rounds", recording)
    rows = bench_kernels.linear_attention_rows("MIS 8+2x4", 8, 2, 4, torch.float32, reps=1, rounds=2)
    assert alternated == [(["ours", "transformers"], 2)]
    assert len(rows) == 1 and rows[0].startswith("conv+rule MIS 8+2x4")


def test_the_int8_rows_compare_the_same_product_at_each_tier():
    """Every int8 contender computes the same x @ W.T: ours at each tier gives the contract's bits
    (pyscore.ops.linear_int8's definition), and the bf16 contenders stay within bf16's rounding of them."""
    if _ext.cpu_module() is None:
        pytest.skip("needs pyscore._C")
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(9, 96, generator=gen).bfloat16()
    w = (torch.randn(80, 96, generator=gen) * 0.1).bfloat16()
    at = bench_kernels.int8_tiers(None)
    runs = bench_kernels.int8_contenders(x, w, at)
    try:
        got = {name: run() for name, run in runs.items()}
    finally:
        os.environ.pop("PYSCORE_CPU_TIER", None)
    assert sorted(got) == sorted([*(f"{kind} ours@{t}" for t in at for kind in ("int8", "bf16")),
                                  "bf16 torch F.linear"])
    torch_int8 = linear_int8_ref(x, quantize_linear(w))
    for name, value in got.items():
        if name.startswith("int8"):
            assert torch.equal(value, torch_int8), name
        else:
            torch.testing.assert_close(value.float(), torch_int8.float(), atol=0.05, rtol=0.05)
