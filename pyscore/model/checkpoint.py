"""A checkpoint's tensors read one at a time, and safetensors files written one tensor at a time, so that neither
loading nor writing a model ever holds more than its result plus one tensor.

Reading: each `get(name)` maps the tensor's safetensors shard (`safe_open`: a private, read-only mapping of the
file), copies that one tensor into memory of its own — a 64 MiB slab at a time, each slab's file pages dropped
from the resident set once copied (`copy_out`) — and drops the mapping before returning. Keeping a shard mapped
would be cheaper in system calls but not in memory: every page read through a mapping stays in the process's
resident set until the mapping goes, so a whole shard (several GB) would sit beside the weights copied out of it.
Every 512 MiB handed out, the heap's free pages go back to the system: a loader fuses tensors as it reads them
(q|k|v, gate|up), and the sources it frees, below glibc's mmap threshold, would otherwise stay resident as holes
between the weights. `shapes()` reads only the shards' headers. A `pytorch_model*.bin` checkpoint (legacy) is read
the same way through `torch.load(mmap=True)`.

Writing: `write_safetensors` writes the header from the tensors' names, dtypes and shapes, then asks for each
tensor's values in turn; a file that is being written is never visible under its final name."""

from __future__ import annotations

import ctypes
import json
import mmap
import os
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

# safetensors' dtype names (https://huggingface.co/docs/safetensors): the ones a model checkpoint uses.
SAFETENSORS_DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64",
                      torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
                      torch.uint8: "U8", torch.bool: "BOOL"}
DTYPES_BY_NAME = {v: k for k, v in SAFETENSORS_DTYPES.items()}
SLAB_BYTES = 64 * 2**20  # how much of a tensor is copied before its source pages are dropped
TRIM_EVERY_BYTES = 512 * 2**20  # how much is handed out between two trims of the heap (release_freed_memory)
PAGE = mmap.PAGESIZE
MADV_DONTNEED = 4  # <sys/mman.h> on Linux


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        n = self.dtype.itemsize
        for d in self.shape:
            n *= d
        return n


class Checkpoint:
    """The weights of a Hugging Face model directory: `get(name)` -> a tensor of its own (or None when the
    checkpoint has no such tensor), `shapes()` -> every tensor's spec without reading any values."""

    def __init__(self, path: Path):
        self.path = path
        self._shards = sorted(path.glob("*.safetensors"))
        self._bins = [] if self._shards else sorted(path.glob("pytorch_model*.bin"))
        if not self._shards and not self._bins:
            raise FileNotFoundError(f"{path} has no *.safetensors or pytorch_model*.bin weights")
        self._specs: dict[str, TensorSpec] = {}
        self._copied = 0  # bytes handed out since the heap was last trimmed
        self._shard_of: dict[str, Path] = {}
        for shard in self._shards or self._bins:
            for spec in _read_specs(shard):
                self._specs[spec.name] = spec
                self._shard_of[spec.name] = shard

    def shapes(self) -> dict[str, TensorSpec]:
        return dict(self._specs)

    def get(self, name: str) -> torch.Tensor | None:
        shard = self._shard_of.get(name)
        if shard is None:
            return None
        self._copied += self._specs[name].nbytes
        if self._copied >= TRIM_EVERY_BYTES:  # the caller has fused and freed earlier tensors: holes in the heap
            from pyscore.memory import release_freed_memory

            release_freed_memory()
            self._copied = 0
        if shard.suffix == ".safetensors":
            from safetensors import safe_open

            with safe_open(str(shard), framework="pt") as f:  # the mapping lives only while this tensor is copied
                return copy_out(f.get_tensor(name))
        return copy_out(torch.load(shard, map_location="cpu", weights_only=True, mmap=True)[name])


def copy_out(mapped: torch.Tensor) -> torch.Tensor:
    """A copy of a tensor that lives in a read-only file mapping, made a slab at a time, each slab's source pages
    dropped from the resident set as soon as it is copied: copying a whole embedding (1.2 GB for Qwen3-8B) would
    otherwise hold it twice, its file pages and its copy."""
    out = torch.empty_like(mapped, memory_format=torch.contiguous_format)
    if mapped.dim() == 0 or not mapped.is_contiguous():
        return out.copy_(mapped)
    src, dst = mapped.reshape(len(mapped), -1), out.view(len(out), -1)
    rows = max(1, SLAB_BYTES // max(1, src[0].nbytes))
    for start in range(0, len(src), rows):
        dst[start:start + rows].copy_(src[start:start + rows])
        _drop_pages(src[start:start + rows])
    return out


def _drop_pages(t: torch.Tensor) -> None:
    """madvise(MADV_DONTNEED) over the whole pages inside `t`, a view of a private file mapping that is never
    written: they leave the resident set (they stay in the page cache; a later read maps them back, unchanged).
    Only pages that lie wholly inside `t`: were it ever not a mapping, nothing but its own copied bytes is lost."""
    start = -(-t.data_ptr() // PAGE) * PAGE
    end = (t.data_ptr() + t.nbytes) // PAGE * PAGE
    if _libc is not None and end > start:
        _libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), MADV_DONTNEED)


def _load_libc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        return libc
    except (OSError, AttributeError):
        return None


_libc = _load_libc()


def _read_specs(shard: Path) -> list[TensorSpec]:
    if shard.suffix == ".safetensors":
        with shard.open("rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(size))
        return [TensorSpec(name, DTYPES_BY_NAME[h["dtype"]], tuple(h["shape"]))
                for name, h in header.items() if name != "__metadata__"]
    state = torch.load(shard, map_location="cpu", weights_only=True, mmap=True)  # mapped: no values are read
    return [TensorSpec(name, t.dtype, tuple(t.shape)) for name, t in state.items()]


def write_safetensors(path: Path, specs: Sequence[TensorSpec], tensor_of: Callable[[TensorSpec], torch.Tensor],
                      metadata: dict[str, str] | None = None) -> None:
    """Writes a safetensors file holding `specs` in their order, each tensor's values asked of `tensor_of` only
    when its turn comes (and dropped right after): memory stays at one tensor, whatever the file's size."""
    header: dict[str, object] = {}
    offset = 0
    for spec in specs:
        header[spec.name] = {"dtype": SAFETENSORS_DTYPES[spec.dtype], "shape": list(spec.shape),
                             "data_offsets": [offset, offset + spec.nbytes]}
        offset += spec.nbytes
    if metadata:
        header["__metadata__"] = metadata
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # the format aligns the data to 8 bytes with spaces
    tmp = path.with_name(path.name + ".partial")
    try:
        with tmp.open("wb") as f:
            f.write(struct.pack("<Q", len(blob)) + blob)
            for spec in specs:
                t = tensor_of(spec)
                if t.dtype != spec.dtype or tuple(t.shape) != spec.shape:
                    raise ValueError(f"{spec.name}: expected {spec.dtype} {list(spec.shape)}, "
                                     f"got {t.dtype} {list(t.shape)}")
                f.write(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy())
                del t
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
