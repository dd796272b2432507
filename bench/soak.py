"""Soak: mixed Score (SIS, MIS, setwise) and Generate traffic at `--load` (default 70%) of the measured
capacity, from `--clients` clients (each its own channel, Poisson arrivals), for `--minutes` (default 10)
against `python -m server` on the embedded model. Every Score answer is checked against the same request
scored alone beforehand (Generate, greedy, against its text generated alone). Reports requests served,
errors, wrong answers, p95, and the server's memory: RSS every 10 s, and every `--memory-every-s` (60) the
server's own probe (server/memory.py: RSS, glibc's mallinfo2 and malloc_info totals, and with `--tracemalloc`
the Python allocation sites that grew); a PNG of the curves, and whether RSS after minute 5 stayed within
±10% of its minute-5 value. Not a CI test: it produces figures.

Controls, to tell allocator retention from a leak: `--trim-under-load` (the worker calls malloc_trim every
10 s even while busy), `--allocator jemalloc|tcmalloc` (LD_PRELOAD of Debian's libjemalloc2 /
libtcmalloc-minimal4: `apt-get install libjemalloc2 libtcmalloc-minimal4`), `--server-env KEY=VALUE` (e.g. a
fixed MALLOC_MMAP_THRESHOLD_, or ONEDNN_PRIMITIVE_CACHE_CAPACITY; see bench/gemm_shapes_memory.py for why).
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
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from bench.common import REPO, ServerProcess, machine, question, spawn_server
from bench.overload import TOLERANCE, ScoreCase, machine_load, max_diff, ms, score_alone
from bench.summary import write_json, write_report
from pyscore.client import AsyncScorerClient, ScorerClient

MARKER = " ###"  # one token in SmolLM2's vocabulary
ALLOCATORS = {"glibc": None, "jemalloc": "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2",
              "tcmalloc": "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"}
PACKAGES = {"jemalloc": "libjemalloc2", "tcmalloc": "libtcmalloc-minimal4"}
STEADY_AFTER_MIN = 5.0  # the target: RSS after this minute stays within +-10% of its value then
MIX = {"sis": 0.3, "mis": 0.3, "setwise": 0.2, "generate": 0.2}


@dataclass
class GenerateCase:
    name: str
    prompt: str
    options: dict[str, Any]
    alone: str | None = None


Case = ScoreCase | GenerateCase


def make_cases(per_kind: int) -> dict[str, list[Case]]:
    cases: dict[str, list[Case]] = {k: [] for k in MIX}
    for i in range(per_kind):
        query, items = question(3, seed=2000 + i)
        cases["sis"].append(ScoreCase(f"sis-{i}", query, items, dict(labels=[" Yes", " No"], mode="sis")))
        query, items = question(5, seed=3000 + i)
        cases["mis"].append(ScoreCase(f"mis-{i}", query, items, dict(labels=[" Yes", " No"], mode="mis")))
        query, items = question(4, seed=4000 + i, item_words=8)
        answers = [item.split("\n")[0] for item in items]  # "Proposed answer: ..." without the question
        ranked = [f"{a}{MARKER} {b}{MARKER}" for a, b in zip(answers[::2], answers[1::2], strict=True)]
        cases["setwise"].append(ScoreCase(f"setwise-{i}", query.replace("which action", "rank the actions"), ranked,
                                          dict(labels=[" Yes", " No"], score_extraction_token=MARKER)))
        cases["generate"].append(GenerateCase(f"generate-{i}", f"Customer {i}: where is my order? Agent:",
                                              dict(max_tokens=8, temperature=0.0)))
    return cases


def generate_alone(target: str, cases: list[Case]) -> None:
    with ScorerClient(target, timeout=120) as client:
        for case in cases:
            assert isinstance(case, GenerateCase)
            case.alone = client.generate(case.prompt, **case.options).text


@dataclass
class Outcome:
    kind: str
    sent: float
    latency: float
    status: str
    wrong: bool = False
    diff: float = 0.0


async def call(client: AsyncScorerClient, kind: str, case: Case, start: float) -> Outcome:
    sent = time.perf_counter() - start
    try:
        if isinstance(case, ScoreCase):
            got = await client.score(case.query, case.items, **case.options)
            assert case.alone is not None
            diff = max_diff(got, case.alone)
            return Outcome(kind, sent, time.perf_counter() - start - sent, "OK", diff > TOLERANCE, diff)
        text = (await client.generate(case.prompt, **case.options)).text
        return Outcome(kind, sent, time.perf_counter() - start - sent, "OK", text != case.alone)
    except grpc.RpcError as e:
        return Outcome(kind, sent, time.perf_counter() - start - sent, e.code().name)


def pick(rng: random.Random, cases: dict[str, list[Case]]) -> tuple[str, Case]:
    kind = rng.choices(list(MIX), weights=list(MIX.values()))[0]
    return kind, rng.choice(cases[kind])


async def capacity(target: str, cases: dict[str, list[Case]], concurrency: int, seconds: float) -> float:
    """Requests of the mix per second with `concurrency` closed-loop callers."""
    rng = random.Random(1)
    done, stop = 0, time.perf_counter() + seconds

    async def caller(client: AsyncScorerClient) -> None:
        nonlocal done
        while time.perf_counter() < stop:
            kind, case = pick(rng, cases)
            outcome = await call(client, kind, case, time.perf_counter())
            done += outcome.status == "OK"

    t0 = time.perf_counter()
    async with AsyncScorerClient(target, timeout=120) as client:
        await asyncio.gather(*(caller(client) for _ in range(concurrency)))
    return done / (time.perf_counter() - t0)


async def soak(server: ServerProcess, cases: dict[str, list[Case]], rate: float, clients: int, seconds: float,
               sample_s: float = 10.0) -> tuple[list[Outcome], list[dict[str, Any]]]:
    outcomes: list[Outcome] = []
    samples: list[dict[str, Any]] = []
    start = time.perf_counter()

    async def client_loop(k: int) -> None:
        rng = random.Random(100 + k)
        tasks = []
        async with AsyncScorerClient(server.target, timeout=120) as client:
            t = 0.0
            while True:
                t += rng.expovariate(rate / clients)
                if t >= seconds:
                    break
                await asyncio.sleep(max(0.0, start + t - time.perf_counter()))
                kind, case = pick(rng, cases)
                tasks.append(asyncio.ensure_future(call(client, kind, case, start)))
            outcomes.extend(await asyncio.gather(*tasks))

    async def sampler() -> None:
        cpu, t = server.cpu_s(), time.perf_counter()
        while time.perf_counter() - start < seconds:
            await asyncio.sleep(sample_s)
            cores = (server.cpu_s() - cpu) / (time.perf_counter() - t)  # the server's CPU use since the last sample
            cpu, t = server.cpu_s(), time.perf_counter()
            samples.append(dict(t=round(t - start), rss_mb=round(server.rss_mb(), 1), server_cores=round(cores, 2),
                                loadavg_1m=round(os.getloadavg()[0], 2),
                                queue=await asyncio.to_thread(server.queue_depth)))

    samples.append(dict(t=0, rss_mb=round(server.rss_mb(), 1), server_cores=0.0,
                        loadavg_1m=round(os.getloadavg()[0], 2), queue=server.queue_depth()))
    sampling = asyncio.ensure_future(sampler())
    await asyncio.gather(*(client_loop(k) for k in range(clients)))
    sampling.cancel()
    samples.append(dict(t=round(time.perf_counter() - start), rss_mb=round(server.rss_mb(), 1), server_cores=None,
                        loadavg_1m=round(os.getloadavg()[0], 2), queue=server.queue_depth()))
    return outcomes, samples


def summarize(outcomes: list[Outcome], minutes: float) -> dict[str, Any]:
    ok = [o for o in outcomes if o.status == "OK"]
    errors: dict[str, int] = {}
    for o in outcomes:
        if o.status != "OK":
            errors[o.status] = errors.get(o.status, 0) + 1
    per_kind = {k: dict(served=sum(o.kind == k for o in ok), wrong=sum(o.wrong for o in ok if o.kind == k),
                        latency_ms=ms([o.latency for o in ok if o.kind == k])) for k in MIX}
    per_minute = []
    for m in range(int(-(-minutes // 1))):
        window = [o for o in outcomes if m * 60 <= o.sent < (m + 1) * 60]
        served = [o for o in window if o.status == "OK"]
        per_minute.append(dict(minute=m + 1, sent=len(window), served=len(served),
                               errors=len(window) - len(served), wrong=sum(o.wrong for o in served),
                               p95_ms=ms([o.latency for o in served])["p95"]))
    score_ok = [o for o in ok if o.kind != "generate"]
    return dict(sent=len(outcomes), served=len(ok), errors=errors,
                wrong_scores=sum(o.wrong for o in score_ok),
                generate_text_mismatches=sum(o.wrong for o in ok if o.kind == "generate"),
                max_abs_score_diff=max((o.diff for o in score_ok), default=0.0),
                latency_ms=ms([o.latency for o in ok]), per_kind=per_kind, per_minute=per_minute)


def report(r: dict[str, Any]) -> str:
    c = r["config"]
    lines = [
        f"# {r['run']} {r['when']} | {r['cpu']}: {c['minutes']} min, {c['clients']} clients, "
        f"{c['load']:.0%} of capacity; load average before {r['machine']['before']['loadavg']}, "
        f"{r['machine']['before']['cpus']} CPUs",
        f"mix {MIX}; capacity (closed loop, 4 callers) {r['capacity_rps']} req/s -> offered {r['offered_rps']} req/s",
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
        *(f"{s['t']:4d} {s['rss_mb']:8.1f} {s['server_cores'] if s['server_cores'] is not None else '':>13} "
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
    ap.add_argument("--minutes", type=float, default=10.0, help="length of the soak (default 10)")
    ap.add_argument("--clients", type=int, default=4, help="clients, each with its own channel (default 4)")
    ap.add_argument("--load", type=float, default=0.7, help="offered load / measured capacity (default 0.7)")
    ap.add_argument("--per-kind", type=int, default=6, help="distinct requests of each kind (default 6)")
    ap.add_argument("--capacity-s", type=float, default=30.0, help="seconds of the capacity measurement")
    ap.add_argument("--server-args", default="", help='more `python -m server` flags, e.g. "--threads 1"')
    ap.add_argument("--allocator", choices=list(ALLOCATORS), default="glibc",
                    help="the server's malloc: glibc, or jemalloc / tcmalloc by LD_PRELOAD (default glibc)")
    ap.add_argument("--trim-under-load", action="store_true", help="the worker calls malloc_trim even while busy")
    ap.add_argument("--tracemalloc", type=int, default=0, help="trace Python allocations with N frames (0 = off)")
    ap.add_argument("--memory-every-s", type=float, default=60.0, help="seconds between memory probes (default 60)")
    ap.add_argument("--server-env", action="append", default=[], metavar="KEY=VALUE",
                    help="more environment for the server, e.g. MALLOC_MMAP_THRESHOLD_=131072 or "
                         "ONEDNN_PRIMITIVE_CACHE_CAPACITY=64 (repeatable)")
    ap.add_argument("--name", help="name of the result files (default: from the variant)")
    ap.add_argument("--out", type=Path, default=REPO / "bench/results/hardening")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    name = variant_name(args)
    memory_log = args.out / f"{name}_memory.jsonl"
    memory_log.unlink(missing_ok=True)

    load_before = machine_load()
    server = spawn_server(*shlex.split(args.server_args), log=args.out / f"{name}_server.log", metrics=True,
                          env=server_env(args, memory_log))
    try:
        cases = make_cases(args.per_kind)
        score_alone(server.target, [c for k in ("sis", "mis", "setwise") for c in cases[k]])  # type: ignore[misc]
        generate_alone(server.target, cases["generate"])
        cap = asyncio.run(capacity(server.target, cases, 4, args.capacity_s))
        rate = args.load * cap
        print(f"capacity {cap:.2f} req/s of the mix; offering {rate:.2f} req/s for {args.minutes} min", flush=True)
        outcomes, samples = asyncio.run(soak(server, cases, rate, args.clients, args.minutes * 60))
        exit_code = server.stop()
    finally:
        if server.proc.poll() is None:
            server.proc.kill()
    memory = read_memory_log(memory_log)
    verdict = rss_verdict(samples)
    result = dict(run=name, when=time.strftime("%Y-%m-%d %H:%M:%S"), cpu=machine(),
                  machine=dict(before=load_before, after=machine_load()), config=dict(vars(args), out=str(args.out)),
                  capacity_rps=round(cap, 3), offered_rps=round(rate, 3), samples=samples, memory=memory,
                  rss_verdict=verdict, server_exit_code=exit_code, **summarize(outcomes, args.minutes))
    write_json(args.out / f"{name}.json", result)
    plot(samples, memory, f"{name}: {args.minutes:g} min, {result['cpu']}", args.out / f"{name}_rss.png")
    write_report(report(result) + "\n".join(memory_report(memory, verdict)), args.out / f"{name}.txt")


if __name__ == "__main__":
    main()
