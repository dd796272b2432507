"""Short gRPC benchmark: starts `python -m server` on a random-weight Qwen3-shaped engine (the hidden `--engine`
flag with bench.gpu.models:RandomEngine), then sends Score requests (token ids, MIS and SIS) at concurrency 1
through pyscore.client and reports p50/p95 latency per candidate count, as the client sees it. The server is
stopped with SIGTERM at the end (graceful stop, exit code recorded).

    python -m bench.gpu.grpc_bench --shape qwen3-0.6b --out grpc.json
    python -m bench.gpu.grpc_bench --tiny --out /tmp/grpc.json
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from pathlib import Path
from typing import Any

from bench.gpu.common import add_run_args, resolve_run_args, summarize
from bench.gpu.models import SHAPES
from bench.gpu.workload import id_questions, labels_for
from bench.summary import write_json

ROOT = Path(__file__).resolve().parents[2]
LISTENING = re.compile(r"pyscore: listening on (\S+):(\d+)")


class Server:
    """`python -m server` in a subprocess; its output is echoed with a prefix and the tail kept for the report."""

    def __init__(self, shape: str, device: str, max_batch_tokens: int) -> None:
        cmd = [sys.executable, "-u", "-m", "server", "--engine", "bench.gpu.models:RandomEngine", "--model", shape,
               "--device", device, "--port", "0", "--max-batch-tokens", str(max_batch_tokens),
               "--log-level", "WARNING", "--grace-s", "5"]
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     env={**os.environ, "PYTHONUNBUFFERED": "1"})
        self.tail: deque[str] = deque(maxlen=40)
        self.port: int | None = None
        self._listening = threading.Event()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.tail.append(line.rstrip())
            print(f"[server] {line.rstrip()}", flush=True)
            m = LISTENING.search(line)
            if m:
                self.port = int(m.group(2))
                self._listening.set()
        self._listening.set()

    def target(self, timeout: float) -> str:
        if not self._listening.wait(timeout) or self.port is None:
            raise RuntimeError(f"the server did not listen within {timeout} s: {list(self.tail)[-5:]}")
        return f"127.0.0.1:{self.port}"

    def stop(self, timeout: float = 30.0) -> int | None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def run(args: argparse.Namespace) -> dict[str, Any]:
    from pyscore.client import ScorerClient

    shape = "tiny" if args.tiny else args.shape
    vocab = SHAPES[shape].vocab
    labels = labels_for(vocab)
    report: dict[str, Any] = dict(shape=shape, device=args.device, requests_per_cell=args.reps, results={},
                                  errors=[])
    t0 = time.perf_counter()
    server = Server(shape, args.device, args.max_batch_tokens)
    try:
        with ScorerClient(server.target(args.ready_timeout_s), timeout=60.0) as client:
            client.wait_ready(timeout=args.ready_timeout_s)
            report["ready_s"] = time.perf_counter() - t0
            info = client.model_info()
            report["model"] = dict(name=info.name, device=info.device, dtype=info.dtype)
            for n in args.candidates:
                questions = id_questions(n, 8, vocab, seed=5, tiny=args.tiny)
                cell: dict[str, Any] = {}
                report["results"][str(n)] = cell
                for mode in args.modes:
                    def call(i: int, mode: str = mode, questions: list = questions) -> None:
                        q = questions[i % len(questions)]
                        client.score(q.query, q.items, label_token_ids=labels, mode=mode)

                    try:
                        for i in range(args.warmup):
                            call(i)
                        times = []
                        for i in range(args.reps):
                            start = time.perf_counter()
                            call(i)
                            times.append((time.perf_counter() - start) * 1e3)
                        cell[mode] = summarize(times)
                    except Exception as e:
                        cell[mode] = dict(error=f"{type(e).__name__}: {e}")
                    write_json(args.out, report)
    except Exception as e:
        report["errors"].append(f"{type(e).__name__}: {e}")
    finally:
        report["server_exit_code"] = server.stop()
        report["server_tail"] = list(server.tail)[-10:]
        report["total_s"] = time.perf_counter() - t0
        write_json(args.out, report)
    return report


def table(report: dict[str, Any]) -> str:
    lines = [f"# gRPC Score at concurrency 1, {report['shape']} on {report.get('model', {}).get('device', '?')}: "
             "client-side ms p50/p95"]
    for n, cell in report["results"].items():
        parts = [f"{m} {s['p50']:.2f}/{s['p95']:.2f}" if "p95" in s else f"{m} {s.get('error')}"
                 for m, s in cell.items()]
        lines.append(f"{n:>3} candidates: " + "   ".join(parts))
    lines.append(f"server exit code {report.get('server_exit_code')}; errors: {report['errors'] or 'none'}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_run_args(p, "requests")
    p.add_argument("--modes", nargs="+", default=["mis", "sis"], choices=["mis", "sis"])
    p.add_argument("--ready-timeout-s", type=float, default=180.0)
    report = run(resolve_run_args(p.parse_args(argv)))
    print(table(report), flush=True)
    return report


if __name__ == "__main__":
    main()
