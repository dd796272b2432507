"""Hardening runs against `python -m server` on the embedded model, recorded in bench/results/hardening/ with
`--out bench/results/hardening` (not CI tests: they produce figures; without --out, bench/results/latest/hardening).
Both replay recorded requests through bench.loadgen's open loop (Poisson arrivals; ReplayTarget judges every answer
against the same request answered alone beforehand) at a multiple of the capacity measured first (closed loop, 4
callers), while the server's RSS, cores used and queue depth are sampled:

- overload: MIS at --factor (3) x capacity for --duration s, --rounds (2) times on one server: whether the queue
  stayed bounded (--max-queue), how fast the excess got RESOURCE_EXHAUSTED, the accepted requests' latency, and RSS
  (growth in the first round and not in the second is a high-water mark, not a leak);
- soak: a mix (SIS 30%, MIS 30%, setwise 20%, greedy Generate 20%) at --load (0.7) x capacity for --minutes through
  --clients channels in turn: errors, wrong answers, p95 per minute, RSS every 10 s and every --memory-every-s the
  server's own probe (server/memory.py: RSS, glibc's mallinfo2 and malloc_info; with --tracemalloc N the Python
  allocation sites that grew), a PNG of the curves and whether RSS after minute 5 stayed within ±10% of its value
  then. Controls go through --server-env: LD_PRELOAD=<libjemalloc.so.2>, PYSCORE_TRIM_UNDER_LOAD=1, ...

    python -m bench.hardening overload [--duration 60] [--factor 3] [--max-queue 16] [--out bench/results/hardening]
    python -m bench.hardening soak [--minutes 10] [--clients 4] [--load 0.7] [--tracemalloc 1] [--name soak-30min]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shlex
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from bench import loadgen
from bench.common import machine, question, sampled, spawned_server
from bench.loadgen import Record
from bench.summary import Summary, default_out, write_json, write_report
from bench.targets import TOLERANCE, Case, ReplayTarget, draws, mis_cases

MARKER = " ###"  # one token in SmolLM2's vocabulary
MIX = {"sis": 0.3, "mis": 0.3, "setwise": 0.2, "generate": 0.2}
YES_NO = dict(labels=[" Yes", " No"])
STEADY_AFTER_MIN = 5.0  # the soak's target: RSS after this minute stays within +-10% of its value then


async def replay_at(server: Any, replay: ReplayTarget, pick: Callable[[int, int], list[Case]], rate: float,
                    seconds: float, seed: int, every_s: float) -> tuple[loadgen.RunResult, list[dict[str, Any]]]:
    """Poisson arrivals at `rate` for `seconds` (requests pick(n, seed)) while the server is sampled."""
    schedule = loadgen.poisson_schedule(rate, seed=seed, duration_s=seconds)
    return await sampled(server, every_s, loadgen.open_loop(replay, "case", pick(len(schedule), seed), schedule))


# --- overload ------------------------------------------------------------------------------------------------------
def summarize(records: Sequence[Record]) -> dict[str, Any]:
    """Statuses, the accepted and refused latencies, and the accepted answers against their answers alone."""
    ok = [r for r in records if r.ok]
    diffs = [r.diff for r in ok if r.diff is not None]
    refused = [(r.completed - r.sent) * 1e3 for r in records if r.status == "RESOURCE_EXHAUSTED"]
    return dict(sent=len(records), statuses=loadgen.statuses(records), accepted_latency_ms=loadgen.latency_ms(ok),
                refused_latency_ms=Summary.of(refused).pick("p50", "p95", "p99", "max", digits=1),
                wrong=sum(d > TOLERANCE for d in diffs), max_abs_diff=max(diffs, default=0.0),
                exact=sum(d == 0.0 for d in diffs))


async def overload(server: Any, a: argparse.Namespace) -> dict[str, Any]:
    cases = mis_cases(a.pool, a.items)
    async with ReplayTarget(server.target, timeout=120) as replay:
        alone_s = await replay.record_alone(cases)
        capacity = await loadgen.capacity(replay, "case", cases, 4, a.capacity_s)
        rss_before, rate = server.rss_mb(), a.factor * capacity
        print(f"capacity {capacity:.2f} MIS req/s; offering {rate:.2f} req/s for {a.duration:.0f} s, {a.rounds} "
              "rounds", flush=True)
        rounds = []
        for k in range(a.rounds):
            cpu0, t0 = server.cpu_s(), time.perf_counter()
            run, samples = await replay_at(server, replay, lambda n, seed: draws(cases, n, seed), rate, a.duration, k,
                                           0.25)
            cores = (server.cpu_s() - cpu0) / (time.perf_counter() - t0)  # < cpus: something else took CPU
            await asyncio.sleep(5)
            rounds.append(dict(round=k + 1, **summarize(run.records), server_cores_used=round(cores, 2),
                               loadavg_after=os.getloadavg(),
                               max_queue_depth_seen=max((s["queue"] for s in samples), default=float("nan")),
                               rss_mb=dict(peak=max(s["rss_mb"] for s in samples), after_5s=round(server.rss_mb(), 1)),
                               queue_samples=[(s["t"], s["queue"]) for s in samples],
                               rss_samples=[(s["t"], s["rss_mb"]) for s in samples[::4]]))
    usage = cases[0].alone.usage if cases[0].alone else None
    return dict(alone_latency_ms=Summary.of(alone_s, scale=1e3).pick("p50", "p95", "p99", "max", digits=1),
                capacity_rps=round(capacity, 3), offered_rps=round(rate, 3), rss_mb_before=round(rss_before, 1),
                usage_of_one_request=asdict(usage) if usage else None, rounds=rounds)


def overload_report(r: dict[str, Any]) -> list[str]:
    c = r["config"]
    lines = [f"{c['rounds']} rounds of {c['duration']:g} s", f"({c['factor']}x) open-loop Poisson for "
             f"{c['duration']:.0f} s per round; --max-queue {c['max_queue']}",
             f"MIS request: {c['items']} items, {r['usage_of_one_request']} tokens; alone {r['alone_latency_ms']} ms",
             f"server RSS MiB before the load: {r['rss_mb_before']}; exit code on SIGTERM {r['server_exit_code']}"]
    for k in r["rounds"]:
        lines += [
            f"round {k['round']}: sent {k['sent']}: {k['statuses']}; queue depth max seen "
            f"{k['max_queue_depth_seen']:.0f} (limit {c['max_queue']}); the server used {k['server_cores_used']} "
            f"cores on average (load average after {tuple(round(x, 2) for x in k['loadavg_after'])})",
            f"  RESOURCE_EXHAUSTED latency ms {k['refused_latency_ms']}",
            f"  accepted latency ms {k['accepted_latency_ms']}",
            f"  wrong answers {k['wrong']} (|diff| > {TOLERANCE}); bitwise equal to alone {k['exact']}; "
            f"max |diff| {k['max_abs_diff']:.2e}",
            f"  RSS MiB peak {k['rss_mb']['peak']}, 5 s after {k['rss_mb']['after_5s']}"]
    return lines


# --- soak ----------------------------------------------------------------------------------------------------------
def make_cases(per_kind: int) -> dict[str, list[Case]]:
    cases: dict[str, list[Case]] = {k: [] for k in MIX}
    for i in range(per_kind):
        cases["sis"].append(Case(f"sis-{i}", "sis", *question(3, seed=2000 + i), dict(YES_NO, mode="sis")))
        cases["mis"].append(Case(f"mis-{i}", "mis", *question(5, seed=3000 + i), dict(YES_NO, mode="mis")))
        query, items = question(4, seed=4000 + i, item_words=8)
        answers = [item.split("\n")[0] for item in items]  # "Proposed answer: ..." without the question
        ranked = [f"{a}{MARKER} {b}{MARKER}" for a, b in zip(answers[::2], answers[1::2], strict=True)]
        cases["setwise"].append(Case(f"setwise-{i}", "setwise", query.replace("which action", "rank the actions"),
                                     ranked, dict(YES_NO, score_extraction_token=MARKER)))
        cases["generate"].append(Case(f"generate-{i}", "generate", f"Customer {i}: where is my order? Agent:", [],
                                      dict(max_tokens=8, temperature=0.0)))
    return cases


def picks(cases: dict[str, list[Case]], n: int, seed: int) -> list[Case]:
    """`n` requests drawn from the mix (kinds by MIX's weights), seeded."""
    rng = random.Random(seed)
    return [rng.choice(cases[rng.choices(list(MIX), weights=list(MIX.values()))[0]]) for _ in range(n)]


async def soak(server: Any, a: argparse.Namespace) -> dict[str, Any]:
    cases = make_cases(a.per_kind)
    async with ReplayTarget(server.target, channels=a.clients, timeout=120) as replay:
        await replay.record_alone([c for k in MIX for c in cases[k]])
        cap = await loadgen.capacity(replay, "case", picks(cases, 1000, seed=1), 4, a.capacity_s)
        print(f"capacity {cap:.2f} req/s of the mix; offering {a.load * cap:.2f} req/s for {a.minutes} min", flush=True)
        run, samples = await replay_at(server, replay, lambda n, seed: picks(cases, n, seed), a.load * cap,
                                       a.minutes * 60, 100, 10.0)
    return dict(capacity_rps=round(cap, 3), offered_rps=round(a.load * cap, 3), samples=samples,
                rss_verdict=rss_verdict(samples), **soak_summary(run.records, a.minutes))


def soak_summary(records: Sequence[Record], minutes: float) -> dict[str, Any]:
    ok = [r for r in records if r.ok]
    per_kind = {k: dict(served=sum(r.kind == k for r in ok), wrong=sum(r.correct is False for r in ok if r.kind == k),
                        latency_ms=loadgen.latency_ms([r for r in ok if r.kind == k])) for k in MIX}
    per_minute = []
    for m in range(int(-(-minutes // 1))):
        window = [r for r in records if m * 60 <= r.sent < (m + 1) * 60]
        served = [r for r in window if r.ok]
        per_minute.append(dict(minute=m + 1, sent=len(window), served=len(served), errors=len(window) - len(served),
                               wrong=sum(r.correct is False for r in served), p95_ms=loadgen.latency_ms(served)["p95"]))
    score_ok = [r for r in ok if r.kind != "generate"]
    return dict(sent=len(records), served=len(ok),
                errors={k: v for k, v in loadgen.statuses(records).items() if k != "OK"},
                wrong_scores=sum(r.correct is False for r in score_ok),
                generate_text_mismatches=sum(r.correct is False for r in ok if r.kind == "generate"),
                max_abs_score_diff=max((r.diff or 0.0 for r in score_ok), default=0.0),
                latency_ms=loadgen.latency_ms(ok), per_kind=per_kind, per_minute=per_minute)


def rss_verdict(samples: list[dict[str, Any]]) -> dict[str, Any]:
    """RSS at minute 5 and its range afterwards: the target is within +-10% until the end."""
    after = [s for s in samples if s["t"] >= STEADY_AFTER_MIN * 60]
    if not after:
        return dict(note=f"shorter than {STEADY_AFTER_MIN:g} minutes: no verdict")
    ref, low, high = after[0]["rss_mb"], min(s["rss_mb"] for s in after), max(s["rss_mb"] for s in after)
    return dict(rss_at_5min_mb=ref, min_mb=low, max_mb=high, end_mb=after[-1]["rss_mb"],
                within_10_percent=bool(low >= 0.9 * ref and high <= 1.1 * ref),
                drift_percent=round(100 * (after[-1]["rss_mb"] - ref) / ref, 1))


def soak_report(r: dict[str, Any]) -> list[str]:
    c, memory = r["config"], r["memory"]
    lines = [
        f"{c['minutes']} min, {c['clients']} clients", f"({c['load']:.0%} of capacity), the mix {MIX}",
        f"sent {r['sent']}, served {r['served']}, errors {r['errors'] or 0}, wrong Score answers {r['wrong_scores']} "
        f"(|diff| > {TOLERANCE}; max |diff| {r['max_abs_score_diff']:.2e}), Generate texts differing from alone "
        f"{r['generate_text_mismatches']}",
        f"latency ms (served) {r['latency_ms']}",
        *(f"  {k:9s} served {v['served']:5d} wrong {v['wrong']} latency ms {v['latency_ms']}"
          for k, v in r["per_kind"].items()),
        "minute  sent served errors wrong  p95 ms",
        *(f"{m['minute']:6d} {m['sent']:5d} {m['served']:6d} {m['errors']:6d} {m['wrong']:5d} {m['p95_ms']:7.1f}"
          for m in r["per_minute"]),
        "t s  RSS MiB  server cores  1-min load  queue",
        *(f"{s['t']:4.0f} {s['rss_mb']:8.1f} {s['server_cores'] if s['server_cores'] is not None else '':>13} "
          f"{s['loadavg_1m']:11.2f} {s['queue']:6.0f}" for s in r["samples"]),
        f"server exit code on SIGTERM {r['server_exit_code']}",
        f"RSS verdict (target: within ±10% of minute {STEADY_AFTER_MIN:g} until the end): {r['rss_verdict']}",
        "probe t s  RSS MiB  peak MiB  glibc in use MiB  glibc free MiB  mmapped MiB  arenas  Python traced MiB"]
    for m in memory:
        mi, info, traced = m.get("mallinfo2", {}), m.get("malloc_info", {}), m.get("tracemalloc", {}).get("traced")
        lines.append(f"{m['t']:9.0f} {m['VmRSS'] / 1024:8.1f} {m['VmHWM'] / 1024:9.1f} "
                     f"{mi.get('uordblks', 0) / 2**20:17.1f} {mi.get('fordblks', 0) / 2**20:15.1f} "
                     f"{mi.get('hblkhd', 0) / 2**20:12.1f} {info.get('heaps', 0):7d} "
                     f"{'' if traced is None else f'{traced / 2**20:.1f}':>18}")
    grown = memory[-1].get("tracemalloc", {}).get("grown_since_first", []) if memory else []
    if grown:
        lines.append("Python allocation sites grown since the first probe (tracemalloc):")
        lines += [f"  {g['bytes'] / 2**20:8.2f} MiB {g['count']:+8d} blocks  {g['site']}" for g in grown]
    return lines


def plot(r: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    samples, memory = r["samples"], r["memory"]
    fig, ax = plt.subplots(figsize=(9, 4.5))
    ax.plot([s["t"] / 60 for s in samples], [s["rss_mb"] for s in samples], label="RSS (every 10 s)")
    if memory and "mallinfo2" in memory[0]:
        minutes = [m["t"] / 60 for m in memory]
        ax.plot(minutes, [(m["mallinfo2"]["uordblks"] + m["mallinfo2"]["hblkhd"]) / 2**20 for m in memory], "o-",
                label="glibc malloc in use (mallinfo2)")
        ax.plot(minutes, [(m["malloc_info"].get("system_current", 0) + m["mallinfo2"]["hblkhd"]) / 2**20
                          for m in memory], "s--", label="glibc heap held + mmapped")
    if "rss_at_5min_mb" in r["rss_verdict"]:
        ref = r["rss_verdict"]["rss_at_5min_mb"]
        ax.axhspan(0.9 * ref, 1.1 * ref, color="green", alpha=0.1, label="±10% of RSS at minute 5")
        ax.axvline(STEADY_AFTER_MIN, color="gray", lw=0.8)
    ax.set(xlabel="minutes", ylabel="MiB")
    ax.set_title(f"{r['run']}: {r['config']['minutes']:g} min, {r['cpu']}", fontsize=9)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# --- the command ---------------------------------------------------------------------------------------------------
def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.hardening", description=__doc__.split("\n\n")[0])
    ap.add_argument("run", choices=["overload", "soak"])
    ap.add_argument("--capacity-s", type=float, default=None, help="seconds of the capacity measurement (20; soak 30)")
    ap.add_argument("--server-args", default="", help='more `python -m server` flags, e.g. "--threads 1"')
    ap.add_argument("--server-env", action="append", default=[], metavar="KEY=VALUE",
                    help="more environment for the server, e.g. MALLOC_MMAP_THRESHOLD_=131072 (repeatable)")
    ap.add_argument("--name", help="the result files' name (default: the run's)")
    ap.add_argument("--out", type=Path, default=default_out("hardening"))
    for name, default, text in [("duration", 60.0, "overload: seconds of open-loop load per round"),
                                ("factor", 3.0, "overload: offered load / capacity"),
                                ("items", 5, "overload: candidates per MIS request"),
                                ("pool", 16, "overload: distinct requests"),
                                ("max_queue", 16, "overload: the server's --max-queue"),
                                ("rounds", 2, "overload: load rounds on the same server"),
                                ("minutes", 10.0, "soak: length"), ("clients", 4, "soak: client channels"),
                                ("load", 0.7, "soak: offered load / capacity"),
                                ("per_kind", 6, "soak: distinct requests of each kind"),
                                ("memory_every_s", 60.0, "soak: seconds between memory probes"),
                                ("tracemalloc", 0, "soak: trace Python allocations with N frames (0 = off)")]:
        ap.add_argument(f"--{name.replace('_', '-')}", type=type(default), default=default,
                        help=f"{text} (default {default:g})")
    a = ap.parse_args(argv)
    a.capacity_s = a.capacity_s or (20.0 if a.run == "overload" else 30.0)
    name = a.name or a.run
    memory_log = a.out / f"{name}_memory.jsonl"
    memory_log.parent.mkdir(parents=True, exist_ok=True)
    memory_log.unlink(missing_ok=True)
    env = dict(kv.split("=", 1) for kv in a.server_env)
    if a.run == "soak":
        env.update(PYSCORE_MEMORY_LOG=str(memory_log), PYSCORE_MEMORY_EVERY_S=str(a.memory_every_s))
        if a.tracemalloc:
            env["PYTHONTRACEMALLOC"] = str(a.tracemalloc)
    flags = [*(["--max-queue", str(a.max_queue)] if a.run == "overload" else []), *shlex.split(a.server_args)]
    load_before = os.getloadavg()
    with spawned_server(a.out / f"{name}_server.log", flags, metrics=True, env=env) as server:
        result = asyncio.run((overload if a.run == "overload" else soak)(server, a))
        exit_code = server.stop()
    r = dict(run=name, when=time.strftime("%Y-%m-%d %H:%M:%S"), cpu=machine(),
             machine=dict(before=dict(loadavg=load_before, cpus=os.cpu_count()),
                          after=dict(loadavg=os.getloadavg(), cpus=os.cpu_count())),
             config=dict(vars(a), out=str(a.out)), server_exit_code=exit_code, **result)
    if a.run == "soak":
        r["memory"] = [json.loads(line) for line in memory_log.read_text().splitlines()] if memory_log.exists() else []
        plot(r, a.out / f"{name}_rss.png")
    write_json(a.out / f"{name}.json", r)
    what, offered, *lines = (overload_report if a.run == "overload" else soak_report)(r)
    m = r["machine"]
    write_report([f"# {name} {r['when']} | {r['cpu']}: {what}; load average before {m['before']['loadavg']}, after "
                  f"{m['after']['loadavg']}, {m['before']['cpus']} CPUs; percentiles by bench.summary (linear "
                  f"interpolation)", f"capacity (closed loop, 4 callers) {r['capacity_rps']} req/s; offered "
                  f"{r['offered_rps']} req/s {offered}", *lines], a.out / f"{name}.txt")


if __name__ == "__main__":
    main()
