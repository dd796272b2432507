"""In-process engine benchmark on the embedded model or, with `--shape`, a random-weight model of a bench.models
shape on token-id questions of the same lengths; three measurements:

- default: time to decision at concurrency 1 across candidate counts, over `--questions` distinct questions: the
  `--modes` (mis, sis and generate: one max_tokens=1 request per candidate, all prefilled in one `engine.step`, as if
  every candidate were in flight at once; mis_store / sis_store: storing the query in the prefix cache under a fresh
  salt, mis_warm / sis_warm: with the query's blocks in the cache; mis_system / sis_system: each call a question
  never asked before after one shared --system-tokens system prompt, which an earlier question left in the cache)
  and, unless --no-stock, stock transformers' one plain causal forward over MIS's tokens (all positions' logits, and
  logits_to_keep=1), all timed alternately; p50/p95 per cell, the MIS-vs-SIS score difference, MIS(16)/MIS(2) and,
  with --overhead, where a MIS of the most candidates spends its time (host enqueue vs device). A table, and JSON
  (default bench/results/latest/engine_cpu.json, as every mode's file: a record is written with --out). A `--shape`
  run adds the H200 compute and weight-read floors and the verdicts against issue 6's targets and the LMSYS study's
  SGLang numbers; bench/gpu_check.sh runs it with `--device cuda` (and `--tiny`, the shape family's tiny model on the
  CPU);
- `--profile`: where one MIS forward spends its time: wall-clock timers around every op the decoder and the read-out
  call (our C++ kernels are invisible to the torch profiler), then the torch profiler's table; `--gemm torch` loads
  the model with no linear kernel registered, so the projections run on torch's path (profile_mis.txt);
- `--decode B`: one decode step of B running generations, our projections against torch's, alternating
  (decode_step.txt).
- `--generate B`: B greedy generations of --new-tokens tokens against stock transformers' generate() on the same
  weights (with `--shape`, stock's own random weights of the shape), ours' prefill and decode steps also apart
  (generate_vs_stock.txt).
- `--prompt-logprobs K`: a prompt's logprobs with K alternatives a position (Generate, max_tokens 0) against stock
  transformers' one forward with its log-softmax, gather and top-K over every position
  (prompt_logprobs.txt).

`--tier T` forces a CPU tier (PYSCORE_CPU_TIER) and, for avx2 / avx512 / generic, torch's matching ISA settings
(bench.common.force_isa: the bench re-executes itself with them, so stock transformers runs as on that CPU);
`--dtype auto` is the tier's (bf16 where the CPU multiplies bf16; bf16 on a GPU). The engine bypasses its prefix
cache but for the _store and _warm modes: every call is the question's first sight (bench.prefix_cache times warm on
text; `--profile --warm` profiles the forward whose query blocks hit the cache)."""

from __future__ import annotations

import argparse
import itertools
import random
import statistics
import time
import uuid
from collections import defaultdict
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F

import pyscore.engine as engine_module
import pyscore.model.decoder as decoder_module
from bench.common import (
    alternate,
    device_info,
    device_ms,
    elapsed_ms,
    force_isa,
    machine,
    question,
    sentence,
    synchronize,
)
from bench.models import SHAPES, Shape, build_random_engine, id_questions, labels_for
from bench.summary import default_out, percentile, timings, write_json, write_report
from bench.targets import max_diff
from pyscore.engine import Engine, set_threads
from pyscore.model.packing import pack
from pyscore.ops import AttentionPlan, _ext
from pyscore.scoring import PreparedScore
from pyscore.types import GenerateRequest, ScoreRequest

LABELS = ["Yes", "No"]
MODES = ("mis", "sis", "generate", "mis_store", "mis_warm", "sis_store", "sis_warm", "mis_system", "sis_system")
# p95 ms at 16 candidates, concurrency 1 (the LMSYS study, SGLang on one H200) and issue 6's targets
STUDY = {"qwen3-0.6b": dict(mis=18.7, generate=39.6, sis=24.3), "qwen3-8b": dict(mis=20.6, generate=54.1, sis=53.1),
         "qwen3.5-4b": dict(mis=55.7, generate=84.8, sis=74.4)}
TARGET_MIS16 = {"qwen3-0.6b": 10.0, "qwen3-8b": 15.0}
TARGET_RATIO = 1.3
# Measured on this workplace's H200s (.library/device/KINDS.md, 2026-10-28 and 2026-11-04): bf16 8192^3 matmul
# on random data, and a device-to-device copy counting bytes read plus written. The floors use these.
H200_BF16_FLOPS = 788e12
H200_BYTES_PER_S = 4.3e12
Question = tuple[Any, list[Any]]  # (query, items): text, or token ids


