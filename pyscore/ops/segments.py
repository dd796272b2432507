"""The segment table of a packed batch, validated once per batch: one int32 row (start, length, prefix_start,
prefix_length) per item or prefix (see pyscore/model/packing.py and csrc/prefix_item_attention/params.h). Every
op that mixes tokens along the stream (prefix_item_attention today, linear attention next) plans from the same
validated table, so no layer checks it again and no device ever copies it back to the host."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, eq=False)
class SegmentTable:
    host: torch.Tensor  # [S, 4] int32, contiguous, on the CPU: what planners and the reference read
    device: torch.Tensor  # the same rows on the compute device (the host tensor itself on the CPU)
    num_tokens: int

    @classmethod
    def of(cls, segments: torch.Tensor, num_tokens: int, device: torch.device | str = "cpu",
           on_device: torch.Tensor | None = None) -> SegmentTable:
        """Validates `segments` (on any device; read on the host once) for a stream of num_tokens tokens and
        places a copy on `device`, or uses `on_device` when it already holds the same rows there (a CUDA graph's
        static buffer, which must not be copied back during capture). Raises ValueError naming what is wrong."""
        for name, t in (("segments", segments), ("on_device", on_device)):
            if t is None:
                continue
            if t.dtype != torch.int32 or t.dim() != 2 or t.shape[1] != 4:
                raise ValueError(f"{name} must be int32 [S, 4], got {t.dtype} {tuple(t.shape)}")
            if not t.is_contiguous():
                raise ValueError(f"{name} must be contiguous")
        host = segments.cpu()
        _check_rows(host, num_tokens)
        device = torch.device(device)
        if on_device is not None and (on_device.shape != host.shape or on_device.device.type != device.type):
            raise ValueError(f"on_device must be [S={host.shape[0]}, 4] on {device}, got {tuple(on_device.shape)} "
                             f"on {on_device.device}")
        if on_device is None:
            on_device = host if device.type == "cpu" else host.to(device)
        return cls(host=host, device=on_device, num_tokens=num_tokens)

    @property
    def num_segments(self) -> int:
        return int(self.host.shape[0])


def _check_rows(seg: torch.Tensor, num_tokens: int) -> None:
    starts, lengths, pstarts, plens = seg.unbind(1)
    if bool((lengths < 0).any() | (plens < 0).any() | (starts < 0).any() | (pstarts < 0).any()):
        raise ValueError("segments must have non-negative start, length, prefix_start and prefix_length")
    if bool(((starts + lengths) > num_tokens).any() | ((pstarts + plens) > num_tokens).any()):
        raise ValueError(f"segments must lie inside the {num_tokens}-token stream")
    if int(lengths.sum()) != num_tokens:
        raise ValueError(f"segments must cover the stream exactly once: lengths sum to {int(lengths.sum())}, "
                         f"T={num_tokens}")
    overlap = (plens > 0) & (pstarts < starts + lengths) & (starts < pstarts + plens)
    if bool(overlap.any()):
        raise ValueError(f"segment {int(overlap.nonzero()[0, 0])}: its prefix range must not overlap its own tokens")
