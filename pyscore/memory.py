"""What a served model takes in memory, planned before any tensor is loaded, and the check that it fits.

The plan (`pyscore.types.MemoryPlan`) adds up, in bytes: the weights as held for serving (the checkpoint's
tensors in the serving dtype, read from its headers), the KV store (one budget for the prefix cache and running
generations' keys and values: `kv_cache_mb`, or pyscore.budget.kv_store_bytes' default), a hybrid model's
per-sequence recurrent state for `max_running_generations` sequences, one forward pass's activations at
`max_batch_tokens` (an estimate), and the runtime (interpreter, torch, tokenizer, gRPC: a constant). Its total
is what a pod must be given: the pools are filled as load comes, so a server sized below it runs until the busy
hour, then is OOM-killed.

`check_fits` compares what the plan still has to allocate with the memory available — on the CPU the smaller
of the cgroup's room (v2 `memory.max`, v1 `memory.limit_in_bytes`, minus its working set) and the machine's
MemAvailable; on a GPU the device's free memory — and refuses to start, naming the numbers, rather than be
killed halfway through loading. `PYSCORE_MEMORY_CHECK=0` turns the refusal into a warning."""

from __future__ import annotations

import ctypes
import functools
import gc
import logging
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from pyscore.budget import (
    DEFAULT_MAX_BATCH_TOKENS,
    DEFAULT_MAX_RUNNING_GENERATIONS,
    kv_store_bytes,
)
from pyscore.model.config import LINEAR_ATTENTION, ModelConfig
from pyscore.types import MemoryPlan

if TYPE_CHECKING:
    from pyscore.model.checkpoint import TensorSpec

log = logging.getLogger(__name__)

GiB = 2**30
# The process before any weight: Python, torch, transformers, a tokenizer, gRPC. Measured at 0.36 GiB with the
# embedded model's tokenizer (VmRSS); a 150k-token vocabulary adds ~0.1 GiB.
RUNTIME_BYTES = 512 * 2**20
CGROUP_ROOT = Path("/sys/fs/cgroup")
NO_LIMIT = 2**60  # cgroup v1 writes "no limit" as a page-rounded 2^63 - 1


@dataclass(frozen=True)
class Pools:
    """The server's settings that memory grows into (the server's flags of the same names). The KV store is
    kv_cache_mb MiB (None: pyscore.budget's default)."""

    max_batch_tokens: int = DEFAULT_MAX_BATCH_TOKENS
    max_running_generations: int = DEFAULT_MAX_RUNNING_GENERATIONS
    kv_cache_mb: float | None = None

    def kv_store_bytes(self, bytes_per_token: int) -> int:
        return kv_store_bytes(self.kv_cache_mb, bytes_per_token)


class InsufficientMemoryError(MemoryError):
    """The model and its pools cannot fit in the memory available; raised before any tensor is loaded."""


def _num_linear(cfg: ModelConfig) -> int:
    return sum(cfg.layer_type(i) == LINEAR_ATTENTION for i in range(cfg.num_layers))


def kv_bytes_per_token(cfg: ModelConfig, dtype: torch.dtype) -> int:
    """One token's keys and values over the attention layers (= Decoder.kv_bytes_per_token)."""
    return 2 * (cfg.num_layers - _num_linear(cfg)) * cfg.num_kv_heads * cfg.head_dim * dtype.itemsize


def linear_state_bytes_per_sequence(cfg: ModelConfig, dtype: torch.dtype) -> int:
    """A hybrid model's fixed per-sequence cache (Decoder.new_cache): conv tail and fp32 recurrent state, each
    with its spare, in every linear-attention layer; 0 for models without linear attention."""
    lin, n = cfg.linear, _num_linear(cfg)
    if lin is None or not n:
        return 0
    conv = (lin.conv_kernel - 1) * lin.conv_channels * dtype.itemsize
    state = lin.num_v_heads * lin.k_dim * lin.v_dim * 4
    return 2 * n * (conv + state)


