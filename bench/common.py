"""What every benchmark shares: where it ran (`machine`, `machine_info`, `git_commit`), a server of our own
(`spawn_server`, `spawned_server`) and its samples under load (`sampled`), the synthetic decision question
(`question`), and the timers: `elapsed_ms` (the host clock, a GPU
synchronised around the call), `device_ms` (CUDA events on a GPU), `median_ms` and `alternate`, the one alternation
(contenders timed in turn, round after round, so the machine's drift hits each alike)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import platform
import random
import re
import subprocess
import sys
import time
import urllib.request
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from bench import dataset
from bench.summary import percentile

REPO = Path(__file__).resolve().parent.parent
T = TypeVar("T")


# --- where it ran ------------------------------------------------------------------------------------------------
# (vendor, family, first model, last model, microarchitecture): the server parts these benchmarks meet.
MICROARCHS = [
    ("AuthenticAMD", 23, 0x00, 0x2F, "Zen/Zen+"), ("AuthenticAMD", 23, 0x30, 0xFF, "Zen 2"),
    ("AuthenticAMD", 25, 0x00, 0x0F, "Zen 3"), ("AuthenticAMD", 25, 0x10, 0x1F, "Zen 4"),
    ("AuthenticAMD", 25, 0x20, 0x5F, "Zen 3"), ("AuthenticAMD", 25, 0x60, 0x7F, "Zen 4"),
    ("AuthenticAMD", 25, 0xA0, 0xAF, "Zen 4c"), ("AuthenticAMD", 26, 0x00, 0xFF, "Zen 5"),
    ("GenuineIntel", 6, 85, 85, "Skylake-SP/Cascade Lake"), ("GenuineIntel", 6, 106, 106, "Ice Lake-SP"),
    ("GenuineIntel", 6, 143, 143, "Sapphire Rapids"), ("GenuineIntel", 6, 207, 207, "Emerald Rapids"),
    ("GenuineIntel", 6, 173, 173, "Granite Rapids"),
]


def lscpu() -> dict[str, str]:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True,
                             env={**os.environ, "LC_ALL": "C"}).stdout
    except (OSError, subprocess.CalledProcessError):
        return {}
    return {k.strip(): v.strip() for k, _, v in (line.partition(":") for line in out.splitlines()) if v}


def cpu() -> str:
    """lscpu's model name with the CPU family/model and, where known, the microarchitecture, e.g.
    "AMD EPYC (family 25 model 17, Zen 4)"."""
    info = lscpu()
    name = info.get("Model name") or platform.processor() or platform.machine()
    if "CPU family" not in info or "Model" not in info:
        return name
    family, model = int(info["CPU family"]), int(info["Model"])
    arch = next((a for vendor, f, lo, hi, a in MICROARCHS
                 if vendor == info.get("Vendor ID") and f == family and lo <= model <= hi), None)
    return f"{name} (family {family} model {model}{', ' + arch if arch else ''})"


def matrix_engine() -> str:
    """'AMX' where the CPU has Intel's AMX-BF16 tiles, else 'no AMX' (what decides the fastest CPU GEMM path)."""
    return "AMX" if "amx_bf16" in lscpu().get("Flags", "").split() else "no AMX"


def machine() -> str:
    """One line for a report: the CPU (see `cpu`), its core count, whether it has a matrix engine and its L3 as
    lscpu reports it (under KVM the family/model may be the host's choice: the L3 tells Xeons apart)."""
    l3 = lscpu().get("L3 cache", "").split(" (")[0]
    return f"{cpu()}, {os.cpu_count()} cores, {matrix_engine()}{f', L3 {l3}' if l3 else ''}"


def gpus() -> list[str]:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=10, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [line.strip() for line in out.splitlines() if line.strip()]


def machine_info() -> dict[str, Any]:
    """The machine as JSON fields: CPU, cores, GPUs, OS, Python."""
    return {"cpu": cpu(), "cores": os.cpu_count(), "matrix_engine": matrix_engine(), "gpu": gpus() or None,
            "platform": platform.platform(), "python": platform.python_version()}


def git_commit(tree: Path = REPO) -> str | None:
    """HEAD, with '+dirty' when the work tree's tracked files differ from it (numbers of uncommitted code)."""
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=tree, capture_output=True, text=True,
                              check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=tree,
                               capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None
    return head + ("+dirty" if dirty else "")


# --- a server of our own -----------------------------------------------------------------------------------------
SERVING = re.compile(r"pyscore: serving .* on (\S+)")
METRICS = re.compile(r"pyscore: metrics on \S+:(\d+)")
HTTP = re.compile(r"pyscore: HTTP on \S+:(\d+)")


