"""`make bench-peers` (`python -m bench.peers`): pyscore and vLLM-CPU side by side on the same questions, one
server at a time, in alternating blocks (pyscore first and last), so the two loads never overlap.

Writes OUT/peers.json (every phase), OUT/records.jsonl.gz (every question) and OUT/report.md (medians over the
blocks, the ratios, the token counts, the CPU). What a block runs and how tokens are counted: bench/peers.md.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gzip
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench import loadgen, serving
from bench.common import machine, machine_info, spawned_server
from bench.dataset import Question, synthetic_question
from bench.summary import default_out, fmt, write_json, write_report
from bench.targets import Target, make_target

# What each side runs: report label -> target path.
SIDES: dict[str, dict[str, str]] = {
    "pyscore": {"mis": "mis", "sis": "sis", "setwise": "setwise", "generate": "generate", "loglik": "loglik",
                "rerank": "rerank"},  # rerank: over HTTP only (--ours-http)
    "vllm": {"generative_scoring": "mis", "completions": "generate", "echo_logprobs": "loglik", "rerank": "rerank"},
}
OURS_OVER_GRPC = tuple(label for label in SIDES["pyscore"] if label != "rerank")  # rerank: --ours-http only
# Our label -> the peer labels it is compared with (the best of them); unnamed labels: the scoring paths.
PEERS_OF = {"generate": ("completions",), "loglik": ("echo_logprobs",), "rerank": ("rerank",)}
SCORING_PEERS = ("generative_scoring", "completions", "rerank")  # rerank: a vLLM started as the LLM reranker
VLLM_PORT = 8013  # fixed by start_vllm.sh
# Cached-token counts in /v1/completions' usage; no access-log line per request (ours logs at WARNING too).
VLLM_ARGS = ("--enable-prompt-tokens-details", "--disable-uvicorn-access-log")
# The issue's side-by-side targets (#9): MIS p50 at 16 candidates, c=1, >= 2.5x faster than the peer's best
# path; ahead in achieved q/s at c=8; Generate at c=8 within 1.5x of the peer's completions.
MIS_SPEEDUP_C1, GENERATE_WITHIN_C8 = 2.5, 1.5


@dataclass
class Plan:
    rounds: int = 2  # vLLM blocks; pyscore runs rounds + 1
    concurrency: tuple[int, ...] = (1, 8)
    candidates: tuple[int, ...] = (16, 9, 5, 2)
    num_questions: int = 8  # per phase at c=1; at c=C max(this, 2C) so every worker sends at least two
    warmup: int = 4  # questions per path at each concurrency before a block's first phase (not recorded)
    idle_max_s: float = 120.0
    smoke: bool = False
    labels: dict[str, tuple[str, ...]] = field(default_factory=lambda: {"pyscore": OURS_OVER_GRPC,
                                                                         "vllm": tuple(SIDES["vllm"])})

    def blocks(self) -> list[str]:
        return ["pyscore", "vllm"] * self.rounds + ["pyscore"]

    def questions_for(self, concurrency: int) -> int:
        return max(self.num_questions, 2 * concurrency)


def question_sets(candidates: Sequence[int], count: int, seed: int = 0) -> dict[int, list[Question]]:
    """`count` seeded synthetic questions with exactly n options for each n: the same questions for both sides
    and every block."""
    return {n: [synthetic_question(random.Random(seed * 1000 + n * 100 + i), i, n) for i in range(count)]
            for n in candidates}


# --- the machine ---------------------------------------------------------------------------------------
def cpu_times() -> tuple[int, int]:
    """(busy, idle) jiffies of all CPUs since boot, from /proc/stat."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return sum(fields[:8]) - idle, idle


def wait_idle(max_s: float, window_s: float = 2.0, threshold: float = 0.9) -> float:
    """Waits (at most max_s) until the machine was >= threshold idle over a window; the last idle fraction."""
    deadline = time.monotonic() + max_s
    while True:
        busy0, idle0 = cpu_times()
        time.sleep(window_s)
        busy1, idle1 = cpu_times()
        total = (busy1 - busy0) + (idle1 - idle0)
        fraction = (idle1 - idle0) / total if total else 1.0
        if fraction >= threshold or time.monotonic() >= deadline:
            return round(fraction, 3)


