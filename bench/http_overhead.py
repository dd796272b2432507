"""What HTTP adds per call over gRPC, on one server: `python -m bench.http_overhead` starts `python -m server
--http-port 0` (or takes a running server's --grpc and --http addresses) and, at each concurrency, asks the same
16-candidate questions along one path (default MIS) in alternating blocks — gRPC, HTTP, HTTP, gRPC, ... — through
bench's GrpcTarget and PyscoreHTTPTarget (the same requests, as protobuf or as JSON). It reports per transport the
p50 / p95 time to decision and the server-side compute p50, and the overhead as the median over block pairs of
HTTP p50 − gRPC p50, with the CPU it ran on. Run it alone on the machine: it is a
difference of two noisy numbers."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.common import machine, spawned_server
from bench.dataset import Dataset, Question
from bench.loadgen import closed_loop
from bench.summary import percentile, write_json, write_report
from bench.targets import GrpcTarget, PyscoreHTTPTarget, Target


def block_ms(records: Sequence[Any]) -> tuple[list[float], list[float]]:
    """Times to decision and server compute times (ms) of a block's answered questions."""
    ok = [r for r in records if r.ok]
    return [(r.completed - r.dispatched) * 1e3 for r in ok], [r.server_compute_ms or 0.0 for r in ok]


async def measure(targets: dict[str, Target], path: str, questions: list[Question], concurrency: int,
                  blocks: int, warmup: int) -> dict[str, Any]:
    """`blocks` blocks per transport, the order alternating (ABBA) so that drift hits both alike."""
    latencies: dict[str, list[float]] = {name: [] for name in targets}
    compute: dict[str, list[float]] = {name: [] for name in targets}
    p50s: dict[str, list[float]] = {name: [] for name in targets}
    errors = {name: 0 for name in targets}
    for target in targets.values():
        await closed_loop(target, path, questions[:warmup] or questions[:1], concurrency)
    names = list(targets)
    for block in range(blocks):
        for name in names if block % 2 == 0 else names[::-1]:
            run = await closed_loop(targets[name], path, questions, concurrency)
            times, server = block_ms(run.records)
            errors[name] += len(run.records) - len(times)
            latencies[name] += times
            compute[name] += server
            p50s[name].append(percentile(times, 50) if times else float("nan"))
    result = {name: {"p50_ms": percentile(latencies[name], 50), "p95_ms": percentile(latencies[name], 95),
                     "server_compute_p50_ms": percentile(compute[name], 50), "block_p50_ms": p50s[name],
                     "questions": len(latencies[name]), "errors": errors[name]} for name in names}
    result["http_minus_grpc_p50_ms"] = statistics.median(h - g for h, g in zip(p50s["http"], p50s["grpc"],
                                                                                 strict=True))
    return result


async def run(grpc_address: str, http_address: str, a: argparse.Namespace) -> dict[str, Any]:
    questions = [q for q in Dataset.synthetic(a.pool, seed=a.seed).questions
                 if q.num_candidates == a.candidates][: a.questions]
    if not questions:
        raise SystemExit(f"no synthetic question has {a.candidates} candidates (candidate counts: 2, 5, 9, 16)")
    targets: dict[str, Target] = {"grpc": GrpcTarget(grpc_address, prefix_cache=a.prefix_cache),
                                  "http": PyscoreHTTPTarget(f"http://{http_address}", prefix_cache=a.prefix_cache)}
    for target in targets.values():
        await target.open()
    try:
        return {f"c={c}": await measure(targets, a.path, questions, c, a.blocks, a.warmup) for c in a.concurrency}
    finally:
        for target in targets.values():
            await target.close()


def report(results: dict[str, Any], a: argparse.Namespace) -> list[str]:
    lines = [f"# HTTP vs gRPC per call: {a.path}, {a.candidates} candidates, {a.questions} questions per block, "
             f"{a.blocks} blocks per transport (alternating)", f"machine: {machine()}", "",
             "| load | gRPC p50 ms | HTTP p50 ms | HTTP − gRPC p50 ms | gRPC p95 ms | HTTP p95 ms | "
             "server compute p50 ms (gRPC / HTTP) | errors |",
             "|---|---|---|---|---|---|---|---|"]
    for load, r in results.items():
        g, h = r["grpc"], r["http"]
        lines.append(f"| {load} | {g['p50_ms']:.1f} | {h['p50_ms']:.1f} | {r['http_minus_grpc_p50_ms']:+.2f} | "
                     f"{g['p95_ms']:.1f} | {h['p95_ms']:.1f} | {g['server_compute_p50_ms']:.1f} / "
                     f"{h['server_compute_p50_ms']:.1f} | {g['errors'] + h['errors']} |")
    return lines


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.http_overhead", description=__doc__.split("\n\n")[0])
    p.add_argument("--grpc", default=None, help="HOST:PORT of a running server (default: start one)")
    p.add_argument("--http", default=None, help="HOST:PORT of that server's --http-port")
    p.add_argument("--server-arg", action="append", default=[], help="extra flag for the started server")
    p.add_argument("--path", default="mis", choices=("mis", "sis", "setwise", "generate", "fused"))
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    p.add_argument("--candidates", type=int, default=16)
    p.add_argument("--questions", type=int, default=16, help="questions per block (default %(default)s)")
    p.add_argument("--blocks", type=int, default=4, help="blocks per transport (default %(default)s)")
    p.add_argument("--warmup", type=int, default=4, help="questions per transport before timing")
    p.add_argument("--pool", type=int, default=256, help="synthetic questions to draw from")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--prefix-cache", default="dispatch", choices=("dispatch", "shared", "off"))
    p.add_argument("--out", default="bench/results/http_overhead", help="writes OUT.txt and OUT.json")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> None:
    a = parse_args(argv)
    out = Path(a.out)
    with contextlib.ExitStack() as stack:
        grpc_address, http_address = a.grpc, a.http
        if grpc_address is None:
            server = stack.enter_context(spawned_server(out.with_suffix(".server.log"),
                                                        ["--http-port", "0", *a.server_arg]))
            grpc_address, http_address = server.target, f"127.0.0.1:{server.http_port}"
        if http_address is None:
            raise SystemExit("--http goes with --grpc")
        results = asyncio.run(run(grpc_address, http_address, a))
    write_json(out.with_suffix(".json"), {"machine": machine(), "args": vars(a), "results": results})
    write_report(report(results, a), out.with_suffix(".txt"))


if __name__ == "__main__":
    main()