@dataclass
class ServerProcess:
    proc: subprocess.Popen[bytes]
    target: str  # host:port
    metrics_port: int | None
    log: Path  # the server's stdout and stderr
    http_port: int | None = None  # the HTTP front door's port, when started with --http-port

    def rss_mb(self) -> float:
        return rss_mb(self.proc.pid)

    def cpu_s(self) -> float:
        """CPU seconds the server process has used (user + system, all threads)."""
        fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def queue_depth(self) -> float:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5) as r:
            for line in r.read().decode().splitlines():
                if line.startswith("pyscore_queue_depth "):
                    return float(line.split()[1])
        return float("nan")

    def stop(self, timeout_s: float = 60.0) -> int:
        """SIGTERM (graceful stop); SIGKILL after timeout_s. Returns the exit code."""
        self.proc.terminate()
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()


def spawn_server(*flags: str, log: Path, metrics: bool = False, timeout_s: float = 180.0,
                 env: dict[str, str] | None = None) -> ServerProcess:
    """`python -m server --port 0 ...` in a subprocess, returned once it prints that it is serving (its output
    goes to `log`: per-request lines would otherwise fill a pipe nobody reads; `env` adds to its environment)."""
    log.parent.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "server", "--port", "0", "--log-level", "WARNING",
           *(["--metrics-port", "0"] if metrics else []), *flags]
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=out, stderr=subprocess.STDOUT,
                                env={**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1", **(env or {})})
    deadline = time.monotonic() + timeout_s
    while True:
        text = log.read_text()
        serving = SERVING.search(text)
        if serving:
            port, http = METRICS.search(text), HTTP.search(text)
            return ServerProcess(proc, serving.group(1), int(port.group(1)) if port else None, log,
                                 int(http.group(1)) if http else None)
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited ({proc.returncode}) before serving:\n{text[-2000:]}")
        if time.monotonic() > deadline:
            proc.kill()
            raise TimeoutError(f"the server did not serve within {timeout_s} s; see {log}")
        time.sleep(0.2)


@contextlib.contextmanager
def spawned_server(log: Path, flags: Sequence[str] = (), **kwargs: Any) -> Iterator[ServerProcess]:
    """spawn_server as a context: the server is stopped (gracefully, else killed) on the way out."""
    server = spawn_server(*flags, log=log, **kwargs)
    try:
        yield server
    finally:
        if server.proc.poll() is None:
            server.stop(30.0)


async def sample_server(server: ServerProcess, every_s: float, stop: asyncio.Event) -> list[dict[str, Any]]:
    """Every `every_s` seconds until `stop` is set (and once more then): t (s), the server's RSS (MiB), the
    cores it used since the last sample (fewer than it has: something else took CPU), the 1-minute load
    average and its queue depth (its metrics endpoint)."""
    samples: list[dict[str, Any]] = []
    start = last = time.perf_counter()
    cpu = server.cpu_s()
    while True:
        now, used = time.perf_counter(), server.cpu_s()
        samples.append(dict(t=round(now - start, 2), rss_mb=round(server.rss_mb(), 1),
                            server_cores=round((used - cpu) / (now - last), 2) if now > last else None,
                            loadavg_1m=round(os.getloadavg()[0], 2),
                            queue=await asyncio.to_thread(server.queue_depth)))
        cpu, last = used, now
        if stop.is_set():
            return samples
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), every_s)


async def sampled(server: ServerProcess, every_s: float, load: Awaitable[T]) -> tuple[T, list[dict[str, Any]]]:
    """Awaits `load` (e.g. an open loop) while sample_server runs beside it; returns both results."""
    stop = asyncio.Event()
    sampler = asyncio.ensure_future(sample_server(server, every_s, stop))
    try:
        result = await load
    finally:
        stop.set()
    return result, await sampler


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


# --- the synthetic question --------------------------------------------------------------------------------------
WORDS = dataset.WORDS[:35]  # the synthetic dataset's first 35 words: the seeded questions depend on this list


def sentence(rng: random.Random, n: int) -> str:
    """`n` seeded words of WORDS, capitalised, with a full stop."""
    return " ".join(rng.choice(WORDS) for _ in range(n)).capitalize() + "."


