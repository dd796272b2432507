"""A checkpoint's tensors read one at a time, and safetensors files written one tensor at a time, so that neither
loading nor writing a model ever holds more than its result plus one tensor.

Reading: each `get(name)` maps the tensor's safetensors shard (`safe_open`: a private, read-only mapping of the
file), copies that one tensor into memory of its own, and drops the mapping before returning. Keeping a shard
mapped would be cheaper in system calls but not in memory: every page read through a mapping stays in the
process's resident set until the mapping goes, so a whole shard (several GB) would sit beside the weights copied
out of it. `shapes()` reads only the shards' headers. A `pytorch_model*.bin` checkpoint (legacy) is read the same
way through `torch.load(mmap=True)`.

Writing: `write_safetensors` writes the header from the tensors' names, dtypes and shapes, then asks for each
tensor's values in turn; a file that is being written is never visible under its final name."""

from __future__ import annotations

import json
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
        if shard.suffix == ".safetensors":
            from safetensors import safe_open

            with safe_open(str(shard), framework="pt") as f:  # the mapping lives only while this tensor is copied
                return f.get_tensor(name).clone()
        return torch.load(shard, map_location="cpu", weights_only=True, mmap=True)[name].clone()


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
