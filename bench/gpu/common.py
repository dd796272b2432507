"""What the GPU benchmarks share: device synchronisation, timing (CUDA events on the GPU, the host clock on the
CPU), summaries (bench.summary's percentile) and the measured H200 ceilings. The benchmarks write their JSON with
bench.summary.write_json (atomic) after every step, so a stage killed by its timeout still leaves what it
measured."""

from __future__ import annotations

import argparse
import os
import platform
import time
from collections.abc import Callable
from typing import Any

import torch

from bench.common import cpu, elapsed_ms
from bench.summary import Summary, write_json

# Measured on this workplace's H200s (.library/device/KINDS.md, 2026-10-28 and 2026-11-04): bf16 8192^3 matmul
# on random data, and a device-to-device copy counting bytes read plus written. Floors below use these.
H200_BF16_FLOPS = 788e12
H200_BYTES_PER_S = 4.3e12


def sync(device: torch.device | str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def summarize(times_ms: list[float]) -> dict[str, Any]:
    """n, p50, p95, mean, min, max (bench.summary's percentile) and every time."""
    s = Summary.of(times_ms)
    return dict(n=s.count, p50=s.p50, p95=s.p95, mean=s.mean, min=s.min, max=s.max, all=[round(t, 4) for t in times_ms])


def wall_ms(fn: Callable[[], object], device: torch.device | str) -> float:
    """Host time of one call with the device synchronised on both sides (what a caller waits for)."""
    sync(device)
    return elapsed_ms(lambda: (fn(), sync(device)))


def device_ms(fn: Callable[[], object], device: torch.device | str, reps: int, warmup: int = 3) -> list[float]:
    """Per-call times: CUDA events around each call on the GPU, the host clock on the CPU."""
    for _ in range(warmup):
        fn()
    if torch.device(device).type != "cuda":
        return [wall_ms(fn, device) for _ in range(reps)]
    out = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        out.append(start.elapsed_time(end))
    return out


def environment(device: torch.device | str) -> dict[str, Any]:
    from pyscore.ops import _ext

    env: dict[str, Any] = dict(python=platform.python_version(), torch=torch.__version__,
                               torch_cuda=torch.version.cuda, cpu=cpu(),
                               cpu_count=os.cpu_count(), device=str(device),
                               cpu_kernels=_ext.cpu_module() is not None, cuda_kernels=_ext.cuda_module() is not None,
                               cuda_kernels_error=_ext.import_error(_ext.CUDA_MODULE))
    if torch.device(device).type == "cuda":
        props = torch.cuda.get_device_properties(torch.device(device))
        env.update(gpu=props.name, sms=props.multi_processor_count, gpu_mem_gib=round(props.total_memory / 2**30, 1))
    return env


def add_run_args(p: argparse.ArgumentParser, what: str) -> None:
    """The options the engine and gRPC benchmarks share (shape, size, device, repetitions, output)."""
    from bench.gpu.models import SHAPES
    from bench.gpu.workload import CANDIDATE_COUNTS

    p.add_argument("--shape", default="qwen3-0.6b", choices=sorted(SHAPES))
    p.add_argument("--tiny", action="store_true", help="tiny shape and lengths on the CPU (plumbing tests)")
    p.add_argument("--device", default=None, help="auto | cpu | cuda (default: cpu with --tiny, else auto)")
    p.add_argument("--candidates", type=int, nargs="+", default=list(CANDIDATE_COUNTS))
    p.add_argument("--reps", type=int, default=None, help=f"timed {what} per cell (default 40; 3 with --tiny)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--max-batch-tokens", type=int, default=8192)
    p.add_argument("--out", required=True)


def resolve_run_args(args: argparse.Namespace) -> argparse.Namespace:
    args.device = args.device or ("cpu" if args.tiny else "auto")
    args.reps = args.reps or (3 if args.tiny else 40)
    if args.tiny:
        args.warmup = min(args.warmup, 1)
    return args


def record(report: dict[str, Any], out: str, key: str, what: str, fn: Callable[..., Any], *args: Any,
           **kwargs: Any) -> None:
    """Appends fn(*args, **kwargs) to report[key], or `what: error` to report["errors"] when it raises, then writes
    the JSON: one failing case does not cost the others, and a stage killed by its timeout keeps what it measured."""
    try:
        report[key].append(fn(*args, **kwargs))
    except Exception as e:
        report["errors"].append(f"{what}: {type(e).__name__}: {e}")
    write_json(out, report)


def cli(report: dict[str, Any], out: str, table: Callable[[dict[str, Any]], str]) -> dict[str, Any]:
    """How every GPU benchmark ends: the final JSON written, its table printed, the report returned (to tests)."""
    write_json(out, report)
    print(table(report), flush=True)
    return report


class Budget:
    """A soft wall-clock budget: benchmarks check `left()` before each step and record what they skipped."""

    def __init__(self, seconds: float) -> None:
        self.deadline = time.monotonic() + seconds

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def exhausted(self) -> bool:
        return self.left() <= 0
