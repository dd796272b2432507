"""The decoder for Llama / Qwen2 / Qwen3 on packed tokens without padding:
embed -> N x (norm -> qkv -> [qk-norm] -> rope(positions) -> prefix_item_attention -> o -> norm -> SwiGLU)
-> final norm, returned only at the read-out rows. A second entry point decodes one token per running
sequence against its KV cache (generation)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pyscore.model.config import ModelConfig
from pyscore.model.packing import PackedBatch
from pyscore.model.rope import Rotary
from pyscore.model.weights import DecoderWeights
from pyscore.ops import AttentionPlan, SegmentTable, add_rms_norm, rotary_, silu_mul

# kv_sink(layer, k [T, Hkv, D], v [T, Hkv, D]) receives each layer's rotated keys and values (prefill).
KVSink = Callable[[int, torch.Tensor, torch.Tensor], None]
# attend(layer, q [T, Hq, D], k [T, Hkv, D], v [T, Hkv, D]) -> attention output [T, Hq, D].
Attend = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass
class KVCache:
    """One sequence's keys/values for all layers: k, v [L, capacity, Hkv, D]; `length` tokens are valid."""

    k: torch.Tensor
    v: torch.Tensor
    length: int = 0


class Decoder:
    """The residual stream x [T, H] is updated in place: each sublayer's output is added by the fused
    add_rms_norm that normalizes the input of the next one (the last MLP output by the final norm).
    op_backend "reference" runs every op as its torch reference (`pyscore.ops.reference`)."""

    def __init__(self, cfg: ModelConfig, weights: DecoderWeights, rotary: Rotary, op_backend: str = "auto"):
        self.cfg = cfg
        self.w = weights
        self.rotary = rotary
        self.op_backend = op_backend

    @property
    def dtype(self) -> torch.dtype:
        return self.w.embed.dtype

    @property
    def device(self) -> torch.device:
        return self.w.embed.device

    def _norm(self, x: torch.Tensor, weight: torch.Tensor, delta: torch.Tensor | None = None) -> torch.Tensor:
        """RMSNorm(x += delta) [T, H]; x is updated in place."""
        return add_rms_norm(x, weight, self.cfg.rms_norm_eps, delta=delta, backend=self.op_backend)

    def _layer(self, i: int, x: torch.Tensor, delta: torch.Tensor | None, positions: torch.Tensor,
               attend: Attend, rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer i on the residual stream x [T, H], which first takes the previous layer's pending MLP output
        `delta` (None before layer 0). Returns the stream and this layer's MLP output, pending in turn. With
        `rows` (the last layer: only read-out rows feed the output) everything after attention runs on those
        rows alone and the returned stream is x[rows]."""
        cfg, layer = self.cfg, self.w.layers[i]
        h = self._norm(x, layer.input_norm, delta)
        qkv = F.linear(h, layer.qkv, layer.qkv_bias).view(x.shape[0], -1, cfg.head_dim)  # [T, Hq + 2 Hkv, D]
        q, k, v = qkv.split([cfg.num_q_heads, cfg.num_kv_heads, cfg.num_kv_heads], dim=1)
        rotary_(q, k, positions, self.rotary.cos, self.rotary.sin, layer.q_norm, layer.k_norm, cfg.rms_norm_eps,
                backend=self.op_backend)  # in place, with Qwen3's qk-norm when present
        attn = attend(i, q, k, v).view(x.shape[0], -1)  # [T, Hq D]
        if rows is not None:
            x, attn = x[rows], attn[rows]
        h = self._norm(x, layer.post_norm, F.linear(attn, layer.o, layer.o_bias))
        act = silu_mul(F.linear(h, layer.gate_up, layer.gate_up_bias), backend=self.op_backend)  # [T, I]
        return x, F.linear(act, layer.down, layer.down_bias)

    @torch.inference_mode()
    def hidden_at(self, batch: PackedBatch, kv_sink: KVSink | None = None,
                  segments: SegmentTable | None = None) -> torch.Tensor:
        """Final-normed hidden states [R, H] at the batch's read-out rows. The segment table is validated and
        attention planned once here, for every layer; `segments` passes a table already validated and placed on
        the device (a CUDA graph's static buffer), else it is made from batch.segments."""
        cfg, device = self.cfg, self.device
        tokens, positions = batch.tokens.to(device), batch.positions.to(device)
        table = segments or SegmentTable.of(batch.segments, batch.num_tokens, device)
        plan = AttentionPlan(table, cfg.num_q_heads, cfg.num_kv_heads, cfg.head_dim, self.dtype, device,
                             self.op_backend)

        def attend(i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            if kv_sink is not None:
                kv_sink(i, k, v)
            return plan.run(q, k, v)

        x = self.w.embed[tokens]  # [T, H]
        delta = None
        readout, last = batch.readout.to(device), len(self.w.layers) - 1
        for i in range(len(self.w.layers)):
            x, delta = self._layer(i, x, delta, positions, attend, rows=readout if i == last else None)
        return self._norm(x, self.w.final_norm, delta)  # [R, H]

    @torch.inference_mode()
    def decode(self, tokens: torch.Tensor, caches: list[KVCache]) -> torch.Tensor:
        """One new token per sequence (tokens [B]) at position cache.length; appends to each cache and
        returns final-normed hidden states [B, H]."""
        device = self.device
        positions = torch.tensor([c.length for c in caches], dtype=torch.long, device=device)

        def attend(i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            outs = []
            for b, cache in enumerate(caches):
                n = cache.length
                cache.k[i, n], cache.v[i, n] = k[b], v[b]
                keys = cache.k[i, : n + 1].transpose(0, 1)[None]  # [1, Hkv, n+1, D]
                values = cache.v[i, : n + 1].transpose(0, 1)[None]
                o = F.scaled_dot_product_attention(q[b].unsqueeze(1)[None], keys, values, enable_gqa=True)
                outs.append(o[0, :, 0])  # [Hq, D]
            return torch.stack(outs)  # [B, Hq, D]

        x = self.w.embed[tokens.to(device)]  # [B, H]
        delta = None
        for i in range(len(self.w.layers)):
            x, delta = self._layer(i, x, delta, positions, attend)
        for cache in caches:
            cache.length += 1
        return self._norm(x, self.w.final_norm, delta)

    def new_cache(self, capacity: int) -> KVCache:
        shape = (self.cfg.num_layers, capacity, self.cfg.num_kv_heads, self.cfg.head_dim)
        return KVCache(torch.empty(shape, dtype=self.dtype, device=self.device),
                       torch.empty(shape, dtype=self.dtype, device=self.device))
