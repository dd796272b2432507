"""linear in int8 (W8A8): x @ W.T (+ bias) with linear's epilogue (SiLU-mul of a gated gate_up, a residual add),
the weight held in int8 per output channel and each x row quantized to int8 as it arrives.

Contract (the same bits on every path; `linear_int8_ref` is the definition):
- Weight (once, at load: `quantize_linear`): per output row n, s_w[n] = max|W[n]| / 127 in fp32 and
  q_w[n] = round_half_even(W[n] / s_w[n]) in [-127, 127] (a zero row: s_w = 0, q_w = 0). Bias in fp32.
- Activations (per call, per row: `quantize_rows`): s_x[m] = max|x[m]| / 127, q_x[m] = round_half_even(x[m] *
  (127 / max|x[m]|)) in [-127, 127], in fp32 from x's dtype, each division one correctly rounded fp32 division (a
  zero row: 0). A row's scale is its own: no other row
  of the call changes it.
- Sums in int32, exactly: q_x[m] . q_w[n] is an integer of at most 127 * 127 * K, so every GEMM that sums integers
  exactly gives the same sums whatever its blocking, threads or the rows beside. Hence, with the per-row scales,
  a row's result never depends on its batch-mates (batch invariance) and the multi-item layout gives the
  single-item bits (MIS = SIS), as in the model's dtype.
- Epilogue in fp32: v = (float(sum) * s_x[m]) * s_w[n] + bias[n]; gated: silu(v_gate) * v_up (pyscore.ops.silu_mul,
  the tier's); then + residual; rounded once to x's dtype.

Paths. Where the tier table (pyscore/ops/tiers.py, op "linear_int8") runs our kernel, the weight is packed
(`PackedQuantLinear`, csrc/linear/linear.h's int8 section) and one C++ call quantizes the rows, sums the quads
(AVX512-VNNI vpdpbusd, or the AVX2 / NEON layers' exact widening products) and runs linear's epilogue in registers;
its gated epilogue is the tier's silu_mul kernel's arithmetic, so the bits are the contract's. Elsewhere the weight
is held as rows and torch runs it, the path chosen once per process (`int_path`): torch._int_mm (oneDNN's int8
GEMM) where it sums exactly on this CPU (it does with VNNI; without it oneDNN's u8 x s8 pairs saturate in 16
bits: checked at first use on worst-case operands, `_int_mm_is_exact`), else fp32 GEMMs over K chunks of at most
EXACT_FP32_K (every partial sum an integer below 2^24, so exact), their int32 sums added. Attention, norms and the
label read-out stay in the model's dtype."""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pyscore.ops import _ext
from pyscore.ops.packing import BLOCK_N, original_rows
from pyscore.ops.silu_mul import silu_mul

QMAX = 127
# K per fp32 GEMM on the fallback path: 127 * 127 * 1040 < 2^24, so every partial sum is an exact fp32 integer.
EXACT_FP32_K = 1024


class RowMajorWeight:
    """What a weight held as [N, K] rows (gated: [2I, K], gate rows then up rows) in `weight` says of itself: the
    facts PlainLinear (pyscore.ops.linear) and QuantLinear share."""

    weight: torch.Tensor
    gated: bool

    @property
    def dtype(self) -> torch.dtype:
        return self.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.weight.device

    @property
    def in_features(self) -> int:
        return self.weight.shape[1]

    @property
    def out_features(self) -> int:
        return self.weight.shape[0] // 2 if self.gated else self.weight.shape[0]


