"""linear: x @ W.T (+ bias) with a fused epilogue (SiLU-mul for a SwiGLU gate_up projection, a residual add for o /
down), whichever path runs it; the decoder calls it the same way on every path (one residual convention). A weight
is held once, in the form its path reads: a `PackedLinear` (prepacked once at load into the layout the CPU kernel
reads, see csrc/linear/linear.h) where the registry (pyscore/ops/_ext.py, pyscore/ops/tiers.py) runs our kernel, a
`PlainLinear` where it runs torch's GEMM; `prepare_linear` makes the right one, and the other paths unpack on demand.

Paths: our C++ kernel; torch's F.linear in the weight's dtype over fixed-size row chunks, the last one zero-padded
(oneDNN picks its blocking by the call's shape, so a row's bits would change with the number of rows; with every
call the same shape a row's bits depend only on that row: measured position-invariant, tested in
tests/ops/test_linear.py); or the fp32 reference (`pyscore.ops.reference.linear_ref`). On every path a row's
result is bitwise the same whatever the other rows of the call (batch invariance).

Weights held in bf16 under fp32 activations (`holds_bf16_weights`): where the model is served in fp32 on a CPU
tier whose kernel reads bf16 weights under fp32 x (pyscore/ops/tiers.py BF16_WEIGHT_TIERS), a projection that the
checkpoint stores in bf16 is held (packed) in bf16 and widened to fp32 in registers: exact, so every result is
bitwise the fp32 weight's, in half the memory and, for a decode step, half the bytes read. The same policy holds
the embedding and the LM head in bf16 (the label read-out widens a bf16 head the same way: pyscore.ops.label_logprobs),
so it asks that both kernels run.

An int8 weight (`QuantLinear`, `--quantize int8`: pyscore.ops.linear_int8) runs linear_int8's paths, the same call."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pyscore.ops import _ext, tiers
from pyscore.ops.linear_int8 import (
    PackedQuantLinear,
    QuantLinear,
    RowMajorWeight,
    by_block,
    linear_int8,
    linear_int8_path,
)
from pyscore.ops.packing import BLOCK_N, original_rows, pack_index, pack_rows
from pyscore.ops.reference import linear_ref
from pyscore.ops.silu_mul import silu_mul

PACK = {torch.bfloat16: 2, torch.float16: 2, torch.int8: 4}  # K elements a packed column holds together (else 1)
# Rows per torch GEMM call on the torch path: prefill passes and decode steps each use one fixed size (a row's bits
# depend on the call's shape); 128 keeps big-M GEMMs within ~1.3-2x of one unchunked call, 16 keeps a decode step's
# padding cheap (bench/results/tiers/kernels/linear_amx.txt).
PREFILL_ROWS = 128
DECODE_ROWS = 16
_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16"}  # the kernel's dtypes


@dataclass(frozen=True)
class PackedLinear:
    """A [N, K] weight (or a gated [2I, K] gate_up) in the kernel's layout: packed [N_pad / 64, K_pad / pack, 64,
    pack] in the weight's dtype, bias in packed column order as fp32 [N_pad] (or None)."""

    packed: torch.Tensor
    bias: torch.Tensor | None
    in_features: int  # K
    out_features: int  # N, or I when gated
    gated: bool

    def __post_init__(self):
        # The kernel arguments that never change, computed once: a decode step makes ~100 of these calls.
        object.__setattr__(self, "_kernel_args", (
            self.packed.data_ptr(), 0 if self.bias is None else self.bias.data_ptr(), self.in_features,
            self.packed_columns, self.out_features, self.gated))

    @property
    def dtype(self) -> torch.dtype:
        return self.packed.dtype

    @property
    def device(self) -> torch.device:
        return self.packed.device

    @property
    def packed_columns(self) -> int:
        return self.packed.shape[0] * BLOCK_N

    def unpacked(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The original weight [N or 2I, K] and bias (fp32), recovered from the packed layout."""
        blocks, steps, _, pack = self.packed.shape
        w = self.packed.permute(0, 2, 1, 3).reshape(blocks * BLOCK_N, steps * pack)[:, : self.in_features]
        rows = original_rows(self.out_features, self.gated, w.device)  # packed column of each row
        bias = None if self.bias is None else self.bias[rows]
        return w[rows], bias


@dataclass(frozen=True)
class PlainLinear(RowMajorWeight):
    """A weight as torch's GEMM reads it: [N, K] (gated: [2I, K], gate rows then up rows) in the model's dtype, and
    its bias [N] (or None)."""

    weight: torch.Tensor
    bias: torch.Tensor | None
    gated: bool = False

    def unpacked(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        return self.weight, self.bias


LinearWeight = PackedLinear | PlainLinear | QuantLinear | PackedQuantLinear
INT8_WEIGHTS = (QuantLinear, PackedQuantLinear)
KERNEL_PACKED = (PackedLinear, PackedQuantLinear)  # a weight in our kernel's layout (linear's or linear_int8's)


def holds_bf16_weights(dtype: torch.dtype, device: torch.device, backend: str = "auto") -> bool:
    """Whether a bf16 checkpoint's projections, embedding and LM head are held in bf16 under `dtype` activations
    (see the module docstring): fp32 on the CPU, linear and label_logprobs on our kernels, a tier in
    tiers.BF16_WEIGHT_TIERS. PYSCORE_FP32_WEIGHTS=1 holds them in fp32 (the same bits; for A/B runs)."""
    if dtype != torch.float32 or device.type != "cpu" or os.environ.get("PYSCORE_FP32_WEIGHTS") == "1":
        return False
    paths = {_ext.path_for(op, device, dtype, backend)[1] for op in ("linear", "label_logprobs")}
    return paths == {"kernel"} and _ext.cpu_tier() in tiers.BF16_WEIGHT_TIERS


def reads_bf16_weight(x: torch.Tensor, weight_dtype: torch.dtype) -> bool:
    """Whether a weight of `weight_dtype` is read as a bf16 weight under fp32 activations `x` on the CPU (what
    holds_bf16_weights holds), which the kernels widen exactly: linear's and label_logprobs' one test of the pair."""
    return x.device.type == "cpu" and x.dtype == torch.float32 and weight_dtype == torch.bfloat16


def prepare_linear(w: LinearWeight, backend: str = "auto") -> LinearWeight:
    """The form of `w` that linear's path for its device and dtype reads: packed for our kernel, plain for torch's
    GEMM or the reference. A converted weight replaces the caller's (hold the result, drop `w`): weights live once.
    An int8 weight is packed for the int8 kernel where linear_int8's path is it (pyscore.ops.linear_int8), else held
    as rows."""
    if isinstance(w, INT8_WEIGHTS):
        return prepare_int8(w, backend)
    _, path = _ext.path_for("linear", w.device, w.dtype, backend)
    if path == "kernel" and isinstance(w, PlainLinear):
        return pack_linear(w.weight, w.bias, gated=w.gated)
    if path == "torch" and isinstance(w, PackedLinear):
        weight, bias = _native(w)
        return PlainLinear(weight.contiguous(), bias, w.gated)
    return w


def pack_linear(weight: torch.Tensor, bias: torch.Tensor | None = None, *, gated: bool = False) -> PackedLinear:
    """weight [N, K] (gated: [2I, K], gate rows then up rows) and bias [N] -> PackedLinear. Done once at load."""
    if weight.dim() != 2:
        raise ValueError(f"weight must be [N, K], got shape {tuple(weight.shape)}")
    rows, k = weight.shape
    if gated and rows % 2:
        raise ValueError(f"a gated weight must have an even number of rows [2I, K], got {rows}")
    if bias is not None and bias.shape != (rows,):
        raise ValueError(f"bias must be [{rows}], got {tuple(bias.shape)}")
    out_features = rows // 2 if gated else rows
    index = pack_index(rows, out_features, gated, weight.device)
    pack = PACK.get(weight.dtype, 1)
    k_pad = (k + pack - 1) // pack * pack
    padded = torch.nn.functional.pad(pack_rows(weight, index), (0, k_pad - k))  # [N_pad, K_pad]
    columns = padded.shape[0]
    packed = padded.view(columns // BLOCK_N, BLOCK_N, k_pad // pack, pack).permute(0, 2, 1, 3).contiguous()
    packed_bias = None if bias is None else pack_rows(bias.float(), index)
    return PackedLinear(packed, packed_bias, k, out_features, gated)


def prepare_int8(w: QuantLinear | PackedQuantLinear, backend: str = "auto") -> QuantLinear | PackedQuantLinear:
    """The form of an int8 weight its path reads: packed (the int8 kernel's layout, linear.h) or rows (torch's)."""
    kernel = linear_int8_path(w.device, backend) == "kernel"
    if kernel and isinstance(w, QuantLinear):
        index = pack_index(w.weight.shape[0], w.out_features, w.gated, w.device)
        packed = pack_linear(w.weight, w.bias, gated=w.gated)
        return PackedQuantLinear(packed.packed, by_block(pack_rows(w.scale, index)),
                                 by_block(pack_rows(w.bases(), index)), packed.bias, w.in_features, w.out_features,
                                 w.gated)
    if not kernel and isinstance(w, PackedQuantLinear):
        return w.rows()
    return w


def _check(x: torch.Tensor, w: LinearWeight, residual: torch.Tensor | None, out: torch.Tensor | None) -> None:
    device = w.device
    if x.dim() != 2 or x.shape[1] != w.in_features or x.stride(1) != 1:
        raise ValueError(f"x must be [M, K={w.in_features}] contiguous in its last dim, got shape {tuple(x.shape)} "
                         f"strides {x.stride()}")
    if (x.dtype != w.dtype and not reads_bf16_weight(x, w.dtype)) or x.device != device:
        raise ValueError(f"x must match the weight's dtype and device ({w.dtype}, {device}), got {x.dtype}, "
                         f"{x.device}")
    for name, t in (("residual", residual), ("out", out)):
        if t is None:
            continue
        if t.shape != (x.shape[0], w.out_features) or t.stride(1) != 1:
            raise ValueError(f"{name} must be [M, N]=({x.shape[0]}, {w.out_features}) contiguous in its last dim, "
                             f"got shape {tuple(t.shape)} strides {t.stride()}")
        if t.dtype != x.dtype or t.device != x.device:
            raise ValueError(f"{name} must match x's dtype and device ({x.dtype}, {x.device}), got {t.dtype}, "
                             f"{t.device}")


def linear(x: torch.Tensor, w: LinearWeight, residual: torch.Tensor | None = None, out: torch.Tensor | None = None,
           backend: str = "auto", rows_per_call: int = PREFILL_ROWS) -> torch.Tensor:
    """x [M, K] (row stride free) -> [M, N] (gated: silu(gate) * up, [M, I]) in x's dtype, plus residual [M, N]
    when given. out, when given, receives the result and may be the residual itself (an in-place residual add)
    but must not overlap x. backend: "auto" | "kernel" | "reference". rows_per_call: the torch path's fixed GEMM
    height (PREFILL_ROWS or DECODE_ROWS; a row's bits depend on it, never on the other rows)."""
    if isinstance(w, INT8_WEIGHTS):
        return linear_int8(x, w, residual, out, reference=backend == "reference")
    _check(x, w, residual, out)
    module, path = _ext.path_for("linear", x.device, x.dtype, backend)
    if path == "kernel" and isinstance(w, PlainLinear) and backend != "kernel":
        path = "torch"  # prepared for torch's GEMM (under another tier table): run it there, no repacking per call
    if path == "torch":
        weight, bias = w.unpacked() if isinstance(w, PlainLinear) else _native(w)
        weight, bias = weight.to(x.dtype), None if bias is None else bias.to(x.dtype)  # a bf16 weight: exact
        return _torch_linear(x, weight, bias, w.gated, residual, out, rows_per_call)
    if module is None:
        result = linear_ref(x, *w.unpacked(), gated=w.gated, residual=residual).to(x.dtype)
        return result if out is None else out.copy_(result)
    if not isinstance(w, PackedLinear):
        raise ValueError("linear's kernel backend reads a PackedLinear: prepare the weight with prepare_linear")
    if out is None:
        out = torch.empty(x.shape[0], w.out_features, dtype=x.dtype)
    module.linear(*kernel_args(x, w, residual, out))
    return out


def kernel_args(x: torch.Tensor, w: PackedLinear, residual: torch.Tensor | None, out: torch.Tensor) -> tuple:
    """The kernel's arguments for checked tensors (linear's, and a decode program's bound once)."""
    packed, bias, k, columns, n_out, gated = w._kernel_args
    return (x.data_ptr(), x.stride(0), packed, bias, 0 if residual is None else residual.data_ptr(),
            0 if residual is None else residual.stride(0), out.data_ptr(), out.stride(0), x.shape[0], k, columns,
            n_out, gated, _DTYPE_NAMES[x.dtype], w.dtype != x.dtype)


def _native(w: PackedLinear) -> tuple[torch.Tensor, torch.Tensor | None]:
    weight, bias = w.unpacked()
    return weight, None if bias is None else bias.to(w.dtype)


def _torch_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, gated: bool,
                  residual: torch.Tensor | None, out: torch.Tensor | None, rows: int) -> torch.Tensor:
    """torch's GEMM in x's dtype over calls of exactly `rows` rows (on the CPU; a GPU's cuBLAS runs one call, as
    before the CPU tiers), then the epilogue in that dtype (as transformers computes it: act(gate) * up,
    residual + y)."""
    m = x.shape[0]
    if x.device.type != "cpu":
        rows = max(m, 1)
    y = torch.empty(m, weight.shape[0], dtype=x.dtype, device=x.device)
    whole = m - m % rows
    for start in range(0, whole, rows):
        y[start : start + rows] = F.linear(x[start : start + rows], weight, bias)
    if whole < m:
        padded = x.new_zeros(rows, x.shape[1])
        padded[: m - whole] = x[whole:]
        y[whole:] = F.linear(padded, weight, bias)[: m - whole]
    if gated:
        y = silu_mul(y)  # the tier's fastest silu(gate) * up: the same recipe as transformers' in x's dtype
    if residual is not None:
        return torch.add(residual, y, out=out) if out is not None else residual + y
    return y if out is None else out.copy_(y)