def activation_bytes_per_token(cfg: ModelConfig, dtype: torch.dtype) -> int:
    """An upper estimate of what one token of a forward pass holds at once, inside one layer: the residual
    stream and its pending add, the widest projection's output, the SiLU product, the attention output and the
    fp32 log-sum-exp scratch of the attention, all in the serving dtype (fp32 scratch at 4 bytes)."""
    qkv = (cfg.num_q_heads * (2 if cfg.attn_output_gate else 1) + 2 * cfg.num_kv_heads) * cfg.head_dim
    lin = cfg.linear
    in_proj = lin.conv_channels + lin.num_v_heads * (lin.v_dim + 2) if lin else 0
    widest = max(qkv, in_proj, 2 * cfg.intermediate_size)
    mixer_out = max(cfg.num_q_heads * cfg.head_dim, lin.num_v_heads * lin.v_dim if lin else 0)
    values = 2 * cfg.hidden_size + widest + cfg.intermediate_size + mixer_out
    return values * dtype.itemsize + 2 * cfg.num_q_heads * 4


def _is_served(name: str, cfg: ModelConfig) -> bool:
    """Whether the loader holds this checkpoint tensor: not a Qwen3.5 vision tower's or multi-token-prediction
    head's, nor a tied lm_head (the embedding serves as both)."""
    if name.startswith(("model.visual.", "mtp.")):
        return False
    return not (cfg.tie_word_embeddings and name == "lm_head.weight")


def weight_bytes(cfg: ModelConfig, specs: dict[str, TensorSpec], dtype: torch.dtype,
                 bf16_weights: bool = False, int8: bool = False) -> int:
    """The weights as the loader holds them: each served tensor in the serving dtype, except the fp32 ones of
    zero-centred families (the (1 + w) RMSNorm weights, A_log, dt_bias; the gated norm stays in the dtype) and,
    with bf16_weights, the matrices the checkpoint holds in bf16 that pyscore.model.weights.held_in_bf16 keeps so;
    with int8, the projections in int8 with, per row and group of input channels, an fp32 scale and the kernel's
    int32 sum base (pyscore.ops.linear_int8), their biases fp32."""
    from pyscore.model.weights import held_in_bf16, is_projection  # the model package imports this module
    from pyscore.ops.linear_int8 import groups_of

    total = 0
    for name, spec in specs.items():
        if not _is_served(name, cfg):
            continue
        if int8 and is_projection(name):
            rows = spec.shape[0]
            total += rows * spec.shape[1] + 8 * rows * groups_of(spec.shape[1]) if len(spec.shape) == 2 else 4 * rows
            continue
        fp32 = cfg.zero_centred_norm and len(spec.shape) == 1 and not name.endswith("linear_attn.norm.weight")
        held = 2 if bf16_weights and spec.dtype == torch.bfloat16 and held_in_bf16(name) else dtype.itemsize
        total += spec.nbytes // spec.dtype.itemsize * (4 if fp32 else held)
    return total


def plan_memory(cfg: ModelConfig, weights: int, dtype: torch.dtype, pools: Pools,
                kv_store_bytes: int | None = None) -> MemoryPlan:
    """The plan for `weights` bytes of weights under `pools`; `kv_store_bytes` overrides the KV store's budget
    (the engine passes what its store really got: whole pages). The prefix cache lives in the store, so
    prefix_cache_bytes is 0."""
    per_token = kv_bytes_per_token(cfg, dtype)
    return MemoryPlan(
        weight_bytes=weights, kv_bytes_per_token=per_token,
        kv_budget_bytes=pools.kv_store_bytes(per_token) if kv_store_bytes is None else kv_store_bytes,
        linear_state_bytes=pools.max_running_generations * linear_state_bytes_per_sequence(cfg, dtype),
        prefix_cache_bytes=0,
        activation_bytes=pools.max_batch_tokens * activation_bytes_per_token(cfg, dtype),
        runtime_bytes=RUNTIME_BYTES)


# -- what is available ------------------------------------------------------------------------------------------
def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return None if text in ("", "max") else int(text)


def _stat(path: Path, key: str) -> int:
    try:
        for line in path.read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == key:
                return int(value)
    except OSError:
        pass
    return 0


def cgroup_room(root: Path = CGROUP_ROOT, cgroup_file: Path = Path("/proc/self/cgroup")) -> tuple[int, str] | None:
    """(bytes the cgroup may still grow by, what that is) for the process's memory cgroup with a limit — the
    limit minus the working set (usage minus inactive file pages, what the kubelet and the OOM killer count) —
    or None when no limit applies. cgroup v2 first; a limit set on an ancestor applies too."""
    try:
        lines = cgroup_file.read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # v2: the unified hierarchy
            found = _v2_room(root, path) or _v2_room(root / "unified", path)
            if found:
                return found
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            return _v1_room(root / "memory", path)
    return None


