"""The op registry: which path runs each op on each device, CPU tier and dtype — our compiled kernel, torch's own
op, or the op's pure-PyTorch reference (`pyscore.ops.reference`) — and why. The decision is made here and nowhere
else: every op wrapper asks `path_for` (or `kernel_for`), and the engine calls `op_paths` once at start to log and
report (GetModelInfo) the same decisions.

On the CPU the choice is per (op, tier, dtype) in `CPU_TIERS`, each entry citing the recorded bench line that
justifies it: our kernel where it beats torch's op at the shapes we run, torch's op where it does not (never a
scalar loop where torch has a vectorized one). The tier comes from the CPU module (csrc/common/cpu_features.h), the
one place it is decided; PYSCORE_CPU_TIER forces a lower one for tests and benches.

`pyscore._C` (CPU) is expected after `make build`; `pyscore._C_cuda` is optional: when it is missing or no
GPU/driver is present, CUDA is reported off, never fatal. Backends: "auto" (the table's production path;
PYSCORE_OP_BACKEND=reference forces the reference everywhere, a slow debugging switch), "kernel" (our kernel
whatever the table says, or a RuntimeError that says why not: how tests reach a kernel on any tier) and
"reference"."""

from __future__ import annotations

import functools
import importlib
import logging
import os
import platform
from dataclasses import dataclass
from types import ModuleType

import torch

from pyscore.ops.tiers import BELOW, CPU_TIERS, TIERS, cpu_choice, uncovered_entries

log = logging.getLogger(__name__)

CPU_MODULE, CUDA_MODULE = "pyscore._C", "pyscore._C_cuda"
_FP32_BF16 = frozenset({torch.float32, torch.bfloat16})
_FP32_BF16_FP16 = _FP32_BF16 | {torch.float16}


# Ops whose production path without a kernel of ours is torch's op in the model's dtype (F.linear on a GPU, or for
# fp16 on a CPU), not their fp32 reference: the projections' GEMM.
TORCH_FALLBACK = frozenset({"linear", "linear_int8"})


@dataclass(frozen=True)
class Kernel:
    module: str  # the extension module that binds the op under the op's name
    dtypes: frozenset[torch.dtype]


# The ops with a pyscore._C_cuda kernel (fp32, bf16 and fp16). Every op of the CPU tier table (tiers.CPU_TIERS) has a
# pyscore._C kernel for fp32 and bf16, so a new CPU op is registered by its tier entry alone.
CUDA_OPS = ("prefix_item_attention", "decode_attention", "label_logprobs", "causal_conv1d", "gated_delta_rule")

# (op, device type) -> its kernel. An op or device missing here runs the reference.
REGISTRY: dict[str, dict[str, Kernel]] = {
    op: {"cpu": Kernel(CPU_MODULE, _FP32_BF16)}
    | ({"cuda": Kernel(CUDA_MODULE, _FP32_BF16_FP16)} if op in CUDA_OPS else {})
    for op in CPU_TIERS
}


@functools.cache
def _load(name: str) -> tuple[ModuleType | None, str | None]:
    """(module, None) or (None, why it failed to import). The CPU module's kernel table is checked against the tier
    table on its first load (check_kernel_table)."""
    try:
        module = importlib.import_module(name)
    except ImportError as e:
        return None, str(e)
    if name == CPU_MODULE:
        check_kernel_table(module.kernel_table())
    return module, None


# The tiers whose kernels a build for each architecture holds (csrc/common/cpu_features.h; generic: the portable loops).
ARCH_TIERS = {"x86_64": ("avx2", "avx512", "avx512bf16", "amx"), "aarch64": ("neon",)}


def check_kernel_table(kernel_table: list[dict], machine: str | None = None) -> None:
    """RuntimeError when the tier table (pyscore/ops/tiers.py) names a kernel at a tier of this architecture that the
    CPU module's generated kernel table (pyscore._C.kernel_table()) did not build."""
    tiers = ARCH_TIERS.get(machine or platform.machine(), ())
    missing = uncovered_entries(kernel_table, tiers)
    if missing:
        raise RuntimeError(f"pyscore/ops/tiers.py names kernels that {CPU_MODULE} did not build: {'; '.join(missing)}")


def cpu_module() -> ModuleType | None:
    return _load(CPU_MODULE)[0]


def cuda_module() -> ModuleType | None:
    return _load(CUDA_MODULE)[0]


def import_error(name: str) -> str | None:
    """Why extension module `name` cannot be imported (None when it can)."""
    return _load(name)[1]


def cuda_status() -> tuple[bool, str]:
    """(usable, why): whether CUDA kernels can run here, for device="auto" and the start-up log."""
    module = cuda_module()
    if module is None:
        return False, f"CUDA off: `_C_cuda` failed to import: {import_error(CUDA_MODULE)}"
    if not module.available():
        return False, "CUDA off: `_C_cuda` sees no GPU or driver"
    if not torch.cuda.is_available():
        return False, "CUDA off: this torch build has no CUDA device"
    return True, f"CUDA on: {module.device_count()} device(s)"


