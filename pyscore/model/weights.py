"""Decoder weights in the layout the runner wants: q/k/v fused into one projection and gate/up into another,
so each layer runs three large matmuls instead of seven. Read from a Hugging Face state dict (safetensors)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from pyscore.model.config import ModelConfig


@dataclass
class LayerWeights:
    input_norm: torch.Tensor  # [H]
    qkv: torch.Tensor  # [(Hq + 2 Hkv) D, H]
    qkv_bias: torch.Tensor | None
    q_norm: torch.Tensor | None  # [D] (Qwen3)
    k_norm: torch.Tensor | None
    o: torch.Tensor  # [H, Hq D]
    o_bias: torch.Tensor | None
    post_norm: torch.Tensor  # [H]
    gate_up: torch.Tensor  # [2 I, H]
    gate_up_bias: torch.Tensor | None
    down: torch.Tensor  # [H, I]
    down_bias: torch.Tensor | None


@dataclass
class DecoderWeights:
    embed: torch.Tensor  # [V, H]
    layers: list[LayerWeights]
    final_norm: torch.Tensor  # [H]
    lm_head: torch.Tensor | None  # [V, H] (causal LM; the embedding itself when tied)
    score_head: torch.Tensor | None  # [C, H] (classifier)
    score_bias: torch.Tensor | None


def _cat_optional(parts: list[torch.Tensor | None]) -> torch.Tensor | None:
    present = [p for p in parts if p is not None]
    if not present:
        return None
    if len(present) != len(parts):
        raise ValueError("bias present on some but not all fused projections")
    return torch.cat(present)


def build_weights(cfg: ModelConfig, get: Callable[[str], torch.Tensor | None], dtype: torch.dtype,
                  device: torch.device) -> DecoderWeights:
    """`get(name)` returns a tensor of the HF state dict, or None when absent."""

    def need(name: str) -> torch.Tensor:
        t = get(name)
        if t is None:
            raise ValueError(f"checkpoint is missing weight {name!r}")
        return t

    def cast(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t.to(device=device, dtype=dtype).contiguous()

    layers = []
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        attn = p + "self_attn."
        layers.append(LayerWeights(
            input_norm=cast(need(p + "input_layernorm.weight")),
            qkv=cast(torch.cat([need(attn + f"{n}_proj.weight") for n in "qkv"])),
            qkv_bias=cast(_cat_optional([get(attn + f"{n}_proj.bias") for n in "qkv"])),
            q_norm=cast(get(attn + "q_norm.weight")) if cfg.qk_norm else None,
            k_norm=cast(get(attn + "k_norm.weight")) if cfg.qk_norm else None,
            o=cast(need(attn + "o_proj.weight")),
            o_bias=cast(get(attn + "o_proj.bias")),
            post_norm=cast(need(p + "post_attention_layernorm.weight")),
            gate_up=cast(torch.cat([need(p + "mlp.gate_proj.weight"), need(p + "mlp.up_proj.weight")])),
            gate_up_bias=cast(_cat_optional([get(p + "mlp.gate_proj.bias"), get(p + "mlp.up_proj.bias")])),
            down=cast(need(p + "mlp.down_proj.weight")),
            down_bias=cast(get(p + "mlp.down_proj.bias")),
        ))
    embed = cast(need("model.embed_tokens.weight"))
    lm_head = score_head = score_bias = None
    if cfg.is_classifier:
        score_head, score_bias = cast(need("score.weight")), cast(get("score.bias"))
    else:
        lm_head = embed if cfg.tie_word_embeddings else cast(need("lm_head.weight"))
    return DecoderWeights(embed=embed, layers=layers, final_norm=cast(need("model.norm.weight")),
                          lm_head=lm_head, score_head=score_head, score_bias=score_bias)