def _v2_room(mount: Path, path: str) -> tuple[int, str] | None:
    leaf = mount / path.lstrip("/")
    if not (mount / "cgroup.controllers").exists() or not leaf.is_dir():
        return None
    limits = [(limit, d) for d in (leaf, *leaf.parents) if d.is_relative_to(mount)
              and (limit := _read_int(d / "memory.max")) is not None]
    if not limits:
        return None
    limit, where = min(limits)
    used = (_read_int(leaf / "memory.current") or 0) - _stat(leaf / "memory.stat", "inactive_file")
    return limit - used, f"cgroup v2 limit {limit / GiB:.2f} GiB ({where / 'memory.max'}), {used / GiB:.2f} GiB in use"


def _v1_room(mount: Path, path: str) -> tuple[int, str] | None:
    leaf = mount / path.lstrip("/")
    if not leaf.is_dir():  # in a container the process's own cgroup is mounted as the root
        leaf = mount
    limit = _read_int(leaf / "memory.limit_in_bytes")
    if limit is None or limit >= NO_LIMIT:
        return None
    used = (_read_int(leaf / "memory.usage_in_bytes") or 0) - _stat(leaf / "memory.stat", "total_inactive_file")
    return limit - used, f"cgroup v1 limit {limit / GiB:.2f} GiB ({leaf}), {used / GiB:.2f} GiB in use"


def mem_available(meminfo: Path = Path("/proc/meminfo")) -> int:
    for line in meminfo.read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    raise OSError("no MemAvailable in /proc/meminfo")


