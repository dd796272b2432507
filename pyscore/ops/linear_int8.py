"""linear in int8 (W8A8): x @ W.T (+ bias) with linear's epilogue (SiLU-mul of a gated gate_up, a residual add),
the weight held in int8 and each x row quantized to int8 as it arrives, both with one scale per GROUP input channels.

Contract (the same bits on every path; `linear_int8_ref` is the definition). K runs in G = ceil(K / GROUP) groups
of GROUP channels (the last one shorter where GROUP does not divide K):
- Weight (once, at load: `quantize_linear`): per output row n and group g, s_w[n, g] = max|W[n, g]| / 127 in fp32
  and q_w[n, g] = round_half_even(W[n, g] / s_w[n, g]) in [-127, 127] (a zero group: s_w = 0, q_w = 0). Bias in
  fp32.
- Activations (per call, per row and group: `quantize_rows`): s_x[m, g] = max|x[m, g]| / 127, q_x[m, g] =
  round_half_even(x[m, g] * (127 / max|x[m, g]|)) in [-127, 127], in fp32 from x's dtype, each division one
  correctly rounded fp32 division (a zero group: 0). A row's scales are its own: no other row of the call changes
  them.
- Sums per group in int32, exactly: S_g[m, n] = q_x[m, g] . q_w[n, g] is an integer of at most 127 * 127 * GROUP
  (< 2^24, so its fp32 is exact too), whatever the blocking, threads or the rows beside. The groups are folded in K
  order: v = 0, then v = fma(float(S_g) * s_w[n, g], s_x[m, g], v) for g = 0, 1, ... (each * one fp32 rounding,
  the fma one). Hence a row's result never depends on its batch-mates (batch invariance) and the multi-item layout
  gives the single-item bits (MIS = SIS), as in the model's dtype.
- Epilogue in fp32: v + bias[n]; gated: silu(v_gate) * v_up (pyscore.ops.silu_mul, the tier's); then + residual;
  rounded once to x's dtype.
Why groups: a per-row activation scale gives a row's many small values a few of int8's levels beside its outliers;
per GROUP channels, with SmoothQuant at load (pyscore.model.smoothing), the drift in P(label) halves against per-row
and per-channel scales (docs' Guarantees page, bench/results/int8/).

Paths. Where the tier table (pyscore/ops/tiers.py, op "linear_int8") runs our kernel, the weight is packed
(`PackedQuantLinear`, csrc/linear/linear.h's int8 section) and one C++ call quantizes the rows, sums each group's
quads (AVX512-VNNI vpdpbusd, or the AVX2 / NEON layers' exact widening products), folds the groups and runs linear's
epilogue; its gated epilogue is the tier's silu_mul kernel's arithmetic, so the bits are the contract's. Elsewhere
the weight is held as rows and torch runs it: the group sums as fp32 batched GEMMs (every partial sum an integer
below 2^24, so exact) and the fold with `fma32`. Attention, norms and the label read-out stay in the model's
dtype."""

from __future__ import annotations

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
# Input channels per scale. 32 reached the same drift in simulation at twice the kernel's folds; 128 (a tail group of
# 64 on SmolLM2's K = 576) three times the drift (bench/results/int8/int8_drift_groups_zen4.txt).
GROUP = 64
# Rows of the torch path's group sums [G, rows, N] per batched GEMM: at most this many fp32 elements at once.
_SUMS_ELEMENTS = 1 << 26


def groups_of(k: int) -> int:
    """The groups of K input channels."""
    return (k + GROUP - 1) // GROUP


def grouped(t: torch.Tensor) -> torch.Tensor:
    """Rows [R, K] as [R, G, GROUP], the last group zero-padded."""
    return F.pad(t, (0, -t.shape[1] % GROUP)).view(t.shape[0], -1, GROUP)


