"""Decoder weights in the layout the runner wants: q/k/v fused into one projection and gate/up into another,
so each layer runs three large matmuls instead of seven (a Qwen3.5 linear-attention layer: its four input
projections fused into one). Every projection is a `LinearWeight` with its bias: built here as a PlainLinear, each
fused one concatenated from its sources as it is read (the sources are dropped at once), and turned by the decoder
into the form its `linear` path reads, which replaces it (a weight is held once). Read from a Hugging Face state
dict (safetensors); a Qwen3.5 image-text-to-text checkpoint's language model sits under `model.language_model.`,
and its vision tower and `mtp.*` are never read.

With `bf16_weights` (pyscore.ops.linear.holds_bf16_weights: fp32 serving at a CPU tier whose linear and label
read-out kernels widen bf16 weights exactly), a projection, the embedding or the LM head read from bf16 tensors stays
bf16 (`held_in_bf16`); everything else is in the dtype.

With `quantize="int8"`, each layer's projections are quantized (pyscore.ops.linear_int8.quantize_linear) as soon as
the layer is built, replacing their sources: one layer is ever held in the dtype. `layer_reader` reads a layer
again in the dtype, for pyscore.model.smoothing's second pass. The embedding, the LM head or
classifier head, the norms and Qwen3.5's conv and decay parameters stay in the dtype."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from pyscore.model.config import LINEAR_ATTENTION, ModelConfig
from pyscore.ops.linear import LinearWeight, PlainLinear
from pyscore.ops.linear_int8 import quantize_linear

QUANTIZE = ("int8",)  # what `quantize` may name (None: the dtype)

# The checkpoint tensors that become projections (LinearWeight), by name suffix inside a layer.
PROJECTION_SUFFIXES = tuple(f"{n}.weight" for n in (
    "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "in_proj_qkv", "in_proj_z",
    "in_proj_b", "in_proj_a", "out_proj"))


def is_projection(name: str) -> bool:
    """Whether this checkpoint tensor is (part of) a decoder layer's projection: what `quantize` holds in int8."""
    return ".layers." in name and name.endswith(PROJECTION_SUFFIXES)


def held_in_bf16(name: str) -> bool:
    """Whether `bf16_weights` holds this checkpoint tensor in bf16 when the checkpoint does: a projection, the
    embedding (gathered rows are widened) or the LM head (the read-out widens it)."""
    return is_projection(name) or name.endswith("embed_tokens.weight") or name == "lm_head.weight"


@dataclass
class LinearAttentionWeights:
    """A Gated DeltaNet mixer (Qwen3.5)."""

    in_proj: LinearWeight  # [C + Hv Dv + 2 Hv, H]: in_proj_qkv, in_proj_z, in_proj_b, in_proj_a
    conv: torch.Tensor  # [C, K] depthwise causal conv over the q|k|v part
    a_log: torch.Tensor  # [Hv] fp32
    dt_bias: torch.Tensor  # [Hv] fp32
    norm: torch.Tensor  # [Dv] gated RMSNorm weight (plain, not zero-centred)
    out: LinearWeight  # [H, Hv Dv]


@dataclass
class LayerWeights:
    """One decoder layer. Zero-centred families (Qwen3.5) keep their RMSNorm weights as fp32 (1 + w), the factor
    transformers applies before rounding. A linear-attention layer has `linear` and no attention weights."""

    input_norm: torch.Tensor  # [H]
    qkv: LinearWeight | None  # [(Hq + 2 Hkv) D, H]; Qwen3.5: [(2 Hq + 2 Hkv) D, H], q and gate per head
    q_norm: torch.Tensor | None  # [D] (Qwen3, Qwen3.5)
    k_norm: torch.Tensor | None
    o: LinearWeight | None  # [H, Hq D]
    post_norm: torch.Tensor  # [H]
    gate_up: LinearWeight  # [2 I, H], gated: silu(gate) * up
    down: LinearWeight  # [H, I]
    linear: LinearAttentionWeights | None = None


@dataclass
class DecoderWeights:
    dtype: torch.dtype  # the activations' (the serving dtype)
    embed: torch.Tensor  # [V, H] (bf16 under fp32 with bf16_weights)
    layers: list[LayerWeights]
    final_norm: torch.Tensor  # [H]
    lm_head: torch.Tensor | None  # [V, H] (causal LM; the embedding itself when tied)
    score_head: torch.Tensor | None  # [C, H] (classifier)
    score_bias: torch.Tensor | None

    def projections(self) -> list[LinearWeight]:
        """Every layer's projections, in the form they are held now."""
        return [w for layer in self.layers for w in (layer.qkv, layer.o, layer.gate_up, layer.down, *(
            (layer.linear.in_proj, layer.linear.out) if layer.linear is not None else ())) if w is not None]


def _cat_optional(parts: list[torch.Tensor | None]) -> torch.Tensor | None:
    present = [p for p in parts if p is not None]
    if not present:
        return None
    if len(present) != len(parts):
        raise ValueError("bias present on some but not all fused projections")
    return torch.cat(present)


def _linear_attention(cfg: ModelConfig, p: str, need, cast, proj) -> LinearAttentionWeights:
    """Layer prefix p + "linear_attn." of a Qwen3.5 checkpoint."""
    p += "linear_attn."
    conv = need(p + "conv1d.weight")  # [C, 1, K]
    return LinearAttentionWeights(
        in_proj=PlainLinear(proj(torch.cat([need(p + f"in_proj_{n}.weight") for n in ("qkv", "z", "b", "a")])), None),
        conv=cast(conv.reshape(conv.shape[0], conv.shape[-1])),
        a_log=cast(need(p + "A_log"), torch.float32),
        dt_bias=cast(need(p + "dt_bias"), torch.float32),
        norm=cast(need(p + "norm.weight")),
        out=PlainLinear(proj(need(p + "out_proj.weight")), None),
    )