# --- time to decision ---------------------------------------------------------------------------------------------
def stock_model(engine: Engine) -> Any:
    """The engine's own weights as stock transformers, in the engine's dtype (default attention: sdpa); for a
    --shape model, stock transformers' own random init of the same config (the same work, other weights: its time
    is comparable, its scores are not)."""
    from transformers import AutoModelForCausalLM

    if str(engine.model.path).startswith("random:"):
        return AutoModelForCausalLM.from_config(engine.model.hf_config, dtype=engine.decoder.dtype).eval()
    return AutoModelForCausalLM.from_pretrained(engine.model.path, dtype=engine.decoder.dtype).eval()


def mis_input_ids(prepared: PreparedScore) -> torch.Tensor:
    """[1, T]: the query's tokens then every item's, the tokens MIS runs, as one causal sequence."""
    return torch.tensor([list(prepared.query) + [t for item in prepared.items for t in item]])


def stock_forward(model: Any, ids: torch.Tensor, keep: int | None) -> torch.Tensor:
    """Logits [1, T or keep, V] of one plain causal forward (no KV cache kept, as MIS keeps none)."""
    with torch.inference_mode():
        return model(input_ids=ids, use_cache=False, **({} if keep is None else {"logits_to_keep": keep})).logits


def generate_first_tokens(engine: Engine, query: Any, items: list[Any]) -> None:
    """One max_tokens=1 generation per candidate, all new, so one packed prefill pass, then each first token."""
    key = "prompt" if isinstance(query, str) else "prompt_token_ids"
    gens = [engine.start_generation(GenerateRequest(**{key: query + item}, max_tokens=1, bypass_prefix_cache=True))
            for item in items]
    engine.step(gens)
    if not all(g.finished for g in gens):
        raise RuntimeError("a max_tokens=1 generation did not finish in one step")


def score_fresh_salt(engine: Engine, query: Any, items: list[Any], mode: str, labels: dict[str, Any]) -> Any:
    """A Score whose query is in no cache entry yet, left there (a salt never seen before)."""
    return engine.score(query, items, mode=mode, prefix_cache_salt=uuid.uuid4().hex, **labels)


def in_turn(calls: list[Callable[[], Any]]) -> Callable[[], Any]:
    """One function that makes the next of `calls` each time (every contender cycles through the questions)."""
    turn = itertools.cycle(calls)
    return lambda: next(turn)()


