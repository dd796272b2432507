"""SmoothQuant's two settings (pyscore.model.smoothing's ALPHA and FLOOR) on one model (default the embedded
SmolLM2), int8 with fp32 activations against the fp32 engine, on --seeds sets of --questions synthetic 16-item
questions (bench.int8's set is seed 0); "off" is int8 unsmoothed (a floor at the 1.0 quantile: every s equal).

    python -m bench.probes.int8_smoothing [--seeds 0 2] [--out FILE]

It wrote bench/results/int8/int8_smoothing_zen5.txt, which chose ALPHA and FLOOR."""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

import pyscore.model.smoothing as smoothing
from bench.common import git_commit, machine
from bench.dataset import synthetic_question
from bench.int8 import drift_lines
from bench.prompts import pointwise
from pyscore.engine import Engine

SETTINGS = [("off", 0.8, 1.0), ("alpha 0.8, floor 0.75", 0.8, 0.75), ("alpha 0.6, floor 0.75", 0.6, 0.75),
            ("alpha 0.8, floor 0.5", 0.8, 0.5), ("alpha 0.8, floor 0.9", 0.8, 0.9),
            ("alpha 0.8, no floor", 0.8, 0.0)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None)
    p.add_argument("--questions", type=int, default=16)
    p.add_argument("--seeds", type=int, nargs="*", default=[0, 2])
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    lines = [f"# python -m bench.probes.int8_smoothing {' '.join(sys.argv[1:])}   (commit {git_commit()})",
             f"# {machine()}",
             f"{'setting':<24}" + "".join(f"{f'seed {s}: median |dP|':>22}{'same best':>11}" for s in args.seeds)]
    print("\n".join(lines), flush=True)
    reference = Engine.from_pretrained(args.model, dtype="float32", device="cpu")
    sets = []
    for seed in args.seeds:
        rng = random.Random(seed)
        sets.append([(pw.query, pw.items) for pw in (pointwise(synthetic_question(rng, i, 16))
                                                     for i in range(args.questions))])
    default = smoothing.ALPHA, smoothing.FLOOR
    for name, alpha, floor in SETTINGS:
        smoothing.ALPHA, smoothing.FLOOR = alpha, floor
        try:
            engine = Engine.from_pretrained(args.model, dtype="float32", device="cpu", quantize="int8")
        finally:
            smoothing.ALPHA, smoothing.FLOOR = default
        cells = []
        for questions in sets:
            row = drift_lines({"fp32": reference, "int8": engine}, questions)[-1].split()
            cells.append(f"{row[1]:>22}{row[4]:>11}")
        lines.append(f"{name:<24}" + "".join(cells))
        print(lines[-1], flush=True)
    if args.out:
        args.out.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