def available_memory(device: torch.device) -> tuple[int, str]:
    """(bytes this process may still allocate, where the number comes from)."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free, f"free memory of {device}"
    physical = mem_available()
    room = cgroup_room()
    if room is not None and room[0] < physical:
        return room
    return physical, "MemAvailable of the machine"


@functools.cache
def glibc() -> ctypes.CDLL | None:
    """The C library when it is glibc (the allocator controls below are glibc's), else None (musl, macOS)."""
    if sys.platform != "linux":
        return None
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return None
    return libc if hasattr(libc, "mallopt") and hasattr(libc, "malloc_trim") else None


def release_freed_memory() -> None:
    """Hand the heap pages that loading freed (converted and replaced weights) back to the OS: glibc keeps freed
    chunks below its mmap threshold in the heap, which RSS (and a pod's memory limit) still counts. The loader
    calls it once the weights are built (the sources of every fused projection are freed), the engine once they
    are packed (every plain projection is)."""
    libc = glibc()
    if libc is not None:
        libc.malloc_trim(0)


# glibc's mallopt parameters (malloc.h) and the values keep_activation_pages sets.
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
HEAP_MMAP_THRESHOLD = 256 << 20
HEAP_TRIM_THRESHOLD = 1 << 30
_USER_MALLOC_ENV = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_")


def keep_activation_pages(env: dict[str, str] | None = None) -> str:
    """Has glibc serve a forward pass's activations from its heap and keep the freed pages for the next pass
    (M_MMAP_THRESHOLD 256 MiB, M_TRIM_THRESHOLD 1 GiB); an Engine calls it last in its construction. By default a
    buffer over glibc's (moving) mmap threshold is a fresh mapping, and free() hands the heap's top back to the OS,
    so a layer's outputs are written into new pages: page faults were 40% of a 16-candidate SIS forward on the AMX
    Xeon (1,118 -> 691-727 ms, bench/results/tiers/engine/heap_ab_amx.txt). The kept pages go back to the OS when the
    server is idle (server/batcher.py's trim) or when release_freed_memory runs. A server worker thread's buffers
    of 64 MiB or more still come from fresh mappings (glibc caps a thread arena's heap at 64 MiB). Left alone when
    the user set one of glibc's MALLOC_*_ variables or PYSCORE_HEAP_TUNING=0, and on other C libraries. Returns
    what was done, for the log."""
    env = os.environ if env is None else env
    if env.get("PYSCORE_HEAP_TUNING", "1") == "0":
        return "heap: glibc defaults (PYSCORE_HEAP_TUNING=0)"
    if any(k in env for k in _USER_MALLOC_ENV):
        return "heap: the user's MALLOC_*_ settings"
    libc = glibc()
    if libc is None:
        return "heap: not glibc, left alone"
    if not (libc.mallopt(_M_MMAP_THRESHOLD, HEAP_MMAP_THRESHOLD) and libc.mallopt(_M_TRIM_THRESHOLD,
                                                                                    HEAP_TRIM_THRESHOLD)):
        return "heap: glibc refused the thresholds"
    return f"heap: activations from glibc's heap (mmap threshold {HEAP_MMAP_THRESHOLD >> 20} MiB, trim threshold " \
           f"{HEAP_TRIM_THRESHOLD >> 20} MiB)"


def freeze_heap() -> str:
    """A full collection, then every object still alive moved to the collector's permanent generation (gc.freeze):
    what a server loaded (modules, the model's Python objects, the tokenizer) lives as long as the process, and each
    full collection would otherwise scan all of it while holding the GIL, on whichever thread allocated last: the
    event loop's, for as long: 136-155 ms of CPU a pass in a process serving the embedded model, ~0 frozen
    (bench/results/hardening/gc_freeze_zen4.txt). Objects created later are collected as before. The server calls
    it once the model is loaded; returns a line for the log."""
    gc.collect()
    gc.freeze()
    return f"gc: {gc.get_freeze_count()} objects alive after loading frozen (full collections no longer scan them)"


def resident_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


# -- the check -----------------------------------------------------------------------------------------------
def still_needed(plan: MemoryPlan, device: torch.device) -> int:
    """Bytes of the plan still to allocate on `device`: on the CPU less what the process holds already (a GPU's plan
    leaves the runtime on the host)."""
    already = resident_bytes() if device.type == "cpu" else 0
    device_total = plan.expected_total_bytes - (plan.runtime_bytes if device.type == "cuda" else 0)
    return max(device_total - already, 0)


def check_fits(plan: MemoryPlan, name: str, device: torch.device, pools: Pools,
               available: tuple[int, str] | None = None) -> None:
    """Raises InsufficientMemoryError, naming the numbers and what to change, when what the plan has yet to
    allocate exceeds the memory available; a GPU's plan leaves the runtime on the host."""
    free, source = available if available is not None else available_memory(device)
    need = still_needed(plan, device)
    if need <= free:
        return
    message = (f"{name} does not fit: it needs {describe(plan)}; {need / GiB:.2f} GiB of it is still to be "
               f"allocated, but only {free / GiB:.2f} GiB is available ({source}). {_advice(plan, need - free, pools)}")
    if os.environ.get("PYSCORE_MEMORY_CHECK", "1") == "0":
        log.warning("%s Starting anyway: PYSCORE_MEMORY_CHECK=0.", message)
        return
    raise InsufficientMemoryError(message)


def describe(plan: MemoryPlan) -> str:
    parts = [("weights", plan.weight_bytes), ("KV budget", plan.kv_budget_bytes),
             ("linear-attention state", plan.linear_state_bytes), ("prefix cache", plan.prefix_cache_bytes),
             ("activations", plan.activation_bytes), ("runtime", plan.runtime_bytes)]
    shown = " + ".join(f"{what} {n / GiB:.2f}" for what, n in parts if n)
    return f"{plan.expected_total_bytes / GiB:.2f} GiB ({shown} GiB)"


def _advice(plan: MemoryPlan, short: int, pools: Pools) -> str:
    """What would make it fit: the pools first (they are settings), then the machine."""
    anyway = "(set PYSCORE_MEMORY_CHECK=0 to start anyway)"
    store_mb = plan.kv_budget_bytes / 2**20
    if plan.kv_bytes_per_token and plan.kv_budget_bytes > short:
        fits = (plan.kv_budget_bytes - short) // 2**20
        return f"Lower --kv-cache-mb (now {store_mb:g}) to at most {fits}, or give it more memory {anyway}."
    pools_left = plan.kv_budget_bytes + plan.linear_state_bytes + plan.prefix_cache_bytes + plan.activation_bytes
    if pools_left > short:
        return (f"Lower --kv-cache-mb (now {store_mb:g}), --max-running-generations (now "
                f"{pools.max_running_generations}) or --max-batch-tokens (now {pools.max_batch_tokens}), or give "
                f"it more memory {anyway}.")
    return f"The weights alone do not fit: give it more memory, or serve a smaller dtype or model {anyway}."
