"""CUDA-graph prototype of the decoder's forward pass (`Decoder.hidden_at`) over bucketed batch shapes.

Why it can work with data-dependent segment tables: the CUDA prefix_item_attention plans its tiles *on the
device* from the segment table (once per forward pass, inside the captured region) and sizes its grid by an upper
bound computed from (T, S) alone, so a graph captured for one (T, S, R) replays correctly for any table of that
shape copied into the static buffers. Each table is validated on the host before it is copied in. A batch
is padded up to its bucket with extra plain-causal segments of dummy tokens (isolated from the real ones by the
segment mask, so real rows are unchanged) and extra read-out rows pointing at a dummy token.

This lives in bench/ until the engine adopts it (see the report of issue 6): it measures what graphs would buy
and checks that replayed results equal eager ones on changing tables."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pyscore.model.decoder import Decoder
from pyscore.model.packing import PackedBatch
from pyscore.ops import SegmentTable


def _next_pow2(n: int, minimum: int) -> int:
    p = minimum
    while p < n:
        p *= 2
    return p


def bucket_of(batch: PackedBatch, token_step: int = 128) -> tuple[int, int, int]:
    """(tokens, segments, read-out rows) of the bucket: segments and rows rounded up to powers of two (at least
    one pad segment), tokens to a multiple of token_step with room for one token per pad segment."""
    num_segments = _next_pow2(batch.segments.shape[0] + 1, 4)
    pad_segments = num_segments - batch.segments.shape[0]
    tokens = -(-(batch.num_tokens + pad_segments) // token_step) * token_step
    return tokens, num_segments, _next_pow2(batch.readout.shape[0], 1)


def pad_batch(batch: PackedBatch, tokens: int, segments: int, rows: int) -> PackedBatch:
    """`batch` padded to exactly (tokens, segments, rows): pad segments of one dummy token each, the last taking
    the remaining pad tokens; pad read-out rows read the first dummy token. Real rows keep their indices."""
    t, s, r = batch.num_tokens, batch.segments.shape[0], batch.readout.shape[0]
    pad_tokens, pad_segments = tokens - t, segments - s
    if pad_segments < 1 or pad_tokens < pad_segments or rows < r:
        raise ValueError(f"cannot pad T={t}, S={s}, R={r} to ({tokens}, {segments}, {rows}): need at least one pad "
                         "segment and one pad token per pad segment")
    lengths = [1] * (pad_segments - 1) + [pad_tokens - (pad_segments - 1)]
    starts = [t + i for i in range(pad_segments)]
    pad_rows = torch.tensor([[st, ln, st, 0] for st, ln in zip(starts, lengths, strict=True)], dtype=torch.int32)
    positions = torch.cat([torch.arange(ln) for ln in lengths])
    return PackedBatch(
        tokens=torch.cat([batch.tokens, torch.zeros(pad_tokens, dtype=torch.long)]),
        positions=torch.cat([batch.positions, positions]),
        segments=torch.cat([batch.segments, pad_rows]),
        readout=torch.cat([batch.readout, torch.full((rows - r,), t, dtype=torch.long)]),
        rows=batch.rows,
    )


@dataclass
class _Captured:
    graph: torch.cuda.CUDAGraph
    inputs: PackedBatch  # static device tensors the graph reads
    out: torch.Tensor  # [rows, H]: the graph writes here


class GraphedDecoder:
    """`hidden_at` through one CUDA graph per bucket (captured on first use). Not thread-safe, like the engine."""

    def __init__(self, decoder: Decoder, token_step: int = 128, capture_error_mode: str = "global") -> None:
        if decoder.device.type != "cuda":
            raise ValueError("CUDA graphs need the decoder on a CUDA device")
        self.decoder = decoder
        self.token_step = token_step
        self.capture_error_mode = capture_error_mode
        self.pool = torch.cuda.graph_pool_handle()
        self.graphs: dict[tuple[int, int, int], _Captured] = {}

    def hidden_at(self, batch: PackedBatch) -> torch.Tensor:
        """Final-normed hidden states [R, H] at the batch's read-out rows, as Decoder.hidden_at returns them: a view
        of the graph's static output, valid until the next call."""
        key = bucket_of(batch, self.token_step)
        padded = pad_batch(batch, *key)
        SegmentTable.of(padded.segments, padded.num_tokens)  # validated here: the graph trusts its buffers
        captured = self.graphs.get(key)
        if captured is None:
            captured = self.graphs[key] = self._capture(padded)
        else:
            for name in ("tokens", "positions", "segments", "readout"):
                getattr(captured.inputs, name).copy_(getattr(padded, name), non_blocking=True)
        captured.graph.replay()
        return captured.out[: batch.readout.shape[0]]

    def _capture(self, padded: PackedBatch) -> _Captured:
        device = self.decoder.device
        inputs = PackedBatch(tokens=padded.tokens.to(device), positions=padded.positions.to(device),
                             segments=padded.segments.to(device), readout=padded.readout.to(device))
        # The static segment buffer is the table's device copy, so the captured pass never copies it back.
        table = SegmentTable.of(padded.segments, padded.num_tokens, device, on_device=inputs.segments)
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            for _ in range(2):  # warm-up off the capture: loads kernels and cuBLAS handles
                self.decoder.hidden_at(inputs, segments=table)
        torch.cuda.current_stream(device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool, capture_error_mode=self.capture_error_mode):
            out = self.decoder.hidden_at(inputs, segments=table)
        return _Captured(graph=graph, inputs=inputs, out=out)
