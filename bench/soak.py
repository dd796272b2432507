"""Soak: mixed Score (SIS, MIS, setwise) and Generate traffic at `--load` (default 70%) of the measured
capacity (bench.loadgen's open loop, Poisson arrivals sent through `--clients` channels in turn), for
`--minutes` (default 10) against `python -m server` on the embedded model. Every Score answer is checked
against the same request scored alone beforehand (Generate, greedy, against its text generated alone).
Reports requests served, errors, wrong answers, p95, and the server's memory: RSS every 10 s, and every
`--memory-every-s` (60) the server's own probe (server/memory.py: RSS, glibc's mallinfo2 and malloc_info
totals, and with `--tracemalloc` the Python allocation sites that grew); a PNG of the curves, and whether RSS
after minute 5 stayed within ±10% of its minute-5 value. Not a CI test: it produces figures.

Controls, to tell allocator retention from a leak: `--trim-under-load` (the worker calls malloc_trim every
10 s even while busy), `--allocator jemalloc|tcmalloc` (LD_PRELOAD of Debian's libjemalloc2 /
libtcmalloc-minimal4: `apt-get install libjemalloc2 libtcmalloc-minimal4`), `--server-env KEY=VALUE` (e.g. a
fixed MALLOC_MMAP_THRESHOLD_, or ONEDNN_PRIMITIVE_CACHE_CAPACITY).
Results are named after the variant (soak, soak-trim, soak-jemalloc, ...) so that runs do not overwrite each
other.

    python -m bench.soak [--minutes 10] [--clients 4] [--load 0.7] [--out bench/results/hardening]
    python -m bench.soak --minutes 30 --tracemalloc 1            # the long soak
    python -m bench.soak --minutes 30 --allocator jemalloc       # a control
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shlex
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench import loadgen
from bench.common import add_server_run_args, question, run_header, run_record, sampled, spawned_server
from bench.loadgen import Record
from bench.summary import write_json, write_report
from bench.targets import TOLERANCE, Case, ReplayTarget

MARKER = " ###"  # one token in SmolLM2's vocabulary
ALLOCATORS = {"glibc": None, "jemalloc": "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2",
              "tcmalloc": "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"}
PACKAGES = {"jemalloc": "libjemalloc2", "tcmalloc": "libtcmalloc-minimal4"}
STEADY_AFTER_MIN = 5.0  # the target: RSS after this minute stays within +-10% of its value then
MIX = {"sis": 0.3, "mis": 0.3, "setwise": 0.2, "generate": 0.2}
YES_NO = dict(labels=[" Yes", " No"])


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


async def soak(target: str, server: Any, cases: dict[str, list[Case]], a: argparse.Namespace
               ) -> tuple[float, float, list[Record], list[dict[str, Any]]]:
    """References alone, the mix's capacity (closed loop, 4 callers), then the open loop at `a.load` of it
    through `a.clients` channels, sampling the server every 10 s; (capacity, rate, records, samples)."""
    async with ReplayTarget(target, channels=a.clients, timeout=120) as replay:
        await replay.record_alone([c for k in MIX for c in cases[k]])
        cap = await loadgen.capacity(replay, "case", picks(cases, 1000, seed=1), 4, a.capacity_s)
        rate = a.load * cap
        print(f"capacity {cap:.2f} req/s of the mix; offering {rate:.2f} req/s for {a.minutes} min", flush=True)
        schedule = loadgen.poisson_schedule(rate, seed=100, duration_s=a.minutes * 60)
        run, samples = await sampled(server, 10.0, loadgen.open_loop(replay, "case", picks(cases, len(schedule), 2),
                                                                      schedule))
    return cap, rate, run.records, samples


def summarize(records: Sequence[Record], minutes: float) -> dict[str, Any]:
    ok = [r for r in records if r.ok]
    errors = {k: v for k, v in loadgen.statuses(records).items() if k != "OK"}
    per_kind = {k: dict(served=sum(r.kind == k for r in ok), wrong=sum(r.correct is False for r in ok if r.kind == k),
                        latency_ms=loadgen.latency_ms([r for r in ok if r.kind == k])) for k in MIX}
    per_minute = []
    for m in range(int(-(-minutes // 1))):
        window = [r for r in records if m * 60 <= r.sent < (m + 1) * 60]
        served = [r for r in window if r.ok]
        per_minute.append(dict(minute=m + 1, sent=len(window), served=len(served),
                               errors=len(window) - len(served), wrong=sum(r.correct is False for r in served),
                               p95_ms=loadgen.latency_ms(served)["p95"]))
    score_ok = [r for r in ok if r.kind != "generate"]
    return dict(sent=len(records), served=len(ok), errors=errors,
                wrong_scores=sum(r.correct is False for r in score_ok),
                generate_text_mismatches=sum(r.correct is False for r in ok if r.kind == "generate"),
                max_abs_score_diff=max((r.diff or 0.0 for r in score_ok), default=0.0),
                latency_ms=loadgen.latency_ms(ok), per_kind=per_kind, per_minute=per_minute)


def report(r: dict[str, Any]) -> str:
    c = r["config"]
    lines = [
        *run_header(r, f"{c['minutes']} min, {c['clients']} clients", f"({c['load']:.0%} of capacity), the mix {MIX}"),
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
    ]
    return "\n".join(lines) + "\n"


def variant_name(args: argparse.Namespace) -> str:
    return args.name or "-".join(["soak", *(["trim"] if args.trim_under_load else []),
                                  *([args.allocator] if args.allocator != "glibc" else []),
                                  *(kv.split("=", 1)[0].strip("_").lower() for kv in args.server_env)])


def server_env(args: argparse.Namespace, memory_log: Path) -> dict[str, str]:
    env = dict(kv.split("=", 1) for kv in args.server_env)
    env.update(PYSCORE_MEMORY_LOG=str(memory_log), PYSCORE_MEMORY_EVERY_S=str(args.memory_every_s))
    if args.trim_under_load:
        env["PYSCORE_TRIM_UNDER_LOAD"] = "1"
    if args.tracemalloc:
        env["PYTHONTRACEMALLOC"] = str(args.tracemalloc)
    library = ALLOCATORS[args.allocator]
    if library is not None:
        if not Path(library).exists():
            raise SystemExit(f"{library} is missing: apt-get install {PACKAGES[args.allocator]}")
        env["LD_PRELOAD"] = library
    return env


def rss_verdict(samples: list[dict[str, Any]]) -> dict[str, Any]:
    """RSS at minute 5 and its range afterwards: the target is within +-10% until the end."""
    after = [s for s in samples if s["t"] >= STEADY_AFTER_MIN * 60]
    if not after:
        return dict(note=f"shorter than {STEADY_AFTER_MIN:g} minutes: no verdict")
    ref = after[0]["rss_mb"]
    low, high = min(s["rss_mb"] for s in after), max(s["rss_mb"] for s in after)
    return dict(rss_at_5min_mb=ref, min_mb=low, max_mb=high, end_mb=after[-1]["rss_mb"],
                within_10_percent=bool(low >= 0.9 * ref and high <= 1.1 * ref),
                drift_percent=round(100 * (after[-1]["rss_mb"] - ref) / ref, 1))


def plot(samples: list[dict[str, Any]], memory: list[dict[str, Any]], title: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4.5))
    ax.plot([s["t"] / 60 for s in samples], [s["rss_mb"] for s in samples], label="RSS (every 10 s)")
    if memory and "mallinfo2" in memory[0]:
        glibc = [(m["mallinfo2"]["uordblks"] + m["mallinfo2"]["hblkhd"]) / 2**20 for m in memory]
        ax.plot([m["t"] / 60 for m in memory], glibc, "o-", label="glibc malloc in use (mallinfo2)")
        held = [m["malloc_info"].get("system_current", 0) / 2**20 + m["mallinfo2"]["hblkhd"] / 2**20 for m in memory]
        ax.plot([m["t"] / 60 for m in memory], held, "s--", label="glibc heap held + mmapped")
    verdict = rss_verdict(samples)
    if "rss_at_5min_mb" in verdict:
        ref = verdict["rss_at_5min_mb"]
        ax.axhspan(0.9 * ref, 1.1 * ref, color="green", alpha=0.1, label="±10% of RSS at minute 5")
        ax.axvline(STEADY_AFTER_MIN, color="gray", lw=0.8)
    ax.set_xlabel("minutes")
    ax.set_ylabel("MiB")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def read_memory_log(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def memory_report(memory: list[dict[str, Any]], verdict: dict[str, Any]) -> list[str]:
    lines = [f"RSS verdict (target: within ±10% of minute {STEADY_AFTER_MIN:g} until the end): {verdict}",
             "probe t s  RSS MiB  peak MiB  glibc in use MiB  glibc free MiB  mmapped MiB  arenas  Python traced MiB"]
    for m in memory:
        mi, info = m.get("mallinfo2", {}), m.get("malloc_info", {})
        traced = m.get("tracemalloc", {}).get("traced")
        lines.append(f"{m['t']:9.0f} {m['VmRSS'] / 1024:8.1f} {m['VmHWM'] / 1024:9.1f} "
                     f"{mi.get('uordblks', 0) / 2**20:17.1f} {mi.get('fordblks', 0) / 2**20:15.1f} "
                     f"{mi.get('hblkhd', 0) / 2**20:12.1f} {info.get('heaps', 0):7d} "
                     f"{'' if traced is None else f'{traced / 2**20:.1f}':>18}")
    grown = memory[-1].get("tracemalloc", {}).get("grown_since_first", []) if memory else []
    if grown:
        lines.append("Python allocation sites grown since the first probe (tracemalloc):")
        lines += [f"  {g['bytes'] / 2**20:8.2f} MiB {g['count']:+8d} blocks  {g['site']}" for g in grown]
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_server_run_args(ap, capacity_s=30.0, minutes=(10.0, "length of the soak"),
                        clients=(4, "client channels the arrivals take in turn"),
                        load=(0.7, "offered load / measured capacity"), per_kind=(6, "distinct requests of each kind"),
                        memory_every_s=(60.0, "seconds between memory probes"))
    ap.add_argument("--allocator", choices=list(ALLOCATORS), default="glibc",
                    help="the server's malloc: glibc, or jemalloc / tcmalloc by LD_PRELOAD (default glibc)")
    ap.add_argument("--trim-under-load", action="store_true", help="the worker calls malloc_trim even while busy")
    ap.add_argument("--tracemalloc", type=int, default=0, help="trace Python allocations with N frames (0 = off)")
    ap.add_argument("--server-env", action="append", default=[], metavar="KEY=VALUE",
                    help="more environment for the server, e.g. MALLOC_MMAP_THRESHOLD_=131072 or "
                         "ONEDNN_PRIMITIVE_CACHE_CAPACITY=64 (repeatable)")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    name = variant_name(args)
    memory_log = args.out / f"{name}_memory.jsonl"
    memory_log.unlink(missing_ok=True)

    load_before = os.getloadavg()
    with spawned_server(args.out / f"{name}_server.log", shlex.split(args.server_args), metrics=True,
                        env=server_env(args, memory_log)) as server:
        cap, rate, records, samples = asyncio.run(soak(server.target, server, make_cases(args.per_kind), args))
        exit_code = server.stop()
    memory = read_memory_log(memory_log)
    verdict = rss_verdict(samples)
    result = run_record(name, args, load_before,
                        capacity_rps=round(cap, 3), offered_rps=round(rate, 3), samples=samples, memory=memory,
                        rss_verdict=verdict, server_exit_code=exit_code, **summarize(records, args.minutes))
    write_json(args.out / f"{name}.json", result)
    plot(samples, memory, f"{name}: {args.minutes:g} min, {result['cpu']}", args.out / f"{name}_rss.png")
    write_report(report(result) + "\n".join(memory_report(memory, verdict)), args.out / f"{name}.txt")


if __name__ == "__main__":
    main()