# --- the servers ---------------------------------------------------------------------------------------
def http_get(url: str, timeout: float = 5.0) -> bytes | None:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.read() if r.status == 200 else None
    except OSError:
        return None


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@contextlib.contextmanager
def pyscore_server(log: Path, threads: int | None, http: bool = False) -> Iterator[dict[str, Any]]:
    """Our server; with `http`, driven through its HTTP front door (the peer's shapes: /v1/score, /rerank)."""
    t0 = time.monotonic()
    flags = (["--threads", str(threads)] if threads else []) + (["--http-port", "0"] if http else [])
    with spawned_server(log, flags) as server:
        spec = f"pyscore-http://127.0.0.1:{server.http_port}" if http else server.target
        yield {"spec": spec, "ready_s": round(time.monotonic() - t0, 1)}


@contextlib.contextmanager
def vllm_server(peers: Path, log: Path, extra_args: Sequence[str], ready_timeout_s: float = 900.0
                ) -> Iterator[dict[str, Any]]:
    """$PEERS/start_vllm.sh (both cores: VLLM_CPU_OMP_THREADS_BIND=0-1 unless set), ready when /v1/models
    answers; $PEERS/stop_all.sh afterwards, waiting for the process to be gone. Its log is copied to `log`."""
    base = f"http://127.0.0.1:{VLLM_PORT}"
    if http_get(base + "/v1/models") is not None:
        raise RuntimeError(f"something already serves on port {VLLM_PORT}: stop it first ($PEERS/stop_all.sh)")
    env = os.environ | {"PEERS": str(peers),
                        "VLLM_CPU_OMP_THREADS_BIND": os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "0-1")}
    t0 = time.monotonic()
    subprocess.run([str(peers / "start_vllm.sh"), *extra_args], env=env, check=True, stdout=subprocess.DEVNULL)
    pid = int((peers / "vllm_server.pid").read_text())
    try:
        while http_get(base + "/v1/models") is None:
            if not pid_alive(pid):
                raise RuntimeError(f"vLLM exited before serving; see {peers / 'vllm_server.log'}")
            if time.monotonic() - t0 > ready_timeout_s:
                raise TimeoutError(f"vLLM did not serve within {ready_timeout_s:.0f} s")
            time.sleep(1.0)
        version = json.loads(http_get(base + "/version") or b"{}").get("version")
        yield {"spec": f"vllm-http://127.0.0.1:{VLLM_PORT}", "ready_s": round(time.monotonic() - t0, 1),
               "version": version, "args": list(extra_args), "threads_bind": env["VLLM_CPU_OMP_THREADS_BIND"],
               "dtype": env.get("DTYPE", "bfloat16")}  # start_vllm.sh's --dtype: $DTYPE, else bfloat16
    finally:
        subprocess.run([str(peers / "stop_all.sh")], env=env, stdout=subprocess.DEVNULL, check=False)
        deadline = time.monotonic() + 60
        while pid_alive(pid) and time.monotonic() < deadline:
            time.sleep(0.5)
        if pid_alive(pid):
            os.killpg(pid, signal.SIGKILL)  # its own process group (setsid in start_vllm.sh)
        log.parent.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(OSError):
            shutil.copyfile(peers / "vllm_server.log", log)


# --- one block -----------------------------------------------------------------------------------------
async def counters(target: Target) -> dict[str, float]:
    get = getattr(target, "counters", None)
    return await get() if get is not None else {}


def per_question(delta: dict[str, float], n: int) -> dict[str, float] | None:
    """The peer's /metrics deltas of one phase per question; computed = queries - hits where the server has no
    computed-token counter of its own."""
    if not delta or not n:
        return None
    out = {k: v / n for k, v in delta.items()}
    if "computed_tokens" not in out and "prefix_cache_queries" in out and "prefix_cache_hits" in out:
        out["computed_tokens"] = out["prefix_cache_queries"] - out["prefix_cache_hits"]
    return out


