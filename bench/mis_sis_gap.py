"""The MIS–SIS gap: how far multi-item scoring's answers are from single-item scoring's on the bench questions
(bench/common.py: a ~270-token query and 16 candidates of ~31 tokens), embedded SmolLM2, in bf16 and fp32.
Per candidate it records P(" Yes") under the label softmax (apply_softmax, what the README example shows) and
under the full vocabulary, for MIS and SIS in the dtype, and SIS in fp32 as the truth; then the distribution of
|MIS − SIS| and of each one's distance to the truth. `--fp32-residual` reruns bf16 with the residual stream
kept in fp32 (an experiment on the reference ops: x in fp32, GEMM inputs in bf16).

    python -m bench.mis_sis_gap [--questions 12] [--out bench/results/mis_sis_gap]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

import torch

import pyscore.model.decoder as decoder_module
from bench.common import REPO as ROOT
from bench.common import machine, question
from bench.summary import Summary, write_json, write_report
from pyscore.engine import Engine

LABELS = [" Yes", " No"]


def keep_residual_in_fp32(engine: Engine) -> None:
    """The experiment: the residual stream x in fp32 (embedding rows upcast; each sublayer's bf16 output added in
    fp32; the norm's output rounded to bf16 for the next GEMM). Reference ops only."""
    engine.decoder.w.embed = engine.decoder.w.embed.float()  # lm_head keeps its own (bf16) reference when tied

    def norm(x: torch.Tensor, weight: torch.Tensor, eps: float, delta: torch.Tensor | None = None,
             backend: str = "auto") -> torch.Tensor:
        if delta is not None:
            x.add_(delta.float())
        xf = x.float()
        return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(weight.dtype)

    decoder_module.add_rms_norm = norm


def yes_probabilities(engine: Engine, query: str, items: list[str], mode: str) -> tuple[list[float], list[float]]:
    """P(" Yes") per item: under the label softmax (P(Yes) / (P(Yes) + P(No)), what apply_softmax computes), and
    under the full vocabulary."""
    vocab = [rows[0] for rows in engine.score(query, items, labels=LABELS, mode=mode).scores]
    return [yes / (yes + no) for yes, no in vocab], [yes for yes, _ in vocab]


def collect(engine: Engine, questions: list[tuple[str, list[str]]], modes: tuple[str, ...]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for mode in modes:
        label, vocab = [], []
        for query, items in questions:
            a, b = yes_probabilities(engine, query, items, mode)
            label += a
            vocab += b
        out[mode] = dict(label=label, vocab=vocab)
    return out


def distribution(values: list[float]) -> dict[str, float]:
    """median (p50), p90, p99, max and mean (bench.summary's percentile)."""
    s = Summary.of(values)
    return dict(median=s.p50, p90=s.p90, p99=s.p99, max=s.max, mean=s.mean)


def gaps(a: list[float], b: list[float]) -> dict[str, float]:
    return distribution([abs(x - y) for x, y in zip(a, b, strict=True)])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--questions", type=int, default=12, help="questions of 16 candidates (default 12)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--fp32-residual", type=int, default=0, metavar="N",
                    help="also run the fp32-residual experiment on the first N questions (slow: reference ops)")
    ap.add_argument("--out", type=Path, default=ROOT / "bench/results/mis_sis_gap")
    args = ap.parse_args()
    questions = [question(16, seed=s) for s in range(args.questions)]
    runs: dict[str, Any] = {}
    t0 = time.perf_counter()
    runs["float32"] = collect(Engine.from_pretrained(None, dtype="float32", threads=args.threads), questions,
                              ("sis", "mis"))
    runs["bfloat16"] = collect(Engine.from_pretrained(None, dtype="bfloat16", threads=args.threads), questions,
                               ("sis", "mis"))
    truth = runs["float32"]["sis"]
    if args.fp32_residual:
        few = args.fp32_residual * 16  # candidates in the experiment
        runs["bfloat16, same questions"] = {  # the kernel path on the experiment's questions, to compare with
            mode: {kind: values[:few] for kind, values in kinds.items()} for mode, kinds in runs["bfloat16"].items()}
        for name, setup in (("bfloat16 reference ops", None),
                            ("bfloat16 reference ops, fp32 residual", keep_residual_in_fp32)):
            engine = Engine.from_pretrained(None, dtype="bfloat16", threads=args.threads, op_backend="reference")
            if setup is not None:
                setup(engine)
            runs[name] = collect(engine, questions[: args.fp32_residual], ("sis", "mis"))
    report: dict[str, Any] = dict(when=time.strftime("%Y-%m-%d %H:%M:%S"), cpu=machine(), model="SmolLM2-135M-Instruct",
                                  questions=args.questions, candidates=16 * args.questions,
                                  seconds=round(time.perf_counter() - t0), runs={})
    for name, run in runs.items():
        n = len(run["sis"]["label"])  # the experiment runs on the first questions only
        report["runs"][f"{name} ({n} candidates)"] = {
            kind: dict(mis_vs_sis=gaps(run["mis"][kind], run["sis"][kind]),
                       mis_vs_fp32_sis=gaps(run["mis"][kind], truth[kind][:n]),
                       sis_vs_fp32_sis=gaps(run["sis"][kind], truth[kind][:n]))
            for kind in ("label", "vocab")}
    write_json(args.out.with_suffix(".json"), dict(report, raw=runs))
    write_report(render(report), args.out.with_suffix(".txt"))


def render(r: dict[str, Any]) -> str:
    lines = [f"# MIS-SIS gap {r['when']} | {r['cpu']} | {r['model']} | {r['questions']} bench questions x 16 "
             f"candidates = {r['candidates']} | {r['seconds']} s",
             "P(' Yes'): label = softmax over ' Yes'/' No' (apply_softmax); vocab = full-vocabulary probability",
             f"{'run':52s} {'P':5s} {'compared':16s} {'median':>9s} {'p90':>9s} {'p99':>9s} {'max':>9s}"]
    for name, kinds in r["runs"].items():
        for kind, comparisons in kinds.items():
            for what, d in comparisons.items():
                lines.append(f"{name:52s} {kind:5s} {what:16s} " + " ".join(f"{d[k]:9.2e}"
                                                                             for k in ("median", "p90", "p99", "max")))
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
