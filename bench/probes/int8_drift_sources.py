"""Where int8 W8A8's drift comes from on one model (default the embedded SmolLM2): the projections' quantization
simulated in fp32 (quantize, dequantize, fp32 GEMM: the same roundings as pyscore.ops.linear_int8 up to the sums'
order), one part at a time, against the fp32 engine over --questions synthetic 16-item questions (bench.int8's set):

- weights only (per output channel, activations fp32); activations only (per row, weights fp32); both (what
  quantize="int8" computes); both in groups of --group along K (a finer scale per group of channels, for weights
  and activations alike); and how peaked the projections' input rows are: the share of rows whose max |x| is above
  8x (and 16x) their rms over the first question (the finer a row's values sit below its max, the fewer of int8's
  levels they get); activations alone in groups of each --x-groups size (weights per output channel, as the kernel
  holds them: a per-(row, group) scale is all a kernel would add), alone and with SmoothQuant; and --mixed XG:WG,
  activations in groups of XG with weights in groups of WG (0: per output channel), with SmoothQuant.

    python -m bench.probes.int8_drift_sources [--questions 8] [--group 32] [--x-groups 32 64] [--mixed 64:128]
        [--only REGEX]

Diagnostic only: it swaps pyscore.ops.linear's int8 call for the simulation inside this process."""

from __future__ import annotations

import argparse
import random
import re
import statistics
import sys

import torch
import torch.nn.functional as F

import pyscore.model.smoothing as smoothing
import pyscore.ops.linear  # noqa: F401  (the module, which pyscore.ops' `linear` function shadows)
from bench.common import git_commit, machine
from bench.dataset import synthetic_question
from bench.int8 import best, p_yes
from bench.prompts import pointwise
from pyscore.engine import Engine
from pyscore.ops.linear_int8 import QuantLinear

LINEAR = sys.modules["pyscore.ops.linear"]
# --product-smoothing: SmoothQuant as pyscore.model.smoothing folds it (these kinds, factors floored), else on every
# projection, unfloored (the earlier records' simulation)
PRODUCT: frozenset[str] | None = None


def fake_quant(t: torch.Tensor, group: int | None) -> torch.Tensor:
    """Rows of t quantized symmetrically to int8 and back, one scale per row (group None) or per `group` columns
    (the last group of a row whose length is not a multiple of it shorter); group 0: unchanged."""
    if group == 0:
        return t
    m, k = t.shape
    g = group or k
    padded = F.pad(t, (0, -k % g))
    parts = padded.reshape(m, -1, g)
    scale = parts.abs().amax(-1, keepdim=True) / 127
    return (torch.round(parts / scale.clamp_min(1e-30)).clamp(-127, 127) * scale).reshape(m, -1)[:, :k]