def default_backend() -> str:
    """What backend="auto" means in this process (PYSCORE_OP_BACKEND=reference forces the reference)."""
    return os.environ.get("PYSCORE_OP_BACKEND", "auto")


def _module_for(name: str) -> ModuleType | None:
    return cpu_module() if name == CPU_MODULE else cuda_module()


def resolve(op: str, device: torch.device, dtype: torch.dtype, backend: str = "auto") -> tuple[ModuleType | None, str]:
    """(the module whose kernel runs `op` for `dtype` tensors on `device`, or None when torch's op or the reference
    does; and why)."""
    module, _, why = resolve_path(op, device, dtype, backend)
    return module, why


# resolve_path's answers by everything they are computed from: the arguments, the two environment switches, the
# op's registry entry and the module loaders (which tests replace), so that a changed input is seen at once. Each
# op wrapper asks on every call (~240 calls a decode step): a hit costs ~1 us instead of ~7.7. The keys do not grow
# with load; the bound only guards a process that keeps changing the switches.
_PATHS: dict[tuple, tuple[ModuleType | None, str, str]] = {}
_PATHS_MAX = 1024


def _switches() -> tuple[str | None, str | None]:
    """PYSCORE_OP_BACKEND and PYSCORE_CPU_TIER as set now, read through the CPU module's getenv where it loads
    (~0.3 us a read; os.environ's ~1.8)."""
    module = cpu_module()
    read = os.environ.get if module is None else module.getenv
    return read("PYSCORE_OP_BACKEND"), read("PYSCORE_CPU_TIER")


def resolve_path(op: str, device: torch.device, dtype: torch.dtype, backend: str = "auto",
                 ) -> tuple[ModuleType | None, str, str]:
    """(kernel module or None, path, why) with path "kernel" | "torch" | "reference"."""
    key = (op, device, dtype, backend, *_switches(), id(REGISTRY.get(op)), _load, cpu_module, cuda_module)
    hit = _PATHS.get(key)
    if hit is None:
        hit = _resolve_path(op, device, dtype, backend)
        if len(_PATHS) >= _PATHS_MAX:
            _PATHS.clear()
        _PATHS[key] = hit
    return hit


def _resolve_path(op: str, device: torch.device, dtype: torch.dtype, backend: str,
                  ) -> tuple[ModuleType | None, str, str]:
    if backend not in ("auto", "kernel", "reference"):
        raise ValueError(f"backend must be auto, kernel or reference, got {backend!r}")
    if backend == "auto" and default_backend() == "reference":
        return None, "reference", "reference: PYSCORE_OP_BACKEND=reference"
    if backend == "reference":
        return None, "reference", "reference: op_backend=reference"
    module, why = _kernel(op, device, dtype)
    if module is None:
        if op in TORCH_FALLBACK:  # torch's own op in the model's dtype, not the fp32 oracle
            return None, "torch", "torch: " + why.removeprefix("reference: ")
        return None, "reference", why
    if backend == "auto" and device.type == "cpu":
        tier = cpu_tier()
        choice = cpu_choice(op, tier, dtype)
        if choice.path == "torch":
            return None, "torch", f"torch: tier {tier}, {choice.why}"
    return module, "kernel", why


def _kernel(op: str, device: torch.device, dtype: torch.dtype) -> tuple[ModuleType | None, str]:
    """Our kernel for (op, device, dtype) if one is registered and its module imports, else None and why not."""
    spec = REGISTRY[op].get(device.type)
    if spec is None:
        return None, f"reference: no {device.type.upper()} kernel for {op}"
    if dtype not in spec.dtypes:
        names = "/".join(sorted(_dtype_name(d) for d in spec.dtypes))
        return None, f"reference: the {device.type.upper()} kernel takes {names}, not {_dtype_name(dtype)}"
    module = _module_for(spec.module)
    if module is None:
        what = "CUDA off" if spec.module == CUDA_MODULE else "CPU kernels off"
        short = spec.module.removeprefix("pyscore.")
        return None, f"reference: {what}: `{short}` failed to import: {import_error(spec.module)}"
    return module, f"kernel: {spec.module}"


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def kernel_for(op: str, device: torch.device, dtype: torch.dtype, backend: str = "auto") -> ModuleType | None:
    """The module whose kernel runs `op` on `dtype` tensors on `device`, or None when torch's op / the reference
    should (the op's PyTorch implementation); with backend "kernel", a RuntimeError saying why no kernel fits."""
    return path_for(op, device, dtype, backend)[0]


def path_for(op: str, device: torch.device, dtype: torch.dtype, backend: str = "auto",
             ) -> tuple[ModuleType | None, str]:
    """(kernel module or None, "kernel" | "torch" | "reference"); backend "kernel" raises instead of falling back."""
    module, path, why = resolve_path(op, device, dtype, backend)
    if module is None and backend == "kernel":
        raise RuntimeError(f"no {op} kernel for {dtype} on {device}: {why}")
    return module, path