@dataclass(frozen=True)
class QuantLinear(RowMajorWeight):
    """A [N, K] weight (gated: [2I, K], gate rows then up rows) in int8 with its per-row fp32 scales [N] and fp32
    bias [N] (or None)."""

    weight: torch.Tensor  # int8 [N, K]
    scale: torch.Tensor  # fp32 [N]
    bias: torch.Tensor | None
    gated: bool = False

    def unpacked(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The dequantized weight [N, K] (fp32) and bias: what the int8 weight stands for."""
        return self.weight.float() * self.scale[:, None], self.bias


@dataclass(frozen=True)
class PackedQuantLinear:
    """An int8 weight in the int8 kernel's layout: codes [N_pad / 64, K4 / 4, 64, 4] int8, and per packed column the
    fp32 scale, 128 * the sum of its codes (int32) and the fp32 bias (or None), zero on padding columns."""

    packed: torch.Tensor
    scale: torch.Tensor
    sums: torch.Tensor
    bias: torch.Tensor | None
    in_features: int
    out_features: int
    gated: bool

    def __post_init__(self):
        # The kernel arguments that never change, computed once (a decode step makes ~100 calls).
        object.__setattr__(self, "_kernel_args", (
            self.packed.data_ptr(), self.scale.data_ptr(), self.sums.data_ptr(),
            0 if self.bias is None else self.bias.data_ptr(), self.in_features, self.packed.shape[0] * BLOCK_N,
            self.out_features, self.gated))

    dtype = torch.int8

    @property
    def device(self) -> torch.device:
        return self.packed.device

    def rows(self) -> QuantLinear:
        """The same weight as rows (QuantLinear), for torch's paths and the reference."""
        blocks, steps, _, pack = self.packed.shape
        codes = self.packed.permute(0, 2, 1, 3).reshape(blocks * BLOCK_N, steps * pack)[:, : self.in_features]
        where = original_rows(self.out_features, self.gated, codes.device)
        return QuantLinear(codes[where].contiguous(), self.scale[where].contiguous(),
                           None if self.bias is None else self.bias[where].contiguous(), self.gated)

    def unpacked(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        return self.rows().unpacked()


def _quantize(t: torch.Tensor, inverse: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of t (fp32) -> (int8 rows, fp32 scales), the contract's rounding (inverse: x times 127 / max, else w
    divided by its scale)."""
    amax = t.abs().amax(dim=1)
    scale = amax / QMAX
    if inverse:
        # torch.full_like(amax, QMAX) / amax, not QMAX / amax: torch computes the latter as amax.reciprocal() * QMAX,
        # two roundings; the kernel's 127.0f / amax is one.
        factor = torch.where(amax > 0, torch.full_like(amax, QMAX) / amax, torch.zeros_like(amax))
        q = torch.round(t * factor[:, None])
    else:
        q = torch.where(scale[:, None] > 0, torch.round(t / scale.clamp_min(torch.finfo(t.dtype).tiny)[:, None]),
                        torch.zeros_like(t))
    return q.clamp_(-QMAX, QMAX).to(torch.int8), scale


def quantize_linear(weight: torch.Tensor, bias: torch.Tensor | None = None, *, gated: bool = False) -> QuantLinear:
    """weight [N, K] (any float dtype) -> QuantLinear. Done once at load; the caller drops the source."""
    if weight.dim() != 2:
        raise ValueError(f"weight must be [N, K], got shape {tuple(weight.shape)}")
    if gated and weight.shape[0] % 2:
        raise ValueError(f"a gated weight must have an even number of rows [2I, K], got {weight.shape[0]}")
    q, scale = _quantize(weight.float(), inverse=False)
    return QuantLinear(q.contiguous(), scale.contiguous(), None if bias is None else bias.float().contiguous(), gated)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (int8 [M, K], fp32 scales [M]): each row on its own."""
    return _quantize(x.float(), inverse=True)


def _sums_fp32(qx: torch.Tensor, qw: torch.Tensor) -> torch.Tensor:
    """Exact int32 sums qx @ qw.T through fp32 GEMMs over K chunks of EXACT_FP32_K."""
    sums = torch.zeros(qx.shape[0], qw.shape[0], dtype=torch.int32, device=qx.device)
    for k0 in range(0, qx.shape[1], EXACT_FP32_K):
        chunk = F.linear(qx[:, k0 : k0 + EXACT_FP32_K].float(), qw[:, k0 : k0 + EXACT_FP32_K].float())
        sums += chunk.to(torch.int32)
    return sums


def _sums_int_mm(qx: torch.Tensor, qw: torch.Tensor) -> torch.Tensor:
    return torch._int_mm(qx, qw.t())  # the weight [N, K] read as [K, N] column-major: no copy


@functools.cache
def _int_mm_is_exact(device_type: str) -> bool:
    """Whether torch._int_mm sums exactly here: worst-case operands (every product +-127 * 127, signs alternating
    and not) at the row counts of a decode step and a prefill, against the fp32-chunk sums."""
    try:
        for m, k, n in ((1, 576, 64), (8, 1024, 96), (40, 2048, 64), (300, 576, 128)):
            a = torch.full((m, k), QMAX, dtype=torch.int8, device=device_type)
            a[:, 1::2] = -QMAX
            b = torch.full((n, k), QMAX, dtype=torch.int8, device=device_type)
            b[1::2, 1::2] = -QMAX
            b[::2, ::2] = -QMAX
            if not torch.equal(_sums_int_mm(a, b), _sums_fp32(a, b)):
                return False
    except (RuntimeError, NotImplementedError):  # no int8 GEMM on this build or device
        return False
    return True


def int_path(device: torch.device) -> str:
    """The path that sums int8 products on `device`: "torch._int_mm" or "fp32 chunks" (see the module docstring)."""
    return "torch._int_mm" if _int_mm_is_exact(device.type) else "fp32 chunks"


def linear_int8_path(device: torch.device, backend: str = "auto") -> str:
    """"kernel" where the tier table runs the int8 kernel for this device (its choice is per tier, the same for
    fp32 and bf16 activations), else "torch" (or "reference")."""
    return _ext.path_for("linear_int8", device, torch.float32, backend)[1]


def describe(device: torch.device) -> str:
    """The int8 path for a log line and ModelInfo.ops."""
    if linear_int8_path(device) == "kernel":
        return ("int8 W8A8 (our kernel: per-row activation scales quantized in its prologue, exact int32 sums, "
                f"linear's epilogue; {_ext.cpu_tier()}'s layer)")
    why = ("oneDNN's int8 GEMM, checked exact on this CPU" if int_path(device) == "torch._int_mm" else
           "torch._int_mm is not exact here (no VNNI: 16-bit pair sums saturate); fp32 GEMMs over K chunks of "
           f"{EXACT_FP32_K}, exact")
    return f"int8 W8A8 ({int_path(device)}: {why}; per-row activation scales, int32 sums)"


def _epilogue(sums: torch.Tensor, sx: torch.Tensor, w: QuantLinear, residual: torch.Tensor | None,
              dtype: torch.dtype) -> torch.Tensor:
    """The contract's epilogue, in place on one fp32 buffer (the same bits as out-of-place: each op is exact
    elementwise IEEE arithmetic); the SiLU-mul is the tier's silu_mul, as on linear's torch path."""
    v = sums.to(torch.float32)
    v.mul_(sx[:, None]).mul_(w.scale)
    if w.bias is not None:
        v.add_(w.bias)
    if w.gated:
        v = silu_mul(v)
    if residual is not None:
        v.add_(residual)  # a bf16 residual widens exactly
    return v.to(dtype)


# What `observing` installs: called with each call's weight and x before the call (a calibration pass's recorder).
_OBSERVER: ContextVar[Callable[[object, torch.Tensor], None] | None] = ContextVar("linear_int8_observer",
                                                                                    default=None)


@contextmanager
def observing(observer: Callable[[object, torch.Tensor], None]) -> Iterator[None]:
    """Inside the block, every linear_int8 call in this context first calls observer(w, x) (pyscore.model.smoothing's
    calibration reads each projection's input through it)."""
    token = _OBSERVER.set(observer)
    try:
        yield
    finally:
        _OBSERVER.reset(token)


def linear_int8(x: torch.Tensor, w: QuantLinear | PackedQuantLinear, residual: torch.Tensor | None = None,
                out: torch.Tensor | None = None, *, reference: bool = False) -> torch.Tensor:
    """x [M, K] (fp32 / bf16 / fp16) -> [M, N] (gated: [M, I]) in x's dtype, + residual; out receives it when given
    (it may be the residual). reference: the fp32-chunk sums whatever the device (the definition)."""
    if (observer := _OBSERVER.get()) is not None:
        observer(w, x)
    module = None
    if isinstance(w, PackedQuantLinear):
        module = None if reference else _ext.kernel_for("linear_int8", x.device, x.dtype)
        if module is None:
            w = w.rows()  # prepared for the kernel under another tier table: the torch path, unpacked per call
    if x.dim() != 2 or x.shape[1] != w.in_features:
        raise ValueError(f"x must be [M, K={w.in_features}], got shape {tuple(x.shape)}")
    if x.device != w.device or not x.is_floating_point():
        raise ValueError(f"x must be a float tensor on the weight's device {w.device}, got {x.dtype}, {x.device}")
    for name, t in (("residual", residual), ("out", out)):
        if t is not None and (t.shape != (x.shape[0], w.out_features) or t.dtype != x.dtype):
            raise ValueError(f"{name} must be [M, N]=({x.shape[0]}, {w.out_features}) in {x.dtype}, got "
                             f"{tuple(t.shape)} {t.dtype}")
    if module is not None:
        if x.stride(1) != 1 or any(t is not None and t.stride(1) != 1 for t in (residual, out)):
            raise ValueError("the int8 kernel reads x, residual and out contiguous in their last dim")
        if out is None:
            out = torch.empty(x.shape[0], w.out_features, dtype=x.dtype, device=x.device)
        module.linear_int8(*kernel_args(x, w, residual, out))
        return out
    qx, sx = quantize_rows(x)
    use_int_mm = not reference and int_path(x.device) == "torch._int_mm"
    sums = _sums_int_mm(qx, w.weight) if use_int_mm else _sums_fp32(qx, w.weight)
    result = _epilogue(sums, sx, w, residual, x.dtype)
    return result if out is None else out.copy_(result)


def kernel_args(x: torch.Tensor, w: PackedQuantLinear, residual: torch.Tensor | None, out: torch.Tensor) -> tuple:
    """The int8 kernel's arguments for checked tensors."""
    packed, scale, sums, bias, k, columns, n_out, gated = w._kernel_args
    return (x.data_ptr(), x.stride(0), packed, scale, sums, bias, 0 if residual is None else residual.data_ptr(),
            0 if residual is None else residual.stride(0), out.data_ptr(), out.stride(0), x.shape[0], k, columns,
            n_out, gated, _ext.torch_dtype_name(x.dtype))


def linear_int8_ref(x: torch.Tensor, w: QuantLinear | PackedQuantLinear,
                    residual: torch.Tensor | None = None) -> torch.Tensor:
    """The definition, independent of every path: float64 sums of the quantized operands (exact: < 2^53)."""
    if isinstance(w, PackedQuantLinear):
        w = w.rows()
    qx, sx = quantize_rows(x)
    sums = (qx.double() @ w.weight.double().t()).to(torch.int32)
    return _epilogue(sums, sx, w, residual, x.dtype)