def simulated(x_group: int | None, w_group: int | None, kinds: frozenset[str] | None = None,
              alpha: float | None = None, outliers: int = 0, layers: frozenset[int] | None = None):
    """The int8 call simulated: x_group / w_group as fake_quant's; kinds: quantize the activations of these
    projections only (the others' stay fp32); alpha: SmoothQuant's per-input-channel factor s = amax_x^alpha /
    amax_w^(1 - alpha) (amax_x from the calibration pass), x / s and W * s quantized; outliers: the input channels
    of the largest calibrated amax_x, this many per projection, kept fp32 (x's and W's), the rest quantized; layers:
    quantize the activations in these decoder layers only."""
    def run(x: torch.Tensor, w: QuantLinear, residual=None, out=None, reference: bool = False) -> torch.Tensor:
        weight, bias = w.source
        xf = x.float()
        if alpha is not None and (PRODUCT is None or w.kind in PRODUCT):
            if PRODUCT is not None:  # the engine's own factors, floored
                s = smoothing.factors(w.calibrated, weight, alpha)
            else:
                s = w.calibrated.clamp_min(1e-5) ** alpha / weight.abs().amax(0).clamp_min(1e-5) ** (1 - alpha)
            xf, weight = xf / s, weight * s
        xg = x_group if (kinds is None or w.kind in kinds) and (layers is None or w.layer in layers) else 0
        kept = 0
        if outliers:
            idx = w.calibrated.topk(outliers).indices
            kept = xf[:, idx] @ weight[:, idx].t()
            xf, weight = xf.clone(), weight.clone()
            xf[:, idx] = 0
            weight[:, idx] = 0
        v = fake_quant(xf, xg) @ fake_quant(weight, w_group).t() + kept
        if bias is not None:
            v = v + bias
        if w.gated:
            half = v.shape[1] // 2
            v = F.silu(v[:, :half]) * v[:, half:]
        if residual is not None:
            v = v + residual.float()
        v = v.to(x.dtype)
        return v if out is None else out.copy_(v)
    return run


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None)
    p.add_argument("--questions", type=int, default=8)
    p.add_argument("--group", type=int, nargs="*", default=[32], help="group sizes along K for weights and x alike")
    p.add_argument("--only", default=None, help="run only the variants whose name matches this regular expression")
    p.add_argument("--calibration", type=int, default=4, help="SmoothQuant: calibration questions (not measured)")
    p.add_argument("--alphas", type=float, nargs="*", default=[0.5, 0.8])
    p.add_argument("--outliers", type=int, nargs="*", default=[4, 16, 64], help="fp32 input channels per projection")
    p.add_argument("--product-smoothing", action="store_true",
                   help="SmoothQuant as the engine folds it: qkv, gate_up, down and in_proj only, factors floored")
    p.add_argument("--per-layer", action="store_true", help="activations quantized in one layer at a time")
    p.add_argument("--x-groups", type=int, nargs="*", default=[32, 64],
                   help="activation group sizes along K (weights per channel)")
    p.add_argument("--mixed", nargs="*", default=[], metavar="XG:WG",
                   help="activations in groups of XG, weights in groups of WG (0: per channel), with each --alphas")
    args = p.parse_args()
    global PRODUCT
    if args.product_smoothing:
        PRODUCT = frozenset({"qkv", "gate_up", "down", "in_proj"})
    rng = random.Random(0)
    questions = [(pw.query, pw.items) for pw in (pointwise(synthetic_question(rng, i, 16))
                                                 for i in range(args.questions))]
    ref = Engine.from_pretrained(args.model, dtype="float32", device="cpu")
    want = [p_yes(ref, q, items) for q, items in questions]
    # The fp32 projections, kept beside each int8 weight for the simulation (the int8 engine's own are dropped).
    sources = {id(w): w for w in ref.decoder.w.projections()}
    # Unsmoothed: the simulation reads the checkpoint's own weights (`source`) and applies its own SmoothQuant, so
    # the engine's norms must be the checkpoint's too (pyscore.model.smoothing folds factors into them).
    smoothing.smooth = lambda *args, **kwargs: None
    engine = Engine.from_pretrained(args.model, dtype="float32", device="cpu", quantize="int8")
    layer_of = [i for i, layer in enumerate(engine.decoder.w.layers) for w in (
        layer.qkv, layer.o, layer.gate_up, layer.down,
        *((layer.linear.in_proj, layer.linear.out) if layer.linear is not None else ())) if w is not None]
    kinds = [kind for layer in engine.decoder.w.layers for kind in ("qkv", "o", "gate_up", "down", "in_proj", "out")
             if getattr(layer, kind, None) is not None or (layer.linear is not None and kind in ("in_proj", "out"))]
    for fp, q, kind, i in zip(sources.values(), engine.decoder.w.projections(), kinds, layer_of, strict=True):
        object.__setattr__(q, "source", fp.unpacked())
        object.__setattr__(q, "kind", kind)
        object.__setattr__(q, "layer", i)
    print(f"# python -m bench.probes.int8_drift_sources {' '.join(sys.argv[1:])}   (commit {git_commit()})")
    print(f"# {machine()}; {engine.model_name}; {len(questions)} questions x 16 items; |dP(Yes)| vs the fp32 engine")
    print(f"{'simulated':<40}{'median':>9}{'p99':>9}{'max':>9}{'same best':>11}")
    variants = {"weights only (per channel)": (0, None), "activations only (per row)": (None, 0),
                "both (per channel, per row)": (None, None)}
    for g in args.group:
        variants[f"both in groups of {g} along K"] = (g, g)
    real = LINEAR.linear_int8
    peaks: list[torch.Tensor] = []

    def recording(x: torch.Tensor, w: QuantLinear, residual=None, out=None, reference: bool = False) -> torch.Tensor:
        xf = x.float()
        peaks.append(xf.abs().amax(1) / xf.pow(2).mean(1).sqrt().clamp_min(1e-30))
        return simulated(0, 0)(x, w, residual, out)

    LINEAR.linear_int8 = recording
    try:
        p_yes(engine, *questions[0])
    finally:
        LINEAR.linear_int8 = real
    ratio = torch.cat(peaks)

    def calibrating(x: torch.Tensor, w: QuantLinear, residual=None, out=None, reference: bool = False):
        amax = x.float().abs().amax(0)
        object.__setattr__(w, "calibrated", torch.maximum(getattr(w, "calibrated", amax), amax))
        return simulated(0, 0)(x, w, residual, out)

    # SmoothQuant's calibration: other questions than the measured ones (seed 1).
    calibration = random.Random(1)
    LINEAR.linear_int8 = calibrating
    try:
        for i in range(args.calibration):
            pw = pointwise(synthetic_question(calibration, 1000 + i, 16))
            p_yes(engine, pw.query, pw.items)
    finally:
        LINEAR.linear_int8 = real
    for kind in sorted(set(kinds)):
        variants[f"activations of {kind} only (per row)"] = (None, 0, frozenset({kind}))
    for alpha in args.alphas:
        variants[f"both, SmoothQuant alpha {alpha}"] = (None, None, None, alpha)
    for k in args.outliers:
        variants[f"both, {k} outlier channels fp32"] = (None, None, None, None, k)
        for alpha in args.alphas:
            variants[f"both, {k} outliers + alpha {alpha}"] = (None, None, None, alpha, k)
    for g in args.group:
        for alpha in args.alphas:
            variants[f"groups of {g} + alpha {alpha}"] = (g, g, None, alpha)
    if args.per_layer:
        for i in range(len(engine.decoder.w.layers)):
            variants[f"activations of layer {i} only"] = (None, 0, None, None, 0, frozenset({i}))
    for g in args.x_groups:
        variants[f"x groups of {g}, w per channel"] = (g, None)
        for alpha in args.alphas:
            variants[f"x groups of {g} + alpha {alpha}"] = (g, None, None, alpha)
    for pair in args.mixed:
        xg, wg = (int(v) for v in pair.split(":"))
        for alpha in args.alphas:
            variants[f"x groups of {xg}, w {f'groups of {wg}' if wg else 'per channel'} + alpha {alpha}"] = (
                xg, wg or None, None, alpha)
    print(f"# projection input rows (all layers, one question): {ratio.numel()}; max |x| > 8x rms in "
          f"{(ratio > 8).float().mean().item():.0%}, > 16x in {(ratio > 16).float().mean().item():.0%}")
    for name, variant in variants.items():
        if args.only and not re.search(args.only, name):
            continue
        LINEAR.linear_int8 = simulated(*variant)
        try:
            got = [p_yes(engine, q, items) for q, items in questions]
        finally:
            LINEAR.linear_int8 = real
        diffs = sorted(abs(a - b) for qa, qb in zip(got, want, strict=True) for a, b in zip(qa, qb, strict=True))
        same = sum(best(a) == best(b) for a, b in zip(got, want, strict=True))
        print(f"{name:<40}{statistics.median(diffs):>9.4f}{diffs[int(0.99 * (len(diffs) - 1))]:>9.4f}"
              f"{diffs[-1]:>9.4f}{f'{same}/{len(want)}':>11}", flush=True)


if __name__ == "__main__":
    main()
