"""A digest of our linear kernel's outputs over a fixed grid of shapes, dtypes and epilogues, one line per case, at
the tier PYSCORE_CPU_TIER names (and the bf16 product PYSCORE_BF16_DOT names): run it in two trees and diff the
lines to check that a kernel change kept every bit (or to see which cases moved).

    PYSCORE_CPU_TIER=avx2 python -m bench.probes.linear_bits > a.txt   (in each tree; then diff)
"""

from __future__ import annotations

import hashlib

import torch

from pyscore import _C
from pyscore.ops.linear import linear, pack_linear

ROWS = (1, 2, 3, 5, 7, 8, 11, 16, 17, 40, 64, 70, 130)
# (K, N, gated): a Qwen3-ish shape, K over both layers' K blocks, an odd K, N not a multiple of 64, gated
SHAPES = ((576, 192, False), (4160, 96, False), (577, 200, False), (576, 200, True), (96, 64, True))
DTYPES = (("fp32", torch.float32, torch.float32), ("bf16", torch.bfloat16, torch.bfloat16),
          ("bf16-weight", torch.float32, torch.bfloat16))


def case(m: int, k: int, n: int, gated: bool, x_dtype: torch.dtype, w_dtype: torch.dtype, extras: bool) -> str:
    g = torch.Generator().manual_seed(m * 7919 + k * 31 + n + gated)
    w = (torch.randn(2 * n if gated else n, k, generator=g) / k**0.5).to(w_dtype)
    bias = torch.randn(w.shape[0], generator=g).to(w_dtype) if extras else None
    x = torch.randn(m, k, generator=g).to(x_dtype)
    residual = torch.randn(m, n, generator=g).to(x_dtype) if extras else None
    out = linear(x, pack_linear(w, bias, gated=gated), residual=residual, backend="kernel")
    return hashlib.sha256(out.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()[:16]


def main() -> None:
    torch.manual_seed(0)
    features = _C.cpu_features()
    print(f"# tier {features['tier']} bf16 product {features['bf16_dot']}")
    for name, x_dtype, w_dtype in DTYPES:
        for k, n, gated in SHAPES:
            for m in ROWS:
                for extras in (False, True):
                    digest = case(m, k, n, gated, x_dtype, w_dtype, extras)
                    print(f"{name:11s} M={m:3d} K={k:4d} N={n:3d} gated={gated:d} bias+residual={extras:d} {digest}")


if __name__ == "__main__":
    main()
