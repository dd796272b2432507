"""label_logprobs with fp32 read-out rows: the LM head held in bf16 (widened in the kernel) vs the same values held in
fp32, at SmolLM2-135M's head (V 49152, H 576) and Qwen3-0.6B's (V 151936, H 1024), at the row counts given (default
1 2 3 8 12 16), with lm_head_logits (Generate's whole rows) the same two ways; the results asserted bitwise equal;
median of 5 alternating rounds, each the median of 10 calls (the heads, 113-622 MB, stream from DRAM). It wrote
sections 1 and 2a of bench/results/tiers/kernels/labels_avx2_bf16_head_ab.txt (tier avx2, torch threads 2):

    python -m bench.probes.label_head 1 2 3 8 12 16
    python -m bench.ab --before OLD_TREE --rounds 2 -- -m bench.probes.label_head 1 2 3 8 16

(then run as an uncommitted lab.py, the same code with the rows fixed in it; here they are the arguments, and the
timed calls are bound with functools.partial instead of lambdas).
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable
from functools import partial

import torch

from bench.common import machine
from pyscore.ops import _ext, label_logprobs, lm_head_logits


def ms(fn: Callable[[], object], n: int = 10) -> float:
    out = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t) * 1e3)
    return statistics.median(out)


def main() -> None:
    rows_list = [int(r) for r in sys.argv[1:]] or [1, 2, 3, 8, 12, 16]
    torch.manual_seed(0)
    print(f"machine: {machine()}; tier {_ext.cpu_tier()}; torch threads {torch.get_num_threads()}")
    for name, (v, h) in {"smollm2-135m": (49152, 576), "qwen3-0.6b": (151936, 1024)}.items():
        w16 = (torch.randn(v, h) * h**-0.5).bfloat16()
        w32 = w16.float()
        for rows in rows_list:
            x = torch.randn(rows, h)
            labels = torch.randint(0, v, (rows, 2), dtype=torch.int32)
            a = label_logprobs(x, w16, labels, backend="kernel")
            b = label_logprobs(x, w32, labels, backend="kernel")
            assert all(torch.equal(p, q) for p, q in zip(a, b, strict=True))
            fns: dict[str, Callable[[], object]] = {
                "bf16": partial(label_logprobs, x, w16, labels, backend="kernel"),
                "fp32": partial(label_logprobs, x, w32, labels, backend="kernel"),
                "bf16 logits": partial(lm_head_logits, x, w16, backend="kernel"),
                "fp32 logits": partial(lm_head_logits, x, w32, backend="kernel")}
            cells: dict[str, list[float]] = {k: [] for k in fns}
            for _ in range(5):
                for k, f in fns.items():
                    cells[k].append(ms(f))
            m = {k: statistics.median(c) for k, c in cells.items()}
            print(f"{name:13} R={rows:2}  labels: bf16 head {m['bf16']:7.2f} ms  fp32 head {m['fp32']:7.2f} ms  "
                  f"{m['fp32'] / m['bf16']:.2f}x   whole rows (Generate): bf16 {m['bf16 logits']:7.2f}  "
                  f"fp32 {m['fp32 logits']:7.2f}  {m['fp32 logits'] / m['bf16 logits']:.2f}x", flush=True)


if __name__ == "__main__":
    main()