def quantized(layer: LayerWeights) -> LayerWeights:
    """The layer with its projections in int8, each replacing its source."""
    def q(w: LinearWeight | None) -> LinearWeight | None:
        return None if w is None else quantize_linear(*w.unpacked(), gated=w.gated)

    layer.qkv, layer.o, layer.gate_up, layer.down = q(layer.qkv), q(layer.o), q(layer.gate_up), q(layer.down)
    if layer.linear is not None:
        layer.linear.in_proj, layer.linear.out = q(layer.linear.in_proj), q(layer.linear.out)
    return layer


class _Reader:
    """Tensors of a state dict as the decoder holds them: `get(name)` returns a tensor of the HF state dict, or None
    when absent."""

    def __init__(self, cfg: ModelConfig, get: Callable[[str], torch.Tensor | None], dtype: torch.dtype,
                 device: torch.device, bf16_weights: bool):
        self.cfg, self.get, self.dtype, self.device, self.bf16_weights = cfg, get, dtype, device, bf16_weights
        embedded = get("model.language_model.embed_tokens.weight") is not None
        self.model = "model.language_model." if embedded else "model."

    def need(self, name: str) -> torch.Tensor:
        t = self.get(name)
        if t is None:
            raise ValueError(f"checkpoint is missing weight {name!r}")
        return t

    def cast(self, t: torch.Tensor | None, to: torch.dtype | None = None) -> torch.Tensor | None:
        return None if t is None else t.to(device=self.device, dtype=to or self.dtype).contiguous()

    def proj(self, t: torch.Tensor) -> torch.Tensor:  # a held_in_bf16 matrix (a projection's: its sources concatenated)
        return self.cast(t, torch.bfloat16 if self.bf16_weights and t.dtype == torch.bfloat16 else self.dtype)

    def norm(self, name: str) -> torch.Tensor:
        if self.cfg.zero_centred_norm:  # (1 + w) in fp32: transformers' `x_hat * (1.0 + w.float())`
            return self.cast(1.0 + self.need(name).float(), torch.float32)
        return self.cast(self.need(name))

    def layer(self, i: int) -> LayerWeights:
        """Decoder layer i in the dtype (projections as PlainLinear)."""
        cfg, need, get, cast, proj, norm = self.cfg, self.need, self.get, self.cast, self.proj, self.norm
        p = f"{self.model}layers.{i}."
        attn = p + "self_attn."
        linear = cfg.layer_type(i) == LINEAR_ATTENTION
        return LayerWeights(
            input_norm=norm(p + "input_layernorm.weight"),
            qkv=None if linear else PlainLinear(
                proj(torch.cat([need(attn + f"{n}_proj.weight") for n in "qkv"])),
                cast(_cat_optional([get(attn + f"{n}_proj.bias") for n in "qkv"]))),
            q_norm=norm(attn + "q_norm.weight") if cfg.qk_norm and not linear else None,
            k_norm=norm(attn + "k_norm.weight") if cfg.qk_norm and not linear else None,
            o=None if linear else PlainLinear(proj(need(attn + "o_proj.weight")), cast(get(attn + "o_proj.bias"))),
            post_norm=norm(p + "post_attention_layernorm.weight"),
            gate_up=PlainLinear(proj(torch.cat([need(p + "mlp.gate_proj.weight"), need(p + "mlp.up_proj.weight")])),
                                cast(_cat_optional([get(p + "mlp.gate_proj.bias"), get(p + "mlp.up_proj.bias")])),
                                gated=True),
            down=PlainLinear(proj(need(p + "mlp.down_proj.weight")), cast(get(p + "mlp.down_proj.bias"))),
            linear=_linear_attention(cfg, p, need, cast, proj) if linear else None,
        )


def layer_reader(cfg: ModelConfig, get: Callable[[str], torch.Tensor | None], dtype: torch.dtype,
                 device: torch.device, bf16_weights: bool = False) -> Callable[[int], LayerWeights]:
    """read(i): decoder layer i as build_weights builds it before quantizing (in the dtype), read again from `get`
    (pyscore.model.smoothing's second pass over the checkpoint)."""
    return _Reader(cfg, get, dtype, device, bf16_weights).layer


def build_weights(cfg: ModelConfig, get: Callable[[str], torch.Tensor | None], dtype: torch.dtype,
                  device: torch.device, bf16_weights: bool = False, quantize: str | None = None) -> DecoderWeights:
    """`get(name)` returns a tensor of the HF state dict, or None when absent. quantize: None or "int8"."""
    if quantize not in (None, *QUANTIZE):
        raise ValueError(f"quantize must be one of {', '.join(QUANTIZE)} or None, got {quantize!r}")
    read = _Reader(cfg, get, dtype, device, bf16_weights)
    need, cast, proj, norm, model = read.need, read.cast, read.proj, read.norm, read.model
    layers = []
    for i in range(cfg.num_layers):
        layers.append(read.layer(i))
        if quantize:
            layers[-1] = quantized(layers[-1])
    embed = proj(need(model + "embed_tokens.weight"))
    lm_head = score_head = score_bias = None
    if cfg.is_classifier:
        score_head, score_bias = cast(need("score.weight")), cast(get("score.bias"))
    else:
        lm_head = embed if cfg.tie_word_embeddings else proj(need("lm_head.weight"))
    return DecoderWeights(dtype=dtype, embed=embed, layers=layers, final_norm=norm(model + "norm.weight"),
                          lm_head=lm_head, score_head=score_head, score_bias=score_bias)