def op_paths(device: torch.device, dtype: torch.dtype, backend: str = "auto") -> dict[str, str]:
    """op -> the path it takes for a model on `device` in `dtype`, and why; CPU kernels name the tier they run."""
    paths = {}
    for op in REGISTRY:
        module, why = resolve(op, device, dtype, backend)
        if module is not None and device.type == "cpu":
            why += f" ({cpu_isa(module)})"
        paths[op] = why
    return paths


def cpu_tier() -> str:
    """The CPU tier the kernels dispatch on now (csrc/common/cpu_features.h; PYSCORE_CPU_TIER lowers it), or
    "generic" when the CPU module is missing."""
    module = cpu_module()
    return "generic" if module is None else module.cpu_features()["tier"]


def runnable_cpu_tiers() -> list[str]:
    """The tiers this CPU can run, lowest first: its own and every tier below it (what PYSCORE_CPU_TIER may force)."""
    module = cpu_module()
    chain = ["generic" if module is None else module.cpu_features()["hardware_tier"]]
    while chain[-1] in BELOW:
        chain.append(BELOW[chain[-1]])
    return chain[::-1]


# The kernels' switches that take a name, and the names they know. The kernels read any other value as unset
# (csrc/common/cpu_features.h; default_backend here), so a misspelt one would run the default while a bench or a
# deployment believes it forced another.
SWITCH_VALUES = {"PYSCORE_CPU_TIER": TIERS, "PYSCORE_BF16_DOT": ("dpbf16", "widen"),
                 "PYSCORE_OP_BACKEND": ("auto", "reference")}


def check_switches() -> None:
    """Each switch of SWITCH_VALUES, when set, must hold a name it knows (ValueError naming the variable and the
    names). A tier this CPU cannot run (above it, or of the other architecture) is legal, as for a setting shared by
    a mixed fleet: the kernels run the CPU's tier (generic across architectures), and that is logged."""
    for name, known in SWITCH_VALUES.items():  # once per engine: os.environ, not _switches' per-call fast read
        value = os.environ.get(name)
        if value and value not in known:
            raise ValueError(f"{name}={value[:32]!r} is not one of {', '.join(known)} (or unset: the default)")
    asked = os.environ.get("PYSCORE_CPU_TIER")
    if asked and asked not in runnable_cpu_tiers():
        log.warning("PYSCORE_CPU_TIER=%s: this CPU cannot run that tier (it runs %s); the kernels run tier %s",
                    asked, ", ".join(runnable_cpu_tiers()), cpu_tier())


def cpu_isa(module: ModuleType) -> str:
    """Which code the CPU kernels run at the current tier, as the module itself decides it: the tier, for AVX-512
    BF16 the bf16 product it uses (vdpbf16ps on AMD, bf16 pairs widened to fp32 FMAs on Intel, PYSCORE_BF16_DOT
    forcing either; widened pairs at tier avx512), and whether the tier was forced below the hardware's."""
    features = module.cpu_features()
    tier, hardware = features["tier"], features["hardware_tier"]
    what = f"tier {tier}"
    if tier in ("avx512", "avx512bf16", "amx"):  # avx512: always widen (no vdpbf16ps)
        what += f", bf16 products by {features['bf16_dot']}"
    if tier != hardware:
        what += f"; forced below the CPU's {hardware}"
    return what


def default_cpu_dtype() -> tuple[torch.dtype, str]:
    """The CPU dtype for dtype="auto", and why: bf16 where the CPU multiplies bf16 (AVX512-BF16, AMX, ARM bf16);
    fp32 elsewhere, where torch's bf16 GEMM is several times slower than its fp32 (no bf16 arithmetic) and ours,
    widening bf16 pairs, slower than our fp32 too (bench/results/tiers/engine/engine_avx512_dtype.txt). The loader
    still serves bf16 where only bf16 fits (pyscore.model.loading.choose_dtype)."""
    tier = cpu_tier()
    module = cpu_module()
    if tier in ("avx512bf16", "amx"):
        return torch.bfloat16, f"bfloat16: tier {tier} multiplies bf16"
    if tier == "neon" and module is not None and module.cpu_features()["arm_bf16"]:
        return torch.bfloat16, "bfloat16: this ARM CPU has bf16 arithmetic"
    return torch.float32, f"float32: tier {tier} has no bf16 arithmetic"


def torch_dtype_name(dtype: torch.dtype) -> str:
    """The kernel-side dtype name ('float32' | 'bfloat16' | 'float16') of a torch dtype."""
    names = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
    if dtype not in names:
        raise TypeError(f"unsupported dtype {dtype}; expected float32, bfloat16 or float16")
    return names[dtype]


def cuda_stream(device: torch.device) -> int:
    """The raw cudaStream_t (as int) of torch's current stream on `device`."""
    return int(torch.cuda.current_stream(device).cuda_stream)
