"""ModelConfig: the few numbers the decoder needs, read from a transformers config of the Llama, Qwen2, Qwen3 or
Qwen3.5 family (causal LM or sequence-classification head; for Qwen3.5 also the whole image-text-to-text checkpoint,
of which only the language model is used). Anything else is refused at load time."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "qwen3_5", "qwen3_5_text")
FULL_ATTENTION, LINEAR_ATTENTION = "full_attention", "linear_attention"
# Qwen3.5 checkpoints whose text model pyscore serves: the text-only causal LM and the image-text-to-text model
# (its vision tower and multi-token-prediction weights are never read: inputs are text only).
CAUSAL_LM_ARCHITECTURES = ("Qwen3_5ForConditionalGeneration",)


@dataclass(frozen=True)
class LinearAttentionShape:
    """Gated DeltaNet layers (Qwen3.5): key/value heads and dims, and the causal conv's kernel size."""

    num_k_heads: int
    num_v_heads: int
    k_dim: int
    v_dim: int
    conv_kernel: int

    @property
    def conv_channels(self) -> int:
        """Width of the fused q|k|v input projection that the conv runs over."""
        return 2 * self.num_k_heads * self.k_dim + self.num_v_heads * self.v_dim


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    architecture: str
    is_classifier: bool
    hidden_size: int
    num_layers: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool  # Qwen2 always; Llama/Qwen3 when attention_bias
    o_bias: bool  # Llama attention_bias also biases o_proj
    mlp_bias: bool
    qk_norm: bool  # Qwen3: RMSNorm over head_dim on q and k before RoPE
    num_labels: int = 0
    id2label: dict[int, str] = field(default_factory=dict)
    pad_token_id: int | None = None
    # Hybrid models (Qwen3.5): per layer FULL_ATTENTION or LINEAR_ATTENTION; () = every layer full attention.
    layer_types: tuple[str, ...] = ()
    attn_output_gate: bool = False  # q_proj also yields a per-head gate: attn * sigmoid(gate) before o_proj
    rotary_dim: int = 0  # leading dims of each head that rotate (partial_rotary_factor); 0 = all
    zero_centred_norm: bool = False  # RMSNorm weights w scale by (1 + w), in fp32 before the rounding
    linear: LinearAttentionShape | None = None

    def layer_type(self, i: int) -> str:
        return self.layer_types[i] if self.layer_types else FULL_ATTENTION

    @property
    def rotary_dims(self) -> int:
        return self.rotary_dim or self.head_dim

    @classmethod
    def from_hf(cls, hf: Any) -> ModelConfig:
        model_type = hf.model_type
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"unsupported model_type {model_type!r}; supported: {', '.join(SUPPORTED_MODEL_TYPES)}")
        architectures = list(getattr(hf, "architectures", None) or [])
        architecture = architectures[0] if architectures else f"{model_type.capitalize()}ForCausalLM"
        is_classifier = architecture.endswith("ForSequenceClassification")
        if not (is_classifier or architecture.endswith("ForCausalLM") or architecture in CAUSAL_LM_ARCHITECTURES):
            raise ValueError(f"unsupported architecture {architecture!r}: "
                             "need *ForCausalLM or *ForSequenceClassification")
        top, hf = hf, hf.get_text_config()  # Qwen3.5's image-text-to-text config nests the language model's
        heads = hf.num_attention_heads
        attention_bias = bool(getattr(hf, "attention_bias", False))
        hybrid = model_type.startswith("qwen3_5")
        head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // heads
        return cls(
            model_type=model_type,
            architecture=architecture,
            is_classifier=is_classifier,
            hidden_size=hf.hidden_size,
            num_layers=hf.num_hidden_layers,
            num_q_heads=heads,
            num_kv_heads=getattr(hf, "num_key_value_heads", None) or heads,
            head_dim=head_dim,
            intermediate_size=hf.intermediate_size,
            vocab_size=hf.vocab_size,
            rms_norm_eps=float(hf.rms_norm_eps),
            max_position_embeddings=int(hf.max_position_embeddings),
            # the top-level flag: what transformers ties in a Qwen3.5 image-text-to-text model
            tie_word_embeddings=bool(getattr(top, "tie_word_embeddings", False)),
            qkv_bias=model_type == "qwen2" or attention_bias,
            o_bias=model_type == "llama" and attention_bias,
            mlp_bias=bool(getattr(hf, "mlp_bias", False)),
            qk_norm=model_type == "qwen3" or hybrid,
            num_labels=int(getattr(top, "num_labels", 0)) if is_classifier else 0,
            id2label={int(k): str(v) for k, v in (getattr(top, "id2label", None) or {}).items()},
            pad_token_id=getattr(hf, "pad_token_id", None),
            **(_hybrid_fields(hf, head_dim) if hybrid else {}),
        )


def _hybrid_fields(hf: Any, head_dim: int) -> dict[str, Any]:
    """Qwen3.5: layer kinds, the gated and partially rotary full attention, zero-centred norms, Gated DeltaNet."""
    layer_types = tuple(hf.layer_types)
    unknown = set(layer_types) - {FULL_ATTENTION, LINEAR_ATTENTION}
    if unknown or len(layer_types) != hf.num_hidden_layers:
        raise ValueError(f"layer_types must name {hf.num_hidden_layers} layers, each {FULL_ATTENTION!r} or "
                         f"{LINEAR_ATTENTION!r}, got {layer_types}")
    params = getattr(hf, "rope_parameters", None) or {}
    factor = float(params.get("partial_rotary_factor", getattr(hf, "partial_rotary_factor", 1.0)))
    linear = LinearAttentionShape(num_k_heads=hf.linear_num_key_heads, num_v_heads=hf.linear_num_value_heads,
                                  k_dim=hf.linear_key_head_dim, v_dim=hf.linear_value_head_dim,
                                  conv_kernel=hf.linear_conv_kernel_dim)
    if linear.num_v_heads % linear.num_k_heads:
        raise ValueError(f"linear_num_value_heads ({linear.num_v_heads}) must be a multiple of linear_num_key_heads "
                         f"({linear.num_k_heads})")
    return dict(layer_types=layer_types, attn_output_gate=True, rotary_dim=int(head_dim * factor),
                zero_centred_norm=True, linear=linear)
