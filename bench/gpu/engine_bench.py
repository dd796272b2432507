"""In-process engine benchmark on a random-weight Qwen3-shaped model: time to decision at concurrency 1 for
Generate, SIS and MIS at 2/5/9/16 candidates (p50/p95 over distinct token-id questions), MIS(16)/MIS(2), the
MIS-vs-SIS score difference, and where the time of a 16-candidate MIS goes (host enqueue vs device).

Generate: one GenerateRequest (max_tokens=1) per candidate, all prefilled in one `engine.step` batch — the
in-process equivalent of every candidate in flight at once; the decision exists when every first token is out.

    python -m bench.gpu.engine_bench --shape qwen3-0.6b --out engine.json          # GPU
    python -m bench.gpu.engine_bench --tiny --out /tmp/engine.json                 # CPU plumbing check
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from functools import partial
from typing import Any

from bench.common import elapsed_ms
from bench.gpu.common import (
    H200_BF16_FLOPS,
    H200_BYTES_PER_S,
    Budget,
    add_run_args,
    cli,
    device_ms,
    environment,
    resolve_run_args,
    summarize,
    sync,
    wall_ms,
)
from bench.gpu.models import SHAPES, Shape, build_random_engine
from bench.gpu.workload import IdQuestion, id_questions, labels_for
from bench.summary import write_json
from pyscore.engine import Engine, set_threads
from pyscore.model.packing import pack
from pyscore.types import GenerateRequest, ScoreRequest

MODES = ("generate", "sis", "mis")
# p95 ms at 16 candidates, concurrency 1 (the LMSYS study, SGLang on one H200) and issue 6's targets
STUDY = {"qwen3-0.6b": dict(mis=18.7, generate=39.6, sis=24.3), "qwen3-8b": dict(mis=20.6, generate=54.1, sis=53.1),
         "qwen3.5-4b": dict(mis=55.7, generate=84.8, sis=74.4)}
TARGET_MIS16 = {"qwen3-0.6b": 10.0, "qwen3-8b": 15.0}
TARGET_RATIO = 1.3


def decide_score(engine: Engine, q: IdQuestion, labels: list[int], mode: str) -> list[float]:
    result = engine.score(q.query, q.items, label_token_ids=labels, mode=mode)
    return [row[0][0] for row in result.scores]


def decide_generate(engine: Engine, q: IdQuestion) -> list[int]:
    gens = [engine.start_generation(GenerateRequest(prompt_token_ids=q.query + item, max_tokens=1))
            for item in q.items]
    engine.step(gens)  # all prompts are new: one packed prefill pass, then each first token is chosen
    if not all(g.finished for g in gens):
        raise RuntimeError("a max_tokens=1 generation did not finish in one step")
    return [g.result().token_ids[0] if g.token_ids else -1 for g in gens]


def floors_ms(shape: Shape, tokens: int, readout_rows: int) -> dict[str, float]:
    """Lower bounds on the H200 for one forward pass: matmul FLOPs at the measured bf16 rate (attention and the
    LM head's label rows are small beside them) and one read of the weights at the measured bandwidth."""
    flops = 2 * shape.matmul_params * tokens + 2 * shape.vocab * shape.hidden * readout_rows
    weight_bytes = 2 * (shape.matmul_params + shape.vocab * shape.hidden)  # layers + the LM head streamed once
    return dict(compute_ms=flops / H200_BF16_FLOPS * 1e3, weights_ms=weight_bytes / H200_BYTES_PER_S * 1e3)


def time_mode(engine: Engine, questions: list[IdQuestion], labels: list[int], mode: str, reps: int,
              warmup: int) -> list[float]:
    device = engine.decoder.device

    def run(q: IdQuestion) -> None:
        if mode == "generate":
            decide_generate(engine, q)
        else:
            decide_score(engine, q, labels, mode)

    for i in range(warmup):
        run(questions[i % len(questions)])
    return [wall_ms(partial(run, questions[i % len(questions)]), device) for i in range(reps)]


def mis_sis_difference(engine: Engine, q: IdQuestion, labels: list[int]) -> dict[str, float]:
    mis = engine.score(q.query, q.items, label_token_ids=labels, mode="mis").scores
    sis = engine.score(q.query, q.items, label_token_ids=labels, mode="sis").scores
    diffs = [abs(a - b) for im, is_ in zip(mis, sis, strict=True) for a, b in zip(im[0], is_[0], strict=True)]
    scale = max(abs(v) for item in sis for v in item[0])
    return dict(max_abs=max(diffs), max_score=scale)


def overhead_probe(engine: Engine, q: IdQuestion, labels: list[int], reps: int) -> dict[str, Any]:
    """Where a pointwise MIS decision's time goes: host-side preparation and packing, the decoder (host enqueue
    time vs. the synchronised total: equal means the GPU waits on Python launches) and the label read-out."""
    decoder, device = engine.decoder, engine.decoder.device
    request = ScoreRequest(query=q.query, items=q.items, label_token_ids=labels, mode="mis")
    prepared = engine.prepare_score(request)
    batch = pack(prepared.groups())
    out: dict[str, Any] = dict(tokens=batch.num_tokens, segments=int(batch.segments.shape[0]))

    out["prepare_pack_ms"] = summarize([elapsed_ms(lambda: pack(engine.prepare_score(request).groups()))
                                        for _ in range(reps)])["p50"]
    decoder.hidden_at(batch)
    enqueue, total = [], []
    for _ in range(reps):
        sync(device)
        t0 = time.perf_counter()
        decoder.hidden_at(batch)
        enqueue.append((time.perf_counter() - t0) * 1e3)
        sync(device)
        total.append((time.perf_counter() - t0) * 1e3)
    out["decoder_enqueue_ms"] = summarize(enqueue)["p50"]
    out["decoder_total_ms"] = summarize(total)["p50"]
    hidden = decoder.hidden_at(batch)
    out["readout_ms"] = summarize(device_ms(lambda: engine._row_scores(hidden, [prepared] * hidden.shape[0]),
                                            device, reps))["p50"]
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    shape_name = args.shape
    if args.tiny:  # the tiny model of the shape's family
        shape_name = "tiny-qwen3.5" if SHAPES[args.shape].linear else "tiny"
    budget = Budget(args.budget_s)
    set_threads(args.threads)  # also sizes the C++ kernels' OpenMP pool, which otherwise takes every host CPU
    t0 = time.perf_counter()
    engine = build_random_engine(shape_name, device=args.device, dtype=args.dtype,
                                 max_batch_tokens=args.max_batch_tokens)
    device = engine.decoder.device
    sync(device)
    report: dict[str, Any] = dict(shape=shape_name, shape_config=dataclasses.asdict(SHAPES[shape_name]),
                                  env=environment(device), dtype=str(engine.decoder.dtype),
                                  build_s=time.perf_counter() - t0,
                                  reps=args.reps, warmup=args.warmup, results={}, skipped=[])
    labels = labels_for(engine.cfg.vocab_size)
    write_json(args.out, report)
    for n in args.candidates:
        questions = id_questions(n, args.questions, engine.cfg.vocab_size, tiny=args.tiny)
        entry: dict[str, Any] = dict(mis_tokens=sum(q.mis_tokens for q in questions) / len(questions),
                                     sis_tokens=sum(q.sis_tokens for q in questions) / len(questions))
        entry["floor_mis"] = floors_ms(SHAPES[shape_name], round(entry["mis_tokens"]), n)
        entry["floor_sis"] = floors_ms(SHAPES[shape_name], round(entry["sis_tokens"]), n)
        report["results"][str(n)] = entry
        for mode in args.modes:
            if budget.exhausted():
                report["skipped"].append(f"{mode}@{n}: budget")
                continue
            try:
                entry[mode] = summarize(time_mode(engine, questions, labels, mode, args.reps, args.warmup))
            except Exception as e:
                entry[mode] = dict(error=f"{type(e).__name__}: {e}")
            write_json(args.out, report)
        if not budget.exhausted():
            entry["mis_vs_sis"] = mis_sis_difference(engine, questions[0], labels)
        write_json(args.out, report)
    res = report["results"]
    if "2" in res and "16" in res and "p95" in res["2"].get("mis", {}) and "p95" in res["16"].get("mis", {}):
        report["mis16_over_mis2_p95"] = res["16"]["mis"]["p95"] / res["2"]["mis"]["p95"]
        report["mis16_over_mis2_p50"] = res["16"]["mis"]["p50"] / res["2"]["mis"]["p50"]
    if args.overhead and not budget.exhausted():
        n = max(args.candidates)
        q = id_questions(n, 1, engine.cfg.vocab_size, seed=7, tiny=args.tiny)[0]
        try:
            report["overhead_mis"] = overhead_probe(engine, q, labels, max(5, args.reps // 2))
        except Exception as e:
            report["overhead_mis"] = dict(error=f"{type(e).__name__}: {e}")
    report["total_s"] = time.perf_counter() - t0
    write_json(args.out, report)
    return report


def table(report: dict[str, Any]) -> str:
    """The report as gpu_check.sh's summary prints it: p50/p95 per cell, the H200 floor, the MIS-SIS difference,
    and the verdicts against issue 6's targets and the study's SGLang numbers."""
    shape = report["shape"]
    lines = [f"# engine {shape} on {report['env'].get('gpu', report['env']['device'])} "
             f"({report['dtype']}), p50/p95 ms over {report['reps']} decisions",
             f"{'cands':>5} {'tok mis/sis':>12} " + " ".join(f"{m + ' p50/p95':>17}" for m in MODES)
             + f" {'floor mis':>9} {'|mis-sis|':>9}"]
    for n, e in report["results"].items():
        cells = []
        for m in MODES:
            s = e.get(m, {})
            cells.append(f"{s['p50']:>8.2f}/{s['p95']:<8.2f}" if "p95" in s else f"{'ERR' if s else '-':>17}")
        floor = max(e["floor_mis"].values())
        diff = e.get("mis_vs_sis", {}).get("max_abs", float("nan"))
        lines.append(f"{n:>5} {e['mis_tokens']:>5.0f}/{e['sis_tokens']:<6.0f} " + " ".join(cells)
                     + f" {floor:>9.2f} {diff:>9.2e}")
    mis16 = report["results"].get("16", {}).get("mis", {}).get("p95")
    if mis16 is not None and shape in STUDY:
        target = TARGET_MIS16.get(shape, STUDY[shape]["mis"])  # no target of its own: the study's MIS
        lines.append(f"MIS(16) p95 {mis16:.2f} ms vs target {target} ({'MET' if mis16 <= target else 'missed'}); "
                     "study SGLang: " + ", ".join(f"{k} {v}" for k, v in STUDY[shape].items()))
    if "mis16_over_mis2_p95" in report:
        r = report["mis16_over_mis2_p95"]
        verdict = "MET" if r <= TARGET_RATIO else "missed"
        lines.append(f"MIS(16)/MIS(2) p95 {r:.2f} vs target {TARGET_RATIO} ({verdict})")
    if "overhead_mis" in report:
        lines.append(f"overhead (MIS, max candidates): {report['overhead_mis']}")
    if report.get("skipped"):
        lines.append(f"skipped: {report['skipped']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_run_args(p, "decisions")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    p.add_argument("--questions", type=int, default=8, help="distinct questions cycled per candidate count")
    p.add_argument("--threads", type=int, default=None, help="CPU threads (default: all cores)")
    p.add_argument("--no-overhead", dest="overhead", action="store_false", help="skip the launch-overhead probe")
    p.add_argument("--budget-s", type=float, default=1e9, help="soft time budget; later cells are skipped")
    args = resolve_run_args(p.parse_args(argv))
    return cli(run(args), args.out, table)


if __name__ == "__main__":
    main()