def question(num_items: int, seed: int = 0, query_words: int = 228, item_words: int = 14) -> tuple[str, list[str]]:
    """A seeded decision question shaped like the Open-Jev pointwise workload: a ~270-token query (context +
    question) and `num_items` candidate items of ~30 tokens, each asking for a Yes/No judgement."""
    rng = random.Random(seed)
    state = " ".join(sentence(rng, 12) for _ in range(query_words // 12))
    query = f"Context:\n{state}\n\nQuestion: which action should the agent take next?\n"
    items = [f"Proposed answer: {sentence(rng, item_words)}\nIs this proposed answer correct? Answer Yes or No."
             for _ in range(num_items)]
    return query, items


# --- timing ------------------------------------------------------------------------------------------------------
def synchronize(device: Any = None) -> None:
    """Waits for the GPU's queued work when `device` is a CUDA device (torch is imported only then)."""
    if device is not None and "cuda" in str(device):
        import torch

        torch.cuda.synchronize()


# Per forced tier, torch's own settings for the same ISA (read once, when torch starts).
TORCH_ISA_ENV = {
    "avx2": {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"},
    "avx512": {"ATEN_CPU_CAPABILITY": "avx512", "ONEDNN_MAX_CPU_ISA": "AVX512_CORE",
               "MKL_ENABLE_INSTRUCTIONS": "AVX512"},
    "generic": {"ATEN_CPU_CAPABILITY": "default", "ONEDNN_MAX_CPU_ISA": "SSE41", "MKL_ENABLE_INSTRUCTIONS": "SSE4_2"},
}


def force_isa(module: str, tier: str | None, torch_isa: str | None = None) -> None:
    """PYSCORE_CPU_TIER for our kernels (read at each call) and torch's settings for the same ISA (or `torch_isa`'s),
    which torch reads only when it starts: re-executes `python -m module` once with them set, so that torch's own
    ops (stock transformers' included) run as on a CPU of that tier."""
    if tier:
        os.environ["PYSCORE_CPU_TIER"] = tier
    wanted = TORCH_ISA_ENV.get(torch_isa or tier or "", {})
    if any(os.environ.get(k) != v for k, v in wanted.items()):
        os.environ.update(wanted)
        os.execv(sys.executable, [sys.executable, "-m", module, *sys.argv[1:]])


def elapsed_ms(fn: Callable[[], object], device: Any = None) -> float:
    """Host wall time of one fn() call in ms (the one timer of bench/'s in-process benchmarks); on a CUDA `device`
    synchronised on both sides, so it is what a caller waits for."""
    synchronize(device)
    t0 = time.perf_counter()
    fn()
    synchronize(device)
    return (time.perf_counter() - t0) * 1e3


def device_ms(fn: Callable[[], object], device: Any, reps: int, warmup: int = 3) -> list[float]:
    """Per-call times in ms after `warmup` calls: CUDA events around each call on a GPU (device time, without the
    host's sync), `elapsed_ms` elsewhere."""
    for _ in range(warmup):
        fn()
    if "cuda" not in str(device):
        return [elapsed_ms(fn) for _ in range(reps)]
    import torch

    out = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        out.append(start.elapsed_time(end))
    return out


def device_info(device: Any) -> dict[str, Any]:
    """A GPU-capable benchmark's environment: the machine, torch and its CUDA, which kernel modules loaded (and why
    not) and, on a GPU, its name, SMs and memory."""
    import torch

    from pyscore.ops import _ext

    env: dict[str, Any] = dict(machine=machine(), python=platform.python_version(), torch=torch.__version__,
                               torch_cuda=torch.version.cuda, device=str(device),
                               cpu_kernels=_ext.cpu_module() is not None, cuda_kernels=_ext.cuda_module() is not None,
                               cuda_kernels_error=_ext.import_error(_ext.CUDA_MODULE))
    if torch.device(device).type == "cuda":
        props = torch.cuda.get_device_properties(torch.device(device))
        env.update(gpu=props.name, sms=props.multi_processor_count, gpu_mem_gib=round(props.total_memory / 2**30, 1))
    return env


def median_ms(fn: Callable[[], object], reps: int, warmup: int = 3) -> float:
    """Median wall time of fn() in ms over `reps` calls after `warmup` untimed ones."""
    for _ in range(warmup):
        fn()
    return percentile([elapsed_ms(fn) for _ in range(reps)], 50)


def alternate(fns: dict[str, Callable[[], object]], rounds: int, timer: Callable[[Callable[[], object]], float]
              = elapsed_ms, setup: dict[str, Callable[[], None]] | None = None) -> dict[str, list[float]]:
    """The one alternation of bench/: `rounds` rounds in which every function is timed in turn (`setup[name]()`
    first, untimed), so the machine's drift hits each alike; {name: [timer(fn) per round]}."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            if setup and name in setup:
                setup[name]()
            times[name].append(timer(fn))
    return times
