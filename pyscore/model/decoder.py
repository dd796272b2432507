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
from pyscore.model.rope import Rotary, apply_rotary
from pyscore.model.weights import DecoderWeights, LayerWeights
from pyscore.ops import prefix_item_attention

# kv_sink(layer, k [T, Hkv, D], v [T, Hkv, D]) receives each layer's rotated keys and values (prefill).
KVSink = Callable[[int, torch.Tensor, torch.Tensor], None]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Llama's RMSNorm: statistics in fp32, scaled in the input dtype (bitwise the transformers recipe)."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


@dataclass
class KVCache:
    """One sequence's keys/values for all layers: k, v [L, capacity, Hkv, D]; `length` tokens are valid."""

    k: torch.Tensor
    v: torch.Tensor
    length: int = 0


class Decoder:
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

    def _qkv(self, layer: LayerWeights, x: torch.Tensor, positions: torch.Tensor):
        """x [T, H] -> rotated q [T, Hq, D], k [T, Hkv, D] and v [T, Hkv, D] (views where possible)."""
        cfg = self.cfg
        h = rms_norm(x, layer.input_norm, cfg.rms_norm_eps)
        qkv = F.linear(h, layer.qkv, layer.qkv_bias)  # [T, (Hq + 2 Hkv) D]
        qkv = qkv.view(x.shape[0], cfg.num_q_heads + 2 * cfg.num_kv_heads, cfg.head_dim)
        q, k, v = qkv.split([cfg.num_q_heads, cfg.num_kv_heads, cfg.num_kv_heads], dim=1)
        if cfg.qk_norm:
            q = rms_norm(q, layer.q_norm, cfg.rms_norm_eps)
            k = rms_norm(k, layer.k_norm, cfg.rms_norm_eps)
        cos, sin = self.rotary.tables(positions, x.dtype)
        return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v

    def _finish_layer(self, layer: LayerWeights, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """Residual adds around the output projection and the SwiGLU MLP. attn: [T, Hq D]."""
        x = x + F.linear(attn, layer.o, layer.o_bias)
        h = rms_norm(x, layer.post_norm, self.cfg.rms_norm_eps)
        gate, up = F.linear(h, layer.gate_up, layer.gate_up_bias).chunk(2, dim=-1)
        return x + F.linear(F.silu(gate) * up, layer.down, layer.down_bias)

    @torch.inference_mode()
    def hidden_at(self, batch: PackedBatch, kv_sink: KVSink | None = None) -> torch.Tensor:
        """Final-normed hidden states [R, H] at the batch's read-out rows."""
        device = self.device
        tokens, positions = batch.tokens.to(device), batch.positions.to(device)
        segments = batch.segments if device.type == "cpu" else batch.segments.to(device)
        x = self.w.embed[tokens]  # [T, H]
        for i, layer in enumerate(self.w.layers):
            q, k, v = self._qkv(layer, x, positions)
            if kv_sink is not None:
                kv_sink(i, k, v)
            attn = prefix_item_attention(q, k, v, segments, backend=self.op_backend)  # [T, Hq, D]
            x = self._finish_layer(layer, x, attn.view(x.shape[0], -1))
        return rms_norm(x[batch.readout.to(device)], self.w.final_norm, self.cfg.rms_norm_eps)

    @torch.inference_mode()
    def decode(self, tokens: torch.Tensor, caches: list[KVCache]) -> torch.Tensor:
        """One new token per sequence (tokens [B]) at position cache.length; appends to each cache and
        returns final-normed hidden states [B, H]."""
        device = self.device
        positions = torch.tensor([c.length for c in caches], dtype=torch.long, device=device)
        x = self.w.embed[tokens.to(device)]  # [B, H]
        for i, layer in enumerate(self.w.layers):
            q, k, v = self._qkv(layer, x, positions)  # [B, H*, D]
            outs = []
            for b, cache in enumerate(caches):
                n = cache.length
                cache.k[i, n], cache.v[i, n] = k[b], v[b]
                keys = cache.k[i, : n + 1].transpose(0, 1)[None]  # [1, Hkv, n+1, D]
                values = cache.v[i, : n + 1].transpose(0, 1)[None]
                o = F.scaled_dot_product_attention(q[b].unsqueeze(1)[None], keys, values, enable_gqa=True)
                outs.append(o[0, :, 0])  # [Hq, D]
            x = self._finish_layer(layer, x, torch.stack(outs).view(len(caches), -1))
        for cache in caches:
            cache.length += 1
        return rms_norm(x, self.w.final_norm, self.cfg.rms_norm_eps)

    def new_cache(self, capacity: int) -> KVCache:
        shape = (self.cfg.num_layers, capacity, self.cfg.num_kv_heads, self.cfg.head_dim)
        return KVCache(torch.empty(shape, dtype=self.dtype, device=self.device),
                       torch.empty(shape, dtype=self.dtype, device=self.device))