def phase_summary(records: Sequence[loadgen.Record], wall_s: float) -> dict[str, Any]:
    s = loadgen.summarize_records(records, wall_s)
    good = [r for r in records if r.ok]
    computed = [r.computed_tokens for r in good]
    return {"num_questions": s["num_questions"], "num_errors": s["num_errors"], "errors": s["errors"],
            "wall_s": round(wall_s, 3), "achieved_qps": s["achieved_qps"],
            "p50_ms": s["end_to_end_latency_ms"]["p50"], "p95_ms": s["end_to_end_latency_ms"]["p95"],
            "mean_ms": s["end_to_end_latency_ms"]["mean"], "accuracy": s["accuracy"],
            "prompt_tokens_per_q": s["mean_prompt_tokens"],
            # 0 means the side did not say (OpenAI usage without cached-token details)
            "computed_tokens_per_q": statistics.mean(computed) if computed and all(computed) else None}


async def run_block(block: int, side: str, spec: str, plan: Plan, questions: dict[int, list[Question]],
                    log: Callable[[str], None] = print, idle: Callable[[], float] | None = None
                    ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Every phase of one side's block against its running server: (phase dicts, per-question records)."""
    phases, records = [], []
    async with make_target(spec) as target:
        labels = plan.labels[side]
        for label in labels:  # warm every path at every concurrency, every candidate count once
            warm = [questions[plan.candidates[i % len(plan.candidates)]][0] for i in range(plan.warmup)]
            for c in plan.concurrency:
                if warm:
                    await loadgen.closed_loop(target, SIDES[side][label], warm, c)
        for c in plan.concurrency:
            for n in plan.candidates:
                for label in labels:
                    path = SIDES[side][label]
                    idle_before = idle() if idle is not None else None
                    before = await counters(target)
                    result = await loadgen.closed_loop(target, path, questions[n][: plan.questions_for(c)], c)
                    after = await counters(target)
                    delta = {k: after[k] - before.get(k, 0.0) for k in after}
                    phase = {"block": block, "side": side, "label": label, "path": path, "concurrency": c,
                             "candidates": n, **phase_summary(result.records, result.wall_s),
                             "counters_per_q": per_question(delta, sum(r.ok for r in result.records)),
                             "idle_before": idle_before, "loadavg_after": serving.loadavg()}
                    phases.append(phase)
                    records += [{"block": block, "side": side, "label": label, "concurrency": c, **r.to_json()}
                                for r in result.records]
                    log(f"block {block} {side:>7} {label:>18} c={c} n={n:>2}: p50 {phase['p50_ms'] or 0:7.0f} ms "
                        f"p95 {phase['p95_ms'] or 0:7.0f} ms {phase['achieved_qps']:6.2f} q/s "
                        f"errors {phase['num_errors']}/{phase['num_questions']}")
    return phases, records


# --- the report ----------------------------------------------------------------------------------------
def median(values: Sequence[float | None]) -> float | None:
    vs = [v for v in values if v is not None]
    return statistics.median(vs) if vs else None


def aggregate(phases: Sequence[dict[str, Any]]) -> dict[tuple[str, str, int, int], dict[str, Any]]:
    """(side, label, concurrency, candidates) -> medians over blocks and the p50 range."""
    groups: dict[tuple[str, str, int, int], list[dict[str, Any]]] = {}
    for p in phases:
        groups.setdefault((p["side"], p["label"], p["concurrency"], p["candidates"]), []).append(p)
    out = {}
    for key, ps in groups.items():
        p50s = [p["p50_ms"] for p in ps if p["p50_ms"] is not None and not p["num_errors"]]
        computed = median([p["computed_tokens_per_q"] for p in ps])
        metrics = median([(p["counters_per_q"] or {}).get("computed_tokens") for p in ps])
        out[key] = {"blocks": len(ps), "errors": sum(p["num_errors"] for p in ps),
                    "p50_ms": median(p50s), "p50_range": (min(p50s), max(p50s)) if p50s else None,
                    "p95_ms": median([p["p95_ms"] for p in ps if not p["num_errors"]]),
                    "qps": median([p["achieved_qps"] for p in ps if not p["num_errors"]]),
                    "prompt_tokens_per_q": median([p["prompt_tokens_per_q"] for p in ps]),
                    "computed_tokens_per_q": metrics if metrics is not None else computed,
                    "computed_source": "/metrics" if metrics is not None else "usage" if computed else None}
    return out


def peer_for(label: str, agg: dict[tuple[str, str, int, int], dict[str, Any]], c: int, n: int,
             key: str) -> tuple[str, dict[str, Any]] | None:
    """The peer path ours is compared with: its completions for Generate, its echoed prompt logprobs for loglik;
    for a scoring path its best scoring path by `key` (lowest p50, or highest q/s)."""
    names = PEERS_OF.get(label, SCORING_PEERS)
    found = [(name, agg[("vllm", name, c, n)]) for name in names if ("vllm", name, c, n) in agg]
    found = [(name, a) for name, a in found if a[key] is not None]
    if not found:
        return None
    pick = min if key == "p50_ms" else max
    return pick(found, key=lambda item: item[1][key])


def ratio(num: float | None, den: float | None) -> float | None:
    return num / den if num is not None and den else None


def comparisons(agg: dict[tuple[str, str, int, int], dict[str, Any]], plan: Plan) -> list[dict[str, Any]]:
    rows = []
    for c in plan.concurrency:
        for n in plan.candidates:
            for label in plan.labels["pyscore"]:
                ours = agg.get(("pyscore", label, c, n))
                fast, busy = peer_for(label, agg, c, n, "p50_ms"), peer_for(label, agg, c, n, "qps")
                if ours is None or fast is None or busy is None:
                    continue
                rows.append({"concurrency": c, "candidates": n, "label": label, "ours": ours,
                             "peer_p50_path": fast[0], "peer_p50": fast[1], "peer_qps_path": busy[0],
                             "peer_qps": busy[1], "speedup_p50": ratio(fast[1]["p50_ms"], ours["p50_ms"]),
                             "qps_ratio": ratio(ours["qps"], busy[1]["qps"])})
    return rows


def targets(rows: Sequence[dict[str, Any]], plan: Plan) -> list[str]:
    """The issue's side-by-side targets, where this run measured them."""
    by = {(r["label"], r["concurrency"], r["candidates"]): r for r in rows}
    n, lo, hi = max(plan.candidates), min(plan.concurrency), max(plan.concurrency)
    lines = []
    if (r := by.get(("mis", lo, n))) and r["speedup_p50"] is not None:
        ok = "met" if r["speedup_p50"] >= MIS_SPEEDUP_C1 else "NOT met"
        lines.append(f"- MIS p50 at {n} candidates, c={lo}: {r['speedup_p50']:.2f}× the peer's best path "
                     f"({r['peer_p50_path']}); target ≥ {MIS_SPEEDUP_C1}×: {ok}")
    if (r := by.get(("mis", hi, n))) and r["qps_ratio"] is not None:
        ok = "met" if r["qps_ratio"] > 1 else "NOT met"
        lines.append(f"- MIS achieved q/s at {n} candidates, c={hi}: {r['qps_ratio']:.2f}× the peer's best "
                     f"({r['peer_qps_path']}); target > 1×: {ok}")
    if (r := by.get(("generate", hi, n))) and r["speedup_p50"] is not None:
        ok = "met" if r["speedup_p50"] >= 1 / GENERATE_WITHIN_C8 else "NOT met"
        lines.append(f"- Generate p50 at {n} candidates, c={hi}: {r['speedup_p50']:.2f}× the peer's completions "
                     f"(peer p50 / ours); target within {GENERATE_WITHIN_C8}× (≥ {1 / GENERATE_WITHIN_C8:.2f}×): {ok}")
    return lines


def render(meta: dict[str, Any], phases: Sequence[dict[str, Any]], plan: Plan) -> str:
    agg = aggregate(phases)
    rows = comparisons(agg, plan)
    out = ["# pyscore vs vLLM-CPU, side by side", ""]
    if plan.smoke:
        out += ["**SMOKE RUN** — a few questions per phase to prove the flow end to end; these are not "
                "measurements to quote.", ""]
    out += [f"- CPU: {meta['machine']}",
            f"- pyscore {meta['git_commit']}; vLLM {meta.get('vllm_version')} "
            f"({meta.get('vllm_dtype', 'bfloat16')}, {meta.get('vllm_threads_bind')}, "
            f"args {' '.join(meta.get('vllm_args') or []) or 'none'})",
            f"- blocks, in order: {' → '.join(b['side'] for b in meta['blocks'])} (one server at a time; each "
            f"started, warmed ({plan.warmup} questions per path and concurrency), timed, stopped; idle wait before "
            f"every phase)",
            "- server ready after: " + ", ".join(f"{b['side']} {b['ready_s']} s" for b in meta["blocks"]),
            f"- closed loop at c = {', '.join(map(str, plan.concurrency))}; candidates "
            f"{', '.join(map(str, plan.candidates))}; {plan.num_questions} questions per phase at c=1, "
            f"max({plan.num_questions}, 2c) above; the same seeded synthetic questions for both sides",
            f"- started {meta['started_at']}, took {meta['took_s']:.0f} s"
            + (f"; command: `{meta['command']}`" if meta.get("command") else ""), ""]
    out += ["## Ratios (medians over blocks)", "",
            "Speed-up = the peer's p50 / ours (above 1: we are faster); q/s ratio = ours / the peer's. A scoring "
            "path is compared with the peer's best path at that point (lowest p50, highest q/s); Generate with "
            "the peer's one-token completions; loglik (each option's continuation log-likelihood, "
            "lm-evaluation-harness's multiple choice) with the peer's echoed prompt logprobs.", "",
            "| c | cand. | pyscore | p50 ms (range) | q/s | peer (by p50) | peer p50 ms (range) | peer q/s (best) "
            "| speed-up p50 | q/s ratio |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        o, p, q = r["ours"], r["peer_p50"], r["peer_qps"]

        def rng(a: dict[str, Any]) -> str:
            return "" if a["p50_range"] is None else f" ({a['p50_range'][0]:.0f}–{a['p50_range'][1]:.0f})"

        out.append(f"| {r['concurrency']} | {r['candidates']} | {r['label']} | {fmt(o['p50_ms'])}{rng(o)} | "
                   f"{fmt(o['qps'], '.2f')} | {r['peer_p50_path']} | {fmt(p['p50_ms'])}{rng(p)} | "
                   f"{fmt(q['qps'], '.2f')} ({r['peer_qps_path']}) | {fmt(r['speedup_p50'], '.2f')}× | "
                   f"{fmt(r['qps_ratio'], '.2f')}× |")
    out += ["", "## Targets of issue #9", ""] + (targets(rows, plan) or ["- not measured in this run"])
    out += ["", "## Tokens per question (c=1 medians over blocks)", "",
            "Prompt = every query+item sequence as a one-sequence-per-item engine sees it; computed = what the "
            "model ran (pyscore's usage; vLLM's /metrics prompt tokens computed locally, not served by its prefix "
            "cache, over the phase: its cache works in 16-token blocks, so a query shared by the candidates is "
            "reused only up to its last full block).", "",
            "| cand. | side | path | prompt tokens | computed tokens | source |", "|---|---|---|---|---|---|"]
    c1 = min(plan.concurrency)
    for n in plan.candidates:
        for side, labels in plan.labels.items():
            for label in labels:
                a = agg.get((side, label, c1, n))
                if a is not None:
                    out.append(f"| {n} | {side} | {label} | {fmt(a['prompt_tokens_per_q'])} | "
                               f"{fmt(a['computed_tokens_per_q'])} | {a['computed_source'] or '–'} |")
    out += ["", "## Every phase", "",
            "| block | side | path | c | cand. | p50 ms | p95 ms | q/s | errors | idle before |",
            "|---|---|---|---|---|---|---|---|---|---|"]
    for p in phases:
        out.append(f"| {p['block']} | {p['side']} | {p['label']} | {p['concurrency']} | {p['candidates']} | "
                   f"{fmt(p['p50_ms'])} | {fmt(p['p95_ms'])} | {p['achieved_qps']:.2f} | "
                   f"{p['num_errors']}/{p['num_questions']} | {fmt(p['idle_before'], '.2f')} |")
    errors = sorted({e for p in phases for e in p["errors"]})
    if errors:
        out += ["", "Errors seen: " + "; ".join(errors[:5])]
    return "\n".join(out) + "\n"


# --- the run -------------------------------------------------------------------------------------------
ServerFactory = Callable[[int, str], contextlib.AbstractContextManager[dict[str, Any]]]


def run(plan: Plan, servers: ServerFactory, out: Path, idle: Callable[[], float] | None = None,
        log: Callable[[str], None] = print, command: str | None = None) -> Path:
    """Every block in order against the server `servers(block, side)` starts (and stops on exit); writes
    peers.json, records.jsonl.gz and report.md in `out` and returns the report's path."""
    out.mkdir(parents=True, exist_ok=True)
    questions = question_sets(plan.candidates, plan.questions_for(max(plan.concurrency)))
    meta: dict[str, Any] = {"machine": machine(), "cpu": machine_info(), "git_commit": serving.git_commit(),
                            "plan": plan.__dict__, "command": command,
                            "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "blocks": []}
    phases: list[dict[str, Any]] = []
    t0 = time.monotonic()
    with gzip.open(out / "records.jsonl.gz", "wt") as rec:
        for block, side in enumerate(plan.blocks()):
            if idle is not None:
                idle()
            with servers(block, side) as server:
                log(f"block {block}: {side} ready after {server['ready_s']} s")
                meta["blocks"].append({"block": block, "side": side, "ready_s": server["ready_s"]})
                if side == "vllm":
                    meta.update(vllm_version=server.get("version"), vllm_args=server.get("args"),
                                vllm_threads_bind=server.get("threads_bind"), vllm_dtype=server.get("dtype"))
                got, records = asyncio.run(run_block(block, side, server["spec"], plan, questions, log, idle))
            phases += got
            rec.writelines(json.dumps(r) + "\n" for r in records)
    meta["took_s"] = time.monotonic() - t0
    write_json(out / "peers.json", {"meta": meta, "phases": phases}, indent=2)
    report = out / "report.md"
    write_report(render(meta, phases, plan), report, echo=False)
    return report


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.peers", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=str(default_out("peers")))
    p.add_argument("--peers", default=os.environ.get("PEERS"),
                   help="the peers folder with start_vllm.sh, stop_all.sh and vllmvenv (default $PEERS)")
    p.add_argument("--rounds", type=int, default=2, help="vLLM blocks (pyscore runs one more) (%(default)s)")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    p.add_argument("--candidates", type=int, nargs="+", default=[16, 9, 5, 2])
    p.add_argument("--num-questions", type=int, default=8, help="per phase at c=1 (%(default)s)")
    p.add_argument("--warmup", type=int, default=4, help="per path and concurrency at each block's start")
    p.add_argument("--ours", nargs="+", default=list(OURS_OVER_GRPC),
                   choices=list(SIDES["pyscore"]), help="rerank needs --ours-http")
    p.add_argument("--ours-http", action="store_true",
                   help="drive our server through its HTTP front door (vLLM's and SGLang's shapes), not gRPC")
    p.add_argument("--peer-paths", nargs="+", default=[p for p in SIDES["vllm"] if p != "rerank"],
                   choices=list(SIDES["vllm"]), help="rerank needs vLLM started as the LLM reranker (bench/peers.md)")
    p.add_argument("--threads", type=int, default=None, help="our server's threads (default: all cores)")
    p.add_argument("--vllm-arg", action="append", default=list(VLLM_ARGS),
                   help=f"one more flag for start_vllm.sh, added to {' '.join(VLLM_ARGS)}")
    p.add_argument("--idle-max", type=float, default=120.0, help="longest wait for an idle machine, seconds")
    p.add_argument("--smoke", action="store_true", help="mark the report as a smoke run")
    a = p.parse_args(argv)
    if not a.peers or not (Path(a.peers) / "start_vllm.sh").exists():
        sys.exit("set PEERS (or --peers) to the folder bench/peers.md sets up (start_vllm.sh, stop_all.sh, vllmvenv)")
    plan = Plan(rounds=a.rounds, concurrency=tuple(a.concurrency), candidates=tuple(a.candidates),
                num_questions=a.num_questions, warmup=a.warmup, idle_max_s=a.idle_max, smoke=a.smoke,
                labels={"pyscore": tuple(a.ours), "vllm": tuple(a.peer_paths)})
    out, peers = Path(a.out), Path(a.peers)

    def servers(block: int, side: str) -> contextlib.AbstractContextManager[dict[str, Any]]:
        log = out / "logs" / f"block{block}-{side}.log"
        return pyscore_server(log, a.threads, a.ours_http) if side == "pyscore" else vllm_server(peers, log,
                                                                                               a.vllm_arg)

    command = " ".join(["python -m bench.peers", *(sys.argv[1:] if argv is None else argv)])
    report = run(plan, servers, out, idle=lambda: wait_idle(plan.idle_max_s), command=command)
    print(f"report: {report}")


if __name__ == "__main__":
    main()
