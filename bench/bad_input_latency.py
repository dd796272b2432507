"""Issue 23's latency targets under hostile input, on the make-serve server (SmolLM2, default flags, --threads 2):
a 1 MB body of 0xFF bytes is answered INVALID_ARGUMENT in < 50 ms, and Health stays < 100 ms p99 while the whole
bad-input matrix (bench/hostile_input.py's CASES, which tests/server/test_hostile_input.py sends too: the inputs
that used to hold the event loop or blow up error messages) is sent, round after round, through a default-settings
client. Percentiles: bench.summary's.
Run it alone (under the machine lock): `python -m bench.bad_input_latency --out
bench/results/hardening/bad_input_latency.txt` (the record; without --out, bench/results/latest/)."""

from __future__ import annotations

import argparse
import shlex
import time
from pathlib import Path

import grpc

from bench.common import cpu, git_commit, spawned_server
from bench.hostile_input import CASES, HealthProbe, raw_call
from bench.summary import Summary, default_out, write_report

FF_TARGET_MS, HEALTH_P99_TARGET_MS = 50.0, 100.0


def timed_refusal(channel: grpc.Channel, method: str, payload: bytes) -> tuple[float, grpc.StatusCode]:
    start = time.monotonic()
    try:
        raw_call(channel, method)(payload, timeout=60)
    except grpc.RpcError as e:
        return (time.monotonic() - start) * 1e3, e.code()
    raise AssertionError(f"{method} accepted a bad input")


def expected(code: grpc.StatusCode, payload: bytes, limit_mb: int) -> grpc.StatusCode:
    """A case's status at this server's --max-message-mb: gRPC refuses a larger message unread."""
    return grpc.StatusCode.RESOURCE_EXHAUSTED if len(payload) > limit_mb * 2**20 else code


def run(target: str, ff_calls: int, rounds: int, limit_mb: int) -> list[str]:
    lines = []
    with grpc.insecure_channel(target) as channel:  # default settings
        ff = [timed_refusal(channel, "Score", b"\xff" * 2**20) for _ in range(ff_calls)]
        codes = {code.name for _, code in ff}
        s = Summary.of([ms for ms, _ in ff])
        lines.append(f"1 MB of 0xFF, Score, {s.count} calls one after another: {'/'.join(sorted(codes))}; "
                     f"p50 {s.p50:.1f} ms, p95 {s.p95:.1f} ms, p99 {s.p99:.1f} ms, max {s.max:.1f} ms "
                     f"(target < {FF_TARGET_MS:g} ms: {'met' if s.max < FF_TARGET_MS else 'MISSED'})")
        per_case: dict[str, tuple[list[float], list[float]]] = {}  # name: (refusal ms, Health ms during it)
        wrong = []
        for name, method, payload, code, _ in CASES:  # a probe per case: which input slows Health, if any
            refusals: list[float] = []
            with HealthProbe(target) as probe:
                for _ in range(rounds):
                    ms, got = timed_refusal(channel, method, payload)
                    refusals.append(ms)
                    if got != expected(code, payload, limit_mb):
                        wrong.append(f"{name}: {got.name}, expected {expected(code, payload, limit_mb).name}")
                time.sleep(0.05)
            per_case[name] = (refusals, [x * 1e3 for x in probe.latencies])
    h = Summary.of([x for _, health in per_case.values() for x in health])
    lines.append(f"Health, checked back to back (10 ms apart) on its own channel while each case of the "
                 f"{len(CASES)}-case matrix is sent {rounds} times: {h.count} checks, p50 {h.p50:.1f} ms, "
                 f"p99 {h.p99:.1f} ms, max {h.max:.1f} ms (target p99 < {HEALTH_P99_TARGET_MS:g} ms: "
                 f"{'met' if h.p99 < HEALTH_P99_TARGET_MS else 'MISSED'})")
    lines.append(f"statuses: {'all as intended' if not wrong else '; '.join(wrong)}")
    lines.append("per case: the client's time to its refusal (max over the rounds; includes sending the body) and "
                 "Health's max while it was sent")
    lines += [f"  refused {max(r):8.1f} ms  health max {max(hs, default=float('nan')):7.1f} ms  {name}"
              for name, (r, hs) in per_case.items()]
    return lines


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ff-calls", type=int, default=50)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", type=Path, default=default_out("bad_input_latency.txt"))
    p.add_argument("--max-message-mb", type=int, default=8, help="the server's --max-message-mb")
    p.add_argument("--server-flags", default="", help="more flags for the server, one string")
    p.add_argument("--log", type=Path, default=Path("/tmp/pyscore-bad-input/server.log"))
    a = p.parse_args()
    header = [f"# bench.bad_input_latency (issue 23): cpu {cpu()}; commit {git_commit()}; SmolLM2-135M-Instruct, "
              f"flags --threads 2 --max-message-mb {a.max_message_mb} {a.server_flags}; a default-settings Python "
              f"client on loopback; cases over the message limit expect RESOURCE_EXHAUSTED"]
    flags = ["--threads", "2", "--max-message-mb", str(a.max_message_mb), *shlex.split(a.server_flags)]
    with spawned_server(a.log, flags) as server:
        lines = run(server.target, a.ff_calls, a.rounds, a.max_message_mb)
    write_report(header + lines, a.out)


if __name__ == "__main__":
    main()