def fma32(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """fp32 a * b + c rounded once, as the kernels' FMA. In float64 the product is exact and the sum rounds once;
    rounding that to fp32 is the single rounding except where it lands on a tie between two fp32 values, and there
    the sum's exact error (TwoSum) says on which side the true value lies."""
    p, c64 = a.double() * b.double(), c.double()
    s = p + c64
    virtual_p = s - c64
    err = (p - virtual_p) + (c64 - (s - virtual_p))
    r = s.float()
    side = torch.where(s > r.double(), torch.inf, -torch.inf).float()
    neighbour = torch.nextafter(r, side)
    tie = (r.double() + neighbour.double()) * 0.5 == s
    toward = tie & (err != 0) & ((err > 0) == (neighbour > r))
    return torch.where(toward, neighbour, r)


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
    """A [N, K] weight (gated: [2I, K], gate rows then up rows) in int8 with its fp32 scales per row and group
    [N, G] and fp32 bias [N] (or None)."""

    weight: torch.Tensor  # int8 [N, K]
    scale: torch.Tensor  # fp32 [N, G]
    bias: torch.Tensor | None
    gated: bool = False

    def unpacked(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The dequantized weight [N, K] (fp32) and bias: what the int8 weight stands for."""
        k = self.in_features
        return self.weight.float() * self.scale.repeat_interleave(GROUP, dim=1)[:, :k], self.bias

    def bases(self) -> torch.Tensor:
        """-128 * each row's and group's code sum [N, G] (int32): where a kernel whose x codes are offset by 128
        starts a group's sums."""
        return grouped(self.weight).sum(dim=2, dtype=torch.int32) * -128


@dataclass(frozen=True)
class PackedQuantLinear:
    """An int8 weight in the int8 kernel's layout: codes [N_pad / 64, K4 / 4, 64, 4] int8; per packed column and
    group the fp32 scale and QuantLinear.bases' sum base (int32), each [N_pad / 64, G, 64]; per packed column the
    fp32 bias (or None); zero on padding columns."""

    packed: torch.Tensor
    scale: torch.Tensor
    base: torch.Tensor
    bias: torch.Tensor | None
    in_features: int
    out_features: int
    gated: bool

    def __post_init__(self):
        # The kernel arguments that never change, computed once (a decode step makes ~100 calls).
        object.__setattr__(self, "_kernel_args", (
            self.packed.data_ptr(), self.scale.data_ptr(), self.base.data_ptr(),
            0 if self.bias is None else self.bias.data_ptr(), self.in_features, GROUP, self.packed.shape[0] * BLOCK_N,
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
        scale = self.scale.transpose(1, 2).reshape(blocks * BLOCK_N, -1)
        return QuantLinear(codes[where].contiguous(), scale[where].contiguous(),
                           None if self.bias is None else self.bias[where].contiguous(), self.gated)

    def unpacked(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        return self.rows().unpacked()


def by_block(t: torch.Tensor) -> torch.Tensor:
    """Per packed column and group [N_pad, G] -> the kernel's [N_pad / 64, G, 64]."""
    return t.view(t.shape[0] // BLOCK_N, BLOCK_N, -1).transpose(1, 2).contiguous()


def _quantize(t: torch.Tensor, inverse: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of t (fp32) -> (int8 rows, fp32 scales per group [R, G]), the contract's rounding (inverse: x times
    127 / max, else w divided by its scale)."""
    parts = grouped(t)
    amax = parts.abs().amax(dim=2)
    scale = amax / QMAX
    if inverse:
        # torch.full_like(amax, QMAX) / amax, not QMAX / amax: torch computes the latter as amax.reciprocal() * QMAX,
        # two roundings; the kernel's 127.0f / amax is one.
        factor = torch.where(amax > 0, torch.full_like(amax, QMAX) / amax, torch.zeros_like(amax))
        q = torch.round(parts * factor[:, :, None])
    else:
        divisor = scale.clamp_min(torch.finfo(t.dtype).tiny)[:, :, None]
        q = torch.where(scale[:, :, None] > 0, torch.round(parts / divisor), torch.zeros_like(parts))
    codes = q.clamp_(-QMAX, QMAX).to(torch.int8).view(t.shape[0], -1)[:, : t.shape[1]]
    return codes.contiguous(), scale


def quantize_linear(weight: torch.Tensor, bias: torch.Tensor | None = None, *, gated: bool = False) -> QuantLinear:
    """weight [N, K] (any float dtype) -> QuantLinear. Done once at load; the caller drops the source."""
    if weight.dim() != 2:
        raise ValueError(f"weight must be [N, K], got shape {tuple(weight.shape)}")
    if gated and weight.shape[0] % 2:
        raise ValueError(f"a gated weight must have an even number of rows [2I, K], got {weight.shape[0]}")
    q, scale = _quantize(weight.float(), inverse=False)
    return QuantLinear(q, scale.contiguous(), None if bias is None else bias.float().contiguous(), gated)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (int8 [M, K], fp32 scales [M, G]): each row on its own."""
    return _quantize(x.float(), inverse=True)


def group_sums(qx: torch.Tensor, qw: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Each group's sums qx[:, g] . qw[:, g] as [G, M, N] in dtype, exactly (fp32: every partial sum an integer below
    127 * 127 * GROUP < 2^24; float64 below 2^53)."""
    a = grouped(qx.to(dtype)).transpose(0, 1)  # [G, M, GROUP]
    b = grouped(qw.to(dtype)).permute(1, 2, 0)  # [G, GROUP, N]
    return torch.bmm(a, b)


def fold_groups(qx: torch.Tensor, sx: torch.Tensor, w: QuantLinear, dtype: torch.dtype) -> torch.Tensor:
    """v [M, N] in fp32: the contract's fold of the group sums (computed in dtype), rows in chunks so that the sums
    stay within _SUMS_ELEMENTS."""
    m, n = qx.shape[0], w.weight.shape[0]
    rows = max(1, _SUMS_ELEMENTS // max(1, groups_of(qx.shape[1]) * n))
    v = torch.zeros(m, n, dtype=torch.float32, device=qx.device)
    for m0 in range(0, m, rows):
        sums = group_sums(qx[m0 : m0 + rows], w.weight, dtype)
        part = v[m0 : m0 + rows]
        for g in range(sums.shape[0]):
            part.copy_(fma32(sums[g].float() * w.scale[:, g], sx[m0 : m0 + rows, g, None].expand_as(part), part))
    return v


def linear_int8_path(device: torch.device, backend: str = "auto") -> str:
    """"kernel" where the tier table runs the int8 kernel for this device (its choice is per tier, the same for
    fp32 and bf16 activations), else "torch" (or "reference")."""
    return _ext.path_for("linear_int8", device, torch.float32, backend)[1]


def describe(device: torch.device) -> str:
    """The int8 path for a log line and ModelInfo.ops."""
    if linear_int8_path(device) == "kernel":
        return (f"int8 W8A8 (our kernel: scales per {GROUP} input channels, the activations' quantized in its "
                f"prologue, exact int32 sums per group, linear's epilogue; {_ext.cpu_tier()}'s layer)")
    return (f"int8 W8A8 (torch: scales per {GROUP} input channels, exact group sums as fp32 batched GEMMs, folded "
            "with an exact fp32 fma)")


def _epilogue(v: torch.Tensor, w: QuantLinear, residual: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """The contract's epilogue, in place on the fp32 fold (the same bits as out-of-place: each op is exact
    elementwise IEEE arithmetic); the SiLU-mul is the tier's silu_mul, as on linear's torch path."""
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
    (it may be the residual). reference: linear_int8_ref's arithmetic whatever the device."""
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
    result = _epilogue(fold_groups(qx, sx, w, torch.float64 if reference else torch.float32), w, residual, x.dtype)
    return result if out is None else out.copy_(result)


def kernel_args(x: torch.Tensor, w: PackedQuantLinear, residual: torch.Tensor | None, out: torch.Tensor) -> tuple:
    """The int8 kernel's arguments for checked tensors."""
    packed, scale, base, bias, k, group, columns, n_out, gated = w._kernel_args
    return (x.data_ptr(), x.stride(0), packed, scale, base, bias, 0 if residual is None else residual.data_ptr(),
            0 if residual is None else residual.stride(0), out.data_ptr(), out.stride(0), x.shape[0], k, group,
            columns, n_out, gated, _ext.torch_dtype_name(x.dtype))


def linear_int8_ref(x: torch.Tensor, w: QuantLinear | PackedQuantLinear,
                    residual: torch.Tensor | None = None) -> torch.Tensor:
    """The definition, independent of every path: float64 group sums of the quantized operands (exact: < 2^53),
    folded with fma32."""
    if isinstance(w, PackedQuantLinear):
        w = w.rows()
    qx, sx = quantize_rows(x)
    return _epilogue(fold_groups(qx, sx, w, torch.float64), w, residual, x.dtype)
