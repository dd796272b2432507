"""bench.kernels' contenders do the same work: the decode-step rule row's two sides (ours from and to the fp32
states, transformers' recurrent fallback from the same state) give the same output. The prefill rows time ours and
transformers' in alternation."""

from __future__ import annotations

import pytest
import torch

from bench import kernels as bench_kernels
from pyscore.ops import _ext


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