def score_after_system(engine: Engine, system: Any, query: Any, items: list[Any], mode: str,
                       labels: dict[str, Any]) -> Any:
    """A Score whose query is the shared system prompt, then a mark no earlier call had, then `query`: the system
    prompt is the only part another question may have left in the cache."""
    mark = next(_marks)
    low = engine.cfg.vocab_size // 2  # two ids of the upper half, not the special tokens
    span = engine.cfg.vocab_size - low
    own = f" [{mark}]" if isinstance(query, str) else [low + mark % span, low + mark // span % span]
    return engine.score(system + own + query, items, mode=mode, prefix_cache_salt="system", **labels)


_marks = itertools.count()


def contenders(engine: Engine, stock: Any, questions: list[Question], labels: dict[str, Any],
               modes: tuple[str, ...] = ("mis", "sis"), system: Any = None) -> dict[str, Callable[[], Any]]:
    cached = labels
    labels = {**labels, "bypass_prefix_cache": True}
    runs: dict[str, Callable[[], Any]] = {}
    for mode in modes:
        scoring = mode.split("_")[0]
        if mode.endswith("_warm"):  # every question's query blocks (and a hybrid's states) stored first, untimed
            calls = [partial(engine.score, q, items, mode=scoring, prefix_cache_salt="warm", **cached)
                     for q, items in questions]
            for call in calls:
                call()
        elif mode.endswith("_store"):  # cold, and storing: a salt no earlier call had
            calls = [partial(score_fresh_salt, engine, q, items, scoring, cached) for q, items in questions]
        elif mode.endswith("_system"):
            calls = [partial(score_after_system, engine, system, q, items, scoring, cached) for q, items in questions]
            calls[0]()  # an earlier question leaves the system prompt in the cache (untimed)
        elif mode == "generate":
            calls = [partial(generate_first_tokens, engine, q, items) for q, items in questions]
        else:
            calls = [partial(engine.score, q, items, mode=mode, **labels) for q, items in questions]
        runs[mode] = in_turn(calls)
    if stock is not None:
        ids = [mis_input_ids(engine.prepare_score(ScoreRequest(q, items, **labels))) for q, items in questions]
        runs["stock"] = in_turn([partial(stock_forward, stock, i, None) for i in ids])
        runs["stock_keep1"] = in_turn([partial(stock_forward, stock, i, 1) for i in ids])
    return runs


def load(args: argparse.Namespace) -> tuple[Engine, Callable[[int], list[Question]], dict[str, Any]]:
    """(engine, n -> questions of n candidates, label arguments): the embedded model on text questions, or a
    random-weight model of --shape on token-id questions of the suite's lengths."""
    if args.shape is None:
        engine = Engine.from_pretrained(None, dtype=args.dtype, device=args.device, threads=args.threads)
        return engine, lambda n: [question(n, seed=n + 1000 * i) for i in range(args.questions)], dict(labels=LABELS)
    set_threads(args.threads)  # also sizes the C++ kernels' OpenMP pool, which otherwise takes every host CPU
    engine = build_random_engine(args.shape, device=args.device, dtype=args.dtype,
                                 max_batch_tokens=args.max_batch_tokens)
    vocab = engine.cfg.vocab_size

    def ask(n: int) -> list[Question]:
        return [(q.query, q.items) for q in id_questions(n, args.questions, vocab, tiny=args.tiny)]

    return engine, ask, dict(label_token_ids=labels_for(vocab))


def floors_ms(shape: Shape, tokens: float, readout_rows: int) -> dict[str, float]:
    """Lower bounds on the H200 for one forward pass: matmul FLOPs at the measured bf16 rate (attention and the
    LM head's label rows are small beside them) and one read of the weights at the measured bandwidth."""
    flops = 2 * shape.matmul_params * tokens + 2 * shape.vocab * shape.hidden * readout_rows
    weight_bytes = 2 * (shape.matmul_params + shape.vocab * shape.hidden)  # layers + the LM head streamed once
    return dict(compute_ms=flops / H200_BF16_FLOPS * 1e3, weights_ms=weight_bytes / H200_BYTES_PER_S * 1e3)


def mis_sis_difference(engine: Engine, q: Question, labels: dict[str, Any]) -> dict[str, float]:
    mis, sis = (engine.score(*q, mode=mode, bypass_prefix_cache=True, **labels).scores for mode in ("mis", "sis"))
    diffs = [abs(a - b) for im, is_ in zip(mis, sis, strict=True) for a, b in zip(im[0], is_[0], strict=True)]
    return dict(max_abs=max(diffs), max_score=max(abs(v) for item in sis for v in item[0]))


def overhead_probe(engine: Engine, q: Question, labels: dict[str, Any], reps: int) -> dict[str, Any]:
    """Where a pointwise MIS decision's time goes: host-side preparation and packing, the decoder (host enqueue
    time vs. the synchronised total: equal means the GPU waits on Python launches) and the label read-out."""
    decoder, device = engine.decoder, engine.decoder.device
    request = ScoreRequest(*q, mode="mis", **labels)
    prepared = engine.prepare_score(request)
    batch = pack(prepared.groups())
    out: dict[str, Any] = dict(tokens=batch.num_tokens, segments=int(batch.segments.shape[0]))
    out["prepare_pack_ms"] = percentile([elapsed_ms(lambda: pack(engine.prepare_score(request).groups()))
                                         for _ in range(reps)], 50)
    decoder.hidden_at(batch)
    enqueue, total = [], []
    for _ in range(reps):
        synchronize(device)
        t0 = time.perf_counter()
        decoder.hidden_at(batch)
        enqueue.append((time.perf_counter() - t0) * 1e3)
        synchronize(device)
        total.append((time.perf_counter() - t0) * 1e3)
    out.update(decoder_enqueue_ms=percentile(enqueue, 50), decoder_total_ms=percentile(total, 50))
    hidden = decoder.hidden_at(batch)
    out["readout_ms"] = percentile(device_ms(lambda: engine._row_scores(hidden, [prepared] * hidden.shape[0]),
                                             device, reps), 50)
    return out


def system_prompt(engine: Engine, tokens: int, text: bool) -> Any:
    """A fixed system prompt of about `tokens` tokens: text, or seeded token ids (a --shape model's questions)."""
    if not text:
        seeded = torch.Generator().manual_seed(7)
        return torch.randint(1000, engine.cfg.vocab_size, (tokens,), generator=seeded).tolist()
    rng = random.Random(7)
    return " ".join(sentence(rng, 12) for _ in range(tokens // 12))


def decision_cell(engine: Engine, stock: Any, questions: list[Question], labels: dict[str, Any],
                  args: argparse.Namespace) -> dict[str, Any]:
    """One candidate count: the token counts, every contender's timings (alternating, after --warmup calls each),
    stock's ratios to MIS and the MIS-vs-SIS difference."""
    prepared = [engine.prepare_score(ScoreRequest(q, items, **labels)) for q, items in questions]
    n = len(questions[0][1])
    cell: dict[str, Any] = dict(
        query_tokens=statistics.mean(len(p.query) for p in prepared),
        item_tokens=statistics.mean(sum(map(len, p.items)) / n for p in prepared),
        mis_tokens=statistics.mean(len(p.query) + sum(map(len, p.items)) for p in prepared),
        sis_tokens=statistics.mean(sum(len(p.query) + len(i) for i in p.items) for p in prepared))
    system = system_prompt(engine, args.system_tokens, isinstance(questions[0][0], str))
    runs = contenders(engine, stock, questions, labels, tuple(args.modes), system)
    for fn in list(runs.values()) * args.warmup:
        fn()
    timer = partial(elapsed_ms, device=engine.decoder.device)
    cell.update({name: timings(ts) for name, ts in alternate(runs, args.reps, timer).items()})
    if stock is not None and "mis" in cell:
        cell.update(stock_over_mis=cell["stock"]["p50"] / cell["mis"]["p50"],
                    stock_keep1_over_mis=cell["stock_keep1"]["p50"] / cell["mis"]["p50"])
    cell["mis_vs_sis"] = mis_sis_difference(engine, questions[0], labels)
    return cell


def time_to_decision(args: argparse.Namespace) -> dict[str, Any]:
    t0 = time.perf_counter()
    engine, ask, labels = load(args)
    device = engine.decoder.device
    stock = None if args.no_stock else stock_model(engine)
    synchronize(device)
    shape = SHAPES.get(args.shape or "")
    report: dict[str, Any] = dict(
        machine=machine(), env=device_info(device), tier=engine.cpu_tier, model=engine.model_name, shape=args.shape,
        dtype=str(engine.decoder.dtype).removeprefix("torch."), threads=args.threads, reps=args.reps,
        questions=args.questions, build_s=time.perf_counter() - t0, results={}, skipped=[])
    out = args.out or default_out("engine_cpu.json")
    deadline = t0 + args.budget_s
    print("\n".join(table_head(report, args.modes, stock is not None)), flush=True)
    for n in args.candidates:
        if time.perf_counter() > deadline:
            report["skipped"].append(f"{n} candidates: budget")
            continue
        try:
            cell = decision_cell(engine, stock, ask(n), labels, args)
        except Exception as e:  # one failing cell does not cost the others
            cell = dict(error=f"{type(e).__name__}: {e}")
        if shape is not None and "mis_tokens" in cell:
            cell.update({f"floor_{m}": floors_ms(shape, cell[f"{m}_tokens"], n) for m in ("mis", "sis")})
        report["results"][str(n)] = cell
        print(table_row(n, cell, args.modes, stock is not None), flush=True)
        write_json(out, report)  # after every cell: a run killed by its timeout keeps what it measured
    mis = {n: report["results"].get(n, {}).get("mis", {}) for n in ("2", "16")}
    if all("p95" in m for m in mis.values()):
        report.update(mis16_over_mis2_p50=mis["16"]["p50"] / mis["2"]["p50"],
                      mis16_over_mis2_p95=mis["16"]["p95"] / mis["2"]["p95"])
    if args.overhead and time.perf_counter() < deadline:
        try:
            q = ask(max(args.candidates))[0]
            report["overhead_mis"] = overhead_probe(engine, q, labels, max(5, args.reps // 2))
        except Exception as e:
            report["overhead_mis"] = dict(error=f"{type(e).__name__}: {e}")
    report["total_s"] = time.perf_counter() - t0
    write_json(out, report)
    print("\n".join(table_foot(report)), flush=True)
    return report


def table_head(report: dict[str, Any], modes: list[str], stock: bool) -> list[str]:
    env = report["env"]
    return [f"# engine {report['model']} on {env.get('gpu') or report['machine']} | CPU tier {report['tier'] or '-'} | "
            f"{report['dtype']} threads={report['threads']} | p50/p95 ms over {report['reps']} decisions "
            f"({report['questions']} questions), alternating",
            f"{'cands':>5} {'tok q/item':>11} " + " ".join(f"{m + ' p50/p95':>17}" for m in modes)
            + f" {'MIS/SIS':>8}" + (f" {'stock ms':>9} {'keep-1 ms':>10} {'stock/MIS':>10} {'keep-1/MIS':>11}"
                                    if stock else "") + f" {'floor mis':>9} {'|mis-sis|':>9}"]


def table_row(n: int | str, cell: dict[str, Any], modes: list[str], stock: bool) -> str:
    if "error" in cell:
        return f"{n:>5} ERROR {cell['error']}"
    p50 = {k: v["p50"] for k, v in cell.items() if isinstance(v, dict) and "p50" in v}
    line = f"{n:>5} {cell['query_tokens']:>4.0f}/{cell['item_tokens']:<6.1f} " + " ".join(
        f"{p50[m]:>8.2f}/{cell[m]['p95']:<8.2f}" for m in modes)
    line += f" {p50['mis'] / p50['sis']:>8.3f}" if "mis" in p50 and "sis" in p50 else f" {'-':>8}"
    if stock:
        line += (f" {p50['stock']:>9.1f} {p50['stock_keep1']:>10.1f} {cell['stock_over_mis']:>9.2f}x "
                 f"{cell['stock_keep1_over_mis']:>10.2f}x")
    floor = max(cell["floor_mis"].values()) if "floor_mis" in cell else float("nan")
    return line + f" {floor:>9.2f} {cell['mis_vs_sis']['max_abs']:>9.2e}"


def table_foot(report: dict[str, Any]) -> list[str]:
    lines, shape = [], report["shape"]
    if "mis16_over_mis2_p95" in report:
        r = report["mis16_over_mis2_p95"]
        lines.append(f"MIS(16)/MIS(2) p95 {r:.2f} (p50 {report['mis16_over_mis2_p50']:.2f})"
                     + (f" vs target {TARGET_RATIO} ({'MET' if r <= TARGET_RATIO else 'missed'})" if shape in STUDY
                        else ""))
    mis16 = report["results"].get("16", {}).get("mis", {}).get("p95")
    if mis16 is not None and shape in STUDY:
        target = TARGET_MIS16.get(shape, STUDY[shape]["mis"])  # no target of its own: the study's MIS
        lines.append(f"MIS(16) p95 {mis16:.2f} ms vs target {target} ({'MET' if mis16 <= target else 'missed'}); "
                     "study SGLang: " + ", ".join(f"{k} {v}" for k, v in STUDY[shape].items()))
    if any("stock" in cell for cell in report["results"].values()):
        lines.append("stock = one AutoModelForCausalLM forward over the query+items tokens (use_cache=False); "
                     "stock/MIS, the ratio issue #9 sets its target on, uses the default forward (logits at every "
                     "position); keep-1/MIS the forward with logits_to_keep=1 (no LM head over the other positions)")
    if "overhead_mis" in report:
        lines.append(f"overhead (MIS, max candidates): {report['overhead_mis']}")
    if report["skipped"]:
        lines.append(f"skipped: {report['skipped']}")
    return lines


def table(report: dict[str, Any]) -> str:
    """The whole table of a recorded report (bench.gpu's summary prints each engine run's)."""
    cells = report["results"]
    modes = [m for m in MODES if any(m in c for c in cells.values())]
    stock = any("stock" in c for c in cells.values())
    return "\n".join([*table_head(report, modes, stock), *(table_row(n, c, modes, stock) for n, c in cells.items()),
                      *table_foot(report)])


# --- where the time goes ------------------------------------------------------------------------------------------
# Where the decoder and the engine look the ops up (attention runs through the batch's plan, once per layer).
TIMED = {decoder_module: ["add_rms_norm", "rotary_", "linear"], engine_module: ["label_logprobs"],
         AttentionPlan: ["run"], F: ["linear"]}
OP_LABELS = {(AttentionPlan, "run"): "prefix_item_attention (plan.run)", (F, "linear"): "F.linear (torch GEMM)",
             (decoder_module, "linear"): "linear (GEMM + epilogue, whichever path)"}


class Timers:
    """Per-op wall time and call counts, and a torch.profiler label for each call."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)

    def wrap(self, name: str, fn: Callable) -> Callable:
        def timed(*args, **kwargs):
            with torch.profiler.record_function(f"pyscore::{name}"):
                t0 = time.perf_counter()
                result = fn(*args, **kwargs)
                self.seconds[name] += time.perf_counter() - t0
            self.calls[name] += 1
            return result
        return timed

    def install(self) -> Callable[[], None]:
        """Wraps the timed ops where the decoder and the engine look them up; returns the undo."""
        undo = []
        for module, names in TIMED.items():
            for name in names:
                original = getattr(module, name)
                setattr(module, name, self.wrap(OP_LABELS.get((module, name), name), original))
                undo.append((module, name, original))

        def restore() -> None:
            for module, name, original in undo:
                setattr(module, name, original)
        return restore


def load_gemm(args: argparse.Namespace, gemm: str, quantize: str | None = None) -> Engine:
    """The embedded model (its projections in int8 with quantize="int8"); with gemm="torch", loaded while the
    registry has no linear kernel (plain projections; in int8, torch's definition of the grouped product)."""
    kernels = _ext.REGISTRY["linear"]
    if gemm == "torch":
        _ext.REGISTRY["linear"] = {}
    try:
        return Engine.from_pretrained(None, dtype=args.dtype, threads=args.threads,
                                      quantize=quantize)
    finally:
        _ext.REGISTRY["linear"] = kernels


def step_ms(engine: Engine, prompts: list[str], steps: int) -> tuple[float, int]:
    """Median ms of a decode step over `steps` steps after the prefill, and the cache length at the end."""
    engine.generation.eos_ids = frozenset()  # every generation runs its full length
    gens = [engine.start_generation(GenerateRequest(prompt=p, max_tokens=steps + 2)) for p in prompts]
    engine.step(gens)  # prefill
    times = [elapsed_ms(lambda: engine.step(gens)) for _ in range(steps)]
    return statistics.median(times), gens[0].cache.length


def decode(args: argparse.Namespace) -> list[str]:
    engines = {gemm: load_gemm(args, gemm) for gemm in ("ours", "torch")}
    query, items = question(args.decode, seed=3)
    times: dict[str, list[float]] = {gemm: [] for gemm in engines}
    length = 0
    for _ in range(args.rounds):
        for gemm, engine in engines.items():
            ms, length = step_ms(engine, [query + item for item in items], args.steps)
            times[gemm].append(ms)
    ours, theirs = statistics.median(times["ours"]), statistics.median(times["torch"])
    return [f"machine: {machine()}",
            f"SmolLM2-135M-Instruct bf16, threads {args.threads}: one decode step of {args.decode} generations "
            f"(~{length} cached tokens each at the end), median of {args.steps} steps, median over {args.rounds} "
            "alternating rounds; attention: decode_attention (one call per layer for all sequences)",
            f"projections on pyscore.ops.linear (prepacked, fused epilogues; the step a bound decode program): "
            f"{ours:.1f} ms",
            f"projections on F.linear + silu_mul + add_rms_norm's residual add (the step through the op wrappers): "
            f"{theirs:.1f} ms  "
            f"(F.linear / linear = {theirs / ours:.2f}x)"]


def greedy_generations(engine: Engine, stock: Any, ids: list[list[int]], n: int, prefill_ms: list[float] | None = None
                       ) -> dict[str, Callable[[], list[list[int]]]]:
    """{"ours", "stock"}: each runs one greedy generation of n new tokens per prompt in `ids` (all of one length) and
    returns the new tokens: the engine's Generate path (a prefill, then decode steps of all sequences together)
    and stock transformers' generate() (its KV cache on). Neither stops at eos (the engine's eos set is emptied).
    `prefill_ms`, when given, receives the time of each of ours' first steps (the prefill and the first token)."""
    engine.generation.eos_ids = frozenset()

    def ours() -> list[list[int]]:
        gens = [engine.start_generation(GenerateRequest(prompt_token_ids=i, max_tokens=n, bypass_prefix_cache=True))
                for i in ids]
        t0 = time.perf_counter()
        engine.step(gens)
        if prefill_ms is not None:
            prefill_ms.append((time.perf_counter() - t0) * 1e3)
        while not all(g.finished for g in gens):
            engine.step(gens)
        return [g.token_ids for g in gens]

    def theirs() -> list[list[int]]:
        with torch.inference_mode():
            prompts = torch.tensor(ids)
            out = stock.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=n,
                                 min_new_tokens=n, do_sample=False, pad_token_id=stock.config.eos_token_id)
        return out[:, len(ids[0]):].tolist()

    return {"ours": ours, "stock": theirs}


def generate_vs_stock(args: argparse.Namespace) -> list[str]:
    """--generate B: B greedy generations of --new-tokens tokens from prompts of one length, ours against stock
    transformers' generate() on the same weights in the same dtype (a --shape model: stock's own random weights of
    the same config, so the tokens differ and the times compare), alternating --rounds times."""
    engine, ask, _ = load(args)
    if args.shape is None:  # text: the prompts recorded runs used
        query, items = question(args.generate, seed=5)
        ids = [engine.tokenize(query + item)[0] for item in items]
    else:  # token ids
        query, items = ask(args.generate)[0]
        ids = [query + item for item in items]
    length, n = min(map(len, ids)), args.new_tokens
    prefill: list[float] = []
    runs = greedy_generations(engine, stock_model(engine), [i[:length] for i in ids], n, prefill)
    same = [next((j for j, (a, b) in enumerate(zip(x, y, strict=True)) if a != b), n)
            for x, y in zip(runs["ours"](), runs["stock"](), strict=True)]
    times = alternate(runs, args.rounds)
    best = {name: min(ms) for name, ms in times.items()}
    first = prefill[-args.rounds:][times["ours"].index(best["ours"])]  # the best round's own prefill
    return [f"machine: {machine()}",
            f"{engine.model_name} {str(engine.decoder.dtype).removeprefix('torch.')}, CPU tier {_ext.cpu_tier()} "
            f"(torch's ISA {torch.backends.cpu.get_cpu_capability()}), threads {args.threads}: {args.generate} greedy "
            f"generation(s) of {n} tokens from {length}-token prompts, "
            f"best of {args.rounds} alternating rounds (ms: "
            f"{'; '.join(k + ' ' + ' '.join(f'{t:.0f}' for t in v) for k, v in times.items())})",
            f"ours (Engine, start_generation + step): {best['ours']:.0f} ms, {best['ours'] / n:.1f} ms per token "
            f"(its prefill included; the prefill and first token {first:.0f} ms, then "
            f"{(best['ours'] - first) / max(n - 1, 1):.1f} ms a decode step)",
            f"stock transformers generate():          {best['stock']:.0f} ms, {best['stock'] / n:.1f} ms per token "
            f"(stock / ours = {best['stock'] / best['ours']:.2f}x)",
            f"greedy tokens equal to stock's, per sequence: the first {same} of {n} (in bf16 a near-tie may go either "
            "way)" if args.shape is None else "tokens not compared: stock runs its own random weights of the shape",
            f"command: python -m bench.engine{f' --shape {args.shape}' if args.shape else ''} --generate "
            f"{args.generate} --new-tokens {n} --rounds {args.rounds}"]


def prompt_logprob_runs(engine: Engine, stock: Any, ids: list[int], k: int) -> dict[str, Callable[[], list[float]]]:
    """{"ours", "stock"}: each returns the logprobs of prompt tokens 1.. of `ids` (and makes k alternatives a
    position): the engine's Generate with prompt_logprobs=k and max_tokens 0, and stock transformers' forward
    with log-softmax, gather and (k > 0) top-k over every position."""

    def ours() -> list[float]:
        r = engine.generate(GenerateRequest(prompt_token_ids=ids, max_tokens=0, prompt_logprobs=k))
        return [lp.logprob for lp in r.prompt_logprobs or []][1:]

    def theirs() -> list[float]:
        with torch.inference_mode():
            logp = stock(torch.tensor([ids])).logits[0, :-1].float().log_softmax(-1)
            if k:
                logp.topk(k, dim=-1)
            return logp.gather(1, torch.tensor(ids[1:])[:, None])[:, 0].tolist()

    return {"ours": ours, "stock": theirs}


def prompt_logprobs_vs_stock(args: argparse.Namespace) -> list[str]:
    """--prompt-logprobs K: prompts of the 16-candidate question's shapes (its query; with 8; with 16 items), ours
    against stock transformers on the same weights in the same dtype, alternating --rounds times."""
    engine = Engine.from_pretrained(None, dtype=args.dtype, threads=args.threads)
    stock, k = stock_model(engine), args.prompt_logprobs
    query, items = question(16, seed=7)
    lines = [f"machine: {machine()}",
             f"{engine.model_name} {str(engine.decoder.dtype).removeprefix('torch.')}, CPU tier {_ext.cpu_tier()} "
             f"(torch's ISA {torch.backends.cpu.get_cpu_capability()}), threads {args.threads}: a prompt's logprobs "
             f"with {k} alternatives a position, best of {args.rounds} alternating rounds",
             f"{'prompt tokens':>13}{'ours ms':>10}{'stock ms':>10}{'stock/ours':>12}{'max |diff|':>12}"]
    for prompt in (query, query + "".join(items[:8]), query + "".join(items)):
        ids = engine.tokenize(prompt)[0]
        runs = prompt_logprob_runs(engine, stock, ids, k)
        diff = max(abs(a - b) for a, b in zip(runs["ours"](), runs["stock"](), strict=True))
        best = {name: min(ms) for name, ms in alternate(runs, args.rounds).items()}
        lines.append(f"{len(ids):>13}{best['ours']:>10.1f}{best['stock']:>10.1f}{best['stock'] / best['ours']:>11.2f}x"
                     f"{diff:>12.2e}")
    tier = f" --tier {args.tier}" if args.tier else ""
    return [*lines, f"command: python -m bench.engine{tier} --prompt-logprobs {k} --rounds {args.rounds}"]


def profile(args: argparse.Namespace) -> list[str]:
    engine = load_gemm(args, args.gemm, args.quantize)
    n = args.candidates[-1]
    query, items = question(n, seed=n)

    def forward(e: Engine = engine):
        return e.score(query, items, labels=LABELS, mode="mis", bypass_prefix_cache=not args.warm)

    other = forward(load_gemm(args, "torch" if args.gemm == "ours" else "ours", args.quantize))
    change = max_diff(forward(), other)
    plain = [elapsed_ms(forward) for _ in range(args.forwards)]
    timers = Timers()
    undo = timers.install()
    try:
        result = forward()
        timers.seconds.clear()
        timers.calls.clear()
        totals = [elapsed_ms(forward) for _ in range(args.forwards)]
        seconds, calls = dict(timers.seconds), dict(timers.calls)  # before the profiled forward adds to them
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            forward()
    finally:
        undo()
    total = statistics.mean(totals)
    lines = [f"machine: {machine()}",
             f"{engine.model_name} {str(engine.decoder.dtype).removeprefix('torch.')}, threads {args.threads}, "
             f"projections: {args.gemm}{' in int8' if args.quantize else ''}, {n} candidates MIS, "
             f"{result.usage.computed_tokens} computed tokens "
             f"({result.usage.prompt_tokens} prompt); mean of {args.forwards} forwards",
             f"engine.score without timers: median {statistics.median(plain):.1f} ms (min {min(plain):.1f}); "
             f"with timers: mean {total:.1f} ms; scores vs the other projection path: max |diff| {change:.2e}", "",
             f"{'op (wall time per forward)':<36}{'calls':>7}{'ms':>9}{'share':>8}"]
    timed = 0.0
    for name, op_seconds in sorted(seconds.items(), key=lambda kv: -kv[1]):
        ms = op_seconds * 1e3 / args.forwards
        timed += ms
        lines.append(f"{name:<36}{calls[name] // args.forwards:>7}{ms:>9.2f}{ms / total:>8.1%}")
    return [*lines, f"{'everything else':<36}{'':>7}{total - timed:>9.2f}{(total - timed) / total:>8.1%}", "",
            "torch profiler, one forward (self CPU time; pyscore::* rows are our timers' labels, their self time is "
            "the C++ kernel):", prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25)]


def main(argv: list[str] | None = None) -> dict[str, Any] | None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--device", default="cpu", help="cpu | cuda | auto (default %(default)s)")
    ap.add_argument("--tier", default=None, help="force this CPU tier (PYSCORE_CPU_TIER), at or below the CPU's")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=5, help="timed decisions per contender and candidate count")
    ap.add_argument("--warmup", type=int, default=1, help="untimed calls per contender before each count's rounds")
    ap.add_argument("--candidates", type=int, nargs="+", default=[2, 5, 9, 16], help="--profile: the last")
    ap.add_argument("--questions", type=int, default=1, help="distinct questions per count, taken in turn")
    ap.add_argument("--modes", nargs="+", default=["mis", "sis"], choices=MODES, help="our contenders (big --shape "
                    "models: MIS alone)")
    ap.add_argument("--system-tokens", type=int, default=1000, help="the *_system modes' shared system prompt")
    ap.add_argument("--no-stock", action="store_true", help="skip stock transformers")
    ap.add_argument("--overhead", action="store_true", help="probe where a MIS of the most candidates spends its time")
    ap.add_argument("--budget-s", type=float, default=1e9, help="soft time budget; later candidate counts are skipped")
    ap.add_argument("--out", default=None)
    ap.add_argument("--shape", default=None, choices=sorted(SHAPES), help="a random-weight model (token-id questions)")
    ap.add_argument("--tiny", action="store_true", help="--shape's tiny twin, short questions (plumbing)")
    ap.add_argument("--max-batch-tokens", type=int, default=8192, help="--shape: the engine's batch budget")
    ap.add_argument("--profile", action="store_true", help="where one MIS forward spends its time")
    ap.add_argument("--gemm", choices=["ours", "torch"], default="ours", help="--profile: the projections' path")
    ap.add_argument("--forwards", type=int, default=10, help="--profile: timed forwards")
    ap.add_argument("--quantize", default=None, choices=["int8"], help="--profile: the projections in int8")
    ap.add_argument("--warm", action="store_true", help="--profile: with the prefix cache (the query's blocks hit)")
    ap.add_argument("--decode", type=int, default=0, help="time a decode step of this many generations")
    ap.add_argument("--steps", type=int, default=20, help="--decode: timed steps per round")
    ap.add_argument("--rounds", type=int, default=2, help="--decode, --generate: alternating rounds")
    ap.add_argument("--generate", type=int, default=0, help="greedy generation of this many prompts vs stock's")
    ap.add_argument("--new-tokens", type=int, default=64, help="--generate: tokens per generation")
    ap.add_argument("--prompt-logprobs", type=int, default=None, help="time prompt logprobs with this many "
                    "alternatives against stock's forward")
    args = ap.parse_args(argv)
    if args.tiny:
        args.shape = "tiny-qwen3.5" if args.shape and SHAPES[args.shape].linear else "tiny"
    force_isa("bench.engine", args.tier)
    if args.decode:
        write_report(decode(args), args.out or default_out("decode_step.txt"))
    elif args.generate:
        write_report(generate_vs_stock(args), args.out or default_out("generate_vs_stock.txt"))
    elif args.prompt_logprobs is not None:
        write_report(prompt_logprobs_vs_stock(args), args.out or default_out("prompt_logprobs.txt"))
    elif args.profile:
        write_report(profile(args), args.out or default_out("profile_mis.txt"))
    else:
        return time_to_decision(args)
    return None


if __name__ == "__main__":
    main()
